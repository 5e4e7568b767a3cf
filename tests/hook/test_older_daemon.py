"""The hook against older node daemons (a DaemonSet rolled back while pods with a newer hook run).

The daemon here is a stub that speaks wire version 1, 2 or 3 as those daemons did (or 3 with a
reserved field set that the hook must refuse; or 4, this one, for the usage reports): hello,
memory and token requests, a frame of a newer version refused with GM_ERR_BAD_VERSION in a frame
of its own version; version 1 with its pages in the channel and (before token request flags)
"token request flags must be zero", version 2 with its pages passed with the hello; version 3's
usage reports with their burst count zero (reserved). The hook speaks the daemon's version to it.
Against the flagless one, the hooked process runs in report mode with a long kernel, so its asks
say GM_TOKEN_WORK_RUNNING: the hook must reconnect and ask again at once without the flag, and
never pass launches ungated for it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
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
from vgpu_runtime.contracts import paths, wire
from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
from vgpu_runtime.daemon.channel.terms import uuid_bytes

C = wire.const
QUOTA_NS = 30_000_000


class OlderDaemon:
    """One channel served as the daemon of wire `version` did: every grant a fresh 30 ms quota
    (the token is this process's alone), and a frame of another version refused with
    GM_ERR_BAD_VERSION in a frame of its own version (then the connection closes), as its header
    check did. Version 1 keeps its pages in the channel and, before GM_TOKEN_WORK_RUNNING
    (`flags_known` False), finds a flagged request malformed; version 2 keeps them elsewhere
    (the state directory) and passes them with the hello."""

    def __init__(self, channel: Path, flags_known: bool = False, version: int = 1,
                 grant_reserved: int = 0) -> None:
        self.channel = channel
        self.flags_known = flags_known
        self.version = version
        self.grant_reserved = grant_reserved   # version 3: what its grant's reserved field says
        self.pages = channel if version == 1 else Path(tempfile.mkdtemp(prefix="gmp-"))
        # Version 1's pages are files in the channel, opened there by path.
        self.page = TokenPage(self.pages / "token.0", GATE_TOKEN, sealed=version > 1)
        self.activity = ActivityPage(self.pages / "activity.0")
        self.seen: Counter[str] = Counter()
        self.reported_bursts: list[int] = []   # each usage report's burst count, as sent
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
        with conn, contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A hook that refuses a reply hangs up: that ends its connection, nothing else.
            while True:
                header = self._read(conn, wire.HEADER_SIZE)
                if header is None:
                    return
                parsed = wire.parse_header(header, wire.SUPPORTED_VERSIONS)
                if parsed.version != self.version:
                    self.seen["other version"] += 1
                    error = wire.new(C("GM_MSG_ERROR"), version=self.version,
                                     status=C("GM_ERR_BAD_VERSION"))
                    error.reason = (f"protocol version {parsed.version}, this daemon speaks "
                                    f"{self.version}").encode()
                    conn.sendall(wire.encode(error))
                    return
                body = self._read(conn, parsed.length - wire.HEADER_SIZE)
                if body is None:
                    return
                frame = wire.decode(header + body, frozenset((self.version,)))
                reply = self._answer(frame)
                if reply is not None and wire.frame_type(frame) == C("GM_MSG_HELLO") and (
                        self.version >= 2):
                    self._send_with_pages(conn, reply)
                elif reply is not None:
                    conn.sendall(reply)
                if (wire.frame_type(frame) == C("GM_MSG_TOKEN_REQUEST") and frame.flags
                        and not self.flags_known):
                    return   # an error closes the connection

    def _send_with_pages(self, conn: socket.socket, reply: bytes) -> None:
        """The hello reply with its pages on the first byte: token page read-only, activity
        page writable, as the version-2 daemon passed them."""
        fds = [self.page.open_for_hook(), self.activity.open_for_hook()]
        try:
            sent = conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           array.array("i", fds))])
            if sent < len(reply):
                conn.sendall(reply[sent:])
        finally:
            for fd in fds:
                os.close(fd)

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
            reply = wire.new(C("GM_MSG_HELLO_REPLY"), seq=seq, version=self.version,
                             status=C("GM_OK"), gpu_count=1)
            reply.allocation_id = b"older-daemon"
            reply.gpus[0].uuid = list(uuid_bytes(UUID))
            reply.gpus[0].memory_limit = LIMIT
            reply.gpus[0].share_ppm = 500_000
            if self.version < 3:
                reply.gpus[0].limit_ppm = 1_000_000
            else:
                reply.gpus[0].reserved = self.grant_reserved
            if self.version >= 2:
                reply.page_fds = 2
            return wire.encode(reply)
        if kind in (C("GM_MSG_MEM_RESERVE"), C("GM_MSG_MEM_RELEASE"), C("GM_MSG_MEM_SET")):
            self.seen["memory"] += 1
            return wire.encode(wire.new(C("GM_MSG_MEM_REPLY"), seq=seq, version=self.version,
                                        status=C("GM_OK"), gpu=0, used=0, limit=LIMIT))
        if kind == C("GM_MSG_TOKEN_REQUEST"):
            if frame.flags and not self.flags_known:  # type: ignore[attr-defined]
                self.seen["flagged"] += 1
                error = wire.new(C("GM_MSG_ERROR"), version=self.version,
                                 status=C("GM_ERR_MALFORMED"))
                error.reason = b"token request flags must be zero"
                return wire.encode(error)
            self.seen["token"] += 1
            self.generation += 1
            until = time.monotonic_ns() + QUOTA_NS
            self.page.grant(self.generation, until)
            return wire.encode(wire.new(C("GM_MSG_TOKEN_GRANT"), seq=seq, version=self.version,
                                        gpu=0, status=C("GM_OK"), generation=self.generation,
                                        valid_until_ns=until))
        if kind == C("GM_MSG_USAGE_REPORT"):
            self.reported_bursts.append(frame.bursts)  # type: ignore[attr-defined]
        return None   # usage reports have no reply

    def close(self) -> None:
        self.server.close()
        self.page.close(remove=False)
        self.activity.close(remove=False)
        if self.pages != self.channel:
            shutil.rmtree(self.pages, ignore_errors=True)


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


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("pod", [False, True], ids=["writable-channel", "read-only-pod"])
def test_an_older_daemon_is_spoken_to_in_its_version(hooked: Hooked, pod: bool,
                                                      version: int) -> None:
    """A DaemonSet rolled back under pods started with this hook: the hook says so once and
    speaks the daemon's version on each connection (after trying its own, refused in a frame of
    the daemon's version): it gets its memory limit, memory is served, and launches are gated on
    that daemon's token page: passed with the hello by a version-2 daemon, read from the channel
    of a version-1 one (read-only in a pod, where its activity page cannot be opened for
    writing and is left out)."""
    if pod and shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    root = Path(tempfile.mkdtemp(prefix="gmv-"))
    daemon = OlderDaemon(root, flags_known=True, version=version)
    try:
        argv = [sys.executable, "-c", PRELUDE + textwrap.dedent("""
            import time
            lib = cuda()
            context(lib)
            rc, _ = alloc(lib, 1 << 20)
            _free, total = mem_info(lib)
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
            print(json.dumps({"alloc": rc, "total": total, "stats": stats()}))
        """)]
        proc = hooked.run(in_pod(str(root), argv) if pod else argv, {
            "GEMINI_CHANNEL_DIR": str(root), "FAKE_CUDA_UUIDS": UUID,
            "FAKE_CUDA_TOTAL_MEM": str(16 * LIMIT), "GEMINI_HOOK_DAEMON_WAIT": "2"})
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        stats = result["stats"]
        assert result["alloc"] == 0 and daemon.seen["memory"] >= 1, (result, daemon.seen)
        assert result["total"] == LIMIT, result                 # the hello's memory limit
        assert stats["ungated_launches"] == 0, stats
        assert stats["token_requests"] >= 1 and stats["token_requests"] * 20 < stats[
            "kernel_launches"], stats                    # the fast path, on its token page
        assert daemon.seen["other version"] == daemon.seen["hello"] == 1, daemon.seen
        assert proc.stderr.count(f"speaks wire version {version}") == 1, proc.stderr
        # Its activity page was written where it was passed or the channel is writable.
        assert (daemon.activity.read().launches > 0) == (version >= 2 or not pod)
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("version", [3, 4])
def test_usage_reports_count_their_bursts_only_to_a_daemon_that_reads_the_count(
        hooked: Hooked, version: int) -> None:
    """Each usage report says how many synchronisation-delimited bursts it merged (wire version
    4: the daemon's measure of a tenant's progress); to a version-3 daemon, which checks that
    the field is zero, it says nothing. Every burst is counted once, merged or not."""
    root = Path(tempfile.mkdtemp(prefix="gmb-"))
    daemon = OlderDaemon(root, flags_known=True, version=version)
    try:
        result = hooked.python("""
            import time
            lib = cuda()
            context(lib)
            stream = ctypes.c_void_p(0x77)
            def burst():
                assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None) == 0
                assert lib.cuStreamSynchronize(stream) == 0
            bursts = 0
            end = time.monotonic() + 0.35
            while time.monotonic() < end:
                for _ in range(3):       # back to back: merged into one report entry
                    burst()
                bursts += 3
                time.sleep(0.004)        # past the merge gap: the next entry
            time.sleep(0.12)             # past the report interval: the next sync sends it all
            burst()
            print(json.dumps({"bursts": bursts + 1, "stats": stats()}))
        """, {"GEMINI_CHANNEL_DIR": str(root), "FAKE_CUDA_UUIDS": UUID,
              "FAKE_CUDA_TOTAL_MEM": str(16 * LIMIT), "GEMINI_HOOK_DAEMON_WAIT": "2"})
        sent = result["stats"]["usage_reports"]
        deadline = time.monotonic() + 5
        while len(daemon.reported_bursts) < sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent >= 2 and len(daemon.reported_bursts) == sent, (result, daemon.seen)
        if version >= 4:
            assert sum(daemon.reported_bursts) == result["bursts"], daemon.reported_bursts
        else:
            assert set(daemon.reported_bursts) == {0}, daemon.reported_bursts
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_hello_reply_whose_reserved_field_is_not_zero_is_refused(hooked: Hooked) -> None:
    """A version-3 reply with its grant's reserved field set (not this version's layout) is not
    taken: the hook says why, the allocation fails closed when the wait runs out, and nothing
    is launched ungated."""
    root = Path(tempfile.mkdtemp(prefix="gmr-"))
    daemon = OlderDaemon(root, flags_known=True, version=3, grant_reserved=1_000_000)
    try:
        proc = hooked.run([sys.executable, "-c", PRELUDE + textwrap.dedent("""
            lib = cuda()
            context(lib)
            rc, _ = alloc(lib, 1 << 20)
            print(json.dumps({"alloc": rc, "stats": stats()}))
        """)], {"GEMINI_CHANNEL_DIR": str(root), "FAKE_CUDA_UUIDS": UUID,
                "FAKE_CUDA_TOTAL_MEM": str(16 * LIMIT), "GEMINI_HOOK_DAEMON_WAIT": "0.5"})
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["alloc"] == 2, result                 # CUDA_ERROR_OUT_OF_MEMORY
        assert result["stats"]["daemon_connects"] == 0, result
        assert "reserved field that is not zero" in proc.stderr, proc.stderr
        assert daemon.seen["hello"] >= 1 and daemon.seen["memory"] == 0, daemon.seen
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)
