"""Host-wide GPU locks: whose daemon serves each GPU of this machine.

Without the host daemon, every user's gemini-run starts a daemon of that user's own; two users'
daemons on one GPU would each believe they own it, and neither share nor memory would hold
between them. So a per-user daemon claims a GPU here before it serves an allocation on it, and
refuses one that another user's daemon (or the host daemon) holds; gemini-run asks first, to
pick a GPU that is free and to refuse at once, naming the holder.

Where: <lock-dir>/gemini-vgpu-<uuid>.lock, with <lock-dir> /run/lock unless GEMINI_GPU_LOCK_DIR
(the daemon's gpu_lock_dir) names another. The directory must be a directory of root's (or of
the caller's own, for tests) that others may not write in, or may only where it is sticky
(/run/lock is root's and 1777 on Debian, Ubuntu and Fedora): a file there can then be removed or
replaced by its owner and root alone. Anything else, or no directory, is refused (fail-safe):
a lock that any user could replace would let two users share a GPU unknowingly again.

The file is made by the first user who locks the GPU (0444, never written) and opened read-only
by everyone. Its bytes are nothing; the POSIX locks on it say who serves the GPU:
 - a daemon of uid U holds a read (shared) lock on byte U, so one user's daemons share a GPU;
 - the host daemon holds one on byte HOST_BYTE, beyond every uid.
A claim checks for another holder and takes its byte under flock(LOCK_EX) on the same file (on
Linux flock and POSIX locks are independent), so two users' claims cannot interleave. The kernel
drops a holder's locks when it exits however it exits, and F_GETLK names a holder's byte and
pid: a refusal names the holder from the kernel, never from a file someone wrote.

What it does not do: keep out a user who means harm. The owner of a lock file may remove it (the
host daemon replaces a lock file a user made with one of root's before it holds it, and a claim
always checks, under the gate, that its file is still the one in place), and any user may use the
GPU without gemini-run at all. The lock keeps honest users apart; the host
daemon, which serves every user from one ledger, is what a shared machine should run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vgpu_runtime.contracts import paths

HOST_BYTE = 1 << 32          # the host daemon's byte: beyond every uid (uids are 32 bits)
LOCK_FILE_MODE = 0o444
GATE_WAIT = 2.0              # seconds a claim waits for another claim's check to end
CLAIM_TRIES = 5              # a claim starts again this often on a lock file replaced under it
_FLOCK = struct.Struct("hhqqi4x")   # struct flock: type, whence, start, len, pid (Linux)


class GpuLockError(Exception):
    """The lock directory or a lock file cannot be trusted or used; the message says the fix."""


class GpuHeld(GpuLockError):
    """Another user's daemon, or the host daemon, serves the GPU."""

    def __init__(self, message: str, holder: Holder) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    uuid: str
    uid: int | None     # None: the host daemon
    pid: int            # 0 where the holder runs in another pid namespace

    @property
    def is_host(self) -> bool:
        return self.uid is None

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid else "pid unknown"
        if self.uid is None:
            return f"the host daemon ({pid})"
        return f"uid {self.uid}{_user_name(self.uid)}'s gemini-daemon ({pid})"


