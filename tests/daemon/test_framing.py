"""How the daemon cuts a byte stream into frames: a real daemon process, real Unix sockets.

A session reads whatever the socket holds and serves every whole frame in it. These tests pin
that down: frames split anywhere, many frames in one write (more than one read's worth), and a
malformed frame after valid ones in the same buffer (the valid ones are answered first, then the
client alone is dropped with its reason and loses what it held, nobody else does).

Token frames are served as they are read while the session's task waits idle (TokenFastPath),
the rest by the task: the streams below mix the two, so a frame served by the wrong one, or
before what came ahead of it, shows as a reply out of order.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import (
    DaemonProcess,
    MiB,
    daemon_with_bystander,
    read_until_closed,
    split_frames,
    wait_for,
)
from vgpu_runtime.contracts import wire
from vgpu_runtime.daemon.channel.client import ChannelClient

C = wire.const
BYSTANDER_BYTES = 10 * MiB


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[DaemonProcess, Path, ChannelClient]]:
    with daemon_with_bystander(BYSTANDER_BYTES) as running:
        yield running


def _hello(seq: int = 1) -> bytes:
    return wire.encode(wire.new(C("GM_MSG_HELLO"), seq=seq, proto_version=wire.VERSION, pid=1))


def _memory(msg: str, seq: int, nbytes: int, kind: int = 1) -> bytes:
    return wire.encode(wire.new(C(msg), seq=seq, gpu=0, kind=kind, bytes=nbytes))


def _exchange(path: Path, *writes: bytes, pause: float = 0.0) -> list[Any]:
    """Send each write separately (pausing between them so the daemon reads them apart),
    half-close, and return every frame the daemon answers until it closes."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        for index, data in enumerate(writes):
            if index and pause:
                time.sleep(pause)
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return split_frames(read_until_closed(sock))


def _token(msg: str, seq: int, gpu: int = 0) -> bytes:
    fields = {"seq": seq, "gpu": gpu}
    if msg == "GM_MSG_TOKEN_REQUEST":
        fields.update(burst_ns=-1, work_end_ns=-1)
    else:
        fields.update(work_end_ns=-1)
    return wire.encode(wire.new(C(msg), **fields))


def _bystander_intact(daemon: DaemonProcess, bystander: ChannelClient) -> None:
    reply = bystander.reserve(0, 0)
    assert (reply.granted, reply.used) == (True, BYSTANDER_BYTES)
    assert daemon.proc.poll() is None


STREAM = _hello(1) + _memory("GM_MSG_MEM_RESERVE", 2, 3 * MiB) + _memory(
    "GM_MSG_MEM_RELEASE", 3, MiB)


def _assert_stream_answered(replies: list[Any]) -> None:
    assert [(wire.frame_type(r), r.h.seq) for r in replies] == [
        (C("GM_MSG_HELLO_REPLY"), 1), (C("GM_MSG_MEM_REPLY"), 2), (C("GM_MSG_MEM_REPLY"), 3)]
    assert replies[1].used == BYSTANDER_BYTES + 3 * MiB
    assert replies[2].used == BYSTANDER_BYTES + 2 * MiB


