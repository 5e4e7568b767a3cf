"""PyTorch in a real container (runc) built from an Allocate response, on the real GPU.

The node of tests/containers (kubelet emulator, the real plugin on NVML with its default CDI
strategy, the real daemon) admits two pods on the machine's GPU, 3 and 5 slices. Each runs a
PyTorch matmul loop in a runc container whose rootfs is the host's root read-only without the
project (tests/gpu/replay.py): the hook arrives only through /opt/gemini/lib, the channel is the
read-only /run/gemini, the process is uid 1000, the GPU comes from the CDI spec of the real GPU.

Asserted from inside and from the hook's counters (GEMINI_HOOK_STATS, written at exit): the
slice's memory (mem_get_info, OutOfMemoryError beyond it, and the GPU usable afterwards), and the
token fast path: with a neighbour contending, the process asks the daemon about once per grant,
not once per launch. Runs with GEMINI_TEST_GPU=1; runc from $GEMINI_TEST_RUNC or PATH. On the
GPU machine (no runc installed), Debian's package unpacked anywhere does:

    dpkg -x runc_1.1.5+ds1-1+deb12u1_amd64.deb /tmp/runc-root
    export GEMINI_TEST_RUNC=/tmp/runc-root/usr/sbin/runc GEMINI_TEST_GPU=1
    pytest tests/gpu/test_container_replay.py
"""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from tests.containers.node import ContainerNode, Tenant, start_node, stop_node
from tests.gpu.replay import GPU_ROOTFS, REPO, gpu_cdi_spec, need_runtime
from vgpu_runtime.contracts import paths

SLICES = (3, 5)
LOOP_SECONDS = 4.0
FAST_PATH_LAUNCHES = 10

TORCH_PROGRAM = textwrap.dedent(r"""
    import errno, json, os, sys, time
    def loaded_from(fragment):
        with open("/proc/self/maps") as maps:
            return sorted({f[5] for f in (l.split() for l in maps)
                           if len(f) >= 6 and fragment in f[5]})
    def write_refused(directory):
        try:
            open(os.path.join(directory, "probe"), "w").close()
        except OSError as err:
            return err.errno in (errno.EROFS, errno.EACCES)
        return False
    print(json.dumps({"ready": True}), flush=True)
    import torch
    free, total = torch.cuda.mem_get_info()
    facts = {"uid": os.getuid(), "preloaded": loaded_from("libgemini-hook"),
             "channel_ro": write_refused("/run/gemini"), "total": total,
             "project": os.path.exists(sys.argv[2])}
    try:
        torch.empty(total + (1 << 20), dtype=torch.uint8, device="cuda")
        facts["oom"] = False
    except torch.cuda.OutOfMemoryError:
        facts["oom"] = True
    print(json.dumps(facts), flush=True)
    start = float(sys.stdin.readline())
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    while time.time() < start:
        time.sleep(0.001)
    steps = 0
    while time.time() < start + float(sys.argv[1]):
        for _ in range(32):
            a @ b
        torch.cuda.synchronize()
        steps += 1
    print(json.dumps({"matmuls": 32 * steps}), flush=True)
""")


@pytest.fixture
def gpu_node() -> Iterator[ContainerNode]:
    need_runtime()
    pytest.importorskip("torch")
    from vgpu_runtime import hooklib

    node = start_node(simulate_gpus=0, write_cdi=gpu_cdi_spec, library=hooklib.library_path())
    try:
        yield node
    finally:
        stop_node(node)


def run_torch(node: ContainerNode, name: str, slices: int) -> Tenant:
    pod = node.admit(name, slices)
    return node.start(pod, args=(sys.executable, "-c", TORCH_PROGRAM, str(LOOP_SECONDS),
                                 str(REPO)), rootfs=GPU_ROOTFS)


@pytest.mark.gpu
def test_pytorch_in_a_runc_container_gets_its_slice_and_keeps_the_token_fast_path(
        gpu_node: ContainerNode) -> None:
    node = gpu_node
    tenants = [run_torch(node, f"torch-{k}", k) for k in SLICES]
    records = [node.record_of(t.pod) for t in tenants]
    uuid = records[0].gpus[0].uuid
    assert records[1].gpus[0].uuid == uuid
    for tenant, record in zip(tenants, records, strict=True):
        facts = tenant.read(timeout=180)   # a cold PyTorch import and CUDA init
        library = f"{paths.CONTAINER_LIB_DIR}/{record.hook_library}"
        assert facts["preloaded"] == [library], (facts, tenant.container.errors())
        assert facts["uid"] == 1000 and facts["channel_ro"] and not facts["project"], facts
        assert facts["total"] == record.gpus[0].memory_limit, facts
        assert facts["oom"] is True, facts
    before = node.gpu_sample(uuid)
    start = time.time() + 2.0
    for tenant in tenants:
        tenant.send(str(start))
    loops = [tenant.read(timeout=LOOP_SECONDS + 120) for tenant in tenants]
    after = node.gpu_sample(uuid)
    grants = after["grants"] - before["grants"]
    idle = after["idle_releases"] - before["idle_releases"]
    for tenant, loop in zip(tenants, loops, strict=True):
        assert tenant.container.wait() == 0, tenant.container.errors()
        stats = tenant.hook_stats_at_exit()
        assert stats, f"no GEMINI_HOOK_STATS written:\n{tenant.container.errors()}"
        seen = (f"{tenant.pod.name}: {stats} over {loop}; GPU: {grants} grants, {idle} idle "
                f"releases\n{tenant.container.errors()[-2000:]}")
        assert stats["daemon_connects"] == 1 and stats["ungated_launches"] == 0, seen
        assert stats["kernel_launches"] >= loop["matmuls"], seen
        # The fast path: a launch under a valid token asks nobody.
        assert stats["token_requests"] * FAST_PATH_LAUNCHES <= stats["kernel_launches"], seen
    assert grants > 2 and idle * 2 <= grants, (grants, idle)
