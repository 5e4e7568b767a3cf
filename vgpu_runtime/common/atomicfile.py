"""Files replaced atomically: a reader sees the old content or the new, never half of either.

What survives what (the rule every writer here follows):
- The temporary file's data is fsynced BEFORE it is renamed over the target, so no crash, not
  even a power loss, can leave a target that names half-written or empty data.
- Once `write_atomic` returns, the new name is in the kernel: a crash of the writing process
  (SIGKILL, OOM kill, segfault) loses nothing.
- Surviving a POWER LOSS also needs the directory fsynced after the rename. `durable=True` does
  that before returning; with a `DirectorySyncer` it is done just after, in a background thread
  that batches every directory written since its last pass into one fsync each. Until that
  pass (normally a millisecond or two), a power loss may bring back the OLD content (or no
  file), never a partial one. Kubelet's own checkpoint gives the same guarantee: it fsyncs the
  file and renames it, and never fsyncs the directory.

Temporary files are named `.<target name>.<writer pid>.<random>.tmp` beside the target. A
writer killed between creating and renaming one leaves it behind; `sweep_stale_temps` removes
those at the start of the process that owns the directory (see its docstring for why by age).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
# A writer holds its temporary file for one write and one fsync (milliseconds); one this old
# belongs to a writer that died, or to one stalled so long that failing it is the right answer.
STALE_TEMP_AGE = 60.0


def fsync_dir(directory: str | Path) -> None:
    """Make a rename or a new name in `directory` survive a power loss."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_prefix(target: str | Path) -> str:
    return f".{os.path.basename(target)}.{os.getpid()}."


def write_atomic(target: str | Path, payload: bytes, mode: int = 0o644, durable: bool = True,
                 syncer: DirectorySyncer | None = None) -> None:
    """Write to a temporary file beside `target`, fsync it, rename it over `target` and, when
    `durable`, fsync the directory: now, or through `syncer` just after returning (see the
    module docstring). Raises OSError; on failure `target` is untouched and no temporary file
    is left behind."""
    directory = os.path.dirname(target) or "."
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=directory)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        if syncer is None:
            fsync_dir(directory)
        else:
            syncer.request(directory)


class DirectorySyncer:
    """Deferred, batched directory fsyncs, done by one background thread.

    `request(d)` returns at once; the thread then fsyncs every directory requested since its
    last pass, once each, however many renames happened in it. `flush()` waits until every
    directory requested before the call is synced (shutdown, tests). A failed fsync is logged
    and counted in `failures`: the renames themselves are done, only their power-loss
    durability is in doubt."""

    def __init__(self, name: str = "dir-fsync") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._dirty: set[str] = set()
        self._requested = 0     # requests so far
        self._synced = 0        # requests covered by a finished pass
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failures = 0
        self.passes = 0

    def request(self, directory: str | Path) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("DirectorySyncer used after close()")
            self._dirty.add(os.fspath(directory))
            self._requested += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """True once everything requested before this call is synced; False on timeout."""
        with self._cond:
            target = self._requested
            return self._cond.wait_for(lambda: self._synced >= target, timeout)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Flush, then stop the thread. Further requests are refused."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._dirty) or self._closed)
                if not self._dirty:
                    return
                batch, self._dirty = self._dirty, set()
                covered = self._requested
            for directory in sorted(batch):
                try:
                    fsync_dir(directory)
                except OSError as err:
                    self.failures += 1
                    log.error("cannot fsync directory: its latest renames may not survive a "
                              "power loss", extra={"directory": directory, "error": str(err)})
            with self._cond:
                self._synced = covered
                self.passes += 1
                self._cond.notify_all()


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def sweep_stale_temps(directory: str | Path, older_than: float = STALE_TEMP_AGE,
                      now: float | None = None) -> list[Path]:
    """Remove the temporary files interrupted atomic writes left in `directory`: regular files
    named `.<...>.tmp` whose last write is more than `older_than` seconds old. Returns them.

    By age, not by the pid in the name: the plugin runs in a pod's pid namespace and gemini-run
    in the host's, so a pid seen from one process means nothing to the other. A file written
    in the last `older_than` seconds may belong to a live writer and is kept. Should a writer
    be stalled longer than that, removing its file makes its rename fail with an error and
    leaves the target as it was: nothing is lost. Sockets and other non-files are never
    touched (the daemon binds `.sched.tmp` sockets)."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    except OSError as err:  # not a directory, no permission: nothing to sweep, say why
        log.warning("cannot sweep temporary files",
                    extra={"directory": os.fspath(directory), "error": str(err)})
        return removed
    for entry in entries:
        if not is_temp_name(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime <= older_than:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue    # its writer renamed or removed it meanwhile
        except OSError as err:
            log.warning("cannot remove stale temporary file",
                        extra={"path": entry.path, "error": str(err)})
            continue
        removed.append(Path(entry.path))
    if removed:
        log.info("removed stale temporary files of interrupted writes",
                 extra={"directory": os.fspath(directory),
                        "files": sorted(p.name for p in removed)})
    return removed
