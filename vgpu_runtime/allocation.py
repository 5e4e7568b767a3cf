"""The allocation record: the one contract between the allocators and the node daemon.

An allocator (the device plugin's Allocate, or gemini-run) writes one record per allocation to
<state-dir>/allocations/<id>.json; the node daemon reads them and serves each allocation's
channel. Records are written atomically (vgpu_runtime.common.atomicfile: temporary file, fsync,
rename, fsync of the directory), so a reader sees the old record or the new one, never half of
one, even if the writer dies or the power fails. Once write_record returns, the record survives
a crash of the writer. The directory fsync that makes it survive a power loss is done before
write_record returns, or just after it by a DirectorySyncer when the caller passes one (the
device plugin, to answer Allocate sooner); until then a power loss can only bring back the old
record, or none. Temporary files a dead writer left behind are removed by sweep_temp_files.

Format (JSON, `version` 1):
    id            "k-<16 hex>" from kubelet slice IDs, "r-<16 hex>" for gemini-run
    origin        "kubelet" | "gemini-run"
    device_ids    the slice IDs kubelet gave (empty for gemini-run)
    gpus          [{uuid, index, share, memory_limit, default_memory}], share in (0, 1],
                  memory_limit in bytes; default_memory (bytes, or null/absent) is what the
                  slices give before any pod annotation, restored when another pod takes them
    limit         cap on the GPU-time share, or null for the node default
    channel_dir   host path of the channel directory mounted into the container
    hook_library  file name of the interposer version the container was given
    created_at    creation time, seconds since the epoch
    owner_pid     gemini-run's pid, or null
    pod           {namespace, name, container, uid} once known, or null
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_runtime import paths
from vgpu_runtime.common.atomicfile import (
    STALE_TEMP_AGE,
    DirectorySyncer,
    fsync_dir,
    sweep_stale_temps,
    write_atomic,
)
from vgpu_runtime.common.securedir import read_nofollow, remove_tree_in

RECORD_VERSION = 1
ORIGINS = ("kubelet", "gemini-run")
# The wire carries a memory limit as a uint64 (gemini_wire.h): a larger one could never be sent.
MAX_MEMORY_LIMIT = (1 << 64) - 1


class RecordError(ValueError):
    """A record is malformed or cannot be stored; the message says which and why."""


@dataclass(frozen=True)
class GpuShare:
    uuid: str
    index: int
    share: float
    memory_limit: int
    default_memory: int | None = None


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    container: str
    uid: str = ""


@dataclass(frozen=True)
class AllocationRecord:
    id: str
    origin: str
    device_ids: tuple[str, ...]
    gpus: tuple[GpuShare, ...]
    channel_dir: str
    hook_library: str
    created_at: float
    limit: float | None = None
    owner_pid: int | None = None
    pod: PodRef | None = None

    def to_json(self) -> dict[str, Any]:
        # Field by field rather than dataclasses.asdict, whose deep copy of every slice ID
        # was the largest CPU cost of a new Allocate.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["version"] = RECORD_VERSION
        data["device_ids"] = list(self.device_ids)
        data["gpus"] = [{f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
                        for g in self.gpus]
        data["pod"] = None if self.pod is None else dataclasses.asdict(self.pod)
        return data

    @classmethod
    def from_json(cls, data: Any) -> AllocationRecord:
        try:
            return _parse(data)
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            # OverflowError: a number too large for a float (found by fuzzing).
            if isinstance(err, RecordError):
                raise
            raise RecordError(f"malformed allocation record: {err!r}") from None


def _need(data: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = data[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RecordError(f"field {key!r} must not be a boolean")
    if not isinstance(value, kind):
        raise RecordError(f"field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _parse(data: Any) -> AllocationRecord:
    if not isinstance(data, dict):
        raise RecordError("an allocation record must be a JSON object")
    if data.get("version") != RECORD_VERSION:
        raise RecordError(f"unsupported record version {data.get('version')!r}")
    origin = _need(data, "origin", str)
    if origin not in ORIGINS:
        raise RecordError(f"unknown origin {origin!r}")
    gpus = []
    for item in _need(data, "gpus", list):
        if not isinstance(item, dict):
            raise RecordError("each entry of 'gpus' must be an object")
        share = float(_need(item, "share", (int, float)))
        memory_limit = _need(item, "memory_limit", int)
        if not (0 < share <= 1) or not 0 <= memory_limit <= MAX_MEMORY_LIMIT:
            raise RecordError(f"GPU entry out of range: share {share}, memory {memory_limit}")
        default_memory = item.get("default_memory")
        if default_memory is not None:
            default_memory = _need(item, "default_memory", int)
            if not 0 <= default_memory <= MAX_MEMORY_LIMIT:
                raise RecordError(f"GPU entry out of range: default memory {default_memory}")
        gpus.append(GpuShare(_need(item, "uuid", str), _need(item, "index", int), share,
                             memory_limit, default_memory))
    if not gpus:
        raise RecordError("an allocation record names no GPU")
    limit = data.get("limit")
    if limit is not None:
        limit = float(_need(data, "limit", (int, float)))
        if not (0 < limit <= 1) or math.isnan(limit):
            raise RecordError(f"limit out of range: {limit}")
    created_at = float(_need(data, "created_at", (int, float)))
    if not math.isfinite(created_at):
        raise RecordError(f"created_at is not a finite time: {created_at}")
    pod = data.get("pod")
    record = AllocationRecord(
        id=_need(data, "id", str),
        origin=origin,
        device_ids=tuple(str(d) for d in _need(data, "device_ids", list)),
        gpus=tuple(gpus),
        channel_dir=_need(data, "channel_dir", str),
        hook_library=_need(data, "hook_library", str),
        created_at=created_at,
        limit=limit,
        owner_pid=data.get("owner_pid") and _need(data, "owner_pid", int),
        pod=PodRef(**pod) if isinstance(pod, dict) else None,
    )
    check_id(record.id)
    return record


def check_id(allocation_id: str) -> str:
    """IDs name files and directories: only the two known shapes are accepted."""
    prefix, _, digest = allocation_id.partition("-")
    if prefix not in ("k", "r") or len(digest) != 16 or not all(
        c in "0123456789abcdef" for c in digest
    ):
        raise RecordError(f"malformed allocation id {allocation_id!r}")
    return allocation_id


def id_for_devices(device_ids: Iterable[str]) -> str:
    """The same set of slice IDs always maps to the same record and channel (idempotence)."""
    joined = "\n".join(sorted(set(device_ids)))
    return "k-" + hashlib.sha256(joined.encode()).hexdigest()[:16]


def new_run_id() -> str:
    return "r-" + secrets.token_hex(8)


# ---- storage ----

def record_path(state_dir: str | Path, allocation_id: str) -> Path:
    return paths.allocations_dir(state_dir) / f"{check_id(allocation_id)}.json"


def encode_record(record: AllocationRecord) -> bytes:
    """The bytes write_record stores for `record` (the same record always gives the same bytes,
    so a reader holding them can tell an unchanged file by comparing)."""
    # Compact: with `indent`, json falls back to its pure-Python encoder (slow for 200 IDs).
    return json.dumps(record.to_json(), sort_keys=True).encode()


def write_record(state_dir: str | Path, record: AllocationRecord,
                 syncer: DirectorySyncer | None = None) -> Path:
    """Write atomically; on any failure the previous record (if any) is left untouched. With
    `syncer`, the directory fsync (power-loss durability) is done by it just after returning."""
    target = record_path(state_dir, record.id)
    write_record_bytes(target, encode_record(record), syncer)
    return target


def write_record_bytes(target: str | Path, payload: bytes,
                       syncer: DirectorySyncer | None = None) -> None:
    """write_record for a caller that keeps the bytes (from encode_record) and the record's
    path (record_path; a string saves pathlib's cost on the device plugin's hot path)."""
    try:
        try:
            write_atomic(target, payload, syncer=syncer)
        except FileNotFoundError:
            # The first record in this state dir: make allocations/ and write again (not
            # made up front on every call: the device plugin writes records on its hot path).
            directory = Path(target).parent
            if directory.is_dir():
                raise
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise RecordError(f"cannot write to state directory {directory}: "
                                  f"{err.strerror}") from None
            write_atomic(target, payload, syncer=syncer)
    except OSError as err:
        raise RecordError(f"cannot write allocation record {target}: {err.strerror}") from None


def read_record(path: str | Path) -> AllocationRecord:
    try:
        raw = read_nofollow(path)   # a link planted among the records is refused, not followed
    except OSError as err:
        raise RecordError(f"cannot read allocation record {path}: {err.strerror}") from None
    return decode_record(path, raw)


def decode_record(path: str | Path, raw: bytes) -> AllocationRecord:
    """Parse and check a record file's bytes; `path` is where they came from (its name must
    match the id)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:
        # ValueError covers bad UTF-8, bad JSON and integers past Python's digit limit;
        # RecursionError, nesting deeper than the parser's stack (both found by fuzzing).
        raise RecordError(f"allocation record {path} is not valid JSON: {err}") from None
    record = AllocationRecord.from_json(data)
    if Path(path).name != f"{record.id}.json":
        raise RecordError(f"allocation record {path} holds id {record.id}")
    return record


