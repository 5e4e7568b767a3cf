"""The context charge in the real daemon: simulated per-process figures, real socket clients.

The daemon runs with --process-memory simulated: it reads {GPU UUID: {pid: bytes}} from a file
every 50 ms, as it reads NVML on a GPU node. Clients are the Python wire client in this process
(its pid is the figure's key) or child processes (other pids).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import child_env
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
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.channel.process_memory import ContextCharger, charger_for
from vgpu_runtime.daemon.telemetry.metrics import render
from vgpu_runtime.devkit.daemon_process import DaemonStatus

C = wire.const
CONTEXT, POOL = C("GM_MEM_CONTEXT"), C("GM_MEM_POOL")
INTERVAL = "0.05"


class FigureFile:
    """What the simulated NVML reports, rewritten atomically like a fresh reading."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, figures: dict[str, dict[int, int]]) -> None:
        self.raw(json.dumps({uuid: {str(pid): used for pid, used in per_pid.items()}
                             for uuid, per_pid in figures.items()}))

    def raw(self, text: str) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(text)
        os.rename(temporary, self.path)


@pytest.fixture
def figures(state_dir: Path) -> FigureFile:
    state_dir.mkdir(parents=True, exist_ok=True)
    return FigureFile(state_dir.parent / "figures.json")


def charge_args(figures: FigureFile, source: str = "simulated") -> tuple[str, ...]:
    return ("--process-memory", source, "--process-memory-file", str(figures.path),
            "--process-memory-interval", INTERVAL)


def start_daemon(state_dir: Path, figures: FigureFile, source: str = "simulated"
                 ) -> InProcessDaemon:
    return InProcessDaemon(state_dir, *charge_args(figures, source)).wait_ready()


def start_daemon_process(state_dir: Path, figures: FigureFile) -> DaemonProcess:
    """A process: for the test that kills it."""
    return DaemonProcess(state_dir, *charge_args(figures)).wait_ready()


@pytest.fixture
def charged(state_dir: Path, figures: FigureFile) -> Iterator[InProcessDaemon]:
    proc = start_daemon(state_dir, figures)
    yield proc
    assert proc.stop() == 0, proc.logs()


def used(daemon: DaemonStatus, record: AllocationRecord, gpu: int = 0) -> int:
    return int(daemon.allocation(record.id)["gpus"][gpu]["memory_used"])


def wait_used(daemon: DaemonStatus, record: AllocationRecord, expected: int,
              gpu: int = 0) -> None:
    wait_for(lambda: used(daemon, record, gpu) == expected, 5.0,
             f"memory_used {expected} (now {used(daemon, record, gpu)})")


def charger(daemon: InProcessDaemon) -> ContextCharger:
    assert daemon.daemon is not None
    return charger_for(daemon.daemon.tokens, daemon.config)


def several_readings(daemon: InProcessDaemon, count: int = 3) -> None:
    """Wait for `count` more readings of the figures (the first may have begun before), for
    what must NOT change: counted, not timed, so a slow box cannot pass it unexercised."""
    begun = charger(daemon).readings
    wait_for(lambda: charger(daemon).readings >= begun + count, 5.0, f"{count} more readings")


def logged(daemon: DaemonProcess, text: str) -> bool:
    return text in daemon.logs()


def context_of(daemon: DaemonStatus, record: AllocationRecord, pid: int) -> Any:
    (conn,) = [c for c in daemon.allocation(record.id)["connections"] if c["peer_pid"] == pid]
    return conn["context"]


def test_charge_follows_the_process_figure(charged: DaemonProcess, state_dir: Path,
                                           figures: FigureFile) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5),))
    me = os.getpid()
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        client.reserve(0, 300 * MiB)
        client.set(0, 200 * MiB, CONTEXT)               # the hook's own measurement
        assert used(charged, record) == 500 * MiB
        figures.write({UUID_A: {me: 380 * MiB}})        # NVML: 300 declared + an 80 MiB context
        wait_used(charged, record, 380 * MiB)
        assert context_of(charged, record, me)["0"] == {
            "charged": 80 * MiB, "from": "simulated", "process_memory": 380 * MiB}
        # The hook's cuMemGetInfo asks with a zero-byte reservation: it sees the charge.
        assert client.reserve(0, 0).used == 380 * MiB
        figures.write({UUID_A: {me: 450 * MiB}})        # the context grew (modules loaded)
        wait_used(charged, record, 450 * MiB)
        client.release(0, 100 * MiB)                    # the charge is fixed until the next
        assert client.reserve(0, 0).used == 350 * MiB   # reading, whose figure still holds the
        wait_used(charged, record, 450 * MiB)           # freed 100 MiB: 200 + (450 - 200)
        figures.write({UUID_A: {me: 330 * MiB}})        # NVML catches up: 200 + 130 MiB context
        wait_used(charged, record, 330 * MiB)


