"""NVML reconciliation on the H200 (marked gpu): a CUDA program that the interposer gemini-run
preloads never sees (tests/security/bypass.py, each of its two ways: libcuda.so.1 loaded with
dlmopen into a new link-map namespace, or loaded plainly after re-executing itself without
LD_PRELOAD) allocates 6 GiB under `gemini-run --memory 4GiB`. The real node daemon, reading
NVML's running-process list every second, must find it (its parents lead to gemini-run), charge
it and report it within 2 s of the allocation; with over_limit_action=kill it must kill it
within 2 s.

bypass.py runs with -X faulthandler, so a crash inside the real driver prints a stack; where it
does not allocate, the failure says gemini-run's exit status (128+N: signal N) and stderr. The
one such end that is not a failure: the real driver does not survive being loaded a second time
into a new namespace (on an H100, driver 580, dlmopen itself segfaults, with or without the
interposer). A process that dies there made no CUDA call and holds nothing: that way around the
hook is closed by the driver, and the test says so.

    python3 -m pytest -m gpu -v -s tests/gpu/test_unhooked_gpu.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import REPO, DaemonProcess, wait_for

pytestmark = pytest.mark.gpu
GiB = 1 << 30
WITHIN = 2.0   # seconds from the allocation to the report (or the kill)
BYPASS = REPO / "tests" / "security" / "bypass.py"
WAYS = {"dlmopen": (), "unpreloaded": ("--unpreloaded",)}   # bypass.py's ways around the hook


@pytest.fixture
def workdir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gub-"))   # short: socket paths under 107 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


DIED_IN_DLMOPEN = 'in load_driver'   # faulthandler's frame: bypass.py's dlmopen of libcuda


def run_bypass(workdir: Path, way: str, *daemon_args: str
               ) -> tuple[DaemonProcess, subprocess.Popen[str], dict[str, Any], float] | None:
    """The daemon, the running bypass, what it printed and when; None where the driver could
    not be loaded into a second namespace (the process died in dlmopen, before any CUDA call)."""
    pytest.importorskip("pynvml")
    state_dir = workdir / "state"
    state_dir.mkdir()
    daemon = DaemonProcess(state_dir, "--process-memory", "nvml", "--process-memory-interval",
                           "1", *daemon_args).wait_ready()
    run = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir), "--gpu", "0",
         "--memory", "4GiB", "--", sys.executable, "-X", "faulthandler", str(BYPASS),
         *WAYS[way], str(6 * GiB)],
        cwd=REPO, env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert run.stdout is not None
    line = run.stdout.readline()
    allocated = time.monotonic()
    if not line:
        out, err = run.communicate(timeout=30)
        daemon.stop()
        if way == "dlmopen" and run.returncode == 128 + 11 and DIED_IN_DLMOPEN in err:
            print(json.dumps({"way": way, "closed": "the driver died in dlmopen"}))
            return None
        raise AssertionError(
            f"bypass.py ({way}) did not allocate: gemini-run exited {run.returncode} (128+N: "
            f"signal N killed it); stdout {out!r}; stderr {err!r}; the daemon's log ends "
            f"{daemon.logs()[-2000:]}")
    shown = json.loads(line)
    assert shown["rc"] == 0 and shown["way"] == way, shown   # 6 GiB: the hook never saw it
    return daemon, run, shown, allocated


def over_limit(daemon: DaemonProcess) -> Any:
    allocations = daemon.status()["allocations"]
    return allocations[0]["gpus"][0]["over_limit"] if allocations else None


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_driver_the_hook_never_sees_past_the_limit_is_reported_within_2_s(
        workdir: Path, way: str) -> None:
    started = run_bypass(workdir, way)
    if started is None:
        return   # no way around the hook here: nothing was allocated to report
    daemon, run, shown, allocated = started
    try:
        report = wait_for(lambda: over_limit(daemon), 10, "the over-limit report")
        took = time.monotonic() - allocated
        print(json.dumps({"way": way, "report": report, "seconds": round(took, 3)}))
        assert report["pid"] == shown["pid"] and report["connected"] is False, report
        assert report["process_bytes"] >= 6 * GiB and report["limit"] == 4 * GiB, report
        assert took < WITHIN, f"reported {took:.2f} s after the allocation"
        assert run.poll() is None   # report only
    finally:
        if run.poll() is None:
            run.communicate("\n", timeout=30)
        daemon.stop()


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_driver_the_hook_never_sees_past_the_limit_is_killed_within_2_s(
        workdir: Path, way: str) -> None:
    started = run_bypass(workdir, way, "--over-limit-action", "kill")
    if started is None:
        return   # no way around the hook here: nothing was allocated to kill
    daemon, run, shown, allocated = started
    try:
        code = run.wait(10)
        took = time.monotonic() - allocated
        print(json.dumps({"way": way, "exit": code, "seconds": round(took, 3)}))
        assert code == 128 + 9, (code, daemon.logs()[-3000:])   # gemini-run: 128 + SIGKILL
        assert took < WITHIN, f"killed {took:.2f} s after the allocation"
        killed = [json.loads(line) for line in daemon.logs().splitlines()
                  if "killed the process past the memory limit" in line]
        assert [entry["pid"] for entry in killed] == [shown["pid"]], killed
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        daemon.stop()
