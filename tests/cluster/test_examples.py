"""The README's examples (daemonset/examples/) on the real cluster, their image and command
replaced by the tests' workload image and its report (their PyTorch programs need a GPU): what
each asks of the scheduler, kubelet, the plugin and the daemon is what they get."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import (
    REPO,
    REPORT,
    SIMULATED_GPUS,
    Cluster,
    environment,
    monitor_pages,
    wait_until,
)
from tests.scrape import samples
from vgpu_runtime.contracts import paths
from vgpu_runtime.gpus.simulated import simulated_uuid

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

EXAMPLES = REPO / "daemonset" / "examples"
GiB = 1 << 30


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]
    return [spec["template"]["spec"]] if "template" in spec else [spec]


def localised(path: Path, cluster: Cluster, report: str = REPORT) -> dict[str, Any]:
    """The example with every container's image, command and args replaced."""
    obj: dict[str, Any] = yaml.safe_load(path.read_text())
    obj["metadata"]["namespace"] = "default"
    for spec in pod_specs(obj):
        for container in spec["containers"]:
            container.update(image=cluster.env["workload_image"], imagePullPolicy="Never",
                             command=["/bin/sh", "-c", report])
            container.pop("args", None)
        spec["terminationGracePeriodSeconds"] = 1
    return obj


@pytest.fixture
def apply(gemini_node: Cluster) -> Iterator[Any]:
    applied: list[dict[str, Any]] = []

    def do(obj: dict[str, Any]) -> None:
        gemini_node.kubectl("apply", "-f", "-", input=json.dumps(obj))
        applied.append(obj)
    yield do
    for obj in applied:
        gemini_node.kubectl("delete", "-f", "-", "--wait=true", "--timeout=90s",
                            "--cascade=foreground", input=json.dumps(obj), check=False,
                            timeout=120)


def reports(cluster: Cluster, selector: str, count: int) -> list[dict[str, str]]:
    """The environment each of `count` pods matching `selector` printed."""
    def ready() -> list[str] | None:
        pods = cluster.get("pods", "-n", "default", "-l", selector)["items"]
        names = [p["metadata"]["name"] for p in pods
                 if p["metadata"].get("deletionTimestamp") is None]
        if len(names) != count:
            return None
        logs = [cluster.kubectl("logs", "-n", "default", n, check=False) for n in names]
        return logs if all("--- end" in log for log in logs) else None
    logs = wait_until(f"{count} reports of pods {selector}", ready, 180,
                      lambda: cluster.kubectl("describe", "pods", "-n", "default", "-l",
                                              selector, check=False)[-4000:])
    return [environment(log) for log in logs]


def labelled(obj: dict[str, Any], label: str) -> dict[str, Any]:
    for spec_holder in ([obj["spec"]["template"]] if "template" in obj["spec"] else [obj]):
        spec_holder.setdefault("metadata", {}).setdefault("labels", {})["example"] = label
    return obj


def test_the_three_slice_pod(gemini_node: Cluster, apply: Any) -> None:
    apply(labelled(localised(EXAMPLES / "pod-3-slices.yaml", gemini_node), "pod-3"))
    (env,) = reports(gemini_node, "example=pod-3", 1)
    assert float(env[paths.ENV_SHARE]) == pytest.approx(0.3), env


def test_the_deployment_packs_three_replicas_onto_one_gpu(gemini_node: Cluster,
                                                          apply: Any) -> None:
    apply(localised(EXAMPLES / "deployment-shared-gpu.yaml", gemini_node))
    envs = reports(gemini_node, "app=vgpu-shared-inference", 3)
    # Best fit (the default placement): 9 of one GPU's 10 slices, all three on one GPU.
    assert len({env["CUDA_VISIBLE_DEVICES"] for env in envs}) == 1, envs
    assert len({env[paths.ENV_ALLOCATION_ID] for env in envs}) == 3, envs


def test_the_pod_with_limits_gets_its_annotations(gemini_node: Cluster, apply: Any) -> None:
    apply(labelled(localised(EXAMPLES / "pod-with-limits.yaml", gemini_node), "limits"))
    (env,) = reports(gemini_node, "example=limits", 1)
    binding = paths.bindings_dir(gemini_node.env["gemini_state"]) / \
        f"{env[paths.ENV_ALLOCATION_ID]}.json"
    # The daemon read the annotations through the API (its RBAC: get pods).
    bound = wait_until("the binding with the annotations' limits", lambda: (
        data if binding.is_file() and (data := json.loads(binding.read_text()))["limit"]
        is not None else None), 60)
    assert bound["pod"]["name"] == "vgpu-with-limits", bound
    assert bound["limit"] == pytest.approx(0.4) and bound["memory_limit"] == 8 * GiB, bound


def test_the_job_on_two_whole_gpus_completes(gemini_node: Cluster, apply: Any) -> None:
    report = REPORT.replace("exec sleep 3600", "exit 0")
    apply(labelled(localised(EXAMPLES / "job-two-gpus.yaml", gemini_node, report), "job"))
    wait_until("the Job complete", lambda: gemini_node.get(
        "job", "-n", "default", "vgpu-two-gpus")["status"].get("succeeded") == 1, 180,
        lambda: gemini_node.kubectl("describe", "pods", "-n", "default", "-l", "example=job",
                                    check=False)[-4000:])
    (env,) = reports(gemini_node, "example=job", 1)
    assert sorted(env["CUDA_VISIBLE_DEVICES"].split(",")) == sorted(
        simulated_uuid(i) for i in range(SIMULATED_GPUS)), env


def test_the_servicemonitor_example_selects_the_metrics_services(
        gemini_node: Cluster, servicemonitor_crd: None) -> None:
    """examples/monitoring/servicemonitor.yaml, for kustomize installs, applied as it is: the
    API server accepts it (the Prometheus Operator's CRD), and each of its endpoints has a
    ready target, the node pod's daemon or plugin, serving metrics."""
    path = EXAMPLES / "monitoring" / "servicemonitor.yaml"
    gemini_node.kubectl("apply", "-f", str(path))
    try:
        pages = monitor_pages(gemini_node, gemini_node.get("-f", str(path)))
        for url, text in pages.items():
            assert "gemini_vgpu_build_info" in samples(text), (url, text[:1000])
    finally:
        gemini_node.kubectl("delete", "-f", str(path), "--ignore-not-found")
