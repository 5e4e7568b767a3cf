"""A discrete-event model of one GPU shared through the token scheduler, for the tests.

Each tenant runs a loop: launch a burst of `per_sync` kernels, synchronise, spend `cpu_gap`
on the host, repeat: GPU-bound with no gap, launch-bound (busy fraction < 1) with one. Like
the hook, a tenant launches only while it holds a valid token of its own (with co-scheduling
several tenants hold one at once); launches are asynchronous, so a burst started before expiry
may run past it (overuse), which the tenant reports with its next request.

The GPU is an engine that runs one piece of work at a time, in launch order across tenants (a
burst queued behind another tenant's waits for it), as the fake driver's shared engine
(FAKE_CUDA_ENGINE) and a time-sliced GPU between contexts do. So busy time is additive: every
busy instant belongs to one tenant, the device's utilisation is the sum of the tenants' parts,
and co-holders that ask for more than the GPU has contend for it rather than each running at
its own rate. (Proportional sharing, MPS-like, would give each co-holder a fraction of every
instant: a tenant's busy time would then depend on a speed-up model of its kernels, and the
scheduler's charge, busy fraction x time held, could not be checked against it.) The engine
pays `handoff` when it switches to a tenant whose token passed (the token's handoff cost), and
`co_switch` (0, as the fake engine) between the pieces of tenants that hold the GPU together.
With `overlap` the engine is an MPS server's instead: each tenant's work runs on its own stream
beside the others' at its own rate (launch-bound kernels that leave SMs free), and the device's
utilisation is the union of the tenants' busy time, below its sum while they overlap (no
slow-down where they do: for launch-bound mixes; GPU-bound tenants would share the SMs).

Like the daemon, the model releases an idle holder (no launch for `idle_release` after its sync,
`MEASURE_IDLE` in a measuring turn) only while it holds alone (channel/tokens.py: co-holders'
quotas bound any wait), calls tick() at the scheduler's deadlines and, with co-scheduling on and
two tenants or more, feeds the scheduler the device's utilisation as channel/gpu_busy.py does: a
sample of each `SAMPLE_PERIOD` on a fixed grid (NVML's, and the fake engine sampler's) covering
the period before its end, delivered `sample_lag` after it (the daemon reads every
SAMPLE_INTERVAL, at its own phase), as observe_utilization(end - SAMPLE_PERIOD, end, busy)
followed by tick().
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from vgpu_runtime.daemon.channel.gpu_busy import SAMPLE_INTERVAL, SAMPLE_PERIOD
from vgpu_runtime.timeshare.policy import (
    MEASURE_IDLE,
    Decision,
    Grant,
    TimeshareSettings,
    TokenScheduler,
)


@dataclass(frozen=True)
class Workload:
    kernel: float          # seconds per kernel
    per_sync: int = 1      # kernels launched between host synchronisations
    cpu_gap: float = 0.0   # host time after each synchronisation
    warmup: float = 0.0    # > 0: a first burst this long (a warm-up), synced, then idle
    idle_until: float = 0.0   # after the warm-up: host idle until this time, then the loop
    slow_until: float = 0.0   # before this time the host takes slow_gap after each burst (a
    slow_gap: float = 0.0     # start-up mostly on the host: loading, compiling)

    def __post_init__(self) -> None:
        if self.kernel <= 0 or self.per_sync < 1 or self.cpu_gap < 0:
            raise ValueError(f"need kernel > 0, per_sync >= 1, cpu_gap >= 0: {self}")

    def alone_rate(self) -> float:
        """Fraction of time the GPU works for this tenant when it has the GPU to itself: its
        busy fraction (1 where GPU-bound)."""
        burst = self.kernel * self.per_sync
        return burst / (burst + self.cpu_gap)


@dataclass
class SimTenant:
    name: str
    request: float
    limit: float
    workload: Workload
    work: list[tuple[float, float]] = field(default_factory=list)  # GPU intervals
    last_work_end: float = 0.0
    blocked: bool = False
    expires_at: float = -1.0
    released_at: float | None = None
    stopped: bool = False
    warmed: bool = False

    def work_between(self, start: float, end: float) -> float:
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.work)


class Simulation:
    def __init__(self, config: TimeshareSettings, handoff: float = 0.0005,
                 idle_release: float = 0.002, co_switch: float = 0.0,
                 sample_lag: float = 0.0, overlap: bool = False) -> None:
        if not 0 <= sample_lag < SAMPLE_INTERVAL:
            raise ValueError(f"need 0 <= sample_lag < {SAMPLE_INTERVAL}, got {sample_lag}")
        self.scheduler = TokenScheduler(config, 0.0)
        self.handoff = handoff
        self.idle_release = idle_release
        self.co_switch = co_switch
        self.sample_lag = sample_lag
        self.overlap = overlap
        self.samples: list[tuple[float, float]] = []   # (period end, busy) fed to the scheduler
        self._sampling = False
        self.tenants: dict[str, SimTenant] = {}
        self.now = 0.0
        self.gpu_free = 0.0
        self.gpu_last: str | None = None
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._tick_at: float | None = None
        self.grants: list[Grant] = []
        self.observers: list[Callable[[], None]] = []   # called after every event

    # ---- setup ----

    def add(self, name: str, request: float, limit: float, workload: Workload,
            start: float = 0.0) -> SimTenant:
        tenant = SimTenant(name, request, limit, workload)
        self.tenants[name] = tenant
        self.at(start, lambda: self._join(tenant))
        return tenant

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._seq), action))

    def run(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            time, _, action = heapq.heappop(self._events)
            self.now = max(self.now, time)
            action()
            self._schedule_tick()
            for observe in self.observers:
                observe()
        self.now = until

    def tick_due(self, within: float = 1e-6) -> bool:
        """A tick() is due now (within rounding): the state seen between two events of one
        instant is not settled yet."""
        return self._tick_at is not None and self._tick_at <= self.now + within

    def share(self, name: str, start: float, end: float) -> float:
        """Achieved share: throughput in [start, end) over the tenant's throughput alone."""
        tenant = self.tenants[name]
        return tenant.work_between(start, end) / (end - start) / tenant.workload.alone_rate()

    def busy(self, name: str, start: float, end: float) -> float:
        """Busy share: the part of [start, end) the engine ran the tenant's work."""
        return self.tenants[name].work_between(start, end) / (end - start)

    def utilization(self, start: float, end: float) -> float:
        """The device's utilisation over [start, end), as NVML reads it: the part some work
        ran (the engine runs one piece at a time, so the tenants' parts add up; overlapping,
        the union of their parts)."""
        if not self.overlap:
            return sum(t.work_between(start, end) for t in self.tenants.values()) / (end - start)
        pieces = sorted((max(s, start), min(e, end)) for t in self.tenants.values()
                        for s, e in t.work if min(e, end) > max(s, start))
        covered, reach = 0.0, start
        for s, e in pieces:
            if e > reach:
                covered += e - max(s, reach)
                reach = e
        return covered / (end - start)

    # ---- the scheduler's side ----

    def apply(self, decision: Decision) -> None:
        """Every grant a decision made reaches its tenant (a blocked one launches at once)."""
        for grant in decision.granted:
            self.grants.append(grant)
            tenant = self.tenants[grant.tenant]
            tenant.expires_at = grant.expires_at
            tenant.released_at = None
            if tenant.blocked:
                tenant.blocked = False
                self.at(self.now, partial(self._launch, tenant))

    def _schedule_tick(self) -> None:
        deadline = self.scheduler.next_deadline(self.now)
        if deadline is None or (self._tick_at is not None and self._tick_at <= deadline
                                and self._tick_at >= self.now):
            return
        self._tick_at = deadline

        def tick() -> None:
            if self._tick_at == deadline:
                self._tick_at = None
            self._note_revocations()
            self.apply(self.scheduler.tick(self.now))

        self.at(deadline, tick)

    def _note_revocations(self) -> None:
        for grant in self.scheduler.grants.values():
            if self.now >= grant.expires_at + self.scheduler.config.revoke_grace:
                self.tenants[grant.tenant].released_at = self.now

    def _start_sampling(self) -> None:
        """The daemon's sampler runs while co-scheduling is on and the GPU has two tenants."""
        if self._sampling or not self.scheduler.config.co_schedule:
            return
        self._sampling = True
        first = (int(self.now / SAMPLE_PERIOD) + 1) * SAMPLE_PERIOD
        self.at(first + self.sample_lag, lambda: self._sample(first))

    def _sample(self, end: float) -> None:
        if len(self.scheduler.tenants) < 2:
            self._sampling = False
            return
        busy = min(1.0, self.utilization(end - SAMPLE_PERIOD, end))
        self.samples.append((end, busy))
        self.scheduler.observe_utilization(end - SAMPLE_PERIOD, end, busy)
        self.apply(self.scheduler.tick(self.now))
        following = end + SAMPLE_PERIOD
        self.at(following + self.sample_lag, lambda: self._sample(following))

    # ---- a tenant's loop (the hook's side) ----

    def _join(self, tenant: SimTenant) -> None:
        self.apply(self.scheduler.add(tenant.name, tenant.request, tenant.limit, self.now))
        if len(self.scheduler.tenants) >= 2:
            self._start_sampling()
        self._launch(tenant)

    def _holds(self, tenant: SimTenant) -> bool:
        grant = self.scheduler.grants.get(tenant.name)
        return grant is not None and self.now < grant.expires_at

    def _launch(self, tenant: SimTenant) -> None:
        if tenant.stopped:
            return
        if not self.scheduler.needs_token() or self._holds(tenant):
            self._run_burst(tenant)
            return
        # Token expired or never held: report when our work ended and ask again (blocking).
        tenant.blocked = True
        self.apply(self.scheduler.request(
            tenant.name, self.now, burst_hint=tenant.workload.kernel * tenant.workload.per_sync,
            work_end=tenant.last_work_end))

    def _report(self, tenant: SimTenant, start: float, end: float) -> None:
        if tenant.name in self.scheduler.tenants:
            self.scheduler.observe_burst(tenant.name, start, end, 1, end)

    def _run_burst(self, tenant: SimTenant) -> None:
        wl = tenant.workload
        start = max(self.now, tenant.last_work_end if self.overlap else self.gpu_free)
        if self.gpu_last not in (None, tenant.name) and not self.overlap:
            # Between co-holders' pieces no token passed: the engine switches contexts only.
            co_held = self.gpu_last in self.scheduler.grants and len(self.scheduler.grants) > 1
            start += self.co_switch if co_held else self.handoff
        warming = wl.warmup > 0 and not tenant.warmed
        end = start + (wl.warmup if warming else wl.kernel * wl.per_sync)
        tenant.work.append((start, end))
        tenant.last_work_end = end
        self.gpu_free, self.gpu_last = end, tenant.name
        # Reported once it ends, as the hook does (its launch to its end: one burst).
        launched = self.now
        self.at(end, lambda: self._report(tenant, launched, end))
        # The host blocks in the synchronisation until the burst ends.
        ready = end + (wl.slow_gap if start < wl.slow_until else wl.cpu_gap)
        if warming:
            tenant.warmed = True
            ready = max(end, wl.idle_until)
        self.at(ready, lambda: self._launch(tenant))
        if ready - end >= self.idle_release:
            self.at(end + self.idle_release, lambda: self._idle_check(tenant, end, False))
        if ready - end >= MEASURE_IDLE:
            self.at(end + MEASURE_IDLE, lambda: self._idle_check(tenant, end, True))

    def _idle_check(self, tenant: SimTenant, since: float, measuring: bool) -> None:
        # The daemon checks an idle holder only while it holds alone, a measuring turn's only
        # after MEASURE_IDLE.
        grants = self.scheduler.grants
        if (list(grants) == [tenant.name] and tenant.last_work_end == since
                and grants[tenant.name].measuring == measuring):
            tenant.released_at = self.now
            self.apply(self.scheduler.release(tenant.name, self.now))

    def stop(self, name: str) -> None:
        """The tenant's process dies: its connection closes and the daemon removes it."""
        tenant = self.tenants[name]
        tenant.stopped = True
        self.apply(self.scheduler.remove(name, self.now))


FILL_EPS = 1e-9


def water_fill(requests: list[float], ceilings: list[float]) -> list[float]:
    """The GPU shared by requests up to each ceiling: each gets min(request, ceiling) and what
    is left goes to those below their ceiling, in proportion to their requests."""
    got = [min(r, c) for r, c in zip(requests, ceilings, strict=True)]
    for _ in range(len(got)):
        spare = 1.0 - sum(got)
        open_ = [i for i in range(len(got)) if got[i] < ceilings[i] - FILL_EPS]
        if spare <= FILL_EPS or not open_:
            break
        weight = sum(requests[i] for i in open_)
        for i in open_:
            got[i] = min(ceilings[i], got[i] + spare * requests[i] / weight)
    return got
