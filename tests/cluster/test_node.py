"""The product against the real kubelet, API server and default scheduler: the
DaemonSet of tests/cluster/overlay rolled out by the real controllers, the plugin registered
with the real kubelet, `kubectl describe node`, and pods asking `gemini.ai/vgpu` placed by the
default scheduler and admitted by kubelet, their containers started by containerd and runc."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster.conftest import (
    HOOK_PREFIX,
    NAMESPACE,
    NODE_PODS,
    REPO,
    SIMULATED_GPUS,
    SLICES_PER_GPU,
    Cluster,
    create,
    environment,
    node_pod,
    phase,
    report,
    wait_until,
    workload,
)
from vgpu_runtime.contracts import paths
from vgpu_runtime.gpus.simulated import simulated_uuid

# Cold start builds Kubernetes (tens of minutes on 2 cores) inside the first test's setup.
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

def section(text: str, title: str) -> str:
    """The lines of `kubectl describe node` under `Title:` up to the next unindented line."""
    match = re.search(rf"^{title}:\n((?:[ \t].*\n)*)", text, re.M)
    assert match, f"no {title} section in:\n{text[:3000]}"
    return match.group(1)


def test_describe_node_shows_the_slices_the_plugin_registered(gemini_node: Cluster) -> None:
    described = gemini_node.kubectl("describe", "node", gemini_node.node)
    total = SIMULATED_GPUS * SLICES_PER_GPU
    for title in ("Capacity", "Allocatable"):
        assert re.search(rf"^\s+gemini\.ai/vgpu:\s+{total}$", section(described, title), re.M), \
            described
    # The daemon labels its node through the API with the ServiceAccount's RBAC.
    labels = wait_until("the daemon's node labels", lambda: {
        k: v for k, v in gemini_node.get("node", gemini_node.node)["metadata"]["labels"].items()
        if k.startswith("gemini.ai/") and k != "gemini.ai/vgpu.enabled"} or None, 60)
    assert labels.get("gemini.ai/gpu.count") == str(SIMULATED_GPUS), labels
    assert labels.get("gemini.ai/vgpu.slices-per-gpu") == str(SLICES_PER_GPU), labels
    assert "gemini.ai/gpu.model" in labels, labels
    # The real kubelet served the plugin's socket directory and the plugin's socket is there.
    socket = Path(gemini_node.env["kubelet_root"]) / "device-plugins" / "gemini-vgpu.sock"
    assert socket.is_socket()


def test_the_daemonset_was_rolled_out_by_the_real_controllers(gemini_node: Cluster) -> None:
    ds = gemini_node.get("daemonset", "-n", NAMESPACE, "gemini-vgpu-node")
    status = ds["status"]
    assert status["desiredNumberScheduled"] == 1 and status["numberReady"] == 1, status
    pods = gemini_node.get("pods", "-n", NAMESPACE, "-l", NODE_PODS)
    (pod,) = pods["items"]
    assert pod["spec"]["nodeName"] == gemini_node.node
    # The init steps ran: the config manager is a sidecar, install-hook ran to completion.
    init = {s["name"]: s for s in pod["status"]["initContainerStatuses"]}
    assert init["install-hook"]["state"]["terminated"]["exitCode"] == 0, init
    assert init["config-manager"]["ready"] is True, init
    assert all(c["ready"] for c in pod["status"]["containerStatuses"]), pod["status"]


def test_a_pod_asking_three_slices_is_placed_admitted_and_sees_its_allocation(
        gemini_node: Cluster, cleanup: None) -> None:
    cluster = gemini_node
    create(cluster, workload(cluster, "three-slices", 3))
    wait_until("three-slices Running", lambda: phase(cluster, "three-slices") == "Running", 120,
               lambda: cluster.kubectl("describe", "pod", "-n", "default", "three-slices",
                                       check=False))
    pod = cluster.get("pod", "-n", "default", "three-slices")
    assert pod["spec"]["nodeName"] == cluster.node
    events = cluster.get("events", "-n", "default", "--field-selector",
                         "involvedObject.name=three-slices")["items"]
    scheduled = [e for e in events if e["reason"] == "Scheduled"]
    assert scheduled, events
    assert (scheduled[0].get("reportingComponent") or scheduled[0]["source"].get("component")) \
        == "default-scheduler", scheduled[0]

    text = report(cluster, "three-slices")
    env = environment(text)
    # The interposer, preloaded from the read-only library mount install-hook filled.
    assert env.get("LD_PRELOAD", "").startswith(HOOK_PREFIX), env
    library = env["LD_PRELOAD"].rsplit("/", 1)[1]
    files = text.split("--- files")[1]
    assert library in files, files
    assert paths.CHANNEL_SOCKET_NAME in files, files
    # The allocation's environment: one GPU, 3/10 of it, its channel.
    assert env.get(paths.ENV_CHANNEL_DIR) == paths.CONTAINER_CHANNEL_DIR, env
    assert float(env[paths.ENV_SHARE]) == pytest.approx(0.3), env
    assert int(env[paths.ENV_MEMORY_LIMIT]) > 0, env
    uuid = env.get("CUDA_VISIBLE_DEVICES")
    assert uuid in {simulated_uuid(i) for i in range(SIMULATED_GPUS)}, env
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "void", env
    # containerd resolved the CDI device the plugin named (nvidia.com/gpu=<uuid>): the spec's
    # edit for that GPU, and only that GPU's, reached the container.
    cdi = {k: v for k, v in env.items() if k.startswith("GEMINI_TEST_CDI_GPU_")}
    assert list(cdi.values()) == [uuid], cdi
    # The channel and library directories are read-only bind mounts.
    mounts = text.split("--- mounts")[1].split("--- write")[0]
    for target in (paths.CONTAINER_CHANNEL_DIR, paths.CONTAINER_LIB_DIR):
        line = next((m for m in mounts.splitlines()
                     if len(m.split()) > 5 and m.split()[4] == target), None)
        assert line is not None, mounts
        assert "ro" in line.split()[5].split(","), line
    assert "READONLY" in text.split("--- write")[1], text

    # The allocation is on the host, bound by the daemon to this pod through kubelet's
    # PodResources API.
    allocation = env[paths.ENV_ALLOCATION_ID]
    state = Path(cluster.env["gemini_state"])
    assert (paths.allocations_dir(state) / f"{allocation}.json").is_file()
    binding = paths.bindings_dir(state) / f"{allocation}.json"
    # Slices an earlier test's deleted pod held keep their allocation id, and its binding stays
    # until the daemon's next PodResources pass binds them to this pod: wait for that one.
    bound: str = wait_until("the daemon's binding of the allocation to the pod", lambda: (
        text if binding.is_file() and "three-slices" in (text := binding.read_text())
        else None), 60)
    assert "three-slices" in bound, bound


def readme_admission_error() -> tuple[str, str]:
    """The reason and message the README's troubleshooting table gives for a pod that fits the
    node's free count but no single GPU."""
    readme = (REPO / "README.md").read_text()
    row = re.search(r'^\| pod fails with `(\w+)` and "([^"]+)" \|', readme, re.M)
    assert row, "README's troubleshooting row of the admission error not found"
    return row.group(1), row.group(2)


