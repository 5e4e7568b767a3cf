"""Builds the native token scheduler (libgemini-timeshare) with gcc alone.

Pure standard library, like vgpu_runtime/hook/build.py: setup.py loads this file by path during
`pip install .` (the library lands in vgpu_runtime/lib/ beside the hook), and
vgpu_runtime.timeshare.nativepolicy imports it to build on demand from a source tree.

The name is `libgemini-timeshare.so.<package version>-<sources digest>`: any change to a source,
a header or this script (its flags) gives a new name. The build is reproducible (no paths, no
timestamps, no debug info), and an existing file is never rewritten in place (the name, the
digest and the install by rename are vgpu_runtime/common/cbuild.py's, shared with the hook's).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

NATIVE_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = NATIVE_DIR.parents[1]   # vgpu_runtime/
if TYPE_CHECKING:
    from vgpu_runtime.common import cbuild
else:  # setup.py runs this file where vgpu_runtime is not importable: cbuild is loaded by path
    _spec = importlib.util.spec_from_file_location("_gemini_cbuild",
                                                   PACKAGE_DIR / "common" / "cbuild.py")
    cbuild = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(cbuild)
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


def source_files() -> list[Path]:
    sources = sorted(NATIVE_DIR.glob("*.c")) + sorted(TOKENS_DIR.glob("*.c"))
    if not sources:
        raise NativeBuildError(f"no scheduler sources under {NATIVE_DIR}")
    return sources


def input_files() -> list[Path]:
    """Everything the library is made from: sources, headers, this script (and cbuild.py, which
    sources_digest adds)."""
    return [*source_files(), *sorted(NATIVE_DIR.glob("*.h")), *sorted(TOKENS_DIR.glob("*.h")),
            WIRE_INCLUDE_DIR / "gemini_wire.h", Path(__file__).resolve()]


def sources_digest() -> str:
    return cbuild.inputs_digest(input_files())


def library_name() -> str:
    return f"{LIBRARY_PREFIX}{cbuild.package_version(NativeBuildError)}-{sources_digest()}"


def compile_command(output: Path, compiler: str = "gcc", strict: bool = False) -> list[str]:
    """strict adds -Werror (the tests build that way; installs tolerate a newer gcc's warnings)."""
    prefix_map = [f"-ffile-prefix-map={PACKAGE_DIR}=vgpu_runtime",
                  f"-I{NATIVE_DIR}", f"-I{WIRE_INCLUDE_DIR}"]
    werror = ["-Werror"] if strict else []
    return [compiler, *CFLAGS, *prefix_map, *werror, f"-Wl,-soname,{library_name()}",
            *map(str, source_files()), "-o", str(output), *LDFLAGS]


def build_library(out_dir: Path, compiler: str | None = None, strict: bool = False) -> Path:
    """Compile into out_dir/<versioned name>; returns that path."""
    compiler = cbuild.find_compiler(compiler, "the native scheduler", NativeBuildError)
    return cbuild.install_built(Path(out_dir) / library_name(),
                                lambda tmp: compile_command(tmp, compiler, strict),
                                NativeBuildError)


if __name__ == "__main__":
    import sys

    # python -m vgpu_runtime.timeshare.native.build [OUT_DIR]
    print(build_library(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
