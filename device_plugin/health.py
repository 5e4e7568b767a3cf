"""GPU health: critical XIDs make a GPU Unhealthy; a documented rule makes it Healthy again.

What marks a GPU Unhealthy:
- a critical XID event on it (any XID not in `ignored_xids`, by default 13, 31, 43, 45, 68
  and 109, which are application faults, not GPU faults). An event that names no device marks
  every GPU Unhealthy;
- a failed probe (the GPU no longer answers NVML: no handle by UUID, or memory info unreadable).
Every slice of an Unhealthy GPU is reported Unhealthy to kubelet.

Recovery rule (unlike NVIDIA's plugin, which needs a restart): an Unhealthy GPU is probed again
every `health_recheck_interval` seconds. It becomes Healthy again when
  1. its probe succeeds (NVML finds it by UUID and reads its memory info), and
  2. no critical XID has been seen on it for `recovery_quiet_period` seconds.
A critical XID during recovery starts the quiet period again. Containers already running on a
GPU are not disturbed by its health; kubelet only stops placing new ones there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Listener = Callable[[], None]


@dataclass
class GpuHealth:
    healthy: bool = True
    reason: str = ""
    last_critical_xid: float | None = None   # clock time of the last critical XID


class HealthTracker:
    """The health state machine. Pure: time comes from `clock`, probes are passed in."""

    def __init__(self, uuids: Iterable[str], ignored_xids: Iterable[int],
                 quiet_period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._gpus = {uuid: GpuHealth() for uuid in uuids}
        self.ignored_xids = frozenset(ignored_xids)
        self.quiet_period = quiet_period
        self.clock = clock
        self._listeners: list[Listener] = []

    def on_change(self, listener: Listener) -> None:
        """Call `listener` after every change of any GPU's health."""
        self._listeners.append(listener)

    def is_healthy(self, uuid: str) -> bool:
        state = self._gpus.get(uuid)
        return state is not None and state.healthy

    def all_uuids(self) -> list[str]:
        return list(self._gpus)

    def state(self, uuid: str) -> GpuHealth:
        return self._gpus[uuid]

    def unhealthy(self) -> dict[str, str]:
        return {u: s.reason for u, s in self._gpus.items() if not s.healthy}

    def xid(self, uuid: str | None, code: int) -> bool:
        """An XID event; uuid None means "no device / all devices". True if health changed."""
        if code in self.ignored_xids:
            log.info("ignoring benign XID", extra={"xid": code, "uuid": uuid or "all"})
            return False
        targets = list(self._gpus) if uuid is None else [uuid]
        if uuid is not None and uuid not in self._gpus:
            log.warning("XID on a GPU this plugin does not serve", extra={"xid": code,
                                                                         "uuid": uuid})
            return False
        now = self.clock()
        changed = False
        for target in targets:
            state = self._gpus[target]
            state.last_critical_xid = now
            if state.healthy:
                state.healthy, state.reason = False, f"critical XID {code}"
                changed = True
                log.warning("GPU unhealthy", extra={"uuid": target, "xid": code})
        if changed:
            self._notify()
        return changed

    def recheck(self, probe: Callable[[str], bool]) -> bool:
        """Probe every GPU and apply the recovery rule. True if any health changed."""
        now = self.clock()
        changed = False
        for uuid, state in self._gpus.items():
            usable = probe(uuid)
            if state.healthy and not usable:
                state.healthy, state.reason = False, "probe failed: GPU does not answer NVML"
                changed = True
                log.warning("GPU unhealthy", extra={"uuid": uuid, "reason": state.reason})
            elif not state.healthy and usable and self._quiet(state, now):
                state.healthy, state.reason = True, ""
                changed = True
                log.info("GPU healthy again", extra={"uuid": uuid})
        if changed:
            self._notify()
        return changed

    def _quiet(self, state: GpuHealth, now: float) -> bool:
        last = state.last_critical_xid
        return last is None or now - last >= self.quiet_period

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()
