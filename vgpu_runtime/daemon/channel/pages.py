"""The shared pages of one allocation on one GPU: its token page and its activity page.

Where they live: <state-dir>/pages/<allocation>.token.<i> and <allocation>.activity.<i>, in a
directory only the daemon's user can enter (0700). Nobody opens them by path: the daemon passes
them to each hook with its hello reply (SCM_RIGHTS), the token page as an O_RDONLY descriptor
(a writable one would let a container forge `valid_until_ns`), the activity page writable. The
container therefore needs no write access to its channel, which is mounted read-only.

`i` is the GPU's index in the allocation (the same index as in HELLO_REPLY and every frame).
The layouts are `struct gm_token_page` and `struct gm_activity_page` of gemini_wire.h.

Token page (written by the daemon only, mapped read-only by the hooks). The fast path of a
launch reads one field, `valid_until_ns`, so the publication order is:

* a grant writes `generation` (and `gate` if it changed) first and `valid_until_ns` last;
* a revocation or release writes `valid_until_ns = 0` first, before anything else.

`valid_until_ns` is a naturally aligned int64 written through a typed cffi pointer, that is one
8-byte store, so a reader never sees it torn: it sees the old deadline or the new one. On x86-64
stores become visible in program order; a hook that also wants `generation` reads it after
`valid_until_ns` with acquire ordering. `generation` is unique within one daemon run only.

A sealed token page cannot be written by anybody but this daemon, whatever the descriptor: it is
a memfd that the daemon maps writable and then seals with F_SEAL_FUTURE_WRITE (Linux 5.1), so no
write() and no new writable mapping succeeds from then on, even through a descriptor reopened
from /proc/<pid>/fd with O_RDWR by root in a container (a read-only file page could be reopened
so: the hook's descriptor names a file whose permission root passes). SHRINK, GROW and SEAL
seals keep its size fixed (no SIGBUS for the hooks) and the seals as they are. The daemon keeps
the memfd open to hand out descriptors (reopened read-only) and writes only through its mapping.
Such a page dies with the daemon: a restarted daemon makes new ones, and a hook takes them at its
next hello (launch/token.c maps the pages of a hello whose inode differs, and a hook whose
connection hung up reconnects on the way: on its slow path, or every few thousand launches of an
open gate). Until then a hook's old page says what the dead daemon last wrote: a grant lapses at
its deadline (one quota), an open gate stays open until the hook reconnects, as it did with files.

On kernels without F_SEAL_FUTURE_WRITE (or without memfd_create) the token page is a file in the
pages directory, as before sealing: it keeps its inode across daemon restarts and is opened
read-only for the hooks, but root in a container can reopen it for writing. The daemon says so
at start (`token_page_kind`, also in its status). A file token page found where a sealed page is
now made (left by an older daemon or a kernel without sealing) has its gate closed and its grant
voided before it is removed, so the hooks still mapping it ask, reconnect and take the new page.

Activity page (written by the hooks of the allocation with plain aligned stores, read here). The
daemon creates and initialises it (magic, version, times -1) so a hook never has to. It is a
file, whatever the kernel: it keeps its inode across daemon restarts (opened without truncation)
so hooks' launches stay visible to a new daemon. Page files are removed with their allocation.

Version-1 daemons kept the pages in the channel directory (token.<i>, activity.<i>), where a
version-1 hook of a writable channel may still have them mapped: `retire_legacy_pages` closes
their gate for good (gate token, no grant) and removes them, so such a hook asks the daemon for
every launch instead of trusting a page nobody writes any more.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import platform
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_runtime.contracts import paths, wire

log = logging.getLogger(__name__)

C = wire.const
PAGE_BYTES = C("GM_PAGE_BYTES")
PAGE_MODE = 0o600
PAGES_DIR_MODE = paths.PAGES_DIR_MODE
GATE_OPEN, GATE_TOKEN = C("GM_GATE_OPEN"), C("GM_GATE_TOKEN")


# linux/fcntl.h and linux/memfd.h; Python names them only in later versions.
F_SEAL_FUTURE_WRITE = 0x0010
MFD_NOEXEC_SEAL = 0x0008
TOKEN_PAGE_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
                    | fcntl.F_SEAL_SEAL)
SEALED, FILE = "sealed", "file"

pages_dir = paths.pages_dir


def _sealed_memfd(name: str) -> tuple[int, mmap.mmap]:
    """A page-sized memfd mapped writable, then sealed (see the module's doc): its descriptor
    and the daemon's mapping. Raises OSError (EINVAL where the kernel lacks a seal)."""
    try:   # not executable either, where the kernel knows the flag (6.3; vm.memfd_noexec=2)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, PAGE_BYTES)
        page_map = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, TOKEN_PAGE_SEALS)
        except OSError:
            page_map.close()
            raise
    except OSError:
        os.close(fd)
        raise
    return fd, page_map


