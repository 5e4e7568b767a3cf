"""Both implementations of a GPU's token, for tests that drive one directly with a clock they
move: tokens.GpuTokens (Python) and nativetokens.NativeGpuTokens (C). The tests never yield to
the event loop, so no loop timer fires: `run_timers` runs what is due as the loop would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vgpu_runtime.daemon.channel.nativetokens import NativeGpuTokens
from vgpu_runtime.daemon.channel.tokens import GpuTokens
from vgpu_runtime.daemon.config import DaemonConfig

IMPLEMENTATIONS = ("python", "native")

AnyTokens = GpuTokens | NativeGpuTokens


def make_tokens(implementation: str, config: DaemonConfig, clock: Callable[[], float],
                uuid: str = "GPU-test") -> AnyTokens:
    if implementation == "native":
        return NativeGpuTokens(uuid, config, clock=clock, exact_timers=False)
    return GpuTokens(uuid, config, clock=clock)


def run_one_timer(tokens: AnyTokens, now: float) -> None:
    """The earliest timer runs at `now` (the deadline before the idle check at one time)."""
    if isinstance(tokens, NativeGpuTokens):
        tokens.on_timer(now)
    elif tokens._deadline_fires <= tokens._idle_fires:
        assert tokens._deadline_timer is not None
        tokens._deadline_timer.cancel()
        tokens._on_deadline()
    else:
        assert tokens._idle_timer is not None
        tokens._idle_timer.cancel()
        tokens._on_idle_check()


def run_timers(tokens: AnyTokens, clock: Any, until: float) -> None:
    """Time passes to `until`; each timer on the way runs at its time. `clock.now` is the
    clock the tokens read."""
    while (at := tokens.next_wakeup()) is not None and at <= until:
        clock.now = max(clock.now, at)
        run_one_timer(tokens, clock.now)
    clock.now = until


def waiting_connections(tokens: AnyTokens, allocation: str) -> int:
    if isinstance(tokens, NativeGpuTokens):
        return int(tokens.slot_info(allocation).connections_waiting)
    return len(tokens.slots[allocation].waiters)
