"""The plugin's part of the node's state directory, made ready at start.

<state-dir>/allocations/ and <state-dir>/channels/ (paths.CHANNELS_DIR_MODE, 0700: set on an
existing one too) are created, and their names fsynced, once here, so that Allocate's hot path
only ever adds names inside them. Temporary files left by atomic writes that a crash
interrupted (records, the preload files in channel directories, health.json) are swept here:
the plugin owns these directories. The rule that keeps a live writer's temporary file
(gemini-run writes records too) is in atomicfile.sweep_stale_temps.

So are empty channel directories that no record names: a crash between Allocate's mkdir of the
channel and the record's rename leaves one. The same age rule keeps a live writer's (gemini-run
makes its channel just before its record), and a channel whose record exists is always kept,
empty or not (its daemon may not have served it yet).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from vgpu_runtime.common import securedir
from vgpu_runtime.common.atomicfile import STALE_TEMP_AGE, fsync_dir, sweep_stale_temps
from vgpu_runtime.contracts import allocation, paths

log = logging.getLogger(__name__)


def prepare(state_dir: str | Path, stale_age: float = STALE_TEMP_AGE) -> list[Path]:
    """Create the directories (durably) and sweep stale temporary files; returns those removed.
    Never raises: on a read-only or full state directory the plugin still serves, and each
    Allocate that needs to write says clearly why it cannot."""
    state = Path(state_dir)
    try:
        state.mkdir(parents=True, exist_ok=True)
        paths.allocations_dir(state).mkdir(mode=0o755, exist_ok=True)
        securedir.make_dir(paths.channels_dir(state), paths.CHANNELS_DIR_MODE)
        fsync_dir(state)
    except (OSError, securedir.InsecureDirectory) as err:
        log.error("cannot prepare the state directory; Allocate will fail until it is "
                  "writable", extra={"state_dir": str(state), "error": str(err)})
    removed = allocation.sweep_temp_files(state, stale_age)
    removed += sweep_stale_temps(state, stale_age)
    try:
        channels = [e.path for e in os.scandir(paths.channels_dir(state)) if e.is_dir()]
    except OSError:
        channels = []   # no channels yet, or an unusable state dir (logged above)
    for channel in channels:
        removed += sweep_stale_temps(channel, stale_age)
    removed += _sweep_orphan_channels(state, channels, stale_age)
    return removed


def _sweep_orphan_channels(state: Path, channels: list[str], stale_age: float) -> list[Path]:
    allocations = paths.allocations_dir(state)
    now = time.time()
    removed = []
    for channel in channels:
        name = os.path.basename(channel)
        if (allocations / f"{name}.json").exists():
            continue
        try:
            if now - os.stat(channel).st_mtime <= stale_age:
                continue
            os.rmdir(channel)   # empty ones only: anything inside says someone uses it
        except OSError:
            continue
        log.info("removed an empty channel directory no record names",
                 extra={"channel_dir": channel})
        removed.append(Path(channel))
    return removed
