"""A CUDA program in a pod of the real cluster: the fake driver from the node's CDI spec, the
interposer from Allocate's LD_PRELOAD, the node daemon of the DaemonSet. Its memory limit comes
from the daemon and its launches are gated (it asks the daemon for the token)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cluster.conftest import (
    NODE_IMAGE,
    REPO,
    Cluster,
    create,
    wait_until,
    workload,
)
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.share import Share

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

MiB = 1 << 20
OUT_OF_MEMORY = 2   # CUDA_ERROR_OUT_OF_MEMORY
# The program the container tests drive (standard library only), driven here by fixed lines.
PROGRAM = (REPO / "tests" / "containers" / "launch_loop.py").read_text()


def cuda_pod(cluster: Cluster, name: str, slices: int) -> dict[str, Any]:
    """Prints its allocation id, then the program's answers to: init, meminfo, two allocations
    of half its memory limit (GEMINI_VGPU_MEMORY_LIMIT) and 1 MiB each, 1 s of 1 ms kernels
    synchronised every 4, quit; then the interposer's counters."""
    script = ("echo \"allocation=$GEMINI_ALLOCATION_ID\";"
              " half=$((GEMINI_VGPU_MEMORY_LIMIT / 2 + 1048576));"
              " printf '%s\\n' init meminfo \"alloc $half\" \"alloc $half\""
              " \"loop now 1 1000000 4\" quit | /usr/bin/python3 -c \"$PROGRAM\";"
              " echo '--- stats'; cat /tmp/hook-stats; echo '--- end'; exec sleep 3600")
    # The node image for its Debian userland and python3 (/usr/bin: Allocate's library mount
    # at /opt/gemini/lib hides the image's own virtual environment).
    return workload(cluster, name, slices, image=NODE_IMAGE, script=script,
                    env={"PROGRAM": PROGRAM, "GEMINI_HOOK_STATS": "/tmp/hook-stats"})


def test_a_cuda_program_gets_its_memory_limit_from_the_daemon_and_launches_gated(
        gemini_node: Cluster, cleanup: None) -> None:
    cluster = gemini_node
    create(cluster, cuda_pod(cluster, "cuda", 3))
    out = wait_until("the CUDA program's report", lambda: (
        text if "--- end" in (text := cluster.kubectl("logs", "-n", "default", "cuda",
                                                      check=False)) else None), 120,
        lambda: cluster.kubectl("describe", "pod", "-n", "default", "cuda", check=False))
    allocation_id = out.split("allocation=", 1)[1].split()[0]
    record_path = paths.allocations_dir(cluster.env["gemini_state"]) / f"{allocation_id}.json"
    record = allocation.decode_record(record_path, record_path.read_bytes())
    limit = record.gpus[0].memory_limit
    assert record.gpus[0].share == Share.of_slices(3, 10)
    answers = [json.loads(line) for line in out.split("--- stats")[0].splitlines()
               if line.startswith("{")]
    ready, init, meminfo, first, second, loop = answers[:6]
    assert ready["ready"] and init == {"rc": 0, "rc_ctx": 0}, answers
    # cuMemGetInfo answers with the allocation's limit, not the simulated GPU's 141 GB; a
    # second half of it (and 1 MiB) is refused.
    assert meminfo["rc"] == 0 and meminfo["total"] == limit, (meminfo, limit)
    assert first["rc"] == 0 and second["rc"] == OUT_OF_MEMORY, (first, second)
    assert loop["failures"] == 0 and loop["kernels"] > 0, loop
    stats = dict(line.split("=", 1) for line in
                 out.split("--- stats")[1].split("--- end")[0].splitlines() if "=" in line)
    assert int(stats["kernel_launches"]) >= loop["kernels"], stats
    assert int(stats["token_requests"]) >= 1, stats
