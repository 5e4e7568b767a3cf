"""The device's utilisation, for co-scheduling's busy fractions.

Co-scheduling (timeshare/policy.py) grants several tenants at once while their busy fractions
leave the GPU room. The figures are the daemon's own, never the hook's: NVML's device
utilisation samples (`nvmlDeviceGetSamples`, NVML_GPU_UTILIZATION_SAMPLES), the part of each
period in which some kernel ran. On the H200 they come every 200 ms and cover exactly the 200 ms
before their timestamp (a square wave of 100 ms of matmuls every 400 ms read 0.31, 0.19, 0.31,
... against 0.32, 0.19, 0.31 of the wave's own time; BENCHMARKS.md, "Real jobs"). The algorithm
solves them for each tenant's busy fraction from who held the GPU alone in each period.
NVML's per-process figure (`nvmlDeviceGetProcessUtilization`) is not used: it credits each
process with the device's activity while it is active (two trainers taking turns each read the
device's 50-54 %).

* Read every `SAMPLE_INTERVAL` in a thread (NVML calls block), only while some GPU has two
  tenants or more and co-scheduling is on.
* Sources: NVML, or simulated (a JSON file the tests write, {GPU UUID: [[end, busy], ...]} with
  `end` on the daemon's monotonic clock in seconds and `busy` a fraction), chosen by the
  `gpu_busy` setting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vgpu_runtime.daemon.config import DaemonConfig

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 0.2   # NVML's own sample period on the H200: reading faster finds nothing new
SAMPLE_PERIOD = 0.2     # the time one sample covers, ending at its timestamp


class GpuBusyError(Exception):
    """The figures could not be read (NVML failed, a malformed simulated file)."""


@dataclass(frozen=True)
class BusySample:
    end: float        # the period's end, on the daemon's monotonic clock (seconds)
    busy: float       # the part of the period some kernel ran


class GpuBusySource(Protocol):
    name: str

    def read(self, uuids: Collection[str]) -> dict[str, list[BusySample]]:
        """Blocking: the samples newer than the last read, per GPU; GpuBusyError."""
        ...


class NvmlGpuBusy:
    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as err:
            raise GpuBusyError(f"pynvml is not installed: {err}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise GpuBusyError(f"NVML unavailable: {err}") from None
        self._nvml: Any = pynvml
        self._handles: dict[str, Any] = {}
        self._last_seen: dict[str, int] = {}

    def read(self, uuids: Collection[str]) -> dict[str, list[BusySample]]:
        nvml = self._nvml
        # NVML stamps samples in microseconds of the wall clock; the scheduler's clock is
        # CLOCK_MONOTONIC.
        offset = time.time() - time.monotonic()
        found: dict[str, list[BusySample]] = {}
        for uuid in uuids:
            try:
                handle = self._handles.get(uuid)
                if handle is None:
                    handle = self._handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
                _, samples = nvml.nvmlDeviceGetSamples(
                    handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._last_seen.get(uuid, 0))
            except nvml.NVMLError_NotFound:
                continue   # no sample since the last (or not a GPU of this machine)
            except nvml.NVMLError as err:
                raise GpuBusyError(f"NVML on {uuid}: {err}") from None
            last = self._last_seen.get(uuid, 0)
            fresh = [s for s in samples if s.timeStamp > last]
            if fresh:
                self._last_seen[uuid] = max(s.timeStamp for s in fresh)
            found[uuid] = [BusySample(s.timeStamp / 1e6 - offset,
                                      min(100, max(0, int(s.sampleValue.uiVal))) / 100)
                           for s in fresh]
        return found


class SimulatedGpuBusy:
    """Samples from a JSON file, {GPU UUID: [[end, busy], ...]}, those newer than the last
    read. No file: none; a malformed one: GpuBusyError naming what is wrong."""

    name = "simulated"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._last_seen: dict[str, float] = {}

    def read(self, uuids: Collection[str]) -> dict[str, list[BusySample]]:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise GpuBusyError(f"{self.path}: {err.strerror}") from None
        except ValueError as err:
            raise GpuBusyError(f"{self.path} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise GpuBusyError(f"{self.path} must map GPU UUIDs to [[end, busy], ...]")
        found: dict[str, list[BusySample]] = {}
        for uuid, rows in data.items():
            if uuid not in uuids:
                continue
            try:
                samples = [BusySample(float(end), float(busy)) for end, busy in rows]
            except (TypeError, ValueError):
                raise GpuBusyError(f"{self.path}: {uuid} must hold [end, busy] rows of "
                                   "numbers") from None
            if any(not 0 <= s.busy <= 1 for s in samples):
                raise GpuBusyError(f"{self.path}: {uuid} holds a busy fraction outside "
                                   "[0, 1]")
            last = self._last_seen.get(uuid, float("-inf"))
            fresh = [s for s in samples if s.end > last]
            if fresh:
                self._last_seen[uuid] = max(s.end for s in fresh)
            found[uuid] = fresh
        return found


def open_source(config: DaemonConfig) -> GpuBusySource | None:
    """The configured source, or None (logged: tenants then take exclusive turns). Blocking."""
    choice = config.gpu_busy
    if choice == "off" or not config.co_schedule:
        return None
    if choice == "simulated":
        assert config.gpu_busy_file is not None   # config.check() requires it
        return SimulatedGpuBusy(config.gpu_busy_file)
    try:
        return NvmlGpuBusy()
    except GpuBusyError as err:
        level = logging.ERROR if choice == "nvml" else logging.INFO
        log.log(level, "no device utilisation; tenants take exclusive turns",
                extra={"gpu_busy": choice, "error": str(err)})
        return None


class SampledGpu(Protocol):
    """One GPU's token as the sampler sees it (tokens.GpuTokens)."""

    @property
    def slots(self) -> Mapping[str, object]: ...

    def observe_utilization(self, samples: list[BusySample]) -> None: ...


