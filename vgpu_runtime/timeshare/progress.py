"""A tenant's progress alone and beside others: its kernel bursts (from a first launch to the
host synchronisation that ended it, counted in the hook's usage reports) per second held, each
way. Their ratio is its slow-down co-held, its rate beside the others over its rate alone. The
GPU's utilisation cannot say it: over MPS the union of the holders' busy time hides who was
slowed, and a launch-bound job's bursts are partly host time.

Time held is cut into segments (a change of holders ends one; so does each CUT seconds of the
same, at fixed points: when the figures are read changes nothing).
A report covers [start, end] of the bursts merged into it and arrives after them, so its bursts
are split over the held segments it overlaps, in proportion to the time held in each: a burst
that waited for the token ran only while held (split by its whole span, the wait's part was lost,
and a turn alone, which follows a wait, read slow). A report with no time held is dropped.
A segment is counted once LAG has passed since its end, when its reports are in (a later one, of
a burst longer than that, adds its part to the count alone); each way's count and time halve once
the time passes HALF_AFTER, so the rates follow a job's phases.
"""

from __future__ import annotations

from collections import deque

ALONE, SHARED = 0, 1
LAG = 0.3           # seconds: a burst is reported by the first sync 0.1 s after the last report
CUT = 0.5           # seconds of one way before its segment is cut (and counted LAG later)
HALF_AFTER = 5.0    # seconds held one way before that way's count and time halve
MIN_HELD = 0.5      # seconds counted each way before a slow-down is given
SEGMENTS_KEPT = 64  # segments waiting to be counted (a handoff makes two)
MAX_PER_SECOND = 1e6  # bursts a report may claim per second held in its span (plus one): a launch
                      # and a synchronisation take a microsecond; the hook's count is untrusted


class Progress:
    def __init__(self, now: float) -> None:
        self._phase: int | None = None       # ALONE, SHARED, or None: not holding
        self._since = now
        self._open = 0.0                     # bursts of the segment in progress
        # [start, end, phase, bursts] of the segments not yet counted, oldest first
        self._waiting: deque[list[float]] = deque(maxlen=SEGMENTS_KEPT)
        self._counted: deque[tuple[float, float, int]] = deque(maxlen=SEGMENTS_KEPT)
        self._known_since = now              # before it, segments forgotten: held, for a split
        self.bursts = [0.0, 0.0]             # counted, each way
        self.held = [0.0, 0.0]

    def hold(self, phase: int | None, now: float) -> None:
        """From `now` on it holds alone, co-held, or not at all (None)."""
        self._count(now)
        if phase != self._phase:
            self._cut(now)
            self._phase = phase

    def next_change(self, now: float) -> float:
        """When the figures may change next with no event (after `now`): a segment counted,
        or cut."""
        self._count(now)
        at = self._waiting[0][1] + LAG if self._waiting else float("inf")
        if self._phase is not None:
            at = min(at, self._since + CUT)
        return at

    def observe(self, start: float, end: float, bursts: int, now: float) -> None:
        """A usage report: `bursts` bursts between `start` and `end`."""
        self._count(now)
        if bursts <= 0 or end < start:
            return
        spans = [(begun, ended) for begun, ended, _way in self._counted]
        spans += [(segment[0], segment[1]) for segment in self._waiting]
        if self._phase is not None:
            spans.append((self._since, float("inf")))
        shares = [_overlap(start, end, begun, ended) for begun, ended in spans]
        # Forgotten segments may have held it: their time counts in the split, not their bursts.
        held = sum(shares) + _overlap(start, end, float("-inf"), self._known_since)
        if held <= 0:
            return
        bursts = min(bursts, int((held if end > start else 0.0) * MAX_PER_SECOND) + 1)
        parts = iter([bursts * share / held for share in shares])
        for (_begun, _ended, way), part in zip(self._counted, parts, strict=False):
            self.bursts[way] += part
        for segment, part in zip(self._waiting, parts, strict=False):
            segment[3] += part
        if self._phase is not None:
            self._open += next(parts)

    def rates(self, now: float) -> tuple[float | None, float | None]:
        """Its bursts per second held alone and co-held; None for a way with less than
        MIN_HELD counted."""
        self._count(now)
        alone, shared = (self.bursts[w] / self.held[w] if self.held[w] >= MIN_HELD else None
                         for w in (ALONE, SHARED))
        return alone, shared

    def slowdown(self, now: float) -> float | None:
        """Its rate co-held over its rate alone (at most 1); None until MIN_HELD is counted
        each way with a burst alone."""
        alone, shared = self.rates(now)
        if alone is None or shared is None or alone <= 0:
            return None
        return min(1.0, shared / alone)

    def _cut(self, now: float) -> None:
        now = max(now, self._since)
        if self._phase is not None and now > self._since:
            self._waiting.append([self._since, now, float(self._phase), self._open])
        self._since, self._open = now, 0.0

    def _count(self, now: float) -> None:
        # The same sums as next_change's: a wake at its time must find the change made.
        while self._phase is not None and self._since + CUT <= now:
            self._cut(self._since + CUT)
        while self._waiting and self._waiting[0][1] + LAG <= now:
            start, end, phase, bursts = self._waiting.popleft()
            way = int(phase)
            if len(self._counted) == self._counted.maxlen:
                self._known_since = self._counted[0][1]
            self._counted.append((start, end, way))
            self.bursts[way] += bursts
            self.held[way] += end - start
            if self.held[way] > HALF_AFTER:
                self.bursts[way] /= 2
                self.held[way] /= 2


def _overlap(start: float, end: float, begun: float, ended: float) -> float:
    """The time of [start, end] within [begun, ended); a report of an instant (start == end)
    weighs 1 where it lies, 0 elsewhere."""
    if end == start:
        return 1.0 if begun <= start < ended else 0.0
    return max(0.0, min(end, ended) - max(start, begun))
