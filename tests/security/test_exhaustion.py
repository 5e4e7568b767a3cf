"""S2, S7, S8 (peers): one tenant's misbehaviour ends that tenant's connection, never the daemon.

A real gemini-daemon serves real records; the attacker is a plain socket client of one
allocation. Each test then checks that the node goes on: the other allocation's client still
reserves, and a record written afterwards is served.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.childenv import as_user, child_env
from tests.daemon.helpers import (
    DaemonProcess,
    make_record,
    rewrite_scans,
    wait_for,
    wait_served,
)
from vgpu_runtime.contracts import allocation, paths, wire
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.channel.pages import pages_dir

C = wire.const
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gx-"))   # short: socket paths must fit 107 bytes
    yield root / "state"
    shutil.rmtree(root, ignore_errors=True)


def connected(path: Path) -> ChannelClient:
    client = ChannelClient(path)
    client.hello()
    return client


def log_lines(daemon: DaemonProcess, message: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("msg", "").startswith(message)]  # type: ignore[union-attr]


def test_connections_past_the_cap_are_refused_one_by_one(state_dir: Path) -> None:
    """Pass: the connection past --max-connections gets GM_MSG_ERROR naming the setting and one
    log line; the others, and the other allocation, are served as before."""
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, "--max-connections", "8").wait_ready()
    try:
        mine, other = make_record(state_dir), make_record(state_dir)
        clients = [connected(wait_served(mine)) for _ in range(8)]
        bystander = connected(wait_served(other))
        for attempt in range(3):
            with ChannelClient(paths.channel_socket(mine.channel_dir)) as extra:
                # Refused on accept, before it says anything (a hello may meet a closed socket).
                refused = extra.recv_frame()
                assert refused is not None and wire.frame_type(refused) == C("GM_MSG_ERROR")
                assert refused.status == C("GM_ERR_OVER_LIMIT")
                assert "max_connections" in wire.text_field(refused.reason)
                assert extra.recv_frame() is None
            wait_for(lambda n=attempt: len(log_lines(daemon, "refusing client")) == n + 1,
                     what="one log line per refused connection")
        assert all(c.reserve(0, MiB).granted for c in clients)
        assert bystander.reserve(0, MiB).granted
        clients.pop().close()
        wait_for(lambda: len(daemon.allocation(mine.id)["connections"]) == 7)
        connected(paths.channel_socket(mine.channel_dir)).close()   # room again
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_the_daemon_survives_running_out_of_descriptors(state_dir: Path) -> None:
    """Old code: os.scandir raised EMFILE, which nothing caught, and the daemon exited. Pass: it
    runs on, keeps serving its allocations, and serves a new record once descriptors are free."""
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, nofile=64).wait_ready()
    hostile: list[socket.socket] = []
    try:
        mine, other = make_record(state_dir), make_record(state_dir)
        bystander = connected(wait_served(other))
        path = wait_served(mine)
        for _ in range(120):   # past the daemon's 64 descriptors; the backlog holds the rest
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            hostile.append(sock)
        wait_for(lambda: "Too many open files" in daemon.logs(), what="EMFILE in the daemon")
        late = make_record(state_dir)
        time.sleep(1.0)   # 20 polls that cannot list the records
        assert daemon.proc.poll() is None, daemon.logs()
        assert bystander.reserve(0, MiB).granted
        for sock in hostile:
            sock.close()
        hostile.clear()
        freed = time.monotonic()
        wait_served(late, timeout=10)
        emfile_lines = daemon.logs().count("Too many open files")
        print(f"new record served {time.monotonic() - freed:.3f} s after the descriptors were "
              f"freed; {emfile_lines} EMFILE log lines")
        assert emfile_lines <= 4, "asyncio's line per failed accept is not rate-limited"
        connected(paths.channel_socket(late.channel_dir)).close()
        assert bystander.reserve(0, MiB).granted
    finally:
        for sock in hostile:
            sock.close()
        assert daemon.stop() == 0, daemon.logs()


STALLING_REQUESTS = {
    "memory": wire.new(C("GM_MSG_MEM_SET"), gpu=0, kind=C("GM_MEM_DEVICE"), bytes=MiB),
    # Served as they are read, outside the session's task: a grant each, the token being free.
    "token": wire.new(C("GM_MSG_TOKEN_REQUEST"), gpu=0, burst_ns=-1, work_end_ns=-1),
}


def _stall(path: Path, kind: str = "memory") -> socket.socket:
    """A client that says hello and reads the reply, as a hook does, then sends requests and
    never reads a reply, until the daemon stops reading from it (its replies fill both socket
    buffers and the daemon's own). The first requests reach a session waiting idle."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(wire.encode(wire.new(C("GM_MSG_HELLO"), proto_version=wire.VERSION, pid=1)))
    reply = sock.recv(wire.HEADER_SIZE, socket.MSG_WAITALL)   # its pages' descriptors: dropped
    length = wire.parse_header(reply, wire.SUPPORTED_VERSIONS).length
    assert len(sock.recv(length - len(reply), socket.MSG_WAITALL)) == length - len(reply)
    request = wire.encode(STALLING_REQUESTS[kind]) * 256
    sock.setblocking(False)
    stalled_since = time.monotonic()
    while time.monotonic() - stalled_since < 1.0:
        try:
            sock.send(request)
            stalled_since = time.monotonic()
        except BlockingIOError:
            time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            break   # the daemon dropped it already
    return sock


def test_closing_a_channel_does_not_wait_for_a_client_that_never_reads(
        state_dir: Path) -> None:
    """Old code: removing the allocation sent its client the error frame and waited, under the
    daemon's sync lock, for it to be read: no record of the node was served meanwhile. Pass: a
    record written after the removal is served at once, and the stalled client is cut off.
    (--client-write-timeout is long so that only the close path is tested.)"""
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, "--client-write-timeout", "600").wait_ready()
    try:
        doomed = make_record(state_dir)
        stuck = _stall(wait_served(doomed))
        allocation.remove_record(state_dir, doomed.id)
        late = make_record(state_dir)
        start = time.monotonic()
        wait_served(late, timeout=10)
        served_after = time.monotonic() - start
        print(f"record served {served_after:.3f} s after the stalled allocation's removal")
        assert served_after < 3, "the close waited on the stalled client"
        connected(paths.channel_socket(late.channel_dir)).close()
        stuck.setblocking(True)
        stuck.settimeout(10)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            while stuck.recv(1 << 20):
                pass
            raise ConnectionResetError   # EOF: closed all the same
        stuck.close()
    finally:
        assert daemon.stop() == 0, daemon.logs()


