"""The real plugin process (`python -m device_plugin.main`, simulated GPUs) driven through the
kubelet emulator over real Unix sockets."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import grpc

from tests.integration.conftest import PluginNode
from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.share import WHOLE, Share
from vgpu_runtime.devkit.kubelet_emulator import Pod
from vgpu_runtime.devkit.kubelet_emulator.protocol import dp, dp_grpc, pr, pr_grpc
from vgpu_runtime.gpus.simulated import simulated_uuid

GPU0, GPU1 = simulated_uuid(0), simulated_uuid(1)
GiB = 1 << 30


def gpus_of(pod: Pod) -> set[str]:
    return {device.split("::")[0] for device in pod.device_ids()}


def record_files(state_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in paths.allocations_dir(state_dir).glob("*.json")}


async def direct_allocate(node: PluginNode, ids: list[str]) -> Any:
    """Allocate straight on the plugin's socket, as a misbehaving client could."""
    async with grpc.aio.insecure_channel(f"unix://{node.kubelet_dir}/gemini-vgpu.sock") as ch:
        response = await dp_grpc.DevicePluginStub(ch).Allocate(dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)]))
        return response.container_responses[0]


async def test_registers_two_gpus_of_ten_slices(node: PluginNode) -> None:
    await node.start_plugin(gpus=2, slices=10)
    assert node.kubelet.capacity() == 20 and node.kubelet.allocatable() == 20
    devices = node.kubelet.devices[paths.RESOURCE_NAME]
    assert {d.split("::")[0] for d in devices} == {GPU0, GPU1}
    assert all(len(d) <= 63 and d.split("::")[1].isdigit() for d in devices)
    assert all(len(d.topology.nodes) == 1 for d in devices.values())
    options = node.kubelet.endpoints[paths.RESOURCE_NAME].options
    assert options.get_preferred_allocation_available


async def test_best_fit_packs_3_and_5_on_one_gpu_and_4_on_the_other(node: PluginNode) -> None:
    await node.start_plugin()
    a, b, c = [await node.kubelet.admit_pod(n, containers=[("main", k)])
               for n, k in (("a", 3), ("b", 5), ("c", 4))]
    assert a.admitted and b.admitted and c.admitted
    assert all(len(gpus_of(p)) == 1 for p in (a, b, c))
    assert gpus_of(a) == gpus_of(b) != gpus_of(c)
    assert [len(p.device_ids()) for p in (a, b, c)] == [3, 5, 4]


async def test_spread_places_each_pod_on_the_gpu_with_most_free(node: PluginNode) -> None:
    await node.start_plugin(args=["--placement", "spread"])
    a, b, c = [await node.kubelet.admit_pod(n, containers=[("main", k)])
               for n, k in (("a", 3), ("b", 5), ("c", 4))]
    assert all(len(gpus_of(p)) == 1 for p in (a, b, c))
    # 3 -> X (7 free left), 5 -> Y (10 free), 4 -> X (7 free beats Y's 5)
    assert gpus_of(a) != gpus_of(b) and gpus_of(c) == gpus_of(a)


async def test_whole_gpu_request_takes_two_full_gpus(node: PluginNode) -> None:
    await node.start_plugin(gpus=3)
    pod = await node.kubelet.admit_pod("big", containers=[("main", 20)])
    assert pod.admitted, pod.message
    assert len(gpus_of(pod)) == 2
    record = allocation.load_record(node.state_dir, allocation.id_for_devices(pod.device_ids()))
    assert record is not None and [g.share for g in record.gpus] == [WHOLE, WHOLE]
    odd = await node.kubelet.admit_pod("odd", containers=[("main", 5)])
    assert odd.admitted and gpus_of(odd).isdisjoint(gpus_of(pod))


