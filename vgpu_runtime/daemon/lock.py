"""One daemon per state directory, through an flock on <state-dir>/scheduler.lock.

The kernel drops the lock when the holder exits however it exits, so a crashed daemon never
blocks the next one. The file is opened without following a link (securedir). The holder
writes its pid into the file, for the message others print.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from vgpu_runtime import paths
from vgpu_runtime.common.securedir import open_nofollow

LOCK_NAME = paths.LOCK_NAME


class AlreadyRunning(RuntimeError):
    """Another daemon holds the state directory's lock."""


def lock_path(state_dir: str | Path) -> Path:
    return paths.lock_file(state_dir)


def holder_pid(state_dir: str | Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(lock_path(state_dir).read_text().strip() or "x")
    return None


def acquire(state_dir: str | Path) -> int:
    """Take the lock (non-blocking) and return its fd, kept open for the daemon's life."""
    path = lock_path(state_dir)
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = holder_pid(state_dir)
        raise AlreadyRunning(
            f"another gemini-daemon (pid {pid or 'unknown'}) already serves state directory "
            f"{state_dir} (lock {path}); stop it first or use another --state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def is_held(state_dir: str | Path) -> bool:
    """True while some daemon holds the lock (used by gemini-run before starting one)."""
    path = lock_path(state_dir)
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except OSError:
        return False   # none, or not a lock file (a link, a directory): no daemon took it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a shared lock we may have taken
    return False
