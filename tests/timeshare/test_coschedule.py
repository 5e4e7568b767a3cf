"""Co-scheduling: tenants that leave the GPU room hold it at once; GPU-bound or unmeasured
tenants get exclusive turns, and nobody is passed over (policy.py's docstring)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from vgpu_runtime.timeshare.policy import MEASURE_TURN, Tenant, TimeshareSettings, TokenScheduler
from vgpu_runtime.timeshare.progress import ALONE, LAG, SHARED


def scheduler_with(busy: dict[str, float], shares: dict[str, float] | None = None,
                   turn: float = 0.2, **settings: object) -> TokenScheduler:
    """Tenants whose busy fractions were measured in a turn alone each (the device's
    utilisation over a period one of them held the GPU alone), `turn` seconds each (0.2: by
    time 1.0 for up to five; MIN_HELD gives each a rate alone, as the slow-down rule needs)."""
    settings.setdefault("co_schedule", True)
    sched = TokenScheduler(TimeshareSettings(**settings), 0.0)   # type: ignore[arg-type]
    now = 0.0
    for name in busy:
        sched.add(name, (shares or {}).get(name, 0.5), 1.0, now)
    for name, fraction in busy.items():
        sched.request(name, now)
        assert set(sched.grants) == {name}
        sched.release(name, now + turn)
        assert sched.observe_utilization(now, now + turn, fraction)
        now += turn
    return sched


def test_tenants_that_leave_room_hold_the_gpu_at_once() -> None:
    sched = scheduler_with({"a": 0.6, "b": 0.6})
    first = sched.request("a", 1.0).grant
    decision = sched.request("b", 1.0)
    second = decision.grant
    assert set(decision.grants) == {"a", "b"} and decision.granted == (second,)
    assert first is not None and not first.shared
    assert second is not None and second.shared
    assert set(sched.grants) == {"a", "b"}
    assert all(g.shared for g in sched.grants.values())   # a was joined: shared from then on
    assert sched.grants["a"].expires_at == first.expires_at   # same grant, same page
    assert sched.co_grants == 1


@pytest.mark.parametrize("busy, why", [
    ({"a": 0.95, "b": 0.3}, "a GPU-bound tenant"),
    ({"a": 0.3, "b": 0.95}, "a GPU-bound waiter"),
    ({"a": 0.8, "b": 0.8}, "more than the room together"),
])
def test_tenants_without_room_take_turns(busy: dict[str, float], why: str) -> None:
    sched = scheduler_with(busy)
    assert sched.request("a", 1.0).grant is not None
    assert sched.request("b", 1.0).grant is None, why
    assert set(sched.grants) == {"a"}
    sched.release("a", 1.05)
    assert set(sched.grants) == {"b"} and not sched.grants["b"].shared


def test_an_unmeasured_or_stale_figure_means_exclusive_turns() -> None:
    sched = TokenScheduler(TimeshareSettings(co_schedule=True), 0.0)
    sched.add("a", 0.5, 1.0, 0.0)
    sched.add("b", 0.5, 1.0, 0.0)
    sched.request("a", 0.0)
    assert sched.request("b", 0.0).grant is None          # never measured
    sched.release("a", 0.1)
    sched.release("b", 0.2)
    sched = scheduler_with({"a": 0.3, "b": 0.3}, co_refresh=5.0)
    sched.request("a", 6.0)                          # measured before 1.0: stale by 6.0
    assert sched.request("b", 6.0).grant is None


def test_co_scheduling_off_keeps_one_holder() -> None:
    sched = scheduler_with({"a": 0.2, "b": 0.2}, co_schedule=False)
    sched.request("a", 1.0)
    assert sched.request("b", 1.0).grant is None and set(sched.grants) == {"a"}


def test_a_shared_grant_is_charged_its_busy_fraction_an_exclusive_one_in_full() -> None:
    sched = scheduler_with({"a": 0.25, "b": 0.5}, window=100.0)
    before = {t: sched.tenants[t].usage.usage(10.0) for t in ("a", "b")}
    sched.request("a", 1.0)                  # alone until 1.1: charged 0.1 in full
    sched.request("b", 1.1)                  # from 1.1 both are shared
    sched.release("a", 1.2)                  # a: 0.1 shared at 0.25
    sched.release("b", 1.3)                  # b: 0.2 shared at 0.5
    got = {t: sched.tenants[t].usage.usage(10.0) - before[t] for t in ("a", "b")}
    assert got["a"] == pytest.approx(0.1 + 0.25 * 0.1)
    assert got["b"] == pytest.approx(0.5 * 0.2)


def test_a_waiter_that_cannot_share_is_never_passed_over() -> None:
    """c is GPU-bound and first in line (least served): a and b, who could share, are not
    granted beside the holder meanwhile, so c is granted as soon as the holder is done."""
    sched = scheduler_with({"a": 0.3, "b": 0.3, "c": 0.95})
    sched.request("a", 1.0)
    assert sched.request("c", 1.01).grant is None
    sched.tenants["c"].vtime = sched.tenants["b"].vtime - 0.1   # c is behind everyone
    assert sched.request("b", 1.02).grant is None   # would fit beside a; c is first
    assert set(sched.grants) == {"a"}
    sched.release("a", 1.05)
    assert set(sched.grants) == {"c"} and not sched.grants["c"].shared


@pytest.mark.parametrize("busy, why", [
    ({"a": 0.95, "b": 0.2}, "a light tenant beside a GPU-bound one"),
    ({"a": 0.2, "b": 0.95}, "a GPU-bound tenant beside a light one"),
])
def test_a_light_tenant_shares_with_one_that_takes_the_whole_gpu(
        busy: dict[str, float], why: str) -> None:
    """A GPU-bound tenant counts for the whole GPU; one light enough to fit co_room beside it
    still fills its gaps (an inference loop beside a trainer need not wait for turns)."""
    sched = scheduler_with(busy)
    sched.request("a", 1.0)
    decision = sched.request("b", 1.0)
    assert decision.grant is not None and decision.grant.shared, why


def test_a_stale_holder_takes_a_measuring_turn_alone() -> None:
    """Only a turn alone measures a tenant: a stale one is neither joined nor joins, and its
    turn spans a whole utilisation period, kept through idle gaps shorter than MEASURE_IDLE."""
    sched = scheduler_with({"a": 0.6, "b": 0.2, "c": 0.3}, co_refresh=5.0)
    sched.tenants["b"].busy_at = sched.tenants["c"].busy_at = 6.0   # b, c measured again
    grant = sched.request("a", 6.0).grant            # a's figure, from before 1.0, is stale
    assert grant is not None and grant.measuring and grant.quota >= MEASURE_TURN
    assert sched.request("b", 6.0).grant is None     # light, but beside an unmeasured holder
    sched.release("a", 6.0 + MEASURE_TURN)
    assert sched.observe_utilization(6.0, 6.2, 0.6)
    assert sched.grants["b"].shared is False          # b's turn; a measured again:
    assert sched.request("a", 6.4).grant is not None  # joins it, 0.6 + 0.2 fits the room


def test_a_tenant_solved_only_from_co_held_time_is_not_co_held_again() -> None:
    """Time-sliced co-held time fixes the co-holders' sum only; a figure from it (a tenant
    never measured alone) is no figure to co-hold by: its next turn is alone and measures it."""
    sched = scheduler_with({"a": 0.3})
    sched.add("b", 0.5, 1.0, 1.0)
    sched.tenants["b"].busy, sched.tenants["b"].busy_at = 0.3, 1.0   # as if solved from sums
    sched.request("a", 1.0)
    assert sched.request("b", 1.0).grant is None


def test_a_co_holder_starts_at_most_the_debt_behind_the_tenants_waiting() -> None:
    """Charged only its busy time, a co-holder pays a lag back slowly: two co-holders, each the
    other's floor, kept a waiter ahead of them 5.3 s against a 5.0 s bound. When a co-held
    grant ends its lag behind the least advanced waiter is cut to `debt`, and no further."""
    sched = scheduler_with({"a": 0.3, "b": 0.3}, shares={"a": 0.4, "b": 0.4})
    sched.add("w", 0.1, 0.1, 0.4)                 # capped: exclusive turns only
    sched.request("a", 0.5)
    assert sched.request("b", 0.5).grant is not None and sched.grants["b"].shared
    for tenant in sched.tenants.values():
        tenant.vtime = 0.0
    sched.tenants["w"].vtime = 5.0                # ahead by its debt bound (0.55 / 0.1)
    assert sched.request("w", 0.5).grant is None
    sched.release("a", 0.6)
    most_behind = 5.0 - sched.config.debt / 0.4
    assert most_behind - 1e-9 <= sched.tenants["a"].vtime < 5.0
    assert sched.tenants["b"].vtime < most_behind   # still holding: charged when it ends


def test_a_co_held_period_with_room_measures_the_holders_again() -> None:
    """Co-holders that left the GPU room filled each other's gaps without contending: the
    period's figure is the sum of theirs, as a period held alone is one's."""
    sched = scheduler_with({"a": 0.3, "b": 0.3})
    sched.request("a", 1.0)
    sched.request("b", 1.0)
    assert sched.observe_utilization(1.0, 1.2, 0.6)
    assert sched.tenants["a"].busy_at == sched.tenants["b"].busy_at == 1.2
    figures = [sched.tenants[t].busy for t in ("a", "b")]
    assert None not in figures and sum(f or 0.0 for f in figures) == pytest.approx(0.6, abs=0.05)


def test_a_saturated_co_held_period_is_not_taken() -> None:
    """Co-holders that kept the GPU saturated contended: each ran less than it would alone,
    so the period says nothing about either."""
    sched = scheduler_with({"a": 0.4, "b": 0.4})
    sched.request("a", 1.0)
    sched.request("b", 1.0)
    sched.release("a", 1.2)
    sched.release("b", 1.2)
    assert not sched.observe_utilization(1.0, 1.2, 0.9)
    assert not sched.observe_utilization(1.1, 1.3, 0.9)   # touched at its start
    assert sched.tenants["a"].busy == pytest.approx(0.4)


def test_busy_fractions_are_solved_from_turns_that_share_periods() -> None:
    """Two tenants take turns of uneven lengths, several to a 0.2 s period: each period's
    utilisation is the sum of their parts, and least squares finds each one's figure."""
    sched = TokenScheduler(TimeshareSettings(co_schedule=True), 0.0)
    truth = {"a": 0.3, "b": 0.7}
    for name in truth:
        sched.add(name, 0.5, 1.0, 0.0)
    now, period_start, used = 0.0, 0.0, 0.0
    turns = [("a", 0.03), ("b", 0.05), ("a", 0.07), ("b", 0.02), ("a", 0.05), ("b", 0.08)] * 10
    for name, length in turns:
        sched.request(name, now)
        assert set(sched.grants) == {name}
        now += length
        sched.release(name, now)
        used += truth[name] * length
        if now - period_start >= 0.2:   # a period ends at a turn's end, as NVML's would
            sched.observe_utilization(period_start, now, used / (now - period_start))
            period_start, used = now, 0.0
    for name, fraction in truth.items():
        assert sched.tenants[name].busy == pytest.approx(fraction, abs=0.02), name