def the_readmes_text(said: str, text: str, numbers: tuple[int, ...]) -> None:
    """`text` holds the README's message `said` with its numbers replaced by `numbers`."""
    pattern = r"(\d+)".join(re.escape(part) for part in re.split(r"\d+", said))
    found = re.search(pattern, text)
    assert found, f"the README's {said!r} is not in what the cluster says:\n{text}"
    assert tuple(int(n) for n in found.groups()) == numbers, (found.group(0), numbers)


def test_pods_that_fit_the_node_but_not_one_gpu_are_refused_with_the_readmes_error(
        gemini_node: Cluster, cleanup: None) -> None:
    """README, troubleshooting: the pod fails with `UnexpectedAdmissionError` and "no GPU has 7
    free slices: the most free on one GPU is 6 of 10", as the pod's status, `kubectl get pods`
    and the Warning Event of `kubectl get events` say it on the real cluster."""
    cluster = gemini_node
    reason, said = readme_admission_error()
    create(cluster, workload(cluster, "six-a", 6))
    wait_until("six-a Running", lambda: phase(cluster, "six-a") == "Running", 120)
    create(cluster, workload(cluster, "six-b", 6))
    wait_until("six-b Running", lambda: phase(cluster, "six-b") == "Running", 120)
    # 8 slices free on the node (4 + 4): the scheduler places a pod of 7, kubelet's Allocate
    # through the plugin refuses it.
    create(cluster, workload(cluster, "seven", 7))
    wait_until("seven Failed", lambda: phase(cluster, "seven") == "Failed", 120)
    numbers = (7, 4, SLICES_PER_GPU)
    pod = cluster.get("pod", "-n", "default", "seven")
    assert pod["spec"]["nodeName"] == cluster.node
    assert pod["status"]["reason"] == reason, pod["status"]
    the_readmes_text(said, pod["status"]["message"], numbers)
    # `kubectl get pods`: STATUS is the reason.
    listed = cluster.kubectl("get", "pod", "-n", "default", "seven", "--no-headers").split()
    assert listed[:3] == ["seven", "0/1", reason], listed
    # `kubectl get events`: one Warning row of that reason on pod/seven, its message the
    # README's in kubelet's words ("Allocate failed due to device plugin GetPreferredAllocation
    # rpc failed with err: rpc error: code = ResourceExhausted desc = ..., which is unexpected").
    table = cluster.kubectl("get", "events", "-n", "default", "--field-selector",
                            "involvedObject.name=seven")
    header, *rows = table.splitlines()
    assert header.split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"], table
    refused = [r for r in rows if r.split()[1:4] == ["Warning", reason, "pod/seven"]]
    assert len(refused) == 1, table
    the_readmes_text(said, refused[0], numbers)


