"""Fuzzed files and strings: allocation records, configuration files, annotations and sizes.

Every reader must answer bad input with its own error type (RecordError, ConfigError,
ValueError with a reason) and never with another exception, which in the daemon or the plugin
would be a crash. A corrupt copy of a record never costs the valid record anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.fuzz.promises import check_accepted_record, check_config_file
from vgpu_runtime import hooklib
from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.sizes import parse_size
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import (
    AllocationRecord,
    Binding,
    GpuShare,
    PodRef,
    RecordError,
)
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.pods import annotations as pod_annotations
from vgpu_runtime.daemon.records import RecordWatcher
from vgpu_runtime.pluginconfig import PluginConfig

GiB = 1 << 30


def fuzz(count: int) -> settings:
    return settings(max_examples=examples(count), deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# JSON-able values that tend to break parsers: huge integers (float overflow, int-string
# limits), non-finite floats, deep nesting, wrong types.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.integers(min_value=10**300, max_value=10**400), st.integers(max_value=-(10**300)),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["k-0123456789abcdef", "GPU-a", "../../etc/passwd", "", "\0"]),
)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)


def _record(state_dir: Path, n: int = 0) -> AllocationRecord:
    ids = (f"GPU-a::{n}",)
    rid = allocation.id_for_devices(ids)
    return AllocationRecord(
        id=rid, origin="kubelet", device_ids=ids,
        gpus=(GpuShare("GPU-a", 0, Share.from_float(0.3), 3 * GiB),),
        channel_dir=str(paths.channel_dir(state_dir, rid)), hook_library=hooklib.library_name(),
        created_at=1.0e9)


def _raw_json_with(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---- allocation records ----

@fuzz(400)
@given(key=st.sampled_from(["version", "id", "origin", "device_ids", "gpus", "limit",
                            "channel_dir", "hook_library", "created_at", "owner_pid", "pod",
                            "gpus.0.share", "gpus.0.memory_limit", "gpus.0.uuid",
                            "gpus.0.index", "pod.name"]),
       value=values)
def test_a_record_with_any_field_replaced_parses_or_is_refused(tmp_path: Path, key: str,
                                                                value: Any) -> None:
    data = _record(tmp_path).to_json()
    data["pod"] = {"namespace": "ns", "name": "p", "container": "c", "uid": "u"}
    target: Any = data
    *parents, last = key.split(".")
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    target[last] = value
    try:
        record = AllocationRecord.from_json(json.loads(json.dumps(data)))
    except RecordError as err:
        assert str(err)
        return
    check_accepted_record(record)


@fuzz(150)
@given(digits=st.integers(300, 6000), where=st.sampled_from(
    ["created_at", "share", "memory_limit", "index", "owner_pid", "limit"]))
def test_huge_numbers_in_a_record_file_are_refused_not_raised(tmp_path: Path, digits: int,
                                                              where: str) -> None:
    """Found by fuzzing: a 400-digit share raised OverflowError and a 5000-digit number raised
    a plain ValueError (int string limit), past the daemon's `except RecordError`."""
    record = _record(tmp_path)
    text = json.dumps(record.to_json()).replace(
        '"created_at": 1000000000.0', '"created_at": ' + ("9" * digits if where == "created_at"
                                                           else "1000000000.0"))
    data = json.loads(json.dumps(record.to_json()))
    placeholder = 271828
    if where in ("share", "memory_limit", "index"):
        data["gpus"][0][where] = placeholder
    elif where in ("owner_pid", "limit"):
        data[where] = placeholder
    if where != "created_at":
        text = json.dumps(data).replace(str(placeholder), "9" * digits)
    path = allocation.record_path(tmp_path, record.id)
    _raw_json_with(path, text)
    try:
        parsed = allocation.read_record(path)
    except RecordError:
        return
    # Accepted only where an exact integer is meaningful, or a float that stays finite.
    assert ((where in ("memory_limit", "owner_pid", "index") and digits <= 4300)
            or (where == "created_at" and digits <= 308)), parsed


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000, "1" * 5000, '"\\ud800"',
                                  '{"version": 1, "gpus": [' + "[" * 50_000])
def test_pathological_record_files_are_refused(tmp_path: Path, text: str) -> None:
    path = allocation.record_path(tmp_path, "k-0123456789abcdef")
    _raw_json_with(path, text)
    with pytest.raises(RecordError):
        allocation.read_record(path)


@fuzz(300)
@given(cut=st.integers(0, 10_000), flip=st.none() | st.tuples(st.integers(0, 10_000),
                                                              st.integers(0, 255)))
def test_truncated_or_damaged_record_is_refused_and_the_valid_ones_are_untouched(
        tmp_path_factory: pytest.TempPathFactory, cut: int, flip: tuple[int, int] | None) -> None:
    state = tmp_path_factory.mktemp("st")
    good, victim = _record(state, 0), _record(state, 1)
    good_path = allocation.write_record(state, good)
    victim_path = allocation.write_record(state, victim)
    original = victim_path.read_bytes()
    # The valid copy of the damaged record, kept elsewhere (a backup, another node's state).
    backup_state = tmp_path_factory.mktemp("backup")
    backup_path = allocation.write_record(backup_state, victim)
    damaged = bytearray(original[:cut % len(original)])
    if flip is not None and damaged:
        damaged[flip[0] % len(damaged)] = flip[1]
    victim_path.write_bytes(bytes(damaged))

    try:
        parsed = allocation.read_record(victim_path)
    except RecordError as err:
        assert str(victim_path) in str(err) or "record" in str(err)
    else:
        # A byte flip inside a string can still be a valid record; truncation never is.
        assert flip is not None, "a truncated record was accepted"
        assert parsed.id == victim.id
    scanned = dict(allocation.scan_records(state))
    assert scanned[good_path] == good
    watcher = RecordWatcher(state).scan()     # the daemon's reader: skips it, keeps the rest
    assert good.id in watcher.records
    assert (str(victim_path) in watcher.corrupt) != (victim.id in watcher.records)
    # Nothing was deleted or rewritten by reading: the damaged bytes stay for the operator,
    # and the valid copy elsewhere is byte for byte what it was.
    assert victim_path.read_bytes() == bytes(damaged)
    assert backup_path.read_bytes() == original
    assert good_path.read_bytes() == allocation.record_path(state, good.id).read_bytes()
    assert sorted(os.listdir(paths.allocations_dir(state))) == sorted(
        [good_path.name, victim_path.name])


