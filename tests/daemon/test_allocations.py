"""The served allocations (vgpu_runtime/daemon/allocations.py) alone: real record files, real
channels (Unix sockets, pages) and the real token service, no daemon around them. The daemon's
wiring of it is every other daemon test's."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import REPO, child_env
from tests.daemon.helpers import UUID_A, MiB, make_record
from tests.host.test_gpulock import Holder
from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, PodRef
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.allocations import Allocations, NoPods
from vgpu_runtime.daemon.bindings import PodBindings
from vgpu_runtime.daemon.channel.reconcile import UNATTRIBUTED_REASON
from vgpu_runtime.daemon.channel.tokens import TokenService
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.troubles import Troubles

GONE = "k-00000000000000ff"
POD = PodRef("ml", "train", "main", "uid-1")


class Served:
    """An Allocations on a state directory, with the events it announces kept in order."""

    def __init__(self, state_dir: Path, *flags: str) -> None:
        self.config = cfg.load_all(DaemonConfig, ["--state-dir", str(state_dir), *flags]).config
        paths.allocations_dir(state_dir).mkdir(parents=True, exist_ok=True)
        self.state_dir = state_dir
        self.tokens = TokenService(self.config)
        self.bindings = PodBindings(state_dir)
        self.events: list[tuple[Any, ...]] = []
        self.allocations = Allocations(self.config, self.tokens, self.bindings, Troubles(),
                                       self.notify)

    def notify(self, event: str, record: AllocationRecord, more: dict[str, object],
               binding: Binding | None = None) -> None:
        self.events.append((event, record.id, more, binding))


@pytest.fixture
def state_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ga-"))   # short: socket paths fit in 107 bytes
    yield root / "state"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def served(state_dir: Path) -> AsyncIterator[Served]:
    s = Served(state_dir)
    yield s
    await s.allocations.close("test over")
    s.tokens.close()


async def test_a_record_is_served_until_it_is_removed(served: Served) -> None:
    record = make_record(served.state_dir)
    await served.allocations.sync()
    assert paths.channel_socket(record.channel_dir).exists()
    assert served.allocations.records() == [record]
    assert [s["id"] for s in served.allocations.snapshot()] == [record.id]
    assert served.events == [("added", record.id, {}, None)]

    await served.allocations.sync()   # nothing changed: nothing announced
    assert len(served.events) == 1

    allocation.remove_record(served.state_dir, record.id)
    await served.allocations.sync()
    assert served.allocations.records() == []
    assert not paths.channel_socket(record.channel_dir).exists()
    assert served.events[-1] == ("removed", record.id, {}, None)


async def test_a_corrupt_record_is_listed_and_not_served(served: Served) -> None:
    good = make_record(served.state_dir)
    bad = paths.allocations_dir(served.state_dir) / "k-broken.json"
    bad.write_text("{not json")
    await served.allocations.sync()
    assert served.allocations.records() == [good]
    (entry,) = served.allocations.corrupt_records()
    assert entry["path"] == str(bad) and "not valid JSON" in entry["error"]


async def test_a_binding_is_stored_and_applied_then_dropped_with_its_record(
        served: Served) -> None:
    record = make_record(served.state_dir, gpus=((UUID_A, 512 * MiB, 0.5),))
    await served.allocations.sync()
    assert served.allocations.bind(Binding(record.id, POD, limit=Share.parse("0.75"),
                                           memory_limit=256 * MiB))
    assert allocation.load_binding(served.state_dir, record.id) == Binding(
        record.id, POD, Share.from_float(0.75), 256 * MiB)
    (snapshot,) = served.allocations.snapshot()
    assert snapshot["gpus"][0]["memory_limit"] == 256 * MiB
    assert snapshot["gpus"][0]["limit_ppm"] == 750_000

    allocation.remove_record(served.state_dir, record.id)
    await served.allocations.sync()
    assert allocation.load_binding(served.state_dir, record.id) is None
    assert served.bindings.get(record.id) is None


async def test_binding_an_allocation_no_longer_served_is_refused(served: Served) -> None:
    assert not served.allocations.bind(Binding(GONE, POD))
    assert allocation.load_binding(served.state_dir, GONE) is None


async def test_collect_ends_the_allocation_and_says_why(served: Served) -> None:
    record = make_record(served.state_dir)
    await served.allocations.sync()
    binding = Binding(record.id, POD)
    assert served.allocations.bind(binding)
    await served.allocations.collect(record.id, "pod ml/train ended")
    assert allocation.load_record(served.state_dir, record.id) is None
    assert not os.path.exists(record.channel_dir)
    assert allocation.load_binding(served.state_dir, record.id) is None
    assert served.allocations.records() == []
    assert served.events[-1] == ("collected", record.id, {"reason": "pod ml/train ended"},
                                 binding)


async def test_collect_of_a_record_not_served_still_removes_it(served: Served) -> None:
    """A record the daemon never served (written after the last poll) is collected too."""
    record = make_record(served.state_dir)
    os.makedirs(record.channel_dir)
    await served.allocations.collect(record.id, "no pod holds its slices")
    assert allocation.load_record(served.state_dir, record.id) is None
    assert not os.path.exists(record.channel_dir)
    assert served.events == [("collected", record.id, {"reason": "no pod holds its slices"},
                              None)]


async def test_close_leaves_records_and_directories(served: Served) -> None:
    record = make_record(served.state_dir)
    await served.allocations.sync()
    await served.allocations.close("stopping")
    assert allocation.load_record(served.state_dir, record.id) == record
    assert os.path.isdir(record.channel_dir)
    assert served.allocations.records() == []


def holder_uid(locks: Path) -> int | None:
    """Who holds UUID_A, as another user's process sees it (a process never sees its own
    POSIX locks)."""
    seen = subprocess.run(
        [sys.executable, "-c", "import sys; from vgpu_runtime import gpulock; "
         "h = gpulock.holder(sys.argv[1], sys.argv[2], 4242); print(h and h.uid)",
         str(locks), UUID_A], capture_output=True, text=True, cwd=REPO, env=child_env(),
        timeout=30, check=True)
    return None if seen.stdout.strip() == "None" else int(seen.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="a lock directory like /run/lock is root's")
async def test_with_gpu_locks_each_gpu_served_is_held_host_wide_until_none_is_on_it(
        state_dir: Path) -> None:
    """gemini-run's daemons (gpu_lock_dir, daemon/gpuclaims.py): a GPU is claimed before its
    first allocation is served, let go once none is left on it, and one another user's daemon
    holds is refused, naming that user."""
    locks = state_dir.parent / "locks"
    locks.mkdir(mode=0o1777)
    os.chmod(locks, 0o1777)
    served = Served(state_dir, "--gpu-lock-dir", str(locks))
    try:
        record = make_record(state_dir)
        await served.allocations.sync()
        assert served.allocations.records() == [record]
        assert holder_uid(locks) == os.geteuid()

        allocation.remove_record(state_dir, record.id)
        await served.allocations.sync()
        assert holder_uid(locks) is None

        other = Holder(locks, 4242, UUID_A)
        try:
            refused = make_record(state_dir)
            await served.allocations.sync()
        finally:
            other.end()
        assert served.allocations.records() == []
        why = served.allocations.corrupt[str(allocation.record_path(state_dir, refused.id))]
        assert "uid 4242" in why, why
    finally:
        await served.allocations.close("test over")
        served.tokens.close()


class NodeEvents(NoPods):
    """The pod watch's part that posts Events on the Node, recorded."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str]] = []

    def post_node_event(self, reason: str, message: str) -> None:
        self.posted.append((reason, message))


