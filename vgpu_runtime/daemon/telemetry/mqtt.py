"""Optional MQTT telemetry (aiomqtt), on only when `mqtt_url` is set.

Topics (`<prefix>` is `mqtt_topic_prefix`, default `gemini`; `<node>` the node name; `<gpu>` the
GPU's UUID). Every payload is one JSON object with `ts` (seconds since the epoch) and `node`:

    <prefix>/<node>/<gpu>/usage    every `mqtt_interval` seconds, one message per container on
                                   that GPU: pod, namespace, container, allocation, gpu,
                                   request, limit, achieved, memory_used_bytes,
                                   memory_limit_bytes, memory_refusals, token_waits,
                                   token_wait_seconds (the figures of /metrics)
    <prefix>/<node>/<gpu>/events   {"event": ...}:
                                   allocation-added / allocation-removed / allocation-bound /
                                   allocation-collected (allocation, pod, namespace, container,
                                   reason where there is one);
                                   gpu-unhealthy / gpu-healthy (reason), from the plugin's
                                   health file

QoS 0, not retained: telemetry, not state. Publishing never blocks scheduling: messages go into a
bounded queue (the oldest is dropped when it is full) that one task drains while connected; on a
broker loss it reconnects with exponential backoff (0.5 s doubling to 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

DEFAULT_PORT = 1883
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0


def parse_broker_url(url: str) -> tuple[str, int]:
    """mqtt://host[:port] (tcp:// too) -> (host, port); raises ValueError saying the form."""
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    try:
        port = parsed.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port in {url!r}; expected mqtt://host[:port]") from None
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise ValueError(f"expected mqtt://host[:port], got {url!r}")
    return parsed.hostname, port


def topic(prefix: str, node: str, gpu: str, kind: str) -> str:
    return f"{prefix}/{node}/{gpu}/{kind}"


class MqttPublisher:
    def __init__(self, url: str, node: str, prefix: str, queue_size: int) -> None:
        self.host, self.port = parse_broker_url(url)
        self.node = node
        self.prefix = prefix
        self.queue: deque[tuple[str, bytes]] = deque(maxlen=queue_size)
        self.dropped = 0
        self.published = 0
        self.connected = False
        self.connects = 0
        self._ready = asyncio.Event()

    def publish(self, gpu: str, kind: str, document: dict[str, Any]) -> None:
        """Queue one message; never waits. A full queue loses its oldest message."""
        payload = json.dumps({"ts": time.time(), "node": self.node, **document}).encode()
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self.queue.append((topic(self.prefix, self.node, gpu, kind), payload))
        self._ready.set()

    async def run(self) -> None:
        import aiomqtt

        backoff = BACKOFF_FIRST
        while True:
            try:
                # The client id keeps the daemon's old name: brokers' ACLs and sessions key on it.
                async with aiomqtt.Client(self.host, self.port, timeout=5,
                                          identifier=f"gemini-scheduler-{self.node}") as client:
                    self.connected = True
                    self.connects += 1
                    backoff = BACKOFF_FIRST
                    log.info("MQTT connected", extra={"broker": f"{self.host}:{self.port}"})
                    await self._drain(client)
            except aiomqtt.MqttError as err:
                if self.connected:
                    log.warning("MQTT broker lost; reconnecting", extra={"error": str(err)})
                else:
                    log.debug("MQTT broker unreachable", extra={"error": str(err),
                                                                "retry_s": backoff})
            finally:
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _drain(self, client: Any) -> None:
        while True:
            if not self.queue:
                self._ready.clear()
                await self._ready.wait()
                continue
            name, payload = self.queue[0]
            await client.publish(name, payload, qos=0)
            # Taken off only once handed to the connection: a broker loss keeps it queued.
            if self.queue and self.queue[0] == (name, payload):
                self.queue.popleft()
            self.published += 1


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
