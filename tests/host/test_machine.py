"""A machine runs the host daemon or the node DaemonSet, not both: each refuses to start over the
other's state, saying so (hoststate.py); the host daemon's other refusals at start, and its own
metrics port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.childenv import REPO
from tests.host.conftest import ENV, HostDaemon, Members
from tests.host.test_gpulock import Holder
from vgpu_runtime import hoststate
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.host.config import HostConfig
from vgpu_runtime.devkit.daemon_process import make_record
from vgpu_runtime.gpus.simulated import simulated_uuid

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the host daemon runs as root")


def run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=timeout)


def host_serve(root: Path, *extra: str, group: str = "root") -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "vgpu_runtime.hostctl", "serve", "--state-dir",
                str(root / "state"), "--host-group", group, "--gpu-lock-dir",
                str(root / "locks"), "--metrics-port", "0", "--simulate-gpus", "1", *extra])


@needs_root
def test_node_programs_refuse_the_host_daemons_state(root_dir: Path) -> None:
    state = root_dir / "state"
    state.mkdir()
    hoststate.write_marker(state, "gemini", paths.HOST_METRICS_PORT)
    for argv in ([sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state),
                  "--metrics-port", "0"],
                 [sys.executable, "-m", "device_plugin.main", "--state-dir", str(state),
                  "--simulate-gpus", "1", "--kubelet-dir", str(root_dir)],
                 [sys.executable, "-m", "vgpu_runtime.install", "--state-dir", str(state)]):
        refused = run(argv)
        assert refused.returncode == 1, refused.stderr
        said = refused.stderr
        assert "belongs to the host daemon" in said and "not both" in said, said
        assert "gemini-host uninstall" in said and "gemini.ai/vgpu.enabled-" in said
    assert not paths.lock_file(state).exists()          # the daemon took nothing
    assert not paths.health_file(state).exists()        # the plugin wrote nothing
    assert not (state / "lib").exists()                 # nor did the install step


@needs_root
@pytest.mark.parametrize("left", ["slices.json", "health.json", "kubelet record"])
def test_the_host_daemon_refuses_a_nodes_state(root_dir: Path, left: str) -> None:
    """health.json: the plugin writes it as it starts, so a running node pod is refused too."""
    state = root_dir / "state"
    state.mkdir()
    if left == "slices.json":
        paths.slices_file(state).write_text("{}")
    elif left == "health.json":
        paths.health_file(state).write_text("{}")
    else:
        make_record(state, gpus=((simulated_uuid(0), 1 << 30, 0.3),))
    refused = host_serve(root_dir)
    assert refused.returncode == 1, refused.stderr
    said = refused.stderr
    assert "holds a Kubernetes node's state" in said and "not both" in said, said
    assert (left if left != "kubelet record" else "1 kubelet allocation record") in said
    assert not paths.host_marker(state).exists()


@needs_root
def test_the_host_daemon_refuses_a_gpu_a_users_daemon_holds(root_dir: Path) -> None:
    holder = Holder(root_dir / "locks", 4242, simulated_uuid(0))
    try:
        refused = host_serve(root_dir)
    finally:
        holder.end()
    assert refused.returncode == 1 and "uid 4242" in refused.stderr, refused.stderr
    assert "the host daemon can serve the GPU once" in refused.stderr


@needs_root
def test_the_host_daemon_refuses_a_missing_group_and_an_open_state_dir(root_dir: Path) -> None:
    refused = host_serve(root_dir, group="gm-no-such-group")
    assert refused.returncode == 1 and "groupadd --system gm-no-such-group" in refused.stderr
    state = root_dir / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    refused = host_serve(root_dir)
    assert refused.returncode == 1 and "Another user could plant" in refused.stderr


def test_the_host_daemon_refuses_to_run_as_a_user(members: Members, root_dir: Path) -> None:
    refused = members.alice.run([sys.executable, "-m", "vgpu_runtime.hostctl", "serve",
                                 "--state-dir", str(root_dir / "state")])
    assert refused.returncode == 1 and "runs as root" in refused.stderr


def test_a_mark_that_is_not_roots_is_no_mark(members: Members, root_dir: Path) -> None:
    own = root_dir / "own"
    own.mkdir(mode=0o700)
    hoststate.write_marker(own, "gemini", paths.HOST_METRICS_PORT)
    assert hoststate.find_host(own) == own
    for path in (own, paths.host_marker(own)):
        os.chown(path, members.alice.uid, members.alice.gid)
    assert hoststate.read_marker(own) is None and hoststate.find_host(own) is None
    # A node program refuses it all the same: it must not start over it whoever wrote it.
    with pytest.raises(hoststate.MachineTaken):
        hoststate.refuse_node_program(own)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@needs_root
def test_the_host_daemon_has_its_own_metrics_port(root_dir: Path) -> None:
    assert HostConfig().metrics_port == paths.HOST_METRICS_PORT == 9402
    assert DaemonConfig().metrics_port == 9401
    assert HostConfig().metrics_address == "127.0.0.1"
    port = free_port()
    daemon = HostDaemon(root_dir, "root", "--simulate-gpus", "1", "--metrics-port", str(port))
    try:
        daemon.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'program="gemini-host"' in next(
            line for line in text.splitlines() if line.startswith("gemini_vgpu_build_info{"))
        marker = json.loads(paths.host_marker(daemon.state_dir).read_text())
        assert marker["metrics_port"] == port and marker["group"] == "root"
    finally:
        assert daemon.stop() == 0, daemon.logs()
