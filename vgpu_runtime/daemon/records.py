"""Watching <state-dir>/allocations/: which records exist now, and which are corrupt.

Polling (every ~0.2 s) keeps this simple and portable. A file is parsed again only when its
inode, size or mtime changed, so a steady node costs one directory listing per poll. A scan
that runs out of descriptors or memory raises OSError: it says nothing about the records.
The first scan also removes temporary files left by record writes a crash interrupted
(gemini-run's, when no plugin owns the node), by the rule in atomicfile.sweep_stale_temps.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from vgpu_runtime.common.securedir import read_nofollow
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.allocation import (
    AllocationRecord,
    RecordError,
    decode_record,
    sweep_temp_files,
)

log = logging.getLogger(__name__)

_Signature = tuple[int, int, int]  # inode, size, mtime_ns
# Errors of the moment, not of the file: no descriptors, no memory.
SHORTAGES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@dataclass(frozen=True)
class Scan:
    records: dict[str, AllocationRecord]    # id -> record
    corrupt: dict[str, str]                 # path -> error


class RecordWatcher:
    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = state_dir
        self.directory = paths.allocations_dir(state_dir)
        self._swept = False
        self._cache: dict[str, tuple[_Signature, AllocationRecord | RecordError]] = {}

    def scan(self) -> Scan:
        records: dict[str, AllocationRecord] = {}
        corrupt: dict[str, str] = {}
        seen: set[str] = set()
        if not self._swept:
            self._swept = True
            sweep_temp_files(self.state_dir)
        try:
            names = [e.name for e in os.scandir(self.directory) if e.name.endswith(".json")]
        except FileNotFoundError:
            names = []
        for name in sorted(names):
            path = str(self.directory / name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # removed between listing and stat
            seen.add(path)
            signature = (st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._cache.get(path)
            if cached is None or cached[0] != signature:
                result: AllocationRecord | RecordError
                try:
                    result = decode_record(path, self._read(path))
                except FileNotFoundError:
                    seen.discard(path)
                    continue
                except RecordError as err:
                    result = err
                    # Logged once per version of the file, never again while it stays the same.
                    log.error("skipping corrupt allocation record",
                              extra={"path": path, "error": str(err)})
                self._cache[path] = (signature, result)
            value = self._cache[path][1]
            if isinstance(value, RecordError):
                corrupt[path] = str(value)
            else:
                records[value.id] = value
        for gone in set(self._cache) - seen:
            del self._cache[gone]
        return Scan(records, corrupt)

    @staticmethod
    def _read(path: str) -> bytes:
        """The file's bytes; OSError for a shortage that passes (the scan fails, the daemon
        keeps what it serves and tries again), RecordError for a file that is wrong."""
        try:
            return read_nofollow(path)
        except OSError as err:
            if err.errno in SHORTAGES or isinstance(err, FileNotFoundError):
                raise
            raise RecordError(f"cannot read allocation record {path}: {err.strerror or err}"
                              ) from None

    def mark_unservable(self, record: AllocationRecord, error: RecordError) -> None:
        """A record that parsed but cannot be served: treat it as corrupt until it changes."""
        path = str(self.directory / f"{record.id}.json")
        if path in self._cache:
            self._cache[path] = (self._cache[path][0], error)
        log.error("skipping allocation record that cannot be served",
                  extra={"path": path, "error": str(error)})
