"""The daemon's HTTP port: `/metrics` (Prometheus), `/healthz` (liveness), `/readyz` (readiness).

Series (all from telemetry.py, the figures `gemini-vgpu status` shows):

    gemini_vgpu_gpu_slices{gpu,model}                    slices the GPU is advertised as
    gemini_vgpu_gpu_slices_allocated{gpu,model}          slices held by allocations
    gemini_vgpu_gpu_healthy{gpu,model}                   1 healthy, 0 not (the plugin's view)
    gemini_vgpu_gpu_unattributed_memory_bytes{gpu,model} held by processes of no allocation
    per container, labels pod, namespace, container, allocation, gpu:
    gemini_vgpu_container_request_ratio                  guaranteed share of the GPU's time
    gemini_vgpu_container_limit_ratio                    cap on that share
    gemini_vgpu_container_achieved_ratio                 share achieved over the window
    gemini_vgpu_container_gpu_seconds_total (counter)    GPU time charged since it joined
                                                         (rate() of it: the share over any span)
    gemini_vgpu_container_memory_used_bytes / _memory_limit_bytes
    gemini_vgpu_token_wait_seconds (histogram)           waits for the GPU-time token
    gemini_vgpu_memory_refusals_total (counter)          allocations refused over the limit
    gemini_vgpu_memory_over_limit_reports_total (counter) found past the limit by NVML
    gemini_vgpu_memory_over_limit_kills_total (counter)  processes killed for it
                                                         (over_limit_action kill)
    gemini_vgpu_memory_unhooked_bytes                    charged for processes with no
                                                         connection to the interposer
    gemini_vgpu_build_info{version,interposer,program}   1: what runs (the package, the
                                                         interposer library it serves, and
                                                         gemini-daemon or gemini-host:
                                                         common/metrics.py)

The server runs in a thread (prometheus_client's exposition, http.server); each scrape asks the
event loop for one status snapshot, so the figures are consistent and the loop stays the only
owner of the state. `/healthz` answers 200 while the loop answers within 2 s; `/readyz` 200 once
the records have been scanned and their channels served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vgpu_runtime.common.metrics import MetricsPort, build_info, not_found
from vgpu_runtime.daemon.telemetry.rows import container_rows, gpu_rows

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT = 2.0
CONTAINER_LABELS = ["pod", "namespace", "container", "allocation", "gpu"]
DEFAULT_PROGRAM = "gemini-daemon"


def metric_families(status: dict[str, Any]) -> Iterable[Metric]:
    yield build_info(str(status.get("daemon", {}).get("program", DEFAULT_PROGRAM)))
    gpu_labels = ["gpu", "model"]
    slices = GaugeMetricFamily("gemini_vgpu_gpu_slices", "Slices the GPU is advertised as",
                               labels=gpu_labels)
    allocated = GaugeMetricFamily("gemini_vgpu_gpu_slices_allocated",
                                  "Slices of the GPU held by allocations", labels=gpu_labels)
    healthy = GaugeMetricFamily("gemini_vgpu_gpu_healthy",
                                "1 if the device plugin reports the GPU healthy, else 0",
                                labels=gpu_labels)
    unattributed = GaugeMetricFamily(
        "gemini_vgpu_gpu_unattributed_memory_bytes", "GPU memory NVML says processes of no "
        "allocation hold on a GPU that allocations share", labels=gpu_labels)
    for gpu in gpu_rows(status):
        values = [gpu.uuid, gpu.model]
        slices.add_metric(values, gpu.slices)
        allocated.add_metric(values, gpu.slices_allocated)
        healthy.add_metric(values, 1.0 if gpu.healthy else 0.0)
        unattributed.add_metric(values, gpu.unattributed_bytes)
    yield from (slices, allocated, healthy, unattributed)

    def gauge(name: str, text: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, text, labels=CONTAINER_LABELS)
    request = gauge("gemini_vgpu_container_request_ratio",
                    "Guaranteed share of the GPU's time (slices / slices per GPU)")
    limit = gauge("gemini_vgpu_container_limit_ratio", "Cap on the share of the GPU's time")
    achieved = gauge("gemini_vgpu_container_achieved_ratio",
                     "Share of the GPU's time achieved over the scheduler's window")
    gpu_seconds = CounterMetricFamily(
        "gemini_vgpu_container_gpu_seconds", "GPU time charged to the container since it "
        "joined the GPU (busy time where co-scheduled)", labels=CONTAINER_LABELS)
    used = gauge("gemini_vgpu_container_memory_used_bytes", "GPU memory the container holds")
    memory_limit = gauge("gemini_vgpu_container_memory_limit_bytes",
                      "GPU memory limit of the container")
    waits = HistogramMetricFamily("gemini_vgpu_token_wait_seconds",
                                  "Time a container waited for the GPU-time token",
                                  labels=CONTAINER_LABELS)
    refusals = CounterMetricFamily("gemini_vgpu_memory_refusals",
                                   "GPU memory allocations refused over the container's limit",
                                   labels=CONTAINER_LABELS)
    over_limit = CounterMetricFamily(
        "gemini_vgpu_memory_over_limit_reports",
        "Times per-process figures found the container past its memory limit (memory the hook "
        "did not see)", labels=CONTAINER_LABELS)
    kills = CounterMetricFamily(
        "gemini_vgpu_memory_over_limit_kills",
        "Processes killed for holding memory past the container's limit (over_limit_action "
        "kill)", labels=CONTAINER_LABELS)
    unhooked = gauge("gemini_vgpu_memory_unhooked_bytes",
                     "GPU memory charged to the container for its processes with no connection "
                     "to the interposer (NVML's figures)")
    for row in container_rows(status):
        values = [row.pod, row.namespace, row.container, row.allocation, row.gpu]
        over_limit.add_metric(values, row.over_limit_reports)
        kills.add_metric(values, row.over_limit_kills)
        unhooked.add_metric(values, row.unhooked_bytes)
        request.add_metric(values, row.share)
        limit.add_metric(values, row.limit)
        achieved.add_metric(values, row.achieved)
        gpu_seconds.add_metric(values, row.gpu_seconds)
        used.add_metric(values, row.memory_used)
        memory_limit.add_metric(values, row.memory_limit)
        refusals.add_metric(values, row.memory_refusals)
        cumulative, buckets = 0, []
        for bound, count in zip([*row.waits["bounds"], float("inf")], row.waits["counts"],
                                strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
        waits.add_metric(values, buckets, row.waits["sum"])
    yield from (request, limit, achieved, gpu_seconds, used, memory_limit, waits, refusals,
                over_limit, kills, unhooked)


class _Snapshot:
    """A collector over one status answer."""

    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status

    def collect(self) -> Iterable[Metric]:
        return metric_families(self.status)


def render(status: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(status))
    return bytes(generate_latest(registry))


class MetricsServer:
    """The daemon's port: every answer is computed on the event loop (the state's one owner)."""

    def __init__(self, address: str, port: int, loop: asyncio.AbstractEventLoop,
                 status: Callable[[], dict[str, Any]], ready: Callable[[], bool]) -> None:
        self.loop = loop
        self.status = status
        self.ready = ready
        self.server = MetricsPort(address, port, self.answer)
        self.port = self.server.port

    def start(self) -> None:
        self.server.start()
        log.info("metrics served", extra={"port": self.port})

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(SCRAPE_TIMEOUT)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        try:
            if path == "/metrics":
                return 200, CONTENT_TYPE_LATEST, render(self._on_loop(self.status))
            if path == "/healthz":
                self._on_loop(lambda: None)
                return 200, "text/plain", b"ok\n"
            if path == "/readyz":
                if self._on_loop(self.ready):
                    return 200, "text/plain", b"ready\n"
                return 503, "text/plain", b"not ready: records not served yet\n"
        except (FutureTimeout, RuntimeError) as err:
            return 503, "text/plain", f"event loop not answering: {err!r}\n".encode()
        return not_found("/metrics, /healthz, /readyz")

    def close(self) -> None:
        self.server.close()
