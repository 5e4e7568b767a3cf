"""The pod watcher (vgpu_runtime/daemon/pods/pods.py) in the test process: real record files, the
real Kubernetes client against the fake API server, and PodResources answers set by the test
(`ScriptedLister`), or the real lister over gRPC to the kubelet emulator. test_pods.py keeps
the whole node (plugin, kubelet, daemon process) for the wiring."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.daemon.helpers import UUID_A, MiB, wait_for, wait_served
from tests.daemon.inprocess import InProcessDaemon
from vgpu_runtime import hooklib
from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, GpuShare, PodRef
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.pods.podresources import PodListing, PodResourcesLister
from vgpu_runtime.daemon.pods.pods import PodWatch
from vgpu_runtime.devkit.kubelet_emulator import KubeletEmulator
from vgpu_runtime.devkit.kubelet_emulator.stub_plugin import StubPlugin
from vgpu_runtime.devkit.podnode import until

if TYPE_CHECKING:
    from vgpu_runtime.daemon.pods.kube import KubeApi
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

GiB = 1 << 30
DEFAULT_MEMORY = 3 * GiB
SLICES = ("GPU-11111111-2222-3333-4444-555555555555::0",
          "GPU-11111111-2222-3333-4444-555555555555::1",
          "GPU-11111111-2222-3333-4444-555555555555::2")


def kubelet_record(state_dir: Path, device_ids: tuple[str, ...] = SLICES,
                   share: float = 0.3) -> AllocationRecord:
    """A record as the plugin writes it at Allocate: slice IDs, no pod yet."""
    allocation_id = allocation.id_for_devices(device_ids)
    record = AllocationRecord(
        id=allocation_id, origin="kubelet", device_ids=device_ids,
        gpus=(GpuShare(UUID_A, 0, Share.from_float(share), DEFAULT_MEMORY, 10),),
        channel_dir=str(paths.channel_dir(state_dir, allocation_id)),
        hook_library=hooklib.library_name(), created_at=time.time())
    allocation.write_record(state_dir, record)
    return record


class ScriptedLister(PodResourcesLister):
    """The real lister (its rate limit, its `listing`), answering what the test sets."""

    def __init__(self) -> None:
        super().__init__("/nonexistent/kubelet.sock", paths.RESOURCE_NAME, 0.0)
        self.answer = PodListing(False, "List failed: UNAVAILABLE: kubelet away")

    def available(self) -> bool:
        return True

    def holding(self, *held: tuple[PodRef, tuple[str, ...]]) -> None:
        """A successful List: these containers hold these slices, beside one pod without any
        (this daemon's own, on a real node)."""
        owners = {d: pod for pod, ids in held for d in ids}
        self.answer = PodListing(True, "", owners, len(held) + 1)

    async def _list(self) -> PodListing:
        self.lists += 1
        return dataclasses.replace(self.answer, at=time.monotonic())


class Watch:
    """A PodWatch on a state directory, with the daemon's callbacks recorded."""

    def __init__(self, state_dir: Path, kube: KubeApi | None, grace: float = 30.0) -> None:
        self.now = 1000.0   # the absence clocks' time: moved by the tests, never the machine
        self.state_dir = state_dir
        self.lister = ScriptedLister()
        self.collected: list[tuple[str, str]] = []
        self.notified: list[tuple[str, AllocationRecord, dict[str, object]]] = []
        self.wakes = 0
        config = cfg.load_all(DaemonConfig, ["--state-dir", str(state_dir), "--node-name",
                                             "node-1", "--collect-grace", str(grace)]).config
        self.bindings: dict[str, Binding] = {}
        self.pods = PodWatch(config, self.lister, kube, self.records, self.bindings.get,
                             self.bind, self.collect, lambda *event: self.notified.append(event),
                             clock=lambda: self.now)

    def records(self) -> list[AllocationRecord]:
        return [r for _, r in allocation.scan_records(self.state_dir)
                if isinstance(r, AllocationRecord)]

    def record(self, allocation_id: str) -> AllocationRecord | None:
        return allocation.load_record(self.state_dir, allocation_id)

    def bind(self, binding: Binding) -> bool:
        """As the daemon binds: stored in its own file, the record untouched."""
        allocation.write_binding(self.state_dir, binding)
        self.bindings[binding.id] = binding
        self.wakes += 1
        return True

    def binding(self, allocation_id: str) -> Binding | None:
        return allocation.load_binding(self.state_dir, allocation_id)

    async def collect(self, allocation_id: str, reason: str) -> None:
        self.collected.append((allocation_id, reason))
        allocation.end_allocation(self.state_dir, allocation_id)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gw-"))
    path = root / "state"
    paths.allocations_dir(path).mkdir(parents=True)
    yield path
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def kube(api: FakeApiServer) -> AsyncIterator[KubeApi]:
    from vgpu_runtime.daemon.pods.kube import KubeApi

    client = KubeApi(api.url)
    yield client
    client.close()


APP = PodRef("default", "app-pod", "app")


# ---- binding ----

async def test_a_record_is_bound_to_the_container_holding_its_slices(state_dir: Path) -> None:
    record = kubelet_record(state_dir)
    watch = Watch(state_dir, kube=None)
    await watch.pods.pass_once()                       # a failed List: nothing is bound
    assert watch.binding(record.id) is None and watch.notified == []
    watch.lister.holding((PodRef("ml", "train", "main"), SLICES[:2]),
                         (PodRef("ml", "train", "side"), SLICES[2:]))
    await watch.pods.pass_once()                       # split between two containers: none
    assert watch.binding(record.id) is None
    watch.lister.holding((PodRef("ml", "train", "main"), SLICES))
    await watch.pods.pass_once()
    bound = watch.binding(record.id)
    assert bound == Binding(record.id, PodRef("ml", "train", "main", ""))
    assert watch.record(record.id) == record, "the plugin's record is never rewritten"
    assert [(event, r.id) for event, r, _ in watch.notified] == [("bound", record.id)]
    assert watch.pods.binds == 1 and watch.wakes == 1
    await watch.pods.pass_once()                       # bound already: nothing rewritten
    assert watch.pods.binds == 1 and watch.binding(record.id) == bound


async def test_invalid_annotations_make_warning_events_and_change_nothing(
        state_dir: Path, api: FakeApiServer, kube: KubeApi) -> None:
    api.add_pod("default", "bad", "uid-bad", {"gemini.ai/vgpu-limit": "0.1",
                                              "gemini.ai/vgpu-memory": "lots"})
    record = kubelet_record(state_dir, share=0.3)
    watch = Watch(state_dir, kube)
    watch.lister.holding((PodRef("default", "bad", "app"), SLICES))
    await watch.pods.pass_once()
    events = await until(lambda: found if len(found := api.events_for("default", "bad")) >= 2
                         else None, what="two events")
    assert len(events) == 2
    assert {e["reason"] for e in events} == {"InvalidVgpuAnnotation"}
    assert all(e["type"] == "Warning" and e["involvedObject"]["uid"] == "uid-bad"
               and e["source"]["host"] == "node-1" for e in events)
    messages = " | ".join(e["message"] for e in events)
    assert "below the pod's request of 0.3" in messages and "vgpu-memory" in messages
    bound = watch.binding(record.id)
    assert bound is not None and bound.pod == PodRef("default", "bad", "app", "uid-bad")
    assert bound.limit is None and bound.memory_limit is None
    assert watch.record(record.id) == record
    assert record.id not in watch.pods.annotations_pending


async def test_a_node_event_names_the_node_as_kubelet_does(
        state_dir: Path, api: FakeApiServer, kube: KubeApi) -> None:
    """The channels' Events on the Node (a process of no allocation): a Warning in namespace
    default on the Node, its name standing for its uid as in kubelet's node Events (every
    kubectl describe node finds those: kubectl 1.34 looks by the uid and by the name, older
    releases by the name alone), whether or not the Node can be read."""
    watch = Watch(state_dir, kube)
    for message in ("first", "second"):
        watch.pods.post_node_event("SomeReason", message)
    events = await until(lambda: len(api.node_events("node-1")) == 2
                              and api.node_events("node-1"), what="two Events")
    for event in events:
        assert event["involvedObject"] == {"kind": "Node", "apiVersion": "v1",
                                           "name": "node-1", "uid": "node-1"}, event
        assert event["metadata"]["namespace"] == "default" and event["type"] == "Warning"
        assert event["reason"] == "SomeReason" and event["source"]["host"] == "node-1", event
    assert {e["message"] for e in events} == {"first", "second"}
    with api.lock:
        del api.nodes["node-1"]      # the Node unreadable (404) to a daemon that never read it
    Watch(state_dir, kube).pods.post_node_event("SomeReason", "unknown")
    (unknown,) = await until(lambda: [e for e in api.node_events("node-1")
                                           if e["message"] == "unknown"], what="the Event")
    assert unknown["involvedObject"]["uid"] == "node-1", unknown


async def test_slices_given_to_a_new_pod_rebind_the_allocation_with_its_annotations(
        state_dir: Path, api: FakeApiServer, kube: KubeApi) -> None:
    api.add_pod("default", "first", "uid-first", {"gemini.ai/vgpu-memory": "1GiB",
                                                  "gemini.ai/vgpu-limit": "0.5"})
    api.add_pod("default", "second", "uid-second", {"gemini.ai/vgpu-memory": "2GiB"})
    api.add_pod("default", "third", "uid-third", {})
    record = kubelet_record(state_dir)
    watch = Watch(state_dir, kube)
    watch.lister.holding((PodRef("default", "first", "app"), SLICES))
    await watch.pods.pass_once()
    first = watch.binding(record.id)
    assert first is not None and first.pod == PodRef("default", "first", "app", "uid-first")
    assert (first.memory_limit, first.limit) == (GiB, Share.parse("0.5"))
    # The first pod deleted, its slices given to the second within the collect grace: the same
    # allocation, the second pod's binding and annotations.
    watch.lister.holding((PodRef("default", "second", "app"), SLICES))
    await watch.pods.pass_once()
    second = watch.binding(record.id)
    assert second is not None and second.pod == PodRef("default", "second", "app", "uid-second")
    assert (second.memory_limit, second.limit) == (2 * GiB, None)
    assert watch.notified[-1][0] == "bound" and watch.notified[-1][2] == {
        "previous_namespace": "default", "previous_pod": "first"}
    # A pod without annotations gets the plugin's defaults, not what the last pod asked.
    watch.lister.holding((PodRef("default", "third", "app"), SLICES))
    await watch.pods.pass_once()
    third = watch.binding(record.id)
    assert third is not None and third.pod == PodRef("default", "third", "app", "uid-third")
    assert (third.memory_limit, third.limit) == (None, None)
    assert watch.record(record.id) == record
    assert watch.pods.binds == 3 and watch.collected == [] and api.events == []


async def test_the_same_pod_keeps_its_binding_and_annotations(
        state_dir: Path, api: FakeApiServer, kube: KubeApi) -> None:
    api.add_pod("default", "app-pod", "uid-app", {"gemini.ai/vgpu-memory": "1GiB"})
    record = kubelet_record(state_dir)
    watch = Watch(state_dir, kube)
    watch.lister.holding((APP, SLICES))
    await watch.pods.pass_once()
    bound = watch.binding(record.id)
    assert bound is not None and bound.memory_limit == GiB
    # PodResources names no uid; the pod it names is the one bound: nothing changes.
    await watch.pods.pass_once()
    assert watch.binding(record.id) == bound and watch.pods.binds == 1


# ---- collection ----

async def test_collected_only_after_the_grace_of_continuous_absence(state_dir: Path) -> None:
    record = kubelet_record(state_dir)
    other = kubelet_record(state_dir, device_ids=("GPU-other::0",))
    watch = Watch(state_dir, kube=None, grace=1.0)
    watch.lister.holding((APP, SLICES), (PodRef("default", "stays", "app"), ("GPU-other::0",)))
    await watch.pods.pass_once()
    watch.lister.holding((PodRef("default", "stays", "app"), ("GPU-other::0",)))
    await watch.pods.pass_once()                       # absent: its clock starts
    watch.now += 0.6
    watch.lister.answer = PodListing(False, "List failed: UNAVAILABLE")
    await watch.pods.pass_once()                       # a failed List restarts every clock
    watch.now += 0.6                                   # past the grace since the first absence
    watch.lister.holding((PodRef("default", "stays", "app"), ("GPU-other::0",)))
    await watch.pods.pass_once()                       # absent again: a new clock
    assert watch.collected == [], "collected though its absence was interrupted"
    watch.now += 0.999
    await watch.pods.pass_once()
    assert watch.collected == [], "collected before the grace period"
    watch.now += 0.01                                  # just past the grace since it went
    await watch.pods.pass_once()
    ((collected_id, reason),) = watch.collected
    assert collected_id == record.id
    prefix = "pod default/app-pod ended (absent from PodResources for "
    assert reason.startswith(prefix) and reason.endswith(" s)"), reason
    assert float(reason[len(prefix):-3]) >= 1.0
    assert watch.record(record.id) is None and watch.record(other.id) is not None


async def test_a_record_whose_slices_a_bigger_pod_holds_is_not_its_and_is_collected(
        state_dir: Path) -> None:
    """Kubelet gave a deleted 3-slice pod's slices, and three more, to a 6-slice pod: the old
    record is not that pod's (a record is one container's allocation, whole), so it is not
    bound to it, and it is collected after the grace (seen on the real cluster)."""
    old = kubelet_record(state_dir)
    bigger = (*SLICES, *(f"GPU-11111111-2222-3333-4444-555555555555::{i}" for i in (3, 4, 5)))
    new = kubelet_record(state_dir, device_ids=bigger)
    watch = Watch(state_dir, kube=None, grace=1.0)
    six = PodRef("default", "six", "app")
    watch.lister.holding((six, bigger))
    await watch.pods.pass_once()
    assert watch.binding(old.id) is None
    bound = watch.binding(new.id)
    assert bound is not None and bound.pod.name == "six"
    watch.now += 1.01
    await watch.pods.pass_once()
    assert [collected for collected, _ in watch.collected] == [old.id]
    assert watch.record(new.id) is not None


async def test_never_collected_while_lists_fail_or_are_empty(state_dir: Path) -> None:
    kubelet_record(state_dir)
    watch = Watch(state_dir, kube=None, grace=0.0)
    for answer in (PodListing(False, "List failed: UNAVAILABLE"),
                   PodListing(False, "List named no pod (kubelet starting?)")):
        watch.lister.answer = answer
        for _ in range(3):
            await watch.pods.pass_once()
    assert watch.collected == [] and watch.pods.absent_since == {}
    watch.lister.holding()
    await watch.pods.pass_once()                       # no grace: the first absence collects
    assert [reason for _, reason in watch.collected] == [
        "no pod holds its slices (absent from PodResources for 0.0 s)"]


# ---- the lister, over gRPC to the emulator's PodResources ----

RES = "example.com/dev"


async def test_the_lister_reads_owners_and_refuses_failed_or_empty_lists() -> None:
    root = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp"))
    kubelet = KubeletEmulator(root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock",
                              dial_timeout=1.0)
    await kubelet.start()
    stub = StubPlugin(kubelet.directory, resource=RES)
    lister = PodResourcesLister(str(kubelet.pod_resources_socket), RES, 0.0)
    try:
        await stub.serve()
        await stub.register()
        await kubelet.wait_until(lambda: kubelet.capacity(RES) == 4)
        empty = await lister.listing()
        assert (empty.ok, empty.error) == (False, "List named no pod (kubelet starting?)")
        pod = await kubelet.admit_pod("p", namespace="ns", containers=[("c", 2), ("idle", 0)],
                                      resource=RES)
        listing = await lister.listing()
        assert listing.ok and listing.pods == 1
        held = tuple(pod.containers["c"].device_ids)
        assert listing.owners == {d: PodRef("ns", "p", "c") for d in held}
        assert listing.owner_of(held) == PodRef("ns", "p", "c")
        assert listing.owner_of((*held, "dev-unknown")) is None
        await kubelet._pod_resources.stop()
        failed = await lister.listing()
        assert not failed.ok and failed.error.startswith("List failed: UNAVAILABLE"), failed
        # gRPC unlinks a stopped server's socket in the background: start after it did.
        await until(lambda: not kubelet.pod_resources_socket.exists(), what="unlink")
        await kubelet._pod_resources.start(kubelet.pod_resources_socket)
        deadline = time.monotonic() + 5
        while not (again := await lister.listing()).ok:    # dialled afresh, as passes retry
            assert time.monotonic() < deadline, again
            await asyncio.sleep(0.05)
        assert again.owners == listing.owners
    finally:
        await lister.close()
        await stub.stop()
        await kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


# ---- the daemon's hellos and binding ----

def _hello(record: AllocationRecord) -> tuple[float, Any]:
    start = time.monotonic()
    with ChannelClient(paths.channel_socket(record.channel_dir), timeout=15) as client:
        reply = client.hello()
    return time.monotonic() - start, reply


def test_without_pod_resources_hellos_never_wait(state_dir: Path) -> None:
    record = kubelet_record(state_dir)
    daemon = InProcessDaemon(state_dir, "--pod-resources-socket",
                             str(state_dir / "absent.sock"), "--bind-timeout", "10").wait_ready()
    try:
        wait_served(record)
        elapsed, reply = _hello(record)
        assert elapsed < 0.5 and reply.gpus[0].memory_limit == DEFAULT_MEMORY
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_hello_gives_up_waiting_and_the_defaults_hold(state_dir: Path) -> None:
    # PodResources is there (its socket exists) but never names the pod: each List fails.
    socket_path = state_dir / "pr.sock"
    socket_path.write_text("")
    record = kubelet_record(state_dir)
    daemon = InProcessDaemon(state_dir, "--pod-resources-socket", str(socket_path),
                             "--bind-timeout", "0.5", "--pod-resources-min-interval",
                             "0.05").wait_ready()
    try:
        wait_served(record)
        elapsed, reply = _hello(record)
        assert 0.45 < elapsed < 3.0
        assert reply.gpus[0].memory_limit == DEFAULT_MEMORY
        assert daemon.allocation(record.id)["gpus"][0]["limit_ppm"] == 1_000_000
        assert allocation.load_binding(state_dir, record.id) is None   # never bound
        assert daemon.status()["node"]["pod_resources_lists"] >= 1
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_a_binding_is_applied_to_the_running_channel_at_once(state_dir: Path) -> None:
    # What the watcher binds, the daemon applies to the served channel without a record rewrite.
    record = kubelet_record(state_dir)
    daemon = InProcessDaemon(state_dir, "--pod-resources-socket",
                             str(state_dir / "absent.sock")).wait_ready()
    try:
        with ChannelClient(wait_served(record)) as client:
            assert client.hello().gpus[0].memory_limit == DEFAULT_MEMORY
            assert client.reserve(0, 200 * MiB).granted
            assert daemon.daemon is not None
            applied_now = concurrent.futures.Future[bool]()
            daemon._loop.call_soon_threadsafe(lambda: applied_now.set_result(
                daemon.daemon.bind(Binding(record.id, APP, Share.from_float(0.5), GiB))))   # type: ignore[union-attr]
            assert applied_now.result(5)
            assert allocation.load_binding(state_dir, record.id) == Binding(
                record.id, APP, Share.from_float(0.5), GiB)
            assert allocation.load_record(state_dir, record.id) == record

            def applied() -> bool:
                entry = daemon.allocation(record.id)
                return bool(entry and entry["gpus"][0]["memory_limit"] == GiB)
            wait_for(applied, 5, "the new limits applied")
            entry = daemon.allocation(record.id)
            assert entry["bound"] is True and entry["gpus"][0]["memory_used"] == 200 * MiB
            assert not client.reserve(0, GiB).granted
    finally:
        assert daemon.stop() == 0, daemon.logs()

