"""The allocation record and the pod binding: the contracts between the allocators and the
node daemon. Each file has one writer.

An allocator (the device plugin's Allocate, or gemini-run) writes one record per allocation to
<state-dir>/allocations/<id>.json, holding the entitlement: what the slices (or gemini-run's
request) give. The node daemon alone writes <state-dir>/bindings/<id>.json, the pod a kubelet
allocation serves and that pod's overrides (its annotations); the daemon enforces the record's
entitlement with the binding's overrides applied (its terms). Both files are written atomically
(vgpu_runtime.common.atomicfile: temporary file, fsync, rename, fsync of the directory), so a
reader sees the old file or the new one, never half of one, even if the writer dies or the power
fails. Once write_record returns, the record survives a crash of the writer. The directory fsync
that makes it survive a power loss is done before write_record returns, or just after it by a
DirectorySyncer when the caller passes one (the device plugin, to answer Allocate sooner); until
then a power loss can only bring back the old record, or none. Temporary files a dead writer
left behind are removed by sweep_temp_files. A record is deleted by end_allocation alone, which
every program that ends an allocation asks (its docstring says who and why).

Record (JSON, `version` 2):
    id            "k-<16 hex>" from kubelet slice IDs, "r-<16 hex>" for gemini-run
    origin        "kubelet" | "gemini-run"
    device_ids    the slice IDs kubelet gave (empty for gemini-run)
    gpus          [{uuid, index, share, memory_limit, slices_per_gpu}]: share in (0, 1], the
                  entitled memory limit in bytes, and the slices the plugin cut that GPU into
                  (null from gemini-run)
    limit         gemini-run's cap on the GPU-time share, or null for the node default
    channel_dir   host path of the channel directory mounted into the container
    hook_library  file name of the interposer version the container was given
    created_at    creation time, seconds since the epoch
    owner_pid     gemini-run's pid, or null
    owner_uid     the user a host daemon's allocation belongs to (only that uid and root may
                  connect to its channel, see it or end it); absent elsewhere

A version-1 record (written before bindings existed) is read too. The daemon of that time
rewrote it with its pod and annotation values (`pod`, `limit`, `memory_limit`, the entitlement
kept in `default_memory`): those are read as the record's `carried` binding, which the daemon
moves into its own binding file the first time it reads the record.

Binding (JSON, `version` 1), written by the daemon only:
    id            the allocation id
    pod           {namespace, name, container, uid}
    limit         the pod's cap on the GPU-time share (annotation), or null
    memory_limit  the pod's memory limit per GPU (annotation), or null
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vgpu_runtime.common.atomicfile import (
    STALE_TEMP_AGE,
    DirectorySyncer,
    fsync_dir,
    sweep_stale_temps,
    write_atomic,
)
from vgpu_runtime.common.securedir import (
    InsecureDirectory,
    make_dir,
    read_nofollow,
    remove_tree_in,
)
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.share import Share, ShareError, optional_json

RECORD_VERSION = 2
READABLE_RECORD_VERSIONS = (1, 2)
BINDING_VERSION = 1
ORIGINS = ("kubelet", "gemini-run")
# The wire carries a memory limit as a uint64 (gemini_wire.h): a larger one could never be sent.
MAX_MEMORY_LIMIT = (1 << 64) - 1

T = TypeVar("T")   # what a scanned file reads as


class RecordError(ValueError):
    """A record is malformed or cannot be stored; the message says which and why."""


@dataclass(frozen=True)
class GpuShare:
    uuid: str
    index: int
    share: Share
    memory_limit: int                   # the entitled memory limit, bytes
    slices_per_gpu: int | None = None   # how many slices the plugin cut this GPU into


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    container: str
    uid: str = ""


@dataclass(frozen=True)
class Binding:
    """The daemon's part of a kubelet allocation: its pod and the pod's overrides."""
    id: str
    pod: PodRef
    limit: Share | None = None          # overrides the record's time cap
    memory_limit: int | None = None     # overrides every GPU's entitled memory limit

    def to_json(self) -> dict[str, Any]:
        return {"version": BINDING_VERSION, "id": self.id, "pod": dataclasses.asdict(self.pod),
                "limit": optional_json(self.limit), "memory_limit": self.memory_limit}

    @classmethod
    def from_json(cls, data: Any) -> Binding:
        try:
            return _parse_binding(data)
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            if isinstance(err, RecordError):
                raise
            raise RecordError(f"malformed pod binding: {err!r}") from None


@dataclass(frozen=True)
class AllocationRecord:
    id: str
    origin: str
    device_ids: tuple[str, ...]
    gpus: tuple[GpuShare, ...]
    channel_dir: str
    hook_library: str
    created_at: float
    limit: Share | None = None
    owner_pid: int | None = None
    owner_uid: int | None = None        # set by the host daemon alone
    # What a version-1 record's old daemon wrote into it (read only, never written back).
    carried: Binding | None = None

    def to_json(self) -> dict[str, Any]:
        # Field by field rather than dataclasses.asdict, whose deep copy of every slice ID
        # was the largest CPU cost of a new Allocate.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del data["carried"]
        if self.owner_uid is None:
            del data["owner_uid"]   # only the host daemon's records carry it
        data["version"] = RECORD_VERSION
        data["device_ids"] = list(self.device_ids)
        data["limit"] = optional_json(self.limit)
        data["gpus"] = [{f.name: getattr(g, f.name) for f in dataclasses.fields(g)}
                        for g in self.gpus]
        for gpu, share in zip(data["gpus"], self.gpus, strict=True):
            gpu["share"] = share.share.to_json()
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
    version = data.get("version")
    if version not in READABLE_RECORD_VERSIONS or isinstance(version, bool):
        raise RecordError(f"unsupported record version {version!r}")
    origin = _need(data, "origin", str)
    if origin not in ORIGINS:
        raise RecordError(f"unknown origin {origin!r}")
    gpus = []
    overrides: set[int] = set()     # version 1: memory limits the old daemon applied
    for item in _need(data, "gpus", list):
        if not isinstance(item, dict):
            raise RecordError("each entry of 'gpus' must be an object")
        share = _share(item, "share")
        memory_limit = _need(item, "memory_limit", int)
        if not 0 <= memory_limit <= MAX_MEMORY_LIMIT:
            raise RecordError(f"GPU entry out of range: memory {memory_limit}")
        slices = None
        if version == 1:
            entitled = _memory(item, "default_memory")
            if entitled is not None and entitled != memory_limit:
                overrides.add(memory_limit)
                memory_limit = entitled
        else:
            slices = item.get("slices_per_gpu")
            if slices is not None and (_need(item, "slices_per_gpu", int) < 1):
                raise RecordError(f"GPU entry out of range: slices per GPU {slices}")
        gpus.append(GpuShare(_need(item, "uuid", str), _need(item, "index", int), share,
                             memory_limit, slices))
    if not gpus:
        raise RecordError("an allocation record names no GPU")
    limit = None if data.get("limit") is None else _share(data, "limit")
    created_at = float(_need(data, "created_at", (int, float)))
    if not math.isfinite(created_at):
        raise RecordError(f"created_at is not a finite time: {created_at}")
    allocation_id = check_id(_need(data, "id", str))
    carried = None
    if version == 1 and origin == "kubelet":
        # Only the old daemon wrote a kubelet record's pod and limit.
        pod = data.get("pod")
        if isinstance(pod, dict):
            carried = Binding(allocation_id, _pod(pod), limit,
                              min(overrides) if overrides else None)
        limit = None
    return AllocationRecord(
        id=allocation_id,
        origin=origin,
        device_ids=tuple(str(d) for d in _need(data, "device_ids", list)),
        gpus=tuple(gpus),
        channel_dir=_need(data, "channel_dir", str),
        hook_library=_need(data, "hook_library", str),
        created_at=created_at,
        limit=limit,
        owner_pid=data.get("owner_pid") and _need(data, "owner_pid", int),
        owner_uid=_uid(data),
        carried=carried,
    )


def _uid(data: dict[str, Any]) -> int | None:
    if data.get("owner_uid") is None:
        return None
    uid = _need(data, "owner_uid", int)
    if not 0 <= uid < 1 << 32:
        raise RecordError(f"owner_uid out of range: {uid}")
    return int(uid)


def _memory(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    value = _need(data, key, int)
    if not 0 <= value <= MAX_MEMORY_LIMIT:
        raise RecordError(f"{key} out of range: {value}")
    return int(value)


def _share(data: dict[str, Any], key: str) -> Share:
    _need(data, key, (int, float))
    try:
        return Share.from_json(data[key])
    except ShareError as err:
        raise RecordError(f"{key} out of range: {err}") from None


def _pod(data: dict[str, Any]) -> PodRef:
    return PodRef(_need(data, "namespace", str), _need(data, "name", str),
                  _need(data, "container", str), str(data.get("uid") or ""))


def _parse_binding(data: Any) -> Binding:
    if not isinstance(data, dict):
        raise RecordError("a pod binding must be a JSON object")
    if data.get("version") != BINDING_VERSION:
        raise RecordError(f"unsupported binding version {data.get('version')!r}")
    pod = _need(data, "pod", dict)
    memory = _memory(data, "memory_limit")
    if memory == 0:
        raise RecordError("memory_limit out of range: 0")
    limit = None if data.get("limit") is None else _share(data, "limit")
    return Binding(check_id(_need(data, "id", str)), _pod(pod), limit, memory)


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


def _scan(directory: Path, read: Callable[[Path], T]) -> Iterator[tuple[Path, T | RecordError]]:
    """Every *.json file of `directory` (none where it is missing), read in name order; a bad
    one yields its error instead of stopping the scan."""
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("*.json")):
        try:
            yield path, read(path)
        except RecordError as err:
            yield path, err


def scan_records(state_dir: str | Path) -> Iterator[tuple[Path, AllocationRecord | RecordError]]:
    """Every record file, parsed; a bad one yields its error instead of stopping the scan."""
    return _scan(paths.allocations_dir(state_dir), read_record)


# ---- ending an allocation: the one place records are deleted ----

def end_allocation(state_dir: str | Path, allocation_id: str,
                   record: AllocationRecord | None = None) -> bool:
    """End an allocation on disk: its record (durably), then its channel directory. Records
    are deleted here alone; the programs that end allocations ask it: the device plugin (the
    records of an Allocate that failed part-way), gemini-run (its command's, as it exits, and
    those of dead owners), the daemon (a pod's that ended; on the host daemon, an allocation
    whose lease closed, whose owner died or that it could not serve, through the same
    collection) and gemini-host uninstall (the users' allocations). So one order and one rule
    hold for all: the record goes first, so the daemon stops serving it before its directory
    goes, and only a directory of this state directory's layout and of this user goes
    (remove_channel_dir). `record` names the directory; without it, the layout's
    <state-dir>/channels/<id> or <state-dir>/host-channels/<id>. Returns whether there was a
    record; OSError if it cannot be removed (the directory is then left: the allocation has
    not ended)."""
    removed = remove_record(state_dir, allocation_id)
    if record is not None:
        _remove_channel_dir(state_dir, allocation_id, record.channel_dir)
    else:
        for parent in _channel_parents(state_dir):
            _remove_channel_dir(state_dir, allocation_id, str(parent / allocation_id))
    return removed


def remove_record(state_dir: str | Path, allocation_id: str) -> bool:
    """The record file alone; the product ends allocations with end_allocation (tests check
    that it is the only caller)."""
    try:
        record_path(state_dir, allocation_id).unlink()
    except FileNotFoundError:
        return False
    fsync_dir(paths.allocations_dir(state_dir))
    return True


def remove_channel_dir(state_dir: str | Path, record: AllocationRecord) -> bool:
    """Remove the record's channel directory, only where this state directory's layout puts it
    (<state-dir>/channels/<id>, or the host daemon's <state-dir>/host-channels/<id>) and only if
    it is a real directory of this process's user: nothing removes what it did not create.
    Returns whether it was removed."""
    return _remove_channel_dir(state_dir, record.id, record.channel_dir)


def _channel_parents(state_dir: str | Path) -> tuple[Path, Path]:
    # A per-user daemon's or a node's channels, and the host daemon's (paths.py).
    return paths.channels_dir(state_dir), paths.host_channels_dir(state_dir)


def _remove_channel_dir(state_dir: str | Path, allocation_id: str, channel_dir: str) -> bool:
    directory = Path(channel_dir)
    if directory.name != allocation_id:
        return False
    for parent in _channel_parents(state_dir):
        if directory.parent.resolve() != parent.resolve():
            continue
        try:
            return remove_tree_in(parent, allocation_id, os.geteuid())
        except OSError:
            return False
    return False


def sweep_temp_files(state_dir: str | Path, older_than: float = STALE_TEMP_AGE) -> list[Path]:
    """Remove temporary files of record writes interrupted by a crash (the rule, and why it
    never breaks a live writer, in atomicfile.sweep_stale_temps). Called at start by each
    process that owns the directory: the device plugin and the node daemon."""
    return sweep_stale_temps(paths.allocations_dir(state_dir), older_than)


# ---- bindings (the daemon's files) ----

def binding_path(state_dir: str | Path, allocation_id: str) -> Path:
    return paths.bindings_dir(state_dir) / f"{check_id(allocation_id)}.json"


def write_binding(state_dir: str | Path, binding: Binding) -> Path:
    """Atomically and durably; on failure (RecordError) the previous binding is untouched."""
    target = binding_path(state_dir, binding.id)
    payload = json.dumps(binding.to_json(), sort_keys=True).encode()
    try:
        # bindings/ is the daemon's alone: a link or another user's directory is refused.
        make_dir(target.parent, paths.BINDINGS_DIR_MODE)
        write_atomic(target, payload, mode=0o600)
    except (OSError, InsecureDirectory) as err:
        detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise RecordError(f"cannot write pod binding {target}: {detail}") from None
    return target


def read_binding(path: str | Path) -> Binding:
    try:
        raw = read_nofollow(path)
    except OSError as err:
        raise RecordError(f"cannot read pod binding {path}: {err.strerror}") from None
    try:
        binding = Binding.from_json(json.loads(raw))
    except (ValueError, RecursionError) as err:
        if isinstance(err, RecordError):
            raise
        raise RecordError(f"pod binding {path} is not valid JSON: {err}") from None
    if Path(path).name != f"{binding.id}.json":
        raise RecordError(f"pod binding {path} holds id {binding.id}")
    return binding


def scan_bindings(state_dir: str | Path) -> Iterator[tuple[Path, Binding | RecordError]]:
    return _scan(paths.bindings_dir(state_dir), read_binding)


def remove_binding(state_dir: str | Path, allocation_id: str) -> bool:
    try:
        binding_path(state_dir, allocation_id).unlink()
    except FileNotFoundError:
        return False
    return True


def load_binding(state_dir: str | Path, allocation_id: str) -> Binding | None:
    """The allocation's binding as the daemon last stored it (a version-1 record's own is its
    `carried`), or None if there is none or it cannot be read."""
    try:
        return read_binding(binding_path(state_dir, allocation_id))
    except RecordError:
        return None
