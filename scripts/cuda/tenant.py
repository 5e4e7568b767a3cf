"""One tenant of scripts/bench-share: a saturating bf16 matmul loop measured in a common window.

Usage: tenant.py SIZE SYNC_EVERY START_AT DURATION OUT
  SIZE        matrix size (8192 or 2048)
  SYNC_EVERY  matmuls between host synchronisations (1 = sync after every step)
  START_AT    wall-clock time (time.time()) at which every tenant starts counting
  DURATION    seconds counted
Writes {"matmuls": n, "seconds": s, "tflops": ...} to OUT.
"""

import json
import sys
import time

import torch


def main() -> None:
    size, sync_every = int(sys.argv[1]), int(sys.argv[2])
    start_at, duration, out = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    while time.time() < start_at - 0.5:      # warm up until just before the common window
        for _ in range(sync_every):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.0005)
    done, begin = 0, time.time()
    end = start_at + duration
    while True:
        for _ in range(sync_every):
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
