"""The DevicePlugin gRPC service (grpc.aio) on a Unix socket in the kubelet directory.

ListAndWatch sends the full device list when a stream opens and again after every health
change, to every open stream. Changes that arrive while a stream is sending are coalesced:
each message carries the latest state, which is all kubelet keeps anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from device_plugin import placement
from device_plugin.allocator import AllocationError, Allocator
from device_plugin.health import HealthTracker
from device_plugin.metrics import GpuRow, PluginMetrics
from device_plugin.slices import SliceTable, brief_ids
from device_plugin.socketdir import SocketDirError, why_unbindable
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class DeviceList:
    """The advertised devices with their health, and a wake-up for every open stream."""

    def __init__(self, table: SliceTable, health: HealthTracker,
                 draining: frozenset[str] = frozenset(),
                 metrics: PluginMetrics | None = None) -> None:
        self.table = table
        self.health = health
        # GPUs waiting to change slice count: Unhealthy to kubelet, so that no new pod lands
        # there (device_plugin.slicecounts); running pods keep their devices.
        self.draining = draining
        self.metrics = metrics
        self._waiters: set[asyncio.Event] = set()
        self._message = self._build()
        health.on_change(self.changed)

    def _build(self) -> api_pb2.ListAndWatchResponse:
        if self.metrics is not None:
            self.metrics.set_devices(tuple(
                GpuRow(gpu.uuid, gpu.model, self.table.count_of(gpu.uuid),
                       self.health.is_healthy(gpu.uuid), gpu.uuid in self.draining)
                for gpu in self.table.gpus), lambda: self.streams)
        devices = []
        for item in self.table.all():
            topology = (api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=item.gpu.numa_node)])
                        if item.gpu.numa_node is not None else None)
            devices.append(api_pb2.Device(
                ID=item.id, topology=topology,
                health=HEALTHY if self.health.is_healthy(item.gpu.uuid)
                and item.gpu.uuid not in self.draining else UNHEALTHY))
        return api_pb2.ListAndWatchResponse(devices=devices)

    @property
    def message(self) -> api_pb2.ListAndWatchResponse:
        return self._message

    def changed(self) -> None:
        """Called (on the event loop) after a health change or a new table."""
        self._message = self._build()
        for waiter in self._waiters:
            waiter.set()

    def subscribe(self) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters.add(event)
        return event

    def unsubscribe(self, event: asyncio.Event) -> None:
        self._waiters.discard(event)

    @property
    def streams(self) -> int:
        return len(self._waiters)


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, devices: DeviceList, allocator: Allocator, policy: str,
                 metrics: PluginMetrics | None = None) -> None:
        self.devices = devices
        self.allocator = allocator
        self.policy = policy
        self.metrics = metrics or PluginMetrics()
        self._closing = asyncio.Event()

    def open_streams(self) -> None:
        """Allow streams again (a new server after a kubelet restart)."""
        self._closing = asyncio.Event()

    def close_streams(self) -> None:
        """End every ListAndWatch stream (shutdown, or before serving anew)."""
        self._closing.set()

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Any
                                     ) -> api_pb2.DevicePluginOptions:
        return options()

    async def ListAndWatch(self, request: api_pb2.Empty, context: Any
                           ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        wake = self.devices.subscribe()
        log.info("ListAndWatch stream opened", extra={"streams": self.devices.streams})
        try:
            yield self.devices.message
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                while True:
                    woken = asyncio.ensure_future(wake.wait())
                    await asyncio.wait({woken, closing}, return_when=asyncio.FIRST_COMPLETED)
                    if closing.done():
                        woken.cancel()
                        return
                    wake.clear()
                    yield self.devices.message
            finally:
                closing.cancel()
        finally:
            self.devices.unsubscribe(wake)
            log.info("ListAndWatch stream closed", extra={"streams": self.devices.streams})

    async def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest,
                                     context: Any) -> api_pb2.PreferredAllocationResponse:
        answers = []
        for ask in request.container_requests:
            try:
                chosen = placement.preferred(self.allocator.table, list(ask.available_deviceIDs),
                                             list(ask.must_include_deviceIDs),
                                             ask.allocation_size, self.policy)
            except placement.PlacementError as err:
                log.warning("no preferred allocation", extra={"reason": str(err),
                                                              "size": ask.allocation_size})
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED if err.exhausted
                        else grpc.StatusCode.INVALID_ARGUMENT)
                self.metrics.placement_refused(code.name)
                await context.abort(code, str(err))
            answers.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api_pb2.PreferredAllocationResponse(container_responses=answers)

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Any
                       ) -> api_pb2.AllocateResponse:
        started = time.perf_counter()
        requests = [list(ask.devices_ids) for ask in request.container_requests]
        try:
            answers = self.allocator.allocate_all(requests)
        except AllocationError as err:
            self.metrics.refused(err.code.name, len(requests), time.perf_counter() - started)
            log.warning("Allocate rejected", extra={
                "reason": err.message, "devices": [brief_ids(ids) for ids in requests[:4]],
                "containers": len(requests)})
            await context.abort(err.code, err.message)
        except Exception:   # grpc answers UNKNOWN; counted, then raised as it was
            self.metrics.refused(grpc.StatusCode.UNKNOWN.name, len(requests),
                                 time.perf_counter() - started)
            raise
        self.metrics.allocated(len(answers), time.perf_counter() - started)
        return api_pb2.AllocateResponse(container_responses=answers)

    async def PreStartContainer(self, request: api_pb2.PreStartContainerRequest, context: Any
                                ) -> api_pb2.PreStartContainerResponse:
        # A later issue binds the allocation to its pod here.
        log.info("PreStartContainer", extra={"devices": list(request.devices_ids)})
        return api_pb2.PreStartContainerResponse()


def options() -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(pre_start_required=True,
                                       get_preferred_allocation_available=True)


class PluginServer:
    """One grpc.aio server on the plugin socket; start() again after a kubelet restart."""

    def __init__(self, socket_path: Path, service: DevicePluginService) -> None:
        self.socket_path = socket_path
        self.service = service
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        await self.stop()
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)  # a stale socket from a previous run
        except OSError as err:
            raise SocketDirError(why_unbindable(self.socket_path) or str(err)) from None
        self.service.open_streams()
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(  # type: ignore[no-untyped-call]
            self.service, server)
        try:
            server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError as err:   # grpc's words name no cause
            raise SocketDirError(why_unbindable(self.socket_path) or str(err)) from None
        await server.start()
        self._server = server
        log.info("serving", extra={"socket": str(self.socket_path)})

    async def stop(self, grace: float = 0.5) -> None:
        if self._server is None:
            return
        self.service.close_streams()
        server, self._server = self._server, None
        await server.stop(grace)
        log.info("stopped serving", extra={"socket": str(self.socket_path)})

    async def close(self) -> None:
        """Stop and remove the socket (SIGTERM); there is none where the directory is not one."""
        await self.stop()
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(self.socket_path)
