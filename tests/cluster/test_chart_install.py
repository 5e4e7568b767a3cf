"""The Helm chart on the real cluster: `helm install` with the test overlay's equivalent values
(tests/cluster/overlay/values.yaml), the DaemonSet rolled out by the real controllers, the plugin
registered with the real kubelet, `kubectl describe node` showing the slices, a pod asking
`gemini.ai/vgpu: 3` placed and running; `helm upgrade` rolling the node pod under that running
pod; `helm uninstall` under it: the hook stops the node pod, whose daemon keeps what the pod
uses on the host, clears the rest and says so in an Event, and every object of the release goes;
then, once the pod has ended, an install and an uninstall that leave the node's state directory
empty and its gemini.ai labels gone. Then an install with the chart's ServiceMonitor (the
Prometheus Operator's CRD applied for it) and `helm upgrade --set image.tag=...` to an image whose
interposer differs, under a running pod.

The kustomize install of the other cluster tests and this one cannot share the node (one
plugin per resource, one state directory): a kustomize install found here is removed first and
applied again afterwards. In file order this runs before the first test that applies it."""

from __future__ import annotations

import copy
import functools
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import (
    CHART,
    HOOK_PREFIX,
    NAMESPACE,
    OVERLAY,
    REPO,
    SIMULATED_GPUS,
    SLICES_PER_GPU,
    Cluster,
    create,
    environment,
    install_overlay,
    monitor_pages,
    node_pod,
    phase,
    prepare_node,
    report,
    run,
    vgpu_capacity,
    wait_node_ready,
    wait_until,
    workload,
)
from tests.scrape import samples
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.uninstall import REASON

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

RELEASE = "gemini-vgpu"
VALUES = OVERLAY / "values.yaml"


def helm(cluster: Cluster, *args: str, timeout: float = 300) -> str:
    return run([cluster.env["helm"], "--kubeconfig", cluster.env["kubeconfig"], *args],
               timeout=timeout).stdout


def kustomize_install_present(cluster: Cluster) -> bool:
    found = cluster.kubectl("get", "daemonset", "-n", NAMESPACE, "-o", "json", check=False)
    return any(d["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") != "Helm"
               for d in (json.loads(found) if found.strip() else {"items": []})["items"])


@pytest.fixture
def node_without_kustomize_install(cluster: Cluster, node_image: str) -> Iterator[Cluster]:
    present = kustomize_install_present(cluster)
    if present:
        # The README's kustomize uninstall: the DaemonSet in the foreground first (its pods
        # clear their node while their RBAC exists), then the rest.
        cluster.kubectl("-n", NAMESPACE, "delete", "daemonset", "gemini-vgpu-node",
                        "--cascade=foreground", "--wait=true", "--timeout=180s", timeout=200)
        cluster.kubectl("delete", "-k", str(OVERLAY), "--ignore-not-found", "--wait=true",
                        "--timeout=180s", timeout=200)
    prepare_node(cluster)
    # The class the base names, mapped to runc, as the GPU Operator would create it for real.
    cluster.kubectl("apply", "-f", str(OVERLAY / "runtimeclass.yaml"))
    try:
        yield cluster
    finally:
        if present:
            install_overlay(cluster)


def gone(cluster: Cluster, obj: dict[str, Any]) -> bool:
    args = [obj["kind"], obj["metadata"]["name"]]
    if "namespace" in obj["metadata"]:
        args += ["-n", obj["metadata"]["namespace"]]
    return "NotFound" in run([cluster.env["kubectl"], "--kubeconfig", cluster.env["kubeconfig"],
                              "get", *args], check=False).stderr


def describe_slices(cluster: Cluster) -> dict[str, str]:
    """gemini.ai/vgpu under Capacity and Allocatable in `kubectl describe node`."""
    described = cluster.kubectl("describe", "node", cluster.node)
    found = {}
    for title in ("Capacity", "Allocatable"):
        block = re.search(rf"^{title}:\n((?:[ \t].*\n)*)", described, re.M)
        assert block, described[:3000]
        value = re.search(r"^\s+gemini\.ai/vgpu:\s+(\S+)$", block.group(1), re.M)
        found[title] = value.group(1) if value else ""
    return found


