from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scheduler.helpers import DaemonProcess


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short, under /tmp: Unix socket paths must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="gm-"))
    yield path / "state"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(state_dir: Path) -> Iterator[DaemonProcess]:
    state_dir.mkdir(parents=True, exist_ok=True)
    proc = DaemonProcess(state_dir).wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, proc.logs()
