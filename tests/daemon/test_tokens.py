"""GPU-time tokens through the real daemon: real Unix sockets, real pages, real processes."""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import (
    REPO,
    UUID_A,
    UUID_B,
    DaemonProcess,
    MiB,
    make_record,
    wait_for,
    wait_served,
)
from tests.daemon.inprocess import InProcessDaemon
from vgpu_runtime.contracts import wire
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.channel import pages
from vgpu_runtime.daemon.channel.client import (
    ChannelClient,
    TokenGrant,
    TokenPageReader,
)

C = wire.const
OPEN, TOKEN = C("GM_GATE_OPEN"), C("GM_GATE_TOKEN")
NS = 1_000_000_000
# Long quotas make "at once" and "at the quota's end" far apart, so timing never decides a test.
LONG_QUOTAS = ("--max-quota", "2", "--cycle", "4")


@pytest.fixture
def long_daemon(state_dir: Path) -> Iterator[InProcessDaemon]:
    served = InProcessDaemon(state_dir, *LONG_QUOTAS).wait_ready()
    yield served
    assert served.stop() == 0, served.logs()


@pytest.fixture
def long_daemon_process(state_dir: Path) -> Iterator[DaemonProcess]:
    """As a process, for the tests whose bounds are times: no test thread shares its GIL."""
    state_dir.mkdir(parents=True, exist_ok=True)
    proc = DaemonProcess(state_dir, *LONG_QUOTAS).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.logs()


class Tenant:
    """One process of one allocation, as a hook would be: a connection and the two pages."""

    def __init__(self, record: AllocationRecord, gpu: int = 0) -> None:
        self.record = record
        self.client = ChannelClient(wait_served(record))
        self.client.hello()
        self.page = self.client.token_page(gpu)
        self.activity = self.client.activity_page(gpu)
        self.gpu = gpu

    def busy(self) -> None:
        """A launch with no sync after it: work in flight, so never idle."""
        self.activity.launched()

    def pending(self, within: float = 0.1) -> bool:
        """True when no frame arrives within `within` seconds."""
        self.client.sock.settimeout(within)
        try:
            frame = self.client.recv_frame()
        except TimeoutError:
            return True
        finally:
            self.client.sock.settimeout(5)
        raise AssertionError(f"expected no reply yet, got {frame}")

    def close(self) -> None:
        self.page.close()
        self.activity.close()
        self.client.close()


def tenants_of(daemon: DaemonProcess, uuid: str = UUID_A) -> dict[str, dict[str, Any]]:
    for gpu in daemon.status()["gpus"]:
        if gpu["uuid"] == uuid:
            return {t["allocation"]: t for t in gpu["tenants"]}
    return {}


def gpu_status(daemon: DaemonProcess, uuid: str = UUID_A) -> dict[str, object]:
    (gpu,) = [g for g in daemon.status()["gpus"] if g["uuid"] == uuid]
    return gpu  # type: ignore[no-any-return]


def test_whole_gpu_alone_is_open_and_a_second_tenant_closes_the_gate(
        daemon: DaemonProcess, state_dir: Path) -> None:
    whole = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 1.0),))
    wait_served(whole)
    page = TokenPageReader.of_allocation(state_dir, whole.id, 0)
    try:
        # The activity page lives in the state directory, for the daemon's user only; the
        # token page is a sealed memfd (no file). Hooks get both with their hello. The
        # channel directory holds none.
        pages = state_dir / "pages"
        assert stat.S_IMODE(pages.stat().st_mode) == 0o700
        assert stat.S_IMODE((pages / f"{whole.id}.activity.0").stat().st_mode) == 0o600
        assert not (pages / f"{whole.id}.token.0").exists()
        assert not any(Path(whole.channel_dir).glob("token.*"))
        assert page.page.magic == C("GM_TOKEN_PAGE_MAGIC") and page.gate == OPEN
        other = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.2),), origin="gemini-run")
        wait_served(other)
        wait_for(lambda: page.gate == TOKEN, 5, "gate closes with a second tenant")
        other_page = TokenPageReader.of_allocation(state_dir, other.id, 0)
        assert other_page.gate == TOKEN
        other_page.close()
        from vgpu_runtime.contracts.allocation import remove_record
        remove_record(state_dir, other.id)
        wait_for(lambda: page.gate == OPEN, 5, "gate opens when alone again")
        wait_for(lambda: not (pages / f"{other.id}.activity.0").exists(), 5, "pages removed")
    finally:
        page.close()


