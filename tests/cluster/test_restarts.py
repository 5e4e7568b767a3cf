"""Restarts on the real node: the kubelet restarted under running pods, and
the node pod (plugin and daemon) deleted under a running workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import (
    NAMESPACE,
    SCRIPT,
    SIMULATED_GPUS,
    SLICES_PER_GPU,
    Cluster,
    create,
    environment,
    explain_node_pod,
    node_pod,
    phase,
    pod_ready,
    report,
    vgpu_capacity,
    wait_until,
    workload,
)
from vgpu_runtime.contracts import paths

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

RESOURCE = "gemini.ai/vgpu"


def running(cluster: Cluster, name: str) -> dict[str, Any]:
    wait_until(f"{name} Running", lambda: phase(cluster, name) == "Running", 120,
               lambda: cluster.kubectl("describe", "pod", "-n", "default", name, check=False))
    pod: dict[str, Any] = cluster.get("pod", "-n", "default", name)
    return pod


def container_state(pod: dict[str, Any]) -> tuple[str, int]:
    (status,) = pod["status"]["containerStatuses"]
    return status["containerID"], status["restartCount"]


def checkpoint_devices(cluster: Cluster, uid: str) -> list[str]:
    """The device IDs kubelet's device-manager checkpoint holds for a pod's container."""
    path = Path(cluster.env["kubelet_root"]) / "device-plugins" / "kubelet_internal_checkpoint"
    data = json.loads(path.read_text())["Data"]
    return sorted(device
                  for entry in data["PodDeviceEntries"] or []
                  if entry["PodUID"] == uid and entry["ResourceName"] == RESOURCE
                  for devices in entry["DeviceIDs"].values() for device in devices)


def plugin_registrations(cluster: Cluster) -> int:
    logs = cluster.kubectl("logs", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=gemini-vgpu",
                           "-c", "device-plugin", "--tail=-1", check=False)
    return logs.count("registered with kubelet")


def restart(component: str) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "restart", component], check=True,
                   capture_output=True, timeout=300)


def test_a_kubelet_restart_keeps_running_pods_and_their_devices(
        gemini_node: Cluster, cleanup: None) -> None:
    cluster = gemini_node
    create(cluster, workload(cluster, "before-restart", 6))
    before = running(cluster, "before-restart")
    env = environment(report(cluster, "before-restart"))
    uid = before["metadata"]["uid"]
    devices = checkpoint_devices(cluster, uid)
    assert len(devices) == 6, devices
    registrations = plugin_registrations(cluster)

    restart("kubelet")

    # kubelet deletes the plugin's socket when it starts; the plugin registers again.
    wait_until("the plugin's registration with the restarted kubelet",
               lambda: plugin_registrations(cluster) > registrations, 120,
               explain_node_pod(cluster))
    total = str(SIMULATED_GPUS * SLICES_PER_GPU)
    wait_until("capacity and allocatable back", lambda: vgpu_capacity(cluster) == (total, total),
               120, explain_node_pod(cluster))
    # The running pod was neither restarted nor allocated again: same container, and the
    # checkpoint still holds its devices.
    after = cluster.get("pod", "-n", "default", "before-restart")
    assert after["status"]["phase"] == "Running"
    assert container_state(after) == container_state(before)
    assert checkpoint_devices(cluster, uid) == devices
    # The checkpoint is honoured: a new pod of 6 cannot get the first pod's GPU (4 free there).
    create(cluster, workload(cluster, "after-restart", 6))
    running(cluster, "after-restart")
    env_after = environment(report(cluster, "after-restart"))
    assert env_after["CUDA_VISIBLE_DEVICES"] != env["CUDA_VISIBLE_DEVICES"], (env, env_after)


def test_deleting_the_node_pod_under_a_running_workload_loses_nothing(
        gemini_node: Cluster, cleanup: None) -> None:
    cluster = gemini_node
    create(cluster, workload(cluster, "survivor", 3))
    pod = running(cluster, "survivor")
    env = environment(report(cluster, "survivor"))
    allocation = env[paths.ENV_ALLOCATION_ID]
    state = Path(cluster.env["gemini_state"])
    record = paths.allocations_dir(state) / f"{allocation}.json"
    binding = paths.bindings_dir(state) / f"{allocation}.json"
    # Slices freed by an earlier test's pod keep their allocation id: the binding file may name
    # that pod until the daemon's next PodResources pass binds it to this one.
    wait_until("the survivor's binding", lambda: binding.is_file()
               and "survivor" in binding.read_text(), 60)
    record_bytes = record.read_bytes()
    old = node_pod(cluster)
    assert old is not None

    cluster.kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=true",
                    "--timeout=120s", timeout=180)
    new = wait_until("a new node pod Ready", lambda: (
        p if (p := node_pod(cluster)) and pod_ready(p)
        and p["metadata"]["uid"] != old["metadata"]["uid"] else None), 300,
        explain_node_pod(cluster))
    assert new["spec"]["nodeName"] == cluster.node

    # The workload ran on, its record and binding kept, and the new daemon serves its channel:
    # seen from inside the container, through the API server's exec to the real kubelet.
    after = cluster.get("pod", "-n", "default", "survivor")
    assert container_state(after) == container_state(pod)
    assert record.read_bytes() == record_bytes
    assert "survivor" in binding.read_text()
    socket = f"{paths.CONTAINER_CHANNEL_DIR}/{paths.CHANNEL_SOCKET_NAME}"
    wait_until("the channel served again", lambda: subprocess.run(
        [cluster.env["kubectl"], "--kubeconfig", cluster.env["kubeconfig"], "exec", "-n",
         "default", "survivor", "--", "test", "-S", socket], capture_output=True,
        timeout=60).returncode == 0, 60)
    # And the new plugin admits pods.
    create(cluster, workload(cluster, "after-node-pod", 3))
    running(cluster, "after-node-pod")
