"""Pod awareness through the whole node: the real daemon process, the kubelet emulator's
PodResources, the real plugin and the fake API server. The wiring of binding, the hello that
waits for its pod with its annotations, and collection of an ended pod; the watcher's rules
(invalid annotations, re-binding, failed or empty Lists, hellos that give up) are
test_pod_watch.py's, in-process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vgpu_runtime import paths
from vgpu_runtime.allocation import AllocationRecord, PodRef
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


async def test_allocation_is_bound_to_its_container(pods: PodNode) -> None:
    pod = await pods.node.kubelet.admit_pod("train", "ml", containers=[("main", 3),
                                                                       ("side", 2)])
    await pods.start_daemon(*FAST)
    main = await until(lambda: pods.bound_record(pod, "main"), 10,
                       "main bound")
    side = await until(lambda: pods.bound_record(pod, "side"), 10,
                       "side bound")
    assert main.pod == PodRef("ml", "train", "main", "")
    assert side.pod == PodRef("ml", "train", "side", "")
    # Everything the plugin wrote is kept.
    assert main.device_ids == pod.containers["main"].device_ids
    assert main.gpus[0].share == pytest.approx(0.3)
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
    assert record is not None and record.pod is None
    await until(paths.channel_socket(record.channel_dir).exists, 10, "channel")
    hello = asyncio.ensure_future(asyncio.to_thread(_hello, record))
    await asyncio.sleep(1.0)
    assert not hello.done(), "hello answered before the pod was known"
    pod.phase = "Running"
    elapsed, reply = await hello
    assert 0.9 < elapsed < 4.0
    assert reply.gpus[0].limit_ppm == 500_000
    assert reply.gpus[0].memory_limit == 4 * GiB
    bound = pods.record_of(pod, "app")
    assert bound is not None and bound.pod == PodRef("default", "infer", "app", "uid-123")
    assert bound.limit == 0.5 and bound.gpus[0].memory_limit == 4 * GiB
    status = await pods.status()
    (tenant,) = [t for g in status["gpus"] for t in g["tenants"] if t["allocation"] == record.id]
    assert tenant["limit"] == 0.5 and tenant["memory_limit"] == 4 * GiB
    assert api.events == []


async def test_ended_pod_is_collected_after_the_grace_period(pods: PodNode) -> None:
    kubelet = pods.node.kubelet
    pod = await kubelet.admit_pod("done", containers=[("app", 2)])
    stays = await kubelet.admit_pod("stays", containers=[("app", 2)])
    await pods.start_daemon(*FAST, "--collect-grace", "1.0")
    record = await until(lambda: pods.bound_record(pod, "app"), 10, "bound")
    await until(paths.channel_socket(record.channel_dir).exists, 10, "channel")
    await kubelet.delete_pod("done")
    deleted = time.monotonic()
    await asyncio.sleep(0.5)
    assert record.id in pods.records(), "collected before the grace period"
    await until(lambda: record.id not in pods.records(), 10, "collection")
    assert time.monotonic() - deleted >= 1.0
    await until(lambda: not Path(record.channel_dir).exists(), 5, "channel dir removed")
    assert pods.record_of(stays, "app") is not None
    status = await pods.status()
    assert record.id not in {a["id"] for a in status["allocations"]}