def exec_ok(cluster: Cluster, pod: str, *command: str) -> bool:
    return run([cluster.env["kubectl"], "--kubeconfig", cluster.env["kubeconfig"], "exec",
                "-n", "default", pod, "--", *command], check=False).returncode == 0


def uninstall(cluster: Cluster, manifest: list[Any]) -> None:
    """`helm uninstall` as the README gives it: its hook stops the node pods, then every
    object of the release goes but the namespace, which holds Helm's records (said so)."""
    said = helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout",
                "300s", timeout=330)
    assert re.search(rf"kept due to the resource policy:\s*\n?\s*\[Namespace\] {NAMESPACE}",
                     said), said
    for obj in manifest:
        if obj["kind"] != "Namespace":
            wait_until(f"{obj['kind']} {obj['metadata']['name']} gone",
                       functools.partial(gone, cluster, obj), 120)
    assert {o["kind"] for o in manifest} >= {"Namespace", "DaemonSet", "ConfigMap",
                                             "ClusterRole", "ClusterRoleBinding", "Role",
                                             "RoleBinding", "ServiceAccount", "Service"}
    # Nothing left in the namespace, the hook's Job and its RBAC included (hook-succeeded),
    # but the ServiceAccount `default` Kubernetes gives every namespace.
    def left() -> list[str]:
        found = json.loads(cluster.kubectl("get", "all,serviceaccounts,roles,rolebindings",
                                           "-n", NAMESPACE, "-o", "json"))["items"]
        return [f"{o['kind']}/{o['metadata']['name']}" for o in found
                if (o["kind"], o["metadata"]["name"]) != ("ServiceAccount", "default")]
    wait_until(f"nothing left in {NAMESPACE}", lambda: not left(), 120, lambda: str(left()))
    # The plugin is gone: kubelet no longer offers its slices.
    wait_until("gemini.ai/vgpu allocatable 0",
               lambda: vgpu_capacity(cluster)[1] in ("0", None), 120)
    releases: list[Any] = yaml.safe_load(helm(cluster, "list", "--all-namespaces", "-o",
                                              "yaml")) or []
    assert releases == []


def uninstall_events(cluster: Cluster) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cluster.get(
        "events", "-n", "default", "--field-selector",
        f"involvedObject.kind=Node,reason={REASON}")["items"]
    return found


def uninstalled_event(cluster: Cluster, before: int) -> str:
    """The message of the node daemon's uninstall Event that follows the `before` there were."""
    found = wait_until(f"a new {REASON} Event on the node", lambda: (
        events if len(events := uninstall_events(cluster)) > before else None), 60)
    newest = max(found, key=lambda e: e["metadata"]["creationTimestamp"])
    assert newest["type"] == "Normal" and newest["involvedObject"]["name"] == cluster.node
    # The README's command shows it.
    command = ["get", "events", "--field-selector", f"reason={REASON}"]
    assert f"`kubectl {' '.join(command)}`" in (REPO / "README.md").read_text()
    table = cluster.kubectl(*command)
    assert any(row.split()[1:4] == ["Normal", REASON, f"node/{cluster.node}"]
               for row in table.splitlines()[1:]), table
    return str(newest["message"])


