"""Co-scheduling over MPS, on the model with overlapping kernels (sim.py's `overlap`: each
tenant's work runs on its own stream beside the others', and the device's utilisation is the
union of their busy time, as NVML reads an MPS server's). Co-held launch-bound tenants run at
their alone rates; with `co_overlap` each is charged its own busy time. Without it the figures
are solved as if busy time added up, and the first co-holder takes the whole overlap: the H100
showed the same (two identical trainers charged 0.13 / 0.74 and 0.05 / 0.88; BENCHMARKS.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.timeshare.sim import Simulation
from tests.timeshare.test_co_invariants import (
    EXAMPLES,
    IDLE_RELEASE,
    KINDS,
    LAUNCH_BOUND_HOLDING,
    TOLERANCE,
    Member,
    lags,
    members,
)
from vgpu_runtime.timeshare.policy import MEASURE_IDLE, MEASURE_TURN, TimeshareSettings
from vgpu_runtime.timeshare.progress import ALONE

OPENS, ENDS = 5.0, 15.0
MIXES = {
    "two 0.33 trainers 0.3 / 0.7": [("launch-0.33", 0.3), ("launch-0.33", 0.7)],
    "two 0.53 trainers 0.3 / 0.7": [("launch-0.53", 0.3), ("launch-0.53", 0.7)],
    "three 0.33 trainers 0.2 / 0.3 / 0.5": [("launch-0.33", 0.2), ("launch-0.33", 0.3),
                                            ("launch-0.33", 0.5)],
}


def run(members: list[tuple[str, float]], co_overlap: bool,
        sample_lag: float = 0.05) -> Simulation:
    """The tenants (kind, request) on the overlapping engine, from 0.01 s apart to ENDS."""
    sim = Simulation(TimeshareSettings(co_schedule=True, co_overlap=co_overlap), handoff=0.0,
                     idle_release=IDLE_RELEASE, sample_lag=sample_lag, overlap=True)
    for i, (kind, request) in enumerate(members):
        sim.add(f"t{i}", request, 1.0, KINDS[kind], start=0.01 * i)
    sim.run(ENDS)
    return sim


def charge_errors(sim: Simulation) -> dict[str, float]:
    """Per tenant: what the scheduler charged over the window less the busy time it ran."""
    window = ENDS - OPENS
    return {name: t.usage.usage(ENDS) / window - sim.busy(name, OPENS, ENDS)
            for name, t in sim.scheduler.tenants.items()}


@pytest.mark.parametrize("members", list(MIXES.values()), ids=list(MIXES))
def test_over_mps_co_held_tenants_are_charged_their_own_busy_time(
        members: list[tuple[str, float]]) -> None:
    sim = run(members, co_overlap=True)
    assert sim.scheduler.co_grants > 100
    assert all(sim.share(name, OPENS, ENDS) >= 0.98 for name in sim.tenants)   # side by side
    errors = charge_errors(sim)
    assert all(abs(e) <= 0.02 for e in errors.values()), errors


@pytest.mark.parametrize("members", list(MIXES.values()), ids=list(MIXES))
def test_the_model_shows_the_undercharge_of_an_additive_solve_over_mps(
        members: list[tuple[str, float]]) -> None:
    """The model is faithful to what the H100 showed: without `co_overlap` the co-holders are
    charged less than they ran (their overlap read as idle time: each scaled down in
    proportion, as a coordinate-wise solve once gave it all to one of them)."""
    errors = charge_errors(run(members, co_overlap=False))
    assert sum(errors.values()) < -0.15 and max(errors.values()) < -0.05, errors


@pytest.mark.parametrize(("co_overlap", "kind"), [
    pytest.param(True, "launch-0.53", id="over MPS"),
    # Time-sliced, co-held time fixes only its co-holders' sum: each is co-held only once a
    # turn alone measured it (co-held first, a split of 0.40 / 0.26 for 0.33 each stayed).
    pytest.param(False, "launch-0.33", id="time-sliced"),
])
def test_trainers_measured_in_their_start_up_are_charged_their_busy_time_after_it(
        co_overlap: bool, kind: str) -> None:
    """Two trainers whose first 3 s are mostly on the host (busy 0.06: what their first turns
    see) were charged at those figures for the whole run on the H100 (0.06 / 0.08 for 0.88 /
    0.91 of alone), every co-held period renewing them; busier co-held time makes them stale,
    forgets the periods they came from, and a turn alone measures them again. (Time-sliced, a
    pair that fits: two 0.53 ones contend, and are charged their alone figures.)"""
    trainer = replace(KINDS[kind], slow_until=3.0, slow_gap=0.03)
    sim = Simulation(TimeshareSettings(co_schedule=True, co_overlap=co_overlap), handoff=0.0,
                     idle_release=IDLE_RELEASE, sample_lag=0.05, overlap=co_overlap)
    for i, request in enumerate((0.3, 0.7)):
        sim.add(f"t{i}", request, 1.0, trainer, start=0.01 * i)
    sim.run(ENDS)
    assert sim.scheduler.co_grants > 100
    errors = charge_errors(sim)
    assert all(abs(e) <= 0.05 for e in errors.values()), errors


def fit_the_room(mix: list[Member]) -> bool:
    """Their busy fractions alone add up to `co_room` at most: all of them hold at once."""
    return sum(KINDS[m.kind].alone_rate() for m in mix) <= TimeshareSettings().co_room


def run_generated(mix: list[Member], sample_lag: float) -> Simulation:
    return run([(m.kind, m.request / 10) for m in mix], co_overlap=True, sample_lag=sample_lag)


@EXAMPLES
@given(members(LAUNCH_BOUND_HOLDING, st.just(False)), lags)
def test_over_mps_no_tenant_is_charged_less_than_it_ran_over_generated_mixes(
        mix: list[Member], sample_lag: float) -> None:
    """Co-held grants are charged the tenant's own busy time, exclusive ones in full (at least
    what it ran): nobody runs on the GPU for free, whatever its neighbours."""
    errors = charge_errors(run_generated(mix, sample_lag))
    assert min(errors.values()) >= -TOLERANCE, errors


M = Member


@pytest.mark.parametrize("sample_lag", [0.0, 0.125, 0.159])
@pytest.mark.parametrize("mix", [
    [M(4, False, "launch-0.2"), M(6, False, "launch-0.2"), M(7, False, "launch-0.2")],
    [M(6, False, "launch-0.2"), M(7, False, "launch-0.53"), M(5, False, "launch-0.33")],
    [M(5, False, "launch-0.33"), M(3, False, "launch-0.67")],
], ids=["three-0.2", "0.2-0.53-0.33", "0.33-0.67"])
def test_over_mps_tenants_that_fit_together_are_charged_what_they_ran(
        mix: list[Member], sample_lag: float) -> None:
    """All of them fit `co_room`: each is measured in a turn alone (one that spans a whole
    utilisation period), then co-held and charged its own busy time. The measuring turns are
    exclusive, charged in full: at most one per `co_refresh` (a figure is renewed while
    co-held below saturation), so a tenant of busy fraction d pays at most (1 - d) of one
    MEASURE_TURN per co_refresh more than it ran."""
    assert fit_the_room(mix)
    sim = run_generated(mix, sample_lag)
    assert sim.scheduler.co_grants > 100
    errors = charge_errors(sim)
    config = sim.scheduler.config
    for i, m in enumerate(mix):
        most = (1 - KINDS[m.kind].alone_rate()) * MEASURE_TURN / config.co_refresh
        assert -TOLERANCE <= errors[f"t{i}"] <= most + TOLERANCE, errors


def test_over_mps_an_inference_loop_is_measured_in_a_turn_kept_from_the_idle_release() -> None:
    """The loop thinks 4 ms between bursts, past the idle release (2 ms): a turn cut at every
    gap never spans a whole utilisation period, so it was never measured and never co-held
    (0.03 of its alone rate beside the trainer). Its measuring turn now lasts its quota."""
    sim = run([("infer-0.29", 0.3), ("launch-0.53", 0.7)], co_overlap=True)
    assert sim.scheduler.tenants["t0"].busy is not None
    assert sim.scheduler.co_grants > 100
    assert all(sim.share(name, OPENS, ENDS) >= 0.98 for name in sim.tenants)
    errors = charge_errors(sim)
    assert all(abs(e) <= 0.02 for e in errors.values()), errors


def test_over_mps_with_the_rule_on_a_co_holder_that_never_breaks_keeps_a_rate_alone() -> None:
    """The trainer beside an inference loop co-held without a break; its slivers alone (the
    loop between grants) renewed when it last held alone, so its measuring turn never came and
    it had no rate alone: the slow-down rule could not see it (the H100 showed the same,
    2026-12-07). Sampled every 0.5 s after the first window, each has a rate alone nearly
    always (none only between a turn leaving the window and the next being counted)."""
    config = TimeshareSettings(co_schedule=True, co_overlap=True, co_starved=1.0)
    sim = Simulation(config, handoff=0.0, idle_release=IDLE_RELEASE, sample_lag=0.05,
                     overlap=True)
    sim.add("t0", 0.3, 1.0, KINDS["infer-0.29"])
    sim.add("t1", 0.7, 1.0, KINDS["launch-0.53"], start=0.01)
    known = {name: 0 for name in sim.tenants}
    samples = 0
    at = 3.0
    while at <= 40.0:
        sim.run(at)
        samples += 1
        for name, tenant in sim.scheduler.tenants.items():
            known[name] += tenant.progress.rates(at)[0] is not None
        at += 0.5
    assert all(count >= 0.8 * samples for count in known.values()), (known, samples)
    assert sim.scheduler.co_grants > 400                  # still co-held, bar the turns alone


def test_over_mps_a_start_up_launch_is_not_held_a_measuring_turn_long() -> None:
    """A job that launches once at start-up and then works on its host for a second (loading,
    building a model) is unmeasured, so its launch gets a measuring turn. Kept to its quota
    through that idle second, the turn held the GPU 0.45 s for one burst while the other
    waited, and its rate alone read 2 bursts a second for the window it stayed in (the fake
    engine, 2026-12-08). Idle for MEASURE_IDLE, it is released as any idle holder."""
    starting = replace(KINDS["launch-0.53"], warmup=0.002, idle_until=1.5)
    sim = Simulation(TimeshareSettings(co_schedule=True, co_overlap=True), handoff=0.0,
                     idle_release=IDLE_RELEASE, sample_lag=0.05, overlap=True)
    sim.add("loop", 0.5, 1.0, KINDS["launch-0.53"])
    sim.add("starting", 0.5, 1.0, starting, start=0.6)   # after the loop's own measuring turn
    sim.run(1.4)
    (first, *_) = [g for g in sim.grants if g.tenant == "starting"]
    assert first.measuring
    released = sim.tenants["starting"].released_at
    assert released is not None
    assert first.granted_at + MEASURE_IDLE <= released < first.granted_at + MEASURE_TURN
    progress = sim.scheduler.tenants["starting"].progress
    progress.rates(1.4)   # counts what has ended
    assert progress.held[ALONE] < MEASURE_IDLE + 0.01, progress.held
    # The loop, waiting meanwhile, had the GPU back within MEASURE_IDLE of the launch's end.
    assert sim.tenants["loop"].work_between(first.granted_at, 1.4) > 0.5 * (1.4 - released)
