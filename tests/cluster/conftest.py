"""The real single-node cluster of scripts/cluster/cluster.py for the tests marked `cluster`.

The session's first cluster test starts it (building what the cache lacks: tens of minutes
cold), imports the node image from scripts/build-image's OCI archive, writes a CDI spec for the
simulated GPUs, labels the node and applies tests/cluster/overlay; the session's end stops it
(GEMINI_CLUSTER_KEEP=1 leaves it up, for a look with `export KUBECONFIG=...`; a cluster already
up is used and left as it is). A cluster that
cannot start fails the tests, saying why: they never skip. Root only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.scrape import fetch
from vgpu_runtime.contracts import paths
from vgpu_runtime.devkit.fakecuda.builder import build_fake_driver
from vgpu_runtime.gpus.simulated import SimulatedBackend, simulated_uuid

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cluster" / "cluster.py"
BUILD_IMAGE = REPO / "scripts" / "build-image"
OVERLAY = REPO / "tests" / "cluster" / "overlay"
CHART = REPO / "daemonset" / "chart" / "gemini-vgpu"
IMAGE_WORK = REPO / "build" / "image"
NODE_IMAGE = "localhost/gemini-vgpu-node:cluster-test"
NAMESPACE = "gemini-system"
# The node DaemonSet's pods (both install ways label them so; the MPS control daemon's pods
# share the name label and are component=mps).
NODE_PODS = "app.kubernetes.io/name=gemini-vgpu,app.kubernetes.io/component=node"
SIMULATED_GPUS = 2          # tests/cluster/overlay/config/default.yaml
DRIVER_IN_CONTAINER = "/opt/nvidia/lib64"   # where the CDI spec mounts the fake driver
SLICES_PER_GPU = 10
T = TypeVar("T")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Every test here is a cluster test; the marker is what lanes select on.
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.cluster)


def run(command: list[str], timeout: float = 600, input: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            input=input, stdin=None if input is not None else subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@dataclass
class Cluster:
    env: dict[str, str]

    @property
    def node(self) -> str:
        return self.env["node"]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> str:
        return run([self.env["kubectl"], "--kubeconfig", self.env["kubeconfig"], *args],
                   timeout=timeout, input=input, check=check).stdout

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def ctr(self, *args: str, timeout: float = 600) -> str:
        return run([self.env["ctr"], "--address", self.env["containerd_socket"], "-n", "k8s.io",
                    *args], timeout=timeout).stdout

    def log(self, component: str, lines: int = 60) -> str:
        path = Path(self.env["state"]) / "logs" / f"{component}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def wait_until(what: str, probe: Callable[[], T | None], timeout: float,
               explain: Callable[[], str] = lambda: "") -> T:
    """Polls `probe` until it returns something true; fails naming `what` and `explain()`."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except AssertionError as error:
            last_error = str(error)[-1500:]
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{last_error}\n{explain()}")


