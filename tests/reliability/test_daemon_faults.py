"""Node daemon faults with real processes: the kubelet emulator admits pods through the real
plugin, the real gemini-daemon serves the records the plugin wrote, and hooked programs over
the fake libcuda hold memory and contend for the token."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for
from tests.hook.conftest import Hooked
from tests.integration.conftest import PluginNode
from tests.reliability.clients import Container, MiB
from vgpu_runtime.contracts import allocation
from vgpu_runtime.contracts.allocation import AllocationRecord

# 12 GiB simulated GPUs, 2 GiB reserve, 10 slices: 1 GiB of memory per slice.
ONE_GIB_SLICES = ("--simulate-memory", "12GiB", "--memory-reserve", "2GiB")


async def admit_records(node: PluginNode, sizes: tuple[int, ...]) -> list[AllocationRecord]:
    """Pods admitted through the emulator; their records, as the plugin wrote them."""
    records = []
    for n, size in enumerate(sizes):
        pod = await node.kubelet.admit_pod(f"p{n}", containers=[("main", size)])
        assert pod.admitted, pod.message
        record = allocation.load_record(node.state_dir, allocation.id_for_devices(pod.device_ids()))
        assert record is not None
        records.append(record)
    return records


@contextmanager
def containers(hooked: Hooked, records: list[AllocationRecord]) -> Iterator[list[Container]]:
    started: list[Container] = []
    try:
        for record in records:
            started.append(Container(hooked, record))
        yield started
    finally:
        for container in started:
            container.stop()


def used_by(daemon: DaemonProcess) -> dict[str, int]:
    """Memory the daemon counts per allocation (GPU 0 of each)."""
    return {a["id"]: int(a["gpus"][0]["memory_used"]) for a in daemon.status()["allocations"]}


def tenants_on_gpu(daemon: DaemonProcess) -> list[Any]:
    return [t for g in daemon.status()["gpus"] for t in g["tenants"]]


@pytest.mark.slow   # a fault case with three containers: CI's lane
async def test_daemon_sigkill_with_three_containers_rebuilds_accounting(
        node: PluginNode, hooked: Hooked) -> None:
    """Pass: every container keeps launching after the restart, its memory is counted once
    (daemon total == sum of what the processes hold), each allocation has one connection, and
    full service (every holding re-declared) returns within 10 s of the SIGKILL (measured)."""
    await node.start_plugin(args=ONE_GIB_SLICES)
    records = await admit_records(node, (3, 3, 3))
    assert len({r.gpus[0].uuid for r in records}) == 1, "best fit packs them on one GPU"
    daemon = DaemonProcess(node.state_dir).wait_ready()
    try:
        with containers(hooked, records) as running:
            held = {c.record.id: (i + 1) * 100 * MiB for i, c in enumerate(running)}
            for c in running:
                assert c.alloc(held[c.record.id]) == 0
            assert used_by(daemon) == held
            for c in running:
                c.send("launch 4")
            def contending() -> bool:             # each has held the token
                tenants = tenants_on_gpu(daemon)
                return len(tenants) == 3 and all(t["achieved"] for t in tenants)
            wait_for(contending, 5, "every container holding the token in turn")
            assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
            killed = time.monotonic()
            daemon = DaemonProcess(node.state_dir).wait_ready(timeout=15)
            answering = time.monotonic() - killed
            wait_for(lambda: used_by(daemon) == held, 10, "every holding re-declared")
            full_service = time.monotonic() - killed
            print(f"daemon answering {answering:.2f} s, full service {full_service:.2f} s "
                  "after SIGKILL")
            restarted_ns = int(killed * 1e9)
            for c in running:
                launched = c.read()
                after = [t for t in launched["returns"] if t > restarted_ns]
                assert after, f"{c.record.id} launched nothing after the restart"
                assert launched["stats"]["daemon_connects"] == 2
            # They go on: more memory is counted once, on top of the re-declared holdings.
            for c in running:
                assert c.alloc(50 * MiB) == 0
                held[c.record.id] += 50 * MiB
            assert used_by(daemon) == held
            assert sum(used_by(daemon).values()) == sum(held.values())
            assert len(tenants_on_gpu(daemon)) == 3
            for entry in daemon.status()["allocations"]:
                assert len(entry["connections"]) == 1, entry
            assert full_service < 10
    finally:
        assert daemon.stop() == 0, daemon.logs()
