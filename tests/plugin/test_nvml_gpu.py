"""On a real GPU: the NVML backend finds it and the plugin process advertises N slices for it.

Synchronous on purpose (asyncio.run inside): GPU machines may lack pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.plugin.fake_kubelet import FakeKubelet
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.containerenv import entitled_memory
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.gpus.nvml import NvmlBackend
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def test_nvml_backend_finds_the_gpu() -> None:
    import pynvml

    backend = NvmlBackend()
    gpus = backend.discover()
    assert gpus, "NVML found no usable GPU"
    for gpu in gpus:
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        assert gpu.uuid == (uuid.decode() if isinstance(uuid, bytes) else uuid)
        assert gpu.uuid.startswith("GPU-")
        assert gpu.memory_total == pynvml.nvmlDeviceGetMemoryInfo(handle).total > 1 << 30
        assert backend.probe(gpu.uuid)
        print(f"GPU {gpu.index}: {gpu.uuid} {gpu.model} {gpu.memory_total} bytes "
              f"minor {gpu.minor} numa {gpu.numa_node}")
    assert not backend.probe("GPU-00000000-0000-0000-0000-000000000000")


async def _advertise(short: Path) -> tuple[list[api_pb2.Device], api_pb2.AllocateResponse]:
    kubelet_dir = short / "kubelet"
    kubelet_dir.mkdir()
    kubelet = FakeKubelet(kubelet_dir)
    await kubelet.start()
    install_hook(paths.default_hook_dir(short / "state"))   # Allocate refuses without it
    proc = subprocess.Popen([sys.executable, "-m", "device_plugin.main", "--kubelet-dir",
                             str(kubelet_dir), "--state-dir", str(short / "state"),
                             "--slices-per-gpu", "10", "--metrics-port", "0"], cwd=REPO)
    try:
        await asyncio.wait_for(kubelet.registered.wait(), 30)
        socket = f"unix://{kubelet_dir / 'gemini-vgpu.sock'}"
        async with grpc.aio.insecure_channel(socket) as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            stream = stub.ListAndWatch(api_pb2.Empty())
            first = await asyncio.wait_for(stream.read(), 10)
            stream.cancel()
            ids = [d.ID for d in first.devices][:3]
            answer = await stub.Allocate(api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]))
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 15) == 0
        return list(first.devices), answer
    finally:
        if proc.poll() is None:
            proc.kill()
        await kubelet.stop()


def test_plugin_advertises_ten_slices_per_real_gpu(short_dir: Path) -> None:
    gpus = NvmlBackend().discover()
    devices, answer = asyncio.run(_advertise(short_dir))
    assert len(devices) == 10 * len(gpus)
    for gpu in gpus:
        mine = [d for d in devices if d.ID.startswith(gpu.uuid + "::")]
        assert [d.ID for d in mine] == [f"{gpu.uuid}::{n}" for n in range(10)]
        assert {d.health for d in mine} == {"Healthy"}
    (container,) = answer.container_responses
    first = gpus[0]
    assert container.envs["CUDA_VISIBLE_DEVICES"] == first.uuid
    assert container.envs[paths.ENV_MEMORY_LIMIT] == str(
        entitled_memory(first.memory_total, 2 << 30, Share.of_slices(3, 10)))
    print(f"advertised {len(devices)} devices; 3 slices get "
          f"{container.envs[paths.ENV_MEMORY_LIMIT]} bytes")
