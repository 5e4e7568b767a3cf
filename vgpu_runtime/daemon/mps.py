"""The MPS backend: the tenants' kernels run side by side on the SMs under one MPS server,
while the tokens still decide who may launch (BENCHMARKS.md, "Co-scheduling over MPS": on real
jobs the same tokens reach MPS's aggregate only over MPS).

One MPS control daemon serves a state directory (pipes and logs under it, so two daemons never
share one). The daemon adopts one that answers, since a daemon restarted under running tenants
must leave their MPS server alone. Where it manages it (gemini-run, a daemon on the host) it
starts one when none answers and quits it once no allocation is live; in Kubernetes a container
of its own runs it (gemini-mps-control), so that rolling the daemon out never kills the server
its tenants' contexts live in. Every tenant runs at 100 % of the threads: the shares are the
tokens', not MPS's.

Whoever starts the control daemon marks the /dev/shm it runs with (paths.mps_shm_id): a
container's MPS client needs the server's own /dev/shm, and the plugin mounts one into a
container only once the marks agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Collection
from pathlib import Path
from typing import Any

from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.atomicfile import write_atomic
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.troubles import Troubles

log = logging.getLogger("gemini-daemon.mps")
ASK_TIMEOUT = 10.0   # seconds for one command to the control daemon


def mps_control_setting() -> Any:
    """The setting naming the MPS control program, declared once for the daemon and
    gemini-mps-control (a fresh field for each configuration class)."""
    return cfg.setting("nvidia-cuda-mps-control",
                       "the MPS control program (a name on PATH, or a path)", cfg.text, "PROGRAM")


class MpsError(Exception):
    """The MPS control daemon cannot be had: the message says why and what to do."""


def shm_filesystem(mount_point: str = paths.SHM_DIR,
                   mountinfo: str | None = None) -> tuple[str, str] | None:
    """The filesystem mounted at `mount_point` (the top one): the directory of it mounted there
    ("/" for a filesystem of its own) and its type; None where nothing is mounted there."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as handle:
            mountinfo = handle.read()
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) >= 9 and fields[4] == mount_point and "-" in fields[6:]:
            after = fields.index("-", 6)
            found = (fields[3], fields[after + 1] if after + 1 < len(fields) else "")
    return found


def shm_refusal(mount_point: str = paths.SHM_DIR, mountinfo: str | None = None) -> str | None:
    """Why the control daemon should not run with this /dev/shm, or None: every tenant writes
    the server's /dev/shm, so it must be a tmpfs of its own (its size the cap on what they can
    fill), not a directory of one the host uses (/run) or of a disk."""
    found = shm_filesystem(mount_point, mountinfo)
    if found == ("/", "tmpfs"):
        return None
    what = ("nothing is mounted there" if found is None else
            f"it is {found[0]} of a {found[1]} filesystem" if found[0] != "/" else
            f"it is a {found[1]} filesystem")
    return (f"{mount_point} is not a tmpfs of its own ({what}): every tenant writes the MPS "
            "server's shared memory, so one could fill the host's filesystem. Mount a tmpfs of "
            "bounded size at the host directory first (e.g. mount -t tmpfs -o size=1g,mode=1777 "
            f"tmpfs {paths.DEFAULT_MPS_SHM_DIR}, or a systemd mount unit; daemonset/README.md, "
            "\"MPS\"), or set allow_shared_shm to accept it")


