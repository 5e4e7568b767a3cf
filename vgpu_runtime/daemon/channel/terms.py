"""The terms the daemon enforces for an allocation on each GPU: the record's entitlement (share,
memory limit) with the pod binding's overrides applied (time cap, memory limit), in the form
HELLO_REPLY carries them."""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass

from vgpu_runtime.contracts import wire
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, RecordError
from vgpu_runtime.contracts.share import Share


@dataclass(frozen=True)
class GpuTerms:
    uuid: str
    uuid_bytes: bytes     # 16 raw bytes, as cuDeviceGetUuid returns them
    memory_limit: int     # the binding's memory limit where it names one, else the record's
    share: Share          # the request on this GPU
    limit: Share          # the cap on this GPU (never below the request)


def uuid_bytes(text: str) -> bytes:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' -> its 16 bytes."""
    if not text.startswith("GPU-"):
        raise RecordError(f"GPU UUID {text!r} does not start with 'GPU-' (MIG is not supported)")
    try:
        return uuidlib.UUID(text[4:]).bytes
    except ValueError:
        raise RecordError(f"malformed GPU UUID {text!r}") from None


LimitRule = Callable[[Share | None, Share], Share]  # (record's limit, request) -> cap


def terms_of(record: AllocationRecord, binding: Binding | None,
             limit_for: LimitRule) -> tuple[GpuTerms, ...]:
    """Raises RecordError when the record cannot be served (bad UUID, too many GPUs, the same
    GPU twice)."""
    uuids = [g.uuid for g in record.gpus]
    if len(set(uuids)) != len(uuids):
        raise RecordError(f"allocation {record.id} names one GPU twice: {uuids}")
    if len(record.gpus) > wire.MAX_GPUS:
        raise RecordError(f"allocation {record.id} names {len(record.gpus)} GPUs; "
                          f"the wire carries at most {wire.MAX_GPUS}")
    if len(record.id.encode()) >= wire.const("GM_ALLOCATION_ID_BYTES"):
        raise RecordError(f"allocation id {record.id!r} is too long for the wire")
    asked_limit = record.limit
    memory_override = None
    if binding is not None:
        asked_limit = binding.limit if binding.limit is not None else record.limit
        memory_override = binding.memory_limit
    terms = []
    for g in record.gpus:
        limit = limit_for(asked_limit, g.share)
        memory = g.memory_limit if memory_override is None else memory_override
        terms.append(GpuTerms(g.uuid, uuid_bytes(g.uuid), memory, g.share, limit))
    return tuple(terms)
