"""Slices: each GPU advertised as N kubelet devices with stable IDs `<GPU UUID>::<n>`.

The ID names its GPU, is the same across restarts (UUIDs are stable, n is 0..N-1) and stays
within kubelet's 63-character limit (an NVML UUID is 40 characters).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vgpu_runtime.gpus import GpuInfo

SEPARATOR = "::"
MAX_ID_LENGTH = 63
# How many IDs, and how much of each, a message names: kubelet's request is not bounded, and a
# gRPC status past its metadata limit (16 KiB) reaches kubelet as a broken stream, not a reason.
BRIEF_IDS = 5
BRIEF_ID_CHARS = MAX_ID_LENGTH + 1


def brief_ids(device_ids: Sequence[str]) -> str:
    """A few of `device_ids` for a message, each cut short, and how many more there are."""
    shown = [d if len(d) <= BRIEF_ID_CHARS else f"{d[:BRIEF_ID_CHARS]}... ({len(d)} chars)"
             for d in device_ids[:BRIEF_IDS]]
    more = len(device_ids) - len(shown)
    return ", ".join(repr(d) if not d.isprintable() else d for d in shown) + (
        f" and {more} more" if more else "")


class SliceIdError(ValueError):
    """A device ID is not of the form <GPU UUID>::<n>."""


@dataclass(frozen=True)
class Slice:
    id: str
    gpu: GpuInfo
    number: int


def slice_id(uuid: str, number: int) -> str:
    return f"{uuid}{SEPARATOR}{number}"


def parse_slice_id(device_id: str) -> tuple[str, int]:
    uuid, sep, number = device_id.rpartition(SEPARATOR)
    if not sep or not uuid or not number.isdigit() or (number != "0" and number[0] == "0"):
        raise SliceIdError(f"{device_id!r} is not a slice ID of the form <GPU UUID>::<n>")
    return uuid, int(number)


class SliceTable:
    """Every slice of the node, by ID and by GPU, in GPU index order.

    `per_gpu` is the configured count; `counts` gives a GPU another one (a GPU that keeps its
    old count until its live allocations end, device_plugin.slicecounts)."""

    def __init__(self, gpus: Sequence[GpuInfo], per_gpu: int,
                 counts: Mapping[str, int] | None = None) -> None:
        if per_gpu < 1 or any(n < 1 for n in (counts or {}).values()):
            raise ValueError("a GPU needs at least one slice")
        self.per_gpu = per_gpu
        self.counts = {g.uuid: (counts or {}).get(g.uuid, per_gpu) for g in gpus}
        self.gpus = sorted(gpus, key=lambda g: g.index)
        self._gpu_by_uuid = {g.uuid: g for g in self.gpus}
        if len(self._gpu_by_uuid) != len(self.gpus):
            raise ValueError("two GPUs report the same UUID")
        self._by_id: dict[str, Slice] = {}
        self._by_gpu: dict[str, list[Slice]] = {}
        # Each ID's place in table order (GPU index, then slice number): sorting IDs by it is
        # a C-level dict lookup per ID, where a (gpu.index, number) key was a tuple per ID.
        self._rank: dict[str, int] = {}
        for gpu in self.gpus:
            row = [Slice(slice_id(gpu.uuid, n), gpu, n) for n in range(self.counts[gpu.uuid])]
            longest = row[-1].id
            if len(longest) > MAX_ID_LENGTH:
                raise ValueError(f"slice ID {longest!r} is longer than {MAX_ID_LENGTH} "
                                 "characters; lower slices_per_gpu")
            self._by_gpu[gpu.uuid] = row
            self._by_id.update((s.id, s) for s in row)
        self._rank = {device_id: n for n, device_id in enumerate(self._by_id)}

    def __len__(self) -> int:
        return len(self._by_id)

    def count_of(self, uuid: str) -> int:
        """The slices a GPU is cut into (its own count, else the configured one)."""
        return self.counts.get(uuid, self.per_gpu)

    def all(self) -> list[Slice]:
        return [s for gpu in self.gpus for s in self._by_gpu[gpu.uuid]]

    def get(self, device_id: str) -> Slice | None:
        return self._by_id.get(device_id)

    def gpu(self, uuid: str) -> GpuInfo | None:
        return self._gpu_by_uuid.get(uuid)

    def slices_of(self, uuid: str) -> list[Slice]:
        return list(self._by_gpu.get(uuid, ()))

    def unknown(self, device_ids: Iterable[str]) -> list[str]:
        return [d for d in device_ids if d not in self._by_id]

    def in_order(self, device_ids: Iterable[str]) -> list[Slice]:
        """The slices of known IDs, in table order (GPU index, then slice number); raises
        KeyError for an unknown ID (callers check `unknown()` for the message)."""
        by_id = self._by_id
        return [by_id[d] for d in sorted(device_ids, key=self._rank.__getitem__)]
