"""GPU-time tokens in the daemon: one `TokenScheduler` per physical GPU, driven by the channels.

The algorithm (vgpu_runtime.timeshare) is pure; this module gives it a clock, timers, pages and
connections:

* tenants are allocations; one joins a GPU's scheduler when its record appears and leaves when
  the record goes, so its request counts while it exists (an idle tenant holds nobody back);
* the clock is CLOCK_MONOTONIC (`time.monotonic_ns()`), the clock the hooks read; the algorithm
  takes seconds, the wire and the pages carry nanoseconds;
* every call into the algorithm returns its decision (policy.Decision), and `_apply` brings
  the pages, the connections and the timers in line with it: one trip down, one back. It
  follows who holds the token now (one tenant, or several co-scheduled): a page whose grant ended
  is cleared first, then each new holder's page is written and every connection of that tenant
  waiting on this GPU gets TOKEN_GRANT;
* a grant to a tenant none of whose connections still waits (they closed while waiting) is
  handed back at once, so a departed waiter costs nobody anything;
* one timer runs `tick()` at the decision's `wake_at` (revocation, a capped tenant eligible);
  another checks an idle holder at `last launch + idle_release`, only while it holds alone and
  someone waits (a measuring turn's at `MEASURE_IDLE`, whether or not anyone waits; before the
  grant's first launch, `first_launch_grace` where longer: a holder woken late by a busy host
  would otherwise lose a grant it was about to use).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vgpu_runtime.daemon.channel.gpu_busy import SAMPLE_PERIOD, BusySample, BusySampler
from vgpu_runtime.daemon.channel.pages import GATE_OPEN, GATE_TOKEN, ActivityPage, TokenPage
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.timeshare.policy import MEASURE_IDLE, Decision, Grant, TokenScheduler

if TYPE_CHECKING:
    from vgpu_runtime.daemon.channel.ledger import MemoryLedger

log = logging.getLogger(__name__)

NS = 1_000_000_000
# Upper bounds (seconds) of the token-wait histogram buckets (Prometheus `le`), +Inf implied.
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5, 5.0)
# Timers run on whole milliseconds, rounded up: asyncio's loop waits in epoll with a timeout
# rounded up to one, uvloop rounds to the nearest and ran timers up to 0.5 ms early (an idle
# release on time where asyncio's came up to 1 ms late, and sub-millisecond re-arms ran at once,
# a spin). Rounded up, both loops keep the timing the settings were measured with, and a
# deadline already passed is retried 1 ms later, never in a spin.
TIMER_RESOLUTION = 0.001


def timer_delay(delay: float) -> float:
    """`delay` rounded up to whole milliseconds, at least one."""
    return max(math.ceil(delay / TIMER_RESOLUTION - 1e-6), 1) * TIMER_RESOLUTION


def now_s() -> float:
    return time.monotonic_ns() / NS


def to_ns(seconds: float) -> int:
    return round(seconds * NS)


def from_ns(value: int) -> float | None:
    """-1 (and any negative value) means unknown."""
    return None if value < 0 else value / NS


class Waiter:
    """What a connection must offer to be answered later: a non-blocking send of one grant.

    `has_activity_page`: its process writes the allocation's activity page. One that does not
    (a version-1 hook, given no pages) asks for every launch, so its asks are its activity."""

    has_activity_page = True


    def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
        raise NotImplementedError


@dataclass
class WaitHistogram:
    """Token waits of one tenant on one GPU: per-bucket counts (not cumulative), sum, count."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1   # first bound >= it
        self.total += seconds
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        return {"bounds": list(WAIT_BUCKETS), "counts": list(self.counts),
                "sum": self.total, "count": self.count}


@dataclass
class TenantSlot:
    """One allocation on one GPU: its pages, its connections waiting for the token."""
    allocation_id: str
    index: int                      # the GPU's index in the allocation
    page: TokenPage
    activity: ActivityPage
    ledger: MemoryLedger
    waiters: dict[Waiter, int] = field(default_factory=dict)   # connection -> seq to echo
    wait_started: float | None = None    # when its oldest unanswered request came in
    waits: WaitHistogram = field(default_factory=WaitHistogram)
    asks: dict[Waiter, Ask] = field(default_factory=dict)   # each connection's last request
    granted: set[Waiter] = field(default_factory=set)   # the connections sent its last grant
    last_pageless_ask: float = -math.inf   # the latest ask of a connection without a page