async def test_pod_fitting_the_node_but_no_single_gpu_is_refused(node: PluginNode) -> None:
    await node.start_plugin()
    for name, k in (("a", 3), ("b", 5), ("c", 4)):
        assert (await node.kubelet.admit_pod(name, containers=[("main", k)])).admitted
    before = record_files(node.state_dir)
    assert node.kubelet.allocatable() - len(node.kubelet.in_use()) == 8
    refused = await node.kubelet.admit_pod("d", containers=[("main", 7)])
    assert refused.reason == "UnexpectedAdmissionError"
    # Word for word what the real 1.34 kubelet put in such a pod's status (tests/cluster/
    # test_node.py): the plugin refuses in GetPreferredAllocation, whose error kubelet wraps.
    assert refused.message == (
        "Pod was rejected: Allocate failed due to device plugin GetPreferredAllocation rpc "
        "failed with err: rpc error: code = ResourceExhausted desc = no GPU has 7 free slices: "
        "the most free on one GPU is 6 of 10; a request of 7 must fit on one GPU. Ask for "
        "fewer slices or wait for running pods to finish, which is unexpected"), refused.message
    assert record_files(node.state_dir) == before
    # Not whole GPUs and more than one: refused too, with the rule in the message.
    rest = await node.kubelet.admit_pod("e", containers=[("main", 15)])
    assert not rest.admitted and "15" in rest.message


async def test_allocate_rejects_unknown_duplicate_and_split_ids(node: PluginNode) -> None:
    await node.start_plugin()
    cases = [
        ([f"{GPU0}::0", "GPU-nope::1"], "GPU-nope::1"),
        ([f"{GPU0}::0", f"{GPU0}::0"], "more than once"),
        ([f"{GPU0}::0", f"{GPU1}::0"], "one GPU"),
        ([f"{GPU0}::{i}" for i in range(10)] + [f"{GPU1}::0"], "multiple"),
    ]
    for ids, expected in cases:
        try:
            await direct_allocate(node, ids)
        except grpc.aio.AioRpcError as err:
            assert err.code() != grpc.StatusCode.OK and expected in (err.details() or ""), (
                ids, err.details())
        else:
            raise AssertionError(f"Allocate accepted {ids}")
    assert record_files(node.state_dir) == {}


async def test_records_hold_share_memory_and_channel(node: PluginNode) -> None:
    # 22 GiB GPUs with a 2 GiB reserve: exactly 2 GiB per slice.
    await node.start_plugin(args=["--simulate-memory", "22GiB", "--memory-reserve", "2GiB",
                                  "--device-list-strategy", "envvar"])
    pod = await node.kubelet.admit_pod("p", containers=[("main", 3)])
    record = allocation.load_record(node.state_dir, allocation.id_for_devices(pod.device_ids()))
    assert record is not None and record.origin == "kubelet"
    assert set(record.device_ids) == pod.device_ids()
    (gpu,) = record.gpus
    assert gpu.share == Share.of_slices(3, 10) and gpu.memory_limit == 3 * 2 * GiB
    response = pod.containers["main"].response
    assert response.envs["CUDA_VISIBLE_DEVICES"] == gpu.uuid
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
    assert response.envs[paths.ENV_MEMORY_LIMIT] == str(6 * GiB)
    assert response.envs["LD_PRELOAD"].endswith(hooklib.library_name())
    mounts = {m.container_path: m for m in response.mounts}
    assert mounts[paths.CONTAINER_CHANNEL_DIR].host_path == record.channel_dir
    assert mounts[paths.CONTAINER_LIB_DIR].read_only
    assert paths.fits_unix_socket(paths.channel_socket(record.channel_dir))


async def test_init_container_slices_reused_by_app_give_one_record(node: PluginNode) -> None:
    await node.start_plugin()
    pod = await node.kubelet.admit_pod("p", init_containers=[("init", 4)],
                                       containers=[("app", 4)])
    assert pod.admitted, pod.message
    init, app = pod.containers["init"], pod.containers["app"]
    assert init.device_ids == app.device_ids
    assert init.response.envs == app.response.envs
    assert len(record_files(node.state_dir)) == 1


