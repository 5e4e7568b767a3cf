"""GPU time charged to one tenant, over a sliding window."""

from __future__ import annotations

import math
from collections import deque


class UsageWindow:
    """Charged intervals [start, end); usage(now) is their overlap with [now - span, now]."""

    def __init__(self, span: float) -> None:
        self.span = span
        self._intervals: deque[tuple[float, float]] = deque()

    def charge(self, start: float, end: float) -> None:
        if end <= start:
            return
        if self._intervals and start < self._intervals[-1][1]:
            # Never count the same instant twice: overlapping charges merge.
            last_start, last_end = self._intervals.pop()
            start, end = min(start, last_start), max(end, last_end)
        self._intervals.append((start, end))

    def _expire(self, now: float) -> None:
        horizon = now - self.span
        while self._intervals and self._intervals[0][1] <= horizon:
            self._intervals.popleft()

    def usage(self, now: float) -> float:
        self._expire(now)
        horizon = now - self.span
        return sum(min(end, now) - max(start, horizon)
                   for start, end in self._intervals if min(end, now) > max(start, horizon))

    def time_until_usage_at_most(self, now: float, target: float) -> float:
        """How long until usage drops to `target` if nothing more is charged (0 if already)."""
        excess = self.usage(now) - target
        if excess <= 0:
            return 0.0
        # Usage falls as the window's trailing edge moves over charged time.
        horizon = now - self.span
        for start, end in self._intervals:
            lo = max(start, horizon)
            length = min(end, now) - lo
            if length <= 0:
                continue
            if length >= excess:
                return lo + excess - horizon
            excess -= length
        return self.span


class DecayingUsage:
    """Charged time weighted by exp(-age / tau): a sliding window without a trailing edge.

    A hard window forgets a charge all at once, `span` seconds later, and the tenant then looks
    owed (an echo of its past). Here old charges fade smoothly, so the order of service follows
    recent use without echoes. share(now) divides by the decayed length of time itself, so a
    tenant that used the GPU all the time has share 1.
    """

    def __init__(self, tau: float, started: float) -> None:
        self.tau = tau
        self.started = started
        self._value = 0.0       # decayed charge, as of self._at
        self._at = started

    def _advance(self, to: float) -> None:
        if to > self._at:
            self._value *= math.exp(-(to - self._at) / self.tau)
            self._at = to

    def charge(self, start: float, end: float) -> None:
        if end <= start:
            return
        self._advance(end)
        tau, at = self.tau, self._at
        self._value += tau * (math.exp(-(at - end) / tau) - math.exp(-(at - start) / tau))

    def share(self, now: float, since: float | None = None) -> float:
        """Decayed charge over decayed time since `since` (default: when this began)."""
        self._advance(now)
        begin = self.started if since is None else since
        span = self.tau * (1.0 - math.exp(-max(0.0, now - begin) / self.tau))
        return self._value / span if span > 0 else 0.0
