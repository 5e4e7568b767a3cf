"""The served allocations (vgpu_runtime/daemon/allocations.py) alone: real record files, real
channels (Unix sockets, pages) and the real token service, no daemon around them. The daemon's
wiring of it is every other daemon test's."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import UUID_A, MiB, make_record
from vgpu_runtime import allocation, paths
from vgpu_runtime.allocation import AllocationRecord, Binding, PodRef
from vgpu_runtime.common import config as cfg
from vgpu_runtime.daemon.allocations import Allocations
from vgpu_runtime.daemon.bindings import PodBindings
from vgpu_runtime.daemon.channel.tokens import TokenService
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.troubles import Troubles

GONE = "k-00000000000000ff"
POD = PodRef("ml", "train", "main", "uid-1")


class Served:
    """An Allocations on a state directory, with the events it announces kept in order."""

    def __init__(self, state_dir: Path) -> None:
        self.config = cfg.load_all(DaemonConfig, ["--state-dir", str(state_dir)]).config
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
    assert served.allocations.bind(Binding(record.id, POD, limit=0.75, memory_limit=256 * MiB))
    assert allocation.load_binding(served.state_dir, record.id) == Binding(
        record.id, POD, 0.75, 256 * MiB)
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
