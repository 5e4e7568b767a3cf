"""The memory ledger: what each allocation holds on each of its GPUs, summed over connections.

Every connection (one per client process) holds amounts per (GPU, kind). The container-wide use
on a GPU is the sum over its connections; the limit is per allocation per GPU. The ledger is
plain synchronous code: the daemon calls it from its one event loop, so a check and its update
are never interleaved with another connection's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


class LedgerError(ValueError):
    """A request that no well-behaved client sends (e.g. releasing more than it holds)."""


# No GPU holds 2^50 bytes (1 PiB); a claim past it is a broken or hostile client, refused
# before it can push a container's use past what MEM_REPLY's uint64 `used` can carry.
MAX_CLAIM = 1 << 50


@dataclass(frozen=True)
class MemoryResult:
    granted: bool     # False: over the limit (RESERVE: not applied; SET: applied anyway)
    used: int         # container-wide use on that GPU after the request
    limit: int


@dataclass
class _Holder:
    amounts: dict[tuple[int, int], int] = field(default_factory=dict)  # (gpu, kind) -> bytes


class MemoryLedger:
    """One allocation's memory: limits per GPU index, holdings per connection."""

    def __init__(self, limits: Sequence[int]) -> None:
        self._limits = list(limits)
        self._used = [0] * len(limits)
        self._holders: dict[Hashable, _Holder] = defaultdict(_Holder)

    @property
    def gpu_count(self) -> int:
        return len(self._limits)

    def set_limits(self, limits: Sequence[int]) -> None:
        """A rewritten record may change limits; what is held stays held."""
        if len(limits) != len(self._limits):
            raise LedgerError("an allocation cannot change its number of GPUs")
        self._limits = list(limits)

    def used(self, gpu: int) -> int:
        return self._used[self._check_gpu(gpu)]

    def limit(self, gpu: int) -> int:
        return self._limits[self._check_gpu(gpu)]

    def held(self, holder: Hashable, gpu: int, kind: int) -> int:
        found = self._holders.get(holder)
        return found.amounts.get((gpu, kind), 0) if found else 0

    def reserve(self, holder: Hashable, gpu: int, kind: int, nbytes: int) -> MemoryResult:
        """Grant only if the container stays within its limit; a refusal changes nothing."""
        self._check_gpu(gpu)
        if self._used[gpu] + nbytes > self._limits[gpu]:
            return MemoryResult(False, self._used[gpu], self._limits[gpu])
        self._apply(holder, gpu, kind, self.held(holder, gpu, kind) + nbytes)
        return MemoryResult(True, self._used[gpu], self._limits[gpu])

    def release(self, holder: Hashable, gpu: int, kind: int, nbytes: int) -> MemoryResult:
        self._check_gpu(gpu)
        held = self.held(holder, gpu, kind)
        if nbytes > held:
            raise LedgerError(f"release of {nbytes} bytes of kind {kind} on GPU {gpu}, "
                              f"but this connection holds {held}")
        self._apply(holder, gpu, kind, held - nbytes)
        return MemoryResult(True, self._used[gpu], self._limits[gpu])

    def set(self, holder: Hashable, gpu: int, kind: int, nbytes: int) -> MemoryResult:
        """Absolute amount, always applied (the memory exists already); reports if over."""
        self._check_gpu(gpu)
        self._apply(holder, gpu, kind, nbytes)
        return MemoryResult(self._used[gpu] <= self._limits[gpu], self._used[gpu],
                            self._limits[gpu])

    def drop(self, holder: Hashable) -> None:
        """Release everything a connection held (it closed, or was killed)."""
        found = self._holders.pop(holder, None)
        if found:
            for (gpu, _kind), amount in found.amounts.items():
                self._used[gpu] -= amount

    def holders(self) -> list[Hashable]:
        return list(self._holders)

    def holdings(self, holder: Hashable) -> dict[tuple[int, int], int]:
        found = self._holders.get(holder)
        return dict(found.amounts) if found else {}

    def _apply(self, holder: Hashable, gpu: int, kind: int, amount: int) -> None:
        if amount > MAX_CLAIM or self._used[gpu] + amount > MAX_CLAIM * 64:
            raise LedgerError(f"{amount} bytes of kind {kind} on GPU {gpu} is past any GPU's "
                              "memory")
        entry = self._holders[holder]
        self._used[gpu] += amount - entry.amounts.get((gpu, kind), 0)
        if amount:
            entry.amounts[(gpu, kind)] = amount
        else:
            entry.amounts.pop((gpu, kind), None)
            if not entry.amounts:
                del self._holders[holder]

    def _check_gpu(self, gpu: int) -> int:
        if not 0 <= gpu < len(self._limits):
            raise LedgerError(f"GPU index {gpu} is outside the allocation "
                              f"({len(self._limits)} GPU(s))")
        return gpu
