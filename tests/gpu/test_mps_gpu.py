"""The MPS backend on a real GPU (marked gpu): a node daemon with `--mps on` starts the driver's
MPS control daemon on its state directory, a PyTorch command under `gemini-run --memory 8GiB`
runs as an MPS client (an `nvidia-cuda-mps-server` holds the GPU for it), its slice still holds
(mem_get_info reports the 8 GiB limit, 6 GiB fit and 3 GiB more do not), and the daemon quits
the control daemon once the command is gone. What NVML lists for the client under MPS is
printed (-s) for BENCHMARKS.md: the daemon's NVML reconciliation depends on it.

    GEMINI_TEST_GPU=1 python3 -m pytest -m gpu -v -s tests/gpu/test_mps_gpu.py
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import REPO, DaemonProcess, wait_for
from vgpu_runtime.contracts import paths

pytestmark = pytest.mark.gpu
GiB = 1 << 30

TORCH_PROCESS = textwrap.dedent("""
    import json, os, sys, torch
    free, total = torch.cuda.mem_get_info()
    x = torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    try:
        torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
        oom = False
    except torch.cuda.OutOfMemoryError:
        oom = True
    s = torch.ones(2**20, device="cuda").sum().item()
    print(json.dumps({"pid": os.getpid(), "total": total, "oom": oom, "sum": s,
                      "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}), flush=True)
    sys.stdin.readline()
""")


@pytest.fixture
def state_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gmps-"))   # short: socket paths under 107 bytes
    (root / "state").mkdir()
    yield root / "state"
    shutil.rmtree(root, ignore_errors=True)


def compute_apps() -> list[str]:
    shown = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           check=False)
    return [line.strip() for line in shown.stdout.splitlines() if line.strip()]


def control_answers(state_dir: Path) -> bool:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(paths.mps_pipe_dir(state_dir)), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", text=True,
                          env=env, capture_output=True, check=False).returncode == 0


def test_a_command_runs_as_an_mps_client_within_its_slice(state_dir: Path) -> None:
    pytest.importorskip("torch")
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("no nvidia-cuda-mps-control on this machine")
    daemon = DaemonProcess(state_dir, "--mps", "on").wait_ready(30)
    run = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(state_dir), "--gpu", "0",
         "--memory", "8GiB", "--", sys.executable, "-c", TORCH_PROCESS],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert run.stdout is not None and run.stdin is not None
        line = run.stdout.readline()
        assert line, f"the command ended: {run.communicate(timeout=30)[1][-4000:]}"
        seen = json.loads(line)
        apps = compute_apps()
        print(json.dumps({"seen": seen, "compute_apps": apps,
                          "daemon_allocations": daemon.status()["allocations"]}))
        assert seen["pipe"] == str(paths.mps_pipe_dir(state_dir)), seen
        # What the fake control program was taught: its socket takes every user's clients
        # (pods run as other uids than the control daemon's container).
        control = paths.mps_pipe_dir(state_dir) / "control"
        assert stat.S_ISSOCK(control.stat().st_mode), control
        assert control.stat().st_mode & 0o006 == 0o006, oct(control.stat().st_mode)
        assert (seen["total"], seen["oom"], seen["sum"]) == (8 * GiB, True, float(2**20)), seen
        assert any("nvidia-cuda-mps-server" in app for app in apps), apps
        run.stdin.write("\n")
        run.stdin.flush()
        assert run.wait(60) == 0
        wait_for(lambda: not daemon.status()["allocations"], 10, "the allocation to end")
        assert daemon.stop() == 0
        assert not control_answers(state_dir), "the control daemon outlived the daemon"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
        if daemon.proc.poll() is None:
            daemon.stop()
        if control_answers(state_dir):
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, check=False,
                           env={"CUDA_MPS_PIPE_DIRECTORY": str(paths.mps_pipe_dir(state_dir)),
                                "PATH": "/usr/bin:/bin"})
