"""The node's GPUs as status shows them: their slice counts and what the allocations hold.

Pure functions of the records served, the GPUs found, the plugin's files and the daemon's own
setting, so each rule is read and tested here alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vgpu_runtime.allocation import AllocationRecord
from vgpu_runtime.gpus import GpuInfo


def slices_per_gpu(records: Iterable[AllocationRecord], configured: int) -> int:
    """What the plugin cuts a GPU into, as its newest record says (the daemon's own setting
    only where no record says it: records written before they carried it, or none)."""
    said = [(r.created_at, g.slices_per_gpu) for r in records for g in r.gpus
            if g.slices_per_gpu is not None]
    return max(said)[1] if said else configured


def gpu_slices(records: Iterable[AllocationRecord], advertised: dict[str, int]
               ) -> dict[str, int]:
    """Each GPU's slice count: its newest record's, else what the plugin advertises."""
    counts = dict(advertised)
    newest: dict[str, float] = {}
    for record in records:
        for gpu in record.gpus:
            if gpu.slices_per_gpu is not None and (
                    record.created_at >= newest.get(gpu.uuid, float("-inf"))):
                newest[gpu.uuid] = record.created_at
                counts[gpu.uuid] = gpu.slices_per_gpu
    return counts


def gpu_rows(records: list[AllocationRecord], found: list[GpuInfo],
             health: dict[str, tuple[bool, str]], advertised: dict[str, int],
             per_gpu: int) -> list[dict[str, Any]]:
    """One row per GPU: the discovered ones in their order, then any other an allocation
    names. A GPU waiting to change its count keeps its old one (gpu_slices)."""
    counts = gpu_slices(records, advertised)
    allocated: dict[str, int] = {}
    shares: dict[str, float] = {}
    indexes = {g.uuid: g.index for g in found}
    for record in records:
        for gpu in record.gpus:
            slices = gpu.slices_per_gpu or counts.get(gpu.uuid, per_gpu)
            allocated[gpu.uuid] = allocated.get(gpu.uuid, 0) + round(gpu.share * slices)
            shares[gpu.uuid] = shares.get(gpu.uuid, 0.0) + gpu.share
            indexes.setdefault(gpu.uuid, gpu.index)
    by_uuid = {g.uuid: g for g in found}
    rows = []
    for uuid in [g.uuid for g in found] + sorted(set(allocated) - set(by_uuid)):
        healthy, reason = health.get(uuid, (True, ""))
        node_gpu = by_uuid.get(uuid)
        rows.append({"uuid": uuid, "index": indexes[uuid],
                     "model": node_gpu.model if node_gpu else "",
                     "memory_total": node_gpu.memory_total if node_gpu else None,
                     "slices": counts.get(uuid, per_gpu),
                     "slices_allocated": allocated.get(uuid, 0),
                     "share_allocated": round(shares.get(uuid, 0.0), 6),
                     "healthy": healthy, "reason": reason})
    return rows
