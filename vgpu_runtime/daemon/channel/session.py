"""One client connection (one process of the container) on an allocation's channel.

The client is who the socket says: the allocation behind the socket it connected through, and
the kernel's SO_PEERCRED. Nothing it sends identifies it; the pid in HELLO is only logged.

Framing: the session reads whatever the socket has (one await per wake-up, not two per frame)
and serves every whole frame in it, in order. Each 16-byte header is validated once (version,
type, exact length for the type, reserved zero, hence at most GM_MAX_FRAME) as soon as it is
there, before the session waits for its body. A frame that breaks the protocol gets GM_MSG_ERROR
with a reason, after the valid frames before it were served; then that connection alone is
closed; everything it held is released in the ledger, and a token its allocation held is passed
on if this was the allocation's last connection.

Token frames skip the task: a chunk that arrives while the session's task waits idle in its
read (nothing left over, nothing unsent) is served by the connection's protocol as it is read
(TokenFastPath), up to its first frame that is not a whole token frame, which goes to the task
with the rest of the chunk, in order. Resuming the task for every frame cost about as much as
the token code itself. An error there ends the connection through the task, as any other.

Tokens: TOKEN_REQUEST is answered with TOKEN_GRANT, at once if the allocation holds a
valid token on that GPU, else when the token comes to it (see tokens.py). TOKEN_RELEASE and
USAGE_REPORT have no reply. All three need HELLO first and a GPU index inside the allocation.

Versions: a connection speaks the protocol version of its HELLO (any the daemon serves, see
gemini_wire.h) in every frame both ways, and gets that version's hello reply. A hello of version
2 or later is answered with the enforcement settings of the node and the allocation's pages,
passed with SCM_RIGHTS (the token page read-only); a version-1 hook gets no pages, and asks for
every launch: its requests count as its activity (`has_activity_page` is False). Versions 1 and 2
still get each GPU's cap (limit_ppm), which their layouts carry; version 3 dropped it.

Contexts: from HELLO on, the connection is charged for its process's contexts from
NVML's per-process figure where the daemon sees one (process_memory.py has the rule), else
from the hook's MEM_SET of kind context.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from vgpu_runtime.contracts import wire
from vgpu_runtime.daemon.channel.ledger import LedgerError, MemoryResult
from vgpu_runtime.daemon.channel.peer import PeerCred
from vgpu_runtime.daemon.channel.process_memory import ContextCharger, charger_for
from vgpu_runtime.daemon.channel.tokens import TokenService, Waiter, from_ns

if TYPE_CHECKING:
    from vgpu_runtime.contracts.allocation import AllocationRecord
    from vgpu_runtime.daemon.channel.ledger import MemoryLedger
    from vgpu_runtime.daemon.channel.terms import GpuTerms


class AllocationChannel(Protocol):
    """What a session uses of the channel it came through (channel.AllocationChannel), so the
    channel depends on its sessions and not the other way round."""

    record: AllocationRecord
    terms: tuple[GpuTerms, ...]
    tokens: TokenService
    ledger: MemoryLedger
    memory_refusals: list[int]
    bound: asyncio.Event

    async def wait_bound(self) -> bool: ...

    def page_descriptors(self) -> list[int]: ...

    def token_request(self, session: Session, gpu: int, seq: int, burst: float | None,
                      work_end: float | None, work_running: bool) -> None: ...

    def token_release(self, gpu: int, work_end: float | None) -> None: ...

    def usage_report(self, gpu: int, start: float, end: float, bursts: int) -> None: ...

    def connection_closed(self, session: Session) -> None: ...

log = logging.getLogger(__name__)

C = wire.const
MSG_HELLO, MSG_HELLO_REPLY = C("GM_MSG_HELLO"), C("GM_MSG_HELLO_REPLY")
MSG_RESERVE, MSG_RELEASE, MSG_SET = C("GM_MSG_MEM_RESERVE"), C("GM_MSG_MEM_RELEASE"), C(
    "GM_MSG_MEM_SET")
MSG_MEM_REPLY, MSG_ERROR = C("GM_MSG_MEM_REPLY"), C("GM_MSG_ERROR")
MSG_TOKEN_REQUEST, MSG_TOKEN_GRANT = C("GM_MSG_TOKEN_REQUEST"), C("GM_MSG_TOKEN_GRANT")
MSG_TOKEN_RELEASE, MSG_USAGE_REPORT = C("GM_MSG_TOKEN_RELEASE"), C("GM_MSG_USAGE_REPORT")
KIND_NAMES = {C(name): name.removeprefix("GM_MEM_").lower() for name in (
    "GM_MEM_DEVICE", "GM_MEM_MANAGED", "GM_MEM_ARRAY", "GM_MEM_VMM", "GM_MEM_POOL",
    "GM_MEM_GRAPH", "GM_MEM_CONTEXT")}
KIND_CONTEXT = C("GM_MEM_CONTEXT")
REASON_BYTES = C("GM_REASON_BYTES")
HEADER_SIZE = wire.HEADER_SIZE
# What one read may take from the socket: many frames (they are at most GM_MAX_FRAME bytes).
READ_CHUNK = 64 * 1024

# Token frames are read with struct (wire.Unpacker), not through a cffi view: they are the hot
# path. The field names come from gemini_wire.h; the handlers below take them in this order.
TOKEN_REQUEST = wire.Unpacker(MSG_TOKEN_REQUEST)
TOKEN_RELEASE = wire.Unpacker(MSG_TOKEN_RELEASE)
USAGE_REPORT = wire.Unpacker(MSG_USAGE_REPORT)
assert TOKEN_REQUEST.fields == ("gpu", "flags", "burst_ns", "work_end_ns")
assert TOKEN_RELEASE.fields == ("gpu", "reserved", "work_end_ns")
assert USAGE_REPORT.fields == ("gpu", "bursts", "burst_start_ns", "burst_end_ns")
BURSTS_SINCE = C("GM_WIRE_BURSTS_SINCE")   # the usage report's bursts: zero before
WORK_RUNNING, OK = C("GM_TOKEN_WORK_RUNNING"), C("GM_OK")
MEM_REPLY = {v: wire.Packer(MSG_MEM_REPLY, v) for v in wire.SUPPORTED_VERSIONS}
TOKEN_GRANT = {v: wire.Packer(MSG_TOKEN_GRANT, v) for v in wire.SUPPORTED_VERSIONS}
ERROR = {v: wire.Packer(MSG_ERROR, v) for v in wire.SUPPORTED_VERSIONS}
NS = 1_000_000_000


class ClientStalled(Exception):
    """The client did not read its replies within client_write_timeout."""


class ProtocolError(Exception):
    """The client broke the protocol; `status` goes into the GM_MSG_ERROR it is sent."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _check_header(data: bytes, offset: int, versions: frozenset[int]) -> tuple[int, int]:
    """(length, type) of the header at `offset`, validated; raises ProtocolError."""
    try:
        length, msg_type, _seq = wire.check_header(data, offset, versions)
    except wire.WrongVersion as err:
        raise ProtocolError(C("GM_ERR_BAD_VERSION"), str(err)) from None
    except wire.MalformedFrame as err:
        raise ProtocolError(C("GM_ERR_MALFORMED"), str(err)) from None
    return length, msg_type


