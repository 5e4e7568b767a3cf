"""Drives an older CUDA runtime (libcudart 11.x or 12.x) through ctypes; run UNDER the hook.

    python -m tests.gpu.cudart_probe /path/to/libcudart.so.N MAJOR   (MAJOR: 11 or 12)

Prints one JSON object (its last line) with what each step returned, for
tests/gpu/test_old_runtimes.py to judge: the reported total, a 6 GiB allocation, a further
4 GiB one, the free, and a kernel launched through driver entry points that the runtime's
cudaGetDriverEntryPoint resolved (so through the hook's cuGetProcAddress wrapper: the 4-argument
one for CUDA 11, the 5-argument one for CUDA 12).

Signatures, from the runtime headers (cudaError_t and CUresult are C enums: int):
    cudaError_t cudaRuntimeGetVersion(int *runtimeVersion)
    cudaError_t cudaMemGetInfo(size_t *free, size_t *total)
    cudaError_t cudaMalloc(void **devPtr, size_t size)
    cudaError_t cudaFree(void *devPtr)
    cudaError_t cudaGetLastError(void)
    cudaError_t cudaDeviceSynchronize(void)
    cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
    11.x: cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr,
                                              unsigned long long flags)
    12.x: cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr,
                                              unsigned long long flags,
                                              cudaDriverEntryPointQueryResult *driverStatus)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tests.hook.cudaprobe import STAT_NAMES, HookStats

GiB = 1 << 30
CUDA_MEMCPY_DEVICE_TO_HOST = 2
CUDA_ENABLE_DEFAULT = 0x0                 # cudaEnableDefault
CUDA_ENABLE_PER_THREAD_DEFAULT_STREAM = 0x2  # cudaEnablePerThreadDefaultStream
DRIVER_ENTRY_POINT_SUCCESS = 0            # cudaDriverEntryPointSuccess

# write_value(unsigned *out, unsigned value): *out = value. PTX ISA 7.0 (CUDA 11.0) for sm_75,
# the oldest architecture CUDA 13 still supports: the driver JITs it for any newer GPU (the H200
# is sm_90), whichever runtime loaded it, since the JIT is the driver's.
WRITE_VALUE_PTX = b"""
.version 7.0
.target sm_75
.address_size 64

.visible .entry write_value(
    .param .u64 write_value_out,
    .param .u32 write_value_value
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;

    ld.param.u64 %rd1, [write_value_out];
    ld.param.u32 %r1, [write_value_value];
    cvta.to.global.u64 %rd2, %rd1;
    st.global.u32 [%rd2], %r1;
    ret;
}
"""
KERNEL_NAME = b"write_value"

c_size_p = ctypes.POINTER(ctypes.c_size_t)
c_void_pp = ctypes.POINTER(ctypes.c_void_p)

# CUresult cuModuleLoadData(CUmodule *module, const void *image)
CuModuleLoadData = ctypes.CFUNCTYPE(ctypes.c_int, c_void_pp, ctypes.c_char_p)
# CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
CuModuleGetFunction = ctypes.CFUNCTYPE(ctypes.c_int, c_void_pp, ctypes.c_void_p,
                                       ctypes.c_char_p)
# CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ,
#     unsigned blockDimX, blockDimY, blockDimZ, unsigned sharedMemBytes, CUstream hStream,
#     void **kernelParams, void **extra)
CuLaunchKernel = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
    ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, c_void_pp, c_void_pp)


def load_runtime(path: str) -> Any:
    rt = ctypes.CDLL(path)
    signatures: dict[str, list[Any]] = {
        "cudaRuntimeGetVersion": [ctypes.POINTER(ctypes.c_int)],
        "cudaMemGetInfo": [c_size_p, c_size_p],
        "cudaMalloc": [c_void_pp, ctypes.c_size_t],
        "cudaFree": [ctypes.c_void_p],
        "cudaGetLastError": [],
        "cudaDeviceSynchronize": [],
        "cudaMemcpy": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
    }
    for name, argtypes in signatures.items():
        function = getattr(rt, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return rt


def runtime_version(rt: Any) -> tuple[int, int]:
    """(rc, version): 11080 for CUDA 11.8. The 11.x runtime answers 35 without a driver."""
    version = ctypes.c_int()
    rc = rt.cudaRuntimeGetVersion(ctypes.byref(version))
    return rc, version.value


def entry_point_getter(rt: Any, major: int) -> Callable[[bytes, int], tuple[int, int]]:
    """cudaGetDriverEntryPoint with the signature of a `major` runtime: (rc, pointer)."""
    if major not in (11, 12):
        raise ValueError(f"runtime major {major}: only 11 and 12 export this signature")
    get = rt.cudaGetDriverEntryPoint
    get.restype = ctypes.c_int
    if major == 11:
        get.argtypes = [ctypes.c_char_p, c_void_pp, ctypes.c_ulonglong]

        def get11(symbol: bytes, flags: int) -> tuple[int, int]:
            pointer = ctypes.c_void_p()
            rc = get(symbol, ctypes.byref(pointer), flags)
            return rc, pointer.value or 0
        return get11
    get.argtypes = [ctypes.c_char_p, c_void_pp, ctypes.c_ulonglong,
                    ctypes.POINTER(ctypes.c_int)]

    def get12(symbol: bytes, flags: int) -> tuple[int, int]:
        pointer = ctypes.c_void_p()
        status = ctypes.c_int(-1)
        rc = get(symbol, ctypes.byref(pointer), flags, ctypes.byref(status))
        if rc == 0 and status.value != DRIVER_ENTRY_POINT_SUCCESS:
            raise RuntimeError(f"cudaGetDriverEntryPoint({symbol!r}): status {status.value}")
        return rc, pointer.value or 0
    return get12


def mapped_ranges(path_suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from a file whose path ends in path_suffix."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(path_suffix):
                low, high = fields[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return ranges


def inside(address: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(low <= address < high for low, high in ranges)


def hook_stats() -> dict[str, int]:
    """The preloaded hook's counters (the same library: dlopen of a loaded path is a no-op)."""
    hook = ctypes.CDLL(os.environ["LD_PRELOAD"].split(":")[0])
    hook.gemini_hook_stats.argtypes = [ctypes.POINTER(HookStats)]
    hook.gemini_hook_stats.restype = ctypes.c_int
    out = HookStats()
    if hook.gemini_hook_stats(ctypes.byref(out)) != 0:
        raise RuntimeError("gemini_hook_stats failed")
    return {name: int(getattr(out, name)) for name in STAT_NAMES}


