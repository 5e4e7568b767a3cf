"""Node labels through the fake API, `kubectl describe node` from the emulator and the fake API,
health from the plugin's health file, and a scrape of the real daemon's /metrics."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from tests import scrape
from tests.scrape import fetch, free_port
from vgpu_runtime import __version__, hooklib
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.devkit.podnode import PodNode, until

if TYPE_CHECKING:
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

MiB = 1 << 20


def kubelet_posts_node_status(pods: PodNode, api: FakeApiServer) -> None:
    """What kubelet's node status updater does with the device manager's counts."""
    kubelet = pods.node.kubelet
    api.set_node_resources("node-1", {paths.RESOURCE_NAME: str(kubelet.capacity())},
                           {paths.RESOURCE_NAME: str(kubelet.allocatable())})


async def test_node_labels_are_patched(pods: PodNode, api: FakeApiServer) -> None:
    api.add_node("node-1", {"kubernetes.io/hostname": "node-1"})
    await pods.start_daemon("--kubernetes", "true", "--kube-api-url", api.url,
                            "--simulate-gpus", "2", "--slices-per-gpu", "10")
    labels = await until(lambda: (lb := api.node("node-1")["metadata"]["labels"]).get(
        "gemini.ai/gpu.count") and lb, 10, "labels")
    assert labels == {"kubernetes.io/hostname": "node-1",
                      "gemini.ai/gpu.model": "Simulated-NVIDIA-H200", "gemini.ai/gpu.count": "2",
                      "gemini.ai/vgpu.slices-per-gpu": "10", "gemini.ai/version": __version__}
    ((node, ctype, _),) = api.patches
    assert node == "node-1" and "merge-patch" in ctype


async def test_describe_node_capacity_health_and_kubelet_restart(
        pods: PodNode, api: FakeApiServer) -> None:
    from vgpu_runtime.devkit.fakeapi import describe_node

    kubelet = pods.node.kubelet
    (plugin,) = pods.node.plugins
    await pods.start_daemon("--kubernetes", "true", "--kube-api-url", api.url,
                            "--simulate-gpus", "2")
    await until(lambda: "gemini.ai/gpu.count" in api.node("node-1")["metadata"]["labels"], 10,
                "labels")
    kubelet_posts_node_status(pods, api)
    text = describe_node(api.node("node-1"))
    print(text)
    assert "gemini.ai/gpu.count=2" in text and "gemini.ai/vgpu.slices-per-gpu=10" in text
    assert text.split("Allocatable:")[0].endswith("gemini.ai/vgpu:  20\n")
    assert text.split("Allocatable:")[1].strip() == "gemini.ai/vgpu:  20"

    plugin.inject({"gpu": 0, "xid": 79})
    await kubelet.wait_until(lambda: kubelet.allocatable() == 10)
    kubelet_posts_node_status(pods, api)
    text = describe_node(api.node("node-1"))
    assert "Capacity:\n  gemini.ai/vgpu:  20" in text
    assert "Allocatable:\n  gemini.ai/vgpu:  10" in text
    # The daemon sees the same health through the plugin's health file.
    status = await pods.status()
    health = {g["uuid"]: g["healthy"] for g in status["node"]["gpus"]}
    assert sorted(health.values()) == [False, True]

    await kubelet.restart()
    kubelet_posts_node_status(pods, api)
    assert "Capacity:\n  gemini.ai/vgpu:  0" in describe_node(api.node("node-1"))
    await kubelet.wait_until(lambda: kubelet.capacity() == 20, timeout=15)
    kubelet_posts_node_status(pods, api)
    assert "Capacity:\n  gemini.ai/vgpu:  20" in describe_node(api.node("node-1"))


async def test_metrics_endpoint_of_the_real_daemon(pods: PodNode) -> None:
    kubelet = pods.node.kubelet
    port = free_port()
    await pods.start_daemon("--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                            "--simulate-gpus", "2", "--pod-resources-interval", "0.1")
    base = f"http://127.0.0.1:{port}"
    assert await asyncio.to_thread(fetch, f"{base}/healthz") == (200, "ok\n")
    assert (await asyncio.to_thread(fetch, f"{base}/readyz"))[0] == 200
    assert (await asyncio.to_thread(fetch, f"{base}/nope"))[0] == 404
    one = await kubelet.admit_pod("a", "ml", containers=[("main", 3)])
    two = await kubelet.admit_pod("b", "ml", containers=[("main", 4)])
    first = await until(lambda: pods.bound_record(one, "main"), 10, "a bound")
    second = await until(lambda: pods.bound_record(two, "main"), 10, "b bound")
    assert first.gpus[0].uuid == second.gpus[0].uuid   # best fit: the same GPU

    def work() -> None:
        with ChannelClient(paths.channel_socket(first.channel_dir)) as a, \
                ChannelClient(paths.channel_socket(second.channel_dir)) as b:
            a.hello()
            b.hello()
            assert a.reserve(0, 100 * MiB).granted
            assert not a.reserve(0, first.gpus[0].memory_limit).granted   # refused: over
            for _ in range(3):
                a.request_token(0)
                a.release_token(0)
                b.request_token(0)
                b.release_token(0)
            status, text = fetch(f"{base}/metrics")
            assert status == 200
            samples = scrape.samples(text)
            labels = {"pod": "a", "namespace": "ml", "container": "main",
                      "allocation": first.id, "gpu": first.gpus[0].uuid}

            def value(name: str, want: dict[str, str] = labels) -> float:
                (found,) = [s for s in samples[name]
                            if all(s.labels.get(k) == v for k, v in want.items())]
                return float(found.value)
            assert value("gemini_vgpu_container_request_ratio") == 0.3
            assert value("gemini_vgpu_container_limit_ratio") == 1.0
            assert value("gemini_vgpu_container_memory_used_bytes") == 100 * MiB
            assert value("gemini_vgpu_container_memory_limit_bytes") == first.gpus[0].memory_limit
            assert value("gemini_vgpu_memory_refusals_total") == 1
            assert 0 <= value("gemini_vgpu_container_achieved_ratio") <= 1
            charged = value("gemini_vgpu_container_gpu_seconds_total")
            assert charged > 0   # three grants, each charged at its release
            assert value("gemini_vgpu_token_wait_seconds_count") >= 3
            assert value("gemini_vgpu_token_wait_seconds_bucket",
                         labels | {"le": "+Inf"}) == value("gemini_vgpu_token_wait_seconds_count")
            gpu = {"gpu": first.gpus[0].uuid, "model": "Simulated NVIDIA H200"}
            assert value("gemini_vgpu_gpu_slices", gpu) == 10
            assert value("gemini_vgpu_gpu_slices_allocated", gpu) == 7
            assert value("gemini_vgpu_gpu_healthy", gpu) == 1
            assert len(samples["gemini_vgpu_gpu_slices"]) == 2
            from vgpu_runtime import __version__
            assert value("gemini_vgpu_build_info", {
                "version": __version__, "interposer": hooklib.library_name(),
                "program": "gemini-daemon"}) == 1
            # gemini-vgpu status reads the same figures from the same snapshot.
            from vgpu_runtime.daemon.channel import client
            answer = client.request(pods.state_dir)
            (tenant,) = [t for g in answer["gpus"] for t in g["tenants"]
                         if t["allocation"] == first.id]
            assert tenant["memory_used"] == 100 * MiB and tenant["waits"]["count"] >= 3
            assert tenant["charged_s"] == charged   # nothing ran since the scrape
            print(json.dumps(answer["node"]))
    await asyncio.to_thread(work)


async def test_slices_per_gpu_come_from_the_plugins_records(pods: PodNode,
                                                           api: FakeApiServer) -> None:
    """The plugin cuts GPUs into 10 slices; a daemon set to 4 takes the records' word: in its
    node label once a record says it, and in the slices it counts as allocated."""
    api.add_node("node-1", {})
    await pods.start_daemon("--kubernetes", "true", "--kube-api-url", api.url,
                            "--simulate-gpus", "2", "--slices-per-gpu", "4",
                            "--node-label-interval", "0.1", "--pod-resources-interval", "0.1")
    label = "gemini.ai/vgpu.slices-per-gpu"
    await until(lambda: api.node("node-1")["metadata"]["labels"].get(label) == "4", 10,
                "the daemon's own setting while no record says otherwise")
    pod = await pods.node.kubelet.admit_pod("a", containers=[("main", 3)])
    record = await until(lambda: pods.record_of(pod, "main"), 10, "record")
    assert record.gpus[0].slices_per_gpu == 10
    await until(lambda: api.node("node-1")["metadata"]["labels"].get(label) == "10", 10,
                "the label the plugin's record gives")
    node = (await pods.status())["node"]
    assert node["slices_per_gpu"] == 10
    (gpu,) = [g for g in node["gpus"] if g["uuid"] == record.gpus[0].uuid]
    assert (gpu["slices"], gpu["slices_allocated"]) == (10, 3)
