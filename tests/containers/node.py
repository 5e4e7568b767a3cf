"""A node whose pods run in real containers: the kubelet emulator (on its own event-loop thread,
so PodResources answers while a test blocks on a container), the real device plugin (CDI
strategy, the default), the real node daemon bound to pods through PodResources and the fake
API server, and the emulator's runtime stage running each admitted container with runc.

The simulated GPUs' CDI spec (written here, as the NVIDIA toolkit writes one for real GPUs)
gives each GPU a device node and mounts the tests' fake driver into the container, with the
fake's settings as CDI env edits. The container's rootfs holds the host's system directories
read-only, the program (tests/containers/launch_loop.py) in /app and a writable /out: the
interposer and the channel arrive only through the Allocate response.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests import sharedbuild
from tests.childenv import child_env
from tests.daemon.helpers import DaemonProcess, wait_for
from tests.hook.cudaprobe import COUNTERS
from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.devkit.kubelet_emulator import KubeletEmulator, Pod
from vgpu_runtime.devkit.kubelet_emulator.plugin_process import PluginProcess
from vgpu_runtime.devkit.kubelet_emulator.runtime import (
    SYSTEM_ROOTFS,
    Container,
    ContainerConfig,
    ContainerRuntime,
    Rootfs,
    Volume,
    runc_refusal,
)
from vgpu_runtime.gpus.simulated import simulated_uuid

T = TypeVar("T")
GiB = 1 << 30
GPUS = 2
SLICES = 10
GPU_MEMORY = 16 * GiB
DRIVER_IN_CONTAINER = "/opt/nvidia/lib64"   # outside the read-only host /usr
PROGRAM = Path(__file__).resolve().parent / "launch_loop.py"
SECURITY = Path(__file__).resolve().parents[1] / "security"
PROGRAMS = (PROGRAM, SECURITY / "forgery.py", SECURITY / "bypass.py")   # its forge, bypass steps
PROCESSES_IN_CONTAINER = "/opt/nvidia/processes"   # the fake NVML's list (FAKE_CUDA_PROCESSES)
# The daemon reports shares over this many seconds: the tests' launch loops last as long, so
# a share sampled as a loop ends is the loop's.
SHARE_WINDOW_S = 3.0
POD_RESOURCES_FAST = ("--pod-resources-interval", "0.1", "--pod-resources-min-interval", "0.05")


def write_cdi_spec(cdi_dir: Path, driver_dir: Path, processes: Path | None = None) -> Path:
    """nvidia.com/gpu devices for the simulated GPUs, named by UUID as the plugin names them;
    with `processes`, every container's fake driver lists what it holds there, for the
    daemon's fake NVML (FAKE_CUDA_PROCESSES)."""
    cdi_dir.mkdir(parents=True, exist_ok=True)
    libraries = ("libcuda.so.1", "libnvidia-ml.so.1")
    env = [f"LD_LIBRARY_PATH={DRIVER_IN_CONTAINER}", f"FAKE_CUDA_TOTAL_MEM={GPU_MEMORY}"]
    mounts = [{"hostPath": str(driver_dir / name), "containerPath": f"{DRIVER_IN_CONTAINER}/{name}",
               "options": ["ro", "nosuid", "nodev", "bind"]} for name in libraries]
    if processes is not None:
        env.append(f"FAKE_CUDA_PROCESSES={PROCESSES_IN_CONTAINER}")
        mounts.append({"hostPath": str(processes), "containerPath": PROCESSES_IN_CONTAINER,
                       "options": ["nosuid", "nodev", "bind"]})
    spec = {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "containerEdits": {
            "env": env,
            "deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255,
                             "permissions": "rw"}],
            "mounts": mounts,
        },
        "devices": [{"name": simulated_uuid(i), "containerEdits": {
            "env": [f"FAKE_CUDA_UUIDS={simulated_uuid(i)}"],
            "deviceNodes": [{"path": f"/dev/nvidia{i}", "type": "c", "major": 195, "minor": i,
                             "permissions": "rw"}]}} for i in range(GPUS)],
    }
    path = cdi_dir / "nvidia.com-gpu.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


