"""One registered plugin as kubelet sees it: a gRPC client, its options and its one stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from vgpu_runtime.devkit.kubelet_emulator.protocol import DIAL_TIMEOUT_S, dp, dp_grpc

log = logging.getLogger(__name__)

DevicesCallback = Callable[["PluginEndpoint", Sequence[Any]], None]
StreamEndCallback = Callable[["PluginEndpoint"], None]


class DialError(RuntimeError):
    """The plugin's socket could not be reached or did not answer GetDevicePluginOptions."""


class PluginEndpoint:
    def __init__(self, resource: str, socket_path: Path) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self.channel: Any = None
        self.stub: Any = None
        self.options: Any = dp.DevicePluginOptions()
        self._stream_task: asyncio.Task[None] | None = None
        self.stopped = False

    async def connect(self, timeout: float = DIAL_TIMEOUT_S) -> None:
        """Blocking dial, then GetDevicePluginOptions: what kubelet does inside Register."""
        self.channel = grpc.aio.insecure_channel(f"unix://{self.socket_path}")
        self.stub = dp_grpc.DevicePluginStub(self.channel)
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
            # Kubelet keeps these options, not those the plugin put in its RegisterRequest.
            self.options = await self.stub.GetDevicePluginOptions(dp.Empty(), timeout=timeout)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError) as err:
            await self.close()
            detail = "timed out" if isinstance(err, asyncio.TimeoutError) else err.details()
            raise DialError(
                f"failed to dial device plugin {self.resource} at {self.socket_path}: {detail}"
            ) from None

    def watch(self, on_devices: DevicesCallback, on_end: StreamEndCallback) -> None:
        """Open the single ListAndWatch stream; kubelet never opens a second one."""
        self._stream_task = asyncio.create_task(self._consume(on_devices, on_end))

    async def _consume(self, on_devices: DevicesCallback, on_end: StreamEndCallback) -> None:
        try:
            async for response in self.stub.ListAndWatch(dp.Empty()):
                on_devices(self, list(response.devices))
        except grpc.aio.AioRpcError as err:
            if not self.stopped:
                log.info("ListAndWatch stream ended", extra={"resource": self.resource,
                                                             "code": err.code().name})
        except asyncio.CancelledError:
            return
        if not self.stopped:
            on_end(self)

    async def close(self) -> None:
        """Stop without reporting the stream's end (replaced endpoint, kubelet shutdown)."""
        self.stopped = True
        if self._stream_task is not None:
            self._stream_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stream_task
        if self.channel is not None:
            await self.channel.close()
