"""Replays a kubelet ContainerAllocateResponse the way a container runtime would apply it.

A runtime gives the container a fresh mount namespace with each `Mount` bound in, the device
nodes it names, and the response's environment. `replay_script` writes that as a POSIX shell
script for `unshare -m --propagation private sh -c SCRIPT` (see `replay_argv`), so the mounts
exist only inside the namespace and vanish with it:

    set -eu
    mkdir -p /opt/gemini/lib                       # mount point (a file for a file)
    mount --bind /host/lib /opt/gemini/lib
    mount -o remount,bind,ro /opt/gemini/lib       # read_only: a separate remount, which
    ...                                            # every util-linux honours
    export LD_PRELOAD=/opt/gemini/lib/libgemini-hook.so.X
    exec python3 ...

What it cannot replay is refused with ReplayError, never skipped silently: CDI devices need a
CDI-aware runtime (use --device-list-strategy envvar or device-nodes for a replay), and paths
must be absolute and free of NUL and newline. Device cgroup permissions are not applied: a
mount namespace has none, and the host's device nodes stay reachable as they are.

Mount points that do not exist are created on the host filesystem (the namespace shares it);
`created_mount_points` names them beforehand so a caller can remove them afterwards.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ReplayError(ValueError):
    """The response holds something a mount-namespace replay cannot give a container."""


def _absolute(path: str, what: str) -> str:
    if not path.startswith("/") or "\0" in path or "\n" in path:
        raise ReplayError(f"{what} {path!r} must be an absolute path without NUL or newline")
    normal = os.path.normpath(path)
    if normal == "/":
        raise ReplayError(f"{what} {path!r}: refusing to mount over /")
    return normal


def _mount_lines(host: str, container: str, read_only: bool) -> list[str]:
    h, c = shlex.quote(host), shlex.quote(container)
    # A directory is bound onto a directory, anything else (file, socket, device) onto a file.
    lines = [f"if [ -d {h} ]; then mkdir -p {c}; "
             f"else mkdir -p {shlex.quote(os.path.dirname(container))}; "
             f"[ -e {c} ] || : > {c}; fi",
             f"mount --bind {h} {c}"]
    if read_only:
        lines.append(f"mount -o remount,bind,ro {c}")
    return lines


def _container_paths(response: Any) -> list[str]:
    paths = [_absolute(m.container_path, "mount container_path") for m in response.mounts]
    paths += [_absolute(d.container_path, "device container_path") for d in response.devices]
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise ReplayError(f"container path {path} is given twice in the response")
        seen.add(path)
    return paths


def replay_script(response: Any, command: Sequence[str]) -> str:
    """The shell script that applies `response` (a ContainerAllocateResponse) and runs command."""
    if not command:
        raise ReplayError("no command to run inside the replayed container")
    if len(response.cdi_devices):
        names = ", ".join(d.name for d in response.cdi_devices)
        raise ReplayError(f"CDI devices ({names}) need a CDI-aware container runtime; start the "
                          "plugin with --device-list-strategy envvar or device-nodes to replay")
    _container_paths(response)  # validates them all before anything is written
    lines = ["set -eu"]
    for mount in response.mounts:
        lines += _mount_lines(_absolute(mount.host_path, "mount host_path"),
                              _absolute(mount.container_path, "mount container_path"),
                              bool(mount.read_only))
    for device in response.devices:
        host = _absolute(device.host_path, "device host_path")
        container = _absolute(device.container_path, "device container_path")
        if host != container:  # the same path is already there: the namespace shares /dev
            lines += _mount_lines(host, container, read_only=False)
    for name in sorted(response.envs):
        if not _ENV_NAME.match(name):
            raise ReplayError(f"environment variable name {name!r} is not a shell name")
        lines.append(f"export {name}={shlex.quote(response.envs[name])}")
    lines.append("exec " + shlex.join(command))
    return "\n".join(lines) + "\n"


def replay_argv(script: str) -> list[str]:
    """The command line that runs `script` in a fresh, private mount namespace."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


def created_mount_points(response: Any) -> list[Path]:
    """The highest missing ancestor of every container path: what replaying will create."""
    created: set[Path] = set()
    for path in map(Path, _container_paths(response)):
        missing = None
        for candidate in (path, *path.parents):
            if candidate.exists() or candidate.is_symlink():
                break
            missing = candidate
        if missing is not None:
            created.add(missing)
    return sorted(created)


def _remove_mount_point_tree(top: Path) -> None:
    """Remove `top` if it holds nothing but directories and empty files (mount points)."""
    if top.is_symlink():
        return
    if top.is_file():
        if top.stat().st_size == 0:
            top.unlink()
        return
    for directory, _subdirs, files in os.walk(top, topdown=False):
        for name in files:
            path = Path(directory, name)
            if path.is_symlink() or not path.is_file() or path.stat().st_size:
                return  # something real lives there now: not ours to delete
            path.unlink()
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def remove_empty_trees(tops: Sequence[Path]) -> None:
    """Remove what a replay created as mount points on the host, where nothing else is there."""
    for top in tops:
        if top.exists() or top.is_symlink():
            _remove_mount_point_tree(top)


@contextlib.contextmanager
def mount_points_cleaned(response: Any) -> Iterator[list[Path]]:
    """Note the mount points a replay will create on the host, and remove them afterwards."""
    tops = created_mount_points(response)
    try:
        yield tops
    finally:
        remove_empty_trees(tops)