@dataclass
class Tools:
    """The cluster lane's helm and kubectl, as scripts/cluster/cluster.py builds them."""
    helm: str
    kubectl: str

    def helm_run(self, *args: str, check: bool = True,
                 timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run([self.helm, *args], check=check, timeout=timeout)


def cluster_step(verb: str) -> None:
    """scripts/cluster/cluster.py VERB (build, up: long when cold), its output passed on; a
    failure fails the test with the output's tail and the time it took."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), verb], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=5400)
    sys.stderr.write(done.stdout)
    if done.returncode != 0:
        pytest.fail(f"scripts/cluster/cluster.py {verb} failed ({done.returncode}) after "
                    f"{time.monotonic() - started:.0f} s:\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-5000:]}")


@pytest.fixture(scope="session")
def tools() -> Tools:
    """helm and kubectl from the cache, built where it lacks them (cluster.py build); no cluster
    needs to be up. Fails, saying why, where they cannot be built."""
    cluster_step("build")
    env = json.loads(run([sys.executable, str(SCRIPT), "env"]).stdout)
    return Tools(env["helm"], env["kubectl"])


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("the cluster tests need root (cgroups, mounts, iptables): run them as root")
    # A cluster already up (cluster.py up by hand) is used as it is and left up.
    reuse = subprocess.run([sys.executable, str(SCRIPT), "status"], capture_output=True,
                           stdin=subprocess.DEVNULL).returncode == 0
    if not reuse:
        cluster_step("up")
    env = json.loads(run([sys.executable, str(SCRIPT), "env"]).stdout)
    try:
        yield Cluster(env)
    finally:
        if not reuse and os.environ.get("GEMINI_CLUSTER_KEEP") != "1":
            run([sys.executable, str(SCRIPT), "down"], timeout=300, check=False)


@pytest.fixture(scope="session")
def node_image(cluster: Cluster) -> str:
    """scripts/build-image's image, imported into the cluster's containerd from its OCI archive.
    Its work directory is tests/rollout/test_image.py's, so one lane's base and layers serve
    the other."""
    work = IMAGE_WORK
    built = run([sys.executable, str(BUILD_IMAGE), "--work", str(work), "--name", NODE_IMAGE],
                timeout=3000).stdout
    archive = next(line.split(" ", 1)[1] for line in built.splitlines()
                   if line.startswith("archive "))
    cluster.ctr("images", "import", archive)
    assert NODE_IMAGE in cluster.ctr("images", "ls", "-q").split()
    return NODE_IMAGE


UPGRADE_IMAGE = NODE_IMAGE + "-upgrade"


@pytest.fixture(scope="session")
def upgrade_image(node_image: str, cluster: Cluster,
                  tmp_path_factory: pytest.TempPathFactory) -> str:
    """An image for upgrades: the tracked tree with one comment added to an interposer source
    (so the interposer's versioned file name differs), built by its own scripts/build-image
    (the context is the script's tree) and imported into containerd."""
    tmp = tmp_path_factory.mktemp("upgrade")
    tree = tmp / "tree"
    tree.mkdir()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    subprocess.run(["tar", "-C", str(REPO), "-cf", str(tmp / "tree.tar"), "--null", "-T", "-"],
                   input="\0".join(f for f in files if f).encode(), check=True)
    subprocess.run(["tar", "-C", str(tree), "-xf", str(tmp / "tree.tar")], check=True)
    source = sorted((tree / "vgpu_runtime" / "hook").rglob("*.c"))[0]
    source.write_text(source.read_text() + "\n/* the cluster test's upgrade */\n")
    built = run([sys.executable, str(tree / BUILD_IMAGE.relative_to(REPO)), "--work",
                 str(IMAGE_WORK), "--name", UPGRADE_IMAGE], timeout=3000).stdout
    archive = next(line.split(" ", 1)[1] for line in built.splitlines()
                   if line.startswith("archive "))
    cluster.ctr("images", "import", archive)
    assert UPGRADE_IMAGE in cluster.ctr("images", "ls", "-q").split()
    return UPGRADE_IMAGE


def write_cdi_spec(cluster: Cluster) -> None:
    """CDI devices for the simulated GPUs, shaped as `nvidia-ctk cdi generate` writes them for
    real ones: the plugin's Allocate names nvidia.com/gpu=<uuid> and containerd resolves it
    here. The spec mounts the tests' fake driver (libcuda.so.1, libnvidia-ml.so.1, built here)
    where the real one would be, with the device nodes; each device sets the fake's GPU and a
    variable naming it, which the test pods read back."""
    driver = build_fake_driver(Path(cluster.env["state"]) / "fake-driver")
    libraries = ("libcuda.so.1", "libnvidia-ml.so.1")
    spec = {
        "cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
        "containerEdits": {
            "env": [f"LD_LIBRARY_PATH={DRIVER_IN_CONTAINER}",
                    f"FAKE_CUDA_TOTAL_MEM={SimulatedBackend(1).gpus[0].memory_total}"],
            "deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195,
                             "minor": 255, "permissions": "rw"}],
            "mounts": [{"hostPath": str(driver / name),
                        "containerPath": f"{DRIVER_IN_CONTAINER}/{name}",
                        "options": ["ro", "nosuid", "nodev", "bind"]} for name in libraries],
        },
        "devices": [{"name": simulated_uuid(i), "containerEdits": {
            "env": [f"FAKE_CUDA_UUIDS={simulated_uuid(i)}",
                    f"GEMINI_TEST_CDI_GPU_{i}={simulated_uuid(i)}"],
            "deviceNodes": [{"path": f"/dev/nvidia{i}", "type": "c", "major": 195, "minor": i,
                             "permissions": "rw"}]}} for i in range(SIMULATED_GPUS)],
    }
    directory = Path(cluster.env["cdi_dir"])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "nvidia.com-gpu.json").write_text(json.dumps(spec, indent=1))


