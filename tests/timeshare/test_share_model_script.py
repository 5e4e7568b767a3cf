"""scripts/bench-share-model end to end, tiny: the REAL daemon and interposer over the fake
libcuda's modelled kernel time, one load and one mix in a 3 s window.

The bounds are loose (a 3 s window holds about ten rounds of quotas, and this box is shared),
but they fail when the scheduler breaks: every tenant has its own fake "GPU", so without a
working token both would reach about 1.0 of alone; a scheduler that ignored requests would split
about evenly (0.5 / 0.5), far outside 0.1 of 0.3 / 0.7; a token that stalls or is never passed
on drops the aggregate below 0.8.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.childenv import child_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench-share-model"


def run_script(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(120)
def test_shares_on_the_modelled_gpu_land_near_their_requests(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    out.write_text(json.dumps({"kept": "from an earlier call"}))   # merged into, not replaced
    proc = run_script("--cases", "shares", "--loads", "2048", "--mixes", "3/7",
                      "--duration", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["kept"] == "from an earlier call"
    (run,) = results["runs"]
    assert run["command"].endswith("--json " + str(out)) and run["machine"] and run["date"]

    alone, hooked = results["alone"]["2048"], results["alone_hook"]["2048"]
    assert alone["seconds"] == 3 and alone["kernel_ns"] == 27_000
    # the fake's kernel time held: a 2048 loop keeps the modelled GPU mostly busy, never more
    assert 0.3 < alone["busy"] <= 1.0, alone
    assert hooked["hook"]["kernel_launches"] > 0 and hooked["kernels"] > 0

    case = results["cases"]["2048 0.3/0.7"]
    assert case["asked"] == [0.3, 0.7] and case["alone_kernels"] == alone["kernels"]
    achieved = case["achieved"]
    assert achieved == [t["kernels"] / alone["kernels"] for t in case["tenants"]]
    for asked, got, tenant in zip(case["asked"], achieved, case["tenants"], strict=True):
        assert abs(got - asked) <= 0.1, (case["asked"], achieved)
        assert tenant["hook"]["token_requests"] > 0, tenant["hook"]   # the gate was shut
        charged = tenant["daemon"]["charged"]   # its counter over the window
        assert abs(charged - asked) <= 0.1, [t["daemon"] for t in case["tenants"]]
    assert sum(achieved) >= 0.8, achieved
    assert case["tenants"][0]["window"]["grants"] > 3        # the token went round
    table = proc.stdout
    assert "| 2048 | 0.30 / 0.70 |" in table and "load average" in table


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(150)
def test_co_case_shares_the_engine_and_charges_busy_time(tmp_path: Path) -> None:
    """The co case, its pair that fits the GPU, in 3 s: co-held, each tenant runs near its
    busy fraction alone and is charged about what it ran; taking turns, each gets only its
    request of that (a scheduler that never co-granted, or charged co-held time in full, or a
    bench that gave each tenant its own engine, fails one of these)."""
    out = tmp_path / "model.json"
    proc = run_script("--cases", "co", "--co-mixes", "fit", "--duration", "3", "--json",
                      str(out), timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    co = json.loads(out.read_text())["co"]
    on, off = (co[f"launch-0.3 + launch-0.3 0.3/0.7 co {mode}"] for mode in ("on", "off"))
    assert on["tenants"][0]["window"]["co_grants"] > 0
    assert off["tenants"][0]["window"]["co_grants"] == 0
    for alone, got, tenant in zip(on["alone_busy"], on["achieved_busy"], on["tenants"],
                                  strict=True):
        assert 0.2 <= alone <= 0.45, on["alone_busy"]
        assert got >= 0.8 * alone, (on["alone_busy"], on["achieved_busy"])
        assert abs(tenant["daemon"]["charged"] - got) <= 0.08, (
            tenant["daemon"], on["tenants"][0]["samples_late_s"])
    # Taking turns, the engine ran one at a time: together about one tenant's busy fraction.
    assert sum(off["achieved_busy"]) <= 0.75 * sum(on["achieved_busy"]), (off, on)
    assert on["tenants"][0]["engine_busy"] == pytest.approx(sum(on["achieved_busy"]), abs=0.05)
    assert "| launch-0.3 + launch-0.3 | on |" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--mixes", "3/x"], "slices of 10"),
    (["--mixes", "6/7"], "at most 10"),
    (["--loads", "4096"], "unknown load"),
    (["--cases", "nonsense"], "unknown case"),
    (["--co-mixes", "fit,nonsense"], "unknown co mix"),
    (["--duration", "0"], "must be positive"),
])
def test_bad_arguments_are_refused_and_the_results_file_kept(
        tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "model.json"
    out.write_text('{"cases": {"kept": 1}}')
    proc = run_script(*args, "--json", str(out), timeout=30)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert out.read_text() == '{"cases": {"kept": 1}}'