@functools.cache
def sealing_unavailable() -> str | None:
    """Why this kernel cannot seal token pages, or None where it can (asked once, by trying)."""
    if not hasattr(os, "memfd_create"):
        return "no memfd_create"
    try:
        fd, page_map = _sealed_memfd("gemini.probe")
    except OSError as err:
        return f"{platform.release()}: {err.strerror} (F_SEAL_FUTURE_WRITE needs Linux 5.1)"
    page_map.close()
    os.close(fd)
    return None


def token_page_kind() -> str:
    """"sealed" where token pages are sealed memfds, else "file" (see the module's doc)."""
    return FILE if sealing_unavailable() else SEALED


def log_token_page_kind() -> None:
    """Once at the daemon's start: a node without sealing is told what it lacks and means."""
    reason = sealing_unavailable()
    if reason is None:
        log.info("token pages are sealed memfds: no container can write them",
                 extra={"token_pages": SEALED})
    else:
        log.warning("this kernel cannot seal token pages: they are read-only files, which root "
                    "in a container can reopen for writing and forge its grants; run GPU pods as "
                    "non-root (RELIABILITY.md, A6)", extra={"token_pages": FILE,
                                                            "reason": reason})


def ensure_pages_dir(directory: Path) -> None:
    """<state-dir>/pages, 0700, a real directory (not a link); raises OSError otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, PAGES_DIR_MODE)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{directory} is not a directory")
    if stat.S_IMODE(st.st_mode) != PAGES_DIR_MODE and st.st_uid == os.geteuid():
        os.chmod(directory, PAGES_DIR_MODE)


def token_page_path(directory: str | Path, allocation_id: str, gpu: int) -> Path:
    return Path(directory) / f"{allocation_id}.token.{gpu}"


def activity_page_path(directory: str | Path, allocation_id: str, gpu: int) -> Path:
    return Path(directory) / f"{allocation_id}.activity.{gpu}"


def _map(path: Path, mode: int) -> tuple[mmap.mmap, bool]:
    """Map `path` read-write, creating it if needed; returns (map, existed-with-right-size)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        reused = st.st_size == PAGE_BYTES
        os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask
        if not reused:
            os.ftruncate(fd, PAGE_BYTES)
        # Blocks reserved now: on a full filesystem this raises ENOSPC here, where a sparse
        # page would be a SIGBUS at its first store through the mapping.
        os.posix_fallocate(fd, 0, PAGE_BYTES)
        return mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), reused
    finally:
        os.close(fd)