class MpsControl:
    def __init__(self, state_dir: str | Path, program: str, manage: bool = True,
                 shm_dir: str | Path = paths.SHM_DIR) -> None:
        self.state_dir = Path(state_dir)
        self.pipe_dir = paths.mps_pipe_dir(state_dir)
        self.log_dir = paths.mps_log_dir(state_dir)
        self.program = program
        self.manage = manage
        self.shm_mark = Path(shm_dir) / paths.mps_shm_name(state_dir)
        self.adopted = False

    def environment(self) -> dict[str, str]:
        """The control daemon's environment: its directories, and no interposer."""
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(CUDA_MPS_PIPE_DIRECTORY=str(self.pipe_dir),
                   CUDA_MPS_LOG_DIRECTORY=str(self.log_dir))
        return env

    def ask(self, command: str) -> subprocess.CompletedProcess[str]:
        """One command through the control client, as `echo COMMAND | nvidia-cuda-mps-control`."""
        return subprocess.run([self.resolved()], input=command + "\n", text=True,
                              capture_output=True, env=self.environment(), timeout=ASK_TIMEOUT,
                              check=False)

    def resolved(self) -> str:
        found = shutil.which(self.program)
        if found is None:
            raise MpsError(f"mps is on but the MPS control program {self.program!r} is not "
                           "found: install the NVIDIA driver's utilities, set mps_control to "
                           "its path, or turn mps off")
        return found

    def answers(self) -> bool:
        return self.ask("get_server_list").returncode == 0

    def make_dirs(self) -> None:
        for folder in (self.pipe_dir, self.log_dir):
            folder.mkdir(parents=True, exist_ok=True, mode=0o755)

    def mark_shm(self) -> None:
        """Before starting a control daemon: the same new token in this process's /dev/shm
        and in the state directory, which the plugin compares (module docstring)."""
        token = secrets.token_hex(16).encode() + b"\n"
        write_atomic(self.shm_mark, token, mode=0o644)
        write_atomic(paths.mps_shm_id(self.state_dir), token, mode=0o644)

    def unmark_shm(self) -> None:
        for mark in (self.shm_mark, paths.mps_shm_id(self.state_dir)):
            with contextlib.suppress(OSError):
                mark.unlink()

    def start(self) -> None:
        """Adopt the control daemon that answers on this state directory's pipes, or, where
        this daemon manages it, start one."""
        self.make_dirs()
        if self.answers():
            self.adopted = True
            log.info("MPS control daemon adopted", extra={"pipe_dir": str(self.pipe_dir)})
            return
        if not self.manage:
            # Tenants that start before it run without MPS (time-sliced, still under the
            # tokens); the plugin gives no container the pipes until the control daemon has
            # marked its /dev/shm.
            log.warning("mps is on and no MPS control daemon answers yet on this state "
                        "directory's pipes; its own container starts it (gemini-mps-control)",
                        extra={"pipe_dir": str(self.pipe_dir)})
            return
        self.mark_shm()
        started = subprocess.run([self.resolved(), "-d"], env=self.environment(), text=True,
                                 capture_output=True, timeout=ASK_TIMEOUT, check=False)
        if started.returncode != 0 or not self.answers():
            raise MpsError(f"the MPS control daemon did not start ({self.program} -d exited "
                           f"{started.returncode}: {(started.stderr or started.stdout).strip()}"
                           f"); its log is in {self.log_dir}")
        log.info("MPS control daemon started", extra={"pipe_dir": str(self.pipe_dir)})

    def quit(self) -> None:
        """Stop the control daemon (and its server) where this daemon manages it; only with no
        allocation live."""
        if not self.manage:
            return
        self.unmark_shm()
        try:
            done = self.ask("quit")
        except (MpsError, OSError, subprocess.TimeoutExpired) as err:
            log.warning("could not stop the MPS control daemon", extra={"error": str(err)})
            return
        log.info("MPS control daemon stopped", extra={"rc": done.returncode})

    def find(self) -> None:
        """Where another container runs it and none answered yet: ask again (the daemon's
        poll does, off its event loop, until it answers)."""
        if not self.adopted and not self.manage:
            with contextlib.suppress(MpsError, OSError, subprocess.TimeoutExpired):
                self.adopted = self.answers()
                if self.adopted:
                    log.info("MPS control daemon adopted", extra={"pipe_dir": str(self.pipe_dir)})

    async def poll(self, uids: Collection[int], troubles: Troubles) -> None:
        """Each poll of the daemon, given the uids its tenants' connections run as: say while
        they are several, and look for a control daemon another container starts."""
        several = several_users(uids)
        if several is None:
            troubles.clear("mps-users")
        else:
            troubles.report("tenants of several users share one MPS server", "mps-users",
                            several)
        if not self.adopted and not self.manage:
            await asyncio.to_thread(self.find)

    def status(self) -> dict[str, Any]:
        return {"pipe_dir": str(self.pipe_dir), "log_dir": str(self.log_dir),
                "adopted": self.adopted, "managed": self.manage}


def several_users(uids: Collection[int]) -> MpsError | None:
    """One MPS server serves one user: a context of another uid waits, inside CUDA, until every
    context of the first has ended. Nothing here can reorder that, so it is said while it
    lasts."""
    if len(set(uids)) <= 1:
        return None
    return MpsError(f"tenants run as uids {', '.join(map(str, sorted(set(uids))))}: MPS serves "
                    "one user at a time, so the others' CUDA waits until every context of the "
                    "first user's has ended; run the pods that share a GPU over MPS as one "
                    "user (securityContext.runAsUser)")
