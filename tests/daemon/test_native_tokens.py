"""The native token code (nativetokens.NativeGpuTokens over native/tokens.c) against tokens.py's
GpuTokens: the same generated steps on both, each with its own real pages and a clock the test
moves, compared after every step: the grants sent (connection, seq, GPU index, generation,
valid_until_ns, in order), every token page (generation, valid_until_ns, gate), when the next
timer runs, the snapshot (the JSON status and metrics are made of) and the log lines.

Steps: asks with any report (none, work just ended, a bogus one reaching back to the release,
work still running), burst hints, releases, connections closing (the tenant's last or not),
launches and syncs written to the activity pages (the idle check), bursts observed, limits
changed, a tenant leaving and rejoining with the same slot (its waiting connections kept), and
time passing (short, so idle checks run; long, so quotas expire and tokens are revoked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon.tokenimpl import AnyTokens, make_tokens, run_timers
from vgpu_runtime.daemon.channel import nativetokens
from vgpu_runtime.daemon.channel.ledger import MemoryLedger
from vgpu_runtime.daemon.channel.nativetokens import NativeGpuTokens, TokenCapacityError
from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
from vgpu_runtime.daemon.channel.tokens import TenantSlot, Waiter
from vgpu_runtime.daemon.config import DaemonConfig

NS = 1_000_000_000
CONNECTIONS = 3   # per tenant; the last has no activity page (a version-1 hook)
LOGGED = ("gpu", "allocation", "generation", "quota_ms", "overrun_ms", "held_ms")


class Lines(logging.Handler):
    """The token code's log lines: message and fields."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[Any, ...]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage(),
                           *(getattr(record, name, None) for name in LOGGED)))


class Connection(Waiter):
    def __init__(self, name: str, sent: list[tuple[Any, ...]], has_page: bool) -> None:
        self.name = name
        self.sent = sent
        self.has_activity_page = has_page

    def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
        self.sent.append((self.name, seq, gpu, generation, valid_until_ns))


class Node:
    """One implementation with its own pages; `now` is its clock."""

    def __init__(self, implementation: str, root: Path, tenants: list[tuple[int, bool]],
                 config: DaemonConfig, lines: Lines) -> None:
        self.now = 1000.0
        self.sent: list[tuple[Any, ...]] = []
        self.lines = lines
        self.logged: list[tuple[Any, ...]] = []
        self.tokens: AnyTokens = make_tokens(implementation, config, lambda: self.now)
        self.names = [f"t{i}" for i in range(len(tenants))]
        self.shares = {name: (request / 10, request / 10 if capped else 1.0)
                       for name, (request, capped) in zip(self.names, tenants, strict=True)}
        self.conns = {name: [Connection(f"{name}/{i}", self.sent, i < CONNECTIONS - 1)
                             for i in range(CONNECTIONS)] for name in self.names}
        self.slots: dict[str, TenantSlot] = {}
        for index, name in enumerate(self.names):
            channel = root / implementation / name
            channel.mkdir(parents=True)
            self.slots[name] = TenantSlot(
                name, index % 2, TokenPage(channel / "token", GATE_TOKEN),
                ActivityPage(channel / "activity"), MemoryLedger([1 << 30, 1 << 30]))
            self.tokens.add(self.slots[name], *self.shares[name])

    def step(self, step: tuple[Any, ...]) -> None:
        self.lines.lines = self.logged
        try:
            self._step(step)
        finally:
            self.lines.lines = []

    def _step(self, step: tuple[Any, ...]) -> None:
        kind, tokens = step[0], self.tokens
        name = self.names[int(step[1]) % len(self.names)] if kind != "wait" else ""
        if kind == "ask":
            _, _, conn, report, hint, running, seq = step
            released = tokens.scheduler.tenants[name].last_release
            work_end = {"none": None, "ended": self.now - 0.001,
                        "since-release": self.now}[report]
            if released is None and work_end is not None:
                work_end = None
            tokens.request(self.conns[name][conn], name, seq, hint, work_end, running)
        elif kind == "release":
            tokens.release(name, self.now - 0.0005 if step[2] else None)
        elif kind == "close":
            tokens.connection_closed(self.conns[name][step[2]], name, last=step[3])
        elif kind == "activity":
            page: Any = self.slots[name].activity._page
            page.last_launch_ns = round((self.now - step[2]) * NS)
            page.last_sync_ns = -1 if step[3] is None else round((self.now - step[3]) * NS)
            page.launches += 1
        elif kind == "burst":
            start = self.now - step[2]
            tokens.observe_burst(name, start, start + step[3])   # perhaps past now: clamped
        elif kind == "limit":
            tokens.set_limit(name, step[2])
        elif kind == "rejoin":
            slot = tokens.remove(name)
            assert slot is self.slots[name]
            tokens.add(slot, *self.shares[name])
        else:
            run_timers(tokens, self, self.now + float(step[1]))

    def state(self) -> dict[str, Any]:
        tokens = self.tokens
        return {
            "sent": list(self.sent),
            "pages": {name: (slot.page.generation, slot.page.valid_until_ns, slot.page.gate)
                      for name, slot in self.slots.items()},
            "wakeup": tokens.next_wakeup(),
            "snapshot": json.dumps(tokens.snapshot(), sort_keys=True),
            "logged": list(self.logged),
        }