async def test_xid_makes_a_gpu_unhealthy_then_it_recovers(node: PluginNode) -> None:
    plugin = await node.start_plugin()
    plugin.inject({"gpu": 0, "xid": 79})
    await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 10)
    assert node.kubelet.capacity() == 20
    assert {d.split("::")[0] for d in node.kubelet.healthy_ids()} == {GPU1}
    # Quiet period 0.5 s, recheck every 0.1 s.
    await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 20, timeout=5)


async def test_ignored_xid_changes_nothing(node: PluginNode) -> None:
    plugin = await node.start_plugin()
    updates: list[float] = []
    node.kubelet.device_listeners.append(lambda resource, at: updates.append(at))
    event = plugin.inject({"gpu": 0, "xid": 13})
    deadline = time.monotonic() + 5
    while event.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not event.exists(), "the plugin did not consume the event"
    assert node.kubelet.allocatable() == 20 and updates == []
    # A fatal one on the other GPU after it: its update is the first and only one kubelet gets,
    # and GPU 0 stays healthy through it.
    plugin.inject({"gpu": 1, "xid": 79})
    await node.kubelet.wait_until(lambda: updates)
    assert len(updates) == 1 and node.kubelet.allocatable() == 10
    assert {d.split("::")[0] for d in node.kubelet.healthy_ids()} == {GPU0}


async def test_kubelet_restart_brings_the_plugin_back_within_a_second(node: PluginNode) -> None:
    plugin = await node.start_plugin()
    pod = await node.kubelet.admit_pod("p", containers=[("main", 3)])
    records = record_files(node.state_dir)
    started = time.monotonic()
    await node.kubelet.restart()
    assert node.kubelet.capacity() == 0
    await node.wait_registered(20, timeout=5)
    elapsed = time.monotonic() - started
    assert elapsed < 1.5, f"re-registration took {elapsed:.2f} s"
    assert plugin.socket_path.exists() and not plugin.exited()
    assert record_files(node.state_dir) == records
    assert node.kubelet.in_use() == pod.device_ids()
    # The node keeps working: the next pod avoids the running pod's slices.
    other = await node.kubelet.admit_pod("q", containers=[("main", 7)])
    assert other.admitted and other.device_ids().isdisjoint(pod.device_ids())


async def test_plugin_restart_keeps_records_and_allocate_is_idempotent(node: PluginNode) -> None:
    plugin = await node.start_plugin()
    pod = await node.kubelet.admit_pod("p", containers=[("main", 3)])
    records = record_files(node.state_dir)
    assert await plugin.stop(signal.SIGTERM) == 0
    assert not plugin.socket_path.exists()
    await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 0)  # stream ended
    assert node.kubelet.capacity() == 20
    await node.start_plugin()
    assert node.kubelet.registrations == 2
    assert record_files(node.state_dir) == records
    ids = sorted(pod.device_ids())
    again = await direct_allocate(node, ids)
    assert again == pod.containers["main"].response
    assert record_files(node.state_dir) == records


async def test_pod_resources_lists_what_was_allocated(node: PluginNode) -> None:
    await node.start_plugin()
    a = await node.kubelet.admit_pod("a", namespace="ml", containers=[("main", 3)])
    b = await node.kubelet.admit_pod("b", namespace="ml", containers=[("main", 5)])
    async with grpc.aio.insecure_channel(f"unix://{node.kubelet.pod_resources_socket}") as ch:
        lister = pr_grpc.PodResourcesListerStub(ch)
        listed = await lister.List(pr.ListPodResourcesRequest())
        allocatable = await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
    reported = {p.name: {i for c in p.containers for d in c.devices for i in d.device_ids}
                for p in listed.pod_resources}
    assert reported == {"a": a.device_ids(), "b": b.device_ids()}
    assert all(d.resource_name == paths.RESOURCE_NAME for d in allocatable.devices)
    assert sum(len(d.device_ids) for d in allocatable.devices) == 20
