"""The allocation record and the pod binding: round trip, atomicity, version-1 records, and
refusal of malformed files."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.readonly import read_only_call
from vgpu_runtime import hooklib
from vgpu_runtime.common import atomicfile
from vgpu_runtime.contracts import allocation as alloc
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.share import Share


def sample(ids: tuple[str, ...] = ("GPU-a::0", "GPU-a::1"), **kw: object) -> alloc.AllocationRecord:
    fields: dict[str, object] = dict(
        id=alloc.id_for_devices(ids), origin="kubelet", device_ids=ids,
        gpus=(alloc.GpuShare("GPU-a", 0, Share.of_slices(2, 10), 2 << 30),),
        channel_dir="/var/lib/gemini/channels/x",
        hook_library=hooklib.library_name(), created_at=time.time(),
    )
    fields.update(kw)
    return alloc.AllocationRecord(**fields)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    record = sample(limit=Share.parse("0.5"),
                    gpus=(alloc.GpuShare("GPU-a", 0, Share.of_slices(2, 10), 2 << 30, 10),))
    path = alloc.write_record(tmp_path, record)
    assert path == tmp_path / "allocations" / f"{record.id}.json"
    assert alloc.read_record(path) == record
    assert alloc.load_record(tmp_path, record.id) == record
    assert json.loads(path.read_text())["version"] == 2


def test_binding_round_trip_and_removal(tmp_path: Path) -> None:
    record = sample()
    binding = alloc.Binding(record.id, alloc.PodRef("ns", "pod", "c", "uid"), Share.parse("0.5"),
                            1 << 30)
    path = alloc.write_binding(tmp_path, binding)
    assert path == tmp_path / "bindings" / f"{record.id}.json"
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    assert alloc.load_binding(tmp_path, record.id) == binding
    assert dict(alloc.scan_bindings(tmp_path)) == {path: binding}
    assert alloc.remove_binding(tmp_path, record.id) and not path.exists()
    assert alloc.load_binding(tmp_path, record.id) is None


def test_a_link_planted_as_a_binding_is_not_followed(tmp_path: Path) -> None:
    record = sample()
    secret = tmp_path / "secret"
    secret.write_text(json.dumps(alloc.Binding(record.id, alloc.PodRef("a", "b", "c")).to_json()))
    (tmp_path / "bindings").mkdir()
    os.symlink(secret, alloc.binding_path(tmp_path, record.id))
    with pytest.raises(alloc.RecordError, match="cannot read pod binding"):
        alloc.read_binding(alloc.binding_path(tmp_path, record.id))
    assert alloc.load_binding(tmp_path, record.id) is None


V1_KUBELET = {   # as today's plugin writes it (version 1, before bindings)
    "version": 1, "id": alloc.id_for_devices(("GPU-a::0", "GPU-a::1")), "origin": "kubelet",
    "device_ids": ["GPU-a::0", "GPU-a::1"],
    "gpus": [{"uuid": "GPU-a", "index": 0, "share": 0.2, "memory_limit": 2 << 30,
              "default_memory": 2 << 30}],
    "limit": None, "channel_dir": "/var/lib/gemini/channels/x", "hook_library": "lib",
    "created_at": 1.0e9, "owner_pid": None, "pod": None}


def test_a_version_1_record_is_read_as_its_entitlement() -> None:
    record = alloc.AllocationRecord.from_json(V1_KUBELET)
    assert record.gpus == (alloc.GpuShare("GPU-a", 0, Share.from_float(0.2), 2 << 30, None),)
    assert record.limit is None and record.carried is None
    older = json.loads(json.dumps(V1_KUBELET))   # written before default_memory was kept
    del older["gpus"][0]["default_memory"]
    assert alloc.AllocationRecord.from_json(older) == record
    # Written again, it is a version-2 record with the same entitlement.
    assert alloc.AllocationRecord.from_json(record.to_json()) == record


def test_a_version_1_record_an_old_daemon_bound_carries_its_binding() -> None:
    data = json.loads(json.dumps(V1_KUBELET))
    data["gpus"][0]["memory_limit"] = 1 << 30     # the pod's annotation, as the daemon wrote it
    data.update(limit=0.5, pod={"namespace": "ns", "name": "p", "container": "c", "uid": "u"})
    record = alloc.AllocationRecord.from_json(data)
    assert record.gpus[0].memory_limit == 2 << 30 and record.limit is None
    assert record.carried == alloc.Binding(record.id, alloc.PodRef("ns", "p", "c", "u"),
                                           Share.parse("0.5"), 1 << 30)
    assert "carried" not in record.to_json() and "pod" not in record.to_json()


def test_a_version_1_gemini_run_record_keeps_its_limit() -> None:
    data = json.loads(json.dumps(V1_KUBELET))
    data.update(origin="gemini-run", device_ids=[], limit=0.6, owner_pid=42,
                id="r-0123456789abcdef")
    record = alloc.AllocationRecord.from_json(data)
    assert record.limit == Share.parse("0.6") and record.carried is None


def test_id_depends_only_on_the_set_of_slices() -> None:
    assert alloc.id_for_devices(["b", "a"]) == alloc.id_for_devices(["a", "b", "a"])
    assert alloc.id_for_devices(["a"]) != alloc.id_for_devices(["a", "b"])
    assert alloc.new_run_id() != alloc.new_run_id()
    alloc.check_id(alloc.new_run_id())


def test_rewrite_replaces_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    record = sample()
    alloc.write_record(tmp_path, record)
    alloc.write_record(tmp_path, sample(limit=Share.parse("0.7")))
    assert alloc.read_record(alloc.record_path(tmp_path, record.id)).limit == Share.parse("0.7")
    assert [p.name for p in (tmp_path / "allocations").iterdir()] == [f"{record.id}.json"]


def test_read_only_state_dir_fails_clearly_and_keeps_the_old_record(tmp_path: Path) -> None:
    record = sample()
    alloc.write_record(tmp_path, record)

    def rewrite() -> str:
        with pytest.raises(alloc.RecordError, match="cannot write") as refused:
            alloc.write_record(tmp_path, sample(limit=Share.parse("0.9")))
        return str(refused.value)

    message = read_only_call(tmp_path / "allocations", rewrite)
    assert ("Read-only file system" if os.geteuid() == 0 else "Permission denied") in message
    assert alloc.read_record(alloc.record_path(tmp_path, record.id)) == record
    assert [p.name for p in (tmp_path / "allocations").iterdir()] == [f"{record.id}.json"]


def test_failed_rename_keeps_the_old_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = sample()
    alloc.write_record(tmp_path, record)

    def fail(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicfile.os, "replace", fail)
    with pytest.raises(alloc.RecordError, match="No space left"):
        alloc.write_record(tmp_path, sample(limit=Share.parse("0.9")))
    assert alloc.read_record(alloc.record_path(tmp_path, record.id)) == record
    assert len(list((tmp_path / "allocations").iterdir())) == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=3), "version"),
    (lambda d: d.update(version=True), "version"),
    (lambda d: d.update(origin="docker"), "origin"),
    (lambda d: d.update(gpus=[]), "no GPU"),
    (lambda d: d["gpus"][0].update(share=1.5), "out of range"),
    (lambda d: d["gpus"][0].update(memory_limit="1GiB"), "wrong type"),
    # S10: a limit past the wire's uint64 was served, then failed every hello.
    (lambda d: d["gpus"][0].update(memory_limit=1 << 64), "out of range"),
    (lambda d: d["gpus"][0].update(memory_limit=-1), "out of range"),
    (lambda d: d.update(limit=0), "limit"),
    (lambda d: d["gpus"][0].update(slices_per_gpu=0), "out of range"),
    (lambda d: d["gpus"][0].update(slices_per_gpu="10"), "wrong type"),
    (lambda d: d.update(version=1) or d["gpus"][0].update(default_memory="2GiB"), "wrong type"),
    (lambda d: d.update(version=1) or d["gpus"][0].update(default_memory=-1), "out of range"),
    (lambda d: d.update(id="../../etc/passwd"), "malformed allocation id"),
    (lambda d: d.pop("channel_dir"), "channel_dir"),
])
def test_malformed_records_are_refused_with_a_reason(mutate, message, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = sample().to_json()
    mutate(data)
    with pytest.raises(alloc.RecordError, match=message):
        alloc.AllocationRecord.from_json(data)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=2), "version"),
    (lambda d: d.update(id="../x"), "malformed allocation id"),
    (lambda d: d.update(pod=None), "wrong type"),
    (lambda d: d["pod"].pop("name"), "name"),
    (lambda d: d.update(limit=1.5), "limit out of range"),
    (lambda d: d.update(memory_limit=0), "out of range"),
    (lambda d: d.update(memory_limit=1 << 64), "out of range"),
    (lambda d: d.update(memory_limit=True), "boolean"),
])
def test_malformed_bindings_are_refused_with_a_reason(mutate, message) -> None:  # type: ignore[no-untyped-def]
    data = alloc.Binding(sample().id, alloc.PodRef("ns", "p", "c"), Share.parse("0.5"),
                         1 << 30).to_json()
    mutate(data)
    with pytest.raises(alloc.RecordError, match=message):
        alloc.Binding.from_json(data)


def test_scan_reports_corrupt_files_and_keeps_going(tmp_path: Path) -> None:
    good = sample()
    alloc.write_record(tmp_path, good)
    (tmp_path / "allocations" / "k-0000000000000000.json").write_text('{"version": 1, "id"')
    results = dict(alloc.scan_records(tmp_path))
    assert results[alloc.record_path(tmp_path, good.id)] == good
    bad = results[tmp_path / "allocations" / "k-0000000000000000.json"]
    assert isinstance(bad, alloc.RecordError)


def test_file_name_must_match_the_id(tmp_path: Path) -> None:
    record = sample()
    path = alloc.write_record(tmp_path, record)
    other = path.with_name("k-1111111111111111.json")
    path.rename(other)
    with pytest.raises(alloc.RecordError, match="holds id"):
        alloc.read_record(other)


def test_remove(tmp_path: Path) -> None:
    record = sample()
    alloc.write_record(tmp_path, record)
    assert alloc.remove_record(tmp_path, record.id)
    assert not alloc.remove_record(tmp_path, record.id)


def test_end_allocation_removes_the_record_then_its_channel_directory(tmp_path: Path) -> None:
    record = sample(channel_dir=str(paths.channel_dir(tmp_path, sample().id)))
    alloc.write_record(tmp_path, record)
    Path(record.channel_dir).mkdir(parents=True)
    Path(record.channel_dir, "preload").write_text("x")
    assert alloc.end_allocation(tmp_path, record.id, record)
    assert alloc.load_record(tmp_path, record.id) is None
    assert not Path(record.channel_dir).exists()
    assert not alloc.end_allocation(tmp_path, record.id, record)   # twice: nothing to end


def test_end_allocation_without_the_record_takes_the_layouts_directory(tmp_path: Path) -> None:
    record = sample()
    alloc.write_record(tmp_path, record)
    paths.channel_dir(tmp_path, record.id).mkdir(parents=True)
    assert alloc.end_allocation(tmp_path, record.id)
    assert not paths.channel_dir(tmp_path, record.id).exists()


def test_end_allocation_takes_the_host_daemons_directory_with_or_without_the_record(
        tmp_path: Path) -> None:
    """The host daemon's channel directories are <state-dir>/host-channels/<id>."""
    for named in (True, False):
        record = sample(channel_dir=str(paths.host_channels_dir(tmp_path) / sample().id))
        alloc.write_record(tmp_path, record)
        Path(record.channel_dir).mkdir(parents=True)
        Path(record.channel_dir, "preload").write_text("x")
        assert alloc.end_allocation(tmp_path, record.id, record if named else None)
        assert alloc.load_record(tmp_path, record.id) is None
        assert not Path(record.channel_dir).exists(), named


