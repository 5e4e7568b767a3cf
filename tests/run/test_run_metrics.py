"""gemini-run's daemon and metrics: off unless asked, then on 127.0.0.1 at the port asked, and
a command that cannot have the port it asked for says why and runs all the same."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.conftest import stop_daemon
from tests.run.test_run import ENV, PROBE, REPO, finish, gemini_run, live_records, probe_started
from tests.scrape import fetch, free_port, samples, scrape, value
from vgpu_runtime import __version__
from vgpu_runtime.daemon.channel import client


def status_text(state_dir: Path) -> str:
    shown = subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "status", "--state-dir",
                            str(state_dir)], cwd=REPO, env=ENV, capture_output=True, text=True,
                           timeout=30)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_off_unless_asked_and_a_later_ask_is_told_the_daemon_keeps_its_start(
        state_dir: Path, hook_library: Path) -> None:
    first = gemini_run(state_dir, hook_library, "--share", "0.5")
    probe_started(first)
    assert client.request(state_dir)["daemon"]["metrics"] is None
    assert "metrics: off (gemini-run --metrics-port PORT starts your daemon with them)" in (
        status_text(state_dir))
    # The daemon runs already, without metrics: a command asking for them says so, and runs.
    port = free_port()
    second = gemini_run(state_dir, hook_library, "--share", "0.5", "--metrics-port", str(port))
    probe_started(second)
    code, err = finish(second)
    assert code == 0
    assert "gemini-run: note: your daemon" in err and "was started without metrics" in err
    assert f"gemini-vgpu stop --state-dir {state_dir}" in err
    with pytest.raises(OSError):
        fetch(f"http://127.0.0.1:{port}/metrics", timeout=2)
    assert finish(first)[0] == 0


def test_the_port_asked_for_serves_the_users_allocations_on_localhost(
        state_dir: Path, hook_library: Path) -> None:
    port = free_port()
    proc = gemini_run(state_dir, hook_library, "--share", "0.25",
                      env={**ENV, "GEMINI_RUN_METRICS_PORT": str(port)})
    seen = probe_started(proc)
    metrics = client.request(state_dir)["daemon"]["metrics"]
    assert metrics == {"address": "127.0.0.1", "asked": port, "port": port, "error": None}
    found = samples(scrape(port))
    assert value(found, "gemini_vgpu_build_info", version=__version__,
                 program="gemini-daemon") == 1
    assert value(found, "gemini_vgpu_container_request_ratio",
                 allocation=seen["allocation_id"]) == 0.25
    assert value(found, "gemini_vgpu_container_memory_used_bytes",
                 allocation=seen["allocation_id"]) == 1 << 20   # the probe's reserve
    assert f"metrics: http://127.0.0.1:{port}/metrics" in status_text(state_dir)
    # A later command asking for another port: told which one the daemon keeps.
    other = gemini_run(state_dir, hook_library, "--share", "0.25", "--metrics-port",
                       str(free_port()))
    probe_started(other)
    code, err = finish(other)
    assert code == 0 and f"serves metrics on port {port}, not" in err
    code, err = finish(proc)
    assert code == 0 and "note" not in err, err   # the port it asked for: nothing to say


def test_a_port_another_holds_is_named_and_the_command_runs(state_dir: Path,
                                                             hook_library: Path) -> None:
    """Another user's daemon (or any program) on the port: this user's daemon runs without
    /metrics, and the command says so."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        proc = gemini_run(state_dir, hook_library, "--metrics-port", str(taken))
        probe_started(proc)
        code, err = finish(proc)
    assert code == 0
    assert f"metrics port {taken} is unavailable (Address already in use)" in err, err
    metrics = client.request(state_dir)["daemon"]["metrics"]
    assert (metrics["asked"], metrics["port"]) == (taken, None)
    assert f"metrics: port {taken} unavailable (Address already in use); none served" in (
        status_text(state_dir))
    assert live_records(state_dir) == []
    stop_daemon(state_dir)


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--metrics-port", "http"], {}, "expected a TCP port"),
    (["--metrics-port", "70000"], {}, "expected a TCP port"),
    ([], {"GEMINI_RUN_METRICS_PORT": "-1"}, "GEMINI_RUN_METRICS_PORT: expected a TCP port"),
])
def test_a_bad_port_is_refused_before_anything_runs(state_dir: Path, hook_library: Path,
                                                    args: list[str], env: dict[str, str],
                                                    message: str) -> None:
    code, err = finish(gemini_run(state_dir, hook_library, *args, env={**ENV, **env},
                                  command=[sys.executable, "-c", PROBE, "0"]))
    assert code == 125 and message in err, err
    assert not state_dir.exists()
