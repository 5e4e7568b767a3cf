"""The hook against older node daemons (a DaemonSet rolled back while pods with a newer hook run).

The daemon here is a stub that speaks wire version 1 as those daemons did: hello, memory and
token requests, its pages in the channel, a version-2 frame refused with GM_ERR_BAD_VERSION, and
(before token request flags) "token request flags must be zero". The hook speaks version 1 to
it. Against the flagless one, the hooked process runs in report mode with a long kernel, so its
asks say GM_TOKEN_WORK_RUNNING: the hook must reconnect and ask again at once without the flag,
and never pass launches ungated for it.
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
from tests.hook.tokenkit import in_pod
from vgpu_runtime import paths, wire
from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
from vgpu_runtime.daemon.channel.terms import uuid_bytes

C = wire.const
QUOTA_NS = 30_000_000


class OlderDaemon:
    """One channel served as the daemon of wire version 1 before GM_TOKEN_WORK_RUNNING: its pages
    in the channel, every grant a fresh 30 ms quota (the token is this process's alone), a
    flagged request malformed, and a frame of another version refused with GM_ERR_BAD_VERSION
    in a version-1 frame (then the connection closes), as its header check did."""

    def __init__(self, channel: Path, flags_known: bool = False) -> None:
        self.channel = channel
        self.flags_known = flags_known
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
                parsed = wire.parse_header(header, wire.SUPPORTED_VERSIONS)
                if parsed.version != 1:
                    self.seen["other version"] += 1
                    error = wire.new(C("GM_MSG_ERROR"), version=1,
                                     status=C("GM_ERR_BAD_VERSION"))
                    error.reason = b"protocol version 2, this daemon speaks 1"
                    conn.sendall(wire.encode(error))
                    return
                body = self._read(conn, parsed.length - wire.HEADER_SIZE)
                if body is None:
                    return
                frame = wire.decode(header + body, frozenset((1,)))
                reply = self._answer(frame)
                if reply is not None:
                    conn.sendall(reply)
                if (wire.frame_type(frame) == C("GM_MSG_TOKEN_REQUEST") and frame.flags
                        and not self.flags_known):
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
            reply = wire.new(C("GM_MSG_HELLO_REPLY"), seq=seq, version=1, status=C("GM_OK"),
                             gpu_count=1)
            reply.allocation_id = b"older-daemon"
            reply.gpus[0].uuid = list(uuid_bytes(UUID))
            reply.gpus[0].memory_limit = LIMIT
            reply.gpus[0].share_ppm = 500_000
            reply.gpus[0].limit_ppm = 1_000_000
            return wire.encode(reply)
        if kind in (C("GM_MSG_MEM_RESERVE"), C("GM_MSG_MEM_RELEASE"), C("GM_MSG_MEM_SET")):
            self.seen["memory"] += 1
            return wire.encode(wire.new(C("GM_MSG_MEM_REPLY"), seq=seq, version=1,
                                        status=C("GM_OK"), gpu=0, used=0, limit=LIMIT))
        if kind == C("GM_MSG_TOKEN_REQUEST"):
            if frame.flags and not self.flags_known:  # type: ignore[attr-defined]
                self.seen["flagged"] += 1
                error = wire.new(C("GM_MSG_ERROR"), version=1, status=C("GM_ERR_MALFORMED"))
                error.reason = b"token request flags must be zero"
                return wire.encode(error)
            self.seen["token"] += 1
            self.generation += 1
            until = time.monotonic_ns() + QUOTA_NS
            self.page.grant(self.generation, until)
            return wire.encode(wire.new(C("GM_MSG_TOKEN_GRANT"), seq=seq, version=1, gpu=0,
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


@pytest.mark.parametrize("pod", [False, True], ids=["writable-channel", "read-only-pod"])
def test_a_version_1_daemon_is_spoken_to_in_version_1(hooked: Hooked, pod: bool) -> None:
    """A DaemonSet rolled back under pods started with this hook: the hook says so once and
    speaks version 1 on each connection (after trying 2): memory is served, and launches are
    gated on that daemon's token page, read from the channel (read-only in a pod, where the
    activity page cannot be opened for writing and is left out)."""
    if pod and shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    root = Path(tempfile.mkdtemp(prefix="gmv-"))
    daemon = OlderDaemon(root, flags_known=True)
    try:
        argv = [sys.executable, "-c", PRELUDE + textwrap.dedent("""
            import time
            lib = cuda()
            context(lib)
            rc, _ = alloc(lib, 1 << 20)
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
            print(json.dumps({"alloc": rc, "stats": stats()}))
        """)]
        proc = hooked.run(in_pod(str(root), argv) if pod else argv, {
            "GEMINI_CHANNEL_DIR": str(root), "FAKE_CUDA_UUIDS": UUID,
            "FAKE_CUDA_TOTAL_MEM": str(16 * LIMIT), "GEMINI_HOOK_DAEMON_WAIT": "2"})
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        stats = result["stats"]
        assert result["alloc"] == 0 and daemon.seen["memory"] >= 1, (result, daemon.seen)
        assert stats["ungated_launches"] == 0, stats
        assert stats["token_requests"] >= 1 and stats["token_requests"] * 20 < stats[
            "kernel_launches"], stats                    # the fast path, on its token page
        assert daemon.seen["other version"] == daemon.seen["hello"] == 1, daemon.seen
        assert proc.stderr.count("speaks wire version 1") == 1, proc.stderr
        # Its activity page was written where the channel is writable, and only there.
        assert (daemon.activity.read().launches > 0) == (not pod)
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)
