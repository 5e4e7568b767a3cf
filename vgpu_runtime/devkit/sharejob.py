"""The demo's GPU program (gemini-demo's sharing part): a CUDA driver-API client through ctypes,
run by gemini-run under the interposer over the fake driver (devkit/fakecuda).

    python -m vgpu_runtime.devkit.sharejob [--seconds S] [--fill F]

It creates a context, then for S seconds launches 1 ms kernels (a sync every 4) as fast as the
GPU-time token lets it, taking memory step by step up to F of its limit (what cuMemGetInfo
reports under the interposer). Then it asks for 1 GiB more than is left, which the interposer
refuses. It reports on stdout, one JSON object a line: `started` (its allocation and limit),
`past_limit` (the answer), and waits for a line on stdin before it exits, so that whoever runs
it can read the daemon's figures while its allocation still lives.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

CUDA_SUCCESS = 0
KERNEL_NS = 1_000_000
STEPS = 8                # memory is taken in this many steps ...
STEP_EVERY = 0.4         # ... this many seconds apart
PAST = 1 << 30           # asked past what is left, at the end


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def check(rc: int, call: str) -> None:
    if rc != CUDA_SUCCESS:
        report(event="error", call=call, rc=rc)
        sys.exit(1)


def mem_info(lib: Any) -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
    return free.value, total.value


def alloc(lib: Any, size: int) -> int:
    pointer = ctypes.c_uint64()
    return int(lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--fill", type=float, default=0.75, help="part of the limit to take")
    args = parser.parse_args(argv)
    lib = ctypes.CDLL("libcuda.so.1")
    check(lib.cuInit(0), "cuInit")
    context = ctypes.c_void_p()
    check(lib.cuCtxCreate_v2(ctypes.byref(context), 0, 0), "cuCtxCreate_v2")
    _free, limit = mem_info(lib)
    report(event="started", allocation=os.environ.get("GEMINI_ALLOCATION_ID"), limit=limit)
    # The fake driver's knob: each launch keeps the (shared) engine busy 1 ms.
    lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
    lib.fake_cuda_set_kernel_ns(KERNEL_NS)
    step, held = int(limit * args.fill) // STEPS, 0
    stream = ctypes.c_void_p(0x77)
    end = time.monotonic() + args.seconds
    next_step = time.monotonic()
    while time.monotonic() < end:
        if held + step <= limit * args.fill and time.monotonic() >= next_step:
            check(alloc(lib, step), "cuMemAlloc_v2")
            held += step
            next_step += STEP_EVERY
        for _ in range(4):
            check(lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None),
                  "cuLaunchKernel")
        check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
    free, _total = mem_info(lib)
    asked = free + PAST
    report(event="past_limit", held=held, free=free, asked=asked, rc=alloc(lib, asked))
    sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
