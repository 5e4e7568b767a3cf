"""Pod awareness: bind kubelet allocations to their pods, apply annotations, collect ended pods.

Binding. Allocate does not say which pod it serves. For every kubelet record without a binding,
the watcher asks PodResources `List` which container holds the record's slice IDs, then (with
the Kubernetes API on) GETs the pod for its uid and annotations, and hands the daemon the pod
binding: the pod and its valid annotations as overrides (`bind`, which writes
<state-dir>/bindings/<id>.json and applies the new terms to the channel at once). The record is
the plugin's and is never written here. The channel's hellos, which wait for the pod
(`AllocationChannel.wait_bound`), are answered with the new terms.

Re-binding. The binding follows what PodResources says holds the slices now. Slices freed by a
deleted pod and given to a new one within the collect grace keep their allocation id (it is the
slice set's), so a bound record whose slices another pod holds is bound again: to the new pod,
with the record's entitlement and the new pod's annotations. The same pod holding them (an
init container's slices replayed to an app container, restarts) keeps everything.

An invalid annotation is ignored with a Warning Event on the pod (reason InvalidVgpuAnnotation).
The channels' Events go through here too: on the pod (a process past its memory limit) and on
the Node (a process of no allocation on a shared GPU).
When the API cannot be reached the pod is bound with the defaults, and the annotations are
tried again on later passes.

Collection. An allocation whose slices no container holds in a successful, non-empty List for
`collect_grace` seconds without interruption is collected: record removed, channel closed and
its directory removed. A failed or empty List restarts every clock: kubelet restarting proves
nothing about pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, PodRef
from vgpu_runtime.contracts.share import optional_json
from vgpu_runtime.daemon.pods.annotations import INVALID_REASON, overrides_of
from vgpu_runtime.daemon.pods.podresources import PodListing, PodResourcesLister

if TYPE_CHECKING:
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.daemon.pods.kube import KubeApi

log = logging.getLogger(__name__)

Records = Callable[[], list[AllocationRecord]]
BindingOf = Callable[[str], Binding | None]
Bind = Callable[[Binding], bool]    # stores and applies a binding; False if it could not
Collect = Callable[[str, str], Awaitable[None]]
Notify = Callable[[str, AllocationRecord, dict[str, object]], None]


class PodWatch:
    def __init__(self, config: DaemonConfig, lister: PodResourcesLister,
                 kube: KubeApi | None, records: Records, binding_of: BindingOf, bind: Bind,
                 collect: Collect, notify: Notify,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock   # absence clocks (collect_grace); tests drive their own
        self.lister = lister
        self.kube = kube
        self.records = records
        self.binding_of = binding_of
        self.bind = bind
        self.collect = collect
        self.notify = notify
        self.absent_since: dict[str, float] = {}
        self.annotations_pending: set[str] = set()
        self.binds = 0
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_listing_ok: bool | None = None

    def poke(self) -> None:
        """Something wants binding now (a new record, a waiting hello)."""
        self._wake.set()

    def bind_timeout(self) -> float:
        """How long a kubelet allocation's hello waits for its pod: without kubelet's
        PodResources on this node no pod can be found, so never."""
        return self.config.bind_timeout if self.lister.available() else 0.0

    def post_pod_event(self, pod: PodRef, reason: str, message: str) -> None:
        """A Warning Event on a pod, posted in the background; nothing without Kubernetes."""
        if self.kube is not None:
            self._spawn(self._post(pod, reason, message))

    def post_node_event(self, reason: str, message: str) -> None:
        """A Warning Event on this node, posted in the background; nothing without
        Kubernetes."""
        if self.kube is not None:
            self._spawn(self._post_node(reason, message))

    async def run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._next_delay())
            self._wake.clear()
            try:
                await self.pass_once()
            except Exception:
                log.exception("pod watch pass failed; trying again")

    def _next_delay(self) -> float:
        if any(self.binding_of(r.id) is None or r.id in self.annotations_pending
               for r in self._kubelet()):
            # Someone may be waiting on these: ask again soon, within the rate limit.
            return max(self.config.pod_resources_min_interval, 0.05)
        return self.config.pod_resources_interval

    def _kubelet(self) -> list[AllocationRecord]:
        return [r for r in self.records() if r.origin == "kubelet" and r.device_ids]

    async def pass_once(self) -> None:
        records = self._kubelet()
        if not records:
            self.absent_since.clear()
            return
        if not self.lister.available():
            self.absent_since.clear()
            return
        listing = await self.lister.listing()
        self._log_listing(listing)
        for record in records:
            bound = self.binding_of(record.id)
            if (bound is None or record.id in self.annotations_pending
                    or _taken_over(bound, record, listing)):
                await self._bind(record, listing)
        await self._collect_ended(records, listing)

    def _log_listing(self, listing: PodListing) -> None:
        if listing.ok != self._last_listing_ok:
            if listing.ok:
                log.info("PodResources answers", extra={"pods": listing.pods})
            else:
                log.warning("PodResources gives no usable answer; nothing is collected",
                            extra={"error": listing.error})
            self._last_listing_ok = listing.ok

    # ---- binding ----

    async def _bind(self, record: AllocationRecord, listing: PodListing) -> None:
        if not listing.ok:
            return
        previous = self.binding_of(record.id)
        owner = listing.owner_of(record.device_ids) or (previous.pod if previous else None)
        if owner is None:
            return
        annotations: dict[str, str] | None = None
        uid = owner.uid
        if self.kube is not None:
            try:
                info = await self.kube.get_pod(owner.namespace, owner.name)
                uid, annotations = info.uid, info.annotations
            except Exception as err:
                log.warning("cannot read the pod's annotations; defaults hold for now",
                            extra={"allocation": record.id, "pod": owner.name,
                                   "namespace": owner.namespace, "error": str(err)})
        previous = self.binding_of(record.id)   # the API call let others run
        rebound = previous is not None and not _same_pod(previous.pod, owner)
        if previous is not None and not rebound:
            # The pod it is bound to: the container it was bound with, the uid once known.
            binding = replace(previous, pod=replace(previous.pod, uid=uid or previous.pod.uid))
        else:
            # A new pod starts from the record's entitlement: no overrides of another pod.
            binding = Binding(record.id, PodRef(owner.namespace, owner.name, owner.container,
                                                uid))
        problems: tuple[str, ...] = ()
        if annotations is not None:
            overrides = overrides_of(record, annotations)
            binding = replace(binding, limit=overrides.limit,
                              memory_limit=overrides.memory_limit)
            problems = overrides.problems
            self.annotations_pending.discard(record.id)
        elif self.kube is not None:
            self.annotations_pending.add(record.id)
        if binding != previous and not self.bind(binding):
            return
        pod = binding.pod
        if previous is None or rebound:
            self.binds += 1
            more = {} if previous is None else {"previous_namespace": previous.pod.namespace,
                                                "previous_pod": previous.pod.name}
            log.info("allocation re-bound to the pod now holding its slices" if rebound else
                     "allocation bound to its pod", extra={
                         "allocation": record.id, "namespace": pod.namespace, "pod": pod.name,
                         "container": pod.container, "limit": optional_json(binding.limit),
                         "memory_limit": binding.memory_limit, **more})
            self.notify("bound", record, dict(more))
        for problem in problems:
            log.warning("ignoring pod annotation", extra={
                "allocation": record.id, "namespace": pod.namespace, "pod": pod.name,
                "problem": problem})
            self._spawn(self._event(pod, problem))

    async def _event(self, pod: PodRef, message: str) -> None:
        await self._post(pod, INVALID_REASON, message)

    async def _post(self, pod: PodRef, reason: str, message: str) -> None:
        assert self.kube is not None
        try:
            await self.kube.post_event(pod, self.config.node_name, reason, message)
        except Exception as err:
            log.warning("cannot post event", extra={"pod": pod.name, "error": str(err)})

    async def _post_node(self, reason: str, message: str) -> None:
        """As kubelet posts its own (KubeApi.post_node_event)."""
        assert self.kube is not None
        node = self.config.node_name
        try:
            await self.kube.post_node_event(node, reason, message)
        except Exception as err:
            log.warning("cannot post event", extra={"node": node, "reason": reason,
                                                    "error": str(err)})

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- collection ----

    async def _collect_ended(self, records: list[AllocationRecord], listing: PodListing) -> None:
        if not listing.ok:
            self.absent_since.clear()   # no evidence; absence must be continuous
            return
        now = self.clock()
        live = {r.id for r in records}
        for gone in set(self.absent_since) - live:
            del self.absent_since[gone]
        for record in records:
            if listing.owner_of(record.device_ids) is not None:   # held whole by its pod
                self.absent_since.pop(record.id, None)
                continue
            since = self.absent_since.setdefault(record.id, now)
            if now - since >= self.config.collect_grace:
                del self.absent_since[record.id]
                binding = self.binding_of(record.id)
                pod = binding.pod if binding else None
                reason = (f"pod {pod.namespace}/{pod.name} ended" if pod else
                          "no pod holds its slices") + (
                    f" (absent from PodResources for {now - since:.1f} s)")
                await self.collect(record.id, reason)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.lister.close()


def _same_pod(bound: PodRef, holder: PodRef) -> bool:
    """PodResources names pods, not uids: a uid is compared only where both are known."""
    return ((bound.namespace, bound.name) == (holder.namespace, holder.name)
            and (not bound.uid or not holder.uid or bound.uid == holder.uid))


def _taken_over(binding: Binding, record: AllocationRecord, listing: PodListing) -> bool:
    """A bound record whose slices another pod now holds (a successful List says so)."""
    if not listing.ok:
        return False
    holder = listing.owner_of(record.device_ids)
    return holder is not None and not _same_pod(binding.pod, holder)

