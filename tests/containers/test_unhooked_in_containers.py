"""NVML reconciliation for a pod in a real container (runc: its own pid and mount namespaces, a
non-root uid): the container's program loads libcuda with dlmopen, so the interposer Allocate
preloaded never sees it, and allocates past the pod's memory limit. The daemon reads the fake
NVML (which names the process by its host pid, as the driver does), finds the pod's channel
mounted in the process's mount namespace, charges and reports it (a Warning Event on the pod)
and, with over_limit_action=kill, kills it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.containers.node import ContainerNode, node_on_fake_api
from tests.daemon.helpers import wait_for
from vgpu_runtime.devkit.kubelet_emulator import Pod

GiB, MiB = 1 << 30, 1 << 20
KILLED = (137, -9)   # runc run's status for a SIGKILLed container process, or its own


@pytest.fixture(scope="module")
def killing_node() -> Iterator[ContainerNode]:
    with node_on_fake_api(fake_nvml=True, daemon_extra=("--over-limit-action", "kill")) as node:
        yield node


def gpu_of(node: ContainerNode, allocation: str) -> dict[str, Any]:
    entry = node.daemon.allocation(allocation)
    assert entry is not None
    gpu: dict[str, Any] = entry["gpus"][0]
    return gpu


def test_a_container_process_that_bypasses_the_hook_is_reported_and_killed(
        killing_node: ContainerNode) -> None:
    node = killing_node
    pod: Pod = node.admit("bypasser", 2, {"gemini.ai/vgpu-memory": "1GiB"})
    try:
        record = node.record_of(pod)
        tenant = node.start(pod)
        pid = tenant.container.pid()
        assert tenant.step(f"bypass {3 * GiB}") == {"rc": 0}, tenant.container.errors()
        allocated = time.monotonic()
        code = tenant.container.proc.wait(10)
        took = time.monotonic() - allocated
        assert code in KILLED, (code, tenant.container.errors(), node.logs())
        gpu = gpu_of(node, record.id)
        assert gpu["over_limit_kills"] == 1, gpu
        report = gpu["over_limit"]
        assert report["pid"] == pid and report["killed"] == pid, report
        assert report["connected"] is False and report["process_bytes"] >= 3 * GiB, report
        assert report["limit"] == GiB, report
        # The report's Event and the kill's are posted concurrently: either may land first.
        def both_events() -> str:
            messages = " | ".join(e["message"] for e in node.api.events_for("default", "bypasser")
                                  if e["reason"] == "GPUMemoryPastLimit")
            return (messages if f"process {pid} holds" in messages
                    and f"killed process {pid}" in messages else "")
        messages = wait_for(both_events, 5, "the report's and the kill's Events")
        assert "no connection" in messages, messages
        wait_for(lambda: gpu_of(node, record.id)["memory_used"] == 0, 5, "uncharged")
        print(f"killed {took:.2f} s after the allocation")
    finally:
        node.delete(pod)
