from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from device_plugin.allocator import AllocationError, Allocator
from device_plugin.slices import SliceTable
from tests.plugin.conftest import Make
from tests.readonly import read_only_call
from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.pluginconfig import PluginConfig

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def slice_ids(table: SliceTable, gpu: int, count: int) -> list[str]:
    return [s.id for s in table.slices_of(table.gpus[gpu].uuid)[:count]]


def rejected(allocator: Allocator, ids: list[str]) -> AllocationError:
    with pytest.raises(AllocationError) as caught:
        allocator.allocate(ids)
    return caught.value


# ---- validation ----

def test_unknown_ids_are_named(make: Make) -> None:
    allocator, table, _ = make()
    err = rejected(allocator, [*slice_ids(table, 0, 1), "GPU-gone::3"])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown device ID(s) GPU-gone::3" in err.message and "delete the pod" in err.message


def test_duplicates_are_named(make: Make) -> None:
    allocator, table, _ = make()
    one = slice_ids(table, 0, 1)[0]
    err = rejected(allocator, [one, one])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and one in err.message
    assert "more than once" in err.message


def test_empty_request_is_refused(make: Make) -> None:
    allocator, _, _ = make()
    assert rejected(allocator, []).code == grpc.StatusCode.INVALID_ARGUMENT


def test_slices_of_two_gpus_are_refused(make: Make) -> None:
    allocator, table, _ = make()
    err = rejected(allocator, slice_ids(table, 0, 2) + slice_ids(table, 1, 1))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "from 2 GPUs" in err.message and "must be on one GPU" in err.message


def test_more_than_a_gpu_must_be_whole_gpus(make: Make) -> None:
    allocator, table, _ = make()
    err = rejected(allocator, slice_ids(table, 0, 10) + slice_ids(table, 1, 2))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "not a multiple of 10" in err.message


def test_uneven_whole_gpu_request_is_refused(make: Make) -> None:
    allocator, _table, _ = make(simulate_gpus=3, slices_per_gpu=4)
    table = allocator.table
    ids = slice_ids(table, 0, 4) + slice_ids(table, 1, 2) + slice_ids(table, 2, 2)
    err = rejected(allocator, ids)
    assert "must take whole GPUs" in err.message and "(2 of 4)" in err.message


def test_unhealthy_gpu_is_refused_for_new_allocations(make: Make) -> None:
    allocator, table, tracker = make()
    tracker.xid(table.gpus[0].uuid, 79)
    err = rejected(allocator, slice_ids(table, 0, 2))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unhealthy" in err.message and "critical XID 79" in err.message


# ---- response per strategy ----

