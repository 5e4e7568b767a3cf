"""The real node daemon for the tests here, keeping PYTHONPATH.

tests.scheduler.helpers.DaemonProcess replaces PYTHONPATH with the repository root. On the GPU
machine scripts/gpu-check puts carried wheels (cffi, which the daemon's wire module needs) on
PYTHONPATH, so the daemon here is started with the root in front of what is there instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.scheduler.helpers import REPO, DaemonProcess


def python_path() -> str:
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


class NodeDaemon(DaemonProcess):
    def __init__(self, state_dir: Path, *extra: str) -> None:
        self.state_dir = state_dir
        self.log_path = state_dir.parent / f"{state_dir.name}-scheduler.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vgpu_runtime.scheduler", "--state-dir", str(state_dir),
             "--poll-interval", "0.05", "--log-format", "json", *extra],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": python_path()})
