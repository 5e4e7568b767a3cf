"""GPU discovery: what GPUs this node has, separated from serving them.

One interface, two backends: NVML (real GPUs, through nvidia-ml-py's pynvml) and a simulated
backend with stable UUIDs, so that the plugin, the demo and the tests run on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuInfo:
    index: int              # NVML index on this node
    uuid: str               # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    model: str
    memory_total: int       # bytes
    minor: int              # /dev/nvidia<minor>
    numa_node: int | None   # None where NVML gives none


class DiscoveryError(RuntimeError):
    """GPUs could not be enumerated; the message says what to check."""


class Backend(Protocol):
    name: str

    def discover(self) -> list[GpuInfo]:
        """The usable GPUs, in index order. GPUs in MIG mode are skipped with a log line."""
        ...

    def probe(self, uuid: str) -> bool:
        """True when the GPU answers queries (the health recovery rule uses this)."""
        ...
