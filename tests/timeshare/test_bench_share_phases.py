"""scripts/bench-share's phases case rates each tenant over the phasing tenant's on phases and
off phases separately, leaving out each phase's settling start, so a neighbour that takes the
idle GPU shows as such and one that stays capped does not pass for it."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests import scriptmodule


def bench_share() -> ModuleType:
    return scriptmodule.load("bench-share")


def steps(every: float, duration: float, keep=lambda t: True) -> list[float]:
    return [i * every for i in range(1, int(duration / every)) if keep(i * every)]


def test_a_neighbour_that_takes_the_idle_gpu_rates_higher_in_the_off_phases() -> None:
    bench = bench_share()
    period = bench.PHASE_S
    on = lambda t: int(t / period) % 2 == 0   # noqa: E731
    # Phasing tenant: half the alone rate while on, nothing while off. Continuous: half the
    # alone rate while the other is on, the whole of it while it is off.
    phasing = steps(0.02, 12.0, on)
    continuous = sorted(steps(0.02, 12.0, on) + steps(0.01, 12.0, lambda t: not on(t)))
    per_step = 2 * 8192**3 * 4 / 1e12
    alone = per_step / 0.01   # one step per 10 ms alone
    row = bench.phases_row([{"ends": phasing}, {"ends": continuous}], "8192", 12.0, alone)
    assert row["on"] == [pytest.approx(0.5, abs=0.02), pytest.approx(0.5, abs=0.02)]
    assert row["off"][0] == 0.0
    assert row["off"][1] == pytest.approx(1.0, abs=0.02)


def test_a_phase_s_settling_start_is_not_rated() -> None:
    bench = bench_share()
    # Work only in the first PHASE_SETTLE_S of each phase: none of it is rated.
    ends = [t for t in steps(0.001, 6.0)
            if (t % bench.PHASE_S) < bench.PHASE_SETTLE_S - 0.002]
    assert bench.phase_rates(ends, 1.0, 6.0) == (0.0, 0.0)