async def until_equal(read: Any, want: Any, what: str) -> None:
    for _ in range(100):
        if read() == want:
            return
        await asyncio.sleep(0.05)
    assert read() == want, what


async def test_a_process_of_no_allocation_on_a_served_gpu_is_listed_and_reported_never_charged(
        state_dir: Path) -> None:
    """NVML reconciliation through the served allocations: a process on the GPU of a served
    allocation that belongs to none is what status shows as unattributed, and gets one Event
    on the Node while it is listed, not one per reading; another such process gets its own."""
    figures = state_dir.parent / "figures.json"
    served = Served(state_dir, "--process-memory", "simulated", "--process-memory-file",
                    str(figures), "--process-memory-interval", "0.05")
    node = NodeEvents()
    served.allocations.pods = node
    stray = subprocess.Popen(["sleep", "60"])   # no mount, no pod, no gemini-run: no allocation
    other = subprocess.Popen(["sleep", "60"])
    try:
        figures.write_text(json.dumps({UUID_A: {str(stray.pid): 300 * MiB}}))
        assert served.allocations.unattributed() == []
        make_record(served.state_dir)
        await served.allocations.sync()
        want = [{"gpu": UUID_A, "pid": stray.pid, "process_bytes": 300 * MiB}]
        await until_equal(served.allocations.unattributed, want, "the stray listed")
        (snapshot,) = served.allocations.snapshot()
        assert snapshot["gpus"][0]["memory_used"] == 0   # nobody charged for it
        await asyncio.sleep(0.3)                          # several readings: one Event
        ((reason, message),) = node.posted
        assert reason == UNATTRIBUTED_REASON == "GPUMemoryOfNoAllocation"
        assert message.startswith(f"process {stray.pid} (sleep) holds 300 MiB "
                                  f"({300 * MiB} bytes) on GPU {UUID_A}"), message
        assert "belongs to none of them" in message, message
        figures.write_text(json.dumps({UUID_A: {str(stray.pid): 300 * MiB,
                                                str(other.pid): 100 * MiB}}))
        await until_equal(lambda: len(node.posted), 2, "the other's Event")
        assert node.posted[1][1].startswith(f"process {other.pid} (sleep) holds 100 MiB")
        await asyncio.sleep(0.3)
        assert len(node.posted) == 2, node.posted
    finally:
        for process in (stray, other):
            process.kill()
            process.wait()
        await served.allocations.close("test over")
        served.tokens.close()


