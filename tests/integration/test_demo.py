"""The README's first command's Python half, run as the user would: the installed gemini-demo
console program (scripts/demo execs it), a real subprocess."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

import pytest

PROGRAM = Path(sysconfig.get_path("scripts")) / "gemini-demo"


def test_demo_shows_capacity_placement_refusal_and_sharing(tmp_path: Path) -> None:
    if not PROGRAM.exists():
        pytest.skip(f"{PROGRAM} is not installed (pip install -e . puts it there)")
    # Run away from the source tree: the demo needs nothing from it, tests/ least of all.
    result = subprocess.run([str(PROGRAM), "--simulate-gpus", "2"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "Capacity:\n    gemini.ai/vgpu:  20" in out
    assert "Allocatable:\n    gemini.ai/vgpu:  20" in out
    assert out.count(": admitted, ") == 3
    assert "3 slices of GPU 0" in out and "5 slices of GPU 0" in out
    assert "4 slices of GPU 1" in out
    assert "free slices: 8 (2 on GPU 0" in out and "asking for 7" in out
    assert "REFUSED, reason UnexpectedAdmissionError" in out
    assert "plugin stopped (exit status 0)" in out and "removed /tmp/gemini-demo-" in out
    # The sharing part (tests/devkit/test_sharedemo.py checks its figures).
    assert "== 5. Two programs sharing one GPU, live" in out
    assert out.count("refused: CUDA_ERROR_OUT_OF_MEMORY") == 2
    assert out.index("plugin stopped") < out.index("== 5.") < out.index("removed /tmp/")


def test_demo_runs_one_part_when_asked(tmp_path: Path) -> None:
    if not PROGRAM.exists():
        pytest.skip(f"{PROGRAM} is not installed (pip install -e . puts it there)")
    result = subprocess.run([str(PROGRAM), "--only", "admission", "--simulate-gpus", "2"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== 3. Admitting" in result.stdout and "== 5." not in result.stdout
