"""The memory ledger: what each allocation holds on each of its GPUs, summed over connections.

Every connection (one per client process) holds amounts per (GPU, kind). The container-wide use
on a GPU is the sum over its connections; the limit is per allocation per GPU. The ledger is
plain synchronous code: the daemon calls it from its one event loop, so a check and its update
are never interleaved with another connection's.

The context charge: a connection's context kind (GM_MEM_CONTEXT) counts what the hook measured
when it created its contexts, unless the daemon has observed the process (`observe_process`,
from NVML's per-process figure): then it counts max(0, observed total - what the connection
has declared of every other kind on that GPU), fixed at the observation, and the hook's number
is kept but not counted. Withdrawing the observation (None) puts the hook's number back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from vgpu_runtime.contracts import wire


class LedgerError(ValueError):
    """A request that no well-behaved client sends (e.g. releasing more than it holds)."""


# No GPU holds 2^50 bytes (1 PiB); a claim past it is a broken or hostile client, refused
# before it can push a container's use past what MEM_REPLY's uint64 `used` can carry.
MAX_CLAIM = 1 << 50
CONTEXT = wire.const("GM_MEM_CONTEXT")


@dataclass(frozen=True)
class MemoryResult:
    granted: bool     # False: over the limit (RESERVE: not applied; SET: applied anyway)
    used: int         # container-wide use on that GPU after the request
    limit: int


@dataclass
class _Holder:
    amounts: dict[tuple[int, int], int] = field(default_factory=dict)  # (gpu, kind) -> bytes
    observed: dict[int, int] = field(default_factory=dict)  # gpu -> context charge from NVML

    def counted(self, gpu: int, kind: int, declared: int) -> int:
        """What a declared amount adds to the GPU's use: an observed context replaces it."""
        return 0 if kind == CONTEXT and gpu in self.observed else declared

    def empty(self) -> bool:
        return not self.amounts and not self.observed


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

    def observe_process(self, holder: Hashable, gpu: int, total: int | None) -> int | None:
        """Charge the holder's context from its process's whole use on the GPU as NVML sees
        it (None: no figure, the hook's own measurement counts). Returns the context charge
        now in force from the observation, or None. Never refused: the memory exists."""
        self._check_gpu(gpu)
        entry = self._holders.get(holder)
        if total is None:
            if entry is None or gpu not in entry.observed:
                return None
            charge = entry.observed.pop(gpu)
            self._used[gpu] += entry.amounts.get((gpu, CONTEXT), 0) - charge
            if entry.empty():
                del self._holders[holder]
            return None
        entry = self._holders[holder]
        declared_other = sum(amount for (g, kind), amount in entry.amounts.items()
                             if g == gpu and kind != CONTEXT)
        charge = min(MAX_CLAIM, max(0, total - declared_other))
        before = entry.observed.get(gpu, entry.amounts.get((gpu, CONTEXT), 0))
        entry.observed[gpu] = charge
        self._used[gpu] += charge - before
        return charge

    def observed_charge(self, holder: Hashable, gpu: int) -> int | None:
        """The context charge from an observation, or None where the hook's number counts."""
        found = self._holders.get(holder)
        return found.observed.get(gpu) if found else None

    def drop(self, holder: Hashable) -> None:
        """Release everything a connection held (it closed, or was killed)."""
        found = self._holders.pop(holder, None)
        if found:
            for (gpu, kind), amount in found.amounts.items():
                self._used[gpu] -= found.counted(gpu, kind, amount)
            for gpu, charge in found.observed.items():
                self._used[gpu] -= charge

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
        self._used[gpu] += entry.counted(gpu, kind, amount - entry.amounts.get((gpu, kind), 0))
        if amount:
            entry.amounts[(gpu, kind)] = amount
        else:
            entry.amounts.pop((gpu, kind), None)
            if entry.empty():
                del self._holders[holder]

    def _check_gpu(self, gpu: int) -> int:
        if not 0 <= gpu < len(self._limits):
            raise LedgerError(f"GPU index {gpu} is outside the allocation "
                              f"({len(self._limits)} GPU(s))")
        return gpu
