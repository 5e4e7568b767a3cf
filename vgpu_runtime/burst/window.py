"""GPU time charged to one tenant, over a sliding window."""

from __future__ import annotations

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

    def usage(self, now: float, ongoing_since: float | None = None) -> float:
        """With `ongoing_since`: also the charge still running since then (a grant in
        progress, charged when it ends), counted once where it meets the last interval."""
        self._expire(now)
        horizon = now - self.span
        intervals = list(self._intervals)
        if ongoing_since is not None and ongoing_since < now:
            if intervals and ongoing_since < intervals[-1][1]:
                start, end = intervals.pop()
                intervals.append((min(start, ongoing_since), max(end, now)))
            else:
                intervals.append((ongoing_since, now))
        return sum(min(end, now) - max(start, horizon)
                   for start, end in intervals if min(end, now) > max(start, horizon))