def live_pod(cluster: Cluster, selector: str) -> dict[str, Any] | None:
    """A pod of the namespace matching `selector` that is not being deleted, or None."""
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", selector)
    running = [p for p in pods["items"] if p["metadata"].get("deletionTimestamp") is None]
    return running[0] if running else None


def node_pod(cluster: Cluster) -> dict[str, Any] | None:
    return live_pod(cluster, NODE_PODS)


def pod_ready(pod: dict[str, Any] | None) -> bool:
    if pod is None:
        return False
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return conditions.get("Ready") == "True"


def vgpu_capacity(cluster: Cluster) -> tuple[str | None, str | None]:
    status = cluster.get("node", cluster.node)["status"]
    return (status.get("capacity", {}).get("gemini.ai/vgpu"),
            status.get("allocatable", {}).get("gemini.ai/vgpu"))


def explain_node_pod(cluster: Cluster) -> Callable[[], str]:
    def explain() -> str:
        out = cluster.kubectl("-n", NAMESPACE, "describe", "pods", check=False)
        logs = "".join(cluster.kubectl("-n", NAMESPACE, "logs", "-l", NODE_PODS, "-c", c,
                                       "--tail=30", check=False)
                       for c in ("device-plugin", "scheduler"))
        return f"{out[-4000:]}\n{logs[-3000:]}\nkubelet:\n{cluster.log('kubelet', 40)}"
    return explain


def prepare_node(cluster: Cluster) -> None:
    """What the node needs before either install: the CDI spec, the opt-in label."""
    write_cdi_spec(cluster)
    cluster.kubectl("label", "node", cluster.node, "gemini.ai/vgpu.enabled=true", "--overwrite")


def wait_node_ready(cluster: Cluster) -> None:
    """The node pod Ready and its slices advertised by the real kubelet."""
    wait_until("the node DaemonSet's pod Ready", lambda: pod_ready(node_pod(cluster)), 300,
               explain_node_pod(cluster))
    expected = str(SIMULATED_GPUS * SLICES_PER_GPU)
    wait_until(f"gemini.ai/vgpu capacity and allocatable {expected}",
               lambda: vgpu_capacity(cluster) == (expected, expected), 120,
               explain_node_pod(cluster))


def install_overlay(cluster: Cluster) -> None:
    prepare_node(cluster)
    cluster.kubectl("apply", "-k", str(OVERLAY))
    wait_node_ready(cluster)


@pytest.fixture(scope="session")
def gemini_node(cluster: Cluster, node_image: str) -> Cluster:
    """The DaemonSet of tests/cluster/overlay running on the labelled node, its slices
    advertised."""
    install_overlay(cluster)
    return cluster


HOOK_PREFIX = f"{paths.CONTAINER_LIB_DIR}/libgemini-hook.so."
# What each workload prints before it sleeps: its environment, its mounts, whether it can
# write its channel directory, what the channel and library directories hold.
REPORT = ("env; echo '--- mounts'; cat /proc/self/mountinfo; echo '--- write';"
          f" (echo x > {paths.CONTAINER_CHANNEL_DIR}/probe) 2>/dev/null && echo WRITABLE"
          " || echo READONLY; echo '--- files';"
          f" ls {paths.CONTAINER_CHANNEL_DIR} {paths.CONTAINER_LIB_DIR}; echo '--- end';"
          " exec sleep 3600")


