"""Memory limits end to end: the hook over the fake driver, against the REAL node daemon."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for
from tests.hook.conftest import LIMIT, OTHER_UUID, PRELUDE, UUID, DaemonNode, GiB, Hooked, MiB


def test_limit_oom_and_free(hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        out = {}
        rc1, p1 = alloc(lib, 600 * 2**20)
        out["first"] = rc1
        out["info_after_first"] = mem_info(lib)
        real_before = calls(lib, "cuMemAlloc_v2")
        out["second"] = alloc(lib, 600 * 2**20)[0]
        out["second_reached_driver"] = calls(lib, "cuMemAlloc_v2") - real_before
        total = ctypes.c_size_t()
        lib.cuDeviceTotalMem_v2(ctypes.byref(total), 0)
        out["device_total"] = total.value
        out["free_rc"] = lib.cuMemFree_v2(ctypes.c_uint64(p1))
        out["after_free"] = alloc(lib, 900 * 2**20)[0]
        out["stats"] = stats()
        print(json.dumps(out))
    """, node.env())
    assert result["first"] == 0
    assert result["info_after_first"] == [LIMIT - 600 * MiB, LIMIT]
    assert result["second"] == 2 and result["second_reached_driver"] == 0
    assert result["device_total"] == LIMIT
    assert result["free_rc"] == 0 and result["after_free"] == 0
    stats = result["stats"]
    assert isinstance(stats, dict) and stats["mem_refused"] == 1 and stats["daemon_connects"] == 1
    wait_for(lambda: node.used() == 0, what="the exited process's memory released")


HOLDER = """
    import sys
    lib = cuda()
    context(lib)
    rc, ptr = alloc(lib, int(sys.argv[1]))
    print(json.dumps({"rc": rc}), flush=True)
    sys.stdin.readline()
    rc2, ptr2 = alloc(lib, int(sys.argv[2])) if len(sys.argv) > 2 else (None, 0)
    print(json.dumps({"rc": rc2, "stats": stats()}), flush=True)
    sys.stdin.readline()
"""


