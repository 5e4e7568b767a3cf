"""Kubelet and plugin faults with real processes: the kubelet emulator, the real plugin, the
real node daemon on the plugin's state directory and hooked containers over the fake libcuda."""

from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from tests.daemon.helpers import DaemonProcess, wait_for
from tests.hook.conftest import Hooked
from tests.integration.conftest import PluginNode
from tests.integration.test_plugin_through_kubelet import direct_allocate, record_files
from tests.reliability.clients import Container, MiB
from tests.reliability.test_daemon_faults import ONE_GIB_SLICES, admit_records, used_by
from vgpu_runtime.contracts import allocation, paths, wire
from vgpu_runtime.contracts.allocation import AllocationRecord, RecordError
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.gpus.simulated import simulated_uuid

ADMISSION_ERROR = "UnexpectedAdmissionError"


def served_ids(daemon: DaemonProcess) -> set[str]:
    return {a["id"] for a in daemon.status()["allocations"]}


def wait_serving_exactly(daemon: DaemonProcess, ids: set[str]) -> None:
    wait_for(lambda: served_ids(daemon) == ids, 5, f"daemon serving exactly {sorted(ids)}")


def hello(record: AllocationRecord) -> None:
    """The daemon answers on the allocation's channel with the allocation's own entitlements,
    as a (re)starting container needs."""
    client = ChannelClient(paths.channel_socket(record.channel_dir))
    try:
        reply = client.hello()
        assert reply.status == wire.const("GM_OK"), reply
        assert reply.allocation_id == record.id
        assert [(g.uuid, g.memory_limit) for g in reply.gpus] == [
            (uuid.UUID(g.uuid[4:]).bytes, g.memory_limit) for g in record.gpus]
    finally:
        client.close()


def whole_records(state_dir: Path) -> dict[str, AllocationRecord]:
    """Every record file parses; anything else in the directory is a temporary file that no
    reader ever picks up (scan_records globs *.json)."""
    found: dict[str, AllocationRecord] = {}
    for path, parsed in allocation.scan_records(state_dir):
        assert not isinstance(parsed, RecordError), f"half-written record {path}: {parsed}"
        found[parsed.id] = parsed
    for entry in paths.allocations_dir(state_dir).iterdir():
        assert entry.suffix == ".json" or (entry.name.startswith(".")
                                           and entry.name.endswith(".tmp")), entry
    return found


async def test_kubelet_restart_leaves_running_containers_undisturbed(
        node: PluginNode, daemon: DaemonProcess, hooked: Hooked) -> None:
    """Pass: the plugin registers again within 1 s of the new kubelet.sock, capacity returns to
    20, and the running containers keep their one connection, memory and launches."""
    await node.start_plugin(args=ONE_GIB_SLICES)
    records = await admit_records(node, (3, 5))
    running = [Container(hooked, r) for r in records]
    try:
        held = {c.record.id: 200 * MiB for c in running}
        for c in running:
            assert c.alloc(200 * MiB) == 0
            assert c.step("launch 0.2")["returns"]
        wait_for(lambda: used_by(daemon) == held, 5, "holdings counted")
        await node.kubelet.restart()
        restarted = time.monotonic()
        await node.wait_registered(20, timeout=5)
        elapsed = time.monotonic() - restarted
        print(f"plugin registered again {elapsed * 1000:.0f} ms after kubelet.sock reappeared")
        assert elapsed < 1.0, f"re-registration took {elapsed:.2f} s"
        for c in running:
            assert c.alloc(100 * MiB) == 0
            held[c.record.id] += 100 * MiB
            after = c.step("launch 0.2")
            assert after["returns"] and after["stats"]["daemon_connects"] == 1
        assert used_by(daemon) == held
        assert node.kubelet.in_use() == {d for r in records for d in r.device_ids}
    finally:
        for c in running:
            c.stop()


async def hammer(node: PluginNode, rng: random.Random, acknowledged: dict[str, list[str]],
                 failures: list[grpc.StatusCode]) -> None:
    """Allocate random new slice sets of GPU 1 back to back until the plugin dies."""
    while True:
        ids = sorted(f"{simulated_uuid(1)}::{i}" for i in rng.sample(range(10), rng.randint(1, 5)))
        try:
            await direct_allocate(node, ids)
        except grpc.aio.AioRpcError as err:
            failures.append(err.code())
            return
        acknowledged[allocation.id_for_devices(ids)] = ids


