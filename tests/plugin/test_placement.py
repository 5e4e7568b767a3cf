from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_plugin.placement import PlacementError, preferred
from device_plugin.slices import SliceTable
from tests.examples import examples
from vgpu_runtime.gpus.simulated import SimulatedBackend

N = 10
TABLE = SliceTable(SimulatedBackend(4).discover(), N)
GPU = [TABLE.slices_of(g.uuid) for g in TABLE.gpus]


def ids(gpu: int, numbers: range | list[int]) -> list[str]:
    return [GPU[gpu][n].id for n in numbers]


def test_best_fit_takes_the_fullest_gpu_that_still_fits() -> None:
    available = ids(0, range(10)) + ids(1, range(4)) + ids(2, range(6)) + ids(3, range(3))
    assert preferred(TABLE, available, [], 4) == ids(1, range(4))
    assert preferred(TABLE, available, [], 5) == ids(2, range(5))
    assert preferred(TABLE, available, [], 3) == ids(3, range(3))


def test_ties_go_to_the_lowest_index() -> None:
    available = ids(2, range(5)) + ids(1, range(5))
    assert preferred(TABLE, available, [], 2) == ids(1, range(2))
    assert preferred(TABLE, available, [], 2, "spread") == ids(1, range(2))


def test_spread_takes_the_emptiest_gpu() -> None:
    available = ids(0, range(3)) + ids(1, range(8)) + ids(2, range(6))
    assert preferred(TABLE, available, [], 2, "spread") == ids(1, range(2))


def test_must_include_decides_the_gpu() -> None:
    available = ids(0, range(10)) + ids(1, range(3))
    assert preferred(TABLE, available, ids(0, [7]), 3) == ids(0, [0, 1, 7])


def test_must_include_on_a_gpu_too_small_is_refused() -> None:
    available = ids(0, range(2)) + ids(1, range(10))
    with pytest.raises(PlacementError, match="must-include"):
        preferred(TABLE, available, ids(0, [0]), 3)


def test_must_include_on_two_gpus_is_refused_for_one_gpu_request() -> None:
    available = ids(0, range(10)) + ids(1, range(10))
    with pytest.raises(PlacementError, match="span 2 GPUs"):
        preferred(TABLE, available, ids(0, [0]) + ids(1, [0]), 4)


def test_nothing_fits_says_why() -> None:
    available = ids(0, range(4)) + ids(1, range(4))
    with pytest.raises(PlacementError, match=r"no GPU has 5 free.*most free on one GPU is 4"):
        preferred(TABLE, available, [], 5)


def test_whole_gpus_for_more_than_one_gpu() -> None:
    available = ids(0, range(9)) + ids(1, range(10)) + ids(2, range(10)) + ids(3, range(10))
    assert preferred(TABLE, available, [], 20) == ids(1, range(10)) + ids(2, range(10))
    assert preferred(TABLE, available, ids(3, [4]), 20) == ids(1, range(10)) + ids(3, range(10))


def test_more_than_a_gpu_must_be_whole_gpus() -> None:
    available = [s.id for s in TABLE.all()]
    with pytest.raises(PlacementError, match="not a multiple of 10"):
        preferred(TABLE, available, [], 15)


def test_not_enough_whole_gpus() -> None:
    available = ids(0, range(9)) + ids(1, range(10))
    with pytest.raises(PlacementError, match="needs 2 wholly free GPUs; only 1"):
        preferred(TABLE, available, [], 20)


def test_unknown_ids_and_bad_sizes_are_refused() -> None:
    with pytest.raises(PlacementError, match="GPU-x::0"):
        preferred(TABLE, ["GPU-x::0"], [], 1)
    with pytest.raises(PlacementError, match="at least 1"):
        preferred(TABLE, ids(0, range(3)), [], 0)


@settings(max_examples=examples(200), deadline=None)
@given(
    free=st.sets(st.sampled_from([s.id for s in TABLE.all()])),
    size=st.integers(1, 40),
    policy=st.sampled_from(["best-fit", "spread"]),
    data=st.data(),
)
def test_placement_never_splits_gpus_nor_invents_ids(free: set[str], size: int, policy: str,
                                                     data: st.DataObject) -> None:
    available = sorted(free)
    must = data.draw(st.lists(st.sampled_from(available), max_size=3, unique=True)
                     if available else st.just([]))
    try:
        chosen = preferred(TABLE, available, must, size, policy)
    except PlacementError:
        return
    assert len(chosen) == size == len(set(chosen))
    assert set(chosen) <= free and set(must) <= set(chosen)
    gpus = {TABLE.get(c).gpu.uuid for c in chosen}  # type: ignore[union-attr]
    if size <= N:
        assert len(gpus) == 1
    else:
        assert size % N == 0 and len(gpus) == size // N