class LoopThread:
    """An asyncio loop on its own thread; `call` runs a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Tenant:
    """One running container of an admitted pod."""
    pod: Pod
    name: str
    record: AllocationRecord
    container: Container
    out_dir: Path

    @property
    def response(self) -> Any:
        return self.pod.containers[self.name].response

    def step(self, line: str, timeout: float = 60.0) -> dict[str, Any]:
        return self.container.step(line, timeout)

    def send(self, line: str) -> None:
        self.container.send(line)

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        return self.container.read_json(timeout)

    def hook_stats_at_exit(self) -> dict[str, int]:
        return hooklib.read_stats_file(self.out_dir / "hook-stats")


@dataclass
class ContainerNode:
    root: Path
    kubelet: KubeletEmulator
    plugin: PluginProcess
    daemon: DaemonProcess
    daemon_args: tuple[str, ...]
    runtime: ContainerRuntime
    loop: LoopThread
    api: Any = None
    bound: bool = True   # the daemon binds allocations to pods through PodResources
    tenants: list[Tenant] = field(default_factory=list)
    daemon_wrap: tuple[str, ...] = ()   # the daemon's environment (the fake NVML's)

    @property
    def state_dir(self) -> Path:
        return self.plugin.state_dir

    def admit(self, name: str, slices: int, annotations: dict[str, str] | None = None) -> Pod:
        if self.api is not None:
            self.api.add_pod("default", name, f"uid-{name}", annotations or {})
        pod = self.loop.call(self.kubelet.admit_pod(name, containers=[("main", slices)]))
        assert pod.admitted, pod.message
        return pod

    def record_of(self, pod: Pod, container: str = "main") -> AllocationRecord:
        record = allocation.load_record(
            self.state_dir, pod.containers[container].response.envs[paths.ENV_ALLOCATION_ID])
        assert record is not None, "Allocate wrote no record"
        return record

    def wait_bound(self, record: AllocationRecord, timeout: float = 15.0) -> None:
        def bound() -> bool:
            entry = self.daemon.allocation(record.id)
            return bool(entry and entry.get("bound"))
        wait_for(bound, timeout, f"allocation {record.id} bound to its pod")

    def start(self, pod: Pod, container: str = "main", response: Any = None,
              args: tuple[str, ...] = (), rootfs: Rootfs = SYSTEM_ROOTFS, **env: str) -> Tenant:
        """Run the pod's container (with its kept response unless another is given): the
        launch loop program, or `args`; it must print {"ready": true} first."""
        record = self.record_of(pod, container)
        if self.bound:
            self.wait_bound(record)
        out = self.root / "out" / f"{pod.name}-{container}-{len(self.tenants)}"
        out.mkdir(parents=True)
        out.chmod(0o777)
        config = ContainerConfig(
            args=args or ("python3", "/app/launch_loop.py", json.dumps(COUNTERS)),
            env={"GEMINI_HOOK_STATS": "/out/hook-stats", "GEMINI_HOOK_DAEMON_WAIT": "10",
                 "PYTHONDONTWRITEBYTECODE": "1", **env},
            volumes=(Volume(str(self.root / "app"), "/app", read_only=True),
                     Volume(str(out), "/out")),
            rootfs=rootfs)
        reply = response if response is not None else pod.containers[container].response
        running = self.runtime.run(reply, config, name=f"{pod.name}-{container}")
        tenant = Tenant(pod, container, record, running, out)
        self.tenants.append(tenant)
        assert running.read_json().get("ready"), running.errors()
        return tenant

    def restart_container(self, tenant: Tenant) -> Tenant:
        """Kubelet's container restart: runc kill and delete, then the kept response again."""
        tenant.container.kill()
        reply = self.loop.call(self.kubelet.restart_container("default", tenant.pod.name,
                                                              tenant.name))
        assert reply is not None, tenant.pod.containers[tenant.name].last_start_error
        return self.start(tenant.pod, tenant.name, response=reply)

    def delete(self, pod: Pod) -> None:
        for tenant in [t for t in self.tenants if t.pod is pod]:
            tenant.container.kill()
            self.tenants.remove(tenant)
        self.loop.call(self.kubelet.delete_pod(pod.name))

    def restart_daemon(self) -> None:
        assert self.daemon.stop() == 0, self.daemon.logs()[-3000:]
        self.daemon = DaemonProcess(self.state_dir, *self.daemon_args,
                                    wrap=self.daemon_wrap).wait_ready(15)

    def charged(self, record: AllocationRecord) -> float:
        """The share of its GPU the daemon charged the allocation over the last window."""
        for gpu in self.daemon.status()["gpus"]:
            for tenant in gpu["tenants"]:
                if tenant["allocation"] == record.id:
                    return float(tenant["achieved"])
        raise AssertionError(f"allocation {record.id} not in the daemon's status")

    def gpu_sample(self, uuid: str) -> dict[str, Any]:
        for gpu in self.daemon.status()["gpus"]:
            if gpu["uuid"] == uuid:
                return dict(gpu)
        raise AssertionError(f"GPU {uuid} not in the daemon's status")

    def logs(self) -> str:
        return (f"---- daemon ----\n{self.daemon.logs()[-4000:]}\n"
                f"---- plugin ----\n{self.plugin.log_text()[-2000:]}")


