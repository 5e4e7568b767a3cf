"""An upgrade on the real node: the DaemonSet's image changed to one whose interposer differs
(its sources changed, so its versioned file name does); the controllers roll the node pod, the
running workload keeps the interposer it started with, a new workload gets the new one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import (
    BUILD_IMAGE,
    HOOK_PREFIX,
    IMAGE_WORK,
    NAMESPACE,
    NODE_IMAGE,
    REPO,
    Cluster,
    create,
    environment,
    phase,
    report,
    run,
    wait_until,
    workload,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

UPGRADE_IMAGE = NODE_IMAGE + "-upgrade"
CONTAINERS = ("config-manager", "install-hook", "device-plugin", "scheduler")


def build_upgrade_image(cluster: Cluster, tmp: Path) -> None:
    """The tracked tree with one comment added to an interposer source, built by its own
    scripts/build-image (the context is the script's tree) and imported into containerd."""
    tree = tmp / "tree"
    tree.mkdir()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    subprocess.run(["tar", "-C", str(REPO), "-cf", str(tmp / "tree.tar"), "--null", "-T", "-"],
                   input="\0".join(f for f in files if f).encode(), check=True)
    subprocess.run(["tar", "-C", str(tree), "-xf", str(tmp / "tree.tar")], check=True)
    source = sorted((tree / "vgpu_runtime" / "hook").rglob("*.c"))[0]
    source.write_text(source.read_text() + "\n/* the cluster test's upgrade */\n")
    work = IMAGE_WORK
    built = run([sys.executable, str(tree / BUILD_IMAGE.relative_to(REPO)), "--work", str(work),
                 "--name", UPGRADE_IMAGE], timeout=3000).stdout
    archive = next(line.split(" ", 1)[1] for line in built.splitlines()
                   if line.startswith("archive "))
    cluster.ctr("images", "import", archive)


def test_an_upgrade_keeps_running_pods_on_their_interposer(
        gemini_node: Cluster, cleanup: None, tmp_path: Path) -> None:
    cluster = gemini_node
    create(cluster, workload(cluster, "old-hook", 3))
    wait_until("old-hook Running", lambda: phase(cluster, "old-hook") == "Running", 120)
    old = environment(report(cluster, "old-hook"))["LD_PRELOAD"]
    container = cluster.get("pod", "-n", "default", "old-hook")["status"]["containerStatuses"]

    build_upgrade_image(cluster, tmp_path)
    cluster.kubectl("-n", NAMESPACE, "set", "image", "daemonset/gemini-vgpu-node",
                    *(f"{c}={UPGRADE_IMAGE}" for c in CONTAINERS))
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
