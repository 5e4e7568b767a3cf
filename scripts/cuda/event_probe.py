"""Whether a hook could learn its process's own busy fraction from sampled CUDA events, and
what contention does to the figure (BENCHMARKS.md, "Real jobs": NVML's per-process figure is
not a process's own).

Usage: event_probe.py OUT [SECONDS]
A launch-bound loop (1024 bf16 matmuls, 0.2 ms of host work between them) times every 8th
matmul with a pair of events, as a hook sampling its launches would, and estimates its busy
fraction as (mean sampled kernel time x launches) / wall time. It runs alone, then beside a
second process looping on 8192 matmuls (time-slicing). Writes {"alone": {...}, "contended":
{...}} with the estimate, the launches per second and the sampled kernel times' median to OUT.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

NEIGHBOUR = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + float(__import__("sys").argv[1])
while time.time() < end:
    for _ in range(4):
        a @ a
    torch.cuda.synchronize()
"""


def launch_bound(seconds: float) -> dict[str, float]:
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    launches = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        if launches % 8 == 0:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            x @ x
            end.record()
            pairs.append((begin, end))
        else:
            x @ x
        launches += 1
        spin = time.perf_counter()
        while time.perf_counter() - spin < 0.0002:   # the host's own work between kernels
            pass
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    times = [b.elapsed_time(e) / 1e3 for b, e in pairs]
    return {"busy_estimate": statistics.fmean(times) * launches / wall,
            "launches_per_s": launches / wall, "kernel_median_us": statistics.median(times) * 1e6}


def main() -> None:
    out, seconds = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    launch_bound(1.0)   # warm-up: cuBLAS, clocks
    result = {"alone": launch_bound(seconds)}
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(seconds + 8)])
    time.sleep(6)   # its start-up
    result["contended"] = launch_bound(seconds)
    neighbour.wait()
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
