"""A tenant's slow-down from its bursts per second held, alone and co-held (progress.py), and
the scheduler feeding it from who holds (policy.py)."""

from __future__ import annotations

import pytest

from tests.timeshare.test_coschedule import scheduler_with
from vgpu_runtime.timeshare.policy import MEASURE_TURN
from vgpu_runtime.timeshare.progress import (
    ALONE,
    ALONE_FRESH,
    BUCKET,
    CUT,
    LAG,
    MIN_HELD,
    SEGMENTS_KEPT,
    SHARED,
    WINDOW,
    Progress,
)


def reports(progress: Progress, start: float, end: float, per_second: float) -> None:
    """The hook's reports over [start, end): one every 0.1 s, received as it ends,
    `per_second` bursts a second."""
    at = start
    while at < end - 1e-9:
        progress.observe(at, at + 0.1, round(per_second * 0.1), at + 0.1)
        at += 0.1


def test_the_slowdown_is_the_rate_co_held_over_the_rate_alone() -> None:
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    reports(progress, 0.0, 2.0, 100)                  # 100 bursts a second alone
    progress.hold(SHARED, 2.0)
    reports(progress, 2.0, 2.4, 70)                   # 70 co-held
    assert progress.slowdown(2.4) is None             # nothing co-held counted yet
    reports(progress, 2.4, 4.0, 70)
    progress.hold(None, 4.0)
    assert progress.slowdown(4.0 + 2 * LAG) == pytest.approx(0.7)
    assert progress.held == pytest.approx([2.0, 2.0])


def test_a_segment_is_counted_once_its_reports_are_in() -> None:
    # Read before its last reports arrive, a segment would be counted short of bursts.
    progress = Progress(0.0)
    progress.hold(SHARED, 1.0)
    reports(progress, 1.0, 1.3, 50)                   # the report of 1.3-1.4 is still due
    progress.hold(None, 1.4)
    progress.slowdown(1.4 + LAG / 2)
    assert progress.held[SHARED] == 0.0               # not counted yet
    progress.observe(1.3, 1.4, 5, 1.4 + LAG / 2)
    progress.slowdown(1.4 + LAG)
    assert progress.held[SHARED] == pytest.approx(0.4)
    assert progress.bursts[SHARED] == pytest.approx(20)


def test_a_report_over_a_handoff_is_split_by_time_held_and_time_not_held_is_not_counted(
        ) -> None:
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    progress.hold(SHARED, 0.4)
    progress.hold(None, 0.8)
    progress.observe(0.2, 0.6, 10, 0.8)               # over the handoff: 5 and 5 (the first
                                                      # part after its segment was counted)
    progress.observe(0.7, 0.9, 4, 0.9)                # half held, half not: ran held, all 4
    progress.observe(1.0, 1.1, 7, 1.1)                # not held at all: dropped
    progress.observe(0.5, 0.5, 1, 1.0)                # an instant: where it lies
    progress.slowdown(1.2)
    assert progress.bursts == pytest.approx([5.0, 5.0 + 4.0 + 1.0])
    assert progress.held == pytest.approx([0.4, 0.4])


def test_a_turn_alone_after_a_wait_reads_the_pace_alone() -> None:
    # Co-held, then the other's turn alone (waiting for the token mid-burst), then a turn
    # alone: 100 bursts a second while held. Split by the report's whole span, the wait took
    # a share: the turn alone read 90 a second.
    progress = Progress(0.0)
    progress.hold(SHARED, 0.0)
    reports(progress, 0.0, 0.9, 100)
    progress.hold(None, 1.0)
    progress.hold(ALONE, 1.3)
    progress.observe(0.9, 1.4, 20, 1.4)               # 0.9-1.0 co-held, 1.3-1.4 alone
    reports(progress, 1.4, 1.9, 100)
    progress.hold(SHARED, 1.9)
    progress.observe(1.9, 2.0, 10, 2.0)
    assert progress.rates(2.0 + LAG) == pytest.approx((100.0, 100.0))