@dataclass
class Ask:
    """A connection's (a process's) last token request, for the next one's overuse charge."""
    release_before: float | None   # the tenant's last release when it asked: its work since
    running: bool                  # it said work from the ask before was still running


class GpuTokens:
    """The token of one physical GPU."""

    def __init__(self, uuid: str, config: DaemonConfig,
                 clock: Callable[[], float] = now_s) -> None:
        self.uuid = uuid
        self.config = config
        self.clock = clock
        self.scheduler = TokenScheduler(config.algorithm(), clock())
        self.slots: dict[str, TenantSlot] = {}
        self.published: dict[str, Grant] = {}   # the grants the pages show, by tenant
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_fires = math.inf           # when the pending deadline timer runs
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_fires = math.inf               # when the pending idle check runs
        self._idle_backoff = config.idle_release
        self.grants = 0
        self.idle_releases = 0
        # The gate every slot's page shows; None until written to all (a new slot's page may
        # differ). Writing only on a change keeps each token hand-off O(1) in the tenants.
        self._gate: int | None = None

    # ---- membership ----

    def add(self, slot: TenantSlot, share: float, limit: float) -> None:
        now = self.clock()
        decision = self.scheduler.add(slot.allocation_id, share, limit, now)
        self.slots[slot.allocation_id] = slot
        self._gate = None
        self._apply(decision, now)

    def remove(self, allocation_id: str) -> TenantSlot | None:
        slot = self.slots.get(allocation_id)
        if slot is None:
            return None
        now = self.clock()
        slot.page.clear()
        decision = self.scheduler.remove(allocation_id, now)
        del self.slots[allocation_id]
        self.published.pop(allocation_id, None)
        self._apply(decision, now)
        return slot

    def set_limit(self, allocation_id: str, limit: float) -> None:
        if self.scheduler.tenants[allocation_id].limit != limit:
            now = self.clock()
            self._apply(self.scheduler.set_limit(allocation_id, limit, now), now)

    def share_of(self, allocation_id: str) -> float:
        return self.scheduler.tenants[allocation_id].share

    # ---- what the connections ask ----

    def request(self, waiter: Waiter, allocation_id: str, seq: int, burst_hint: float | None,
                work_end: float | None, work_running: bool = False) -> None:
        """TOKEN_REQUEST. The answer goes through `waiter.send_grant`, now or later; a
        connection has at most one pending entry, so asking again changes nothing.

        Overuse is measured per process: work its hook says is still running was launched
        before its previous ask, under a grant that had ended by the tenant's release seen
        then, and has run since; the report after such requests is charged from there too.
        Other processes of the container ask in between without moving that point."""
        slot = self.slots[allocation_id]
        now = self.clock()
        if not waiter.has_activity_page:
            slot.last_pageless_ask = now
        previous = slot.asks.get(waiter)
        since = previous.release_before if previous is not None and (
            work_running or previous.running) else None
        holder = self.scheduler.grants.get(allocation_id)
        granted = holder is not None and now < holder.expires_at
        if not granted:
            slot.waiters[waiter] = seq
            if slot.wait_started is None:
                slot.wait_started = now
        elif waiter in slot.granted and since is None:
            # Asking during the grant it was sent itself (a hook never does; a client that asks
            # ahead may): its work end is of this grant, which is charged when it ends.
            work_end = None
        # With the tenant's grant still valid this only charges: another process's work
        # launched before that grant, running past the release before it.
        decision = self.scheduler.request(allocation_id, now, burst_hint, work_end, work_running,
                                          since)
        slot.asks[waiter] = Ask(self.scheduler.tenants[allocation_id].last_release, work_running)
        if granted:
            assert holder is not None
            waiter.send_grant(seq, slot.index, holder.generation, to_ns(holder.expires_at))
            return
        self._apply(decision, now)

    def release(self, allocation_id: str, work_end: float | None) -> None:
        now = self.clock()
        self._apply(self.scheduler.release(allocation_id, now, work_end), now)

    def observe_burst(self, allocation_id: str, start: float, end: float,
                      bursts: int = 0) -> None:
        # A burst cannot end after now: a claimed future end would stretch quotas and stay in
        # the history; clamped, a burst wholly in the future ends before it starts and is dropped.
        now = self.clock()
        self.scheduler.observe_burst(allocation_id, start, min(end, now), bursts, now)

    def observe_utilization(self, samples: list[BusySample]) -> None:
        """NVML's device utilisation samples (gpu_busy.py) go to the algorithm, which may now
        co-grant a waiter."""
        for sample in samples:
            self.scheduler.observe_utilization(sample.end - SAMPLE_PERIOD, sample.end,
                                               sample.busy)
        now = self.clock()
        self._apply(self.scheduler.tick(now), now)

    def connection_closed(self, waiter: Waiter, allocation_id: str, last: bool) -> None:
        """A connection went away; with the tenant's last one goes the token it held."""
        slot = self.slots.get(allocation_id)
        if slot is None:
            return
        slot.waiters.pop(waiter, None)
        slot.asks.pop(waiter, None)
        slot.granted.discard(waiter)
        if not slot.waiters:
            slot.wait_started = None
        if last and allocation_id in self.scheduler.grants:
            log.info("token holder gone; passing the token on",
                     extra={"gpu": self.uuid, "allocation": allocation_id})
            now = self.clock()
            self._apply(self.scheduler.release(allocation_id, now), now)

    # ---- keeping pages, connections and timers in line with the algorithm ----

    def _apply(self, decision: Decision, now: float) -> None:
        revoked = list(decision.revoked)   # kept across the hand-backs below
        while True:
            grants = decision.grants
            for tenant, old in list(self.published.items()):
                new = grants.get(tenant)
                slot = self.slots.get(tenant)
                if new is None or new.generation != old.generation:
                    if slot is not None:
                        slot.page.clear()
                    del self.published[tenant]
                elif new.expires_at != old.expires_at and slot is not None:
                    # Same grant, cut short (a waking tenant preempts): the holder's next
                    # launch reads the new end from its page and asks again.
                    slot.page.grant(new.generation, to_ns(new.expires_at))
                    self.published[tenant] = new
                else:
                    self.published[tenant] = new   # shared from now on: the page is the same
            gone = next((grant for tenant, grant in grants.items()
                         if tenant not in self.published and not self.slots[tenant].waiters),
                        None)
            if gone is not None:
                # Granted to a tenant whose waiting connections all left: pass it on.
                decision = self.scheduler.release(gone.tenant, now)
                revoked += decision.revoked
                continue
            for tenant, grant in grants.items():
                if tenant not in self.published:
                    self._hand_over(grant, self.slots[tenant])
            break
        for grant in revoked:
            log.info("token revoked: not returned in time", extra={
                "gpu": self.uuid, "allocation": grant.tenant, "generation": grant.generation,
                "overrun_ms": round((now - grant.expires_at) * 1000, 3)})
        self._update_gates(decision.needs_token)
        self._arm_deadline(now, decision.wake_at)
        self._arm_idle_check(now, holders=decision.grants)

    def _hand_over(self, grant: Grant, slot: TenantSlot) -> None:
        valid_until = to_ns(grant.expires_at)
        slot.page.grant(grant.generation, valid_until)
        self.published[grant.tenant] = grant
        self.grants += 1
        self._idle_backoff = self.config.idle_release
        self._cancel_idle_check()   # a pending check was about the previous holder
        waiters, slot.waiters = slot.waiters, {}
        slot.granted = set(waiters)
        if slot.wait_started is not None:
            slot.waits.observe(max(0.0, self.clock() - slot.wait_started))
            slot.wait_started = None
        for waiter, seq in waiters.items():
            waiter.send_grant(seq, slot.index, grant.generation, valid_until)
        if log.isEnabledFor(logging.DEBUG):   # the fields cost more than the grant's frames
            log.debug("token granted", extra={"gpu": self.uuid, "allocation": grant.tenant,
                                               "generation": grant.generation,
                                               "shared": grant.shared,
                                               "quota_ms": round(grant.quota * 1000, 3)})

    def _update_gates(self, needs_token: bool) -> None:
        gate = GATE_TOKEN if needs_token else GATE_OPEN
        if gate == self._gate:
            return
        for slot in self.slots.values():
            if slot.page.gate != gate:
                slot.page.set_gate(gate)
        self._gate = gate

    def _arm_deadline(self, now: float, deadline: float | None) -> None:
        """A timer that runs no later than the next deadline. One that runs earlier is kept:
        tick() is right at any time and `_on_deadline` arms the next, so a hand-off (whose
        deadline is later than its predecessor's) costs no timer, only an early tick now and
        then."""
        if self._deadline_timer is not None:
            if deadline is not None and self._deadline_fires <= deadline:
                return
            self._deadline_timer.cancel()
            self._deadline_timer = None
            self._deadline_fires = math.inf
        if deadline is not None:
            delay = timer_delay(deadline - now)
            self._deadline_timer = asyncio.get_running_loop().call_later(delay, self._on_deadline)
            self._deadline_fires = now + delay

    def _on_deadline(self) -> None:
        self._deadline_timer = None
        self._deadline_fires = math.inf
        now = self.clock()
        self._apply(self.scheduler.tick(now), now)

    def _someone_else_waits(self, holder: Grant) -> bool:
        return any(t.waiting_since is not None for t in self.scheduler.tenants.values()
                   if t.id != holder.tenant)

    def _may_release(self, holder: Grant) -> bool:
        """An idle holder is released while someone else waits; a measuring turn whatever
        happens (held idle, it measures nothing and its time alone reads as no progress)."""
        return holder.measuring or self._someone_else_waits(holder)

    def _idle_reference(self, holder: Grant) -> tuple[float, float, float]:
        """(last activity, last launch, last sync) of the holder, in seconds. A connection
        without an activity page asks for every launch: its last ask is a launch whose end no
        page reports, so the holder counts as busy (backing off) rather than idle."""
        slot = self.slots[holder.tenant]
        activity = slot.activity.read()
        launch = from_ns(activity.last_launch_ns)
        sync = from_ns(activity.last_sync_ns)
        last_launch = max(-math.inf if launch is None else launch, slot.last_pageless_ask)
        last_sync = -math.inf if sync is None else sync
        return max(last_launch, holder.granted_at), last_launch, last_sync

    def _idle_after(self, holder: Grant) -> float:
        """How long the holder may idle before it is released: a measuring turn is kept through
        gaps shorter than MEASURE_IDLE (policy.py), so that its turn measures it."""
        if holder.measuring:
            return max(MEASURE_IDLE, self.config.idle_release)
        return self.config.idle_release

    def _alone_holder(self, grants: Mapping[str, Grant] | None = None) -> Grant | None:
        """The holder, when one tenant holds alone (co-holders' quotas bound any wait)."""
        grants = self.scheduler.grants if grants is None else grants
        return next(iter(grants.values())) if len(grants) == 1 else None

    def _arm_idle_check(self, now: float, at: float | None = None,
                        holders: Mapping[str, Grant] | None = None) -> None:
        holder = self._alone_holder(holders)
        if holder is None or not self._may_release(holder):
            self._cancel_idle_check()
            return
        if self._idle_timer is not None and at is None:
            return   # one check is pending already
        if at is None:
            reference, _, _ = self._idle_reference(holder)
            at = reference + self._idle_after(holder)
        if at >= holder.expires_at:
            self._cancel_idle_check()   # the quota ends first; the deadline timer handles it
            return
        self._cancel_idle_check()
        delay = timer_delay(at - now)
        self._idle_timer = asyncio.get_running_loop().call_later(delay, self._on_idle_check)
        self._idle_fires = now + delay

    def _cancel_idle_check(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
            self._idle_fires = math.inf

    def _on_idle_check(self) -> None:
        self._idle_timer = None
        self._idle_fires = math.inf
        now = self.clock()
        holder = self._alone_holder()
        if holder is None or not self._may_release(holder):
            return
        reference, last_launch, last_sync = self._idle_reference(holder)
        grace_ends = holder.granted_at + self.config.first_launch_grace
        idle_after = self._idle_after(holder)
        if now - reference < idle_after:
            self._arm_idle_check(now, reference + idle_after)  # launched since
        elif last_launch < holder.granted_at and now < grace_ends:
            # Nothing launched under this grant yet, within its first-launch grace: look again,
            # backing off as below, so a first launch is still noticed within 16 idle releases.
            self._idle_backoff = min(self._idle_backoff * 2, 16 * self.config.idle_release,
                                     self.config.max_quota)
            self._arm_idle_check(now, min(now + self._idle_backoff, grace_ends))
        elif last_sync < last_launch:
            # Work in flight (no sync since the last launch): look again later, backing off so
            # that a long kernel costs a few wake-ups (at most one per 16 x idle_release), not
            # a poll loop, and a finished one is still noticed within that.
            self._idle_backoff = min(self._idle_backoff * 2, 16 * self.config.idle_release,
                                     self.config.max_quota)
            self._arm_idle_check(now, now + self._idle_backoff)
        else:
            self.idle_releases += 1
            log.debug("idle holder releases early", extra={
                "gpu": self.uuid, "allocation": holder.tenant,
                "held_ms": round((now - holder.granted_at) * 1000, 3)})
            self._apply(self.scheduler.release(holder.tenant, now), now)

    def close(self) -> None:
        self._cancel_idle_check()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
            self._deadline_fires = math.inf

    # ---- status ----

    def next_wakeup(self) -> float | None:
        """When the next timer runs (this object's clock): the earlier of the deadline and the
        idle check; None: neither is pending."""
        at = min(self._deadline_fires, self._idle_fires)
        return None if math.isinf(at) else at

    def snapshot(self) -> dict[str, Any]:
        return gpu_snapshot(self)


def gpu_snapshot(tokens: GpuTokens) -> dict[str, Any]:
    """The status of one GPU's token (`gemini-vgpu status`, metrics, MQTT)."""
    now = tokens.clock()
    scheduler = tokens.scheduler
    holder = scheduler.holder
    tenants = []
    for view in scheduler.snapshot(now):
        slot = tokens.slots[view.id]
        tenants.append({
            "allocation": view.id, "gpu_index": slot.index,
            "request": view.share, "limit": view.limit, "achieved": view.used,
            "waiting": view.waiting, "holder": view.holder,
            "connections_waiting": len(slot.waiters),
            "wait_p50_ms": None if view.wait_p50 is None else view.wait_p50 * 1000,
            "wait_p99_ms": None if view.wait_p99 is None else view.wait_p99 * 1000,
            "revocations": view.revocations,
            "burst_ms": None if view.burst is None else view.burst * 1000,
            "quota_ms": None if view.last_quota is None else view.last_quota * 1000,
            "busy": view.busy, "shared": view.shared, "charged_s": view.charged_total,
            "slowdown": view.slowdown, "burst_rates": list(view.burst_rates),
            "memory_used": slot.ledger.used(slot.index),
            "memory_limit": slot.ledger.limit(slot.index),
            "waits": slot.waits.snapshot(),
        })
    return {
        "uuid": tokens.uuid,
        "gate": "token" if scheduler.needs_token() else "open",
        "holder": holder.tenant if holder else None,
        "holders": sorted(scheduler.grants),
        "co_grants": scheduler.co_grants,
        "holder_remaining_ms": max(0.0, (holder.expires_at - now) * 1000) if holder else None,
        "generation": scheduler.generation,
        "grants": tokens.grants, "idle_releases": tokens.idle_releases,
        "preemptions": scheduler.preemptions,
        "window_s": tokens.config.window,
        "tenants": tenants,
    }


class TokenService:
    """Every GPU's token on this node, keyed by UUID."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.gpus: dict[str, GpuTokens] = {}
        self.sampler = BusySampler(self)

    def gpu(self, uuid: str) -> GpuTokens:
        """The GPU's token; asked for when a tenant joins it, so sampling starts here."""
        tokens = self.gpus.get(uuid)
        if tokens is None:
            tokens = self.gpus[uuid] = GpuTokens(uuid, self.config)
        self.sampler.wake()
        return tokens

    def close(self) -> None:
        self.sampler.close()
        for tokens in self.gpus.values():
            tokens.close()

    def snapshot(self) -> list[dict[str, Any]]:
        return [self.gpus[uuid].snapshot() for uuid in sorted(self.gpus)]
