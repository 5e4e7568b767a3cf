"""A minimal kubelet Registration server for the plugin's own tests.

Like kubelet, it dials the plugin back inside Register and calls GetDevicePluginOptions, so a
plugin that registers before serving fails here as it would on a node. (The faithful device
manager emulator lives in vgpu_runtime/devkit/kubelet_emulator/.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.requests: list[api_pb2.RegisterRequest] = []
        self.options: list[api_pb2.DevicePluginOptions] = []
        self.registered = asyncio.Event()
        self._server: grpc.aio.Server | None = None

    async def Register(self, request: api_pb2.RegisterRequest, context: Any) -> api_pb2.Empty:
        path = self.directory / request.endpoint
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            try:
                opts = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
            except grpc.aio.AioRpcError as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"dial-back failed: {err}")
        self.requests.append(request)
        self.options.append(opts)
        self.registered.set()
        return api_pb2.Empty()

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            self, self._server)
        self._server.add_insecure_port(f"unix://{self.directory / 'kubelet.sock'}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None

    async def restart(self) -> None:
        """Like a kubelet restart: wipe every socket in the directory, serve kubelet.sock anew."""
        await self.stop()
        for path in self.directory.glob("*.sock"):
            path.unlink()
        self.registered.clear()
        await self.start()


async def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