def _user_name(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f" ({pwd.getpwuid(uid).pw_name})"
    return ""


def lock_dir(explicit: str | None = None) -> Path:
    """The lock directory: `explicit` (a flag or setting), else GEMINI_GPU_LOCK_DIR, else
    /run/lock."""
    return Path(explicit or os.environ.get(paths.ENV_GPU_LOCK_DIR) or paths.DEFAULT_GPU_LOCK_DIR)


def lock_file(directory: str | Path, uuid: str) -> Path:
    if not uuid or "/" in uuid or uuid.startswith("."):
        raise GpuLockError(f"GPU UUID {uuid!r} cannot name a lock file")
    return Path(directory) / f"gemini-vgpu-{uuid}.lock"


def check_dir(directory: str | Path) -> None:
    """Refuse a lock directory that another user could replace files in (or none at all)."""
    fix = (f"create it (sudo install -d -m 1777 -o root -g root {directory}) or set "
           f"{paths.ENV_GPU_LOCK_DIR} to a root-owned sticky directory; or install the host "
           "daemon, which serves every user of the machine (sudo gemini-host install)")
    try:
        st = os.stat(directory)
    except OSError as err:
        raise GpuLockError(
            f"GPU lock directory {directory}: {err.strerror}. Each user's daemon locks the GPUs "
            f"it serves there, so that two users never share one unknowingly: {fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise GpuLockError(f"GPU lock directory {directory} is not a directory: {fix}")
    if st.st_uid not in (0, os.geteuid()):
        raise GpuLockError(f"GPU lock directory {directory} is owned by uid {st.st_uid}, who "
                           f"could replace every lock in it: {fix}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise GpuLockError(f"GPU lock directory {directory} has mode "
                           f"{stat.S_IMODE(st.st_mode):04o}: others may write in it and it is "
                           f"not sticky, so any user could replace a lock: {fix}")


def _open(path: Path, create: bool) -> int | None:
    """The lock file, opened read-only (made 0444 where missing and `create`); None where it is
    missing and not `create`. A link, a FIFO or anything but a regular file is refused."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    while True:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                return None
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, LOCK_FILE_MODE)
            except FileExistsError:
                continue   # another claimant made it first: open theirs
            os.fchmod(fd, LOCK_FILE_MODE)   # whatever the umask: every user must open it
        except OSError as err:
            owner = _owner(path)
            raise GpuLockError(
                f"cannot open GPU lock file {path}{owner}: {err.strerror}. Whoever made it so "
                "keeps this GPU from every daemon; an administrator may remove it") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise GpuLockError(f"GPU lock file {path} (owned by uid {st.st_uid}) is not a "
                               "regular file; an administrator may remove it")
        return fd


def _owner(path: Path) -> str:
    with contextlib.suppress(OSError):
        return f" (owned by uid {os.lstat(path).st_uid})"
    return ""


def _other_holder(fd: int, uuid: str, byte: int) -> Holder | None:
    """A lock on any byte but `byte`: the host daemon's first, then another user's."""
    if byte == HOST_BYTE:
        ranges = [(0, HOST_BYTE), (HOST_BYTE + 1, 0)]
    else:   # a length of 0 reaches to the end of every file
        ranges = [(HOST_BYTE, 1), *([(0, byte)] if byte else []), (byte + 1, 0)]
    for start, length in ranges:
        raw = fcntl.fcntl(fd, fcntl.F_GETLK,
                          _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
        kind, _whence, held_start, _held_len, pid = _FLOCK.unpack(raw)
        if kind != fcntl.F_UNLCK:
            return Holder(uuid, None if held_start >= HOST_BYTE else held_start, pid)
    return None


def _is_current(fd: int, path: Path) -> bool:
    """Whether `fd` is still the file at `path` (a claim checks it under the gate: whoever
    replaces a lock file does so under the old one's gate, and claims go to the new one)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _replace_with_roots(path: Path) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 LOCK_FILE_MODE)
    try:
        os.fchmod(fd, LOCK_FILE_MODE)
    finally:
        os.close(fd)
    os.rename(temporary, path)


def _set(fd: int, kind: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))


def holder(directory: str | Path, uuid: str, uid: int | None) -> Holder | None:
    """Who other than `uid`'s daemons (None: the host daemon) serves GPU `uuid` now; None if
    nobody does. Raises GpuLockError where the directory or the file cannot be trusted."""
    check_dir(directory)
    fd = _open(lock_file(directory, uuid), create=False)
    if fd is None:
        return None
    try:
        return _other_holder(fd, uuid, HOST_BYTE if uid is None else uid)
    finally:
        os.close(fd)


def refusal(held: Holder, asker_uid: int | None) -> str:
    """Why a GPU is not this user's now, and what to do: a message for people."""
    verb = "served" if held.is_host else "held"
    return f"GPU {held.uuid} is {verb} by {held.describe()}: {advice(held, asker_uid)}"


def advice(held: Holder, asker_uid: int | None) -> str:
    if held.is_host:
        return ("it serves every user of this machine: run gemini-run without --state-dir (it "
                f"finds the host daemon by itself in {paths.DEFAULT_STATE_DIR}), or stop the "
                "host daemon first")
    if asker_uid is None:
        return ("that user's gemini-run started it; the host daemon can serve the GPU once "
                "that daemon has no allocation on it (that user or root may stop it now: "
                "gemini-vgpu stop)")
    return ("one user's daemon holds a GPU alone while it runs allocations there, so that two "
            "users never share it unknowingly. Use another GPU (--gpu), wait for that user's "
            "jobs to end, or have an administrator install the host daemon, which shares every "
            "GPU among all users (sudo gemini-host install; README, 'One daemon for every "
            "user')")


class GpuClaims:
    """The GPUs one daemon holds: claimed as it serves them, kept while it does."""

    def __init__(self, directory: str | Path, uid: int | None) -> None:
        self.directory = Path(directory)
        self.uid = uid                       # None: the host daemon
        self.byte = HOST_BYTE if uid is None else uid
        self._held: dict[str, int] = {}      # uuid -> the lock file's descriptor

    @property
    def held(self) -> set[str]:
        return set(self._held)

    def claim(self, uuid: str) -> None:
        """Hold GPU `uuid` (nothing to do if held already); GpuHeld if another user's daemon
        or the host daemon holds it, GpuLockError if the lock cannot be trusted or taken."""
        if uuid in self._held:
            return
        check_dir(self.directory)
        path = lock_file(self.directory, uuid)
        for _ in range(CLAIM_TRIES):
            fd = _open(path, create=True)
            assert fd is not None
            try:
                claimed = self._try(fd, path, uuid)
            except BaseException:
                os.close(fd)
                raise
            if claimed:
                self._held[uuid] = fd
                return
            os.close(fd)
        raise GpuLockError(f"{path} was replaced {CLAIM_TRIES} times while this daemon claimed "
                           "it; some process keeps replacing it")

    def _try(self, fd: int, path: Path, uuid: str) -> bool:
        """Claim through `fd`; False where the file was replaced meanwhile (try again on the
        one in its place)."""
        self._gate(fd, path)
        try:
            if not _is_current(fd, path):
                return False
            other = _other_holder(fd, uuid, self.byte)
            if other is not None:
                raise GpuHeld(refusal(other, self.uid), other)
            if self.uid is None and os.fstat(fd).st_uid != 0 and os.geteuid() == 0:
                # The host daemon's lock must be a file no user can remove: a user who made it
                # could otherwise unlink it and lock a new one beside the host daemon.
                _replace_with_roots(path)
                return False
            _set(fd, fcntl.F_RDLCK, self.byte)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    @staticmethod
    def _gate(fd: int, path: Path) -> None:
        deadline = time.monotonic() + GATE_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise GpuLockError(f"cannot lock {path}: {err.strerror}") from None
            if time.monotonic() > deadline:
                raise GpuLockError(f"{path} stays flock()ed for more than {GATE_WAIT:g} s: "
                                   "a claim takes milliseconds, so some process keeps it; an "
                                   "administrator can find it in /proc/locks")
            time.sleep(0.01)

    def release(self, uuid: str) -> None:
        fd = self._held.pop(uuid, None)
        if fd is not None:
            os.close(fd)   # drops this process's locks on the file

    def keep(self, uuids: Iterable[str]) -> list[str]:
        """Release every GPU not in `uuids`; returns those released."""
        wanted = set(uuids)
        released = sorted(set(self._held) - wanted)
        for uuid in released:
            self.release(uuid)
        return released

    def close(self) -> None:
        self.keep(())
