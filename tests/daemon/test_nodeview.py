"""The node's GPUs as status shows them (vgpu_runtime/daemon/nodeview.py): the rules alone."""

from __future__ import annotations

import dataclasses

from vgpu_runtime.allocation import AllocationRecord, GpuShare
from vgpu_runtime.daemon import nodeview
from vgpu_runtime.gpus import GpuInfo

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"
GiB = 1 << 30


def record(allocation_id: str, created_at: float, *gpus: tuple[str, int, float, int | None]
           ) -> AllocationRecord:
    return AllocationRecord(
        id=allocation_id, origin="kubelet", device_ids=(),
        gpus=tuple(GpuShare(uuid, index, share, GiB, slices)
                   for uuid, index, share, slices in gpus),
        channel_dir=f"/nonexistent/{allocation_id}", hook_library="x.so", created_at=created_at)


def gpu(uuid: str, index: int) -> GpuInfo:
    return GpuInfo(index, uuid, "NVIDIA H200", 140 * GiB, index, None)


def test_the_newest_record_says_the_slice_count() -> None:
    older = record("k-1", 1.0, (A, 0, 0.5, 4))
    newer = record("k-2", 2.0, (A, 0, 0.5, 10))
    unsaid = record("k-3", 3.0, (A, 0, 0.5, None))   # written before records carried it
    assert nodeview.slices_per_gpu([newer, older, unsaid], configured=8) == 10
    assert nodeview.slices_per_gpu([unsaid], configured=8) == 8
    assert nodeview.slices_per_gpu([], configured=8) == 8


def test_a_records_count_wins_over_the_advertised_one_per_gpu() -> None:
    held = record("k-1", 1.0, (A, 0, 0.5, 4))
    assert nodeview.gpu_slices([held], {A: 10, B: 10}) == {A: 4, B: 10}


def test_rows_count_the_allocated_slices_and_shares() -> None:
    found = [gpu(A, 0), gpu(B, 1)]
    records = [record("k-1", 1.0, (A, 0, 0.3, 10)), record("k-2", 2.0, (A, 0, 0.2, 10)),
               record("k-3", 3.0, (C, 5, 0.5, None))]   # a GPU not (or no longer) found
    rows = nodeview.gpu_rows(records, found, {B: (False, "XID 79")}, {B: 10}, per_gpu=10)
    assert [r["uuid"] for r in rows] == [A, B, C]
    a, b, c = rows
    assert (a["slices"], a["slices_allocated"], a["share_allocated"]) == (10, 5, 0.5)
    assert (a["model"], a["memory_total"], a["healthy"]) == ("NVIDIA H200", 140 * GiB, True)
    assert (b["slices_allocated"], b["healthy"], b["reason"]) == (0, False, "XID 79")
    assert (c["index"], c["model"], c["memory_total"], c["slices_allocated"]) == (5, "", None, 5)


def test_a_gpu_waiting_to_change_its_count_keeps_its_old_one() -> None:
    """The plugin advertises 10 until the allocation cut at 4 ends: status says 4."""
    found = [gpu(A, 0)]
    held = record("k-1", 1.0, (A, 0, 0.5, 4))
    (row,) = nodeview.gpu_rows([held], found, {}, {A: 10}, per_gpu=10)
    assert (row["slices"], row["slices_allocated"]) == (4, 2)
    (row,) = nodeview.gpu_rows([dataclasses.replace(held, gpus=())], found, {}, {A: 10}, 10)
    assert (row["slices"], row["slices_allocated"]) == (10, 0)