def test_end_allocation_leaves_a_directory_outside_the_layout(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / sample().id
    elsewhere.mkdir(parents=True)
    record = sample(channel_dir=str(elsewhere))
    alloc.write_record(tmp_path, record)
    assert alloc.end_allocation(tmp_path, record.id, record)
    assert elsewhere.is_dir()


def test_a_record_that_cannot_be_removed_keeps_its_directory(tmp_path: Path) -> None:
    """The allocation has not ended: the daemon still serves it, so its socket stays."""
    record = sample(channel_dir=str(paths.channel_dir(tmp_path, sample().id)))
    alloc.write_record(tmp_path, record)
    Path(record.channel_dir).mkdir(parents=True)

    def end() -> str:
        try:
            alloc.end_allocation(tmp_path, record.id, record)
        except OSError as err:
            return type(err).__name__
        return "ended"

    assert read_only_call(paths.allocations_dir(tmp_path), end) in (
        "PermissionError", "OSError")
    assert alloc.load_record(tmp_path, record.id) == record
    assert Path(record.channel_dir).is_dir()


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_crash_the_reader(tmp_path_factory: pytest.TempPathFactory,
                                             data: bytes) -> None:
    path = tmp_path_factory.mktemp("rec") / "k-0000000000000000.json"
    path.write_bytes(data)
    with pytest.raises(alloc.RecordError):
        alloc.read_record(path)


@settings(max_examples=examples(200), deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                         max_size=4)))
def test_random_json_is_refused_cleanly(value: object) -> None:
    data = sample().to_json()
    for key in list(data):
        variant = dict(data, **{key: value})
        with contextlib.suppress(alloc.RecordError):
            alloc.AllocationRecord.from_json(json.loads(json.dumps(variant)))


