"""Lazy loading on the H200 (marked gpu): under `gemini-run --memory 4GiB` with
CUDA_MODULE_LOADING=LAZY, a library whose PTX holds a 3 GiB global is loaded (the driver takes
the memory only at its first launch). The hook must charge the globals at the load (so a 1 GiB
allocation beside them is refused), NVML must never show the process above the limit plus
TOLERANCE, and after the first launch the daemon's figure for the container must follow NVML's
(the code and anything the image did not say, charged by NVML reconciliation within 2 s).

    python3 -m pytest -m gpu -v -s tests/gpu/test_lazy_loading_gpu.py
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

from tests.daemon.helpers import REPO, DaemonProcess

pytestmark = pytest.mark.gpu
GiB, MiB = 1 << 30, 1 << 20
LIMIT = 4 * GiB
OOM = 2
TOLERANCE = 512 * MiB   # as tests/gpu/test_driver_reservations_gpu.py
FOLLOWS = 64 * MiB      # the daemon's figure against NVML's, after the readings


@pytest.fixture
def workdir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="glz-"))   # short: socket paths under 107 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_lazily_loaded_library_is_charged_at_its_load_and_followed_after_its_launch(
        workdir: Path) -> None:
    pytest.importorskip("pynvml")
    state_dir = workdir / "state"
    state_dir.mkdir()
    daemon = DaemonProcess(state_dir, "--process-memory", "nvml",
                           "--process-memory-interval", "1").wait_ready()
    run = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir), "--gpu", "0",
         "--memory", "4GiB", "--", sys.executable, "-m", "tests.gpu.lazy_probe"],
        cwd=REPO, env={**os.environ, "CUDA_MODULE_LOADING": "LAZY"}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps: dict[str, Any] = {}
    try:
        assert run.stdout is not None and run.stdin is not None
        while "first_launch" not in steps:
            line = run.stdout.readline()
            assert line, run.communicate(timeout=30)[1][-3000:]
            if line.startswith("{"):
                entry = json.loads(line)
                steps[entry.get("step", "done")] = entry
        time.sleep(2.5)   # two readings at 1 s
        (allocation,) = daemon.status()["allocations"]
        used = allocation["gpus"][0]["memory_used"]
        run.stdin.write("\n")
        run.stdin.flush()
        for line in run.stdout:
            if line.startswith("{"):
                entry = json.loads(line)
                steps[entry.get("step", "done")] = entry
    finally:
        if run.poll() is None:
            run.communicate(timeout=30)
        daemon.stop()
    print(json.dumps({"steps": steps, "daemon_used": used}))
    assert steps["library_3g_loaded"]["rc"] == 0, steps
    assert steps["alloc_1g_beside_it"]["rc"] == OOM, steps
    assert steps["first_launch"]["rc"] == 0 and steps["first_launch"]["sync"] == 0, steps
    peak = max(step["nvml_peak"] for step in steps.values() if "nvml_peak" in step)
    assert peak <= LIMIT + TOLERANCE, f"NVML peak {peak / MiB:.0f} MiB"
    figure = steps["after_readings"]["nvml_now"]
    assert abs(used - figure) <= FOLLOWS, (used, figure)
