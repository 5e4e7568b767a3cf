"""A GPU's token (tokens.GpuTokens) for tests that drive one directly with a clock they move.
The tests never yield to the event loop, so no loop timer fires: `run_timers` runs what is due
as the loop would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vgpu_runtime.daemon.channel.tokens import GpuTokens
from vgpu_runtime.daemon.config import DaemonConfig


def make_tokens(config: DaemonConfig, clock: Callable[[], float],
                uuid: str = "GPU-test") -> GpuTokens:
    return GpuTokens(uuid, config, clock=clock)


def run_one_timer(tokens: GpuTokens) -> None:
    """The earliest timer runs (the deadline before the idle check at one time)."""
    if tokens._deadline_fires <= tokens._idle_fires:
        assert tokens._deadline_timer is not None
        tokens._deadline_timer.cancel()
        tokens._on_deadline()
    else:
        assert tokens._idle_timer is not None
        tokens._idle_timer.cancel()
        tokens._on_idle_check()


def run_timers(tokens: GpuTokens, clock: Any, until: float) -> None:
    """Time passes to `until`; each timer on the way runs at its time. `clock.now` is the
    clock the tokens read."""
    while (at := tokens.next_wakeup()) is not None and at <= until:
        clock.now = max(clock.now, at)
        run_one_timer(tokens)
    clock.now = until


def waiting_connections(tokens: GpuTokens, allocation: str) -> int:
    return len(tokens.slots[allocation].waiters)
