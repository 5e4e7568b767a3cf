"""The MPS backend as an operator installs it (daemonset/components/mps, through
tests/cluster/overlay-mps) on the real kubelet: the control daemon's own DaemonSet, the node
daemon adopting it, pods given its pipes and its /dev/shm, a refused Allocate while it has not
marked that /dev/shm, and a roll of the node pods that leaves it running. The node has no GPU:
the control daemon is the devkit's stand-in for nvidia-cuda-mps-control, which answers on the
same pipes as the real one."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import (
    NAMESPACE,
    NODE_IMAGE,
    NODE_PODS,
    OVERLAY,
    REPO,
    Cluster,
    create,
    live_pod,
    node_pod,
    phase,
    pod_ready,
    report,
    wait_node_ready,
    wait_until,
    workload,
)
from vgpu_runtime.contracts import paths
from vgpu_runtime.devkit.fakecuda import fake_mps_control

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

MPS_OVERLAY = REPO / "tests" / "cluster" / "overlay-mps"
FAKE_DIR = Path("/run/gemini-test/mps")   # tests/cluster/overlay-mps mounts it
SHM = Path(paths.DEFAULT_MPS_SHM_DIR)
MPS_SELECTOR = "app.kubernetes.io/component=mps"

# What a tenant of the MPS backend prints: its pipe directory, the control daemon's answer to a
# command sent on its socket (the stand-in answers `unknown command`), what its /dev/shm holds
# after it wrote a file named after itself there.
TENANT = ("echo \"pipes=$CUDA_MPS_PIPE_DIRECTORY\";"
          " /usr/bin/python3 -c 'import socket, sys; s = socket.socket(socket.AF_UNIX);"
          " s.connect(sys.argv[1] + \"/control\"); s.sendall(b\"hello\\n\");"
          " s.shutdown(socket.SHUT_WR); print(\"control:\", s.makefile().read().strip())'"
          " \"$CUDA_MPS_PIPE_DIRECTORY\";"
          " echo x > \"/dev/shm/from-$HOSTNAME\"; echo \"shm: $(ls /dev/shm | tr '\\n' ' ')\";"
          " echo '--- end'; exec sleep 3600")


def tenant(cluster: Cluster, name: str) -> dict[str, Any]:
    return workload(cluster, name, 2, image=NODE_IMAGE, script=TENANT)


def said(cluster: Cluster, name: str) -> dict[str, str]:
    """A tenant's report, its lines `key: value` or `key=value` as a dict."""
    found = {}
    for line in report(cluster, name).splitlines():
        for sep in (": ", "="):
            if sep in line:
                key, value = line.split(sep, 1)
                found[key] = value
                break
    return found


def mps_pod(cluster: Cluster) -> dict[str, Any] | None:
    return live_pod(cluster, MPS_SELECTOR)


def scheduler_log(cluster: Cluster, pod: dict[str, Any]) -> str:
    return cluster.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "scheduler",
                           check=False)


def explain(cluster: Cluster) -> Any:
    return lambda: (cluster.kubectl("-n", NAMESPACE, "describe", "pods", check=False)[-5000:]
                    + cluster.kubectl("-n", NAMESPACE, "logs", "-l", MPS_SELECTOR,
                                      "--tail=20", check=False))


def node_pod_with_mps(cluster: Cluster, mps: bool) -> dict[str, Any]:
    """The node pod once the rollout of `kubectl apply` has replaced it: the only one, Ready,
    its daemon's environment saying mps or not as asked, its slices advertised."""
    def rolled() -> dict[str, Any] | None:
        pods = cluster.get("pods", "-n", NAMESPACE, "-l", NODE_PODS)["items"]
        if len(pods) != 1 or not pod_ready(pods[0]):
            return None
        env = {e["name"]: e.get("value") for c in pods[0]["spec"]["containers"]
               if c["name"] == "scheduler" for e in c.get("env", [])}
        return pods[0] if ("GEMINI_MPS" in env) == mps else None
    pod = wait_until(f"the node pod rolled out with mps {'on' if mps else 'off'}", rolled, 300,
                     explain(cluster))
    wait_node_ready(cluster)
    return pod


def remove_mps_install(cluster: Cluster) -> None:
    cluster.kubectl("delete", "daemonset", "-n", NAMESPACE, "gemini-vgpu-mps",
                    "--ignore-not-found", "--wait=true", "--timeout=90s", timeout=120)
    cluster.kubectl("apply", "-k", str(OVERLAY))
    node_pod_with_mps(cluster, False)
    # The tests after these run on the plain install: apply took the component's additions out.
    ds = cluster.get("daemonset", "-n", NAMESPACE, "gemini-vgpu-node")
    env = {e["name"] for c in ds["spec"]["template"]["spec"]["containers"]
           for e in c.get("env", [])}
    assert not env & {"GEMINI_MPS", "GEMINI_MPS_MANAGE", "GEMINI_MPS_CONTROL"}, env