def test_a_report_reaching_before_the_segments_kept_splits_over_the_time_forgotten() -> None:
    # Its early part may have been held in a segment no longer kept: its share of the bursts
    # is dropped rather than piled onto the segments kept.
    progress = Progress(0.0)
    for i in range(SEGMENTS_KEPT + 1):                # alternately held alone and not, 0.1 s each
        progress.hold(ALONE, 0.2 * i)
        progress.hold(None, 0.2 * i + 0.1)
    progress.rates(0.2 * SEGMENTS_KEPT + 1.0)         # all counted, the first forgotten
    before = list(progress.bursts)
    progress.observe(0.0, 0.3, 10, 0.2 * SEGMENTS_KEPT + 1.0)   # 0.0-0.1 forgotten, 0.2-0.3 kept
    assert progress.bursts[ALONE] - before[ALONE] == pytest.approx(5.0)


def test_a_long_stretch_one_way_is_counted_as_it_goes() -> None:
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    reports(progress, 0.0, 1.0, 100)
    progress.hold(SHARED, 1.0)
    reports(progress, 1.0, 4.0, 80)                   # still co-held: cut every CUT seconds
    assert progress.slowdown(4.0) == pytest.approx(0.8)


def test_the_rates_are_those_of_the_window_so_a_start_up_alone_is_forgotten() -> None:
    # A trainer's start-up alone at 20 steps a second, then co-held at 30 for a long time, with
    # a turn alone at its pace alone (40) every 10 s: once the start-up has left the window,
    # the slow-down is 30 / 40, not 30 over a rate alone that the start-up held down.
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    reports(progress, 0.0, 3.0, 20)
    at, alone_rates = 3.0, []
    while at < 3.0 + 3 * WINDOW:
        progress.hold(SHARED, at)
        reports(progress, at, at + 9.6, 30)
        progress.hold(ALONE, at + 9.6)
        reports(progress, at + 9.6, at + 10.0, 40)
        at += 10.0
        alone_rates.append(progress.rates(at)[ALONE])
    progress.hold(SHARED, at)
    assert alone_rates[0] is not None and alone_rates[0] < 25     # the start-up still counts
    assert alone_rates[-1] == pytest.approx(40)
    assert progress.slowdown(at + LAG) == pytest.approx(30 / 40)
    # The window's turns: two, or three where one ended in the bucket at its edge.
    assert 0.8 - 1e-9 <= progress.held[ALONE] <= 1.2 + 1e-9


def test_a_way_with_nothing_in_the_window_has_no_rate_and_it_says_when_it_last_held_alone(
        ) -> None:
    progress = Progress(0.0)
    assert progress.alone_at(0.0) == float("-inf")
    progress.hold(ALONE, 1.0)
    assert progress.alone_at(1.2) == float("-inf")             # no segment alone ended yet
    assert progress.alone_at(1.5) == 1.5                       # cut at CUT: one has
    reports(progress, 1.0, 2.0, 100)
    progress.hold(SHARED, 2.0)
    reports(progress, 2.0, 3.0, 50)
    progress.hold(None, 3.0)
    assert progress.alone_at(3.5) == 2.0
    assert progress.slowdown(3.0 + LAG) == pytest.approx(0.5)
    # Segments leave the window by bucket, at its end plus the window, which wakes the
    # scheduler: cut every CUT, they ended at 1.5 and 2.0 alone, 2.5 and 3.0 co-held.
    first, second, third = (k * BUCKET + WINDOW for k in (2, 3, 4))
    assert progress.next_change(3.0 + LAG) == pytest.approx(first)
    assert progress.rates(first) == pytest.approx((100.0, 50.0))   # 0.5 s each way left
    assert progress.next_change(first) == pytest.approx(second)
    assert progress.rates(second)[ALONE] is None
    assert progress.slowdown(second) is None
    assert progress.next_change(second) == pytest.approx(third)
    assert progress.rates(third) == (None, None)
    assert progress.next_change(third) == float("inf")
    assert progress.alone_at(third) == 2.0


