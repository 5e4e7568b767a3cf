"""What the daemon publishes over MQTT besides its usage rows (mqtt.py has the topics): an event
per allocation change, on each of its GPUs, and a GPU's change of health.

The documents are built by pure functions here; MqttTelemetry publishes them and the usage
snapshots (rows.py) on the publisher it is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vgpu_runtime.allocation import AllocationRecord, Binding
from vgpu_runtime.daemon.pods.node import HealthFile
from vgpu_runtime.daemon.telemetry.rows import container_rows

if TYPE_CHECKING:
    from vgpu_runtime.daemon.telemetry.mqtt import MqttPublisher

Health = dict[str, tuple[bool, str]]    # uuid -> (healthy, reason)


def allocation_documents(event: str, record: AllocationRecord, more: dict[str, object],
                         binding: Binding | None) -> list[tuple[str, dict[str, Any]]]:
    """`allocation-<event>`'s document for each GPU of the record, by GPU uuid: the pod the
    binding names, the GPU's share and the memory limit in force (the binding's override)."""
    pod = binding.pod if binding else None
    document: dict[str, Any] = {
        "event": f"allocation-{event}", "allocation": record.id, "origin": record.origin,
        "pod": pod.name if pod else None, "namespace": pod.namespace if pod else None,
        "container": pod.container if pod else None, **more}
    override = binding.memory_limit if binding else None
    return [(gpu.uuid, document | {
        "share": gpu.share,
        "memory_limit": gpu.memory_limit if override is None else override})
        for gpu in record.gpus]


def health_documents(last: Health, now: Health) -> list[tuple[str, dict[str, Any]]]:
    """The health changes from `last` to `now`, by GPU uuid. A GPU seen for the first time is
    reported only if unhealthy: healthy is what every GPU is until it is said otherwise."""
    return [(uuid, {"event": "gpu-healthy" if healthy else "gpu-unhealthy", "reason": reason})
            for uuid, (healthy, reason) in now.items()
            if last.get(uuid, (True, "")) != (healthy, reason) and (uuid in last or not healthy)]


class MqttTelemetry:
    def __init__(self, mqtt: MqttPublisher, bindings: Callable[[str], Binding | None]) -> None:
        self.mqtt = mqtt
        self.bindings = bindings

    def allocation_event(self, event: str, record: AllocationRecord, more: dict[str, object],
                         binding: Binding | None = None) -> None:
        """Publish `allocation-<event>`; `binding` where the daemon has let it go already."""
        for uuid, document in allocation_documents(event, record, more,
                                                   binding or self.bindings(record.id)):
            self.mqtt.publish(uuid, "events", document)

    async def publish(self, status: Callable[[], dict[str, Any]], health: HealthFile,
                      interval: float) -> None:
        """Usage snapshots every `interval`, and health changes as events."""
        last: Health = {}
        while True:
            for row in container_rows(status()):
                self.mqtt.publish(row.gpu, "usage", row.usage())
            now = health.read()
            for uuid, document in health_documents(last, now):
                self.mqtt.publish(uuid, "events", document)
            last = dict(now)
            await asyncio.sleep(interval)