def test_response_with_cdi(make: Make) -> None:
    allocator, table, _ = make(device_list_strategy="cdi")
    answer = allocator.allocate(slice_ids(table, 1, 3))
    uuid = table.gpus[1].uuid
    record_id = allocation.id_for_devices(slice_ids(table, 1, 3))
    assert [d.name for d in answer.cdi_devices] == [f"nvidia.com/gpu={uuid}"]
    assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert answer.envs["CUDA_VISIBLE_DEVICES"] == uuid
    assert answer.envs["LD_PRELOAD"] == f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}"
    assert answer.envs[paths.ENV_CHANNEL_DIR] == paths.CONTAINER_CHANNEL_DIR
    assert answer.envs[paths.ENV_ALLOCATION_ID] == record_id
    assert answer.envs[paths.ENV_SHARE] == "0.3"
    assert answer.envs[paths.ENV_MEMORY_LIMIT] == str(3 * ((100 * GIB - 2 * GIB) // 10))
    mounts = {m.container_path: m for m in answer.mounts}
    assert mounts[paths.CONTAINER_LIB_DIR].host_path == str(allocator.config.host_hook_dir)
    assert mounts[paths.CONTAINER_LIB_DIR].read_only
    channel = paths.channel_dir(allocator.config.state_dir, record_id)
    assert mounts[paths.CONTAINER_CHANNEL_DIR].host_path == str(channel)
    assert channel.is_dir()
    assert not answer.devices


def test_response_with_envvar(make: Make) -> None:
    allocator, table, _ = make(device_list_strategy="envvar")
    answer = allocator.allocate(slice_ids(table, 0, 10) + slice_ids(table, 1, 10))
    both = f"{table.gpus[0].uuid},{table.gpus[1].uuid}"
    assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == both
    assert answer.envs["CUDA_VISIBLE_DEVICES"] == both
    assert answer.envs[paths.ENV_SHARE] == "1.0"
    assert not answer.cdi_devices and not answer.devices


def test_response_with_device_nodes(make: Make) -> None:
    allocator, table, _ = make(device_list_strategy="device-nodes")
    answer = allocator.allocate(slice_ids(table, 1, 1))
    nodes = [(d.container_path, d.host_path, d.permissions) for d in answer.devices]
    assert nodes == [(p, p, "rw") for p in ("/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                                            "/dev/nvidia-uvm-tools")]
    assert answer.envs["CUDA_VISIBLE_DEVICES"] == table.gpus[1].uuid


# ---- the record ----

@pytest.mark.parametrize("injection, env, file", [
    ("ld-preload", True, False), ("preload-file", False, True), ("both", True, True)])
def test_each_injection_method(make: Make, injection: str, env: bool, file: bool) -> None:
    allocator, table, _ = make(injection=injection)
    answer = allocator.allocate(slice_ids(table, 0, 2))
    hook = f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}"
    assert (answer.envs.get("LD_PRELOAD") == hook) is env
    mounts = {m.container_path: m for m in answer.mounts}
    assert (paths.CONTAINER_PRELOAD_FILE in mounts) is file
    channel = paths.channel_dir(allocator.config.state_dir, answer.envs[paths.ENV_ALLOCATION_ID])
    preload = channel / paths.CHANNEL_PRELOAD_NAME
    assert preload.exists() is file
    if file:
        mount = mounts[paths.CONTAINER_PRELOAD_FILE]
        assert mount.read_only and mount.host_path == str(preload)
        assert preload.read_text() == hook + "\n"
        preload.unlink()                      # a replay restores what the response points to
        assert allocator.allocate(slice_ids(table, 0, 2)) == answer
        assert preload.read_text() == hook + "\n"


def test_record_contents(make: Make) -> None:
    allocator, table, _ = make()
    ids = slice_ids(table, 1, 4)
    allocator.allocate(list(reversed(ids)))
    record = allocation.load_record(allocator.config.state_dir, allocation.id_for_devices(ids))
    assert record is not None
    assert record.origin == "kubelet" and record.device_ids == tuple(ids)
    (gpu,) = record.gpus
    assert (gpu.uuid, gpu.index, gpu.share) == (table.gpus[1].uuid, 1, Share.of_slices(4, 10))
    assert gpu.memory_limit == 4 * ((100 * GIB - 2 * GIB) // 10)
    assert record.hook_library == hooklib.library_name() and record.created_at == 1000.0
    assert record.channel_dir == str(paths.channel_dir(allocator.config.state_dir, record.id))


def test_whole_gpu_record_gets_all_memory_but_the_reserve(make: Make) -> None:
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 10) + slice_ids(table, 1, 10)
    answer = allocator.allocate(ids)
    record = allocation.load_record(allocator.config.state_dir,
                                    answer.envs[paths.ENV_ALLOCATION_ID])
    assert record is not None
    assert [(g.share, g.memory_limit) for g in record.gpus] == [(Share.parse("1"), 98 * GIB)] * 2


def test_slices_of_a_gpu_fit_on_it(make: Make) -> None:
    allocator, table, _ = make(slices_per_gpu=7, simulate_memory=80 * GIB + 3)
    gpu = table.gpus[0]
    assert allocator.entitled_memory(gpu, 1) * 7 <= gpu.memory_total - 2 * GIB
    assert allocator.entitled_memory(gpu, 1) == (78 * GIB + 3) // 7
    assert allocator.entitled_memory(gpu, 7) == 78 * GIB + 3


def test_repeated_allocate_is_idempotent_and_keeps_created_at(make: Make) -> None:
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 3)
    first = allocator.allocate(ids)
    path = allocation.record_path(allocator.config.state_dir, first.envs[paths.ENV_ALLOCATION_ID])
    before = path.read_bytes()
    allocator.clock = lambda: 2000.0
    again = allocator.allocate(list(reversed(ids)))
    assert again == first
    assert path.read_bytes() == before
    assert len(list(path.parent.glob("*.json"))) == 1


def test_a_replay_writes_the_entitlement_only_and_leaves_the_binding_alone(make: Make) -> None:
    """An init container's slices given again to the app container: the record keeps what the
    slices give, and the daemon's binding file (pod, overrides) is neither read nor written."""
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 3)
    first = allocator.allocate(ids)
    state = allocator.config.state_dir
    record = allocation.load_record(state, first.envs[paths.ENV_ALLOCATION_ID])
    assert record is not None
    assert record.gpus[0].memory_limit == allocator.entitled_memory(table.gpus[0], 3)
    assert record.gpus[0].slices_per_gpu == 10 and record.limit is None
    binding = allocation.Binding(record.id, allocation.PodRef("ns", "pod", "init", "uid"),
                                 Share.from_float(0.5), 4 << 30)
    path = allocation.write_binding(state, binding)
    written = path.read_bytes()
    again = allocator.allocate(ids)
    assert allocation.load_record(state, record.id) == record
    assert path.read_bytes() == written
    assert again.envs[paths.ENV_MEMORY_LIMIT] == str(record.gpus[0].memory_limit)


def test_a_version_1_record_an_older_daemon_bound_is_left_as_it_is(make: Make) -> None:
    """Today's daemon wrote the pod and its annotations into the plugin's record: a replay after
    the upgrade answers with the entitlement and leaves the file for the new daemon to read
    the binding from."""
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 3)
    first = allocator.allocate(ids)
    state = allocator.config.state_dir
    path = allocation.record_path(state, first.envs[paths.ENV_ALLOCATION_ID])
    entitled = allocator.entitled_memory(table.gpus[0], 3)
    old = json.loads(path.read_text())
    old["version"] = 1
    del old["gpus"][0]["slices_per_gpu"]
    old["gpus"][0].update(memory_limit=4 << 30, default_memory=entitled)
    old.update(limit=0.5, pod={"namespace": "ns", "name": "pod", "container": "init",
                               "uid": "uid"})
    path.write_text(json.dumps(old))
    written = path.read_bytes()
    again = allocator.allocate(ids)
    assert path.read_bytes() == written
    assert again.envs[paths.ENV_MEMORY_LIMIT] == str(entitled)
    assert again.envs[paths.ENV_SHARE] == "0.3"
    # One the old daemon never bound is rewritten in today's format.
    del old["pod"], old["gpus"][0]["default_memory"]
    old.update(limit=None)
    old["gpus"][0]["memory_limit"] = entitled
    path.write_text(json.dumps(old))
    allocator.allocate(ids)
    assert json.loads(path.read_text())["version"] == allocation.RECORD_VERSION


