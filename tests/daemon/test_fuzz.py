"""Malformed frames, fuzzed: only the offending client is dropped; the daemon and others go on."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon.helpers import (
    DaemonProcess,
    MiB,
    daemon_with_bystander,
    read_until_closed,
    split_frames,
)
from tests.examples import examples
from vgpu_runtime.contracts import wire
from vgpu_runtime.daemon.channel.client import ChannelClient

C = wire.const
HEADER = struct.Struct("=IHHII")  # gm_header: length, type, version, seq, reserved
KNOWN_SIZES = sorted({wire.ffi.sizeof(s) for s in wire.STRUCT_OF_TYPE.values()})


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[DaemonProcess, Path, ChannelClient]]:
    with daemon_with_bystander(10 * MiB) as running:
        yield running


def _header(length: int, msg_type: int, version: int = wire.VERSION, reserved: int = 0) -> bytes:
    return HEADER.pack(length, msg_type, version, 7, reserved)


def _valid_frames() -> list[bytes]:
    hello = wire.encode(wire.new(C("GM_MSG_HELLO"), proto_version=wire.VERSION, pid=1))
    reserve = wire.encode(wire.new(C("GM_MSG_MEM_RESERVE"), gpu=0, kind=1, bytes=MiB))
    return [hello, reserve]


frames = st.one_of(
    st.binary(min_size=1, max_size=300),                                   # random bytes
    st.builds(lambda n, t, v, r: _header(n, t, v, r),                      # bad headers
              st.integers(0, 2**32 - 1), st.integers(0, 2**16 - 1),
              st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1)),
    st.builds(lambda t, n: _header(n, t) + b"\0" * 64,                     # bad lengths
              st.sampled_from(sorted(wire.STRUCT_OF_TYPE)),
              st.integers(0, wire.MAX_FRAME * 2).filter(lambda n: n not in KNOWN_SIZES)),
    st.builds(lambda v: _header(32, C("GM_MSG_HELLO"), v) + b"\0" * 16,     # bad versions
              st.integers(0, 2**16 - 1).filter(lambda v: v != wire.VERSION)),
    st.builds(lambda f, cut: f[:max(1, len(f) * cut // 100)],               # truncated frames
              st.sampled_from(_valid_frames()), st.integers(0, 99)),
    st.builds(lambda t: _header(wire.HEADER_SIZE, t),                      # daemon-only types
              st.sampled_from([C("GM_MSG_HELLO_REPLY"), C("GM_MSG_MEM_REPLY"),
                               C("GM_MSG_ERROR")])),
)


def _exchange(path: Path, data: bytes, hello_first: bool) -> list[Any]:
    """Send `data`, half-close, and collect what the daemon answers until it closes."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        if hello_first:
            sock.sendall(_valid_frames()[0])
            reply = sock.recv(wire.ffi.sizeof("struct gm_hello_reply"), socket.MSG_WAITALL)
            assert wire.frame_type(wire.decode(reply)) == C("GM_MSG_HELLO_REPLY")
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return split_frames(read_until_closed(sock))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=frames, hello_first=st.booleans())
def test_malformed_frame_drops_only_that_client(
        served: tuple[DaemonProcess, Path, ChannelClient], data: bytes, hello_first: bool) -> None:
    daemon, path, bystander = served
    replies = _exchange(path, data, hello_first)
    assert len(replies) <= 1
    if replies:
        (error,) = replies
        assert wire.frame_type(error) == C("GM_MSG_ERROR")
        assert error.status != C("GM_OK") and wire.text_field(error.reason)
    # The daemon carries on, and the other client keeps its connection and its memory.
    reply = bystander.reserve(0, 0)
    assert (reply.granted, reply.used) == (True, 10 * MiB)
    assert daemon.proc.poll() is None


def test_every_truncation_of_a_frame_is_answered_with_a_reason(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    daemon, path, _ = served
    frame = _valid_frames()[1]
    for cut in range(1, len(frame)):
        (error,) = _exchange(path, frame[:cut], hello_first=True)
        assert "truncated" in wire.text_field(error.reason)
    assert '"peer_pid"' in daemon.logs() and "truncated" in daemon.logs()
