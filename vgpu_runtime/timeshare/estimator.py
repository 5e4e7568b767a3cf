"""Kernel-burst estimation: how long a tenant keeps the GPU busy between host synchronisations.

A burst is the GPU work from a first launch to the next host synchronisation. Bursts less than
`merge_gap` apart are one burst (a sync followed at once by more launches is not a pause), and
an estimate only looks at bursts of the last `history` seconds, so it follows phase changes.
"""

from __future__ import annotations

from collections import deque

# Bursts kept per tenant, the oldest dropped: the hook reports them, and ends it claims in the
# future would otherwise be kept (and sorted on every grant) without bound. 1024 covers 3 s of
# bursts 3 ms apart, finer than any quota.
MAX_BURSTS = 1024


class BurstEstimator:
    def __init__(self, merge_gap: float, history: float, percentile: float = 0.9) -> None:
        self.merge_gap = merge_gap
        self.history = history
        self.percentile = percentile
        self._bursts: deque[tuple[float, float]] = deque(maxlen=MAX_BURSTS)  # (start, end)

    def observe(self, start: float, end: float) -> None:
        if end < start:
            return
        if self._bursts and start - self._bursts[-1][1] < self.merge_gap:
            first, _ = self._bursts.pop()
            start = min(first, start)
        self._bursts.append((start, end))

    def estimate(self, now: float) -> float | None:
        """The `percentile` burst length over the history, or None with no recent burst."""
        while self._bursts and self._bursts[0][1] < now - self.history:
            self._bursts.popleft()
        if not self._bursts:
            return None
        lengths = sorted(end - start for start, end in self._bursts)
        return lengths[min(len(lengths) - 1, int(self.percentile * len(lengths)))]