def test_replay_is_allowed_on_an_unhealthy_gpu(make: Make) -> None:
    allocator, table, tracker = make()
    ids = slice_ids(table, 0, 3)
    first = allocator.allocate(ids)
    tracker.xid(table.gpus[0].uuid, 79)
    assert allocator.allocate(ids) == first  # a kept response must stay valid


def test_state_dir_too_long_for_channel_socket(make: Make, short_dir: Path) -> None:
    allocator, table, _ = make()
    long_state = short_dir / ("s" * 80)
    allocator.config = type(allocator.config)(**{**allocator.config.__dict__,
                                                 "state_dir": str(long_state),
                                                 "hook_dir": str(allocator.config.host_hook_dir)})
    err = rejected(allocator, slice_ids(table, 0, 1))
    assert "longer than 107 bytes" in err.message and "--state-dir" in err.message
    assert not long_state.exists()


def test_read_only_state_dir_fails_clearly_and_damages_nothing(make: Make) -> None:
    allocator, table, _ = make()
    kept = allocator.allocate(slice_ids(table, 0, 2))
    records = paths.allocations_dir(allocator.config.state_dir)
    snapshot = {p.name: p.read_bytes() for p in records.iterdir()}

    def refused() -> tuple[grpc.StatusCode, str]:
        err = rejected(allocator, slice_ids(table, 1, 2))
        return err.code, err.message

    code, message = read_only_call(records, refused)
    assert code == grpc.StatusCode.INTERNAL
    assert "cannot store allocation" in message and "writable" in message
    assert {p.name: p.read_bytes() for p in records.iterdir()} == snapshot
    new_channel = paths.channel_dir(allocator.config.state_dir,
                                    allocation.id_for_devices(slice_ids(table, 1, 2)))
    assert not new_channel.exists(), "a failed Allocate leaves no empty channel behind"
    assert allocator.allocate(slice_ids(table, 0, 2)) == kept