def test_first_granted_at_once_second_waits_then_release_hands_over(
        long_daemon: DaemonProcess, state_dir: Path) -> None:
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    try:
        before = time.monotonic_ns()
        grant = a.client.request_token(0)
        a.busy()
        assert grant.status == C("GM_OK") and grant.gpu == 0
        assert grant.valid_until_ns > before and a.page.valid()
        assert (a.page.generation, a.page.valid_until_ns) == (grant.generation,
                                                             grant.valid_until_ns)
        assert not b.page.valid()
        b.client.send_token_request(0)
        assert b.pending(0.2)  # a's work is in flight: no early release
        assert a.client.request_token(0) == TokenGrant(  # a holder asking again: same grant
            grant.seq + 1, 0, C("GM_OK"), grant.generation, grant.valid_until_ns)
        assert gpu_status(long_daemon)["holder"] == a.record.id
        released = time.monotonic_ns()
        a.client.release_token(0, work_end_ns=released)
        handed = b.client.recv_grant()
        assert time.monotonic_ns() - released < 0.5 * NS
        assert handed.generation > grant.generation and b.page.valid()
        assert a.page.valid_until_ns == 0  # cleared before b's page was written
        assert time.monotonic_ns() < grant.valid_until_ns  # long before a's quota would end
    finally:
        a.close()
        b.close()


def test_quota_end_then_asking_again_hands_over(daemon: DaemonProcess,
                                                 state_dir: Path) -> None:
    # b has work in flight from before its grant: were it idle, the daemon (2 ms idle release)
    # would hand the token straight back to a waiting a, and on a slow box the page reads
    # below would see a's next grant.
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    try:
        grant = a.client.request_token(0)
        a.busy()
        b.busy()
        b.client.send_token_request(0)
        wait_for(lambda: time.monotonic_ns() >= grant.valid_until_ns, 2, "a's quota to end")
        # What the hook does at its next launch: settle and ask again.
        seq = a.client.send_token_request(0, work_end_ns=time.monotonic_ns())
        handed = b.client.recv_grant()
        time.sleep(0.02)                           # a slow box between grant and reads
        assert handed.valid_until_ns > grant.valid_until_ns
        assert a.page.valid_until_ns == 0 and b.page.valid()
        b.client.release_token(0)
        again = a.client.recv_grant()
        assert again.seq == seq and again.generation > handed.generation
    finally:
        a.close()
        b.close()


