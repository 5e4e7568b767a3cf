"""Registering with kubelet, and doing it again whenever kubelet restarts.

Order matters: kubelet dials the plugin back inside Register, so the plugin serves first.
While kubelet is absent, Register is retried with capped exponential backoff (0.1 s to 5 s).
A kubelet restart wipes every socket in the directory and serves a new kubelet.sock; the plugin
notices either (a new inode for kubelet.sock, or its own socket gone) by polling the directory
every 0.2 s, then serves anew and registers again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc

from device_plugin.server import PluginServer, options
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
POLL_INTERVAL = 0.2
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0
REGISTER_TIMEOUT = 15.0  # kubelet's dial-back alone may take 10 s


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino)


async def register(kubelet_socket: Path, endpoint: str, resource_name: str,
                   timeout: float = REGISTER_TIMEOUT) -> None:
    """One Register call; raises grpc.aio.AioRpcError when kubelet refuses or is absent."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        await stub.Register(api_pb2.RegisterRequest(
            version=API_VERSION, endpoint=endpoint, resource_name=resource_name,
            options=options()), timeout=timeout)


class Registrar:
    """Serve, register, watch for a kubelet restart, repeat, until stop() is called."""

    def __init__(self, server: PluginServer, kubelet_socket: Path, resource_name: str) -> None:
        self.server = server
        self.kubelet_socket = kubelet_socket
        self.resource_name = resource_name
        self.registrations = 0
        self._stopping = asyncio.Event()
        self.registered = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True when stopping."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    def _own_socket_present(self) -> bool:
        return _inode(self.server.socket_path) is not None

    async def _serve_with_backoff(self) -> bool:
        """Start serving; while the kubelet dir is missing or unusable, retry. False if stopping."""
        delay = BACKOFF_FIRST
        while not self._stopping.is_set():
            try:
                await self.server.start()
            except (RuntimeError, OSError) as err:  # grpc raises RuntimeError when bind fails
                log.warning("cannot serve on the plugin socket; retrying", extra={
                    "socket": str(self.server.socket_path), "error": str(err),
                    "retry_in_s": delay})
            else:
                return True
            if await self._sleep(delay):
                break
            delay = min(delay * 2, BACKOFF_MAX)
        return False

    async def run(self) -> None:
        while not self._stopping.is_set():
            if not await self._serve_with_backoff():
                break
            kubelet = await self._register_with_backoff()
            if kubelet is None:
                continue  # our socket vanished while kubelet was away, or stopping
            await self._watch(kubelet)
        await self.server.close()

    async def _register_with_backoff(self) -> tuple[int, int] | None:
        """Register until it works; the kubelet.sock identity it registered with, or None."""
        delay = BACKOFF_FIRST
        endpoint = self.server.socket_path.name
        while not self._stopping.is_set():
            if not self._own_socket_present():
                log.warning("plugin socket disappeared before registering; serving anew")
                return None
            kubelet = _inode(self.kubelet_socket)
            if kubelet is not None:
                try:
                    await register(self.kubelet_socket, endpoint, self.resource_name)
                except grpc.aio.AioRpcError as err:
                    log.warning("Register failed; retrying", extra={
                        "code": err.code().name, "details": err.details(), "retry_in_s": delay})
                else:
                    self.registrations += 1
                    self.registered.set()
                    log.info("registered with kubelet", extra={
                        "resource": self.resource_name, "endpoint": endpoint,
                        "kubelet_socket": str(self.kubelet_socket)})
                    return kubelet
            elif delay == BACKOFF_FIRST:
                log.info("waiting for kubelet", extra={"kubelet_socket": str(self.kubelet_socket)})
            if await self._sleep(delay):
                return None
            delay = min(delay * 2, BACKOFF_MAX)
        return None

    async def _watch(self, kubelet: tuple[int, int]) -> None:
        """Return when kubelet restarted (new kubelet.sock, or our socket wiped) or stopping."""
        while not await self._sleep(POLL_INTERVAL):
            if not self._own_socket_present():
                log.warning("plugin socket removed (kubelet restart?); serving and registering "
                            "again")
                self.registered.clear()
                return
            current = _inode(self.kubelet_socket)
            if current is not None and current != kubelet:
                log.warning("kubelet.sock created anew (kubelet restart); serving and "
                            "registering again")
                self.registered.clear()
                return
