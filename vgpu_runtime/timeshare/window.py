"""GPU time charged to one tenant, over a sliding window."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

# Charged intervals kept (the oldest forgotten beyond): a tenant's history is bounded however
# short its grants, as in the native scheduler (TS_WINDOW_INTERVALS in native/timeshare.h).
MAX_INTERVALS = 4096


def add_up(values: Iterable[float]) -> float:
    """Left to right from 0.0: the sum the native scheduler computes (Python 3.12's sum()
    compensates rounding, so its last bits depend on the Python version)."""
    total = 0.0
    for value in values:
        total += value
    return total


class UsageWindow:
    """Charged intervals [start, end), kept sorted and disjoint; usage(now) is their overlap
    with [now - span, now]."""

    def __init__(self, span: float) -> None:
        self.span = span
        self._intervals: list[tuple[float, float]] = []
        self._forgotten_until = float("-inf")   # history before this was dropped
        self.total = 0.0   # every second ever charged (a counter: the window forgets, this not)

    def charge(self, start: float, end: float) -> float:
        """Charge [start, end) and return the seconds it added: an instant already charged is
        never counted twice (a report of work that ran into the tenant's own next grant), and
        one older than the kept history is not counted at all."""
        start = max(start, self._forgotten_until)
        if end <= start:
            return 0.0
        # Every kept interval that touches [start, end) merges into it.
        first = bisect.bisect_left(self._intervals, (start, start))
        if first > 0 and self._intervals[first - 1][1] >= start:
            first -= 1
        last = first
        while last < len(self._intervals) and self._intervals[last][0] <= end:
            lo, hi = self._intervals[last]
            start, end = min(start, lo), max(end, hi)
            last += 1
        added = (end - start) - add_up(hi - lo for lo, hi in self._intervals[first:last])
        self._intervals[first:last] = [(start, end)]
        self.total += added
        # Charges end no later than the present, so what ended a window before this one is
        # history no share will read: dropped here, or the list grows with every grant
        # while nobody asks for the usage (no status, no scrape).
        self._expire(end)
        if len(self._intervals) > MAX_INTERVALS:
            self._forgotten_until = max(self._forgotten_until, self._intervals[0][1])
            del self._intervals[0]
        return added

    def _expire(self, now: float) -> None:
        horizon = now - self.span
        gone = 0
        while gone < len(self._intervals) and self._intervals[gone][1] <= horizon:
            gone += 1
        if gone:
            self._forgotten_until = max(self._forgotten_until, self._intervals[gone - 1][1])
            del self._intervals[:gone]

    def usage(self, now: float, ongoing_since: float | None = None) -> float:
        """With `ongoing_since`: also the charge still running since then (a grant in
        progress, charged when it ends), counted once where it meets the charged intervals."""
        self._expire(now)
        horizon = now - self.span
        intervals = list(self._intervals)
        if ongoing_since is not None and ongoing_since < now:
            until = now
            while intervals and ongoing_since < intervals[-1][1]:
                start, end = intervals.pop()
                ongoing_since, until = min(start, ongoing_since), max(end, until)
            intervals.append((ongoing_since, until))
        return add_up(min(end, now) - max(start, horizon)
                      for start, end in intervals if min(end, now) > max(start, horizon))