def test_no_two_tenants_hold_at_once_under_load(long_daemon: DaemonProcess,
                                                state_dir: Path) -> None:
    # Four tenants ask, hold for 0-3 ms and release as fast as they can, from four threads
    # beside the daemon on a busy box. Quotas are long (2 s), so within one no revocation can
    # hand the token on: whenever a tenant holds a grant, every other page must say no.
    tenants = [Tenant(make_record(state_dir)) for _ in range(4)]
    seen: list[str] = []
    grants = [0] * len(tenants)
    stop = time.monotonic() + 2.0

    def run(index: int) -> None:
        me, rng = tenants[index], random.Random(index)
        try:
            while time.monotonic() < stop and not seen:
                me.busy()
                grant = me.client.request_token(0)
                others = [t.page.valid() for i, t in enumerate(tenants) if i != index]
                if any(others):
                    seen.append(f"tenant {index} granted {grant.generation}, others {others}")
                grants[index] += 1
                time.sleep(rng.random() * 0.003)
                me.client.release_token(0)
        except Exception as err:
            seen.append(f"tenant {index}: {err!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(tenants))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        for tenant in tenants:
            tenant.close()
    assert not seen, seen
    assert min(grants) > 0, grants      # every tenant was served, so the check ran for each


def test_unreturned_token_is_revoked_after_quota_and_grace(daemon: DaemonProcess,
                                                           state_dir: Path) -> None:
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    try:
        grant = a.client.request_token(0)
        a.busy()                       # and it never asks again nor releases
        b.client.send_token_request(0)
        handed = b.client.recv_grant()
        grace_ns = 0.05 * NS           # the default revoke_grace
        assert time.monotonic_ns() >= grant.valid_until_ns + grace_ns - 0.005 * NS
        assert handed.generation > grant.generation
        assert a.page.valid_until_ns == 0 and b.page.valid()
        assert tenants_of(daemon)[a.record.id]["revocations"] == 1
        assert tenants_of(daemon)[b.record.id]["revocations"] == 0
        assert "token revoked" in daemon.logs()
    finally:
        a.close()
        b.close()


HOLDER_SCRIPT = """
import sys, time
from vgpu_runtime.daemon.channel.client import ChannelClient
c = ChannelClient(sys.argv[1]); c.hello()
g = c.request_token(0)
c.activity_page(0).launched()
print(g.valid_until_ns, flush=True)
time.sleep(60)
"""


def test_sigkill_of_the_holder_hands_over_at_once(long_daemon: DaemonProcess,
                                                  state_dir: Path) -> None:
    held = make_record(state_dir)
    b = Tenant(make_record(state_dir))
    child = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, str(wait_served(held))],
                             stdout=subprocess.PIPE, cwd=REPO)
    holder_page = TokenPageReader.of_allocation(state_dir, held.id, 0)
    try:
        assert child.stdout is not None
        valid_until = int(child.stdout.readline())
        assert holder_page.valid()
        b.client.send_token_request(0)
        assert b.pending(0.1)
        killed = time.monotonic_ns()
        child.send_signal(signal.SIGKILL)
        child.wait()
        b.client.recv_grant()
        assert time.monotonic_ns() - killed < 0.5 * NS
        assert time.monotonic_ns() < valid_until   # long before its quota ended
        assert holder_page.valid_until_ns == 0
        assert tenants_of(long_daemon)[held.id]["revocations"] == 0
    finally:
        child.kill()
        holder_page.close()
        b.close()


def test_a_flooding_client_does_not_delay_the_others(long_daemon_process: DaemonProcess,
                                                     state_dir: Path) -> None:
    long_daemon = long_daemon_process
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    flooder = Tenant(make_record(state_dir))
    try:
        a.client.request_token(0)
        a.busy()
        b.client.send_token_request(0)
        for _ in range(5000):
            flooder.client.send_token_request(0, burst_ns=10**9)
        status_started = time.monotonic()
        assert long_daemon.status()["gpus"]  # the daemon still answers
        assert time.monotonic() - status_started < 1.0
        released = time.monotonic_ns()
        a.client.release_token(0)
        # b asked first; the flooder's thousands of requests are one waiting entry.
        b.client.recv_grant()
        assert time.monotonic_ns() - released < 0.3 * NS
        b.client.release_token(0)
        grants = 0
        flooder.client.sock.settimeout(0.3)
        try:
            while flooder.client.recv_grant():
                grants += 1
        except TimeoutError:
            pass
        assert grants == 1  # one pending entry per connection: one answer
        entry = tenants_of(long_daemon)
        assert entry[flooder.record.id]["holder"] and entry[flooder.record.id]["revocations"] == 0
    finally:
        for t in (a, b, flooder):
            t.close()


