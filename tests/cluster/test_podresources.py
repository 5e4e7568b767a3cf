"""The real kubelet's PodResources API feeding the node daemon: an allocation is bound to the
pod that holds its slices, and collected (record, binding, channel) once its pod has been gone
from PodResources for the daemon's grace period (collect_grace, 60 s by default)."""

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
from vgpu_runtime import allocation, paths

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
