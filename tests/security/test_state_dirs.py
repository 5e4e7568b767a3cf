"""S1: gemini-run's state directory, attacked by another user of the machine.

The victim is a real second uid running the real gemini-run (and the daemon it starts) with no
XDG_RUNTIME_DIR, as under cron, `su` or `sudo -u`; so its state directory is /tmp/gemini-<uid>,
a name anyone can make first. The attacker is another uid that made it first, mode 0777, with
links to the victim's files and a stale record. The victim runs through setpriv (as_user).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.childenv import as_user, child_env
from vgpu_runtime.common import securedir
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon import lock

REPO = Path(__file__).resolve().parents[2]
# Uids nobody on a test machine has; unique per run so parallel sessions do not meet.
VICTIM = 50_000 + os.getpid() % 5_000
ATTACKER = VICTIM + 5_000

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as two other users")


def processes_of(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
    return pids


def stop_processes_of(uid: int) -> None:
    """The daemons the victim's gemini-run started (this test's own uid: nobody else's)."""
    for pid in processes_of(uid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass
class Victim:
    home: Path
    library: Path

    def files(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.home)): p.read_bytes() if p.is_file() else b"<dir>"
                for p in sorted(self.home.rglob("*"))}

    def gemini_run(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in child_env().items()
               if k not in ("XDG_RUNTIME_DIR", "GEMINI_STATE_DIR")}
        argv = [sys.executable, "-m", "vgpu_runtime.run", "--simulate-gpus", "1",
                "--hook-library", str(self.library), *args, "--", "/bin/true"]
        return subprocess.run(as_user(VICTIM, argv), cwd=REPO, env={**env, "HOME": str(self.home)},
                              capture_output=True, text=True, timeout=60)


