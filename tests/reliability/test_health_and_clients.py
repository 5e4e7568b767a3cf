"""GPU health and client faults with real processes: an XID on one simulated GPU under running
containers, and a hooked container SIGKILLed while it holds the GPU-time token."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for, wait_served
from tests.hook.conftest import Hooked
from tests.hook.tokenkit import Rival, read_token_page
from tests.integration.conftest import PluginNode
from tests.integration.test_plugin_through_kubelet import direct_allocate
from tests.reliability.clients import Container, MiB
from tests.reliability.test_daemon_faults import ONE_GIB_SLICES, admit_records
from tests.reliability.test_plugin_faults import hello
from vgpu_runtime.contracts import allocation
from vgpu_runtime.gpus.simulated import simulated_uuid

GPU0, GPU1 = simulated_uuid(0), simulated_uuid(1)
# Long quotas: "at once" and "at the quota's end" are seconds apart (as in the token tests).
LONG_QUOTAS = ("--max-quota", "2", "--cycle", "4")


@pytest.fixture
def long_daemon(node: PluginNode) -> Iterator[DaemonProcess]:
    node.state_dir.mkdir(parents=True, exist_ok=True)
    proc = DaemonProcess(node.state_dir, *LONG_QUOTAS).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.logs()


async def test_xid_on_one_gpu_leaves_the_other_and_running_containers_alone(
        node: PluginNode, daemon: DaemonProcess, hooked: Hooked) -> None:
    """Pass: XID 79 on GPU 0 turns its 10 slices Unhealthy (capacity stays 20) and GPU 1's stay
    Healthy; the container running on GPU 0 keeps its connection, memory and launches; a new
    pod lands on GPU 1; a replayed Allocate on GPU 0 still answers; GPU 0 is Healthy again once
    the quiet period (0.5 s here) passes with a working probe, the documented rule."""
    plugin = await node.start_plugin(args=ONE_GIB_SLICES)
    (on_gpu0,) = await admit_records(node, (3,))
    assert on_gpu0.gpus[0].uuid == GPU0
    container = Container(hooked, on_gpu0)
    try:
        assert container.alloc(300 * MiB) == 0
        plugin.inject({"gpu": 0, "xid": 79})
        await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 10)
        assert node.kubelet.capacity() == 20
        assert {d.split("::")[0] for d in node.kubelet.healthy_ids()} == {GPU1}
        assert container.alloc(100 * MiB) == 0
        running = container.step("launch 0.2")
        assert running["returns"] and running["stats"]["daemon_connects"] == 1
        assert daemon.allocation(on_gpu0.id)["gpus"][0]["memory_used"] == 400 * MiB
        new = await node.kubelet.admit_pod("new", containers=[("main", 4)])
        assert new.admitted and {d.split("::")[0] for d in new.device_ids()} == {GPU1}
        replayed = await direct_allocate(node, sorted(on_gpu0.device_ids))
        assert replayed.envs["CUDA_VISIBLE_DEVICES"] == GPU0
        recovering = time.monotonic()
        await node.kubelet.wait_until(lambda: node.kubelet.allocatable() == 20, timeout=5)
        print(f"GPU 0 healthy again {time.monotonic() - recovering:.2f} s after the check")
        hello(on_gpu0)
    finally:
        container.stop()


async def test_sigkill_of_a_hooked_holder_hands_the_token_on_at_once(
        node: PluginNode, long_daemon: DaemonProcess, hooked: Hooked) -> None:
    """Pass: a hooked container killed while its grant is valid loses it at once (the rival is
    granted within 0.5 s, long before the 2 s quota the holder had), and the rival goes on."""
    await node.start_plugin(args=ONE_GIB_SLICES)
    held, other = await admit_records(node, (3, 3))
    holder = Container(hooked, held)
    wait_served(other)
    rival = Rival(other)
    try:
        holder.send("launch 30 nosync")
        wait_for(lambda: read_token_page(held)[2] > time.monotonic_ns(), 5, "holder granted")
        rival.request()
        rival.sock.settimeout(0.2)
        with pytest.raises(TimeoutError):              # still waiting: the holder holds
            rival.sock.recv(1, socket.MSG_PEEK)
        rival.sock.settimeout(10)
        _gate, _generation, valid_until = read_token_page(held)
        assert valid_until > time.monotonic_ns() + 0.5e9, "the holder's grant runs on"
        killed = time.monotonic_ns()
        holder.proc.kill()
        holder.proc.wait()
        rival.granted()
        handed_after = (time.monotonic_ns() - killed) / 1e9
        print(f"token handed on {handed_after * 1000:.0f} ms after SIGKILL of the holder")
        assert handed_after < 0.5 and time.monotonic_ns() < valid_until
        assert read_token_page(held)[2] == 0, "the dead holder's page is closed"
        tenants = {t["allocation"]: t for g in long_daemon.status()["gpus"]
                   for t in g["tenants"]}
        assert tenants[held.id]["revocations"] == 0, "released, not revoked"
        assert allocation.load_record(node.state_dir, held.id) == held
    finally:
        holder.stop()
        rival.close()
