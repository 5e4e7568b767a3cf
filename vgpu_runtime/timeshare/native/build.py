"""Builds the native token scheduler (libgemini-timeshare) with gcc alone.

Pure standard library, like vgpu_runtime/hook/build.py: setup.py loads this file by path during
`pip install .` (the library lands in vgpu_runtime/lib/ beside the hook), and
vgpu_runtime.timeshare.nativepolicy imports it to build on demand from a source tree.

The name is `libgemini-timeshare.so.<package version>-<sources digest>`: any change to a source,
a header or this script (its flags) gives a new name. The build is reproducible (no paths, no
timestamps, no debug info), and an existing file is never rewritten in place: a different one
is replaced by an atomic rename, so a daemon that mapped the old file keeps it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = NATIVE_DIR.parents[1]   # vgpu_runtime/
# The daemon's token code (GpuTokens in C) is built into the same library: it calls the
# scheduler C to C, and writes the pages laid out by the hook's wire header.
TOKENS_DIR = PACKAGE_DIR / "daemon" / "channel" / "native"
WIRE_INCLUDE_DIR = PACKAGE_DIR / "hook" / "include"
# Plain C11, no -ffast-math and no FMA contraction: the doubles must be the ones Python computes,
# operation for operation. Symbols are hidden but for the API (TS_API in timeshare.h).
CFLAGS = (
    "-std=c11", "-O2", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off",
    "-Wall", "-Wextra", "-Wno-unused-parameter",
)
LDFLAGS = ("-shared", "-Wl,--build-id=sha1", "-Wl,-z,defs", "-Wl,-z,now", "-lm")
LIBRARY_PREFIX = "libgemini-timeshare.so."


class NativeBuildError(RuntimeError):
    """gcc is missing or the sources do not compile; the message holds gcc's output."""


def package_version() -> str:
    """vgpu_runtime.__version__, read without importing the package (setup.py)."""
    init = (PACKAGE_DIR / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', init, re.M)
    if match is None:
        raise NativeBuildError("cannot find __version__ in vgpu_runtime/__init__.py")
    return match.group(1)


def source_files() -> list[Path]:
    sources = sorted(NATIVE_DIR.glob("*.c")) + sorted(TOKENS_DIR.glob("*.c"))
    if not sources:
        raise NativeBuildError(f"no scheduler sources under {NATIVE_DIR}")
    return sources


def input_files() -> list[Path]:
    """Everything the library is made from: sources, headers, this script."""
    return [*source_files(), *sorted(NATIVE_DIR.glob("*.h")), *sorted(TOKENS_DIR.glob("*.h")),
            WIRE_INCLUDE_DIR / "gemini_wire.h", Path(__file__).resolve()]


def sources_digest() -> str:
    digest = hashlib.sha256()
    for path in input_files():
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def library_name() -> str:
    return f"{LIBRARY_PREFIX}{package_version()}-{sources_digest()}"


def compile_command(output: Path, compiler: str = "gcc", strict: bool = False) -> list[str]:
    """strict adds -Werror (the tests build that way; installs tolerate a newer gcc's warnings)."""
    prefix_map = [f"-ffile-prefix-map={PACKAGE_DIR}=vgpu_runtime",
                  f"-I{NATIVE_DIR}", f"-I{WIRE_INCLUDE_DIR}"]
    werror = ["-Werror"] if strict else []
    return [compiler, *CFLAGS, *prefix_map, *werror, f"-Wl,-soname,{library_name()}",
            *map(str, source_files()), "-o", str(output), *LDFLAGS]


def build_library(out_dir: Path, compiler: str | None = None, strict: bool = False) -> Path:
    """Compile into out_dir/<versioned name>; returns that path."""
    compiler = compiler or os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"the native scheduler needs a C compiler: {compiler!r} was "
                               "not found")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / library_name()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        proc = subprocess.run(compile_command(tmp, compiler, strict), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise NativeBuildError(f"building {target.name} failed:\n{proc.stderr}")
        if target.exists() and target.read_bytes() == tmp.read_bytes():
            return target
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)   # a new inode: a process that mapped the old file keeps it
    finally:
        tmp.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    import sys

    # python -m vgpu_runtime.timeshare.native.build [OUT_DIR]
    print(build_library(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
