"""The context charge from per-process GPU memory figures (NVML), where the daemon can see them.

A context's cost is hard to measure from inside the process: the hook reads the device's free
memory before and after creating it, and other processes allocating in between skew that (it
caps one context at 1 GiB for this reason). NVML knows better: `usedGpuMemory` of
`nvmlDeviceGetComputeRunningProcesses` is what a process holds on a GPU, context included.

The rule, per connection and GPU of its allocation:

    context charge = max(0, figure(pid) - what the connection declared of every other kind)

* `pid` is the connection's SO_PEERCRED pid, never what the client says. NVML reports pids of
  the host's pid namespace; SO_PEERCRED reports them in the daemon's. They are the same only
  when the daemon runs in the host's pid namespace (hostPID in the DaemonSet, or on the host as
  gemini-run starts it), so `auto` uses NVML only there. A peer the daemon's namespace cannot
  see has pid 0, which never matches.
* The figure is read every `process_memory_interval` (1 s) in a thread (NVML calls block), and
  the charge is fixed at each reading until the next: a connection that allocates in between
  is not charged twice, because the figure lagging behind its declarations only lowers the
  charge until the next reading (hence the max(0, ...)).
* Only where NVML has a figure for that pid on that GPU. Where it has none (no NVML, another
  pid namespace, the process not on NVML's list, usedGpuMemory not available, a failed call),
  the hook's measured MEM_SET of kind context stands; a reading that fails withdraws every
  figure, so a stale one never lingers.
* One connection per (pid, GPU) is charged: the newest, should a process ever hold two (a
  reconnect racing the old connection's close). Figures follow connections, so a daemon
  restart starts from nothing and charges each process once when it reconnects.
* Never refused (like the hook's context kind): the memory exists already. It counts toward
  the container's use, so the memory reported (cuMemGetInfo, NVML inside the container) and
  later reservations see it. It goes with the connection.

The figures come from a `ProcessMemorySource`: NVML (pynvml) or simulated (a JSON file the
tests write, {GPU UUID: {pid: bytes}}), chosen by the `process_memory` setting.

Readings go on while any allocation is served, connected or not: after the connections are
charged, reconcile.py charges the processes no connection speaks for and judges each allocation
against its limit (NVML reconciliation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import weakref
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

from vgpu_runtime.daemon.channel.reconcile import UNHOOKED_GRACE, Reconciled, Reconciler
from vgpu_runtime.daemon.config import DaemonConfig

log = logging.getLogger(__name__)

# A GPU's figures: pid -> bytes; a reading: GPU UUID -> figures, only for GPUs it could read.
Figures = dict[str, dict[int, int]]

# The kernel's inode number of the initial pid namespace (PROC_PID_INIT_INO), fixed since 3.8.
INITIAL_PID_NAMESPACE_INODE = 0xEFFFFFFC


class ProcessMemoryError(Exception):
    """The figures cannot be read now; every figure is withdrawn until they can."""


class ProcessMemorySource(Protocol):
    name: str

    def read(self, uuids: Collection[str]) -> Figures:
        """Blocking: per-process use on these GPUs; raises ProcessMemoryError."""
        ...


class NvmlProcessMemory:
    """NVML's per-process figures. `nvml` is the pynvml module (a test may pass another)."""

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml
            except ImportError as err:
                raise ProcessMemoryError(f"pynvml is not installed: {err}") from None
            nvml = pynvml
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as err:
            raise ProcessMemoryError(f"NVML unavailable: {err}") from None
        self._handles: dict[str, Any] = {}

    def read(self, uuids: Collection[str]) -> Figures:
        nvml = self._nvml
        figures: Figures = {}
        for uuid in uuids:
            try:
                handle = self._handles.get(uuid)
                if handle is None:
                    handle = self._handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
                processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError_NotFound:
                continue   # not a GPU of this machine (simulated allocations): no figures
            except nvml.NVMLError as err:
                raise ProcessMemoryError(f"NVML on {uuid}: {err}") from None
            per_pid: dict[int, int] = {}
            for process in processes:
                used = process.usedGpuMemory   # None: not available (permissions, WDDM)
                if isinstance(used, int) and used >= 0:
                    pid = int(process.pid)
                    per_pid[pid] = per_pid.get(pid, 0) + used
            figures[uuid] = per_pid
        return figures


