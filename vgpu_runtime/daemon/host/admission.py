"""Admission across the users of one machine, from the one set of live allocations (pure).

A GPU takes a new allocation while the shares on it, with the new one, add up to at most 1.0
and their memory limits to at most its memory: what each user is guaranteed then holds whoever
else runs. --overcommit passes either bound only over the asker's own allocations: it may never
take from what another user was guaranteed. Another user's allocations are counted, never named:
their ids lead to their channels.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpu_runtime.common.sizes import format_size
from vgpu_runtime.contracts.allocation import MAX_MEMORY_LIMIT
from vgpu_runtime.contracts.containerenv import entitled_memory
from vgpu_runtime.contracts.share import Share, total
from vgpu_runtime.gpus import GpuInfo


class Refused(Exception):
    """The allocation cannot be admitted; the message says why and what would be."""


@dataclass(frozen=True)
class Ask:
    uid: int
    gpu: str | None          # an index or a UUID; None: the first GPU with room
    share: Share
    limit: Share | None
    memory: int | None       # None: the share's part of the GPU's memory
    overcommit: bool = False


@dataclass(frozen=True)
class Held:
    """A live allocation on one GPU."""
    id: str
    uid: int | None          # None: an allocation of no user's (written before the host daemon)
    share: Share
    memory: int


@dataclass(frozen=True)
class Admitted:
    gpu: GpuInfo
    memory: int


def check(ask: Ask) -> None:
    """What the types leave to check (a Share is in (0, 1] already)."""
    if ask.limit is not None and not ask.share <= ask.limit:
        raise Refused(f"limit {ask.limit} must be in [share, 1] (share {ask.share})")
    if ask.memory is not None and not 0 < ask.memory <= MAX_MEMORY_LIMIT:
        raise Refused(f"memory {ask.memory!r} must be more than 0 bytes")


def memory_of(ask: Ask, gpu: GpuInfo) -> int:
    return ask.memory if ask.memory is not None else entitled_memory(gpu.memory_total, 0,
                                                                     ask.share)


def _fits(ask: Ask, gpu: GpuInfo, held: list[Held]) -> bool:
    share = total(h.share for h in held) + ask.share.value <= 1
    memory = sum(h.memory for h in held) + memory_of(ask, gpu) <= gpu.memory_total
    own = all(h.uid == ask.uid for h in held)
    return (share and memory) or (ask.overcommit and own)


def admit(ask: Ask, gpus: list[GpuInfo], held: dict[str, list[Held]]) -> Admitted:
    """The GPU and memory limit of a new allocation, or Refused saying why."""
    check(ask)
    if not gpus:
        raise Refused("the host daemon found no GPU (NVML found none; it simulates GPUs only "
                      "when started with --simulate-gpus N)")
    if ask.gpu is not None:
        matches = [g for g in gpus if ask.gpu in (str(g.index), g.uuid)]
        if not matches:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus)
            raise Refused(f"no GPU {ask.gpu!r} on this machine; known: {known}")
        gpu = matches[0]
    else:
        gpu = next((g for g in gpus if _fits(ask, g, held.get(g.uuid, []))), gpus[0])
    on_gpu = held.get(gpu.uuid, [])
    if not _fits(ask, gpu, on_gpu):
        raise Refused(_why(ask, gpu, on_gpu))
    return Admitted(gpu, memory_of(ask, gpu))


def _why(ask: Ask, gpu: GpuInfo, held: list[Held]) -> str:
    share_used = total(h.share for h in held)
    memory_used = sum(h.memory for h in held)
    own = [h for h in held if h.uid == ask.uid]
    others = [h for h in held if h.uid != ask.uid]
    parts = []
    if own:
        parts.append("yours: " + ", ".join(f"{h.id} {h.share:g} ({format_size(h.memory)})"
                                          for h in own))
    if others:
        parts.append(f"{len(others)} of other users: {float(total(h.share for h in others)):g} "
                     f"({format_size(sum(h.memory for h in others))})")
    memory = memory_of(ask, gpu)
    advice = "ask for a smaller --share or --memory, or another --gpu"
    if others:
        advice += ("; --overcommit cannot help: it passes the bounds over your own allocations "
                   "only, never over what another user was guaranteed")
    else:
        advice += ", or pass --overcommit"
    free = max(0.0, float(1 - share_used))
    return (f"GPU {gpu.index} ({gpu.uuid}) has {free:.6g} of its time and "
            f"{format_size(max(0, gpu.memory_total - memory_used))} of its memory free; asked: "
            f"--share {ask.share:g} with {format_size(memory)}. In use: "
            f"{'; '.join(parts) or 'nothing'}. {advice.capitalize()}.")
