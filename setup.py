"""Builds the interposer (C, gcc only) as part of `pip install .`.

The library lands in the package as vgpu_runtime/lib/libgemini-hook.so.<version>-<digest>,
with vgpu_runtime/lib/hook-library-name naming it (read by vgpu_runtime/hooklib.py; see
vgpu_runtime/hook/build.py for the compiler line and the glibc symbol-version rules);
build.py loads vgpu_runtime/common/cbuild.py, which names it and installs it by rename.
The wheel is tagged py3-none-manylinux2014_<machine>: its Python is pure (cffi in ABI mode) but
it carries that machine's library, which needs nothing newer than glibc 2.17 (manylinux2014).

GEMINI_WHEEL=node builds the node image's wheel (daemonset/image/Dockerfile): the same, less the
development kit (vgpu_runtime/devkit: the kubelet emulator, the fake API server, the fake
libcuda, gemini-demo), which no program of the node imports (tests/test_layering.py).
"""

import importlib.util
import os
import platform
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).parent
# The architectures vgpu_runtime/hook/include/glibc_compat.h pins to glibc 2.17 symbols.
MANYLINUX2014 = {"x86_64", "aarch64"}
WHEELS = ("full", "node")
NODE_WHEEL_LEAVES_OUT = "vgpu_runtime.devkit"


def _builder(name, path):
    spec = importlib.util.spec_from_file_location(name, HERE / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hook_builder():
    return _builder("_gemini_hook_build", "vgpu_runtime/hook/build.py")


def platform_tag():
    machine = platform.machine()
    if machine not in MANYLINUX2014:
        raise RuntimeError(f"the interposer has no glibc 2.17 symbol pins for {machine!r} "
                           "(vgpu_runtime/hook/include/glibc_compat.h)")
    return f"manylinux2014_{machine}"


def wheel_kind():
    kind = os.environ.get("GEMINI_WHEEL", "full")
    if kind not in WHEELS:
        raise RuntimeError(f"GEMINI_WHEEL={kind!r}: expected one of {', '.join(WHEELS)}")
    return kind


class BuildWithHook(build_py):
    def finalize_options(self):
        super().finalize_options()
        if wheel_kind() == "node":
            left_out = NODE_WHEEL_LEAVES_OUT
            self.packages = [p for p in self.packages
                             if p != left_out and not p.startswith(left_out + ".")]

    def run(self):
        super().run()
        out_dir = Path(self.build_lib) / "vgpu_runtime" / "lib"
        _hook_builder().build_into_package(out_dir)


class WithNativeLibrary(Distribution):
    """Not pure: installed to platlib, and the wheel is not root-is-purelib."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        return "py3", "none", platform_tag()


setup(distclass=WithNativeLibrary,
      cmdclass={"build_py": BuildWithHook, "bdist_wheel": PlatformWheel})
