"""The daemon: keeps one AllocationChannel per live allocation record, and the control socket.

State lives in the state directory only. On start (including a restart) every record is served
again; clients reconnect and re-declare what they hold with MEM_SET, so nothing is doubled: the
new daemon starts from an empty ledger. Tokens start afresh too: every page is cleared, and a
hook whose token vanished asks again.

Around that core, each optional and none on the token path: the pod watch (pods.py:
binding, annotations, collection), node labels through the Kubernetes API (node.py, kube.py),
the metrics port (metrics.py) and MQTT telemetry (mqtt.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu_runtime import __version__, allocation, paths
from vgpu_runtime.allocation import AllocationRecord, Binding, RecordError
from vgpu_runtime.common import securedir
from vgpu_runtime.daemon.channel.channel import AllocationChannel, ChannelUnavailable, needs_binding
from vgpu_runtime.daemon.channel.terms import terms_of
from vgpu_runtime.daemon.channel.tokens import TokenService
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.control import ControlServer, control_socket
from vgpu_runtime.daemon.pods.node import (
    HealthFile,
    SliceCount,
    SliceCountsFile,
    discover_gpus,
    node_labels,
)
from vgpu_runtime.daemon.pods.podresources import PodResourcesLister
from vgpu_runtime.daemon.pods.pods import PodWatch
from vgpu_runtime.daemon.records import RecordWatcher
from vgpu_runtime.daemon.telemetry.rows import container_rows
from vgpu_runtime.gpus import GpuInfo

if TYPE_CHECKING:
    from vgpu_runtime.daemon.pods.kube import KubeApi
    from vgpu_runtime.daemon.telemetry.metrics import MetricsServer
    from vgpu_runtime.daemon.telemetry.mqtt import MqttPublisher

log = logging.getLogger(__name__)

ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"   # asyncio's message
ACCEPT_LOG_INTERVAL = 10.0


def event_loop_name() -> str:
    """'uvloop' or 'asyncio': the loop this daemon runs on (logged at start, for benchmarks)."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.channels: dict[str, AllocationChannel] = {}
        self.tokens = TokenService(config)
        self.watcher = RecordWatcher(self.state_dir)
        self.corrupt: dict[str, str] = {}
        # The pod bindings this daemon wrote (<state-dir>/bindings), by allocation id.
        self.bindings: dict[str, Binding] = {}
        self.started_at = time.time()
        self.control = ControlServer(control_socket(self.state_dir),
                                     {"status": self.status_request,
                                      "stop": self.stop_request})
        self.ready = False
        self.node_gpus: list[GpuInfo] = []
        self.health = HealthFile(self.state_dir)
        self.slice_counts = SliceCountsFile(self.state_dir)
        self.kube: KubeApi | None = None
        self.metrics: MetricsServer | None = None
        self.mqtt: MqttPublisher | None = None
        self.pods = PodWatch(
            config, PodResourcesLister(config.pod_resources_socket, config.resource_name,
                                       config.pod_resources_min_interval),
            None, self.records, self.bindings.get, self.bind, self.collect,
            self.allocation_event)
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._sync_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._troubles: dict[str, str] = {}   # what failed and was logged -> the error
        self._accept_failures = 0
        self._accept_logged = -ACCEPT_LOG_INTERVAL

    def stop(self) -> None:
        self._stop.set()

    async def stop_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """`gemini-vgpu stop`: refused while an allocation is live, unless forced (its hooks
        then gate themselves at their shares until a daemon is back). Live means its record is
        on disk now, not at the last poll: gemini-run removes its record as it exits."""
        await self._records_now()
        live = sorted(self.channels)
        if live and request.get("force") is not True:
            return {"error": f"{len(live)} allocation(s) live ({', '.join(live[:5])}); their "
                             "processes would gate themselves without the daemon. Stop them "
                             "first, or force it (gemini-vgpu stop --force)"}
        log.info("stopping on request", extra={"live_allocations": live})
        self.stop()
        return {"stopping": True, "pid": os.getpid()}

    async def status_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """`gemini-vgpu status`: the allocations whose records are on disk now, so a
        command that just ended (its record removed) is not shown until the next poll."""
        await self._records_now()
        return self.status(request)

    async def _records_now(self) -> None:
        """Bring the channels in line with the records before a control answer; once the
        first scan is done (the optional parts have started), and a failed scan leaves what
        is served, as the poll would."""
        if self.ready:
            with contextlib.suppress(OSError):
                await self.sync()

    def wake(self) -> None:
        """Scan the records now."""
        self._wake.set()

    def records(self) -> list[AllocationRecord]:
        return [c.record for c in self.channels.values()]

    async def run(self) -> None:
        paths.allocations_dir(self.state_dir).mkdir(parents=True, exist_ok=True)
        self._load_bindings()
        try:
            # Also on a node whose channels/ an older version made 0755.
            securedir.make_dir(paths.channels_dir(self.state_dir), paths.CHANNELS_DIR_MODE)
        except (OSError, securedir.InsecureDirectory) as err:
            log.error("cannot make the channels directory private; other host users may reach "
                      "channel sockets", extra={"error": str(err)})
        asyncio.get_running_loop().set_exception_handler(self._on_loop_error)
        await self.control.start()
        self._start_optional()
        log.info("gemini-scheduler started", extra={"state_dir": str(self.state_dir),
                                                    "pid": os.getpid(),
                                                    "node": self.config.node_name,
                                                    "event_loop": event_loop_name()})
        if self.config.token_path != "auto":
            log.warning("token_path is deprecated and ignored: the token code is Python alone "
                        "(the C path was removed; BENCHMARKS.md, \"One token implementation\"); "
                        "drop the setting, it goes in the next release",
                        extra={"token_path": self.config.token_path})
        idle_since = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    await self.sync()
                    self._troubles.pop("sync", None)
                except OSError as err:
                    # Exhaustion (descriptors, space, a read-only state directory) must not
                    # end the daemon: what it serves goes on, and the next poll tries again.
                    self._trouble("cannot bring the allocations in line with the records",
                                  "sync", err)
                self.ready = True
                now = time.monotonic()
                if self.channels or self.corrupt or self._troubles:
                    idle_since = now
                elif self.config.idle_exit and now - idle_since >= self.config.idle_exit:
                    log.info("no allocation for idle_exit seconds: exiting",
                             extra={"idle_exit": self.config.idle_exit})
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wait_stop_or_wake(), self.config.poll_interval)
                self._wake.clear()
        finally:
            await self.shutdown()

    async def _wait_stop_or_wake(self) -> None:
        stop = asyncio.ensure_future(self._stop.wait())
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({stop, wake}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            wake.cancel()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.create_task(coro))

    def _start_optional(self) -> None:
        config = self.config
        if config.kubernetes:
            from vgpu_runtime.daemon.pods.kube import KubeApi

            try:
                self.kube = KubeApi(config.kube_api_url, config.kubeconfig)
            except Exception as err:
                # No in-cluster config (not in a pod): run on without the API, say so.
                log.error("Kubernetes API unavailable; annotations, Events and node labels "
                          "are off", extra={"error": str(err)})
            self.pods.kube = self.kube
        self._spawn(self.pods.run())
        self._spawn(self._discover_and_label())
        if self.kube is not None:
            self._spawn(self._report_slice_counts())
        if config.metrics_port:
            from vgpu_runtime.daemon.telemetry.metrics import MetricsServer

            try:
                self.metrics = MetricsServer(config.metrics_address, config.metrics_port,
                                             asyncio.get_running_loop(), self.telemetry_status,
                                             lambda: self.ready)
                self.metrics.start()
            except OSError as err:
                log.error("metrics port unavailable; running without /metrics", extra={
                    "port": config.metrics_port, "error": str(err)})
                self.metrics = None
        if config.mqtt_url:
            from vgpu_runtime.daemon.telemetry.mqtt import MqttPublisher

            self.mqtt = MqttPublisher(config.mqtt_url, config.node_name,
                                      config.mqtt_topic_prefix, config.mqtt_queue)
            self._spawn(self.mqtt.run())
            self._spawn(self._publish_usage())

    async def _discover_and_label(self) -> None:
        """GPUs for labels and metrics (in a thread: NVML may be slow), then the labels."""
        self.node_gpus = await asyncio.to_thread(discover_gpus, self.config.simulate_gpus,
                                                 self.config.simulate_model)
        if self.kube is None:
            return
        while True:
            wanted = node_labels(self.node_gpus, self.slices_per_gpu())
            try:
                current = await self.kube.node_labels(self.config.node_name)
                change = {k: v for k, v in wanted.items() if current.get(k) != v}
                if change:
                    await self.kube.patch_node_labels(self.config.node_name, change)
                    log.info("node labels set", extra={"node": self.config.node_name,
                                                       "labels": change})
                delay = self.config.node_label_interval
            except Exception as err:
                log.warning("cannot label the node; trying again", extra={
                    "node": self.config.node_name, "error": str(err)})
                delay = min(30.0, self.config.node_label_interval)
            await asyncio.sleep(delay)

    async def _report_slice_counts(self, interval: float = 1.0) -> None:
        """An Event on the Node when a GPU's change of slices_per_gpu waits for allocations
        (the plugin, which has no API access, says so in slices.json) and when it is done."""
        assert self.kube is not None
        reported: dict[str, SliceCount] = {}
        uid: str | None = None
        while True:
            for uuid, count in self.slice_counts.read().items():
                before = reported.get(uuid)
                waiting = count.advertised != count.configured
                if before == count or (before is None and not waiting):
                    reported[uuid] = count
                    continue
                if waiting:
                    reason, kind = "SlicesPerGpuChangeWaiting", "Warning"
                    message = (f"GPU {uuid} keeps {count.advertised} slices, not the configured "
                               f"{count.configured}, until allocation(s) "
                               f"{', '.join(count.waiting_for) or '(unreadable records)'} end: "
                               "kubelet names its devices in running pods; it takes no new pod "
                               "meanwhile")
                elif before is not None and before.advertised != count.advertised:
                    reason, kind = "SlicesPerGpuChanged", "Normal"
                    message = f"GPU {uuid} is now cut into {count.configured} slices"
                else:
                    reported[uuid] = count
                    continue
                try:
                    if uid is None:
                        uid = (await self.kube.node(self.config.node_name)).uid
                    await self.kube.post_node_event(self.config.node_name, uid, reason, message,
                                                    kind=kind)
                except Exception as err:
                    log.warning("cannot post an Event on the node; trying again", extra={
                        "error": str(err), "reason": reason})
                    break
                log.info("node event posted", extra={"reason": reason, "gpu": uuid})
                reported[uuid] = count
            await asyncio.sleep(interval)

    async def sync(self) -> None:
        """Bring the served channels in line with the records on disk."""
        async with self._sync_lock:
            await self._sync()

    async def _sync(self) -> None:
        try:
            scan = self.watcher.scan()
        except OSError as err:
            # No descriptors or memory for a listing: it says nothing about the records, so
            # every allocation served goes on being served; the next poll tries again.
            self._trouble("cannot scan the allocation records", "scan", err)
            return
        self._troubles.pop("scan", None)
        self.corrupt = dict(scan.corrupt)
        for allocation_id in set(self.channels) - set(scan.records):
            channel = self.channels.pop(allocation_id)
            await channel.close("allocation record removed")
            self.allocation_event("removed", channel.record, {})
        unreadable = {Path(p).stem for p in scan.corrupt}
        for allocation_id in set(self.bindings) - set(scan.records) - unreadable:
            self._unbind(allocation_id)
        for allocation_id, record in scan.records.items():
            current = self.channels.get(allocation_id)
            if current is not None and current.record == record:
                continue
            try:
                await self._serve(current, record)
            except ChannelUnavailable as err:
                # Out of descriptors or space, or a read-only state directory: tried again at
                # every poll, logged once.
                self._trouble("cannot serve allocation yet", record.id, err)
                self.corrupt[str(paths.allocations_dir(self.state_dir) / f"{record.id}.json")] = (
                    str(err))
            except RecordError as err:
                self.watcher.mark_unservable(record, err)
                self.corrupt[str(paths.allocations_dir(self.state_dir) / f"{record.id}.json")] = (
                    str(err))

    async def _serve(self, current: AllocationChannel | None, record: AllocationRecord) -> None:
        binding = self._binding_for(record)
        terms = terms_of(record, binding, self.config.limit_for)
        if current is not None:
            current.update(record, binding, terms)
            return
        channel = AllocationChannel(record, terms, self.tokens, self._bind_timeout,
                                    self.pods.poke, binding, self.pods.post_pod_event)
        await channel.start()
        self._troubles.pop(record.id, None)
        self.channels[record.id] = channel
        self.allocation_event("added", record, {})
        if needs_binding(record, binding):
            self.pods.poke()

    # ---- pod bindings: this daemon's files ----

    def _load_bindings(self) -> None:
        for path, binding in allocation.scan_bindings(self.state_dir):
            if isinstance(binding, RecordError):
                # The pod watch binds the allocation again, replacing the file.
                log.error("ignoring unreadable pod binding", extra={"path": str(path),
                                                                     "error": str(binding)})
            else:
                self.bindings[binding.id] = binding

    def _binding_for(self, record: AllocationRecord) -> Binding | None:
        """The record's binding; a version-1 record's pod, which an older daemon wrote into
        it, is moved into this daemon's binding file the first time it is read."""
        binding = self.bindings.get(record.id)
        if binding is None and record.carried is not None and record.origin == "kubelet":
            binding = record.carried
            try:
                allocation.write_binding(self.state_dir, binding)
            except RecordError as err:
                log.error("cannot store the pod binding of a version-1 record; it holds in "
                          "memory", extra={"allocation": record.id, "error": str(err)})
            else:
                log.info("pod binding moved out of a version-1 record", extra={
                    "allocation": record.id, "namespace": binding.pod.namespace,
                    "pod": binding.pod.name, "limit": binding.limit,
                    "memory_limit": binding.memory_limit})
            self.bindings[record.id] = binding
        return binding

    def bind(self, binding: Binding) -> bool:
        """Store a pod binding and apply its terms to the allocation's channel now; False if
        the allocation is no longer served or the file cannot be written (logged)."""
        channel = self.channels.get(binding.id)
        if channel is None:
            return False
        try:
            terms = terms_of(channel.record, binding, self.config.limit_for)
            allocation.write_binding(self.state_dir, binding)
        except RecordError as err:
            log.error("cannot bind: binding not stored", extra={"allocation": binding.id,
                                                                 "error": str(err)})
            return False
        self.bindings[binding.id] = binding
        channel.update(channel.record, binding, terms)
        return True

    def _unbind(self, allocation_id: str) -> None:
        self.bindings.pop(allocation_id, None)
        with contextlib.suppress(OSError, RecordError):
            allocation.remove_binding(self.state_dir, allocation_id)

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio logs, with a traceback, every accept that fails for want of descriptors: a
        hundred lines a second per socket while a tenant holds them all. One line per
        ACCEPT_LOG_INTERVAL instead, with the count; anything else as asyncio would."""
        if not str(context.get("message", "")).startswith(ACCEPT_OUT_OF_RESOURCES):
            loop.default_exception_handler(context)
            return
        self._accept_failures += 1
        now = time.monotonic()
        if now - self._accept_logged >= ACCEPT_LOG_INTERVAL:
            log.error("cannot accept connections (out of descriptors or memory); each socket "
                      "retries every second", extra={"error": str(context.get("exception")),
                                                     "failed_accepts": self._accept_failures})
            self._accept_logged, self._accept_failures = now, 0

    def _trouble(self, message: str, key: str, err: Exception) -> None:
        """Log a passing failure once while it lasts (it is retried at every poll)."""
        if self._troubles.get(key) != str(err):
            self._troubles[key] = str(err)
            log.error(message, extra={"what": key, "error": str(err)})

    def _bind_timeout(self) -> float:
        # Without kubelet's PodResources on this node no pod can be found: never wait.
        return self.config.bind_timeout if self.pods.lister.available() else 0.0

    async def collect(self, allocation_id: str, reason: str) -> None:
        """The allocation's pod is gone: record removed, channel closed, directory removed."""
        async with self._sync_lock:
            channel = self.channels.pop(allocation_id, None)
            record = channel.record if channel else allocation.load_record(self.state_dir,
                                                                           allocation_id)
            allocation.remove_record(self.state_dir, allocation_id)
            if channel is not None:
                await channel.close(reason)
            binding = self.bindings.get(allocation_id)
            self._unbind(allocation_id)
            if record is not None:
                self._remove_channel_dir(record)
                self.allocation_event("collected", record, {"reason": reason}, binding)
            log.info("allocation collected", extra={"allocation": allocation_id,
                                                    "reason": reason})

    def _remove_channel_dir(self, record: AllocationRecord) -> None:
        allocation.remove_channel_dir(self.state_dir, record)

    def allocation_event(self, event: str, record: AllocationRecord,
                         more: dict[str, object], binding: Binding | None = None) -> None:
        if self.mqtt is None:
            return
        binding = binding or self.bindings.get(record.id)
        pod = binding.pod if binding else None
        document: dict[str, Any] = {
            "event": f"allocation-{event}", "allocation": record.id, "origin": record.origin,
            "pod": pod.name if pod else None, "namespace": pod.namespace if pod else None,
            "container": pod.container if pod else None, **more}
        override = binding.memory_limit if binding else None
        for gpu in record.gpus:
            self.mqtt.publish(gpu.uuid, "events", document | {
                "share": gpu.share,
                "memory_limit": gpu.memory_limit if override is None else override})

    async def _publish_usage(self) -> None:
        """MQTT: usage snapshots every mqtt_interval, and health changes as events."""
        assert self.mqtt is not None
        last_health: dict[str, tuple[bool, str]] = {}
        while True:
            status = self.telemetry_status()
            for row in container_rows(status):
                self.mqtt.publish(row.gpu, "usage", row.usage())
            health = self.health.read()
            for uuid, (healthy, reason) in health.items():
                if last_health.get(uuid, (True, "")) != (healthy, reason) and (
                        uuid in last_health or not healthy):
                    self.mqtt.publish(uuid, "events", {
                        "event": "gpu-healthy" if healthy else "gpu-unhealthy",
                        "reason": reason})
            last_health = dict(health)
            await asyncio.sleep(self.config.mqtt_interval)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.pods.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.kube is not None:
            self.kube.close()
        await self.control.close()
        await asyncio.gather(*(c.close("gemini-scheduler stopping", removed=False)
                               for c in self.channels.values()), return_exceptions=True)
        self.channels.clear()
        self.tokens.close()
        log.info("gemini-scheduler stopped")

    def slices_per_gpu(self) -> int:
        """What the plugin cuts a GPU into, as its newest record says (the daemon's own setting
        only where no record says it: records written before they carried it, or none)."""
        said = [(c.record.created_at, g.slices_per_gpu) for c in self.channels.values()
                for g in c.record.gpus if g.slices_per_gpu is not None]
        return max(said)[1] if said else self.config.slices_per_gpu

    def gpu_slices(self) -> dict[str, int]:
        """Each GPU's slice count: its newest record's, else what the plugin advertises."""
        counts = {uuid: c.advertised for uuid, c in self.slice_counts.read().items()}
        newest: dict[str, float] = {}
        for channel in self.channels.values():
            for gpu in channel.record.gpus:
                if gpu.slices_per_gpu is not None and (
                        channel.record.created_at >= newest.get(gpu.uuid, float("-inf"))):
                    newest[gpu.uuid] = channel.record.created_at
                    counts[gpu.uuid] = gpu.slices_per_gpu
        return counts

    def node_status(self) -> dict[str, Any]:
        """The node's GPUs: discovered ones, plus any GPU an allocation names."""
        per_gpu = self.slices_per_gpu()
        health = self.health.read()
        counts = self.gpu_slices()   # a GPU waiting to change count keeps its old one
        allocated: dict[str, int] = {}
        shares: dict[str, float] = {}
        indexes = {g.uuid: g.index for g in self.node_gpus}
        for channel in self.channels.values():
            for gpu in channel.record.gpus:
                slices = gpu.slices_per_gpu or counts.get(gpu.uuid, per_gpu)
                allocated[gpu.uuid] = allocated.get(gpu.uuid, 0) + round(gpu.share * slices)
                shares[gpu.uuid] = shares.get(gpu.uuid, 0.0) + gpu.share
                indexes.setdefault(gpu.uuid, gpu.index)
        found = {g.uuid: g for g in self.node_gpus}
        uuids = [g.uuid for g in self.node_gpus] + sorted(set(allocated) - set(found))
        gpus = []
        for uuid in uuids:
            healthy, reason = health.get(uuid, (True, ""))
            node_gpu = found.get(uuid)
            gpus.append({"uuid": uuid, "index": indexes[uuid],
                         "model": node_gpu.model if node_gpu else "",
                         "memory_total": node_gpu.memory_total if node_gpu else None,
                         "slices": counts.get(uuid, per_gpu),
                         "slices_allocated": allocated.get(uuid, 0),
                         "share_allocated": round(shares.get(uuid, 0.0), 6),
                         "healthy": healthy, "reason": reason})
        return {"name": self.config.node_name, "slices_per_gpu": per_gpu, "gpus": gpus,
                "kubernetes": self.kube is not None, "pod_binds": self.pods.binds,
                "pod_resources_lists": self.pods.lister.lists,
                "mqtt": None if self.mqtt is None else {
                    "connected": self.mqtt.connected, "published": self.mqtt.published,
                    "queued": len(self.mqtt.queue), "dropped": self.mqtt.dropped}}

    def telemetry_status(self) -> dict[str, Any]:
        return self.status({})

    def status(self, _request: dict[str, Any]) -> dict[str, Any]:
        return {
            "daemon": {"pid": os.getpid(), "version": __version__,
                       "state_dir": str(self.state_dir), "started_at": self.started_at,
                       "default_limit": self.config.default_limit,
                       "limit_policy": self.config.limit_policy,
                       "idle_exit": self.config.idle_exit,
                       "token_settings": dataclasses.asdict(self.config.algorithm())
                       | {"idle_release": self.config.idle_release},
                       "ready": self.ready},
            "node": self.node_status(),
            "allocations": [c.snapshot() for _, c in sorted(self.channels.items())],
            "gpus": self.tokens.snapshot(),
            "corrupt_records": [{"path": p, "error": e} for p, e in sorted(self.corrupt.items())],
        }
