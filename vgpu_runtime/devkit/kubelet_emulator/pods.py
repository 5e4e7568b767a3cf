"""Pods as the device manager keeps them: per-container devices and the kept Allocate answer."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

RUNNING = "Running"
FAILED = "Failed"


@dataclass
class ContainerAllocation:
    name: str
    init: bool
    requested: int
    device_ids: tuple[str, ...] = ()
    # The ContainerAllocateResponse kept for the pod's life: a restart reuses it.
    response: Any = None
    starts: int = 0
    last_start_error: str | None = None


@dataclass
class Pod:
    name: str
    namespace: str
    resource: str
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    phase: str = RUNNING
    reason: str = ""
    message: str = ""
    containers: dict[str, ContainerAllocation] = field(default_factory=dict)
    # Devices of finished init containers that the app containers may take over.
    reusable: set[str] = field(default_factory=set)

    @property
    def admitted(self) -> bool:
        return self.phase == RUNNING

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def device_ids(self) -> set[str]:
        return {d for c in self.containers.values() for d in c.device_ids}

    def requested(self) -> int:
        """What the scheduler counts: max(any init container, sum of app containers)."""
        init = max((c.requested for c in self.containers.values() if c.init), default=0)
        return max(init, sum(c.requested for c in self.containers.values() if not c.init))
