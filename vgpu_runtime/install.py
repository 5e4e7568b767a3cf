"""gemini-install-hook: puts the interposer on the host under its versioned name, retires old ones.

The DaemonSet runs this as an init container before the device plugin starts. The rule:

1. The packaged interposer is installed as `<hook-dir>/libgemini-hook.so.<version>-<digest>`
   (`hooklib.library_name()`: the digest is of the hook's sources, so every change to them is a
   new name; hook-dir defaults to `<state-dir>/lib`). It is written to a
   temporary file in that directory, synced, then hard-linked to its name, which fails if the
   name exists: a reader sees no file or the whole file, and two installers racing cannot
   overwrite each other.
2. A file of that name is never overwritten. With identical bytes there is nothing to do (the
   build is reproducible, so a rebuilt image of the same sources lands here); with different
   bytes the install is refused (exit status 1) and the message names what differs (size,
   sha256, SONAME, build ID, compiler). A name's library must never change:
   kubelet replays a container's kept Allocate response (`LD_PRELOAD=/opt/gemini/lib/<name>`) when
   the container restarts, so a name must mean the same code for the life of every pod using it.
3. Any other version (`libgemini-hook.so.*`, old names without a digest included) is deleted
   only when no allocation record (`<state-dir>/allocations/*.json`, field `hook_library`) names
   it. The current version is never deleted.
4. If any record cannot be read, no old version is deleted in that run. An unreadable record may
   belong to a running pod; were its library deleted, a restart of its container would preload a
   missing file, which ld.so skips with a warning, and the program would run outside its limits.
   Keeping an old file costs a few hundred kilobytes; the next run tries again.

So an upgrade leaves running pods, and their container restarts, on the library they started with
and gives new pods the new one. An old file goes at the first install run after the records of its
last pods are gone (records are removed when their pod is gone), that is at the next rollout or
restart of the node's DaemonSet pod.
"""

from __future__ import annotations

import contextlib
import filecmp
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vgpu_runtime import __version__, hooklib, hoststate
from vgpu_runtime.common import cli, logs
from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.atomicfile import fsync_dir
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.hook import identity

log = logging.getLogger("gemini-install-hook")
PROG = "gemini-install-hook"

# Every version's file starts with this; temporary files start with "." and are never versions.
LIBRARY_PREFIX = hooklib.LIBRARY_PREFIX
TEMP_SUFFIX = ".tmp"
STALE_TEMP_AGE = 3600.0  # seconds; a temporary file this old was left by an installer that died
LIBRARY_MODE = 0o755     # readable by every container user; the directory is mounted read-only


class InstallError(RuntimeError):
    """The library cannot be installed; the message says why and what to do."""


@dataclass(frozen=True)
class InstallConfig:
    # The node file's node section (it has no section of its own).
    state_dir: str = cfg.node_setting("state_dir")
    hook_dir: str | None = cfg.setting(None, "host directory holding the interposer library "
                                       "(default <state-dir>/lib)", cfg.optional(cfg.text), "DIR")
    library: str | None = cfg.setting(None, "interposer to install (default: the one packaged "
                                      "with vgpu_runtime, built from source in a source tree)",
                                      cfg.optional(cfg.text), "FILE")
    log_level: str = cfg.setting("info", "debug|info|warning|error",
                                 cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "json|text", cfg.choice("json", "text"), "FORMAT")

    @property
    def host_hook_dir(self) -> Path:
        return Path(self.hook_dir) if self.hook_dir else paths.default_hook_dir(self.state_dir)


@dataclass
class Outcome:
    """What one run did: the installed file, whether it was new, and the fate of old versions."""

    library: Path
    newly_installed: bool
    removed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)   # name -> why it stays


# ---- step 1 and 2: install, never overwrite ----

def _check_existing(source: Path, target: Path) -> bool:
    """True if target already holds source's bytes; raises InstallError if it holds others."""
    if target.is_symlink() or not target.is_file():
        raise InstallError(f"{target} exists but is not a regular file; remove it by hand "
                           "after checking that no pod uses it")
    if filecmp.cmp(source, target, shallow=False):
        return True
    raise InstallError(
        f"{target} already exists with different content than {source} "
        f"({identity.differences(target, source)}). A name's interposer must never change "
        "(restarted containers reload it by name), so it is not replaced. The name carries the "
        "digest of the hook's sources, so the same sources were built differently (another "
        f"compiler, or flags outside vgpu_runtime/hook/build.py); if no pod uses {target.name}, "
        "delete it by hand")