def test_a_period_in_which_nothing_ran_is_not_taken() -> None:
    """A job that holds the token while it loads launches nothing: that says nothing of what
    it needs once it runs."""
    sched = scheduler_with({"a": 0.6, "b": 0.6})
    sched.request("a", 2.0)
    sched.release("a", 2.2)
    assert not sched.observe_utilization(2.0, 2.2, 0.0)
    assert sched.tenants["a"].busy == pytest.approx(0.6)


def test_too_little_time_alone_gives_no_figure() -> None:
    sched = TokenScheduler(TimeshareSettings(co_schedule=True), 0.0)
    sched.add("a", 0.5, 1.0, 0.0)
    sched.request("a", 0.0)
    sched.release("a", 0.04)
    assert sched.observe_utilization(0.0, 0.2, 0.1)   # taken, but 0.2 of a period is not enough
    assert sched.tenants["a"].busy is None


def test_co_holders_keep_each_others_gaps_filled_until_one_turns_gpu_bound() -> None:
    """Two launch-bound tenants hold the GPU together round after round; when one's figure,
    measured again in a turn alone, says it is GPU-bound, turns are exclusive again."""
    sched = scheduler_with({"a": 0.5, "b": 0.5})
    now = 1.0
    for _ in range(20):
        for name in ("a", "b"):
            if name in sched.grants:
                sched.release(name, now)
            sched.request(name, now)
        assert set(sched.grants) == {"a", "b"}
        now += 0.05
    sched.tenants["b"].busy = 0.97
    for name in ("a", "b"):
        sched.release(name, now)
    sched.request("a", now)
    sched.request("b", now)
    assert len(sched.grants) == 1


