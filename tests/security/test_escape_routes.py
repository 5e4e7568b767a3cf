"""Escape routes, tried and recorded: what a pod gets when it sets LD_PRELOAD or
NVIDIA_VISIBLE_DEVICES itself. These document outcomes; not every route is blocked.

Environment precedence, as the container gets it (kubelet GenerateRunContainerOptions puts the
device plugin's envs first and appends the container spec's `env`; CRI runtimes apply the list in
order over the image's env, a later name replacing an earlier one):

    image ENV  <  Allocate response envs  <  pod spec env
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from device_plugin.allocator import Allocator
from device_plugin.slices import SliceTable
from tests import sharedbuild
from tests.childenv import as_user, child_env, in_mount_namespace
from tests.gpu.replay import need_runtime, replayed
from vgpu_runtime import hooklib
from vgpu_runtime import pluginconfig as plugin_config
from vgpu_runtime.contracts import paths
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.devkit.kubelet_emulator.runtime import ContainerConfig
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2
from vgpu_runtime.pluginconfig import PluginConfig

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def container_env(image: Mapping[str, str], response: Mapping[str, str],
                  pod: Mapping[str, str]) -> dict[str, str]:
    """The precedence above: the pod's own env has the last word."""
    return {**image, **response, **pod}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ge-"))   # Unix socket paths must fit in 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _allocate(root: Path, strategy: str, **settings: str) -> tuple[PluginConfig, object]:
    (root / "k").mkdir(exist_ok=True)
    config = plugin_config.check(PluginConfig(
        kubelet_dir=str(root / "k"), state_dir=str(root / f"s-{strategy}"), simulate_gpus=2,
        simulate_memory=11 * GIB, memory_reserve=GIB, slices_per_gpu=10,
        device_list_strategy=strategy, **settings))  # type: ignore[arg-type]
    install_hook(config.host_hook_dir)
    table = SliceTable(SimulatedBackend(2, memory=config.simulate_memory).discover(), 10)
    return config, Allocator(config, table).allocate([f"{table.gpus[0].uuid}::0"])


# ---- NVIDIA_VISIBLE_DEVICES=all, per device-list strategy ----

@pytest.mark.parametrize("strategy, gpu_given_by, outcome", [
    # envvar: the GPU is only the env; the pod's "all" replaces it, and the NVIDIA runtime
    # then mounts every GPU. An escape, unless the runtime ignores the variable for
    # unprivileged pods (accept-nvidia-visible-devices-envvar-when-unprivileged = false).
    ("envvar", "env", "escape: every GPU with a default NVIDIA runtime"),
    # cdi: the GPU comes from cdi_devices; the response's "void" keeps an image's "all" out,
    # but a pod's own "all" replaces "void". A runtime in CDI mode (or with the envvar ignored
    # for unprivileged pods) gives only the CDI device; a legacy-mode runtime still honours it.
    ("cdi", "cdi_devices", "contained with a CDI-mode runtime; escape with a legacy one"),
    # device-nodes: the device nodes are in the response; same reasoning as cdi for the env.
    ("device-nodes", "devices", "contained unless a legacy NVIDIA runtime honours the env"),
])
def test_a_pod_asking_for_all_gpus(short_dir: Path, strategy: str, gpu_given_by: str,
                                   outcome: str) -> None:
    _, response = _allocate(short_dir, strategy)
    envs = dict(response.envs)  # type: ignore[attr-defined]
    uuid = envs["CUDA_VISIBLE_DEVICES"]
    assert "," not in uuid
    if gpu_given_by == "env":
        assert envs["NVIDIA_VISIBLE_DEVICES"] == uuid
        assert not list(response.cdi_devices) and not list(response.devices)  # type: ignore[attr-defined]
    else:
        assert envs["NVIDIA_VISIBLE_DEVICES"] == "void"
        given = (list(response.cdi_devices) if gpu_given_by == "cdi_devices"  # type: ignore[attr-defined]
                 else list(response.devices))  # type: ignore[attr-defined]
        assert len(given) >= 1
    cuda_image = {"NVIDIA_VISIBLE_DEVICES": "all"}      # what CUDA base images set
    assert container_env(cuda_image, envs, {})["NVIDIA_VISIBLE_DEVICES"] == envs[
        "NVIDIA_VISIBLE_DEVICES"], "the response must beat the image's own 'all'"
    hostile = container_env(cuda_image, envs, {"NVIDIA_VISIBLE_DEVICES": "all"})
    assert hostile["NVIDIA_VISIBLE_DEVICES"] == "all", outcome   # the pod's env wins


