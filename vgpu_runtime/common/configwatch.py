"""A running program notices that its configuration file changed, and restarts to take it.

The node's file is rewritten (atomically) by gemini-config-manager when the node's
gemini.ai/vgpu.config label or the named configuration changes. A program reads it again every
CHECK_INTERVAL seconds when its bytes changed, with the flags and environment it started with:

- the settings it uses are unchanged (another program's section changed): nothing happens;
- the new file is invalid: an error is logged and the program runs on with what it has, so a
  bad edit never takes a node down;
- otherwise it logs which settings changed and stops cleanly (`stop`); its main then starts it
  again in the same process (`restart`: exec with the same command line and environment), as
  kubelet would restart the container but without kubelet's restart back-off (10 s and more),
  during which the node would have no plugin or no daemon. Both programs are restart-safe:
  allocations, channels and records live in the state directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

from vgpu_runtime.common import native_stderr
from vgpu_runtime.common.config import ConfigError, Loaded

log = logging.getLogger(__name__)

CHECK_INTERVAL = 2.0   # seconds; one read of a small file, and a restart within about 2 s
T = TypeVar("T")


def _content(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def changed_settings(old: Any, new: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]


class ConfigWatch(Generic[T]):
    """Watches `loaded`'s file; `changed` names the settings that made it call `stop`."""

    def __init__(self, loaded: Loaded[T], stop: Callable[[], None],
                 check: Callable[[T], object] = lambda config: None,
                 interval: float = CHECK_INTERVAL) -> None:
        self.loaded = loaded
        self.stop = stop
        self.check = check
        self.interval = interval
        self.changed: list[str] = []

    async def run(self) -> None:
        """Return after calling `stop` once the file gives this program other valid settings;
        never returns for a program started without a file."""
        path = self.loaded.path
        if path is None:
            await asyncio.Event().wait()
            return
        # The bytes the program was configured from, not the file's bytes as this starts: a
        # change made in between is a change.
        seen = self.loaded.raw if self.loaded.raw is not None else _content(path)
        while True:
            await asyncio.sleep(self.interval)
            now = _content(path)
            if now == seen or now is None:   # unchanged, or missing for a moment
                continue
            seen = now
            try:
                fresh = self.loaded.reread(now)
                self.check(fresh)
            except ConfigError as err:
                log.error("configuration file changed but is invalid; running on with the "
                          "settings read at start", extra={"path": path, "error": str(err)})
                continue
            changed = changed_settings(self.loaded.config, fresh)
            if not changed:
                log.info("configuration file changed; none of this program's settings did",
                         extra={"path": path})
                continue
            log.warning("configuration changed: restarting with it",
                        extra={"path": path, "settings": changed})
            self.changed = changed
            self.stop()
            return


def restart() -> NoReturn:
    """Start this program again in this process: the same pid (PID 1 of its container stays),
    command line and environment; descriptors close on exec (Python opens them O_CLOEXEC)."""
    native_stderr.release()   # fd 2 would stay a pipe whose reader the exec ends
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
