"""Allocate and GetPreferredAllocation fuzzed over real gRPC, on the plugin's real server.

The server (device_plugin.server.PluginServer, grpc.aio) runs in its own thread and event loop
on a Unix socket; the fuzzer is a plain blocking gRPC client, as kubelet is a separate client.
Random IDs (valid, unknown, very long, non-ASCII), duplicates, sizes and empty requests must get
either a sound answer or a clean gRPC status with a message, never UNKNOWN/INTERNAL (a crash in a
handler), and a rejected Allocate must leave no allocation record behind.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_plugin.allocator import Allocator
from device_plugin.health import HealthTracker
from device_plugin.server import DeviceList, DevicePluginService, PluginServer
from device_plugin.slices import SliceTable
from tests.examples import examples
from vgpu_runtime import pluginconfig as plugin_config
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_runtime.pluginconfig import PluginConfig

GIB = 1 << 30
PER_GPU = 4
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass
class Plugin:
    stub: api_pb2_grpc.DevicePluginStub
    table: SliceTable
    config: PluginConfig
    calls: list[int]


@pytest.fixture(scope="module")
def plugin() -> Iterator[Plugin]:
    root = Path(tempfile.mkdtemp(prefix="gf-"))
    (root / "k").mkdir()
    config = plugin_config.check(PluginConfig(
        kubelet_dir=str(root / "k"), state_dir=str(root / "s"), simulate_gpus=3,
        simulate_memory=16 * GIB, memory_reserve=GIB, slices_per_gpu=PER_GPU))
    install_hook(config.host_hook_dir)
    table = SliceTable(SimulatedBackend(3, memory=config.simulate_memory).discover(), PER_GPU)
    tracker = HealthTracker([g.uuid for g in table.gpus], config.ignored_xids, 300)
    loop = asyncio.new_event_loop()
    server_box: list[PluginServer] = []

    async def start() -> None:
        service = DevicePluginService(DeviceList(table, tracker),
                                      Allocator(config, table, tracker), config.placement)
        server_box.append(PluginServer(config.plugin_socket, service))
        await server_box[0].start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    channel = grpc.insecure_channel(f"unix://{config.plugin_socket}")
    stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
    yield Plugin(stub, table, config, [0])
    channel.close()
    asyncio.run_coroutine_threadsafe(server_box[0].close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    shutil.rmtree(root, ignore_errors=True)


def _record_files(config: PluginConfig) -> set[str]:
    directory = paths.allocations_dir(config.state_dir)
    return set(os.listdir(directory)) if directory.is_dir() else set()


def _channel_dirs(config: PluginConfig) -> set[str]:
    directory = paths.channel_dir(config.state_dir, "k-" + "0" * 16).parent
    return set(os.listdir(directory)) if directory.is_dir() else set()


VALID = [f"{u}::{i}" for u in (SimulatedBackend(3, memory=16 * GIB).discover()[g].uuid
                               for g in range(3)) for i in range(PER_GPU)]
ids = st.one_of(
    st.sampled_from(VALID), st.sampled_from(VALID), st.sampled_from(VALID),
    st.text(max_size=20), st.text(min_size=200, max_size=600),
    st.sampled_from(VALID).map(lambda v: v.replace("::", "::1")),   # slice numbers past N
    st.sampled_from(VALID).map(lambda v: v.upper()), st.sampled_from(["", "::", "GPU-::0"]),
)
id_lists = st.lists(ids, max_size=2 * PER_GPU + 2)


def _call(fn: object, request: object) -> tuple[object | None, grpc.RpcError | None]:
    try:
        return fn(request, timeout=10), None  # type: ignore[operator]
    except grpc.RpcError as err:
        return None, err


def _assert_clean(err: grpc.RpcError) -> None:
    code, details = err.code(), err.details()
    assert code in CLEAN, f"{code}: {details}"
    assert details and len(details) > 20


def fuzz(count: int) -> settings:
    return settings(max_examples=examples(count), deadline=None, suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@fuzz(400)
@given(devices=id_lists)
def test_allocate_answers_soundly_or_rejects_cleanly_leaving_no_record(
        plugin: Plugin, devices: list[str]) -> None:
    before, channels_before = _record_files(plugin.config), _channel_dirs(plugin.config)
    request = api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=devices)])
    answer, err = _call(plugin.stub.Allocate, request)
    plugin.calls[0] += 1
    if err is not None:
        _assert_clean(err)
        assert _record_files(plugin.config) == before, "a rejected Allocate left a record"
        assert _channel_dirs(plugin.config) == channels_before
        return
    assert isinstance(answer, api_pb2.AllocateResponse)
    (response,) = answer.container_responses
    rid = response.annotations["gemini.ai/allocation-id"]
    record = allocation.load_record(plugin.config.state_dir, rid)
    assert record is not None and sorted(record.device_ids) == sorted(devices)
    assert len(set(devices)) == len(devices)
    k = len(devices)
    assert (k <= PER_GPU and len(record.gpus) == 1) or k % PER_GPU == 0
    assert response.envs["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in record.gpus)


@fuzz(400)
@given(available=id_lists, must=st.lists(ids, max_size=4),
       size=st.one_of(st.integers(-3, 3 * PER_GPU + 2), st.sampled_from([-(2**31), 2**31 - 1])),
       extra=st.integers(0, 2))
def test_preferred_allocation_is_sound_or_a_clean_error_and_writes_nothing(
        plugin: Plugin, available: list[str], must: list[str], size: int, extra: int) -> None:
    before = _record_files(plugin.config)
    asks = [api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)
        for _ in range(1 + extra)]
    answer, err = _call(plugin.stub.GetPreferredAllocation,
                        api_pb2.PreferredAllocationRequest(container_requests=asks))
    plugin.calls[0] += 1
    assert _record_files(plugin.config) == before
    if err is not None:
        _assert_clean(err)
        return
    assert isinstance(answer, api_pb2.PreferredAllocationResponse)
    assert len(answer.container_responses) == len(asks)
    for chosen in answer.container_responses:
        picked = list(chosen.deviceIDs)
        assert len(picked) == size == len(set(picked))
        assert set(picked) <= set(available) and set(must) <= set(picked)
        gpus = {p.split("::")[0] for p in picked}
        assert len(gpus) == 1 if size <= PER_GPU else len(gpus) * PER_GPU == size


def test_empty_requests_are_answered_and_write_nothing(plugin: Plugin) -> None:
    before = _record_files(plugin.config)
    answer = plugin.stub.Allocate(api_pb2.AllocateRequest(), timeout=10)
    assert list(answer.container_responses) == []
    preferred = plugin.stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest(),
                                                   timeout=10)
    assert list(preferred.container_responses) == []
    _, err = _call(plugin.stub.Allocate, api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest()]))
    assert err is not None
    _assert_clean(err)
    assert _record_files(plugin.config) == before


def test_allocate_of_several_containers_is_all_or_nothing(plugin: Plugin) -> None:
    before = _record_files(plugin.config)
    one_gpu_sets = [list(c) for k in range(1, PER_GPU + 1) for g in range(3)
                    for c in itertools.combinations(VALID[g * PER_GPU:(g + 1) * PER_GPU], k)]
    unused = [c for c in one_gpu_sets if allocation.id_for_devices(c) + ".json" not in before]
    assert unused, "the fuzzer allocated every set of slices"
    fresh = unused[0]
    _, err = _call(plugin.stub.Allocate, api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=fresh),
        api_pb2.ContainerAllocateRequest(devices_ids=["no-such-slice"])]))
    assert err is not None
    _assert_clean(err)
    assert _record_files(plugin.config) == before


# S9: one Allocate with a huge unknown ID, or very many, wedged the plugin (the error message
# named every ID: a status past gRPC's metadata limit). Every later call must still be served.
# Under gRPC's 4 MiB message limit, so that the plugin itself must answer.
HUGE_REQUESTS = {
    "one_1MB_id": ([["x" * (1 << 20)]], "unknown device ID"),
    "100k_unknown_ids": ([[f"GPU-nope::{i}" for i in range(100_000)]], "unknown device ID"),
    "25k_ids_twice": ([[f"GPU-nope::{i}" for i in range(25_000)] * 2], "more than once"),
}


@pytest.mark.parametrize("requests,reason", list(HUGE_REQUESTS.values()), ids=list(HUGE_REQUESTS))
def test_a_huge_allocate_is_refused_briefly_and_the_plugin_serves_on(
        plugin: Plugin, requests: list[list[str]], reason: str) -> None:
    before = _record_files(plugin.config)
    _, err = _call(plugin.stub.Allocate, api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in requests]))
    assert err is not None
    # The plugin's own reason, not a stream broken by a 1 MB status ("Stream removed").
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert reason in err.details() and len(err.details()) < 2000, err.details()[:300]
    assert _record_files(plugin.config) == before
    _, err = _call(plugin.stub.GetPreferredAllocation, api_pb2.PreferredAllocationRequest(
        container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=requests[0][:50_000], allocation_size=1)]))
    if reason == "unknown device ID":
        assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not served by this plugin" in err.details() and len(err.details()) < 2000
    # The plugin still answers at once.
    answer = plugin.stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=[VALID[-1]])]), timeout=10)
    assert len(answer.container_responses) == 1
