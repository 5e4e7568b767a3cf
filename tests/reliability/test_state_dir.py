"""A state directory that is read-only or full, under the real plugin process.

The plugin runs in its own mount namespace (`unshare -m`, root only) where the state directory
is a read-only bind mount, or a tiny tmpfs filled to the last block; the kubelet emulator and
the node daemon stay outside and keep seeing the real directory."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess
from tests.integration.conftest import FAST_HEALTH, PluginNode
from tests.integration.test_plugin_through_kubelet import direct_allocate, record_files
from tests.reliability.test_plugin_faults import ADMISSION_ERROR, hello, whole_records
from vgpu_runtime.contracts import allocation
from vgpu_runtime.devkit.kubelet_emulator.plugin_process import PluginProcess

READ_ONLY = 'mount --bind "$S" "$S" && mount -o remount,bind,ro "$S"'
# A 512 KiB tmpfs holding a copy of the state directory (with the interposer in lib/), then
# filled to the last block.
FULL = ('cp -a "$S" "$T/copy" && mount -t tmpfs -o size=512k,mode=755 tmpfs "$S" && '
        'cp -a "$T/copy/." "$S/" && { dd if=/dev/zero of="$S/filler" bs=4k 2>/dev/null; true; }')


def namespaces_usable() -> bool:
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as probe:
        done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               f"mount -t tmpfs -o size=4k tmpfs {probe}"],
                              capture_output=True, timeout=10)
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not namespaces_usable(),
                                reason="needs root and unshare -m to mount in a namespace")


async def start_confined_plugin(node: PluginNode, setup: str, scratch: Path) -> PluginProcess:
    plugin = PluginProcess(node.kubelet_dir, node.state_dir,
                           args=[*FAST_HEALTH, "--log-format", "text"],
                           log_path=node.root / "plugin.log")
    plugin.argv = ["unshare", "-m", "--propagation", "private", "env",
                   f"S={node.state_dir}", f"T={scratch}", "sh", "-c",
                   f'{setup} && exec "$@"', "sh", *plugin.argv]
    await plugin.start()
    node.plugins.append(plugin)
    await node.wait_registered(20)
    return plugin


@pytest.mark.parametrize("fault,setup,errno_text", [
    ("read-only", READ_ONLY, "Read-only file system"),
    ("full", FULL, "No space left on device"),
], ids=["read_only", "full"])
async def test_allocate_fails_clearly_and_damages_nothing(
        node: PluginNode, daemon: DaemonProcess, tmp_path: Path, fault: str, setup: str,
        errno_text: str) -> None:
    """Pass: a new pod fails admission with a message naming the state directory, the errno
    and what to do; the kept allocation's record is byte-for-byte the same (in the plugin's view
    and on the host), its replay still answers, and the daemon still serves it."""
    first = await node.start_plugin()
    kept = await node.kubelet.admit_pod("kept", containers=[("main", 3)])
    assert kept.admitted, kept.message
    assert await first.stop() == 0
    await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 0)   # stream ended
    before = record_files(node.state_dir)
    (record,) = whole_records(node.state_dir).values()

    plugin = await start_confined_plugin(node, setup, tmp_path)
    seen_by_plugin = Path(f"/proc/{plugin.pid}/root") / node.state_dir.relative_to("/")
    assert record_files(seen_by_plugin) == before
    refused = await node.kubelet.admit_pod("new", containers=[("main", 5)])
    print(f"{fault}: {refused.message}")
    assert not refused.admitted and refused.reason == ADMISSION_ERROR
    assert "cannot store allocation" in refused.message and errno_text in refused.message
    assert str(node.state_dir) in refused.message and "delete the pod" in refused.message
    replayed = await direct_allocate(node, sorted(kept.device_ids()))
    assert replayed == kept.containers["main"].response
    assert record_files(seen_by_plugin) == before
    assert whole_records(seen_by_plugin).keys() == {record.id}
    assert not (seen_by_plugin / "channels" / allocation.id_for_devices(
        refused.containers["main"].device_ids)).exists(), "no empty channel left behind"
    assert await plugin.stop() == 0
    await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 0)

    assert record_files(node.state_dir) == before
    hello(record)
    again = await node.start_plugin()
    retry = await node.kubelet.admit_pod("retry", containers=[("main", 5)])
    assert retry.admitted, retry.message
    assert len(record_files(node.state_dir)) == 2
    assert await again.stop() == 0