def retire_page_file(path: Path, token: bool) -> None:
    """Remove a page file nobody will write again; a token page's gate is closed and its grant
    voided first, so a hook still mapping it asks the daemon instead of trusting it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        if token and stat.S_ISREG(st.st_mode) and st.st_size == PAGE_BYTES:
            with mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE) as page_map:
                buffer = wire.ffi.from_buffer(page_map)
                page: Any = wire.ffi.cast("struct gm_token_page *", buffer)
                page.valid_until_ns = 0
                page.gate = GATE_TOKEN
                del page
                wire.ffi.release(buffer)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def retire_legacy_pages(channel_dir: str | Path, gpu_count: int) -> None:
    """Close for good the version-1 pages of a channel directory (see the module's doc)."""
    for gpu in range(gpu_count):
        retire_page_file(Path(channel_dir) / f"token.{gpu}", token=True)
        retire_page_file(Path(channel_dir) / f"activity.{gpu}", token=False)


@dataclass(frozen=True)
class Activity:
    last_launch_ns: int
    last_sync_ns: int
    launches: int


class _MappedPage:
    """A page mapped shared, seen through its struct from the wire header: a file at `path`,
    or (`sealed`) a sealed memfd named after it."""

    HOOK_ACCESS = os.O_RDONLY   # how the hooks get it (see open_for_hook)

    def __init__(self, path: Path, struct: str, sealed: bool = False) -> None:
        self.path = path
        self._memfd: int | None = None
        if sealed:
            self._memfd, self._map = _sealed_memfd(f"gemini.{path.name}")
            self.reused = False
        else:
            self._map, self.reused = _map(path, PAGE_MODE)
        self._buffer = wire.ffi.from_buffer(self._map)
        self._page: Any = wire.ffi.cast(f"struct {struct} *", self._buffer)

    @property
    def sealed(self) -> bool:
        return self._memfd is not None

    @property
    def address(self) -> int:
        """Where the page is mapped in this process (the native token code writes it there);
        valid until close()."""
        return int(wire.ffi.cast("uintptr_t", self._page))

    def open_for_hook(self) -> int:
        """A new descriptor of the page, as a hook may have it (the caller closes it). A
        memfd is reopened through /proc, which gives a description of its own access mode."""
        if self._memfd is not None:
            return os.open(f"/proc/self/fd/{self._memfd}", self.HOOK_ACCESS | os.O_CLOEXEC)
        return os.open(self.path, self.HOOK_ACCESS | os.O_CLOEXEC | os.O_NOFOLLOW)

    def close(self, remove: bool) -> None:
        del self._page
        wire.ffi.release(self._buffer)
        self._map.close()
        if self._memfd is not None:
            os.close(self._memfd)   # the hooks' mappings keep the memory while they last
            self._memfd = None
        elif remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class TokenPage(_MappedPage):
    HOOK_ACCESS = os.O_RDONLY   # the hook must not be able to forge a grant

    def __init__(self, path: Path, gate: int, sealed: bool | None = None) -> None:
        """`sealed`: None seals where the kernel can; False makes the file page (an older
        daemon's, in tests)."""
        if sealed is None:
            sealed = sealing_unavailable() is None
        if sealed:
            retire_page_file(path, token=True)
        super().__init__(path, "gm_token_page", sealed)
        self._page.valid_until_ns = 0   # whatever a previous daemon granted is void
        self._page.magic = C("GM_TOKEN_PAGE_MAGIC")
        self._page.version = wire.VERSION
        self._page.gate = gate

    @property
    def gate(self) -> int:
        value: int = self._page.gate
        return value

    @property
    def valid_until_ns(self) -> int:
        value: int = self._page.valid_until_ns
        return value

    @property
    def generation(self) -> int:
        value: int = self._page.generation
        return value

    def set_gate(self, gate: int) -> None:
        self._page.gate = gate

    def grant(self, generation: int, valid_until_ns: int) -> None:
        self._page.generation = generation
        self._page.valid_until_ns = valid_until_ns  # last: the fast path reads only this

    def clear(self) -> None:
        self._page.valid_until_ns = 0

    def close(self, remove: bool) -> None:
        self.clear()
        super().close(remove)


class ActivityPage(_MappedPage):
    HOOK_ACCESS = os.O_RDWR

    def __init__(self, path: Path) -> None:
        super().__init__(path, "gm_activity_page")
        if not self.reused or self._page.magic != C("GM_ACTIVITY_PAGE_MAGIC"):
            self._page.last_launch_ns = -1
            self._page.last_sync_ns = -1
            self._page.launches = 0
            self._page.fallback_ns = 0
            self._page.version = wire.VERSION
            self._page.magic = C("GM_ACTIVITY_PAGE_MAGIC")

    def read(self) -> Activity:
        """What the hooks wrote; untrusted, so callers bound what they do with it."""
        page = self._page
        return Activity(int(page.last_launch_ns), int(page.last_sync_ns), int(page.launches))
