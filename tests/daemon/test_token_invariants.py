"""The time-share invariants on the daemon's GpuTokens (real pages, a clock the test moves), over
generated sequences of asks with any report (none, work just ended, a bogus report that claims
all the time since the release), releases, closed connections and time passing (0 to 3 s, so
quotas expire and tokens are revoked).

After every step:
* exclusive holding: at most one tenant's page is valid at the clock's now, and it is the
  scheduler's holder's;
* bounded debt: no active tenant is more than `debt` GPU seconds ahead of the least advanced
  active one, no capped tenant below its credit floor;
* no idle GPU while someone is entitled: while a connection waits whose tenant has credit (or
  no cap), the token is held.
Deadlines (revocations, a capped tenant's credit) run when the clock passes them, as the
daemon's timer would; the test never yields to the event loop, so no real timer fires.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon.tokenimpl import make_tokens, run_timers, waiting_connections
from tests.examples import examples
from vgpu_runtime.daemon.channel.ledger import MemoryLedger
from vgpu_runtime.daemon.channel.pages import GATE_TOKEN, ActivityPage, TokenPage
from vgpu_runtime.daemon.channel.tokens import TenantSlot, Waiter
from vgpu_runtime.daemon.config import DaemonConfig

NS = 1_000_000_000


class Connection(Waiter):
    def send_grant(self, seq: int, gpu: int, generation: int, valid_until_ns: int) -> None:
        pass


tenant_strategy = st.tuples(st.integers(1, 5), st.booleans())   # request in tenths, capped
step_strategy = st.one_of(
    st.tuples(st.just("ask"), st.integers(0, 7), st.integers(0, 1),
              st.sampled_from(["none", "ended", "since-release"])),
    st.tuples(st.just("release"), st.integers(0, 7)),
    st.tuples(st.just("close"), st.integers(0, 7), st.integers(0, 1)),
    st.tuples(st.just("wait"), st.floats(0.0, 3.0)),
)


class Node:
    def __init__(self, root: Path, tenants: list[tuple[int, bool]]) -> None:
        self.now = 1000.0
        self.config = DaemonConfig()
        self.tokens = make_tokens(self.config, lambda: self.now)
        self.names = [f"t{i}" for i in range(len(tenants))]
        self.conns = {name: [Connection(), Connection()] for name in self.names}
        for name, (request, capped) in zip(self.names, tenants, strict=True):
            channel = root / name
            channel.mkdir()
            slot = TenantSlot(name, 0, TokenPage(channel / "token.0", GATE_TOKEN),
                              ActivityPage(channel / "activity.0"), MemoryLedger([1 << 30]))
            self.tokens.add(slot, request / 10, request / 10 if capped else 1.0)

    def step(self, step: tuple[Any, ...]) -> None:
        kind = step[0]
        scheduler = self.tokens.scheduler
        if kind == "ask":
            name = self.names[int(step[1]) % len(self.names)]
            conn = self.conns[name][int(step[2])]
            released = scheduler.tenants[name].last_release
            work_end = {"none": None, "ended": self.now - 0.001,
                        "since-release": self.now}[str(step[3])]
            if released is None and work_end is not None:
                work_end = None
            self.tokens.request(conn, name, 1, None, work_end)
        elif kind == "release":
            name = self.names[int(step[1]) % len(self.names)]
            self.tokens.release(name, None)
        elif kind == "close":
            name = self.names[int(step[1]) % len(self.names)]
            conn = self.conns[name][int(step[2])]
            self.tokens.connection_closed(conn, name, last=False)
        else:
            self.wait(float(step[1]))

    def wait(self, seconds: float) -> None:
        """Time passes; each timer on the way runs at its time, as the daemon's would."""
        run_timers(self.tokens, self, self.now + seconds)

    def violation(self) -> str | None:
        scheduler = self.tokens.scheduler
        now_ns = round(self.now * NS)
        valid = [name for name, slot in self.tokens.slots.items()
                 if slot.page.valid_until_ns > now_ns]
        holder = scheduler.holder
        if len(valid) > 1 or (valid and (holder is None or valid != [holder.tenant])):
            return f"pages valid for {valid}, holder {holder}"
        shares = scheduler.shares()
        active = [t for t in scheduler.tenants.values()
                  if t.waiting_since is not None or (holder and holder.tenant == t.id)]
        if active:
            floor = min(t.vtime for t in active)
            for t in active:
                if (t.vtime - floor) * shares[t.id] > self.config.algorithm().debt + 1e-6:
                    return f"{t.id} {(t.vtime - floor) * shares[t.id]:.3f} s ahead"
        for t in scheduler.tenants.values():
            if t.limit < 1 and t.credit < self.config.algorithm().credit_floor(t.limit) - 1e-6:
                return f"{t.id} credit {t.credit:.3f}"
        if holder is None:
            waiting = [name for name in self.tokens.slots
                       if waiting_connections(self.tokens, name)
                       and scheduler._has_credit(scheduler.tenants[name], self.now)]
            if waiting:
                return f"no holder while {waiting} wait with credit"
        return None


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tenant_strategy, min_size=2, max_size=4),
       st.lists(step_strategy, min_size=1, max_size=40))
def test_gpu_tokens_keep_the_invariants_over_generated_steps(
        tenants: list[tuple[int, bool]],
        steps: list[tuple[Any, ...]]) -> None:
    async def body() -> None:
        with tempfile.TemporaryDirectory(prefix="gti-") as tmp:
            node = Node(Path(tmp), tenants)
            try:
                for index, step in enumerate(steps):
                    node.step(step)
                    problem = node.violation()
                    assert problem is None, (index, step, problem)
            finally:
                node.tokens.close()
    asyncio.run(body())