tenant_strategy = st.tuples(st.integers(1, 6), st.booleans())   # request in tenths, capped
tenant_index = st.integers(0, 3)
ask_strategy = st.tuples(
    st.just("ask"), tenant_index, st.integers(0, CONNECTIONS - 1),
    st.sampled_from(["none", "ended", "since-release"]),
    st.sampled_from([None, 0.0005, 0.004, 0.05]), st.booleans(), st.integers(0, 2**32 - 1))
short_wait = st.tuples(st.just("wait"), st.floats(0.0, 0.01))
# Asks and short waits weigh more: the idle check and the hand-overs need several in a row.
step_strategy = st.one_of(
    ask_strategy, ask_strategy, ask_strategy, short_wait, short_wait,
    st.tuples(st.just("release"), tenant_index, st.booleans()),
    st.tuples(st.just("close"), tenant_index, st.integers(0, CONNECTIONS - 1), st.booleans()),
    st.tuples(st.just("activity"), tenant_index, st.sampled_from([0.0, 0.001, 0.003, 0.02]),
              st.sampled_from([None, 0.0, 0.002, 0.05])),
    st.tuples(st.just("burst"), tenant_index, st.sampled_from([0.0002, 0.003, 0.03]),
              st.sampled_from([0.0001, 0.003, 0.1])),
    st.tuples(st.just("limit"), tenant_index, st.sampled_from([0.2, 0.5, 1.0])),
    st.tuples(st.just("rejoin"), tenant_index),
    st.tuples(st.just("wait"), st.one_of(st.floats(0.0, 0.01), st.floats(0.0, 0.2),
                                         st.floats(0.0, 3.0))),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tenant_strategy, min_size=1, max_size=4),
       st.lists(step_strategy, min_size=20, max_size=80),
       st.sampled_from([0.002, 0.0005]))
def test_native_gpu_tokens_do_what_gpu_tokens_do_step_by_step(
        tenants: list[tuple[int, bool]], steps: list[tuple[Any, ...]],
        idle_release: float) -> None:
    config = DaemonConfig(idle_release=idle_release)

    async def body() -> None:
        logger = logging.getLogger("vgpu_runtime.daemon.channel.tokens")
        lines, level = Lines(), logger.level
        logger.addHandler(lines)
        logger.setLevel(logging.DEBUG)   # the debug lines too: every grant, every idle release
        with tempfile.TemporaryDirectory(prefix="gnt-") as tmp:
            python = Node("python", Path(tmp), tenants, config, lines)
            native = Node("native", Path(tmp), tenants, config, lines)
            try:
                assert native.state() == python.state()
                for index, step in enumerate(steps):
                    python.step(step)
                    native.step(step)
                    assert native.now == python.now
                    assert native.state() == python.state(), (index, step)
            finally:
                python.tokens.close()
                native.tokens.close()
                logger.removeHandler(lines)
                logger.setLevel(level)
    asyncio.run(body())


