"""The native scheduler decides exactly as the Python one: the same grants, the same holder, the
same deadlines and the same doubles (compared by repr, so bit for bit), after every step of
random sequences of every call, at random and tied times; bad input is refused by both alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu_runtime.timeshare.estimator import MAX_BURSTS, BurstEstimator
from vgpu_runtime.timeshare.nativepolicy import NativeTokenScheduler
from vgpu_runtime.timeshare.policy import MAX_TENANTS, TimeshareSettings, TokenScheduler
from vgpu_runtime.timeshare.window import MAX_INTERVALS, UsageWindow

NAMES = ("a", "b", "c", "d")
# Steps in time: ties, nanoseconds, a handoff, a quota, a window's worth.
STEPS = st.one_of(st.sampled_from([0.0, 0.0, 1e-9, 1e-6, 0.0005, 0.001, 0.02, 0.05, 0.2, 0.3,
                                   1.0, 3.0]),
                  st.floats(0.0, 0.5, allow_nan=False))
# How far back a report reaches: within a grant, or windows back (into forgotten history).
OFFSETS = st.one_of(st.none(), st.sampled_from([0.0, 1e-9, 0.001, 0.01, 0.2, 1.0, 5.0]),
                    st.floats(0.0, 12.0, allow_nan=False))
SHARES = st.one_of(st.sampled_from([0.05, 0.1, 0.25, 0.3, 0.5, 0.7, 1.0]),
                   st.floats(0.01, 1.0, allow_nan=False))
LIMITS = st.one_of(st.sampled_from([None, 1.0, 0.1, 0.3, 0.5]), st.floats(0.0, 1.0))
# Burst hints: none (None, -1, 0) and both max_quota settings exactly among them.
HINTS = st.one_of(st.none(), st.sampled_from([0.0, -1.0, 0.001, 0.05, 0.1, 0.2, 0.5]),
                  st.floats(0.0, 0.3))
BAD = st.sampled_from([0.0, -0.5, 1.5, float("nan")])

SETTINGS = st.builds(
    TimeshareSettings,
    window=st.sampled_from([0.5, 2.0, 10.0]),
    min_quota=st.sampled_from([0.001, 0.02]),
    max_quota=st.sampled_from([0.05, 0.2]),
    cycle=st.sampled_from([0.1, 0.3]),
    catch_up=st.sampled_from([0.0, 0.25]),
    revoke_grace=st.sampled_from([0.0, 0.05]),
    preempt_after=st.sampled_from([0.0, 0.0, 0.002, 0.01]),
    burst_merge_gap=st.sampled_from([0.0, 0.002]),
    burst_history=st.sampled_from([0.5, 3.0]),
)

ARGUMENTS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "add": st.tuples(st.sampled_from(NAMES), SHARES, LIMITS),
    "add_bad": st.tuples(st.sampled_from(NAMES), BAD, SHARES),
    "remove": st.tuples(st.sampled_from(NAMES)),
    "set_limit": st.tuples(st.sampled_from(NAMES), st.one_of(LIMITS, BAD)),
    "request": st.tuples(st.sampled_from(NAMES), HINTS, OFFSETS, st.booleans(), OFFSETS,
                         st.booleans()),
    "release": st.tuples(st.sampled_from(NAMES), OFFSETS, st.booleans()),
    "burst": st.tuples(st.sampled_from(NAMES), st.floats(0.0, 1.0), st.floats(-0.01, 0.3)),
    "tick": st.tuples(),
    "snapshot": st.tuples(),
    "to_deadline": st.tuples(),
    "to_expiry": st.tuples(st.booleans()),
}
# Requests and releases are most of what a GPU sees: drawn more often than the rest.
KINDS = [*["request"] * 8, *["release"] * 4, *["to_expiry"] * 2, *["to_deadline"] * 2,
         "tick", "burst", "snapshot", "add", "add_bad", "remove", "set_limit"]
OPS = st.sampled_from(KINDS).flatmap(
    lambda kind: ARGUMENTS[kind].map(lambda arguments: (kind, *arguments)))
# The tenants there at the start, at time 0: a, b, ... with these requests and limits.
MEMBERS = st.lists(st.tuples(SHARES, LIMITS), min_size=1, max_size=len(NAMES))


@dataclass
class Pair:
    python: TokenScheduler
    native: NativeTokenScheduler
    now: float = 0.0

    def both(self, call: str, *args: Any, **kwargs: Any) -> Any:
        """The call on each; the outcomes (a result, or an error's type) must be the same."""
        outcomes = []
        for scheduler in (self.python, self.native):
            try:
                outcomes.append(repr(getattr(scheduler, call)(*args, **kwargs)))
            except (KeyError, ValueError) as error:
                outcomes.append(type(error).__name__)
        assert outcomes[0] == outcomes[1], (call, args, kwargs)
        return outcomes[0]


def state(scheduler: TokenScheduler | NativeTokenScheduler, now: float,
          used: bool) -> str:
    """Everything the scheduler decides from, as exact text (repr tells every double apart)."""
    tenants = [(t.id, t.share, t.limit, t.vtime, t.credit, t.credit_at, t.waiting_since,
                t.burst_hint, t.last_release, t.revocations, t.last_quota, list(t.waits))
               for t in scheduler.tenants.values()]
    shown: list[Any] = [scheduler.holder, scheduler.generation, scheduler.preemptions,
                        scheduler.shares(), scheduler.needs_token(), tenants,
                        scheduler.next_deadline(now)]
    if used:
        shown.append([scheduler.used(name, now) for name in scheduler.tenants])
    return repr(shown)


def step(pair: Pair, op: tuple[Any, ...]) -> None:
    now = pair.now
    kind, *args = op
    if kind == "add":
        name, share, limit = args
        pair.both("add", name, share, share if limit is None else max(share, limit), now)
    elif kind == "add_bad":
        name, share, limit = args
        pair.both("add", name, share, limit, now)
    elif kind == "remove":
        pair.both("remove", args[0], now)
    elif kind == "set_limit":
        name, limit = args
        pair.both("set_limit", name, 1.0 if limit is None else limit, now)
    elif kind == "request":
        name, hint, end, running, since, end_ahead = args
        work_end = None if end is None else (now + end if end_ahead else now - end)
        pair.both("request", name, now, burst_hint=hint,
                  work_end=None if running else work_end, work_running=running,
                  work_since=None if since is None else now - since)
    elif kind == "release":
        name, end, end_ahead = args
        pair.both("release", name, now,
                  None if end is None else (now + end if end_ahead else now - end))
    elif kind == "burst":
        name, ago, length = args
        pair.both("observe_burst", name, now - ago, now - ago + length)
    elif kind == "tick":
        pair.both("tick", now)
    elif kind == "snapshot":
        pair.both("snapshot", now)
    elif kind == "to_deadline":
        # Asked of both: next_deadline refills credit, and so changes what follows.
        pair.both("next_deadline", now)
        deadline = pair.python.next_deadline(now)
        pair.native.next_deadline(now)
        if deadline is not None and deadline > now:
            pair.now = deadline
            pair.both("tick", pair.now)
    elif kind == "to_expiry":
        holder = pair.python.holder
        if holder is not None:
            grace = pair.python.config.revoke_grace if args[0] else 0.0
            pair.now = max(now, holder.expires_at + grace)
            pair.both("request", holder.tenant, pair.now)


@settings(max_examples=300, deadline=None)
@given(config=SETTINGS, members=MEMBERS,
       ops=st.lists(st.tuples(STEPS, OPS), min_size=20, max_size=150), used=st.booleans())
def test_the_native_scheduler_decides_as_the_python_one(
        config: TimeshareSettings, members: list[tuple[float, float | None]],
        ops: list[tuple[float, tuple[Any, ...]]], used: bool) -> None:
    pair = Pair(TokenScheduler(config, 0.0), NativeTokenScheduler(config, 0.0))
    for name, (share, limit) in zip(NAMES, members, strict=False):
        step(pair, ("add", name, share, limit))
    for delay, op in ops:
        pair.now += delay
        step(pair, op)
        assert state(pair.python, pair.now, used) == state(pair.native, pair.now, used), op
    assert state(pair.python, pair.now, True) == state(pair.native, pair.now, True)


# ---- boundaries the random sequences rarely reach: doubles exactly equal ----

BOTH = pytest.mark.parametrize("make", [TokenScheduler, NativeTokenScheduler],
                               ids=["python", "native"])


@BOTH
def test_credit_exactly_one_least_grant_is_enough(make: type[TokenScheduler]) -> None:
    # Binary-exact figures: capacity 0.5, least grant 0.0625, a 0.4375 grant leaves 0.0625.
    sched = make(TimeshareSettings(min_quota=0.25, cycle=1.0), 0.0)
    sched.add("a", 0.5, 0.5, 0.0)
    sched.add("b", 0.5, 1.0, 0.0)
    assert sched.request("a", 0.0) is not None
    sched.release("a", 0.4375)
    assert sched.tenants["a"].credit == 0.0625
    grant = sched.request("a", 0.4375)
    assert grant is not None and grant.tenant == "a"


@BOTH
def test_an_interval_ending_at_the_horizon_is_forgotten(make: type[TokenScheduler]) -> None:
    # [1, 2) charged; at 2.5 with a 0.5 s window it ends exactly at the horizon and is dropped,
    # so a later report of work since 0 is charged from 2 on: [2, 3), not [0, 1) too.
    sched = make(TimeshareSettings(window=0.5), 0.0)
    sched.add("a", 0.5, 1.0, 0.0)
    sched.request("a", 1.0)
    sched.release("a", 2.0)
    assert sched.used("a", 2.5) == 0.0
    sched.request("a", 3.0, work_running=True, work_since=0.0)
    assert sched.tenants["a"].vtime == 1.0 / 0.5 + 1.0 / 0.5


@BOTH
def test_a_charge_forgets_what_ended_a_window_before_it(make: type[TokenScheduler]) -> None:
    # [0, 0.1) ended more than a 0.5 s window before the charge ending at 1.1, so it is
    # forgotten then: a report of work since -0.5 is charged from 0.1 on, [0.1, 1.5) less
    # the [1.0, 1.1) already charged, 1.3 s; 0.4 + 1.3 / 0.5 in virtual time.
    sched = make(TimeshareSettings(window=0.5), 0.0)
    sched.add("a", 0.5, 1.0, 0.0)
    sched.request("a", 0.0)
    sched.release("a", 0.1)
    sched.request("a", 1.0)
    sched.release("a", 1.1)
    sched.request("a", 1.5, work_running=True, work_since=-0.5)
    assert sched.tenants["a"].vtime == 3.0


# ---- what a tenant keeps is bounded, alike in both ----

def test_a_hook_cannot_grow_a_tenants_burst_history_without_bound() -> None:
    # Bursts reported to end in the future, further apart than the merge gap, are never old
    # enough to leave the history: only the newest MAX_BURSTS are kept (and sorted per grant).
    bursts = BurstEstimator(merge_gap=0.002, history=3.0)
    for i in range(5 * MAX_BURSTS):
        bursts.observe(1.0 + i * 0.01, 1.0 + i * 0.01 + 0.001 * (i % 7))
    assert len(bursts._bursts) == MAX_BURSTS
    assert bursts._bursts[-1][0] == 1.0 + (5 * MAX_BURSTS - 1) * 0.01   # the newest stay


def test_a_tenants_charged_history_is_bounded() -> None:
    # Grants far apart leave one interval each; beyond MAX_INTERVALS the oldest is forgotten,
    # and a later report reaching back into it is not charged again.
    window = UsageWindow(1e9)
    for i in range(MAX_INTERVALS + 10):
        window.charge(2.0 * i, 2.0 * i + 1.0)
    assert len(window._intervals) == MAX_INTERVALS
    assert window.charge(0.0, 19.0) == 0.0   # [0, 19) was dropped: never charged twice
    assert window.usage(2.0 * (MAX_INTERVALS + 10)) == MAX_INTERVALS * 1.0


def test_both_bound_the_history_alike() -> None:
    config = TimeshareSettings(window=1e6, burst_history=1e6)
    pair = Pair(TokenScheduler(config, 0.0), NativeTokenScheduler(config, 0.0))
    step(pair, ("add", "a", 0.5, 1.0))
    step(pair, ("add", "b", 0.5, 1.0))
    for i in range(MAX_INTERVALS + 100):
        pair.now = i * 0.01
        pair.both("request", "a", pair.now)
        pair.both("release", "a", pair.now + 0.001)
        pair.both("observe_burst", "b", pair.now, pair.now + 0.0001 * (i % 13))
        if i % 500 == 0:
            assert state(pair.python, pair.now, True) == state(pair.native, pair.now, True)
    pair.both("request", "a", pair.now + 1.0, work_running=True, work_since=0.0)
    pair.both("request", "b", pair.now + 1.0)
    assert state(pair.python, pair.now + 1.0, True) == state(pair.native, pair.now + 1.0, True)
    assert pair.both("snapshot", pair.now + 1.0)


# ---- bad input: a clear error, and nothing changed ----

@BOTH
def test_bad_input_is_refused_and_changes_nothing(make: type[TokenScheduler]) -> None:
    sched = make(TimeshareSettings(), 0.0)
    sched.add("a", 0.5, 1.0, 0.0)
    sched.add("b", 0.3, 0.5, 0.0)
    sched.request("a", 0.0)
    sched.request("b", 0.01)
    now = 0.02
    before = state(sched, now, True)
    refused: list[tuple[type[Exception], str, Any]] = [
        (ValueError, "0 < share <= limit <= 1", lambda: sched.add("c", 0.0, 1.0, now)),
        (ValueError, "0 < share <= limit <= 1", lambda: sched.add("c", 1.5, 1.5, now)),
        (ValueError, "0 < share <= limit <= 1", lambda: sched.add("c", float("nan"), 1.0, now)),
        (ValueError, "0 < share <= limit <= 1", lambda: sched.add("c", 0.5, 0.4, now)),
        (ValueError, "0 < share <= limit <= 1", lambda: sched.add("c", 0.5, 1.1, now)),
        (ValueError, "already scheduled", lambda: sched.add("a", 0.5, 1.0, now)),
        (ValueError, "0 < limit <= 1", lambda: sched.set_limit("b", 0.0, now)),
        (ValueError, "0 < limit <= 1", lambda: sched.set_limit("b", 2.0, now)),
        (ValueError, "0 < limit <= 1", lambda: sched.set_limit("b", float("nan"), now)),
        (KeyError, "z", lambda: sched.set_limit("z", 0.5, now)),
        (KeyError, "z", lambda: sched.request("z", now)),
        (KeyError, "z", lambda: sched.observe_burst("z", 0.0, now)),
        (KeyError, "z", lambda: sched.used("z", now)),
    ]
    for error, says, call in refused:
        with pytest.raises(error, match=says):
            call()
        assert state(sched, now, True) == before, says
    assert sched.release("z", now) is None         # a stale release changes nothing
    assert state(sched, now, True) == before


@BOTH
def test_a_gpu_takes_at_most_max_tenants(make: type[TokenScheduler]) -> None:
    sched = make(TimeshareSettings(), 0.0)
    for i in range(MAX_TENANTS):
        sched.add(f"t{i}", 0.01, 1.0, 0.0)
    before = state(sched, 0.0, True)
    with pytest.raises(ValueError, match=f"at most {MAX_TENANTS} tenants"):
        sched.add("one-more", 0.01, 1.0, 0.0)
    assert state(sched, 0.0, True) == before
    sched.remove("t3", 0.0)
    sched.add("one-more", 0.01, 1.0, 0.0)        # a freed place is taken again
    assert list(sched.tenants)[-1] == "one-more"
