"""MQTT telemetry against a real Mosquitto broker: messages arrive, a broker restart is survived,
and a broker that is down never slows the token path."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, make_record, wait_for, wait_served
from tests.daemon.mosquitto import Broker, Subscriber, free_port
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.telemetry.mqtt import parse_broker_url, topic

MiB = 1 << 20


@pytest.fixture
def broker(state_dir: Path) -> Iterator[Broker]:
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    server = Broker(state_dir.parent).start()
    yield server
    server.stop()


def start_daemon(state_dir: Path, port: int, *extra: str) -> DaemonProcess:
    state_dir.mkdir(parents=True, exist_ok=True)
    return DaemonProcess(state_dir, "--metrics-port", "0", "--node-name", "n1",
                         "--mqtt-url", f"mqtt://127.0.0.1:{port}", "--mqtt-interval", "0.2",
                         *extra).wait_ready()


def test_broker_urls() -> None:
    assert parse_broker_url("mqtt://broker:1884") == ("broker", 1884)
    assert parse_broker_url("broker") == ("broker", 1883)
    for bad in ("http://broker", "mqtt://", "mqtt://b:notaport"):
        with pytest.raises(ValueError, match="mqtt://host"):
            parse_broker_url(bad)
    assert topic("gemini", "n1", "GPU-x", "usage") == "gemini/n1/GPU-x/usage"


def test_usage_and_events_arrive_and_a_broker_restart_is_survived(
        state_dir: Path, broker: Broker) -> None:
    subscriber = Subscriber(broker.port, "gemini/n1/#")
    daemon = start_daemon(state_dir, broker.port)
    try:
        record = make_record(state_dir)
        with ChannelClient(wait_served(record)) as client:
            client.hello()
            client.reserve(0, 10 * MiB)
            gpu = record.gpus[0].uuid

            def usage() -> list[dict[str, object]]:
                return [m for t, m in subscriber.received() if t == f"gemini/n1/{gpu}/usage"
                        and m["allocation"] == record.id and m["memory_used_bytes"] == 10 * MiB]
            found = wait_for(usage, 10, "usage message")
            assert found[0]["node"] == "n1" and found[0]["request"] == 0.5
            events = [m for t, m in subscriber.received() if t == f"gemini/n1/{gpu}/events"]
            assert any(e["event"] == "allocation-added" and e["allocation"] == record.id
                       for e in events)

            broker.stop()
            wait_for(lambda: not daemon.status()["node"]["mqtt"]["connected"], 10,
                     "the daemon noticing the broker gone")
            broker.start()
            subscriber.close()
            subscriber = Subscriber(broker.port, "gemini/n1/#")
            client.reserve(0, 5 * MiB)

            def after_restart() -> list[dict[str, object]]:
                return [m for t, m in subscriber.received() if t.endswith("/usage")
                        and m["memory_used_bytes"] == 15 * MiB]
            wait_for(after_restart, 20, "usage after the broker restart")
        assert daemon.status()["node"]["mqtt"]["connected"] is True
    finally:
        subscriber.close()
        assert daemon.stop() == 0, daemon.logs()


def _token_round_trips(state_dir: Path, n: int = 300) -> float:
    """p99 of request+grant round trips on a GPU shared by two allocations (seconds)."""
    a = make_record(state_dir)
    b = make_record(state_dir)
    with ChannelClient(wait_served(a)) as ca, ChannelClient(wait_served(b)) as cb:
        ca.hello()
        cb.hello()
        times = []
        for i in range(n):
            client = ca if i % 2 else cb
            start = time.perf_counter()
            client.request_token(0)
            times.append(time.perf_counter() - start)
            client.release_token(0)
    return statistics.quantiles(times, n=100)[98]


def test_a_broker_that_is_down_never_slows_the_token_path(state_dir: Path) -> None:
    baseline_dir = state_dir.parent / "plain"
    baseline_dir.mkdir(parents=True)
    plain = DaemonProcess(baseline_dir, "--metrics-port", "0").wait_ready()
    try:
        without = _token_round_trips(baseline_dir)
    finally:
        assert plain.stop() == 0
    # Nothing listens on this port: every connection attempt fails.
    down = start_daemon(state_dir, free_port(), "--mqtt-interval", "0.05")
    try:
        with_down = _token_round_trips(state_dir)
        node = down.status()["node"]["mqtt"]
        assert node["connected"] is False and node["queued"] > 0
    finally:
        assert down.stop() == 0, down.logs()
    print(f"token round trip p99: {without * 1e3:.3f} ms without MQTT, "
          f"{with_down * 1e3:.3f} ms with the broker down")
    # Generous: two shared cores; the point is no connect() or timeout on the token path.
    assert with_down < max(5 * without, 0.02)
