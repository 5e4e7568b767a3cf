"""The interposer on a real GPU (marked gpu): run on the H200 by scripts/gpu-check.

Every test starts the REAL node daemon on a temporary state directory, writes an allocation
record for GPU 0 with an 8 GiB limit, and runs an unmodified program with the hook preloaded
and GEMINI_CHANNEL_DIR set. Tools that are missing (nvcc, torch, nvidia-smi) skip their test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, make_record, wait_served
from vgpu_runtime import hooklib

pytestmark = pytest.mark.gpu
GiB = 1 << 30
LIMIT = 8 * GiB


def gpu0_uuid() -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    finally:
        pynvml.nvmlShutdown()


class GpuNode:
    def __init__(self, root: Path) -> None:
        self.state_dir = root / "state"
        self.state_dir.mkdir()
        self.daemon = DaemonProcess(self.state_dir).wait_ready()
        self.uuid = gpu0_uuid()
        self.record = make_record(self.state_dir, gpus=((self.uuid, LIMIT, 0.5),))
        wait_served(self.record)
        self.hook = hooklib.library_path()

    def env(self, preload: bool = True, **extra: str) -> dict[str, str]:
        import os

        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.uuid, **extra)
        if preload:
            env.update(LD_PRELOAD=str(self.hook), GEMINI_CHANNEL_DIR=self.record.channel_dir)
        return env

    def run(self, argv: list[str], preload: bool = True, timeout: float = 300,
            **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env(preload, **extra), capture_output=True,
                              text=True, timeout=timeout)

    def python(self, code: str, preload: bool = True, **extra: str) -> dict[str, object]:
        proc = self.run([sys.executable, "-c", textwrap.dedent(code)], preload, 300, **extra)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result


@pytest.fixture
def gpu_node() -> Iterator[GpuNode]:
    root = Path(tempfile.mkdtemp(prefix="gmg-"))
    node = GpuNode(root)
    yield node
    node.daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def need_torch() -> None:
    pytest.importorskip("torch")


CUDA_RUNTIME_PROGRAM = r"""
#include <cstdio>
#include <cuda_runtime.h>
__global__ void add(float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
int main() {
    size_t free_b, total_b;
    cudaMemGetInfo(&free_b, &total_b);
    float *x; cudaMalloc(&x, 1 << 20);
    for (int i = 0; i < 100; i++) add<<<1024, 256>>>(x, 1 << 18);
    cudaDeviceSynchronize();
    void *big; cudaError_t over = cudaMalloc(&big, 9ull << 30);
    cudaGetLastError();
    void *ok; cudaError_t fits = cudaMalloc(&ok, 1ull << 30);
    printf("%zu %d %d\n", total_b, (int)over, (int)fits);
    return 0;
}
"""


def test_cuda_runtime_program(gpu_node: GpuNode, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = tmp_path / "prog.cu"
    src.write_text(CUDA_RUNTIME_PROGRAM)
    subprocess.run([nvcc, str(src), "-o", str(tmp_path / "prog")], check=True)
    stats = tmp_path / "stats"
    proc = gpu_node.run([str(tmp_path / "prog")], GEMINI_HOOK_STATS=str(stats))
    assert proc.returncode == 0, proc.stderr
    total, over, fits = proc.stdout.split()
    assert int(total) == LIMIT and int(over) == 2 and int(fits) == 0
    counters = hooklib.read_stats_file(stats)
    assert int(counters["kernel_launches"]) >= 100
    assert int(counters["syncs_observed"]) >= 1      # cudaDeviceSynchronize


def test_torch_synchronisations_end_bursts(gpu_node: GpuNode, tmp_path: Path) -> None:
    # Burst estimation and idle release depend on seeing every host synchronisation; CUDA 13
    # reaches some of them through entry points older hooks never saw (cuCtxSynchronize_v2).
    need_torch()
    stats = tmp_path / "stats"
    gpu_node.python("""
        import json, torch
        x = torch.ones(1024, 1024, device="cuda")
        stream, event = torch.cuda.current_stream(), torch.cuda.Event()
        for _ in range(10):
            y = x @ x
            torch.cuda.synchronize()
            y = x @ x
            stream.synchronize()
            y = x @ x
            event.record()
            event.synchronize()
            y = x @ x
            y.sum().item()
        print(json.dumps({}))
    """, GEMINI_HOOK_STATS=str(stats))
    counters = hooklib.read_stats_file(stats)
    assert int(counters["syncs_observed"]) >= 40, counters


def test_torch_mem_get_info_oom_and_continue(gpu_node: GpuNode) -> None:
    need_torch()
    result = gpu_node.python("""
        import json, torch
        free, total = torch.cuda.mem_get_info()
        x = torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
            oom = False
        except torch.cuda.OutOfMemoryError:
            oom = True
        y = torch.ones(2**20, device="cuda").sum().item()
        print(json.dumps({"total": total, "oom": oom, "after": y}))
    """)
    assert result == {"total": LIMIT, "oom": True, "after": float(2**20)}


def test_torch_expandable_segments_are_limited(gpu_node: GpuNode) -> None:
    need_torch()
    result = gpu_node.python("""
        import json, torch
        keep = [torch.empty(2**30, dtype=torch.uint8, device="cuda") for _ in range(7)]
        try:
            keep += [torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")]
            oom = False
        except torch.cuda.OutOfMemoryError:
            oom = True
        print(json.dumps({"oom": oom}))
    """, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert result == {"oom": True}


TRAIN = """
    import json, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(256, 512, device="cuda")
    target = torch.randint(0, 10, (256,), device="cuda")
    torch.backends.cudnn.deterministic = True
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data), target)
        loss.backward()
        opt.step()
    print(json.dumps({"loss": loss.item()}))
"""


def test_torch_training_is_identical_with_and_without_the_hook(gpu_node: GpuNode) -> None:
    need_torch()
    assert gpu_node.python(TRAIN) == gpu_node.python(TRAIN, preload=False)


def test_torch_cuda_graphs_and_compile(gpu_node: GpuNode) -> None:
    need_torch()
    result = gpu_node.python("""
        import json, torch
        x = torch.randn(1024, 1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x @ x
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = x @ x
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        graph_ok = torch.allclose(y, x @ x, atol=1e-3)
        f = torch.compile(lambda a: torch.nn.functional.gelu(a) * 2)
        compiled_ok = torch.allclose(f(x), torch.nn.functional.gelu(x) * 2, atol=1e-4)
        print(json.dumps({"graph": graph_ok, "compile": compiled_ok}))
    """)
    assert result == {"graph": True, "compile": True}


def test_nvidia_smi_shows_the_limit(gpu_node: GpuNode) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not installed")
    proc = gpu_node.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                         "-i", gpu_node.uuid])
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) == LIMIT >> 20     # MiB
