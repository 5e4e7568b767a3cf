"""The context charge on a real GPU (marked gpu): the daemon's accounting for a PyTorch process
matches NVML's per-process figure for that pid.

The real node daemon runs with the default `--process-memory auto` (NVML where pids match) on
a short temporary state directory; `python -m vgpu_runtime.run --memory 8GiB` finds it and runs
a PyTorch process that allocates 1 GiB and then waits for commands on stdin. The test reads
NVML for that pid itself and compares: what the daemon holds for the connection (declared
kinds + the context charge) is within TOLERANCE of NVML's figure, and the process's
torch.cuda.mem_get_info() reports the limit less that use. Skips without torch or pynvml, and
where NVML does not list the pid as this namespace knows it (pid namespaces differ).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import REPO, DaemonProcess, wait_for

pytestmark = pytest.mark.gpu
GiB, MiB = 1 << 30, 1 << 20
LIMIT = 8 * GiB
# NVML's figure moves only when the process allocates; the process is idle while compared, so
# the daemon's last reading (every 0.2 s here) equals it. The slack covers a late free by the
# CUDA runtime between the two readings.
TOLERANCE = 16 * MiB
LINE_TIMEOUT = 90.0   # a cold PyTorch import and CUDA start; under pytest's 120 s per test

TORCH_PROCESS = textwrap.dedent("""
    import json, os, sys, torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    print(json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "info":
            break
        free, total = torch.cuda.mem_get_info()
        print(json.dumps({"free": free, "total": total}), flush=True)
""")


def nvml_figure(uuid: str, pid: int) -> int | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if int(process.pid) == pid and isinstance(process.usedGpuMemory, int):
                return int(process.usedGpuMemory)
        return None
    finally:
        pynvml.nvmlShutdown()


def connection_of(daemon: DaemonProcess, pid: int) -> tuple[dict[str, Any], dict[str, Any]]:
    for entry in daemon.status()["allocations"]:
        for conn in entry["connections"]:
            if conn["peer_pid"] == pid:
                return entry, conn
    raise AssertionError(f"no connection from pid {pid}")


def accounted(conn: dict[str, Any]) -> int:
    """What the daemon counts for the connection on GPU 0: declared kinds but the context,
    plus the context charge in force."""
    held = conn["held"].get("0", {})
    declared = sum(int(v) for kind, v in held.items() if kind != "context")
    return declared + int(conn["context"]["0"]["charged"])


@pytest.fixture
def state_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gmc-"))   # short: socket paths under 107 bytes
    yield root / "state"
    shutil.rmtree(root, ignore_errors=True)


def test_daemon_accounting_matches_nvml_per_process_figure(state_dir: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("pynvml")
    state_dir.mkdir()
    daemon = DaemonProcess(state_dir, "--process-memory-interval", "0.2").wait_ready()
    errors = state_dir.parent / "run.stderr"
    with open(errors, "wb") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir), "--gpu",
             "0", "--memory", "8GiB", "--", sys.executable, "-c", TORCH_PROCESS],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert run.stdin is not None and run.stdout is not None
    lines = ThreadPoolExecutor(1)

    def read_line() -> Any:
        assert run.stdout is not None
        line = lines.submit(run.stdout.readline).result(LINE_TIMEOUT)
        assert line, f"the PyTorch process ended early:\n{errors.read_text()[-4000:]}"
        return json.loads(line)

    try:
        pid = int(read_line()["pid"])
        found = wait_for(lambda: connection_of_or_none(daemon, pid), 30, "the connection")
        assert found is not None
        entry = found[0]
        uuid = entry["gpus"][0]["uuid"]
        if nvml_figure(uuid, pid) is None:
            pytest.skip(f"NVML does not list pid {pid}: its pid namespace is not this one")
        try:
            wait_for(lambda: connection_of(daemon, pid)[1]["context"]["0"]["from"] == "nvml", 15,
                     "the context charged from NVML")
        except AssertionError:
            if "not in the host's pid namespace" in daemon.logs():
                pytest.skip("the daemon is not in the host's pid namespace (auto keeps the "
                            "hook's measurement)")
            raise AssertionError(daemon.logs()[-4000:]) from None
        time.sleep(0.5)                                  # a couple of readings on an idle process
        figure = nvml_figure(uuid, pid)
        entry, conn = connection_of(daemon, pid)
        ours = accounted(conn)
        measured = {"nvml_process_bytes": figure, "daemon_accounted_bytes": ours,
                    "held": conn["held"], "context": conn["context"]["0"],
                    "memory_used": entry["gpus"][0]["memory_used"]}
        print(json.dumps(measured))                       # for BENCHMARKS.md (-s)
        assert figure is not None
        assert conn["held"]["0"].get("device", 0) >= GiB, measured
        assert abs(ours - figure) <= TOLERANCE, measured
        assert entry["gpus"][0]["memory_used"] == ours, measured   # the only process
        # The process sees its slice less what it is charged, context included.
        run.stdin.write("info\n")
        run.stdin.flush()
        info = read_line()
        assert info["total"] == LIMIT, info
        assert abs(info["free"] - (LIMIT - ours)) <= TOLERANCE, (info, measured)
        run.stdin.write("exit\n")
        run.stdin.flush()
        assert run.wait(60) == 0, errors.read_text()[-4000:]
        wait_for(lambda: not daemon.status()["allocations"], 10, "the allocation to end")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
        lines.shutdown(wait=False)
        daemon.stop()


def connection_of_or_none(daemon: DaemonProcess, pid: int
                          ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    try:
        return connection_of(daemon, pid)
    except AssertionError:
        return None
