"""The daemon's small parts, each alone: passing failures logged once (troubles.py), accept
failures throttled (loop.py), the MQTT event documents (telemetry/events.py) and the node
Events of a slice-count change (pods/node_reports.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from vgpu_runtime.allocation import AllocationRecord, Binding, GpuShare, PodRef
from vgpu_runtime.daemon.loop import ACCEPT_LOG_INTERVAL, ACCEPT_OUT_OF_RESOURCES, AcceptFailureLog
from vgpu_runtime.daemon.pods.node import SliceCount
from vgpu_runtime.daemon.pods.node_reports import NodeEvent, slice_count_event
from vgpu_runtime.daemon.telemetry.events import allocation_documents, health_documents
from vgpu_runtime.daemon.troubles import Troubles

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
GiB = 1 << 30


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_trouble_is_logged_once_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    troubles = Troubles()
    assert not troubles
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            troubles.report("cannot scan", "scan", OSError(24, "Too many open files"))
        assert errors(caplog) == ["cannot scan"]
        assert troubles
        troubles.report("cannot scan", "scan", OSError(28, "No space left"))   # a new error
        assert errors(caplog) == ["cannot scan"] * 2
        troubles.clear("scan")
        assert not troubles
        troubles.report("cannot scan", "scan", OSError(28, "No space left"))   # back again
        assert errors(caplog) == ["cannot scan"] * 3


def test_accept_failures_are_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    handler = AcceptFailureLog(clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        context = {"message": f"{ACCEPT_OUT_OF_RESOURCES}: listening on ...",
                   "exception": OSError(24, "Too many open files")}
        with caplog.at_level(logging.ERROR):
            for _ in range(100):
                handler(loop, context)
            assert len(errors(caplog)) == 1
            now[0] += ACCEPT_LOG_INTERVAL
            handler(loop, context)
            lines = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(lines) == 2
            assert lines[1].__dict__["failed_accepts"] == 100   # the 99 unlogged, and this one
            handler(loop, {"message": "something else"})        # asyncio's own, as ever
            assert any("something else" in r.getMessage() for r in caplog.records)
    finally:
        loop.close()


def test_allocation_documents_name_the_pod_and_the_limits_in_force() -> None:
    record = AllocationRecord(
        id="k-0000000000000001", origin="kubelet", device_ids=(),
        gpus=(GpuShare(A, 0, 0.5, 4 * GiB), GpuShare(B, 1, 0.25, 2 * GiB)),
        channel_dir="/nonexistent", hook_library="x.so", created_at=1.0)
    binding = Binding(record.id, PodRef("ml", "train", "main", ""), memory_limit=GiB)
    docs = dict(allocation_documents("collected", record, {"reason": "pod ended"}, binding))
    assert docs[A] == {"event": "allocation-collected", "allocation": record.id,
                       "origin": "kubelet", "pod": "train", "namespace": "ml",
                       "container": "main", "reason": "pod ended", "share": 0.5,
                       "memory_limit": GiB}
    assert (docs[B]["share"], docs[B]["memory_limit"]) == (0.25, GiB)
    unbound = dict(allocation_documents("added", record, {}, None))
    assert (unbound[A]["pod"], unbound[A]["memory_limit"]) == (None, 4 * GiB)


def test_health_documents_are_the_changes() -> None:
    assert health_documents({}, {A: (True, ""), B: (False, "XID 79")}) == [
        (B, {"event": "gpu-unhealthy", "reason": "XID 79"})]
    assert health_documents({A: (True, ""), B: (False, "XID 79")},
                            {A: (True, ""), B: (True, "")}) == [
        (B, {"event": "gpu-healthy", "reason": ""})]
    assert health_documents({A: (True, "")}, {A: (True, "")}) == []


@pytest.mark.parametrize(("before", "now", "expected"), [
    (None, SliceCount(10, 10), None),                        # nothing to say
    (None, SliceCount(10, 4, ("k-1",)), "SlicesPerGpuChangeWaiting"),
    (SliceCount(10, 4, ("k-1",)), SliceCount(10, 4, ("k-1",)), None),   # said already
    (SliceCount(10, 4, ("k-1",)), SliceCount(10, 4, ("k-2",)), "SlicesPerGpuChangeWaiting"),
    (SliceCount(10, 4, ("k-1",)), SliceCount(4, 4), "SlicesPerGpuChanged"),
    (SliceCount(10, 10), SliceCount(10, 10, ()), None),
])
def test_slice_count_events(before: SliceCount | None, now: SliceCount,
                            expected: str | None) -> None:
    event: Any = slice_count_event(A, before, now)
    assert (event.reason if event else None) == expected


def test_a_waiting_change_names_what_it_waits_for() -> None:
    event = slice_count_event(A, None, SliceCount(10, 4, ("k-1", "k-2")))
    assert event == NodeEvent(
        "SlicesPerGpuChangeWaiting", "Warning",
        f"GPU {A} keeps 10 slices, not the configured 4, until allocation(s) k-1, k-2 end: "
        "kubelet names its devices in running pods; it takes no new pod meanwhile")
    unreadable = slice_count_event(A, None, SliceCount(10, 4, ()))
    assert unreadable is not None and "(unreadable records)" in unreadable.message
