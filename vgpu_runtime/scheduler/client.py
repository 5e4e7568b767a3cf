"""A small blocking client of the daemon, for tests, tools and gemini-run.

`ChannelClient` speaks the hook's protocol on an allocation's channel socket (what the C hook
does, in Python); `request` asks the control socket one JSON question.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu_runtime import wire
from vgpu_runtime.scheduler.control import control_socket

C = wire.const


class ChannelClosed(ConnectionError):
    """The daemon closed the connection; `error` holds its GM_MSG_ERROR if it sent one."""

    def __init__(self, message: str, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class GpuGrantReply:
    uuid: bytes
    memory_limit: int
    share_ppm: int
    limit_ppm: int


@dataclass(frozen=True)
class HelloReply:
    status: int
    allocation_id: str
    gpus: tuple[GpuGrantReply, ...]


@dataclass(frozen=True)
class MemReply:
    status: int
    gpu: int
    used: int
    limit: int

    @property
    def granted(self) -> bool:
        return self.status == C("GM_OK")


class ChannelClient:
    def __init__(self, socket_path: str | Path, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self.sock.connect(str(socket_path))
        self._seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ChannelClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _recv_exact(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                break
            data += chunk
        return data

    def recv_frame(self) -> Any | None:
        """The next frame from the daemon, or None at EOF."""
        head = self._recv_exact(wire.HEADER_SIZE)
        if not head:
            return None
        header = wire.parse_header(head)
        return wire.decode(head + self._recv_exact(header.length - wire.HEADER_SIZE))

    def _call(self, frame: Any, expect: int) -> Any:
        self._seq += 1
        frame.h.seq = self._seq
        self.send_raw(wire.encode(frame))
        reply = self.recv_frame()
        if reply is None:
            raise ChannelClosed("the daemon closed the connection")
        if wire.frame_type(reply) == C("GM_MSG_ERROR"):
            reason = wire.text_field(reply.reason)
            raise ChannelClosed(f"daemon error {reply.status}: {reason}", reply.status, reason)
        if wire.frame_type(reply) != expect or reply.h.seq != self._seq:
            raise ChannelClosed(f"unexpected reply type {wire.frame_type(reply)} "
                                f"seq {reply.h.seq}")
        return reply

    def hello(self, pid: int | None = None) -> HelloReply:
        frame = wire.new(C("GM_MSG_HELLO"), proto_version=wire.VERSION,
                         pid=os.getpid() if pid is None else pid)
        reply = self._call(frame, C("GM_MSG_HELLO_REPLY"))
        gpus = tuple(
            GpuGrantReply(bytes(reply.gpus[i].uuid), int(reply.gpus[i].memory_limit),
                          int(reply.gpus[i].share_ppm), int(reply.gpus[i].limit_ppm))
            for i in range(reply.gpu_count))
        return HelloReply(int(reply.status), wire.text_field(reply.allocation_id), gpus)

    def _memory(self, msg: str, gpu: int, kind: int, nbytes: int) -> MemReply:
        frame = wire.new(C(msg), gpu=gpu, kind=kind, bytes=nbytes)
        reply = self._call(frame, C("GM_MSG_MEM_REPLY"))
        return MemReply(int(reply.status), int(reply.gpu), int(reply.used), int(reply.limit))

    def reserve(self, gpu: int, nbytes: int, kind: int = C("GM_MEM_DEVICE")) -> MemReply:
        return self._memory("GM_MSG_MEM_RESERVE", gpu, kind, nbytes)

    def release(self, gpu: int, nbytes: int, kind: int = C("GM_MEM_DEVICE")) -> MemReply:
        return self._memory("GM_MSG_MEM_RELEASE", gpu, kind, nbytes)

    def set(self, gpu: int, nbytes: int, kind: int = C("GM_MEM_DEVICE")) -> MemReply:
        return self._memory("GM_MSG_MEM_SET", gpu, kind, nbytes)


def request(state_dir: str | Path, op: str = "status", timeout: float = 5.0,
            **fields: Any) -> Any:
    """One question to the control socket; raises OSError when no daemon answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(control_socket(state_dir)))
        sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
