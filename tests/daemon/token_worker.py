"""A tenant that "works" only while it holds the GPU token, as a hooked application would.

python -m tests.daemon.token_worker SOCKET START_NS SECONDS
Starts at START_NS (CLOCK_MONOTONIC), asks for the token like the hook does when its page says
no, "launches" (writes its activity page, passed with the hello) every half millisecond while
the token is valid, and prints one JSON line: the seconds it held the token inside the common
window, and its grants.
"""

from __future__ import annotations

import json
import sys
import time

from vgpu_runtime.daemon.channel.client import ChannelClient

NS = 1_000_000_000


def main(argv: list[str]) -> int:
    socket_path, start_ns, seconds = argv[0], int(argv[1]), float(argv[2])
    end_ns = start_ns + int(seconds * NS)
    client = ChannelClient(socket_path, timeout=seconds + 5)
    client.hello()
    activity = client.activity_page(0)
    while time.monotonic_ns() < start_ns:
        time.sleep(0.0005)
    held_ns, grants, work_end = 0, 0, -1
    while time.monotonic_ns() < end_ns:
        grant = client.request_token(0, work_end_ns=work_end)
        grants += 1
        began = time.monotonic_ns()
        until = min(grant.valid_until_ns, end_ns)
        # Launch only while the token is valid; the last launch leaves room for the work.
        while time.monotonic_ns() < until - 500_000:
            activity.launched()
            time.sleep(0.0005)
        work_end = time.monotonic_ns()
        held_ns += max(0, min(work_end, end_ns) - began)
    print(json.dumps({"held": held_ns / NS, "grants": grants}), flush=True)
    activity.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
