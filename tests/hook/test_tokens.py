"""GPU-time tokens in the launch gate: the hook over the fake driver, against the REAL daemon."""

from __future__ import annotations

import itertools
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import wait_for
from tests.hook.conftest import DaemonNode, Hooked, compile_program, start_node, stop_node
from tests.hook.tokenkit import Loop, Rival, read_activity_page, read_token_page
from vgpu_runtime.daemon.channel import client

GATE_OPEN, GATE_TOKEN = 0, 1


@pytest.fixture
def whole_gpu_node() -> Iterator[DaemonNode]:
    started = start_node(1.0)
    yield started
    stop_node(started)


def test_gate_is_open_for_a_whole_gpu_alone(hooked: Hooked, whole_gpu_node: DaemonNode) -> None:
    node = whole_gpu_node
    assert read_token_page(node.record)[0] == GATE_OPEN
    result = hooked.python("""
        lib = cuda()
        context(lib)
        for _ in range(500):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print(json.dumps(stats()))
    """, node.env())
    assert result["kernel_launches"] == 500
    assert result["token_requests"] == 0 and result["token_wait_ns"] == 0
    assert result["frames_sent"] == 1                       # the hello, nothing per launch
    assert read_activity_page(node.record)[2] == 0          # no activity written either


def test_fast_path_sends_nothing_while_the_grant_is_valid(hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)   # asks: never held
        first = stats()
        for _ in range(1000):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        print(json.dumps({"first": first, "then": stats()}))
    """, node.env())
    first, then = result["first"], result["then"]
    assert read_token_page(node.record)[0] == GATE_TOKEN    # share 0.5: tokens needed
    assert first["token_requests"] == 1
    assert then["token_requests"] == 1 and then["frames_sent"] == first["frames_sent"]
    assert then["kernel_launches"] == 1001
    last_launch, _, launches = read_activity_page(node.record)
    assert launches == 1001 and last_launch > 0


FAST_PATH_PROGRAM = r"""
    #include <stdio.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include "cuda_types.h"
    CUresult cuInit(unsigned int);
    CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
    CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, CUstream, void **, void **);
    int main(void) {
        CUcontext ctx;
        cuInit(0);
        cuCtxCreate_v2(&ctx, 0, 0);
        cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);   /* the slow path: asks, is granted */
        syscall(SYS_getuid);                               /* marker: the fast path starts */
        for (int i = 0; i < 20000; i++) cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
        syscall(SYS_getgid);                              /* marker: the fast path ends */
        return 0;
    }
"""


def test_fast_path_makes_no_system_call_under_strace(
        hooked: Hooked, node: DaemonNode, tmp_path: Path) -> None:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    program = compile_program(FAST_PATH_PROGRAM, tmp_path / "fast", hooked.fake,
                              f"-L{hooked.fake}", "-lcuda")
    trace = tmp_path / "trace"
    proc = hooked.run(["strace", "-f", "-o", str(trace), str(program)], node.env())
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    lines = trace.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\d+ +getuid\(", line))
    end = next(i for i, line in enumerate(lines) if re.match(r"\d+ +getgid\(", line))
    between = [line for line in lines[start + 1:end] if "resumed" not in line]
    assert between == [], f"system calls on the fast path: {between[:10]}"


EARLY_LIBRARY = r"""
    #include "cuda_types.h"
    CUresult cuInit(unsigned int);
    CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
    CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, CUstream, void **, void **);
    /* A library the program links runs its constructors before those of the preloaded hook:
     * this one's first launch makes the process's hello. */
    __attribute__((constructor)) static void start_early(void) {
        CUcontext ctx;
        cuInit(0);
        cuCtxCreate_v2(&ctx, 0, 0);
        cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    }
    void early_linked(void) {}
