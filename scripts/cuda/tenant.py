"""One tenant of scripts/bench-share: a saturating bf16 matmul loop measured in a common window.

Usage: tenant.py SIZE SYNC_EVERY START_AT DURATION OUT [ON_OFF]
  SIZE        matrix size (8192 or 2048)
  SYNC_EVERY  matmuls between host synchronisations (1 = sync after every step)
  START_AT    wall-clock time (time.time()) at which every tenant starts counting
  DURATION    seconds counted
  ON_OFF      phases: in the window, load for ON_OFF seconds, idle as long, and again (0: always on)
After its first matmul (context, cuBLAS) a tenant idles until RAMP seconds before START_AT, so
every tenant of a case starts loading the GPU at the same instant: none runs alone first and
then owes the others for it while the window is open.
Writes {"matmuls": n, "seconds": s, "tflops": ..., "step_p50_s": median step, "ends": each step's
end in seconds from START_AT} to OUT (the ends let bench-share's phases case rate each phase).
"""

import json
import statistics
import sys
import time

import torch

RAMP = 3.0   # seconds of common load before the window opens


def ready_operands(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a, b and the output of the load's bf16 matmul, after a first one (context, cuBLAS)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    return a, b, c


def idle_until_ramp(start_at: float) -> None:
    """Idle until RAMP seconds before the common window opens at start_at."""
    while time.time() < start_at - RAMP:
        time.sleep(0.005)


def main() -> None:
    size, sync_every = int(sys.argv[1]), int(sys.argv[2])
    start_at, duration, out = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    on_off = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    a, b, c = ready_operands(size)
    idle_until_ramp(start_at)
    while time.time() < start_at - 0.5:      # warm up until just before the common window
        for _ in range(sync_every):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.0005)
    done, begin = 0, time.time()
    end = start_at + duration
    steps, ends = [], []
    while True:
        phase = int((time.time() - start_at) / on_off) if on_off else 0
        if phase % 2:   # an off phase: idle through it
            off_ends = start_at + (phase + 1) * on_off
            time.sleep(max(0.0, min(off_ends, end) - time.time()))
            if time.time() >= end:
                now = time.time()
                break
        step = time.perf_counter()
        for _ in range(sync_every):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - step)
        done += sync_every
        now = time.time()
        ends.append(round(now - start_at, 5))
        if now >= end:
            break
    seconds = now - begin
    # The median step: one that waited for no token, so alone against shared says whether a
    # matmul itself ran faster (a GPU at 30 % duty boosts higher than one at its power limit).
    with open(out, "w") as handle:
        json.dump({"matmuls": done, "seconds": seconds,
                   "tflops": 2 * size**3 * done / seconds / 1e12,
                   "step_p50_s": statistics.median(steps), "ends": ends}, handle)


if __name__ == "__main__":
    main()
