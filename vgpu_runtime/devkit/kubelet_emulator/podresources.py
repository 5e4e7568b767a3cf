"""Kubelet's PodResources v1 API, answering from the emulator's own allocations."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import grpc

from vgpu_runtime.devkit.kubelet_emulator.pods import Pod
from vgpu_runtime.devkit.kubelet_emulator.protocol import pr, pr_grpc


class KubeletEmulator(Protocol):
    """What the PodResources API reads of the emulator (emulator.KubeletEmulator), so the
    emulator depends on this server and not the other way round."""

    devices: dict[str, dict[str, Any]]
    pods: dict[tuple[str, str], Pod]

    def resources(self) -> list[str]: ...

    def healthy_ids(self, resource: str = ...) -> set[str]: ...

    def running_pods(self) -> list[Pod]: ...


def _numa_nodes(device: Any) -> tuple[int, ...]:
    if device is None or not device.HasField("topology"):
        return ()
    return tuple(sorted(node.ID for node in device.topology.nodes))


def _topology(nodes: tuple[int, ...]) -> Any:
    return pr.TopologyInfo(nodes=[pr.NUMANode(ID=n) for n in nodes]) if nodes else None


def container_devices(emulator: KubeletEmulator, resource: str,
                      device_ids: Iterable[str]) -> list[Any]:
    """Devices grouped by NUMA placement, one ContainerDevices per group, as kubelet does."""
    known = emulator.devices.get(resource, {})
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for device_id in sorted(device_ids):
        groups[_numa_nodes(known.get(device_id))].append(device_id)
    return [pr.ContainerDevices(resource_name=resource, device_ids=ids, topology=_topology(n))
            for n, ids in sorted(groups.items())]


def pod_resources(emulator: KubeletEmulator, pod: Pod) -> Any:
    containers = [
        pr.ContainerResources(name=c.name, devices=container_devices(
            emulator, pod.resource, c.device_ids) if c.device_ids else [])
        for c in pod.containers.values()
    ]
    return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)


class _Servicer(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, emulator: KubeletEmulator) -> None:
        self.emulator = emulator

    async def List(self, request: Any, context: Any) -> Any:
        return pr.ListPodResourcesResponse(pod_resources=[
            pod_resources(self.emulator, p) for p in self.emulator.running_pods()])

    async def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        devices = []
        for resource in self.emulator.resources():
            devices += container_devices(self.emulator, resource,
                                         self.emulator.healthy_ids(resource))
        return pr.AllocatableResourcesResponse(devices=devices)

    async def Get(self, request: Any, context: Any) -> Any:
        pod = self.emulator.pods.get((request.pod_namespace, request.pod_name))
        if pod is None or not pod.admitted:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"pod {request.pod_name} in namespace "
                                f"{request.pod_namespace} not found")
        assert pod is not None  # abort() raised
        return pr.GetPodResourcesResponse(pod_resources=pod_resources(self.emulator, pod))


class PodResourcesServer:
    def __init__(self, emulator: KubeletEmulator) -> None:
        self.emulator = emulator
        self._server: Any = None

    async def start(self, socket_path: Path) -> None:
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        socket_path.unlink(missing_ok=True)
        self._server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self.emulator), self._server)
        self._server.add_insecure_port(f"unix://{socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
