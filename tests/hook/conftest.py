"""Fixtures for the hook's tests: the hook built strict, the fake driver, hooked children."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import python_path
from tests.fakecuda.builder import build_fake_driver
from tests.scheduler.helpers import DaemonProcess, make_record, wait_served
from vgpu_runtime.allocation import AllocationRecord
from vgpu_runtime.gpus.simulated import simulated_uuid
from vgpu_runtime.hook import build

MiB = 1 << 20
GiB = 1 << 30
LIMIT = 1 * GiB
UUID = simulated_uuid(0)
OTHER_UUID = simulated_uuid(1)

REPO = Path(__file__).resolve().parents[2]
PRELUDE = "from tests.hook.cudaprobe import *\nimport ctypes, json, os\n"


@pytest.fixture(scope="session")
def hook_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build.build_library(tmp_path_factory.mktemp("hook"), strict=True)


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_driver(tmp_path_factory.mktemp("fakecuda"))


class Hooked:
    """Runs programs with the hook preloaded in front of the fake driver."""

    def __init__(self, hook: Path, fake: Path) -> None:
        self.hook, self.fake = hook, fake

    def env(self, extra: Mapping[str, str] | None = None, preload: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMINI_", "FAKE_"))}
        env["LD_LIBRARY_PATH"] = str(self.fake)
        env["PYTHONPATH"] = python_path()
        env["GEMINI_TEST_HOOK"] = str(self.hook)
        if preload:
            env["LD_PRELOAD"] = str(self.hook)
        env.update(extra or {})
        return env

    def run(self, argv: list[str], extra: Mapping[str, str] | None = None,
            preload: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env(extra, preload), capture_output=True, text=True,
                              timeout=timeout)

    def start(self, code: str, extra: Mapping[str, str] | None = None
              ) -> subprocess.Popen[str]:
        """Start `code` under the hook with pipes; drive it with Hooked.step."""
        return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                                env=self.env(extra), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def line(proc: subprocess.Popen[str], go: bool = False) -> dict[str, Any]:
        """Optionally send a newline, then read one JSON line."""
        assert proc.stdin is not None and proc.stdout is not None
        if go:
            proc.stdin.write("\n")
            proc.stdin.flush()
        text = proc.stdout.readline()
        assert text, proc.stderr.read() if proc.stderr else "no output"
        result: dict[str, Any] = json.loads(text)
        return result

    def python(self, code: str, extra: Mapping[str, str] | None = None,
               preload: bool = True, timeout: float = 30) -> dict[str, Any]:
        """Run `code` under the hook; it must print one JSON object last, which is returned."""
        source = PRELUDE + textwrap.dedent(code)
        proc = self.run([sys.executable, "-c", source], extra, preload, timeout)
        assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
        last = proc.stdout.strip().splitlines()[-1]
        result: dict[str, Any] = json.loads(last)
        return result


@pytest.fixture(scope="session")
def hooked(hook_lib: Path, fake_dir: Path) -> Hooked:
    return Hooked(hook_lib, fake_dir)


def compile_program(source: str, out: Path, fake: Path, *flags: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(textwrap.dedent(source))
    cmd = ["gcc", "-std=gnu11", "-O1", "-Wall", "-Werror", "-Wno-unused-parameter",
           f"-I{REPO / 'vgpu_runtime' / 'hook' / 'include'}", str(src), "-o", str(out), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


@dataclass
class Node:
    """A REAL gemini-scheduler on a temporary state directory, with allocations on UUID."""
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


def start_node(share: float = 0.5, *daemon_args: str) -> Node:
    root = Path(tempfile.mkdtemp(prefix="gmh-"))   # short: socket paths must fit 107 bytes
    state_dir = root / "state"
    state_dir.mkdir()
    daemon = DaemonProcess(state_dir, *daemon_args).wait_ready()
    record = make_record(state_dir, gpus=((UUID, LIMIT, share),))
    wait_served(record)
    return Node(root, state_dir, daemon, record, daemon_args)


def stop_node(node: Node) -> None:
    node.daemon.stop()
    shutil.rmtree(node.root, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[Node]:
    started = start_node()
    yield started
    stop_node(started)


@pytest.fixture
def pair_node() -> Iterator[Node]:
    """Two allocations of 0.5 on one GPU: the token passes between them."""
    started = start_node(0.5)
    started.allocate(0.5)
    yield started
    stop_node(started)