def test_idle_holder_is_released_early_through_the_activity_page(
        long_daemon: DaemonProcess, state_dir: Path) -> None:
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    try:
        grant = a.client.request_token(0)
        a.busy()
        b.client.send_token_request(0)
        assert b.pending(0.15)       # launched, not synced: busy, keeps the token
        a.activity.synced()          # its burst ends with a sync, and nothing follows
        synced = time.monotonic_ns()
        handed = b.client.recv_grant()
        waited = time.monotonic_ns() - synced
        assert waited < 0.1 * NS    # the in-flight re-check backs off to 32 ms at most
        assert time.monotonic_ns() < grant.valid_until_ns and handed.generation > grant.generation
        assert a.page.valid_until_ns == 0
        assert gpu_status(long_daemon)["idle_releases"] == 1
        assert tenants_of(long_daemon)[a.record.id]["revocations"] == 0
    finally:
        a.close()
        b.close()


def test_a_fresh_grant_waits_its_first_launch_grace_before_an_idle_release(
        state_dir: Path) -> None:
    """With --first-launch-grace, a holder that has launched nothing under its grant (woken
    late) keeps it through the grace while another waits, and gives it back when the grace
    ends; once it has launched, the idle release watches it as without the grace."""
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, *LONG_QUOTAS, "--first-launch-grace", "0.3")
    daemon.wait_ready()
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    try:
        asked = time.monotonic_ns()  # before the daemon's grant, so the grace counts from it
        a.client.request_token(0)
        b.client.send_token_request(0)
        b.client.recv_grant()        # a never launches: its 2 s quota does not hold b back
        assert 0.3 * NS <= time.monotonic_ns() - asked < 0.5 * NS
        a.client.send_token_request(0)
        assert a.pending(0.15)       # b, within its grace, has not launched yet: still b's
        b.busy()                     # its first launch, then a sync and nothing after
        b.activity.synced()
        synced = time.monotonic_ns()
        a.client.recv_grant()
        assert time.monotonic_ns() - synced < 0.1 * NS   # the idle release again, not the grace
        assert gpu_status(daemon)["idle_releases"] == 2
    finally:
        a.close()
        b.close()
        assert daemon.stop() == 0, daemon.logs()


def test_limit_change_by_rewriting_the_record(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, "--window", "1", "--max-quota", "0.05").wait_ready()
    record = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.3),))
    try:
        wait_served(record)
        assert tenants_of(daemon)[record.id]["limit"] == 1.0   # work-conserving default
        make_record(state_dir, allocation_id=record.id, gpus=((UUID_A, 100 * MiB, 0.3),),
                    limit=0.3)
        wait_for(lambda: tenants_of(daemon)[record.id]["limit"] == 0.3, 5, "new limit")
        tenant = Tenant(record)
        tenant.client.hello()
        assert daemon.allocation(record.id)["gpus"][0]["limit_ppm"] == 300_000
        # Alone and saturating, it is held to its cap over the window.
        held, started, work_end = 0.0, time.monotonic_ns(), -1
        while time.monotonic_ns() - started < 1.5 * NS:
            grant = tenant.client.request_token(0, work_end_ns=work_end)
            granted = time.monotonic_ns()
            while time.monotonic_ns() < grant.valid_until_ns:
                tenant.busy()
                time.sleep(0.001)
            work_end = time.monotonic_ns()
            held += (work_end - granted) / NS
        achieved = tenants_of(daemon)[record.id]["achieved"]
        assert 0.2 < achieved <= 0.36, achieved
        assert held / 1.5 < 0.45
        tenant.close()
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_strict_policy_caps_at_the_request(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    daemon = InProcessDaemon(state_dir, "--limit-policy", "strict").wait_ready()
    try:
        record = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.3),))
        with ChannelClient(wait_served(record)) as client:
            client.hello()
        assert daemon.allocation(record.id)["gpus"][0]["limit_ppm"] == 300_000
        assert tenants_of(daemon)[record.id]["limit"] == 0.3
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_two_gpus_hold_two_independent_tokens(long_daemon: DaemonProcess,
                                              state_dir: Path) -> None:
    both = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5), (UUID_B, 100 * MiB, 0.5)))
    on_a = Tenant(make_record(state_dir))
    on_b = Tenant(make_record(state_dir, gpus=((UUID_B, 100 * MiB, 0.5),)))
    first = Tenant(both, gpu=0)
    second_page = first.client.token_page(1)
    second_activity = first.client.activity_page(1)
    try:
        grant_a = first.client.request_token(0)
        grant_b = first.client.request_token(1)      # same connection, other GPU: at once
        assert grant_a.gpu == 0 and grant_b.gpu == 1
        first.busy()
        second_activity.launched()
        assert first.page.valid() and second_page.valid()
        on_a.client.send_token_request(0)
        on_b.client.send_token_request(0)
        assert on_a.pending(0.1) and on_b.pending(0.01)
        first.client.release_token(1)                 # gives up GPU B only
        on_b.client.recv_grant()
        assert not second_page.valid() and first.page.valid()
        assert on_a.pending(0.1)
        assert gpu_status(long_daemon, UUID_A)["holder"] == both.id
        assert gpu_status(long_daemon, UUID_B)["holder"] == on_b.record.id
    finally:
        second_page.close()
        second_activity.close()
        for t in (first, on_a, on_b):
            t.close()