def node_config(cluster: Cluster) -> str:
    """The node's configuration file as the plugin's container reads it."""
    return cluster.kubectl("exec", "-n", NAMESPACE, "daemonset/gemini-vgpu-node", "-c",
                           "device-plugin", "--", "cat", "/etc/gemini/node/config.yaml")


def test_a_label_naming_a_missing_configuration_is_a_warning_on_the_node(
        gemini_node: Cluster) -> None:
    """daemonset/README: a label naming a missing configuration keeps the node's file as it is
    and posts a Warning Event on the Node (`ConfigNotFound`; `kubectl describe node <node>`)."""
    cluster = gemini_node
    before, pod = node_config(cluster), node_pod(cluster)
    assert pod is not None
    cluster.kubectl("label", "node", cluster.node, "gemini.ai/vgpu.config=no-such-config",
                    "--overwrite")
    try:
        def warnings() -> list[list[str]]:
            described = cluster.kubectl("describe", "node", cluster.node)
            # Type, Reason, Age, From, Message
            rows = [line.split(None, 4) for line in section(described, "Events").splitlines()]
            return [r for r in rows if r[:2] == ["Warning", "ConfigNotFound"]]
        (row,) = wait_until("the ConfigNotFound Event in kubectl describe node", warnings, 60)
        assert row[3] == "gemini-config-manager", row
        assert "'no-such-config'" in row[4] and "keeps its current configuration" in row[4], row
        assert node_config(cluster) == before
        after = node_pod(cluster)
        assert after is not None and after["metadata"]["uid"] == pod["metadata"]["uid"]
    finally:
        cluster.kubectl("label", "node", cluster.node, "gemini.ai/vgpu.config-")


SERVICE_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:gemini-vgpu"
# daemonset/base/rbac.yaml's grants (tests/rollout/test_rbac.py derives them from the code's
# calls), and neighbours the code never needs.
Check = tuple[str, str, "str | None"] | tuple[str, str, "str | None", str]
ALLOWED: list[Check] = [
    ("get", "pods", "default"), ("get", "pods", "kube-system"), ("create", "events", "default"),
    ("create", "events", "kube-system"), ("get", "nodes", None), ("patch", "nodes", None),
    ("watch", "nodes", None), ("get", "daemonsets.apps/gemini-vgpu-node", NAMESPACE)]
DENIED: list[Check] = [
    ("list", "pods", "default"), ("watch", "pods", "default"), ("patch", "pods", "default"),
    ("delete", "pods", "default"), ("create", "pods", "default"), ("list", "nodes", None),
    ("update", "nodes", None), ("delete", "nodes", None), ("patch", "nodes", None, "status"),
    ("update", "events", "default"), ("list", "events", "default"),
    ("get", "secrets", NAMESPACE), ("get", "configmaps", NAMESPACE),
    ("list", "daemonsets.apps", NAMESPACE), ("delete", "daemonsets.apps", NAMESPACE),
    ("get", "daemonsets.apps/another", NAMESPACE), ("get", "daemonsets.apps", "default")]


def test_the_real_api_server_grants_the_service_account_the_roles_verbs_alone(
        gemini_node: Cluster) -> None:
    """The tests passing show the RBAC is enough; this shows it is no broader, as the real
    API server's authorizer answers `kubectl auth can-i` for the node pods' ServiceAccount."""
    def can(verb: str, resource: str, namespace: str | None, subresource: str = "") -> bool:
        args = ["auth", "can-i", verb, resource, f"--as={SERVICE_ACCOUNT}"]
        args += ["-n", namespace] if namespace else []
        args += [f"--subresource={subresource}"] if subresource else []
        answer = gemini_node.kubectl(*args, check=False).strip()
        assert answer in ("yes", "no"), answer
        return answer == "yes"
    assert [c for c in ALLOWED if not can(*c)] == []
    assert [c for c in DENIED if can(*c)] == []
