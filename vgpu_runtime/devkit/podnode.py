"""A node for pod-awareness tests: kubelet emulator (with PodResources), the real plugin, the
real gemini-daemon process pointed at the emulator, and optionally the fake API server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vgpu_runtime import allocation
from vgpu_runtime.allocation import AllocationRecord, Binding
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.devkit.daemon_process import DaemonProcess
from vgpu_runtime.devkit.plugin_node import PluginNode

T = TypeVar("T")


async def until(predicate: Callable[[], T | None], timeout: float = 10.0,
                what: str = "condition") -> T:
    """Poll without blocking the loop (the emulator serves PodResources from it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class PodNode:
    node: PluginNode
    daemon: DaemonProcess | None = None

    @property
    def state_dir(self) -> Path:
        return self.node.state_dir

    @property
    def pr_socket(self) -> Path:
        return self.node.kubelet.pod_resources_socket

    async def start_daemon(self, *args: str) -> DaemonProcess:
        daemon = DaemonProcess(self.state_dir, "--pod-resources-socket", str(self.pr_socket),
                               "--metrics-port", "0", "--node-name", "node-1", *args)
        self.daemon = daemon

        def ready() -> bool:
            if daemon.proc.poll() is not None:
                raise AssertionError(f"daemon exited:\n{daemon.logs()}")
            try:
                return bool(client.request(self.state_dir)["daemon"]["ready"])
            except OSError:
                return False
        await until(ready, 15, "daemon ready")
        return daemon

    def records(self) -> dict[str, AllocationRecord]:
        return {r.id: r for _, r in allocation.scan_records(self.state_dir)
                if isinstance(r, AllocationRecord)}

    def record_of(self, pod: Any, container: str) -> AllocationRecord | None:
        ids = allocation.id_for_devices(pod.containers[container].device_ids)
        return self.records().get(ids)

    def binding_of(self, pod: Any, container: str) -> Binding | None:
        """The daemon's binding of the container's allocation, once it has written one."""
        ids = allocation.id_for_devices(pod.containers[container].device_ids)
        return allocation.load_binding(self.state_dir, ids)

    def bound_record(self, pod: Any, container: str) -> AllocationRecord | None:
        record = self.record_of(pod, container)
        bound = record is not None and self.binding_of(pod, container) is not None
        return record if bound else None

    async def status(self) -> Any:
        return await asyncio.to_thread(client.request, self.state_dir)
