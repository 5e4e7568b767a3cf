"""Attacks on the memory limit and the token through the real driver's API (ctypes); run
UNDER the hook (by tests/gpu/test_driver_reservations_gpu.py, inside `gemini-run --memory
4GiB`).

    python -m tests.gpu.driver_probe [CUBIN FATBIN COMPRESSED_FATBIN [ZSTD_FATBIN]]

The optional files are nvcc's output for a module with a 4 GiB `__device__` array (plain
cubin, fatbin, fatbin compressed in nvcc's default mode (LZ4), and in -compress-mode=size
(zstd)). A thread samples NVML's figure for this process every
millisecond; each step prints one JSON line: what the driver answered, and the most NVML saw
this process hold during the step. The last line is {"done": true, "peak": ...}.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

from tests.hook.cudaprobe import STAT_NAMES, HookStats

GiB, MiB = 1 << 30, 1 << 20
STACK, PRINTF_FIFO, MALLOC_HEAP = 0, 1, 2
JIT_INPUT_PTX = 1   # CUjitInputType

KERNEL_PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .entry noop() { ret; }
"""


def global_ptx(size: int) -> bytes:
    return (b".version 7.0\n.target sm_70\n.address_size 64\n"
            b".visible .global .align 8 .b8 big[%d];\n"
            b".visible .entry touch() {\n .reg .b64 %%rd<2>;\n mov.u64 %%rd1, big;\n"
            b" st.global.u8 [%%rd1], 1;\n ret;\n}\n" % size) + b"\0"


