"""The MPS backend as a pod sees it, in real runc containers over the kubelet emulator: the
plugin (mps on) refuses a pod until the control daemon of the node's own container
(gemini-mps-control, here on the fake control program) has marked its /dev/shm; then the
container gets that /dev/shm and the control daemon's pipes, and its client reaches the control
daemon through them. On the GPU: tests/gpu/test_mps_gpu.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.childenv import REPO, child_env
from tests.containers.node import ContainerNode, node_on_fake_api
from tests.daemon.helpers import wait_for
from tests.mpsfake import control_answers, fake_mps_control, quit_control
from vgpu_runtime.contracts import paths

# In the container: what it was given, and the control daemon's answer through the pipes.
PROBE = textwrap.dedent("""
    import json, os, socket
    print(json.dumps({"ready": True}), flush=True)
    pipes = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(os.path.join(pipes, "control"))
    client.sendall(b"get_server_list\\n")
    client.shutdown(socket.SHUT_WR)
    answered = client.recv(100) == b""
    marks = {n: open(os.path.join("/dev/shm", n)).read() for n in os.listdir("/dev/shm")
             if n.startswith("gemini-mps-")}
    print(json.dumps({"pipes": pipes, "answered": answered, "marks": marks}), flush=True)
""")


@pytest.fixture(scope="module")
def mps_node() -> Iterator[ContainerNode]:
    with node_on_fake_api(plugin_extra=("--mps", "on", "--mps-shm-dir", paths.SHM_DIR)) as node:
        yield node


def test_a_pod_runs_over_the_nodes_mps_control_daemon(mps_node: ContainerNode) -> None:
    node = mps_node
    state = node.state_dir
    program = fake_mps_control(node.root)
    mark = Path(paths.SHM_DIR) / paths.mps_shm_name(state)
    # Before the control daemon runs: refused, saying why (the real kubelet rejects the pod:
    # tests/cluster/test_mps.py).
    early = node.loop.call(node.kubelet.admit_pod("early", containers=[("main", 3)]))
    assert not early.admitted and "no MPS control daemon has started" in early.message, \
        early.message
    control = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.mpscontrol", "--state-dir", str(state),
         "--mps-control", str(program), "--log-format", "text"],
        cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: control_answers(state, program), 20, "the control daemon")
        pod = node.admit("tenant", 3)
        tenant = node.start(pod, args=("python3", "-c", PROBE))
        seen = tenant.read()
        assert seen["pipes"] == paths.CONTAINER_MPS_PIPE_DIR
        assert seen["answered"], "the container's client reached the node's control daemon"
        assert seen["marks"][mark.name] == mark.read_text(), "the server's own /dev/shm"
        log = (paths.mps_log_dir(state) / "control.log").read_text()
        assert "get_server_list" in log
    finally:
        control.terminate()
        control.wait(30)
        quit_control(state, program)
        mark.unlink(missing_ok=True)
