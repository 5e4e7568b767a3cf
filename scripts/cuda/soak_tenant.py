"""One compute tenant of scripts/soak-gpu: a saturating loop that writes down how far it got.

Usage: soak_tenant.py --backend torch|driver --progress FILE --stop FILE
                      [--size N] [--sync-every K] [--step-sleep S] [--max-seconds S]

A step is K kernels and one synchronisation. Four times a second the tenant appends
"<time.time()> <steps so far>" to FILE (flushed), so the caller can take its throughput over any
window, however the daemon behaved meanwhile. It stops when the file STOP exists (or after
--max-seconds, a safety net) and exits 0; any error ends it with a traceback and a non-zero
status, which is what the soak counts as an application error.

Backends:
  torch   bf16 SIZE x SIZE matmuls on "cuda" (as scripts/cuda/tenant.py): a real tenant.
  driver  ctypes on libcuda.so.1: cuLaunchKernel K times, then cuStreamSynchronize. Only for the
          tests' fake libcuda (vgpu_runtime/devkit/fakecuda), whose kernels take no time:
          --step-sleep stands in for the kernel, between the launches and the synchronisation.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from collections.abc import Callable

REPORT_EVERY = 0.25


def torch_step(size: int, sync_every: int) -> Callable[[], None]:
    import torch  # type: ignore[import-not-found, unused-ignore]

    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def step() -> None:
        for _ in range(sync_every):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
    return step


def driver_step(sync_every: int, step_sleep: float) -> Callable[[], None]:
    lib = ctypes.CDLL("libcuda.so.1")
    check(lib.cuInit(0), "cuInit")
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    stream = ctypes.c_void_p(0x77)   # the fake driver accepts any stream handle

    def step() -> None:
        for _ in range(sync_every):
            check(lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None),
                  "cuLaunchKernel")
        if step_sleep > 0:
            time.sleep(step_sleep)
        check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
    return step


def check(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} failed with CUresult {rc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "driver"), required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args()
    if args.backend == "torch":
        step = torch_step(args.size, args.sync_every)
    else:
        step = driver_step(args.sync_every, args.step_sleep)
    steps = 0
    give_up = time.monotonic() + args.max_seconds
    with open(args.progress, "a", buffering=1) as progress:
        next_report = 0.0
        while True:
            step()
            steps += 1
            now = time.monotonic()
            if now >= next_report:
                progress.write(f"{time.time():.4f} {steps}\n")
                next_report = now + REPORT_EVERY
                if os.path.exists(args.stop) or now > give_up:
                    break


if __name__ == "__main__":
    main()
