"""The hook<->daemon protocol fuzzed against the real daemon process.

Each example is one hostile process on allocation A's channel: a hello, then well-framed frames
with any field values (GPU indexes outside the allocation, unknown kinds, 2^64-1 byte counts,
negative times, token frames for GPUs it lacks) and sometimes broken framing. The daemon must
answer only with daemon-to-hook frames, end with at most one ERROR, give back everything the
process held when it goes, and never touch allocation B, whose process keeps its connection.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon.helpers import (
    UUID_A,
    UUID_B,
    DaemonProcess,
    MiB,
    make_record,
    wait_for,
    wait_served,
)
from tests.examples import examples
from tests.fuzz.wirefuzz import DAEMON_TYPES, INTERNAL_ERROR, play, random_session
from vgpu_runtime.contracts import wire
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.channel.client import ChannelClient

C = wire.const
UUID_C = "GPU-cccccccc-2222-3333-4444-555555555555"
# The stated bound: while a flood of hostile clients runs, another allocation's requests keep a
# p99 round trip under this (quiet p99 on the shared 2-core machine: ~2 ms), and none fail.
BYSTANDER_P99_BOUND_S = 0.050


@dataclass
class Node:
    daemon: DaemonProcess
    hostile: AllocationRecord
    bystander: AllocationRecord
    client: ChannelClient
    sessions: list[int] = field(default_factory=lambda: [0])


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="gz-"))
    state_dir = root / "s"
    state_dir.mkdir()
    # A hostile session per case, hundreds a second on one allocation: no connect rate here
    # (it has its own test, tests/security/test_reconnects.py).
    daemon = DaemonProcess(state_dir, "--connect-rate", "0").wait_ready()
    hostile = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5), (UUID_C, 50 * MiB, 0.3)))
    bystander = make_record(state_dir, gpus=((UUID_B, 100 * MiB, 0.5),))
    wait_served(hostile)
    client = ChannelClient(wait_served(bystander))
    client.hello()
    client.reserve(0, 10 * MiB)
    yield Node(daemon, hostile, bystander, client)
    client.close()
    assert daemon.stop() == 0, daemon.logs()
    # Exactly the known bug's one internal error (test below), nothing else.
    assert daemon.logs().count("internal error") <= 1, daemon.logs()
    shutil.rmtree(root, ignore_errors=True)


def _memory_used(node: Node, record: AllocationRecord) -> list[int]:
    entry = node.daemon.allocation(record.id)
    return [g["memory_used"] for g in entry["gpus"]]


def _check_answers(replies: list[object], trailing: bytes) -> None:
    assert trailing == b"", "the daemon sent a partial frame"
    types = [wire.frame_type(r) for r in replies]
    assert set(types) <= DAEMON_TYPES
    errors = [i for i, t in enumerate(types) if t == C("GM_MSG_ERROR")]
    assert errors in ([], [len(types) - 1]), f"ERROR must be the last frame: {types}"
    if errors:
        reason = wire.text_field(replies[-1].reason)  # type: ignore[attr-defined]
        assert reason and reason != INTERNAL_ERROR, "the daemon hit a bug, not a protocol error"


@settings(max_examples=examples(300), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False), hello_first=st.booleans())
def test_hostile_session_drops_only_itself_and_leaks_nothing(
        node: Node, rng: random.Random, hello_first: bool) -> None:
    frames = random_session(rng, hello_first or rng.random() < 0.9)
    replies, trailing = play(wait_served(node.hostile), frames)
    node.sessions[0] += 1
    _check_answers(replies, trailing)
    for reply in replies:
        if wire.frame_type(reply) == C("GM_MSG_MEM_REPLY") and reply.status == C("GM_OK"):
            assert reply.used <= reply.limit
    # Gone: whatever it reserved is given back; the other allocation is untouched.
    wait_for(lambda: _memory_used(node, node.hostile) == [0, 0], 5, "hostile memory released")
    assert node.client.reserve(0, 0).used == 10 * MiB
    assert node.daemon.proc.poll() is None


def test_bystander_latency_stays_bounded_during_a_flood(node: Node) -> None:
    client = node.client

    def round_trips(n: int, until: Callable[[], bool] = lambda: True,
                    deadline_s: float = 60.0) -> list[float]:
        """At least n round trips, and on until `until()` holds (the deadline bounds it)."""
        out: list[float] = []
        deadline = time.monotonic() + deadline_s
        while len(out) < n or (not until() and time.monotonic() < deadline):
            start = time.perf_counter()
            reply = client.reserve(0, 0)
            out.append(time.perf_counter() - start)
            assert reply.granted and reply.used == 10 * MiB
            time.sleep(0.001)
        return out

    quiet = round_trips(300)
    stop = threading.Event()
    flooded = [0]

    def flood(seed: int) -> None:
        rng = random.Random(seed)
        path = wait_served(node.hostile)
        while not stop.is_set():
            _check_answers(*play(path, random_session(rng)))
            flooded[0] += 1

    threads = [threading.Thread(target=flood, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    try:
        # Measured during the flood, however slowly a loaded box plays its sessions.
        loud = round_trips(1000, until=lambda: flooded[0] >= 50)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    node.sessions[0] += flooded[0]
    p99_quiet = statistics.quantiles(quiet, n=100)[98]
    p99_loud = statistics.quantiles(loud, n=100)[98]
    print(f"bystander p99 quiet {p99_quiet * 1e3:.2f} ms, during {flooded[0]} hostile sessions "
          f"{p99_loud * 1e3:.2f} ms (max {max(loud) * 1e3:.2f} ms); "
          f"total hostile sessions {node.sessions[0]}")
    assert flooded[0] >= 50, "the flood did not run"
    assert p99_loud < BYSTANDER_P99_BOUND_S


def test_mem_set_past_uint64_is_a_protocol_error_not_an_internal_one(node: Node) -> None:
    huge = 2**64 - 1
    frames = [wire.encode(wire.new(C("GM_MSG_HELLO"), seq=1, proto_version=wire.VERSION, pid=1)),
              wire.encode(wire.new(C("GM_MSG_MEM_SET"), seq=2, gpu=0, kind=1, bytes=huge)),
              wire.encode(wire.new(C("GM_MSG_MEM_SET"), seq=3, gpu=0, kind=2, bytes=huge))]
    replies, trailing = play(wait_served(node.hostile), frames)
    wait_for(lambda: _memory_used(node, node.hostile) == [0, 0], 5, "hostile memory released")
    _check_answers(replies, trailing)
