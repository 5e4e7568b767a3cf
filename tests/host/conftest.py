"""Two real Unix users, a group, and the host daemon run by hand, for the shared-host tests.

The users and the group are made with useradd/groupadd for the module and removed after it
(root only: the tests skip, saying why, elsewhere). Their processes run through setpriv with
their own uid, gid and groups (--init-groups: the group's membership is real). To run this
machine's Python wherever it lives (under /root here) they keep CAP_DAC_READ_SEARCH, which
reads and searches but never writes, owns or connects; what a user may read is checked by a
process without any capability (`bare`).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import REPO, child_env
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.host import client as host_client
from vgpu_runtime.devkit.daemon_process import wait_for

NEEDS = ("useradd", "userdel", "groupadd", "groupdel", "setpriv")
missing = [tool for tool in NEEDS if shutil.which(tool) is None]


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def argv(self, argv: list[str], caps: tuple[str, ...] = ("dac_read_search",)) -> list[str]:
        """`argv` run as this user, with its groups; `caps` kept (none: a plain user)."""
        wanted = ",".join(f"+{cap}" for cap in caps)
        keep = [f"--inh-caps={wanted}", f"--ambient-caps={wanted}"] if caps else [
            "--inh-caps=-all"]
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                *keep, *argv]

    def bare(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        """`argv` run as this user without any capability, as a login would run it."""
        return subprocess.run(self.argv(argv, caps=()), capture_output=True, text=True,
                              timeout=30, env=ENV)

    def run(self, argv: list[str], **popen: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=60,
                              cwd=REPO, env=popen.pop("env", ENV), **popen)

    def start(self, argv: list[str], env: dict[str, str] | None = None,
              caps: tuple[str, ...] = ("dac_read_search",)) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(argv, caps), cwd=REPO, env=env or ENV, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)


ENV = child_env()
for _name in ("GEMINI_STATE_DIR", "GEMINI_SIMULATE_GPUS", "XDG_RUNTIME_DIR"):
    ENV.pop(_name, None)


@dataclass(frozen=True)
class Members:
    group: str
    gid: int
    alice: User
    bob: User
    outsider: User      # a user of the machine who is not in the group


def _add_user(name: str, group: str | None) -> User:
    argv = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group"]
    subprocess.run([*argv, *(["-G", group] if group else []), name], check=True,
                   capture_output=True)
    import pwd

    entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid)


@pytest.fixture(scope="module")
def members() -> Iterator[Members]:
    if os.geteuid() != 0 or missing:
        pytest.skip("needs root to create Unix users (CI runs as root)" if os.geteuid() != 0
                    else f"needs {', '.join(missing)}")
    tag = f"{os.getpid() % 100000}"
    group = f"gmhost{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    import grp

    made: list[str] = []
    try:
        alice = _add_user(f"gmalice{tag}", group)
        made.append(alice.name)
        bob = _add_user(f"gmbob{tag}", group)
        made.append(bob.name)
        outsider = _add_user(f"gmout{tag}", None)
        made.append(outsider.name)
        yield Members(group, grp.getgrnam(group).gr_gid, alice, bob, outsider)
    finally:
        import pwd

        for name in made:
            end_processes_of(pwd.getpwnam(name).pw_uid)
            # --force: userdel refuses a user with a process, and one may be exiting yet.
            subprocess.run(["userdel", "--force", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def end_processes_of(uid: int) -> None:
    """SIGKILL, by pid, what is left running as a user this fixture made (a job whose
    gemini-run a failed test killed): userdel refuses a user with processes."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A short directory of root's that every user may pass (socket paths fit 107 bytes),
    with a sticky lock directory like /run/lock."""
    root = Path(tempfile.mkdtemp(prefix="gmh-"))
    os.chmod(root, 0o755)
    locks = root / "locks"
    locks.mkdir()
    os.chmod(locks, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


class HostDaemon:
    """gemini-host serve, run by hand as the unit would run it, on `root`/state."""

    def __init__(self, root: Path, group: str, *extra: str) -> None:
        self.state_dir = root / "state"
        self.log_path = root / "host.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vgpu_runtime.hostctl", "serve", "--state-dir",
             str(self.state_dir), "--host-group", group, "--gpu-lock-dir", str(root / "locks"),
             "--metrics-port", "0", "--poll-interval", "0.05", "--log-format", "text", *extra],
            cwd=REPO, env=ENV, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> HostDaemon:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"host daemon exited {self.proc.returncode}:\n"
                                     f"{self.logs()}")
            return paths.host_socket(self.state_dir).exists()
        wait_for(ready, 15, "the host socket")
        return self

    def status(self) -> dict[str, Any]:
        """Root's view, through the same socket the users have."""
        return host_client.request(self.state_dir, "status")

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(15)
        self.log.close()
        return code


def mode_of(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def wait_exit(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err