def test_first_record_makes_the_allocations_directory(tmp_path: Path) -> None:
    record = sample()
    alloc.write_record(tmp_path / "new-state", record)
    assert alloc.load_record(tmp_path / "new-state", record.id) == record


def test_allocations_path_that_is_not_a_directory_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "allocations").write_text("not a directory")
    with pytest.raises(alloc.RecordError, match="cannot write"):
        alloc.write_record(tmp_path, sample())
    assert (tmp_path / "allocations").read_text() == "not a directory"


def test_encoded_bytes_are_what_is_stored(tmp_path: Path) -> None:
    record = sample()
    payload = alloc.encode_record(record)
    path = str(alloc.record_path(tmp_path, record.id))
    alloc.write_record_bytes(path, payload)
    assert alloc.read_record_bytes(path) == payload
    assert alloc.decode_record(path, payload) == record
    assert alloc.read_record_bytes(alloc.record_path(tmp_path, "k-" + "0" * 16)) is None


def test_a_link_in_place_of_the_bindings_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "bindings")
    binding = alloc.Binding(sample().id, alloc.PodRef("ns", "p", "c"))
    with pytest.raises(alloc.RecordError, match=r"cannot write pod binding.*not a directory"):
        alloc.write_binding(tmp_path, binding)
    assert list(elsewhere.iterdir()) == []
