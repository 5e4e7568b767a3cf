"""The atheris harnesses run (briefly) and find nothing; skipped where atheris is not installed.

The long runs are done by hand (RELIABILITY.md, "Bad input"); this keeps the harnesses working.
A crash they find gets its regression test in the hypothesis suites of this directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("atheris")

HERE = Path(__file__).resolve().parent
HARNESSES = ("atheris_wire", "atheris_files")


@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_runs_clean_for_a_few_thousand_inputs(harness: str, tmp_path: Path) -> None:
    state = tempfile.mkdtemp(prefix="gm-atheris-", dir="/tmp")   # short: socket paths
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / f"{harness}.py"), "-runs=3000", "-seed=1",
             f"-artifact_prefix={tmp_path}/"],
            capture_output=True, text=True, timeout=90, cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path), "GM_ATHERIS_STATE": state})
    finally:
        shutil.rmtree(state, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 3000 runs" in done.stderr
    assert not list(tmp_path.glob("crash-*"))

