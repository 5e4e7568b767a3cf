"""Builds the interposer shared library with gcc alone (no CUDA toolkit).

Pure standard library: setup.py loads this file by path during `pip install .`, and
vgpu_runtime.hooklib imports it to build on demand from a source tree.

The library's name is `libgemini-hook.so.<package version>-<sources digest>`
(vgpu_runtime.hooklib.library_name()): every change to a source, header, the hook table or
this script (its flags) gives a new name, so an upgraded node installs the new file beside the
old one and running pods keep theirs. The build is reproducible: the same sources give the same
bytes wherever they are checked out (no build paths, no timestamps, no debug info), so a rebuild
of unchanged sources installs over nothing.

A running program's library is never rewritten: the name, the digest and the install by rename
are vgpu_runtime/common/cbuild.py's, shared with the native scheduler's build.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

HOOK_DIR = Path(__file__).resolve().parent
# The hook's own headers, and the wire's, which lives beside its Python reader (contracts/).
INCLUDE_DIRS = (HOOK_DIR / "include", HOOK_DIR.parent / "contracts")
if TYPE_CHECKING:
    from vgpu_runtime.common import cbuild
else:  # setup.py runs this file where vgpu_runtime is not importable: cbuild is loaded by path
    _spec = importlib.util.spec_from_file_location("_gemini_cbuild",
                                                   HOOK_DIR.parent / "common" / "cbuild.py")
    cbuild = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(cbuild)
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
# Written by build_into_package beside the packaged library: the installed package reads its
# interposer's name here (vgpu_runtime.hooklib) and never hashes the sources again.
NAME_FILE = "hook-library-name"


class HookBuildError(RuntimeError):
    """gcc is missing or the sources do not compile; the message holds gcc's output."""


def library_name() -> str:
    """The name these sources build to: the package version and the sources' digest."""
    return f"{LIBRARY_PREFIX}{cbuild.package_version(HookBuildError)}-{sources_digest()}"


def source_files() -> list[Path]:
    sources = sorted(p for family in FAMILIES for p in (HOOK_DIR / family).glob("*.c"))
    if not sources:
        raise HookBuildError(f"no hook sources under {HOOK_DIR}")
    return sources


def input_files() -> list[Path]:
    """Everything the library is made from: sources, headers, the table, this script (and
    cbuild.py, which sources_digest adds)."""
    headers = [h for directory in INCLUDE_DIRS for h in sorted(directory.glob("*.h"))]
    headers += sorted(p for family in FAMILIES for p in (HOOK_DIR / family).glob("*.h"))
    return [*source_files(), *headers, HOOK_DIR / "hooks.def", Path(__file__).resolve()]


def sources_digest() -> str:
    return cbuild.inputs_digest(input_files())


def include_flags() -> list[str]:
    """-I for every directory the hook's headers are in: what any C file using them needs."""
    return [f"-I{directory}" for directory in INCLUDE_DIRS]


def compile_command(output: Path, compiler: str = "gcc", strict: bool = False,
                    profile: bool = False) -> list[str]:
    """strict adds -Werror (the tests build that way; installs tolerate a newer gcc's warnings);
    profile adds -DGM_PROFILE (launch/profile.h: the launch path timed, for benchmarks only)."""
    includes = [*include_flags(), f"-include{HOOK_DIR / 'include' / 'glibc_compat.h'}"]
    # __FILE__ and any path the compiler records read relative to the package's directory.
    prefix_map = [f"-ffile-prefix-map={HOOK_DIR.parent}=vgpu_runtime"]
    werror = ["-Werror"] if strict else []
    defines = ["-DGM_PROFILE"] if profile else []
    return [compiler, *CFLAGS, *prefix_map, *werror, *defines, *includes,
            f"-Wl,-soname,{library_name()}", *map(str, source_files()), "-o", str(output),
            *LDFLAGS]


def build_library(out_dir: Path, compiler: str | None = None, strict: bool = False,
                  profile: bool = False) -> Path:
    """Compile into out_dir/<versioned name> (with `profile`, <versioned name>.profile: never
    the name an installed library has); returns that path."""
    compiler = cbuild.find_compiler(compiler, "the interposer", HookBuildError)
    target = Path(out_dir) / (library_name() + (".profile" if profile else ""))
    return cbuild.install_built(
        target, lambda tmp: compile_command(tmp, compiler, strict, profile), HookBuildError)


def build_into_package(lib_dir: Path, compiler: str | None = None) -> Path:
    """setup.py's step: the library in the package's lib/ and, beside it, NAME_FILE naming it,
    written once here so the installed code reads the name instead of computing it."""
    library = build_library(lib_dir, compiler)
    (Path(lib_dir) / NAME_FILE).write_text(library.name + "\n")
    return library


if __name__ == "__main__":
    import sys

    # python -m vgpu_runtime.hook.build [--profile] [OUT_DIR]
    arguments = [a for a in sys.argv[1:] if a != "--profile"]
    print(build_library(Path(arguments[0] if arguments else "."),
                        profile="--profile" in sys.argv[1:]))