def test_no_slowdown_without_a_burst_alone_and_never_above_one() -> None:
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    progress.hold(SHARED, 2.0)
    reports(progress, 2.0, 4.0, 50)
    progress.hold(None, 4.0)
    assert progress.slowdown(5.0) is None             # nothing counted alone (an older hook)
    fresh = Progress(0.0)
    fresh.hold(ALONE, 0.0)
    reports(fresh, 0.0, 1.0, 10)
    fresh.hold(SHARED, 1.0)
    reports(fresh, 1.0, 2.0, 50)
    fresh.hold(None, 2.0)
    assert fresh.slowdown(3.0) == 1.0                 # faster beside others: no slow-down


def test_the_scheduler_counts_a_tenants_bursts_by_who_holds() -> None:
    # a holds alone 1.0-2.5, then b joins it until 4.0: a's reports say 100 a second alone and
    # 60 co-held. b's grant ending leaves a alone again (its grant stays `shared`). Its turn
    # alone in scheduler_with (0.2 s, no report) counts too: 200 bursts in 2.2 s alone.
    sched = scheduler_with({"a": 0.3, "b": 0.3}, max_quota=5.0, cycle=10.0)
    assert sched.request("a", 1.0).grant is not None
    for at in (1.0, 1.5, 2.0):
        sched.observe_burst("a", at, at + 0.5, 50)
    assert sched.request("b", 2.5).grant is not None and sched.grants["a"].shared
    for at in (2.5, 3.0, 3.5):
        sched.observe_burst("a", at, at + 0.5, 30)
    sched.release("b", 4.0)
    sched.observe_burst("a", 4.0, 4.5, 50)
    sched.release("a", 4.5)
    view = {v.id: v for v in sched.snapshot(4.5 + LAG)}
    assert view["a"].slowdown == pytest.approx(60 / (200 / 2.2))
    assert view["b"].slowdown is None                 # never held alone since it was added
    # An older hook's reports count nothing.
    sched.observe_burst("b", 3.0, 3.5)
    assert sched.tenants["b"].progress.bursts == [0.0, 0.0]


def test_a_report_claims_at_most_a_burst_a_microsecond() -> None:
    # The count comes from the container's hook: a hostile one's is cut to what could run.
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    progress.observe(0.1, 0.2, 2**32 - 1, 0.2)
    progress.observe(0.3, 0.3, 1000, 0.3)
    progress.hold(None, 1.0)
    progress.slowdown(2.0)
    assert progress.bursts[ALONE] == pytest.approx(100_001 + 1)


def slowed(factor: float) -> Progress:
    """A progress measured at 100 bursts a second alone and `factor` times that co-held."""
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    reports(progress, 0.0, 1.0, 100)
    progress.hold(SHARED, 1.0)
    reports(progress, 1.0, 2.0, 100 * factor)
    progress.hold(None, 2.0)
    progress.slowdown(2.0 + LAG)
    return progress


@pytest.mark.parametrize(("co_starved", "b_slowed", "b_behind", "joins"), [
    (0.0, 0.3, 0.1, True),      # the rule off: figures that fit join
    (1.0, 0.6, 0.1, True),      # b beside a at 0.6 of its pace, over its half of the turns
    (1.0, 0.3, 0.01, True),     # starved (0.3 < 0.5), but not behind by more than JOIN_LAG
    (1.0, 0.3, 0.1, False),     # starved and behind: it catches up alone
    (0.5, 0.3, 0.1, True),      # starved below 0.5 x its half: 0.25
])
def test_a_starved_party_behind_another_blocks_a_join_where_they_over_fill_the_gpu(
        co_starved: float, b_slowed: float, b_behind: float, joins: bool) -> None:
    # Figures 0.7 + 0.5: over the GPU, under co_room. b holds; a asks to join it.
    sched = scheduler_with({"a": 0.7, "b": 0.5}, turn=MIN_HELD, co_starved=co_starved)
    assert sched.request("b", 3.0).grant is not None
    b = sched.tenants["b"]
    b.progress = slowed(b_slowed)
    b.vtime = sched.tenants["a"].vtime - b_behind / sched.shares()["b"]   # GPU seconds behind
    assert (sched.request("a", 3.0).grant is not None) == joins


