"""Files replaced atomically: a reader sees the old content or the new, never half of either."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(directory: str | Path) -> None:
    """Make a rename or a new name in `directory` survive a power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, payload: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Write to a temporary file beside `target`, fsync it, rename it over `target` and (when
    `durable`) fsync the directory. Raises OSError; on failure `target` is untouched and no
    temporary file is left behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        if durable:
            fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
