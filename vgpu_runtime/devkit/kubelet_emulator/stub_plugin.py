"""A tiny in-process device plugin for testing the emulator itself (kubelet's test style)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from vgpu_runtime.devkit.kubelet_emulator.protocol import (
    API_VERSION,
    HEALTHY,
    KUBELET_SOCKET,
    dp,
    dp_grpc,
)

Preference = Callable[[list[str], list[str], int], list[str]]


class StubPlugin(dp_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, directory: Path, resource: str = "example.com/dev", count: int = 4,
                 endpoint: str = "stub.sock", preferred: bool = False,
                 pre_start: bool = False) -> None:
        self.directory = directory
        self.resource = resource
        self.endpoint = endpoint
        self.options = dp.DevicePluginOptions(pre_start_required=pre_start,
                                              get_preferred_allocation_available=preferred)
        self.health = {f"dev-{i}": HEALTHY for i in range(count)}
        self.prefer: Preference = lambda available, must, size: []
        self.allocate_error: str | None = None
        self.allocate_calls: list[list[str]] = []
        self.preferred_calls: list[tuple[list[str], list[str], int]] = []
        self.pre_start_calls: list[list[str]] = []
        self.list_and_watch_calls = 0
        # One queue per open stream: an update or an end goes to the streams open right now.
        self._streams: list[asyncio.Queue[bool]] = []
        self._server: Any = None

    # ---- DevicePlugin service ----

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.list_and_watch_calls += 1
        updates: asyncio.Queue[bool] = asyncio.Queue()
        self._streams.append(updates)
        try:
            while True:
                yield dp.ListAndWatchResponse(devices=[
                    dp.Device(ID=i, health=h,
                              topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=0)]))
                    for i, h in sorted(self.health.items())])
                if not await updates.get():
                    return
        finally:
            self._streams.remove(updates)

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        responses = []
        for req in request.container_requests:
            args = (list(req.available_deviceIDs), list(req.must_include_deviceIDs),
                    req.allocation_size)
            self.preferred_calls.append(args)
            responses.append(dp.ContainerPreferredAllocationResponse(deviceIDs=self.prefer(*args)))
        return dp.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: Any, context: Any) -> Any:
        ids = [list(r.devices_ids) for r in request.container_requests]
        self.allocate_calls += ids
        if self.allocate_error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.allocate_error)
        return dp.AllocateResponse(container_responses=[
            dp.ContainerAllocateResponse(envs={"STUB_DEVICES": ",".join(i)}) for i in ids])

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        self.pre_start_calls.append(list(request.devices_ids))
        return dp.PreStartContainerResponse()

    # ---- control ----

    async def serve(self) -> None:
        self._server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.directory / self.endpoint}")
        await self._server.start()

    async def register(self, version: str = API_VERSION, resource: str | None = None,
                       options: Any = None) -> None:
        async with grpc.aio.insecure_channel(f"unix://{self.directory / KUBELET_SOCKET}") as ch:
            await dp_grpc.RegistrationStub(ch).Register(dp.RegisterRequest(
                version=version, endpoint=self.endpoint,
                resource_name=resource or self.resource, options=options or self.options))

    def set_health(self, device: str, health: str) -> None:
        self.health[device] = health
        for stream in self._streams:
            stream.put_nowait(True)

    def end_stream(self) -> None:
        for stream in self._streams:
            stream.put_nowait(False)

    async def stop(self) -> None:
        if self._server is not None:
            self.end_stream()
            await self._server.stop(None)
            self._server = None
