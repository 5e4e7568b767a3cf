"""The node image, built for real by scripts/build-image (mmdebstrap, podman import, podman build
on its own store) and its three entrypoints run under runc over the kubelet emulator's sockets.

Needs root, Debian's tools (the script installs mmdebstrap and podman with apt-get) and the
network (Debian's mirror, the Python package index). The build takes 5-7 minutes on two cores;
a rerun reuses build/image/base.tar and podman's layer cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.childenv import REPO
from tests.hook.conftest import Hooked, fake_dir, hook_lib, hooked  # noqa: F401 (fixtures)
from tests.integration.conftest import PluginNode, node  # noqa: F401 (fixture)
from tests.reliability.clients import Container, GiB
from tests.rollout import oci
from tests.scrape import free_port, samples, scrape, value
from vgpu_runtime import __version__, hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.devkit.fakeapi import FakeApiServer
from vgpu_runtime.hook import identity

SCRIPT = REPO / "scripts" / "build-image"
WORK = REPO / "build" / "image"
NAME = f"localhost/gemini-vgpu-node:{__version__}-test"
NETWORK_DOWN = re.compile(r"Failed to establish a new connection|Temporary failure resolving|"
                          r"Could not resolve|Network is unreachable")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@dataclass(frozen=True)
class Image:
    name: str
    image_id: str
    archive: Path
    digest: str
    podman: list[str]
    env: list[str]        # the image's Env, which runc does not read from the image itself
    registry: str | None  # host:port of the registry it was pushed to
    pushed: str | None    # the `pushed` line: REPOSITORY@sha256:...


def cannot_build() -> str | None:
    if os.geteuid() != 0:
        return "the image build needs root (mmdebstrap, podman, runc)"
    if shutil.which("apt-get") is None and not (shutil.which("mmdebstrap")
                                                and shutil.which("podman")):
        return "mmdebstrap and podman are missing and there is no apt-get to install them"
    return oci.runtime_available()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """Debian's docker-registry (the distribution registry) on a free local port, plain HTTP;
    None where it is not installed (the push is then not exercised, and its test skips)."""
    if shutil.which("docker-registry") is None:
        yield None
        return
    root = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    (root / "config.yml").write_text(f"version: 0.1\nstorage:\n  filesystem:\n"
                                     f"    rootdirectory: {root / 'data'}\n"
                                     f"http:\n  addr: {address}\n")
    with open(root / "registry.log", "wb") as log:
        proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{address}/v2/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((root / "registry.log").read_text()) from None
                time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def image(registry: str | None) -> Image:
    reason = cannot_build()
    if reason:
        pytest.skip(reason)
    push = (["--push", f"{registry}/gemini/vgpu-node:{__version__}", "--tls-verify=false"]
            if registry else [])
    result = subprocess.run([sys.executable, str(SCRIPT), "--work", str(WORK), "--name", NAME,
                             *push], capture_output=True, text=True, timeout=1500)
    if result.returncode != 0 and NETWORK_DOWN.search(result.stderr):
        pytest.skip(f"the build cannot reach Debian's mirror or the package index:\n"
                    f"{result.stderr[-3000:]}")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [line.split()[1] for line in result.stdout.splitlines()
             if line.startswith("build-image: ")]
    assert steps == ["1/6", "2/6", "3/6", "4/6", "5/6", "6/6"], result.stdout
    facts = dict(line.split(" ", 1) for line in result.stdout.splitlines()
                 if line.split(" ", 1)[0] in ("image", "id", "archive", "digest", "pushed"))
    # The driver the build chose and kept (auto: overlay where native here, else vfs).
    driver = (WORK / "storage-driver").read_text().strip()
    assert driver in ("overlay", "vfs") and f"(storage: {driver})" in result.stdout
    podman = ["podman", "--root", str(WORK / "storage"), "--runroot", str(WORK / "run"),
              "--storage-driver", driver]
    env = json.loads(subprocess.run([*podman, "image", "inspect", "--format",
                                     "{{json .Config.Env}}", NAME], capture_output=True,
                                    text=True, check=True).stdout)
    return Image(facts["image"], facts["id"], Path(facts["archive"]), facts["digest"], podman,
                 env, registry, facts.get("pushed"))


@pytest.fixture(scope="module")
def rootfs(image: Image) -> Iterator[Path]:
    with oci.mounted_image(image.podman, image.name) as path:
        yield path


def test_the_build_prints_the_name_and_digest_and_exports_an_oci_archive(image: Image) -> None:
    assert image.name == NAME
    inspected = subprocess.run([*image.podman, "image", "inspect", "--format", "{{.Id}}",
                                NAME], capture_output=True, text=True, check=True).stdout
    assert image.image_id == f"sha256:{inspected.strip()}"
    with tarfile.open(image.archive) as archive:
        layout = json.load(archive.extractfile("oci-layout"))  # type: ignore[arg-type]
        index = json.load(archive.extractfile("index.json"))  # type: ignore[arg-type]
    assert layout["imageLayoutVersion"] == "1.0.0"
    (manifest,) = index["manifests"]
    assert manifest["digest"] == image.digest and image.digest.startswith("sha256:")
    with tarfile.open(image.archive) as archive:
        blob = archive.extractfile("blobs/sha256/" + image.digest.split(":")[1])
        assert blob is not None
        config = json.load(blob)["config"]["digest"]
    assert config == image.image_id    # the manifest is this image's


def test_the_push_reaches_the_registry_under_the_digest_it_prints(image: Image) -> None:
    if image.registry is None:
        pytest.skip("Debian's docker-registry is not installed (scripts/test installs it)")
    assert image.pushed is not None
    repository, digest = image.pushed.split("@")
    assert repository == f"{image.registry}/gemini/vgpu-node" and digest.startswith("sha256:")
    accept = ("application/vnd.oci.image.manifest.v1+json, "
              "application/vnd.docker.distribution.manifest.v2+json")
    by_tag = urllib.request.Request(
        f"http://{image.registry}/v2/gemini/vgpu-node/manifests/{__version__}",
        headers={"Accept": accept})
    with urllib.request.urlopen(by_tag, timeout=10) as answer:
        manifest = answer.read()
    assert "sha256:" + hashlib.sha256(manifest).hexdigest() == digest
    layers = json.loads(manifest)["layers"]
    assert len(layers) >= 2   # the Debian base and the runtime stage's own


def test_the_image_runs_from_a_virtual_environment_without_a_compiler(image: Image,
                                                                      rootfs: Path) -> None:
    for script in ("gemini-install-hook", "gemini-device-plugin", "gemini-daemon",
                   "gemini-config-manager"):
        assert (rootfs / "opt" / "gemini" / "bin" / script).is_file()
    assert any(e.startswith("PATH=/opt/gemini/bin:") for e in image.env)
    assert not (rootfs / "usr" / "bin" / "gcc").exists(), "the builder's gcc leaked in"
    assert not (rootfs / "src").exists()


def test_the_image_carries_no_development_kit(rootfs: Path) -> None:
    """The node runs none of the kubelet emulator, the fake API server, the fake libcuda or
    gemini-demo (the cluster lane mounts its fake driver from the host, tests/cluster)."""
    (package,) = rootfs.glob("opt/gemini/lib/python3*/site-packages/vgpu_runtime")
    assert (package / "daemon").is_dir() and not (package / "devkit").exists()
    assert not list(rootfs.glob("opt/gemini/lib/python3*/site-packages/**/fake_cuda.c"))
    assert not (rootfs / "opt" / "gemini" / "bin" / "gemini-demo").exists()


def test_the_images_interposer_is_the_one_these_sources_build_here(rootfs: Path,
                                                                    hook_lib: Path) -> None:  # noqa: F811
    """Built in the image's /src by its own gcc, in another directory than the host's build:
    the same name, and the same bytes wherever the two compilers are the same release."""
    lib = "opt/gemini/lib/python3*/site-packages/vgpu_runtime/lib"
    (packaged,) = rootfs.glob(f"{lib}/{hooklib.LIBRARY_PREFIX}*")
    assert packaged.name == hooklib.library_name()
    # The only C library in the package: the token scheduler is Python alone.
    assert not list(rootfs.glob(f"{lib}/libgemini-timeshare.so.*"))
    ours, theirs = identity.describe(hook_lib), identity.describe(packaged)
    assert theirs["soname"] == hooklib.library_name()
    if ours["compiler"] != theirs["compiler"]:
        pytest.skip(f"this machine's gcc ({ours['compiler']}) is not the image's "
                    f"({theirs['compiler']}): bytes may differ")
    assert packaged.read_bytes() == hook_lib.read_bytes()


def build_infos(port: int) -> list[dict[str, str]]:
    """The labels of gemini_vgpu_build_info on a port (127.0.0.1: runc keeps the host's
    network)."""
    return [dict(sample.labels) for sample in samples(scrape(port, wait=30)).get(
        "gemini_vgpu_build_info", [])]


async def test_the_images_entrypoints_serve_a_node(image: Image, rootfs: Path,
                                                   node: PluginNode, hooked: Hooked,  # noqa: F811
                                                   ) -> None:
    """The DaemonSet's four containers from the image, under runc with a read-only root and
    no capabilities: the config manager writes the node's configuration (over the fake API
    server), the init step installs the interposer on the "host" (twice: a restart never
    fails), the plugin registers with the kubelet emulator and answers Allocate with the
    installed file's name, and the daemon serves the allocation's channel to a hooked program.
    The three long-running programs serve their metrics ports, each with the image's build."""
    state, kubelet_dir, pod_resources = node.state_dir, node.kubelet_dir, node.root / "pr"
    state.mkdir(parents=True)
    configs, node_config = node.root / "configs", node.root / "node-config"
    configs.mkdir()
    node_config.mkdir()
    (configs / "default.yaml").write_bytes((REPO / "daemonset/base/config/default.yaml")
                                           .read_bytes())
    ports = {"config-manager": free_port(), "scheduler": free_port(),
             "device-plugin": free_port()}
    programs = {"config-manager": "gemini-config-manager", "scheduler": "gemini-daemon",
                "device-plugin": "gemini-device-plugin"}
    runc = oci.Runc(node.root / "runc", rootfs, image.env)
    install = ["gemini-install-hook", f"--state-dir={state}", "--log-format=text"]
    stack = contextlib.ExitStack()   # the fake API server, for the config manager
    api = stack.enter_context(FakeApiServer())
    api.add_node("gemini-node")
    try:
        runc.start("config-manager", [
            "gemini-config-manager", f"--kube-api-url={api.url}", "--node-name=gemini-node",
            f"--source-dir={configs}", f"--output={node_config / 'config.yaml'}",
            f"--metrics-port={ports['config-manager']}", "--metrics-address=127.0.0.1",
            "--log-format=text"], [(configs, False), (node_config, True)])
        deadline = time.monotonic() + 60
        while not (node_config / "config.yaml").exists():
            assert runc.alive("config-manager") and time.monotonic() < deadline, \
                runc.output("config-manager")
            await asyncio.sleep(0.2)
        assert (node_config / "config.yaml").read_bytes() == (configs / "default.yaml"
                                                              ).read_bytes()
        code, out = runc.run("install-hook", install, [(state, True)])
        assert code == 0 and "interposer installed" in out, out
        installed = state / "lib" / hooklib.library_name()
        assert installed.read_bytes() == next(rootfs.glob(
            f"opt/gemini/lib/python3*/site-packages/vgpu_runtime/lib/{installed.name}"
        )).read_bytes()
        code, out = runc.run("install-hook-again", install, [(state, True)])
        assert code == 0 and "already present" in out, out

        runc.start("scheduler", ["gemini-daemon", f"--state-dir={state}",
                                 f"--pod-resources-socket={pod_resources}/kubelet.sock",
                                 "--simulate-gpus=2",
                                 f"--metrics-port={ports['scheduler']}",
                                 "--metrics-address=127.0.0.1", "--log-format=text"],
                   [(state, True), (pod_resources, False)])
        runc.start("device-plugin", ["gemini-device-plugin", f"--kubelet-dir={kubelet_dir}",
                                     f"--state-dir={state}", "--simulate-gpus=2",
                                     f"--metrics-port={ports['device-plugin']}",
                                     "--metrics-address=127.0.0.1", "--log-format=text"],
                   [(kubelet_dir, True), (state, True)])
        try:
            await node.wait_registered(20, timeout=60)
        except AssertionError:
            raise AssertionError(runc.output("device-plugin")) from None

        pod = await node.kubelet.admit_pod("trainer", containers=[("main", 3)])
        assert pod.admitted, pod.message
        response = pod.containers["main"].response
        preload = f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}"
        assert response.envs["LD_PRELOAD"] == preload
        (lib_mount,) = [m for m in response.mounts
                        if m.container_path == paths.CONTAINER_LIB_DIR]
        assert lib_mount.read_only and Path(lib_mount.host_path) / installed.name == installed
        (record,) = [r for _, r in allocation.scan_records(state)]
        assert isinstance(record, allocation.AllocationRecord)
        assert record.hook_library == hooklib.library_name()

        # A program of that pod, preloading the very file the init step installed.
        def use_the_gpu() -> dict[str, object]:
            program = Container(Hooked(installed, hooked.fake), record)
            try:
                assert program.alloc(GiB) == 0
                limit = record.gpus[0].memory_limit
                assert program.alloc(limit) == 2, "past the 3-slice memory limit"
                return program.step("launch 0.2")
            finally:
                program.stop()

        launched = await asyncio.to_thread(use_the_gpu)
        stats = launched["stats"]
        assert launched["returns"] and isinstance(stats, dict)
        assert stats["daemon_connects"] == 1 and stats["token_requests"] >= 1, stats
        assert stats["ungated_launches"] == 0 and stats["mem_refused"] == 1, stats

        # Each program's port: the image's build, and what it did here.
        for name, port in ports.items():
            infos = await asyncio.to_thread(build_infos, port)
            assert infos == [{"version": __version__, "interposer": installed.name,
                              "program": programs[name]}], (name, infos)
        found = samples(await asyncio.to_thread(scrape, ports["device-plugin"]))
        assert value(found, "gemini_vgpu_plugin_allocations_served_total") == 1
        assert sum(s.value for s in found["gemini_vgpu_plugin_gpu_slices_advertised"]) == 20
        found = samples(await asyncio.to_thread(scrape, ports["config-manager"]))
        assert value(found, "gemini_vgpu_config_manager_configuration_applied",
                     config="default") == 1
        assert value(found, "gemini_vgpu_config_manager_writes_total") == 1
        assert runc.alive("scheduler") and runc.alive("device-plugin")
        assert runc.alive("config-manager")
    finally:
        codes = {name: runc.stop(name) for name in list(runc.running)}
        stack.close()
        for name in runc.logs:
            print(f"---- {name} ----\n{runc.output(name)[-4000:]}")
    assert codes == {"scheduler": 0, "device-plugin": 0, "config-manager": 0}, codes