def _frame(msg: str, **fields: int) -> bytes:
    return wire.encode(wire.new(C(msg), **fields))


@pytest.mark.parametrize(("data", "hello", "status", "words"), [
    (_frame("GM_MSG_TOKEN_REQUEST", gpu=1, burst_ns=-1, work_end_ns=-1), True,
     "GM_ERR_BAD_GPU", "outside"),
    (_frame("GM_MSG_TOKEN_REQUEST", gpu=0, burst_ns=-1, work_end_ns=-1), False,
     "GM_ERR_NOT_READY", "before hello"),
    (_frame("GM_MSG_TOKEN_REQUEST", gpu=0, flags=2, burst_ns=-1, work_end_ns=-1), True,
     "GM_ERR_MALFORMED", "flags 0x2"),
    (_frame("GM_MSG_TOKEN_REQUEST", gpu=0, flags=1, burst_ns=-1, work_end_ns=5), True,
     "GM_ERR_MALFORMED", "still running and also when it ended"),
    (_frame("GM_MSG_TOKEN_REQUEST", gpu=0, burst_ns=-5, work_end_ns=-1), True,
     "GM_ERR_MALFORMED", "burst_ns"),
    (_frame("GM_MSG_TOKEN_REQUEST", gpu=0)[:-8], True, "GM_ERR_MALFORMED", "truncated"),
    (_frame("GM_MSG_TOKEN_RELEASE", gpu=7), True, "GM_ERR_BAD_GPU", "outside"),
    (_frame("GM_MSG_USAGE_REPORT", gpu=0, burst_start_ns=10, burst_end_ns=5), True,
     "GM_ERR_MALFORMED", "before it starts"),
    (_frame("GM_MSG_TOKEN_GRANT", gpu=0), True, "GM_ERR_MALFORMED", "daemon-to-hook"),
])
def test_malformed_token_frames_drop_only_that_client(
        state_dir: Path, data: bytes, hello: bool, status: str, words: str) -> None:
    # The holder's grant must outlast the test on a loaded machine (2 s quotas ran out under
    # CI's load): the longest quota the daemon allows.
    daemon = InProcessDaemon(state_dir, "--max-quota", "10", "--cycle", "20",
                             "--window", "60").wait_ready()
    try:
        malformed_frame_drops_only_its_client(state_dir, data, hello, status, words)
    finally:
        assert daemon.stop() == 0, daemon.logs()


