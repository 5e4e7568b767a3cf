"""The daemon's timers run on whole milliseconds, rounded up (tokens.timer_delay): never early
(uvloop rounds a delay to the nearest millisecond, and ran an idle release up to 0.5 ms before
its time) and never at 0 ms (a re-arm for the rest of a delay ran at once, again and again)."""

from __future__ import annotations

import asyncio

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
            # On the loop's own clock: uvloop's is the time its iteration began, and a CPU-
            # starved iteration makes it run behind the wall clock (a timer then fires early
            # by the wall; the daemon reads the clock when one fires and re-arms).
            done = loop.create_future()
            start = loop.time()
            loop.call_later(timer_delay(wanted), done.set_result, None)
            await done
            early.append(wanted - (loop.time() - start))
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