# ---- properties over generated histories ----

# A step: (tenant index, action, seconds that pass first, a figure)
#   ask      the tenant asks for the token (as a hook whose page says no)
#   release  it gives the token back (idle, or done)
#   measure  the device's utilisation over the last 0.2 s is the figure
#   tick     the daemon's timer runs (revocations)
def counted(tenant: Tenant, now: float, config: TimeshareSettings) -> float:
    """What a tenant counts for beside others: its fresh figure up to co_busy_max, else 1."""
    f = tenant.busy
    fresh = f is not None and now - tenant.busy_at <= config.co_refresh
    return f if fresh and f is not None and f <= config.co_busy_max else 1.0


step_strategy = st.tuples(st.integers(0, 3), st.sampled_from(["ask", "release", "measure",
                                                               "tick"]),
                          st.floats(0.0, 0.3), st.floats(0.0, 1.0))


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.sampled_from([0.2, 0.3, 0.5, 0.7]), min_size=2, max_size=4),
       st.lists(step_strategy, min_size=1, max_size=80))
def test_co_grants_keep_their_rules_over_generated_histories(
        shares: list[float], steps: list[tuple[int, str, float, float]]) -> None:
    """After every event: a co-grant is only ever made beside holders that, with it, leave the
    room (each counted for its fresh figure, or the whole GPU, together at most co_room) and
    only to the waiter first in line; a co-held grant is charged its busy fraction of its time
    at most; and the GPU is never idle while a tenant waits (no caps here)."""
    config = TimeshareSettings(co_schedule=True, window=1000.0)
    sched = TokenScheduler(config, 0.0)
    names = [f"t{i}" for i in range(len(shares))]
    for name, share in zip(names, shares, strict=True):
        sched.add(name, share, 1.0, 0.0)
    now = 0.0
    for index, action, wait, figure in steps:
        name = names[index % len(names)]
        now += wait
        holders_before = dict(sched.grants)
        order = sorted((t for t in sched.tenants.values() if t.waiting_since is not None),
                       key=lambda t: (t.vtime, t.waiting_since or 0.0))
        charged_before = {t: sched.tenants[t].usage.usage(now + 1e-9) for t in names}
        if action == "ask":
            decision = sched.request(name, now)
        elif action == "release":
            decision = sched.release(name, now)
        elif action == "measure":
            sched.observe_utilization(max(0.0, now - 0.2), now, figure)
            decision = sched.tick(now)
        else:
            decision = sched.tick(now)
        for grant in decision.granted:
            if not grant.shared:
                continue
            # Beside holders that, with the newcomer, leave room: each counted for its fresh
            # figure, or for the whole GPU where GPU-bound, unmeasured or stale.
            figures = [counted(sched.tenants[t], now, config) for t in decision.grants]
            assert sum(figures) <= config.co_room + 1e-9, figures
            assert sum(f < 1.0 for f in figures) >= len(figures) - 1, figures
        if (len(decision.granted) == 1 and decision.granted[0].shared and order
                and action == "measure"):
            # A co-grant made by a new figure goes to the first in line, nobody else.
            assert decision.granted[0].tenant == order[0].id
        # A shared grant that ended was charged at most its time (its busy fraction of it).
        for tenant, grant in holders_before.items():
            if tenant not in decision.grants and grant.shared:
                added = sched.tenants[tenant].usage.usage(now + 1e-9) - charged_before[tenant]
                assert added <= (now - grant.granted_at) + 1e-6
        waiting = [t.id for t in sched.tenants.values() if t.waiting_since is not None]
        assert not waiting or decision.grants, ("idle GPU while", waiting, "wait")


