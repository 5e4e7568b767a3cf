"""One GPU's token scheduler: the single authority on who may launch work, and for how long.

One tenant (a container: all of its processes) holds the GPU's token at a time, for a quota
sized from its estimated kernel burst, unless the tenants leave the GPU room: then several hold
it at once (co-scheduling, below). Every tenant has a request (guaranteed share, k/N)
and a limit (cap). GPU time is charged per tenant over a sliding window. The rules (why each is
so, with the measurements behind it: README.md beside this file):

* the holder pays from grant to release at least; overuse (work that ran past the release,
  measured by the hook) is added, and can only lengthen a charge, never shorten it. An
  instant is charged once. A hook that does not wait for its work (report mode) says so when
  work queued before its previous ask is still running: that work is charged from the release
  before that ask (`work_since`) up to now, then to its end;
* a token not returned by its expiry plus a grace period is revoked, and charged in full;
* the next holder is the waiting tenant with the smallest virtual time (GPU time charged /
  request), as in weighted fair queuing: tenants under their request come first, spare
  capacity is shared in proportion to requests up to each one's limit, and a tenant that is not
  waiting holds nobody back;
* a limit below 1 is a rate: the tenant's credit fills at `limit` seconds per second, up to
  limit x cycle, every charge spends it, and the tenant waits while it has none. Over any
  interval T it gets at most limit x T + limit x cycle;
* a tenant that becomes active again (asks after being idle), or has waited at its limit,
  starts no further behind than the least advanced active tenant: idle time is not banked,
  and time borrowed while others were idle is not paid back. Reported shares use the hard
  window;
* with `preempt_after` set (off by default), a tenant that starts waiting while another holds
  the token and is behind the holder in virtual time cuts the holder's quota short, to
  `preempt_after` at least; tenants already waiting at the grant never do, so busy tenants keep
  their quotas;
* requests that add up to more than 1.0 (only `gemini-run --overcommit` allows it) are scaled
  down in proportion, so each tenant is guaranteed request / sum(requests);
* debt is bounded (`TimeshareSettings.debt`, D = cycle + max_quota + revoke_grace): a tenant is
  never more than D GPU seconds ahead of the least advanced active tenant and, under a cap, its
  credit never falls below `credit_floor`. A single charge longer than a grant (a long kernel,
  a warm-up, an overuse report) is still charged in full to the reported window;
* so a busy tenant's wait is bounded (`TimeshareSettings.longest_wait`), and the GPU is never
  left idle while a waiting tenant has credit (or no cap), since every event dispatches.

Co-scheduling (`co_schedule`): a tenant's busy fraction (the part of the time its kernels keep
the GPU busy while it holds the token) is estimated from the device's own utilisation
(`observe_utilization`: NVML's 200 ms samples, measured on the H200 to cover exactly the 200 ms
before their timestamp): each period is an equation, utilisation = sum of (busy fraction x part
of the period held), over the last `BUSY_PERIODS` of them. A figure is a base times a scale: the
base solved by least squares from the tenants' turns alone, the scale from their co-held time
(its utilisation over what the co-holders' bases predict), so co-held time, which fixes only the
co-holders' sum, moves them in proportion. A period that co-held grants touched is taken only
while the GPU was not saturated (`BUSY_SATURATED`): there the holders filled each other's gaps;
in a saturated one they contended. Beside others a tenant counts for its figure, or for the
whole GPU where it is GPU-bound (above `co_busy_max`), unmeasured, or measured longer than
`co_refresh` ago. The waiting tenant first in line is granted beside the holders while all of
them and it count for `co_room` at most: launch-bound jobs fill each other's idle gaps, as under
time-slicing, and a light tenant (an inference loop) fills a GPU-bound one's, while two that may
be GPU-bound never share, so their shares stay exact where they contend. A co-held grant is
charged its busy fraction of its time (what the tenant used of the GPU; in full where
unmeasured); an exclusive grant is charged in full (it kept everyone else out). Over MPS
(`co_overlap`) co-held kernels run side by side, so a co-held period's utilisation is the union
of the co-holders' busy time, below its sum: solved as a sum it would hand the whole overlap to
one of them. There a co-held period is never taken; below saturation it renews the co-holders'
figures from their turns alone (unless it is busier than their sum allows: then they go stale,
as they do time-sliced where the scale would pass its most), so each is charged its own busy
time. On both paths only a turn alone measures a tenant: one with no fresh figure from turns
alone is never co-held, and its exclusive turn lasts `MEASURE_TURN` at least, so that a whole
utilisation period measures it (a measuring turn, which the daemon does not cut short at the
holder's idle gaps shorter than `MEASURE_IDLE`; `longest_wait` counts it). A co-held tenant ran
all it launched, kept waiting by nobody: when its grant ends it starts no further behind than
the least advanced other active tenant, as one back from idle (a light co-holder left behind
would otherwise be the floor that pins every other lead, and the largest request would win every
turn), nor more than `debt` behind the least advanced waiter (charged only its busy time, it
would pay a longer lag back slower than `longest_wait` allows). Figures that go stale while
co-held at saturation mean exclusive turns, which measure them again. Only the first in line is
ever co-granted, so a tenant that must wait for an exclusive turn is never passed over: the
holders drain within a quota and it is granted. A capped tenant (limit below 1) is never
co-held: its busy time beside others cannot be told from theirs, so it takes exclusive turns,
charged in full, and its cap holds in busy time; it is woken when its credit refills
(`next_deadline`).

Slow-down: each tenant's bursts per second held, alone and co-held, over the same recent
window (progress.py), give its rate beside the others over its rate alone
(`TenantView.slowdown`). Acted on only with `co_starved` set (an experiment, off by default):
see `_fits` and README.md beside this file. With it on, a tenant whose rate alone is due (it
has not held alone for `ALONE_FRESH`, or too briefly for a rate: `Progress.needs_turn_alone`) is
not measured: its next turn is a measuring turn, which renews its rate alone.

Flooding cannot delay others: a tenant is either waiting or not, so repeated requests change
nothing, and the choice never depends on how often anyone asked.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vgpu_runtime.timeshare.estimator import BurstEstimator
from vgpu_runtime.timeshare.progress import ALONE, SHARED, Progress
from vgpu_runtime.timeshare.window import UsageWindow, add_up

# Tenants on one GPU, as the native scheduler bounds them (timeshare.h): above the most slices
# a GPU can be cut into (paths.MAX_SLICES_PER_GPU, 1000).
MAX_TENANTS = 1024
# Utilisation periods kept for the busy fractions' least squares (3 s of NVML's 200 ms ones:
# a job's loading phase, holding the GPU idle, is forgotten within as long), and the part of a
# period (summed over them) a tenant must have held alone to be estimated.
BUSY_PERIODS = 15
BUSY_EVIDENCE = 1.0
# A turn that measures a tenant over MPS: two of NVML's 200 ms periods, so one lies whole inside.
MEASURE_TURN = 0.4
# A measuring turn is kept through its holder's idle gaps up to this long (an inference loop's
# think time, 4-30 ms); a holder idle for longer is released as any other. Kept through a
# start-up's idle seconds, a turn held the GPU 0.45 s for one launch while another waited, and
# read as a rate alone of 2 bursts a second (the fake engine, 2026-12-08).
MEASURE_IDLE = 0.1
BUSY_RIDGE = 0.05
# The most a co-held period's utilisation moves its co-holders' figures, either way; co-held
# time busier than their figures allow by more than BUSY_UNEXPLAINED (a scale past the most,
# or over MPS above their sum) makes their figures stale: an exclusive turn measures them again.
BUSY_SCALE_MAX = 2.0
BUSY_UNEXPLAINED = 0.1
# A period in which (almost) nothing ran tells nothing of a holder's demand: a job holding the
# token while it loads or sleeps launches nothing, and would read as a job that needs no GPU.
BUSY_IDLE = 0.02
# A co-held period busier than this is left out: there the co-holders contended (each ran
# less than it would alone), so the sum of their figures is not what they would use. Below
# it they filled each other's gaps, and the period measures them as one held alone does.
BUSY_SATURATED = 0.9
# A starved party (co_starved) this many GPU seconds behind another blocks a join.
JOIN_LAG = 0.02


@dataclass(frozen=True)
class Period:
    """A utilisation period taken: each tenant's part of it held alone and co-held."""

    alone: dict[str, float]
    shared: dict[str, float]
    util: float


