"""Pod awareness through the whole node: the real daemon process, the kubelet emulator's
PodResources, the real plugin and the fake API server: binding, the hello that waits for its pod
with its annotations, invalid annotations, re-binding of reused slices, failed or empty Lists and
collection of an ended pod. The watcher's rules are also test_pod_watch.py's, in-process."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.daemon.helpers import list_passes
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, PodRef
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.channel.client import ChannelClient, HelloReply
from vgpu_runtime.devkit.podnode import PodNode, until

if TYPE_CHECKING:
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

GiB = 1 << 30
FAST = ("--pod-resources-interval", "0.1", "--pod-resources-min-interval", "0.05")


def _hello(record: AllocationRecord) -> tuple[float, HelloReply]:
    start = time.monotonic()
    with ChannelClient(paths.channel_socket(record.channel_dir), timeout=15) as client:
        reply = client.hello()
    return time.monotonic() - start, reply


def _connections(pods: PodNode, allocation_id: str) -> int:
    assert pods.daemon is not None
    return len(pods.daemon.allocation(allocation_id)["connections"])


async def _limit_ppm(pods: PodNode, record: AllocationRecord) -> int:
    """The cap the daemon enforces on the record's first GPU, as its status shows it."""
    status = await pods.status()
    entry = next(a for a in status["allocations"] if a["id"] == record.id)
    return int(entry["gpus"][0]["limit_ppm"])


async def test_allocation_is_bound_to_its_container(pods: PodNode) -> None:
    pod = await pods.node.kubelet.admit_pod("train", "ml", containers=[("main", 3),
                                                                       ("side", 2)])
    written = pods.records()
    await pods.start_daemon(*FAST)
    main = await until(lambda: pods.bound_record(pod, "main"), 10,
                       "main bound")
    side = await until(lambda: pods.bound_record(pod, "side"), 10,
                       "side bound")
    assert pods.binding_of(pod, "main") == Binding(main.id, PodRef("ml", "train", "main", ""))
    assert pods.binding_of(pod, "side") == Binding(side.id, PodRef("ml", "train", "side", ""))
    # The record is the plugin's: the daemon never rewrites it.
    assert main == written[main.id] and side == written[side.id]
    assert main.device_ids == pod.containers["main"].device_ids
    assert main.gpus[0].share == Share.of_slices(3, 10)
    status = await pods.status()
    entry = next(a for a in status["allocations"] if a["id"] == main.id)
    assert entry["pod"] == {"namespace": "ml", "name": "train", "container": "main", "uid": ""}
    assert entry["bound"] is True


async def test_hello_waits_for_the_pod_then_gets_its_annotations(
        pods: PodNode, api: FakeApiServer) -> None:
    kubelet = pods.node.kubelet
    pod = await kubelet.admit_pod("infer", containers=[("app", 2)])
    api.add_pod("default", "infer", "uid-123", {"gemini.ai/vgpu-limit": "50%",
                                                "gemini.ai/vgpu-memory": "4GiB"})
    pod.phase = "Pending"   # not in PodResources yet
    await pods.start_daemon(*FAST, "--kubernetes", "true", "--kube-api-url", api.url)
    record = pods.record_of(pod, "app")
    assert record is not None and pods.binding_of(pod, "app") is None
    await until(paths.channel_socket(record.channel_dir).exists, 10, "channel")
    hello = asyncio.ensure_future(asyncio.to_thread(_hello, record))
    await until(lambda: _connections(pods, record.id), 10, "the hello's connection")
    await list_passes(pods)                                # Lists that do not name the pod yet
    assert not hello.done(), "hello answered before the pod was known"
    pod.phase = "Running"
    _, reply = await asyncio.wait_for(hello, 10)
    assert await _limit_ppm(pods, record) == 500_000
    assert reply.gpus[0].memory_limit == 4 * GiB
    assert pods.binding_of(pod, "app") == Binding(
        record.id, PodRef("default", "infer", "app", "uid-123"), Share.from_float(0.5), 4 * GiB)
    assert pods.record_of(pod, "app") == record, "the record holds the entitlement, unchanged"
    status = await pods.status()
    (tenant,) = [t for g in status["gpus"] for t in g["tenants"] if t["allocation"] == record.id]
    assert tenant["limit"] == 0.5 and tenant["memory_limit"] == 4 * GiB
    assert api.events == []