class TokenFastPath(asyncio.StreamReaderProtocol):
    """A channel connection's protocol: hands each chunk to its session's `serve_inline`
    first; what that leaves goes to the stream, for the session's task."""

    session: Session | None = None

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is not None and session.reading_idle:
            data = session.serve_inline(data)
            if not data:
                return
        super().data_received(data)


class Session(Waiter):
    def __init__(self, channel: AllocationChannel, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, peer: PeerCred) -> None:
        self.channel = channel
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.log_level = logging.INFO   # DEBUG when the channel summarises a flood (reconnects.py)
        # True only while the task waits in its read with nothing left over: then a chunk's
        # token frames may be served as they arrive (TokenFastPath), in order.
        self.reading_idle = False
        protocol = writer.transport.get_protocol()
        self._fast_path = protocol if isinstance(protocol, TokenFastPath) else None
        if self._fast_path is not None:
            self._fast_path.session = self
        self.connected_at = time.time()
        self.hello_pid: int | None = None
        # The protocol version of this connection's hello; until then, any the daemon serves.
        self.version = wire.VERSION
        self.versions: frozenset[int] = wire.SUPPORTED_VERSIONS
        self.has_activity_page = False   # its pages were passed (a version-2+ hello)
        self._mem_reply, self._token_grant = MEM_REPLY[wire.VERSION], TOKEN_GRANT[wire.VERSION]
        self.closing_status: int | None = None
        self.charger: ContextCharger | None = None
        self.process_memory: dict[int, int] = {}   # GPU index -> its process's figure
        self.process_memory_source = "hook"
        self.handlers: dict[int, Callable[[Any], Awaitable[None]]] = {
            MSG_HELLO: self._hello,
            MSG_RESERVE: self._memory,
            MSG_RELEASE: self._memory,
            MSG_SET: self._memory,
        }
        # Frames served without an await (no reply, or one queued without waiting), read from
        # the bytes at an offset.
        self.token_handlers: dict[int, Callable[[bytes, int], None]] = {
            MSG_TOKEN_REQUEST: self._token_request,
            MSG_TOKEN_RELEASE: self._token_release,
            MSG_USAGE_REPORT: self._usage_report,
        }

    def _log_fields(self, **more: Any) -> dict[str, Any]:
        return {"allocation": self.channel.record.id, "peer_pid": self.peer.pid,
                "peer_uid": self.peer.uid, "peer_gid": self.peer.gid, **more}

    async def run(self) -> None:
        log.log(self.log_level, "client connected", extra=self._log_fields())
        try:
            await self._serve()
        except ProtocolError as err:
            log.warning("dropping client: %s", err.reason,
                        extra=self._log_fields(reason=err.reason, status=err.status))
            await self._send_error(err.status, err.reason)
        except ClientStalled as err:
            log.warning("dropping client: %s", err, extra=self._log_fields(reason=str(err)))
            self.writer.transport.abort()   # an error frame would wait behind what it never read
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away mid-write; nothing to answer
        except Exception:
            # A bug must cost this one connection, never the daemon or the other clients.
            log.exception("internal error; dropping client", extra=self._log_fields())
            await self._send_error(C("GM_ERR_MALFORMED"), "internal daemon error")
        finally:
            self.reading_idle = False
            if self._fast_path is not None:
                self._fast_path.session = None   # the protocol and the session, unlinked
            if self.charger is not None:
                self.charger.unregister(self)
            self.channel.ledger.drop(self)
            self.channel.connection_closed(self)
            self.writer.close()
            with contextlib.suppress(Exception):
                # Flushing the last frames waits on the client too: bounded, then aborted.
                await asyncio.wait_for(self.writer.wait_closed(),
                                       self.channel.tokens.config.client_write_timeout)
            self.writer.transport.abort()   # nothing left to flush, or a client that never read
            log.log(self.log_level, "client disconnected", extra=self._log_fields(
                used=[self.channel.ledger.used(g) for g in range(self.channel.ledger.gpu_count)]))

    async def _serve(self) -> None:
        """Read until EOF or the allocation closes, serving each whole frame as it completes.

        `pending` holds the start of a frame whose rest has not arrived; its header (once whole)
        has been validated already."""
        pending = b""
        handlers, token_handlers = self.handlers, self.token_handlers
        while True:
            self.reading_idle = not pending
            try:
                chunk = await self.reader.read(READ_CHUNK)
            finally:
                self.reading_idle = False
            if self.closing_status is not None:
                return   # the allocation is going away: its close() has told the client why
            if not chunk:
                self._check_clean_eof(pending)
                return
            data = pending + chunk if pending else chunk
            end, offset = len(data), 0
            while end - offset >= HEADER_SIZE:
                if self.closing_status is not None:
                    return   # closed while a handler waited
                length, msg_type = _check_header(data, offset, self.versions)
                if end - offset < length:
                    break
                token_handler = token_handlers.get(msg_type)
                if token_handler is not None:
                    token_handler(data, offset)
                    offset += length
                    if self.writer.transport.get_write_buffer_size():
                        await self._drain()   # a flooding client waits on its own replies
                    continue
                handler = handlers.get(msg_type)
                if handler is None:
                    raise ProtocolError(C("GM_ERR_MALFORMED"),
                                        f"frame type {msg_type} is daemon-to-hook only")
                frame = data if length == end else data[offset:offset + length]
                await handler(wire.view(msg_type, frame))
                offset += length
            pending = data[offset:] if offset else data

    def serve_inline(self, data: bytes) -> bytes:
        """Serve the whole token frames at the start of `data`, read while the task waits idle;
        returns the rest, from the first frame the task must serve (or b"" when none is left).
        An error goes to the task's read, which ends the connection as `_serve` would."""
        transport = self.writer.transport
        if self.closing_status is not None or transport.get_write_buffer_size():
            self.reading_idle = False   # the task drains, or finds the allocation closing
            return data
        end, offset = len(data), 0
        token_handlers, versions = self.token_handlers, self.versions
        try:
            while end - offset >= HEADER_SIZE:
                length, msg_type = _check_header(data, offset, versions)
                token_handler = token_handlers.get(msg_type)
                if token_handler is None or end - offset < length:
                    break
                token_handler(data, offset)
                offset += length
                if transport.get_write_buffer_size():
                    break   # a client behind on its replies: the task waits on it (_drain)
        except Exception as err:   # every error ends the connection, in the task (run)
            self.reading_idle = False
            self.reader.set_exception(err)
            return b""
        if offset == end:
            if transport.get_write_buffer_size():
                self.reading_idle = False
            return b""
        self.reading_idle = False   # from here on, every chunk goes to the task, in order
        return data[offset:] if offset else data

    def _check_clean_eof(self, pending: bytes) -> None:
        """EOF is clean only between frames; raises ProtocolError for a frame cut short."""
        if not pending:
            return
        if len(pending) < HEADER_SIZE:
            raise ProtocolError(C("GM_ERR_MALFORMED"),
                                f"truncated header: {len(pending)} bytes then EOF")
        length, _msg_type = _check_header(pending, 0, self.versions)
        raise ProtocolError(C("GM_ERR_MALFORMED"), f"truncated frame: "
                            f"{len(pending) - HEADER_SIZE} of {length - HEADER_SIZE} body bytes")

    async def _send(self, data: bytes) -> None:
        self._check_open()
        self.writer.transport.write(data)
        await self._drain()

    def _check_open(self) -> None:
        if self.writer.transport.is_closing():
            # A send failed (the client is gone): stop here, as drain() would have, rather
            # than write the replies of its buffered frames into a dead socket.
            raise ConnectionResetError("connection lost")

    async def _drain(self) -> None:
        # drain() only matters once the transport holds unsent bytes; skip its await otherwise.
        if self.writer.transport.get_write_buffer_size():
            # Bounded: a client that never reads costs its own connection, after a while.
            timeout = self.channel.tokens.config.client_write_timeout
            try:
                await asyncio.wait_for(self.writer.drain(), timeout)
            except asyncio.TimeoutError:
                raise ClientStalled(f"the client read none of its replies for {timeout:g} s "
                                    "(client_write_timeout)") from None

    async def _send_error(self, status: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await self._send(ERROR[self.version].pack(0, status, 0,
                                                      reason.encode()[:REASON_BYTES - 1]))

    async def _hello(self, frame: Any) -> None:
        version = int(frame.proto_version)
        if version not in wire.SUPPORTED_VERSIONS or version != frame.h.version or (
                self.hello_pid is not None and version != self.version):
            raise ProtocolError(C("GM_ERR_BAD_VERSION"), f"hook speaks protocol {version} in "
                                f"a version {frame.h.version} frame; this daemon serves "
                                f"{wire.VERSION_MIN} to {wire.VERSION}")
        self.version, self.versions = version, frozenset((version,))
        self._mem_reply, self._token_grant = MEM_REPLY[version], TOKEN_GRANT[version]
        if not self.channel.bound.is_set():
            # Per-pod limits must hold from the first CUDA call: wait (bounded) for the pod.
            await self.channel.wait_bound()
        first = self.hello_pid is None
        self.hello_pid = int(frame.pid)
        terms = self.channel.terms
        reply = wire.new(MSG_HELLO_REPLY, seq=frame.h.seq, version=version, status=C("GM_OK"),
                         gpu_count=len(terms))
        reply.allocation_id = self.channel.record.id.encode()
        for index, gpu in enumerate(terms):
            slot = reply.gpus[index]
            slot.uuid = list(gpu.uuid_bytes)
            slot.memory_limit = self.channel.ledger.limit(index)
            slot.share_ppm = wire.share_ppm(gpu.share)
            if version < 3:   # their grants still carry the cap (version 3 dropped it)
                slot.limit_ppm = wire.share_ppm(gpu.limit)
        fds: list[int] = []
        if version >= 2:
            self._fill_settings(reply.settings)
            # The pages go with the connection's first reply only: one set per connection.
            # Without them (descriptors exhausted) the hook asks for every launch: slower, and
            # still gated.
            try:
                fds = self.channel.page_descriptors() if first else []
            except OSError as err:
                log.warning("cannot open the pages for a hook; it will ask for every launch",
                            extra=self._log_fields(error=str(err)))
            reply.page_fds = len(fds)
        log.log(self.log_level, "hello", extra=self._log_fields(
            hello_pid=self.hello_pid, version=version, pages_passed=len(fds)))
        try:
            if fds:
                self._send_with_fds(wire.encode(reply), fds)
                self.has_activity_page = True
            else:
                await self._send(wire.encode(reply))
        finally:
            for fd in fds:
                os.close(fd)
        if self.charger is None:
            self.charger = charger_for(self.channel.tokens, self.channel.tokens.config)
            self.charger.register(self)

    def _fill_settings(self, settings: Any) -> None:
        config = self.channel.tokens.config
        settings.token_timeout_ns = round(config.interposer_token_timeout * NS)
        settings.fallback_retry_ns = round(config.interposer_fallback_retry * NS)
        settings.io_timeout_ns = round(config.interposer_io_timeout * NS)
        settings.context_bytes = config.interposer_context_bytes
        settings.context_max_bytes = config.interposer_context_max_bytes

    def _send_with_fds(self, data: bytes, fds: list[int]) -> None:
        """`data` with `fds` attached to its first byte (SCM_RIGHTS). The transport cannot pass
        descriptors, so this sends on its socket directly: only when nothing is queued before
        it (the first reply of a connection), and what the socket did not take goes after."""
        self._check_open()
        if self.writer.transport.get_write_buffer_size():
            raise ProtocolError(C("GM_ERR_MALFORMED"), "hello sent behind unread replies")
        transport_socket = self.writer.get_extra_info("socket")
        with socket.socket(fileno=os.dup(transport_socket.fileno())) as raw:
            try:
                sent = raw.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", fds))], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                raise ConnectionResetError("hook does not read its replies") from None
        if sent < len(data):
            self.writer.transport.write(data[sent:])

    # ---- the context charge (process_memory.Charged) ----

    @property
    def peer_pid(self) -> int:
        return self.peer.pid

    def gpu_uuids(self) -> list[str]:
        return [gpu.uuid for gpu in self.channel.terms]

    def charge_process_memory(self, source: str, totals: list[int | None]) -> None:
        ledger = self.channel.ledger
        for gpu, total in enumerate(totals[:ledger.gpu_count]):
            before = ledger.observed_charge(self, gpu)
            after = ledger.observe_process(self, gpu, total)
            if total is None:
                self.process_memory.pop(gpu, None)
            else:
                self.process_memory[gpu] = total
            if after != before:
                log.debug("context charge", extra=self._log_fields(
                    gpu=gpu, source=source if after is not None else "hook", charge=after,
                    process_total=total, used=ledger.used(gpu)))
        self.process_memory_source = source if self.process_memory else "hook"

    async def _memory(self, frame: Any) -> None:
        if self.hello_pid is None:
            raise ProtocolError(C("GM_ERR_NOT_READY"), "memory request before hello")
        gpu, kind, nbytes = int(frame.gpu), int(frame.kind), int(frame.bytes)
        ledger = self.channel.ledger
        if gpu >= ledger.gpu_count:
            raise ProtocolError(C("GM_ERR_BAD_GPU"), f"GPU index {gpu} is outside the "
                                f"allocation ({ledger.gpu_count} GPU(s))")
        if kind not in KIND_NAMES:
            raise ProtocolError(C("GM_ERR_MALFORMED"), f"unknown memory kind {kind}")
        msg_type = wire.frame_type(frame)
        result: MemoryResult
        try:
            if msg_type == MSG_RESERVE:
                result = ledger.reserve(self, gpu, kind, nbytes)
            elif msg_type == MSG_RELEASE:
                result = ledger.release(self, gpu, kind, nbytes)
            else:
                result = ledger.set(self, gpu, kind, nbytes)
        except LedgerError as err:
            raise ProtocolError(C("GM_ERR_MALFORMED"), str(err)) from None
        if not result.granted:
            if msg_type == MSG_RESERVE:
                self.channel.memory_refusals[gpu] += 1
            log.info("over memory limit", extra=self._log_fields(
                gpu=gpu, kind=KIND_NAMES[kind], bytes=nbytes, used=result.used,
                limit=result.limit, applied=msg_type == MSG_SET))
        await self._send(self._mem_reply.pack(
            frame.h.seq, C("GM_OK") if result.granted else C("GM_ERR_OVER_LIMIT"), gpu,
            result.used, result.limit))

    def _token_gpu(self, gpu: int, what: str) -> int:
        """The GPU index of a token frame, checked; raises ProtocolError."""
        if self.hello_pid is None:
            raise ProtocolError(C("GM_ERR_NOT_READY"), f"{what} before hello")
        if gpu >= len(self.channel.terms):
            raise ProtocolError(C("GM_ERR_BAD_GPU"), f"{what}: GPU index {gpu} is outside the "
                                f"allocation ({len(self.channel.terms)} GPU(s))")
        return gpu

    @staticmethod
    def _time(value: int, name: str) -> float | None:
        """A CLOCK_MONOTONIC nanosecond field: -1 is unknown, other negatives are malformed."""
        if value < -1:
            raise ProtocolError(C("GM_ERR_MALFORMED"), f"{name} is {value}: a time is >= 0, "
                                "or -1 for unknown")
        return from_ns(value)

    def _token_request(self, data: bytes, offset: int) -> None:
        seq, (gpu, flags, burst_ns, work_end_ns) = TOKEN_REQUEST.unpack_from(data, offset)
        self._token_gpu(gpu, "token request")
        if flags & ~WORK_RUNNING:
            raise ProtocolError(C("GM_ERR_MALFORMED"), f"token request flags {flags:#x}: "
                                f"only GM_TOKEN_WORK_RUNNING ({WORK_RUNNING:#x}) is defined")
        burst = self._time(burst_ns, "burst_ns")
        work_end = self._time(work_end_ns, "work_end_ns")
        if flags & WORK_RUNNING and work_end is not None:
            raise ProtocolError(C("GM_ERR_MALFORMED"), "token request says its work is still "
                                "running and also when it ended (work_end_ns must be -1)")
        self.channel.token_request(self, gpu, seq, burst or None, work_end,
                                   bool(flags & WORK_RUNNING))
        self._check_open()   # a grant sent into a dead socket ends the connection here

    def _token_release(self, data: bytes, offset: int) -> None:
        _seq, (gpu, reserved, work_end_ns) = TOKEN_RELEASE.unpack_from(data, offset)
        self._token_gpu(gpu, "token release")
        if reserved != 0:
            raise ProtocolError(C("GM_ERR_MALFORMED"), "token release reserved field not zero")
        self.channel.token_release(gpu, self._time(work_end_ns, "work_end_ns"))

    def _usage_report(self, data: bytes, offset: int) -> None:
        _seq, (gpu, bursts, start_ns, end_ns) = USAGE_REPORT.unpack_from(data, offset)
        self._token_gpu(gpu, "usage report")
        if bursts != 0 and self.version < BURSTS_SINCE:
            raise ProtocolError(C("GM_ERR_MALFORMED"), "usage report reserved field not zero")
        start = self._time(start_ns, "burst_start_ns")
        end = self._time(end_ns, "burst_end_ns")
        if start is not None and end is not None:
            if end < start:
                raise ProtocolError(C("GM_ERR_MALFORMED"), "usage report: the burst ends "
                                    "before it starts")
            self.channel.usage_report(gpu, start, end, bursts)

    def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
        """Queue a TOKEN_GRANT without waiting: the token code calls this from any context,
        and at most one grant is owed per request, so the buffer stays small."""
        if self.closing_status is not None or self.writer.is_closing():
            return
        self.writer.write(self._token_grant.pack(seq, gpu, OK, generation, valid_until_ns))

    async def close(self, status: int, reason: str) -> None:
        """The allocation is going away: tell the client why, then close its connection.

        Never waits on the client: this runs under the daemon's sync lock, where waiting for a
        client that does not read stalled every allocation of the node. A client whose replies
        are still queued gets its connection aborted (the frame would wait behind them)."""
        self.closing_status = status
        transport = self.writer.transport
        if not transport.is_closing():
            transport.write(ERROR[self.version].pack(0, status, 0,
                                                     reason.encode()[:REASON_BYTES - 1]))
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()

    def snapshot(self) -> dict[str, Any]:
        held: dict[str, dict[str, int]] = {}
        for (gpu, kind), amount in self.channel.ledger.holdings(self).items():
            held.setdefault(str(gpu), {})[KIND_NAMES.get(kind, str(kind))] = amount
        ledger = self.channel.ledger
        context = {}
        for gpu in range(ledger.gpu_count):
            observed = ledger.observed_charge(self, gpu)
            context[str(gpu)] = {
                "charged": ledger.held(self, gpu, KIND_CONTEXT) if observed is None else observed,
                "from": "hook" if observed is None else self.process_memory_source,
                "process_memory": self.process_memory.get(gpu)}
        return {"peer_pid": self.peer.pid, "uid": self.peer.uid, "gid": self.peer.gid,
                "hello_pid": self.hello_pid, "connected_at": self.connected_at, "held": held,
                "context": context}
