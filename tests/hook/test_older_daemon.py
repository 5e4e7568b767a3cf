"""The hook against a node daemon older than token request flags (a daemon rolled back while pods
with a newer hook run): such a daemon answers any flag with GM_ERR_MALFORMED and closes.

The daemon here is a stub that speaks the wire protocol as that older daemon did: hello, memory
and token requests, its own token page, and "token request flags must be zero". The hooked
process runs in report mode with a long kernel, so its asks say GM_TOKEN_WORK_RUNNING. The hook
must reconnect and ask again at once without the flag, and never pass launches ungated for it.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hook.conftest import LIMIT, PRELUDE, UUID, Hooked
from vgpu_runtime import paths, wire
from vgpu_runtime.scheduler.grants import uuid_bytes
from vgpu_runtime.scheduler.pages import GATE_TOKEN, ActivityPage, TokenPage

C = wire.const
QUOTA_NS = 30_000_000


class OlderDaemon:
    """One channel served as the daemon before GM_TOKEN_WORK_RUNNING: every grant is a fresh
    30 ms quota (the token is this process's alone), and a flagged request is malformed."""

    def __init__(self, channel: Path) -> None:
        self.channel = channel
        self.page = TokenPage(channel / "token.0", GATE_TOKEN)
        self.activity = ActivityPage(channel / "activity.0")
        self.seen: Counter[str] = Counter()
        self.generation = 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(paths.channel_socket(channel)))
        self.server.listen(8)
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                header = self._read(conn, wire.HEADER_SIZE)
                if header is None:
                    return
                length = wire.parse_header(header).length
                body = self._read(conn, length - wire.HEADER_SIZE)
                if body is None:
                    return
                frame = wire.decode(header + body)
                reply = self._answer(frame)
                if reply is not None:
                    conn.sendall(reply)
                if wire.frame_type(frame) == C("GM_MSG_TOKEN_REQUEST") and frame.flags:
                    return   # an error closes the connection

    @staticmethod
    def _read(conn: socket.socket, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _answer(self, frame: object) -> bytes | None:
        kind = wire.frame_type(frame)
        seq = frame.h.seq  # type: ignore[attr-defined]
        if kind == C("GM_MSG_HELLO"):
            self.seen["hello"] += 1
            reply = wire.new(C("GM_MSG_HELLO_REPLY"), seq=seq, status=C("GM_OK"), gpu_count=1)
            reply.allocation_id = b"older-daemon"
            reply.gpus[0].uuid = list(uuid_bytes(UUID))
            reply.gpus[0].memory_limit = LIMIT
            reply.gpus[0].share_ppm = 500_000
            reply.gpus[0].limit_ppm = 1_000_000
            return wire.encode(reply)
        if kind in (C("GM_MSG_MEM_RESERVE"), C("GM_MSG_MEM_RELEASE"), C("GM_MSG_MEM_SET")):
            self.seen["memory"] += 1
            return wire.encode(wire.new(C("GM_MSG_MEM_REPLY"), seq=seq, status=C("GM_OK"),
                                        gpu=0, used=0, limit=LIMIT))
        if kind == C("GM_MSG_TOKEN_REQUEST"):
            if frame.flags:  # type: ignore[attr-defined]
                self.seen["flagged"] += 1
                error = wire.new(C("GM_MSG_ERROR"), status=C("GM_ERR_MALFORMED"))
                error.reason = b"token request flags must be zero"
                return wire.encode(error)
            self.seen["token"] += 1
            self.generation += 1
            until = time.monotonic_ns() + QUOTA_NS
            self.page.grant(self.generation, until)
            return wire.encode(wire.new(C("GM_MSG_TOKEN_GRANT"), seq=seq, gpu=0,
                                        status=C("GM_OK"), generation=self.generation,
                                        valid_until_ns=until))
        return None   # usage reports have no reply

    def close(self) -> None:
        self.server.close()
        self.page.close(remove=False)
        self.activity.close(remove=False)


@pytest.fixture
def older_daemon() -> Iterator[OlderDaemon]:
    root = Path(tempfile.mkdtemp(prefix="gmo-"))   # short: socket paths must fit 107 bytes
    daemon = OlderDaemon(root)
    yield daemon
    daemon.close()
    shutil.rmtree(root, ignore_errors=True)


# A long kernel, then short launches every millisecond without a sync: in report mode, the ask
# after the next finds the first ask's events still running and says so.
LAUNCHER = """
    import time
    lib = cuda()
    context(lib)
    lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
    stream = ctypes.c_void_p(0x77)
    def launch():
        assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None) == 0
    lib.fake_cuda_set_kernel_ns(500_000_000)
    launch()
    lib.fake_cuda_set_kernel_ns(100_000)
    end = time.monotonic() + 0.8
    while time.monotonic() < end:
        launch()
        time.sleep(0.001)
    assert lib.cuStreamSynchronize(stream) == 0
    print(json.dumps({"stats": stats()}), flush=True)
"""


def test_a_refused_flag_is_dropped_and_the_request_sent_again_at_once(
        hooked: Hooked, older_daemon: OlderDaemon) -> None:
    env = {"GEMINI_CHANNEL_DIR": str(older_daemon.channel), "FAKE_CUDA_UUIDS": UUID,
           "FAKE_CUDA_TOTAL_MEM": str(16 * LIMIT), "GEMINI_HOOK_DAEMON_WAIT": "5",
           "GEMINI_HOOK_DRAIN": "report"}
    result = hooked.python(LAUNCHER, env)
    stats = result["stats"]
    seen = older_daemon.seen
    # The flag went out once, was refused, and never again; the hook reconnected for it.
    assert seen["flagged"] == 1, seen
    assert seen["hello"] == 2, seen
    # Nothing ran ungated: the request was sent again, without the flag, at once.
    assert stats["ungated_launches"] == 0, stats
    assert stats["token_timeouts"] == 0, stats
    assert seen["token"] >= 5 and stats["daemon_connects"] == 2, (seen, stats)


class Version1Daemon:
    """A daemon of wire version 1 (a DaemonSet rolled back under pods that started with this
    hook): it answers any other version's frame with GM_ERR_BAD_VERSION, in a version-1 frame,
    and closes, as the version-1 daemon's header check did."""

    def __init__(self, channel: Path) -> None:
        self.refused = 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(paths.channel_socket(channel)))
        self.server.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                header = OlderDaemon._read(conn, wire.HEADER_SIZE)
                if header is None:
                    continue
                self.refused += 1
                error = wire.new(C("GM_MSG_ERROR"), version=1, status=C("GM_ERR_BAD_VERSION"))
                error.reason = b"protocol version 2, this daemon speaks 1"
                conn.sendall(wire.encode(error))

    def close(self) -> None:
        self.server.close()


