"""Per-pod annotations: what a pod may ask of its allocation beyond its slice count.

    gemini.ai/vgpu-limit   cap on the GPU-time share: "0.5" or "50%"; 0 < x <= 1 and at or
                           above the request (a cap below what is guaranteed means nothing)
    gemini.ai/vgpu-memory  memory limit per GPU: "4GiB", "512Mi", bytes; at most the record's
                           entitled memory (a pod cannot take memory its neighbours were
                           promised)

They become the pod binding's overrides; the record's entitlement is never changed. An invalid
value is ignored with a reason (the daemon posts it as an Event on the pod); the entitlement
holds and nothing else changes. Pure functions: no I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vgpu_runtime.common.sizes import format_size, parse_size
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.contracts.share import Share

LIMIT_ANNOTATION = "gemini.ai/vgpu-limit"
MEMORY_ANNOTATION = "gemini.ai/vgpu-memory"
INVALID_REASON = "InvalidVgpuAnnotation"


@dataclass(frozen=True)
class Overrides:
    limit: Share | None               # the time cap the pod asks, or None
    memory_limit: int | None          # the memory limit per GPU the pod asks, or None
    problems: tuple[str, ...]         # one message per ignored annotation


def parse_limit(text: str) -> Share:
    """'0.5' or '50%' -> 1/2; raises ValueError saying what is accepted."""
    try:
        return Share.parse(text)
    except ValueError as err:
        raise ValueError(f"{LIMIT_ANNOTATION}={err}") from None


def overrides_of(record: AllocationRecord, annotations: Mapping[str, str]) -> Overrides:
    """What the pod's annotations override in the record's entitlement; invalid ones are
    reported, not applied."""
    problems: list[str] = []
    limit: Share | None = None
    memory_limit: int | None = None
    share = max(g.share for g in record.gpus)
    raw_limit = annotations.get(LIMIT_ANNOTATION)
    if raw_limit is not None:
        try:
            value = parse_limit(raw_limit)
            if value < share:
                raise ValueError(f"{LIMIT_ANNOTATION}={raw_limit!r} is below the pod's request "
                                 f"of {share:g} of the GPU; a limit caps the share at or "
                                 "above what the slices guarantee")
            limit = value
        except ValueError as err:
            problems.append(f"{err}; ignored, the default limit holds")
    raw_memory = annotations.get(MEMORY_ANNOTATION)
    if raw_memory is not None:
        try:
            try:
                memory = parse_size(raw_memory)
            except ValueError as err:
                raise ValueError(f"{MEMORY_ANNOTATION}: {err}") from None
            entitled = min(g.memory_limit for g in record.gpus)
            if memory <= 0 or memory > entitled:
                raise ValueError(f"{MEMORY_ANNOTATION}={raw_memory!r} must be more than 0 and "
                                 f"at most the slices' default of {format_size(entitled)} "
                                 f"({entitled} bytes)")
            memory_limit = memory
        except ValueError as err:
            problems.append(f"{err}; ignored, the default memory limit holds")
    return Overrides(limit, memory_limit, tuple(problems))