class SimulatedProcessMemory:
    """Figures from a JSON file, {GPU UUID: {pid: bytes}}, read at every reading. No file: no
    figures; a malformed one: ProcessMemoryError naming what is wrong."""

    name = "simulated"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self, uuids: Collection[str]) -> Figures:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise ProcessMemoryError(f"{self.path}: {err.strerror}") from None
        except ValueError as err:
            raise ProcessMemoryError(f"{self.path} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ProcessMemoryError(f"{self.path} must map GPU UUIDs to {{pid: bytes}}")
        figures: Figures = {}
        for uuid, per_pid in data.items():
            if not isinstance(per_pid, dict):
                raise ProcessMemoryError(f"{self.path}: {uuid} must map pids to bytes")
            try:
                parsed = {int(pid): int(used) for pid, used in per_pid.items()}
            except (TypeError, ValueError):
                raise ProcessMemoryError(f"{self.path}: {uuid} holds a pid or a byte count "
                                         "that is not an integer") from None
            if any(pid <= 0 or used < 0 for pid, used in parsed.items()):
                raise ProcessMemoryError(f"{self.path}: {uuid} holds a pid <= 0 or a negative "
                                         "byte count")
            if uuid in uuids:
                figures[uuid] = parsed
        return figures


def in_initial_pid_namespace() -> bool:
    """True where SO_PEERCRED pids are the host's, as NVML reports them."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INITIAL_PID_NAMESPACE_INODE
    except OSError:
        return False


def open_source(config: DaemonConfig) -> ProcessMemorySource | None:
    """The configured source, or None (logged: why the hook's measurements stand). Blocking."""
    choice = config.process_memory
    if choice == "off":
        return None
    if choice == "simulated":
        assert config.process_memory_file is not None   # config.check() requires it
        return SimulatedProcessMemory(config.process_memory_file)
    if choice == "auto" and not in_initial_pid_namespace():
        log.info("not in the host's pid namespace: NVML's pids are not this daemon's; "
                 "contexts are charged as the hook measures them", extra={"process_memory": choice})
        return None
    try:
        return NvmlProcessMemory()
    except ProcessMemoryError as err:
        level = logging.ERROR if choice == "nvml" else logging.INFO
        log.log(level, "no per-process figures; contexts are charged as the hook measures them",
                extra={"process_memory": choice, "error": str(err)})
        return None


class Charged(Protocol):
    """A connection as the charger sees it (session.Session)."""

    @property
    def peer_pid(self) -> int: ...

    @property
    def connected_at(self) -> float: ...

    def gpu_uuids(self) -> list[str]: ...

    def charge_process_memory(self, source: str, totals: list[int | None]) -> None:
        """One reading for this connection: per GPU index, its process's figure or None."""
        ...


class ContextCharger:
    """Reads the figures every interval while an allocation is served or a connection is live,
    charges each connection, then reconciles (reconcile.py)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.source: ProcessMemorySource | None = None
        self.opened = False
        self.error: str | None = None
        self.readings = 0
        self.reconciler = Reconciler(config.over_limit_action, mps=config.mps)
        self._connections: set[Charged] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def register(self, connection: Charged) -> None:
        """From hello: charge it from the next reading, which comes at once."""
        self._connections.add(connection)
        self._wake.set()
        self._start()

    def add_channel(self, channel: Reconciled) -> None:
        """A served allocation: reconciled from the next reading on."""
        self.reconciler.add(channel)
        self._wake.set()
        self._start()

    def remove_channel(self, channel: Reconciled) -> None:
        self.reconciler.remove(channel)

    def _start(self) -> None:
        if self._task is None and (self.source is not None or not self.opened):
            self._task = asyncio.get_running_loop().create_task(self._run())

    def unregister(self, connection: Charged) -> None:
        """The connection closed: a reading still in flight will not touch it."""
        self._connections.discard(connection)
        if not self._connections:
            self._wake.set()

    async def _run(self) -> None:
        try:
            if not self.opened:
                self.source = await asyncio.to_thread(open_source, self.config)
                self.opened = True
                if self.source is not None:
                    self._check_attribution(self.source)
            while (self._connections or self.reconciler.channels) and self.source is not None:
                self._wake.clear()
                soon = await self._reading(self.source)
                interval = self.config.process_memory_interval
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(),
                                           min(interval, UNHOOKED_GRACE) if soon else interval)
        finally:
            self._task = None

    def _check_attribution(self, source: ProcessMemorySource) -> None:
        """Processes without a connection are found by their host pid in /proc: only where
        this daemon's pids are NVML's (simulated figures are the tests', on their host)."""
        self.reconciler.attribute = source.name == "simulated" or in_initial_pid_namespace()
        if not self.reconciler.attribute:
            log.warning("not in the host's pid namespace: processes that never connect are not "
                        "found (hostPID)", extra={"source": source.name})

    async def _reading(self, source: ProcessMemorySource) -> bool:
        """One reading, charged and reconciled; True when the next should come soon."""
        uuids = {uuid for connection in self._connections for uuid in connection.gpu_uuids()}
        uuids |= self.reconciler.uuids()
        try:
            figures = await asyncio.to_thread(source.read, uuids)
            if self.error is not None:
                log.info("per-process figures readable again", extra={"source": source.name})
            self.error = None
        except ProcessMemoryError as err:
            if self.error != str(err):
                log.warning("cannot read per-process figures; contexts are charged as the hook "
                            "measures them", extra={"source": source.name, "error": str(err)})
            self.error = str(err)
            figures = {}
        self.readings += 1
        # The newest connection of a pid takes the pid's figure on each GPU, no other does.
        newest: dict[tuple[int, str], Charged] = {}
        for connection in sorted(self._connections, key=lambda c: c.connected_at):
            for uuid in connection.gpu_uuids():
                newest[(connection.peer_pid, uuid)] = connection
        for connection in list(self._connections):
            pid = connection.peer_pid
            totals = [figures.get(uuid, {}).get(pid) if pid > 0 and newest[(pid, uuid)] is
                      connection else None for uuid in connection.gpu_uuids()]
            connection.charge_process_memory(source.name, totals)
        return self.reconciler.reconcile(figures)


_chargers: weakref.WeakKeyDictionary[object, ContextCharger] = weakref.WeakKeyDictionary()


def charger_for(owner: object, config: DaemonConfig) -> ContextCharger:
    """The one charger of a daemon (`owner`: an object that lives as long as the daemon)."""
    charger = _chargers.get(owner)
    if charger is None:
        charger = _chargers[owner] = ContextCharger(config)
    return charger
