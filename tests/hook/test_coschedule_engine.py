"""Co-scheduling end to end without a GPU: two hooked processes whose kernels contend on one
fake GPU (the fake driver's shared engine, FAKE_CUDA_ENGINE), the real daemon measuring them
from the engine's utilisation as NVML's samples (devkit/fakecuda/engine.py).

Each tenant is launch-bound: a 1 ms kernel, a sync, 1 ms of host time, again (scripts/model/
tenant.py's infer shape), so alone it keeps the GPU busy about half the time (it launches again
within the daemon's idle release of its last launch: it holds its turns whole). Two such figures
sum well under the daemon's co_room of 1.25; at 0.5 ms of host time they measured 0.6 to 0.64
each on a loaded CI machine, and the pair no longer fit. Taking
exclusive turns, each one's idle gaps are lost to the other; held together, they fill each
other's gaps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.hook.conftest import Hooked
from vgpu_runtime.devkit.daemon_process import DaemonProcess
from vgpu_runtime.devkit.fakecuda.engine import EngineSampler, busy_between
from vgpu_runtime.gpus.simulated import simulated_uuid

REPO = Path(__file__).resolve().parents[2]
TENANT = REPO / "scripts" / "model" / "tenant.py"
KERNEL_NS, THINK_S = 1_000_000, 0.001
LEAD, WINDOW = 4.0, 4.0

pytestmark = [pytest.mark.slow, pytest.mark.timing]


def run_pair(hooked: Hooked, root: Path, co_schedule: str,
             shares: tuple[str, str] = ("0.5", "0.5"),
             limits: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    """Both tenants under gemini-run at 0.5 each (or `shares`, and `limits` where given),
    against a daemon with co-scheduling on or off; their requests in the common window and the
    daemon's view at its end."""
    root.mkdir()
    state, engine, busy = root / "state", root / "engine", root / "busy.json"
    uuid = simulated_uuid(0)
    sampler = EngineSampler(engine, uuid, busy)
    sampler.start()
    daemon = DaemonProcess(state, "--simulate-gpus", "1", "--co-schedule", co_schedule,
                           "--gpu-busy", "simulated", "--gpu-busy-file", str(busy),
                           "--metrics-port", "0").wait_ready()
    try:
        start_at = time.time() + LEAD
        procs, outs = [], []
        for i in range(2):
            out = root / f"t{i}.json"
            env = hooked.env({"FAKE_CUDA_ENGINE": str(engine), "FAKE_CUDA_UUIDS": uuid},
                             preload=False)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state),
                 "--simulate-gpus", "1", "--hook-library", str(hooked.hook), "--share", shares[i],
                 *(["--limit", limits[i]] if limits[i] else []), "--", sys.executable,
                 str(TENANT), "infer", str(KERNEL_NS), "1", str(THINK_S),
                 str(start_at), str(WINDOW), str(out)], env=env, cwd=REPO))
            outs.append(out)
        # The daemon's view every half second of the window's second half: a figure goes
        # stale (None) for a while whenever co-held periods saturate the engine, since those
        # measure nothing (timeshare/policy.py), so one reading may miss it.
        views = []
        for offset in (WINDOW / 2, WINDOW / 2 + 0.5, WINDOW / 2 + 1.0, WINDOW - 0.5, WINDOW - 0.2):
            time.sleep(max(0.0, start_at + offset - time.time()))
            views.append(daemon.status()["gpus"][0])
        gpu = views[-1]
        for proc in procs:
            assert proc.wait(timeout=60) == 0
        engine_busy = busy_between(engine, int((start_at - time.time() + time.monotonic())
                                               * 1e9), int(time.monotonic() * 1e9))
        return {"requests": [json.loads(out.read_text())["requests"] for out in outs],
                "gpu": gpu, "views": views, "engine_busy": engine_busy}
    finally:
        assert daemon.stop() == 0, daemon.logs()
        sampler.stop()