def test_a_stream_split_at_every_byte_boundary_is_served(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    daemon, path, bystander = served
    for cut in range(1, len(STREAM)):
        replies = _exchange(path, STREAM[:cut], STREAM[cut:], pause=0.005)
        _assert_stream_answered(replies)
    _bystander_intact(daemon, bystander)


def test_a_stream_sent_one_byte_at_a_time_is_served(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    daemon, path, bystander = served
    _assert_stream_answered(_exchange(path, *(bytes([b]) for b in STREAM), pause=0.001))
    _bystander_intact(daemon, bystander)


def test_several_frames_in_one_write_are_answered_in_order(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    daemon, path, bystander = served
    reserves = b"".join(_memory("GM_MSG_MEM_RESERVE", seq, MiB) for seq in range(2, 12))
    replies = _exchange(path, _hello(1) + reserves)
    assert [r.h.seq for r in replies] == list(range(1, 12))
    assert [r.used for r in replies[1:]] == [BYSTANDER_BYTES + n * MiB for n in range(1, 11)]
    _bystander_intact(daemon, bystander)   # the client's 10 MiB went with its connection


def test_more_frames_than_one_read_takes_are_all_answered(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    """~100 KiB of frames in one write: frames straddle the daemon's reads."""
    daemon, path, bystander = served
    count = 3000
    stream = _hello(1) + b"".join(
        _memory("GM_MSG_MEM_SET", seq, seq) for seq in range(2, count + 2))
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        def send() -> None:
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)

        # Send from a thread: the replies must be read while the requests go in.
        sender = threading.Thread(target=send)
        sender.start()
        replies = split_frames(read_until_closed(sock))
        sender.join()
    assert [r.h.seq for r in replies] == list(range(1, count + 2))
    assert [r.used for r in replies[1:]] == [BYSTANDER_BYTES + seq for seq in range(2, count + 2)]
    _bystander_intact(daemon, bystander)


TOKEN_FRAMES = [_hello(1), _token("GM_MSG_TOKEN_REQUEST", 2), _memory("GM_MSG_MEM_RESERVE", 3, MiB),
                _token("GM_MSG_TOKEN_RELEASE", 4), _token("GM_MSG_TOKEN_REQUEST", 5),
                _memory("GM_MSG_MEM_RELEASE", 6, MiB)]
TOKEN_STREAM = b"".join(TOKEN_FRAMES)


def _assert_token_stream_answered(replies: list[Any]) -> None:
    grant, mem_reply = C("GM_MSG_TOKEN_GRANT"), C("GM_MSG_MEM_REPLY")
    assert [(wire.frame_type(r), r.h.seq) for r in replies] == [
        (C("GM_MSG_HELLO_REPLY"), 1), (grant, 2), (mem_reply, 3), (grant, 5), (mem_reply, 6)]
    assert all(r.status == C("GM_OK") for r in replies)


def test_token_and_memory_frames_split_at_every_byte_boundary_are_served_in_order(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    daemon, path, bystander = served
    for cut in range(1, len(TOKEN_STREAM)):
        _assert_token_stream_answered(
            _exchange(path, TOKEN_STREAM[:cut], TOKEN_STREAM[cut:], pause=0.005))
    _bystander_intact(daemon, bystander)


def test_token_frames_sent_after_the_hello_reply_are_answered_in_order(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    # Each write reaches a session whose task waits idle: the token frames at its head are
    # served as they are read, the memory frame and what follows it by the task.
    daemon, path, bystander = served
    _assert_token_stream_answered(_exchange(path, *TOKEN_FRAMES, pause=0.02))
    _bystander_intact(daemon, bystander)


def test_token_frames_among_more_than_one_read_of_memory_frames_keep_their_order(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    """A client that writes faster than it reads: the task falls behind (its reads hold many
    frames, and it waits on its replies), and token frames must wait their turn behind it."""
    daemon, path, bystander = served
    stream, expected = [_hello(1)], [1]
    for seq in range(2, 4000, 4):
        stream += [_memory("GM_MSG_MEM_SET", seq, seq), _token("GM_MSG_TOKEN_REQUEST", seq + 1),
                   _token("GM_MSG_TOKEN_RELEASE", seq + 2), _memory("GM_MSG_MEM_SET", seq + 3, 1)]
        expected += [seq, seq + 1, seq + 3]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))

        def send() -> None:
            for start in range(0, len(stream), 7):   # many writes, each several frames
                sock.sendall(b"".join(stream[start:start + 7]))
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        replies = split_frames(read_until_closed(sock))
        sender.join()
    assert [r.h.seq for r in replies] == expected
    assert all(r.status == C("GM_OK") for r in replies)
    _bystander_intact(daemon, bystander)


def _header(length: int, msg_type: int, version: int = wire.VERSION, reserved: int = 0) -> bytes:
    values = {"length": length, "type": msg_type, "version": version, "seq": 9,
              "reserved": reserved}
    return wire.HEADER.pack(*(values[name] for name in wire.HEADER_FIELDS))


RESERVE_BODY = _memory("GM_MSG_MEM_RESERVE", 9, MiB)[wire.HEADER_SIZE:]
RESERVE_SIZE = len(RESERVE_BODY) + wire.HEADER_SIZE
DEFECTS = {
    "bad version": (_header(RESERVE_SIZE, C("GM_MSG_MEM_RESERVE"), version=7) + RESERVE_BODY,
                    C("GM_ERR_BAD_VERSION"), "protocol version 7"),
    "unknown type": (_header(RESERVE_SIZE, 99) + RESERVE_BODY,
                     C("GM_ERR_MALFORMED"), "unknown frame type 99"),
    "wrong length": (_header(RESERVE_SIZE + 8, C("GM_MSG_MEM_RESERVE")) + RESERVE_BODY,
                     C("GM_ERR_MALFORMED"), f"must be {RESERVE_SIZE} bytes"),
    "reserved set": (_header(RESERVE_SIZE, C("GM_MSG_MEM_RESERVE"), reserved=1) + RESERVE_BODY,
                     C("GM_ERR_MALFORMED"), "reserved header field"),
    "daemon-only type": (wire.encode(wire.new(C("GM_MSG_MEM_REPLY"), seq=9)),
                         C("GM_ERR_MALFORMED"), "daemon-to-hook only"),
    "truncated header": (_memory("GM_MSG_MEM_RESERVE", 9, MiB)[:5],
                         C("GM_ERR_MALFORMED"), "truncated header: 5 bytes then EOF"),
    "truncated body": (_memory("GM_MSG_MEM_RESERVE", 9, MiB)[:RESERVE_SIZE - 3],
                       C("GM_ERR_MALFORMED"),
                       f"truncated frame: {RESERVE_SIZE - 3 - wire.HEADER_SIZE} of "
                       f"{RESERVE_SIZE - wire.HEADER_SIZE} body bytes"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_malformed_frame_after_valid_ones_in_one_buffer(
        served: tuple[DaemonProcess, Path, ChannelClient], defect: str) -> None:
    """The valid frames before it are answered, then the error with its reason; nothing after
    it is served, and what the client held is released."""
    daemon, path, bystander = served
    bad, status, reason = DEFECTS[defect]
    valid = _hello(1) + _memory("GM_MSG_MEM_RESERVE", 2, MiB) + _memory(
        "GM_MSG_MEM_RESERVE", 3, MiB)
    after = _memory("GM_MSG_MEM_RESERVE", 4, MiB)
    replies = _exchange(path, valid + bad + (after if "truncated" not in defect else b""))
    assert [wire.frame_type(r) for r in replies] == [
        C("GM_MSG_HELLO_REPLY"), C("GM_MSG_MEM_REPLY"), C("GM_MSG_MEM_REPLY"), C("GM_MSG_ERROR")]
    assert replies[2].used == BYSTANDER_BYTES + 2 * MiB
    error = replies[-1]
    assert error.status == status and reason in wire.text_field(error.reason)
    _bystander_intact(daemon, bystander)
    assert reason.split(":")[0] in daemon.logs()


def test_a_client_gone_with_frames_unanswered_costs_one_failed_send(
        served: tuple[DaemonProcess, Path, ChannelClient]) -> None:
    """Frames buffered behind a client that closed: the session stops at the first reply it
    cannot send (no write after write into a dead socket), and the daemon goes on."""
    daemon, path, bystander = served
    stream = _hello(1) + b"".join(_memory("GM_MSG_MEM_SET", seq, seq) for seq in range(2, 400))
    for _ in range(5):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(path))
            sock.sendall(stream)
        # closed unread: the daemon's replies hit a dead socket
    # Those sessions end on their own time: wait until what they held is released.
    wait_for(lambda: bystander.reserve(0, 0).used == BYSTANDER_BYTES, what="sessions released")
    _bystander_intact(daemon, bystander)
    assert "socket.send() raised exception" not in daemon.logs()
