"""What feeds the health state machine: NVML XID events, periodic probes, simulated events.

Simulated events are JSON files dropped into the control directory and consumed in name order:
  {"gpu": <index>, "xid": <code>}        an XID on that GPU (no "gpu" key: all GPUs)
  {"gpu": <index>, "usable": false|true} make that GPU's probe fail or succeed
Each file is deleted once applied. A malformed file is renamed to <name>.rejected, with a log
line saying why, so nothing dropped there is lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_plugin.health import HealthTracker
from vgpu_runtime.gpus import Backend, GpuInfo
from vgpu_runtime.gpus.simulated import SimulatedBackend

log = logging.getLogger(__name__)

CONTROL_POLL_INTERVAL = 0.02  # an os.listdir every 20 ms is cheap; keeps updates prompt


async def recheck_forever(tracker: HealthTracker, backend: Backend, interval: float) -> None:
    """Probe every GPU every `interval` seconds (probes may block: run them in a thread)."""
    while True:
        await asyncio.sleep(interval)
        results = await asyncio.to_thread(
            lambda: {uuid: backend.probe(uuid) for uuid in tracker.all_uuids()})
        tracker.recheck(results.__getitem__)


class ControlError(ValueError):
    pass


def parse_event(data: Any, gpus: list[GpuInfo]) -> tuple[str | None, dict[str, Any]]:
    """Check one control event; returns the GPU UUID (None = all) and the event."""
    if not isinstance(data, dict):
        raise ControlError("an event must be a JSON object")
    unknown = set(data) - {"gpu", "xid", "usable"}
    if unknown:
        raise ControlError(f"unknown key(s) {', '.join(sorted(unknown))}")
    if ("xid" in data) == ("usable" in data):
        raise ControlError('an event needs exactly one of "xid" or "usable"')
    uuid: str | None = None
    if "gpu" in data:
        index = data["gpu"]
        matches = [g.uuid for g in gpus if g.index == index and not isinstance(index, bool)]
        if not matches:
            raise ControlError(f"no simulated GPU with index {index!r}")
        uuid = matches[0]
    elif "usable" in data:
        raise ControlError('a "usable" event needs "gpu"')
    if "xid" in data and (isinstance(data["xid"], bool) or not isinstance(data["xid"], int)):
        raise ControlError(f'"xid" must be an integer, got {data["xid"]!r}')
    if "usable" in data and not isinstance(data["usable"], bool):
        raise ControlError(f'"usable" must be true or false, got {data["usable"]!r}')
    return uuid, data


class SimulatedControl:
    """Polls the control directory and applies its events to the simulated GPUs."""

    def __init__(self, directory: Path, backend: SimulatedBackend, tracker: HealthTracker) -> None:
        self.directory = directory
        self.backend = backend
        self.tracker = tracker

    def poll_once(self) -> int:
        """Apply every pending event file; returns how many were applied."""
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".json"))
        except FileNotFoundError:
            return 0
        applied = 0
        for name in names:
            path = self.directory / name
            try:
                uuid, event = parse_event(json.loads(path.read_bytes()), self.backend.gpus)
            except FileNotFoundError:
                continue
            except (ControlError, ValueError) as err:
                log.error("rejected simulated health event", extra={"file": str(path),
                                                                    "reason": str(err)})
                with contextlib.suppress(OSError):
                    path.rename(path.with_name(name + ".rejected"))
                continue
            self._apply(uuid, event)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            applied += 1
        return applied

    def _apply(self, uuid: str | None, event: dict[str, Any]) -> None:
        log.info("simulated health event", extra={"uuid": uuid or "all", "event": event})
        if "xid" in event:
            self.tracker.xid(uuid, int(event["xid"]))
        else:
            assert uuid is not None
            self.backend.usable[uuid] = bool(event["usable"])
            # Apply a probe change at once rather than at the next periodic recheck.
            self.tracker.recheck(self.backend.probe)

    async def run(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            self.poll_once()
            await asyncio.sleep(CONTROL_POLL_INTERVAL)


class NvmlXidWatcher:
    """A thread waiting on NVML XID events; each is handed to the event loop."""

    WAIT_MS = 1000

    def __init__(self, nvml: Any, gpus: list[GpuInfo],
                 deliver: Callable[[str | None, int], None]) -> None:
        self.nvml = nvml
        self.gpus = gpus
        self.deliver = deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self._events: Any = None

    def start(self) -> None:
        nvml = self.nvml
        self._events = nvml.nvmlEventSetCreate()
        for gpu in self.gpus:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                              self._events)
            except nvml.NVMLError as err:
                # Some GPUs (or vGPU guests) do not support events: health then rests on probes.
                log.warning("XID events unavailable for GPU; relying on probes",
                            extra={"uuid": gpu.uuid, "error": str(err)})
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.WAIT_MS / 1000)
        if self._events is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlEventSetFree(self._events)

    def _uuid_of(self, handle: Any) -> str | None:
        if handle is None:
            return None
        try:
            value = self.nvml.nvmlDeviceGetUUID(handle)
        except self.nvml.NVMLError:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def _run(self) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait(self._events, self.WAIT_MS)
            except nvml.NVMLError as err:
                if getattr(err, "value", None) == nvml.NVML_ERROR_TIMEOUT:
                    continue
                # An unknown failure of the event set: treat it as a fault on every GPU.
                log.error("NVML event wait failed; marking all GPUs unhealthy",
                          extra={"error": str(err)})
                self.deliver(None, -1)
                self._stop.wait(self.WAIT_MS / 1000)
                continue
            if data.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            self.deliver(self._uuid_of(data.device), int(data.eventData))
