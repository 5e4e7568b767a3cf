"""The daemon's event loop (event_loop): uvloop when installed, asyncio's on request, the same
token service on both (grants handed over, charged and counted); asking for uvloop where it is
not installed is a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.childenv import python_path
from tests.daemon.helpers import REPO, DaemonProcess, make_record, wait_for
from tests.daemon.test_tokens import Tenant, gpu_status, tenants_of

NS = 1_000_000_000


def started_line(daemon: DaemonProcess) -> dict[str, object]:
    for line in daemon.logs().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("msg") == "gemini-daemon started":
                return entry  # type: ignore[no-any-return]
    raise AssertionError(f"no start line in:\n{daemon.logs()}")


def no_uvloop(tmp: Path) -> tuple[str, ...]:
    """A command prefix under which `import uvloop` fails, as where it is not installed."""
    stub = tmp / "no-uvloop"
    stub.mkdir()
    (stub / "uvloop.py").write_text("raise ImportError('uvloop is not installed here')\n")
    return ("env", f"PYTHONPATH={stub}:{python_path()}")


@pytest.mark.parametrize("choice, expected", [("auto", "uvloop"), ("asyncio", "asyncio")])
def test_tokens_are_handed_over_and_charged_on_either_loop(
        state_dir: Path, choice: str, expected: str) -> None:
    pytest.importorskip("uvloop")   # a dependency: installed with the project
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, "--event-loop", choice, "--max-quota", "2",
                           "--cycle", "4").wait_ready()
    try:
        assert started_line(daemon)["event_loop"] == expected
        joined = time.monotonic()   # the GPU's scheduler starts with its first tenant
        a, b = Tenant(make_record(state_dir)), Tenant(make_record(state_dir))
        try:
            grant = a.client.request_token(0)
            granted = time.monotonic()
            a.busy()
            b.client.send_token_request(0)
            assert b.pending(0.1)
            time.sleep(0.2)
            held = time.monotonic() - granted   # what a is charged
            a.client.release_token(0, work_end_ns=time.monotonic_ns())
            handed = b.client.recv_grant()
            assert handed.generation > grant.generation and b.page.valid()
            assert a.page.valid_until_ns == 0
            status = gpu_status(daemon)
            assert status["grants"] == 2 and status["holder"] == b.record.id
            # a's share of the time since the scheduler started (shorter than the window) is
            # the time it held.
            share = tenants_of(daemon)[a.record.id]["achieved"]
            assert share * (time.monotonic() - joined) == pytest.approx(held, rel=0.25)
        finally:
            a.close()
            b.close()
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_auto_without_uvloop_runs_on_asyncio(state_dir: Path, tmp_path: Path) -> None:
    state_dir.mkdir(parents=True)
    daemon = DaemonProcess(state_dir, wrap=no_uvloop(tmp_path)).wait_ready()
    try:
        wait_for(lambda: "gemini-daemon started" in daemon.logs(), 5, "start line")
        assert started_line(daemon)["event_loop"] == "asyncio"
    finally:
        assert daemon.stop() == 0, daemon.logs()


def test_uvloop_asked_for_but_not_installed_is_a_clear_error(state_dir: Path,
                                                              tmp_path: Path) -> None:
    done = subprocess.run(
        [*no_uvloop(tmp_path), sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir",
         str(state_dir), "--event-loop", "uvloop"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "gemini-daemon: error: event_loop uvloop: uvloop is not installed" in done.stderr
    assert not state_dir.exists()   # refused before it touched anything