class Sampler(threading.Thread):
    """NVML's figure for this pid, every millisecond; `peak` since the last take()."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import pynvml
        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("PROBE_NVML_INDEX",
                                                                           "0")))
        self.pid, self.peak, self.ever = os.getpid(), 0, 0
        self.lock = threading.Lock()

    def figure(self) -> int:
        for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if int(process.pid) == self.pid and isinstance(process.usedGpuMemory, int):
                return int(process.usedGpuMemory)
        return 0

    def run(self) -> None:
        while True:
            value = self.figure()
            with self.lock:
                self.peak = max(self.peak, value)
                self.ever = max(self.ever, value)
            time.sleep(0.001)

    def take(self) -> int:
        time.sleep(0.05)   # a few samples after the step
        with self.lock:
            peak, self.peak = self.peak, 0
        return peak


def make_primary_context_current(cuda: ctypes.CDLL) -> ctypes.c_int:
    """cuInit, then device 0's primary context retained and made current (the context charge
    the probes' first step reports); returns device 0's handle."""
    assert cuda.cuInit(0) == 0
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    return device


def stats() -> dict[str, int]:
    out = HookStats()
    assert ctypes.CDLL(None).gemini_hook_stats(ctypes.byref(out)) == 0
    return {name: int(getattr(out, name)) for name in STAT_NAMES}


def main(files: list[str]) -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    sampler = Sampler()
    sampler.start()

    def report(step: str, rc: int, **more: Any) -> None:
        print(json.dumps({"step": step, "rc": rc, "nvml_peak": sampler.take(),
                          "held": stats()["bytes_held"], **more}), flush=True)

    device = make_primary_context_current(cuda)
    report("context", 0)

    def limit(which: int) -> int:
        value = ctypes.c_size_t()
        cuda.cuCtxGetLimit(ctypes.byref(value), which)
        return value.value

    for name, which, value in (("stack_256k", STACK, 256 << 10), ("stack_32k", STACK, 32 << 10),
                               ("heap_6g", MALLOC_HEAP, 6 * GiB),
                               ("printf_6g", PRINTF_FIFO, 6 * GiB)):
        old = limit(which)
        rc = cuda.cuCtxSetLimit(which, ctypes.c_size_t(value))
        report(name, rc, old=old, now=limit(which))
    rc = cuda.cuCtxSetLimit(STACK, ctypes.c_size_t(4 << 10))    # 4 KiB: ~1 GiB on an H200
    report("stack_4k", rc, now=limit(STACK))
    rc = cuda.cuCtxSetLimit(STACK, ctypes.c_size_t(1 << 10))    # back to the default
    report("stack_1k", rc, now=limit(STACK))
    # A3: a heap that fits is charged its value, and uncharged when set back.
    old_heap = limit(MALLOC_HEAP)
    rc = cuda.cuCtxSetLimit(MALLOC_HEAP, ctypes.c_size_t(1 * GiB))
    report("heap_1g", rc, old=old_heap, now=limit(MALLOC_HEAP))
    rc = cuda.cuCtxSetLimit(MALLOC_HEAP, ctypes.c_size_t(old_heap))
    report("heap_back", rc, now=limit(MALLOC_HEAP))

    module = ctypes.c_void_p()
    rc = cuda.cuModuleLoadData(ctypes.byref(module), global_ptx(4 * GiB))
    report("ptx_global_4g", rc)
    for path, step in zip(files, ("cubin_4g", "fatbin_4g", "compressed_fatbin_4g",
                                  "zstd_fatbin_4g"), strict=False):
        with open(path, "rb") as handle:
            image = handle.read()
        rc = cuda.cuModuleLoadData(ctypes.byref(module), image)
        report(step, rc)
    library = ctypes.c_void_p()
    rc = cuda.cuLibraryLoadData(ctypes.byref(library), global_ptx(4 * GiB), None, None, 0, None,
                                None, 0)
    report("library_ptx_global_4g", rc)
    with tempfile.NamedTemporaryFile(suffix=".ptx") as ptx_file:
        ptx_file.write(global_ptx(4 * GiB)[:-1])   # a PTX file as nvcc writes it: no NUL
        ptx_file.flush()
        rc = cuda.cuLibraryLoadFromFile(ctypes.byref(library), ptx_file.name.encode(), None,
                                        None, 0, None, None, 0)
    report("library_file_ptx_global_4g", rc)

    # A3: the JIT linker's cubin (host memory) loaded with cuModuleLoadData.
    state = ctypes.c_void_p()
    linked = cuda.cuLinkCreate_v2(0, None, None, ctypes.byref(state))
    source = global_ptx(4 * GiB)
    if linked == 0:
        linked = cuda.cuLinkAddData_v2(state, JIT_INPUT_PTX, source, ctypes.c_size_t(len(source)),
                                       b"big.ptx", 0, None, None)
    cubin, cubin_size = ctypes.c_void_p(), ctypes.c_size_t()
    if linked == 0:
        linked = cuda.cuLinkComplete(state, ctypes.byref(cubin), ctypes.byref(cubin_size))
    rc = cuda.cuModuleLoadData(ctypes.byref(module), cubin) if linked == 0 else -1
    report("link_global_4g", rc, link=linked, cubin_bytes=cubin_size.value)
    if state.value:
        cuda.cuLinkDestroy(state)

    pointer = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(3 * GiB))
    report("alloc_3g", rc)
    rc = cuda.cuModuleLoadData(ctypes.byref(module), global_ptx(1 * GiB))
    report("ptx_global_1g_after_3g", rc)
    cuda.cuMemFree_v2(pointer)
    report("free_3g", 0)

    # A graph with a memory node added by hand.
    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class PoolProps(ctypes.Structure):
        _fields_ = [("allocType", ctypes.c_int), ("handleTypes", ctypes.c_int),
                    ("location", Location), ("win32", ctypes.c_void_p),
                    ("maxSize", ctypes.c_size_t), ("usage", ctypes.c_ushort),
                    ("reserved", ctypes.c_ubyte * 54)]

    class Params(ctypes.Structure):
        _fields_ = [("poolProps", PoolProps), ("accessDescs", ctypes.c_void_p),
                    ("accessDescCount", ctypes.c_size_t), ("bytesize", ctypes.c_size_t),
                    ("dptr", ctypes.c_uint64)]

    def graph_with(size: int) -> ctypes.c_void_p:
        graph, node, exe = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        assert cuda.cuGraphCreate(ctypes.byref(graph), 0) == 0
        params = Params(bytesize=size)
        params.poolProps.allocType = 1                                  # PINNED
        params.poolProps.location = Location(1, device.value)           # DEVICE
        rc = cuda.cuGraphAddMemAllocNode(ctypes.byref(node), graph, None, 0, ctypes.byref(params))
        assert rc == 0, rc
        free_node = ctypes.c_void_p()
        deps = (ctypes.c_void_p * 1)(node)
        assert cuda.cuGraphAddMemFreeNode(ctypes.byref(free_node), graph, deps, 1,
                                          ctypes.c_uint64(params.dptr)) == 0
        assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph,
                                                ctypes.c_ulonglong(0)) == 0
        return exe

    big = graph_with(6 * GiB)
    rc = cuda.cuGraphLaunch(big, None)
    sync = cuda.cuCtxSynchronize()
    report("graph_6g", rc, sync=sync)
    small = graph_with(1 * GiB)
    rc = cuda.cuGraphLaunch(small, None)
    sync = cuda.cuCtxSynchronize()
    report("graph_1g", rc, sync=sync)
    cuda.cuDeviceGraphMemTrim(device)

    # Legacy launches of an empty kernel: they pass the gate (counted) and run.
    function = ctypes.c_void_p()
    assert cuda.cuModuleLoadData(ctypes.byref(module), KERNEL_PTX + b"\0") == 0
    assert cuda.cuModuleGetFunction(ctypes.byref(function), module, b"noop") == 0
    before = stats()["kernel_launches"]
    cuda.cuFuncSetBlockShape(function, 1, 1, 1)
    results = [cuda.cuLaunch(function), cuda.cuLaunchGrid(function, 2, 2),
               cuda.cuLaunchGridAsync(function, 2, 2, None)]
    sync = cuda.cuCtxSynchronize()
    report("legacy_launches", max(results), results=results, sync=sync,
           gated=stats()["kernel_launches"] - before)

    # The multi-device cooperative launch (deprecated since 11.3), on this one device.
    class LaunchParams(ctypes.Structure):   # CUDA_LAUNCH_PARAMS
        _fields_ = [("function", ctypes.c_void_p), ("dims", ctypes.c_uint * 7),
                    ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p)]

    stream = ctypes.c_void_p()
    assert cuda.cuStreamCreate(ctypes.byref(stream), 0) == 0
    launches = (LaunchParams * 1)(LaunchParams(function=function.value,
                                               dims=(ctypes.c_uint * 7)(1, 1, 1, 1, 1, 1, 0),
                                               stream=stream.value))
    before = stats()["kernel_launches"]
    rc = cuda.cuLaunchCooperativeKernelMultiDevice(launches, 1, 0)
    sync = cuda.cuCtxSynchronize()
    report("cooperative_multi_device", rc, sync=sync, gated=stats()["kernel_launches"] - before)

    # The 32-bit original cuMemAlloc (v1 ABI): does today's driver still allocate through it?
    v1_pointer = ctypes.c_uint()
    rc = cuda.cuMemAlloc(ctypes.byref(v1_pointer), ctypes.c_uint(1 << 31))
    report("v1_cuMemAlloc_2g", rc)

    print(json.dumps({"done": True, "peak": sampler.ever}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