class SampledGpus(Protocol):
    """Every GPU's token (tokens.TokenService)."""

    @property
    def config(self) -> DaemonConfig: ...

    @property
    def gpus(self) -> Mapping[str, SampledGpu]: ...


class BusySampler:
    """Reads the figures every SAMPLE_INTERVAL while a GPU has two tenants or more, and gives
    each GPU's token its tenants' samples."""

    def __init__(self, service: SampledGpus) -> None:
        self.service = service
        self.source: GpuBusySource | None = None
        self.opened = False
        self.error: str | None = None
        self.readings = 0
        self._task: asyncio.Task[None] | None = None

    def wake(self) -> None:
        """A tenant joined a GPU: sample while any GPU is shared (from the daemon's loop)."""
        if self._task is None and (self.source is not None or not self.opened):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return   # driven without a loop (tests of the token alone): nothing samples
            self._task = loop.create_task(self._run())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _shared_gpus(self) -> list[str]:
        return [uuid for uuid, gpu in self.service.gpus.items() if len(gpu.slots) > 1]

    async def _run(self) -> None:
        try:
            if not self.opened:
                self.source = await asyncio.to_thread(open_source, self.service.config)
                self.opened = True
            while self.source is not None and (uuids := self._shared_gpus()):
                await self._reading(self.source, uuids)
                await asyncio.sleep(SAMPLE_INTERVAL)
        finally:
            self._task = None

    async def _reading(self, source: GpuBusySource, uuids: list[str]) -> None:
        try:
            found = await asyncio.to_thread(source.read, uuids)
            if self.error is not None:
                log.info("device utilisation readable again", extra={"source": source.name})
            self.error = None
        except GpuBusyError as err:
            if self.error != str(err):
                log.warning("cannot read the device utilisation; tenants take exclusive turns "
                            "until it can be", extra={"source": source.name, "error": str(err)})
            self.error = str(err)
            return
        self.readings += 1
        for uuid, samples in found.items():
            gpu = self.service.gpus.get(uuid)
            if gpu is not None and samples:
                gpu.observe_utilization(samples)