async def test_hello_gives_up_waiting_and_the_defaults_hold(pods: PodNode) -> None:
    pod = await pods.node.kubelet.admit_pod("ghost", containers=[("app", 1)])
    pod.phase = "Pending"   # never listed
    await pods.start_daemon(*FAST, "--bind-timeout", "0.5")
    record = pods.record_of(pod, "app")
    assert record is not None
    await until(paths.channel_socket(record.channel_dir).exists, 10, "channel")
    elapsed, reply = await asyncio.to_thread(_hello, record)
    assert 0.45 < elapsed < 3.0
    assert reply.gpus[0].memory_limit == record.gpus[0].memory_limit
    assert await _limit_ppm(pods, record) == 1_000_000
    assert pods.binding_of(pod, "app") is None


async def test_without_pod_resources_hellos_never_wait(pods: PodNode) -> None:
    # No PodResources socket where the daemon looks: it cannot bind, so hellos never wait.
    pod = await pods.node.kubelet.admit_pod("solo", containers=[("app", 1)])
    record = pods.record_of(pod, "app")
    assert record is not None
    daemon_args = ("--pod-resources-socket", str(pods.node.root / "absent.sock"))
    await pods.start_daemon(*daemon_args)
    await until(paths.channel_socket(record.channel_dir).exists, 10, "channel")
    elapsed, _ = await asyncio.to_thread(_hello, record)
    assert elapsed < 0.5


async def test_invalid_annotations_make_events_and_change_nothing(
        pods: PodNode, api: FakeApiServer) -> None:
    pod = await pods.node.kubelet.admit_pod("bad", containers=[("app", 3)])
    api.add_pod("default", "bad", "uid-bad", {"gemini.ai/vgpu-limit": "0.1",
                                              "gemini.ai/vgpu-memory": "lots"})
    default_memory = pods.record_of(pod, "app").gpus[0].memory_limit  # type: ignore[union-attr]
    await pods.start_daemon(*FAST, "--kubernetes", "true", "--kube-api-url", api.url)
    def two_events() -> list[dict[str, Any]] | None:
        found = api.events_for("default", "bad")
        return found if len(found) >= 2 else None
    events = await until(two_events, 10, "two events")
    assert {e["reason"] for e in events} == {"InvalidVgpuAnnotation"}
    assert all(e["type"] == "Warning" and e["involvedObject"]["uid"] == "uid-bad"
               and e["source"]["host"] == "node-1" for e in events)
    messages = " | ".join(e["message"] for e in events)
    assert "below the pod's request of 0.3" in messages and "vgpu-memory" in messages
    record = pods.record_of(pod, "app")
    binding = pods.binding_of(pod, "app")
    assert record is not None and binding is not None and binding.pod.uid == "uid-bad"
    assert binding.limit is None and binding.memory_limit is None
    assert record.limit is None and record.gpus[0].memory_limit == default_memory
    await asyncio.to_thread(_hello, record)
    assert await _limit_ppm(pods, record) == 1_000_000
    assert pods.daemon is not None and pods.daemon.proc.poll() is None


async def test_ended_pod_is_collected_after_the_grace_period(pods: PodNode) -> None:
    kubelet = pods.node.kubelet
    pod = await kubelet.admit_pod("done", containers=[("app", 2)])
    stays = await kubelet.admit_pod("stays", containers=[("app", 2)])
    await pods.start_daemon(*FAST, "--collect-grace", "1.0")
    record = await until(lambda: pods.bound_record(pod, "app"), 10, "bound")
    await until(paths.channel_socket(record.channel_dir).exists, 10, "channel")
    await kubelet.delete_pod("done")
    deleted = time.monotonic()
    await list_passes(pods)                                # it saw the pod gone ...
    assert record.id in pods.records() or time.monotonic() - deleted >= 1.0, (
        "collected before the grace period")
    await until(lambda: record.id not in pods.records(), 10, "collection")
    assert time.monotonic() - deleted >= 1.0           # ... and kept it the grace through
    await until(lambda: not Path(record.channel_dir).exists(), 5, "channel dir removed")
    assert pods.binding_of(pod, "app") is None, "the binding goes with its allocation"
    assert pods.binding_of(stays, "app") is not None
    assert pods.record_of(stays, "app") is not None
    status = await pods.status()
    assert record.id not in {a["id"] for a in status["allocations"]}


