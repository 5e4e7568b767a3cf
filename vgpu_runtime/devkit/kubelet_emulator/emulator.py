"""The emulated kubelet device manager: registration, device sets, admission, restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from vgpu_runtime.contracts.paths import RESOURCE_NAME
from vgpu_runtime.devkit.kubelet_emulator import protocol
from vgpu_runtime.devkit.kubelet_emulator.endpoint import DialError, PluginEndpoint
from vgpu_runtime.devkit.kubelet_emulator.podresources import PodResourcesServer
from vgpu_runtime.devkit.kubelet_emulator.pods import FAILED, RUNNING, ContainerAllocation, Pod
from vgpu_runtime.devkit.kubelet_emulator.protocol import dp, dp_grpc

log = logging.getLogger(__name__)

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")

DeviceListener = Callable[[str, float], None]


class AllocationError(RuntimeError):
    """Why kubelet could not give a container its devices (shown on the failed pod)."""


def is_extended_resource_name(name: str) -> bool:
    """Kubelet accepts only `<domain>/<name>` outside the kubernetes.io namespace."""
    domain, slash, short = name.partition("/")
    return (bool(slash) and bool(_DOMAIN.match(domain)) and len(domain) <= 253
            and not domain.endswith("kubernetes.io") and len(short) <= 63
            and bool(_NAME.match(short)) and not name.startswith("requests."))


def _rpc_text(err: grpc.aio.AioRpcError) -> str:
    # How a Go gRPC error prints (%v), which is what kubelet puts in the pod's message.
    return f"rpc error: code = {err.code().name.title().replace('_', '')} desc = {err.details()}"


class _RegistrationServicer(dp_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, emulator: KubeletEmulator) -> None:
        self.emulator = emulator

    async def Register(self, request: Any, context: Any) -> Any:
        try:
            await self.emulator._register(request)
        except (DialError, ValueError) as err:
            # Kubelet returns a plain Go error, which gRPC reports as code Unknown.
            await context.abort(grpc.StatusCode.UNKNOWN, str(err))
        return dp.Empty()


class KubeletEmulator:
    """Kubelet's device manager over real Unix sockets, driven from asyncio code.

    `directory` plays /var/lib/kubelet/device-plugins; `pod_resources_socket` plays
    /var/lib/kubelet/pod-resources/kubelet.sock (default: a sibling `pod-resources` dir).
    """

    def __init__(self, directory: str | Path, pod_resources_socket: str | Path | None = None,
                 dial_timeout: float = protocol.DIAL_TIMEOUT_S) -> None:
        self.directory = Path(directory)
        self.pod_resources_socket = Path(
            pod_resources_socket or self.directory.parent / "pod-resources" / "kubelet.sock")
        self.dial_timeout = dial_timeout
        self.endpoints: dict[str, PluginEndpoint] = {}
        # resource -> device ID -> last Device message seen on ListAndWatch
        self.devices: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], Pod] = {}
        self.registrations = 0
        self.device_listeners: list[DeviceListener] = []
        self._server: Any = None
        self._pod_resources = PodResourcesServer(self)
        self._changed = asyncio.Condition()
        self._admission = asyncio.Lock()

    @property
    def socket_path(self) -> Path:
        return self.directory / protocol.KUBELET_SOCKET

    # ---- lifecycle ----

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        await self._server.start()
        await self._pod_resources.start(self.pod_resources_socket)
        log.info("kubelet emulator serving", extra={"socket": str(self.socket_path)})

    async def stop(self) -> None:
        for endpoint in list(self.endpoints.values()):
            await endpoint.close()
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        await self._pod_resources.stop()

    async def restart(self) -> None:
        """Kubelet restarts: sockets wiped, registrations lost, running pods kept."""
        await self.stop()
        self.endpoints.clear()
        for path in self.directory.iterdir():
            if path.name != protocol.CHECKPOINT_FILE and not path.is_dir():
                path.unlink(missing_ok=True)
        # Known resources read back from the checkpoint stay at zero until re-registration.
        for resource in self.devices:
            self.devices[resource] = {}
        await self._notify()
        await self.start()

    async def __aenter__(self) -> KubeletEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- registration and ListAndWatch ----

    async def _register(self, request: Any) -> None:
        if request.version != protocol.API_VERSION:
            raise ValueError(f"requested API version {request.version!r} is not supported by "
                             f"kubelet. Supported version is {protocol.API_VERSION!r}")
        if not is_extended_resource_name(request.resource_name):
            raise ValueError(f"the ResourceName {request.resource_name!r} is invalid")
        endpoint = PluginEndpoint(request.resource_name, self.directory / request.endpoint)
        await endpoint.connect(self.dial_timeout)
        old = self.endpoints.get(request.resource_name)
        self.endpoints[request.resource_name] = endpoint
        self.devices.setdefault(request.resource_name, {})
        self.registrations += 1
        if old is not None:
            await old.close()
        endpoint.watch(self._on_devices, self._on_stream_end)
        log.info("plugin registered", extra={"resource": request.resource_name,
                                             "endpoint": request.endpoint})

    def _on_devices(self, endpoint: PluginEndpoint, devices: Sequence[Any]) -> None:
        if self.endpoints.get(endpoint.resource) is not endpoint:
            return
        self.devices[endpoint.resource] = {d.ID: d for d in devices}
        self._changed_now(endpoint.resource)

    def _on_stream_end(self, endpoint: PluginEndpoint) -> None:
        if self.endpoints.get(endpoint.resource) is not endpoint:
            return
        for device in self.devices.get(endpoint.resource, {}).values():
            device.health = protocol.UNHEALTHY
        self._changed_now(endpoint.resource)

    def _changed_now(self, resource: str) -> None:
        now = time.monotonic()
        for listener in self.device_listeners:
            listener(resource, now)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until the device state satisfies `predicate` (re-checked on every update)."""
        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)
        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"condition not met within {timeout} s; node state:\n"
                                 f"{self.summary()}") from None

    # ---- node status ----

    def resources(self) -> list[str]:
        return sorted(self.devices)

    def healthy_ids(self, resource: str = RESOURCE_NAME) -> set[str]:
        return {i for i, d in self.devices.get(resource, {}).items()
                if d.health == protocol.HEALTHY}

    def capacity(self, resource: str = RESOURCE_NAME) -> int:
        return len(self.devices.get(resource, {}))

    def allocatable(self, resource: str = RESOURCE_NAME) -> int:
        return len(self.healthy_ids(resource))

    def summary(self) -> str:
        return ", ".join(f"{r}: capacity {self.capacity(r)} allocatable {self.allocatable(r)}"
                         for r in self.resources()) or "no resources registered"

    def running_pods(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.phase == RUNNING]

    def in_use(self, resource: str = RESOURCE_NAME) -> set[str]:
        return {d for p in self.running_pods() if p.resource == resource for d in p.device_ids()}

    # ---- admission ----

    async def admit_pod(self, name: str, namespace: str = "default",
                        containers: Iterable[tuple[str, int]] = (),
                        init_containers: Iterable[tuple[str, int]] = (),
                        resource: str = RESOURCE_NAME) -> Pod:
        """Admit a pod as kubelet does; a failed admission returns a Failed pod, never raises."""
        async with self._admission:
            if (namespace, name) in self.pods:
                raise ValueError(f"pod {namespace}/{name} already exists")
            pod = Pod(name, namespace, resource)
            for cname, count in init_containers:
                pod.containers[cname] = ContainerAllocation(cname, True, count)
            for cname, count in containers:
                if cname in pod.containers:
                    raise ValueError(f"container name {cname!r} used twice in pod {name}")
                pod.containers[cname] = ContainerAllocation(cname, False, count)
            self.pods[pod.key] = pod
            try:
                for container in pod.containers.values():
                    await self._allocate_container(pod, container)
                    if container.init:
                        pod.reusable |= set(container.device_ids)
                    else:
                        pod.reusable -= set(container.device_ids)
            except AllocationError as err:
                # kubelet's rejectPod: the Event says the admission message, the pod's status
                # "Pod was rejected: " and that message (seen on the real 1.34 kubelet).
                pod.phase, pod.reason = FAILED, protocol.ADMISSION_ERROR_REASON
                pod.message = (f"{protocol.REJECTED_PREFIX}Allocate failed due to {err}, "
                               "which is unexpected")
                log.info("pod rejected", extra={"pod": name, "error": pod.message})
            self._write_checkpoint()
        if pod.admitted:
            for container in pod.containers.values():
                await self.start_container(pod, container.name)
        return pod

    async def _allocate_container(self, pod: Pod, container: ContainerAllocation) -> None:
        resource, required = pod.resource, container.requested
        if required == 0:
            return
        if resource not in self.devices:
            raise AllocationError(f"cannot allocate unregistered device {resource}")
        chosen = await self._choose_devices(pod, resource, required)
        container.device_ids = tuple(chosen)
        endpoint = self.endpoints.get(resource)
        if endpoint is None or endpoint.stopped:
            raise AllocationError(f"endpoint for {resource} is not connected")
        request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=list(chosen))])
        try:
            response = await endpoint.stub.Allocate(request)
        except grpc.aio.AioRpcError as err:
            raise AllocationError(_rpc_text(err)) from None
        if not response.container_responses:
            raise AllocationError(f"no containers return in allocation response {response}")
        container.response = response.container_responses[0]

    async def _choose_devices(self, pod: Pod, resource: str, required: int) -> list[str]:
        """Kubelet's devicesToAllocate without a topology manager (no NUMA alignment)."""
        chosen: list[str] = []

        def take_from(devices: Iterable[str]) -> bool:
            for device in sorted(devices):
                if len(chosen) == required:
                    break
                if device not in chosen:
                    chosen.append(device)
            return len(chosen) == required

        if take_from(pod.reusable):
            return chosen
        available = self.healthy_ids(resource) - self.in_use(resource)
        needed = required - len(chosen)
        if len(available) < needed:
            raise AllocationError(f"requested number of devices unavailable for {resource}. "
                                  f"Requested: {needed}, Available: {len(available)}")
        endpoint = self.endpoints.get(resource)
        if endpoint is not None and endpoint.options.get_preferred_allocation_available:
            request = dp.PreferredAllocationRequest(container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(available | set(chosen)),
                    must_include_deviceIDs=list(chosen),
                    allocation_size=required)])
            try:
                response = await endpoint.stub.GetPreferredAllocation(request)
            except grpc.aio.AioRpcError as err:
                # kubelet wraps this RPC's error (an Allocate error it passes on as it is).
                raise AllocationError("device plugin GetPreferredAllocation rpc failed with "
                                      f"err: {_rpc_text(err)}") from None
            preferred: list[str] = []
            for answer in response.container_responses:
                preferred += list(answer.deviceIDs)
            # Kept in the plugin's order; only what is really available counts.
            for device in preferred:
                if device in available and device not in chosen and len(chosen) < required:
                    chosen.append(device)
        # A short (or absent) preference is filled silently from the rest.
        if take_from(available):
            return chosen
        raise AllocationError(f"unexpectedly allocated less resources than required. "
                              f"Requested: {required}, Got: {len(chosen)}")

    async def start_container(self, pod: Pod, container_name: str) -> Any:
        """(Re)start a container: PreStartContainer if asked for, then the kept response."""
        container = pod.containers[container_name]
        endpoint = self.endpoints.get(pod.resource)
        container.last_start_error = None
        if (container.device_ids and endpoint is not None
                and endpoint.options.pre_start_required):
            try:
                await endpoint.stub.PreStartContainer(
                    dp.PreStartContainerRequest(devices_ids=list(container.device_ids)))
            except grpc.aio.AioRpcError as err:
                container.last_start_error = _rpc_text(err)
                return None
        container.starts += 1
        return container.response

    async def restart_container(self, namespace: str, name: str, container_name: str) -> Any:
        return await self.start_container(self.pods[(namespace, name)], container_name)

    async def delete_pod(self, name: str, namespace: str = "default") -> None:
        async with self._admission:
            self.pods.pop((namespace, name), None)
            self._write_checkpoint()

    def _by_numa_node(self, resource: str, device_ids: Iterable[str]) -> dict[str, list[str]]:
        known = self.devices.get(resource, {})
        nodes: dict[str, list[str]] = {}
        for device_id in device_ids:
            device = known.get(device_id)
            topology = getattr(device, "topology", None)
            numa = [str(n.ID) for n in topology.nodes] if topology is not None else []
            nodes.setdefault(numa[0] if numa else "-1", []).append(device_id)
        return nodes

    def _write_checkpoint(self) -> None:
        """Kubelet's checkpoint (simplified: no AllocResp, no Checksum): what survives its
        restart. DeviceIDs maps a NUMA node ("-1": none known) to the container's devices on
        it, as the real kubelet's file does (read back by tests/cluster/test_restarts.py)."""
        entries = [{"PodUID": p.uid, "ContainerName": c.name, "ResourceName": p.resource,
                    "DeviceIDs": self._by_numa_node(p.resource, c.device_ids)}
                   for p in self.running_pods() for c in p.containers.values() if c.device_ids]
        data = {"Data": {"PodDeviceEntries": entries,
                         "RegisteredDevices": {r: sorted(d) for r, d in self.devices.items()}}}
        path = self.directory / protocol.CHECKPOINT_FILE
        tmp = path.with_suffix(".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