def malformed_frame_drops_only_its_client(state_dir: Path, data: bytes, hello: bool,
                                          status: str, words: str) -> None:
    holder = Tenant(make_record(state_dir))
    try:
        grant = holder.client.request_token(0)
        holder.busy()
        with ChannelClient(wait_served(holder.record)) as bad:
            if hello:
                bad.hello()
            if words == "truncated":
                # Declare the right length for the type, then send less and stop.
                header = wire.parse_header(data[:wire.HEADER_SIZE])
                assert header.length == len(data) + 8
                bad.send_raw(data)
                bad.sock.shutdown(socket.SHUT_WR)
            else:
                bad.send_raw(data)
            error = bad.recv_frame()
            assert error is not None and wire.frame_type(error) == C("GM_MSG_ERROR")
            assert error.status == C(status), wire.text_field(error.reason)
            assert words in wire.text_field(error.reason)
            assert bad.recv_frame() is None
        # Its allocation's other process keeps its token and its connection.
        assert holder.page.valid() and holder.page.generation == grant.generation
        assert holder.client.request_token(0).generation == grant.generation
    finally:
        holder.close()


def test_wrong_length_token_frame_is_refused_before_its_body(long_daemon: DaemonProcess,
                                                              state_dir: Path) -> None:
    record = make_record(state_dir)
    with ChannelClient(wait_served(record)) as bad:
        bad.hello()
        frame = wire.new(C("GM_MSG_TOKEN_REQUEST"), gpu=0)
        frame.h.length = 4000
        bad.send_raw(wire.encode(frame))
        error = bad.recv_frame()
        assert error is not None and error.status == C("GM_ERR_MALFORMED")
        assert "must be 40 bytes" in wire.text_field(error.reason)
    assert long_daemon.running()


class Restart:
    """One allocation served by a first daemon and a tenant connected to it; `restart` has the
    tenant take the token and hang up, stops that daemon (its grants voided) and starts a second
    on the same state directory. Leaving stops whichever daemon runs."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True)
        self.state_dir = state_dir
        self.record = make_record(state_dir)
        self.daemon = InProcessDaemon(state_dir).wait_ready()
        wait_served(self.record)
        self.tenant = Tenant(self.record)

    def __enter__(self) -> Restart:
        return self

    def restart(self) -> InProcessDaemon:
        self.tenant.client.request_token(0)
        assert self.tenant.page.valid()
        self.tenant.client.close()
        assert self.daemon.stop() == 0, self.daemon.logs()
        assert self.tenant.page.valid_until_ns == 0   # a stopping daemon voids its grants
        self.daemon = InProcessDaemon(self.state_dir).wait_ready()
        wait_served(self.record)
        return self.daemon

    def __exit__(self, *_: object) -> None:
        self.tenant.close()
        assert self.daemon.stop() == 0, self.daemon.logs()


def test_a_restarted_daemon_hands_out_new_sealed_token_pages_and_keeps_activity_pages(
        state_dir: Path) -> None:
    """A sealed token page dies with its daemon (nobody else can ever write it): the old
    mapping is voided by the stopping daemon and never written again; a hello to the new daemon
    brings a new token page, which it writes. The activity page is a file and keeps its inode,
    so hooks' launches stay visible to the new daemon."""
    with Restart(state_dir) as restart:
        record, tenant = restart.record, restart.tenant
        activity_path = state_dir / "pages" / f"{record.id}.activity.0"
        activity_inode = activity_path.stat().st_ino
        old_inode = os.fstat(tenant.client.page_fds[0]).st_ino
        restart.restart()
        assert activity_path.stat().st_ino == activity_inode
        with ChannelClient(wait_served(record)) as again:
            again.hello()
            assert os.fstat(again.page_fds[0]).st_ino != old_inode
            new_page = again.token_page(0)
            grant = again.request_token(0)
            # Read while `again` is still connected: its close hands the token back.
            assert new_page.valid_until_ns == grant.valid_until_ns
            assert tenant.page.valid_until_ns == 0    # the dead daemon's page stays void
            new_page.close()


