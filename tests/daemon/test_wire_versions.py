"""The daemon serves the hooks of older wire versions that keep running in pods across its upgrade.

Each hello gets the reply layout of its version: versions 3 and 4 without the cap, versions 1
and 2 with it (the daemon's effective cap, which their structs carry). A version-1 hook gets every
frame in version-1 headers and no page descriptors: it asks for every launch, and the daemon
takes its asks as its activity, so it is not released as idle 2 ms into every grant (the idle
check once fell back to the grant time for a holder that never wrote an activity page). A
version the daemon does not serve is refused, naming those it does. A usage report counts its
bursts from version 4 on; before, that field is reserved (zero).
"""

from __future__ import annotations

import array
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import UUID_A, UUID_B, DaemonProcess, make_record, wait_served
from vgpu_runtime.contracts import wire
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.channel.terms import uuid_bytes

C = wire.const
V1 = frozenset((1,))
MiB = 1 << 20


class V1Hook:
    """A connection as a version-1 hook makes it."""

    def __init__(self, record: AllocationRecord) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(wait_served(record)))
        self.seq = 0
        self.fds_received = 0

    def send(self, frame: Any) -> None:
        self.seq += 1
        frame.h.seq = self.seq
        self.sock.sendall(wire.encode(frame))

    def _recv(self, size: int) -> bytes:
        data, ancillary, _flags, _addr = self.sock.recvmsg(size, socket.CMSG_SPACE(64))
        for _level, _kind, payload in ancillary:
            fds = array.array("i")
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
            self.fds_received += len(fds)
        while data and len(data) < size:
            chunk = self.sock.recv(size - len(data))
            assert chunk, "daemon closed the connection"
            data += chunk
        return data

    def read(self) -> Any:
        head = self._recv(wire.HEADER_SIZE)
        assert head, "daemon closed the connection"
        header = wire.parse_header(head, wire.SUPPORTED_VERSIONS)
        return wire.decode(head + self._recv(header.length - wire.HEADER_SIZE),
                           wire.SUPPORTED_VERSIONS)

    def call(self, frame: Any) -> Any:
        self.send(frame)
        return self.read()

    def hello(self) -> Any:
        return self.call(wire.new(C("GM_MSG_HELLO"), version=1, proto_version=1, pid=1))

    def ask(self) -> Any:
        return self.call(wire.new(C("GM_MSG_TOKEN_REQUEST"), version=1, gpu=0, burst_ns=-1,
                                  work_end_ns=-1))

    def close(self) -> None:
        self.sock.close()


REPLY_STRUCT = {1: "struct gm_hello_reply_v1", 2: "struct gm_hello_reply_v2",
                3: "struct gm_hello_reply", 4: "struct gm_hello_reply"}


def test_every_version_served_is_tested() -> None:
    assert set(REPLY_STRUCT) == wire.SUPPORTED_VERSIONS


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_each_hello_version_gets_its_own_reply_layout_with_its_values(
        daemon: DaemonProcess, state_dir: Path, version: int) -> None:
    """Versions 1 and 2 get each GPU's cap (0.6 asked; the whole GPU keeps 1.0), versions 3
    and 4 a zero reserved field in its place; versions 2 on get the settings and two pages per
    GPU."""
    record = make_record(state_dir, gpus=((UUID_A, 300 * MiB, 0.3), (UUID_B, 700 * MiB, 1.0)),
                         limit=0.6)
    with ChannelClient(wait_served(record)) as client:
        reply = client.hello_frame(version)
        assert reply.h.version == version and reply.status == C("GM_OK")
        assert reply.h.length == wire.ffi.sizeof(REPLY_STRUCT[version])
        assert wire.text_field(reply.allocation_id) == record.id and reply.gpu_count == 2
        gpus = [reply.gpus[i] for i in range(2)]
        assert [bytes(g.uuid) for g in gpus] == [uuid_bytes(UUID_A), uuid_bytes(UUID_B)]
        assert [g.memory_limit for g in gpus] == [300 * MiB, 700 * MiB]
        assert [g.share_ppm for g in gpus] == [300_000, 1_000_000]
        if version < 3:
            assert [g.limit_ppm for g in gpus] == [600_000, 1_000_000]
        else:
            assert not hasattr(gpus[0], "limit_ppm") and [g.reserved for g in gpus] == [0, 0]
        if version >= 2:
            assert reply.page_fds == len(client.page_fds) == 4
            assert reply.settings.token_timeout_ns == 30 * 1_000_000_000
        else:
            assert client.page_fds == []
        # The connection goes on in its version: memory and tokens are served.
        assert client.reserve(1, MiB).granted and client.request_token(0).valid()


