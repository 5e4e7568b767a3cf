"""A discrete-event model of one GPU shared through the token scheduler, for the tests.

Each tenant runs a loop: launch a burst of `per_sync` kernels, synchronise, spend `cpu_gap`
on the host, repeat. Like the hook, a tenant launches only while it holds a valid token;
launches are asynchronous, so a burst started before expiry may run past it (overuse), which
the tenant reports with its next request. The GPU runs one tenant's work at a time and pays
`handoff` whenever it switches tenants. Like the daemon, the model releases an idle holder
(no launch for `idle_release`) and calls tick() at the scheduler's deadlines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from vgpu_runtime.timeshare.policy import Grant, TimeshareSettings, TokenScheduler


@dataclass(frozen=True)
class Workload:
    kernel: float          # seconds per kernel
    per_sync: int = 1      # kernels launched between host synchronisations
    cpu_gap: float = 0.0   # host time after each synchronisation
    warmup: float = 0.0    # > 0: a first burst this long (a warm-up), synced, then idle
    idle_until: float = 0.0   # after the warm-up: host idle until this time, then the loop

    def alone_rate(self) -> float:
        """Fraction of time the GPU works for this tenant when it has the GPU to itself."""
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
                 idle_release: float = 0.002) -> None:
        self.scheduler = TokenScheduler(config, 0.0)
        self.handoff = handoff
        self.idle_release = idle_release
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

    def share(self, name: str, start: float, end: float) -> float:
        """Achieved share: throughput in [start, end) over the tenant's throughput alone."""
        tenant = self.tenants[name]
        return tenant.work_between(start, end) / (end - start) / tenant.workload.alone_rate()

    # ---- the scheduler's side ----

    def _apply(self, grant: Grant | None) -> None:
        if grant is None:
            return
        self.grants.append(grant)
        tenant = self.tenants[grant.tenant]
        tenant.expires_at = grant.expires_at
        tenant.released_at = None
        if tenant.blocked:
            tenant.blocked = False
            self.at(self.now, lambda: self._launch(tenant))

    def _schedule_tick(self) -> None:
        deadline = self.scheduler.next_deadline(self.now)
        if deadline is None or (self._tick_at is not None and self._tick_at <= deadline
                                and self._tick_at >= self.now):
            return
        self._tick_at = deadline

        def tick() -> None:
            if self._tick_at == deadline:
                self._tick_at = None
            self._note_release_of_holder()
            self._apply(self.scheduler.tick(self.now).grant)

        self.at(deadline, tick)

    def _note_release_of_holder(self) -> None:
        holder = self.scheduler.holder
        if holder and self.now >= holder.expires_at + self.scheduler.config.revoke_grace:
            self.tenants[holder.tenant].released_at = self.now

    # ---- a tenant's loop (the hook's side) ----

    def _join(self, tenant: SimTenant) -> None:
        self._apply(self.scheduler.add(tenant.name, tenant.request, tenant.limit,
                                          self.now).grant)
        self._launch(tenant)

    def _holds(self, tenant: SimTenant) -> bool:
        holder = self.scheduler.holder
        return bool(holder and holder.tenant == tenant.name and self.now < holder.expires_at)

    def _launch(self, tenant: SimTenant) -> None:
        if tenant.stopped:
            return
        if not self.scheduler.needs_token() or self._holds(tenant):
            self._run_burst(tenant)
            return
        # Token expired or never held: report when our work ended and ask again (blocking).
        tenant.blocked = True
        self._apply(self.scheduler.request(
            tenant.name, self.now, burst_hint=tenant.workload.kernel * tenant.workload.per_sync,
            work_end=tenant.last_work_end).grant)

    def _run_burst(self, tenant: SimTenant) -> None:
        wl = tenant.workload
        start = max(self.now, self.gpu_free)
        if self.gpu_last not in (None, tenant.name):
            start += self.handoff
        warming = wl.warmup > 0 and not tenant.warmed
        end = start + (wl.warmup if warming else wl.kernel * wl.per_sync)
        tenant.work.append((start, end))
        tenant.last_work_end = end
        self.gpu_free, self.gpu_last = end, tenant.name
        self.scheduler.observe_burst(tenant.name, start, end)
        # The host blocks in the synchronisation until the burst ends.
        ready = end + wl.cpu_gap
        if warming:
            tenant.warmed = True
            ready = max(end, wl.idle_until)
        self.at(ready, lambda: self._launch(tenant))
        if ready - end >= self.idle_release:
            self.at(end + self.idle_release, lambda: self._idle_check(tenant, end))

    def _idle_check(self, tenant: SimTenant, since: float) -> None:
        holder = self.scheduler.holder
        if holder and holder.tenant == tenant.name and tenant.last_work_end == since:
            tenant.released_at = self.now
            self._apply(self.scheduler.release(tenant.name, self.now).grant)

    def stop(self, name: str) -> None:
        """The tenant's process dies: its connection closes and the daemon removes it."""
        tenant = self.tenants[name]
        tenant.stopped = True
        self._apply(self.scheduler.remove(name, self.now).grant)
