"""One tenant of scripts/bench-share's startup case: the start-up shape, as a real job.

Usage: startup_tenant.py SIZE SYNC_EVERY WARMUP_SIZE ALLOC START_AT DURATION OUT
  SIZE         matrix size of the loop (8192)
  SYNC_EVERY   matmuls between host synchronisations
  WARMUP_SIZE  the warm-up's one long matmul: WARMUP_SIZE^3 x 2 flops (49152: ~0.36 s on an
               H200, past a 0.2 s quota and its 50 ms grace)
  ALLOC        1: every matmul allocates its result (`a @ b`), as most training code does
  START_AT     wall-clock time (time.time()) of the common start
  DURATION     seconds counted
At once: the loop's tensors and a first allocating matmul (context, cuBLAS), then the long
warm-up matmul, a synchronisation, and nothing at all until START_AT (data loading, compiling,
waiting for peers). At START_AT every tenant records a timing event (stream work the hook does
not gate) and loops from that instant, with no ramp: the shape that once starved tenants for
seconds (BENCHMARKS.md). Unlike tenant.py it does not warm up together with the others first.
Writes {"matmuls": n, "seconds": s, "tflops": ...} to OUT.
"""

import json
import sys
import time

import torch


def main() -> None:
    size, sync_every, warmup_size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    alloc = sys.argv[4] == "1"
    start_at, duration, out = float(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    big = torch.ones(warmup_size, warmup_size, device="cuda", dtype=torch.bfloat16)
    torch.matmul(big, big)                    # the long first kernel
    torch.cuda.synchronize()
    del big
    torch.cuda.empty_cache()
    while time.time() < start_at:
        time.sleep(0.01)
    started = torch.cuda.Event(enable_timing=True)
    started.record()
    done, begin = 0, time.time()
    end = start_at + duration
    while True:
        for _ in range(sync_every):
            if alloc:
                c = a @ b
            else:
                torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        done += sync_every
        now = time.time()
        if now >= end:
            break
    seconds = now - begin
    with open(out, "w") as handle:
        json.dump({"matmuls": done, "seconds": seconds,
                   "tflops": 2 * size**3 * done / seconds / 1e12}, handle)


if __name__ == "__main__":
    main()
