"""Simulated GPUs: stable UUIDs, a model name and a memory size, for machines without a GPU."""

from __future__ import annotations

import uuid as uuidlib

from vgpu_runtime.gpus import GpuInfo

# Fixed namespace: the same index always yields the same UUID, across restarts and machines.
_NAMESPACE = uuidlib.UUID("6f1c2d0e-5b7a-4c39-9e8d-2a4b6c8d0e1f")

DEFAULT_MODEL = "Simulated NVIDIA H200"
DEFAULT_MEMORY = 141 * 1000**3


def simulated_uuid(index: int) -> str:
    return "GPU-" + str(uuidlib.uuid5(_NAMESPACE, f"gemini-simulated-gpu-{index}"))


class SimulatedBackend:
    name = "simulated"

    def __init__(self, count: int, model: str = DEFAULT_MODEL, memory: int = DEFAULT_MEMORY,
                 numa_nodes: int = 1) -> None:
        if count < 1:
            raise ValueError("a simulated node needs at least one GPU")
        self.gpus = [
            GpuInfo(index=i, uuid=simulated_uuid(i), model=model, memory_total=memory, minor=i,
                    numa_node=i * numa_nodes // count)
            for i in range(count)
        ]
        # Whether each GPU answers queries; health tests flip this to model a dead GPU.
        self.usable: dict[str, bool] = {gpu.uuid: True for gpu in self.gpus}

    def discover(self) -> list[GpuInfo]:
        return list(self.gpus)

    def probe(self, uuid: str) -> bool:
        return self.usable.get(uuid, False)
