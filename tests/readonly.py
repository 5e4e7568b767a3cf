"""A directory made read-only for one call, also for root (whom directory modes do not stop)."""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")
CLONE_NEWNS = 0x00020000


def read_only_call(directory: Path, fn: Callable[[], T]) -> T:
    """fn() run while `directory` is read-only: by its mode for a non-root user; for root, in a
    forked child in its own mount namespace where `directory` is a read-only bind mount (the
    rest of the machine sees no change). fn's result must pickle; its failure is raised here."""
    if os.geteuid() != 0:
        mode = directory.stat().st_mode
        directory.chmod(0o555)
        try:
            return fn()
        finally:
            directory.chmod(mode)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        status = 0
        try:
            os.close(read)
            if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
                raise PermissionError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
            for argv in (["mount", "--make-rprivate", "/"],
                         ["mount", "--bind", str(directory), str(directory)],
                         ["mount", "-o", "remount,bind,ro", str(directory)]):
                subprocess.run(argv, check=True, capture_output=True, timeout=30)
            result: tuple[str, object] = ("ok", fn())
        except PermissionError as err:
            result = ("skip", f"mount namespaces are not permitted here ({err})")
        except BaseException:
            result = ("error", traceback.format_exc())
        try:
            data = memoryview(pickle.dumps(result))
            while data:
                data = data[os.write(write, data):]
        except BaseException:
            status = 1
        os._exit(status)
    os.close(write)
    chunks = []
    with os.fdopen(read, "rb") as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and chunks, f"the read-only child failed (status {status})"
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "skip":
        pytest.skip(str(value))
    if kind == "error":
        raise AssertionError(f"in the read-only child:\n{value}")
    return value  # type: ignore[return-value]
