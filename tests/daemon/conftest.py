from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.daemon.helpers import DaemonProcess
from tests.daemon.inprocess import InProcessDaemon
from vgpu_runtime.devkit.kubelet_emulator import KubeletEmulator
from vgpu_runtime.devkit.plugin_node import PluginNode
from vgpu_runtime.devkit.podnode import PodNode

if TYPE_CHECKING:
    from vgpu_runtime.devkit.fakeapi import FakeApiServer


@pytest.fixture
def state_dir() -> Iterator[Path]:
    # Short, under /tmp: Unix socket paths must fit in 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="gm-"))
    yield path / "state"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(state_dir: Path) -> Iterator[InProcessDaemon]:
    """The real daemon in this process (inprocess.py): sockets, records and pages as ever."""
    served = InProcessDaemon(state_dir).wait_ready()
    yield served
    assert served.stop() == 0, served.logs()


@pytest.fixture
def daemon_process(state_dir: Path) -> Iterator[DaemonProcess]:
    """gemini-daemon as a process: for what proves the program's wiring."""
    state_dir.mkdir(parents=True, exist_ok=True)
    proc = DaemonProcess(state_dir).wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, proc.logs()


@pytest.fixture
async def pods() -> AsyncIterator[PodNode]:
    root = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))
    kubelet = KubeletEmulator(root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock")
    await kubelet.start()
    node = PluginNode(root, kubelet)
    pn = PodNode(node)
    try:
        await node.start_plugin()
        # A pod without slices, as every real node has (this daemon's own, for one).
        await kubelet.admit_pod("gemini-node", "kube-system", containers=[("daemon", 0)])
        yield pn
    finally:
        if pn.daemon is not None:
            code = pn.daemon.stop()
            assert code == 0, pn.daemon.logs()
        for plugin in node.plugins:
            await plugin.stop()
        await kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    pytest.importorskip("kubernetes", reason="the fake API server uses the official client")
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

    with FakeApiServer() as server:
        server.add_node("node-1")
        yield server