async def test_not_collected_while_list_fails_or_is_empty(pods: PodNode) -> None:
    kubelet = pods.node.kubelet
    pod = await kubelet.admit_pod("kept", containers=[("app", 2)])
    await pods.start_daemon(*FAST, "--collect-grace", "0.5")
    record = await until(lambda: pods.bound_record(pod, "app"), 10, "bound")
    # Kubelet restarting: PodResources away, the pod not listed either. A stopped kubelet
    # removes its socket (no List at all) ...
    saved = dict(kubelet.pods)
    socket_path = kubelet.pod_resources_socket
    await kubelet._pod_resources.stop()
    kubelet.pods.clear()
    await until(lambda: not socket_path.exists(), 10, "the socket removed")
    await asyncio.sleep(0.6)                           # the grace; no List to count
    assert record.id in pods.records(), "collected without PodResources"
    # ... a killed one leaves it behind, refusing: failed Lists.
    socket_path.write_text("")
    await list_passes(pods, after=0.6)
    assert record.id in pods.records(), "collected on a failed List"
    # Back, but not knowing its pods yet: an empty List.
    socket_path.unlink()
    await kubelet._pod_resources.start(socket_path)
    await list_passes(pods, after=0.6)
    assert record.id in pods.records(), "collected on an empty List"
    # A whole emulated kubelet restart keeps running pods: still kept.
    kubelet.pods.update(saved)
    await kubelet.restart()
    await list_passes(pods)                                # Lists naming the pod again
    assert record.id in pods.records()
    # The same daemon does collect once the pod is really gone.
    await kubelet.delete_pod("kept")
    await until(lambda: record.id not in pods.records(), 10, "collection")


async def test_slices_reused_by_a_new_pod_are_bound_to_it(
        pods: PodNode, api: FakeApiServer) -> None:
    # A pod deleted and a new one given the same slices within the collect grace: the same
    # allocation id, but the binding and the limits are the new pod's.
    kubelet = pods.node.kubelet
    first = await kubelet.admit_pod("first", containers=[("app", 3)])
    api.add_pod("default", "first", "uid-first", {"gemini.ai/vgpu-memory": "1GiB"})
    api.add_pod("default", "second", "uid-second", {"gemini.ai/vgpu-memory": "2GiB"})
    await pods.start_daemon(*FAST, "--kubernetes", "true", "--kube-api-url", api.url)
    old = await until(lambda: pods.bound_record(first, "app"), 10, "first bound")
    assert pods.binding_of(first, "app") == Binding(
        old.id, PodRef("default", "first", "app", "uid-first"), None, GiB)
    await kubelet.delete_pod("first")
    second = await kubelet.admit_pod("second", containers=[("app", 3)])
    assert second.admitted
    assert second.containers["app"].device_ids == first.containers["app"].device_ids
    binding = await until(lambda: _bound_to(pods, second, "second"), 10, "second bound")
    record = pods.record_of(second, "app")
    assert record is not None and record.id == old.id
    assert binding == Binding(record.id, PodRef("default", "second", "app", "uid-second"),
                              None, 2 * GiB)
    _, reply = await asyncio.to_thread(_hello, record)
    assert reply.gpus[0].memory_limit == 2 * GiB
    assert api.events == []


async def test_a_rebound_pod_without_annotations_gets_the_defaults(pods: PodNode,
                                                                   api: FakeApiServer) -> None:
    kubelet = pods.node.kubelet
    first = await kubelet.admit_pod("first", containers=[("app", 3)])
    default = pods.record_of(first, "app").gpus[0].memory_limit  # type: ignore[union-attr]
    api.add_pod("default", "first", "uid-first", {"gemini.ai/vgpu-memory": "1GiB",
                                                  "gemini.ai/vgpu-limit": "0.5"})
    api.add_pod("default", "second", "uid-second", {})
    await pods.start_daemon(*FAST, "--kubernetes", "true", "--kube-api-url", api.url)
    old = await until(lambda: pods.bound_record(first, "app"), 10, "first bound")
    first_binding = pods.binding_of(first, "app")
    assert first_binding is not None
    assert (first_binding.memory_limit, first_binding.limit) == (GiB, Share.parse("0.5"))
    await kubelet.delete_pod("first")
    second = await kubelet.admit_pod("second", containers=[("app", 3)])
    binding = await until(lambda: _bound_to(pods, second, "second"), 10, "second bound")
    assert binding.memory_limit is None and binding.limit is None
    record = pods.record_of(second, "app")
    assert record is not None and record.id == old.id and record.gpus[0].memory_limit == default
    _, reply = await asyncio.to_thread(_hello, record)
    assert reply.gpus[0].memory_limit == default
    assert await _limit_ppm(pods, record) == 1_000_000