def test_starved_parties_do_not_block_joins_that_fit_the_gpu() -> None:
    sched = scheduler_with({"a": 0.5, "b": 0.4}, turn=MIN_HELD, co_starved=1.0)   # room: 0.9
    assert sched.request("b", 3.0).grant is not None
    b = sched.tenants["b"]
    b.progress = slowed(0.3)
    b.vtime = sched.tenants["a"].vtime - 1.0
    assert sched.request("a", 3.0).grant is not None


def test_figures_read_at_any_time_are_the_same() -> None:
    # Segments are cut at fixed points, so reading the figures (status, a join's check) never
    # changes what they will be.
    read, unread = Progress(0.0), Progress(0.0)
    for progress in (read, unread):
        progress.hold(ALONE, 0.0)
        progress.hold(SHARED, 1.37)
    for i in range(40):
        at = 1.37 + 0.1 * i
        for progress in (read, unread):
            progress.observe(at, at + 0.1, 6, at + 0.1)
        read.slowdown(at + 0.05)
    assert read.slowdown(9.0) == unread.slowdown(9.0)
    assert read.held == unread.held and read.bursts == unread.bursts


def test_the_next_change_is_a_segment_counted_or_cut() -> None:
    progress = Progress(0.0)
    assert progress.next_change(0.0) == float("inf")
    progress.hold(ALONE, 1.0)
    assert progress.next_change(1.0) == pytest.approx(1.0 + CUT)
    # Cut at 1.5: that segment is counted LAG later, before the next cut.
    assert progress.next_change(1.0 + CUT) == pytest.approx(1.0 + CUT + LAG)
    progress.hold(None, 1.7)
    assert progress.next_change(1.7) == pytest.approx(1.0 + CUT + LAG)
    assert progress.next_change(1.0 + CUT + LAG) == pytest.approx(1.7 + LAG)
    # Then each leaves the window: the first (ended at 1.5, bucket 1-2 s) at 2 + WINDOW.
    assert progress.next_change(1.7 + LAG) == pytest.approx(2 * BUCKET + WINDOW)
    assert progress.next_change(2 * BUCKET + WINDOW) == float("inf")


