"""The real grpc.aio server on a real Unix socket, called by a real gRPC client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from device_plugin.allocator import Allocator
from device_plugin.health import HealthTracker
from device_plugin.server import DeviceList, DevicePluginService, PluginServer
from device_plugin.slices import SliceTable
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_runtime.pluginconfig import PluginConfig

Plugin = tuple[api_pb2_grpc.DevicePluginStub, HealthTracker, SliceTable, PluginConfig]


@pytest.fixture
async def plugin(make_config: Callable[..., PluginConfig]) -> AsyncIterator[Plugin]:
    config = make_config()
    gpus = SimulatedBackend(2, memory=config.simulate_memory).discover()
    table = SliceTable(gpus, config.slices_per_gpu)
    tracker = HealthTracker([g.uuid for g in gpus], config.ignored_xids, 300)
    service = DevicePluginService(DeviceList(table, tracker),
                                  Allocator(config, table, tracker), config.placement)
    server = PluginServer(config.plugin_socket, service)
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{config.plugin_socket}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        yield stub, tracker, table, config
    await server.close()
    assert not Path(config.plugin_socket).exists()


async def test_options_ask_for_preferred_allocation_and_prestart(plugin: Plugin) -> None:
    stub = plugin[0]
    opts = await stub.GetDevicePluginOptions(api_pb2.Empty())
    assert opts.get_preferred_allocation_available and opts.pre_start_required


async def test_list_and_watch_sends_full_list_then_updates_on_health(plugin: Plugin) -> None:
    stub, tracker, table, _ = plugin
    stream = stub.ListAndWatch(api_pb2.Empty())
    first = await asyncio.wait_for(stream.read(), 5)
    assert [d.ID for d in first.devices] == [s.id for s in table.all()]
    assert {d.health for d in first.devices} == {"Healthy"}
    assert all(list(d.topology.nodes) == [api_pb2.NUMANode(ID=0)] for d in first.devices)

    bad = table.gpus[1].uuid
    tracker.xid(bad, 79)
    second = await asyncio.wait_for(stream.read(), 5)
    health = {d.ID: d.health for d in second.devices}
    assert len(health) == 20
    assert all(health[s.id] == "Unhealthy" for s in table.slices_of(bad))
    assert all(health[s.id] == "Healthy" for s in table.slices_of(table.gpus[0].uuid))
    stream.cancel()


async def test_health_change_reaches_every_open_stream(plugin: Plugin) -> None:
    stub, tracker, _, _ = plugin
    streams = [stub.ListAndWatch(api_pb2.Empty()) for _ in range(3)]
    for stream in streams:
        await asyncio.wait_for(stream.read(), 5)
    tracker.xid(None, 48)  # no device: every GPU
    for stream in streams:
        update = await asyncio.wait_for(stream.read(), 5)
        assert {d.health for d in update.devices} == {"Unhealthy"}
        stream.cancel()


async def test_benign_xid_sends_no_update(plugin: Plugin) -> None:
    stub, tracker, _, _ = plugin
    stream = stub.ListAndWatch(api_pb2.Empty())
    await asyncio.wait_for(stream.read(), 5)
    tracker.xid(None, 13)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(stream.read(), 0.3)
    stream.cancel()


async def test_allocate_returns_response_for_each_container(plugin: Plugin) -> None:
    stub, _, table, config = plugin
    ids = [s.id for s in table.slices_of(table.gpus[0].uuid)[:3]]
    answer = await stub.Allocate(api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]))
    (container,) = answer.container_responses
    assert container.envs["CUDA_VISIBLE_DEVICES"] == table.gpus[0].uuid
    assert container.envs["GEMINI_VGPU_SHARE"] == "0.3"
    assert Path(config.state_dir, "allocations").is_dir()


async def test_allocate_error_comes_back_as_grpc_status_with_message(plugin: Plugin) -> None:
    stub, _, table, _ = plugin
    ids = [table.slices_of(g.uuid)[0].id for g in table.gpus]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Allocate(api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "must be on one GPU" in (caught.value.details() or "")

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Allocate(api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["GPU-nope::1"])]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-nope::1" in (caught.value.details() or "")


async def test_preferred_allocation_over_grpc(plugin: Plugin) -> None:
    stub, _, table, _ = plugin
    gpu0, gpu1 = (table.slices_of(g.uuid) for g in table.gpus)
    available = [s.id for s in gpu0[:6] + gpu1]  # GPU 0 has 6 free, GPU 1 has 10
    answer = await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
        container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, allocation_size=4)]))
    assert list(answer.container_responses[0].deviceIDs) == [s.id for s in gpu0[:4]]

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
            container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, allocation_size=15)]))
    assert "not a multiple of 10" in (caught.value.details() or "")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(
            container_requests=[api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available[:12], allocation_size=7)]))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no GPU has 7 free slices" in (caught.value.details() or "")


async def test_prestart_container_answers(plugin: Plugin) -> None:
    stub, _, table, _ = plugin
    reply = await stub.PreStartContainer(api_pb2.PreStartContainerRequest(
        devices_ids=[table.all()[0].id]))
    assert reply == api_pb2.PreStartContainerResponse()
