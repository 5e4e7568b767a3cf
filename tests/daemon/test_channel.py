"""The real daemon, driven through real Unix sockets with the Python wire client."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.helpers import (
    UUID_A,
    UUID_B,
    DaemonProcess,
    MiB,
    make_record,
    record_scans,
    socket_of,
    wait_for,
    wait_served,
)
from tests.daemon.inprocess import InProcessDaemon
from vgpu_runtime.contracts import allocation, wire
from vgpu_runtime.daemon.channel.client import ChannelClient, ChannelClosed

C = wire.const
POOL = C("GM_MEM_POOL")


def test_hello_reply_matches_the_record(daemon: DaemonProcess, state_dir: Path) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 300 * MiB, 0.3), (UUID_B, 700 * MiB, 1.0)),
                         limit=0.6)
    with ChannelClient(wait_served(record)) as client:
        reply = client.hello()
        entry = daemon.allocation(record.id)
    assert reply.status == C("GM_OK")
    assert reply.allocation_id == record.id
    assert [g.uuid for g in reply.gpus] == [uuid.UUID(UUID_A[4:]).bytes,
                                            uuid.UUID(UUID_B[4:]).bytes]
    assert [g.memory_limit for g in reply.gpus] == [300 * MiB, 700 * MiB]
    assert [g.share_ppm for g in reply.gpus] == [300_000, 1_000_000]
    # A cap is never below the guarantee: the whole-GPU share keeps 1.0. The daemon enforces
    # it; the hello no longer carries it (wire version 3).
    assert [g["limit_ppm"] for g in entry["gpus"]] == [600_000, 1_000_000]


def test_limit_defaults_to_the_node_default(daemon: DaemonProcess, state_dir: Path) -> None:
    record = make_record(state_dir)
    wait_served(record)
    assert daemon.allocation(record.id)["gpus"][0]["limit_ppm"] == 1_000_000


def test_socket_is_connectable_by_any_user_and_dir_searchable(
        daemon: DaemonProcess, state_dir: Path) -> None:
    path = wait_served(make_record(state_dir))
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755


def test_reserve_release_set_and_status(daemon: DaemonProcess, state_dir: Path) -> None:
    record = make_record(state_dir)
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        assert (client.reserve(0, 40 * MiB).used, client.reserve(0, 10 * MiB).used) == (
            40 * MiB, 50 * MiB)
        assert client.release(0, 20 * MiB).used == 30 * MiB
        assert client.set(0, 25 * MiB, POOL).used == 55 * MiB
        assert client.set(0, 5 * MiB, POOL).used == 35 * MiB  # pools trim
        entry = daemon.allocation(record.id)
        assert entry["gpus"][0]["memory_used"] == 35 * MiB
        (conn,) = entry["connections"]
        assert conn["peer_pid"] == os.getpid() and conn["uid"] == os.getuid()
        assert conn["held"] == {"0": {"device": 30 * MiB, "pool": 5 * MiB}}


def test_over_limit_reserve_is_refused_and_not_applied(daemon: DaemonProcess,
                                                       state_dir: Path) -> None:
    record = make_record(state_dir)  # 100 MiB
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        client.reserve(0, 90 * MiB)
        refused = client.reserve(0, 11 * MiB)
        assert (refused.status, refused.used, refused.limit) == (
            C("GM_ERR_OVER_LIMIT"), 90 * MiB, 100 * MiB)
        assert client.reserve(0, 10 * MiB).granted  # exactly at the limit is fine


def test_set_past_the_limit_is_applied_and_flagged(daemon: DaemonProcess,
                                                   state_dir: Path) -> None:
    record = make_record(state_dir)
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        reply = client.set(0, 120 * MiB, POOL)
        assert (reply.status, reply.used) == (C("GM_ERR_OVER_LIMIT"), 120 * MiB)
        assert not client.reserve(0, 1).granted


def test_limit_is_shared_by_the_connections_of_one_allocation(daemon: DaemonProcess,
                                                              state_dir: Path) -> None:
    record = make_record(state_dir)
    path = wait_served(record)
    with ChannelClient(path) as first, ChannelClient(path) as second:
        first.hello()
        second.hello()
        assert first.reserve(0, 60 * MiB).granted
        assert not second.reserve(0, 50 * MiB).granted
        assert second.reserve(0, 40 * MiB).used == 100 * MiB
        with pytest.raises(ChannelClosed) as err:
            second.release(0, 41 * MiB)  # more than this connection holds
        assert err.value.status == C("GM_ERR_MALFORMED")
        # second's 40 MiB went with its connection; first is untouched
        assert first.reserve(0, 40 * MiB).used == 100 * MiB


def test_release_on_disconnect(daemon: DaemonProcess, state_dir: Path) -> None:
    record = make_record(state_dir)
    path = wait_served(record)
    with ChannelClient(path) as holder:
        holder.hello()
        assert holder.reserve(0, 80 * MiB).granted
        assert daemon.allocation(record.id)["gpus"][0]["memory_used"] == 80 * MiB
    wait_for(lambda: daemon.allocation(record.id)["gpus"][0]["memory_used"] == 0, 5,
             "release after close")


def test_release_when_a_client_process_is_killed(daemon: DaemonProcess, state_dir: Path) -> None:
    record = make_record(state_dir)
    path = wait_served(record)
    code = ("import sys, time; from vgpu_runtime.daemon.channel.client import ChannelClient; "
            f"c = ChannelClient({str(path)!r}); c.hello(); c.reserve(0, {70 * MiB}); "
            "print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert child.stdout is not None and child.stdout.readline() == b"held\n"
        entry = daemon.allocation(record.id)
        assert entry["gpus"][0]["memory_used"] == 70 * MiB
        assert entry["connections"][0]["peer_pid"] == child.pid  # SO_PEERCRED, not hello
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        child.kill()
    wait_for(lambda: daemon.allocation(record.id)["gpus"][0]["memory_used"] == 0, 5,
             "release after SIGKILL")
    with ChannelClient(path) as client:
        client.hello()
        assert client.reserve(0, 100 * MiB).granted


def test_allocations_are_separate(daemon: DaemonProcess, state_dir: Path) -> None:
    a, b = make_record(state_dir), make_record(state_dir)
    with ChannelClient(wait_served(a)) as client_a, ChannelClient(wait_served(b)) as client_b:
        assert client_a.hello().allocation_id == a.id
        assert client_b.hello().allocation_id == b.id
        client_a.reserve(0, 100 * MiB)
        assert client_b.reserve(0, 100 * MiB).used == 100 * MiB
        with pytest.raises(ChannelClosed):
            client_a.release(0, 200 * MiB)  # cannot release B's memory through A
    assert daemon.allocation(b.id)["gpus"][0]["memory_used"] == 0


def test_protocol_errors_name_their_status(daemon: DaemonProcess, state_dir: Path) -> None:
    path = wait_served(make_record(state_dir))
    cases: list[tuple[Callable[[ChannelClient], object], int]] = [
        (lambda c: c.reserve(0, 1), C("GM_ERR_NOT_READY")),           # before hello
        (lambda c: (c.hello(), c.reserve(1, 1)), C("GM_ERR_BAD_GPU")),
        (lambda c: (c.hello(), c.reserve(0, 1, kind=99)), C("GM_ERR_MALFORMED")),
        (lambda c: c.hello() and c._call(  # a token request with a hello's length
            _token_frame(), C("GM_MSG_TOKEN_GRANT")), C("GM_ERR_MALFORMED")),
    ]
    for action, status in cases:
        with ChannelClient(path) as client, pytest.raises(ChannelClosed) as err:
            action(client)
        assert err.value.status == status, err.value
        assert err.value.reason
    assert "dropping client" in daemon.logs()


def _token_frame() -> object:
    frame = wire.new(C("GM_MSG_HELLO"))  # any body; only the header matters
    frame.h.type = C("GM_MSG_TOKEN_REQUEST")
    return frame


def test_bad_hello_version_is_refused(daemon: DaemonProcess, state_dir: Path) -> None:
    path = wait_served(make_record(state_dir))
    with ChannelClient(path) as client:
        frame = wire.new(C("GM_MSG_HELLO"), proto_version=wire.VERSION + 1, pid=1)
        client.send_raw(wire.encode(frame))
        reply = client.recv_frame()
        assert reply is not None and wire.frame_type(reply) == C("GM_MSG_ERROR")
        assert reply.status == C("GM_ERR_BAD_VERSION")
        assert client.recv_frame() is None  # then closed


def test_record_removal_closes_its_channel(daemon: DaemonProcess, state_dir: Path) -> None:
    record, other = make_record(state_dir), make_record(state_dir)
    path = wait_served(record)
    with ChannelClient(path) as client, ChannelClient(wait_served(other)) as bystander:
        client.hello()
        bystander.hello()
        client.reserve(0, 10 * MiB)
        allocation.remove_record(state_dir, record.id)
        reply = client.recv_frame()
        assert reply is not None and reply.status == C("GM_ERR_NO_ALLOCATION")
        assert client.recv_frame() is None
        wait_for(lambda: not path.exists(), 5, "socket removal")
        wait_for(lambda: not Path(record.channel_dir).exists(), 5, "channel dir removal")
        assert bystander.reserve(0, 1).granted
    assert daemon.allocation(record.id) is None


def test_corrupt_record_is_logged_once_and_skipped(daemon: DaemonProcess,
                                                   state_dir: Path) -> None:
    bad = allocation.record_path(state_dir, "k-0123456789abcdef")
    tmp = bad.with_suffix(".tmp")
    tmp.write_text('{"version": 1, "origin": "kubelet"')
    tmp.rename(bad)  # whole, so the daemon sees one version of the file
    wrong_uuid = make_record(state_dir, gpus=(("GPU-not-a-uuid", MiB, 1.0),))
    good = make_record(state_dir)
    wait_served(good)
    wait_for(lambda: len(daemon.status()["corrupt_records"]) == 2, 5, "corrupt records listed")
    assert not socket_of(wrong_uuid).exists()
    wait_for(lambda: daemon.logs().count("skipping") >= 2, 2, "log lines")
    record_scans(state_dir)
    lines = daemon.logs().splitlines()
    assert len([line for line in lines if str(bad) in line]) == 1
    logs = "\n".join(lines)
    assert logs.count("skipping allocation record that cannot be served") == 1
    # Fixed in place: served on the next poll.
    make_record(state_dir, allocation_id="k-0123456789abcdef")
    wait_served(allocation.load_record(state_dir, "k-0123456789abcdef"))  # type: ignore[arg-type]


def test_record_rewrite_updates_limits_and_keeps_connections(daemon: DaemonProcess,
                                                             state_dir: Path) -> None:
    record = make_record(state_dir)
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        client.reserve(0, 90 * MiB)
        make_record(state_dir, allocation_id=record.id, gpus=((UUID_A, 200 * MiB, 0.5),))
        wait_for(lambda: daemon.allocation(record.id)["gpus"][0]["memory_limit"] == 200 * MiB)
        assert client.reserve(0, 100 * MiB).used == 190 * MiB


def test_daemon_restart_with_redeclaration(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    record = make_record(state_dir)
    first = InProcessDaemon(state_dir).wait_ready()
    path = wait_served(record)
    client = ChannelClient(path)
    client.hello()
    client.reserve(0, 30 * MiB)
    client.set(0, 20 * MiB, POOL)
    assert first.stop() == 0
    assert not path.exists()  # a stop removes the sockets it created
    assert client.recv_frame() is not None  # told why ...
    assert client.recv_frame() is None      # ... then closed
    client.close()

    second = InProcessDaemon(state_dir).wait_ready()
    try:
        with ChannelClient(wait_served(record)) as again:
            again.hello()
            # The hook re-declares what it holds, per kind, from its own bookkeeping.
            again.set(0, 30 * MiB)
            assert again.set(0, 20 * MiB, POOL).used == 50 * MiB
            assert again.set(0, 20 * MiB, POOL).used == 50 * MiB  # idempotent, never doubled
            assert not again.reserve(0, 51 * MiB).granted
    finally:
        assert second.stop() == 0


def test_daemon_replaces_a_stale_socket_after_sigkill(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    record = make_record(state_dir)
    first = DaemonProcess(state_dir).wait_ready()
    wait_served(record)
    first.stop(signal.SIGKILL)
    assert socket_of(record).exists()  # left behind
    second = DaemonProcess(state_dir).wait_ready()
    try:
        with ChannelClient(wait_served(record)) as client:
            assert client.hello().allocation_id == record.id
    finally:
        assert second.stop() == 0


def test_single_instance_lock(daemon_process: DaemonProcess, state_dir: Path) -> None:
    daemon = daemon_process
    second = subprocess.run(
        [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=30, cwd=Path(__file__).resolve().parents[2])
    assert second.returncode == 1
    assert "already serves state directory" in second.stderr
    assert str(daemon.proc.pid) in second.stderr
    assert daemon.status()["daemon"]["pid"] == daemon.proc.pid  # first one unharmed


def test_bad_configuration_names_the_field(state_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state_dir),
         "--poll-interval", "soon"], capture_output=True, text=True, timeout=30,
        cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2
    assert "--poll-interval" in result.stderr


def test_control_socket_rejects_bad_requests(daemon: DaemonProcess, state_dir: Path) -> None:
    import socket

    from vgpu_runtime.daemon.control import control_socket
    for line, expected in ((b"nonsense\n", "not JSON"), (b'{"op": "reboot"}\n', "unknown op"),
                           (b"[1]\n", "must be an object")):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(control_socket(state_dir)))
            sock.sendall(line)
            assert expected in sock.makefile().readline()
    assert "allocations" in daemon.status()


def test_sigint_stops_the_daemon_cleanly(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    record = make_record(state_dir)
    daemon = DaemonProcess(state_dir).wait_ready()
    wait_served(record)
    assert daemon.stop(signal.SIGINT) == 0
    assert not socket_of(record).exists()
    assert not (state_dir / "scheduler.sock").exists()
    assert allocation.load_record(state_dir, record.id) == record  # records are never touched
