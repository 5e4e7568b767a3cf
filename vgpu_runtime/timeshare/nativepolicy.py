"""The native token scheduler (native/timeshare.h) behind TokenScheduler's Python API.

`NativeTokenScheduler` decides exactly as `policy.TokenScheduler` does (the same rules, the
same doubles: tests/timeshare/test_native_equal.py checks it step by step); tenants are strings
here as there, mapped to the library's small integer handles. The library is read through cffi
in ABI mode: the declarations come from timeshare.h between TS_CDEF_BEGIN and TS_CDEF_END,
never written a second time. It is the installed copy in vgpu_runtime/lib/ or, in a source
tree, one built on demand into the per-user cache (as vgpu_runtime.hooklib does for the hook).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import cffi

from vgpu_runtime.timeshare.native import build
from vgpu_runtime.timeshare.policy import Grant, TenantView, TimeshareSettings

HEADER_PATH = Path(build.NATIVE_DIR) / "timeshare.h"
PACKAGE_LIB_DIR = build.PACKAGE_DIR / "lib"


def _cdef_text() -> str:
    text = HEADER_PATH.read_text()
    begin, end = "/* TS_CDEF_BEGIN */", "/* TS_CDEF_END */"
    return text[text.index(begin) + len(begin):text.index(end)].replace("TS_API ", "")


ffi = cffi.FFI()
ffi.cdef(_cdef_text())
_lib: Any = None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemini-vgpu" / "timeshare"


def library_path(rebuild: bool = False) -> Path:
    """The installed library, or one built (gcc) into the per-user cache."""
    name = build.library_name()
    installed = PACKAGE_LIB_DIR / name
    if installed.is_file() and not rebuild:
        return installed
    target = cache_root() / build.sources_digest() / name
    if target.is_file() and not rebuild:
        return target
    return build.build_library(target.parent)


def library() -> Any:
    """The loaded library (loaded once per process)."""
    global _lib
    if _lib is None:
        _lib = ffi.dlopen(str(library_path()))
    return _lib


def _none(value: float) -> float | None:
    return None if math.isnan(value) else value


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


class NativeUsage:
    """A tenant's window, as `UsageWindow.usage` reads it."""

    def __init__(self, owner: NativeTokenScheduler, handle: int) -> None:
        self._owner = owner
        self._handle = handle

    def usage(self, now: float, ongoing_since: float | None = None) -> float:
        value: float = self._owner._lib.ts_tenant_usage(self._owner._ptr, self._handle, now,
                                                        _nan(ongoing_since))
        return value


class NativeTenant:
    """One tenant, read live from the library (policy.Tenant's fields)."""

    def __init__(self, owner: NativeTokenScheduler, name: str, handle: int) -> None:
        self._owner = owner
        self.id = name
        self.handle = handle
        self.usage = NativeUsage(owner, handle)

    def _state(self) -> Any:
        return self._owner._state(self.handle)

    @property
    def share(self) -> float:
        return float(self._state().share)

    @property
    def limit(self) -> float:
        return float(self._state().limit)

    @property
    def vtime(self) -> float:
        return float(self._state().vtime)

    @property
    def credit(self) -> float:
        return float(self._state().credit)

    @property
    def credit_at(self) -> float:
        return float(self._state().credit_at)

    @property
    def waiting_since(self) -> float | None:
        return _none(self._state().waiting_since)

    @property
    def burst_hint(self) -> float | None:
        return _none(self._state().burst_hint)

    @property
    def last_release(self) -> float | None:
        return _none(self._state().last_release)

    @property
    def last_quota(self) -> float | None:
        return _none(self._state().last_quota)

    @property
    def revocations(self) -> int:
        return int(self._state().revocations)

    @property
    def waits(self) -> list[float]:
        """The token waits kept, oldest first."""
        return self._owner._waits(self.handle)


