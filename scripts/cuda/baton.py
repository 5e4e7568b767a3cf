"""One of two tenants of scripts/bench-share's `floor` case: the sync-each load, handing the GPU
to the other tenant through a pipe every QUOTA seconds, with no hook and no daemon.

Usage: baton.py SIZE QUOTA START_AT DURATION OUT IN_FIFO OUT_FIFO FIRST WAIT
  SIZE      matrix size (the sync load: 2048, a synchronisation after every matmul)
  QUOTA     seconds a tenant keeps the baton before passing it on
  START_AT  wall-clock time (time.time()) at which both start counting
  DURATION  seconds counted
  IN_FIFO   the FIFO this tenant receives the baton on; OUT_FIFO the other's
  FIRST     1 for the tenant that holds the baton first
  WAIT      block (a blocking read, as the hook waits for its grant) or spin (polls the
            FIFO, awake when the baton comes)
A handoff here costs what two processes alternating on one GPU cannot avoid: the holder's
last synchronisation, a pipe write, the waiter's wake-up and the GPU's switch between the two
contexts. The slope of aggregate against handoffs per second is the floor under the daemon's.
Writes {"matmuls": n, "seconds": s, "tflops": ..., "handoffs": batons received in the window}
to OUT.
"""

import json
import os
import select
import sys
import time

import torch
from tenant import idle_until_ramp, ready_operands  # this directory: the same load's set-up

GIVE_UP = 5.0   # seconds past the window after which a waiter stops waiting for the other


def main() -> None:
    size, quota = int(sys.argv[1]), float(sys.argv[2])
    start_at, duration, out = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    in_fifo, out_fifo, first, spin = sys.argv[6], sys.argv[7], sys.argv[8] == "1", \
        sys.argv[9] == "spin"
    # Read ends are opened read-write, so neither open waits for the other tenant.
    inbox = os.open(in_fifo, os.O_RDWR | (os.O_NONBLOCK if spin else 0))
    outbox = os.open(out_fifo, os.O_RDWR)
    a, b, c = ready_operands(size)
    idle_until_ramp(start_at)
    end = start_at + duration
    done = handoffs = 0   # matmuls finished and batons received inside the window
    holding = first
    while True:
        if not holding:
            if not wait_for_baton(inbox, spin, end + GIVE_UP):
                break
            if start_at <= time.time() < end:
                handoffs += 1
        held_at = time.perf_counter()
        while time.perf_counter() - held_at < quota:
            torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
            if start_at <= time.time() < end:
                done += 1
        os.write(outbox, b"x")
        holding = False
        if time.time() >= end:
            break
    with open(out, "w") as handle:
        json.dump({"matmuls": done, "seconds": duration,
                   "tflops": 2 * size**3 * done / duration / 1e12, "handoffs": handoffs}, handle)


def wait_for_baton(inbox: int, spin: bool, give_up_at: float) -> bool:
    while time.time() < give_up_at:
        if spin:
            try:
                if os.read(inbox, 1):
                    return True
            except BlockingIOError:
                continue
        elif select.select([inbox], [], [], 0.5)[0]:
            return bool(os.read(inbox, 1))
    return False


if __name__ == "__main__":
    main()