def test_helm_install_upgrade_and_uninstall(node_without_kustomize_install: Cluster,
                                            cleanup: None) -> None:
    cluster = node_without_kustomize_install
    took: dict[str, float] = {}
    start = time.monotonic()
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--create-namespace", "--values", str(VALUES))
    wait_node_ready(cluster)
    took["install to slices advertised"] = time.monotonic() - start
    total = str(SIMULATED_GPUS * SLICES_PER_GPU)
    assert describe_slices(cluster) == {"Capacity": total, "Allocatable": total}
    daemonset = cluster.get("daemonset", "-n", NAMESPACE, "gemini-vgpu-node")
    assert daemonset["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert daemonset["status"]["numberReady"] == 1, daemonset["status"]
    namespace = cluster.get("namespace", NAMESPACE)["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "privileged", namespace
    manifest = [o for o in yaml.safe_load_all(helm(cluster, "get", "manifest", RELEASE,
                                                   "--namespace", NAMESPACE)) if o]

    create(cluster, workload(cluster, "helm-three", 3))
    wait_until("helm-three Running", lambda: phase(cluster, "helm-three") == "Running", 120,
               lambda: cluster.kubectl("describe", "pod", "-n", "default", "helm-three",
                                       check=False))
    env = environment(report(cluster, "helm-three"))
    assert env.get("LD_PRELOAD", "").startswith(HOOK_PREFIX), env
    assert float(env[paths.ENV_SHARE]) == pytest.approx(0.3), env
    running = cluster.get("pod", "-n", "default", "helm-three")["status"]["containerStatuses"]

    # An upgrade with another setting: a new configuration, so a new ConfigMap name, so the
    # node pod is replaced; the running workload is not disturbed.
    old_pod = node_pod(cluster)
    assert old_pod is not None
    start = time.monotonic()
    helm(cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--values", str(VALUES), "--set", "logLevel=debug")
    cluster.kubectl("-n", NAMESPACE, "rollout", "status", "daemonset/gemini-vgpu-node",
                    "--timeout=300s", timeout=330)
    wait_node_ready(cluster)
    took["upgrade to slices advertised"] = time.monotonic() - start
    new_pod = node_pod(cluster)
    assert new_pod is not None
    assert new_pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
    envs = [e for c in new_pod["spec"]["initContainers"] + new_pod["spec"]["containers"]
            for e in c.get("env", [])]
    assert {"name": "GEMINI_LOG_LEVEL", "value": "debug"} in envs
    after = cluster.get("pod", "-n", "default", "helm-three")
    assert after["status"]["phase"] == "Running"
    assert after["status"]["containerStatuses"][0]["containerID"] == running[0]["containerID"]

    # Uninstall under the running pod: its node keeps what it uses, and says so.
    allocation = env[paths.ENV_ALLOCATION_ID]
    start = time.monotonic()
    events = len(uninstall_events(cluster))
    uninstall(cluster, manifest)
    took["uninstall, a pod running"] = time.monotonic() - start
    message = uninstalled_event(cluster, events)
    assert "default/helm-three" in message and f"allocations/{allocation}.json" in message, \
        message
    state = Path(cluster.env["gemini_state"])
    assert [p.name for p in paths.allocations_dir(state).iterdir()] == [f"{allocation}.json"]
    assert [p.name for p in paths.channels_dir(state).iterdir()] == [allocation]
    assert [p.name for p in paths.default_hook_dir(state).iterdir()] == [
        env["LD_PRELOAD"].rsplit("/", 1)[1]]
    assert not {paths.LOCK_NAME, paths.HEALTH_FILE_NAME} & {p.name for p in state.iterdir()}
    # The pod still runs on the interposer and channel it was given.
    assert phase(cluster, "helm-three") == "Running"
    assert exec_ok(cluster, "helm-three", "test", "-f", env["LD_PRELOAD"])

    # Once it ends, an install and an uninstall with no pod left clear the node entirely.
    cluster.kubectl("delete", "pod", "-n", "default", "helm-three", "--grace-period=1",
                    "--wait=true", timeout=120)
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--values", str(VALUES))
    wait_node_ready(cluster)
    start = time.monotonic()
    events = len(uninstall_events(cluster))
    uninstall(cluster, manifest)
    took["uninstall, no pod"] = time.monotonic() - start
    message = uninstalled_event(cluster, events)
    assert "removed everything" in message, message
    assert list(state.iterdir()) == [], sorted(p.name for p in state.iterdir())
    labels = cluster.get("node", cluster.node)["metadata"]["labels"]
    assert [k for k in labels if k.startswith("gemini.ai/")] == ["gemini.ai/vgpu.enabled"], \
        labels
    # The namespace then goes as the README says, leaving the cluster as the test found it.
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s",
                    timeout=150)
    sys.stderr.write("".join(f"helm: {what} {seconds:.0f} s\n" for what, seconds in took.items()))


def test_helm_with_a_servicemonitor_and_an_upgrade_to_another_image(
        node_without_kustomize_install: Cluster, servicemonitor_crd: None, upgrade_image: str,
        cleanup: None) -> None:
    """`helm install --set metrics.serviceMonitor.enabled=true` on a cluster with the Prometheus
    Operator's CRD: the API server accepts the chart's ServiceMonitor (the CRD's schema refuses
    an invalid one), which selects the metrics Services, whose endpoints are the node pod's
    daemon and plugin serving /metrics. Then `helm upgrade --set image.tag=...` to an image
    whose interposer differs: the node pod is replaced, a running pod keeps its interposer, a
    new pod gets the new one; `helm uninstall` removes the ServiceMonitor with the rest."""
    cluster = node_without_kustomize_install
    tag = upgrade_image.rsplit(":", 1)[1]
    monitoring = ["--set", "metrics.serviceMonitor.enabled=true",
                  "--set", "metrics.serviceMonitor.labels.release=prometheus"]
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--create-namespace", "--values", str(VALUES), *monitoring)
    wait_node_ready(cluster)
    manifest = [o for o in yaml.safe_load_all(helm(cluster, "get", "manifest", RELEASE,
                                                   "--namespace", NAMESPACE)) if o]
    monitor = cluster.get("servicemonitor", "-n", NAMESPACE, "gemini-vgpu")
    assert monitor["metadata"]["labels"]["release"] == "prometheus", monitor["metadata"]
    assert monitor["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    # The API server checks a ServiceMonitor against the CRD's schema: accepted means valid.
    invalid = copy.deepcopy(monitor)
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        invalid["metadata"].pop(key, None)
    invalid["metadata"]["name"] = "gemini-vgpu-invalid"
    invalid["spec"]["endpoints"][0]["interval"] = "15 seconds"
    refused = run([cluster.env["kubectl"], "--kubeconfig", cluster.env["kubeconfig"], "create",
                   "--dry-run=server", "-f", "-"], input=json.dumps(invalid), check=False)
    assert refused.returncode != 0 and "interval" in refused.stderr, refused
    # Every endpoint reaches the node pod: the daemon's metrics and the plugin's.
    for url, text in monitor_pages(cluster, monitor).items():
        assert "gemini_vgpu_build_info" in samples(text), (url, text[:1000])

    create(cluster, workload(cluster, "old-hook", 3))
    wait_until("old-hook Running", lambda: phase(cluster, "old-hook") == "Running", 120)
    old = environment(report(cluster, "old-hook"))["LD_PRELOAD"]
    running = cluster.get("pod", "-n", "default", "old-hook")["status"]["containerStatuses"]
    old_pod = node_pod(cluster)
    assert old_pod is not None

    helm(cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE,
         "--values", str(VALUES), *monitoring, "--set", f"image.tag={tag}")
    cluster.kubectl("-n", NAMESPACE, "rollout", "status", "daemonset/gemini-vgpu-node",
                    "--timeout=300s", timeout=330)
    wait_node_ready(cluster)
    new_pod = node_pod(cluster)
    assert new_pod is not None and new_pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
    images = {c["name"]: c["image"] for c in new_pod["spec"]["initContainers"]
              + new_pod["spec"]["containers"]}
    assert set(images.values()) == {upgrade_image}, images

    create(cluster, workload(cluster, "new-hook", 3))
    wait_until("new-hook Running", lambda: phase(cluster, "new-hook") == "Running", 120)
    new = environment(report(cluster, "new-hook"))["LD_PRELOAD"]
    assert new.startswith(HOOK_PREFIX) and old.startswith(HOOK_PREFIX)
    assert new != old, "the upgraded image's interposer has the same name"
    lib = paths.default_hook_dir(Path(cluster.env["gemini_state"]))
    assert (lib / Path(old).name).is_file() and (lib / Path(new).name).is_file()
    after = cluster.get("pod", "-n", "default", "old-hook")
    assert after["status"]["phase"] == "Running"
    assert after["status"]["containerStatuses"][0]["containerID"] == running[0]["containerID"]
    assert exec_ok(cluster, "old-hook", "test", "-f", old)
    assert cluster.get("servicemonitor", "-n", NAMESPACE, "gemini-vgpu")["spec"] == \
        monitor["spec"]

    cluster.kubectl("delete", "pods", "-n", "default", "old-hook", "new-hook",
                    "--grace-period=1", "--wait=true", timeout=120)
    assert "ServiceMonitor" in {o["kind"] for o in manifest}
    uninstall(cluster, manifest)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s",
                    timeout=150)