def test_full_state_dir_fails_clearly_and_damages_nothing(short_dir: Path) -> None:
    """A real write failure that root cannot bypass: a file-size limit (EFBIG), in a child."""
    script = f"""
import os, resource, signal, json
from device_plugin.allocator import AllocationError, Allocator
from vgpu_runtime.pluginconfig import PluginConfig
from vgpu_runtime.gpus.simulated import SimulatedBackend
from device_plugin.slices import SliceTable
from vgpu_runtime.devkit.hookdir import install_hook
from tests.plugin.conftest import Make
from tests.readonly import read_only_call
from vgpu_runtime.contracts import allocation, paths
config = PluginConfig(state_dir={str(short_dir / "state")!r}, simulate_gpus=2)
install_hook(config.host_hook_dir)
table = SliceTable(SimulatedBackend(2).discover(), 10)
allocator = Allocator(config, table)
kept_ids = [s.id for s in table.all()[:2]]
kept = allocator.allocate(kept_ids)
records = paths.allocations_dir(config.state_dir)
snapshot = {{p.name: p.read_bytes() for p in records.iterdir()}}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
new_ids = [s.id for s in table.all()[10:12]]
try:
    allocator.allocate(new_ids)
except AllocationError as err:
    print("ERROR", err.code.name, err.message)
assert {{p.name: p.read_bytes() for p in records.iterdir()}} == snapshot, "records changed"
assert not paths.channel_dir(config.state_dir, allocation.id_for_devices(new_ids)).exists()
assert allocator.allocate(kept_ids) == kept
print("INTACT")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "ERROR INTERNAL cannot store allocation" in done.stdout
    assert "File too large" in done.stdout and "free space" in done.stdout
    assert "INTACT" in done.stdout


def test_corrupt_existing_record_is_reported_not_overwritten(make: Make) -> None:
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 2)
    path = allocation.record_path(allocator.config.state_dir, allocation.id_for_devices(ids))
    path.parent.mkdir(parents=True)
    path.write_text("{half")
    err = rejected(allocator, ids)
    assert "not valid JSON" in err.message and "move the file aside" in err.message
    assert path.read_text() == "{half"


def test_a_failed_allocate_of_several_containers_leaves_nothing(make: Make) -> None:
    """All or nothing: the first container's record is written, the second's cannot be (a
    corrupt file holds its name), and the first is ended again: record and channel directory,
    its preload file with it (allocation.end_allocation, the records' one deleter)."""
    allocator, table, _ = make(injection="preload-file")
    first, second = slice_ids(table, 0, 2), slice_ids(table, 1, 2)
    state_dir = allocator.config.state_dir
    corrupt = allocation.record_path(state_dir, allocation.id_for_devices(second))
    corrupt.parent.mkdir(parents=True)
    corrupt.write_text("{half")
    with pytest.raises(AllocationError, match="not valid JSON"):
        allocator.allocate_all([first, second])
    first_id = allocation.id_for_devices(first)
    assert allocation.load_record(state_dir, first_id) is None
    assert not paths.channel_dir(state_dir, first_id).exists()
    assert corrupt.read_text() == "{half"   # not this call's: left for the operator
    assert allocator.allocate_all([first])[0].envs[paths.ENV_ALLOCATION_ID] == first_id


def test_memory_reserve_larger_than_gpu_is_refused(make_config: Callable[..., PluginConfig]
                                                   ) -> None:
    config = make_config()
    gpus = SimulatedBackend(1, memory=GIB).discover()
    with pytest.raises(ValueError, match="memory_reserve"):
        Allocator(config, SliceTable(gpus, 10))


def test_record_is_valid_json_for_the_daemon(make: Make) -> None:
    allocator, table, _ = make()
    answer = allocator.allocate(slice_ids(table, 0, 1))
    path = allocation.record_path(allocator.config.state_dir, answer.envs[paths.ENV_ALLOCATION_ID])
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["origin"] == "kubelet"
    assert "pod" not in data and "default_memory" not in data["gpus"][0]
    assert data["gpus"][0]["slices_per_gpu"] == 10
    assert allocation.read_record(path).gpus[0].share == Share.of_slices(1, 10)
    assert data["gpus"][0]["share"] == 0.1


# ---- replays answered from a kept response ----

def test_replay_after_the_daemon_changed_the_record_answers_from_the_file(make: Make) -> None:
    """A kept answer is used only while the file holds the very bytes it was made from: a
    record changed after the first answer (by an older plugin's settings, or by hand) answers
    with its own entitled memory, which a replay keeps."""
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 3)
    first = allocator.allocate(ids)
    assert allocator.allocate(ids) is first     # unchanged file: the kept answer
    state = allocator.config.state_dir
    record = allocation.load_record(state, first.envs[paths.ENV_ALLOCATION_ID])
    assert record is not None
    annotated = dataclasses.replace(
        record, gpus=tuple(dataclasses.replace(g, memory_limit=5 << 30) for g in record.gpus))
    allocation.write_record(state, annotated)
    again = allocator.allocate(ids)
    assert again.envs[paths.ENV_MEMORY_LIMIT] == str(5 << 30)
    assert allocation.load_record(state, record.id) == annotated
    assert allocator.allocate(ids) is again     # and that answer is kept in turn