"""

EARLY_MAIN = r"""
    #include <dlfcn.h>
    #include <stdio.h>
    #include "cuda_types.h"
    #include "gemini_hook.h"
    CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, unsigned, CUstream, void **, void **);
    void early_linked(void);
    int main(void) {
        early_linked();
        for (int i = 0; i < 200; i++) cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
        int (*read_stats)(struct gemini_hook_stats *) =
            (int (*)(struct gemini_hook_stats *))dlsym(RTLD_DEFAULT, "gemini_hook_stats");
        struct gemini_hook_stats s;
        if (read_stats == NULL || read_stats(&s) != 0) return 1;
        printf("%llu %llu %llu\n", (unsigned long long)s.daemon_connects,
               (unsigned long long)s.kernel_launches, (unsigned long long)s.token_requests);
        return 0;
    }
"""


def test_a_hello_made_before_the_hooks_constructors_still_maps_the_pages(
        hooked: Hooked, node: DaemonNode, tmp_path: Path) -> None:
    """The families register for the hello at link time, not from constructors: a hello made
    from a linked library's constructor, before the hook's run, still hands the launch family
    its token pages, so later launches take the fast path instead of asking every time."""
    compile_program(EARLY_LIBRARY, tmp_path / "libearly.so", hooked.fake, "-shared", "-fPIC",
                    f"-L{hooked.fake}", "-lcuda")
    program = compile_program(EARLY_MAIN, tmp_path / "early", hooked.fake, f"-L{tmp_path}",
                              "-learly", f"-Wl,-rpath,{tmp_path}", f"-L{hooked.fake}", "-lcuda",
                              "-ldl")
    proc = hooked.run([str(program)], node.env())
    assert proc.returncode == 0, proc.stderr
    connects, launches, requests = map(int, proc.stdout.split())
    assert (connects, launches) == (1, 201)
    assert requests < 10                                     # without the pages: 201


def test_a_contending_container_blocks_launches_until_it_releases(
        hooked: Hooked, node: DaemonNode) -> None:
    rival_record = node.allocate(0.5)
    rival = Rival(rival_record)
    loop = Loop(hooked, node.env(), 0.05)
    try:
        valid_until = rival.hold()
        started = time.monotonic_ns()
        assert valid_until > started                          # the rival holds it now
        loop.go()
        result = loop.result()
        first_launch = result["returns"][0]
        # Blocked until the rival's quota ended (it is revoked then: it never asks again).
        assert first_launch >= valid_until
        assert result["stats"]["token_wait_ns"] >= (valid_until - started) * 0.9
        assert result["stats"]["token_requests"] >= 1
        # The longest single wait is that one, and no longer than all waits together.
        longest = result["stats"]["token_wait_max_ns"]
        assert (valid_until - started) * 0.9 <= longest <= result["stats"]["token_wait_ns"]
    finally:
        loop.kill()
        rival.close()


def switches(a: list[int], b: list[int]) -> int:
    merged = sorted([(t, 0) for t in a] + [(t, 1) for t in b])
    return sum(1 for x, y in itertools.pairwise(merged) if x[1] != y[1])


@pytest.fixture
def patient_node() -> Iterator[DaemonNode]:
    """A node whose daemon takes the token from an idle holder after 50 ms, not 2 ms: on a
    starved box (two busy loops on two cores) a holder descheduled for a few ms looked idle,
    and the handoffs that followed were the idle release's, not the quota's (62-100 switches
    in 0.8 s)."""
    started = start_node(0.5, "--idle-release", "0.05")
    yield started
    stop_node(started)


@pytest.mark.parametrize("sync_each", [False, True], ids=["stream", "sync-each"])
def test_two_containers_take_turns(hooked: Hooked, patient_node: DaemonNode,
                                   sync_each: bool) -> None:
    node = patient_node
    other = node.allocate(0.5)
    first = Loop(hooked, node.env(), 0.8, sync_each)
    second = Loop(hooked, node.env_of(other), 0.8, sync_each)
    try:
        first.go()
        second.go()
        a, b = first.result(), second.result()
    finally:
        first.kill()
        second.kill()
    ra, rb = a["returns"], b["returns"]
    assert len(ra) > 100 and len(rb) > 100
    # Exclusive turns: launches of the two alternate in blocks, one per grant (quotas are at
    # least 20 ms), not launch by launch as two ungated loops would.
    assert switches(ra, rb) <= 0.8 / 0.02 + 4, switches(ra, rb)
    for stats in (a["stats"], b["stats"]):
        assert stats["token_requests"] >= 2 and stats["token_wait_ns"] > 0
        assert stats["ungated_launches"] == 0
        if sync_each:
            assert stats["syncs_observed"] >= 100 and stats["usage_reports"] >= 1
    if sync_each:
        assert read_activity_page(node.record)[1] > 0       # last_sync_ns written


LAUNCH = "lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)"


def test_a_waking_tenant_cuts_a_hooked_holders_quota_short(hooked: Hooked) -> None:
    # --preempt-after: a tenant that starts waiting while the hook holds the token gets it
    # after 5 ms of the holder's quota (pinned to 1 s here), not at its end. The hook learns it
    # from its page at its next launch, settles and asks again. Without preemption the rival,
    # asking 0.3 s into the quota, would wait about 0.7 s: the bound below keeps clear of that
    # and of a busy box's scheduling delays (a 150 ms quota made the two overlap).
    node = start_node(0.5, "--preempt-after", "0.005", "--min-quota", "1", "--max-quota", "1")
    try:
        rival = Rival(node.allocate(0.5))
        loop = Loop(hooked, node.env(), 1.0)
        try:
            loop.go()
            time.sleep(0.3)                       # the loop holds and keeps launching
            asked = time.monotonic_ns()
            rival.hold()
            waited = (time.monotonic_ns() - asked) / 1e9
            result = loop.result()
        finally:
            loop.kill()
            rival.close()
        status = client.request(node.state_dir, "status")
        assert status["gpus"][0]["preemptions"] >= 1, status["gpus"][0]
        assert waited < 0.3, waited               # 5 ms + the loop's next launch + a round trip
        assert result["stats"]["ungated_launches"] == 0
    finally:
        stop_node(node)


def test_requests_carry_the_longest_unmerged_burst(hooked: Hooked, node: DaemonNode) -> None:
    # 5 ms bursts back to back (gaps far below the 2 ms merge gap) merge into one long run in
    # the usage reports; the figure quota sizing gets is the burst from launch to sync.
    hooked.python(f"""
        import time
        lib = cuda()
        context(lib)
        end = time.monotonic() + 0.7          # past a lone tenant's 0.2 s quota, twice
        while time.monotonic() < end:
            {LAUNCH}
            time.sleep(0.005)
            lib.cuStreamSynchronize(None)
        print(json.dumps(stats()))
    """, node.env())
    status = client.request(node.state_dir, "status")
    tenant = next(t for gpu in status["gpus"] for t in gpu["tenants"]
                  if t["allocation"] == node.record.id)
    assert 5.0 <= tenant["burst_ms"] < 20.0, tenant
    assert tenant["quota_ms"] is not None


def test_every_synchronisation_ends_a_burst_however_it_was_resolved(
        hooked: Hooked, node: DaemonNode) -> None:
    # CUDA 13's runtime resolves cuCtxSynchronize to cuCtxSynchronize_v2 (a context argument):
    # cudaDeviceSynchronize and torch.cuda.synchronize reach the driver only through it.
    result = hooked.python("""
        lib = cuda()
        context(lib)
        def resolved(name, version):
            fn = ctypes.c_void_p()
            status = ctypes.c_int()
            assert lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), version,
                                           ctypes.c_uint64(0), ctypes.byref(status)) == 0
            return fn.value
        calls = {
            "cuCtxSynchronize_v2 via procaddress 13000": (
                ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(
                    resolved("cuCtxSynchronize", 13000)), (None,)),
            "cuCtxSynchronize via procaddress 12000": (
                ctypes.CFUNCTYPE(ctypes.c_int)(resolved("cuCtxSynchronize", 12000)), ()),
            "cuStreamSynchronize by name": (lib.cuStreamSynchronize, (None,)),
            "cuMemcpyDtoH_v2 by name": (lib.cuMemcpyDtoH_v2, (ctypes.create_string_buffer(8),
                                                              ctypes.c_uint64(0), 8)),
        }
        seen = {}
        for name, (fn, args) in calls.items():
            LAUNCH
            before = stats()["syncs_observed"]
            fn(*args)
            seen[name] = stats()["syncs_observed"] - before
        print(json.dumps(seen))
    """.replace("LAUNCH", LAUNCH), node.env())
    assert result == {name: 1 for name in result} and len(result) == 4, result


def test_revocation_is_seen_by_the_next_launch(hooked: Hooked, node: DaemonNode) -> None:
    rival = Rival(node.allocate(0.5))
    proc = hooked.start(f"""
        import sys
        lib = cuda()
        context(lib)
        {LAUNCH}
        print(json.dumps(stats()), flush=True)
        sys.stdin.readline()
        {LAUNCH}
        print(json.dumps(stats()), flush=True)
    """, node.env())
    try:
        granted = hooked.line(proc)
        assert granted["token_requests"] == 1
        assert read_token_page(node.record)[2] > time.monotonic_ns()   # it holds the token
        rival.request()                                     # the rival waits for it...
        rival.granted()                                     # ...and gets it once revoked
        assert read_token_page(node.record)[2] == 0         # revoked: the page says so
        after = hooked.line(proc, go=True)
        assert after["token_requests"] == 2                 # the next launch asked again
        assert after["token_wait_ns"] > granted["token_wait_ns"]
    finally:
        proc.kill()
        proc.wait()
        rival.close()


def test_processes_of_one_container_share_its_grant(hooked: Hooked) -> None:
    # 5 s quotas: the second process starts within the first's grant on a busy box too (with
    # the default 150 ms it asked whenever its start-up took longer, on the old code as well).
    node = start_node(0.5, "--min-quota", "5", "--max-quota", "5")
    node.allocate(0.5)                                      # contended: quotas, not gate open
    first = hooked.start(f"""
        import sys
        lib = cuda()
        context(lib)
        {LAUNCH}
        print(json.dumps(stats()), flush=True)
        sys.stdin.readline()
    """, node.env())
    try:
        assert hooked.line(first)["token_requests"] == 1
        second = hooked.python(f"""
            lib = cuda()
            context(lib)
            for _ in range(200):
                {LAUNCH}
            print(json.dumps(stats()))
        """, node.env())
        assert second["kernel_launches"] == 200
        assert second["token_requests"] == 0                # the page said: granted
        assert second["frames_sent"] == 1                   # its own hello, nothing more
    finally:
        first.kill()
        first.wait()
        stop_node(node)


def test_launches_into_a_capturing_stream_are_not_gated(hooked: Hooked, node: DaemonNode) -> None:
    rival = Rival(node.allocate(0.5))
    try:
        rival.hold()
        started = time.monotonic()
        result = hooked.python("""
            lib = cuda()
            context(lib)
            captured = ctypes.c_void_p(0x5eed)
            lib.cuStreamBeginCapture_v2(captured, 0)
            for _ in range(3):
                lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, captured, None, None)
            lib.cuStreamSynchronize(captured)
            out = stats()
            lib.cuStreamEndCapture(captured, ctypes.byref(ctypes.c_void_p()))
            print(json.dumps(out))
        """, node.env())
        assert result["captured_launches"] == 3 and result["kernel_launches"] == 0
        assert result["token_requests"] == 0 and result["syncs_observed"] == 0
        assert time.monotonic() - started < 5
    finally:
        rival.close()


def test_a_killed_daemon_leaves_the_program_running_self_gated(
        hooked: Hooked, node_process: DaemonNode) -> None:
    node = node_process
    loop = Loop(hooked, node.env(GEMINI_HOOK_DAEMON_WAIT="0.3"), 1.0)
    try:
        loop.go()
        wait_for(lambda: node.daemon.status()["gpus"][0]["grants"] > 0, 5,
                 "the program gated by the daemon")
        node.daemon.stop(signal.SIGKILL)
        result = loop.result()
    finally:
        loop.kill()
    assert len(result["returns"]) > 100
    assert result["stats"]["ungated_launches"] > 0
    assert result["stderr"].count("gates its launches itself") == 1   # warned once


def test_a_forked_child_maps_its_own_pages_and_shares_the_grant(
        hooked: Hooked, node: DaemonNode) -> None:
    node.allocate(0.5)
    result = hooked.python(f"""
        lib = cuda()
        context(lib)
        {LAUNCH}
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            for _ in range(10):
                {LAUNCH}
            os.write(write, json.dumps(stats()).encode())
            os._exit(0)
        os.close(write)
        child = json.loads(os.read(read, 8192))
        os.waitpid(pid, 0)
        print(json.dumps({{"child": child, "parent": stats()}}))
    """, node.env())
    child, parent = result["child"], result["parent"]
    assert child["daemon_connects"] == parent["daemon_connects"] + 1   # its own hello
    assert child["token_requests"] == parent["token_requests"] == 1    # no new request
    assert child["kernel_launches"] == parent["kernel_launches"] + 10


@pytest.mark.parametrize("drain", ["sync", "report"])
def test_asking_again_settles_own_streams_never_recording_on_the_legacy_one(
        hooked: Hooked, node: DaemonNode, drain: str) -> None:
    # Kernels of 1 s: the work is still queued when the process asks again (its grant was
    # revoked after quota + grace), so the sync drain has something to wait for.
    rival = Rival(node.allocate(0.5))
    proc = hooked.start("""
        import sys
        lib = cuda()
        context(lib)
        lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
        lib.fake_cuda_set_kernel_ns(1000000000)
        for stream in (0x77, 0x78, 0x77, None):
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream), None, None)
        print(json.dumps({}), flush=True)
        sys.stdin.readline()
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(0x77), None, None)
        names = ["cuEventRecord", "cuEventSynchronize", "cuEventQuery", "cuStreamSynchronize",
                 "cuStreamQuery"]
        lib.fake_cuda_events_live.restype = ctypes.c_ulong
        print(json.dumps({"calls": {n: calls(lib, n) for n in names},
                          "events_live": lib.fake_cuda_events_live(), "stats": stats()}),
              flush=True)
    """, node.env(GEMINI_HOOK_DRAIN=drain))
    try:
        hooked.line(proc)
        rival.request()
        rival.granted()                                    # the process's grant was revoked
        after = hooked.line(proc, go=True)
        calls = after["calls"]
        assert calls["cuEventRecord"] == 2                 # streams 0x77 and 0x78, once each
        if drain == "sync":
            assert calls["cuStreamQuery"] >= 1             # asked first: still running
            assert calls["cuEventSynchronize"] == 2
            assert calls["cuStreamSynchronize"] == 1       # the legacy stream: drained, no event
            assert after["events_live"] == 0
            assert after["stats"]["drain_ns"] > 0
        else:
            assert calls["cuEventSynchronize"] == 0 and calls["cuStreamSynchronize"] == 0
            assert after["events_live"] == 2               # kept, queried when it next asks
    finally:
        proc.kill()
        proc.wait()
        rival.close()


def test_more_bursts_than_a_report_holds_are_reported_never_dropped(
        hooked: Hooked, node: DaemonNode) -> None:
    """Bursts 3 ms apart (past the 2 ms merge gap) are kept apart for the report every 100 ms,
    about 25 of them to a table of 16: the last kept one is stretched over the rest, so the busy
    time reported is at least the busy time seen (it was 60 % of it when they were dropped)."""
    result = hooked.python("""
        import time
        lib = cuda()
        context(lib)
        stream = ctypes.c_void_p(0x77)
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None)
            lib.cuStreamSynchronize(stream)
            time.sleep(0.003)
        time.sleep(0.12)   # past the report interval: the next synchronisation sends it all
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None)
        lib.cuStreamSynchronize(stream)
        print(json.dumps(stats()))
    """, node.env())
    assert result["syncs_observed"] >= 60, result
    assert result["usage_reported_ns"] >= result["bursts_observed_ns"] > 0, result