def test_a_capped_tenant_takes_exclusive_turns_and_is_capped_in_holding_time() -> None:
    """A tenant limited to 0.3 is never co-held, even beside a tenant that leaves room (its
    busy time there could not be told from its neighbour's): it takes exclusive turns, charged
    in full, so over 10 s it holds the GPU no longer than its cap allows, while the other,
    uncapped, is granted whenever it is free."""
    sched = TokenScheduler(TimeshareSettings(co_schedule=True, window=100.0, co_refresh=100.0),
                           0.0)
    sched.add("a", 0.3, 0.3, 0.0)
    sched.add("b", 0.3, 1.0, 0.0)
    for name, busy in (("a", 0.6), ("b", 0.3)):   # each measured in a turn alone
        sched.request(name, 0.0)
        sched.release(name, 1.0)
        assert sched.observe_utilization(0.0, 1.0, busy)
        sched.tenants[name].usage = type(sched.tenants[name].usage)(100.0)   # forget the turn
    now, step = 1.0, 0.01
    co_held = held_a = 0
    while now < 11.0:
        for name in ("a", "b"):
            grant = sched.grants.get(name)
            if grant is None or now >= grant.expires_at:
                sched.request(name, now)   # always wants the GPU
        co_held += len(sched.grants) == 2
        held_a += "a" in sched.grants
        sched.tick(now)
        now += step
    for name in ("a", "b"):
        if name in sched.grants:
            sched.release(name, now)
    assert co_held == 0
    assert 0.3 * 10.0 * 0.8 <= held_a * step <= 0.3 * 10.0 + 0.3 * sched.config.cycle + 0.05
    charged = sched.tenants["a"].usage.usage(now)
    assert charged <= 0.3 * 10.0 + 0.3 * sched.config.cycle + 0.05, charged


