"""A library loaded lazily on the real driver (CUDA_MODULE_LOADING=LAZY, its default since 12.2),
run UNDER the hook by tests/gpu/test_lazy_loading_gpu.py inside `gemini-run --memory 4GiB`:
its 3 GiB of globals are charged at the load, before the driver takes them at the first
launch. One JSON line per step (the driver's answer, NVML's peak for this process during it);
after the launch it waits for a line on stdin (the test reads the daemon meanwhile).

    python -m tests.gpu.lazy_probe
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

from tests.gpu.driver_probe import GiB, Sampler, global_ptx, make_primary_context_current, stats


def main() -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    sampler = Sampler()
    sampler.start()

    def report(step: str, rc: int, **more: Any) -> None:
        print(json.dumps({"step": step, "rc": rc, "nvml_peak": sampler.take(),
                          "nvml_now": sampler.figure(), "held": stats()["bytes_held"],
                          **more}), flush=True)

    make_primary_context_current(cuda)
    report("context", 0)
    library = ctypes.c_void_p()
    rc = cuda.cuLibraryLoadData(ctypes.byref(library), global_ptx(3 * GiB), None, None, 0, None,
                                None, 0)
    report("library_3g_loaded", rc)
    pointer = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(1 * GiB))
    report("alloc_1g_beside_it", rc)   # the globals count before the driver takes them
    kernel, function = ctypes.c_void_p(), ctypes.c_void_p()
    rc = cuda.cuLibraryGetKernel(ctypes.byref(kernel), library, b"touch")
    if rc == 0:
        rc = cuda.cuKernelGetFunction(ctypes.byref(function), kernel)
    if rc == 0:
        rc = cuda.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    sync = cuda.cuCtxSynchronize()
    report("first_launch", rc, sync=sync)
    sys.stdin.readline()
    report("after_readings", 0)
    print(json.dumps({"done": True, "peak": sampler.ever}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