# ---- LD_PRELOAD, per injection method ----

PROBE = textwrap.dedent("""
    import json
    maps = open("/proc/self/maps").read()
    print(json.dumps({"hook_loaded": "libgemini-hook" in maps}))
""")


@pytest.fixture(scope="module")
def hook_lib() -> Path:
    """The run's strict build, in a directory every user may read (tests/sharedbuild.py)."""
    return sharedbuild.hook_library()


def _probe(env: Mapping[str, str]) -> bool:
    argv = [sys.executable, "-c", PROBE]
    proc = subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    loaded: bool = json.loads(proc.stdout.strip().splitlines()[-1])["hook_loaded"]
    return loaded


@pytest.mark.parametrize("pod_preload, expect_loaded", [
    (None, True),                         # the pod leaves it alone: the hook is loaded
    ("", False),                          # the pod empties it: not loaded
    ("/usr/lib/libother.so", False),      # the pod preloads its own library: not loaded
])
def test_env_injection_is_replaced_by_a_pods_own_ld_preload(
        short_dir: Path, hook_lib: Path, pod_preload: str | None, expect_loaded: bool) -> None:
    _, response = _allocate(short_dir, "cdi")
    envs = dict(response.envs)  # type: ignore[attr-defined]
    # Inside a container the response names the library under CONTAINER_LIB_DIR; here it is
    # the host path of the same file.
    assert envs["LD_PRELOAD"] == f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}"
    envs["LD_PRELOAD"] = str(hook_lib)
    pod = {} if pod_preload is None else {"LD_PRELOAD": pod_preload}
    env = container_env(child_env(), envs, pod)
    assert _probe(env) is expect_loaded


def _probe_in_container(response: object, pod_env: Mapping[str, str]) -> bool:
    """The probe in a runc container that `response` is applied to, with the pod's env."""
    config = ContainerConfig(args=("python3", "-c", PROBE), env=dict(pod_env))
    with replayed(response, config) as container:
        seen = container.read_json()
        assert container.wait() == 0, container.errors()
    loaded: bool = seen["hook_loaded"]
    return loaded


def test_ld_so_preload_injection_survives_a_pods_ld_preload(short_dir: Path,
                                                           hook_lib: Path) -> None:
    """A preload file at /etc/ld.so.preload is read by the loader whatever the environment
    says: here a hand-made response mounts one, naming the hook's mounted copy."""
    need_runtime()
    lib_dir = short_dir / "lib"
    lib_dir.mkdir()
    shutil.copy2(hook_lib, lib_dir / hooklib.library_name())
    preload = short_dir / "ld.so.preload"
    preload.write_text(f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}\n")
    response = api_pb2.ContainerAllocateResponse(mounts=[
        api_pb2.Mount(container_path=paths.CONTAINER_LIB_DIR, host_path=str(lib_dir),
                      read_only=True),
        api_pb2.Mount(container_path=paths.CONTAINER_PRELOAD_FILE, host_path=str(preload),
                      read_only=True)])
    host_preload = Path(paths.CONTAINER_PRELOAD_FILE)
    before = host_preload.read_bytes() if host_preload.exists() else None
    assert _probe_in_container(response, {"LD_PRELOAD": ""}) is True
    after = host_preload.read_bytes() if host_preload.exists() else None
    assert after == before, "the host's own preload file must be untouched"


