"""Fixtures for the hook's tests: the hook built strict, the fake driver, hooked children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.fakecuda.builder import build_fake_driver
from vgpu_runtime.hook import build

REPO = Path(__file__).resolve().parents[2]
PRELUDE = "from tests.hook.cudaprobe import *\nimport ctypes, json, os\n"


@pytest.fixture(scope="session")
def hook_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.build_library(tmp_path_factory.mktemp("hook"), strict=True)


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_driver(tmp_path_factory.mktemp("fakecuda"))


class Hooked:
    """Runs programs with the hook preloaded in front of the fake driver."""

    def __init__(self, hook: Path, fake: Path) -> None:
        self.hook, self.fake = hook, fake

    def env(self, extra: Mapping[str, str] | None = None, preload: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMINI_", "FAKE_"))}
        env["LD_LIBRARY_PATH"] = str(self.fake)
        env["PYTHONPATH"] = str(REPO)
        env["GEMINI_TEST_HOOK"] = str(self.hook)
        if preload:
            env["LD_PRELOAD"] = str(self.hook)
        env.update(extra or {})
        return env

    def run(self, argv: list[str], extra: Mapping[str, str] | None = None,
            preload: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env(extra, preload), capture_output=True, text=True,
                              timeout=timeout)

    def python(self, code: str, extra: Mapping[str, str] | None = None,
               preload: bool = True, timeout: float = 30) -> dict[str, object]:
        """Run `code` under the hook; it must print one JSON object last, which is returned."""
        source = PRELUDE + textwrap.dedent(code)
        proc = self.run([sys.executable, "-c", source], extra, preload, timeout)
        assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
        last = proc.stdout.strip().splitlines()[-1]
        result: dict[str, object] = json.loads(last)
        return result


@pytest.fixture(scope="session")
def hooked(hook_lib: Path, fake_dir: Path) -> Hooked:
    return Hooked(hook_lib, fake_dir)


def compile_program(source: str, out: Path, fake: Path, *flags: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(textwrap.dedent(source))
    cmd = ["gcc", "-std=gnu11", "-O1", "-Wall", "-Werror", "-Wno-unused-parameter",
           f"-I{REPO / 'vgpu_runtime' / 'hook' / 'include'}", str(src), "-o", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out