def install_library(source: Path, hook_dir: Path) -> tuple[Path, bool]:
    """Install source as hook_dir/hooklib.library_name(); returns (path, newly written)."""
    if not source.is_file():
        raise InstallError(f"interposer {source} not found or not a regular file")
    try:
        hook_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise InstallError(f"cannot create hook directory {hook_dir}: {err.strerror}") from None
    target = hook_dir / hooklib.library_name()
    if os.path.lexists(target):
        return target, not _check_existing(source, target)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX,
                                        dir=hook_dir)
    except OSError as err:
        raise InstallError(f"cannot write to hook directory {hook_dir}: {err.strerror}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle, open(source, "rb") as data:
            while chunk := data.read(1 << 20):
                handle.write(chunk)
            handle.flush()
            os.fchmod(handle.fileno(), LIBRARY_MODE)
            os.fsync(handle.fileno())
        try:
            os.link(tmp, target)   # unlike rename, link never replaces an existing name
        except FileExistsError:    # another installer won the race: same rule as above
            return target, not _check_existing(source, target)
        fsync_dir(hook_dir)
        return target, True
    except OSError as err:
        raise InstallError(f"cannot install {target}: {err.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)


# ---- step 3 and 4: retire old versions nobody uses ----

def versions_in_use(state_dir: Path) -> tuple[set[str], list[str]]:
    """Library names the allocation records use, and the records that could not be read."""
    used: set[str] = set()
    unreadable: list[str] = []
    for path, record in allocation.scan_records(state_dir):
        if isinstance(record, allocation.RecordError):
            unreadable.append(f"{path.name}: {record}")
        else:
            used.add(record.hook_library)
    return used, unreadable


def retire_old_versions(hook_dir: Path, state_dir: Path, outcome: Outcome) -> None:
    old = sorted(p for p in hook_dir.glob(LIBRARY_PREFIX + "*")
                 if p.name != hooklib.library_name())
    if not old:
        return
    used, unreadable = versions_in_use(state_dir)
    for path in old:
        if unreadable:
            outcome.kept[path.name] = ("unreadable allocation record(s) may use it: "
                                       + "; ".join(unreadable))
        elif path.name in used:
            outcome.kept[path.name] = "an allocation record uses it"
        elif path.is_symlink() or not path.is_file():
            outcome.kept[path.name] = "not a regular file; left for the operator"
        else:
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as err:
                outcome.kept[path.name] = f"cannot delete: {err.strerror}"
                continue
            outcome.removed.append(path.name)
    if outcome.removed:
        fsync_dir(hook_dir)


def remove_stale_temporaries(hook_dir: Path, now: float | None = None) -> list[str]:
    """Temporary files an installer left when it died mid-copy (never a version's name)."""
    now = time.time() if now is None else now
    removed = []
    for path in hook_dir.glob(f".{LIBRARY_PREFIX}*{TEMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if now - path.lstat().st_mtime > STALE_TEMP_AGE:
                path.unlink()
                removed.append(path.name)
    return removed


# ---- the whole step ----

def packaged_library() -> Path:
    """The interposer shipped in the package; in a source tree, built on demand (gcc)."""
    from vgpu_runtime.hook import build

    installed = hooklib.installed_library()
    if installed is not None:
        return installed
    try:
        return hooklib.library_path()
    except build.HookBuildError as err:
        raise InstallError(f"no packaged interposer, and building one failed: {err}") from None


def run(config: InstallConfig) -> Outcome:
    source = Path(config.library) if config.library else packaged_library()
    hook_dir = config.host_hook_dir
    target, newly = install_library(source, hook_dir)
    outcome = Outcome(library=target, newly_installed=newly)
    retire_old_versions(hook_dir, Path(config.state_dir), outcome)
    for name in remove_stale_temporaries(hook_dir):
        log.info("removed a stale temporary file", extra={"file": name})
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = cfg.load(InstallConfig, argv, prog=PROG,
                          description="Install the gemini.ai/vgpu interposer on the host under "
                                      "its versioned name and delete old versions no allocation "
                                      "record uses")
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    logs.setup(config.log_level, config.log_format)
    try:
        # The node pod's first step: on the host daemon's machine it stops there, saying why,
        # before it writes into (or retires interposers from) the host daemon's state.
        hoststate.refuse_node_program(config.state_dir)
    except hoststate.MachineTaken as err:
        cli.error(PROG, str(err))
        return 1
    try:
        outcome = run(config)
    except (InstallError, OSError) as err:
        log.error("interposer not installed", extra={"reason": str(err)})
        cli.error(PROG, f"interposer not installed: {err}")
        return 1
    log.info("interposer installed" if outcome.newly_installed else "interposer already present",
             extra={"library": str(outcome.library), "version": __version__})
    for name in outcome.removed:
        log.info("removed an old interposer version no allocation uses", extra={"file": name})
    for name, reason in outcome.kept.items():
        log.warning("kept an old interposer version", extra={"file": name, "reason": reason})
    return 0


if __name__ == "__main__":
    sys.exit(main())
