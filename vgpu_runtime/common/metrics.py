"""What every program that serves Prometheus metrics shares: `gemini_vgpu_build_info`, the
small HTTP server its port runs in, and a registry served at /metrics.

    gemini_vgpu_build_info{version,interposer,program}   1: what runs (the package, the
                                                          interposer library it hands out or
                                                          serves, and which program says so)

The ports, one per program so that any two can share a machine (README, "Metrics"):
    9401  gemini-daemon (the node daemon)
    9402  gemini-host serve (the host daemon; 127.0.0.1 unless opened)
    9403  gemini-device-plugin
    9404  gemini-config-manager (the node pod's sidecar; none with --oneshot)
    none  gemini-run's per-user daemon, until a user asks for one (gemini-run --metrics-port)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vgpu_runtime import __version__, hooklib

log = logging.getLogger(__name__)

BUILD_INFO = "gemini_vgpu_build_info"
PLUGIN_PORT = 9403
CONFIG_MANAGER_PORT = 9404

# path -> (HTTP status, content type, body)
Answer = Callable[[str], tuple[int, str, bytes]]


def build_info(program: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(BUILD_INFO, "The package version, the interposer library and "
                               "the program that exports it (always 1)",
                               labels=["version", "interposer", "program"])
    family.add_metric([__version__, hooklib.library_name(), program], 1.0)
    return family


class MetricsPort:
    """An HTTP server in a thread of its own; `answer(path)` (query string removed) gives each
    GET its reply. Scrapes are not logged (one line each would drown the log)."""

    def __init__(self, address: str, port: int, answer: Answer, name: str = "metrics") -> None:
        self.answer = answer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    code, ctype, body = answer(self.path.split("?", 1)[0])
                except Exception as err:   # a reply still, and the server serves on
                    log.exception("metrics request failed")
                    code, ctype, body = 500, "text/plain", f"error: {err!r}\n".encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        # Raises OSError where the port is taken: the caller says so and runs on without it.
        self.httpd = ThreadingHTTPServer((address, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


def not_found(paths_served: str) -> tuple[int, str, bytes]:
    return 404, "text/plain", f"not found: try {paths_served}\n".encode()


def new_registry() -> CollectorRegistry:
    """A registry of a program's own series: no process or platform collectors (they would
    differ between programs and say nothing about GPU sharing), and no <name>_created series
    beside each counter (a series per counter that no panel or alert reads)."""
    disable_created_metrics()  # type: ignore[no-untyped-call]
    return CollectorRegistry(auto_describe=False)


def registry_answer(registry: CollectorRegistry) -> Answer:
    """A port's answer that serves `registry` at /metrics and nothing else."""
    def answer(path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, bytes(generate_latest(registry))
        return not_found("/metrics")
    return answer


def open_port(answer: Answer, address: str, port: int, name: str) -> MetricsPort | None:
    """Start a port in its thread `name`; None, with an error line, where it cannot be had:
    metrics are not worth stopping a program that serves the node otherwise."""
    try:
        server = MetricsPort(address, port, answer, name=name)
    except OSError as err:
        log.error("metrics port unavailable; running without /metrics",
                  extra={"port": port, "address": address, "error": str(err)})
        return None
    server.start()
    log.info("metrics served", extra={"port": server.port, "address": address})
    return server
