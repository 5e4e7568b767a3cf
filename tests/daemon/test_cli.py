"""`gemini-vgpu status`, run as a process against the real daemon."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

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
from vgpu_runtime.contracts import allocation
from vgpu_runtime.daemon import lock
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.gpus.simulated import SimulatedBackend


def run_status(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "status", "--state-dir",
                           str(state_dir), *args], capture_output=True, text=True, timeout=30,
                          cwd=REPO)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", *args], capture_output=True,
                          text=True, timeout=30, cwd=REPO, env=child_env(**(env or {})))


def test_status_without_allocations_lists_the_gpus_and_what_is_free(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    first, second = SimulatedBackend(2).discover()
    daemon = InProcessDaemon(state_dir, "--simulate-gpus", "2").wait_ready()
    try:
        # No --state-dir: GEMINI_STATE_DIR names it, as for every other program.
        env = child_env(GEMINI_STATE_DIR=str(state_dir), COLUMNS="400")
        status = [sys.executable, "-m", "vgpu_runtime.cli", "status"]
        empty = subprocess.run(status, capture_output=True, text=True, timeout=30, cwd=REPO,
                               env=env)
        assert empty.returncode == 0, empty.stderr
        for gpu in (first, second):
            (row,) = [line.split() for line in empty.stdout.splitlines() if gpu.uuid in line]
            assert row[0] == str(gpu.index) and row[-5:] == ["1.00", "10", "of", "10", "healthy"]
        assert "no allocations" in empty.stdout
        record = make_record(state_dir, gpus=((second.uuid, 100 * MiB, 0.3),))
        wait_served(record)
        used = subprocess.run(status, capture_output=True, text=True, timeout=30, cwd=REPO,
                              env=env)
    finally:
        assert daemon.stop() == 0, daemon.logs()
    assert used.returncode == 0, used.stderr
    (row,) = [line.split() for line in used.stdout.splitlines()
              if line.lstrip().startswith(f"{second.index} ")]
    assert row[1] == second.uuid and row[-5:] == ["0.70", "7", "of", "10", "healthy"]


def test_status_prints_a_table_per_gpu_and_container(state_dir: Path) -> None:
    # Quotas far longer than the status command takes to start, so the holder is still the
    # holder when it asks (with default quotas of tens of ms this raced on a loaded box).
    state_dir.mkdir(parents=True, exist_ok=True)
    daemon = InProcessDaemon(state_dir, "--window", "60", "--min-quota", "9",
                             "--max-quota", "9").wait_ready()
    try:
        check_status_table(state_dir)
    finally:
        assert daemon.stop() == 0, daemon.logs()


def check_status_table(state_dir: Path) -> None:
    holder = make_record(state_dir, gpus=((UUID_A, 100 * MiB, 0.3),), limit=0.6)
    waiter = make_record(state_dir, gpus=((UUID_A, 200 * MiB, 0.7),), origin="gemini-run",
                         owner_pid=4242)
    whole = make_record(state_dir, gpus=((UUID_B, 300 * MiB, 1.0),))
    wait_served(whole)
    with ChannelClient(wait_served(holder)) as first, ChannelClient(wait_served(waiter)) as other:
        first.hello()
        other.hello()
        first.reserve(0, 10 * MiB)
        first.request_token(0)
        result = run_status(state_dir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"GPU {UUID_A}  gate: token  holder now: {holder.id}" in out
    assert f"GPU {UUID_B}  gate: open" in out
    for column in ("REQUEST", "LIMIT", "ACHIEVED", "MEMORY USED / LIMIT", "WAIT P50", "WAIT P99",
                   "HOLDER"):
        assert column in out
    (holder_row,) = [line for line in out.splitlines() if holder.id in line and "GPU" not in line]
    assert "0.30" in holder_row and "0.60" in holder_row and holder_row.rstrip().endswith("*")
    assert "10.0 MiB / 100.0 MiB" in holder_row
    (waiter_row,) = [line for line in out.splitlines() if waiter.id in line]
    assert "gemini-run pid 4242" in waiter_row and "0.70" in waiter_row
    assert "1.00" in next(line for line in out.splitlines() if whole.id in line)


def test_status_json_parses(state_dir: Path) -> None:
    # Long quotas, as above: the holder must still hold when the status process asks.
    state_dir.mkdir(parents=True, exist_ok=True)
    daemon = InProcessDaemon(state_dir, "--window", "60", "--min-quota", "9",
                             "--max-quota", "9").wait_ready()
    try:
        record = make_record(state_dir)
        with ChannelClient(wait_served(record)) as client:
            client.hello()
            client.request_token(0)
            result = run_status(state_dir, "--json")
    finally:
        assert daemon.stop() == 0, daemon.logs()
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    (gpu,) = answer["gpus"]
    assert gpu["uuid"] == UUID_A and gpu["holder"] == record.id
    (tenant,) = gpu["tenants"]
    assert tenant["request"] == 0.5 and tenant["limit"] == 1.0 and tenant["wait_p50_ms"] >= 0
    assert tenant["memory_limit"] == 100 * MiB


def test_status_without_a_daemon_says_so(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    result = run_status(state_dir)
    assert result.returncode == 1
    assert "no gemini-daemon serves" in result.stderr and "--state-dir" in result.stderr
    assert result.stdout == ""


def test_status_after_the_daemon_was_killed_says_so(state_dir: Path) -> None:
    state_dir.mkdir(parents=True)
    DaemonProcess(state_dir).wait_ready().stop(signal.SIGKILL)  # leaves a stale socket
    result = run_status(state_dir)
    assert result.returncode == 1
    assert "not running" in result.stderr


def test_stop_is_refused_while_an_allocation_is_live_unless_forced(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    daemon = DaemonProcess(state_dir).wait_ready()
    try:
        record = make_record(state_dir)
        wait_served(record)
        refused = run_cli("stop", "--state-dir", str(state_dir))
        assert refused.returncode == 1
        assert refused.stderr.startswith("gemini-vgpu: error: gemini-daemon refused stop: "
                                         f"1 allocation(s) live ({record.id})"), refused.stderr
        assert "gemini-vgpu stop --force" in refused.stderr   # the way out, named
        assert daemon.proc.poll() is None and run_status(state_dir).returncode == 0
        forced = run_cli("stop", "--state-dir", str(state_dir), "--force")
        assert forced.returncode == 0, forced.stderr
        assert forced.stdout == f"gemini-daemon pid {daemon.proc.pid} of {state_dir} stopped\n"
        assert not lock.is_held(state_dir)   # it waited for the daemon to let go
        assert daemon.proc.wait(15) == 0, daemon.logs()
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_status_right_after_a_record_is_removed_no_longer_shows_it(state_dir: Path) -> None:
    # gemini-run removes its record as its command ends; `status` typed next must not show it
    # until the poll (10 s here: only the status's own look at the records can drop it).
    state_dir.mkdir(parents=True, exist_ok=True)
    ended, running = make_record(state_dir), make_record(state_dir)
    daemon = DaemonProcess(state_dir, "--poll-interval", "10").wait_ready()
    try:
        wait_served(ended)
        wait_served(running)
        assert allocation.remove_record(state_dir, ended.id)
        status = run_status(state_dir, "--json")
        assert status.returncode == 0, status.stderr
        assert [a["id"] for a in json.loads(status.stdout)["allocations"]] == [running.id]
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_stop_right_after_the_last_record_is_removed_is_not_refused(state_dir: Path) -> None:
    # gemini-run removes its record and exits; a `stop` typed next must not wait for the poll.
    # The poll is 10 s here, so only the stop's own look at the records can let it through.
    state_dir.mkdir(parents=True, exist_ok=True)
    record = make_record(state_dir)   # served by the first scan, before the long poll
    daemon = DaemonProcess(state_dir, "--poll-interval", "10").wait_ready()
    try:
        wait_served(record)
        assert allocation.remove_record(state_dir, record.id)
        stopped = run_cli("stop", "--state-dir", str(state_dir))
        assert stopped.returncode == 0, stopped.stderr
        assert daemon.proc.wait(15) == 0, daemon.logs()
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_stop_without_allocations_and_without_a_daemon(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    daemon = DaemonProcess(state_dir).wait_ready()
    try:
        stopped = run_cli("stop", env={"GEMINI_STATE_DIR": str(state_dir)})
        assert stopped.returncode == 0, stopped.stderr
        assert daemon.proc.wait(15) == 0, daemon.logs()
    finally:
        assert daemon.stop() == 0, daemon.logs()
    again = run_cli("stop", "--state-dir", str(state_dir))
    assert again.returncode == 1, again.stderr
    assert again.stderr.startswith(f"gemini-vgpu: error: no gemini-daemon runs for {state_dir}"
                                   ": nothing to stop"), again.stderr


def test_idle_exit_waits_for_the_last_allocation(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    record = make_record(state_dir)   # before the daemon: it must never be idle until removed
    daemon = DaemonProcess(state_dir, "--idle-exit", "0.5").wait_ready()
    try:
        wait_served(record)
        time.sleep(0.6)   # past idle_exit with an allocation ...
        # ... and a scan after it (the one that applies a rewrite): it stays.
        make_record(state_dir, allocation_id=record.id, gpus=((UUID_A, 200 * MiB, 0.5),))
        wait_for(lambda: daemon.allocation(record.id)["gpus"][0]["memory_limit"] == 200 * MiB,
                 5, "the rewrite applied")
        assert daemon.proc.poll() is None, daemon.logs()
        allocation.remove_record(state_dir, record.id)
        assert daemon.proc.wait(15) == 0, daemon.logs()
        assert "no allocation for idle_exit seconds: exiting" in daemon.logs()
        assert not lock.is_held(state_dir)
    finally:
        daemon.stop()
