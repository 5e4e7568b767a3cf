"""Building a native library from a checkout, as setup.py does, for the build tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def build_in(script: Path, out: Path, cwd: Path) -> Path:
    """The checkout's own build.py, run the way setup.py runs it, from cwd."""
    result = subprocess.run([sys.executable, str(script), str(out)], cwd=cwd,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())
