"""NVML reconciliation on the H200 (marked gpu): a CUDA program that loads libcuda.so.1 with
dlmopen into a new link-map namespace (tests/security/bypass.py), so that the interposer
gemini-run preloads never sees a call, allocates 6 GiB under `gemini-run --memory 4GiB`. The
real node daemon, reading NVML's running-process list every second, must find it (its parents
lead to gemini-run), charge it and report it within 2 s of the allocation; with
over_limit_action=kill it must kill it within 2 s.

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


@pytest.fixture
def workdir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gub-"))   # short: socket paths under 107 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


def run_bypass(workdir: Path, *daemon_args: str) -> tuple[DaemonProcess, subprocess.Popen[str],
                                                          dict[str, Any], float]:
    pytest.importorskip("pynvml")
    state_dir = workdir / "state"
    state_dir.mkdir()
    daemon = DaemonProcess(state_dir, "--process-memory", "nvml", "--process-memory-interval",
                           "1", *daemon_args).wait_ready()
    run = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir), "--gpu", "0",
         "--memory", "4GiB", "--", sys.executable, str(BYPASS), str(6 * GiB)],
        cwd=REPO, env=dict(os.environ), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert run.stdout is not None
    line = run.stdout.readline()
    allocated = time.monotonic()
    if not line:
        daemon.stop()
        raise AssertionError(f"bypass.py did not allocate: {run.communicate(timeout=30)[1]}")
    shown = json.loads(line)
    assert shown["rc"] == 0, shown   # the driver gave it 6 GiB: the hook never saw the call
    return daemon, run, shown, allocated


def over_limit(daemon: DaemonProcess) -> Any:
    allocations = daemon.status()["allocations"]
    return allocations[0]["gpus"][0]["over_limit"] if allocations else None


def test_a_dlmopen_driver_past_the_limit_is_reported_within_2_s(workdir: Path) -> None:
    daemon, run, shown, allocated = run_bypass(workdir)
    try:
        report = wait_for(lambda: over_limit(daemon), 10, "the over-limit report")
        took = time.monotonic() - allocated
        print(json.dumps({"report": report, "seconds": round(took, 3)}))
        assert report["pid"] == shown["pid"] and report["connected"] is False, report
        assert report["process_bytes"] >= 6 * GiB and report["limit"] == 4 * GiB, report
        assert took < WITHIN, f"reported {took:.2f} s after the allocation"
        assert run.poll() is None   # report only
    finally:
        if run.poll() is None:
            run.communicate("\n", timeout=30)
        daemon.stop()


def test_a_dlmopen_driver_past_the_limit_is_killed_within_2_s(workdir: Path) -> None:
    daemon, run, shown, allocated = run_bypass(workdir, "--over-limit-action", "kill")
    try:
        code = run.wait(10)
        took = time.monotonic() - allocated
        print(json.dumps({"exit": code, "seconds": round(took, 3)}))
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
