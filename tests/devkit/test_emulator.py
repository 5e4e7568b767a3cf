"""The emulator against a stub plugin: real gRPC over real Unix sockets, both in this process."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from vgpu_runtime.devkit.kubelet_emulator import KubeletEmulator, describe_node
from vgpu_runtime.devkit.kubelet_emulator.protocol import (
    CHECKPOINT_FILE,
    HEALTHY,
    UNHEALTHY,
    pr,
    pr_grpc,
)
from vgpu_runtime.devkit.kubelet_emulator.stub_plugin import StubPlugin

RES = "example.com/dev"


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # Short, so that socket paths stay far below the 107-byte limit.
    root = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    yield root / "device-plugins"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[KubeletEmulator]:
    emulator = KubeletEmulator(plugin_dir, dial_timeout=1.0)
    await emulator.start()
    yield emulator
    await emulator.stop()


async def serving_stub(kubelet: KubeletEmulator, **kwargs: object) -> StubPlugin:
    stub = StubPlugin(kubelet.directory, **kwargs)  # type: ignore[arg-type]
    await stub.serve()
    await stub.register()
    await kubelet.wait_until(lambda: kubelet.capacity(RES) == len(stub.health))
    return stub


async def test_registration_opens_one_stream_and_sets_capacity(kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    assert kubelet.capacity(RES) == 4 and kubelet.allocatable(RES) == 4
    assert stub.list_and_watch_calls == 1
    await stub.stop()


@pytest.mark.parametrize(("version", "resource", "message"), [
    ("v1alpha", RES, "'v1alpha' is not supported"),
    ("v1beta1", "novendor", "the ResourceName 'novendor' is invalid"),
    ("v1beta1", "kubernetes.io/dev", "is invalid"),
])
async def test_registration_rejects_bad_version_or_resource(
        kubelet: KubeletEmulator, version: str, resource: str, message: str) -> None:
    stub = StubPlugin(kubelet.directory)
    await stub.serve()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.register(version=version, resource=resource)
    assert message in (err.value.details() or "")
    assert kubelet.resources() == []
    await stub.stop()


async def test_plugin_registering_before_serving_fails(kubelet: KubeletEmulator) -> None:
    stub = StubPlugin(kubelet.directory)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.register()
    assert "failed to dial device plugin" in (err.value.details() or "")
    assert kubelet.resources() == []


async def test_options_are_taken_from_the_plugin_not_the_request(
        kubelet: KubeletEmulator) -> None:
    from vgpu_runtime.devkit.kubelet_emulator.protocol import dp

    stub = StubPlugin(kubelet.directory, preferred=False)
    await stub.serve()
    await stub.register(options=dp.DevicePluginOptions(get_preferred_allocation_available=True))
    await kubelet.wait_until(lambda: kubelet.capacity(RES) == 4)
    pod = await kubelet.admit_pod("p", containers=[("c", 1)], resource=RES)
    assert pod.admitted and stub.preferred_calls == []
    await stub.stop()


async def test_health_change_keeps_capacity_and_lowers_allocatable(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    stub.set_health("dev-1", UNHEALTHY)
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 3)
    assert kubelet.capacity(RES) == 4
    stub.set_health("dev-1", HEALTHY)
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 4)
    await stub.stop()


async def test_stream_end_marks_all_unhealthy_until_the_plugin_registers_again(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    stub.end_stream()
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 0)
    assert kubelet.capacity(RES) == 4
    await asyncio.sleep(0.2)
    assert stub.list_and_watch_calls == 1  # kubelet never re-opens the stream by itself
    await stub.register()
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 4)
    assert stub.list_and_watch_calls == 2 and kubelet.registrations == 2
    await stub.stop()


async def test_reregistration_replaces_the_old_endpoint(kubelet: KubeletEmulator) -> None:
    first = await serving_stub(kubelet, count=2, endpoint="first.sock")
    second = await serving_stub(kubelet, count=3, endpoint="second.sock")
    assert kubelet.endpoints[RES].socket_path.name == "second.sock"
    await first.stop()  # the replaced stream ending must not mark anything unhealthy
    await asyncio.sleep(0.1)
    assert kubelet.allocatable(RES) == 3
    await second.stop()


async def test_preference_is_intersected_with_available_and_filled(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet, preferred=True)
    stub.prefer = lambda available, must, size: ["dev-3", "not-a-device"]
    pod = await kubelet.admit_pod("p", containers=[("c", 2)], resource=RES)
    assert pod.admitted, pod.message
    available, must, size = stub.preferred_calls[0]
    assert sorted(available) == ["dev-0", "dev-1", "dev-2", "dev-3"] and must == [] and size == 2
    ids = pod.containers["c"].device_ids
    assert "dev-3" in ids and len(ids) == 2 and "not-a-device" not in ids
    assert stub.allocate_calls == [list(ids)]  # one container request per Allocate
    assert pod.containers["c"].response.envs["STUB_DEVICES"] == ",".join(ids)
    # The next pod is offered only what is left.
    await kubelet.admit_pod("q", containers=[("c", 1)], resource=RES)
    assert sorted(stub.preferred_calls[1][0]) == sorted({"dev-0", "dev-1", "dev-2"} - set(ids))
    await stub.stop()


async def test_allocate_error_fails_the_pod_and_frees_its_devices(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    stub.allocate_error = "slices of two GPUs: ask for fewer"
    pod = await kubelet.admit_pod("p", containers=[("c", 2)], resource=RES)
    assert not pod.admitted and pod.reason == "UnexpectedAdmissionError"
    assert "slices of two GPUs: ask for fewer" in pod.message
    assert "code = InvalidArgument" in pod.message
    assert kubelet.in_use(RES) == set()
    stub.allocate_error = None
    assert (await kubelet.admit_pod("p2", containers=[("c", 4)], resource=RES)).admitted
    await stub.stop()


async def test_pod_asking_more_than_available_is_refused_without_calling_the_plugin(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet, preferred=True)
    stub.set_health("dev-0", UNHEALTHY)
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 3)
    pod = await kubelet.admit_pod("p", containers=[("c", 4)], resource=RES)
    assert pod.reason == "UnexpectedAdmissionError"
    assert "Requested: 4, Available: 3" in pod.message
    assert stub.allocate_calls == [] and stub.preferred_calls == []
    await stub.stop()


async def test_app_containers_reuse_init_container_devices(kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet, preferred=True)
    pod = await kubelet.admit_pod("p", init_containers=[("init", 2)],
                                  containers=[("app", 2)], resource=RES)
    assert pod.admitted, pod.message
    assert pod.containers["app"].device_ids == pod.containers["init"].device_ids
    assert stub.allocate_calls[0] == stub.allocate_calls[1]
    assert len(stub.preferred_calls) == 1  # the reused devices needed no choice
    assert kubelet.in_use(RES) == set(pod.containers["init"].device_ids)
    await stub.stop()


async def test_container_restart_reuses_the_kept_response(kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet, pre_start=True)
    pod = await kubelet.admit_pod("p", containers=[("c", 1)], resource=RES)
    first = pod.containers["c"].response
    again = await kubelet.restart_container("default", "p", "c")
    assert again is first and len(stub.allocate_calls) == 1
    assert stub.pre_start_calls == [list(pod.containers["c"].device_ids)] * 2
    await stub.stop()


async def test_deleting_a_pod_frees_its_devices(kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    await kubelet.admit_pod("p", containers=[("c", 4)], resource=RES)
    refused = await kubelet.admit_pod("q", containers=[("c", 1)], resource=RES)
    assert not refused.admitted
    await kubelet.delete_pod("p")
    assert (await kubelet.admit_pod("r", containers=[("c", 4)], resource=RES)).admitted
    await stub.stop()


async def test_restart_wipes_sockets_keeps_checkpoint_and_running_pods(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    pod = await kubelet.admit_pod("p", containers=[("c", 2)], resource=RES)
    await kubelet.restart()
    assert not (kubelet.directory / "stub.sock").exists()
    # The real kubelet's shape (tests/cluster reads it): device IDs by NUMA node (the stub
    # reports node 0; -1 stands for none).
    (entry,) = json.loads((kubelet.directory / CHECKPOINT_FILE).read_text())["Data"][
        "PodDeviceEntries"]
    assert entry["DeviceIDs"] == {"0": list(pod.containers["c"].device_ids)}
    assert kubelet.socket_path.exists()
    assert kubelet.capacity(RES) == 0 and pod.admitted
    await stub.stop()
    await stub.serve()
    await stub.register()
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 4)
    assert kubelet.in_use(RES) == set(pod.containers["c"].device_ids)
    assert len(stub.allocate_calls) == 1  # running containers are not allocated again
    await stub.stop()


async def test_pod_resources_reports_allocations_and_healthy_devices(
        kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    await kubelet.admit_pod("p", namespace="ns", containers=[("c", 2), ("idle", 0)],
                            resource=RES)
    stub.set_health("dev-3", UNHEALTHY)
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 3)
    async with grpc.aio.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        lister = pr_grpc.PodResourcesListerStub(channel)
        listed = await lister.List(pr.ListPodResourcesRequest())
        (pod,) = listed.pod_resources
        assert (pod.name, pod.namespace) == ("p", "ns")
        devices = pod.containers[0].devices[0]
        assert devices.resource_name == RES and len(devices.device_ids) == 2
        assert [n.ID for n in devices.topology.nodes] == [0]
        assert list(pod.containers[1].devices) == []
        allocatable = await lister.GetAllocatableResources(pr.AllocatableResourcesRequest())
        ids = {i for d in allocatable.devices for i in d.device_ids}
        assert ids == {"dev-0", "dev-1", "dev-2"}
        got = await lister.Get(pr.GetPodResourcesRequest(pod_name="p", pod_namespace="ns"))
        assert got.pod_resources == pod
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await lister.Get(pr.GetPodResourcesRequest(pod_name="x", pod_namespace="ns"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.stop()


async def test_describe_node_shows_capacity_and_allocatable(kubelet: KubeletEmulator) -> None:
    stub = await serving_stub(kubelet)
    stub.set_health("dev-0", UNHEALTHY)
    await kubelet.wait_until(lambda: kubelet.allocatable(RES) == 3)
    text = describe_node(kubelet)
    assert "Capacity:\n  example.com/dev:  4\n" in text
    assert "Allocatable:\n  example.com/dev:  3\n" in text
    await stub.stop()
