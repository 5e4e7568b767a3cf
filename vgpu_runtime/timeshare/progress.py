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
a burst longer than that, adds its part to the count alone). Each way's rate is that of the
segments that ended in the last WINDOW seconds (in BUCKET-second buckets), so the two are
compared over the same stretch of the job: a rate alone from its start-up, whose first steps
are slow, is forgotten once the window has passed (timeshare/README.md, "The slow-down").
`alone_at` says when it last held alone, `needs_turn_alone` whether the scheduler's slow-down
rule gives it a turn alone: its rate alone is older than ALONE_FRESH or has too little behind it.
"""

from __future__ import annotations

from collections import deque

ALONE, SHARED = 0, 1
LAG = 0.3           # seconds: a burst is reported by the first sync 0.1 s after the last report
CUT = 0.5           # seconds of one way before its segment is cut (and counted LAG later)
ALONE_FRESH = 10.0  # seconds since it last held alone before its rate alone is due again
WINDOW = 2 * ALONE_FRESH   # seconds of segments each rate counts: two turns alone at least
BUCKET = 1.0        # seconds of segment ends summed together in the window
MIN_HELD = 0.3      # seconds counted each way before a slow-down is given: most of one
                    # measuring turn (policy.MEASURE_TURN), so one renews a rate alone
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
        # each way's [bucket, bursts, held] of the counted segments in the window, oldest first
        self._buckets: tuple[deque[list[float]], deque[list[float]]] = (deque(), deque())
        self._alone_until = float("-inf")    # the end of its last segment held alone

    @property
    def bursts(self) -> list[float]:
        """Bursts counted in the window, each way (as of the last reading)."""
        return [sum(b[1] for b in self._buckets[w]) for w in (ALONE, SHARED)]

    @property
    def held(self) -> list[float]:
        """Seconds held counted in the window, each way (as of the last reading)."""
        return [sum(b[2] for b in self._buckets[w]) for w in (ALONE, SHARED)]

    def hold(self, phase: int | None, now: float) -> None:
        """From `now` on it holds alone, co-held, or not at all (None)."""
        self._count(now)
        if phase != self._phase:
            self._cut(now)
            self._phase = phase

    def alone_at(self, now: float) -> float:
        """The end of its last segment held alone (-inf if none): while it holds alone, the
        last cut, so a turn just granted is not yet a turn alone that others may join."""
        self._count(now)
        return self._alone_until

    def needs_turn_alone(self, now: float) -> bool:
        """Its rate alone is due (the slow-down rule's measuring turn): no segment alone ended
        in the last ALONE_FRESH, or those in the window, counted or not yet, held it alone less
        than MIN_HELD. Slivers alone (while a co-holder is between grants) renew the first and
        not the second: without it a tenant that co-held without a break was never given its
        turn alone and had no rate alone for 46 s (H100, 2026-12-07)."""
        if now - self.alone_at(now) > ALONE_FRESH:
            return True
        ended = sum(end - start for start, end, phase, _ in self._waiting if phase == ALONE)
        return self.held[ALONE] + ended < MIN_HELD

    def next_change(self, now: float) -> float:
        """When the figures may change next with no event (after `now`): a segment counted,
        cut, or leaving the window."""
        self._count(now)
        at = self._waiting[0][1] + LAG if self._waiting else float("inf")
        if self._phase is not None:
            at = min(at, self._since + CUT)
        for buckets in self._buckets:
            if buckets:
                at = min(at, _leaves_at(buckets[0][0]))
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
        for (_begun, ended, way), part in zip(self._counted, parts, strict=False):
            bucket = self._bucket(way, ended)
            if bucket is not None:
                bucket[1] += part
        for segment, part in zip(self._waiting, parts, strict=False):
            segment[3] += part
        if self._phase is not None:
            self._open += next(parts)

    def rates(self, now: float) -> tuple[float | None, float | None]:
        """Its bursts per second held alone and co-held in the window; None for a way with
        less than MIN_HELD counted."""
        self._count(now)
        bursts, held = self.bursts, self.held
        alone, shared = (bursts[w] / held[w] if held[w] >= MIN_HELD else None
                         for w in (ALONE, SHARED))
        return alone, shared

    def slowdown(self, now: float) -> float | None:
        """Its rate co-held over its rate alone (at most 1); None until MIN_HELD is counted
        each way in the window with a burst alone."""
        alone, shared = self.rates(now)
        if alone is None or shared is None or alone <= 0:
            return None
        return min(1.0, shared / alone)

    def _bucket(self, way: int, ended: float) -> list[float] | None:
        """The window's bucket of a counted segment that ended at `ended`, if still kept."""
        index = _index(ended)
        for bucket in reversed(self._buckets[way]):
            if bucket[0] == index:
                return bucket
            if bucket[0] < index:
                break
        return None

    def _cut(self, now: float) -> None:
        now = max(now, self._since)
        if self._phase is not None and now > self._since:
            self._waiting.append([self._since, now, float(self._phase), self._open])
            if self._phase == ALONE:
                self._alone_until = now
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
            buckets, index = self._buckets[way], _index(end)
            if buckets and buckets[-1][0] == index:
                buckets[-1][1] += bursts
                buckets[-1][2] += end - start
            else:
                buckets.append([index, bursts, end - start])
        for buckets in self._buckets:
            while buckets and _leaves_at(buckets[0][0]) <= now:
                buckets.popleft()


def _index(ended: float) -> float:
    """The bucket of a segment that ended at `ended`."""
    return ended // BUCKET


def _leaves_at(index: float) -> float:
    """When a bucket's segments have all ended more than WINDOW ago."""
    return (index + 1) * BUCKET + WINDOW


def _overlap(start: float, end: float, begun: float, ended: float) -> float:
    """The time of [start, end] within [begun, ended); a report of an instant (start == end)
    weighs 1 where it lies, 0 elsewhere."""
    if end == start:
        return 1.0 if begun <= start < ended else 0.0
    return max(0.0, min(end, ended) - max(start, begun))