@pytest.mark.parametrize("header_version", [4, 5])
def test_a_hello_of_a_version_not_served_is_refused_naming_those_served(
        daemon: DaemonProcess, state_dir: Path, header_version: int) -> None:
    """Version 5 in the hello (in a version-4 header, or in its own): GM_ERR_BAD_VERSION in a
    version-4 frame (what a newer hook falls back on), naming versions 1 to 4; then closed."""
    record = make_record(state_dir)
    with ChannelClient(wait_served(record)) as client:
        hello = wire.new(C("GM_MSG_HELLO"), proto_version=5, pid=1)
        hello.h.version = header_version
        client.send_raw(wire.encode(hello))
        error = client.recv_frame()
        assert error is not None and wire.frame_type(error) == C("GM_MSG_ERROR")
        assert error.h.version == 4 and error.status == C("GM_ERR_BAD_VERSION")
        reason = wire.text_field(error.reason)
        assert "protocol 5" in reason or "protocol version 5" in reason, reason
        assert "1 to 4" in reason or "1 or 2 or 3 or 4" in reason, reason
        assert client.recv_frame() is None


@pytest.mark.parametrize("version", [3, 4])
def test_a_usage_reports_burst_count_is_read_from_version_4_and_must_be_zero_before(
        daemon: DaemonProcess, state_dir: Path, version: int) -> None:
    record = make_record(state_dir)
    with ChannelClient(wait_served(record)) as client:
        client.hello_frame(version)
        now = time.monotonic_ns()
        client.report_usage(0, now - 5_000_000, now, bursts=0)   # every version: accepted
        client.report_usage(0, now - 5_000_000, now, bursts=3)
        if version >= 4:
            assert client.request_token(0).valid()
        else:
            error = client.recv_frame()
            assert error is not None and error.status == C("GM_ERR_MALFORMED")
            assert "reserved field not zero" in wire.text_field(error.reason)
            assert client.recv_frame() is None


def test_a_version_1_hook_gets_its_own_reply_and_headers_and_no_pages(
        daemon: DaemonProcess, state_dir: Path) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),))
    hook = V1Hook(record)
    try:
        reply = hook.hello()
        assert reply.h.version == 1 and reply.status == C("GM_OK")
        assert reply.h.length == wire.ffi.sizeof("struct gm_hello_reply_v1")
        assert reply.gpu_count == 1 and reply.gpus[0].memory_limit == 100 * MiB
        assert hook.fds_received == 0
        memory = hook.call(wire.new(C("GM_MSG_MEM_RESERVE"), version=1, gpu=0,
                                    kind=C("GM_MEM_DEVICE"), bytes=MiB))
        assert memory.h.version == 1 and memory.status == C("GM_OK") and memory.used == MiB
        grant = hook.ask()
        assert grant.h.version == 1 and wire.frame_type(grant) == C("GM_MSG_TOKEN_GRANT")
        # The connection speaks the version of its hello: a version-2 frame is refused, in a
        # frame the version-1 hook can read.
        error = hook.call(wire.new(C("GM_MSG_TOKEN_REQUEST"), gpu=0, burst_ns=-1,
                                   work_end_ns=-1))
        assert error.h.version == 1 and error.status == C("GM_ERR_BAD_VERSION")
    finally:
        hook.close()


