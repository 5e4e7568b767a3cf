"""The daemon's timers run on whole milliseconds, rounded up (tokens.timer_delay): never early
(uvloop rounds a delay to the nearest millisecond, and ran an idle release up to 0.5 ms before
its time) and never at 0 ms (a re-arm for the rest of a delay ran at once, again and again)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from vgpu_runtime.daemon.channel.tokens import timer_delay


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


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_the_native_token_codes_timer_never_runs_before_its_wakeup(
        loop_name: str, tmp_path: Path) -> None:
    """The native path's one loop timer: each idle check (a holder that launched nothing while
    another tenant waits) runs at or after the time the C code asked for."""
    from vgpu_runtime.daemon.channel.ledger import MemoryLedger
    from vgpu_runtime.daemon.channel.nativetokens import NativeGpuTokens
    from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
    from vgpu_runtime.daemon.channel.tokens import TenantSlot, Waiter, now_s
    from vgpu_runtime.daemon.config import DaemonConfig

    class Quiet(Waiter):
        def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
            pass

    async def body() -> list[float]:
        tokens = NativeGpuTokens("GPU-test", DaemonConfig(idle_release=0.0007))
        for name in ("a", "b"):
            tokens.add(TenantSlot(name, 0, TokenPage(tmp_path / f"{name}.t", GATE_TOKEN),
                                  ActivityPage(tmp_path / f"{name}.a"), MemoryLedger([1 << 30])),
                       0.5, 1.0)
        early: list[float] = []
        run = tokens.on_timer

        def on_timer(now: float) -> None:
            wakeup = tokens.next_wakeup()
            early.append(0.0 if wakeup is None else wakeup - now)
            run(now)

        tokens.on_timer = on_timer  # type: ignore[method-assign]
        a, b = Quiet(), Quiet()
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
