"""A change of slices_per_gpu under running pods, through the kubelet emulator, the real plugin
and the real daemon: a GPU with a live allocation keeps its old devices (taking no new pod)
until the allocation ends, the other GPU takes the new count at once, and the log and an Event
on the Node say why."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.devkit.podnode import PodNode, until
from vgpu_runtime.gpus.simulated import SimulatedBackend

if TYPE_CHECKING:
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

TIMEOUT = 20.0


def slices(uuid: str, count: int) -> set[str]:
    return {f"{uuid}::{n}" for n in range(count)}


def gpus_of(pod: Any) -> set[str]:
    return {device.split("::")[0] for device in pod.device_ids()}


def node_events(api: FakeApiServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.node_events("node-1") if e["reason"] == reason]


async def test_a_slices_change_waits_on_the_gpu_with_a_live_allocation(
        pods: PodNode, api: FakeApiServer) -> None:
    kubelet = pods.node.kubelet
    gpu0, gpu1 = (g.uuid for g in SimulatedBackend(2).discover())
    await pods.start_daemon("--kubernetes", "true", "--kube-api-url", api.url,
                            "--simulate-gpus", "2", "--collect-grace", "0.3",
                            "--pod-resources-interval", "0.1")
    running = await kubelet.admit_pod("running", containers=[("main", 3)])
    assert running.admitted and gpus_of(running) == {gpu0}
    record = await until(lambda: pods.record_of(running, "main"), TIMEOUT, "its record")

    # The node's slices_per_gpu becomes 4; the plugin starts again with it (as it does when
    # its configuration file changes).
    (plugin,) = pods.node.plugins
    assert await plugin.stop() == 0
    await pods.node.start_plugin(slices=4, wait=False)
    await kubelet.wait_until(lambda: kubelet.capacity() == 14, TIMEOUT)
    devices = set(kubelet.devices[paths.RESOURCE_NAME])
    assert devices == slices(gpu0, 10) | slices(gpu1, 4)     # GPU 0 keeps its old 10
    assert kubelet.healthy_ids() == slices(gpu1, 4)          # and takes no new pod
    assert kubelet.in_use() == running.device_ids()
    state = json.loads((pods.state_dir / "slices.json").read_text())
    assert state[gpu0] == {"advertised": 10, "configured": 4, "waiting_for": [record.id]}
    assert state[gpu1] == {"advertised": 4, "configured": 4, "waiting_for": []}
    assert "slices_per_gpu change waits on this GPU" in pods.node.plugins[-1].log_text()
    # gemini-vgpu status (the daemon's node status) shows each GPU's own count.
    status = await pods.status()
    assert {g["uuid"]: (g["slices"], g["slices_allocated"]) for g in status["node"]["gpus"]} == {
        gpu0: (10, 3), gpu1: (4, 0)}
    (waiting,) = await until(lambda: node_events(api, "SlicesPerGpuChangeWaiting"), TIMEOUT,
                             "the Event")
    assert waiting["type"] == "Warning" and waiting["involvedObject"]["kind"] == "Node"
    assert gpu0 in waiting["message"] and record.id in waiting["message"]

    # A new pod goes to GPU 1, cut into 4: 3 slices are 3/4 of it.
    newer = await kubelet.admit_pod("newer", containers=[("main", 3)])
    assert newer.admitted and gpus_of(newer) == {gpu1}
    newer_record = await until(lambda: pods.record_of(newer, "main"), TIMEOUT, "its record")
    assert newer_record.gpus[0].share == Share.of_slices(3, 4)
    # The running pod restarts its container: kubelet replays its old devices, still served.
    assert await kubelet.restart_container("default", "running", "main") is not None

    # The running pod ends; the daemon collects its record; GPU 0 takes the new count.
    await kubelet.delete_pod("running")
    await kubelet.wait_until(lambda: kubelet.capacity() == 8, TIMEOUT)
    assert set(kubelet.devices[paths.RESOURCE_NAME]) == slices(gpu0, 4) | slices(gpu1, 4)
    assert kubelet.healthy_ids() == slices(gpu0, 4) | slices(gpu1, 4)
    # Each GPU's change is an Event: GPU 1's at the restart, GPU 0's now.
    changed = await until(lambda: len(node_events(api, "SlicesPerGpuChanged")) == 2 and
                          node_events(api, "SlicesPerGpuChanged"), TIMEOUT, "GPU 0's Event")
    assert [gpu1 in e["message"] for e in changed] == [True, False]
    assert gpu0 in changed[1]["message"] and changed[1]["type"] == "Normal"
    assert json.loads((pods.state_dir / "slices.json").read_text())[gpu0]["advertised"] == 4
    again = await kubelet.admit_pod("again", containers=[("main", 4)])
    assert again.admitted and gpus_of(again) == {gpu0}