def malloc(rt: Any, size: int) -> tuple[int, int]:
    pointer = ctypes.c_void_p()
    rc = rt.cudaMalloc(ctypes.byref(pointer), size)
    return rc, pointer.value or 0


def memory_steps(rt: Any) -> dict[str, Any]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    info_rc = rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    fits_rc, fits = malloc(rt, 6 * GiB)
    over_rc, _ = malloc(rt, 4 * GiB)
    last_error = rt.cudaGetLastError()   # clears the (non-sticky) allocation error
    free_rc = rt.cudaFree(ctypes.c_void_p(fits))
    again_rc, again = malloc(rt, 4 * GiB)  # fits once the 6 GiB went back
    again_free_rc = rt.cudaFree(ctypes.c_void_p(again))
    return {"info_rc": info_rc, "total": total.value, "free": free.value,
            "malloc_6g_rc": fits_rc, "malloc_4g_over_rc": over_rc, "last_error": last_error,
            "free_rc": free_rc, "malloc_4g_after_free_rc": again_rc,
            "free_again_rc": again_free_rc}


def launch_steps(rt: Any, major: int) -> dict[str, Any]:
    get = entry_point_getter(rt, major)
    hook_ranges = mapped_ranges(os.path.basename(os.environ["LD_PRELOAD"].split(":")[0]))
    resolved: dict[str, int] = {}
    for key, symbol, flags in (("load", b"cuModuleLoadData", CUDA_ENABLE_DEFAULT),
                               ("function", b"cuModuleGetFunction", CUDA_ENABLE_DEFAULT),
                               ("launch", b"cuLaunchKernel", CUDA_ENABLE_DEFAULT),
                               ("launch_ptsz", b"cuLaunchKernel",
                                CUDA_ENABLE_PER_THREAD_DEFAULT_STREAM)):
        rc, pointer = get(symbol, flags)
        if rc != 0 or not pointer:
            return {"entry_point_failed": key, "rc": rc}
        resolved[key] = pointer
    load = CuModuleLoadData(resolved["load"])
    get_function = CuModuleGetFunction(resolved["function"])

    out_rc, out = malloc(rt, 8)
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    load_rc = load(ctypes.byref(module), WRITE_VALUE_PTX)
    function_rc = get_function(ctypes.byref(function), module, KERNEL_NAME) if load_rc == 0 \
        else -1
    before = hook_stats()
    launch_rcs = []
    # The legacy-stream variant writes 42 to out[0], the per-thread one 43 to out[1].
    for key, offset, value in (("launch", 0, 42), ("launch_ptsz", 4, 43)):
        if function_rc != 0:
            break
        target = ctypes.c_uint64(out + offset)
        number = ctypes.c_uint32(value)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(target), ctypes.addressof(number))
        launch = CuLaunchKernel(resolved[key])
        launch_rcs.append(launch(function, 1, 1, 1, 1, 1, 1, 0, None, params, None))
    sync_rc = rt.cudaDeviceSynchronize()
    after = hook_stats()
    host = (ctypes.c_uint32 * 2)()
    copy_rc = rt.cudaMemcpy(ctypes.addressof(host), ctypes.c_void_p(out), 8,
                            CUDA_MEMCPY_DEVICE_TO_HOST)
    return {
        "wrapped": {key: inside(pointer, hook_ranges) for key, pointer in resolved.items()},
        "out_malloc_rc": out_rc, "load_rc": load_rc, "function_rc": function_rc,
        "launch_rcs": launch_rcs, "sync_rc": sync_rc, "copy_rc": copy_rc,
        "values": list(host),
        "gated_launches": after["kernel_launches"] - before["kernel_launches"],
    }


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3 or argv[2] not in ("11", "12"):
        print("usage: python -m tests.gpu.cudart_probe /path/to/libcudart.so.N 11|12",
              file=sys.stderr)
        return 2
    rt = load_runtime(argv[1])
    version_rc, version = runtime_version(rt)
    result: dict[str, Any] = {"runtime_version_rc": version_rc, "runtime_version": version}
    result.update(memory_steps(rt))
    result.update(launch_steps(rt, int(argv[2])))
    result["stats"] = hook_stats()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
