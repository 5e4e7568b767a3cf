"""The context charge in the ledger: NVML's per-process figure replaces the hook's context
measurement while it is observed, and the hook's number comes back when it is withdrawn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from vgpu_runtime.contracts import wire
from vgpu_runtime.daemon.channel.ledger import MAX_CLAIM, MemoryLedger

C = wire.const
DEVICE, POOL, CONTEXT = C("GM_MEM_DEVICE"), C("GM_MEM_POOL"), C("GM_MEM_CONTEXT")
MiB = 1 << 20


def test_observation_replaces_the_hook_context_and_withdrawal_restores_it() -> None:
    ledger = MemoryLedger([1000 * MiB])
    ledger.reserve("a", 0, DEVICE, 300 * MiB)
    ledger.set("a", 0, CONTEXT, 200 * MiB)          # the hook's measurement
    assert ledger.used(0) == 500 * MiB
    assert ledger.observe_process("a", 0, 380 * MiB) == 80 * MiB   # 380 - 300 declared
    assert ledger.used(0) == 380 * MiB
    assert ledger.observed_charge("a", 0) == 80 * MiB
    assert ledger.held("a", 0, CONTEXT) == 200 * MiB     # kept, not counted
    assert ledger.observe_process("a", 0, None) is None
    assert ledger.used(0) == 500 * MiB
    assert ledger.observed_charge("a", 0) is None


def test_charge_never_negative_and_other_kinds_count_against_the_figure() -> None:
    ledger = MemoryLedger([1000 * MiB])
    ledger.reserve("a", 0, DEVICE, 300 * MiB)
    ledger.set("a", 0, POOL, 100 * MiB)
    # NVML lags behind the declarations: the context is charged nothing, not less than nothing.
    assert ledger.observe_process("a", 0, 350 * MiB) == 0
    assert ledger.used(0) == 400 * MiB


def test_hook_context_updates_while_observed_do_not_count() -> None:
    ledger = MemoryLedger([1000 * MiB])
    ledger.observe_process("a", 0, 90 * MiB)
    assert ledger.used(0) == 90 * MiB
    ledger.set("a", 0, CONTEXT, 500 * MiB)
    ledger.reserve("a", 0, DEVICE, 10 * MiB)           # counts: a new allocation
    assert ledger.used(0) == 100 * MiB
    ledger.set("a", 0, CONTEXT, 0)
    assert ledger.used(0) == 100 * MiB
    ledger.observe_process("a", 0, None)
    assert ledger.used(0) == 10 * MiB                # hook's context is 0 now


def test_observed_charge_is_never_refused_but_later_reservations_are() -> None:
    ledger = MemoryLedger([100 * MiB])
    assert ledger.observe_process("a", 0, 150 * MiB) == 150 * MiB
    assert ledger.used(0) == 150 * MiB
    refused = ledger.reserve("b", 0, DEVICE, 1)
    assert not refused.granted and refused.used == 150 * MiB


def test_drop_releases_the_observed_charge_and_only_it() -> None:
    ledger = MemoryLedger([1000 * MiB, 1000 * MiB])
    ledger.reserve("a", 0, DEVICE, 10 * MiB)
    ledger.set("a", 0, CONTEXT, 400 * MiB)
    ledger.observe_process("a", 0, 60 * MiB)
    ledger.observe_process("a", 1, 70 * MiB)          # nothing declared there: all context
    ledger.reserve("b", 0, DEVICE, 5 * MiB)
    assert (ledger.used(0), ledger.used(1)) == (65 * MiB, 70 * MiB)
    ledger.drop("a")
    assert (ledger.used(0), ledger.used(1)) == (5 * MiB, 0)
    assert ledger.holders() == ["b"]


def test_withdrawing_an_observation_that_was_never_made_changes_nothing() -> None:
    ledger = MemoryLedger([100 * MiB])
    assert ledger.observe_process("a", 0, None) is None
    assert ledger.holders() == [] and ledger.used(0) == 0


def test_huge_figures_are_capped_and_bad_gpu_indexes_refused() -> None:
    ledger = MemoryLedger([100 * MiB])
    assert ledger.observe_process("a", 0, 1 << 62) == MAX_CLAIM
    with pytest.raises(ValueError, match="outside the allocation"):
        ledger.observe_process("a", 1, 10)


operations = st.lists(st.tuples(
    st.sampled_from(["reserve", "set", "observe", "withdraw", "drop"]),
    st.sampled_from(["a", "b"]), st.integers(0, 1), st.sampled_from([DEVICE, POOL, CONTEXT]),
    st.integers(0, 200)), max_size=40)


@settings(max_examples=examples(150), deadline=None)
@given(operations)
def test_use_always_equals_each_holders_counted_amounts(ops: list[tuple[str, str, int, int, int]]
                                                         ) -> None:
    ledger = MemoryLedger([10**9, 10**9])
    for op, holder, gpu, kind, amount in ops:
        if op == "reserve":
            ledger.reserve(holder, gpu, kind, amount)
        elif op == "set":
            ledger.set(holder, gpu, kind, amount)
        elif op == "observe":
            ledger.observe_process(holder, gpu, amount * 3)
        elif op == "withdraw":
            ledger.observe_process(holder, gpu, None)
        else:
            ledger.drop(holder)
        for g in (0, 1):
            expected = 0
            for h in ("a", "b"):
                held = ledger.holdings(h)
                observed = ledger.observed_charge(h, g)
                expected += sum(v for (hg, k), v in held.items() if hg == g and k != CONTEXT)
                expected += held.get((g, CONTEXT), 0) if observed is None else observed
            assert ledger.used(g) == expected
