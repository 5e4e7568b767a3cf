"""Rolling upgrade of the node daemon while a container runs: the install step (a real
`python -m vgpu_runtime.install` run, as the new DaemonSet pod's init container runs it), then
the daemon stopped and started again on the same state directory. Hooks of the release before
wire version 3 (built from that commit's sources), running in containers under that release's
daemon, keep their token and memory limit across the upgrade to this tree's daemon. And records
in the format the plugin and daemon wrote before pod bindings (version 1), served after the
upgrade with the limits they had."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import child_env
from tests.daemon.helpers import REPO, DaemonProcess, wait_for
from tests.hook.conftest import Hooked
from tests.integration.conftest import PluginNode
from tests.older_release import NoOlderRelease, OlderRelease, extract
from tests.reliability.clients import Container, GiB, MiB
from tests.reliability.test_daemon_faults import ONE_GIB_SLICES, admit_records, used_by
from vgpu_runtime import hooklib, install
from vgpu_runtime.contracts import allocation, paths, wire
from vgpu_runtime.contracts.allocation import Binding, PodRef
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.channel.client import ChannelClient, ChannelClosed
from vgpu_runtime.devkit.daemon_process import wait_served
from vgpu_runtime.gpus.simulated import simulated_uuid

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


@pytest.fixture(scope="module")
def wire_2_release(tmp_path_factory: pytest.TempPathFactory) -> OlderRelease:
    """The release before wire version 3: its daemon and its hook (built here with gcc)."""
    try:
        return extract(2, tmp_path_factory.mktemp("wire2"))
    except NoOlderRelease as err:
        pytest.skip(f"needs the repository's history to build the wire-2 release: {err}")


def hellos(log_text: str) -> list[dict[str, Any]]:
    """The daemon's structured "hello" log entries."""
    entries = (json.loads(line) for line in log_text.splitlines() if line.startswith("{"))
    return [e for e in entries if e.get("msg") == "hello"]


def launch_together(containers: list[Container], seconds: float) -> list[list[int]]:
    """Every container launches (synchronising each kernel) for `seconds`, all at once: they
    contend for the token. What each saw return."""
    for container in containers:
        container.send(f"launch {seconds}")
    return [container.read()["returns"] for container in containers]


async def test_version_2_hooks_keep_their_token_and_memory_limit_across_the_upgrade(
        node: PluginNode, hooked: Hooked, wire_2_release: OlderRelease) -> None:
    """Pass: two containers of 3 slices each share a GPU (gated by the token), running the
    wire-2 release's hook under that release's daemon (which refuses a version-3 hello in a
    version-2 frame). After the upgrade to this tree's daemon, each hook says hello again in
    version 2 and gets its pages; the first keeps its 3 GiB limit (2.5 GiB held, counted once;
    1 GiB more refused, 0.4 GiB more granted), and both keep launching under the new daemon's
    token (each holds it in turn)."""
    state_dir = node.state_dir
    await node.start_plugin(args=ONE_GIB_SLICES)
    records = await admit_records(node, (3, 3))
    assert len({r.gpus[0].uuid for r in records}) == 1, "best fit packs them on one GPU"
    daemon = DaemonProcess(state_dir, wrap=wire_2_release.daemon_wrap()).wait_ready()
    with ChannelClient(wait_served(records[0])) as probe, pytest.raises(ChannelClosed) as refused:
        probe.hello()
    assert refused.value.status == wire.const("GM_ERR_BAD_VERSION"), refused.value
    assert "speaks 1 or 2" in refused.value.reason, "the wire-2 daemon runs"
    old_hook = Hooked(wire_2_release.hook, hooked.fake)
    containers = [Container(old_hook, record) for record in records]
    first = containers[0]
    try:
        assert first.alloc(2 * GiB + 512 * MiB) == 0
        assert all(launch_together(containers, 0.3))
        assert {h["version"] for h in hellos(daemon.logs())} == {2}

        assert daemon.stop() == 0, daemon.logs()
        upgraded_at = len(daemon.logs())
        daemon = DaemonProcess(state_dir).wait_ready()
        assert first.alloc(GiB) == 2, "2.5 GiB held + 1 GiB must pass the 3 GiB limit"
        assert first.alloc(400 * MiB) == 0
        wait_for(lambda: used_by(daemon).get(records[0].id) == 2 * GiB + 912 * MiB, 5,
                 "holding counted once")
        grants_before = daemon.status()["gpus"][0]["grants"]
        assert all(launch_together(containers, 0.5))
        (gpu,) = [g for g in daemon.status()["gpus"] if g["uuid"] == records[0].gpus[0].uuid]
        assert gpu["gate"] == "token" and gpu["grants"] > grants_before + 1, gpu
        assert all(t["achieved"] > 0 for t in gpu["tenants"]), gpu["tenants"]
        after = hellos(daemon.logs()[upgraded_at:])
        assert sorted(h["allocation"] for h in after) == sorted(r.id for r in records), after
        assert all(h["version"] == 2 and h["pages_passed"] == 2 for h in after), after
        for record in records:
            assert len(daemon.allocation(record.id)["connections"]) == 1
    finally:
        for container in containers:
            container.stop()
        assert daemon.stop() == 0, daemon.logs()


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
    installed = paths.default_hook_dir(state_dir) / hooklib.library_name()
    original = installed.read_bytes()
    (installed.parent / RETIRED).write_bytes(b"an old interposer")

    await node.start_plugin(args=ONE_GIB_SLICES)
    (record,) = await admit_records(node, (3,))
    assert record.hook_library == hooklib.library_name()
    daemon = DaemonProcess(state_dir).wait_ready()
    container = Container(Hooked(installed, hooked.fake), record)
    try:
        assert container.alloc(2 * GiB + 512 * MiB) == 0
        assert container.step("launch 0.2")["returns"]
        mapped = mapped_library(container.proc.pid, hooklib.library_name())
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
        assert mapped_library(container.proc.pid, hooklib.library_name()) == mapped
        assert installed.read_bytes() == original
    finally:
        container.stop()
        assert daemon.stop() == 0, daemon.logs()