# ---- configuration files ----

setting_names = st.sampled_from(["slices_per_gpu", "memory_reserve", "state_dir", "placement",
                                 "device_list_strategy", "simulate_gpus", "window", "min_quota",
                                 "max_quota", "default_limit", "ignored_xids", "poll_interval",
                                 "log_level", 1, "x"])
# Version v1 node files: the sections (and misspelled ones) with settings of either program.
node_files = st.dictionaries(
    st.sampled_from(["version", "node", "devicePlugin", "scheduler", "devicePlugn", 2]),
    st.one_of(st.sampled_from(["v1", "v2", 1, None]),
              st.dictionaries(setting_names, values, max_size=3), values),
    max_size=4).map(lambda d: json.dumps({"version": "v1", **d}, default=str))

yaml_texts = st.one_of(
    st.text(max_size=200),
    node_files,
    st.dictionaries(st.sampled_from(["slices_per_gpu", "memory_reserve", "state_dir",
                                     "placement", "device_list_strategy", "simulate_gpus",
                                     "window", "min_quota", "max_quota", "default_limit",
                                     "ignored_xids", "poll_interval", "log_level", 1, "x"]),
                    values, max_size=4).map(lambda d: json.dumps(d, default=str)),
    st.sampled_from(["[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "{a: 1, 1: a}",
                     "slices_per_gpu: 1" + "0" * 5000, "window: 1e999", "? [a]\n: 1",
                     "&a [*a]", "[" * 50_000, "a: " + "{b: " * 50_000,
                     "!!python/object:os.system {}", "slices_per_gpu: .nan",
                     "memory_reserve: 9" + "9" * 400 + "GiB", "window: " + "9" * 400]),
)


@pytest.mark.parametrize("config_class", [DaemonConfig, PluginConfig])
@fuzz(250)
@given(text=yaml_texts, raw=st.none() | st.binary(max_size=120))
def test_any_configuration_file_loads_or_is_a_config_error(
        tmp_path: Path, config_class: type[Any], text: str, raw: bytes | None) -> None:
    path = tmp_path / "config.yaml"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(text)
    check_config_file(path, config_class)


@fuzz(300)
@given(field=st.sampled_from([f for f in ("slices_per_gpu", "memory_reserve", "window",
                                          "min_quota", "default_limit", "ignored_xids",
                                          "placement", "simulate_memory")]),
       value=st.text(max_size=30) | st.sampled_from(["9" * 400, "9" * 5000, "1e999", "nan",
                                                      "-0", "inf", "9" * 400 + "GiB"]))
def test_any_flag_or_env_value_loads_or_names_the_field(field: str, value: str) -> None:
    for config_class in (DaemonConfig, PluginConfig):
        if field not in {f.name for f in dataclasses.fields(config_class)}:
            continue
        for flags, env in (({field: value}, {}), ({}, {cfg.env_name(field): value})):
            try:
                cfg.resolve(config_class, flags, env, {})
            except cfg.ConfigError as err:
                assert field.upper() in str(err).upper().replace("-", "_"), err


# ---- sizes and annotations ----

size_texts = st.one_of(st.text(max_size=24), st.from_regex(
    r"\s*\d{1,500}(\.\d{0,400})?\s*[kKmMgGtT]?i?[bB]?\s*", fullmatch=True))


@fuzz(500)
@given(text=size_texts)
def test_parse_size_returns_bytes_or_a_value_error(text: str) -> None:
    try:
        result = parse_size(text)
    except ValueError as err:
        assert "size" in str(err)
        return
    assert isinstance(result, int) and result >= 0


annotation_values = st.one_of(st.text(max_size=20), size_texts,
                              st.sampled_from(["nan", "inf", "-inf", "1e-320", "50%", "%",
                                               "1e999%", "0.3", "1", "0", "-1", "9" * 400]))


@fuzz(500)
@given(limit=st.none() | annotation_values, memory=st.none() | annotation_values,
       noise=st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=3))
def test_annotations_apply_within_bounds_or_are_reported(
        tmp_path: Path, limit: str | None, memory: str | None, noise: dict[str, str]) -> None:
    record = _record(tmp_path)
    given_annotations = dict(noise)
    if limit is not None:
        given_annotations[pod_annotations.LIMIT_ANNOTATION] = limit
    if memory is not None:
        given_annotations[pod_annotations.MEMORY_ANNOTATION] = memory
    overrides = pod_annotations.overrides_of(record, given_annotations)
    # Never more than promised: limit in [request, 1], memory in (0, entitlement].
    assert overrides.limit is None or overrides.limit >= record.gpus[0].share
    assert overrides.memory_limit is None or 0 < overrides.memory_limit <= 3 * GiB
    changed = (overrides.limit is not None) + (overrides.memory_limit is not None)
    assert changed + len(overrides.problems) <= 2
    # What was taken round-trips through the binding format.
    binding = Binding(record.id, PodRef("ns", "pod", "c"), overrides.limit,
                      overrides.memory_limit)
    assert Binding.from_json(json.loads(json.dumps(binding.to_json()))) == binding
