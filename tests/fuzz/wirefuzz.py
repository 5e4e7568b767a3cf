"""Random hook sessions for fuzzing the daemon: well-formed frames with hostile field values,
mixed with broken framing. Shared by the fuzz tests and scripts that want a hostile client."""

from __future__ import annotations

import random
import socket
import struct
from pathlib import Path
from typing import Any

from vgpu_runtime.contracts import wire

C = wire.const
HEADER = struct.Struct("=IHHII")  # gm_header: length, type, version, seq, reserved
HOOK_TYPES = ("GM_MSG_HELLO", "GM_MSG_MEM_RESERVE", "GM_MSG_MEM_RELEASE", "GM_MSG_MEM_SET",
              "GM_MSG_TOKEN_REQUEST", "GM_MSG_TOKEN_RELEASE", "GM_MSG_USAGE_REPORT")
DAEMON_TYPES = {C(n) for n in ("GM_MSG_HELLO_REPLY", "GM_MSG_MEM_REPLY", "GM_MSG_TOKEN_GRANT",
                               "GM_MSG_ERROR")}
U32, U64, I64 = 2**32 - 1, 2**64 - 1, 2**63 - 1
INTERNAL_ERROR = "internal daemon error"


def _u32(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 3, 7, 8, 15, 16, 17, U32, rng.randrange(U32 + 1)])


def _u64(rng: random.Random) -> int:
    return rng.choice([0, 1, 1 << 20, 1 << 30, 100 << 20, U64, U64 - 1, 1 << 63,
                       rng.randrange(U64 + 1)])


def _time(rng: random.Random) -> int:
    return rng.choice([-1, -2, -(I64 + 1), 0, 1, I64, rng.randrange(-(I64 + 1), I64)])


def hostile_frame(rng: random.Random) -> bytes:
    """One well-framed hook frame whose fields are anything the types allow."""
    msg = C(rng.choice(HOOK_TYPES))
    fields: dict[str, Any]
    if msg == C("GM_MSG_HELLO"):
        fields = {"proto_version": rng.choice([wire.VERSION, wire.VERSION, 0, 2, U32]),
                  "pid": _u32(rng), "flags": _u64(rng)}
    elif msg in (C("GM_MSG_MEM_RESERVE"), C("GM_MSG_MEM_RELEASE"), C("GM_MSG_MEM_SET")):
        nbytes = _u64(rng)
        fields = {"gpu": rng.choice([0, 1, 1, 2, _u32(rng)]),
                  "kind": rng.choice([1, 2, 5, 7, 0, 8, _u32(rng)]), "bytes": nbytes}
    elif msg == C("GM_MSG_TOKEN_REQUEST"):
        fields = {"gpu": rng.choice([0, 1, 2, _u32(rng)]), "flags": rng.choice([0, 0, _u32(rng)]),
                  "burst_ns": _time(rng), "work_end_ns": _time(rng)}
    elif msg == C("GM_MSG_TOKEN_RELEASE"):
        fields = {"gpu": rng.choice([0, 1, 2, _u32(rng)]),
                  "reserved": rng.choice([0, 0, _u32(rng)]), "work_end_ns": _time(rng)}
    else:
        fields = {"gpu": rng.choice([0, 1, 2, _u32(rng)]),
                  "bursts": rng.choice([0, 1, _u32(rng)]),
                  "burst_start_ns": _time(rng), "burst_end_ns": _time(rng)}
    return wire.encode(wire.new(msg, seq=_u32(rng), **fields))


def broken_frame(rng: random.Random) -> bytes:
    """Bytes that break the framing: garbage, bad headers, truncation."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:
        return HEADER.pack(_u32(rng), rng.randrange(2**16), rng.randrange(2**16), _u32(rng),
                           _u32(rng)) + rng.randbytes(rng.randrange(64))
    if kind == 2:
        frame = hostile_frame(rng)
        return frame[:rng.randrange(1, len(frame))]
    return HEADER.pack(wire.HEADER_SIZE, rng.choice(sorted(DAEMON_TYPES)), wire.VERSION, 1, 0)


def random_session(rng: random.Random, hello_first: bool = True) -> list[bytes]:
    """What one hostile process sends: usually a valid hello, then frames, maybe garbage."""
    frames = []
    if hello_first:
        frames.append(wire.encode(wire.new(C("GM_MSG_HELLO"), seq=1, proto_version=wire.VERSION,
                                           pid=4242)))
    for _ in range(rng.randrange(1, 12)):
        frames.append(broken_frame(rng) if rng.random() < 0.08 else hostile_frame(rng))
    return frames


def play(path: Path, frames: list[bytes], timeout: float = 5.0) -> tuple[list[Any], bytes]:
    """Send the frames, half-close, read until the daemon closes. Returns the decoded replies
    and any trailing bytes that did not form a whole frame (must be none)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        try:
            sock.sendall(b"".join(frames))
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon already dropped us; read what it said
        received = b""
        try:
            while chunk := sock.recv(65536):   # a timeout raises: the daemon must not hang
                received += chunk
        except ConnectionResetError:
            pass
    replies = []
    while len(received) >= wire.HEADER_SIZE:
        header = wire.parse_header(received, wire.SUPPORTED_VERSIONS)
        if len(received) < header.length:
            break
        replies.append(wire.decode(received[:header.length], wire.SUPPORTED_VERSIONS))
        received = received[header.length:]
    return replies, received
