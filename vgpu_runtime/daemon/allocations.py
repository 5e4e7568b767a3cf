"""The allocations this daemon serves: one AllocationChannel per readable record, kept in line
with <state-dir>/allocations/ at every poll, with each kubelet allocation's pod binding applied.

The records are the allocators' (the plugin's, gemini-run's) and are only read here. A record
that cannot be served yet (no descriptors, no space, a read-only state directory) or at all (its
terms cannot be met) is listed as corrupt and tried again when it changes or at the next poll.
A daemon of gemini-run's (gpu_lock_dir set) claims each GPU host-wide before it serves an
allocation on it, and lets it go once none is left on it (gpuclaims.py).

Each channel joins NVML reconciliation itself (channel/process_memory.py's charger, one per
daemon); the processes it finds on the served GPUs that belong to no allocation are read here
(`unattributed`), for status and the metrics, and reported through the pod watch as Events on
the Node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, PodRef, RecordError
from vgpu_runtime.daemon.channel.channel import AllocationChannel, ChannelUnavailable, needs_binding
from vgpu_runtime.daemon.channel.process_memory import charger_for
from vgpu_runtime.daemon.channel.terms import terms_of
from vgpu_runtime.daemon.gpuclaims import ServedGpus
from vgpu_runtime.daemon.records import RecordWatcher

if TYPE_CHECKING:
    from vgpu_runtime.daemon.bindings import PodBindings
    from vgpu_runtime.daemon.channel.tokens import TokenService
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.daemon.troubles import Troubles

log = logging.getLogger(__name__)

# allocation_event(event, record, more, binding): "added", "removed", "collected" here.
Notify = Callable[..., None]


class PodSide(Protocol):
    """What the channels need of the pod watch (pods/pods.py's PodWatch)."""

    def poke(self) -> None: ...

    def post_pod_event(self, pod: PodRef, reason: str, message: str) -> None: ...

    def post_node_event(self, reason: str, message: str) -> None: ...

    def bind_timeout(self) -> float: ...


class NoPods:
    """No pod watch: nothing is bound, so no hello waits for a pod and no Event is posted."""

    def poke(self) -> None:
        pass

    def post_pod_event(self, pod: PodRef, reason: str, message: str) -> None:
        pass

    def post_node_event(self, reason: str, message: str) -> None:
        pass

    def bind_timeout(self) -> float:
        return 0.0


class Allocations:
    def __init__(self, config: DaemonConfig, tokens: TokenService, bindings: PodBindings,
                 troubles: Troubles, notify: Notify) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.tokens = tokens
        self.bindings = bindings
        self.troubles = troubles
        self.notify = notify
        self.pods: PodSide = NoPods()   # the daemon gives its pod watch once both exist
        self.watcher = RecordWatcher(self.state_dir)
        self.channels: dict[str, AllocationChannel] = {}
        self.corrupt: dict[str, str] = {}   # record path -> why it is not served
        self.claims = ServedGpus(config.gpu_lock_dir)   # gemini-run's daemons: host-wide
        self._lock = asyncio.Lock()   # a sync and a collection never interleave
        # Reconciliation's reports on processes of no allocation go to whichever pod watch
        # the daemon gives later.
        charger_for(tokens, config).reconciler.node_event = (
            lambda reason, message: self.pods.post_node_event(reason, message))

    def records(self) -> list[AllocationRecord]:
        return [c.record for c in self.channels.values()]

    async def sync(self) -> None:
        """Bring the served channels in line with the records on disk."""
        async with self._lock:
            await self._sync()

    async def _sync(self) -> None:
        try:
            scan = self.watcher.scan()
        except OSError as err:
            # No descriptors or memory for a listing: it says nothing about the records, so
            # every allocation served goes on being served; the next poll tries again.
            self.troubles.report("cannot scan the allocation records", "scan", err)
            return
        self.troubles.clear("scan")
        self.corrupt = dict(scan.corrupt)
        for allocation_id in set(self.channels) - set(scan.records):
            channel = self.channels.pop(allocation_id)
            await channel.close("allocation record removed")
            self.notify("removed", channel.record, {})
        unreadable = {Path(p).stem for p in scan.corrupt}
        for allocation_id in self.bindings.ids() - set(scan.records) - unreadable:
            self.bindings.drop(allocation_id)
        for allocation_id, record in scan.records.items():
            current = self.channels.get(allocation_id)
            if current is not None and current.record == record:
                continue
            try:
                await self._serve(current, record)
            except ChannelUnavailable as err:
                # Out of descriptors or space, or a read-only state directory: tried again at
                # every poll, logged once.
                self.troubles.report("cannot serve allocation yet", record.id, err)
                self.corrupt[self._path(record.id)] = str(err)
            except RecordError as err:
                self.watcher.mark_unservable(record, err)
                self.corrupt[self._path(record.id)] = str(err)
        self.claims.keep(self.records())

    def _path(self, allocation_id: str) -> str:
        return str(paths.allocations_dir(self.state_dir) / f"{allocation_id}.json")

    async def _serve(self, current: AllocationChannel | None, record: AllocationRecord) -> None:
        binding = self.bindings.for_record(record)
        terms = terms_of(record, binding, self.config.limit_for)
        if current is not None:
            current.update(record, binding, terms)
            return
        self.claims.claim(record)   # RecordError where another user's daemon holds a GPU
        channel = AllocationChannel(record, terms, self.tokens, self.pods.bind_timeout,
                                    self.pods.poke, binding, self.pods.post_pod_event)
        await channel.start()
        self.troubles.clear(record.id)
        self.channels[record.id] = channel
        self.notify("added", record, {})
        if needs_binding(record, binding):
            self.pods.poke()

    def bind(self, binding: Binding) -> bool:
        """Store a pod binding and apply its terms to the allocation's channel now; False if
        the allocation is no longer served or the file cannot be written (logged)."""
        channel = self.channels.get(binding.id)
        if channel is None:
            return False
        try:
            terms = terms_of(channel.record, binding, self.config.limit_for)
            self.bindings.store(binding)
        except RecordError as err:
            log.error("cannot bind: binding not stored", extra={"allocation": binding.id,
                                                                 "error": str(err)})
            return False
        channel.update(channel.record, binding, terms)
        return True

    async def collect(self, allocation_id: str, reason: str) -> None:
        """The allocation's pod is gone: its channel closed and its binding dropped, then its
        record and directory removed (end_allocation, the records' one deleter), so that what
        outlives the record is nothing and the directory is the last to go. A record that
        cannot be removed is served again at the next poll, and collected again later."""
        async with self._lock:
            channel = self.channels.pop(allocation_id, None)
            record = channel.record if channel else allocation.load_record(self.state_dir,
                                                                           allocation_id)
            if channel is not None:
                await channel.close(reason)
            binding = self.bindings.get(allocation_id)
            self.bindings.drop(allocation_id)
            allocation.end_allocation(self.state_dir, allocation_id, record)
            if record is not None:
                self.notify("collected", record, {"reason": reason}, binding)
            log.info("allocation collected", extra={"allocation": allocation_id,
                                                    "reason": reason})

    async def close(self, reason: str) -> None:
        """Close every channel, leaving records and directories: a daemon stopping, not the
        allocations ending."""
        await asyncio.gather(*(c.close(reason, removed=False) for c in self.channels.values()),
                             return_exceptions=True)
        self.channels.clear()
        self.claims.close()

    def snapshot(self) -> list[dict[str, Any]]:
        return [c.snapshot() for _, c in sorted(self.channels.items())]

    def corrupt_records(self) -> list[dict[str, str]]:
        return [{"path": p, "error": e} for p, e in sorted(self.corrupt.items())]

    def unattributed(self) -> list[dict[str, Any]]:
        """What NVML reconciliation (channel/reconcile.py) last found on the served
        allocations' GPUs held by processes of no allocation: reported, never charged."""
        return list(charger_for(self.tokens, self.config).reconciler.unattributed)
