"""The real kubelet's PodResources API and the API server feeding the node daemon: an allocation
is bound to the pod that holds its slices, collected (record, binding, channel) once its pod has
been gone from PodResources for the daemon's grace period (collect_grace, 60 s by default), and
an invalid annotation of its pod is a Warning Event."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.conftest import (
    Cluster,
    create,
    environment,
    phase,
    report,
    wait_until,
    workload,
)
from vgpu_runtime.contracts import allocation, paths

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

COLLECT_GRACE_S = 60.0     # the daemon's default collect_grace
POD_RESOURCES_INTERVAL_S = 5.0


def test_a_deleted_pods_allocation_is_collected_after_the_grace_period(
        gemini_node: Cluster, cleanup: None) -> None:
    cluster = gemini_node
    create(cluster, workload(cluster, "short-lived", 2))
    wait_until("short-lived Running", lambda: phase(cluster, "short-lived") == "Running", 120)
    allocation_id = environment(report(cluster, "short-lived"))[paths.ENV_ALLOCATION_ID]
    state = Path(cluster.env["gemini_state"])
    record = paths.allocations_dir(state) / f"{allocation_id}.json"
    binding = paths.bindings_dir(state) / f"{allocation_id}.json"
    wait_until("the binding to short-lived", lambda: binding.is_file()
               and "short-lived" in binding.read_text(), 60)
    channel = Path(allocation.decode_record(record, record.read_bytes()).channel_dir)
    assert channel.is_dir()

    cluster.kubectl("delete", "pod", "-n", "default", "short-lived", "--grace-period=1",
                    "--wait=true", timeout=120)
    # Not at once: a pod absent from one List may be a kubelet restart.
    assert record.is_file()
    wait_until("the record collected", lambda: not record.exists(),
               COLLECT_GRACE_S + 6 * POD_RESOURCES_INTERVAL_S + 30)
    assert not binding.exists() and not channel.exists()


def test_an_invalid_annotation_is_an_event_on_the_pod(gemini_node: Cluster,
                                                      cleanup: None) -> None:
    """README: an invalid value is ignored with a Warning Event (InvalidVgpuAnnotation) on the
    pod, which runs with the defaults; the daemon posts it with the ServiceAccount's RBAC."""
    cluster = gemini_node
    pod = workload(cluster, "bad-annotation", 2)
    pod["metadata"]["annotations"] = {"gemini.ai/vgpu-limit": "lots"}
    create(cluster, pod)
    wait_until("bad-annotation Running", lambda: phase(cluster, "bad-annotation") == "Running",
               120)
    events = wait_until("the InvalidVgpuAnnotation Event", lambda: [
        e for e in cluster.get("events", "-n", "default", "--field-selector",
                               "involvedObject.name=bad-annotation")["items"]
        if e["reason"] == "InvalidVgpuAnnotation"], 60)
    assert events[0]["type"] == "Warning" and "lots" in events[0]["message"], events
    allocation_id = environment(report(cluster, "bad-annotation"))[paths.ENV_ALLOCATION_ID]
    binding = paths.bindings_dir(cluster.env["gemini_state"]) / f"{allocation_id}.json"
    assert '"limit": null' in binding.read_text()
