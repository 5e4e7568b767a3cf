"""State directories that nobody else can plant files in, and files opened without following links.

The rule (RELIABILITY.md, security table S1): a state directory is a real directory owned by its
user, and nobody else may write in it. Root's (the node's /var/lib/gemini) may be read by others
(it is shared with the plugin, and the hook library under it is mounted into pods); a user's is
0700. Inside one, every file is opened with O_NOFOLLOW, and a tree is removed only through a
directory descriptor, so a link planted on the way cannot send a write or a removal elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

# What a directory's mode may grant beyond its owner.
ROOT_DIR_MODE = 0o755
USER_DIR_MODE = 0o700


class InsecureDirectory(Exception):
    """A state directory that someone other than its user could write in; says which and why."""


def allowed_mode(uid: int) -> int:
    return ROOT_DIR_MODE if uid == 0 else USER_DIR_MODE


def check_owned_dir(path: str | Path, uid: int, mode: int | None = None) -> None:
    """Raise InsecureDirectory unless `path` is a directory (not a link) owned by `uid` whose
    mode grants nothing beyond `mode` (default: 0755 for root, 0700 for anyone else)."""
    allowed = allowed_mode(uid) if mode is None else mode
    try:
        st = os.lstat(path)
    except OSError as err:
        raise InsecureDirectory(f"{path}: {err.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise InsecureDirectory(f"{path} is a symbolic link, not a directory")
    if not stat.S_ISDIR(st.st_mode):
        raise InsecureDirectory(f"{path} is not a directory")
    if st.st_uid != uid:
        raise InsecureDirectory(f"{path} is owned by uid {st.st_uid}, not by uid {uid}")
    extra = stat.S_IMODE(st.st_mode) & ~allowed
    if extra:
        raise InsecureDirectory(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; it must grant "
                                f"nothing beyond {allowed:04o}")


def make_dir(path: str | Path, mode: int) -> None:
    """mkdir `path` with exactly `mode` (not the umask's), or give an existing directory of this
    user that mode; raises OSError, or InsecureDirectory for a link or another user's directory
    (neither is changed)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InsecureDirectory(f"{path} is not a directory (a link or a file is in its place)")
    if st.st_uid != os.geteuid():
        raise InsecureDirectory(f"{path} is owned by uid {st.st_uid}, not by uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def open_nofollow(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """os.open that refuses a symbolic link in the last component (ELOOP) and anything but a
    regular file (a FIFO or a device opened for writing could block or harm)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_nofollow(path: str | Path) -> bytes:
    """The bytes of a regular file, opened without following a link."""
    fd = open_nofollow(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove_tree_in(parent: str | Path, name: str, owner: int) -> bool:
    """Remove directory `parent`/`name` and what it holds, through directory descriptors: a link
    in `parent` or inside is removed itself, never followed. Only a real directory owned by
    `owner` is removed; returns whether it was. Raises OSError if `parent` is unusable."""
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
            return False
        for _root, dirs, files, root_fd in os.fwalk(name, topdown=False, dir_fd=parent_fd):
            for entry in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=root_fd)
            for entry in dirs:
                try:
                    os.rmdir(entry, dir_fd=root_fd)
                except NotADirectoryError:   # a link to a directory: the link goes, not its target
                    os.unlink(entry, dir_fd=root_fd)
                except FileNotFoundError:
                    pass
        os.rmdir(name, dir_fd=parent_fd)
        return True
    finally:
        os.close(parent_fd)