@pytest.fixture(scope="module")
def mps_node(gemini_node: Cluster) -> Iterator[Cluster]:
    """The node as daemonset/README.md's MPS section has the operator prepare it (a tmpfs of
    its own at /run/gemini/mps/shm), the stand-in control program where the overlay mounts it,
    then tests/cluster/overlay-mps applied and rolled out; the plain overlay back at the end."""
    cluster = gemini_node
    SHM.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "tmpfs", str(SHM)],
                   check=True)
    FAKE_DIR.mkdir(parents=True, exist_ok=True)
    program = FAKE_DIR / "nvidia-cuda-mps-control"
    program.write_text("#!/usr/bin/env python3\n" + Path(fake_mps_control.__file__).read_text())
    program.chmod(0o755)
    try:
        cluster.kubectl("apply", "-k", str(MPS_OVERLAY))
        wait_until("the MPS control daemon's pod Ready", lambda: pod_ready(mps_pod(cluster)),
                   180, explain(cluster))
        node_pod_with_mps(cluster, True)
        yield cluster
    finally:
        cluster.kubectl("delete", "pods", "-n", "default", "-l", "test=cluster", "--wait=true",
                        "--grace-period=1", "--timeout=60s", check=False)
        remove_mps_install(cluster)
        shutil.rmtree(paths.mps_pipe_dir(cluster.env["gemini_state"]).parent,
                      ignore_errors=True)
        with contextlib.suppress(OSError):
            paths.mps_shm_id(cluster.env["gemini_state"]).unlink()
        subprocess.run(["umount", str(SHM)], check=False)
        shutil.rmtree(FAKE_DIR, ignore_errors=True)


def test_the_node_daemon_adopts_the_control_daemon_and_pods_become_its_clients(
        mps_node: Cluster) -> None:
    cluster = mps_node
    node = node_pod(cluster)
    assert node is not None
    wait_until("the node daemon adopting the control daemon",
               lambda: "MPS control daemon adopted" in scheduler_log(cluster, node), 60,
               lambda: scheduler_log(cluster, node)[-3000:])
    create(cluster, tenant(cluster, "mps-tenant"))
    report = said(cluster, "mps-tenant")
    assert report["pipes"] == paths.CONTAINER_MPS_PIPE_DIR, report
    # The pod reached the node's control daemon through the pipes it was given...
    assert report["control"] == "unknown command", report
    log = paths.mps_log_dir(cluster.env["gemini_state"]) / "control.log"
    assert "] hello" in log.read_text(), log.read_text()[-2000:]
    # ...and its /dev/shm is the server's: the control daemon's mark in it, and what the pod
    # wrote there is in the host's tmpfs.
    assert paths.mps_shm_name(cluster.env["gemini_state"]) in report["shm"].split(), report
    assert (SHM / "from-mps-tenant").is_file()


def rejected(pod: dict[str, Any]) -> bool:
    status = pod["status"]
    return bool(status.get("phase") == "Failed"
                and status.get("reason") == "UnexpectedAdmissionError")


def test_before_the_control_daemon_has_marked_its_shm_kubelet_rejects_the_pod(
        mps_node: Cluster) -> None:
    """Allocate refuses while the marks disagree, and the real kubelet then rejects that pod
    for good: a bare pod stays Failed, a Deployment makes new pods until one is admitted once
    the marks agree."""
    cluster = mps_node
    mark = SHM / paths.mps_shm_name(cluster.env["gemini_state"])
    saved = mark.read_bytes()
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "mps-deployed", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "mps-deployed"}},
                 "template": {"metadata": {"labels": {"app": "mps-deployed"}},
                              "spec": tenant(cluster, "unused")["spec"]}}}
    deployment["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    mark.unlink()
    try:
        create(cluster, tenant(cluster, "mps-too-early"), deployment)
        wait_until("mps-too-early Failed", lambda: phase(cluster, "mps-too-early") == "Failed",
                   60, lambda: cluster.kubectl("describe", "pod", "-n", "default",
                                               "mps-too-early", check=False))
        wait_until("a pod of the Deployment rejected", lambda: any(
            rejected(p) for p in cluster.get(
                "pods", "-n", "default", "-l", "app=mps-deployed")["items"]), 60)
        mark.write_bytes(saved)
        status = cluster.get("pod", "-n", "default", "mps-too-early")["status"]
        assert rejected({"status": status}), status
        assert "is not the /dev/shm the MPS control daemon" in status.get("message", ""), status
        # Kubelet never retries the bare pod; the Deployment's next pod is admitted.
        admitted = wait_until("a pod of the Deployment Running", lambda: next(
            (p["metadata"]["name"] for p in cluster.get(
                "pods", "-n", "default", "-l", "app=mps-deployed")["items"]
             if p["status"].get("phase") == "Running"), None), 120)
        assert said(cluster, admitted)["control"] == "unknown command"
        assert phase(cluster, "mps-too-early") == "Failed"
    finally:
        if not mark.exists():
            mark.write_bytes(saved)
        cluster.kubectl("delete", "deployment", "-n", "default", "mps-deployed",
                        "--ignore-not-found", "--wait=true", "--timeout=60s", timeout=90)


def test_rolling_the_node_pods_leaves_the_control_daemon_and_its_tenants_running(
        mps_node: Cluster) -> None:
    cluster = mps_node
    create(cluster, tenant(cluster, "mps-across-roll"))
    said(cluster, "mps-across-roll")
    control = mps_pod(cluster)
    node = node_pod(cluster)
    assert control is not None and node is not None
    cluster.kubectl("rollout", "restart", "daemonset", "-n", NAMESPACE, "gemini-vgpu-node")
    wait_until("a new node pod", lambda: (
        new if (new := node_pod(cluster)) is not None and new["metadata"]["uid"]
        != node["metadata"]["uid"] and pod_ready(new) else None), 300, explain(cluster))
    wait_node_ready(cluster)
    new_node = node_pod(cluster)
    assert new_node is not None
    wait_until("the new node daemon adopting the control daemon",
               lambda: "MPS control daemon adopted" in scheduler_log(cluster, new_node), 60,
               lambda: scheduler_log(cluster, new_node)[-3000:])
    after = mps_pod(cluster)
    assert after is not None and after["metadata"]["uid"] == control["metadata"]["uid"]
    assert [c["restartCount"] for c in after["status"]["containerStatuses"]] == [0], after
    assert phase(cluster, "mps-across-roll") == "Running"
    assert (SHM / "from-mps-across-roll").is_file()
