"""The daemon's pod bindings (vgpu_runtime/daemon/bindings.py) alone, on real files."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest

from tests.daemon.helpers import make_record
from vgpu_runtime import allocation, paths
from vgpu_runtime.allocation import Binding, PodRef, RecordError
from vgpu_runtime.daemon.bindings import PodBindings

POD = PodRef("ml", "train", "main", "uid-1")
MiB = 1 << 20
ONE, GOOD, BAD = "k-0000000000000001", "k-0000000000000002", "k-0000000000000003"


def test_stored_bindings_are_kept_and_read_again_at_start(tmp_path: Path) -> None:
    bindings = PodBindings(tmp_path)
    bindings.store(Binding(ONE, POD, 0.5, 64 * MiB))
    assert bindings.get(ONE) == Binding(ONE, POD, 0.5, 64 * MiB)
    assert allocation.load_binding(tmp_path, ONE) == bindings.get(ONE)

    restarted = PodBindings(tmp_path)
    assert restarted.get(ONE) is None   # nothing is read until load()
    restarted.load()
    assert restarted.ids() == {ONE}
    assert restarted.get(ONE) == Binding(ONE, POD, 0.5, 64 * MiB)


def test_drop_removes_the_file(tmp_path: Path) -> None:
    bindings = PodBindings(tmp_path)
    bindings.store(Binding(ONE, POD))
    bindings.drop(ONE)
    assert bindings.get(ONE) is None
    assert not allocation.binding_path(tmp_path, ONE).exists()
    bindings.drop(ONE)   # twice is harmless


def test_an_unreadable_binding_is_skipped_and_logged(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    PodBindings(tmp_path).store(Binding(GOOD, POD))
    allocation.binding_path(tmp_path, BAD).write_text("{")
    bindings = PodBindings(tmp_path)
    with caplog.at_level(logging.ERROR):
        bindings.load()
    assert bindings.ids() == {GOOD}
    assert any(r.message == "ignoring unreadable pod binding" for r in caplog.records)


def test_a_binding_that_cannot_be_written_is_not_kept(tmp_path: Path) -> None:
    """bindings/ is the daemon's alone: a link planted there is refused, and nothing is kept
    that the next start would not find."""
    tmp_path.joinpath("elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", paths.bindings_dir(tmp_path))
    bindings = PodBindings(tmp_path)
    with pytest.raises(RecordError, match="cannot write pod binding"):
        bindings.store(Binding(ONE, POD))
    assert bindings.get(ONE) is None
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_version_1_records_pod_moves_into_a_binding_file(tmp_path: Path) -> None:
    record = dataclasses.replace(make_record(tmp_path), carried=Binding("x", POD, 0.25))
    record = dataclasses.replace(record, carried=Binding(record.id, POD, 0.25))
    bindings = PodBindings(tmp_path)
    assert bindings.for_record(record) == Binding(record.id, POD, 0.25)
    assert allocation.load_binding(tmp_path, record.id) == Binding(record.id, POD, 0.25)


def test_a_binding_of_its_own_wins_over_the_records(tmp_path: Path) -> None:
    record = make_record(tmp_path)
    record = dataclasses.replace(record, carried=Binding(record.id, POD, 0.25))
    bindings = PodBindings(tmp_path)
    bindings.store(Binding(record.id, POD, 0.75))
    assert bindings.for_record(record) == Binding(record.id, POD, 0.75)


def test_a_gemini_run_record_has_no_binding(tmp_path: Path) -> None:
    record = make_record(tmp_path, origin="gemini-run", owner_pid=os.getpid())
    assert PodBindings(tmp_path).for_record(record) is None
