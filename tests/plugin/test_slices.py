from __future__ import annotations

import pytest

from device_plugin.slices import MAX_ID_LENGTH, SliceIdError, SliceTable, parse_slice_id, slice_id
from vgpu_runtime.gpus import GpuInfo
from vgpu_runtime.gpus.simulated import SimulatedBackend


def test_ids_name_their_gpu_and_are_stable(gpus: list[GpuInfo]) -> None:
    table = SliceTable(gpus, 10)
    again = SliceTable(SimulatedBackend(2, memory=gpus[0].memory_total).discover(), 10)
    assert [s.id for s in table.all()] == [s.id for s in again.all()]
    assert len(table) == 20
    for item in table.all():
        assert item.id.startswith(item.gpu.uuid + "::")
        assert parse_slice_id(item.id) == (item.gpu.uuid, item.number)
        assert len(item.id) <= MAX_ID_LENGTH


def test_slices_are_grouped_by_gpu_in_index_order(gpus: list[GpuInfo]) -> None:
    table = SliceTable(list(reversed(gpus)), 3)
    assert [s.gpu.index for s in table.all()] == [0, 0, 0, 1, 1, 1]
    assert [s.number for s in table.slices_of(gpus[1].uuid)] == [0, 1, 2]


def test_largest_slice_count_stays_within_63_characters(gpus: list[GpuInfo]) -> None:
    table = SliceTable(gpus, 1000)
    assert max(len(s.id) for s in table.all()) <= MAX_ID_LENGTH


def test_too_long_uuid_is_refused() -> None:
    gpu = GpuInfo(0, "GPU-" + "x" * 60, "m", 1, 0, None)
    with pytest.raises(ValueError, match="longer than 63"):
        SliceTable([gpu], 10)


@pytest.mark.parametrize("bad", ["", "GPU-1", "GPU-1::", "::3", "GPU-1::x", "GPU-1::01",
                                 "GPU-1::-1"])
def test_malformed_ids_are_rejected(bad: str) -> None:
    with pytest.raises(SliceIdError):
        parse_slice_id(bad)


def test_slice_id_round_trip() -> None:
    assert parse_slice_id(slice_id("GPU-a", 7)) == ("GPU-a", 7)


def test_in_order_sorts_by_gpu_then_number_and_refuses_unknown(gpus: list[GpuInfo]) -> None:
    table = SliceTable(gpus, 12)
    wanted = [slice_id(gpus[1].uuid, 10), slice_id(gpus[0].uuid, 2), slice_id(gpus[1].uuid, 9),
              slice_id(gpus[0].uuid, 11)]
    assert [(s.gpu.index, s.number) for s in table.in_order(wanted)] == [
        (0, 2), (0, 11), (1, 9), (1, 10)]
    with pytest.raises(KeyError):
        table.in_order([*wanted, "GPU-gone::0"])
