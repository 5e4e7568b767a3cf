#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the hook<->daemon frame handling.

Every input is what one hook process sends on its connection. Two layers see it:

1. `wire.decode` on the whole input: a frame or `MalformedFrame`, nothing else; a frame it
   accepts encodes back to the same bytes.
2. The daemon's own `Session` (the code that serves a channel connection), in this process, on a
   real socketpair, for a real `AllocationChannel` of two GPUs (pages, ledger, token schedulers)
   served from a temporary state directory. The input is sent, the write side shut, and the
   session runs until it drops the client. It must answer only with whole daemon-to-hook frames,
   end with at most one ERROR, never hit its "internal daemon error" path, and leave the ledger
   empty when the connection is gone.

Any other outcome raises, and atheris saves the input as crash-<sha1>.

    /work/venv/bin/python tests/fuzz/atheris_wire.py -max_total_time=180 [CORPUS_DIR ...]

With no corpus directory a temporary one is seeded with valid sessions (tests/fuzz/wirefuzz.py).
Needs `pip install atheris`; CI does not (tests/fuzz/test_atheris.py skips without it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import atheris

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

with atheris.instrument_imports(include=["vgpu_runtime"]):
    from vgpu_runtime import hooklib
    from vgpu_runtime.contracts import allocation, paths, wire
    from vgpu_runtime.contracts.share import Share
    from vgpu_runtime.daemon.channel.channel import AllocationChannel
    from vgpu_runtime.daemon.channel.peer import PeerCred
    from vgpu_runtime.daemon.channel.session import Session
    from vgpu_runtime.daemon.channel.terms import terms_of
    from vgpu_runtime.daemon.channel.tokens import TokenService
    from vgpu_runtime.daemon.config import DaemonConfig

from tests.fuzz.atheris_main import fuzz  # noqa: E402
from tests.fuzz.wirefuzz import DAEMON_TYPES, INTERNAL_ERROR, random_session  # noqa: E402

MiB = 1 << 20
UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")
MSG_ERROR = wire.const("GM_MSG_ERROR")
SESSION_TIMEOUT_S = 10.0


class Harness:
    """One event loop and one served channel for the whole run; one session per input."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        # GM_ATHERIS_STATE (the test's, which it removes), else under /tmp whatever TMPDIR
        # says: a socket path must fit in 108 bytes. libFuzzer exits without Python's atexit.
        self.root = Path(os.environ.get("GM_ATHERIS_STATE")
                         or tempfile.mkdtemp(prefix="gm-atheris-", dir="/tmp"))
        state = self.root / "s"
        rid = allocation.new_run_id().replace("r-", "k-")
        record = allocation.AllocationRecord(
            id=rid, origin="kubelet", device_ids=(),
            gpus=tuple(allocation.GpuShare(uuid, i, Share.from_float(0.5), 100 * MiB)
                       for i, uuid in enumerate(UUIDS)),
            channel_dir=str(paths.channel_dir(state, rid)),
            hook_library=hooklib.library_name(), created_at=time.time())
        config = DaemonConfig(state_dir=str(state))
        self.channel = AllocationChannel(record, terms_of(record, None, config.limit_for),
                                         TokenService(config))
        self.loop.run_until_complete(self.channel.start())
        self.internal_errors: list[logging.LogRecord] = []
        session_log = logging.getLogger("vgpu_runtime.daemon.channel.session")
        session_log.addHandler(_Collect(self.internal_errors))
        session_log.propagate = False
        session_log.setLevel(logging.ERROR)

    def serve(self, data: bytes) -> bytes:
        """Run one session over `data`; returns everything the daemon sent."""
        daemon_end, hook_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with daemon_end, hook_end:
            hook_end.setblocking(False)
            return self.loop.run_until_complete(
                asyncio.wait_for(self._session(daemon_end, hook_end, data), SESSION_TIMEOUT_S))

    async def _session(self, daemon_end: socket.socket, hook_end: socket.socket,
                       data: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(sock=daemon_end)
        session = Session(self.channel, reader, writer, PeerCred(1, 0, 0))
        self.channel.sessions.add(session)
        sent = asyncio.ensure_future(self._send_all(hook_end, data))
        received = asyncio.ensure_future(self._receive_all(hook_end))
        try:
            await session.run()
        finally:
            self.channel.sessions.discard(session)
        await sent
        return await received

    async def _send_all(self, sock: socket.socket, data: bytes) -> None:
        try:
            await self.loop.sock_sendall(sock, data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon dropped us before reading everything

    async def _receive_all(self, sock: socket.socket) -> bytes:
        chunks = []
        try:
            while chunk := await self.loop.sock_recv(sock, 65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


class _Collect(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


def check_decode(data: bytes) -> None:
    try:
        frame = wire.decode(data)
    except wire.MalformedFrame as err:
        assert str(err), "MalformedFrame without a reason"
        return
    assert wire.encode(frame) == data, "an accepted frame does not encode back to its bytes"


def check_replies(output: bytes) -> None:
    replies: list[Any] = []
    rest = output
    while rest:
        versions = wire.SUPPORTED_VERSIONS   # a version-1 hello is answered in version 1
        frame = wire.decode(rest[:wire.parse_header(rest, versions).length], versions)
        replies.append(frame)
        rest = rest[frame.h.length:]
    for index, frame in enumerate(replies):
        kind = wire.frame_type(frame)
        assert kind in DAEMON_TYPES, f"daemon sent frame type {kind}"
        if kind == MSG_ERROR:
            assert index == len(replies) - 1, "the daemon went on after an ERROR"
            assert wire.text_field(frame.reason) != INTERNAL_ERROR, "internal daemon error"


HARNESS: Harness | None = None


def test_one_input(data: bytes) -> None:
    global HARNESS
    if HARNESS is None:
        HARNESS = Harness()
    check_decode(data)
    output = HARNESS.serve(data)
    if HARNESS.internal_errors:
        error = HARNESS.internal_errors.pop()
        raise AssertionError(f"session hit its internal-error path: {error.exc_info!r}")
    check_replies(output)
    ledger = HARNESS.channel.ledger
    used = [ledger.used(g) for g in range(ledger.gpu_count)]
    assert used == [0, 0], f"memory still charged after the connection closed: {used}"


def seed_corpus(directory: Path, count: int = 64) -> None:
    rng = random.Random(6)
    for n in range(count):
        (directory / f"seed-{n}").write_bytes(b"".join(random_session(rng)))


def main() -> None:
    fuzz("atheris-wire", test_one_input, seed_corpus, max_len=2048)


if __name__ == "__main__":
    main()
