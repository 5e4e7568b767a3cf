"""Real GPUs through NVML (nvidia-ml-py's pynvml)."""

from __future__ import annotations

import logging
from typing import Any

from vgpu_runtime.gpus import DiscoveryError, GpuInfo

log = logging.getLogger(__name__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    name = "nvml"

    def __init__(self) -> None:
        import pynvml  # imported here: the simulated path must not need libnvidia-ml

        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise DiscoveryError(
                f"NVML did not initialise ({err}); is the NVIDIA driver installed and "
                "libnvidia-ml.so.1 visible? Use --simulate-gpus N to run without a GPU."
            ) from None

    def _numa_node(self, handle: Any) -> int | None:
        try:
            node = int(self.nvml.nvmlDeviceGetNumaNodeId(handle))
        except (self.nvml.NVMLError, AttributeError):
            return None
        return node if node >= 0 else None

    def _in_mig_mode(self, handle: Any) -> bool:
        try:
            current, _pending = self.nvml.nvmlDeviceGetMigMode(handle)
        except self.nvml.NVMLError:
            return False  # GPUs without MIG support answer NOT_SUPPORTED
        return bool(current == self.nvml.NVML_DEVICE_MIG_ENABLE)

    def discover(self) -> list[GpuInfo]:
        nvml = self.nvml
        gpus = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                if self._in_mig_mode(handle):
                    log.warning("skipping GPU in MIG mode: sharing MIG instances is not supported",
                                extra={"gpu_index": index, "uuid": uuid})
                    continue
                gpus.append(GpuInfo(
                    index=index,
                    uuid=uuid,
                    model=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    minor=int(nvml.nvmlDeviceGetMinorNumber(handle)),
                    numa_node=self._numa_node(handle),
                ))
        except nvml.NVMLError as err:
            raise DiscoveryError(f"NVML failed while enumerating GPUs: {err}") from None
        return gpus

    def probe(self, uuid: str) -> bool:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
            nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError:
            return False
        return True