def load_record(state_dir: str | Path, allocation_id: str) -> AllocationRecord | None:
    path = record_path(state_dir, allocation_id)
    raw = read_record_bytes(path)
    return None if raw is None else decode_record(path, raw)


def read_record_bytes(path: str | Path) -> bytes | None:
    """A record file's bytes, unparsed (decode_record parses them), or None if there is none."""
    try:
        return read_nofollow(path)   # one open, no separate exists(): Allocate's hot path
    except FileNotFoundError:
        return None
    except OSError as err:
        raise RecordError(f"cannot read allocation record {path}: {err.strerror}") from None


def scan_records(state_dir: str | Path) -> Iterator[tuple[Path, AllocationRecord | RecordError]]:
    """Every record file, parsed; a bad one yields its error instead of stopping the scan."""
    directory = paths.allocations_dir(state_dir)
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("*.json")):
        try:
            yield path, read_record(path)
        except RecordError as err:
            yield path, err


def remove_record(state_dir: str | Path, allocation_id: str) -> bool:
    try:
        record_path(state_dir, allocation_id).unlink()
    except FileNotFoundError:
        return False
    fsync_dir(paths.allocations_dir(state_dir))
    return True


def remove_channel_dir(state_dir: str | Path, record: AllocationRecord) -> bool:
    """Remove the record's channel directory, only where this state directory's layout puts it
    (<state-dir>/channels/<id>) and only if it is a real directory of this process's user:
    nothing removes what it did not create. Returns whether it was removed."""
    channels = paths.channels_dir(state_dir)
    directory = Path(record.channel_dir)
    if directory.name != record.id or directory.parent.resolve() != channels.resolve():
        return False
    try:
        return remove_tree_in(channels, record.id, os.geteuid())
    except OSError:
        return False


def sweep_temp_files(state_dir: str | Path, older_than: float = STALE_TEMP_AGE) -> list[Path]:
    """Remove temporary files of record writes interrupted by a crash (the rule, and why it
    never breaks a live writer, in atomicfile.sweep_stale_temps). Called at start by each
    process that owns the directory: the device plugin and the node daemon."""
    return sweep_stale_temps(paths.allocations_dir(state_dir), older_than)
