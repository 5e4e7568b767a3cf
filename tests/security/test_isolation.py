"""Isolation between containers, tried with the real plugin allocator and the real daemon.

Two containers, A and B, get slices of the same GPU through the plugin's Allocate (written to a
real state directory that a real gemini-daemon process serves). Then A tries, through the
wire protocol, everything it must not be able to do; and A's Allocate response is replayed the
way a container runtime applies it, to see what A can reach.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from device_plugin.allocator import Allocator
from device_plugin.slices import SliceTable
from tests.daemon.helpers import DaemonProcess, split_frames, wait_for, wait_served
from tests.gpu.replay import need_runtime, replayed
from vgpu_runtime import allocation, paths, wire
from vgpu_runtime import pluginconfig as plugin_config
from vgpu_runtime.allocation import AllocationRecord
from vgpu_runtime.daemon.channel.client import ChannelClient, ChannelClosed
from vgpu_runtime.daemon.control import control_socket
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.devkit.kubelet_emulator.runtime import ContainerConfig
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.pluginconfig import PluginConfig

C = wire.const
GIB = 1 << 30
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Tenant:
    record: AllocationRecord
    response: Any

    @property
    def socket(self) -> Path:
        return paths.channel_socket(self.record.channel_dir)


@dataclass
class Node:
    state_dir: Path
    config: PluginConfig
    daemon: DaemonProcess
    a: Tenant
    b: Tenant

    def used(self, tenant: Tenant) -> int:
        entry = self.daemon.allocation(tenant.record.id)
        return int(entry["gpus"][0]["memory_used"])


def _config(root: Path, strategy: str = "envvar") -> PluginConfig:
    (root / "k").mkdir(exist_ok=True)
    return plugin_config.check(PluginConfig(
        kubelet_dir=str(root / "k"), state_dir=str(root / "s"), simulate_gpus=2,
        simulate_memory=10 * GIB + GIB, memory_reserve=GIB, slices_per_gpu=10,
        device_list_strategy=strategy, hook_dir=str(root / "lib")))


def _allocator(config: PluginConfig) -> Allocator:
    gpus = SimulatedBackend(2, memory=config.simulate_memory).discover()
    return Allocator(config, SliceTable(gpus, config.slices_per_gpu))


def _tenant(allocator: Allocator, state_dir: Path, slices: list[str]) -> Tenant:
    response = allocator.allocate(slices)
    record = allocation.load_record(state_dir, response.annotations["gemini.ai/allocation-id"])
    assert record is not None
    return Tenant(record, response)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="gs-"))
    root.chmod(0o755)   # as /var/lib/gemini: other users may traverse to what they can reach
    config = _config(root)
    install_hook(config.host_hook_dir)
    state_dir = Path(config.state_dir)
    allocator = _allocator(config)
    gpu0 = allocator.table.gpus[0].uuid
    a = _tenant(allocator, state_dir, [f"{gpu0}::0", f"{gpu0}::1"])
    b = _tenant(allocator, state_dir, [f"{gpu0}::2", f"{gpu0}::3", f"{gpu0}::4"])
    # No pod binding in this test: hellos need not wait for PodResources.
    daemon = DaemonProcess(state_dir, "--bind-timeout", "0").wait_ready()
    wait_served(a.record)
    wait_served(b.record)
    yield Node(state_dir, config, daemon, a, b)
    assert daemon.stop() == 0, daemon.logs()
    shutil.rmtree(root, ignore_errors=True)


# ---- a container reaches only its own channel ----

def test_each_allocation_has_its_own_channel_directory_and_socket(node: Node) -> None:
    a_dir, b_dir = Path(node.a.record.channel_dir), Path(node.b.record.channel_dir)
    assert a_dir != b_dir and a_dir.parent == b_dir.parent
    assert node.a.socket.parent == a_dir and node.b.socket.parent == b_dir
    for directory in (a_dir, b_dir):
        mode = stat.S_IMODE(directory.stat().st_mode)
        assert not mode & stat.S_IWOTH and not mode & stat.S_IWGRP, oct(mode)
        assert directory.stat().st_uid == os.geteuid()
    control = control_socket(node.state_dir)
    assert stat.S_ISSOCK(control.stat().st_mode)
    assert stat.S_IMODE(control.stat().st_mode) == 0o600
    assert a_dir not in control.parents and b_dir not in control.parents


def test_an_allocate_response_mounts_only_its_own_channel_and_the_library_read_only(
        node: Node) -> None:
    for me, other in ((node.a, node.b), (node.b, node.a)):
        mounts = {(m.container_path, m.host_path, m.read_only) for m in me.response.mounts}
        assert mounts == {
            (paths.CONTAINER_LIB_DIR, str(node.config.host_hook_dir), True),
            (paths.CONTAINER_CHANNEL_DIR, me.record.channel_dir, True)}
        for _, host, _ in mounts:
            host_path = Path(host)
            # Nothing mounted holds the other's channel, the records or the control socket.
            for private in (Path(other.record.channel_dir), paths.allocations_dir(node.state_dir),
                            control_socket(node.state_dir)):
                assert host_path != private and host_path not in private.parents
        assert me.response.envs[paths.ENV_ALLOCATION_ID] == me.record.id
        assert not list(me.response.devices) and not list(me.response.cdi_devices)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
def test_the_control_socket_refuses_every_other_user(node: Node) -> None:
    """It shows every tenant's usage: only its owner may connect (0600)."""
    code = textwrap.dedent(f"""
        import os, socket, sys
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({str(control_socket(node.state_dir))!r})
        except PermissionError:
            sys.exit(0)
        sys.exit(1)
    """)
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
    # S8: nor can it reach a channel socket on the host (0666, for whatever uid the container
    # runs as; channels/ is 0700, and a container reaches its own through its bind mount).
    code = code.replace(repr(str(control_socket(node.state_dir))), repr(str(node.a.socket)))
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