async def admissions(node: PluginNode, rng: random.Random, prefix: str) -> Any:
    """Admit pods back to back, as kubelet would, until one fails; returns the failed pod.
    Each admitted pod is deleted again so the node never runs out of slices."""
    for n in range(10_000):
        size = rng.randint(1, 3)
        pod = await node.kubelet.admit_pod(f"{prefix}-{n}", containers=[("main", size)])
        if not pod.admitted:
            return pod
        await node.kubelet.delete_pod(pod.name)
    raise AssertionError("the plugin never died")


async def test_plugin_sigkill_at_random_moments_of_allocate_leaves_whole_records(
        node: PluginNode, daemon: DaemonProcess) -> None:
    """Pass, after each of several SIGKILLs at random moments of a stream of Allocates: every
    record file is whole, every acknowledged Allocate has its record, the daemon serves exactly
    the whole records, a pod admitted while the plugin is down fails with
    UnexpectedAdmissionError, and the first Allocate after the restart succeeds."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    acknowledged: dict[str, list[str]] = {}
    failures: list[grpc.StatusCode] = []
    admission_messages: list[str] = []
    for round_number in range(4):
        plugin = await node.start_plugin()
        stream = asyncio.create_task(hammer(node, rng, acknowledged, failures))
        admitting = asyncio.create_task(admissions(node, rng, f"r{round_number}"))
        await asyncio.sleep(rng.uniform(0.05, 0.3))
        assert await plugin.stop(signal.SIGKILL) == -signal.SIGKILL
        await asyncio.wait_for(stream, 10)
        cut = await asyncio.wait_for(admitting, 10)
        assert cut.reason == ADMISSION_ERROR, (cut.reason, cut.message)
        admission_messages.append(cut.message)
        await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 0)
        records = whole_records(node.state_dir)
        assert set(acknowledged) <= set(records), "an acknowledged Allocate lost its record"
        wait_serving_exactly(daemon, set(records))
        refused = await node.kubelet.admit_pod(f"down-{round_number}", containers=[("main", 2)])
        assert not refused.admitted and refused.reason == ADMISSION_ERROR, refused
        assert whole_records(node.state_dir).keys() == records.keys()
    assert "skipping allocation record" not in daemon.logs()
    print(f"{len(acknowledged)} allocations acknowledged; in-flight RPCs cut by the kills: "
          f"{[code.name for code in failures]}")
    print("pods cut by the kills:", *admission_messages, sep="\n  ")
    assert len(failures) == 4, "each kill ended a stream of Allocates"
    await node.start_plugin()
    after = await node.kubelet.admit_pod("after", containers=[("main", 3)])
    assert after.admitted, after.message
    assert allocation.id_for_devices(after.device_ids()) in whole_records(node.state_dir)


async def test_plugin_sigkill_then_restart_restores_every_allocation(
        node: PluginNode, daemon: DaemonProcess) -> None:
    """Pass: after SIGKILL and restart the records are byte-for-byte the same, the daemon
    served them throughout, every replayed Allocate returns the same response and writes
    nothing, and a new pod avoids the running pods' slices."""
    plugin = await node.start_plugin()
    pods = [await node.kubelet.admit_pod(name, containers=[("main", k)])
            for name, k in (("a", 3), ("b", 5), ("c", 10))]
    assert all(p.admitted for p in pods)
    records = {r.id: r for r in whole_records(node.state_dir).values()}
    before = record_files(node.state_dir)
    wait_serving_exactly(daemon, set(records))
    assert await plugin.stop(signal.SIGKILL) == -signal.SIGKILL
    await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 0)   # stream ended
    for record in records.values():
        hello(record)                               # the daemon does not need the plugin
    await node.start_plugin()
    assert record_files(node.state_dir) == before
    for pod in pods:
        replayed: Any = await direct_allocate(node, sorted(pod.device_ids()))
        assert replayed == pod.containers["main"].response
    assert record_files(node.state_dir) == before
    assert served_ids(daemon) == set(records)
    fresh = await node.kubelet.admit_pod("d", containers=[("main", 2)])
    running = {d for pod in pods for d in pod.device_ids()}
    assert fresh.admitted and fresh.device_ids().isdisjoint(running)
    assert len(record_files(node.state_dir)) == len(before) + 1
