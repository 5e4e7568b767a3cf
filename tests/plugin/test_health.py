"""The health state machine, and the simulated control directory that feeds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from device_plugin.health import HealthTracker
from device_plugin.health_events import ControlError, SimulatedControl, parse_event
from vgpu_runtime.gpus.simulated import SimulatedBackend


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tracker(clock: Clock) -> HealthTracker:
    return HealthTracker(["A", "B"], (13, 31, 43, 45, 68, 109), quiet_period=300, clock=clock)


def always(ok: bool):  # type: ignore[no-untyped-def]
    return lambda uuid: ok


def test_critical_xid_makes_gpu_unhealthy(tracker: HealthTracker) -> None:
    changes: list[int] = []
    tracker.on_change(lambda: changes.append(1))
    assert tracker.xid("A", 79)
    assert not tracker.is_healthy("A") and tracker.is_healthy("B")
    assert tracker.unhealthy() == {"A": "critical XID 79"}
    assert not tracker.xid("A", 79)  # already unhealthy: no new notification
    assert changes == [1]


@pytest.mark.parametrize("benign", [13, 31, 43, 45, 68, 109])
def test_ignored_xids_change_nothing(tracker: HealthTracker, benign: int) -> None:
    assert not tracker.xid("A", benign)
    assert tracker.is_healthy("A")


def test_event_without_device_marks_every_gpu(tracker: HealthTracker) -> None:
    tracker.xid(None, 48)
    assert not tracker.is_healthy("A") and not tracker.is_healthy("B")


def test_unknown_gpu_xid_is_ignored(tracker: HealthTracker) -> None:
    assert not tracker.xid("Z", 79)
    assert tracker.unhealthy() == {}


def test_recovery_needs_quiet_period_and_working_probe(tracker: HealthTracker,
                                                       clock: Clock) -> None:
    tracker.xid("A", 79)
    clock.now = 299
    assert not tracker.recheck(always(True))
    assert not tracker.is_healthy("A")
    clock.now = 300
    assert not tracker.recheck(lambda uuid: uuid != "A")  # quiet, but the probe fails
    assert not tracker.is_healthy("A")
    assert tracker.recheck(always(True))
    assert tracker.is_healthy("A")


def test_xid_during_recovery_restarts_quiet_period(tracker: HealthTracker, clock: Clock) -> None:
    tracker.xid("A", 79)
    clock.now = 250
    tracker.xid("A", 94)
    clock.now = 400
    tracker.recheck(always(True))
    assert not tracker.is_healthy("A")
    clock.now = 550
    tracker.recheck(always(True))
    assert tracker.is_healthy("A")


def test_failed_probe_makes_unhealthy_and_success_recovers_without_xid(
        tracker: HealthTracker) -> None:
    assert tracker.recheck(lambda uuid: uuid != "B")
    assert tracker.unhealthy() == {"B": "probe failed: GPU does not answer NVML"}
    assert tracker.recheck(always(True))  # no XID was ever seen: no quiet period to wait
    assert tracker.is_healthy("B")


def test_control_events(tmp_path: Path, clock: Clock) -> None:
    backend = SimulatedBackend(2)
    uuids = [g.uuid for g in backend.gpus]
    tracker = HealthTracker(uuids, (13,), quiet_period=10, clock=clock)
    control = SimulatedControl(tmp_path, backend, tracker)
    (tmp_path / "1.json").write_text(json.dumps({"gpu": 1, "xid": 13}))
    (tmp_path / "2.json").write_text(json.dumps({"gpu": 1, "xid": 79}))
    (tmp_path / "3.json").write_text(json.dumps({"gpu": 0, "usable": False}))
    (tmp_path / "notes.txt").write_text("not an event")
    assert control.poll_once() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert tracker.unhealthy() == {uuids[0]: "probe failed: GPU does not answer NVML",
                                   uuids[1]: "critical XID 79"}
    (tmp_path / "4.json").write_text(json.dumps({"gpu": 0, "usable": True}))
    control.poll_once()
    assert tracker.is_healthy(uuids[0]) and not tracker.is_healthy(uuids[1])


def test_malformed_control_file_is_kept_aside(tmp_path: Path) -> None:
    backend = SimulatedBackend(1)
    tracker = HealthTracker([backend.gpus[0].uuid], (), quiet_period=10)
    control = SimulatedControl(tmp_path, backend, tracker)
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text(json.dumps({"gpu": 0, "xid": 79}))
    assert control.poll_once() == 1
    assert (tmp_path / "a.json.rejected").read_text() == "{not json"
    assert not tracker.is_healthy(backend.gpus[0].uuid)


@pytest.mark.parametrize(("event", "reason"), [
    ([], "JSON object"),
    ({"gpu": 0}, "exactly one"),
    ({"gpu": 0, "xid": 1, "usable": True}, "exactly one"),
    ({"gpu": 5, "xid": 79}, "no simulated GPU with index 5"),
    ({"gpu": True, "xid": 79}, "no simulated GPU"),
    ({"gpu": 0, "xid": "79"}, "integer"),
    ({"gpu": 0, "usable": "no"}, "true or false"),
    ({"usable": False}, "needs \"gpu\""),
    ({"gpu": 0, "xid": 1, "extra": 1}, "unknown key"),
])
def test_bad_control_events_say_why(event: object, reason: str) -> None:
    with pytest.raises(ControlError, match=reason):
        parse_event(event, SimulatedBackend(1).gpus)


def test_xid_without_gpu_means_all() -> None:
    uuid, event = parse_event({"xid": 48}, SimulatedBackend(1).gpus)
    assert uuid is None and event["xid"] == 48
