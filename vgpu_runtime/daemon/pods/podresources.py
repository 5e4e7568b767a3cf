"""Kubelet's PodResources v1 `List`, over its Unix socket: which container holds which slices.

A `PodResourcesLister` asks on demand but never more often than `min_interval` (kubelet
rate-limits the API at about 100 qps, burst 10); callers that ask sooner get the last answer.
A List that fails, or that names no pod at all (kubelet restarting and not yet knowing its
pods; on a real node at least this daemon's own pod is always listed), comes back with `ok`
False: nothing about ended pods may be concluded from it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from vgpu_runtime.contracts.allocation import PodRef
from vgpu_runtime.kubeletapi.podresources.v1 import api_pb2 as pr
from vgpu_runtime.kubeletapi.podresources.v1 import api_pb2_grpc as _pr_grpc

log = logging.getLogger(__name__)

pr_grpc: Any = _pr_grpc   # generated, untyped
LIST_TIMEOUT = 2.0


@dataclass(frozen=True)
class PodListing:
    ok: bool                                    # a successful, non-empty List
    error: str = ""                             # why not, when not ok
    owners: dict[str, PodRef] = field(default_factory=dict)   # device ID -> its container
    pods: int = 0
    at: float = 0.0                             # time.monotonic() of the answer

    def owner_of(self, device_ids: tuple[str, ...]) -> PodRef | None:
        """The container that holds exactly these slices; None unless one container holds
        them all and no others. A record is one container's allocation, whole: a pod holding
        more (kubelet gave a deleted pod's slices to a bigger one) is another allocation's."""
        owners = {self.owners.get(d) for d in device_ids}
        if len(owners) != 1:
            return None
        owner = owners.pop()
        if owner is None:
            return None
        held = {d for d, o in self.owners.items() if o == owner}
        return owner if held == set(device_ids) else None


class PodResourcesLister:
    def __init__(self, socket_path: str, resource: str, min_interval: float) -> None:
        self.socket_path = socket_path
        self.resource = resource
        self.min_interval = min_interval
        self.lists = 0
        self.last: PodListing | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._lock = asyncio.Lock()

    def available(self) -> bool:
        """Kubelet serves PodResources here (else no allocation can be bound on this node)."""
        return os.path.exists(self.socket_path)

    async def listing(self, max_age: float = 0.0) -> PodListing:
        """A List no older than max(max_age, min_interval)."""
        async with self._lock:
            now = time.monotonic()
            if self.last is not None and now - self.last.at < max(max_age, self.min_interval):
                return self.last
            self.last = await self._list()
            return self.last

    async def _list(self) -> PodListing:
        self.lists += 1
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket_path}")
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        try:
            answer = await self._stub.List(pr.ListPodResourcesRequest(), timeout=LIST_TIMEOUT)
        except grpc.aio.AioRpcError as err:
            await self.close()   # a kubelet restart replaces the socket: dial afresh next time
            return PodListing(False, f"List failed: {err.code().name}: {err.details()}",
                              at=time.monotonic())
        owners: dict[str, PodRef] = {}
        for pod in answer.pod_resources:
            for container in pod.containers:
                for devices in container.devices:
                    if devices.resource_name != self.resource:
                        continue
                    for device_id in devices.device_ids:
                        owners[device_id] = PodRef(pod.namespace, pod.name, container.name)
        pods = len(answer.pod_resources)
        if pods == 0:
            return PodListing(False, "List named no pod (kubelet starting?)", at=time.monotonic())
        return PodListing(True, "", owners, pods, time.monotonic())

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel, self._stub = None, None
