"""NVML reconciliation for processes that never connect: a CUDA program that loads libcuda with
dlmopen, or drops LD_PRELOAD and loads it plainly (tests/security/bypass.py, its two ways), so
the interposer preloaded in front of it never sees a call, allocates past its container's
limit. The real daemon reads NVML's running-process list (pynvml over the fake libnvidia-ml,
whose list is what each fake libcuda copy of every process holds: FAKE_CUDA_PROCESSES),
attributes the process to its allocation (its parents lead to gemini-run; or its mount
namespace has the pod's channel at /run/gemini), charges it, reports it within 2 s and, with
over_limit_action=kill, kills it. A process of no allocation on the same GPU is reported (a
Warning Event on the Node, through the fake API server), never charged nor killed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.childenv import child_env
from tests.daemon.helpers import DaemonProcess, make_record, wait_for, wait_served
from tests.hook.conftest import Hooked
from tests.hook.tokenkit import in_pod
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.channel.reconcile import UNATTRIBUTED_REASON
from vgpu_runtime.daemon.telemetry.metrics import render
from vgpu_runtime.gpus.simulated import simulated_uuid

if TYPE_CHECKING:
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) (a pod's mount namespace)")

GiB, MiB = 1 << 30, 1 << 20
UUID = simulated_uuid(0)
BYPASS = Path(__file__).with_name("bypass.py")
REPORT_WITHIN = 2.0   # seconds from the allocation to the report (the bound)
NODE = "node-1"
WAYS = {"dlmopen": (), "unpreloaded": ("--unpreloaded",)}   # bypass.py's ways around the hook


@dataclass
class Node:
    root: Path
    state_dir: Path
    processes: Path            # FAKE_CUDA_PROCESSES
    daemon: DaemonProcess
    hooked: Hooked

    def driver_env(self) -> dict[str, str]:
        """The fake driver's settings, for the daemon (its NVML) and the CUDA programs."""
        return {"LD_LIBRARY_PATH": str(self.hooked.fake), "FAKE_CUDA_UUIDS": UUID,
                "FAKE_CUDA_PROCESSES": str(self.processes),
                "FAKE_CUDA_TOTAL_MEM": str(16 * GiB), "FAKE_CUDA_CONTEXT_BYTES": str(64 * MiB)}

    def gpu(self, record: AllocationRecord) -> dict[str, Any]:
        entry = self.daemon.allocation(record.id)
        assert entry is not None, f"allocation {record.id} not served"
        gpu: dict[str, Any] = entry["gpus"][0]
        return gpu


def start_node(hooked: Hooked, *args: str, interval: float = 1.0) -> Node:
    root = Path(tempfile.mkdtemp(prefix="s28u-"))   # short: socket paths
    state_dir, processes = root / "state", root / "processes"
    state_dir.mkdir()
    processes.mkdir()
    processes.chmod(0o777)
    node = Node(root, state_dir, processes, None, hooked)  # type: ignore[arg-type]
    env = [f"{k}={v}" for k, v in node.driver_env().items()]
    node.daemon = DaemonProcess(
        state_dir, "--simulate-gpus", "1", "--process-memory", "nvml",
        "--process-memory-interval", str(interval), *args, wrap=("env", *env)).wait_ready()
    return node


def stop_node(node: Node) -> None:
    node.daemon.stop()
    shutil.rmtree(node.root, ignore_errors=True)


@pytest.fixture
def node(hooked: Hooked) -> Iterator[Node]:
    started = start_node(hooked)
    yield started
    stop_node(started)


@pytest.fixture
def killing_node(hooked: Hooked) -> Iterator[Node]:
    started = start_node(hooked, "--over-limit-action", "kill")
    yield started
    stop_node(started)


