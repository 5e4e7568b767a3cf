"""Token round trips through the node daemon, from inside a gemini-run allocation (no GPU work).

Usage: token_rtt.py COUNT HOLD_MS OUT
Speaks the hook's protocol on the allocation's channel (vgpu_runtime.daemon.channel.client): COUNT
times, ask for GPU 0's token, wait for the grant, hold it HOLD_MS (a sleep), give it back.
Writes the request->grant times and, for handoff analysis, every (release sent, grant received)
CLOCK_MONOTONIC pair. Alone on a GPU (with a share below 1, so tokens are needed), request->grant
is the daemon's pure round trip; with a peer doing the same, a grant right after the peer's
release is the handoff latency.
"""

import json
import os
import sys
import time

from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.channel.client import ChannelClient


def main() -> None:
    count, hold, out = int(sys.argv[1]), float(sys.argv[2]) / 1e3, sys.argv[3]
    sock = paths.channel_socket(os.environ[paths.ENV_CHANNEL_DIR])
    waits, grants, releases = [], [], []
    with ChannelClient(sock, timeout=30) as client:
        client.hello()
        for _ in range(count):
            asked = time.monotonic_ns()
            client.request_token(0)
            got = time.monotonic_ns()
            waits.append(got - asked)
            grants.append(got)
            if hold:
                time.sleep(hold)
            releases.append(time.monotonic_ns())
            client.release_token(0)
    with open(out, "w") as handle:
        json.dump({"waits_ns": waits, "grants_ns": grants, "releases_ns": releases}, handle)


if __name__ == "__main__":
    main()