def test_replay_after_the_record_was_removed_writes_it_again(make: Make) -> None:
    allocator, table, tracker = make()
    ids = slice_ids(table, 1, 2)
    first = allocator.allocate(ids)
    path = allocation.record_path(allocator.config.state_dir, first.envs[paths.ENV_ALLOCATION_ID])
    path.unlink()
    assert allocator.allocate(ids) == first
    assert allocation.read_record(path).device_ids == tuple(ids)
    path.unlink()                                 # gone, and now a new allocation: health counts
    tracker.xid(table.gpus[1].uuid, 79)
    assert rejected(allocator, ids).code == grpc.StatusCode.FAILED_PRECONDITION
    assert not path.exists()


def test_replay_over_a_record_corrupted_after_the_answer_is_refused(make: Make) -> None:
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 2)
    first = allocator.allocate(ids)
    path = allocation.record_path(allocator.config.state_dir, first.envs[paths.ENV_ALLOCATION_ID])
    path.write_text("{half")
    err = rejected(allocator, ids)
    assert err.code == grpc.StatusCode.INTERNAL and "not valid JSON" in err.message
    assert path.read_text() == "{half"


def test_log_line_waits_for_the_answer_and_names_no_slice(
        make_config: Callable[..., PluginConfig], caplog: pytest.LogCaptureFixture) -> None:
    config = make_config(slices_per_gpu=100)
    gpus = SimulatedBackend(2, memory=100 * GIB).discover()
    table = SliceTable(gpus, 100)
    later: list[Callable[[], None]] = []
    allocator = Allocator(config, table, defer=later.append)
    ids = [s.id for g in gpus for s in table.slices_of(g.uuid)]
    with caplog.at_level("INFO", logger="device_plugin.allocator"):
        allocator.allocate(ids)
        allocator.allocate(ids)
        assert not [r for r in caplog.records if r.msg == "allocated"]
        for work in later:
            work()
    lines = [r for r in caplog.records if r.msg == "allocated"]
    assert [(r.slices, r.gpus, r.replay) for r in lines] == [  # type: ignore[attr-defined]
        (200, [g.uuid for g in gpus], False), (200, [g.uuid for g in gpus], True)]


# ---- the interposer ----