@dataclass(frozen=True)
class TimeshareSettings:
    """The scheduler's settings; why each default is what it is: README.md beside this file."""

    window: float = 10.0          # seconds of history a share is measured over
    min_quota: float = 0.02       # shortest token: bounds the number of handoffs per second
    max_quota: float = 0.2        # longest token: bounds how long others wait
    cycle: float = 0.3            # a round: each tenant's base quota is its part of it
    catch_up: float = 0.25        # of the virtual-time lag, in quota: a tenant behind gets longer
    revoke_grace: float = 0.05    # a holder may overrun its quota this long before revocation
    preempt_after: float = 0.0    # > 0: a holder gives way to a waking tenant after this
    burst_merge_gap: float = 0.002  # the daemon's own burst estimate, used only when the hook
    burst_history: float = 3.0      # sends no figure: gaps merged, seconds remembered
    # Off by default: NVML's per-process figure, the busy fraction's source, read 0.86-1.0 for
    # a trainer whose true figure is 0.5-0.6 on the H200 (BENCHMARKS.md, "Real jobs").
    co_schedule: bool = False     # grant several tenants at once when they leave the GPU room
    co_room: float = 1.25         # the most the co-holders' busy fractions may add up to
    co_busy_max: float = 0.85     # busier than this alone: GPU-bound, exclusive turns only
    co_refresh: float = 3.0       # a busy figure older than this is stale: exclusive turns
    co_overlap: bool = False      # co-held kernels run side by side (MPS), not in turns
    co_starved: float = 0.0       # > 0: slowed below this x its part of the turns: starved

    @property
    def debt(self) -> float:
        """The most GPU seconds a tenant can be ahead of the others, or in debt under its cap:
        one round and one longest grant, revoked late, so it is paid back within seconds."""
        return self.cycle + self.max_quota + self.revoke_grace

    def credit_floor(self, limit: float) -> float:
        """The lowest credit of a tenant capped at `limit`: `debt` seconds of its refill, and
        never less than a revoked least grant (so a cap holds whatever the limit)."""
        return -max(limit * self.debt, self.revoke_grace + self.min_quota)

    @property
    def longest_grant(self) -> float:
        """The longest grant: `max_quota`, or with co-scheduling a measuring turn."""
        return max(self.max_quota, MEASURE_TURN) if self.co_schedule else self.max_quota

    def longest_wait(self, share: float, limit: float, tenants: int) -> float:
        """The bound on how long a tenant asking continuously waits for a grant (effective
        request, limit, tenants on the GPU), handoffs aside: its lead paid back at its
        request, one longest grant plus grace of each other tenant, and its credit refilled."""
        lead = self.debt * (1 - share) / share
        grants = (tenants - 1) * (self.longest_grant + self.revoke_grace)
        credit = (self.min_quota - self.credit_floor(limit)) / limit if limit < 1 else 0.0
        return lead + grants + credit