# Literal records of the version before pod bindings, as its plugin wrote them (12 GiB GPU,
# 2 GiB reserve, 10 slices) and, for the first, as its daemon rewrote it once it had bound the
# pod and applied the annotations gemini.ai/vgpu-memory=3GiB and gemini.ai/vgpu-limit=0.6.
TODAYS_BOUND_RECORD = {
    "version": 1, "id": allocation.id_for_devices([f"{simulated_uuid(0)}::{n}" for n in range(5)]),
    "origin": "kubelet", "device_ids": [f"{simulated_uuid(0)}::{n}" for n in range(5)],
    "gpus": [{"uuid": simulated_uuid(0), "index": 0, "share": 0.5, "memory_limit": 3 * GiB,
              "default_memory": 5 * GiB}],
    "limit": 0.6, "channel_dir": "", "hook_library": hooklib.library_name(),
    "created_at": 1.7e9, "owner_pid": None,
    "pod": {"namespace": "ml", "name": "train", "container": "main", "uid": "uid-1"}}
TODAYS_RECORD = {
    "version": 1, "id": allocation.id_for_devices([f"{simulated_uuid(0)}::{n}" for n in (5, 6)]),
    "origin": "kubelet", "device_ids": [f"{simulated_uuid(0)}::{n}" for n in (5, 6)],
    "gpus": [{"uuid": simulated_uuid(0), "index": 0, "share": 0.2, "memory_limit": 2 * GiB,
              "default_memory": 2 * GiB}],
    "limit": None, "channel_dir": "", "hook_library": hooklib.library_name(),
    "created_at": 1.7e9, "owner_pid": None, "pod": None}


def write_todays_record(state_dir: Path, data: dict[str, object]) -> Path:
    data = dict(data, channel_dir=str(paths.channel_dir(state_dir, str(data["id"]))))
    path = allocation.record_path(state_dir, str(data["id"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


async def test_records_of_the_version_before_bindings_keep_their_limits(
        node: PluginNode, hooked: Hooked) -> None:
    """Pass: the record the old daemon had bound is served with the pod's 3 GiB and 0.6 cap,
    not the slices' 5 GiB (2.5 GiB held, 1 GiB more refused), the pod moves into the new
    daemon's binding file, both records stay byte for byte as they were (the daemon never
    writes one), and after a restart of the new daemon the same limits come from its file."""
    state_dir = node.state_dir
    bound_path = write_todays_record(state_dir, TODAYS_BOUND_RECORD)
    plain_path = write_todays_record(state_dir, TODAYS_RECORD)
    written = {p: p.read_bytes() for p in (bound_path, plain_path)}
    bound, plain = allocation.read_record(bound_path), allocation.read_record(plain_path)
    daemon = DaemonProcess(state_dir).wait_ready()
    container = Container(hooked, bound)
    try:
        assert container.alloc(2 * GiB + 512 * MiB) == 0
        assert container.alloc(GiB) == 2, "the pod's 3 GiB holds, not the slices' 5 GiB"
        entry = daemon.allocation(bound.id)
        assert entry["pod"] == {"namespace": "ml", "name": "train", "container": "main",
                                "uid": "uid-1"}
        assert (entry["limit"], entry["gpus"][0]["limit_ppm"]) == (0.6, 600_000)
        assert entry["gpus"][0]["memory_limit"] == 3 * GiB
        other = daemon.allocation(plain.id)
        assert other["gpus"][0]["memory_limit"] == 2 * GiB and other["pod"] is None
        assert other["gpus"][0]["share_ppm"] == 200_000
        assert allocation.load_binding(state_dir, bound.id) == Binding(
            bound.id, PodRef("ml", "train", "main", "uid-1"), Share.from_float(0.6), 3 * GiB)
        assert allocation.load_binding(state_dir, plain.id) is None
        assert {p: p.read_bytes() for p in written} == written

        assert daemon.stop() == 0, daemon.logs()
        daemon = DaemonProcess(state_dir).wait_ready()
        assert container.alloc(GiB) == 2
        assert container.alloc(400 * MiB) == 0
        wait_for(lambda: used_by(daemon).get(bound.id) == 2 * GiB + 912 * MiB, 5,
                 "holding counted once")
        assert daemon.allocation(bound.id)["gpus"][0]["limit_ppm"] == 600_000
        after = container.step("launch 0.2")
        assert after["returns"] and after["stats"]["daemon_connects"] == 2
        assert {p: p.read_bytes() for p in written} == written
    finally:
        container.stop()
        assert daemon.stop() == 0, daemon.logs()
