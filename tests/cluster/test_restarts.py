"""Restarts on the real node: the kubelet restarted under running pods; the node pod (plugin
and daemon) deleted under running workloads, one of them launching CUDA kernels, followed by a
container restart that kubelet answers with the Allocate response it kept; the daemon's container
alone killed under a CUDA program that holds memory and launches."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.samples import Sample

from tests.cluster.conftest import (
    NAMESPACE,
    NODE_IMAGE,
    NODE_PODS,
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
from tests.scrape import fetch, samples
from vgpu_runtime.contracts import allocation, paths

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

RESOURCE = "gemini.ai/vgpu"
DAEMON_WAIT_S = 30.0   # the hook's GEMINI_HOOK_DAEMON_WAIT default (README)
DAEMON_METRICS_PORT = 9401   # daemonset/base/node/daemonset.yaml, the daemon's `metrics` port
OUT_OF_MEMORY = 2            # CUDA_ERROR_OUT_OF_MEMORY
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
    logs = cluster.kubectl("logs", "-n", NAMESPACE, "-l", NODE_PODS,
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
# own GEMINI_HOOK_STATS: this driver is preloaded too, and would overwrite them). The lines of
# BEFORE and AFTER (`;` between them) are asked once after init and once after the rounds,
# each answer with its line as "step".
DRIVER = """
import json, os, subprocess, sys, time
env = dict(os.environ, GEMINI_HOOK_STATS="/tmp/hook-stats")
program = subprocess.Popen([sys.executable, "-c", os.environ["PROGRAM"]], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
def ask(line):
    program.stdin.write(line + "\\n")
    program.stdin.flush()
    return json.loads(program.stdout.readline())
def steps(name):
    for line in filter(None, os.environ.get(name, "").split(";")):
        print(json.dumps(dict(ask(line), step=line)), flush=True)
print(program.stdout.readline().strip(), flush=True)
print(json.dumps(ask("init")), flush=True)
steps("BEFORE")
while not os.path.exists("/tmp/stop"):
    start = time.time()
    answer = ask(f"loop {start} 1 1000000 4")
    answer["took"] = round(time.time() - start, 3)
    print(json.dumps(answer), flush=True)
steps("AFTER")
program.stdin.write("quit\\n")
program.stdin.close()
program.wait()
print("--- stats")
print(open("/tmp/hook-stats").read())
print("--- end", flush=True)
"""


def launcher_pod(cluster: Cluster, name: str, slices: int, before: str = "",
                 after: str = "") -> dict[str, Any]:
    """A CUDA program (tests/containers/launch_loop.py over the fake driver) launching gated
    kernels in rounds of 1 s until /tmp/stop exists (DRIVER), then its interposer's counters.
    `before` and `after` are DRIVER's BEFORE and AFTER, in which the shell puts $half: half the
    container's memory limit, and 1 MiB."""
    script = ("echo \"allocation=$GEMINI_ALLOCATION_ID\";"
              " half=$((GEMINI_VGPU_MEMORY_LIMIT / 2 + 1048576));"
              f" BEFORE=\"{before}\" AFTER=\"{after}\" /usr/bin/python3 -c \"$DRIVER\";"
              " exec sleep 3600")
    return workload(cluster, name, slices, image=NODE_IMAGE, script=script,
                    env={"PROGRAM": PROGRAM, "DRIVER": DRIVER})


@dataclass
class LauncherReport:
    """What a launcher pod printed: the program's answers, its rounds, its BEFORE and AFTER
    answers in order (each with its line as "step"), the interposer's counters."""
    answers: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    stats: dict[str, str]

    def said(self) -> str:
        return json.dumps({"rounds": self.rounds, "steps": self.steps, "stats": self.stats})


def rounds_so_far(cluster: Cluster, name: str) -> int:
    """How many rounds a launcher has printed."""
    return cluster.kubectl("logs", "-n", "default", name, check=False).count('"kernels"')


def stop_launcher(cluster: Cluster, name: str) -> LauncherReport:
    """Ends a launcher's rounds (/tmp/stop) and reads its report once it is whole."""
    assert exec_ok(cluster, name, "touch", "/tmp/stop")
    out = wait_until(f"{name}'s report", lambda: (
        text if "--- end" in (text := cluster.kubectl("logs", "-n", "default", name,
                                                      check=False)) else None), 60)
    answers = [json.loads(line) for line in out.split("--- stats")[0].splitlines()
               if line.startswith("{")]
    stats = dict(line.split("=", 1) for line in
                 out.split("--- stats")[1].split("--- end")[0].splitlines() if "=" in line)
    return LauncherReport(answers, [a for a in answers if "kernels" in a],
                          [a for a in answers if "step" in a], stats)


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
    launched = stop_launcher(cluster, "launcher")
    answers, loops, stats = launched.answers, launched.rounds, launched.stats
    assert answers[1] == {"rc": 0, "rc_ctx": 0}, answers[:2]
    said = launched.said()
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


def daemon_metrics(cluster: Cluster, pod: dict[str, Any]) -> dict[str, list[Sample]]:
    """The node daemon's /metrics, through the node pod's address on the pod network."""
    status, text = fetch(f"http://{pod['status']['podIP']}:{DAEMON_METRICS_PORT}/metrics")
    assert status == 200, text
    return samples(text)


def container_statuses(pod: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {c["name"]: (c.get("containerID", ""), c["restartCount"])
            for c in pod["status"]["containerStatuses"]}


def test_the_daemon_container_killed_under_a_running_workload_comes_back_with_its_records(
        gemini_node: Cluster, cleanup: None) -> None:
    """Only the daemon's container dies (SIGKILL to its process, pid 1 there): kubelet starts
    it again in the same pod, the plugin beside it runs on. The new daemon serves the records
    it finds (byte for byte the old ones), the CUDA program launching through it keeps its
    gate and its memory limit: what it held before is counted again (re-declared on its
    reconnect), so half its limit more is refused after the restart as before."""
    cluster = gemini_node
    create(cluster, launcher_pod(cluster, "steady", 3, before="alloc $half",
                                 after="meminfo;alloc $half;alloc 1048576"))
    running(cluster, "steady")
    allocation_id = wait_until("steady's allocation id", lambda: (
        out.split("allocation=", 1)[1].split()[0] if "allocation=" in (
            out := cluster.kubectl("logs", "-n", "default", "steady", check=False)) else None),
        60)
    state = Path(cluster.env["gemini_state"])
    record = allocation.decode_record(
        paths.allocations_dir(state) / f"{allocation_id}.json",
        (paths.allocations_dir(state) / f"{allocation_id}.json").read_bytes())
    limit = record.gpus[0].memory_limit
    binding = paths.bindings_dir(state) / f"{allocation_id}.json"
    wait_until("steady's binding", lambda: binding.is_file()
               and "steady" in binding.read_text(), 60)
    node = node_pod(cluster)
    assert node is not None and pod_ready(node)

    def held(pod: dict[str, Any]) -> float | None:
        found = daemon_metrics(cluster, pod)
        used = [s.value for s in found.get("gemini_vgpu_container_memory_used_bytes", [])
                if s.labels.get("allocation") == allocation_id]
        return used[0] if used and used[0] >= limit // 2 else None
    held_before = wait_until("steady's half of its limit counted by the daemon",
                             lambda: held(node), 60)
    slices_before = daemon_metrics(cluster, node)["gemini_vgpu_gpu_slices_allocated"]
    before = records(state)
    containers = container_statuses(node)
    registrations = plugin_registrations(cluster)
    total = str(SIMULATED_GPUS * SLICES_PER_GPU)

    daemon_id = containers["scheduler"][0].split("://", 1)[1]
    cluster.ctr("tasks", "kill", "--signal", "SIGKILL", daemon_id)
    restarted = wait_until("the daemon's container started again and Ready", lambda: (
        p if (p := node_pod(cluster)) and container_statuses(p)["scheduler"][1] == 1
        and pod_ready(p) else None), 120, explain_node_pod(cluster))

    # The same pod: only the daemon's container is new; the plugin neither restarted nor
    # registered again, and kubelet still offers every slice.
    assert restarted["metadata"]["uid"] == node["metadata"]["uid"]
    after = container_statuses(restarted)
    assert after["scheduler"][0] != containers["scheduler"][0]
    assert after["device-plugin"] == containers["device-plugin"], (containers, after)
    assert plugin_registrations(cluster) == registrations
    assert vgpu_capacity(cluster) == (total, total)
    # The new daemon took over the records as they were, and counts what the program holds
    # once it has reconnected and said so.
    assert records(state) == before
    assert "steady" in binding.read_text()
    assert wait_until("steady's memory counted again by the new daemon",
                      lambda: held(restarted), 60) == held_before
    assert daemon_metrics(cluster, restarted)["gemini_vgpu_gpu_slices_allocated"] == \
        slices_before

    done = rounds_so_far(cluster, "steady")
    wait_until("three more rounds with the new daemon",
               lambda: rounds_so_far(cluster, "steady") >= done + 3, 60)
    launched = stop_launcher(cluster, "steady")
    said = launched.said()
    assert launched.answers[1] == {"rc": 0, "rc_ctx": 0}, launched.answers[:2]
    first, meminfo, second, small = launched.steps
    assert first["rc"] == 0, said
    # Its gate: every round launched without a failed call, at most one held up waiting for
    # the new daemon, kernels in the others; it reconnected, and no launch went ungated.
    rounds = launched.rounds
    held_up = [i for i, a in enumerate(rounds) if a["took"] > 2.0]
    assert len(rounds) >= 5 and all(a["failures"] == 0 for a in rounds), said
    assert len(held_up) <= 1, said
    assert all(a["kernels"] > 0 for i, a in enumerate(rounds) if i not in held_up), said
    assert int(launched.stats["daemon_connects"]) >= 2, said
    assert int(launched.stats["ungated_launches"]) == 0, said
    assert int(launched.stats["token_timeouts"]) == 0, said
    # Its limit: still the allocation's; the second half refused, 1 MiB more given.
    assert meminfo["rc"] == 0 and meminfo["total"] == limit, (meminfo, limit)
    assert second["rc"] == OUT_OF_MEMORY and small["rc"] == 0, said
