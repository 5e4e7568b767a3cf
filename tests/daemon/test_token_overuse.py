"""Overuse is measured per process (per connection): the daemon's GpuTokens with real pages, a
real ledger and a clock the test moves.

A container (one tenant) runs several processes, each with its own hook and its own events. When
one says the work it queued before its previous ask is still running, that work has run since the
tenant's release seen at that ask, however many times the container's other processes asked in
between. Before this was tracked per connection, the tenant's second-to-last release stood in for
it, which is too late as soon as another process asks in between: an undercharge.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.tokenimpl import make_tokens
from vgpu_runtime.daemon.channel.ledger import MemoryLedger
from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
from vgpu_runtime.daemon.channel.tokens import TenantSlot, Waiter
from vgpu_runtime.daemon.config import DaemonConfig


class Connection(Waiter):
    def __init__(self) -> None:
        self.grants: list[int] = []    # generations granted

    def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
        self.grants.append(generation)


class Node:
    def __init__(self, root: Path) -> None:
        self.now = 100.0
        self.tokens = make_tokens(DaemonConfig(), lambda: self.now)
        for name in ("a", "b"):
            channel = root / name
            channel.mkdir()
            slot = TenantSlot(name, 0, TokenPage(channel / "token.0", GATE_TOKEN),
                              ActivityPage(channel / "activity.0"), MemoryLedger([1 << 30]))
            self.tokens.add(slot, 0.5, 1.0)

    def holder(self) -> str:
        grant = self.tokens.scheduler.holder
        assert grant is not None
        return grant.tenant

    def expiry(self) -> float:
        grant = self.tokens.scheduler.holder
        assert grant is not None
        return grant.expires_at

    def ask(self, tenant: str, conn: Connection, work_end: float | None = None,
            work_running: bool = False) -> None:
        self.tokens.request(conn, tenant, 1, None, work_end, work_running)

    def at_expiry(self, tenant: str, conn: Connection, work_end: float | None = None,
                  work_running: bool = False) -> float:
        """The holder's quota runs out and `conn` of `tenant` asks then: returns that moment."""
        self.now = self.expiry()
        self.ask(tenant, conn, work_end, work_running)
        return self.now

    def charged(self, tenant: str) -> float:
        return self.tokens.scheduler.tenants[tenant].usage.usage(self.now)


async def test_a_process_that_says_its_work_runs_is_charged_from_its_own_previous_ask(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    x, y, b = Connection(), Connection(), Connection()
    node.ask("a", x)                       # x's first ask: the container gets the token
    node.ask("b", b)
    started = node.now
    assert node.holder() == "a"
    node.at_expiry("a", x)                 # x's quota is over: its events go behind its work
    assert node.holder() == "b"
    node.at_expiry("b", b)
    assert node.holder() == "a"            # x is granted again
    node.at_expiry("a", y)                 # y, the container's other process, asks: a release
    assert node.holder() == "b"
    node.at_expiry("b", b)
    assert node.holder() == "a"            # granted to y
    node.now += 0.001
    node.ask("a", x, work_running=True)    # x: what it queued in its first grant still runs
    # Since x's first release, through b's two turns: all of the container's time so far.
    assert node.charged("a") == pytest.approx(node.now - started)
    scheduler = node.tokens.scheduler
    assert scheduler.tenants["a"].vtime - scheduler.tenants["b"].vtime > 0


async def test_the_report_after_running_ones_is_charged_from_the_ask_before_it(
        tmp_path: Path) -> None:
    node = Node(tmp_path)
    x, b = Connection(), Connection()
    node.ask("a", x)
    node.ask("b", b)
    started = node.now
    node.at_expiry("a", x)
    node.at_expiry("b", b)
    node.at_expiry("a", x, work_running=True)   # still running: charged up to now
    assert node.charged("a") == pytest.approx(node.now - started)
    while node.holder() != "a":            # b's turns while a's work runs on
        node.at_expiry(node.holder(), b)
    ended = node.now - 0.002               # 2 ms before a's grant: b's turn, all but that
    node.at_expiry("a", x, work_end=ended)   # found done: it ran until `ended`, unbroken
    assert node.charged("a") == pytest.approx(node.now - started - 0.002)
    assert x.grants and b.grants


async def test_a_process_that_never_says_running_is_charged_past_its_release_only(
        tmp_path: Path) -> None:
    # Sync mode: the work_end of x's ask is measured from the container's last release, never
    # from an older one, so b's turn before x's second grant is not charged to it.
    node = Node(tmp_path)
    x, b = Connection(), Connection()
    node.ask("a", x)
    node.ask("b", b)
    started = node.now
    first_end = node.at_expiry("a", x)
    node.at_expiry("b", b)
    assert node.holder() == "a"
    second_start, node.now = node.now, node.expiry()
    node.ask("a", x, work_end=node.now - 0.01)   # its work ended inside its own grant
    assert node.charged("a") == pytest.approx(first_end - started + node.now - second_start)


async def test_a_connection_asking_inside_its_own_grant_is_not_charged_for_it(
        tmp_path: Path) -> None:
    # A client that asks ahead, while the grant it was sent is still valid, reports the end of
    # work done in that grant: the grant is charged when it ends, and b's turn before it is
    # not a's (the bug, end to end: a 0.3 tenant held 0.17).
    node = Node(tmp_path)
    x, b = Connection(), Connection()
    node.ask("a", x)
    node.ask("b", b)
    node.at_expiry("a", x)
    node.at_expiry("b", b)
    assert node.holder() == "a" and len(x.grants) == 2
    before = node.charged("a")
    node.now = node.expiry() - 0.0005              # x asks ahead, inside its grant
    node.ask("a", x, work_end=node.now - 0.0001)
    assert node.charged("a") == pytest.approx(before)
    assert len(x.grants) == 3                      # answered with the grant it holds


async def test_another_process_reporting_during_the_containers_grant_is_charged(
        tmp_path: Path) -> None:
    # y, another process of the container, asks after x was granted: its work, launched before
    # that grant, ran on past the release before it, through b's turn.
    node = Node(tmp_path)
    x, y, b = Connection(), Connection(), Connection()
    node.ask("a", x)
    node.ask("b", b)
    released = node.at_expiry("a", x)
    assert node.holder() == "b"
    node.at_expiry("b", b)
    assert node.holder() == "a"                    # granted to x
    before = node.charged("a")
    node.now += 0.002
    node.ask("a", y, work_end=node.now - 0.001)
    assert node.charged("a") == pytest.approx(before + node.now - 0.001 - released)
