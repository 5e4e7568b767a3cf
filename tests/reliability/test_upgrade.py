"""Rolling upgrade of the node daemon while a container runs: the install step (a real
`python -m vgpu_runtime.install` run, as the new DaemonSet pod's init container runs it), then
the daemon stopped and started again on the same state directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.childenv import child_env
from tests.daemon.helpers import REPO, DaemonProcess, wait_for
from tests.hook.conftest import Hooked
from tests.integration.conftest import PluginNode
from tests.reliability.clients import Container, GiB, MiB
from tests.reliability.test_daemon_faults import ONE_GIB_SLICES, admit_records, used_by
from vgpu_runtime import install, paths

RETIRED = install.LIBRARY_PREFIX + "0.0.1"     # an old version no record uses


def install_step(state_dir: Path, library: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.install", "--state-dir",
                           str(state_dir), "--library", str(library), "--log-format", "text"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)


def mapped_library(pid: int, name: str) -> tuple[str, int]:
    """(path, inode) of the preloaded library as the running process maps it."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(name):
            return fields[5], int(fields[4])
    raise AssertionError(f"{name} is not mapped by {pid}")


def share_ppm(daemon: DaemonProcess, allocation_id: str) -> int:
    return int(daemon.allocation(allocation_id)["gpus"][0]["share_ppm"])


async def test_rolling_upgrade_keeps_the_running_containers_library_and_quota(
        node: PluginNode, hooked: Hooked, tmp_path: Path) -> None:
    """Pass: the library file the container mapped is never replaced (same path, inode and
    bytes; a rebuilt file under the same version is refused), an unused old version is retired,
    and after the daemon restart the container keeps its share and its 3 GiB limit (counted
    once: 2.5 GiB held, 1 GiB more refused, 0.4 GiB more granted) and keeps launching."""
    state_dir = node.state_dir
    state_dir.mkdir(parents=True)
    first = install_step(state_dir, hooked.hook)
    assert first.returncode == 0, first.stderr
    installed = paths.default_hook_dir(state_dir) / paths.HOOK_LIBRARY_NAME
    original = installed.read_bytes()
    (installed.parent / RETIRED).write_bytes(b"an old interposer")

    await node.start_plugin(args=ONE_GIB_SLICES)
    (record,) = await admit_records(node, (3,))
    assert record.hook_library == paths.HOOK_LIBRARY_NAME
    daemon = DaemonProcess(state_dir).wait_ready()
    container = Container(Hooked(installed, hooked.fake), record)
    try:
        assert container.alloc(2 * GiB + 512 * MiB) == 0
        assert container.step("launch 0.2")["returns"]
        mapped = mapped_library(container.proc.pid, paths.HOOK_LIBRARY_NAME)
        assert mapped == (str(installed), os.stat(installed).st_ino)
        share = share_ppm(daemon, record.id)

        assert daemon.stop() == 0, daemon.logs()          # old daemon pod goes
        again = install_step(state_dir, hooked.hook)       # new pod's init step
        assert again.returncode == 0 and "already present" in again.stderr, again.stderr
        rebuilt = tmp_path / "rebuilt.so"
        rebuilt.write_bytes(original + b"\0")
        refused = install_step(state_dir, rebuilt)
        assert refused.returncode == 1 and "different content" in refused.stderr
        assert not (installed.parent / RETIRED).exists(), "unused old version retired"
        daemon = DaemonProcess(state_dir).wait_ready()     # new daemon pod

        assert container.alloc(GiB) == 2, "2.5 GiB held + 1 GiB must pass the 3 GiB limit"
        assert container.alloc(400 * MiB) == 0
        wait_for(lambda: used_by(daemon) == {record.id: 2 * GiB + 912 * MiB}, 5,
                 "holding counted once")
        after = container.step("launch 0.2")
        assert after["returns"] and after["stats"]["daemon_connects"] == 2
        assert share_ppm(daemon, record.id) == share
        assert mapped_library(container.proc.pid, paths.HOOK_LIBRARY_NAME) == mapped
        assert installed.read_bytes() == original
    finally:
        container.stop()
        assert daemon.stop() == 0, daemon.logs()
