"""Builds the interposer shared library with gcc alone (no CUDA toolkit).

Pure standard library: setup.py loads this file by path during `pip install .`, and
vgpu_runtime.hooklib imports it to build on demand from a source tree.

The library's name is `libgemini-hook.so.<package version>-<sources digest>`
(vgpu_runtime.paths.HOOK_LIBRARY_NAME): every change to a source, header, the hook table or
this script (its flags) gives a new name, so an upgraded node installs the new file beside the
old one and running pods keep theirs. The build is reproducible: the same sources give the same
bytes wherever they are checked out (no build paths, no timestamps, no debug info), so a rebuild
of unchanged sources installs over nothing.

A running program's library is never rewritten. A file of that name with the same content
is left alone; one with different content is replaced by an atomic rename (a process that
mapped the old file keeps the old inode), never overwritten in place.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HOOK_DIR = Path(__file__).resolve().parent
FAMILIES = ("core", "launch", "memory", "nvml", "channel")
# No -g: debug info records the build directory, and the name promises the same bytes for the
# same sources. The symbol table stays, so backtraces still name functions.
CFLAGS = (
    "-std=gnu11", "-O2", "-fPIC", "-fvisibility=hidden", "-pthread",
    "-Wall", "-Wextra", "-Wno-unused-parameter",
    "-fno-strict-aliasing", "-D_GNU_SOURCE",
)
# -Bsymbolic-functions: the hook's own references (the name -> wrapper table) bind to its
# wrappers, whatever else the process exports. -z defs: every wrapper the table names exists.
# libdl and libpthread stay NEEDED so the old symbol versions resolve on glibc < 2.34.
# --build-id=sha1: a content hash in the library, which gemini-install-hook shows when it refuses.
LDFLAGS = (
    "-shared", "-Wl,--build-id=sha1", "-Wl,-Bsymbolic-functions", "-Wl,-z,defs", "-Wl,-z,now",
    "-Wl,--no-as-needed", "-ldl", "-lpthread",
)


# Every version's file starts with this (libraries installed before the digest was added are
# named libgemini-hook.so.<version> and are retired by the same prefix).
LIBRARY_PREFIX = "libgemini-hook.so."


class HookBuildError(RuntimeError):
    """gcc is missing or the sources do not compile; the message holds gcc's output."""


def package_version() -> str:
    """vgpu_runtime.__version__, read without importing the package (setup.py)."""
    init = (HOOK_DIR.parent / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', init, re.M)
    if match is None:
        raise HookBuildError("cannot find __version__ in vgpu_runtime/__init__.py")
    return match.group(1)


def library_name() -> str:
    """vgpu_runtime.paths.HOOK_LIBRARY_NAME: the package version and the sources' digest."""
    return f"{LIBRARY_PREFIX}{package_version()}-{sources_digest()}"


def source_files() -> list[Path]:
    sources = sorted(p for family in FAMILIES for p in (HOOK_DIR / family).glob("*.c"))
    if not sources:
        raise HookBuildError(f"no hook sources under {HOOK_DIR}")
    return sources


def input_files() -> list[Path]:
    """Everything the library is made from: sources, headers, the table, this script."""
    headers = sorted((HOOK_DIR / "include").glob("*.h"))
    headers += sorted(p for family in FAMILIES for p in (HOOK_DIR / family).glob("*.h"))
    return [*source_files(), *headers, HOOK_DIR / "hooks.def", Path(__file__).resolve()]


def sources_digest() -> str:
    digest = hashlib.sha256()
    for path in input_files():
        digest.update(path.relative_to(HOOK_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def compile_command(output: Path, compiler: str = "gcc", strict: bool = False,
                    profile: bool = False) -> list[str]:
    """strict adds -Werror (the tests build that way; installs tolerate a newer gcc's warnings);
    profile adds -DGM_PROFILE (launch/profile.h: the launch path timed, for benchmarks only)."""
    includes = [f"-I{HOOK_DIR / 'include'}",
                f"-include{HOOK_DIR / 'include' / 'glibc_compat.h'}"]
    # __FILE__ and any path the compiler records read relative to the hook's directory.
    prefix_map = [f"-ffile-prefix-map={HOOK_DIR}=vgpu_runtime/hook"]
    werror = ["-Werror"] if strict else []
    defines = ["-DGM_PROFILE"] if profile else []
    return [compiler, *CFLAGS, *prefix_map, *werror, *defines, *includes,
            f"-Wl,-soname,{library_name()}", *map(str, source_files()), "-o", str(output),
            *LDFLAGS]


def build_library(out_dir: Path, compiler: str | None = None, strict: bool = False,
                  profile: bool = False) -> Path:
    """Compile into out_dir/<versioned name> (with `profile`, <versioned name>.profile: never
    the name an installed library has); returns that path."""
    compiler = compiler or os.environ.get("CC", "gcc")
    if shutil.which(compiler) is None:
        raise HookBuildError(f"the interposer needs a C compiler: {compiler!r} was not found")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / (library_name() + (".profile" if profile else ""))
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        command = compile_command(tmp, compiler, strict, profile)
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise HookBuildError(f"building {target.name} failed:\n{proc.stderr}")
        if target.exists() and target.read_bytes() == tmp.read_bytes():
            return target
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)   # a new inode: programs that mapped the old file keep it
    finally:
        tmp.unlink(missing_ok=True)
    return target


if __name__ == "__main__":
    import sys

    # python -m vgpu_runtime.hook.build [--profile] [OUT_DIR]
    arguments = [a for a in sys.argv[1:] if a != "--profile"]
    print(build_library(Path(arguments[0] if arguments else "."),
                        profile="--profile" in sys.argv[1:]))
