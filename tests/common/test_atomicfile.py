"""Atomic replacement, deferred directory fsyncs, and the sweep of stale temporary files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from vgpu_runtime.common import atomicfile
from vgpu_runtime.common.atomicfile import DirectorySyncer, sweep_stale_temps, write_atomic
from vgpu_runtime.contracts import allocation as alloc
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.records import RecordWatcher

REPO = Path(__file__).resolve().parents[2]


def temps(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if atomicfile.is_temp_name(p.name))


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


class GatedFsync:
    """Stands in for atomicfile.fsync_dir: records each call and, while `gate` is clear,
    holds the syncer's thread inside its first call, as a slow disk would."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, directory: str | Path) -> None:
        self.calls.append(os.fspath(directory))
        self.entered.set()
        assert self.gate.wait(10)


# ---- deferred directory fsyncs ----

def test_write_with_a_syncer_is_renamed_before_the_directory_fsync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsync = GatedFsync()
    monkeypatch.setattr(atomicfile, "fsync_dir", fsync)
    syncer = DirectorySyncer()
    target = tmp_path / "r.json"
    write_atomic(target, b"new", syncer=syncer)
    # The writer returned while the directory fsync is still held: the rename is done, so a
    # crash of this process from here on cannot lose the file.
    assert fsync.entered.wait(10)
    assert target.read_bytes() == b"new"
    assert not syncer.flush(timeout=0.05), "flush must wait for the held fsync"
    fsync.gate.set()
    assert syncer.flush(timeout=10)
    assert fsync.calls == [str(tmp_path)]
    assert syncer.close()


def test_syncer_batches_requests_that_arrive_during_a_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fsync = GatedFsync()
    monkeypatch.setattr(atomicfile, "fsync_dir", fsync)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    syncer = DirectorySyncer()
    write_atomic(a / "0", b"0", syncer=syncer)
    assert fsync.entered.wait(10)           # first pass: held inside fsync of a
    for n in range(1, 6):                   # five more writes to a, two to b, meanwhile
        write_atomic(a / str(n), b"x", syncer=syncer)
    for n in range(2):
        write_atomic(b / str(n), b"y", syncer=syncer)
    fsync.gate.set()
    assert syncer.flush(timeout=10)
    # One fsync for the first write, then one per directory for everything that queued up.
    assert fsync.calls == [str(a), str(a), str(b)]
    assert syncer.passes == 2
    syncer.close()
    with pytest.raises(RuntimeError, match="after close"):
        syncer.request(a)


def test_failed_directory_fsync_is_counted_and_does_not_stop_the_syncer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncer = DirectorySyncer()
    syncer.request(tmp_path / "missing")    # ENOENT, as an EIO would be reported
    syncer.request(tmp_path)
    assert syncer.flush(timeout=10)
    assert syncer.failures == 1
    syncer.request(tmp_path)
    assert syncer.close(timeout=10)
    assert syncer.failures == 1


def test_write_record_with_a_syncer_defers_only_the_directory_fsync(tmp_path: Path) -> None:
    record = alloc.AllocationRecord(
        id=alloc.id_for_devices(["GPU-a::0"]), origin="kubelet", device_ids=("GPU-a::0",),
        gpus=(alloc.GpuShare("GPU-a", 0, Share.from_float(0.1), 1 << 30),), channel_dir="/x",
        hook_library="libgemini-hook.so.0", created_at=1.0)
    syncer = DirectorySyncer()
    path = alloc.write_record(tmp_path, record, syncer)
    assert alloc.read_record(path) == record
    assert syncer.close(timeout=10) and syncer.passes >= 1


# ---- a crash in the middle of a write ----

CRASHING_WRITER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from vgpu_runtime.common import atomicfile
    target, point = Path(sys.argv[1]), sys.argv[2]
    real = {"fsync": os.fsync, "replace": os.replace}
    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)
    setattr(atomicfile.os, point, die)   # the process dies at this step of the write
    atomicfile.write_atomic(target, b'{"version": "new"}' + b" " * 100000)