def test_hook_number_stands_where_the_pid_has_no_figure(charged: InProcessDaemon,
                                                        state_dir: Path,
                                                        figures: FigureFile) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5), (UUID_B, 1000 * MiB, 0.5)))
    me = os.getpid()
    # Another pid, and this pid on a GPU outside the allocation: no figure for this connection.
    figures.write({UUID_A: {me + 1: 900 * MiB}, "GPU-elsewhere": {me: 900 * MiB}})
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        client.reserve(0, 100 * MiB)
        client.set(0, 50 * MiB, CONTEXT)
        client.set(1, 70 * MiB, CONTEXT)
        several_readings(charged)
        assert (used(charged, record, 0), used(charged, record, 1)) == (150 * MiB, 70 * MiB)
        assert context_of(charged, record, me)["0"]["from"] == "hook"
        figures.write({UUID_B: {me: 20 * MiB}})        # GPU B (index 1) only
        wait_used(charged, record, 20 * MiB, gpu=1)
        assert used(charged, record, 0) == 150 * MiB
        figures.write({})                               # gone from NVML: the hook's number
        wait_used(charged, record, 70 * MiB, gpu=1)


def test_charge_is_released_when_the_connection_closes(charged: DaemonProcess,
                                                       state_dir: Path,
                                                       figures: FigureFile) -> None:
    record = make_record(state_dir)
    me = os.getpid()
    figures.write({UUID_A: {me: 40 * MiB}})
    path = wait_served(record)
    with ChannelClient(path) as client:
        client.hello()
        wait_used(charged, record, 40 * MiB)
    wait_used(charged, record, 0)
    assert charged.allocation(record.id)["connections"] == []
    with ChannelClient(path) as again:                  # same pid, new connection: once
        again.hello()
        again.set(0, 10 * MiB, CONTEXT)
        wait_used(charged, record, 40 * MiB)


def test_two_connections_of_one_process_are_charged_once(charged: DaemonProcess,
                                                         state_dir: Path,
                                                         figures: FigureFile) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5),))
    me = os.getpid()
    figures.write({UUID_A: {me: 100 * MiB}})
    path = wait_served(record)
    with ChannelClient(path) as old:
        old.hello()
        wait_used(charged, record, 100 * MiB)
        with ChannelClient(path) as new:
            new.hello()
            new.reserve(0, 30 * MiB)
            # The newest connection takes the figure (100 - 30 declared = 70 of context); the
            # old one falls back to what it declared itself (nothing).
            wait_used(charged, record, 100 * MiB)
            conns = {c["connected_at"]: c["context"]["0"]["charged"]
                     for c in charged.allocation(record.id)["connections"]}
            assert [conns[t] for t in sorted(conns)] == [0, 70 * MiB]


CHILD = textwrap.dedent("""
    import os, sys
    from vgpu_runtime.daemon.channel.client import ChannelClient
    with ChannelClient(sys.argv[1]) as client:
        client.hello()
        client.reserve(0, int(sys.argv[2]))
        print(os.getpid(), flush=True)
        sys.stdin.readline()
""")


def test_each_process_is_charged_its_own_figure(charged: DaemonProcess, state_dir: Path,
                                                figures: FigureFile) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5),))
    path = wait_served(record)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(n * 10 * MiB)],
                                 cwd=REPO, env=child_env(), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for n in (1, 2)]
    try:
        pids = [int(child.stdout.readline()) for child in children]   # type: ignore[union-attr]
        wait_used(charged, record, 30 * MiB)
        figures.write({UUID_A: {pids[0]: 110 * MiB, pids[1]: 220 * MiB}})
        wait_used(charged, record, 330 * MiB)
        assert context_of(charged, record, pids[0])["0"]["charged"] == 100 * MiB
        assert context_of(charged, record, pids[1])["0"]["charged"] == 200 * MiB
        children[0].kill()                              # killed: its charge goes with it
        children[0].wait(10)
        wait_used(charged, record, 220 * MiB)
    finally:
        for child in children:
            child.kill()
            child.wait(10)


def test_restart_charges_each_process_once(state_dir: Path, figures: FigureFile) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5),))
    me = os.getpid()
    figures.write({UUID_A: {me: 260 * MiB}})

    def declare(client: ChannelClient) -> None:
        client.hello()
        client.set(0, 200 * MiB)                        # re-declared from the hook's books
        client.set(0, 90 * MiB, CONTEXT)

    first = start_daemon_process(state_dir, figures)
    try:
        with ChannelClient(wait_served(record)) as client:
            declare(client)
            wait_used(first, record, 260 * MiB)
            first.stop(signal.SIGKILL)
    finally:
        first.stop(signal.SIGKILL)
    second = start_daemon(state_dir, figures)
    try:
        with ChannelClient(wait_served(record)) as client:
            declare(client)
            wait_used(second, record, 260 * MiB)
            assert client.reserve(0, 0).used == 260 * MiB
            assert context_of(second, record, me)["0"]["charged"] == 60 * MiB
    finally:
        assert second.stop() == 0, second.logs()


