"""The NVML XID watcher thread, driven by a scripted stand-in for pynvml (no GPU here).

The real NVML path runs in test_nvml_gpu.py on a GPU machine; this checks the thread's own
logic: timeouts are waited out, events are mapped to GPUs, a device-less event means all GPUs,
non-XID events are skipped, and stop() ends the thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from device_plugin.health_events import NvmlXidWatcher
from vgpu_runtime.gpus.simulated import SimulatedBackend


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class EventData:
    device: Any
    eventType: int
    eventData: int


class ScriptedNvml:
    NVMLError = NVMLError
    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, uuids: list[str], script: list[Any]) -> None:
        self.uuids = uuids
        self.script = list(script)
        self.registered: list[str] = []
        self.freed = False

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> str:
        return "h:" + uuid.decode()

    def nvmlDeviceRegisterEvents(self, handle: str, kind: int, events: str) -> None:
        if handle.endswith(self.uuids[-1]):
            raise NVMLError(3)  # NOT_SUPPORTED on the last GPU
        self.registered.append(handle[2:])

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return handle[2:].encode()

    def nvmlEventSetWait(self, events: str, timeout_ms: int) -> EventData:
        if not self.script:
            time.sleep(timeout_ms / 1000 / 50)
            raise NVMLError(self.NVML_ERROR_TIMEOUT)
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item  # type: ignore[no-any-return]

    def nvmlEventSetFree(self, events: str) -> None:
        self.freed = True


def test_watcher_delivers_xids_per_gpu_and_all() -> None:
    uuids = [g.uuid for g in SimulatedBackend(2).gpus]
    nvml = ScriptedNvml(uuids, [
        NVMLError(ScriptedNvml.NVML_ERROR_TIMEOUT),
        EventData("h:" + uuids[0], 8, 79),
        EventData("h:" + uuids[1], 1, 5),      # not an XID event: skipped
        EventData(None, 8, 48),                # no device: all GPUs
    ])
    seen: list[tuple[str | None, int]] = []
    done = threading.Event()

    def deliver(uuid: str | None, xid: int) -> None:
        seen.append((uuid, xid))
        if len(seen) == 2:
            done.set()

    watcher = NvmlXidWatcher(nvml, SimulatedBackend(2).gpus, deliver)
    watcher.start()
    assert done.wait(5)
    watcher.stop()
    assert seen == [(uuids[0], 79), (None, 48)]
    assert nvml.registered == [uuids[0]]  # the unsupported GPU is left to probes
    assert nvml.freed and not watcher._thread.is_alive()


def test_broken_event_set_marks_all_gpus() -> None:
    uuids = [g.uuid for g in SimulatedBackend(1).gpus]
    nvml = ScriptedNvml([*uuids, "GPU-other"], [NVMLError(999)])
    seen: list[tuple[str | None, int]] = []
    watcher = NvmlXidWatcher(nvml, SimulatedBackend(1).gpus, lambda u, x: seen.append((u, x)))
    watcher.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()
    assert seen[:1] == [(None, -1)]
