"""A real gemini-daemon process on a temporary state directory, and the records it serves."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from vgpu_runtime import allocation, paths
from vgpu_runtime.allocation import AllocationRecord, GpuShare
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.devkit.childenv import SOURCE_ROOT, child_env

T = TypeVar("T")

UUID_A = "GPU-11111111-2222-3333-4444-555555555555"
MiB = 1 << 20


def wait_for(predicate: Callable[[], T], timeout: float = 5.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def make_record(state_dir: Path, allocation_id: str | None = None,
                gpus: tuple[tuple[str, int, float], ...] = ((UUID_A, 100 * MiB, 0.5),),
                limit: float | None = None, origin: str = "kubelet",
                owner_pid: int | None = None, created_at: float | None = None
                ) -> AllocationRecord:
    allocation_id = allocation_id or allocation.new_run_id().replace("r-", "k-")
    record = AllocationRecord(
        id=allocation_id, origin=origin, device_ids=(),
        gpus=tuple(GpuShare(uuid, i, share, mem) for i, (uuid, mem, share) in enumerate(gpus)),
        channel_dir=str(paths.channel_dir(state_dir, allocation_id)),
        hook_library=paths.HOOK_LIBRARY_NAME, created_at=created_at or time.time(), limit=limit,
        owner_pid=owner_pid)
    allocation.write_record(state_dir, record)
    return record


def socket_of(record: AllocationRecord) -> Path:
    return paths.channel_socket(record.channel_dir)


def wait_served(record: AllocationRecord, timeout: float = 5.0) -> Path:
    path = socket_of(record)
    wait_for(path.exists, timeout, f"channel socket {path}")
    return path


class DaemonStatus:
    """What a test asks a daemon serving `state_dir` through its control socket."""

    state_dir: Path

    def status(self) -> Any:
        return client.request(self.state_dir)

    def allocation(self, allocation_id: str) -> Any:
        for entry in self.status()["allocations"]:
            if entry["id"] == allocation_id:
                return entry
        return None


class DaemonProcess(DaemonStatus):
    """gemini-daemon run as `python -m vgpu_runtime.daemon`, logs to a file."""

    def __init__(self, state_dir: Path, *extra: str, nofile: int | None = None,
                 wrap: tuple[str, ...] = ()) -> None:
        """`nofile`: the daemon's descriptor limit, soft and hard (it raises soft to hard);
        `wrap`: a command line the daemon's is appended to (it must exec it)."""
        self.state_dir = state_dir
        self.log_path = state_dir.parent / f"{state_dir.name}-scheduler.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process
        limit = [] if nofile is None else ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
        self.proc = subprocess.Popen(
            [*wrap, *limit, sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir",
             str(state_dir), "--poll-interval", "0.05", "--log-format", "json", *extra],
            cwd=SOURCE_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env=child_env())

    def wait_ready(self, timeout: float = 10.0) -> DaemonProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                client.request(self.state_dir)
            except OSError:
                return False
            return True
        wait_for(ready, timeout, "daemon control socket")
        return self

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self.log.close()
        return code
