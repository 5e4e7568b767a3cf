"""scripts/soak-gpu on the CPU (--fake): the real script, the real daemon SIGKILLed and restarted,
gemini-run tenants over the fake libcuda under the hook. Shares on the fake GPU mean little, so
these tests check what does mean something there: no application error, a new daemon each time
and every tenant reconnected to it, and the memory accounting exact to the byte at the end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import scriptmodule
from tests.childenv import child_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "soak-gpu"
MiB = 1 << 20


def load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (it has no .py name); dataclasses need it in sys.modules."""
    return scriptmodule.load("soak-gpu", lambda name, module: monkeypatch.setitem(
        sys.modules, name, module))


@pytest.fixture
def work_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gsk-"))   # short: channel socket paths fit 107 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


def soak(work_dir: Path, hook_lib: Path, fake_dir: Path, *args: str,
         timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = work_dir / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--fake", "--dir", str(work_dir / "run"),
         "--fake-driver-dir", str(fake_dir), "--hook-library", str(hook_lib),
         "--json", str(out), "--alone-seconds", "2", "--alone-warmup", "0.5",
         "--memory-limit", "4GiB", *args],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"no JSON ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(out.read_text())
    return proc, result


@pytest.mark.slow   # a soak, if a short one: the fast lane leaves it out
def test_fake_soak_with_two_daemon_restarts_passes(
        work_dir: Path, hook_lib: Path, fake_dir: Path) -> None:
    # Shares on the fake GPU depend on how busy this machine's cores are: bound 1 keeps only
    # what is meaningful here of that criterion, that every tenant progressed in every window.
    proc, result = soak(work_dir, hook_lib, fake_dir, "--duration", "15", "--restarts", "2",
                        "--settle", "1", "--window", "3", "--bound", "1")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert result["passed"] is True and all(result["criteria"].values()), result["criteria"]
    assert "| memory accounting exact | pass |" in proc.stdout

    # Two SIGKILLs, each answered by a new daemon, every tenant back on it.
    assert len(result["restarts"]) == 2
    for restart in result["restarts"]:
        assert restart["new_pid"] != restart["killed_pid"]
        assert 0 < restart["answering_s"] <= restart["full_service_s"] < 30
    pids = [r["killed_pid"] for r in result["restarts"]] + [result["restarts"][-1]["new_pid"]]
    assert len(set(pids)) == 3

    # No application errors; each tenant's hook connected to all three daemons.
    assert [t["kind"] for t in result["tenants"]] == ["compute"] * 3 + ["memory"]
    for tenant in result["tenants"]:
        assert tenant["exit_code"] == 0 and tenant["traceback"] is None, tenant
        assert tenant["hook_stats"]["daemon_connects"] == 3, tenant

    # Memory: the daemon's allocations (every kind but the context) equal the live bytes the
    # tenant holds, to the byte; the context charge is the fake driver's, kept as its own kind.
    memory = result["memory"]
    assert memory["operations"] > 100 and memory["refused"] == 0
    assert memory["live_allocations"] > 0 and memory["live_bytes"] % MiB != 0
    assert memory["daemon_allocations"] == memory["live_bytes"]
    assert memory["daemon_by_kind"] == {"device": memory["live_bytes"], "context": 64 * MiB}
    assert memory["daemon_memory_used"] == memory["live_bytes"] + 64 * MiB
    assert memory["context_before_first_allocation"] == 64 * MiB
    assert memory["daemon_connections"] == 1

    # The per-second shares cover the whole soak for each compute tenant.
    timeline = result["share_per_second"]
    assert sorted(timeline) == ["compute-0", "compute-1", "compute-2"]
    assert all(len(series) == 15 and series[5] is not None for series in timeline.values())

    # Every phase was judged in a window of its own, after its recovery.
    assert [p["phase"] for p in result["phases"]] == [0, 1, 2]
    starts = [p["window_s"][0] for p in result["phases"]]
    assert starts == sorted(starts)
    for phase, restart in zip(result["phases"][1:], result["restarts"], strict=True):
        assert phase["window_s"][0] >= restart["killed_at_s"] + restart["full_service_s"]
        assert all(row["achieved"] is not None for row in phase["tenants"])


@pytest.mark.slow
def test_a_failed_criterion_makes_the_script_fail(
        work_dir: Path, hook_lib: Path, fake_dir: Path) -> None:
    """No share is ever exactly what was asked: bound 0 must fail the shares criterion alone,
    and the exit status must say so."""
    proc, result = soak(work_dir, hook_lib, fake_dir, "--duration", "4", "--restarts", "0",
                        "--settle", "0.5", "--window", "3", "--bound", "0")
    assert proc.returncode == 1
    assert result["passed"] is False
    assert result["criteria"]["shares_within_bound"] is False
    assert result["criteria"]["no_application_errors"] is True
    assert result["criteria"]["memory_accounting_exact"] is True
    assert "| shares within bound | **FAIL** |" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--shares", "0.6,0.5"], "summing to at most 0.99"),
    (["--loads", "8192:4"], "gives 1 loads for 3 shares"),
    (["--memory-limit", "1GiB"], "leave 1 GiB for the context"),
    (["--loads", "8192:4,2048:1,8192:4", "--alone", "10"], "--alone is one figure"),
])
def test_bad_arguments_get_a_clear_error_and_start_nothing(
        work_dir: Path, args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--fake", "--dir",
                           str(work_dir / "run"), *args],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (work_dir / "run").exists()


def test_throughput_is_interpolated_between_reports_and_torn_lines_are_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script(monkeypatch)
    progress = tmp_path / "progress"
    progress.write_text("100.0 0\n101.0 10\n102.0 30\n102.5 3")   # last line torn mid-write
    points = script.read_progress(progress)
    assert points == [(100.0, 0.0), (101.0, 10.0), (102.0, 30.0)]
    assert script.count_at(points, 101.5) == pytest.approx(20.0)
    assert script.rate(points, 100.5, 101.5) == pytest.approx(15.0)
    assert script.rate(points, 99.0, 101.0) is None          # before the first report
    assert script.rate(points, 101.0, 103.0) is None         # after the last
    assert script.read_progress(tmp_path / "missing") == []
