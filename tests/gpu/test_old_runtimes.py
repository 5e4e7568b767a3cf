"""CUDA 11 and 12 runtimes under gemini-run on a real GPU (marked gpu).

The runtimes come from the PyPI wheels nvidia-cuda-runtime-cu11 (11.8) and -cu12 (12.9), found
in the directory named by $GEMINI_TEST_CUDART_WHEELS (scripts/gpu-check sets it to .whl-cudart);
each test skips when the variable or its wheel is missing. A wheel is a zip: the library is
extracted into a temporary directory.

Each runtime is driven through ctypes by tests/gpu/cudart_probe.py, run by the real gemini-run
(--memory 8GiB) with the real node daemon and the real hook. The CUDA 11.8 runtime resolves
every driver entry point through the 4-argument cuGetProcAddress, the 12.9 runtime through
cuGetProcAddress_v2: both must hand out the hook's wrappers, so the limit holds and the launch
is gated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import python_path
from tests.daemon.helpers import DaemonProcess
from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation

REPO = Path(__file__).resolve().parents[2]
WHEELS_ENV = "GEMINI_TEST_CUDART_WHEELS"
GiB = 1 << 30
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation

# major -> (wheel file pattern, library inside the wheel)
RUNTIMES = {
    11: ("nvidia_cuda_runtime_cu11-*.whl", "nvidia/cuda_runtime/lib/libcudart.so.11.0"),
    12: ("nvidia_cuda_runtime_cu12-*.whl", "nvidia/cuda_runtime/lib/libcudart.so.12"),
}


def runtime_library(major: int, into: Path) -> Path:
    """libcudart of `major`, extracted from its wheel into `into`; skips when it is missing."""
    wheels = os.environ.get(WHEELS_ENV)
    if not wheels:
        pytest.skip(f"{WHEELS_ENV} is not set (a directory holding the cudart wheels)")
    pattern, member = RUNTIMES[major]
    found = sorted(Path(wheels).glob(pattern))
    if not found:
        pytest.skip(f"no {pattern} in {WHEELS_ENV}={wheels}")
    with zipfile.ZipFile(found[-1]) as wheel:
        if member not in wheel.namelist():
            pytest.skip(f"{found[-1].name} holds no {member}")
        return Path(wheel.extract(member, into))


@pytest.fixture
def short_root() -> Iterator[Path]:
    # Short on purpose: the channel socket path under it must fit in 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="gmo-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def read_stats(path: Path) -> dict[str, int]:
    return {key: int(value) for key, value in
            (line.split("=", 1) for line in path.read_text().split())}


def run_probe(major: int, library: Path, root: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """cudart_probe under gemini-run --memory 8GiB; returns its report and the exit stats."""
    state = root / "state"
    state.mkdir()
    daemon = DaemonProcess(state).wait_ready()  # gemini-run finds it and starts none
    stats_file = root / "stats"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GEMINI_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")}
    # python_path(): the carried wheels on the GPU machine stay reachable.
    env.update(PYTHONPATH=python_path(), GEMINI_HOOK_STATS=str(stats_file))
    argv = [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state), "--gpu", "0",
            "--memory", "8GiB", "--hook-library", str(hooklib.library_path()), "--",
            sys.executable, "-m", "tests.gpu.cudart_probe", str(library), str(major)]
    detail = ""
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=180)
        detail = (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                  f"stderr:\n{proc.stderr[-4000:]}\ndaemon:\n{daemon.logs()[-3000:]}")
        assert proc.returncode == 0, detail
        report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        # gemini-run ended its allocation when the command ended.
        assert list(allocation.scan_records(state)) == []
    finally:
        daemon.stop()
    assert stats_file.is_file(), f"the hook wrote no stats at exit\n{detail}"
    return report, read_stats(stats_file)


@pytest.mark.gpu
@pytest.mark.parametrize("major", sorted(RUNTIMES))
def test_older_runtime_sees_the_limit_and_launches_through_the_gate(
        major: int, short_root: Path) -> None:
    library = runtime_library(major, short_root / "cudart")
    report, exit_stats = run_probe(major, library, short_root)
    context = json.dumps(report, indent=1)

    # The runtime of that major version is the one that ran.
    assert report["runtime_version_rc"] == 0, context
    assert major * 1000 <= report["runtime_version"] < (major + 1) * 1000, context

    # Memory: the slice is what the runtime sees, and the limit holds.
    assert report["info_rc"] == 0 and report["total"] == 8 * GiB, context
    assert report["free"] <= 8 * GiB, context
    assert report["malloc_6g_rc"] == 0, context
    assert report["malloc_4g_over_rc"] == CUDA_ERROR_MEMORY_ALLOCATION, context
    assert report["last_error"] == CUDA_ERROR_MEMORY_ALLOCATION, context
    assert report["free_rc"] == 0, context
    assert report["malloc_4g_after_free_rc"] == 0, context  # freeing gave the 6 GiB back
    assert report["free_again_rc"] == 0, context

    # A launch through entry points the runtime resolved (cuGetProcAddress for 11.x, _v2 for
    # 12.x): both cuLaunchKernel variants are the hook's wrappers, ran, and were gated.
    assert "entry_point_failed" not in report, context
    assert report["wrapped"]["launch"] and report["wrapped"]["launch_ptsz"], context
    assert report["load_rc"] == 0 and report["function_rc"] == 0, context
    assert report["launch_rcs"] == [0, 0], context
    assert report["sync_rc"] == 0 and report["copy_rc"] == 0, context
    assert report["values"] == [42, 43], context
    assert report["gated_launches"] == 2, context

    # The hook was active, talked to the daemon, and refused the 4 GiB itself.
    stats = report["stats"]
    assert stats["active"] == 1 and stats["daemon_connects"] >= 1, context
    assert stats["mem_refused"] >= 1, context
    assert exit_stats["kernel_launches"] >= 2, exit_stats
    assert exit_stats["wrapped_by_procaddress"] >= 1, exit_stats
    assert exit_stats["mem_refused"] >= 1, exit_stats