@pytest.mark.parametrize("start", [0.1 + 0.2, 1.37, 1e6 + 0.3, 12.521000000000001])
def test_a_wake_at_the_next_change_finds_it_made(start: float) -> None:
    # The scheduler wakes at next_change: were the change not made then (float rounding),
    # the wake would come again at the same instant for ever.
    progress = Progress(0.0)
    progress.hold(SHARED, start)
    progress.hold(None, start + 0.7)
    at, wakes = start + 0.7, []
    while (later := progress.next_change(at)) < float("inf") and len(wakes) < 5:
        assert later > at
        wakes.append(at := later)
    # The two segments (cut at CUT, then released) counted, then each bucket of them left
    # the window: one bucket, or two where the cut and the release fall in different ones.
    buckets = len({int((start + CUT) // BUCKET), int((start + 0.7) // BUCKET)})
    assert len(wakes) == 2 + buckets


def test_with_the_rule_on_a_tenant_whose_rate_alone_is_old_gets_a_measuring_turn() -> None:
    # Figures stay fresh (co_refresh long): only the rate alone ages. Co-held from 1.0, both
    # last held alone in scheduler_with's turns (by 1.0); past ALONE_FRESH each must hold alone
    # again (a measuring turn, not cut short at its short idle gaps) before it is co-held.
    sched = scheduler_with({"a": 0.5, "b": 0.4}, turn=MIN_HELD, co_starved=1.0,
                           co_refresh=1e3, max_quota=0.1)
    assert sched.request("a", 1.0).grant is not None
    joined = sched.request("b", 1.0).grant
    assert joined is not None and joined.shared
    sched.release("a", 1.05)
    sched.release("b", 1.05)
    late = 2 * MIN_HELD + ALONE_FRESH + 0.1
    turn = sched.request("a", late).grant
    assert turn is not None and turn.measuring and turn.quota >= MEASURE_TURN
    assert sched.request("b", late).grant is None             # its rate alone is old too
    handed = sched.release("a", late + MEASURE_TURN).grant   # b waited: its turn now
    assert handed is not None and handed.tenant == "b" and handed.measuring
    sched.release("b", late + 2 * MEASURE_TURN)
    again = late + 2 * MEASURE_TURN
    assert sched.request("a", again).grant is not None
    joined = sched.request("b", again).grant
    assert joined is not None and joined.shared and not joined.measuring


def test_with_the_rule_off_an_old_rate_alone_changes_nothing() -> None:
    sched = scheduler_with({"a": 0.5, "b": 0.4}, co_refresh=1e3, max_quota=0.1)
    late = 0.4 + ALONE_FRESH + 0.1
    turn = sched.request("a", late).grant
    assert turn is not None and not turn.measuring
    joined = sched.request("b", late).grant
    assert joined is not None and joined.shared


def test_nobody_joins_a_turn_that_renews_a_rate_alone() -> None:
    # b renews its rate alone first; then a's turn renews its own, and b, fresh, must not join
    # it: joined at once, a's turn would never be alone (on the model a 0.2 tenant took such
    # turns four times running, each joined, and a third tenant waited past its bound).
    sched = scheduler_with({"a": 0.5, "b": 0.4}, turn=MIN_HELD, co_starved=1.0,
                           co_refresh=1e3, max_quota=0.1)
    late = 2 * MIN_HELD + ALONE_FRESH + 0.1
    turn = sched.request("b", late).grant
    assert turn is not None and turn.measuring
    sched.release("b", late + MEASURE_TURN)
    at = late + MEASURE_TURN
    turn = sched.request("a", at).grant
    assert turn is not None and turn.measuring
    assert sched.request("b", at).grant is None
    assert set(sched.grants) == {"a"}
    handed = sched.release("a", at + MEASURE_TURN).grant
    assert handed is not None and handed.tenant == "b" and not handed.measuring


def test_slivers_alone_renew_when_it_last_held_alone_but_not_its_rate_alone() -> None:
    # A co-holder is alone for an instant whenever the other is between grants: that renews
    # alone_at, never a rate alone (MIN_HELD). The rule asked only for the first, and on the
    # H100 a trainer beside an inference loop went 46 s without a turn alone or a rate alone.
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    progress.hold(None, MIN_HELD / 2)                     # a short turn alone
    at = 1.0
    while at < 9.0:                                       # co-held, a sliver alone each second
        progress.hold(SHARED, at)
        progress.hold(ALONE, at + 0.999)
        at += 1.0
    progress.hold(SHARED, at)
    assert at - progress.alone_at(at) < 0.002             # it held alone just now
    assert progress.needs_turn_alone(at)                  # but too little for a rate alone
    assert progress.rates(at + LAG)[ALONE] is None
    progress.hold(ALONE, at + 1.0)                         # the measuring turn it is given
    progress.hold(SHARED, at + 1.0 + MEASURE_TURN)
    assert not progress.needs_turn_alone(at + 1.0 + MEASURE_TURN)   # counted or not yet
    assert progress.rates(at + 1.0 + MEASURE_TURN + LAG)[ALONE] is not None


def test_a_rate_alone_older_than_alone_fresh_is_due_whatever_the_window_holds() -> None:
    progress = Progress(0.0)
    progress.hold(ALONE, 0.0)
    progress.hold(SHARED, 2.0)                            # 2 s alone: a rate for the window
    assert not progress.needs_turn_alone(2.0 + ALONE_FRESH)
    assert progress.needs_turn_alone(2.0 + ALONE_FRESH + 0.01)
    assert progress.rates(2.0 + ALONE_FRESH + 0.01)[ALONE] is not None