def bypass(node: Node, size: int, pod: AllocationRecord | None = None
           ) -> tuple[subprocess.Popen[str], int, float]:
    """bypass.py allocating `size` under the interposer (LD_PRELOAD set), in `pod` (its
    channel mounted at /run/gemini) or in no allocation; its pid and when it allocated."""
    argv = [sys.executable, str(BYPASS), str(size)]
    env = node.driver_env()
    if pod is not None:
        argv = in_pod(pod.channel_dir, argv)
        env["GEMINI_CHANNEL_DIR"] = "/run/gemini"
    proc = subprocess.Popen(argv, env=node.hooked.env(env),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    allocated = time.monotonic()
    assert line, proc.stderr.read() if proc.stderr else ""
    shown = json.loads(line)
    assert shown["rc"] == 0, shown
    return proc, int(shown["pid"]), allocated


def end(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.communicate("\n", timeout=10)
    return proc.wait(10)


def pod_record(node: Node, limit: int = GiB) -> AllocationRecord:
    record = make_record(node.state_dir, gpus=((UUID, limit, 0.5),))
    wait_served(record)
    return record


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_process_of_gemini_run_that_bypasses_the_hook_is_charged_and_reported_in_2_s(
        node: Node, way: str) -> None:
    """The H200 scenario on the fake: `gemini-run --memory 1GiB -- bypass.py 3GiB`, the
    driver loaded with dlmopen or, LD_PRELOAD dropped, as any program loads it."""
    env = child_env()
    env.update(node.driver_env())
    run = subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.run", "--state-dir", str(node.state_dir),
         "--simulate-gpus", "1", "--hook-library", str(node.hooked.hook), "--memory", "1GiB",
         "--", sys.executable, str(BYPASS), *WAYS[way], str(3 * GiB)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        assert run.stdout is not None
        line = run.stdout.readline()
        allocated = time.monotonic()
        assert line, run.stderr.read() if run.stderr else ""
        started = json.loads(line)
        assert started["way"] == way and started["rc"] == 0, started
        pid = started["pid"]
        (entry,) = node.daemon.status()["allocations"]
        assert entry["origin"] == "gemini-run" and entry["owner_pid"] == run.pid
        record_id = entry["id"]

        def report() -> Any:
            return node.daemon.allocation(record_id)["gpus"][0]["over_limit"]
        shown = wait_for(report, 5, "the over-limit report")
        took = time.monotonic() - allocated
        assert shown["pid"] == pid and shown["connected"] is False, shown
        assert shown["process_bytes"] == 3 * GiB + 64 * MiB, shown   # the allocation + context
        assert shown["declared_bytes"] == 0 and shown["limit"] == GiB, shown
        gpu = node.daemon.allocation(record_id)["gpus"][0]
        assert gpu["unhooked"] == [{"pid": pid, "process_bytes": 3 * GiB + 64 * MiB}], gpu
        assert gpu["memory_used"] == 3 * GiB + 64 * MiB and gpu["over_limit_kills"] == 0, gpu
        logs = node.daemon.logs()
        assert "without the interposer" in logs and "past its memory limit" in logs, logs
        exposition = render(node.daemon.status()).decode()
        series = re.search(rf'gemini_vgpu_memory_unhooked_bytes{{[^}}]*allocation="{record_id}"'
                           r'[^}]*} (\S+)', exposition)
        assert series and float(series.group(1)) == 3 * GiB + 64 * MiB, exposition
        assert took < REPORT_WITHIN, f"reported {took:.2f} s after the allocation"
        print(f"reported {took:.2f} s after the allocation")
    finally:
        code = end(run)
    assert code == 0   # report only: the command ran to its end


def test_kill_takes_the_process_that_bypasses_the_hook_and_spares_the_rest(
        killing_node: Node) -> None:
    """In a pod (its channel at /run/gemini, as Allocate mounts it): a hooked process within
    the limit, a bypassing one past it. over_limit_action=kill kills the bypassing one; the
    hooked one goes on, and so does a process of no allocation on the same GPU."""
    node = killing_node
    record = pod_record(node)
    env = {"GEMINI_CHANNEL_DIR": "/run/gemini"}
    hooked = subprocess.Popen(
        in_pod(record.channel_dir, [sys.executable, "-c", HOOKED_HOLDER]),
        env=node.hooked.env({**node.driver_env(), **env}), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stray, stray_pid, _ = bypass(node, 2 * GiB)   # no pod, no gemini-run: no allocation
    try:
        assert hooked.stdout is not None
        assert json.loads(hooked.stdout.readline())["rc"] == 0, hooked.stderr
        wait_for(lambda: node.gpu(record)["memory_used"] == 200 * MiB + 64 * MiB, 5,
                 "the hooked process charged by its figure")
        proc, pid, allocated = bypass(node, 3 * GiB, record)
        code = proc.wait(5)
        took = time.monotonic() - allocated
        assert code == -signal.SIGKILL, (code, node.daemon.logs()[-3000:])
        gpu = node.gpu(record)
        assert gpu["over_limit_kills"] == 1, gpu
        assert gpu["over_limit"]["pid"] == pid and gpu["over_limit"]["killed"] == pid, gpu
        wait_for(lambda: node.gpu(record)["memory_used"] == 200 * MiB + 64 * MiB, 5,
                 "the killed process's charge withdrawn")
        assert hooked.poll() is None and stray.poll() is None   # spared
        unattributed = node.daemon.status()["unattributed"]
        assert unattributed == [{"gpu": UUID, "pid": stray_pid,
                                 "process_bytes": 2 * GiB + 64 * MiB}], unattributed
        assert "a process of no allocation" in node.daemon.logs()
        killed = [json.loads(line) for line in node.daemon.logs().splitlines()
                  if "killed the process past the memory limit" in line]
        assert [entry["pid"] for entry in killed] == [pid], killed   # tests/gpu reads it so
        print(f"killed {took:.2f} s after the allocation")
    finally:
        end(stray)
        end(hooked)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    pytest.importorskip("kubernetes", reason="the fake API server uses the official client")
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

    with FakeApiServer() as server:
        server.add_node(NODE)
        yield server


def test_a_process_of_no_allocation_on_a_shared_gpu_gets_one_event_on_the_node(
        hooked: Hooked, api: FakeApiServer) -> None:
    """A process that bypasses the hook in no pod and no gemini-run command, on a GPU that an
    allocation shares: a Warning Event on the Node naming the process and what it holds, once
    however many readings see it, and nobody charged."""
    node = start_node(hooked, "--kubernetes", "true", "--kube-api-url", api.url,
                      "--node-name", NODE, "--pod-resources-socket", "/nonexistent/kubelet.sock",
                      interval=0.2)
    try:
        record = pod_record(node)
        stray, pid, allocated = bypass(node, 2 * GiB)
        try:
            def events() -> list[dict[str, Any]]:
                return [e for e in api.node_events(NODE) if e["reason"] == UNATTRIBUTED_REASON]
            (event,) = wait_for(events, 5, "the Event on the Node")
            took = time.monotonic() - allocated
            time.sleep(1.0)                    # five readings more: still the one Event
            assert events() == [event], events()
            held = 2 * GiB + 64 * MiB          # the allocation + the context
            assert event["involvedObject"] == {"kind": "Node", "apiVersion": "v1",
                                               "name": NODE, "uid": NODE}, event
            assert event["metadata"]["namespace"] == "default", event
            assert event["type"] == "Warning" and event["source"]["host"] == NODE, event
            message = event["message"]
            assert message.startswith(f"process {pid} ("), message
            assert f"holds {held >> 20} MiB ({held} bytes) on GPU {UUID}" in message, message
            assert "belongs to none of them" in message, message
            assert node.daemon.status()["unattributed"] == [
                {"gpu": UUID, "pid": pid, "process_bytes": held}]
            assert node.gpu(record)["memory_used"] == 0   # nobody charged for it
            assert [e for e in api.events if e["involvedObject"]["kind"] != "Node"] == []
            assert took < REPORT_WITHIN, f"reported {took:.2f} s after the allocation"
            print(f"Event on the Node {took:.2f} s after the allocation")
        finally:
            end(stray)
    finally:
        stop_node(node)


# A hooked program in the pod: 200 MiB through the interposer, then waits.
HOOKED_HOLDER = """
import ctypes, json, sys
lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
ptr = ctypes.c_uint64()
print(json.dumps({"rc": lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(200 << 20))}),
      flush=True)
sys.stdin.readline()
"""


def test_a_process_within_the_limit_is_charged_so_the_hook_sees_less_free(node: Node) -> None:
    """300 MiB held without the interposer in a pod of 1 GiB: no report, but charged, so a
    hooked reservation that fits the limit alone but not beside it is refused."""
    record = pod_record(node)
    proc, pid, _ = bypass(node, 300 * MiB, record)
    try:
        wait_for(lambda: node.gpu(record)["unhooked"] == [
            {"pid": pid, "process_bytes": 364 * MiB}], 5, "the charge")
        assert node.gpu(record)["memory_used"] == 364 * MiB
        with ChannelClient(wait_served(record)) as client:
            client.hello()
            assert not client.reserve(0, 700 * MiB).granted    # 364 + 700 > 1024
            assert client.reserve(0, 600 * MiB).granted
        assert node.gpu(record)["over_limit"] is None
    finally:
        end(proc)
    wait_for(lambda: node.gpu(record)["memory_used"] == 0, 5, "uncharged once it is gone")
