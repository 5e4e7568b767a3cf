"""What a container gets: an Allocate response replayed in a fresh mount namespace.

The real device plugin (`python -m device_plugin.main`, --device-list-strategy envvar, the hook
library in its --hook-dir) admits a pod of 3 slices through the kubelet emulator; the real node
daemon serves the record's channel; the response is replayed by tests/gpu/replay.py under
`unshare -m` (mounts bound, envs exported) and a program runs inside it:

- on a GPU (marked gpu): PyTorch, with the hook loaded from the mounted /opt/gemini/lib, the
  channel reached through the mounted /run/gemini, mem_get_info() equal to the record's limit
  and OutOfMemoryError beyond it;
- everywhere: the same replay with simulated GPUs and a stand-in library, checking the mounts,
  the environment and the channel (hello over the mounted socket, seen by the daemon);
- and the script generator itself, from hand-made responses, good and bad.

Tests that replay skip when mount namespaces are not permitted (not root, no unshare).
The synchronous tests run the emulator with asyncio.run: the GPU machine may lack
pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from device_plugin.kubeletapi.deviceplugin.v1beta1 import api_pb2
from tests.childenv import python_path
from tests.gpu.replay import (
    ReplayError,
    created_mount_points,
    mount_points_cleaned,
    remove_empty_trees,
    replay_argv,
    replay_script,
)
from tests.kubelet_emulator import KubeletEmulator
from tests.kubelet_emulator.plugin_process import PluginProcess
from tests.scheduler.helpers import DaemonProcess, wait_for, wait_served
from vgpu_runtime import allocation, paths
from vgpu_runtime.allocation import AllocationRecord

REPO = Path(__file__).resolve().parents[2]
HOOK_IN_CONTAINER = f"{paths.CONTAINER_LIB_DIR}/{paths.HOOK_LIBRARY_NAME}"
SLICES = 3
LINE_TIMEOUT = 120.0  # a cold PyTorch import and CUDA init on a busy machine


# ---- environment checks ----

@functools.cache
def unshare_refusal() -> str | None:
    """Why this machine cannot replay (None when it can): a bind mount in a new namespace."""
    for tool in ("unshare", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    scratch = tempfile.mkdtemp(prefix="gm-ns-")
    try:
        proc = subprocess.run(replay_argv(f"mount --bind {scratch} {scratch}"),
                              capture_output=True, text=True, timeout=30)
    finally:
        os.rmdir(scratch)
    if proc.returncode != 0:
        return f"mount namespaces are not permitted here: {proc.stderr.strip()}"
    return None


def need_unshare() -> None:
    reason = unshare_refusal()
    if reason is not None:
        pytest.skip(reason)


# ---- the script generator (CPU) ----

def response(mounts: Sequence[tuple[str, str, bool]] = (), envs: dict[str, str] | None = None,
             devices: Sequence[tuple[str, str]] = (), cdi: Sequence[str] = ()
             ) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=envs or {},
        mounts=[api_pb2.Mount(container_path=c, host_path=h, read_only=ro)
                for c, h, ro in mounts],
        devices=[api_pb2.DeviceSpec(container_path=c, host_path=h, permissions="rw")
                 for c, h in devices],
        cdi_devices=[api_pb2.CDIDevice(name=n) for n in cdi])


def test_script_binds_every_mount_then_exports_the_envs_then_execs() -> None:
    script = replay_script(response(
        mounts=[("/opt/gemini/lib", "/var/lib/gemini/lib", True),
                ("/scratch", "/data/scratch", False)],
        envs={"B": "two words", "A": "it's $HOME"}), ["python3", "-c", "print('hi there')"])
    assert script.splitlines() == [
        "set -eu",
        "if [ -d /var/lib/gemini/lib ]; then mkdir -p /opt/gemini/lib; "
        "else mkdir -p /opt/gemini; [ -e /opt/gemini/lib ] || : > /opt/gemini/lib; fi",
        "mount --bind /var/lib/gemini/lib /opt/gemini/lib",
        "mount -o remount,bind,ro /opt/gemini/lib",
        "if [ -d /data/scratch ]; then mkdir -p /scratch; "
        "else mkdir -p /; [ -e /scratch ] || : > /scratch; fi",
        "mount --bind /data/scratch /scratch",
        "export A='it'\"'\"'s $HOME'",
        "export B='two words'",
        "exec python3 -c 'print('\"'\"'hi there'\"'\"')'",
    ]


def test_devices_at_another_path_are_bound_and_same_path_ones_left_alone() -> None:
    script = replay_script(response(devices=[("/dev/nvidia0", "/dev/nvidia0"),
                                             ("/dev/gpu", "/dev/nvidia1")]), ["true"])
    assert "mount --bind /dev/nvidia1 /dev/gpu" in script
    assert "/dev/nvidia0" not in script


@pytest.mark.parametrize(("bad", "message"), [
    (response(cdi=["nvidia.com/gpu=GPU-1"]), "CDI devices (nvidia.com/gpu=GPU-1)"),
    (response(mounts=[("opt/lib", "/host", True)]), "'opt/lib' must be an absolute path"),
    (response(mounts=[("/opt/lib", "host", True)]), "'host' must be an absolute path"),
    (response(mounts=[("/x\nrm -rf /", "/host", True)]), "without NUL or newline"),
    (response(mounts=[("/", "/host", True)]), "refusing to mount over /"),
    (response(mounts=[("/a", "/h1", True), ("/a/", "/h2", True)]), "/a is given twice"),
    (response(mounts=[("/a", "/h1", True)], devices=[("/a", "/dev/x")]), "/a is given twice"),
    (response(envs={"A B": "x"}), "'A B' is not a shell name"),
    (response(envs={"X=1; rm": "x"}), "is not a shell name"),
])
def test_what_cannot_be_replayed_is_refused_with_the_reason(bad: Any, message: str) -> None:
    with pytest.raises(ReplayError) as err:
        replay_script(bad, ["true"])
    assert message in str(err.value)


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(ReplayError, match="no command"):
        replay_script(response(), [])


def test_mount_points_created_by_a_replay_are_named_and_removed(tmp_path: Path) -> None:
    (tmp_path / "exists").mkdir()
    reply = response(mounts=[(str(tmp_path / "new" / "deep" / "lib"), "/h1", True),
                             (str(tmp_path / "exists" / "chan"), "/h2", True),
                             (str(tmp_path / "exists"), "/h3", True)])
    tops = created_mount_points(reply)
    assert tops == [tmp_path / "exists" / "chan", tmp_path / "new"]
    (tmp_path / "new" / "deep" / "lib").mkdir(parents=True)
    (tmp_path / "exists" / "chan").touch()  # a file mount point
    remove_empty_trees(tops)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]
    assert list((tmp_path / "exists").iterdir()) == []


def test_cleanup_keeps_a_tree_that_holds_real_files(tmp_path: Path) -> None:
    reply = response(mounts=[(str(tmp_path / "top" / "lib"), "/h1", True)])
    with mount_points_cleaned(reply) as tops:
        assert tops == [tmp_path / "top"]
        (tmp_path / "top" / "lib").mkdir(parents=True)
        (tmp_path / "top" / "keep.txt").write_text("someone's data")
    assert (tmp_path / "top" / "keep.txt").read_text() == "someone's data"


INSPECT = r"""
import json, os, sys
def writable(directory):
    try:
        open(os.path.join(directory, "probe"), "w").close()
        return True
    except OSError:
        return False
