"""Whose a machine's state directory is: the host daemon's or a Kubernetes node's.

A machine runs the host daemon (gemini-host: one daemon for every user, installed by an
administrator) or the node DaemonSet (gemini-install-hook, the device plugin and gemini-daemon),
never both: both use /var/lib/gemini and would count the same GPUs twice. Each refuses to start
over the other's state, saying so:

* the host daemon's mark is <state-dir>/host.json, written by `gemini-host install` and by the
  host daemon when it starts, removed by `gemini-host uninstall` alone (a stopped host daemon is
  still installed). gemini-install-hook, the device plugin and every other gemini-daemon
  refuse a state directory that holds it. gemini-run and gemini-vgpu read it to find the host
  daemon.
* a node's marks are the device plugin's own files (health.json, slices.json) and records of
  kubelet allocations; the host daemon refuses a state directory that holds any.

The mark is trusted only as root's: a regular file owned by root in a directory of root's that
nobody else may write in. A user cannot plant one to catch another user's gemini-run.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_runtime.common.atomicfile import write_atomic
from vgpu_runtime.common.securedir import read_nofollow
from vgpu_runtime.contracts import allocation, paths

MARKER_VERSION = 1
HOST_UNIT = "gemini-host"


class MachineTaken(Exception):
    """The state directory is the other kind's; the message says whose and what to do."""


@dataclass(frozen=True)
class HostMarker:
    group: str
    metrics_port: int
    since: float

    def to_json(self) -> dict[str, Any]:
        return {"version": MARKER_VERSION, "group": self.group,
                "metrics_port": self.metrics_port, "since": self.since}


def write_marker(state_dir: str | Path, group: str, metrics_port: int) -> HostMarker:
    """Mark `state_dir` as the host daemon's (root's file, readable by all)."""
    marker = read_marker(state_dir)
    since = marker.since if marker is not None else time.time()
    marker = HostMarker(group, metrics_port, since)
    write_atomic(paths.host_marker(state_dir),
                 json.dumps(marker.to_json(), sort_keys=True).encode() + b"\n", mode=0o644)
    return marker


def remove_marker(state_dir: str | Path) -> bool:
    try:
        os.unlink(paths.host_marker(state_dir))
    except FileNotFoundError:
        return False
    return True


def _roots(path: Path, directory: bool) -> bool:
    """A real file or directory of root's that nobody else may write in."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    return kind(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022


def read_marker(state_dir: str | Path) -> HostMarker | None:
    """The host daemon's mark in `state_dir`, or None: none, or one that is not root's (a mark
    anybody else could have written is no mark)."""
    path = paths.host_marker(state_dir)
    if not (_roots(Path(state_dir), directory=True) and _roots(path, directory=False)):
        return None
    try:
        data = json.loads(read_nofollow(path))
        return HostMarker(str(data["group"]), int(data["metrics_port"]), float(data["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        # Root's file that cannot be read: the host daemon's all the same (it is in its place).
        return HostMarker(paths.DEFAULT_HOST_GROUP, paths.HOST_METRICS_PORT, 0.0)


def marked_anywhere(state_dir: str | Path) -> bool:
    """Whether a host mark is in `state_dir` at all, root's or not (what node programs refuse:
    they run as root and must not start over it whoever wrote it)."""
    return os.path.lexists(paths.host_marker(state_dir))


def find_host(state_dir: str | Path | None) -> Path | None:
    """The state directory of an installed host daemon: `state_dir` where one was named (a
    flag, GEMINI_STATE_DIR) and it is the host daemon's, else the machine's default if that is;
    None where there is none (gemini-run then keeps a daemon of the user's own)."""
    if state_dir:
        # A directory named on purpose that is not the host daemon's: the user's own.
        return Path(state_dir) if read_marker(state_dir) is not None else None
    default = Path(paths.DEFAULT_STATE_DIR)
    return default if read_marker(default) is not None else None


def refuse_node_program(state_dir: str | Path) -> None:
    """A node program (the device plugin, gemini-daemon) must not start over the host
    daemon's state: raises MachineTaken saying whose it is and what to do."""
    if not marked_anywhere(state_dir):
        return
    raise MachineTaken(
        f"state directory {state_dir} belongs to the host daemon ({HOST_UNIT}, "
        f"{paths.host_marker(state_dir)}), which serves every user of this machine. A machine "
        "runs the host daemon or the node DaemonSet, not both: to make this a Kubernetes node, "
        f"uninstall it first (sudo gemini-host uninstall); to keep it, take this node out of "
        "the DaemonSet (kubectl label node <node> gemini.ai/vgpu.enabled-)")


def node_state(state_dir: str | Path) -> list[str]:
    """What in `state_dir` a Kubernetes node's programs left: the plugin's files, kubelet
    allocation records. Empty where there is none."""
    found = [str(p) for p in (paths.health_file(state_dir), paths.slices_file(state_dir))
             if os.path.lexists(p)]
    kubelet = [str(path) for path, record in allocation.scan_records(state_dir)
               if isinstance(record, allocation.AllocationRecord) and record.origin == "kubelet"]
    if kubelet:
        found.append(f"{len(kubelet)} kubelet allocation record(s) "
                     f"({', '.join(kubelet[:3])}{', ...' if len(kubelet) > 3 else ''})")
    return found


def refuse_node_state(state_dir: str | Path) -> None:
    """The host daemon must not start over a node's state: raises MachineTaken naming it."""
    found = node_state(state_dir)
    if not found:
        return
    raise MachineTaken(
        f"state directory {state_dir} holds a Kubernetes node's state ({'; '.join(found)}): "
        "the gemini.ai/vgpu DaemonSet runs, or ran, on this machine. A machine runs the host "
        "daemon or the node DaemonSet, not both: take the node out of the DaemonSet (kubectl "
        "label node <node> gemini.ai/vgpu.enabled-), wait for its pods to end, remove those "
        f"files, then start the host daemon again; or keep the DaemonSet and uninstall the host "
        f"daemon (sudo gemini-host uninstall)")