# A stand-in for the MPS server: a process that names itself as the server does (comm).
MPS_SERVER_LIKE = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'nvidia-cuda-mps-server')"
                   "; print('named', flush=True); time.sleep(60)")


@pytest.mark.parametrize("mps", [True, False])
async def test_the_mps_server_is_reported_as_what_its_name_claims_only_with_mps_on(
        state_dir: Path, mps: bool) -> None:
    """Over MPS the server holds memory of its own that no allocation is charged for: its
    Event says so (still an Event: the name is the process's to choose, so it hides nothing).
    Without mps the same name is any process of no allocation."""
    figures = state_dir.parent / "figures.json"
    served = Served(state_dir, "--process-memory", "simulated", "--process-memory-file",
                    str(figures), "--process-memory-interval", "0.05", "--mps", str(mps).lower(),
                    "--mps-manage", "false")
    node = NodeEvents()
    served.allocations.pods = node
    server = subprocess.Popen([sys.executable, "-c", MPS_SERVER_LIKE], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "named\n"
        figures.write_text(json.dumps({UUID_A: {str(server.pid): 64 * MiB}}))
        make_record(served.state_dir)
        await served.allocations.sync()
        await until_equal(lambda: len(node.posted), 1, "the Event")
        ((reason, message),) = node.posted
        assert reason == UNATTRIBUTED_REASON
        assert message.startswith(f"process {server.pid} (nvidia-cuda-mps) holds 64 MiB"), message
        said = "by its name the MPS server of this node's tenants"
        assert (said in message) is mps, message
        assert ("belongs to none of them" in message) is not mps, message
    finally:
        server.kill()
        server.wait()
        await served.allocations.close("test over")
        served.tokens.close()
