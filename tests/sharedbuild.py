"""The native libraries the tests preload, built once per run and shared by its pytest-xdist
workers: the hook built strict (-Werror) and the fake driver.

Rule: the first worker to ask builds, under an exclusive lock; the others wait on that lock and
reuse the result, so a run compiles each library once instead of once per worker. The run's
directory (tests/conftest.py makes it, its workers inherit it) is readable by every user, since
the tests also run programs as other uids and in containers that mount the fake driver.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from vgpu_runtime.devkit.fakecuda.builder import build_fake_driver
from vgpu_runtime.hook import build

# The run's directory of shared builds: set by tests/conftest.py in the controller, inherited.
ROOT_VARIABLE = "GEMINI_TEST_BUILT"


def built_once(name: str, make: Callable[[Path], Path]) -> Path:
    """make(<run's directory>/name) the first time any worker asks for `name`, under a lock;
    every later ask, from any worker, returns that first result."""
    root = Path(os.environ[ROOT_VARIABLE])
    done = root / f"{name}.done"   # written last, naming the result: a failed build leaves none
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return Path(done.read_text())
        directory = root / name
        result = make(directory)
        for path in (directory, *directory.rglob("*")):
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)   # other uids and containers read it, whatever the umask
        done.write_text(str(result))
        return result


def hook_library() -> Path:
    """The interposer built strict: a warning fails the first test that asks for it."""
    return built_once("hook", lambda directory: build.build_library(directory, strict=True))


def fake_driver() -> Path:
    """The directory of the fake libcuda and NVML (vgpu_runtime/devkit/fakecuda)."""
    return built_once("fake-driver", build_fake_driver)