def test_past_the_limit_is_charged_never_refused_and_counts(charged: DaemonProcess,
                                                            state_dir: Path,
                                                            figures: FigureFile) -> None:
    record = make_record(state_dir)                     # 100 MiB
    me = os.getpid()
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        assert client.reserve(0, 50 * MiB).granted
        figures.write({UUID_A: {me: 120 * MiB}})
        wait_used(charged, record, 120 * MiB)
        refused = client.reserve(0, 1 * MiB)
        assert (refused.status, refused.used) == (C("GM_ERR_OVER_LIMIT"), 120 * MiB)
        assert client.release(0, 50 * MiB).used == 70 * MiB   # the connection is fine


def test_bad_figures_withdraw_the_charge_and_lose_nothing(charged: DaemonProcess,
                                                          state_dir: Path,
                                                          figures: FigureFile) -> None:
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5),))
    me = os.getpid()
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        client.reserve(0, 10 * MiB)
        client.set(0, 5 * MiB, CONTEXT)
        figures.write({UUID_A: {me: 100 * MiB}})
        wait_used(charged, record, 100 * MiB)
        for bad, why in (("{not json", "is not JSON"),
                         (json.dumps({UUID_A: {str(me): -1}}), "negative byte count"),
                         (json.dumps({UUID_A: {"x": 1}}), "not an integer"),
                         (json.dumps([1]), "must map GPU UUIDs")):
            figures.raw(bad)
            wait_used(charged, record, 15 * MiB)        # the hook's numbers stand
            wait_for(functools.partial(logged, charged, why), what=f"log naming {why!r}")
            figures.write({UUID_A: {me: 100 * MiB}})
            wait_used(charged, record, 100 * MiB)
        assert client.reserve(0, 0).used == 100 * MiB   # the connection was never disturbed


def test_off_keeps_the_hook_measurement(state_dir: Path, figures: FigureFile) -> None:
    record = make_record(state_dir)
    figures.write({UUID_A: {os.getpid(): 90 * MiB}})
    daemon = start_daemon(state_dir, figures, source="off")
    try:
        with ChannelClient(wait_served(record)) as client:
            client.hello()
            client.set(0, 7 * MiB, CONTEXT)
            # Off: the source, once opened, is none, and nothing is ever read.
            wait_for(lambda: charger(daemon).opened, 5.0, "the source opened")
            assert charger(daemon).source is None and charger(daemon).readings == 0
            assert used(daemon, record) == 7 * MiB
    finally:
        assert daemon.stop() == 0, daemon.logs()


@pytest.mark.parametrize(("args", "message"), [
    (["--process-memory", "simulated"], "process_memory=simulated needs process_memory_file"),
    (["--process-memory", "sometimes"], "flag --process-memory: must be one of"),
    (["--process-memory-interval", "0"], "flag --process-memory-interval: must be at least"),
])
def test_bad_settings_stop_start_up_naming_the_field(state_dir: Path, args: list[str],
                                                     message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir",
                           str(state_dir), *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_process_past_the_limit_by_undeclared_memory_is_reported_once(
        charged: InProcessDaemon, state_dir: Path, figures: FigureFile) -> None:
    """NVML reconciliation for a connected process: its figure takes the allocation past the
    limit plus over_limit_tolerance (64 MiB) with memory the hook never declared (another API,
    an old entry point): one warning naming the pid, what it holds, what it declared and the
    limit, a count for the metric, and one line when it is back within."""
    record = make_record(state_dir, gpus=((UUID_A, 1000 * MiB, 0.5),))
    me = os.getpid()
    with ChannelClient(wait_served(record)) as client:
        client.hello()
        assert client.reserve(0, 300 * MiB).granted
        figures.write({UUID_A: {me: 1050 * MiB}})       # within the tolerance: not reported
        wait_used(charged, record, 1050 * MiB)
        several_readings(charged)
        assert charged.allocation(record.id)["gpus"][0]["over_limit"] is None
        figures.write({UUID_A: {me: 1500 * MiB}})       # 1.2 GiB the hook never saw
        wait_for(lambda: charged.allocation(record.id)["gpus"][0]["over_limit"] is not None,
                 5.0, "the report")
        several_readings(charged)                       # still one report
        gpu = charged.allocation(record.id)["gpus"][0]
        assert gpu["over_limit"] == {"pid": me, "process_bytes": 1500 * MiB,
                                     "declared_bytes": 300 * MiB, "connected": True,
                                     "used": 1500 * MiB, "limit": 1000 * MiB}
        assert gpu["over_limit_reports"] == 1
        assert charged.logs().count("the hook did not declare") == 1
        exposition = render(charged.status()).decode()
        assert re.search(rf'gemini_vgpu_memory_over_limit_reports_total{{[^}}]*allocation="'
                         rf'{record.id}"[^}}]*}} 1\.0', exposition), exposition
        figures.write({UUID_A: {me: 400 * MiB}})
        wait_for(lambda: charged.allocation(record.id)["gpus"][0]["over_limit"] is None, 5.0,
                 "back within the limit")
        assert charged.allocation(record.id)["gpus"][0]["over_limit_reports"] == 1
        assert "within its memory limit again" in charged.logs()
