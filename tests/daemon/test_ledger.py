"""Unit tests of the memory ledger (no daemon)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_runtime.daemon.channel.ledger import LedgerError, MemoryLedger

DEVICE, POOL = 1, 5


def test_reserve_within_limit_is_granted_and_counted() -> None:
    ledger = MemoryLedger([100])
    result = ledger.reserve("a", 0, DEVICE, 60)
    assert (result.granted, result.used, result.limit) == (True, 60, 100)


def test_limit_is_shared_by_every_connection_of_the_allocation() -> None:
    ledger = MemoryLedger([100])
    assert ledger.reserve("a", 0, DEVICE, 60).granted
    refused = ledger.reserve("b", 0, DEVICE, 41)
    assert (refused.granted, refused.used) == (False, 60)
    assert ledger.held("b", 0, DEVICE) == 0  # a refusal is not applied
    assert ledger.reserve("b", 0, DEVICE, 40).used == 100


def test_release_more_than_held_is_an_error_and_changes_nothing() -> None:
    ledger = MemoryLedger([100])
    ledger.reserve("a", 0, DEVICE, 10)
    ledger.reserve("b", 0, DEVICE, 50)
    with pytest.raises(LedgerError, match="holds 10"):
        ledger.release("a", 0, DEVICE, 11)  # b's memory does not count for a
    with pytest.raises(LedgerError):
        ledger.release("a", 0, POOL, 1)  # nor does another kind
    assert ledger.used(0) == 60


def test_set_is_absolute_always_applied_and_reports_over_limit() -> None:
    ledger = MemoryLedger([100])
    ledger.reserve("a", 0, DEVICE, 50)
    assert ledger.set("b", 0, POOL, 30).used == 80
    assert ledger.set("b", 0, POOL, 20).used == 70  # pools shrink too
    over = ledger.set("b", 0, POOL, 70)
    assert (over.granted, over.used) == (False, 120)
    assert ledger.set("b", 0, POOL, 0).used == 50
    assert ledger.holders() == ["a"]


def test_drop_releases_everything_a_connection_held_on_every_gpu() -> None:
    ledger = MemoryLedger([100, 200])
    ledger.reserve("a", 0, DEVICE, 10)
    ledger.set("a", 1, POOL, 20)
    ledger.reserve("b", 1, DEVICE, 5)
    ledger.drop("a")
    assert (ledger.used(0), ledger.used(1)) == (0, 5)
    ledger.drop("a")  # twice is harmless
    assert ledger.used(1) == 5


def test_gpu_outside_the_allocation_is_refused() -> None:
    ledger = MemoryLedger([100])
    with pytest.raises(LedgerError, match="outside"):
        ledger.reserve("a", 1, DEVICE, 1)


def test_limits_can_change_but_not_the_gpu_count() -> None:
    ledger = MemoryLedger([100])
    ledger.reserve("a", 0, DEVICE, 80)
    ledger.set_limits([50])
    assert (ledger.used(0), ledger.limit(0)) == (80, 50)
    assert not ledger.reserve("a", 0, DEVICE, 1).granted
    with pytest.raises(LedgerError):
        ledger.set_limits([50, 50])


_ops = st.lists(st.tuples(
    st.sampled_from(["reserve", "release", "set", "drop"]),
    st.sampled_from(["a", "b", "c"]), st.integers(0, 1), st.sampled_from([DEVICE, POOL]),
    st.integers(0, 80)), max_size=60)


@given(_ops)
def test_used_always_equals_the_sum_of_holdings_and_never_passes_limit_by_reserve(
        ops: list[tuple[str, str, int, int, int]]) -> None:
    ledger = MemoryLedger([100, 150])
    model: dict[tuple[str, int, int], int] = {}
    for op, holder, gpu, kind, nbytes in ops:
        key = (holder, gpu, kind)
        before = ledger.used(gpu)
        if op == "reserve":
            if ledger.reserve(holder, gpu, kind, nbytes).granted:
                model[key] = model.get(key, 0) + nbytes
                assert ledger.used(gpu) <= max(ledger.limit(gpu), before)
        elif op == "release":
            if nbytes > model.get(key, 0):
                with pytest.raises(LedgerError):
                    ledger.release(holder, gpu, kind, nbytes)
            else:
                ledger.release(holder, gpu, kind, nbytes)
                model[key] = model.get(key, 0) - nbytes
        elif op == "set":
            ledger.set(holder, gpu, kind, nbytes)
            model[key] = nbytes
        else:
            ledger.drop(holder)
            model = {k: v for k, v in model.items() if k[0] != holder}
        for g in (0, 1):
            expected = sum(v for k, v in model.items() if k[1] == g)
            assert ledger.used(g) == expected >= 0
