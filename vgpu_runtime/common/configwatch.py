"""A running program notices that its configuration file changed, and stops to take it.

The node's file is rewritten (atomically) by gemini-config-manager when the node's
gemini.ai/vgpu.config label or the named configuration changes. A program reads it again every
CHECK_INTERVAL seconds when its bytes changed, with the flags and environment it started with:

- the settings it uses are unchanged (another program's section changed): nothing happens;
- the new file is invalid: an error is logged and the program runs on with what it has, so a
  bad edit never takes a node down;
- otherwise it logs which settings changed and stops cleanly (`stop`), and kubelet restarts the
  container, which starts with the new file. Both programs are restart-safe: allocations,
  channels and records live in the state directory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

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


async def watch(loaded: Loaded[T], stop: Callable[[], None],
                check: Callable[[T], object] = lambda config: None,
                interval: float = CHECK_INTERVAL) -> None:
    """Return after calling `stop` once the file gives this program other valid settings;
    never returns for a program started without a file."""
    path = loaded.path
    if path is None:
        await asyncio.Event().wait()
        return
    seen = _content(path)
    while True:
        await asyncio.sleep(interval)
        now = _content(path)
        if now == seen or now is None:   # unchanged, or between a rename and the next read
            continue
        seen = now
        try:
            fresh = loaded.reread()
            check(fresh)
        except ConfigError as err:
            log.error("configuration file changed but is invalid; running on with the settings "
                      "read at start", extra={"path": path, "error": str(err)})
            continue
        changed = changed_settings(loaded.config, fresh)
        if not changed:
            log.info("configuration file changed; none of this program's settings did",
                     extra={"path": path})
            continue
        log.warning("configuration changed: stopping so that the container restarts with it",
                    extra={"path": path, "settings": changed})
        stop()
        return
