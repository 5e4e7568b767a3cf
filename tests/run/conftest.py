from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vgpu_runtime.daemon import lock


@pytest.fixture(scope="session")
def hook_library() -> Iterator[Path]:
    """A real (empty) shared library for LD_PRELOAD, standing in for the interposer."""
    root = Path(tempfile.mkdtemp(prefix="gm-lib-"))
    source = root / "marker.c"
    source.write_text("int gemini_test_preloaded = 1;\n")
    library = root / "libgemini-test.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    yield library
    shutil.rmtree(root, ignore_errors=True)


def stop_daemon(state_dir: Path) -> None:
    """Stop the gemini-daemon that gemini-run started in the background for this test."""
    if not lock.is_held(state_dir):
        return
    pid = lock.holder_pid(state_dir)
    if pid:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while lock.is_held(state_dir) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gm-"))
    path = root / "state"
    yield path
    stop_daemon(path)
    shutil.rmtree(root, ignore_errors=True)
