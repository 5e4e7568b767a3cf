"""Replays a kubelet ContainerAllocateResponse in a real container, for tests that hold a response
rather than a whole node: a thin use of the kubelet emulator's runtime stage
(vgpu_runtime/devkit/kubelet_emulator/runtime.py says what the container gets), so there is one
replay mechanism.

`gpu_cdi_spec` writes the CDI spec of this machine's real GPUs (what the NVIDIA toolkit writes on
a node), so the plugin's default CDI names resolve; the container's root is then the host's,
read-only (`GPU_ROOTFS`): PyTorch and the driver's libraries live there, the project does not
(its top-level directory is left out).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vgpu_runtime.devkit.kubelet_emulator.runtime import (
    Container,
    ContainerConfig,
    ContainerRuntime,
    Rootfs,
    runc_refusal,
)

REPO = Path(__file__).resolve().parents[2]
# The host's root without the project's top-level directory (unless Python lives under it).
GPU_ROOTFS = Rootfs(host_root=True, exclude=() if Path(sys.prefix).resolve().parts[1]
                    == REPO.parts[1] else (REPO.parts[1],))
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def need_runtime() -> None:
    reason = runc_refusal()
    if reason:
        pytest.skip(reason)


def driver_dir() -> str:
    """Where this process's loader finds libcuda.so.1 (the container is given the same)."""
    ctypes.CDLL("libcuda.so.1")
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libcuda.so"):
                return os.path.dirname(fields[5])
    raise RuntimeError("libcuda.so.1 is loaded but not in /proc/self/maps")


def gpu_cdi_spec(cdi_dir: Path) -> Path:
    """nvidia.com/gpu=<uuid> for every GPU NVML finds: its device node, the control nodes, and
    the driver's library directory on LD_LIBRARY_PATH."""
    import pynvml

    pynvml.nvmlInit()
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            minor = pynvml.nvmlDeviceGetMinorNumber(handle)
            devices.append({"name": uuid if isinstance(uuid, str) else uuid.decode(),
                            "containerEdits": {"deviceNodes": [
                                {"path": f"/dev/nvidia{minor}", "permissions": "rw"}]}})
    finally:
        pynvml.nvmlShutdown()
    spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devices,
            "containerEdits": {
                "env": [f"LD_LIBRARY_PATH={driver_dir()}"],
                "deviceNodes": [{"path": p, "permissions": "rw"} for p in CONTROL_NODES
                                if os.path.exists(p)]}}
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = cdi_dir / "nvidia.com-gpu.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


@contextlib.contextmanager
def replayed(response: Any, config: ContainerConfig, cdi_dir: Path | None = None,
             name: str = "replayed") -> Iterator[Container]:
    """`response` applied by runc to a container running `config`; removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="grp-", dir="/tmp"))
    try:
        with ContainerRuntime(root, cdi_dir) as runtime:
            yield runtime.run(response, config, name=name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