@pytest.mark.parametrize("kind", sorted(STALLING_REQUESTS))
def test_a_client_that_never_reads_loses_its_connection_after_the_write_timeout(
        state_dir: Path, kind: str) -> None:
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, "--client-write-timeout", "0.5").wait_ready()
    try:
        record = make_record(state_dir)
        path = wait_served(record)
        bystander = connected(path)
        stuck = _stall(path, kind)
        wait_for(lambda: log_lines(daemon, "dropping client: the client read none"),
                 timeout=10, what="the stalled client dropped")
        wait_for(lambda: len(daemon.allocation(record.id)["connections"]) == 1)
        assert bystander.reserve(0, MiB).granted
        stuck.close()
    finally:
        assert daemon.stop() == 0, daemon.logs()


# ---- S8: a known user's channel takes only that user ----

CONNECT = textwrap.dedent("""
    import sys
    from vgpu_runtime.contracts import wire
    from vgpu_runtime.daemon.channel.client import ChannelClient, ChannelClosed
    with ChannelClient(sys.argv[1]) as client:
        try:
            print(client.hello().allocation_id)
        except ChannelClosed as err:
            print("refused", err.reason)
        except OSError:   # refused on accept, before the hello went out
            print("refused", wire.text_field(client.recv_frame().reason))
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to connect as other users")
def test_a_gemini_run_channel_refuses_peers_of_another_uid(state_dir: Path) -> None:
    """Even where its directory lets others in (here made 0755 on purpose), a gemini-run
    allocation's socket serves only the uid that made the directory, and root."""
    owner, stranger = 42_000 + os.getpid() % 5_000, 47_000 + os.getpid() % 5_000
    state_dir.mkdir(parents=True)
    state_dir.parent.chmod(0o755)
    daemon = DaemonProcess(state_dir).wait_ready()
    try:
        record = allocation.AllocationRecord(
            **{**make_record(state_dir, allocation.new_run_id(), origin="gemini-run").__dict__})
        channel = Path(record.channel_dir)
        allocation.remove_record(state_dir, record.id)
        wait_for(lambda: daemon.allocation(record.id) is None)
        channel.mkdir(mode=0o755, exist_ok=True)
        os.chown(channel, owner, owner)
        paths.channels_dir(state_dir).chmod(0o711)   # loosened by hand: the check must hold
        allocation.write_record(state_dir, record)
        path = wait_served(record)

        def hello_as(uid: int) -> str:
            done = subprocess.run(as_user(uid, [sys.executable, "-c", CONNECT, str(path)]),
                                  cwd=REPO, env=child_env(), capture_output=True, text=True,
                                  timeout=30)
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        assert hello_as(owner) == record.id
        answer = hello_as(stranger)
        assert answer.startswith("refused") and f"uid {stranger} is not the owner" in answer
        assert connected(path).hello().allocation_id == record.id   # root
    finally:
        assert daemon.stop() == 0, daemon.logs()


def _mount_namespaces_usable() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs none /mnt"], capture_output=True, timeout=30)
    return probe.returncode == 0


def in_mount_namespace_of(daemon: DaemonProcess, script: str, path: str) -> None:
    """Runs a shell `script` ($1 = `path`) in the daemon's own mount namespace."""
    done = subprocess.run(["nsenter", "-t", str(daemon.proc.pid), "-m", "sh", "-c", script,
                           "sh", path], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(not _mount_namespaces_usable(),
                    reason="needs root, unshare -m and nsenter to make the state dir read-only")
def test_a_read_only_state_dir_keeps_what_is_served_and_serves_the_rest_once_writable(
        state_dir: Path) -> None:
    """The daemon's view of its channels directory becomes a read-only bind mount (in its own
    mount namespace; the host still writes records). Old code: a record that arrived meanwhile
    was marked unservable for good. Pass: the daemon runs on, its allocation is served, the
    new record's failure is logged once, and it is served once the directory is writable."""
    state_dir.mkdir(parents=True)
    wrap = ("unshare", "-m", "--propagation", "private")
    daemon = DaemonProcess(state_dir, wrap=wrap).wait_ready()
    channels = str(paths.channels_dir(state_dir))

    def in_daemons_namespace(script: str) -> None:
        # A read-only mount on top of channels/ (a remount of one holding files open for
        # writing, as the daemon's pages are, is refused); lazily unmounted to end it.
        in_mount_namespace_of(daemon, script, channels)

    try:
        served = make_record(state_dir)
        kept = connected(wait_served(served))
        in_daemons_namespace('mount --bind "$1" "$1" && mount -o remount,bind,ro "$1"')
        late = make_record(state_dir)
        wait_for(lambda: log_lines(daemon, "cannot serve allocation yet"), what="the failure")
        rewrite_scans(daemon, served)   # later scans: still one line
        assert len(log_lines(daemon, "cannot serve allocation yet")) == 1
        assert "Read-only file system" in daemon.logs()
        assert kept.reserve(0, MiB).granted and daemon.proc.poll() is None
        in_daemons_namespace('umount -l "$1"')
        wait_served(late, timeout=10)
        connected(paths.channel_socket(late.channel_dir)).close()
    finally:
        assert daemon.stop() == 0, daemon.logs()


@pytest.mark.skipif(not _mount_namespaces_usable(),
                    reason="needs root, unshare -m and nsenter to fill the pages directory")
def test_a_full_pages_directory_keeps_what_is_served_and_serves_the_rest_once_freed(
        state_dir: Path) -> None:
    """ENOSPC: the daemon's pages directory (<state-dir>/pages, the only place a channel needs
    blocks) becomes a full 64 KiB tmpfs (in its own mount namespace). Pass: the daemon runs on
    and serves its allocation; the new record's channel is refused cleanly (not a SIGBUS on a
    page it could not back: pages.py reserves a page's blocks before mapping it), then served
    once there is room."""
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, wrap=("unshare", "-m", "--propagation", "private"))
    daemon.wait_ready()
    channels = str(pages_dir(state_dir))

    def in_daemons_namespace(script: str) -> None:
        in_mount_namespace_of(daemon, script, channels)

    try:
        kept = connected(wait_served(make_record(state_dir)))
        in_daemons_namespace('mount -t tmpfs -o size=64k tmpfs "$1" && '
                             '{ dd if=/dev/zero of="$1/filler" bs=4k 2>/dev/null; true; }')
        late = make_record(state_dir)
        wait_for(lambda: log_lines(daemon, "cannot serve allocation yet"), what="the failure")
        assert "No space left on device" in daemon.logs()
        assert kept.reserve(0, MiB).granted and daemon.proc.poll() is None
        in_daemons_namespace('rm "$1/filler"')
        wait_for(lambda: daemon.allocation(late.id) is not None, timeout=10,
                 what="the new allocation served")
    finally:
        assert daemon.stop() == 0, daemon.logs()
