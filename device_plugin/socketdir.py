"""Why the plugin's socket cannot be made in kubelet's directory, in words.

grpc says only "Failed to bind to address unix://...". The operator needs the cause: the
directory is missing (kubelet's device-plugins directory not mounted at the same path), not a
directory, or not writable (the path's length is checked with the configuration).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path


class SocketDirError(RuntimeError):
    """The plugin socket cannot be served; the message says why."""


def why_unbindable(socket_path: Path) -> str | None:
    """The reason a Unix socket cannot be bound at socket_path, or None if it can be now."""
    directory = socket_path.parent
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return (f"kubelet directory {directory} does not exist (is kubelet's device-plugins "
                "directory mounted at that path?)")
    except OSError as err:
        return f"kubelet directory {directory} cannot be reached: {err.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"kubelet directory {directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"kubelet directory {directory} is not writable by uid {os.geteuid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(str(socket_path))
        except OSError as err:
            return f"cannot make the plugin socket {socket_path}: {err.strerror}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    return None
