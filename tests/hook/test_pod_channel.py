"""The hook in a pod: the channel mounted READ-ONLY at /run/gemini, as Allocate mounts it.

Each test runs the hooked program in its own mount namespace with the channel bound read-only
at /run/gemini (tokenkit.in_pod), against the REAL daemon over the fake libcuda. The pages come
with the hello (SCM_RIGHTS), so nothing under /run/gemini needs to be writable and the token
fast path holds: token requests are of the order of grants, not of launches.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for, wait_served
from tests.hook.conftest import PRELUDE, DaemonNode, Hooked, start_node, stop_node
from tests.hook.tokenkit import Loop, in_pod
from vgpu_runtime.contracts.allocation import AllocationRecord

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")


def pod_env(node: DaemonNode, record: AllocationRecord | None = None,
            **extra: str) -> dict[str, str]:
    """What Allocate gives a pod: the channel at its mount point (the host path is not used)."""
    env = node.env_of(record or node.record, **extra)
    env["GEMINI_CHANNEL_DIR"] = "/run/gemini"
    env.update(extra)
    return env


def gpu_status(node: DaemonNode) -> dict[str, object]:
    (gpu,) = node.daemon.status()["gpus"]
    return gpu  # type: ignore[no-any-return]


def granted(node: DaemonNode, what: str) -> None:
    """Wait until the node's daemon has granted the token (its count starts at 0)."""
    wait_for(lambda: int(gpu_status(node)["grants"]) > 0, 5,  # type: ignore[call-overload]
             what)


