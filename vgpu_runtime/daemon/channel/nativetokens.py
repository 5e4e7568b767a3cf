"""GpuTokens over the C token code (native/tokens.h): the same API, the same decisions.

`NativeGpuTokens` is what tokens.py's `GpuTokens` is, with its logic (publishing, hand-over,
gates, the deadline and the idle check) in C, calling the C scheduler directly; what stays here
is what needs Python: the connections (`Waiter.send_grant`), the log lines, one loop timer.

* Tenants are added and removed through `NativeTokenScheduler` (`self.scheduler`, which keeps
  their names); the C code borrows its scheduler for everything else.
* Connections (`Waiter`s) get small integer ids, allocations' slots the C slot ids; the pages
  are handed to C by address, and a slot's pages stay mapped while it is attached (the channel
  closes them only after `remove`).
* The C code says when it wants to run next. In the daemon (`exact_timers`) that is the time
  itself, and a timerfd on CLOCK_MONOTONIC (native/wakeup.c) watched by the loop wakes it
  then: the loop's own timers run on whole milliseconds, up to two late on uvloop, and an idle
  check that late misses an inference loop's idle gap. Without (the tests that compare it with
  tokens.py) the times are on whole milliseconds as tokens.timer_delay rounds, and a loop timer
  runs them. Either is re-armed only when the time moves earlier; one that comes early looks
  again, so a grant and its release move no timer at all.
* tests/daemon/test_native_tokens.py runs both implementations side by side and compares the
  grants, the pages, the timers and the snapshot after every step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cffi

from vgpu_runtime.daemon.channel.tokens import (
    TIMER_RESOLUTION,
    WAIT_BUCKETS,
    TenantSlot,
    Waiter,
    WaitHistogram,
    gpu_snapshot,
    now_s,
    timer_delay,
)
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.timeshare import nativepolicy
from vgpu_runtime.timeshare.nativepolicy import NativeTokenScheduler

log = logging.getLogger("vgpu_runtime.daemon.channel.tokens")   # the same lines as tokens.py

HEADER_PATH = Path(__file__).resolve().parent / "native" / "tokens.h"


def _cdef_text() -> str:
    text = HEADER_PATH.read_text()
    begin, end = "/* TD_CDEF_BEGIN */", "/* TD_CDEF_END */"
    return text[text.index(begin) + len(begin):text.index(end)].replace("TD_API ", "")


ffi = cffi.FFI()
ffi.include(nativepolicy.ffi)
ffi.cdef(_cdef_text())
_lib: Any = None


class TokenCapacityError(RuntimeError):
    """A bound of the native token code (connections, slots) is reached; nothing changed."""


def library() -> Any:
    """The loaded library (libgemini-timeshare holds the scheduler and this code); raises
    OSError or nativepolicy's build error where it cannot be had."""
    global _lib
    if _lib is None:
        nativepolicy.library()
        _lib = ffi.dlopen(str(nativepolicy.library_path()))
        bounds = list(ffi.unpack(_lib.td_wait_bounds(), _lib.TD_WAIT_BUCKETS))
        if bounds != list(WAIT_BUCKETS):
            raise OSError(f"the native wait buckets {bounds} are not tokens.WAIT_BUCKETS")
        if _lib.TD_EVENTS_SHIFT != EVENTS_SHIFT or _lib.TD_MAX_GRANTS_OUT > GRANTS_MASK:
            raise OSError("the native token code's result layout is not this binding's")
    return _lib


GRANTS_MASK = (1 << 16) - 1
EVENTS_SHIFT = 16   # TD_EVENTS_SHIFT; checked against the library when it loads


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