# ---- bad input: a clear error, nothing changed ----

def _native(tmp: Path) -> tuple[Node, str]:
    node = Node("native", tmp, [(3, False), (3, False)], DaemonConfig(), Lines())
    return node, json.dumps(node.state(), sort_keys=True)


async def test_an_unknown_allocation_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    node, before = _native(tmp_path)
    tokens = node.tokens
    conn = node.conns["t0"][0]
    with pytest.raises(KeyError):
        tokens.request(conn, "nobody", 1, None, None)
    with pytest.raises(KeyError):
        tokens.set_limit("nobody", 0.5)
    with pytest.raises(KeyError):
        tokens.observe_burst("nobody", 1.0, 2.0)
    assert tokens.remove("nobody") is None
    tokens.connection_closed(conn, "nobody", last=True)
    assert json.dumps(node.state(), sort_keys=True) == before
    assert isinstance(tokens, NativeGpuTokens) and not tokens._conn_ids
    tokens.close()


async def test_a_connection_asking_through_two_allocations_is_refused(tmp_path: Path) -> None:
    node, _ = _native(tmp_path)
    tokens = node.tokens
    conn = node.conns["t0"][0]
    tokens.request(conn, "t0", 1, None, None)
    before = json.dumps(node.state(), sort_keys=True)
    with pytest.raises(ValueError, match="another allocation"):
        tokens.request(conn, "t1", 2, None, None)
    assert json.dumps(node.state(), sort_keys=True) == before
    tokens.close()


async def test_bad_limits_and_shares_are_refused_and_change_nothing(tmp_path: Path) -> None:
    node, before = _native(tmp_path)
    tokens = node.tokens
    with pytest.raises(ValueError):
        tokens.set_limit("t0", 1.5)
    slot = TenantSlot("t9", 0, TokenPage(tmp_path / "t9.token", GATE_TOKEN),
                      ActivityPage(tmp_path / "t9.activity"), MemoryLedger([1 << 30]))
    with pytest.raises(ValueError):
        tokens.add(slot, 0.0, 1.0)
    with pytest.raises(ValueError, match="already scheduled"):
        tokens.add(node.slots["t0"], 0.3, 1.0)
    assert json.dumps(node.state(), sort_keys=True) == before
    assert isinstance(tokens, NativeGpuTokens)
    assert not tokens._known.keys() - {id(s) for s in node.slots.values()}
    tokens.close()


async def test_connections_past_the_bound_are_refused_and_change_nothing(
        tmp_path: Path) -> None:
    node, _ = _native(tmp_path)
    tokens = node.tokens
    assert isinstance(tokens, NativeGpuTokens)
    bound = nativetokens.library().TD_MAX_CONNECTIONS
    many = [Connection(f"c{i}", node.sent, True) for i in range(bound)]
    for i, conn in enumerate(many):
        tokens.request(conn, "t0", i, None, None)
    before = json.dumps(node.state(), sort_keys=True)
    extra = Connection("extra", node.sent, True)
    with pytest.raises(TokenCapacityError, match="connections"):
        tokens.request(extra, "t1", 1, None, None)
    assert json.dumps(node.state(), sort_keys=True) == before
    # One closes: its id is free again, and the next connection gets it.
    tokens.connection_closed(many[0], "t0", last=False)
    tokens.request(extra, "t1", 1, None, None)
    assert tokens._conn_ids[extra] == 0
    tokens.close()


