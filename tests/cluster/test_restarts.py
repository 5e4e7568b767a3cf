"""Restarts on the real node: the kubelet restarted under running pods, and the node pod (plugin
and daemon) deleted under running workloads, one of them launching CUDA kernels, followed by a
container restart that kubelet answers with the Allocate response it kept."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import (
    NAMESPACE,
    NODE_IMAGE,
    REPO,
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
DAEMON_WAIT_S = 30.0   # the hook's GEMINI_HOOK_DAEMON_WAIT default (README)
# The program the container tests drive (standard library only), driven here by fixed lines.
PROGRAM = (REPO / "tests" / "containers" / "launch_loop.py").read_text()


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


# Drives the CUDA program one round at a time, each round a loop of 1 s from the moment it is
# sent (so a round held up does not make the next ones stale), until /tmp/stop exists; prints
# every answer with the round's wall time, then the interposer's counters of the program (its
# own GEMINI_HOOK_STATS: this driver is preloaded too, and would overwrite them).
DRIVER = """
import json, os, subprocess, sys, time
env = dict(os.environ, GEMINI_HOOK_STATS="/tmp/hook-stats")
program = subprocess.Popen([sys.executable, "-c", os.environ["PROGRAM"]], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
def ask(line):
    program.stdin.write(line + "\\n")
    program.stdin.flush()
    return json.loads(program.stdout.readline())
print(program.stdout.readline().strip(), flush=True)
print(json.dumps(ask("init")), flush=True)
while not os.path.exists("/tmp/stop"):
    start = time.time()
    answer = ask(f"loop {start} 1 1000000 4")
    answer["took"] = round(time.time() - start, 3)
    print(json.dumps(answer), flush=True)
program.stdin.write("quit\\n")
program.stdin.close()
program.wait()
print("--- stats")
print(open("/tmp/hook-stats").read())
print("--- end", flush=True)
"""


def launcher_pod(cluster: Cluster, name: str, slices: int) -> dict[str, Any]:
    """A CUDA program (tests/containers/launch_loop.py over the fake driver) launching gated
    kernels in rounds of 1 s until /tmp/stop exists (DRIVER), then its interposer's counters."""
    script = ("echo \"allocation=$GEMINI_ALLOCATION_ID\"; /usr/bin/python3 -c \"$DRIVER\";"
              " exec sleep 3600")
    return workload(cluster, name, slices, image=NODE_IMAGE, script=script,
                    env={"PROGRAM": PROGRAM, "DRIVER": DRIVER})


def records(state: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in paths.allocations_dir(state).glob("*.json")}


def exec_ok(cluster: Cluster, pod: str, *command: str) -> bool:
    return subprocess.run([cluster.env["kubectl"], "--kubeconfig", cluster.env["kubeconfig"],
                           "exec", "-n", "default", pod, "--", *command],
                          capture_output=True, timeout=60).returncode == 0


def test_deleting_the_node_pod_under_a_running_workload_loses_nothing(
        gemini_node: Cluster, cleanup: None) -> None:
    """The plugin and the daemon are the node pod's containers: deleting it restarts both. A
    pod that only holds its allocation and a CUDA program launching through the deletion both
    run on; every record is kept byte for byte; the new daemon serves their channels; a
    container restart after it gets kubelet's kept Allocate response (same allocation), which
    the new plugin and daemon still serve; the new plugin admits pods."""
    cluster = gemini_node
    survivor = workload(cluster, "survivor", 3)
    survivor["spec"]["restartPolicy"] = "Always"   # its container is killed below
    create(cluster, survivor, launcher_pod(cluster, "launcher", 3))
    pod = running(cluster, "survivor")
    env = environment(report(cluster, "survivor"))
    running(cluster, "launcher")
    allocation = env[paths.ENV_ALLOCATION_ID]
    state = Path(cluster.env["gemini_state"])
    binding = paths.bindings_dir(state) / f"{allocation}.json"
    # Slices freed by an earlier test's pod keep their allocation id: the binding file may name
    # that pod until the daemon's next PodResources pass binds it to this one.
    wait_until("the survivor's binding", lambda: binding.is_file()
               and "survivor" in binding.read_text(), 60)
    before = records(state)
    assert f"{allocation}.json" in before and len(before) >= 2, sorted(before)
    devices = checkpoint_devices(cluster, pod["metadata"]["uid"])
    old = node_pod(cluster)
    assert old is not None

    cluster.kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=true",
                    "--timeout=120s", timeout=180)
    new = wait_until("a new node pod Ready", lambda: (
        p if (p := node_pod(cluster)) and pod_ready(p)
        and p["metadata"]["uid"] != old["metadata"]["uid"] else None), 300,
        explain_node_pod(cluster))
    assert new["spec"]["nodeName"] == cluster.node

    # The workloads ran on, every record and the binding kept, and the new daemon serves the
    # channel: seen from inside the container, through the API server's exec to the kubelet.
    after = cluster.get("pod", "-n", "default", "survivor")
    assert container_state(after) == container_state(pod)
    assert records(state) == before
    assert "survivor" in binding.read_text()
    socket = f"{paths.CONTAINER_CHANNEL_DIR}/{paths.CHANNEL_SOCKET_NAME}"
    wait_until("the channel served again", lambda: exec_ok(cluster, "survivor", "test", "-S",
                                                          socket), 60)
    # The CUDA program launched through it all without a failed call, and its interposer
    # reconnected to the new daemon.
    time.sleep(3)   # a few rounds with the new daemon
    assert exec_ok(cluster, "launcher", "touch", "/tmp/stop")
    out = wait_until("the launcher's report", lambda: (
        text if "--- end" in (text := cluster.kubectl("logs", "-n", "default", "launcher",
                                                      check=False)) else None), 60)
    answers = [json.loads(line) for line in out.split("--- stats")[0].splitlines()
               if line.startswith("{")]
    loops = [a for a in answers if "kernels" in a]
    stats = dict(line.split("=", 1) for line in
                 out.split("--- stats")[1].split("--- end")[0].splitlines() if "=" in line)
    assert answers[1] == {"rc": 0, "rc_ctx": 0}, answers[:2]
    said = json.dumps({"rounds": loops, "stats": stats})
    assert len(loops) >= 5 and all(a["failures"] == 0 for a in loops), said
    # Kernels in every round but one that waited for the next daemon (its second ran out
    # meanwhile), and in the rounds after it: launching resumed with the new daemon.
    held = [i for i, a in enumerate(loops) if a["took"] > 2.0]
    assert all(a["kernels"] > 0 for i, a in enumerate(loops) if i not in held), said
    assert len(held) <= 1 and len(loops) - (held[-1] if held else 0) > 2, said
    # It reconnected to the new daemon. Meanwhile its launch waited for the next daemon, as
    # the README says a call does for GEMINI_HOOK_DAEMON_WAIT (30 s) before the hook gates
    # itself: the node pod was back sooner, so no launch went ungated and none timed out.
    assert int(stats["daemon_connects"]) >= 2, said
    assert int(stats["ungated_launches"]) == 0 and int(stats["token_timeouts"]) == 0, said
    assert int(stats["token_wait_max_ns"]) < DAEMON_WAIT_S * 1e9, said
    sys.stderr.write(f"launches paused {int(stats['token_wait_max_ns']) / 1e9:.1f} s while the "
                     "node pod was replaced\n")

    # The survivor's container dies; kubelet starts it again with the Allocate response it
    # kept (no new Allocate: the checkpoint's devices), and the new daemon serves it.
    container_id = container_state(after)[0].split("://", 1)[1]
    cluster.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)
    wait_until("the survivor's container restarted", lambda: (
        container_state(cluster.get("pod", "-n", "default", "survivor"))[1] == 1
        and phase(cluster, "survivor") == "Running"), 120,
        lambda: cluster.kubectl("describe", "pod", "-n", "default", "survivor", check=False))
    again = environment(report(cluster, "survivor"))
    assert again[paths.ENV_ALLOCATION_ID] == allocation
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"]
    assert checkpoint_devices(cluster, pod["metadata"]["uid"]) == devices
    wait_until("the restarted container's channel served", lambda: exec_ok(
        cluster, "survivor", "test", "-S", socket), 60)
    assert records(state)[f"{allocation}.json"] == before[f"{allocation}.json"]
    # And the new plugin admits pods.
    create(cluster, workload(cluster, "after-node-pod", 3))
    running(cluster, "after-node-pod")