@dataclass(frozen=True)
class Grant:
    tenant: str
    generation: int
    granted_at: float
    quota: float
    shared: bool = False    # held beside others: charged at the tenant's busy fraction
    measuring: bool = False  # a turn that measures the holder: idle release after MEASURE_IDLE

    @property
    def expires_at(self) -> float:
        return self.granted_at + self.quota


@dataclass(frozen=True)
class Decision:
    """What one event decided, for the daemon to apply without asking again: who holds the GPU
    now and until when, the grants the event made, the grants it revoked (not returned in
    time), whether launches need the token at all, and when `tick` must run next."""

    grants: Mapping[str, Grant]
    granted: tuple[Grant, ...] = ()
    revoked: tuple[Grant, ...] = ()
    wake_at: float | None = None
    needs_token: bool = True

    @property
    def grant(self) -> Grant | None:
        """The first grant the event made, if any."""
        return self.granted[0] if self.granted else None


@dataclass
class Tenant:
    id: str
    share: float
    limit: float
    usage: UsageWindow          # the window: what status and metrics report
    bursts: BurstEstimator
    progress: Progress          # its bursts per second held alone and co-held: its slow-down
    vtime: float = 0.0          # charged GPU time / request: the order of service
    credit: float = 0.0         # limit < 1: GPU seconds it may still use (fills at `limit`/s)
    credit_at: float = 0.0
    waiting_since: float | None = None
    burst_hint: float | None = None
    last_release: float | None = None
    revocations: int = 0
    last_quota: float | None = None
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    busy: float | None = None   # its kernels' part of the time it held the GPU alone
    busy_base: float | None = None   # that, from its turns alone (busy: it scaled)
    measured_alone: bool = False     # its base came from turns alone (else from all its time)
    busy_at: float = float("-inf")


@dataclass(frozen=True)
class TenantView:
    id: str
    share: float              # effective (scaled) share
    limit: float
    used: float               # share of the window used
    waiting: bool
    holder: bool
    wait_p50: float | None
    wait_p99: float | None
    revocations: int
    burst: float | None       # what quota sizing takes as its kernel burst
    last_quota: float | None  # the quota of its last grant
    busy: float | None        # its busy fraction alone (co-scheduling), None: not measured
    shared: bool              # it holds a co-granted (shared) grant
    charged_total: float      # GPU seconds charged since it joined: any span's charge, by
                              # difference, whenever it is read
    slowdown: float | None    # its rate co-held over its rate alone, None: not measured
    burst_rates: tuple[float | None, float | None]   # its bursts per second held alone, co-held