@pytest.mark.parametrize("injection", ["ld-preload", "preload-file", "both"])
def test_refused_without_the_interposer_and_nothing_is_written(make: Make,
                                                               injection: str) -> None:
    """Without the library the answer names, the loader skips it and the pod runs ungated."""
    allocator, table, _ = make(injection=injection)
    library = allocator.config.host_hook_dir / hooklib.library_name()
    library.unlink()
    ids = slice_ids(table, 0, 2)
    err = rejected(allocator, ids)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(library) in err.message and "does not exist" in err.message
    assert "gemini-install-hook" in err.message
    state = allocator.config.state_dir
    assert not paths.allocations_dir(state).exists() or not any(
        paths.allocations_dir(state).iterdir()), "a refused Allocate writes no record"
    assert not paths.channel_dir(state, allocation.id_for_devices(ids)).exists()
    install_hook(allocator.config.host_hook_dir)
    assert allocator.allocate(ids).envs[paths.ENV_ALLOCATION_ID] == \
        allocation.id_for_devices(ids)


def test_replay_is_refused_once_the_interposer_is_gone(make: Make) -> None:
    allocator, table, _ = make()
    ids = slice_ids(table, 0, 2)
    allocator.allocate(ids)
    record_id = allocation.id_for_devices(ids)
    before = allocation.record_path(allocator.config.state_dir, record_id).read_bytes()
    (allocator.config.host_hook_dir / hooklib.library_name()).unlink()
    err = rejected(allocator, ids)
    assert "does not exist" in err.message
    assert allocation.record_path(allocator.config.state_dir, record_id).read_bytes() == before


def test_interposer_that_is_a_link_is_refused(make: Make, short_dir: Path) -> None:
    allocator, table, _ = make(hook_dir=str(short_dir / "hooks"))
    library = allocator.config.host_hook_dir / hooklib.library_name()
    real = short_dir / "elsewhere.so"
    library.rename(real)
    library.symlink_to(real)
    err = rejected(allocator, slice_ids(table, 0, 1))
    assert "is not a regular file" in err.message and str(library) in err.message


# ---- one container environment for both allocators ----

@pytest.mark.parametrize(("slices", "per_gpu", "share"), [(3, 10, 0.3), (2, 10, 0.2),
                                                          (1, 7, 1 / 7), (4, 4, 1.0)])
def test_the_plugin_and_gemini_run_give_the_same_share_the_same_environment(
        make: Make, tmp_path: Path, slices: int, per_gpu: int, share: float) -> None:
    """k/N slices from the plugin (no reserve) and gemini-run --share k/N (written as a decimal)
    on the same GPU: the same share, memory limit and variables, built by one function from the
    record."""
    from vgpu_runtime import run

    allocator, table, _ = make(slices_per_gpu=per_gpu, memory_reserve=0,
                               simulate_memory=80 * GIB + 12345)
    gpu = table.gpus[0]
    plugin_env = dict(allocator.allocate(slice_ids(table, 0, slices)).envs)
    request = run.Request(gpu=None, share=Share.parse(repr(share)), limit=None, memory=None,
                          state_dir=tmp_path, overcommit=False, simulate_gpus=None,
                          hook_library=None, command=[])
    record = run.build_record(request, gpu, tmp_path / "libgemini-hook.so")
    run_env = run.child_environment(record, tmp_path / "libgemini-hook.so")
    assert record.gpus[0].memory_limit == (80 * GIB + 12345) * slices // per_gpu
    for name in (paths.ENV_SHARE, paths.ENV_MEMORY_LIMIT, "CUDA_VISIBLE_DEVICES"):
        assert plugin_env[name] == run_env[name], name
    # Information for the workload: what the allocation's record says.
    written = allocation.load_record(allocator.config.state_dir,
                                     plugin_env[paths.ENV_ALLOCATION_ID])
    assert written is not None
    assert written.gpus[0].share == record.gpus[0].share == Share.of_slices(slices, per_gpu)
    assert float(plugin_env[paths.ENV_SHARE]) == written.gpus[0].share.to_float()
    assert int(plugin_env[paths.ENV_MEMORY_LIMIT]) == written.gpus[0].memory_limit