def test_the_plugins_preload_file_survives_a_pods_ld_preload(short_dir: Path,
                                                           hook_lib: Path) -> None:
    """`--injection preload-file`: the Allocate response mounts a file at /etc/ld.so.preload
    naming the interposer; applied by a real container runtime, the hook is loaded even though
    the pod empties LD_PRELOAD."""
    need_runtime()
    lib_dir = short_dir / "lib"
    lib_dir.mkdir()
    shutil.copy2(hook_lib, lib_dir / hooklib.library_name())
    _, response = _allocate(short_dir, "envvar", injection="preload-file",
                            hook_dir=str(lib_dir))
    envs = dict(response.envs)  # type: ignore[attr-defined]
    assert "LD_PRELOAD" not in envs
    mounts = {m.container_path: m for m in response.mounts}  # type: ignore[attr-defined]
    preload = mounts[paths.CONTAINER_PRELOAD_FILE]
    assert preload.read_only
    assert Path(preload.host_path).read_text() == \
        f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}\n"
    host_preload = Path(paths.CONTAINER_PRELOAD_FILE)
    before = host_preload.read_bytes() if host_preload.exists() else None
    assert _probe_in_container(response, {"LD_PRELOAD": ""}) is True
    # ...and with the pod's LD_PRELOAD left alone too (nothing preloads it twice).
    assert _probe_in_container(response, {}) is True
    after = host_preload.read_bytes() if host_preload.exists() else None
    assert after == before, "the host's own preload file must be untouched"


# ---- S6: the hook's file-writing debug variable ----

def _mount_namespaces_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(in_mount_namespace("mount -t tmpfs none /mnt"), capture_output=True,
                           timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _mount_namespaces_usable(),
                    reason="needs root, unshare -m and setpriv for a private /etc and a user")
def test_hook_stats_is_ignored_in_a_setuid_program(hook_lib: Path, tmp_path: Path) -> None:
    """With the hook in /etc/ld.so.preload (preload-file injection), a user ran the setuid
    `mount --version` with GEMINI_HOOK_STATS naming a root-only file: the hook, running as root,
    overwrote it. Pass: under AT_SECURE the variable is ignored and the file is as it was."""
    mount = shutil.which("mount")
    assert mount is not None and os.stat(mount).st_mode & 0o4000, "mount is not setuid here"
    secret = tmp_path / "root-only"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    uid = 46_000 + os.getpid() % 3_000
    setup = (f"mount -t tmpfs none /mnt && cp -a /etc/. /mnt/ && "
             f"echo {hook_lib} > /mnt/ld.so.preload && mount --bind /mnt /etc && "
             f"exec setpriv --reuid={uid} --regid={uid} --clear-groups {mount} --version")
    done = subprocess.run(in_mount_namespace(setup),
                          env={**child_env(), "GEMINI_HOOK_STATS": str(secret)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "mount from util-linux" in done.stdout
    assert secret.read_text() == "root's secret\n"


def test_hook_stats_never_follows_a_link(hook_lib: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("kept\n")
    link = tmp_path / "stats"
    link.symlink_to(target)
    env = {**child_env(), "LD_PRELOAD": str(hook_lib), "GEMINI_HOOK_STATS": str(link)}
    subprocess.run(["/bin/true"], env=env, check=True, timeout=30)
    assert target.read_text() == "kept\n" and link.is_symlink()
    plain = tmp_path / "plain"
    subprocess.run(["/bin/true"], env={**env, "GEMINI_HOOK_STATS": str(plain)}, check=True,
                   timeout=30)
    assert "bytes_held=0" in plain.read_text()   # the variable still works where it is safe
    assert plain.stat().st_mode & 0o077 == 0


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to run the hook as another user")
def test_hook_stats_never_writes_anothers_file(hook_lib: Path, tmp_path: Path) -> None:
    # A file of another user that this one may write (mode 0666): not this process's own.
    user = 43_000 + os.getpid() % 3_000
    target = tmp_path / "target"
    target.write_text("kept\n")
    os.chown(target, user + 1, user + 1)
    target.chmod(0o666)
    own = tmp_path / "own"
    own.mkdir()
    os.chown(own, user, user)
    env = {**child_env(), "LD_PRELOAD": str(hook_lib)}
    for stats in (target, own / "stats"):
        subprocess.run(as_user(user, ["/bin/true"]), env={**env, "GEMINI_HOOK_STATS":
                                                           str(stats)}, check=True, timeout=30)
    assert target.read_text() == "kept\n"
    assert (own / "stats").stat().st_uid == user   # the hook was loaded, and wrote its own