class NativeGpuTokens:
    """The token of one physical GPU (tokens.GpuTokens' API)."""

    def __init__(self, uuid: str, config: DaemonConfig,
                 clock: Callable[[], float] = now_s, exact_timers: bool = True) -> None:
        lib = library()
        self._lib = lib
        self.uuid = uuid
        self.config = config
        self.clock = clock
        self.scheduler = NativeTokenScheduler(config.algorithm(), clock())
        settings = ffi.new("struct td_settings *", {
            "idle_release": config.idle_release, "max_quota": config.max_quota,
            "timer_resolution": 0.0 if exact_timers else TIMER_RESOLUTION})
        self._exact_timers = exact_timers
        self._wakeup_fd = -1                       # the timerfd (exact timers), once armed
        self._wakeup_loop: asyncio.AbstractEventLoop | None = None   # the loop watching it
        pointer = lib.td_create(settings, self.scheduler._ptr)
        if pointer == ffi.NULL:
            raise MemoryError("the native token code could not be allocated")
        self._gpu = ffi.gc(pointer, lib.td_destroy)
        self._out: Any = ffi.new("struct td_out *")
        self._info: Any = ffi.new("struct td_slot_info *")
        self._slot_id_out: Any = ffi.new("int32_t *")
        self.slots: dict[str, TenantSlot] = {}
        self._attached: dict[str, int] = {}        # allocation -> its C slot
        self._slot_names: dict[int, str] = {}      # C slot -> allocation (events)
        self._known: dict[int, tuple[weakref.ref[TenantSlot], int]] = {}   # id(slot) -> C slot
        self._detached: list[int] = []             # C slots not attached, oldest first
        self._gone: list[int] = []                 # C slots whose TenantSlot was collected
        self._conn_ids: dict[Waiter, int] = {}
        self._waiters: list[Waiter | None] = [None] * lib.TD_MAX_CONNECTIONS
        self._free_ids = list(range(lib.TD_MAX_CONNECTIONS - 1, -1, -1))   # lowest last
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf                  # what the loop timer is for; inf: none
        self._debug = log.isEnabledFor(logging.DEBUG)
        lib.td_debug_events(self._gpu, self._debug)

    # ---- membership ----

    def add(self, slot: TenantSlot, share: float, limit: float) -> None:
        if slot.allocation_id in self.slots:
            raise ValueError(f"tenant {slot.allocation_id} is already scheduled on this GPU")
        c_slot, created = self._c_slot(slot)
        now = self.clock()
        try:
            self.scheduler.add(slot.allocation_id, share, limit, now)
        except ValueError:
            if created:
                self._free_slot(c_slot)
            raise
        handle = self.scheduler.tenants[slot.allocation_id].handle
        result = self._check(self._lib.td_attach(self._gpu, c_slot, handle, now, self._out))
        if c_slot in self._detached:
            self._detached.remove(c_slot)
        self.slots[slot.allocation_id] = slot
        self._attached[slot.allocation_id] = c_slot
        self._slot_names[c_slot] = slot.allocation_id
        self._deliver(result)

    def remove(self, allocation_id: str) -> TenantSlot | None:
        c_slot = self._attached.get(allocation_id)
        if c_slot is None:
            return None
        slot = self.slots.pop(allocation_id)
        del self._attached[allocation_id]
        now = self.clock()
        self._check(self._lib.td_detach(self._gpu, c_slot))   # its page cleared first
        self.scheduler.remove(allocation_id, now)
        self._detached.append(c_slot)
        self._deliver(self._check(self._lib.td_publish(self._gpu, now, self._out)))
        return slot

    def set_limit(self, allocation_id: str, limit: float) -> None:
        c_slot = self._attached[allocation_id]
        rc = self._lib.td_set_limit(self._gpu, c_slot, limit, self.clock(), self._out)
        if rc == self._lib.TD_EINVAL:
            raise ValueError(f"need 0 < limit <= 1, got {limit}")
        self._deliver(self._check(rc))

    def share_of(self, allocation_id: str) -> float:
        return self.scheduler.tenants[allocation_id].share

    # ---- what the connections ask ----

    def request(self, waiter: Waiter, allocation_id: str, seq: int, burst_hint: float | None,
                work_end: float | None, work_running: bool = False) -> None:
        """tokens.GpuTokens.request. Raises KeyError for an allocation not on this GPU and
        TokenCapacityError past TD_MAX_CONNECTIONS connections; neither changes anything."""
        c_slot = self._attached[allocation_id]
        conn = self._conn_ids.get(waiter)
        new = conn is None
        if conn is None:
            conn = self._new_connection(waiter)
        try:
            rc = self._lib.td_request(self._gpu, conn, waiter.has_activity_page, c_slot, seq,
                                      _nan(burst_hint), _nan(work_end), work_running,
                                      self.clock(), self._out)
        except (TypeError, OverflowError):   # a seq or time cffi cannot pass
            if new:
                self._forget_connection(waiter, conn)
            raise
        if rc < 0:
            if new:
                self._forget_connection(waiter, conn)
            if rc == self._lib.TD_EINVAL:
                raise ValueError(f"this connection already asks through another allocation "
                                 f"than {allocation_id} on GPU {self.uuid}")
            self._check(rc)
        self._deliver(rc)

    def release(self, allocation_id: str, work_end: float | None) -> None:
        c_slot = self._attached.get(allocation_id)
        now = self.clock()
        if c_slot is None:   # the scheduler ignores it; the pages are brought in line anyway
            result = self._lib.td_publish(self._gpu, now, self._out)
        else:
            result = self._lib.td_release(self._gpu, c_slot, _nan(work_end), now, self._out)
        self._deliver(self._check(result))

    def observe_burst(self, allocation_id: str, start: float, end: float) -> None:
        self._check(self._lib.td_observe_burst(self._gpu, self._attached[allocation_id], start,
                                               end, self.clock()))

    def connection_closed(self, waiter: Waiter, allocation_id: str, last: bool) -> None:
        """A connection went away; with the tenant's last one goes the token it held."""
        c_slot = self._attached.get(allocation_id)
        if c_slot is None:
            return
        conn = self._conn_ids.get(waiter, -1)   # -1: it never asked
        result = self._check(self._lib.td_connection_closed(self._gpu, conn, c_slot, last,
                                                            self.clock(), self._out))
        if conn >= 0 and self._lib.td_connection_slot(self._gpu, conn) < 0:
            self._forget_connection(waiter, conn)
        self._deliver(result)

    # ---- what the C code asks of Python ----

    def _deliver(self, result: int) -> None:
        """Send the grants of the last call, log its events, keep a timer for its wakeup.
        `result`: the call's (grants | events << TD_EVENTS_SHIFT)."""
        out = self._out
        if result:
            waiters = self._waiters
            for i in range(result & GRANTS_MASK):
                grant = out.grant[i]
                waiter = waiters[grant.connection]
                assert waiter is not None
                waiter.send_grant(grant.seq, grant.gpu_index, grant.generation,
                                  grant.valid_until_ns)
            for i in range(result >> EVENTS_SHIFT):
                self._log_event(out.event[i])
        wakeup = out.wakeup
        if wakeup < self._armed_at:   # earlier than the timer (none: inf), and not NaN
            self._arm(wakeup)
        debug = log.isEnabledFor(logging.DEBUG)
        if debug is not self._debug:   # the debug lines' events, only while they are logged
            self._debug = debug
            self._lib.td_debug_events(self._gpu, debug)

    def _log_event(self, event: Any) -> None:
        lib = self._lib
        allocation = self._slot_names.get(int(event.slot))
        if event.kind == lib.TD_EVENT_GRANTED:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("token granted", extra={
                    "gpu": self.uuid, "allocation": allocation,
                    "generation": int(event.generation),
                    "quota_ms": round(event.value * 1000, 3)})
        elif event.kind == lib.TD_EVENT_REVOKED:
            log.info("token revoked: not returned in time", extra={
                "gpu": self.uuid, "allocation": allocation, "generation": int(event.generation),
                "overrun_ms": round(event.value * 1000, 3)})
        elif event.kind == lib.TD_EVENT_IDLE_RELEASE:
            log.debug("idle holder releases early", extra={
                "gpu": self.uuid, "allocation": allocation,
                "held_ms": round(event.value * 1000, 3)})
        elif event.kind == lib.TD_EVENT_HOLDER_GONE:
            log.info("token holder gone; passing the token on",
                     extra={"gpu": self.uuid, "allocation": allocation})

    def _arm(self, wakeup: float) -> None:
        """Wake for `wakeup`, never before it. Exact: the timerfd, set to the time itself.
        Otherwise a loop timer, its delay rounded up to whole milliseconds (timer_delay's rule)
        from the loop's own time, which uvloop reads once per iteration (in whole ms), so it is
        behind the clock: a delay from the clock ran up to 0.9 ms early there."""
        self._armed_at = wakeup
        loop = asyncio.get_running_loop()
        if self._exact_timers:
            if self._wakeup_fd < 0:
                fd = self._lib.td_wakeup_create()
                if fd < 0:
                    raise OSError(-fd, f"timerfd_create: {os.strerror(-fd)}")
                self._wakeup_fd = fd
                self._wakeup_loop = loop
                loop.add_reader(fd, self._on_wakeup_fd)
            rc = self._lib.td_wakeup_set(self._wakeup_fd, wakeup)
            if rc < 0:
                raise OSError(-rc, f"timerfd_settime: {os.strerror(-rc)}")
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(timer_delay(wakeup - loop.time()), self._on_timer)

    def _on_wakeup_fd(self) -> None:
        """The timerfd fired: C reads it, runs what is due and sets it again; Python runs on
        only for a grant or an event (an idle check that finds the holder busy has neither)."""
        self._on_wakeup(self._wakeup_fd)

    def _on_timer(self) -> None:
        """The loop timer fired, perhaps a little early: the same C call decides what is due,
        and `_deliver` sets the timer again."""
        self._timer = None
        self._on_wakeup(-1)

    def _on_wakeup(self, fd: int) -> None:
        result = self._lib.td_on_wakeup(self._gpu, fd, self._armed_at, self.clock(), self._out)
        wakeup = self._out.wakeup
        # The timerfd is set to what C says (NaN: disarmed); the loop timer is spent.
        self._armed_at = wakeup if fd >= 0 and wakeup == wakeup else math.inf
        if result or fd < 0:
            self._deliver(self._check(result))

    def on_timer(self, now: float) -> None:
        """The earliest wakeup has come: run what is due (the loop timer, or a test)."""
        self._deliver(self._check(self._lib.td_on_timer(self._gpu, now, self._out)))

    def next_wakeup(self) -> float | None:
        """When the C code wants `on_timer`; None: never."""
        value = float(self._lib.td_next_wakeup(self._gpu))
        return None if math.isnan(value) else value

    def close(self) -> None:
        self._lib.td_close(self._gpu)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wakeup_fd >= 0:
            if self._wakeup_loop is not None and not self._wakeup_loop.is_closed():
                self._wakeup_loop.remove_reader(self._wakeup_fd)
            os.close(self._wakeup_fd)
            self._wakeup_fd = -1
        self._armed_at = math.inf

    # ---- handles ----

    def _c_slot(self, slot: TenantSlot) -> tuple[int, bool]:
        """The C slot of this TenantSlot (its connections kept across remove and add), or a
        new one; (slot, created)."""
        known = self._known.get(id(slot))
        if known is not None and known[0]() is slot:
            return known[1], False
        while self._gone:   # collected TenantSlots: their C slots go now, between calls
            c_slot = self._gone.pop()
            if c_slot in self._detached:
                self._free_slot(c_slot)
        lib = self._lib
        page = ffi.cast("void *", slot.page.address)
        activity = ffi.cast("void *", slot.activity.address)
        rc = lib.td_slot_new(self._gpu, slot.index, page, activity, self._slot_id_out)
        if rc == lib.TD_EFULL and self._detached:
            self._free_slot(self._detached[0])   # the oldest removed slot's waiters forgotten
            rc = lib.td_slot_new(self._gpu, slot.index, page, activity, self._slot_id_out)
        if rc == lib.TD_EFULL:
            raise TokenCapacityError(f"GPU {self.uuid} holds {lib.TD_MAX_SLOTS} allocations "
                                     f"already; cannot add {slot.allocation_id}")
        self._check(rc)
        c_slot = int(self._slot_id_out[0])
        key = id(slot)
        self._known[key] = (weakref.ref(slot, lambda _: self._slot_gone(key, c_slot)), c_slot)
        return c_slot, True

    def _slot_gone(self, key: int, c_slot: int) -> None:
        """A TenantSlot was collected (at any moment, the collector may run inside a call
        here): its C slot is freed at the next add, which is the only one that needs it."""
        self._gone.append(c_slot)

    def _free_slot(self, c_slot: int) -> None:
        """Forget a detached slot and the connections bound to it."""
        bound = [(waiter, conn) for waiter, conn in self._conn_ids.items()
                 if self._lib.td_connection_slot(self._gpu, conn) == c_slot]
        self._check(self._lib.td_slot_free(self._gpu, c_slot))
        if c_slot in self._detached:
            self._detached.remove(c_slot)
        self._slot_names.pop(c_slot, None)
        self._known = {key: value for key, value in self._known.items() if value[1] != c_slot}
        for waiter, conn in bound:
            self._forget_connection(waiter, conn)

    def _new_connection(self, waiter: Waiter) -> int:
        if not self._free_ids:
            raise TokenCapacityError(f"GPU {self.uuid}: {self._lib.TD_MAX_CONNECTIONS} "
                                     "connections ask for its token already")
        conn = self._free_ids.pop()
        self._conn_ids[waiter] = conn
        self._waiters[conn] = waiter
        return conn

    def _forget_connection(self, waiter: Waiter, conn: int) -> None:
        del self._conn_ids[waiter]
        self._waiters[conn] = None
        self._free_ids.append(conn)

    def _check(self, rc: int) -> int:
        """rc, where it is not an error."""
        if rc == self._lib.TD_ENOENT:
            raise KeyError("no such allocation on this GPU")
        if rc < 0:
            raise RuntimeError(f"native token code: error {rc}")
        return rc

    # ---- status ----

    @property
    def grants(self) -> int:
        return int(self._counters().grants)

    @property
    def idle_releases(self) -> int:
        return int(self._counters().idle_releases)

    def _counters(self) -> Any:
        counters = ffi.new("struct td_counters *")
        self._lib.td_counters(self._gpu, counters)
        return counters

    def slot_info(self, allocation_id: str) -> Any:
        self._lib.td_slot_info(self._gpu, self._attached[allocation_id], self._info)
        return self._info

    def snapshot(self) -> dict[str, Any]:
        return gpu_snapshot(self, self._waiting)

    def _waiting(self, allocation_id: str) -> tuple[int, dict[str, Any]]:
        info = self.slot_info(allocation_id)
        waits = WaitHistogram(counts=[int(count) for count in info.wait_counts],
                              total=float(info.wait_sum), count=int(info.wait_count))
        return int(info.connections_waiting), waits.snapshot()
