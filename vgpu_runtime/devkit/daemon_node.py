"""A real gemini-daemon on a temporary state directory, serving allocations on one simulated
GPU, for the interposer over the fake driver; and C programs compiled against the wire header."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from vgpu_runtime.allocation import AllocationRecord
from vgpu_runtime.devkit.daemon_process import DaemonProcess, make_record, wait_served
from vgpu_runtime.gpus.simulated import simulated_uuid
from vgpu_runtime.hook import build

MiB = 1 << 20
GiB = 1 << 30
LIMIT = 1 * GiB
UUID = simulated_uuid(0)
OTHER_UUID = simulated_uuid(1)


def compile_program(source: str, out: Path, fake: Path, *flags: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(textwrap.dedent(source))
    cmd = ["gcc", "-std=gnu11", "-O1", "-Wall", "-Werror", "-Wno-unused-parameter",
           f"-I{build.HOOK_DIR / 'include'}", str(src), "-o", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


@dataclass
class DaemonNode:
    """A REAL gemini-daemon on a temporary state directory, with allocations on UUID."""
    root: Path
    state_dir: Path
    daemon: DaemonProcess
    record: AllocationRecord
    daemon_args: tuple[str, ...] = ()
    others: list[AllocationRecord] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        return self.env_of(self.record, **extra)

    def env_of(self, record: AllocationRecord, **extra: str) -> dict[str, str]:
        return {"GEMINI_CHANNEL_DIR": record.channel_dir, "FAKE_CUDA_UUIDS": UUID,
                "FAKE_CUDA_TOTAL_MEM": str(16 * GiB), "GEMINI_HOOK_DAEMON_WAIT": "5", **extra}

    def used(self, record: AllocationRecord | None = None) -> int:
        entry = self.daemon.allocation((record or self.record).id)
        return int(entry["gpus"][0]["memory_used"]) if entry else -1

    def allocate(self, share: float, memory: int = LIMIT) -> AllocationRecord:
        """Another allocation (another container) on the same GPU."""
        record = make_record(self.state_dir, gpus=((UUID, memory, share),))
        wait_served(record)
        self.others.append(record)
        return record

    def restart_daemon(self) -> None:
        assert self.daemon.stop() == 0, self.daemon.logs()
        self.daemon = DaemonProcess(self.state_dir, *self.daemon_args).wait_ready()
        for record in (self.record, *self.others):
            wait_served(record)


def start_node(share: float = 0.5, *daemon_args: str) -> DaemonNode:
    root = Path(tempfile.mkdtemp(prefix="gmh-"))   # short: socket paths must fit 107 bytes
    state_dir = root / "state"
    state_dir.mkdir()
    daemon = DaemonProcess(state_dir, *daemon_args).wait_ready()
    record = make_record(state_dir, gpus=((UUID, LIMIT, share),))
    wait_served(record)
    return DaemonNode(root, state_dir, daemon, record, daemon_args)


def stop_node(node: DaemonNode) -> None:
    node.daemon.stop()
    shutil.rmtree(node.root, ignore_errors=True)