def built() -> tuple[Path, Path]:
    """The strict interposer and the fake driver, built once per run (tests/sharedbuild.py):
    every node installs the one and mounts the other, read-only (containers of other uids read
    the driver), so nodes need not compile them again."""
    return sharedbuild.hook_library(), sharedbuild.fake_driver()


def install_hook(state_dir: Path, library: Path | None = None) -> None:
    """The interposer (the process's strict build unless given) installed as the DaemonSet's
    init container installs it."""
    library = library or built()[0]
    subprocess.run([sys.executable, "-m", "vgpu_runtime.install", "--state-dir", str(state_dir),
                    "--library", str(library), "--log-format", "text"], check=True,
                   env=child_env(), capture_output=True)


def start_node(api: Any = None, simulate_gpus: int = GPUS,
               write_cdi: Callable[[Path], Path] | None = None,
               library: Path | None = None, daemon_extra: tuple[str, ...] = (),
               fake_nvml: bool = False, plugin_extra: tuple[str, ...] = ()) -> ContainerNode:
    """The node; `simulate_gpus` 0 takes the machine's real GPUs (NVML), whose CDI spec
    `write_cdi` then writes (the simulated GPUs' spec mounts the fake driver). `fake_nvml`:
    the daemon reads per-process figures (process_memory nvml) from the fake NVML, which lists
    what the containers' fake drivers hold."""
    root = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))   # socket paths <= 107 bytes
    root.chmod(0o755)
    state_dir = root / "state"
    install_hook(state_dir, library)
    processes = root / "processes" if fake_nvml else None
    wrap: tuple[str, ...] = ()
    if write_cdi is not None:
        write_cdi(root / "cdi")
    else:
        driver = built()[1]
        if processes is not None:
            processes.mkdir()
            processes.chmod(0o777)
            wrap = ("env", f"LD_LIBRARY_PATH={driver}", f"FAKE_CUDA_PROCESSES={processes}",
                    f"FAKE_CUDA_UUIDS={','.join(simulated_uuid(i) for i in range(GPUS))}")
        write_cdi_spec(root / "cdi", driver, processes)
    (root / "app").mkdir()
    for program in PROGRAMS:
        shutil.copy2(program, root / "app" / program.name)
    loop = LoopThread()
    kubelet = KubeletEmulator(root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock")
    args = ["--log-format", "text", *plugin_extra]
    if simulate_gpus:
        args += ["--simulate-memory", str(GPU_MEMORY)]
    plugin = PluginProcess(kubelet.directory, state_dir, gpus=simulate_gpus, slices=SLICES,
                           args=args, log_path=root / "plugin.log")
    loop.call(kubelet.start())
    loop.call(plugin.start())
    loop.call(kubelet.wait_until(lambda: kubelet.allocatable() > 0, timeout=60))
    daemon_args: tuple[str, ...] = (
        "--pod-resources-socket", str(kubelet.pod_resources_socket), "--node-name", "node-1",
        "--metrics-port", "0", "--window", str(SHARE_WINDOW_S), *POD_RESOURCES_FAST)
    if api is not None:
        daemon_args += ("--kubernetes", "true", "--kube-api-url", api.url)
    if processes is not None:
        daemon_args += ("--process-memory", "nvml", "--process-memory-interval", "1")
    daemon_args += daemon_extra
    daemon = DaemonProcess(state_dir, *daemon_args, wrap=wrap).wait_ready(15)
    return ContainerNode(root, kubelet, plugin, daemon, daemon_args,
                         ContainerRuntime(root, root / "cdi"), loop, api, daemon_wrap=wrap)


def stop_node(node: ContainerNode) -> None:
    try:
        node.runtime.close()
        node.daemon.stop()
        node.loop.call(node.plugin.stop())
        node.loop.call(node.kubelet.stop())
    finally:
        node.loop.stop()
        shutil.rmtree(node.root, ignore_errors=True)


@contextmanager
def node_on_fake_api(**start: Any) -> Iterator[ContainerNode]:
    """A module's node (start_node's arguments) on a fake API server holding node-1; skips,
    saying why, where runc cannot run or the Kubernetes client is missing."""
    reason = runc_refusal()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("kubernetes", reason="the fake API server uses the official client")
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

    with FakeApiServer() as api:
        api.add_node("node-1")
        node = start_node(api, **start)
        try:
            yield node
        finally:
            stop_node(node)