def test_the_build_context_leaves_out_the_venv_and_caches(image: Image, tmp_path: Path) -> None:
    """podman build reads .dockerignore, an allowlist: the whole context copied into an empty
    image holds what the wheel is built from and nothing else: no .venv/ (scripts/test made
    one; the demo's is 444 MB), build/ (this test's podman storage), tests or bytecode caches."""
    assert (REPO / ".venv").is_dir() and (REPO / "build").is_dir()
    dockerfile = tmp_path / "Containerfile"
    dockerfile.write_text("FROM scratch\nCOPY . /context\n")
    name = "localhost/gemini-vgpu-context:test"
    subprocess.run([*image.podman, "build", "--isolation", "chroot", "--file", str(dockerfile),
                    "--tag", name, str(REPO)], check=True, capture_output=True, timeout=300)
    try:
        with oci.mounted_image(image.podman, name) as root:
            context = root / "context"
            assert (context / "vgpu_runtime" / "hook" / "build.py").is_file()
            assert (context / "vgpu_runtime" / "common" / "cbuild.py").is_file()
            assert sorted(p.name for p in context.iterdir()) == [
                "README.md", "device_plugin", "pyproject.toml", "setup.py", "vgpu_runtime"]
            assert not list(context.rglob("__pycache__"))
    finally:
        subprocess.run([*image.podman, "rmi", "--force", name], capture_output=True)