def test_co_held_periods_move_the_co_holders_in_proportion_in_either_order() -> None:
    """Time-sliced, co-held time fixes only its co-holders' sum. Both busy less than their
    turns alone said (a loaded host): each figure moves in proportion, whoever was measured
    first (solved with the turns alone, the sum's error went to one of them: 0.55 / 0.09 one
    way, 0.49 / 0.15 the other), and stays there once the turns alone have left the kept
    periods."""
    figures = {"a": 0.6, "b": 0.2}
    ends = []
    for order in (("a", "b"), ("b", "a")):
        sched = scheduler_with({name: figures[name] for name in order})
        sched.request("a", 1.0)
        assert sched.request("b", 1.0).grant is not None
        now = 1.0
        for i in range(40):
            assert sched.observe_utilization(now, now + 0.2, 0.64 + (0.05 if i % 2 else -0.05))
            now += 0.2
        ends.append({name: sched.tenants[name].busy or 0.0 for name in figures})
    assert ends[0] == pytest.approx(ends[1], abs=1e-9)
    assert ends[0] == pytest.approx({"a": 0.48, "b": 0.16}, abs=0.01)


@pytest.mark.parametrize("co_overlap", [True, False], ids=["over MPS", "time-sliced"])
def test_co_held_time_busier_than_the_figures_allow_makes_them_stale(co_overlap: bool) -> None:
    """Figures taken in a warm-up (0.06 and 0.04 for two trainers busy 0.9 together on an H100,
    charged at them for a whole run) cannot explain a co-held period at 0.6: they go stale, the
    next turns are exclusive, and a turn alone measures the tenant again."""
    sched = scheduler_with({"a": 0.06, "b": 0.04}, co_overlap=co_overlap)
    sched.request("a", 1.0)
    assert sched.request("b", 1.0).grant is not None   # co-held at their low figures
    sched.observe_utilization(1.0, 1.2, 0.6)
    assert not any(sched._fresh(t, 1.2) for t in sched.tenants.values())
    sched.release("a", 1.2)
    sched.release("b", 1.2)
    sched.request("a", 1.2)
    sched.request("b", 1.2)
    assert len(sched.grants) == 1   # exclusive turns until measured again
    (holder,) = sched.grants
    end = 1.2 + max(MEASURE_TURN, 0.2)
    sched.release(holder, end)
    assert sched.observe_utilization(1.2, 1.4, 0.45)
    # Raised (the warm-up period, still kept, holds it below 0.45 for a while) and fresh.
    assert (sched.tenants[holder].busy or 0.0) >= 0.2
    assert sched._fresh(sched.tenants[holder], 1.4)


