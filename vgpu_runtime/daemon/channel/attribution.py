"""Which allocation a host process belongs to, read from /proc: for processes the daemon sees
in NVML's running-process list but not on any connection (reconcile.py).

The daemon must see host pids (the host's pid namespace: hostPID in the DaemonSet, or on the
host as gemini-run starts it), and reads only what /proc shows any process of its uid: no
ptrace access. In this order:

1. The pod's channel mount. Allocate mounts <state-dir>/channels/<id> at /run/gemini in every
   container of a kubelet allocation, so a process whose mount namespace has a mount there
   whose source is a `channels/<id>` directory (/proc/<pid>/mountinfo) is in that allocation's
   container. A container cannot mount another allocation's channel (it cannot see one); root
   with CAP_SYS_ADMIN in it can unmount its own, which only loses the attribution.
2. The pod's cgroup. A process whose cgroup path names a pod uid (`pod<uid>`, the kubelet's
   cgroupfs and systemd layouts) bound to exactly one allocation belongs to it.
3. gemini-run's command. A process whose parents lead to a record's `owner_pid` (gemini-run,
   a child subreaper, so a double fork stays below it) belongs to that allocation.

A process is named by its pid and its start time (`ProcessId`), so that a pid reused by another
process is never taken for the first one: a kill (`kill`) opens a pidfd and checks the start
time before it signals.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vgpu_runtime.contracts import paths

PROC = Path("/proc")
MAX_ANCESTRY = 256   # parents followed up from a process, at most
# The kubelet's pod cgroup: cgroupfs "pod<uid>", systemd "pod<uid with _ for ->.slice".
POD_CGROUP = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_]"
                        r"[0-9a-f]{12})")


@dataclass(frozen=True)
class ProcessId:
    """A process as it was when read: a pid and its start time (clock ticks after boot)."""
    pid: int
    start: int


@dataclass(frozen=True)
class Candidate:
    """What attribution needs of an allocation."""
    allocation: str
    origin: str
    owner_pid: int | None
    pod_uid: str


def _stat_fields(pid: int, proc: Path) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def identify(pid: int, proc: Path = PROC) -> ProcessId | None:
    """The process `pid` is now, or None if there is none."""
    fields = _stat_fields(pid, proc)
    return ProcessId(pid, int(fields[19])) if fields and len(fields) > 19 else None


def command_of(pid: int, proc: Path = PROC) -> str:
    """The process's command name (/proc/<pid>/comm, at most 15 bytes, the process's own
    choice), or "" if there is none: it names a process in a report, never decides anything."""
    try:
        return (proc / str(pid) / "comm").read_text(errors="replace").strip()
    except OSError:
        return ""


def parent_of(pid: int, proc: Path = PROC) -> int:
    fields = _stat_fields(pid, proc)
    return int(fields[1]) if fields and len(fields) > 1 else 0


def channel_mounted(pid: int, proc: Path = PROC) -> str | None:
    """The allocation id whose channel is mounted at /run/gemini in the process's mount
    namespace, or None."""
    try:
        lines = (proc / str(pid) / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # id, parent, major:minor, root (the source within its filesystem), mount point, ...
        if len(fields) > 4 and fields[4] == paths.CONTAINER_CHANNEL_DIR:
            parent, _, allocation = fields[3].rpartition("/")
            if parent.endswith("/channels") or parent == "channels":
                return allocation
    return None


def pod_uid_of(pid: int, proc: Path = PROC) -> str | None:
    """The pod uid the process's cgroup names, or None."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    found = POD_CGROUP.search(text)
    return found.group(1).replace("_", "-") if found else None


def attribute(pid: int, candidates: Iterable[Candidate], proc: Path = PROC) -> str | None:
    """The allocation `pid` belongs to (see the module's doc), or None."""
    candidates = list(candidates)
    by_id = {c.allocation: c for c in candidates}
    mounted = channel_mounted(pid, proc)
    if mounted in by_id:
        return mounted
    uid = pod_uid_of(pid, proc)
    if uid is not None:
        pods = [c.allocation for c in candidates if c.pod_uid == uid]
        if len(pods) == 1:
            return pods[0]
    owners = {c.owner_pid: c.allocation for c in candidates
              if c.origin == "gemini-run" and c.owner_pid}
    if owners:
        ancestor = pid
        for _ in range(MAX_ANCESTRY):
            ancestor = parent_of(ancestor, proc)
            if ancestor <= 1:
                break
            if ancestor in owners:
                return owners[ancestor]
    return None


def kill(process: ProcessId, proc: Path = PROC) -> str | None:
    """SIGKILL to `process` if it is still that process (its start time): None when sent,
    else why not (gone, or the error: EPERM without CAP_KILL for another uid's process)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:
        return "gone"
    try:
        if identify(process.pid, proc) != process:   # the pidfd pins the pid: checked after
            return "gone"
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return None
    except OSError as err:
        return err.strerror or str(err)
    finally:
        with contextlib.suppress(OSError):
            os.close(pidfd)
