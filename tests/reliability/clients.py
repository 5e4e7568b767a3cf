"""Containers for the fault scenarios: hooked Python programs over the fake libcuda that hold
memory, launch kernels (so they contend for the token) and say what they saw."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from tests.hook.conftest import PRELUDE, Hooked
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.gpus.simulated import simulated_uuid

GiB = 1 << 30
MiB = 1 << 20

# Steps, each on a newline from stdin: "alloc <bytes>", "launch <seconds> [nosync]", "stats",
# "quit". Every step answers one JSON line. Launches synchronise after each kernel, so a
# contended token is asked for again and again (the token path through the daemon is
# exercised); with "nosync" work stays in flight, so the holder is never idle and keeps the
# token for its whole quota.
CONTAINER = """
    import sys, time
    lib = cuda()
    context(lib)
    held = []
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op, _, arg = line.strip().partition(" ")
        if op == "alloc":
            rc, ptr = alloc(lib, int(arg))
            if rc == 0:
                held.append(ptr)
            out = {"rc": rc}
        elif op == "launch":
            seconds, _, mode = arg.partition(" ")
            returns, end = [], time.monotonic() + float(seconds)
            while time.monotonic() < end:
                lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(0x77), None, None)
                if mode != "nosync":
                    lib.cuStreamSynchronize(ctypes.c_void_p(0x77))
                returns.append(time.monotonic_ns())
            out = {"returns": returns}
        elif op == "quit":
            break
        else:
            out = {}
        out["stats"] = stats()
        print(json.dumps(out), flush=True)
"""


def channel_env(record: AllocationRecord, **extra: str) -> dict[str, str]:
    """What Allocate gives a container, pointed at the fake driver's single GPU."""
    (gpu,) = record.gpus
    assert gpu.uuid == simulated_uuid(0), "the fake driver plays the plugin's first GPU"
    return {"GEMINI_CHANNEL_DIR": record.channel_dir, "FAKE_CUDA_UUIDS": gpu.uuid,
            "FAKE_CUDA_TOTAL_MEM": str(24 * GiB), "GEMINI_HOOK_DAEMON_WAIT": "10", **extra}


class Container:
    """One hooked process of one allocation, driven step by step."""

    def __init__(self, hooked: Hooked, record: AllocationRecord, **extra: str) -> None:
        self.record = record
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(CONTAINER)],
            env=hooked.env(channel_env(record, **extra)), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.read().get("ready"), "container did not start"

    def send(self, step: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(step + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"container exited ({self.proc.poll()}):\n{err}")
        result: dict[str, Any] = json.loads(line)
        return result

    def step(self, step: str) -> dict[str, Any]:
        self.send(step)
        return self.read()

    def alloc(self, size: int) -> int:
        return int(self.step(f"alloc {size}")["rc"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