def test_a_tenant_that_leaves_takes_its_periods_along() -> None:
    """Periods it held in cannot be explained without it: the figures left are solved from the
    others' periods, and a figure of its own is never asked for (it is gone)."""
    sched = scheduler_with({"a": 0.6, "b": 0.2, "c": 0.3})
    sched.request("a", 1.0)
    assert sched.request("b", 1.0).grant is not None
    for i in range(3):
        assert sched.observe_utilization(1.0 + 0.2 * i, 1.2 + 0.2 * i, 0.8)
    sched.remove("b", 1.6)
    sched.release("a", 1.6)
    sched.request("c", 1.6)
    assert set(sched.grants) == {"c"}
    assert sched.observe_utilization(1.6, 1.8, 0.3)
    assert sched.tenants["c"].busy == pytest.approx(0.3)
    assert sched.tenants["a"].busy == pytest.approx(0.6)


def test_over_mps_co_held_periods_keep_the_figures_in_either_order() -> None:
    """Over MPS co-held kernels overlap, so the device's utilisation is below the co-holders'
    figures and says nothing of each (an additive solve gave the whole gap to the first of
    them: 0.46 / 0.14 one way, 0.54 / 0.06 the other); with `co_overlap` the figures from
    their turns alone stay, renewed while the period has room."""
    figures = {"a": 0.6, "b": 0.2}
    ends = []
    for order in (("a", "b"), ("b", "a")):
        sched = scheduler_with({name: figures[name] for name in order}, co_overlap=True)
        sched.request("a", 1.0)
        assert sched.request("b", 1.0).grant is not None
        now = 1.0
        for _ in range(40):     # the alone periods long gone, figures renewed, not taken
            assert not sched.observe_utilization(now, now + 0.2, 0.6)
            now += 0.2
        assert all(now - sched.tenants[name].busy_at <= 0.2 for name in figures)   # fresh
        ends.append({name: sched.tenants[name].busy or 0.0 for name in figures})
    for end in ends:
        assert end == pytest.approx(figures)


def test_a_co_holders_re_ask_leaves_the_other_no_time_alone() -> None:
    """A co-holder whose quota ran out asks again and is granted beside the other at the same
    instant (within the grace its grant is still held), so the other holds alone for no time:
    co-held tenants renew no rate alone, and only the slow-down rule's measuring turns do (the
    H100's trainers over MPS kept their start-up's rate alone all window, BENCHMARKS.md, "What
    the H100 series say of the rate alone"). Only a grant revoked first leaves time alone."""
    sched = scheduler_with({"a": 0.4, "b": 0.4}, co_overlap=True)
    sched.request("a", 1.0)
    sched.request("b", 1.0)
    assert set(sched.grants) == {"a", "b"}
    alone_before = {t: sched.tenants[t].progress.held[ALONE] for t in "ab"}
    now, late = 1.0, 0.0
    while now < 2.8:   # each asks again as its quota runs out, or late within the grace
        name, grant = min(sched.grants.items(), key=lambda item: item[1].expires_at)
        now = grant.expires_at + late
        sched.request(name, now)
        assert set(sched.grants) == {"a", "b"}, now
        late = 0.02 - late   # figures measured by 0.4 stay fresh till 3.4
    # One whose sync outlasted the grace is revoked: the other holds alone until it asks.
    name, grant = min(sched.grants.items(), key=lambda item: item[1].expires_at)
    other = "b" if name == "a" else "a"
    revoked_at = grant.expires_at + sched.config.revoke_grace
    sched.tick(revoked_at)
    assert set(sched.grants) == {other}
    sched.request(name, revoked_at + 0.03)
    assert set(sched.grants) == {"a", "b"}
    later = revoked_at + 0.03 + LAG + 0.01
    for tenant, alone in ((name, 0.0), (other, 0.03)):
        progress = sched.tenants[tenant].progress
        progress.rates(later)   # counts what has ended
        assert progress.held[ALONE] - alone_before[tenant] == pytest.approx(alone), tenant
        assert progress.held[SHARED] > 1.5