async def test_a_removed_slot_is_forgotten_once_nothing_holds_it(tmp_path: Path) -> None:
    node, _ = _native(tmp_path)
    tokens = node.tokens
    assert isinstance(tokens, NativeGpuTokens)
    tokens.request(node.conns["t1"][0], "t1", 1, None, None)
    slot = tokens.remove("t1")
    assert slot is not None and len(tokens._detached) == 1
    del node.slots["t1"], node.conns["t1"], slot
    assert tokens._gone and tokens._detached   # freed at the next add, between calls
    again = TenantSlot("t2", 0, TokenPage(tmp_path / "t2.token", GATE_TOKEN),
                       ActivityPage(tmp_path / "t2.activity"), MemoryLedger([1 << 30]))
    tokens.add(again, 0.3, 1.0)
    assert not tokens._detached and not tokens._gone and len(tokens._known) == 2
    assert len(tokens._conn_ids) == 0 or all(
        tokens._lib.td_connection_slot(tokens._gpu, c) >= 0 for c in tokens._conn_ids.values())
    tokens.close()


def test_the_wait_buckets_are_the_same_in_c() -> None:
    lib = nativetokens.library()
    from vgpu_runtime.daemon.channel.tokens import WAIT_BUCKETS
    assert list(nativetokens.ffi.unpack(lib.td_wait_bounds(), lib.TD_WAIT_BUCKETS)) == list(
        WAIT_BUCKETS)
    assert not math.isnan(WAIT_BUCKETS[0])


async def test_the_c_api_refuses_ids_out_of_range_and_changes_nothing(tmp_path: Path) -> None:
    node, _ = _native(tmp_path)
    tokens = node.tokens
    assert isinstance(tokens, NativeGpuTokens)
    tokens.request(node.conns["t0"][0], "t0", 1, None, None)
    before = json.dumps(node.state(), sort_keys=True)
    lib, gpu, out, nan = tokens._lib, tokens._gpu, tokens._out, math.nan
    slot = tokens._attached["t0"]
    for conn in (-1, lib.TD_MAX_CONNECTIONS, 1 << 30):
        assert lib.td_request(gpu, conn, True, slot, 1, nan, nan, False, node.now,
                              out) == lib.TD_EINVAL
    assert lib.td_connection_closed(gpu, -2, slot, True, node.now, out) == lib.TD_EINVAL
    for bad in (-1, lib.TD_MAX_SLOTS, 77):
        assert lib.td_release(gpu, bad, nan, node.now, out) == lib.TD_ENOENT
        assert lib.td_request(gpu, 5, True, bad, 1, nan, nan, False, node.now,
                              out) == lib.TD_ENOENT
        assert lib.td_slot_free(gpu, bad) == lib.TD_ENOENT
    assert lib.td_slot_free(gpu, slot) == lib.TD_EINVAL          # attached: remove it first
    assert lib.td_attach(gpu, slot, 0, node.now, out) == lib.TD_EINVAL   # attached already
    assert lib.td_connection_slot(gpu, 5) == -1
    assert json.dumps(node.state(), sort_keys=True) == before
    tokens.close()


def test_many_tenants_on_one_gpu_alike() -> None:
    """Past the 64 tenants a GPU once took: 150 allocations asking in turn, every release and
    quota end, compared as above after each step."""
    tenants = [(1 + i % 6, i % 3 == 0) for i in range(150)]
    config = DaemonConfig()

    async def body() -> None:
        with tempfile.TemporaryDirectory(prefix="gnt-") as tmp:
            python = Node("python", Path(tmp), tenants, config, Lines())
            native = Node("native", Path(tmp), tenants, config, Lines())
            python.names = native.names = [f"t{i}" for i in range(len(tenants))]
            steps: list[tuple[Any, ...]] = []
            for i in range(len(tenants)):
                steps.append(("ask", i, i % 2, "none", None, False, i))
            for i in range(0, len(tenants), 7):
                steps += [("release", i, True), ("wait", 0.05), ("rejoin", i + 3)]
            try:
                for index, step in enumerate(steps):
                    python.step(step)
                    native.step(step)
                    assert native.state() == python.state(), (index, step)
            finally:
                python.tokens.close()
                native.tokens.close()
    asyncio.run(body())
