"""scripts/bench-jobs' table: a run in which a job started too late measured no sharing (the
others had the GPU alone meanwhile) and is left out of the medians, saying why; an alone
reference that did nothing is not divided by. The harness opens a run's window only once every
job (a stub following jobs.py's protocol) is ready."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import scriptmodule


def bench_jobs() -> ModuleType:
    return scriptmodule.load("bench-jobs")


def job(kind: str, rate: float, late: float = 0.0) -> dict[str, Any]:
    return {"kind": kind, "rate": rate, "late_s": late}


def run(together: list[dict[str, Any]], alone_trainer: float = 30.0,
        alone_late: float = 0.0) -> dict[str, Any]:
    return {"jobs": [["resnet", 0.5], ["trainer", 0.5]], "duration": 8.0,
            "alone": {"resnet": {"jobs": [job("resnet", 16.0)]},
                      "trainer": {"jobs": [job("trainer", alone_trainer, alone_late)]}},
            "modes": {"mps": {"jobs": together, "nvml": {"sm_pct": {}}}}}


def test_late_runs_are_left_out_of_the_medians_and_named() -> None:
    table = bench_jobs().table({"scenarios": {"mixed": [
        run([job("resnet", 8.0), job("trainer", 15.0)]),
        run([job("resnet", 14.0), job("trainer", 3.0, late=4.7)]),   # resnet alone for 4.7 s
    ]}})
    row = [line for line in table.splitlines() if "| mixed | mps |" in line]
    assert row == ["| mixed | mps | 1 | 0.500 / 0.500 | 1.000 | - | nan / nan |"], table


def test_a_reference_that_did_nothing_gives_no_row_and_no_division() -> None:
    table = bench_jobs().table({"scenarios": {"mixed": [
        run([job("resnet", 8.0), job("trainer", 15.0)], alone_trainer=0.0, alone_late=8.2)]}})
    assert "| mixed | mps | 0 | no valid run (alone: trainer 8.2 s late) |" in table, table


STUB_JOB = '''
import json, sys, time
from pathlib import Path
kind, go, duration, out = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
time.sleep({"slow": 2.0, "fast": 0.1}[kind])   # imports and warm-up
Path(out + ".ready").write_text("0")
while not go.exists():
    time.sleep(0.005)
start_at = float(go.read_text())
ready_lead = start_at - time.time()
while time.time() < start_at + duration:
    time.sleep(0.01)
json.dump({"kind": kind, "rate": 1.0, "late_s": max(0.0, -ready_lead),
           "lead_left_s": ready_lead}, open(out, "w"))
'''


def test_the_window_opens_once_every_job_is_ready(tmp_path: Path) -> None:
    """A job that takes 2 s to warm up beside one that takes 0.1 s: neither is late, and both
    saw the whole lead before the window (the fixed lead it replaces left cold jobs late)."""
    module = bench_jobs()
    stub = tmp_path / "stub_job.py"
    stub.write_text(STUB_JOB)
    module.JOBS = stub
    run = module.run_together("timeslice", [("slow", 0.5), ("fast", 0.5)], 0.5, 0.2, tmp_path)
    assert [j["late_s"] for j in run["jobs"]] == [0.0, 0.0], run
    assert all(0.3 < j["lead_left_s"] <= 0.5 for j in run["jobs"]), run


def test_a_job_that_dies_before_it_is_ready_fails_the_run_at_once(tmp_path: Path) -> None:
    module = bench_jobs()
    stub = tmp_path / "stub_job.py"
    stub.write_text(STUB_JOB)
    module.JOBS = stub
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited .* before it was ready"):
        module.run_together("timeslice", [("slow", 0.5), ("no such kind", 0.5)], 0.5, 0.2,
                            tmp_path)
    assert time.monotonic() - began < 30
