"""The shared pages of one allocation on one GPU: <channel>/token.<i> and <channel>/activity.<i>.

`i` is the GPU's index in the allocation (the same index as in HELLO_REPLY and every frame).
The layouts are `struct gm_token_page` and `struct gm_activity_page` of gemini_wire.h.

Token page (mode 0644, written by the daemon only, mapped read-only by the hooks). The fast path
of a launch reads one field, `valid_until_ns`, so the publication order is:

* a grant writes `generation` (and `gate` if it changed) first and `valid_until_ns` last;
* a revocation or release writes `valid_until_ns = 0` first, before anything else.

`valid_until_ns` is a naturally aligned int64 written through a typed cffi pointer, that is one
8-byte store, so a reader never sees it torn: it sees the old deadline or the new one. On x86-64
stores become visible in program order; a hook that also wants `generation` reads it after
`valid_until_ns` with acquire ordering. `generation` is unique within one daemon run only.

Activity page (mode 0666, written by the hooks of the allocation with plain aligned stores, read
here). The daemon creates and initialises it (magic, version, times -1) so a hook never has to.

Both files keep their inode across daemon restarts (opened without truncation): a hook's mapping
stays live while a new daemon takes over. They are removed when the allocation is removed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_runtime import wire

C = wire.const
PAGE_BYTES = C("GM_PAGE_BYTES")
TOKEN_PAGE_MODE = 0o644
ACTIVITY_PAGE_MODE = 0o666
GATE_OPEN, GATE_TOKEN = C("GM_GATE_OPEN"), C("GM_GATE_TOKEN")


def token_page_path(channel_dir: str | Path, gpu: int) -> Path:
    return Path(channel_dir) / f"token.{gpu}"


def activity_page_path(channel_dir: str | Path, gpu: int) -> Path:
    return Path(channel_dir) / f"activity.{gpu}"


def _map(path: Path, mode: int) -> tuple[mmap.mmap, bool]:
    """Map `path` read-write, creating it if needed; returns (map, existed-with-right-size)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        st = os.fstat(fd)
        reused = st.st_size == PAGE_BYTES
        os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask
        if not reused:
            os.ftruncate(fd, PAGE_BYTES)
        return mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), reused
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Activity:
    last_launch_ns: int
    last_sync_ns: int
    launches: int


class _MappedPage:
    """A page file mapped shared, seen through its struct from the wire header."""

    def __init__(self, path: Path, mode: int, struct: str) -> None:
        self.path = path
        self._map, self.reused = _map(path, mode)
        self._buffer = wire.ffi.from_buffer(self._map)
        self._page: Any = wire.ffi.cast(f"struct {struct} *", self._buffer)

    def close(self, remove: bool) -> None:
        del self._page
        wire.ffi.release(self._buffer)
        self._map.close()
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class TokenPage(_MappedPage):
    def __init__(self, path: Path, gate: int) -> None:
        super().__init__(path, TOKEN_PAGE_MODE, "gm_token_page")
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
    def __init__(self, path: Path) -> None:
        super().__init__(path, ACTIVITY_PAGE_MODE, "gm_activity_page")
        if not self.reused or self._page.magic != C("GM_ACTIVITY_PAGE_MAGIC"):
            self._page.last_launch_ns = -1
            self._page.last_sync_ns = -1
            self._page.launches = 0
            self._page.version = wire.VERSION
            self._page.magic = C("GM_ACTIVITY_PAGE_MAGIC")

    def read(self) -> Activity:
        """What the hooks wrote; untrusted, so callers bound what they do with it."""
        page = self._page
        return Activity(int(page.last_launch_ns), int(page.last_sync_ns), int(page.launches))