# ---- what a client can do through its own channel ----

def _expect_dropped(client: ChannelClient, status: str, call: Any) -> str:
    try:
        call()
        frame = client.recv_frame()   # frames without a reply: the error comes next
    except ChannelClosed as err:
        assert err.status == C(status), err
        return err.reason
    assert frame is not None and wire.frame_type(frame) == C("GM_MSG_ERROR"), frame
    assert frame.status == C(status), wire.text_field(frame.reason)
    assert client.recv_frame() is None, "the daemon must close the connection after ERROR"
    return wire.text_field(frame.reason)


def test_a_client_cannot_act_for_another_allocation_nor_outside_its_own(node: Node) -> None:
    with ChannelClient(node.b.socket) as b:
        b.hello()
        assert b.reserve(0, 300 * MiB).granted
        b_used = node.used(node.b)
        # Claiming B's pid in hello changes nothing: identity comes from the socket.
        with ChannelClient(node.a.socket) as a:
            hello = a.hello(pid=b.sock.fileno() and os.getpid())
            assert hello.allocation_id == node.a.record.id and len(hello.gpus) == 1
            assert hello.gpus[0].memory_limit == node.a.record.gpus[0].memory_limit
        attempts = [
            ("GM_ERR_BAD_GPU", lambda c: c.reserve(1, MiB)),            # a GPU index it lacks
            ("GM_ERR_BAD_GPU", lambda c: c.set(7, MiB, C("GM_MEM_POOL"))),
            ("GM_ERR_BAD_GPU", lambda c: c.release(2**32 - 1, MiB)),
            ("GM_ERR_MALFORMED", lambda c: c.set(0, MiB, 99)),         # a kind that is no kind
            ("GM_ERR_MALFORMED", lambda c: c.release(0, MiB)),         # what B holds, not A
            ("GM_ERR_BAD_GPU", lambda c: c.request_token(1)),          # B's GPU index? no: A's 1
            ("GM_ERR_BAD_GPU", lambda c: c.release_token(3)),
            ("GM_ERR_BAD_GPU", lambda c: c.report_usage(5, 1, 2)),
        ]
        for status, attempt in attempts:
            with ChannelClient(node.a.socket) as a:
                a.hello()
                _expect_dropped(a, status, lambda a=a, attempt=attempt: attempt(a))
            assert node.used(node.b) == b_used
        assert b.reserve(0, 0).used == b_used   # B's own connection never noticed


