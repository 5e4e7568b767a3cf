"""Whether the process that made something is still the one alive under its pid.

A pid alone is not an identity: after its process ends the kernel hands it to a new one. A
process is taken to be the same only where it started no later than the thing it made (a
record's created_at). gemini-run judges its own records by this, and the host daemon the
allocations of the users it serves (both run in the host's pid namespace).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# Start times are in clock ticks since boot: a second of rounding is allowed.
START_SLACK = 1.0


def _boot_time() -> float | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/stat") as handle:
        for line in handle:
            if line.startswith("btime "):
                return float(line.split()[1])
    return None


def process_start_time(pid: int) -> float | None:
    """When `pid` started (seconds since the epoch), or None when it cannot be told."""
    boot = _boot_time()
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if boot is None or len(fields) < 20:
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def alive_since(pid: int, created_at: float) -> bool:
    """True while `pid` is the process that was alive at `created_at` (or cannot be told
    otherwise: another user's process we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    started = process_start_time(pid)
    return started is None or started <= created_at + START_SLACK