print(json.dumps({"env": {k: os.environ.get(k) for k in ("A", "B")},
                  "lib": sorted(os.listdir(sys.argv[1])), "lib_writable": writable(sys.argv[1]),
                  "rw": sorted(os.listdir(sys.argv[2])), "rw_writable": writable(sys.argv[2])}))
"""


def test_the_script_runs_in_a_namespace_and_leaves_the_host_as_it_was(tmp_path: Path) -> None:
    need_unshare()
    host_lib, host_rw = tmp_path / "host-lib", tmp_path / "host-rw"
    host_lib.mkdir()
    host_rw.mkdir()
    (host_lib / "libx.so").write_text("x")
    in_lib, in_rw = tmp_path / "container" / "lib", tmp_path / "container" / "rw"
    reply = response(mounts=[(str(in_lib), str(host_lib), True), (str(in_rw), str(host_rw), False)],
                     envs={"A": "it's $HOME", "B": "two\nlines"})
    with mount_points_cleaned(reply):
        script = replay_script(reply, [sys.executable, "-c", INSPECT, str(in_lib), str(in_rw)])
        proc = subprocess.run(replay_argv(script), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        assert seen == {"env": {"A": "it's $HOME", "B": "two\nlines"}, "lib": ["libx.so"],
                        "lib_writable": False, "rw": [], "rw_writable": True}
        assert list(in_lib.iterdir()) == []      # the bind existed only in the namespace
        assert (host_rw / "probe").exists()      # the read-write mount wrote through
    assert not (tmp_path / "container").exists()  # mount points removed afterwards


# ---- a node: emulator + real plugin, then the daemon ----

@dataclass
class Admitted:
    response: Any
    record: AllocationRecord


async def _admit(root: Path, hook_dir: Path, simulate_gpus: int) -> Admitted:
    kubelet = KubeletEmulator(root / "dp", pod_resources_socket=root / "pr" / "kubelet.sock")
    plugin = PluginProcess(kubelet.directory, root / "state", gpus=simulate_gpus, slices=10,
                           args=["--device-list-strategy", "envvar", "--hook-dir", str(hook_dir),
                                 "--log-format", "text"], log_path=root / "plugin.log")
    await kubelet.start()
    try:
        await plugin.start()
        try:
            await kubelet.wait_until(lambda: kubelet.allocatable() > 0, timeout=60)
            pod = await kubelet.admit_pod("replayed", containers=[("main", SLICES)])
            assert pod.admitted, pod.message
            reply = pod.containers["main"].response
        except AssertionError as err:
            raise AssertionError(f"{err}\nplugin log:\n{plugin.log_text()[-4000:]}") from None
        finally:
            await plugin.stop()
    finally:
        await kubelet.stop()
    record = allocation.load_record(root / "state", reply.envs[paths.ENV_ALLOCATION_ID])
    assert record is not None, "Allocate wrote no record"
    return Admitted(reply, record)


class ReplayNode:
    """A short temp root holding the kubelet dir, the state dir and the hook dir."""

    def __init__(self, library: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gmr-", dir="/tmp"))  # socket paths <= 107
        self.hook_dir = self.root / "hook"
        self.hook_dir.mkdir()
        shutil.copy2(library, self.hook_dir / paths.HOOK_LIBRARY_NAME)
        self.daemon: DaemonProcess | None = None

    def admit(self, simulate_gpus: int) -> tuple[Admitted, DaemonProcess]:
        """A pod of SLICES admitted by the real plugin, then the daemon serving its channel."""
        admitted = asyncio.run(_admit(self.root, self.hook_dir, simulate_gpus))
        daemon = self.daemon = DaemonProcess(self.root / "state").wait_ready()
        wait_served(admitted.record, timeout=10)
        return admitted, daemon

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def marker_library(tmp_path: Path) -> Path:
    """A real shared library standing in for the hook where no GPU is (nothing to intercept)."""
    source = tmp_path / "marker.c"
    source.write_text("int gemini_replay_marker = 1;\n")
    library = tmp_path / "libmarker.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def base_env() -> dict[str, str]:
    """The test's environment without anything the response must provide itself."""
    own = ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMINI_") and k not in own}
    env["PYTHONPATH"] = python_path()  # the carried wheels on the GPU machine stay reachable
    return env


