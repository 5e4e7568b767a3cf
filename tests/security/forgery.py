"""Every way a process might write a token page it holds a descriptor of, each tried and its
outcome named: "ok" where the write went through, else the errno's name. Standard library only:
it runs in the tests' processes and inside their containers alike (tests/containers copies it
next to the container's program).

The page's layout is gemini_wire.h's struct gm_token_page: `valid_until_ns`, the field a launch
trusts, is the int64 at VALID_UNTIL_OFFSET. A forged deadline is a year ahead.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable

PAGE_BYTES = 4096
VALID_UNTIL_OFFSET = 24           # magic, version, gate, reserved (4 each), generation (8)
F_SEAL_WRITE_ALL = 0x1F           # every seal there is: adding any is a change of seals
FALLOC_FL_PUNCH_HOLE_KEEP_SIZE = 0x3
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
YEAR_NS = 365 * 24 * 3600 * 10**9


def forged_deadline() -> bytes:
    return struct.pack("<q", time.monotonic_ns() + YEAR_NS)


def _outcome(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as err:
        return errno.errorcode.get(err.errno or 0, str(err.errno))
    return "ok"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _check(rc: int) -> None:
    if rc != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def forged(fd: int) -> bool:
    """The page now holds a forged deadline (read through `fd`)."""
    return read_valid_until(fd) > time.monotonic_ns() + YEAR_NS // 2


def read_valid_until(fd: int) -> int:
    value: int = struct.unpack("<q", os.pread(fd, 8, VALID_UNTIL_OFFSET))[0]
    return value


def attempts(path: str, readonly_fd: int | None = None) -> dict[str, str]:
    """Write attempts on the page that `path` reopens (/proc/<pid>/fd/<n>, or
    /proc/<pid>/map_files/<range>); with `readonly_fd`, also those on that descriptor."""
    libc = _libc()
    results: dict[str, str] = {}
    fd = -1

    def reopen() -> None:
        nonlocal fd
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    results["reopen O_RDWR"] = _outcome(reopen)
    if fd >= 0:
        try:   # those that would spoil the page first, the forging writes last
            results["ftruncate"] = _outcome(lambda: os.ftruncate(fd, 2 * PAGE_BYTES))
            results["fallocate punch hole"] = _outcome(lambda: _check(libc.fallocate(
                fd, FALLOC_FL_PUNCH_HOLE_KEEP_SIZE, 0, PAGE_BYTES)))
            results["add seals"] = _outcome(
                lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_WRITE_ALL))
            results["mmap shared writable"] = _outcome(_write_through_map(fd))
            results["pwrite"] = _outcome(
                lambda: os.pwrite(fd, forged_deadline(), VALID_UNTIL_OFFSET))
        finally:
            os.close(fd)
    if readonly_fd is not None:
        results["pwrite read-only"] = _outcome(
            lambda: os.pwrite(readonly_fd, forged_deadline(), VALID_UNTIL_OFFSET))
        results["mprotect writable"] = _outcome(_mprotect_writable(readonly_fd, libc))
    return results


def _write_through_map(fd: int) -> Callable[[], None]:
    def write() -> None:
        with mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, PROT_READ_WRITE) as page:
            page[VALID_UNTIL_OFFSET:VALID_UNTIL_OFFSET + 8] = forged_deadline()
    return write


def _mprotect_writable(fd: int, libc: ctypes.CDLL) -> Callable[[], None]:
    """Map read-only (as the hook does), then ask for write access to the mapping."""
    def write() -> None:
        address = libc.mmap(None, PAGE_BYTES, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            _check(-1)
        try:
            _check(libc.mprotect(address, PAGE_BYTES, PROT_READ_WRITE))
            ctypes.memmove(address + VALID_UNTIL_OFFSET, forged_deadline(), 8)
        finally:
            libc.munmap(address, PAGE_BYTES)
    return write
