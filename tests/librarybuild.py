"""Building a native library from a checkout, as setup.py does, for the build tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_in(script: Path, out: Path, cwd: Path) -> Path:
    """The checkout's own build.py, run the way setup.py runs it, from cwd."""
    result = subprocess.run([sys.executable, str(script), str(out)], cwd=cwd,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


def copy_build_base(package: Path) -> Path:
    """Into another checkout's vgpu_runtime/: what every library's build reads besides its own
    files, the version, the shared recipe (common/cbuild.py) and the wire's header
    (contracts/gemini_wire.h); returns the recipe's copy."""
    (package / "common").mkdir(parents=True, exist_ok=True)
    (package / "contracts").mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "vgpu_runtime" / "__init__.py", package / "__init__.py")
    shutil.copy2(REPO / "vgpu_runtime" / "contracts" / "gemini_wire.h",
                 package / "contracts" / "gemini_wire.h")
    return Path(shutil.copy2(REPO / "vgpu_runtime" / "common" / "cbuild.py",
                             package / "common" / "cbuild.py"))
