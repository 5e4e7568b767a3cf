"""The memory tenant of scripts/soak-gpu: allocates and frees GPU memory at random and writes
down exactly how many bytes it holds live.

Usage: soak_memory.py --backend torch|driver --dir DIR --max-bytes N
                      [--seed S] [--pause S] [--max-seconds S]

A handshake through files in DIR lets the caller read the daemon's view at the right moments:
  1. once its context exists, before any allocation: writes DIR/context.json, waits for DIR/go;
  2. then allocates (sizes log-uniform from 1 MiB to N/8, plus an odd number of bytes, so the
     accounting is checked to the byte) and frees at random, never holding more than N, and
     appends "<time.time()> <operations> <live bytes>" to DIR/progress four times a second;
  3. when DIR/stop exists (and, if nothing is live then, after one more allocation, so the check
     always has bytes to compare): writes DIR/final.json {"live_bytes", "live_allocations",
     "operations", "refused", "peak_bytes", "allocator_cached_bytes"} while still holding
     everything, waits for DIR/release, frees everything and exits 0.
An allocation refused for memory is counted in "refused" (the tenant stays under its limit by
construction, so the soak treats any refusal as an accounting fault); any other error ends it
with a traceback and a non-zero status.

Backends:
  torch   PYTORCH_NO_CUDA_MEMORY_CACHING=1 (set here before torch loads) and uint8 tensors:
          every tensor is one cudaMalloc of exactly its size, every del one cudaFree.
  driver  ctypes on libcuda.so.1: cuMemAlloc_v2 / cuMemFree_v2 in the primary context (the
          tests' fake libcuda, or a real driver).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
REPORT_EVERY = 0.25
CUDA_ERROR_OUT_OF_MEMORY = 2


class OutOfMemory(Exception):
    """The allocation was refused for memory (by the interposer's limit or the GPU)."""


class TorchMemory:
    def __init__(self) -> None:
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        import torch  # type: ignore[import-not-found, unused-ignore]

        self.torch = torch
        torch.cuda.init()
        torch.cuda.synchronize()      # creates the primary context now, before any allocation

    def alloc(self, size: int) -> Any:
        try:
            return self.torch.empty(size, dtype=self.torch.uint8, device="cuda")
        except self.torch.cuda.OutOfMemoryError as err:
            raise OutOfMemory(str(err)) from None

    def free(self, handle: Any) -> None:
        pass   # the caller drops the last reference next; the uncached allocator frees then

    def cached(self) -> int:
        """What PyTorch's allocator keeps reserved: 0 when caching is really off."""
        return int(self.torch.cuda.memory_reserved())


class DriverMemory:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        check(self.lib.cuInit(0), "cuInit")
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        check(self.lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
              "cuDevicePrimaryCtxRetain")
        check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def alloc(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        rc = self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemory(f"cuMemAlloc_v2({size}) out of memory")
        check(rc, "cuMemAlloc_v2")
        return ptr.value

    def free(self, handle: int) -> None:
        check(self.lib.cuMemFree_v2(ctypes.c_uint64(handle)), "cuMemFree_v2")

    def cached(self) -> int:
        return 0


def check(rc: int, call: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{call} failed with CUresult {rc}")


def write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)     # the caller never reads half a file


def wait_for_file(path: Path, give_up: float) -> None:
    while not path.exists():
        if time.monotonic() > give_up:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def random_size(rng: random.Random, max_bytes: int) -> int:
    top = max(2 * MiB, max_bytes // 8)
    return int(math.exp(rng.uniform(math.log(MiB), math.log(top)))) + rng.randrange(1, 4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "driver"), required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--max-bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument("--pause", type=float, default=0.01,
                        help="longest random pause between operations, seconds")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    args = parser.parse_args()
    give_up = time.monotonic() + args.max_seconds
    memory: TorchMemory | DriverMemory = (
        TorchMemory() if args.backend == "torch" else DriverMemory())
    write_json(args.dir / "context.json", {"pid": os.getpid(), "time": time.time()})
    wait_for_file(args.dir / "go", give_up)

    rng = random.Random(args.seed)
    live: list[tuple[Any, int]] = []
    live_bytes = peak = operations = refused = 0
    next_report = 0.0
    with open(args.dir / "progress", "a", buffering=1) as progress:
        while not (args.dir / "stop").exists() and time.monotonic() < give_up:
            size = random_size(rng, args.max_bytes)
            if live and (rng.random() < 0.5 or live_bytes + size > args.max_bytes):
                handle, freed = live.pop(rng.randrange(len(live)))
                memory.free(handle)
                del handle
                live_bytes -= freed
            else:
                try:
                    live.append((memory.alloc(size), size))
                    live_bytes += size
                except OutOfMemory:
                    refused += 1
            operations += 1
            peak = max(peak, live_bytes)
            now = time.monotonic()
            if now >= next_report:
                progress.write(f"{time.time():.4f} {operations} {live_bytes}\n")
                next_report = now + REPORT_EVERY
            time.sleep(rng.uniform(0, args.pause))
    if not live:   # the walk may stop at nothing held: hold one odd size, so bytes are compared
        size = random_size(rng, args.max_bytes)
        live.append((memory.alloc(size), size))
        live_bytes += size
        operations += 1
        peak = max(peak, live_bytes)
    write_json(args.dir / "final.json", {
        "live_bytes": live_bytes, "live_allocations": len(live), "operations": operations,
        "refused": refused, "peak_bytes": peak, "allocator_cached_bytes": memory.cached()})
    wait_for_file(args.dir / "release", give_up + 60)
    while live:
        handle, _ = live.pop()
        memory.free(handle)
        del handle


if __name__ == "__main__":
    main()
