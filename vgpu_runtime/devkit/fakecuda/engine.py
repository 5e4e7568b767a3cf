"""The fake driver's shared engine (FAKE_CUDA_ENGINE, fake_cuda.c) read as NVML would: the
device's utilisation in 200 ms periods, each the part of the period some work ran.

`EngineSampler` writes those samples, as they come, into the JSON file the node daemon reads
with `gpu_busy=simulated` ({GPU UUID: [[end, busy], ...]}), so co-scheduling is tested with
contention and the daemon's own figures on a machine without a GPU.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import time
from pathlib import Path

MAGIC = 0x454E474E            # fake_cuda.c: FAKE_ENGINE_MAGIC
HEADER = struct.Struct("=IIqQ")   # magic, ring_size, busy_until, appended
PERIOD_NS = 200_000_000       # NVML's sample period on the H200
KEPT_ROWS = 50


def busy_between(path: Path, start_ns: int, end_ns: int) -> float:
    """The part of [start_ns, end_ns) in which the engine ran work (pieces never overlap: the
    engine runs one at a time). 0 where the file is missing or not an engine's."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0,
                                                  access=mmap.ACCESS_READ) as view:
            magic, ring_size, _busy_until, appended = HEADER.unpack_from(view, 0)
            if magic != MAGIC:
                return 0.0
            pieces = struct.unpack_from(f"={2 * ring_size}q", view, HEADER.size)
    except (OSError, ValueError, struct.error):
        return 0.0
    count = min(appended, ring_size)
    ran = 0
    for i in range(count):
        lo, hi = pieces[2 * i], pieces[2 * i + 1]
        ran += max(0, min(hi, end_ns) - max(lo, start_ns))
    return ran / (end_ns - start_ns)


class EngineSampler(threading.Thread):
    """Every 200 ms, the engine's last complete period as an NVML sample of GPU `uuid`,
    written (atomically) into `out` for the daemon's simulated source."""

    def __init__(self, engine: Path, uuid: str, out: Path) -> None:
        super().__init__(daemon=True, name="fake-engine-sampler")
        self.engine, self.uuid, self.out = engine, uuid, out
        self.rows: list[list[float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        end = time.monotonic_ns() // PERIOD_NS * PERIOD_NS
        while not self._halt.is_set():
            end += PERIOD_NS
            wait = (end - time.monotonic_ns()) / 1e9
            if wait > 0 and self._halt.wait(wait):
                return
            busy = min(1.0, busy_between(self.engine, end - PERIOD_NS, end))
            self.rows = [*self.rows, [end / 1e9, busy]][-KEPT_ROWS:]
            temporary = self.out.with_suffix(".tmp")
            temporary.write_text(json.dumps({self.uuid: self.rows}))
            os.replace(temporary, self.out)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
