"""An upgrade on the real node: the DaemonSet's image changed to one whose interposer differs
(its sources changed, so its versioned file name does); the controllers roll the node pod, the
running workload keeps the interposer it started with, a new workload gets the new one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.conftest import (
    HOOK_PREFIX,
    NAMESPACE,
    Cluster,
    create,
    environment,
    phase,
    report,
    wait_until,
    workload,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

CONTAINERS = ("config-manager", "install-hook", "device-plugin", "scheduler")


def test_an_upgrade_keeps_running_pods_on_their_interposer(
        gemini_node: Cluster, upgrade_image: str, cleanup: None) -> None:
    cluster = gemini_node
    create(cluster, workload(cluster, "old-hook", 3))
    wait_until("old-hook Running", lambda: phase(cluster, "old-hook") == "Running", 120)
    old = environment(report(cluster, "old-hook"))["LD_PRELOAD"]
    container = cluster.get("pod", "-n", "default", "old-hook")["status"]["containerStatuses"]

    cluster.kubectl("-n", NAMESPACE, "set", "image", "daemonset/gemini-vgpu-node",
                    *(f"{c}={upgrade_image}" for c in CONTAINERS))
    cluster.kubectl("-n", NAMESPACE, "rollout", "status", "daemonset/gemini-vgpu-node",
                    "--timeout=300s", timeout=330)

    create(cluster, workload(cluster, "new-hook", 3))
    wait_until("new-hook Running", lambda: phase(cluster, "new-hook") == "Running", 120)
    new = environment(report(cluster, "new-hook"))["LD_PRELOAD"]
    assert new.startswith(HOOK_PREFIX) and old.startswith(HOOK_PREFIX)
    assert new != old, "the upgraded image's interposer has the same name"
    # Both versions are on the host; the running pod still runs, still sees its own.
    lib = Path(cluster.env["gemini_state"]) / "lib"
    assert (lib / Path(old).name).is_file() and (lib / Path(new).name).is_file()
    after = cluster.get("pod", "-n", "default", "old-hook")
    assert after["status"]["phase"] == "Running"
    assert after["status"]["containerStatuses"][0]["containerID"] == container[0]["containerID"]
    cluster.kubectl("exec", "-n", "default", "old-hook", "--", "test", "-f", old)
