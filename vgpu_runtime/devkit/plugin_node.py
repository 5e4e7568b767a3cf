"""A node: the kubelet emulator and the real plugin process, in a temporary directory."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vgpu_runtime.devkit.kubelet_emulator import KubeletEmulator
from vgpu_runtime.devkit.kubelet_emulator.plugin_process import PluginProcess

# Short health timings keep the tests fast; the plugin's defaults are 10 s and 300 s.
FAST_HEALTH = ("--health-recheck-interval", "0.1", "--recovery-quiet-period", "0.5")
START_TIMEOUT = 15.0  # a cold interpreter on two busy cores


@dataclass
class PluginNode:
    root: Path
    kubelet: KubeletEmulator
    plugins: list[PluginProcess] = field(default_factory=list)

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "dp"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    async def start_plugin(self, gpus: int = 2, slices: int = 10, args: Sequence[str] = (),
                           wait: bool = True) -> PluginProcess:
        plugin = PluginProcess(self.kubelet_dir, self.state_dir, gpus=gpus, slices=slices,
                               args=[*FAST_HEALTH, "--log-format", "text", *args],
                               log_path=self.root / "plugin.log")
        await plugin.start()
        self.plugins.append(plugin)
        if wait:
            await self.wait_registered(gpus * slices)
        return plugin

    async def wait_registered(self, capacity: int, timeout: float = START_TIMEOUT) -> None:
        await self.kubelet.wait_until(
            lambda: self.kubelet.allocatable() == capacity == self.kubelet.capacity(), timeout)



@contextlib.asynccontextmanager
async def plugin_node() -> AsyncIterator[PluginNode]:
    """A started emulator on a fresh directory; plugins started on it are stopped at exit, and
    the plugin log is printed."""
    root = Path(tempfile.mkdtemp(prefix="gv-", dir="/tmp"))  # short: socket paths <= 107 bytes
    kubelet = KubeletEmulator(root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock")
    await kubelet.start()
    node = PluginNode(root, kubelet)
    try:
        yield node
    finally:
        for plugin in node.plugins:
            await plugin.stop()
        await kubelet.stop()
        log = (root / "plugin.log")
        if log.exists():
            print("---- plugin log ----\n" + log.read_text(errors="replace")[-6000:])
        shutil.rmtree(root, ignore_errors=True)
