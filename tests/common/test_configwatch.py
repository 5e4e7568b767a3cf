"""ConfigWatch (vgpu_runtime/common/configwatch.py) against real files: it compares the file
with the bytes the program was configured from, so a change made between the program's load and
the watch's start is seen, an invalid change is logged and the program runs on, and a change of
another program's settings stops nothing."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.configwatch import ConfigWatch
from vgpu_runtime.daemon.config import DaemonConfig

FILE = ("version: v1\nscheduler:\n  limit_policy: {policy}\n"
        "devicePlugin:\n  placement: {placement}\n")


def write(path: Path, policy: str = "work-conserving", placement: str = "best-fit") -> None:
    path.write_text(FILE.format(policy=policy, placement=placement))


async def watch_until(watch: ConfigWatch[DaemonConfig], stopped: asyncio.Event,
                      timeout: float = 5.0) -> bool:
    task = asyncio.create_task(watch.run())
    try:
        await asyncio.wait_for(stopped.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        task.cancel()


async def test_a_change_before_the_watch_starts_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    write(path)
    loaded = cfg.load_all(DaemonConfig, ["--config", str(path)], environ={})
    write(path, policy="strict")     # after the load, before the watch's first read
    stopped = asyncio.Event()
    watch = ConfigWatch(loaded, stopped.set, interval=0.01)
    assert await watch_until(watch, stopped)
    assert watch.changed == ["limit_policy"]


async def test_invalid_and_foreign_changes_stop_nothing(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "config.yaml"
    write(path)
    loaded = cfg.load_all(DaemonConfig, ["--config", str(path)], environ={})
    stopped = asyncio.Event()
    watch = ConfigWatch(loaded, stopped.set, interval=0.01)
    path.write_text(FILE.format(policy="sometimes", placement="best-fit"))
    with caplog.at_level(logging.INFO):
        assert not await watch_until(watch, stopped, 0.3)
        assert "changed but is invalid" in caplog.text
        write(path, placement="spread")     # the plugin's section
        assert not await watch_until(watch, stopped, 0.3)
        assert "none of this program's settings did" in caplog.text
    assert watch.changed == []
