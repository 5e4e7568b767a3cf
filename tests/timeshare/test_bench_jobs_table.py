"""scripts/bench-jobs' table: a run in which a job started too late measured no sharing (the
others had the GPU alone meanwhile) and is left out of the medians, saying why; an alone
reference that did nothing is not divided by."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def bench_jobs() -> ModuleType:
    path = str(REPO / "scripts" / "bench-jobs")
    loader = importlib.machinery.SourceFileLoader("bench_jobs", path)
    spec = importlib.util.spec_from_loader("bench_jobs", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


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