def start_holder(hooked: Hooked, node: DaemonNode, *sizes: int,
                 **env: str) -> subprocess.Popen[str]:
    source = PRELUDE + textwrap.dedent(HOLDER)
    proc = subprocess.Popen([sys.executable, "-c", source, *map(str, sizes)],
                            env=hooked.env(node.env(**env)), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else ""
    assert json.loads(line)["rc"] == 0
    return proc


def step(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    result: dict[str, object] = json.loads(proc.stdout.readline())
    return result


def one_alloc(hooked: Hooked, node: DaemonNode, size: int) -> int:
    result = hooked.python(f"""
        lib = cuda()
        context(lib)
        print(json.dumps({{"rc": alloc(lib, {size})[0]}}))
    """, node.env())
    rc = result["rc"]
    assert isinstance(rc, int)
    return rc


def test_processes_share_one_limit_and_a_killed_holder_is_released(
        hooked: Hooked, node: DaemonNode) -> None:
    holder = start_holder(hooked, node, 700 * MiB)
    try:
        assert node.used() == 700 * MiB
        assert one_alloc(hooked, node, 500 * MiB) == 2     # 700 + 500 > 1024
        assert one_alloc(hooked, node, 300 * MiB) == 0     # 700 + 300 fits
        holder.kill()                                      # SIGKILL: no goodbye at all
        holder.wait()
        wait_for(lambda: node.used() == 0, what="the killed holder's memory released")
        assert one_alloc(hooked, node, 900 * MiB) == 0
    finally:
        holder.kill()
        holder.wait()


def test_daemon_restart_redeclares_what_the_process_holds(hooked: Hooked, node: DaemonNode) -> None:
    holder = start_holder(hooked, node, 600 * MiB, 600 * MiB)
    try:
        node.restart_daemon()
        assert node.used() == 0                            # the new daemon knows nothing yet
        second = step(holder)                              # next need: reconnect, re-declare
        assert second["rc"] == 2, "600 MiB held + 600 MiB must pass the 1 GiB limit"
        stats = second["stats"]
        assert isinstance(stats, dict) and stats["daemon_connects"] == 2
        assert node.used() == 600 * MiB
    finally:
        holder.kill()
        holder.wait()


def test_fork_child_opens_its_own_connection(hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        assert alloc(lib, 400 * 2**20)[0] == 0
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            rc = alloc(lib, 300 * 2**20)[0]
            os.write(write, json.dumps({"rc": rc, "stats": stats()}).encode())
            os._exit(0)
        os.close(write)
        child = json.loads(os.read(read, 4096))
        os.waitpid(pid, 0)
        print(json.dumps({"child": child, "parent": stats()}))
    """, node.env())
    child = result["child"]
    assert isinstance(child, dict)
    assert child["rc"] == 0
    parent = result["parent"]
    assert isinstance(parent, dict) and parent["bytes_held"] == 400 * MiB
    # Counters are inherited (1 from the parent): one more is the child's own hello; had it
    # used its parent's socket, the daemon would have refused nothing and no hello was sent.
    assert parent["daemon_connects"] == 1
    assert child["stats"]["daemon_connects"] == 2
    assert child["stats"]["bytes_held"] == 300 * MiB       # the parent's 400 MiB are not its own


def test_pool_growth_and_trim_are_declared_and_overflow_is_undone(
        hooked: Hooked, node: DaemonNode) -> None:
    holder_code = """
        lib = cuda()
        context(lib)
        ptr = ctypes.c_uint64()
        rc = lib.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(300 * 2**20), None)
        print(json.dumps({"rc": rc}), flush=True)
        import sys; sys.stdin.readline()
        lib.cuMemFreeAsync(ptr, None)
        lib.cuStreamSynchronize(None)                  # the pool trims here
        print(json.dumps({"rc": 0}), flush=True)
        sys.stdin.readline()
        big = ctypes.c_uint64()
        rc = lib.cuMemAllocAsync(ctypes.byref(big), ctypes.c_size_t(1100 * 2**20), None)
        free, total = mem_info(lib)
        print(json.dumps({"rc": rc, "free": free, "stats": stats()}), flush=True)
        sys.stdin.readline()
    """
    source = PRELUDE + textwrap.dedent(holder_code)
    proc = subprocess.Popen([sys.executable, "-c", source], env=hooked.env(node.env()),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["rc"] == 0
        assert node.used() == 300 * MiB                    # the pool's 2 MiB chunks: 300 MiB
        step(proc)
        assert node.used() == 0                            # trimmed at synchronisation
        over = step(proc)
        assert over["rc"] == 2                             # grew past the limit: undone
        assert over["free"] == LIMIT                       # and the pool gave it back
        assert node.used() == 0
    finally:
        proc.kill()
        proc.wait()


def test_every_pool_is_measured_however_many(hooked: Hooked, node: DaemonNode) -> None:
    """S4: the hook tracked 64 pools; allocations from the 65th on were never measured (4 GiB
    each went through against a 1 GiB limit). Pass: pool 66 and 67 are refused like the first."""
    result = hooked.python("""
        lib = cuda()
        context(lib)
        ptr = ctypes.c_uint64()
        def from_pool(pool, size):
            return lib.cuMemAllocFromPoolAsync(ctypes.byref(ptr), ctypes.c_size_t(size),
                                               ctypes.c_void_p(pool), None)
        small = [from_pool(pool, 2**20) for pool in range(2, 68)]   # 66 pools (1: the default)
        big = [from_pool(pool, 4 * 2**30) for pool in (66, 67)]
        print(json.dumps({"small": small, "big": big, "stats": stats()}))
    """, node.env())
    assert result["small"] == [0] * 66
    assert result["big"] == [2, 2]                           # CUDA_ERROR_OUT_OF_MEMORY, both
    assert node.used() == 0                                   # the process exited: all released
    stats = result["stats"]
    assert isinstance(stats, dict) and stats["bytes_held"] == 66 * 2 * MiB   # 2 MiB chunks


def test_vmm_managed_pitch_and_arrays_count_and_free(hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        class Prop(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int),
                        ("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int),
                        ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]
        class Array(ctypes.Structure):
            _fields_ = [("w", ctypes.c_size_t), ("h", ctypes.c_size_t), ("fmt", ctypes.c_int),
                        ("ch", ctypes.c_uint)]
        lib = cuda()
        context(lib)
        out = {}
        handle = ctypes.c_uint64()
        prop = Prop(1, 0, 1, 0)
        out["vmm"] = lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(512 * 2**20),
                                     ctypes.byref(prop), ctypes.c_ulonglong(0))
        out["vmm_over"] = lib.cuMemCreate(ctypes.byref(ctypes.c_uint64()),
                                          ctypes.c_size_t(600 * 2**20), ctypes.byref(prop),
                                          ctypes.c_ulonglong(0))
        managed = ctypes.c_uint64()
        out["managed"] = lib.cuMemAllocManaged(ctypes.byref(managed),
                                               ctypes.c_size_t(100 * 2**20), 1)
        pitched, pitch = ctypes.c_uint64(), ctypes.c_size_t()
        out["pitch"] = lib.cuMemAllocPitch_v2(ctypes.byref(pitched), ctypes.byref(pitch),
                                              ctypes.c_size_t(1000), ctypes.c_size_t(1024), 4)
        array = ctypes.c_void_p()
        desc = Array(1024, 1024, 0x20, 4)
        out["array"] = lib.cuArrayCreate_v2(ctypes.byref(array), ctypes.byref(desc))
        out["held"] = stats()["bytes_held"]
        out["frees"] = [lib.cuMemRelease(handle), lib.cuMemFree_v2(managed),
                        lib.cuMemFree_v2(pitched), lib.cuArrayDestroy(array)]
        out["held_after"] = stats()["bytes_held"]
        print(json.dumps(out))
    """, node.env())
    assert result["vmm"] == 0 and result["vmm_over"] == 2
    assert result["managed"] == 0 and result["pitch"] == 0 and result["array"] == 0
    # VMM 512 + managed 100 + pitch 1024 rows x 1024 B (real pitch) + array 16 MiB estimate
    assert result["held"] == 512 * MiB + 100 * MiB + 1024 * 1024 + 16 * MiB
    assert result["frees"] == [0, 0, 0, 0] and result["held_after"] == 0


def test_nvml_reports_the_slice_without_underflow(hooked: Hooked, node: DaemonNode) -> None:
    code = """
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        nvml.nvmlInit_v2()
        dev = ctypes.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev))
        mem = (ctypes.c_ulonglong * 3)()
        assert nvml.nvmlDeviceGetMemoryInfo(dev, mem) == 0
        v2 = (ctypes.c_ulonglong * 5)()
        v2[0] = (2 << 24) | 40
        assert nvml.nvmlDeviceGetMemoryInfo_v2(dev, v2) == 0
        print(json.dumps({"v1": list(mem), "v2": list(v2)[1:]}))
    """
    result = hooked.python(code, node.env())
    assert result["v1"] == [LIMIT, LIMIT, 0]                   # total, free, used
    assert result["v2"] == [LIMIT, 0, LIMIT, 0]                # total, reserved, free, used
    holder = start_holder(hooked, node, 900 * MiB)
    try:
        result = hooked.python(code, node.env())
        assert result["v1"] == [LIMIT, LIMIT - 900 * MiB, 900 * MiB]
    finally:
        holder.kill()
        holder.wait()


def test_graph_memory_is_declared_and_use_past_the_limit_does_not_underflow(
        hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        context(lib)
        out = {"alloc": alloc(lib, 800 * 2**20)[0]}
        # The fake's graph exec handle is the memory the graph allocates: 400 MiB.
        out["launch"] = lib.cuGraphLaunch(ctypes.c_void_p(400 * 2**20), None)
        out["info"] = mem_info(lib)
        out["stats"] = stats()
        print(json.dumps(out))
    """, node.env())
    assert result["alloc"] == 0 and result["launch"] == 0
    assert result["info"] == [0, LIMIT]                        # 1200 MiB used of 1024: free 0
    stats = result["stats"]
    assert isinstance(stats, dict) and stats["graph_launches"] == 1


def test_devices_outside_the_allocation_are_refused(hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        lib.cuInit(0)
        ctx = ctypes.c_void_p()
        out = {"other": lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 1),
               "ours": lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)}
        print(json.dumps(out))
    """, node.env(FAKE_CUDA_UUIDS=f"{UUID},{OTHER_UUID}"))
    assert result == {"other": 101, "ours": 0}


def test_daemon_away_fails_allocations_closed_without_crashing(
        hooked: Hooked, tmp_path: Path) -> None:
    started = time.monotonic()
    result = hooked.python("""
        lib = cuda()
        context(lib)
        first = alloc(lib, 2**20)[0]
        second = alloc(lib, 2**20)[0]
        print(json.dumps({"rcs": [first, second], "info": mem_info(lib)}))
    """, {"GEMINI_CHANNEL_DIR": str(tmp_path), "GEMINI_HOOK_DAEMON_WAIT": "0.5",
          "FAKE_CUDA_TOTAL_MEM": str(4 * GiB)})
    assert result["rcs"] == [2, 2]
    assert result["info"] == [4 * GiB, 4 * GiB]                # no limit known: real figures
    assert time.monotonic() - started < 10                     # waited once, not per call


@pytest.mark.slow
def test_a_daemon_wait_that_is_not_a_number_waits_the_default_then_fails_closed(
        hooked: Hooked, tmp_path: Path) -> None:
    """GEMINI_HOOK_DAEMON_WAIT=inf once waited forever for an absent daemon (nan too). A value
    that is not a number in range is ignored with a warning, as for every setting the hook reads:
    the default wait (30 s), then allocations fail closed."""
    code = PRELUDE + textwrap.dedent("""
        lib = cuda()
        context(lib)
        print(json.dumps({"rc": alloc(lib, 2**20)[0]}))
    """)
    started = time.monotonic()
    proc = hooked.run([sys.executable, "-c", code],
                      {"GEMINI_CHANNEL_DIR": str(tmp_path), "GEMINI_HOOK_DAEMON_WAIT": "inf"},
                      timeout=60)
    waited = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"rc": 2}
    assert "GEMINI_HOOK_DAEMON_WAIT=inf is not a number" in proc.stderr, proc.stderr
    assert "after 30.0 s" in proc.stderr, proc.stderr
    assert waited > 29                                          # the default, not 0


def test_stopped_daemon_does_not_crash_the_holder(hooked: Hooked,
                                                  node_process: DaemonNode) -> None:
    node = node_process
    holder = start_holder(hooked, node, 100 * MiB, 100 * MiB, GEMINI_HOOK_DAEMON_WAIT="0.3")
    try:
        node.daemon.stop(signal.SIGKILL)
        second = step(holder)
        assert second["rc"] == 2                                # fails closed, keeps running
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
        node.daemon = DaemonProcess(node.state_dir).wait_ready()
