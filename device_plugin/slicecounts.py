"""A change of slices_per_gpu, GPU by GPU: a GPU changes count only when no allocation is live.

Kubelet names devices by ID (`<uuid>::<n>`) in its checkpoint and in running pods; cutting a GPU
into another number of slices renames its devices under them. So a GPU takes the configured
count only when no allocation record names one of its slices. Until then it keeps the count it
last advertised (<state-dir>/slices.json), reports its slices Unhealthy to kubelet so that no
new pod lands on it and keeps it from ever changing (running pods keep their devices: kubelet
does not evict for health), and the plugin logs why; the node daemon posts the same as an
Event on the Node (it has the API access the plugin does not). While any record cannot be read,
no GPU changes count.

slices.json's format: vgpu_runtime.contracts.nodefiles.

Written atomically (not durably: it is rewritten at every start) whenever a count changes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from device_plugin.slices import SliceIdError, SliceTable, parse_slice_id
from vgpu_runtime.common.atomicfile import write_atomic
from vgpu_runtime.contracts import allocation, nodefiles, paths
from vgpu_runtime.contracts.allocation import RecordError
from vgpu_runtime.gpus import GpuInfo

log = logging.getLogger(__name__)

SETTLE_INTERVAL = 2.0   # seconds between scans of the records while a GPU waits


counts_file = paths.slices_file


@dataclass(frozen=True)
class Waiting:
    """A GPU that keeps `advertised` slices until `waiting_for` (allocation ids) end."""
    uuid: str
    advertised: int
    configured: int
    waiting_for: tuple[str, ...]


def read_advertised(state_dir: str | Path) -> dict[str, int]:
    """What the last run advertised per GPU; {} (as on a first start) if unknown."""
    path = counts_file(state_dir)
    try:
        counts = nodefiles.decode_slice_counts(path.read_bytes())
        return {uuid: c.advertised for uuid, c in counts.items() if c.advertised >= 1}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring unreadable slice counts; every GPU takes the configured count",
                    extra={"path": str(path), "error": str(err)})
        return {}


def live_allocations(state_dir: str | Path) -> tuple[dict[str, list[str]], bool]:
    """Allocation ids per GPU UUID, from the records' device IDs, and whether every record
    could be read."""
    live: dict[str, list[str]] = {}
    readable = True
    for _path, record in allocation.scan_records(state_dir):
        if isinstance(record, RecordError):
            readable = False
            continue
        for device_id in record.device_ids:
            try:
                uuid, _ = parse_slice_id(device_id)
            except SliceIdError:
                continue
            ids = live.setdefault(uuid, [])
            if record.id not in ids:
                ids.append(record.id)
    return live, readable


def plan(gpus: Sequence[GpuInfo], configured: int, advertised: Mapping[str, int],
         live: Mapping[str, list[str]], readable: bool
         ) -> tuple[dict[str, int], list[Waiting]]:
    """Each GPU's count, and the GPUs that wait: those whose advertised count differs from the
    configured one while an allocation is live on them (or a record is unreadable)."""
    counts: dict[str, int] = {}
    waiting: list[Waiting] = []
    for gpu in gpus:
        old = advertised.get(gpu.uuid, configured)
        if old != configured and (live.get(gpu.uuid) or not readable):
            counts[gpu.uuid] = old
            waiting.append(Waiting(gpu.uuid, old, configured, tuple(live.get(gpu.uuid, ()))))
        else:
            counts[gpu.uuid] = configured
    return counts, waiting


def write_counts(state_dir: str | Path, table: SliceTable, waiting: Sequence[Waiting]) -> None:
    """Never raises: the counts reach kubelet through ListAndWatch whatever happens here."""
    by_gpu = {w.uuid: w for w in waiting}
    document = {uuid: nodefiles.SliceCount(
        table.count_of(uuid), table.per_gpu, by_gpu[uuid].waiting_for if uuid in by_gpu else ())
        for uuid in table.counts}
    target = counts_file(state_dir)
    try:
        write_atomic(target, nodefiles.encode_slice_counts(document), durable=False)
    except OSError as err:
        log.warning("cannot write slice counts", extra={"path": str(target),
                                                        "error": str(err)})


class SliceCounts:
    """The node's table across a change of slices_per_gpu."""

    def __init__(self, state_dir: str, gpus: Sequence[GpuInfo], configured: int) -> None:
        self.state_dir = state_dir
        self.gpus = list(gpus)
        self.configured = configured
        self.waiting: list[Waiting] = []

    @property
    def draining(self) -> frozenset[str]:
        return frozenset(w.uuid for w in self.waiting)

    def start(self) -> SliceTable:
        """The table to serve at start: the configured count where it can be, the old one
        where allocations still live."""
        live, readable = live_allocations(self.state_dir)
        counts, self.waiting = plan(self.gpus, self.configured,
                                    read_advertised(self.state_dir), live, readable)
        table = SliceTable(self.gpus, self.configured, counts)
        write_counts(self.state_dir, table, self.waiting)
        for item in self.waiting:
            self._log_waiting(item, readable)
        return table

    def settle(self) -> SliceTable | None:
        """A new table if a waiting GPU can now change count (or what it waits for changed);
        None if nothing changed."""
        if not self.waiting:
            return None
        live, readable = live_allocations(self.state_dir)
        advertised = {w.uuid: w.advertised for w in self.waiting}
        counts, waiting = plan(self.gpus, self.configured, advertised, live, readable)
        if waiting == self.waiting:
            return None
        done = {w.uuid for w in self.waiting} - {w.uuid for w in waiting}
        self.waiting = waiting
        table = SliceTable(self.gpus, self.configured, counts)
        write_counts(self.state_dir, table, waiting)
        for uuid in sorted(done):
            log.info("GPU changed slice count: no allocation is live on it", extra={
                "gpu": uuid, "slices": self.configured, "was": advertised[uuid]})
        return table

    def _log_waiting(self, item: Waiting, readable: bool) -> None:
        log.warning(
            "slices_per_gpu change waits on this GPU: it keeps its old slices, taking no new "
            "pod, until the allocations live on it end" if readable else
            "slices_per_gpu change waits: an allocation record cannot be read", extra={
                "gpu": item.uuid, "advertised": item.advertised,
                "configured": item.configured, "waiting_for": list(item.waiting_for)})