def test_launch_bound_tenants_fill_each_others_gaps_on_one_contended_gpu(
        hooked: Hooked) -> None:
    # Short, under /tmp: channel socket paths must fit in 107 bytes.
    with tempfile.TemporaryDirectory(prefix="gm-") as short:
        apart = run_pair(hooked, Path(short) / "off", "off")
        together = run_pair(hooked, Path(short) / "on", "on")
    # Exclusive turns: never co-held. Together: co-held, measured near 0.5 each.
    assert apart["gpu"]["co_grants"] == 0
    assert together["gpu"]["co_grants"] > 0, json.dumps(together, indent=1)
    # Each tenant measured in the window's second half, and every figure read near 0.5.
    figures: dict[str, list[float]] = {}
    for view in together["views"]:
        for t in view["tenants"]:
            if t["busy"] is not None:
                figures.setdefault(t["allocation"], []).append(t["busy"])
    assert len(figures) == 2, [view["tenants"] for view in together["views"]]
    assert all(0.3 <= f <= 0.85 for got in figures.values() for f in got), figures
    # More work done in the same window, and each tenant keeps at least its share's worth of
    # what the pair did apart (neither is starved to make room for the other).
    assert sum(together["requests"]) >= 1.2 * sum(apart["requests"]), (apart, together)
    assert min(together["requests"]) >= 0.45 * sum(apart["requests"]), (apart, together)
    # The daemon's count of each one's progress co-held (its bursts per second held beside the
    # other, from the hook's usage reports) is what it did: co-held most of the window, one
    # request a burst (the two run the same shape: against their mean).
    done = sum(together["requests"]) / 2 / WINDOW
    for tenant in together["gpu"]["tenants"]:
        _alone, co_held = tenant["burst_rates"]
        assert co_held is not None and 0.7 <= co_held / done <= 1.3, (done, tenant)


def test_a_capped_tenant_is_never_co_held_and_stays_within_its_cap_on_the_engine(
        hooked: Hooked) -> None:
    """A launch-bound tenant (about 0.5 busy alone) limited to 0.2, beside an uncapped one that
    leaves room, co-scheduling on: it takes exclusive turns (no co-grant: co-held, its busy
    time could not be told from its neighbour's), so the engine runs its kernels no more than
    its cap allows (co-held before the fix: 0.255), while the other has the turns it leaves."""
    with tempfile.TemporaryDirectory(prefix="gm-") as short:
        got = run_pair(hooked, Path(short) / "capped", "on", shares=("0.2", "0.5"),
                       limits=("0.2", None))
    assert got["gpu"]["co_grants"] == 0, json.dumps(got, indent=1)
    # One 1 ms kernel a request: the capped tenant's busy share of the window.
    busy = got["requests"][0] * KERNEL_NS / 1e9 / WINDOW
    assert busy <= 0.2 + 0.05, (busy, got["requests"])
    assert got["requests"][1] > 0


def test_the_engine_serialises_two_processes_work(hooked: Hooked, tmp_path: Path) -> None:
    """Without the hook: two processes each queueing 100 x 2 ms on the shared engine take
    400 ms together, where each alone would take 200 ms."""
    engine = tmp_path / "engine"
    program = ("import sys; sys.path.insert(0, sys.argv[1]);"
               "from scripts.model.tenant import driver;"
               "_, launch, sync = driver(2_000_000)\n"
               "for _ in range(100): launch()\n"
               "sync()")
    env = hooked.env({"FAKE_CUDA_ENGINE": str(engine)}, preload=False)
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", program, str(REPO)], env=env)
             for _ in range(2)]
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    took = time.monotonic() - started
    assert took >= 0.4, took
    ran = busy_between(engine, int((time.monotonic() - took) * 1e9), int(time.monotonic() * 1e9))
    assert ran * took == pytest.approx(0.4, abs=0.01)
    assert os.path.getsize(engine) > 0
