"""A small blocking client of the daemon, for tests, tools and gemini-run.

`ChannelClient` speaks the hook's protocol on an allocation's channel socket (what the C hook
does, in Python), tokens included; its hello receives the allocation's page descriptors, which
`token_page` and `activity_page` map the way a hook does (`TokenPageReader.of_allocation` takes
an allocation's token page with a hello of its own, `ActivityPageWriter.of_allocation` opens an
activity page by path, for an observer with access to the state directory); `request` asks the
control socket one JSON question.
"""

from __future__ import annotations

import array
import json
import mmap
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vgpu_runtime.contracts import paths, wire
from vgpu_runtime.contracts.allocation import load_record
from vgpu_runtime.daemon.channel.pages import PAGE_BYTES, activity_page_path, pages_dir
from vgpu_runtime.daemon.control import control_socket

C = wire.const


class ChannelClosed(ConnectionError):
    """The daemon closed the connection; `error` holds its GM_MSG_ERROR if it sent one."""

    def __init__(self, message: str, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class GpuEntitlementReply:
    uuid: bytes
    memory_limit: int
    share_ppm: int


@dataclass(frozen=True)
class HelloReply:
    status: int
    allocation_id: str
    gpus: tuple[GpuEntitlementReply, ...]
    settings: dict[str, int]
    page_fds: int


@dataclass(frozen=True)
class MemReply:
    status: int
    gpu: int
    used: int
    limit: int

    @property
    def granted(self) -> bool:
        return self.status == C("GM_OK")


@dataclass(frozen=True)
class TokenGrant:
    seq: int
    gpu: int
    status: int
    generation: int
    valid_until_ns: int

    def valid(self, now_ns: int | None = None) -> bool:
        return (time.monotonic_ns() if now_ns is None else now_ns) < self.valid_until_ns


class ChannelClient:
    def __init__(self, socket_path: str | Path, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        self.sock.connect(str(socket_path))
        self._seq = 0
        self.version = wire.VERSION     # what this connection speaks: set by its hello
        self.page_fds: list[int] = []   # from the hello: per GPU, token then activity page

    @property
    def versions(self) -> frozenset[int]:
        return frozenset((self.version,))

    def close(self) -> None:
        for fd in self.page_fds:
            os.close(fd)
        self.page_fds = []
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
        """The next frame from the daemon (in the version of this connection's hello), or None
        at EOF."""
        head = self._recv_exact(wire.HEADER_SIZE)
        if not head:
            return None
        header = wire.parse_header(head, self.versions)
        return wire.decode(head + self._recv_exact(header.length - wire.HEADER_SIZE),
                           self.versions)

    def _expect(self, expect: int, seq: int | None = None) -> Any:
        """The next frame, which must be of type `expect` (echoing `seq` when given)."""
        reply = self.recv_frame()
        if reply is None:
            raise ChannelClosed("the daemon closed the connection")
        if wire.frame_type(reply) == C("GM_MSG_ERROR"):
            reason = wire.text_field(reply.reason)
            raise ChannelClosed(f"daemon error {reply.status}: {reason}", reply.status, reason)
        if wire.frame_type(reply) != expect or (seq is not None and reply.h.seq != seq):
            raise ChannelClosed(f"unexpected reply type {wire.frame_type(reply)} "
                                f"seq {reply.h.seq}")
        return reply

    def _call(self, frame: Any, expect: int) -> Any:
        self._seq += 1
        frame.h.seq = self._seq
        self.send_raw(wire.encode(frame))
        return self._expect(expect, self._seq)

    def _recv_fds(self, size: int) -> bytes:
        """`size` bytes (the start of a frame), keeping descriptors passed with them."""
        fd_bytes = array.array("i").itemsize
        data, ancillary, _flags, _addr = self.sock.recvmsg(
            size, socket.CMSG_SPACE(2 * wire.MAX_GPUS * fd_bytes), socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fd_bytes])
                self.page_fds += list(fds)
        return data + (self._recv_exact(size - len(data)) if data else b"")

    def hello(self, pid: int | None = None, keep_pages: bool = True) -> HelloReply:
        """HELLO in this version; the page descriptors it passes are kept (`page_fds`) unless
        `keep_pages` is False (a load generator holding thousands of connections needs no
        pages). A reserved field that is not zero is refused, as the hook refuses it."""
        reply = self.hello_frame(wire.VERSION, pid)
        gpus = tuple(
            GpuEntitlementReply(bytes(reply.gpus[i].uuid), int(reply.gpus[i].memory_limit),
                                int(reply.gpus[i].share_ppm))
            for i in range(reply.gpu_count))
        if reply.reserved or any(reply.gpus[i].reserved for i in range(reply.gpu_count)):
            raise ChannelClosed("hello reply has a reserved field that is not zero")
        if not keep_pages:
            for fd in self.page_fds:
                os.close(fd)
            self.page_fds = []
        settings = {name: int(getattr(reply.settings, name)) for name in (
            "token_timeout_ns", "fallback_retry_ns", "io_timeout_ns", "context_bytes",
            "context_max_bytes")}
        return HelloReply(int(reply.status), wire.text_field(reply.allocation_id), gpus,
                          settings, int(reply.page_fds))

    def hello_frame(self, version: int, pid: int | None = None) -> Any:
        """HELLO in protocol `version`, as a hook of that version says it: the reply as its
        cffi struct (that version's layout). The connection speaks `version` from then on."""
        self.version = version
        frame = wire.new(C("GM_MSG_HELLO"), version=version, proto_version=version,
                         pid=os.getpid() if pid is None else pid)
        self._seq += 1
        frame.h.seq = self._seq
        self.send_raw(wire.encode(frame))
        head = self._recv_fds(wire.HEADER_SIZE)
        if not head:
            raise ChannelClosed("the daemon closed the connection")
        # An older daemon refuses a newer version in an error frame of its own version.
        header = wire.parse_header(head, wire.SUPPORTED_VERSIONS)
        reply = wire.decode(head + self._recv_exact(header.length - wire.HEADER_SIZE),
                            wire.SUPPORTED_VERSIONS)
        if wire.frame_type(reply) == C("GM_MSG_ERROR"):
            reason = wire.text_field(reply.reason)
            raise ChannelClosed(f"daemon error {reply.status} (wire version {header.version}): "
                                f"{reason}", reply.status, reason)
        if (wire.frame_type(reply) != C("GM_MSG_HELLO_REPLY") or reply.h.seq != self._seq
                or header.version != version):
            raise ChannelClosed(f"unexpected reply type {wire.frame_type(reply)} "
                                f"(wire version {header.version})")
        return reply

    def token_page(self, gpu: int) -> TokenPageReader:
        """The token page of GPU `gpu`, from the descriptor the hello passed (read-only)."""
        return TokenPageReader(self.page_fds[2 * gpu])

    def activity_page(self, gpu: int) -> ActivityPageWriter:
        """The activity page of GPU `gpu`, from the descriptor the hello passed."""
        return ActivityPageWriter(self.page_fds[2 * gpu + 1])

    def _memory(self, msg: str, gpu: int, kind: int, nbytes: int) -> MemReply:
        frame = wire.new(C(msg), version=self.version, gpu=gpu, kind=kind, bytes=nbytes)
        reply = self._call(frame, C("GM_MSG_MEM_REPLY"))
        return MemReply(int(reply.status), int(reply.gpu), int(reply.used), int(reply.limit))

    def reserve(self, gpu: int, nbytes: int, kind: int = C("GM_MEM_DEVICE")) -> MemReply:
        return self._memory("GM_MSG_MEM_RESERVE", gpu, kind, nbytes)

    def release(self, gpu: int, nbytes: int, kind: int = C("GM_MEM_DEVICE")) -> MemReply:
        return self._memory("GM_MSG_MEM_RELEASE", gpu, kind, nbytes)

    def set(self, gpu: int, nbytes: int, kind: int = C("GM_MEM_DEVICE")) -> MemReply:
        return self._memory("GM_MSG_MEM_SET", gpu, kind, nbytes)

    # ---- tokens ----

    def send_token_request(self, gpu: int, burst_ns: int = -1, work_end_ns: int = -1,
                           work_running: bool = False) -> int:
        """Ask for the token without waiting; returns the seq the grant will echo."""
        self._seq += 1
        flags = C("GM_TOKEN_WORK_RUNNING") if work_running else 0
        self.send_raw(wire.encode(wire.new(C("GM_MSG_TOKEN_REQUEST"), seq=self._seq,
                                           version=self.version, gpu=gpu,
                                           flags=flags, burst_ns=burst_ns,
                                           work_end_ns=work_end_ns)))
        return self._seq

    def recv_grant(self) -> TokenGrant:
        """The next TOKEN_GRANT; raises ChannelClosed on an error or EOF, or socket.timeout."""
        reply = self._expect(C("GM_MSG_TOKEN_GRANT"))
        return TokenGrant(int(reply.h.seq), int(reply.gpu), int(reply.status),
                          int(reply.generation), int(reply.valid_until_ns))

    def request_token(self, gpu: int, burst_ns: int = -1, work_end_ns: int = -1,
                      work_running: bool = False) -> TokenGrant:
        """Ask and block until the token is granted (what a hook does when its page says no)."""
        seq = self.send_token_request(gpu, burst_ns, work_end_ns, work_running)
        grant = self.recv_grant()
        if grant.seq != seq:
            raise ChannelClosed(f"grant echoes seq {grant.seq}, expected {seq}")
        return grant

    def release_token(self, gpu: int, work_end_ns: int = -1) -> None:
        self._seq += 1
        self.send_raw(wire.encode(wire.new(C("GM_MSG_TOKEN_RELEASE"), seq=self._seq,
                                           version=self.version, gpu=gpu,
                                           work_end_ns=work_end_ns)))

    def report_usage(self, gpu: int, burst_start_ns: int, burst_end_ns: int,
                     bursts: int = 0) -> None:
        self._seq += 1
        self.send_raw(wire.encode(wire.new(C("GM_MSG_USAGE_REPORT"), seq=self._seq,
                                           version=self.version, gpu=gpu, bursts=bursts,
                                           burst_start_ns=burst_start_ns,
                                           burst_end_ns=burst_end_ns)))


_Page = TypeVar("_Page", bound="_PageMap")


class _PageMap:
    """A page mapped from a descriptor (which stays the caller's)."""

    STRUCT = ""
    WRITABLE = False

    def __init__(self, fd: int) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.WRITABLE else 0)
        self._map = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, prot)
        self._buffer = wire.ffi.from_buffer(self._map)   # read-only maps are fine to read
        self.page: Any = wire.ffi.cast(self.STRUCT + " *", self._buffer)

    @classmethod
    def _opened(cls: type[_Page], path: Path) -> _Page:
        """Opened by path: for an observer that may enter the state directory."""
        flags = os.O_RDWR if cls.WRITABLE else os.O_RDONLY
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            return cls(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        del self.page
        wire.ffi.release(self._buffer)
        self._map.close()


class TokenPageReader(_PageMap):
    """An allocation's token page on one GPU, mapped read-only as a hook maps it."""

    STRUCT = "struct gm_token_page"

    @classmethod
    def of_allocation(cls, state_dir: str | Path, allocation_id: str,
                      gpu: int) -> TokenPageReader:
        """Taken as a hook takes it, with a hello on the allocation's channel (a sealed page
        has no path); the connection closes, the mapping stays."""
        record = load_record(state_dir, allocation_id)
        if record is None:
            raise FileNotFoundError(f"no allocation {allocation_id} in {state_dir}")
        with ChannelClient(paths.channel_socket(record.channel_dir)) as client:
            client.hello()
            return client.token_page(gpu)

    @property
    def gate(self) -> int:
        return int(self.page.gate)

    @property
    def generation(self) -> int:
        return int(self.page.generation)

    @property
    def valid_until_ns(self) -> int:
        return int(self.page.valid_until_ns)

    def valid(self) -> bool:
        """The hook's fast path: one load and a clock read."""
        return time.monotonic_ns() < self.valid_until_ns


class ActivityPageWriter(_PageMap):
    """An allocation's activity page on one GPU, mapped read-write as a hook maps it."""

    STRUCT = "struct gm_activity_page"
    WRITABLE = True

    @classmethod
    def of_allocation(cls, state_dir: str | Path, allocation_id: str,
                      gpu: int) -> ActivityPageWriter:
        return cls._opened(activity_page_path(pages_dir(state_dir), allocation_id, gpu))

    def launched(self, now_ns: int | None = None) -> None:
        self.page.last_launch_ns = time.monotonic_ns() if now_ns is None else now_ns
        self.page.launches += 1

    def synced(self, now_ns: int | None = None) -> None:
        self.page.last_sync_ns = time.monotonic_ns() if now_ns is None else now_ns


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


TENANT_SAMPLE_FIELDS = ("achieved", "wait_p50_ms", "wait_p99_ms", "revocations", "burst_ms",
                        "quota_ms", "busy", "charged_s", "slowdown", "burst_rates")
GPU_SAMPLE_FIELDS = ("grants", "preemptions", "idle_releases", "co_grants", "window_s")


def token_sample(state_dir: str | Path, owner_pids: list[int]) -> dict[str, Any]:
    """The token view of the GPU that the allocations of `owner_pids` (their records'
    owner_pid: gemini-run's) share, for the benchmarks: {"gpu": its counters, "tenants":
    {index in owner_pids: charged share over the window, waits, revocations, burst, quota}}.
    Raises OSError when no daemon answers, LookupError when none of them is scheduled."""
    status = request(state_dir)
    owner = {a["id"]: owner_pids.index(a["owner_pid"]) for a in status["allocations"]
             if a.get("owner_pid") in owner_pids}
    for gpu in status["gpus"]:
        tenants = {owner[t["allocation"]]: {key: t[key] for key in TENANT_SAMPLE_FIELDS}
                   for t in gpu["tenants"] if t["allocation"] in owner}
        if tenants:
            return {"gpu": {key: gpu[key] for key in GPU_SAMPLE_FIELDS}, "tenants": tenants}
    raise LookupError(f"no GPU schedules the allocations of pids {owner_pids}")
