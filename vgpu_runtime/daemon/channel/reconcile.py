"""NVML reconciliation: after each per-process reading, what no hook declared is found, charged
and reported, and (where the node says so) its process killed.

Connected processes are charged by the context charge (process_memory.py): NVML's figure less
what the connection declared. This module adds the processes on the allocations' GPUs that no
connection speaks for (a static binary, a driver loaded with dlmopen, LD_PRELOAD unset, a hook
whose connection is down), then judges every allocation on every GPU once per reading:

* Attribution: attribution.py (the pod's channel mount, its cgroup, gemini-run's process tree).
  Only where pids are the host's: the daemon in the host's pid namespace (hostPID), or the
  simulated figures of the tests.
* Charge: a process without a connection is charged its whole figure to its allocation's
  ledger, as a holder of its own, so the container's reported free memory and every later
  reservation see it. From its second sighting UNHOOKED_GRACE or more after the first (the next
  reading comes that soon): a hooked process that has just made its context and is connecting
  is never charged twice. It is uncharged when NVML no longer lists it or it connects.
* Past the limit (its use by the ledger above limit + over_limit_tolerance): the channel reports
  it once per episode, naming the process to blame: the unconnected process holding most, else
  the connected process holding most memory its hook did not declare (channel.reconcile).
  With over_limit_action=kill the process to blame is killed (SIGKILL through a pidfd, its start
  time checked), and while the allocation stays past its limit the next one is at a later
  reading, once the killed one is off NVML's list. A process of no allocation is never killed.
  The default is report: NVML's figure holds memory the hook accounts for a moment later (a
  context being made, a module loading), and a kill loses work; killing needs CAP_KILL in the
  DaemonSet for another uid's process.
* A process of no allocation on one of the allocations' GPUs is listed in the status
  (`unattributed`, and the GPU's metric) and reported once per process and GPU while NVML lists
  it, as a process past the limit is once per episode: a warning and, with the Kubernetes API
  on, a Warning Event on the Node (UNATTRIBUTED_REASON; there is no pod to put it on). Nobody is
  charged for it and it is never killed: whose it is, nobody here knows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vgpu_runtime.contracts.allocation import AllocationRecord, Binding
from vgpu_runtime.daemon.channel import attribution
from vgpu_runtime.daemon.channel.attribution import Candidate, ProcessId
from vgpu_runtime.daemon.channel.ledger import MemoryLedger
from vgpu_runtime.daemon.channel.terms import GpuTerms

log = logging.getLogger(__name__)

# A GPU's figures: pid -> bytes; a reading: GPU UUID -> figures (process_memory.Figures).
Figures = dict[str, dict[int, int]]
UNHOOKED_GRACE = 0.25   # seconds from a process's first sighting without a connection to its charge
REPORT, KILL = "report", "kill"
OVER_LIMIT_ACTIONS = (REPORT, KILL)
UNATTRIBUTED_REASON = "GPUMemoryOfNoAllocation"   # the Node Event's reason
MPS_COMMAND = "nvidia-cuda-mps"   # the MPS server's /proc/<pid>/comm (15 bytes of its name)
NodeEvent = Callable[[str, str], None]   # (reason, message): a Warning Event on the Node


@dataclass(frozen=True)
class ProcessMemory:
    """A process of an allocation on one GPU, as one reading found it."""
    pid: int
    process_bytes: int        # NVML's figure
    declared_bytes: int       # what its hook declared of every kind but the context
    connected: bool
    process: ProcessId | None = None   # who to kill; unconnected processes only

    @property
    def undeclared(self) -> int:
        return max(0, self.process_bytes - self.declared_bytes)


@dataclass(frozen=True)
class Unhooked:
    """The ledger's holder for a process without a connection."""
    process: ProcessId


class Reconciled(Protocol):
    """What reconciliation uses of a channel (channel.AllocationChannel)."""

    record: AllocationRecord
    binding: Binding | None
    terms: tuple[GpuTerms, ...]
    ledger: MemoryLedger

    def peer_pids(self) -> set[int]: ...

    def reconcile(self, gpu: int, unhooked: list[ProcessMemory]) -> ProcessMemory | None: ...

    def killed(self, gpu: int, blamed: ProcessMemory, failure: str | None) -> None: ...


