"""A real Mosquitto broker on a free port with a temporary config, and a subscriber."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest


def mosquitto_binary() -> str:
    for candidate in (shutil.which("mosquitto"), "/usr/sbin/mosquitto"):
        if candidate and Path(candidate).exists():
            return candidate
    pytest.skip("mosquitto not installed (apt-get install mosquitto; scripts/test does it)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Broker:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.binary = mosquitto_binary()
        self.port = port or free_port()
        self.config = directory / "mosquitto.conf"
        self.config.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\n"
                               "persistence false\n")
        self.log = directory / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Broker:
        self.proc = subprocess.Popen([self.binary, "-c", str(self.config)],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise AssertionError(f"mosquitto did not listen:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


class Subscriber:
    """paho in its own thread: every message on `topic`, decoded."""

    def __init__(self, port: int, topic: str) -> None:
        import paho.mqtt.client as paho

        mqtt: Any = paho

        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, *_: c.subscribe(topic)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        with self.lock:
            self.messages.append((message.topic, json.loads(message.payload)))

    def received(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return list(self.messages)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
