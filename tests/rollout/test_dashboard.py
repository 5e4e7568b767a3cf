"""The example Grafana dashboard queries only series the node daemon exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from vgpu_runtime.common import metrics as common_metrics
from vgpu_runtime.daemon.telemetry import metrics

DASHBOARD = (Path(__file__).resolve().parents[2]
             / "daemonset/examples/monitoring/grafana-dashboard.json")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def exported_families() -> set[str]:
    return set(re.findall(r'"(gemini_vgpu_[a-z_]+)"', Path(metrics.__file__).read_text()
                          + Path(common_metrics.__file__).read_text()))


def test_every_panel_queries_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    families = exported_families()
    assert families, "no metric families found in the daemon's metrics module"
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for name in re.findall(r"gemini_vgpu_[a-z_]+", target["expr"]):
                family = name
                for suffix in SUFFIXES:
                    if family.endswith(suffix) and family[: -len(suffix)] in families:
                        family = family[: -len(suffix)]
                assert family in families, f"{panel['title']}: {name} is not exported"
                used.add(family)
    assert used == families, f"series without a panel: {sorted(families - used)}"