def test_a_client_cannot_raise_its_memory_limit(node: Node) -> None:
    limit = node.a.record.gpus[0].memory_limit
    with ChannelClient(node.a.socket) as a, ChannelClient(node.a.socket) as a2:
        a.hello()
        a2.hello()
        granted = a.reserve(0, limit)
        assert granted.granted and granted.limit == limit
        refused = a2.reserve(0, 1)                  # another process of A: same limit
        assert not refused.granted and refused.used == limit
        # An absolute SET is applied (it reports what exists) but raises nothing: still refused.
        over = a2.set(0, limit, C("GM_MEM_CONTEXT"))
        assert over.status == C("GM_ERR_OVER_LIMIT") and over.limit == limit
        assert not a2.reserve(0, 1).granted
        # Replies name A's own use and limit only, never B's.
        assert {over.used, refused.used} <= {limit, 2 * limit}
    wait_for(lambda: node.used(node.a) == 0, 5, "A's memory given back")


def test_usage_cannot_be_read_through_a_channel(node: Node) -> None:
    """The control socket's status question, asked on a channel, is a malformed frame."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(node.a.socket))
        sock.sendall(b'{"op": "status"}\n')
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    error = wire.decode(data)
    assert wire.frame_type(error) == C("GM_MSG_ERROR")
    assert node.b.record.id.encode() not in data and b"memory_used" not in data


# ---- the container's view: the response applied by a real container runtime ----

# Stdlib only (the container holds nothing of the project): the HELLO is encoded here and its
# reply's bytes decoded here.
INSIDE = textwrap.dedent("""
    import json, os, socket, sys
    channel = os.environ["GEMINI_CHANNEL_DIR"]
    listing = sorted(os.listdir(channel))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(1.0)
        sock.connect(os.path.join(channel, sys.argv[1]))
        sock.sendall(bytes.fromhex(sys.argv[3]))
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except TimeoutError:
            pass
    try:
        open(os.path.join(channel, "planted"), "w").close()
        writable = True
    except OSError:
        writable = False
    print(json.dumps({"listing": listing, "reply": reply.hex(), "writable": writable,
                      "lib": sorted(os.listdir(sys.argv[2]))}))
""")


def test_a_container_sees_only_its_own_channel(node: Node, tmp_path: Path) -> None:
    """The container runs as a non-root uid; channels/ on the host is 0700 (S8), and the
    container still reaches its own channel through the bind mount of the leaf."""
    need_runtime()
    assert stat.S_IMODE(paths.channels_dir(node.state_dir).stat().st_mode) == 0o700
    lib = node.config.host_hook_dir
    lib.mkdir(parents=True, exist_ok=True)
    (lib / paths.HOOK_LIBRARY_NAME).unlink()
    (lib / paths.HOOK_LIBRARY_NAME).write_bytes(b"stand-in")
    hello = wire.new(C("GM_MSG_HELLO"), proto_version=wire.VERSION, pid=1)
    hello.h.seq = 1
    # The stand-in library is no ELF file: the loader says so and the program runs on.
    config = ContainerConfig(args=("python3", "-c", INSIDE, paths.CHANNEL_SOCKET_NAME,
                                   paths.CONTAINER_LIB_DIR, wire.encode(hello).hex()))
    with replayed(node.a.response, config) as container:
        seen = container.read_json()
        assert container.wait() == 0, container.errors()
    own = sorted(os.listdir(node.a.record.channel_dir))
    assert seen["listing"] == own and paths.CHANNEL_SOCKET_NAME in own
    reply = split_frames(bytes.fromhex(seen["reply"]))[0]
    assert wire.frame_type(reply) == C("GM_MSG_HELLO_REPLY"), reply
    assert wire.text_field(reply.allocation_id) == node.a.record.id
    assert not seen["writable"], "the channel mount must be read-only"
    assert seen["lib"] == [paths.HOOK_LIBRARY_NAME]
    assert not (Path(node.a.record.channel_dir) / "planted").exists()