class Contained:
    """A replayed container's program that reports one JSON line, waits, then reports again."""

    def __init__(self, reply: Any, code: str) -> None:
        script = replay_script(reply, [sys.executable, "-c", textwrap.dedent(code)])
        # stderr to a file: a chatty program must not block on a pipe nobody reads yet.
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in kill()
        # unshare and sh exec, so this pid ends up being the contained program's own.
        self.proc = subprocess.Popen(replay_argv(script), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     env=base_env())

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    def read_report(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], LINE_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.communicate(timeout=30)
            raise AssertionError(f"the contained program exited {self.proc.returncode} "
                                 f"without a report:\n{self.errors()}")
        report: dict[str, Any] = json.loads(line)
        return report

    def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        report = self.read_report()
        self.proc.communicate(timeout=LINE_TIMEOUT)
        assert self.proc.returncode == 0, self.errors()
        return report

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=30)
        self.stderr.close()


@pytest.fixture
def contained_runs() -> Iterator[list[Contained]]:
    runs: list[Contained] = []
    yield runs
    for run in runs:
        run.kill()


# What every contained program reports first: where the preload came from, the mounts, the env.
CONTAINER_FACTS = r"""
import errno, json, os, sys
def loaded_from(fragment):
    with open("/proc/self/maps") as maps:
        return sorted({f[5] for f in (l.split() for l in maps) if len(f) >= 6 and fragment in f[5]})
def write_refused(directory):
    try:
        open(os.path.join(directory, "probe"), "w").close()
    except OSError as err:
        return err.errno == errno.EROFS
    return False
facts = {"pid": os.getpid(), "preloaded": loaded_from("libgemini-hook"),
         "lib_ro": write_refused(os.environ["LD_PRELOAD"].rsplit("/", 1)[0]),
         "channel_ro": write_refused(os.environ["GEMINI_CHANNEL_DIR"]),
         "env": {k: os.environ.get(k) for k in ("LD_PRELOAD", "GEMINI_CHANNEL_DIR",
                 "GEMINI_ALLOCATION_ID", "GEMINI_VGPU_MEMORY_LIMIT", "CUDA_VISIBLE_DEVICES")}}
"""