def _bound_to(pods: PodNode, pod: Any, name: str) -> Binding | None:
    binding = pods.binding_of(pod, "app")
    return binding if binding is not None and binding.pod.name == name else None


async def test_a_process_past_the_limit_by_memory_the_hook_never_saw_gets_an_event(
        pods: PodNode, api: FakeApiServer, tmp_path: Path) -> None:
    """NVML reconciliation: the per-process figure of a connected process puts its container
    past the memory limit; the pod gets a Warning Event naming the process, what it holds and
    the limit (once)."""
    import json
    import os

    pod = await pods.node.kubelet.admit_pod("big", containers=[("app", 3)])
    api.add_pod("default", "big", "uid-big", {})
    figures = tmp_path / "figures.json"
    await pods.start_daemon(*FAST, "--kubernetes", "true", "--kube-api-url", api.url,
                            "--process-memory", "simulated", "--process-memory-file",
                            str(figures), "--process-memory-interval", "0.05")
    record = await until(lambda: pods.bound_record(pod, "app"), 10, "bound")
    limit = record.gpus[0].memory_limit
    me = os.getpid()
    with ChannelClient(paths.channel_socket(record.channel_dir), timeout=15) as client:
        await asyncio.to_thread(client.hello)

        def holds(extra: int) -> None:
            figures.write_text(json.dumps({record.gpus[0].uuid: {str(me): limit + extra}}))

        def charged(extra: int) -> bool:
            assert pods.daemon is not None
            return bool(pods.daemon.allocation(record.id)["gpus"][0]["memory_used"]
                        == limit + extra)

        holds(512 << 20)
        events = await until(lambda: api.events_for("default", "big") or None, 10, "an event")
        for extra in (600 << 20, 512 << 20):           # later readings, still past the limit:
            holds(extra)                               # still one event
            await until(functools.partial(charged, extra), 10, "the reading")
        events = api.events_for("default", "big")
    assert len(events) == 1, events
    event = events[0]
    assert event["reason"] == "GPUMemoryPastLimit" and event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == "uid-big"
    assert f"process {me} holds {(limit >> 20) + 512} MiB" in event["message"]
    assert f"limit of {limit >> 20} MiB" in event["message"]


async def test_a_renamed_resource_is_advertised_and_bound_from_one_node_file() -> None:
    """node.resource_name, set once in the node's file, is what the plugin registers with
    kubelet and what the daemon looks for in PodResources: a pod holding the renamed resource
    is bound to its allocation."""
    from vgpu_runtime.devkit.plugin_node import plugin_node

    renamed = "example.com/shared-gpu"
    async with plugin_node() as node:
        config = node.root / "node.yaml"
        config.write_text(f"version: v1\nnode:\n  resource_name: {renamed}\n")
        await node.start_plugin(args=["--config", str(config)], wait=False)
        await node.kubelet.wait_until(lambda: node.kubelet.allocatable(renamed) == 20, 15)
        assert node.kubelet.capacity() == 0    # nothing registered as gemini.ai/vgpu
        pods = PodNode(node)
        pod = await node.kubelet.admit_pod("renamed", containers=[("app", 3)],
                                           resource=renamed)
        try:
            await pods.start_daemon(*FAST, "--config", str(config))
            record = await until(lambda: pods.bound_record(pod, "app"), 10, "app bound")
            assert pods.binding_of(pod, "app") == Binding(record.id,
                                                          PodRef("default", "renamed", "app", ""))
        finally:
            if pods.daemon is not None:
                assert pods.daemon.stop() == 0, pods.daemon.logs()
