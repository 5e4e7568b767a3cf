"""The atheris harnesses run (briefly) and find nothing; skipped where atheris is not installed.

The long runs are done by hand (RELIABILITY.md, "Bad input"); this keeps the harnesses working
and replays every input that ever crashed one (tests/fuzz/crashes/<harness>/) through it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HERE = Path(__file__).resolve().parent
HARNESSES = ("atheris_wire", "atheris_files")


@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_runs_clean_for_a_few_thousand_inputs(harness: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HERE / f"{harness}.py"), "-runs=3000", "-seed=1",
         f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 3000 runs" in done.stderr
    assert not list(tmp_path.glob("crash-*"))


@pytest.mark.parametrize("harness", HARNESSES)
def test_saved_crash_inputs_now_pass(harness: str, tmp_path: Path) -> None:
    crashes = sorted((HERE / "crashes" / harness).glob("*"))
    if not crashes:
        pytest.skip(f"no saved crash inputs for {harness}")
    done = subprocess.run(
        [sys.executable, str(HERE / f"{harness}.py"), *map(str, crashes)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
