"""The latency tenant of scripts/bench-share: small-batch inference, one request at a time.

Usage: infer.py START_AT DURATION OUT
Every request is a forward pass of a 4-layer MLP (4096 wide, batch 16, bf16) followed by a host
synchronisation, as a server answering one request does; 2 ms of think time separate requests.
Writes {"requests": n, "p50_ms", "p99_ms", "mean_ms"} for the requests that started inside the
common window [START_AT, START_AT + DURATION).
"""

import json
import statistics
import sys
import time

import torch

THINK_S = 0.002


def main() -> None:
    start_at, duration, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    layers = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
              for _ in range(4)]
    batch = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)

    def request() -> None:
        x = batch
        for w in layers:
            x = torch.relu(x @ w)
        torch.cuda.synchronize()

    request()
    while time.time() < start_at - 3.0:   # start loading together with the others
        time.sleep(0.005)
    while time.time() < start_at - 0.5:
        request()
    while time.time() < start_at:
        time.sleep(0.0005)
    end = start_at + duration
    latencies = []
    while time.time() < end:
        begin = time.perf_counter()
        request()
        latencies.append(time.perf_counter() - begin)
        time.sleep(THINK_S)
    latencies.sort()
    with open(out, "w") as handle:
        json.dump({"requests": len(latencies),
                   "p50_ms": 1e3 * statistics.median(latencies),
                   "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                   "mean_ms": 1e3 * statistics.fmean(latencies)}, handle)


if __name__ == "__main__":
    main()
