"""Building the package's C library (the interposer, hook/build.py) with gcc alone.

Pure standard library: hook/build.py loads it by path, since setup.py runs that file by path
during `pip install .`, where vgpu_runtime is not importable.

A library is named `<prefix><package version>-<digest of its inputs>`, the inputs being every
file its bytes come from: its sources and headers, its build.py (its flags) and this file. Each
build is reproducible (its build.py keeps paths, timestamps and debug info out), so the same
inputs give the same bytes under the same name. An existing file is never rewritten in place: one
with the same content is left alone, one with different content is replaced by an atomic rename
(a process that mapped the old file keeps the old inode).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]   # vgpu_runtime/


def package_version(error: type[Exception]) -> str:
    """vgpu_runtime.__version__, read without importing the package (setup.py)."""
    init = (PACKAGE_DIR / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', init, re.M)
    if match is None:
        raise error("cannot find __version__ in vgpu_runtime/__init__.py")
    return match.group(1)


def inputs_digest(inputs: Iterable[Path]) -> str:
    """The inputs' paths (relative to vgpu_runtime/, so any checkout gives the same) and bytes,
    this file's included, hashed into 16 hex digits."""
    digest = hashlib.sha256()
    for path in [*inputs, Path(__file__).resolve()]:
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def find_compiler(compiler: str | None, needed_by: str, error: type[Exception]) -> str:
    """The compiler given, else $CC, else gcc; `error` names needed_by when it is missing."""
    compiler = compiler or os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        raise error(f"{needed_by} needs a C compiler: {compiler!r} was not found")
    return compiler


def install_built(target: Path, command: Callable[[Path], list[str]],
                  error: type[Exception]) -> Path:
    """Runs command(temporary file beside target) and installs its output as target, never
    writing into an existing target; `error` holds the compiler's output when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        proc = subprocess.run(command(tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"building {target.name} failed:\n{proc.stderr}")
        if target.exists() and target.read_bytes() == tmp.read_bytes():
            return target
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)   # a new inode: a process that mapped the old file keeps it
    finally:
        tmp.unlink(missing_ok=True)
    return target