def test_a_version_1_hook_without_pages_is_not_released_as_idle_2_ms_into_its_grants(
        daemon: DaemonProcess, state_dir: Path) -> None:
    """Two old hooks take turns, each asking for every launch (0.5 ms apart) as a version-1
    hook without pages does. Released 2 ms into each grant, they switched ~every 2 ms."""
    records = [make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),)) for _ in range(2)]
    hooks = [V1Hook(r) for r in records]
    for hook in hooks:
        assert hook.hello().status == C("GM_OK")
    generations: list[set[int]] = [set(), set()]
    errors: list[BaseException] = []

    def launch_loop(index: int) -> None:
        try:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                grant = hooks[index].ask()
                assert wire.frame_type(grant) == C("GM_MSG_TOKEN_GRANT"), grant
                generations[index].add(int(grant.generation))
                time.sleep(0.0005)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=launch_loop, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors
        (gpu,) = daemon.status()["gpus"]
        assert all(generations), generations                      # both ran
        assert gpu["idle_releases"] <= 2, gpu
        # Turns last their quotas, not 2 ms: far fewer grants than 1 s / 2 ms.
        assert gpu["grants"] < 150, gpu
    finally:
        for hook in hooks:
            hook.close()


def test_pages_a_version_1_daemon_left_in_a_channel_are_closed_for_good_and_removed(
        state_dir: Path) -> None:
    """A version-1 hook of a writable channel (gemini-run) may have its old daemon's pages
    mapped. Nobody writes them any more, so the new daemon closes their gate (a stale "open"
    would pass its launches ungated forever) and removes them; such a hook then asks."""
    import mmap
    import os

    from vgpu_runtime.daemon.channel.pages import GATE_OPEN, TokenPage

    state_dir.mkdir(parents=True)
    record = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),))
    channel = Path(record.channel_dir)
    channel.mkdir(parents=True, exist_ok=True)
    legacy = TokenPage(channel / "token.0", GATE_OPEN, sealed=False)   # version 1's: a file
    legacy.grant(7, time.monotonic_ns() + 3600 * 1_000_000_000)
    legacy.close(remove=False)
    (channel / "activity.0").write_bytes(b"\0" * 4096)
    fd = os.open(channel / "token.0", os.O_RDONLY)
    mapped = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)   # as the old hook has it
    os.close(fd)
    daemon = DaemonProcess(state_dir).wait_ready()
    try:
        wait_served(record)
        buffer = wire.ffi.from_buffer(mapped)
        page = wire.ffi.cast("struct gm_token_page *", buffer)
        assert page.gate == C("GM_GATE_TOKEN") and page.valid_until_ns == 0
        del page
        wire.ffi.release(buffer)
        assert sorted(p.name for p in channel.iterdir()) == ["sched.sock"]
    finally:
        mapped.close()
        assert daemon.stop() == 0, daemon.logs()


def test_a_hello_whose_pages_cannot_be_opened_is_answered_without_them(
        daemon: DaemonProcess, state_dir: Path) -> None:
    """Descriptors exhausted, a page file gone: the hook is answered, without pages, and is
    served as one that asks for every launch (never dropped for it)."""
    from vgpu_runtime.daemon.channel.client import ChannelClient

    record = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),))
    wait_served(record)
    (state_dir / "pages" / f"{record.id}.activity.0").unlink()
    with ChannelClient(wait_served(record)) as client:
        reply = client.hello()
        assert reply.status == C("GM_OK") and reply.page_fds == 0 and client.page_fds == []
        assert reply.settings["token_timeout_ns"] == 30 * 1_000_000_000
        assert client.request_token(0).valid()
    assert "cannot open the pages" in daemon.logs()