def test_a_version_1_daemon_is_named_and_treated_as_away(hooked: Hooked) -> None:
    """This hook does not speak version 1: against a rolled-back daemon its memory fails
    closed and its launches are gated by the hook itself (at 0.04), and it says why, once."""
    root = Path(tempfile.mkdtemp(prefix="gmv-"))
    daemon = Version1Daemon(root)
    try:
        proc = hooked.run([sys.executable, "-c", PRELUDE + textwrap.dedent("""
            lib = cuda()
            context(lib)
            rc, _ = alloc(lib, 1 << 20)
            for _ in range(20):
                assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
            print(json.dumps({"alloc": rc, "stats": stats()}))
        """)], {"GEMINI_CHANNEL_DIR": str(root), "FAKE_CUDA_UUIDS": UUID,
                "FAKE_CUDA_TOTAL_MEM": str(16 * LIMIT), "GEMINI_HOOK_DAEMON_WAIT": "0.3"})
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["alloc"] == 2                       # CUDA_ERROR_OUT_OF_MEMORY
        assert result["stats"]["ungated_launches"] == 20  # self-gated
        assert daemon.refused >= 1
        assert "speaks wire version 1, this hook 2" in proc.stderr, proc.stderr
        assert proc.stderr.count("speaks wire version 1") == 1
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)