def test_without_sealing_pages_survive_a_daemon_restart_with_the_same_inode(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel without F_SEAL_FUTURE_WRITE: token pages are files, as before sealing, and a
    new daemon writes the page an old hook still maps."""
    monkeypatch.setattr(pages, "sealing_unavailable", lambda: "a kernel without the seal")
    with Restart(state_dir) as restart:
        assert restart.daemon.status()["daemon"]["token_pages"] == "file"
        page_path = state_dir / "pages" / f"{restart.record.id}.token.0"
        inode = page_path.stat().st_ino
        restart.restart()
        assert page_path.stat().st_ino == inode
        with ChannelClient(wait_served(restart.record)) as again:
            again.hello()
            grant = again.request_token(0)
            # Read while `again` is still connected: its close hands the token back and the
            # daemon clears the page (that read after the close raced in CI). The page is
            # written before the grant is sent, so this read cannot come too early.
            assert restart.tenant.page.valid_until_ns == grant.valid_until_ns   # old mapping


def test_control_socket_is_private(daemon: DaemonProcess, state_dir: Path) -> None:
    path = state_dir / "scheduler.sock"
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()


def test_bad_token_settings_stop_start_up() -> None:
    root = Path(tempfile.mkdtemp(prefix="gm-"))
    try:
        for args, words in ((("--min-quota", "0.5", "--max-quota", "0.1"), "min_quota"),
                            (("--limit-policy", "greedy",), "--limit-policy"),
                            (("--idle-release", "-1",), "--idle-release")):
            result = subprocess.run(
                [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir",
                 str(root / "s"), *args], capture_output=True, text=True, timeout=30, cwd=REPO)
            assert result.returncode == 2, result.stderr
            assert words in result.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_closed_waiter_is_forgotten(long_daemon: DaemonProcess, state_dir: Path) -> None:
    a = Tenant(make_record(state_dir))
    gone = Tenant(make_record(state_dir))
    c = Tenant(make_record(state_dir))
    try:
        a.client.request_token(0)
        a.busy()
        def queued(waiter: Tenant) -> bool:
            return bool(tenants_of(long_daemon)[waiter.record.id]["connections_waiting"] == 1)

        for waiter in (gone, c):            # gone waits first ...
            waiter.client.send_token_request(0)
            wait_for(functools.partial(queued, waiter), 5, "the request queued")
        gone.close()                        # ... and leaves while waiting
        a.client.release_token(0)
        c.client.recv_grant()               # the token does not get stuck with the departed
        assert c.page.valid()
    finally:
        a.close()
        c.close()


def test_usage_reports_are_accepted(long_daemon: DaemonProcess, state_dir: Path) -> None:
    tenant = Tenant(make_record(state_dir))
    try:
        now = time.monotonic_ns()
        tenant.client.report_usage(0, now - 5_000_000, now)
        tenant.client.report_usage(0, -1, -1)   # unknown: ignored, not an error
        assert tenant.client.request_token(0).status == C("GM_OK")
    finally:
        tenant.close()


def test_a_burst_reported_to_end_in_the_future_ends_now(long_daemon: DaemonProcess,
                                                         state_dir: Path) -> None:
    # A hostile hook's bursts: one claimed to run 100 s into the future would size the
    # tenant's quotas for it, and ends spaced into the future would be kept without bound.
    # The daemon's clock cuts the first to what has run, and drops the wholly future ones.
    tenant = Tenant(make_record(state_dir))
    try:
        now = time.monotonic_ns()
        tenant.client.report_usage(0, now - 1_000_000, now + 100 * NS)
        for i in range(1, 50):
            start = now + i * 100_000_000
            tenant.client.report_usage(0, start, start + 50 * NS)
        assert tenant.client.request_token(0).status == C("GM_OK")   # the reports are in
        burst_ms = tenants_of(long_daemon)[tenant.record.id]["burst_ms"]
        assert burst_ms is not None and 1.0 <= burst_ms < 1000.0
    finally:
        tenant.close()


def test_two_saturating_tenants_get_their_shares_end_to_end(daemon_process: DaemonProcess,
                                                            state_dir: Path) -> None:
    """Loose bound (0.05) on the split of the time held: the tight ones are the algorithm tests'
    and the share benchmark's. The split, not the part of the window held, since a worker
    starved of CPU on a loaded machine wakes late to its grants whatever the daemon decided
    (0.265 / 0.641 of the window there, a split of 0.293 / 0.707)."""
    shares = (0.3, 0.7)
    records = [make_record(state_dir, gpus=((UUID_A, 100 * MiB, s),)) for s in shares]
    seconds = 3.0
    start = time.monotonic_ns() + int(0.5 * NS)
    workers = [subprocess.Popen(
        [sys.executable, "-m", "tests.daemon.token_worker", str(wait_served(r)),
         str(start), str(seconds)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        for r in records]
    try:
        results = [json.loads(w.communicate(timeout=30)[0]) for w in workers]
    finally:
        for w in workers:
            w.kill()
    held = sum(r["held"] for r in results)
    split = [r["held"] / held for r in results]
    for got, wanted in zip(split, shares, strict=True):
        assert abs(got - wanted) <= 0.05, (split, results)
    # Someone holds the token nearly all the window: handoffs between processes cost little.
    assert held >= 0.8 * seconds, results
    tenants = tenants_of(daemon_process)
    assert set(tenants) == {r.id for r in records}, tenants
    assert all(t["revocations"] == 0 for t in tenants.values()), tenants


def test_removing_the_holders_record_hands_the_token_on(long_daemon: DaemonProcess,
                                                        state_dir: Path) -> None:
    from vgpu_runtime.contracts.allocation import remove_record
    a = Tenant(make_record(state_dir))
    b = Tenant(make_record(state_dir))
    try:
        grant = a.client.request_token(0)
        a.busy()
        b.client.send_token_request(0)
        assert b.pending(0.1)
        remove_record(state_dir, a.record.id)
        error = a.client.recv_frame()
        assert error is not None and error.status == C("GM_ERR_NO_ALLOCATION")
        b.client.recv_grant()
        assert time.monotonic_ns() < grant.valid_until_ns
        assert list(tenants_of(long_daemon)) == [b.record.id]
        assert a.page.valid_until_ns == 0
    finally:
        a.close()
        b.close()


def test_rewritten_share_rejoins_with_the_new_request(daemon: DaemonProcess,
                                                       state_dir: Path) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),))
    other = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),))
    wait_served(record)
    wait_served(other)
    make_record(state_dir, allocation_id=record.id, gpus=((UUID_A, 100 * MiB, 0.2),))
    wait_for(lambda: tenants_of(daemon)[record.id]["request"] == 0.2, 5, "new request")
    assert tenants_of(daemon)[other.id]["request"] == 0.5
    with ChannelClient(wait_served(record)) as client:
        assert client.hello().gpus[0].share_ppm == 200_000
        assert client.request_token(0).status == C("GM_OK")


def test_a_configured_token_path_is_ignored_with_a_warning(state_dir: Path) -> None:
    """token_path stays one release so that a node configuration naming it still loads; the
    daemon says the setting is ignored (there is one token implementation)."""
    daemon = InProcessDaemon(state_dir, "--token-path", "native").wait_ready()
    try:
        warned = [json.loads(line) for line in daemon.logs().splitlines()
                  if line.startswith("{") and "token_path is deprecated" in line]
        assert warned and warned[0]["token_path"] == "native"
    finally:
        assert daemon.stop() == 0, daemon.logs()
