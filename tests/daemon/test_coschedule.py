"""Co-scheduling through the real daemon: two tenant processes, measured by the (simulated)
device utilisation source while each holds the GPU alone, hold it at once when they leave it
room, and take turns when one is GPU-bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.helpers import REPO, UUID_A, MiB, make_record, wait_for, wait_served
from tests.daemon.inprocess import InProcessDaemon
from tests.mpsfake import fake_mps_control
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.timeshare.policy import MEASURE_IDLE

# A tenant process: hello, then one command a line: "ask" prints the grant it gets (blocking
# until it comes) and launches, "sync" ends that work (idle from then), "release" gives the
# token back.
TENANT = """
import json, os, sys
from vgpu_runtime.daemon.channel.client import ChannelClient
client = ChannelClient(sys.argv[1], timeout=30)
client.hello()
activity = client.activity_page(0)
print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    if line.strip() == "ask":
        grant = client.request_token(0)
        activity.launched()   # work in flight: busy, never released as idle
        print(json.dumps({"generation": grant.generation}), flush=True)
    elif line.strip() == "sync":
        activity.synced()
    elif line.strip() == "release":
        client.release_token(0)
"""


class TenantProcess:
    def __init__(self, socket: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TENANT, str(socket)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = int(self._line()["pid"])
        self.pending = False

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the tenant process ended"
        return dict(json.loads(line))

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self) -> None:
        self.send("ask")
        self.pending = True

    def granted(self, timeout: float = 5.0) -> bool:
        """Whether its ask was answered within `timeout`."""
        import select
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if ready:
            self._line()
            self.pending = False
        return not self.pending

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture
def busy_file(tmp_path: Path) -> Path:
    return tmp_path / "busy.json"


@pytest.fixture
def daemon(state_dir: Path, busy_file: Path) -> Iterator[InProcessDaemon]:
    served = InProcessDaemon(state_dir, "--co-schedule", "on", "--gpu-busy", "simulated",
                             "--gpu-busy-file", str(busy_file)).wait_ready()
    yield served
    assert served.stop() == 0, served.logs()


@pytest.fixture
def pair(daemon: InProcessDaemon, state_dir: Path) -> Iterator[tuple[list[Any], list[
        TenantProcess]]]:
    """Two allocations of half the GPU, each with a tenant process connected."""
    records = [make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),)) for _ in range(2)]
    tenants = [TenantProcess(wait_served(r)) for r in records]
    yield records, tenants
    for tenant in tenants:
        tenant.close()


def gpu_status(daemon: InProcessDaemon) -> dict[str, Any]:
    (gpu,) = [g for g in daemon.status()["gpus"] if g["uuid"] == UUID_A]
    return dict(gpu)


def measure_alone(daemon: InProcessDaemon, busy_file: Path, tenant: TenantProcess,
                  allocation: str, busy: float, rows: list[list[float]]) -> None:
    """The tenant holds the GPU alone for a while; the simulated NVML then says how busy the
    device was over two 0.2 s periods inside that hold, and the daemon takes the figure."""
    tenant.ask()
    assert tenant.granted()
    start = time.monotonic()
    while time.monotonic() < start + 0.45:   # asking again as each quota ends, as a hook does
        time.sleep(0.03)
        tenant.ask()
        assert tenant.granted()
    rows += [[start + 0.2, busy], [start + 0.4, busy]]
    tenant.send("release")
    busy_file.write_text(json.dumps({UUID_A: rows}))
    wait_for(lambda: {t["allocation"]: t for t in gpu_status(daemon)["tenants"]}[allocation]
             ["busy"] is not None, 5, f"{allocation}'s busy fraction")


# A GPU-bound tenant counts for the whole GPU: beside it only a light tenant fits co_room.
@pytest.mark.parametrize("busy, together", [((0.2, 0.3), True), ((0.95, 0.5), False),
                                            ((0.95, 0.15), True)],
                         ids=["room", "gpu-bound", "light-beside-gpu-bound"])
def test_tenants_with_room_hold_the_gpu_at_once_and_gpu_bound_ones_take_turns(
        daemon: InProcessDaemon, pair: tuple[list[Any], list[TenantProcess]], busy_file: Path,
        busy: tuple[float, float], together: bool) -> None:
    records, tenants = pair
    rows: list[list[float]] = []
    for tenant, record, fraction in zip(tenants, records, busy, strict=True):
        measure_alone(daemon, busy_file, tenant, record.id, fraction, rows)
    tenants[0].ask()
    assert tenants[0].granted()
    tenants[1].ask()
    assert tenants[1].granted(timeout=0.1 if not together else 5.0) == together
    # Granted beside the holder (a count: the grants themselves end within a quota).
    assert (gpu_status(daemon)["co_grants"] >= 1) == together
    if not together:
        tenants[0].send("release")
        assert tenants[1].granted()   # its turn comes once the GPU-bound one is done


def test_a_period_nobody_held_alone_gives_nobody_a_figure(
        daemon: InProcessDaemon, pair: tuple[list[Any], list[TenantProcess]],
        busy_file: Path) -> None:
    now = time.monotonic()   # the GPU was busy, but no tenant held it then
    busy_file.write_text(json.dumps({UUID_A: [[now - 0.6, 0.9], [now - 0.4, 0.9]]}))
    assert daemon.daemon is not None
    sampler = daemon.daemon.tokens.sampler
    begun = sampler.readings   # three more: the last two read the file whole and were taken
    wait_for(lambda: sampler.readings >= begun + 3, 5, "three more readings")
    assert [t["busy"] for t in gpu_status(daemon)["tenants"]] == [None, None]


def test_a_malformed_busy_file_is_reported_and_changes_nothing(
        daemon: InProcessDaemon, pair: tuple[list[Any], list[TenantProcess]],
        busy_file: Path) -> None:
    busy_file.write_text(json.dumps({UUID_A: [[time.monotonic(), 7]]}))
    wait_for(lambda: "busy fraction outside [0, 1]" in daemon.logs(), 5, "the warning")
    assert [t["busy"] for t in gpu_status(daemon)["tenants"]] == [None, None]


def test_tenants_of_an_mps_server_are_co_scheduled_as_overlapping() -> None:
    """Where the daemon runs its tenants as clients of one MPS server, co-held kernels run side
    by side, and the algorithm is told so (policy.py, `co_overlap`)."""
    assert DaemonConfig(mps=True).algorithm().co_overlap
    assert not DaemonConfig().algorithm().co_overlap


def test_over_mps_a_measuring_turn_outlasts_the_idle_release_until_its_holder_idles_long(
        state_dir: Path, busy_file: Path, tmp_path: Path) -> None:
    """Over MPS an unmeasured tenant's turn is its measurement (policy.py, MEASURE_TURN): the
    idle release (2 ms) does not cut it short while another waits, but a holder idle for
    MEASURE_IDLE is released, rather than holding the GPU to its quota's end for nothing (a
    start-up's launch, then seconds of host work)."""
    served = InProcessDaemon(state_dir, "--co-schedule", "on", "--mps", "on", "--mps-manage",
                             "false", "--mps-control", str(fake_mps_control(tmp_path)),
                             "--gpu-busy", "simulated",
                             "--gpu-busy-file", str(busy_file)).wait_ready()
    records = [make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.5),)) for _ in range(2)]
    a, b = (TenantProcess(wait_served(r)) for r in records)
    try:
        before_launch = time.monotonic()
        a.ask()
        assert a.granted()
        a.send("sync")           # launched once, synced, idle from here
        b.ask()
        assert b.granted(timeout=2.0)
        # Released no earlier than MEASURE_IDLE after its launch, and as idle, not at the end
        # of its quota (MEASURE_TURN).
        assert time.monotonic() - before_launch >= MEASURE_IDLE
        assert gpu_status(served)["idle_releases"] == 1
    finally:
        a.close()
        b.close()
        assert served.stop() == 0, served.logs()