""")


@pytest.mark.parametrize("point", ["fsync", "replace"])
def test_writer_killed_mid_write_leaves_the_old_file_and_a_temp_the_sweep_removes(
        tmp_path: Path, point: str) -> None:
    target = tmp_path / "k-0123456789abcdef.json"
    write_atomic(target, b'{"version": "old"}')
    child = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(target), point],
                           cwd=REPO, capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert target.read_bytes() == b'{"version": "old"}'
    [left] = temps(tmp_path)
    assert left.name.startswith(f".{target.name}.")
    assert left.name.endswith(".tmp")
    # Young: it could be a live writer's, so the sweep keeps it...
    assert sweep_stale_temps(tmp_path) == []
    assert left.exists()
    # ...and removes it once nobody can still be writing it.
    age(left, atomicfile.STALE_TEMP_AGE + 5)
    assert sweep_stale_temps(tmp_path) == [left]
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


RACING_WRITER = textwrap.dedent("""
    import itertools, sys
    from pathlib import Path
    from vgpu_runtime.common.atomicfile import write_atomic
    target = Path(sys.argv[1])
    payloads = [bytes([65 + n]) * (256 * 1024) for n in range(2)]
    print("ready", flush=True)
    for n in itertools.count():
        write_atomic(target, payloads[n % 2], durable=False)
""")


def test_writer_killed_at_random_points_never_leaves_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "big"
    write_atomic(target, b"A" * (256 * 1024))
    for round_ in range(8):
        child = subprocess.Popen([sys.executable, "-c", RACING_WRITER, str(target)], cwd=REPO,
                                 stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        time.sleep(0.005 + 0.007 * round_)
        child.kill()
        child.wait()
        content = target.read_bytes()
        assert content in (b"A" * (256 * 1024), b"B" * (256 * 1024)), (
            f"round {round_}: {len(content)} bytes, a partial file")
    for left in temps(tmp_path):
        age(left, atomicfile.STALE_TEMP_AGE + 1)
    sweep_stale_temps(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["big"]


# ---- the sweep never breaks a live writer, and touches only temporary files ----

def test_sweep_keeps_young_temps_other_names_and_sockets(tmp_path: Path) -> None:
    old = tmp_path / ".r.json.123.abc.tmp"
    young = tmp_path / ".r.json.124.abd.tmp"
    record = tmp_path / "r.json"
    not_hidden = tmp_path / "notes.tmp"
    for path in (old, young, record, not_hidden):
        path.write_bytes(b"x")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / ".sched.tmp"))     # the daemon's socket before its rename
    try:
        for path in (old, record, not_hidden, tmp_path / ".sched.tmp"):
            age(path, 3600)
        assert sweep_stale_temps(tmp_path) == [old]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [young.name, record.name, not_hidden.name, ".sched.tmp"])
    finally:
        sock.close()
    assert sweep_stale_temps(tmp_path / "absent") == []


def test_a_writer_whose_temp_is_swept_fails_cleanly_and_keeps_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer stalled past the age limit: the sweep removes its file mid-write; its rename
    then fails, the target keeps its old content, and nothing half-written appears."""
    target = tmp_path / "r.json"
    write_atomic(target, b"old")
    real_fsync = os.fsync

    def stalled_fsync(fd: int) -> None:
        real_fsync(fd)
        for left in temps(tmp_path):
            age(left, atomicfile.STALE_TEMP_AGE + 1)
        assert len(sweep_stale_temps(tmp_path)) == 1

    monkeypatch.setattr(os, "fsync", stalled_fsync)
    with pytest.raises(FileNotFoundError):
        write_atomic(target, b"new", durable=False)
    assert target.read_bytes() == b"old"
    assert temps(tmp_path) == []


def test_daemon_sweeps_stale_record_temps_once_at_start(tmp_path: Path) -> None:
    records = tmp_path / "allocations"
    records.mkdir()
    stale = records / ".k-0123456789abcdef.json.77.x1.tmp"
    fresh = records / ".k-0123456789abcdef.json.78.x2.tmp"
    for path in (stale, fresh):
        path.write_bytes(b'{"half')
    age(stale, atomicfile.STALE_TEMP_AGE + 1)
    watcher = RecordWatcher(tmp_path)
    scan = watcher.scan()
    assert not stale.exists() and fresh.exists()
    assert scan.records == {} and scan.corrupt == {}    # temp files are never records
    age(fresh, atomicfile.STALE_TEMP_AGE + 1)
    watcher.scan()
    assert fresh.exists(), "only at start: later scans leave the directory to its writers"
