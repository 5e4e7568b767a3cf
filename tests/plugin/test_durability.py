"""Allocate's durability rule: answered records survive a plugin crash, directory fsyncs come
just after the answer (batched), and the plugin sweeps stale temporary files at start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from device_plugin import statedir
from device_plugin.allocator import Allocator
from device_plugin.health import HealthTracker
from device_plugin.slices import SliceTable
from tests.plugin.fake_kubelet import FakeKubelet
from vgpu_runtime.common import atomicfile
from vgpu_runtime.common.atomicfile import DirectorySyncer
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.gpus.simulated import SimulatedBackend, simulated_uuid
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from vgpu_runtime.pluginconfig import PluginConfig

REPO = Path(__file__).resolve().parents[2]


class RecordingSyncer(DirectorySyncer):
    """A real syncer that also remembers which directories it was asked to fsync."""

    def __init__(self) -> None:
        super().__init__()
        self.requested: list[str] = []

    def request(self, directory: str | Path) -> None:
        self.requested.append(os.fspath(directory))
        super().request(directory)


def _allocator(config: PluginConfig, syncer: DirectorySyncer | None) -> Allocator:
    gpus = SimulatedBackend(config.simulate_gpus, memory=config.simulate_memory).discover()
    table = SliceTable(gpus, config.slices_per_gpu)
    tracker = HealthTracker([g.uuid for g in gpus], config.ignored_xids, 300)
    return Allocator(config, table, tracker, syncer=syncer)


def test_new_allocation_hands_every_new_name_to_the_syncer(
        make_config: Callable[..., PluginConfig]) -> None:
    config = make_config(injection="both")
    syncer = RecordingSyncer()
    allocator = _allocator(config, syncer)
    ids = [f"{simulated_uuid(0)}::{n}" for n in range(3)]
    allocator.allocate(ids)
    record_id = allocation.id_for_devices(ids)
    channel = paths.channel_dir(config.state_dir, record_id)
    # The channel's name in channels/, the preload file's in the channel, the record's.
    assert syncer.requested == [str(channel.parent), str(channel),
                                str(paths.allocations_dir(config.state_dir))]
    assert syncer.close(timeout=10) and syncer.failures == 0
    # A replay with nothing changed writes nothing, so it asks for no fsync.
    syncer2 = RecordingSyncer()
    allocator.syncer = syncer2
    allocator.allocate(list(reversed(ids)))
    assert syncer2.requested == []


def test_without_a_syncer_the_record_is_fsynced_before_the_answer(
        make_config: Callable[..., PluginConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config()
    calls: list[str] = []
    real = atomicfile.fsync_dir

    def counting(directory: str | Path) -> None:
        calls.append(os.fspath(directory))
        real(directory)

    monkeypatch.setattr(atomicfile, "fsync_dir", counting)
    _allocator(config, None).allocate([f"{simulated_uuid(1)}::0"])
    assert calls == [str(paths.allocations_dir(config.state_dir))]


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_start_sweeps_stale_temps_of_records_channels_and_health(short_dir: Path) -> None:
    state = short_dir / "state"
    channel = paths.channel_dir(state, "k-0123456789abcdef")
    channel.mkdir(parents=True)
    paths.allocations_dir(state).mkdir()
    stale = [paths.allocations_dir(state) / ".k-0123456789abcdef.json.9.a.tmp",
             channel / ".ld.so.preload.9.b.tmp", state / ".health.json.9.c.tmp"]
    young = paths.allocations_dir(state) / ".k-0123456789abcdef.json.10.d.tmp"
    for path in [*stale, young]:
        path.write_bytes(b"{")
    for path in stale:
        _age(path, atomicfile.STALE_TEMP_AGE + 1)
    removed = statedir.prepare(state)
    assert sorted(removed) == sorted(stale)
    assert young.exists(), "a temp file written just now may be a live gemini-run's"
    assert paths.channels_dir(state).is_dir()


def test_start_removes_old_empty_channels_that_no_record_names(short_dir: Path) -> None:
    state = short_dir / "state"
    paths.allocations_dir(state).mkdir(parents=True)
    orphan = paths.channel_dir(state, "k-00000000000000aa")     # crash before the record
    young = paths.channel_dir(state, "r-00000000000000bb")      # a gemini-run writing now
    recorded = paths.channel_dir(state, "k-00000000000000cc")   # its daemon not up yet
    busy = paths.channel_dir(state, "k-00000000000000dd")       # something inside
    for channel in (orphan, young, recorded, busy):
        channel.mkdir(parents=True)
    (busy / "sched.sock").write_bytes(b"")
    allocation.record_path(state, "k-00000000000000cc").write_text("{}")
    for channel in (orphan, recorded, busy):
        _age(channel, atomicfile.STALE_TEMP_AGE + 1)
    assert statedir.prepare(state) == [orphan]
    assert not orphan.exists()
    assert young.is_dir() and recorded.is_dir() and busy.is_dir()


def test_start_on_an_unusable_state_dir_does_not_raise(short_dir: Path) -> None:
    blocker = short_dir / "file"
    blocker.write_text("not a directory")
    assert statedir.prepare(blocker / "state") == []


async def test_record_answered_for_survives_sigkill_right_after_the_answer(
        short_dir: Path) -> None:
    """The plugin is killed the instant Allocate has answered: the record is there, whole, and
    the restarted plugin answers the replay from it (same record, same creation time)."""
    kubelet_dir = short_dir / "kubelet"
    kubelet_dir.mkdir()
    state = short_dir / "state"
    install_hook(paths.default_hook_dir(state))
    kubelet = FakeKubelet(kubelet_dir)
    await kubelet.start()
    args = [sys.executable, "-m", "device_plugin.main", "--simulate-gpus", "2",
            "--kubelet-dir", str(kubelet_dir), "--state-dir", str(state), "--metrics-port", "0"]
    ids = [f"{simulated_uuid(1)}::{n}" for n in (4, 2, 7)]
    request = api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=ids)])
    socket = f"unix://{kubelet_dir / 'gemini-vgpu.sock'}"
    procs = []
    try:
        answers = []
        for _ in range(2):
            kubelet.registered.clear()
            proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            procs.append(proc)
            await asyncio.wait_for(kubelet.registered.wait(), 20)
            async with grpc.aio.insecure_channel(socket) as channel:
                stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
                answers.append(await stub.Allocate(request, timeout=10))
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
            record = allocation.load_record(state, allocation.id_for_devices(ids))
            assert record is not None and sorted(record.device_ids) == sorted(ids)
            assert not [p for p in paths.allocations_dir(state).iterdir()
                        if atomicfile.is_temp_name(p.name)]
        assert answers[0] == answers[1]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await kubelet.stop()