def workload(cluster: Cluster, name: str, slices: int, image: str | None = None,
             script: str = REPORT, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod of one container asking `slices`, running `script` in `image` (the workload
    image and the REPORT script unless told)."""
    container: dict[str, Any] = {
        "name": "app", "image": image or cluster.env["workload_image"],
        "imagePullPolicy": "Never", "command": ["/bin/sh", "-c", script],
        "resources": {"limits": {"gemini.ai/vgpu": str(slices)}},
    }
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"test": "cluster"}},
        "spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [container],
        },
    }


def create(cluster: Cluster, *pods: dict[str, Any]) -> None:
    cluster.kubectl("create", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": list(pods)}))


def phase(cluster: Cluster, name: str) -> str:
    return str(cluster.get("pod", name, "-n", "default")["status"].get("phase", ""))


def report(cluster: Cluster, name: str) -> str:
    def complete() -> str | None:
        out = cluster.kubectl("logs", "-n", "default", name, check=False)
        return out if "--- end" in out else None
    return wait_until(f"{name}'s report", complete, 60,
                      lambda: cluster.kubectl("describe", "pod", "-n", "default", name,
                                              check=False))


def environment(text: str) -> dict[str, str]:
    """The variables a workload's report printed."""
    return dict(line.split("=", 1) for line in text.split("--- mounts")[0].splitlines()
                if "=" in line)


@pytest.fixture
def cleanup(cluster: Cluster) -> Iterator[None]:
    yield
    cluster.kubectl("delete", "pods", "-n", "default", "-l", "test=cluster", "--wait=true",
                    "--grace-period=1", "--timeout=60s", check=False)


SERVICEMONITOR_CRD = "servicemonitors.monitoring.coreos.com"


@pytest.fixture
def servicemonitor_crd(cluster: Cluster) -> Iterator[None]:
    """The Prometheus Operator's ServiceMonitor CRD (scripts/cluster/cluster.py copies it from
    the operator's Go module into its cache), applied for one test and deleted after it: the
    cluster, like most, has no Prometheus Operator otherwise."""
    cluster.kubectl("apply", "--server-side", "-f", cluster.env["servicemonitor_crd"])
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{SERVICEMONITOR_CRD}",
                    "--timeout=60s", timeout=90)
    try:
        yield
    finally:
        cluster.kubectl("delete", "crd", SERVICEMONITOR_CRD, "--wait=true", "--timeout=120s",
                        timeout=150, check=False)


def ready_urls(cluster: Cluster, namespace: str, service: str,
               endpoint: dict[str, Any]) -> list[str]:
    """The URLs of a ServiceMonitor endpoint at a Service's ready EndpointSlice addresses."""
    urls = []
    for piece in cluster.get("endpointslices", "-n", namespace, "-l",
                             f"kubernetes.io/service-name={service}")["items"]:
        (port,) = [p["port"] for p in piece.get("ports") or [] if p["name"] == endpoint["port"]]
        urls += [f"http://{a['addresses'][0]}:{port}{endpoint['path']}"
                 for a in piece.get("endpoints") or [] if a["conditions"].get("ready")]
    return urls


def scrape_urls(cluster: Cluster, monitor: dict[str, Any]) -> list[str]:
    """What Prometheus would scrape for a ServiceMonitor: for each of its endpoints, the
    Services its selector picks in the namespaces it names that have a port of that name, at
    their ready addresses."""
    spec = monitor["spec"]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    urls = []
    for namespace in spec["namespaceSelector"]["matchNames"]:
        services = cluster.get("services", "-n", namespace, "-l", selector)["items"]
        for endpoint in spec["endpoints"]:
            named = [s["metadata"]["name"] for s in services
                     if endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}]
            assert named, f"no Service selected by {selector} has a port {endpoint['port']}"
            for service in named:
                urls += ready_urls(cluster, namespace, service, endpoint)
    return urls


def scrape_url(url: str) -> str:
    """A target's page; a failure to reach it fails as an assertion (wait_until retries)."""
    try:
        status, text = fetch(url)
    except OSError as err:
        raise AssertionError(f"{url}: {err}") from None
    assert status == 200, (url, text[:500])
    return text


def monitor_pages(cluster: Cluster, monitor: dict[str, Any]) -> dict[str, str]:
    """Each page a ServiceMonitor's targets serve, by URL, once every endpoint has a ready
    target and each target answers."""
    urls = wait_until("a ready target for each of the ServiceMonitor's endpoints", lambda: (
        found if len(found := scrape_urls(cluster, monitor)) == len(
            monitor["spec"]["endpoints"]) else None), 60)
    return {url: wait_until(f"{url} answering", functools.partial(scrape_url, url), 60)
            for url in urls}