class Reconciler:
    def __init__(self, action: str = REPORT, clock: Callable[[], float] = time.monotonic,
                 proc: Path = attribution.PROC, mps: bool = False) -> None:
        self.action = action
        self.mps = mps   # the tenants run over MPS: its server holds memory of its own
        self.clock = clock
        self.proc = proc
        self.attribute = True     # pids are the host's (the charger says, from its source)
        self.channels: dict[str, Reconciled] = {}
        self._first_seen: dict[ProcessId, float] = {}
        self._charged: dict[Unhooked, tuple[str, int]] = {}   # -> (allocation, GPU index)
        self._said: set[Hashable] = set()    # processes logged once: unconnected, unattributed
        self._killing: dict[tuple[str, int], ProcessId] = {}  # killed, still on NVML's list
        self.unattributed: list[dict[str, Any]] = []
        self.node_event: NodeEvent = lambda reason, message: None   # the daemon sets it

    def add(self, channel: Reconciled) -> None:
        self.channels[channel.record.id] = channel

    def remove(self, channel: Reconciled) -> None:
        if self.channels.get(channel.record.id) is channel:
            del self.channels[channel.record.id]
        for holder, (allocation, _gpu) in list(self._charged.items()):
            if allocation == channel.record.id:
                del self._charged[holder]   # its ledger goes with the channel

    def uuids(self) -> set[str]:
        return {gpu.uuid for channel in self.channels.values() for gpu in channel.terms}

    def reconcile(self, figures: Figures) -> bool:
        """One reading (empty where it failed: every unconnected charge is withdrawn); True when
        the next reading should come within UNHOOKED_GRACE (a process awaits its charge)."""
        now = self.clock()
        connected = set().union(*(c.peer_pids() for c in self.channels.values()))
        candidates = [Candidate(c.record.id, c.record.origin, c.record.owner_pid,
                                c.binding.pod.uid if c.binding else "")
                      for c in self.channels.values()]
        indexes = {(c.record.id, g.uuid): i for c in self.channels.values()
                   for i, g in enumerate(c.terms)}
        charges: dict[Unhooked, tuple[str, int, int]] = {}
        unattributed: list[dict[str, Any]] = []
        seen: set[ProcessId] = set()
        soon = False
        for uuid in sorted(self.uuids() & set(figures)):
            for pid, used in sorted(figures[uuid].items()):
                if pid in connected or not self.attribute:
                    continue
                process = attribution.identify(pid, self.proc)
                if process is None:
                    continue   # gone since the reading
                seen.add(process)
                if now - self._first_seen.setdefault(process, now) < UNHOOKED_GRACE:
                    soon = True
                    continue
                owner = attribution.attribute(pid, candidates, self.proc)
                index = indexes.get((owner, uuid)) if owner else None
                if owner is None or index is None:
                    unattributed.append({"gpu": uuid, "pid": pid, "process_bytes": used})
                    self._unattributed(process, uuid, used)
                    continue
                charges[Unhooked(process)] = (owner, index, used)
                self._say_once(process, "a process uses the GPU without the interposer (no "
                               "connection): charged to its allocation", allocation=owner,
                               gpu=uuid, pid=pid, process_bytes=used)
        self._first_seen = {p: t for p, t in self._first_seen.items() if p in seen}
        self._said = {key for key in self._said
                      if (key[1] if isinstance(key, tuple) else key) in seen}
        self._charge(charges)
        self.unattributed = unattributed
        for channel in list(self.channels.values()):
            for gpu in range(len(channel.terms)):
                self._judge(channel, gpu, charges, figures.get(channel.terms[gpu].uuid, {}))
        return soon

    def _charge(self, charges: dict[Unhooked, tuple[str, int, int]]) -> None:
        for holder, (allocation, gpu) in list(self._charged.items()):
            now = charges.get(holder)
            if now is None or now[:2] != (allocation, gpu):
                channel = self.channels.get(allocation)
                if channel is not None:
                    channel.ledger.observe_process(holder, gpu, None)
                del self._charged[holder]
        for holder, (allocation, gpu, used) in charges.items():
            self.channels[allocation].ledger.observe_process(holder, gpu, used)
            self._charged[holder] = (allocation, gpu)

    def _judge(self, channel: Reconciled, gpu: int,
               charges: dict[Unhooked, tuple[str, int, int]], listed: dict[int, int]) -> None:
        allocation = channel.record.id
        unhooked = [ProcessMemory(holder.process.pid, used, 0, False, holder.process)
                    for holder, (owner, index, used) in charges.items()
                    if owner == allocation and index == gpu]
        blamed = channel.reconcile(gpu, unhooked)
        key = (allocation, gpu)
        pending = self._killing.get(key)
        if pending is not None and pending.pid in listed and attribution.identify(
                pending.pid, self.proc) == pending:
            return   # the last one killed has not let go of its memory yet
        self._killing.pop(key, None)
        if blamed is None or self.action != KILL:
            return
        process = blamed.process or attribution.identify(blamed.pid, self.proc)
        if process is None:
            return
        failure = attribution.kill(process, self.proc)
        if failure is None:
            self._killing[key] = process
        channel.killed(gpu, blamed, failure)

    def _unattributed(self, process: ProcessId, uuid: str, used: int) -> None:
        """Report a process of no allocation on a served GPU, once while NVML lists it there
        (its command read only then, not at every reading)."""
        key = ("unattributed", process, uuid)
        if key in self._said:
            return
        command = attribution.command_of(process.pid, self.proc)
        self._say_once(key, "a process of no allocation uses a shared GPU", gpu=uuid,
                       pid=process.pid, command=command, process_bytes=used)
        named = f"process {process.pid}" + (f" ({command})" if command else "")
        held = f"{named} holds {used >> 20} MiB ({used} bytes) on GPU {uuid}"
        if self.mps and command.startswith(MPS_COMMAND):
            # Said as what its name claims, still reported: a name is the process's to choose.
            self.node_event(UNATTRIBUTED_REASON,
                            f"{held}: by its name the MPS server of this node's tenants (mps "
                            "is on), whose own memory no allocation is charged for")
            return
        self.node_event(UNATTRIBUTED_REASON,
                        f"{held}, which allocations of this node share, and belongs to none of "
                        "them (no pod's container, no gemini-run command): no allocation is "
                        "charged for it and no limit holds it")

    def _say_once(self, key: Hashable, message: str, **fields: Any) -> None:
        """Log `message` unless `key` was logged while its process stayed listed."""
        if key not in self._said:
            self._said.add(key)
            log.warning(message, extra=fields)
