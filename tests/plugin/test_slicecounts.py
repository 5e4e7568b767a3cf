"""device_plugin.slicecounts: which GPUs take a new slices_per_gpu now, and which wait."""

from __future__ import annotations

import json
import time
from pathlib import Path

from device_plugin.slicecounts import SliceCounts, counts_file
from device_plugin.slices import SliceTable
from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.pluginconfig import PluginConfig

GPUS = SimulatedBackend(2).discover()


def write_record(state_dir: Path, gpu: int, slices: int) -> AllocationRecord:
    uuid = GPUS[gpu].uuid
    ids = tuple(f"{uuid}::{n}" for n in range(slices))
    record_id = allocation.id_for_devices(ids)
    record = AllocationRecord(
        id=record_id, origin="kubelet", device_ids=ids,
        gpus=(GpuShare(uuid, gpu, Share.of_slices(slices, 10), 1 << 30, 1 << 30),),
        channel_dir=str(paths.channel_dir(state_dir, record_id)),
        hook_library=hooklib.library_name(), created_at=time.time())
    allocation.write_record(state_dir, record)
    return record


def test_first_start_takes_the_configured_count_everywhere(tmp_path: Path) -> None:
    write_record(tmp_path, 0, 3)    # no slices.json: nothing says what was advertised
    table = SliceCounts(str(tmp_path), GPUS, 4).start()
    assert table.counts == {GPUS[0].uuid: 4, GPUS[1].uuid: 4}
    written = json.loads(counts_file(tmp_path).read_text())
    assert {u: e["advertised"] for u, e in written.items()} == table.counts


def test_a_gpu_with_a_live_record_waits_and_switches_once_it_is_gone(tmp_path: Path) -> None:
    SliceCounts(str(tmp_path), GPUS, 10).start()
    record = write_record(tmp_path, 0, 3)
    counts = SliceCounts(str(tmp_path), GPUS, 4)
    table = counts.start()
    assert table.counts == {GPUS[0].uuid: 10, GPUS[1].uuid: 4}
    assert counts.draining == {GPUS[0].uuid}
    assert counts.settle() is None        # still live
    allocation.remove_record(tmp_path, record.id)
    switched = counts.settle()
    assert switched is not None and switched.counts == {GPUS[0].uuid: 4, GPUS[1].uuid: 4}
    assert counts.draining == frozenset()
    # A restart after the switch starts from the new counts.
    assert SliceCounts(str(tmp_path), GPUS, 4).start().counts == switched.counts


def test_an_unreadable_record_keeps_every_changing_gpu_waiting(tmp_path: Path) -> None:
    SliceCounts(str(tmp_path), GPUS, 10).start()
    (paths.allocations_dir(tmp_path)).mkdir(parents=True, exist_ok=True)
    (paths.allocations_dir(tmp_path) / "k-0000000000000000.json").write_text("{not json")
    counts = SliceCounts(str(tmp_path), GPUS, 4)
    assert counts.start().counts == {GPUS[0].uuid: 10, GPUS[1].uuid: 10}
    assert counts.draining == {GPUS[0].uuid, GPUS[1].uuid}


def test_allocate_on_a_waiting_gpu_is_refused_but_a_replay_is_served(tmp_path: Path) -> None:
    from device_plugin.allocator import AllocationError, Allocator
    from vgpu_runtime.devkit.hookdir import install_hook

    config = PluginConfig(state_dir=str(tmp_path), slices_per_gpu=10)
    install_hook(config.host_hook_dir)
    allocator = Allocator(config, SliceTable(GPUS, 10))
    live = [f"{GPUS[0].uuid}::{n}" for n in range(3)]
    first = allocator.allocate(live)
    allocator.draining = frozenset({GPUS[0].uuid})
    assert allocator.allocate(live) == first     # a container restart replays its devices
    try:
        allocator.allocate([f"{GPUS[0].uuid}::5"])
    except AllocationError as err:
        assert "take no new allocation" in err.message
    else:
        raise AssertionError("a new allocation on a waiting GPU was served")