class NativeTokenScheduler:
    """TokenScheduler's API over the C library; one instance owns one C scheduler."""

    def __init__(self, config: TimeshareSettings, now: float) -> None:
        self._lib = library()
        self.config = config
        self.started = now
        settings = ffi.new("struct ts_settings *", {
            "window": config.window, "min_quota": config.min_quota,
            "max_quota": config.max_quota, "cycle": config.cycle,
            "catch_up": config.catch_up, "revoke_grace": config.revoke_grace,
            "preempt_after": config.preempt_after, "burst_merge_gap": config.burst_merge_gap,
            "burst_history": config.burst_history})
        pointer = self._lib.ts_create(settings, now)
        if pointer == ffi.NULL:
            raise MemoryError("the native token scheduler could not be allocated")
        self._ptr = ffi.gc(pointer, self._lib.ts_destroy)
        self._handles: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._tenants: dict[str, NativeTenant] = {}
        self._grant = ffi.new("struct ts_grant *")
        self._handle_out = ffi.new("int32_t *")

    # ---- membership ----

    def add(self, tenant: str, share: float, limit: float, now: float) -> Grant | None:
        if tenant in self._handles:
            raise ValueError(f"tenant {tenant} is already scheduled on this GPU")
        rc = self._lib.ts_add(self._ptr, share, limit, now, self._handle_out, self._grant)
        if rc == self._lib.TS_EINVAL:
            raise ValueError(f"need 0 < share <= limit <= 1, got {share}, {limit}")
        if rc == self._lib.TS_ENOMEM:
            raise MemoryError(f"no memory for tenant {tenant}'s histories")
        if rc == self._lib.TS_EFULL:
            raise ValueError(f"at most {self._lib.TS_MAX_TENANTS} tenants on one GPU: "
                             f"cannot add {tenant}")
        handle = int(self._handle_out[0])
        self._handles[tenant] = handle
        self._names[handle] = tenant
        self._tenants[tenant] = NativeTenant(self, tenant, handle)
        return self._result(rc)

    def remove(self, tenant: str, now: float) -> Grant | None:
        handle = self._handles.pop(tenant, -1)
        self._names.pop(handle, None)
        self._tenants.pop(tenant, None)
        return self._result(self._lib.ts_remove(self._ptr, handle, now, self._grant))

    def set_limit(self, tenant: str, limit: float, now: float) -> Grant | None:
        rc = self._lib.ts_set_limit(self._ptr, self._handle(tenant), limit, now, self._grant)
        if rc == self._lib.TS_EINVAL:
            raise ValueError(f"need 0 < limit <= 1, got {limit}")
        return self._result(rc)

    def needs_token(self) -> bool:
        return bool(self._lib.ts_needs_token(self._ptr))

    # ---- the token ----

    def request(self, tenant: str, now: float, burst_hint: float | None = None,
                work_end: float | None = None, work_running: bool = False,
                work_since: float | None = None) -> Grant | None:
        return self._result(self._lib.ts_request(
            self._ptr, self._handle(tenant), now, _nan(burst_hint), _nan(work_end),
            work_running, _nan(work_since), self._grant))

    def release(self, tenant: str, now: float, work_end: float | None = None) -> Grant | None:
        handle = self._handles.get(tenant)
        if handle is None:
            return None
        return self._result(self._lib.ts_release(self._ptr, handle, now, _nan(work_end),
                                                  self._grant))

    def observe_burst(self, tenant: str, start: float, end: float) -> None:
        self._lib.ts_observe_burst(self._ptr, self._handle(tenant), start, end)

    def tick(self, now: float) -> Grant | None:
        return self._result(self._lib.ts_tick(self._ptr, now, self._grant))

    def next_deadline(self, now: float) -> float | None:
        return _none(self._lib.ts_next_deadline(self._ptr, now))

    # ---- views ----

    @property
    def holder(self) -> Grant | None:
        grant = ffi.new("struct ts_grant *")
        if not self._lib.ts_holder(self._ptr, grant):
            return None
        return self._grant_of(grant)

    @property
    def generation(self) -> int:
        return int(self._lib.ts_generation(self._ptr))

    @property
    def preemptions(self) -> int:
        return int(self._lib.ts_preemptions(self._ptr))

    @property
    def tenants(self) -> Mapping[str, NativeTenant]:
        """Every tenant's state as of now, in the order they were added."""
        return {name: self._tenants[name] for name, _ in self._ordered()}

    def shares(self) -> dict[str, float]:
        return {name: float(self._state(handle).effective_share)
                for name, handle in self._ordered()}

    def used(self, tenant: str, now: float) -> float:
        value: float = self._lib.ts_used(self._ptr, self._handle(tenant), now)
        return value

    def snapshot(self, now: float) -> list[TenantView]:
        views = []
        view = ffi.new("struct ts_tenant_view *")
        for name, handle in self._ordered():
            self._lib.ts_tenant_view(self._ptr, handle, now, view)
            views.append(TenantView(
                name, view.share, view.limit, view.used, bool(view.waiting), bool(view.holder),
                _none(view.wait_p50), _none(view.wait_p99), int(view.revocations),
                _none(view.burst), _none(view.last_quota)))
        return views

    def _has_credit(self, tenant: NativeTenant, now: float) -> bool:
        return bool(self._lib.ts_has_credit(self._ptr, tenant.handle, now) == 1)

    # ---- internals ----

    def _handle(self, tenant: str) -> int:
        handle = self._handles.get(tenant)
        if handle is None:
            raise KeyError(tenant)
        return handle

    def _ordered(self) -> Iterator[tuple[str, int]]:
        handles = ffi.new("int32_t[]", self._lib.TS_MAX_TENANTS)
        count = self._lib.ts_tenants(self._ptr, handles, self._lib.TS_MAX_TENANTS)
        for i in range(count):
            yield self._names[handles[i]], int(handles[i])

    def _state(self, handle: int) -> Any:
        state = ffi.new("struct ts_tenant_state *")
        self._lib.ts_tenant_state(self._ptr, handle, state)
        return state

    def _waits(self, handle: int) -> list[float]:
        waits = ffi.new("double[]", self._lib.TS_WAITS_KEPT)
        count = self._lib.ts_tenant_waits(self._ptr, handle, waits, self._lib.TS_WAITS_KEPT)
        return list(waits[0:count])

    def _grant_of(self, grant: Any) -> Grant:
        return Grant(self._names[int(grant.tenant)], int(grant.generation), grant.granted_at,
                     grant.quota)

    def _result(self, rc: int) -> Grant | None:
        if rc == self._lib.TS_GRANTED:
            return self._grant_of(self._grant)
        if rc == self._lib.TS_ENOENT:
            raise KeyError("unknown tenant")
        return None
