"""The daemon: the allocations it serves (allocations.py), their pod bindings (bindings.py) and
the control socket, with the optional parts around them, composed and run.

State lives in the state directory only. On start (including a restart) every record is served
again; clients reconnect and re-declare what they hold with MEM_SET, so nothing is doubled: the
new daemon starts from an empty ledger. Tokens start afresh too: every page is cleared, and a
hook whose token vanished asks again.

Around that core, each optional and none on the token path: the pod watch (pods/pods.py:
binding, annotations, collection), the node's labels and Events through the Kubernetes API
(pods/node_reports.py), the metrics port (telemetry/metrics.py) and MQTT telemetry
(telemetry/events.py, telemetry/mqtt.py).
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

from vgpu_runtime import __version__
from vgpu_runtime.common import securedir
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding
from vgpu_runtime.daemon import nodeview
from vgpu_runtime.daemon.allocations import Allocations
from vgpu_runtime.daemon.bindings import PodBindings
from vgpu_runtime.daemon.channel.pages import log_token_page_kind, token_page_kind
from vgpu_runtime.daemon.channel.tokens import TokenService
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.control import ControlServer, control_socket
from vgpu_runtime.daemon.loop import AcceptFailureLog, event_loop_name
from vgpu_runtime.daemon.mps import MpsControl
from vgpu_runtime.daemon.pods.node import HealthFile, SliceCountsFile, discover_gpus
from vgpu_runtime.daemon.pods.podresources import PodResourcesLister
from vgpu_runtime.daemon.pods.pods import PodWatch
from vgpu_runtime.daemon.troubles import Troubles
from vgpu_runtime.gpus import GpuInfo

if TYPE_CHECKING:
    from vgpu_runtime.daemon.pods.kube import KubeApi
    from vgpu_runtime.daemon.telemetry.events import MqttTelemetry
    from vgpu_runtime.daemon.telemetry.metrics import MetricsServer
    from vgpu_runtime.daemon.telemetry.mqtt import MqttPublisher

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        # The program this daemon runs in, as its status and gemini_vgpu_build_info name it
        # (the host daemon sets gemini-host).
        self.program = "gemini-daemon"
        self.state_dir = Path(config.state_dir)
        self.started_at = time.time()
        self.ready = False   # the first scan is done and the optional parts have started
        self.troubles = Troubles()
        self.tokens = TokenService(config)
        self.bindings = PodBindings(self.state_dir)
        self.allocations = Allocations(config, self.tokens, self.bindings, self.troubles,
                                       self.allocation_event)
        self.pods = PodWatch(
            config, PodResourcesLister(config.pod_resources_socket, config.resource_name,
                                       config.pod_resources_min_interval),
            None, self.allocations.records, self.bindings.get, self.allocations.bind,
            self.allocations.collect, self.allocation_event)
        self.allocations.pods = self.pods
        self.control = ControlServer(control_socket(self.state_dir),
                                     {"status": self.status_request,
                                      "stop": self.stop_request})
        self.node_gpus: list[GpuInfo] = []
        self.health = HealthFile(self.state_dir)
        self.mps = (MpsControl(self.state_dir, config.mps_control, config.mps_manage)
                    if config.mps else None)
        self.slice_counts = SliceCountsFile(self.state_dir)
        self.kube: KubeApi | None = None
        self.metrics: MetricsServer | None = None
        self.metrics_error: str | None = None   # why the asked port is not served
        self.mqtt: MqttPublisher | None = None
        self.telemetry: MqttTelemetry | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def stop(self) -> None:
        self._stop.set()

    def wake(self) -> None:
        """Scan the records now."""
        self._wake.set()

    def bind(self, binding: Binding) -> bool:
        """Store a pod binding and apply it now (Allocations.bind)."""
        return self.allocations.bind(binding)

    # ---- the control socket's ops ----

    async def stop_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """`gemini-vgpu stop`: refused while an allocation is live, unless forced (its hooks
        then gate themselves at their shares until a daemon is back). Live means its record is
        on disk now, not at the last poll: gemini-run removes its record as it exits."""
        await self._records_now()
        live = sorted(self.allocations.channels)
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
                await self.allocations.sync()

    # ---- running ----

    async def run(self) -> None:
        paths.allocations_dir(self.state_dir).mkdir(parents=True, exist_ok=True)
        if self.mps is not None:   # before any channel: a tenant's first context is a client
            await asyncio.to_thread(self.mps.start)
        self.bindings.load()
        try:
            # Also on a node whose channels/ an older version made 0755.
            securedir.make_dir(paths.channels_dir(self.state_dir), paths.CHANNELS_DIR_MODE)
        except (OSError, securedir.InsecureDirectory) as err:
            log.error("cannot make the channels directory private; other host users may reach "
                      "channel sockets", extra={"error": str(err)})
        asyncio.get_running_loop().set_exception_handler(AcceptFailureLog())
        await self.control.start()
        self._start_optional()
        log.info("gemini-daemon started", extra={"state_dir": str(self.state_dir),
                                                    "pid": os.getpid(),
                                                    "node": self.config.node_name,
                                                    "event_loop": event_loop_name()})
        log_token_page_kind()
        if self.config.token_path != "auto":
            log.warning("token_path is deprecated and ignored: the token code is Python alone "
                        "(the C path was removed; BENCHMARKS.md, \"One token implementation\"); "
                        "drop the setting, it goes in the next release",
                        extra={"token_path": self.config.token_path})
        uninstalling: str | None = None
        kept: dict[str, str] = {}
        pods: list[str] = []
        try:
            await self._poll()
            uninstalling = await self._uninstalling()
            if uninstalling is not None:
                kept, pods = await self._collect_unheld(uninstalling)
        finally:
            await self.shutdown(keep_kube=uninstalling is not None)
        if uninstalling is not None:
            await self._clear_node(uninstalling, kept, pods)

    async def _poll(self) -> None:
        """Sync every poll_interval (or when woken) until stopped, or idle for idle_exit."""
        idle_since = time.monotonic()
        while not self._stop.is_set():
            try:
                await self.allocations.sync()
                self.troubles.clear("sync")
            except OSError as err:
                # Exhaustion (descriptors, space, a read-only state directory) must not
                # end the daemon: what it serves goes on, and the next poll tries again.
                self.troubles.report("cannot bring the allocations in line with the records",
                                     "sync", err)
            if self.mps is not None:
                await self.mps.poll({s.peer.uid for c in self.allocations.channels.values()
                                     for s in c.sessions}, self.troubles)
            self.ready = True
            now = time.monotonic()
            if self.allocations.channels or self.allocations.corrupt or self.troubles:
                idle_since = now
            elif self.config.idle_exit and now - idle_since >= self.config.idle_exit:
                log.info("no allocation for idle_exit seconds: exiting",
                         extra={"idle_exit": self.config.idle_exit})
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wait_stop_or_wake(), self.config.poll_interval)
            self._wake.clear()

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
            from vgpu_runtime.daemon.pods.node_reports import NodeReports

            self._spawn(NodeReports(self.kube, config.node_name).report_slice_counts(
                self.slice_counts))
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
                self.metrics_error = err.strerror or str(err)
        if config.mqtt_url:
            from vgpu_runtime.daemon.telemetry.events import MqttTelemetry
            from vgpu_runtime.daemon.telemetry.mqtt import MqttPublisher

            self.mqtt = MqttPublisher(config.mqtt_url, config.node_name,
                                      config.mqtt_topic_prefix, config.mqtt_queue)
            self.telemetry = MqttTelemetry(self.mqtt, self.bindings.get)
            self._spawn(self.mqtt.run())
            self._spawn(self.telemetry.publish(self.telemetry_status, self.health,
                                               config.mqtt_interval))

    async def _discover_and_label(self) -> None:
        """GPUs for labels and metrics (in a thread: NVML may be slow), then the labels."""
        self.node_gpus = await asyncio.to_thread(discover_gpus, self.config.simulate_gpus,
                                                 self.config.simulate_model)
        if self.kube is not None:
            from vgpu_runtime.daemon.pods.node_reports import NodeReports

            await NodeReports(self.kube, self.config.node_name).keep_labels(
                self.node_gpus, self.slices_per_gpu, self.config.node_label_interval)

    def allocation_event(self, event: str, record: AllocationRecord,
                         more: dict[str, object], binding: Binding | None = None) -> None:
        """An allocation changed: published where MQTT is on, nothing otherwise."""
        if self.telemetry is not None:
            self.telemetry.allocation_event(event, record, more, binding)

    # ---- uninstall (daemon/uninstall.py) ----

    async def _uninstalling(self) -> str | None:
        """Why this stop is an uninstall (the pod's DaemonSet gone or being deleted), or None:
        whenever that cannot be told, None, so nothing is removed."""
        name, namespace = self.config.pod_name, self.config.pod_namespace
        if self.kube is None or not name or not namespace:
            return None
        try:
            owner = await self.kube.pod_owner(namespace, name)
            if owner is None or owner[0] != "DaemonSet":
                return None
            state = await self.kube.daemonset_state(namespace, owner[1])
            return None if state == "standing" else f"DaemonSet {namespace}/{owner[1]} {state}"
        except Exception as err:
            log.warning("cannot tell whether the DaemonSet is being deleted; the node's state "
                        "stays", extra={"error": str(err)})
            return None

    async def _collect_unheld(self, why: str) -> tuple[dict[str, str], list[str]]:
        """Collect the allocations no running pod holds; the others are kept: id -> why, and
        the pods ("namespace/name") that hold them."""
        listing = (await self.pods.lister.listing() if self.pods.lister.available()
                   else None)
        kept: dict[str, str] = {}
        pods: set[str] = set()
        for record in self.allocations.records():
            if record.origin != "kubelet" or not record.device_ids:
                kept[record.id] = f"not a pod's allocation ({record.origin})"
                continue
            if listing is None or not listing.ok:
                kept[record.id] = ("PodResources gave no answer"
                                   f"{f' ({listing.error})' if listing else ''}: its pod may run")
                continue
            owner = listing.owner_of(record.device_ids)
            if owner is not None:
                pods.add(f"{owner.namespace}/{owner.name}")
                kept[record.id] = f"pod {owner.namespace}/{owner.name} is running"
                continue
            await self.allocations.collect(record.id, f"uninstall ({why}); no pod holds it")
        log.info("uninstall: allocations of running pods kept, the others collected",
                 extra={"reason": why, "kept": sorted(kept), "pods": sorted(pods)})
        return kept, sorted(pods)

    async def _clear_node(self, why: str, kept: dict[str, str], pods: list[str]) -> None:
        """Remove the state directory's entries no kept allocation uses and the daemon's node
        labels, then say what went and what stayed in an Event on the Node."""
        from vgpu_runtime.daemon import uninstall

        assert self.kube is not None
        node = self.config.node_name
        try:
            cleanup = uninstall.clean_state(self.state_dir, kept)
            try:
                labels = uninstall.node_labels_to_remove(await self.kube.node_labels(node))
                if labels:
                    await self.kube.patch_node_labels(node, labels)
            except Exception as err:
                cleanup.kept["(node labels)"] = f"cannot be removed: {err}"
            message = cleanup.message(pods)
            log.info("uninstalled from this node", extra={
                "reason": why, "removed": cleanup.removed, "kept": cleanup.kept})
            try:
                await self.kube.post_node_event(node, uninstall.REASON, message, kind="Normal")
            except Exception as err:
                log.warning("cannot post the uninstall Event on the node",
                            extra={"error": str(err), "event": message})
        finally:
            self.kube.close()

    async def shutdown(self, keep_kube: bool = False) -> None:
        """Stop everything; the API client stays open where `keep_kube` (an uninstall's last
        words), to be closed by whoever asked."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.pods.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.kube is not None and not keep_kube:
            self.kube.close()
        await self.control.close()
        if self.mps is not None and not self.allocations.channels:
            # With tenants live (a restart under them), their MPS server stays: the next
            # daemon adopts it.
            await asyncio.to_thread(self.mps.quit)
        await self.allocations.close("gemini-daemon stopping")
        self.tokens.close()
        log.info("gemini-daemon stopped")

    # ---- status: `gemini-vgpu status`, /metrics and MQTT read the same answer ----

    def slices_per_gpu(self) -> int:
        return nodeview.slices_per_gpu(self.allocations.records(), self.config.slices_per_gpu)

    def node_status(self) -> dict[str, Any]:
        """The node's GPUs (nodeview.gpu_rows) and the state of the optional parts."""
        per_gpu = self.slices_per_gpu()
        advertised = {uuid: c.advertised for uuid, c in self.slice_counts.read().items()}
        gpus = nodeview.gpu_rows(self.allocations.records(), self.node_gpus,
                                 self.health.read(), advertised, per_gpu)
        return {"name": self.config.node_name, "slices_per_gpu": per_gpu, "gpus": gpus,
                "kubernetes": self.kube is not None, "pod_binds": self.pods.binds,
                "pod_resources_lists": self.pods.lister.lists,
                "mqtt": None if self.mqtt is None else {
                    "connected": self.mqtt.connected, "published": self.mqtt.published,
                    "queued": len(self.mqtt.queue), "dropped": self.mqtt.dropped}}

    def metrics_status(self) -> dict[str, Any] | None:
        """The metrics port: None when off; else where it was asked for, the port served
        (None, with the error, where it could not be had). gemini-run and gemini-vgpu status
        tell the user from it."""
        if not self.config.metrics_port:
            return None
        return {"address": self.config.metrics_address, "asked": self.config.metrics_port,
                "port": None if self.metrics is None else self.metrics.port,
                "error": self.metrics_error}

    def telemetry_status(self) -> dict[str, Any]:
        return self.status({})

    def status(self, _request: dict[str, Any]) -> dict[str, Any]:
        return {
            "daemon": {"pid": os.getpid(), "version": __version__, "program": self.program,
                       "state_dir": str(self.state_dir), "started_at": self.started_at,
                       "default_limit": self.config.default_limit,
                       "limit_policy": self.config.limit_policy,
                       "idle_exit": self.config.idle_exit,
                       "token_pages": token_page_kind(),
                       "token_settings": dataclasses.asdict(self.config.algorithm())
                       | {"idle_release": self.config.idle_release},
                       "ready": self.ready, "metrics": self.metrics_status(),
                       "mps": None if self.mps is None else self.mps.status()},
            "node": self.node_status(),
            "allocations": self.allocations.snapshot(),
            "gpus": self.tokens.snapshot(),
            "corrupt_records": self.allocations.corrupt_records(),
            "unattributed": self.allocations.unattributed(),
        }
