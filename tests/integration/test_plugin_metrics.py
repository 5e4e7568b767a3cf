"""The device plugin's /metrics, scraped over HTTP from the real process driven through the
kubelet emulator: allocations served and refused, Allocate's latency, health, slices."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.integration.conftest import PluginNode
from tests.integration.test_plugin_through_kubelet import direct_allocate
from tests.scrape import fetch, free_port, samples, scrape, value
from vgpu_runtime import __version__, hooklib
from vgpu_runtime.gpus.simulated import simulated_uuid

GPU0, GPU1 = simulated_uuid(0), simulated_uuid(1)
MODEL = "Simulated NVIDIA H200"


async def test_metrics_of_the_real_plugin(node: PluginNode) -> None:
    port = free_port()
    plugin = await node.start_plugin(args=["--metrics-port", str(port),
                                           "--metrics-address", "127.0.0.1"])
    kubelet = node.kubelet
    found = samples(await asyncio.to_thread(scrape, port))
    assert value(found, "gemini_vgpu_build_info", version=__version__,
                 interposer=hooklib.library_name(), program="gemini-device-plugin") == 1
    for gpu in (GPU0, GPU1):
        assert value(found, "gemini_vgpu_plugin_gpu_slices_advertised", gpu=gpu,
                     model=MODEL) == 10
        assert value(found, "gemini_vgpu_plugin_gpu_healthy", gpu=gpu) == 1
        assert value(found, "gemini_vgpu_plugin_gpu_draining", gpu=gpu) == 0
    assert value(found, "gemini_vgpu_plugin_listandwatch_streams") == 1   # kubelet's
    assert value(found, "gemini_vgpu_plugin_allocations_served_total") == 0
    assert value(found, "gemini_vgpu_plugin_allocate_duration_seconds_count") == 0
    assert not [n for n in found if n.endswith("_created")]

    # Two pods served (3 and 5 slices, best fit: both on GPU 0); one refused placement: 11
    # slices fit the node's 12 free ones only as part of a GPU and all of another.
    for name, count in (("a", 3), ("b", 5)):
        assert (await kubelet.admit_pod(name, containers=[("main", count)])).admitted
    refused = await kubelet.admit_pod("split", containers=[("main", 11)])
    assert not refused.admitted, refused
    # A critical XID on GPU 1: unhealthy there, and its slices leave kubelet's allocatable.
    plugin.inject({"gpu": 1, "xid": 79})
    await kubelet.wait_until(lambda: kubelet.allocatable() == 10)
    # Two Allocate calls refused, as a client past kubelet's checks would see them.
    with pytest.raises(grpc.aio.AioRpcError) as sick:
        await direct_allocate(node, [f"{GPU1}::0"])
    assert sick.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as alien:
        await direct_allocate(node, ["GPU-not-here::0"])
    assert alien.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    found = samples(await asyncio.to_thread(scrape, port))
    assert value(found, "gemini_vgpu_plugin_allocations_served_total") == 2
    for code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        assert value(found, "gemini_vgpu_plugin_allocations_failed_total", code=code) == 1
    assert value(found, "gemini_vgpu_plugin_placements_failed_total",
                 code="INVALID_ARGUMENT") == 1
    assert value(found, "gemini_vgpu_plugin_allocate_duration_seconds_count") == 4
    assert value(found, "gemini_vgpu_plugin_allocate_duration_seconds_bucket", le="+Inf") == 4
    assert 0 < value(found, "gemini_vgpu_plugin_allocate_duration_seconds_sum") < 30
    assert value(found, "gemini_vgpu_plugin_gpu_healthy", gpu=GPU1) == 0
    assert value(found, "gemini_vgpu_plugin_gpu_healthy", gpu=GPU0) == 1
    assert await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/nope") == (
        404, "not found: try /metrics\n")


async def test_the_port_is_the_plugins_own_and_can_be_off(node: PluginNode) -> None:
    from vgpu_runtime.common.metrics import PLUGIN_PORT
    from vgpu_runtime.pluginconfig import PluginConfig

    assert PluginConfig().metrics_port == PLUGIN_PORT == 9403
    # A port that is taken: the plugin says so and serves kubelet all the same.
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        await node.start_plugin(args=["--metrics-port", str(taken),
                                      "--metrics-address", "127.0.0.1"])
        log = node.plugins[0].log_text()
        assert "metrics port unavailable; running without /metrics" in log, log


async def test_device_rows_follow_the_device_list() -> None:
    """A GPU waiting to change its slice count reads draining; a new table its new count."""
    from device_plugin.health import HealthTracker
    from device_plugin.metrics import PluginMetrics
    from device_plugin.server import DeviceList
    from device_plugin.slices import SliceTable
    from tests.scrape import samples as parse
    from vgpu_runtime.gpus.simulated import SimulatedBackend

    gpus = SimulatedBackend(2).discover()
    metrics = PluginMetrics()
    tracker = HealthTracker([g.uuid for g in gpus], (), 300)
    devices = DeviceList(SliceTable(gpus, 10), tracker, frozenset({GPU1}), metrics)
    found = parse(metrics.render().decode())
    assert value(found, "gemini_vgpu_plugin_gpu_draining", gpu=GPU1) == 1
    assert value(found, "gemini_vgpu_plugin_gpu_draining", gpu=GPU0) == 0
    devices.table = SliceTable(gpus, 4, {GPU1: 10})
    devices.draining = frozenset()
    devices.changed()
    found = parse(metrics.render().decode())
    assert value(found, "gemini_vgpu_plugin_gpu_draining", gpu=GPU1) == 0
    assert value(found, "gemini_vgpu_plugin_gpu_slices_advertised", gpu=GPU0) == 4
    assert value(found, "gemini_vgpu_plugin_gpu_slices_advertised", gpu=GPU1) == 10
