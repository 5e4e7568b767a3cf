"""The real device plugin as a child process (`python -m device_plugin.main`), and its controls."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from vgpu_runtime.contracts import paths
from vgpu_runtime.devkit.childenv import SOURCE_ROOT, child_env
from vgpu_runtime.devkit.hookdir import install_hook

_event_numbers = itertools.count()


class PluginProcess:
    """One run of the plugin; `start()` again after `stop()` is a plugin restart."""

    def __init__(self, kubelet_dir: Path, state_dir: Path, gpus: int = 2, slices: int = 10,
                 args: Sequence[str] = (), log_path: Path | None = None) -> None:
        self.kubelet_dir = kubelet_dir
        self.state_dir = state_dir
        self.control_dir = state_dir / "simulate"
        self.log_path = log_path or state_dir.parent / "plugin.log"
        self.argv = [
            sys.executable, "-m", "device_plugin.main",
            "--kubelet-dir", str(kubelet_dir), "--state-dir", str(state_dir),
            "--slices-per-gpu", str(slices), "--simulate-control-dir", str(self.control_dir),
            *(["--simulate-gpus", str(gpus)] if gpus else []),
            # No metrics port unless `args` names one: plugins of parallel runs would race for
            # 9403 (the last flag wins).
            "--metrics-port", "0", *args,
        ]
        self.process: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "plugin not started"
        return self.process.pid

    @property
    def socket_path(self) -> Path:
        return self.kubelet_dir / "gemini-vgpu.sock"

    @property
    def hook_dir(self) -> Path:
        """Where this plugin's Allocate looks for the interposer (--hook-dir, or its default)."""
        for i, arg in enumerate(self.argv):
            if arg.startswith("--hook-dir="):
                return Path(arg.split("=", 1)[1])
            if arg == "--hook-dir":
                return Path(self.argv[i + 1])
        return paths.default_hook_dir(self.state_dir)

    async def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        install_hook(self.hook_dir)   # as the node's install-hook step does before the plugin
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        env = child_env()
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            cwd=SOURCE_ROOT, env=env)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the plugin and wait for it; returns its exit status."""
        if self.process is None:
            return 0
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        code = self.process.returncode
        assert code is not None
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def exited(self) -> bool:
        return self.process is not None and self.process.returncode is not None

    def inject(self, event: dict[str, Any]) -> Path:
        """Drop a simulated health event; written aside then renamed, so never read half."""
        self.control_dir.mkdir(parents=True, exist_ok=True)
        name = f"{time.time_ns()}-{next(_event_numbers):06d}"
        tmp = self.control_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(event))
        target = self.control_dir / f"{name}.json"
        os.replace(tmp, target)
        return target

    def rss_bytes(self) -> int:
        """Resident memory from /proc/<pid>/status (VmRSS)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("VmRSS missing from /proc status")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
