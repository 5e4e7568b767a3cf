"""How fine and how late NVML's device utilisation samples are: the signal a busy fraction per
tenant could be regressed from (BENCHMARKS.md, "Real jobs").

Usage: nvml_samples.py OUT [ON_MS OFF_MS SECONDS]
Runs a square wave on GPU 0: bf16 matmuls for ON_MS (synchronised), idle for OFF_MS, for
SECONDS, logging each on-phase's wall-clock start and end. Meanwhile reads
nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) and nvmlDeviceGetProcessUtilization. Writes
{"phases": [[start, end], ...], "device": [[timestamp_s, util %], ...], "process": [[pid,
timestamp_s, sm %], ...]} to OUT: the timestamps against the phases give the sample period and
its lag.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pynvml
import torch


def sample(stop: threading.Event, device: list[list[float]], process: list[list[float]]) -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    last_device = last_process = 0
    while not stop.is_set():
        try:
            _, samples = pynvml.nvmlDeviceGetSamples(
                handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last_device)
            for s in samples:
                if s.timeStamp > last_device:
                    device.append([s.timeStamp / 1e6, float(s.sampleValue.uiVal)])
            last_device = max([last_device] + [s.timeStamp for s in samples])
        except pynvml.NVMLError:
            pass
        try:
            for s in pynvml.nvmlDeviceGetProcessUtilization(handle, last_process):
                if s.timeStamp > last_process:
                    process.append([int(s.pid), s.timeStamp / 1e6, float(s.smUtil)])
                    last_process = max(last_process, s.timeStamp)
        except pynvml.NVMLError:
            pass
        time.sleep(0.05)


def main() -> None:
    out = sys.argv[1]
    on, off, seconds = (float(a) for a in sys.argv[2:5]) if len(sys.argv) > 4 else (100, 300, 6)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ b).sum().item()
    stop = threading.Event()
    device: list[list[float]] = []
    process: list[list[float]] = []
    thread = threading.Thread(target=sample, args=(stop, device, process), daemon=True)
    thread.start()
    time.sleep(1.0)
    phases = []
    end = time.time() + seconds
    while time.time() < end:
        start = time.time()
        while time.time() - start < on / 1e3:
            a @ b
            torch.cuda.synchronize()
        phases.append([start, time.time()])
        time.sleep(off / 1e3)
    time.sleep(1.5)
    stop.set()
    thread.join()
    with open(out, "w") as handle:
        json.dump({"phases": phases, "device": device, "process": process}, handle)


if __name__ == "__main__":
    main()
