"""The daemon's timers run on whole milliseconds, rounded up (tokens.timer_delay): never early
(uvloop rounds a delay to the nearest millisecond, and ran an idle release up to 0.5 ms before
its time) and never at 0 ms (a re-arm for the rest of a delay ran at once, again and again)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from vgpu_runtime.daemon.channel.tokens import Waiter, timer_delay


@pytest.mark.parametrize("delay, expected", [
    (-1.0, 0.001), (0.0, 0.001), (0.00005, 0.001), (0.0003, 0.001), (0.001, 0.001),
    (0.0011, 0.002), (0.002, 0.002), (0.0005 + 0.0015, 0.002), (0.0021, 0.003), (0.2, 0.2)])
def test_delays_round_up_to_whole_milliseconds(delay: float, expected: float) -> None:
    assert timer_delay(delay) == pytest.approx(expected)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_timer_never_runs_before_its_time_on_either_loop(loop_name: str) -> None:
    async def body() -> list[float]:
        loop = asyncio.get_running_loop()
        early = []
        for wanted in (0.0003, 0.0007, 0.0015, 0.0024):
            done = loop.create_future()
            start = time.monotonic()
            loop.call_later(timer_delay(wanted), done.set_result, None)
            await done
            early.append(wanted - (time.monotonic() - start))
        return early

    if loop_name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop) if hasattr(
            asyncio, "Runner") else None
        if runner is None:
            pytest.skip("asyncio.Runner needs Python 3.11")
        with runner:
            early = runner.run(body())
    else:
        early = asyncio.run(body())
    assert max(early) <= 0, early


def native_tokens_of_a_and_b(tmp_path: Path, idle_release: float) -> Any:
    """A NativeGpuTokens with tenants "a" and "b" at 0.5 each (made inside the running loop)."""
    from vgpu_runtime.daemon.channel.ledger import MemoryLedger
    from vgpu_runtime.daemon.channel.nativetokens import NativeGpuTokens
    from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
    from vgpu_runtime.daemon.channel.tokens import TenantSlot
    from vgpu_runtime.daemon.config import DaemonConfig

    tokens = NativeGpuTokens("GPU-test", DaemonConfig(idle_release=idle_release))
    for name in ("a", "b"):
        tokens.add(TenantSlot(name, 0, TokenPage(tmp_path / f"{name}.t", GATE_TOKEN),
                              ActivityPage(tmp_path / f"{name}.a"), MemoryLedger([1 << 30])),
                   0.5, 1.0)
    return tokens


class QuietWaiter(Waiter):
    """A connection that drops its grants (the tests read the pages and counters)."""

    def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
        pass


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_the_native_token_codes_timer_never_runs_before_its_wakeup(
        loop_name: str, tmp_path: Path) -> None:
    """The native path's one loop timer: each idle check (a holder that launched nothing while
    another tenant waits) runs at or after the time the C code asked for."""
    from vgpu_runtime.daemon.channel.tokens import now_s

    async def body() -> list[float]:
        tokens = native_tokens_of_a_and_b(tmp_path, 0.0007)
        early: list[float] = []
        run = tokens._on_wakeup_fd

        def on_wakeup_fd() -> None:   # the loop's callback; the C call in it reads the clock later
            wakeup, now = tokens.next_wakeup(), now_s()
            if wakeup is not None and wakeup <= tokens._armed_at:   # what it will run now
                early.append(wakeup - now)
            run()

        tokens._on_wakeup_fd = on_wakeup_fd  # type: ignore[method-assign]   # before the first arm
        a, b = QuietWaiter(), QuietWaiter()
        try:
            for i in range(20):   # each: one holds idle, the other waits; the idle check passes it
                tokens.request(a, "a", i, None, None)
                tokens.request(b, "b", i, None, None)
                started = now_s()
                while tokens.idle_releases <= i and now_s() - started < 1.0:
                    await asyncio.sleep(0.0002)
                tokens.release("a", None)
                tokens.release("b", None)
        finally:
            tokens.close()
        assert tokens.idle_releases >= 20
        return early

    if loop_name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            early = runner.run(body())
    else:
        early = asyncio.run(body())
    assert early and max(early) <= 0, early


def test_a_native_wakeup_that_has_not_fired_changes_nothing(tmp_path: Path) -> None:
    """The loop may call the timerfd's callback when the descriptor has nothing to read (a
    wake-up already served): the C call then runs no timer and leaves the descriptor set."""
    from vgpu_runtime.daemon.channel.tokens import now_s

    async def body() -> None:
        tokens = native_tokens_of_a_and_b(tmp_path, 0.05)
        try:
            tokens.request(QuietWaiter(), "a", 0, None, None)
            tokens.request(QuietWaiter(), "b", 0, None, None)   # waits: an idle check is set for a
            armed, wakeup = tokens._armed_at, tokens.next_wakeup()
            assert wakeup is not None and armed == wakeup > now_s()
            tokens._on_wakeup_fd()                         # early: nothing to read yet
            assert (tokens._armed_at, tokens.next_wakeup(), tokens.idle_releases) == (
                armed, wakeup, 0)
            started = now_s()
            while tokens.idle_releases == 0 and now_s() - started < 2.0:
                await asyncio.sleep(0.005)
            assert tokens.idle_releases == 1               # the descriptor still fired, once
            assert now_s() >= wakeup
        finally:
            tokens.close()

    asyncio.run(body())
