"""The MPS backend: the tenants' kernels run side by side on the SMs under one MPS server,
while the tokens still decide who may launch (BENCHMARKS.md, "Co-scheduling over MPS": on real
jobs the same tokens reach MPS's aggregate only over MPS).

The daemon owns one MPS control daemon per state directory (pipes and logs under it, so two
daemons never share one). It adopts one that answers, since a daemon restarted under running
tenants must leave their MPS server alone, and quits it only when no allocation is live. Every
tenant runs at 100 % of the threads: the shares are the tokens', not MPS's.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from vgpu_runtime.contracts import paths

log = logging.getLogger("gemini-daemon.mps")
ASK_TIMEOUT = 10.0   # seconds for one command to the control daemon


class MpsError(Exception):
    """The MPS control daemon cannot be had: the message says why and what to do."""


class MpsControl:
    def __init__(self, state_dir: str | Path, program: str) -> None:
        self.pipe_dir = paths.mps_pipe_dir(state_dir)
        self.log_dir = paths.mps_log_dir(state_dir)
        self.program = program
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

    def start(self) -> None:
        """Adopt the control daemon that answers on this state directory's pipes, or start one.
        """
        for folder in (self.pipe_dir, self.log_dir):
            folder.mkdir(parents=True, exist_ok=True, mode=0o755)
        if self.answers():
            self.adopted = True
            log.info("MPS control daemon adopted", extra={"pipe_dir": str(self.pipe_dir)})
            return
        started = subprocess.run([self.resolved(), "-d"], env=self.environment(), text=True,
                                 capture_output=True, timeout=ASK_TIMEOUT, check=False)
        if started.returncode != 0 or not self.answers():
            raise MpsError(f"the MPS control daemon did not start ({self.program} -d exited "
                           f"{started.returncode}: {(started.stderr or started.stdout).strip()}"
                           f"); its log is in {self.log_dir}")
        log.info("MPS control daemon started", extra={"pipe_dir": str(self.pipe_dir)})

    def quit(self) -> None:
        """Stop the control daemon (and its server); only with no allocation live."""
        try:
            done = self.ask("quit")
        except (MpsError, OSError, subprocess.TimeoutExpired) as err:
            log.warning("could not stop the MPS control daemon", extra={"error": str(err)})
            return
        log.info("MPS control daemon stopped", extra={"rc": done.returncode})

    def status(self) -> dict[str, Any]:
        return {"pipe_dir": str(self.pipe_dir), "log_dir": str(self.log_dir),
                "adopted": self.adopted}