class TokenScheduler:
    def __init__(self, config: TimeshareSettings, now: float) -> None:
        self.config = config
        self.started = now
        self.tenants: dict[str, Tenant] = {}
        self.grants: dict[str, Grant] = {}   # who holds the token now, by tenant
        # History for the busy fractions: who held when, alone or co-held, and the utilisation
        # periods taken.
        self._held: dict[str, deque[tuple[float, float, bool]]] = {}
        self._periods: deque[Period] = deque(maxlen=BUSY_PERIODS)
        self.generation = 0
        self.preemptions = 0
        self.co_grants = 0
        # Effective shares, kept with the membership (the only thing they depend on): every
        # grant and charge reads them, and the token path is the daemon's hot path.
        self._shares: dict[str, float] = {}

    # ---- membership ----

    def add(self, tenant: str, share: float, limit: float, now: float) -> Decision:
        if not (0 < share <= 1) or not (share <= limit <= 1):
            raise ValueError(f"need 0 < share <= limit <= 1, got {share}, {limit}")
        if tenant in self.tenants:
            raise ValueError(f"tenant {tenant} is already scheduled on this GPU")
        if len(self.tenants) >= MAX_TENANTS:
            raise ValueError(f"at most {MAX_TENANTS} tenants on one GPU: cannot add {tenant}")
        self.tenants[tenant] = Tenant(
            tenant, share, limit, UsageWindow(self.config.window),
            BurstEstimator(self.config.burst_merge_gap, self.config.burst_history),
            Progress(now), vtime=self._floor(exclude=None) or 0.0, credit_at=now)
        self.tenants[tenant].credit = self._capacity(self.tenants[tenant])
        self._rescale()
        return self._decided(now, self._dispatch(now))

    def remove(self, tenant: str, now: float) -> Decision:
        """A tenant leaves (its last connection closed): what it held is released at once."""
        if tenant in self.grants:
            self._end_grant(tenant, now)
        self.tenants.pop(tenant, None)
        self._held.pop(tenant, None)
        self._forget_periods({tenant})   # they cannot be explained without it
        self._rescale()
        return self._decided(now, self._dispatch(now))

    def set_limit(self, tenant: str, limit: float, now: float) -> Decision:
        state = self.tenants[tenant]
        if not 0 < limit <= 1:
            raise ValueError(f"need 0 < limit <= 1, got {limit}")
        self._refill(state, now)            # what it earned so far, at the old rate
        state.limit = max(limit, state.share)
        state.credit = min(max(state.credit, self.config.credit_floor(state.limit)),
                           self._capacity(state))
        return self._decided(now, self._dispatch(now))

    def needs_token(self) -> bool:
        """A GPU given whole to one tenant needs no token: its launches go straight through."""
        return not (len(self.tenants) == 1 and next(iter(self.tenants.values())).share >= 1.0)

    # ---- the token ----

    def request(self, tenant: str, now: float, burst_hint: float | None = None,
                work_end: float | None = None, work_running: bool = False,
                work_since: float | None = None) -> Decision:
        """The tenant wants the token. The decision says whether it (or anyone) was granted.

        `work_end` is the hook's measurement (same monotonic clock) of when the GPU work of its
        last grant finished; work past the last release is overuse and is charged.
        `work_running`: work the process queued before its previous ask is still running, and
        has been since `work_since` (the release before that ask: launches wait for a grant).
        `work_since` with a `work_end`: that work ran without a break from then to its end,
        the report that follows `work_running` ones.
        """
        state = self.tenants[tenant]
        # Every request carries the hook's current figure; none (-1) means it saw no burst end.
        state.burst_hint = burst_hint if burst_hint is not None and burst_hint > 0 else None
        was_active = state.waiting_since is not None
        grant = self.grants.get(tenant)
        if grant is not None:
            if now < grant.expires_at:
                # Still valid: another process of the tenant asked first. Its report is of work
                # launched before this grant (it asked because its page said no), so it is
                # measured from the release before it like any other; the caller drops the
                # report of a connection asking ahead inside a grant it was sent itself.
                self._charge_work(state, now, work_end, work_running, work_since)
                return self._decided(now, [])
            self._end_grant(tenant, now)   # quota used up: back to the queue like everyone else
            was_active = True
        self._charge_work(state, now, work_end, work_running, work_since)
        if not was_active:
            # Back from idle: no credit for the idle time.
            state.vtime = max(state.vtime, self._floor(exclude=state.id) or 0.0)
        self._bound_lead(state, self._floor(exclude=state.id, idle_too=False))
        if state.waiting_since is None:
            state.waiting_since = now
        self._preempt_for(state, now)
        return self._decided(now, self._dispatch(now))

    def release(self, tenant: str, now: float, work_end: float | None = None) -> Decision:
        """The holder gives the token back (idle, or done). A stale release changes nothing."""
        state = self.tenants.get(tenant)
        if state is None:
            return self._decided(now, [])
        if tenant in self.grants:
            self._end_grant(tenant, now)
        self._charge_overuse(state, work_end, now)   # none from the daemon's own releases
        return self._decided(now, self._dispatch(now))

    def observe_burst(self, tenant: str, start: float, end: float, bursts: int = 0,
                      now: float | None = None) -> None:
        """A usage report, received at `now` (default `end`): the tenant's kernel bursts
        (`bursts` of them merged, 0: not counted, an older hook) between `start` and `end`."""
        state = self.tenants[tenant]
        state.bursts.observe(start, end)
        state.progress.observe(start, end, bursts, end if now is None else now)

    def observe_utilization(self, start: float, end: float, busy: float) -> bool:
        """The device's utilisation over [start, end): the part of it some kernel ran. Taken
        where something ran (only holders run kernels: launches wait for the token) and, if
        co-held grants touched the period, the GPU was not saturated; then the busy fractions
        are estimated again. Returns whether it was taken."""
        if end <= start or busy < BUSY_IDLE:
            return False
        span = end - start
        alone: dict[str, float] = {}
        shared: dict[str, float] = {}
        for tenant in self.tenants:
            for s, e, was_shared in self._held.get(tenant, ()):
                if min(e, end) > max(s, start):
                    into = shared if was_shared else alone
                    into[tenant] = into.get(tenant, 0.0) + (min(e, end) - max(s, start)) / span
        for tenant, grant in self.grants.items():   # grants in progress
            if end > max(start, grant.granted_at):
                into = shared if grant.shared else alone
                into[tenant] = into.get(tenant, 0.0) + (end - max(start, grant.granted_at)) / span
        co_held = bool(shared) or any(g.shared for g in self.grants.values())
        if co_held and busy >= BUSY_SATURATED:
            return False
        if co_held and self.config.co_overlap:
            # Overlapping kernels: the period's utilisation is below its co-holders' sum and
            # says nothing of each, but that they fit: their figures stay, renewed. Unless it
            # is above that sum: then the figures are too low (taken in a warm-up, say, 0.06
            # for a trainer busy 0.5 on an H100) and go stale, so a turn alone measures them.
            held = alone.keys() | shared.keys()
            allowed = add_up((self.tenants[t].busy or 0.0)
                             * (alone.get(t, 0.0) + shared.get(t, 0.0)) for t in held)
            measured = all(self.tenants[t].busy is not None for t in held)
            if measured and busy > allowed + BUSY_UNEXPLAINED:
                self._go_stale(held)
                return False
            for tenant in held:
                if self.tenants[tenant].busy is not None:
                    self.tenants[tenant].busy_at = end
            return False
        self._periods.append(Period(alone, shared, min(max(busy, 0.0), 1.0)))
        self._estimate_busy(end)
        return True

    def _estimate_busy(self, now: float) -> None:
        """Each tenant's figure is its base, solved from its turns alone, times its scale,
        solved from its co-held time.

        The base: least squares over the kept periods' time held alone, the co-held time in
        them counted at the co-holders' figures. The scale: the utilisation of a period's
        co-held time (what its turns alone at their bases leave of it) over what the
        co-holders' bases predict, averaged over the periods a tenant was co-held in, by its
        part of each. Co-held time fixes only its co-holders' sum; solved with the turns alone
        it gave the whole error to one of them (the first solved, or the one whose alone period
        left the kept 3 s last: 0.09 / 0.55 for 0.2 / 0.6 taken at 0.8 of their sum), where
        the scale moves co-holders in proportion and never changes their bases."""
        base = self._solve_base()
        def base_of(tenant: str) -> float | None:
            return base.get(tenant, self.tenants[tenant].busy_base)
        weight: dict[str, float] = {}
        scaled: dict[str, float] = {}
        unexplained: set[str] = set()
        for period in self._periods:
            if not period.shared:
                continue
            bases = {t: base_of(t) for t in period.alone.keys() | period.shared.keys()}
            if any(b is None for b in bases.values()):
                continue   # someone in it never measured: it fixes nobody's scale
            # Scaled: the co-held time of tenants measured alone; the rest at its base.
            scaling = {t: p for t, p in period.shared.items() if self.tenants[t].measured_alone}
            predicted = add_up(p * (bases[t] or 0.0) for t, p in scaling.items())
            left = period.util - add_up(p * (bases[t] or 0.0) for t, p in period.alone.items())
            left -= add_up(p * (bases[t] or 0.0) for t, p in period.shared.items()
                           if t not in scaling)
            if predicted <= 0:
                continue
            if left > BUSY_SCALE_MAX * predicted + BUSY_UNEXPLAINED:
                unexplained.update(scaling)
            ratio = min(BUSY_SCALE_MAX, max(1 / BUSY_SCALE_MAX, left / predicted))
            for tenant, part in scaling.items():
                weight[tenant] = weight.get(tenant, 0.0) + part
                scaled[tenant] = scaled.get(tenant, 0.0) + part * ratio
        for tenant in base.keys() | weight.keys():
            state = self.tenants[tenant]
            if tenant in base:
                state.busy_base = base[tenant]
            if state.busy_base is None:
                continue
            scale = scaled[tenant] / weight[tenant] if weight.get(tenant) else 1.0
            state.busy = min(1.0, max(0.0, state.busy_base * scale))
            state.busy_at = now
        if unexplained:
            self._go_stale(unexplained)

    def _go_stale(self, tenants: Iterable[str]) -> None:
        """Figures the co-held time cannot explain: stale, so the next turns are exclusive,
        and the periods they were solved from forgotten (they describe a past phase of the
        job, a start-up say: kept, they held a trainer re-measured at 0.53 to 0.30)."""
        gone = set(tenants)
        for tenant in gone:
            self.tenants[tenant].busy_at = float("-inf")
        self._forget_periods(gone)

    def _forget_periods(self, tenants: set[str]) -> None:
        """Drop the kept periods any of these tenants held in."""
        kept = [p for p in self._periods if not tenants & (p.alone.keys() | p.shared.keys())]
        self._periods = deque(kept, maxlen=BUSY_PERIODS)

    def _solve_base(self) -> dict[str, float]:
        """Least squares of the periods' time held alone, for the tenants that held alone long
        enough in them (Gauss-Seidel: a few sweeps of each tenant's own normal equation, from
        the bases before; their few sweeps also keep an early, underdetermined system near
        them, where an exact solve swung two tenants met only together to 1 and 0)."""
        # A tenant never measured alone is solved from its co-held time too, as one sum (beside
        # a light tenant it may be co-held before it ever held alone); one measured alone from
        # its turns alone, its co-held time left to its scale.
        alone: dict[str, float] = {}
        for period in self._periods:
            for tenant, part in period.alone.items():
                alone[tenant] = alone.get(tenant, 0.0) + part
        for tenant, part in alone.items():
            if part >= BUSY_EVIDENCE and tenant in self.tenants:
                self.tenants[tenant].measured_alone = True

        def solved_parts(period: Period) -> dict[str, float]:
            parts = dict(period.alone)
            for tenant, part in period.shared.items():
                if not self.tenants[tenant].measured_alone:
                    parts[tenant] = parts.get(tenant, 0.0) + part
            return parts

        held: dict[str, float] = {}
        for period in self._periods:
            for tenant, part in solved_parts(period).items():
                held[tenant] = held.get(tenant, 0.0) + part
        known = [t for t, h in held.items() if h >= BUSY_EVIDENCE and t in self.tenants]
        if not known:
            return {}
        # Each period as (parts of the tenants solved for, the utilisation they leave): the
        # rest counts at what is known, a measured co-holder's time at its figure, a turn alone
        # of a tenant not solved for at its base.
        rows: list[tuple[dict[str, float], float]] = []
        for period in self._periods:
            parts = solved_parts(period)
            rest = add_up(p * (self.tenants[t].busy_base or 0.0)
                          for t, p in parts.items() if t not in known)
            rest += add_up(p * (self.tenants[t].busy or 0.0) for t, p in period.shared.items()
                           if self.tenants[t].measured_alone)
            rows.append(({t: p for t, p in parts.items() if t in known}, period.util - rest))
        b: dict[str, float] = {}
        for tenant in known:
            previous = self.tenants[tenant].busy_base
            b[tenant] = 0.5 if previous is None else previous
        for _ in range(8):
            for tenant in known:
                num = den = 0.0
                for parts, util in rows:
                    mine = parts.get(tenant, 0.0)
                    if mine <= 0:
                        continue
                    others = add_up(b[o] * p for o, p in parts.items() if o != tenant)
                    num += mine * (util - others)
                    den += mine * mine
                # A little weight on the figure so far keeps it where turns always split
                # periods alike (then only the sum of the figures is known).
                prior = b[tenant]
                b[tenant] = min(1.0, max(0.0, (num + BUSY_RIDGE * prior) / (den + BUSY_RIDGE)))
        return b

    @property
    def holder(self) -> Grant | None:
        """The longest-held grant: the only one unless tenants are co-scheduled."""
        return min(self.grants.values(), key=lambda g: g.generation, default=None)

    def tick(self, now: float) -> Decision:
        """Revoke an overdue token and wake tenants whose window freed capacity."""
        revoked = []
        for grant in list(self.grants.values()):
            if now >= grant.expires_at + self.config.revoke_grace:
                self.tenants[grant.tenant].revocations += 1
                self._end_grant(grant.tenant, now)
                revoked.append(grant)
        return self._decided(now, self._dispatch(now), tuple(revoked))

    def next_deadline(self, now: float) -> float | None:
        """When tick() must run next: a revocation, or a limited tenant becoming eligible (with
        co-scheduling, while others hold too: it may fit beside them)."""
        wakes = []
        if self.grants:
            wakes.append(min(g.expires_at for g in self.grants.values())
                         + self.config.revoke_grace)
        if not self.grants:
            wakes += [self._eligible_at(t, now) for t in self.tenants.values()
                      if t.waiting_since is not None]
        elif self.config.co_schedule:
            wakes += [at for t in self.tenants.values() if t.waiting_since is not None
                      and (at := self._eligible_at(t, now)) > now]
            if self.config.co_starved > 0 and any(
                    t.waiting_since is not None for t in self.tenants.values()):
                # A join kept back for a starved party may be due when its figures change.
                wakes += [t.progress.next_change(now) for t in self.tenants.values()
                          if t.id in self.grants or t.waiting_since is not None]
        return min(wakes) if wakes else None

    # ---- views ----

    def shares(self) -> dict[str, float]:
        """Effective shares: scaled down in proportion where they add up to more than 1."""
        return dict(self._shares)

    def _rescale(self) -> None:
        total = add_up(t.share for t in self.tenants.values())
        scale = 1.0 / total if total > 1.0 else 1.0
        self._shares = {t.id: t.share * scale for t in self.tenants.values()}

    def used(self, tenant: str, now: float) -> float:
        """Share of the window charged, the holder's grant in progress included (it is charged
        only when it ends, and leaving it out would make sampled shares jump)."""
        span = self._span(now)
        if span <= 0:
            return 0.0
        grant = self.grants.get(tenant)
        running = grant.granted_at if grant is not None and not grant.shared else None
        return self.tenants[tenant].usage.usage(now, running) / span

    def snapshot(self, now: float) -> list[TenantView]:
        shares = self._shares
        views = []
        for t in self.tenants.values():
            waits = sorted(t.waits)
            views.append(TenantView(
                t.id, shares[t.id], t.limit, self.used(t.id, now), t.waiting_since is not None,
                t.id in self.grants,
                statistics.median(waits) if waits else None,
                waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else None,
                t.revocations, t.burst_hint or t.bursts.estimate(now), t.last_quota,
                t.busy if now - t.busy_at <= self.config.co_refresh else None,
                t.id in self.grants and self.grants[t.id].shared, t.usage.total,
                t.progress.slowdown(now), t.progress.rates(now)))
        return views

    # ---- internals ----

    def _span(self, now: float) -> float:
        return min(self.config.window, now - self.started)

    def _charge_work(self, state: Tenant, now: float, work_end: float | None,
                     work_running: bool, work_since: float | None) -> None:
        """Charge what a request reports: work still running since `work_since` up to now,
        or work that ran past the last release (or from `work_since`) up to its end."""
        if work_running:
            if work_since is not None:
                self._charge(state, work_since, now)
        else:
            self._charge_overuse(state, work_end, now, work_since)

    def _charge_overuse(self, state: Tenant, work_end: float | None, now: float,
                        since: float | None = None) -> None:
        """Charge work that ran past the last release (or from `since`). A report can only add
        charge, and never beyond the present; instants already charged count once."""
        since = since if since is not None else state.last_release
        if work_end is None or since is None or work_end <= since:
            return
        self._charge(state, since, min(work_end, now))

    def _end_grant(self, tenant: str, now: float) -> None:
        grant = self.grants.pop(tenant)
        self._holding_changed(now)
        state = self.tenants[tenant]
        end = max(now, grant.granted_at)
        if grant.shared:
            # Charged what it used of the GPU: its busy fraction of the time it held.
            busy = state.busy if state.busy is not None else 1.0
            start = grant.granted_at
            self._charge(state, start, start + busy * (end - start))
            # It ran all it launched, kept waiting by nobody: like idle time, its lag behind
            # the others is not banked (left behind, it would pin every other lead). Behind
            # the tenants waiting, at most `debt`: co-held, it is charged only its busy time,
            # so a lag paid back at that pace kept a waiter ahead of two co-holders 5 s.
            floor = self._floor(exclude=tenant, idle_too=False)
            if floor is not None and not self._starved(state, now):
                state.vtime = max(state.vtime, floor)
            waiting = [t.vtime for t in self.tenants.values()
                       if t.id != tenant and t.waiting_since is not None]
            if waiting:
                state.vtime = max(state.vtime,
                                  min(waiting) - self.config.debt / self._shares[tenant])
        else:
            self._charge(state, grant.granted_at, end)
        self._held_for(tenant, grant.granted_at, end, grant.shared)
        state.last_release = now

    def _preempt_for(self, waiter: Tenant, now: float) -> None:
        """Cut the holder's quota short for a tenant that woke up behind it."""
        grant = self.holder
        if (self.config.preempt_after <= 0 or grant is None or grant.tenant == waiter.id
                or grant.shared
                or waiter.waiting_since is None or waiter.waiting_since <= grant.granted_at
                or not self._has_credit(waiter, now)):
            return
        holder = self.tenants[grant.tenant]
        running = holder.vtime + (now - grant.granted_at) / self._shares[holder.id]
        if waiter.vtime >= running:
            return
        expires = max(now, grant.granted_at + self.config.preempt_after)
        if expires < grant.expires_at:
            self.grants[grant.tenant] = Grant(grant.tenant, grant.generation, grant.granted_at,
                                              expires - grant.granted_at)
            self.preemptions += 1

    def _charge(self, state: Tenant, start: float, end: float) -> None:
        added = state.usage.charge(start, end)   # what was not charged already
        if added <= 0:
            return
        state.vtime += added / self._shares[state.id]
        self._refill(state, end)
        # Overuse is paid back in waiting, but never more than the debt bound's worth.
        state.credit = max(state.credit - added, self.config.credit_floor(state.limit))
        self._bound_lead(state, self._floor(exclude=state.id, idle_too=False))

    def _bound_lead(self, state: Tenant, floor: float | None) -> None:
        """At most `debt` GPU seconds ahead of `floor` (the least advanced active tenant)."""
        if floor is not None:
            state.vtime = min(state.vtime,
                              floor + self.config.debt / self._shares[state.id])

    def _capacity(self, tenant: Tenant) -> float:
        return max(tenant.limit * self.config.cycle, self.config.min_quota)

    def _refill(self, tenant: Tenant, now: float) -> None:
        if now > tenant.credit_at:
            tenant.credit = min(self._capacity(tenant),
                                tenant.credit + tenant.limit * (now - tenant.credit_at))
            tenant.credit_at = now

    def _has_credit(self, tenant: Tenant, now: float) -> bool:
        if tenant.limit >= 1.0:
            return True
        self._refill(tenant, now)
        return tenant.credit >= self._least_grant(tenant)

    def _least_grant(self, tenant: Tenant) -> float:
        """The smallest quota worth a handoff, for a capped tenant (never above its bucket)."""
        return min(self.config.min_quota / 4, self._capacity(tenant))

    def _floor(self, exclude: str | None, idle_too: bool = True) -> float | None:
        """The least advanced active (waiting or holding) tenant's virtual time; with none,
        the most advanced idle one's (`idle_too`) or None, and 0 with no tenant at all."""
        active = [t.vtime for t in self.tenants.values() if t.id != exclude and (
            t.waiting_since is not None or t.id in self.grants)]
        if active:
            return min(active)
        if not idle_too:
            return None
        return max((t.vtime for t in self.tenants.values() if t.id != exclude), default=0.0)

    def _lag(self, tenant: Tenant) -> float:
        """GPU seconds the tenant is behind the most advanced waiting tenant, at its request."""
        waiting = [t.vtime for t in self.tenants.values() if t.waiting_since is not None]
        ahead = max(waiting, default=tenant.vtime)
        return max(0.0, ahead - tenant.vtime) * self._shares[tenant.id]

    def _eligible_at(self, tenant: Tenant, now: float) -> float:
        """Earliest time the tenant has credit for a grant, if nothing more is charged."""
        if self._has_credit(tenant, now):
            return now
        return now + (self._least_grant(tenant) - tenant.credit) / tenant.limit + 1e-9

    def _choose(self, now: float) -> Tenant | None:
        waiting = [t for t in self.tenants.values() if t.waiting_since is not None]
        eligible = [t for t in waiting if self._has_credit(t, now)]
        if not eligible:
            return None
        floor = min(t.vtime for t in eligible)
        for t in waiting:
            if t not in eligible:
                t.vtime = max(t.vtime, floor)   # waiting at its limit banks nothing either
        # The lead of those that wait is bounded against every active tenant, the holders too
        # (a tenant waiting at its limit, just raised to the eligible ones, as well: a holder
        # may be further behind than they are).
        active = self._floor(exclude=None, idle_too=False)
        for t in waiting:
            self._bound_lead(t, active)
        first = min(eligible, key=lambda t: (t.vtime, t.waiting_since or 0.0))
        if self.grants and not self._fits(first, now):
            return None   # it waits for the holders to drain; nobody passes it meanwhile
        return first

    def _room_taken(self, tenant: Tenant, now: float) -> float:
        """The part of the GPU a tenant is counted for beside others: its busy fraction where
        measured recently enough, and the whole GPU where GPU-bound, unmeasured or stale."""
        busy = tenant.busy
        if busy is None or not self._fresh(tenant, now):
            return 1.0
        # GPU-bound by its turns alone too: a scale below 1 (it was slowed beside others)
        # does not make it light.
        if max(busy, tenant.busy_base or 0.0) > self.config.co_busy_max:
            return 1.0
        return busy

    def _measured(self, tenant: Tenant, now: float) -> bool:
        """Its figure is from turns alone and fresh, and where the slow-down rule is on
        (`co_starved`), so is its rate alone: the rule compares a pace beside others with one
        alone near in time, never with the start-up's (its first steps are slow)."""
        if self.config.co_starved > 0 and tenant.progress.needs_turn_alone(now):
            return False
        return tenant.measured_alone and self._fresh(tenant, now)

    def _fresh(self, tenant: Tenant, now: float) -> bool:
        return tenant.busy is not None and now - tenant.busy_at <= self.config.co_refresh

    def _fits(self, tenant: Tenant, now: float) -> bool:
        """The tenant may hold the GPU beside the present holders: all of them and it are
        counted for `co_room` at most (so a GPU-bound holder admits only light tenants, and
        two that may be GPU-bound never share); a capped tenant never shares."""
        if not self.config.co_schedule:
            return False
        # A capped tenant takes exclusive turns, charged in full: its own busy time beside
        # others is not identifiable (only the co-holders' sum is), so a charge at its figure
        # let it run past its cap (0.72 of the GPU under a 0.3 cap over MPS, H100).
        if tenant.limit < 1.0 or any(self.tenants[t].limit < 1.0 for t in self.grants):
            return False
        # Only a turn alone measures a tenant (over MPS co-held time says nothing of each;
        # time-sliced only the co-holders' sum): one with no fresh figure from turns alone
        # takes exclusive turns until it has one.
        if not all(self._measured(self.tenants[t], now) for t in (*self.grants, tenant.id)):
            return False
        taken = add_up(self._room_taken(self.tenants[t], now) for t in self.grants)
        room = taken + self._room_taken(tenant, now)
        if room > self.config.co_room:
            return False
        # Where they over-fill the GPU, not while a starved party is behind another: it
        # catches up alone.
        if room > 1.0 and self.config.co_starved > 0:
            party = [self.tenants[t] for t in (*self.grants, tenant.id)]
            lead = max(t.vtime for t in party)
            if any(self._starved(t, now) and (lead - t.vtime) * self._shares[t.id] > JOIN_LAG
                   for t in party):
                return False
        return True

    def _starved(self, tenant: Tenant, now: float) -> bool:
        """Beside others it runs below `co_starved` x its part of the turns, of its pace alone
        (off at 0): at 1, exclusive turns would give it more (its request's part of the active
        tenants' requests, at its pace alone)."""
        if self.config.co_starved <= 0:
            return False
        slowdown = tenant.progress.slowdown(now)
        return (slowdown is not None
                and slowdown < self.config.co_starved * self._part_of_turns(tenant))

    def _part_of_turns(self, tenant: Tenant) -> float:
        """Its request's part of those of the tenants holding or waiting, itself counted."""
        active = add_up(self._shares[t.id] for t in self.tenants.values()
                        if t.id != tenant.id and (t.waiting_since is not None
                                                  or t.id in self.grants))
        return self._shares[tenant.id] / (self._shares[tenant.id] + active)

    def _quota(self, tenant: Tenant, now: float) -> float:
        """A tenant's part of one round (its part of all requests x cycle), plus part of its
        lag behind the others, stretched to fit its kernel bursts when they are short enough to
        fit in a quota at all. The hook's figure (the longest burst from a launch to the host
        synchronisation that ended it, unmerged) comes first: merged bursts of a saturating
        tenant span its whole grant and would only stretch quotas towards the maximum.
        """
        cfg = self.config
        if len(self.tenants) == 1:
            quota = cfg.max_quota   # alone: no one to hand over to, so hand over rarely
        else:
            shares = self._shares
            # Spare capacity is shared in proportion too, so size the round on the
            # tenant's part of all requests rather than its request alone.
            part = shares[tenant.id] / add_up(shares.values())
            quota = part * cfg.cycle + self._lag(tenant) * cfg.catch_up
            burst = tenant.burst_hint or tenant.bursts.estimate(now)
            if burst is not None and burst < cfg.max_quota:
                quota = max(quota, burst)
            quota = min(max(quota, cfg.min_quota), cfg.max_quota)
        if tenant.limit < 1.0:
            quota = min(quota, max(tenant.credit, self._least_grant(tenant)))
        return quota

    def _decided(self, now: float, granted: list[Grant],
                 revoked: tuple[Grant, ...] = ()) -> Decision:
        return Decision(dict(self.grants), tuple(granted), revoked, self.next_deadline(now),
                        self.needs_token())

    def _dispatch(self, now: float) -> list[Grant]:
        """Grant the first in line, and the next ones too while they fit beside the holders.
        Returns the grants made."""
        made: list[Grant] = []
        while True:
            # Where no waiter fits beside the holders nothing is chosen (choosing moves waiters'
            # virtual times) until the holders are gone, as with one token.
            if self.grants and not any(self._fits(t, now) for t in self.tenants.values()
                                       if t.waiting_since is not None):
                break
            chosen = self._choose(now)
            if chosen is None:
                break
            shared = bool(self.grants)
            if shared:
                self._share_holders(now)
                self.co_grants += 1
            self.generation += 1
            quota = self._quota(chosen, now)
            # Only a period held alone measures a tenant: its turn spans one, and is not cut
            # short in the tenant's idle gaps.
            measuring = (self.config.co_schedule and not shared and len(self.tenants) > 1
                         and not self._measured(chosen, now) and chosen.limit >= 1.0)
            if measuring:
                quota = max(quota, MEASURE_TURN)
            grant = Grant(chosen.id, self.generation, now, quota, shared, measuring)
            self.grants[chosen.id] = grant
            self._holding_changed(now)
            chosen.last_quota = grant.quota
            if chosen.waiting_since is not None:
                chosen.waits.append(now - chosen.waiting_since)
            chosen.waiting_since = None
            made.append(grant)
        return made

    def _share_holders(self, now: float) -> None:
        """A holder alone so far is joined: its time alone is charged in full up to now, and
        from now on its busy fraction (the same grant: its page does not change)."""
        for tenant, grant in list(self.grants.items()):
            if grant.shared:
                continue
            state = self.tenants[tenant]
            self._charge(state, grant.granted_at, max(now, grant.granted_at))
            self._held_for(tenant, grant.granted_at, now, False)
            self.grants[tenant] = Grant(tenant, grant.generation, now,
                                        grant.expires_at - now, True)

    def _holding_changed(self, now: float) -> None:
        """The holders changed: each tenant holds alone, co-held or not, by how many hold (a
        grant joined once stays `shared` after the others leave, so the flag cannot say)."""
        phase = ALONE if len(self.grants) == 1 else SHARED
        for tenant in self.tenants.values():
            tenant.progress.hold(phase if tenant.id in self.grants else None, now)

    def _held_for(self, tenant: str, start: float, end: float, shared: bool) -> None:
        self._held.setdefault(tenant, deque(maxlen=64)).append((start, end, shared))
