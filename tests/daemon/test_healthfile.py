"""The plugin's health file, as the daemon reads it."""

from __future__ import annotations

import json
from pathlib import Path

from device_plugin.health import HealthTracker
from device_plugin.healthfile import health_file, publish_health
from vgpu_runtime.daemon.pods.node import HealthFile


def test_health_changes_reach_the_daemon_reader(tmp_path: Path) -> None:
    now = [0.0]
    tracker = HealthTracker(["GPU-a", "GPU-b"], [13], quiet_period=1.0, clock=lambda: now[0])
    publish_health(tmp_path, tracker)
    reader = HealthFile(tmp_path)
    assert reader.read() == {"GPU-a": (True, ""), "GPU-b": (True, "")}
    tracker.xid("GPU-b", 79)
    assert reader.read()["GPU-b"] == (False, "critical XID 79")
    now[0] = 2.0
    tracker.recheck(lambda uuid: True)
    assert reader.read()["GPU-b"] == (True, "")
    assert not list(tmp_path.glob(".health.*"))   # no temporary file left behind


def test_a_bad_health_file_keeps_the_last_good_view(tmp_path: Path) -> None:
    reader = HealthFile(tmp_path)
    assert reader.read() == {}
    health_file(tmp_path).write_text(json.dumps({"GPU-a": {"healthy": False, "reason": "x"}}))
    assert reader.read() == {"GPU-a": (False, "x")}
    health_file(tmp_path).write_text("{not json")
    assert reader.read() == {"GPU-a": (False, "x")}
