"""The README's first command's Python half, run as the user would (a real subprocess)."""

from __future__ import annotations

import subprocess
import sys

from tests.kubelet_emulator.plugin_process import REPO_ROOT


def test_demo_shows_capacity_placement_and_refusal() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.kubelet_emulator.demo", "--simulate-gpus", "2"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
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
