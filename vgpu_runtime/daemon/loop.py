"""The daemon's event loop: which one runs, and what it logs of errors it does not raise."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"   # asyncio's message
ACCEPT_LOG_INTERVAL = 10.0


def event_loop_name() -> str:
    """'uvloop' or 'asyncio': the loop this daemon runs on (logged at start, for benchmarks)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"


class AcceptFailureLog:
    """The loop's exception handler. asyncio logs, with a traceback, every accept that fails for
    want of descriptors: a hundred lines a second per socket while a tenant holds them all. One
    line per ACCEPT_LOG_INTERVAL instead, with the count; anything else as asyncio would."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.failures = 0   # since the last line
        self._logged = -ACCEPT_LOG_INTERVAL

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith(ACCEPT_OUT_OF_RESOURCES):
            loop.default_exception_handler(context)
            return
        self.failures += 1
        now = self.clock()
        if now - self._logged >= ACCEPT_LOG_INTERVAL:
            log.error("cannot accept connections (out of descriptors or memory); each socket "
                      "retries every second", extra={"error": str(context.get("exception")),
                                                     "failed_accepts": self.failures})
            self._logged, self.failures = now, 0
