"""Fixtures for the hook's tests: the hook built strict, the fake driver, hooked children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import sharedbuild
from tests.childenv import python_path
from tests.daemon.inprocess import InProcessDaemon
from vgpu_runtime.devkit.daemon_node import (
    LIMIT,
    OTHER_UUID,
    UUID,
    DaemonNode,
    GiB,
    MiB,
    compile_program,
    start_node,
    stop_node,
)
from vgpu_runtime.devkit.daemon_process import make_record, wait_served

REPO = Path(__file__).resolve().parents[2]
PRELUDE = "from tests.hook.cudaprobe import *\nimport ctypes, json, os\n"

__all__ = ["LIMIT", "OTHER_UUID", "PRELUDE", "UUID", "DaemonNode", "GiB", "Hooked", "MiB",
           "compile_program", "fake_dir", "hook_lib", "hooked", "node", "pair_node", "start_node",
           "stop_node"]


@pytest.fixture(scope="session")
def hook_lib() -> Path:
    """The hook built strict, once per run for all workers (tests/sharedbuild.py)."""
    return sharedbuild.hook_library()


@pytest.fixture(scope="session")
def fake_dir() -> Path:
    return sharedbuild.fake_driver()


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


class InProcessNode(DaemonNode):
    """A DaemonNode whose daemon runs in the test process (tests/daemon/inprocess.py); the
    hooked programs are processes as ever and reach it through the same sockets and pages."""

    def restart_daemon(self) -> None:
        assert self.daemon.stop() == 0, self.daemon.logs()
        self.daemon = InProcessDaemon(self.state_dir,  # type: ignore[assignment]
                                      *self.daemon_args).wait_ready()
        for record in (self.record, *self.others):
            wait_served(record)


def start_inprocess_node(share: float = 0.5, *daemon_args: str) -> InProcessNode:
    root = Path(tempfile.mkdtemp(prefix="gmh-"))   # short: socket paths must fit 107 bytes
    state_dir = root / "state"
    daemon = InProcessDaemon(state_dir, *daemon_args).wait_ready()
    record = make_record(state_dir, gpus=((UUID, LIMIT, share),))
    wait_served(record)
    return InProcessNode(root, state_dir, daemon, record, daemon_args)  # type: ignore[arg-type]


@pytest.fixture
def node() -> Iterator[DaemonNode]:
    started = start_inprocess_node()
    yield started
    stop_node(started)


@pytest.fixture
def node_process() -> Iterator[DaemonNode]:
    """The daemon as a process: for tests that kill it."""
    started = start_node()
    yield started
    stop_node(started)


@pytest.fixture
def pair_node() -> Iterator[DaemonNode]:
    """Two allocations of 0.5 on one GPU: the token passes between them."""
    started = start_inprocess_node(0.5)
    started.allocate(0.5)
    yield started
    stop_node(started)
