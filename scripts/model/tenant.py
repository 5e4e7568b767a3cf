"""One tenant of scripts/bench-share-model: a loop of modelled kernels over the fake libcuda.

Usage: tenant.py loop KERNEL_NS SYNC_EVERY START_AT DURATION OUT
       tenant.py infer KERNEL_NS KERNELS THINK_S START_AT DURATION OUT
       tenant.py startup KERNEL_NS SYNC_EVERY WARMUP_NS ALLOC START_AT DURATION OUT
  loop     a saturating loop: SYNC_EVERY launches of KERNEL_NS each, then a stream sync
  infer    one request at a time: KERNELS launches of KERNEL_NS, a sync, THINK_S of think time
  startup  the start-up shape: at once, one WARMUP_NS kernel (longer than a quota and
           its grace: revoked) and a sync; idle until START_AT; a short copy the hook does not
           gate (PyTorch queues such work, e.g. an event record or a memset); then the loop
           from the first instant, no ramp. ALLOC=1: a 64 MiB cuMemAlloc/cuMemFree every step
The fake driver (vgpu_runtime/devkit/fakecuda/fake_cuda.c) gives every launch KERNEL_NS of
modelled GPU time on its stream; a sync sleeps until the stream's work is done. The process
reaches the driver through ctypes (dlopen + dlsym), so under LD_PRELOAD every call goes through
the interposer.

Like scripts/cuda/tenant.py, a tenant idles until RAMP seconds before START_AT and then loads
the GPU, so every tenant of a case starts together; it counts what completes inside
[START_AT, START_AT + DURATION) and writes JSON to OUT:
  loop:  {"kernels", "seconds", "kernel_ns", "busy"}   busy = kernels x kernel time / seconds
  infer: {"requests", "p50_ms", "p99_ms", "mean_ms", "kernels", "seconds", "kernel_ns"}
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

RAMP = 2.0            # seconds of common load before the window opens
STREAM = 0x5EED       # one stream of our own: the hook drains it before the token passes
PR_SET_TIMERSLACK = 29


def driver(kernel_ns: int) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """The (fake) driver with a context, and launch/sync on our stream."""
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0:
        raise SystemExit("tenant: cuInit failed")
    ctx = ctypes.c_void_p()
    if lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) != 0:
        raise SystemExit("tenant: cuCtxCreate failed")
    lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
    lib.fake_cuda_set_kernel_ns(kernel_ns)
    launch_kernel = lib.cuLaunchKernel
    launch_kernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    stream_sync = lib.cuStreamSynchronize
    stream_sync.argtypes = [ctypes.c_void_p]
    stream = ctypes.c_void_p(STREAM)

    def launch() -> None:
        if launch_kernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None) != 0:
            raise SystemExit("tenant: cuLaunchKernel failed")

    def sync() -> None:
        if stream_sync(stream) != 0:
            raise SystemExit("tenant: cuStreamSynchronize failed")

    return lib, launch, sync


def precise_sleeps() -> None:
    """A sync's sleep ends when the modelled work does, not up to 50 us later (the default
    timer slack): a real driver's sync spins or yields, it does not oversleep."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


def wait_until(when: float) -> None:
    while time.time() < when:
        time.sleep(min(0.005, max(0.0, when - time.time())))


def run_loop(kernel_ns: int, sync_every: int, start_at: float, duration: float) -> dict[str, Any]:
    _, launch, sync = driver(kernel_ns)
    launch()
    sync()

    def step() -> None:
        for _ in range(sync_every):
            launch()
        sync()

    wait_until(start_at - RAMP)
    while time.time() < start_at:     # everyone loads the GPU together before the window
        step()
    end = start_at + duration
    kernels = 0
    while True:
        step()
        now = time.time()
        if now >= end:
            break
        if now >= start_at:
            kernels += sync_every
    return {"kernels": kernels, "seconds": duration, "kernel_ns": kernel_ns,
            "busy": kernels * kernel_ns / 1e9 / duration}


COPY_NS = 140_000    # the ungated stream work found at the H200's start instant (~0.14 ms)


def run_startup(kernel_ns: int, sync_every: int, warmup_ns: int, alloc: bool,
                start_at: float, duration: float) -> dict[str, Any]:
    lib, launch, sync = driver(warmup_ns)
    launch()                          # the warm-up's first kernel: longer than quota + grace
    sync()
    lib.fake_cuda_set_kernel_ns(kernel_ns)
    lib.fake_cuda_set_copy_ns.argtypes = [ctypes.c_longlong]
    lib.fake_cuda_set_copy_ns(COPY_NS)
    copy = lib.cuMemcpyHtoDAsync_v2
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    wait_until(start_at)
    if copy(0, None, 0, ctypes.c_void_p(STREAM)) != 0:
        raise SystemExit("tenant: cuMemcpyHtoDAsync_v2 failed")
    end = start_at + duration
    kernels = 0
    while True:
        if alloc:
            pointer = ctypes.c_uint64()
            if lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(64 << 20)) != 0:
                raise SystemExit("tenant: cuMemAlloc_v2 failed")
        for _ in range(sync_every):
            launch()
        sync()
        if alloc:
            lib.cuMemFree_v2(pointer.value)
        if time.time() >= end:
            break
        kernels += sync_every
    return {"kernels": kernels, "seconds": duration, "kernel_ns": kernel_ns,
            "busy": kernels * kernel_ns / 1e9 / duration}


def run_infer(kernel_ns: int, per_request: int, think_s: float, start_at: float,
              duration: float) -> dict[str, Any]:
    _, launch, sync = driver(kernel_ns)

    def request() -> None:
        for _ in range(per_request):
            launch()
        sync()

    request()
    wait_until(start_at - RAMP)
    while time.time() < start_at:
        request()
        time.sleep(think_s)
    end = start_at + duration
    latencies: list[float] = []
    while time.time() < end:
        begin = time.perf_counter()
        request()
        latencies.append(time.perf_counter() - begin)
        time.sleep(think_s)
    if not latencies:
        raise SystemExit("tenant: no request inside the window")
    latencies.sort()
    return {"requests": len(latencies), "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "mean_ms": 1e3 * statistics.fmean(latencies),
            "kernels": per_request * len(latencies), "seconds": duration,
            "kernel_ns": kernel_ns}


def main(argv: list[str]) -> None:
    precise_sleeps()
    if len(argv) == 7 and argv[1] == "loop":
        result = run_loop(int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]))
    elif len(argv) == 9 and argv[1] == "startup":
        result = run_startup(int(argv[2]), int(argv[3]), int(argv[4]), argv[5] == "1",
                             float(argv[6]), float(argv[7]))
    elif len(argv) == 8 and argv[1] == "infer":
        result = run_infer(int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]),
                           float(argv[6]))
    else:
        raise SystemExit(__doc__)
    with open(argv[-1], "w") as handle:
        json.dump(result, handle)
    hold_until_released()


def hold_until_released() -> None:
    """With MODEL_TENANT_HOLD set, stay (idle, still a tenant) until that file exists, 30 s at
    most: the harness's sample of the daemon at the window's end must find every tenant there,
    and one that exits with the window races it on a loaded host."""
    release = os.environ.get("MODEL_TENANT_HOLD")
    deadline = time.time() + 30
    while release and not os.path.exists(release) and time.time() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv)