def check_container_facts(facts: dict[str, Any], admitted: Admitted) -> None:
    record = admitted.record
    assert facts["preloaded"] == [HOOK_IN_CONTAINER], facts
    assert facts["lib_ro"] and facts["channel_ro"], facts
    assert facts["env"] == {
        "LD_PRELOAD": HOOK_IN_CONTAINER, "GEMINI_CHANNEL_DIR": paths.CONTAINER_CHANNEL_DIR,
        "GEMINI_ALLOCATION_ID": record.id,
        "GEMINI_VGPU_MEMORY_LIMIT": str(record.gpus[0].memory_limit),
        "CUDA_VISIBLE_DEVICES": record.gpus[0].uuid}, facts


def connections_of(daemon: DaemonProcess, allocation_id: str) -> list[dict[str, Any]]:
    entry = daemon.allocation(allocation_id)
    return list(entry["connections"]) if entry else []


CHANNEL_PROGRAM = CONTAINER_FACTS + r"""
from vgpu_runtime.scheduler.client import ChannelClient
client = ChannelClient(os.path.join(os.environ["GEMINI_CHANNEL_DIR"], "sched.sock"))
hello = client.hello()
facts.update(allocation_id=hello.allocation_id, memory_limit=hello.gpus[0].memory_limit,
             reserve=client.reserve(0, 1 << 20).granted)
print(json.dumps(facts), flush=True)
sys.stdin.readline()
print(json.dumps({"done": True}), flush=True)
"""


def test_replayed_container_reaches_its_channel_through_the_mounts(
        marker_library: Path, contained_runs: list[Contained]) -> None:
    need_unshare()
    node = ReplayNode(marker_library)
    try:
        admitted, daemon = node.admit(simulate_gpus=2)
        with mount_points_cleaned(admitted.response):
            run = Contained(admitted.response, CHANNEL_PROGRAM)
            contained_runs.append(run)
            facts = run.read_report()
            check_container_facts(facts, admitted)
            assert facts["allocation_id"] == admitted.record.id
            assert facts["memory_limit"] == admitted.record.gpus[0].memory_limit
            assert facts["reserve"] is True
            # The daemon knows the container's process by its socket's peer credentials.
            assert facts["pid"] == run.proc.pid
            connections = connections_of(daemon, admitted.record.id)
            assert [c["peer_pid"] for c in connections] == [facts["pid"]], daemon.logs()[-3000:]
            assert run.finish() == {"done": True}
            wait_for(lambda: not connections_of(daemon, admitted.record.id), 10,
                     "the connection to close")
    finally:
        node.close()


TORCH_PROGRAM = CONTAINER_FACTS + r"""
import torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
facts.update(total=total, held=held.numel())
print(json.dumps(facts), flush=True)
sys.stdin.readline()
try:
    torch.empty(total, dtype=torch.uint8, device="cuda")
    oom = False
except torch.cuda.OutOfMemoryError:
    oom = True
after = torch.ones(1 << 20, device="cuda").sum().item()
print(json.dumps({"oom": oom, "after": after}), flush=True)
"""


@pytest.mark.gpu
def test_pytorch_in_a_replayed_container_gets_its_slice(contained_runs: list[Contained]) -> None:
    need_unshare()
    pytest.importorskip("torch")
    from vgpu_runtime import hooklib

    node = ReplayNode(hooklib.library_path())
    try:
        admitted, daemon = node.admit(simulate_gpus=0)  # NVML: the real GPU
        limit = admitted.record.gpus[0].memory_limit
        assert admitted.record.gpus[0].share == pytest.approx(SLICES / 10)
        with mount_points_cleaned(admitted.response):
            run = Contained(admitted.response, TORCH_PROGRAM)
            contained_runs.append(run)
            facts = run.read_report()
            check_container_facts(facts, admitted)
            assert facts["total"] == limit
            # The hook reached the daemon through /run/gemini: its process holds the tensor.
            connections = connections_of(daemon, admitted.record.id)
            assert [c["peer_pid"] for c in connections] == [facts["pid"]], (
                f"{connections}\n{run.errors()}\n{daemon.logs()[-3000:]}")
            entry = daemon.allocation(admitted.record.id)
            assert entry["gpus"][0]["memory_used"] >= facts["held"]
            assert run.finish() == {"oom": True, "after": float(1 << 20)}
    finally:
        node.close()