def run_in_pod(hooked: Hooked, node: DaemonNode, code: str, env: dict[str, str],
               record: AllocationRecord | None = None, uid: int | None = None
               ) -> dict[str, object]:
    argv = [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
    if uid is not None:   # as most pods run: not root
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    proc = subprocess.run(in_pod((record or node.record).channel_dir, argv),
                          env=hooked.env(env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


def test_a_read_only_channel_keeps_the_token_fast_path(hooked: Hooked, node: DaemonNode) -> None:
    """A read-only channel directory once cost a token request per launch."""
    loop = Loop(hooked, pod_env(node), 0.5, pod_channel=node.record.channel_dir)
    loop.go()
    result = loop.result()
    stats = result["stats"]
    assert stats["kernel_launches"] > 1000, stats
    assert stats["token_requests"] <= 20, stats          # of the order of grants
    assert stats["ungated_launches"] == 0, stats
    assert "not gated" not in result["stderr"] and "cannot map" not in result["stderr"]


def test_two_pods_take_turns_on_their_pages_without_idle_releases(
        hooked: Hooked, pair_node: DaemonNode) -> None:
    """The daemon sees each pod's launches on its activity page: it does not take the token
    back 2 ms into every grant (the bug: an idle release in almost every grant)."""
    node = pair_node
    other = node.others[0]
    loops = [Loop(hooked, pod_env(node, record), 1.5, pod_channel=record.channel_dir)
             for record in (node.record, other)]
    for loop in loops:
        loop.go()
    results = [loop.result() for loop in loops]
    gpu = gpu_status(node)
    for result in results:
        stats = result["stats"]
        assert stats["kernel_launches"] > 1000, stats
        assert stats["token_requests"] * 20 < stats["kernel_launches"], stats
        assert stats["ungated_launches"] == 0, stats
    grants, idle = int(gpu["grants"]), int(gpu["idle_releases"])  # type: ignore[call-overload]
    assert grants >= 4, gpu                             # they did take turns
    assert idle <= 2, gpu                               # a loop's end may look idle, no more


def test_an_empty_channel_variable_does_not_switch_the_hook_off_in_a_pod(
        hooked: Hooked, node: DaemonNode) -> None:
    """S5: GEMINI_CHANNEL_DIR="" made the old hook pass every call through, and a 3 GiB
    allocation went through against a 1 GiB limit. /run/gemini/sched.sock wins."""
    code = """
        lib = cuda()
        context(lib)
        ptr = ctypes.c_uint64()
        big = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(3 << 30))
        print(json.dumps({"big": big, "stats": stats()}))
    """
    for channel in ("", "/nonexistent-gemini-channel"):
        result = run_in_pod(hooked, node, code, pod_env(node, GEMINI_CHANNEL_DIR=channel))
        assert result["big"] == 2, (channel, result)   # CUDA_ERROR_OUT_OF_MEMORY
        stats = result["stats"]
        assert isinstance(stats, dict) and stats["mem_refused"] == 1, result


def test_a_pod_of_a_non_root_user_keeps_the_fast_path_and_its_memory_limit(
        hooked: Hooked, node: DaemonNode) -> None:
    """Nothing the hook needs from its channel is more than connecting to the socket: a pod
    running as uid 65534 is gated on its pages and held to its limit."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv(1)")
    shared = Path(tempfile.mkdtemp(prefix="gmu-"))   # the libraries where uid 65534 reads them
    shutil.copytree(hooked.fake, shared / "fake")
    shutil.copy(hooked.hook, shared / hooked.hook.name)
    for path in (shared, shared / "fake"):
        path.chmod(0o755)
    as_user = Hooked(shared / hooked.hook.name, shared / "fake")
    try:
        result = run_in_pod(as_user, node, """
        lib = cuda()
        context(lib)
        for _ in range(20000):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        big = alloc(lib, 3 << 30)[0]
        print(json.dumps({"uid": os.getuid(), "big": big, "stats": stats()}))
    """, pod_env(node), uid=65534)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    stats = result["stats"]
    assert isinstance(stats, dict)
    assert result["uid"] == 65534 and result["big"] == 2, result
    assert stats["kernel_launches"] == 20000 and stats["token_requests"] <= 5, stats
    assert stats["ungated_launches"] == 0, stats


def test_the_token_page_is_mapped_read_only_and_cannot_be_made_writable(
        hooked: Hooked, node: DaemonNode) -> None:
    """A writable token page would let a container forge valid_until_ns."""
    result = run_in_pod(hooked, node, """
        import errno
        lib = cuda()
        context(lib)
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)   # maps, asks
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        maps = {}
        for line in open("/proc/self/maps"):
            fields = line.split()
            if len(fields) >= 6 and (".token." in fields[5] or ".activity." in fields[5]):
                kind = "token" if ".token." in fields[5] else "activity"
                maps[kind] = (int(fields[0].split("-")[0], 16), fields[1], fields[5])
        address = maps["token"][0]
        rc = libc.mprotect(address, 4096, 3)    # PROT_READ | PROT_WRITE
        mprotect_errno = ctypes.get_errno()
        # Reopening the mapped file by its path: the pages are in the daemon's state directory.
        try:
            open(maps["token"][2], "r+b")
            reopened = "yes"
        except OSError as err:
            reopened = errno.errorcode[err.errno]
        fds = sorted(os.listdir("/proc/self/fd"))
        links = [os.readlink(f"/proc/self/fd/{fd}") for fd in fds if os.path.exists(
            f"/proc/self/fd/{fd}")]
        print(json.dumps({"maps": maps, "rc": rc, "errno": errno.errorcode[mprotect_errno],
                          "reopened": reopened, "links": links}))
    """, pod_env(node))
    maps = result["maps"]
    assert isinstance(maps, dict)
    assert maps["token"][1] == "r--s", maps
    assert maps["activity"][1] == "rw-s", maps
    assert result["rc"] == -1 and result["errno"] == "EACCES", result
    # No descriptor of a page stays open in the process: only the mappings.
    assert not [link for link in result["links"] if ".token." in link], result  # type: ignore
    # The channel holds no page, and it is read-only in the pod.
    assert not list((node.state_dir / "channels").glob("*/token.*"))


def test_the_token_page_descriptor_is_read_only(node: DaemonNode) -> None:
    """What the daemon passes, seen from the receiving process: O_RDONLY, writes refused."""
    import errno
    import mmap
    import os

    from vgpu_runtime.daemon.channel.client import ChannelClient

    with ChannelClient(wait_served(node.record)) as client:
        reply = client.hello()
        assert reply.page_fds == 2 and len(client.page_fds) == 2
        token_fd, activity_fd = client.page_fds

        def access_mode(fd: int) -> int:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags = next(int(line.split()[1], 8) for line in info
                             if line.startswith("flags:"))
            return flags & os.O_ACCMODE

        assert access_mode(token_fd) == os.O_RDONLY
        assert access_mode(activity_fd) == os.O_RDWR
        with pytest.raises(OSError) as write_error:
            os.write(token_fd, b"\xff" * 8)
        assert write_error.value.errno == errno.EBADF
        with pytest.raises(PermissionError):
            mmap.mmap(token_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        page = client.token_page(0)
        assert page.page.magic == 1196250187
        page.close()


def test_a_daemon_restart_under_a_running_pod_keeps_it_gated_on_the_fast_path(
        hooked: Hooked, node: DaemonNode) -> None:
    loop = Loop(hooked, pod_env(node), 30.0, pod_channel=node.record.channel_dir,
                stoppable=True)
    loop.go()
    granted(node, "the first daemon grants to the running pod")
    node.restart_daemon()
    # The new daemon (its counters start at 0) gates the running pod.
    granted(node, "the new daemon grants to the running pod")
    loop.stop()
    result = loop.result()
    stats = result["stats"]
    assert stats["daemon_connects"] == 2, stats        # it said hello to the new daemon
    assert stats["ungated_launches"] == 0, stats
    assert stats["token_requests"] * 20 < stats["kernel_launches"], stats


def test_pages_made_anew_by_a_restarted_daemon_are_mapped_on_the_next_hello(
        hooked: Hooked, node: DaemonNode) -> None:
    """Pages lost with the state directory's pages/ (a new node image, a wiped tmpfs): the
    hook's re-hello brings the new files and the fast path goes on from them."""
    loop = Loop(hooked, pod_env(node), 30.0, pod_channel=node.record.channel_dir,
                stoppable=True)
    loop.go()
    granted(node, "the first daemon grants to the running pod")
    assert node.daemon.stop() == 0
    shutil.rmtree(node.state_dir / "pages")
    node.daemon = DaemonProcess(node.state_dir).wait_ready()
    wait_served(node.record)
    granted(node, "the new daemon grants to the running pod")
    loop.stop()
    result = loop.result()
    stats = result["stats"]
    assert stats["daemon_connects"] == 2 and stats["ungated_launches"] == 0, stats
    assert stats["token_requests"] * 20 < stats["kernel_launches"], stats


def test_gemini_run_style_writable_channel_needs_no_page_files_in_it(
        hooked: Hooked, node: DaemonNode) -> None:
    """Outside a pod (GEMINI_CHANNEL_DIR, gemini-run) the pages come the same way."""
    result = hooked.python("""
        lib = cuda()
        context(lib)
        for _ in range(2000):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print(json.dumps(stats()))
    """, node.env())
    assert result["token_requests"] <= 5 and result["ungated_launches"] == 0, result
    assert sorted(p.name for p in (node.state_dir / "channels" / node.record.id).iterdir()) == [
        "sched.sock"]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_an_open_gate_dies_with_its_daemon_and_the_next_daemon_gates_the_pod(
        hooked: Hooked, stop: int) -> None:
    """A whole GPU alone: the page says "open" and the hook launches without asking. A token
    page is sealed and dies with its daemon, so no later daemon can close that gate: the hook
    notices the daemon hung up (every few thousand open-gate launches), reconnects without
    waiting and takes the new daemon's page, whose gate closes when a second tenant comes.
    Without that the pod ran ungated beside the second tenant for as long as it lived."""
    node = start_node(1.0)
    try:
        loop = Loop(hooked, pod_env(node), 30.0, pod_channel=node.record.channel_dir,
                    stoppable=True)
        loop.go()
        wait_for(lambda: len(node.daemon.allocation(node.record.id)["connections"]) == 1, 5,
                 "the pod connected to the first daemon")
        assert node.daemon.stop(stop) in (0, -signal.SIGKILL), node.daemon.logs()
        node.daemon = DaemonProcess(node.state_dir, *node.daemon_args).wait_ready()
        wait_served(node.record)
        wait_for(lambda: len(node.daemon.allocation(node.record.id)["connections"]) == 1, 5,
                 "the pod reconnects to the new daemon while its gate is open")
        node.allocate(0.5)
        granted(node, "the pod asks the new daemon for the token once a second tenant comes")
        loop.stop()
        stats = loop.result()["stats"]
        assert stats["daemon_connects"] == 2, stats
        assert stats["ungated_launches"] == 0, stats
    finally:
        stop_node(node)
