"""The fake MPS control program (vgpu_runtime/devkit/fakecuda/fake_mps_control.py) as an
executable on disk, and what tests ask of it."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from tests.run.test_run import ENV
from vgpu_runtime.contracts import paths

REPO = Path(__file__).resolve().parents[1]


def fake_mps_control(folder: Path) -> Path:
    """`nvidia-cuda-mps-control` in `folder`: the fake, run from this checkout."""
    program = folder / "nvidia-cuda-mps-control"
    program.write_text(f"#!/bin/sh\ncd {REPO} && exec {sys.executable} -m "
                       "vgpu_runtime.devkit.fakecuda.fake_mps_control \"$@\"\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return program


def ask(state_dir: Path, program: Path, command: str) -> subprocess.CompletedProcess[str]:
    env = {**ENV, "CUDA_MPS_PIPE_DIRECTORY": str(paths.mps_pipe_dir(state_dir))}
    return subprocess.run([str(program)], input=command + "\n", text=True, env=env,
                          capture_output=True, check=False, timeout=30)


def control_answers(state_dir: Path, program: Path) -> bool:
    return ask(state_dir, program, "get_server_list").returncode == 0


def quit_control(state_dir: Path, program: Path) -> None:
    """Stops a control daemon a failed test left behind."""
    if control_answers(state_dir, program):
        ask(state_dir, program, "quit")