@pytest.fixture
def victim() -> Iterator[Victim]:
    root = Path(tempfile.mkdtemp(prefix="gm-users-"))
    root.chmod(0o755)
    home = root / "home"
    (home / "precious").mkdir(parents=True)
    (home / "precious" / "thesis.tex").write_text("years of work\n")
    (home / "important.txt").write_text("do not lose\n")
    (home / ".bashrc").write_text("export PS1='$ '\n")
    library = root / "libgemini-test.so"
    library.write_bytes(b"")   # gemini-run only checks that it exists; /bin/true ignores it
    for path in [home, *home.rglob("*")]:
        os.lchown(path, VICTIM, VICTIM)
    home.chmod(0o700)
    default = Path(f"/tmp/gemini-{VICTIM}")
    shutil.rmtree(default, ignore_errors=True)
    yield Victim(home, library)
    stop_processes_of(VICTIM)
    shutil.rmtree(default, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def plant(state: Path, victim: Victim) -> None:
    """What the attacker leaves in the victim's default state directory, made first."""
    (state / "allocations").mkdir(parents=True)
    stale = allocation.AllocationRecord(
        id="r-" + "a" * 16, origin="gemini-run", device_ids=(),
        gpus=(allocation.GpuShare("GPU-x", 0, Share.from_float(0.1), 1),),
        channel_dir=str(paths.channels_dir(state) / "precious"),
        hook_library="x", created_at=time.time() - 3600, owner_pid=dead_pid())
    allocation.write_record(state, stale)
    os.symlink(victim.home, paths.channels_dir(state))
    os.symlink(victim.home / "important.txt", state / lock.LOCK_NAME)
    os.symlink(victim.home / "important.txt", state / "run.lock")
    os.symlink(victim.home / ".bashrc", state / "scheduler.log")
    for path in [state, *state.rglob("*")]:
        os.lchown(path, ATTACKER, ATTACKER)
        if not path.is_symlink():
            path.chmod(0o777)


def test_a_state_dir_another_user_made_first_is_refused_and_nothing_is_touched(
        victim: Victim) -> None:
    """Pass: gemini-run exits 125 naming the directory, its owner and the fix; the victim's
    files are as they were (old code: ~/precious deleted, ~/important.txt truncated to the
    daemon's pid, the daemon's log appended to ~/.bashrc)."""
    state = Path(f"/tmp/gemini-{VICTIM}")
    plant(state, victim)
    before = victim.files()
    done = victim.gemini_run()
    stop_processes_of(VICTIM)
    assert victim.files() == before
    assert done.returncode == 125, done.stderr
    assert f"refusing state directory {state}" in done.stderr
    assert f"owned by uid {ATTACKER}" in done.stderr and "--state-dir" in done.stderr


@pytest.mark.parametrize("mode", [0o777, 0o750, 0o705])
def test_the_users_own_state_dir_open_to_others_is_refused(victim: Victim, mode: int) -> None:
    state = victim.home / "state"
    state.mkdir()
    os.chown(state, VICTIM, VICTIM)
    state.chmod(mode)
    done = victim.gemini_run("--state-dir", str(state))
    assert done.returncode == 125
    assert f"has mode {mode:04o}" in done.stderr and "chmod 0700" in done.stderr
    assert not (state / "allocations").exists()


def test_a_fresh_default_state_dir_is_private_and_works(victim: Victim) -> None:
    done = victim.gemini_run()
    assert done.returncode == 0, done.stderr
    state = Path(f"/tmp/gemini-{VICTIM}")
    for directory, mode in ((state, 0o700), (paths.channels_dir(state), 0o700)):
        st = directory.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (VICTIM, mode), directory
    assert (state / "scheduler.log").stat().st_uid == VICTIM
    assert (state / "scheduler.log").stat().st_mode & 0o077 == 0


# ---- the pieces, each on its own ----

def test_lock_log_and_records_are_never_opened_through_a_link(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("kept\n")
    state = tmp_path / "state"
    paths.allocations_dir(state).mkdir(parents=True)
    os.symlink(target, lock.lock_path(state))
    with pytest.raises(OSError):
        lock.acquire(state)
    assert target.read_text() == "kept\n"
    record = paths.allocations_dir(state) / ("k-" + "b" * 16 + ".json")
    target.write_text(json.dumps({"version": 1}))
    os.symlink(target, record)
    with pytest.raises(allocation.RecordError, match="Too many levels of symbolic links"):
        allocation.read_record(record)
    with pytest.raises(allocation.RecordError):
        allocation.read_record_bytes(record)


def test_a_record_cannot_make_anyone_remove_what_is_outside_its_channel(tmp_path: Path) -> None:
    state = tmp_path / "state"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "file").write_text("x")
    paths.channels_dir(state).mkdir(parents=True)
    base = allocation.AllocationRecord(
        id="r-" + "c" * 16, origin="gemini-run", device_ids=(),
        gpus=(allocation.GpuShare("GPU-x", 0, Share.from_float(0.1), 1),), channel_dir=str(outside),
        hook_library="x", created_at=time.time())
    for channel_dir in (str(outside), str(paths.channels_dir(state) / ".." / ".." / "precious"),
                        str(paths.channels_dir(state) / "precious")):
        record = allocation.AllocationRecord(**{**base.__dict__, "channel_dir": channel_dir})
        assert not allocation.remove_channel_dir(state, record)
    # Its own channel, but a link to elsewhere: the link goes, not what it points to.
    os.symlink(outside, paths.channel_dir(state, base.id))
    record = allocation.AllocationRecord(
        **{**base.__dict__, "channel_dir": str(paths.channel_dir(state, base.id))})
    assert not allocation.remove_channel_dir(state, record)
    assert (outside / "file").read_text() == "x"
    # A real channel with a link inside: the link is removed, its target kept.
    os.unlink(paths.channel_dir(state, base.id))
    paths.channel_dir(state, base.id).mkdir()
    os.symlink(outside, paths.channel_dir(state, base.id) / "escape")
    assert allocation.remove_channel_dir(state, record)
    assert not paths.channel_dir(state, base.id).exists()
    assert (outside / "file").read_text() == "x"


def test_check_owned_dir_names_what_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    securedir.check_owned_dir(tmp_path / "d", os.geteuid(), mode=0o700)
    os.symlink(tmp_path / "d", tmp_path / "link")
    with pytest.raises(securedir.InsecureDirectory, match="symbolic link"):
        securedir.check_owned_dir(tmp_path / "link", os.geteuid())
    with pytest.raises(securedir.InsecureDirectory, match="owned by uid"):
        securedir.check_owned_dir(tmp_path / "d", os.geteuid() + 1)


def test_a_link_in_the_users_own_state_dir_is_a_clear_error(tmp_path: Path) -> None:
    """Even in a directory that passes the check (here root's own), the lock is not followed."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    target = tmp_path / "target"
    target.write_text("kept\n")
    os.symlink(target, state / "run.lock")
    argv = [sys.executable, "-m", "vgpu_runtime.run", "--simulate-gpus", "1", "--state-dir",
            str(state), "--hook-library", "/bin/true", "--", "/bin/true"]
    done = subprocess.run(argv, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 125 and "run.lock" in done.stderr, done.stderr
    assert target.read_text() == "kept\n"
