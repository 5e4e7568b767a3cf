"""Starts N copies of a program at once; prints seconds until the last one was ready.

Each child prints the CLOCK_MONOTONIC nanosecond at which it was ready (scripts/cuda/ctx_start.c).
"""

import subprocess
import sys
import time


def main() -> None:
    program, count = sys.argv[1], int(sys.argv[2])
    start = time.monotonic_ns()
    children = [subprocess.Popen([program], stdout=subprocess.PIPE, text=True)
                for _ in range(count)]
    ready = []
    for child in children:
        out, _ = child.communicate()
        if child.returncode != 0:
            sys.exit(f"a child failed with status {child.returncode}")
        ready.append(int(out.strip()))
    print(f"{(max(ready) - start) / 1e9:.3f}")


if __name__ == "__main__":
    main()
