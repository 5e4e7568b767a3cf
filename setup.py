"""Builds the interposer (C, gcc only) as part of `pip install .`.

The library lands in the package as vgpu_runtime/lib/libgemini-hook.so.<version>; see
vgpu_runtime/hook/build.py for the compiler line and the glibc symbol-version rules.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent


def _hook_builder():
    spec = importlib.util.spec_from_file_location(
        "_gemini_hook_build", HERE / "vgpu_runtime/hook/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithHook(build_py):
    def run(self):
        super().run()
        out_dir = Path(self.build_lib) / "vgpu_runtime" / "lib"
        _hook_builder().build_library(out_dir)


setup(cmdclass={"build_py": BuildWithHook})
