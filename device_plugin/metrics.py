"""The device plugin's Prometheus port (9403 by default, `metrics_port`; 0 = off): `/metrics`.

    gemini_vgpu_plugin_allocations_served_total            container requests Allocate
                                                           answered (kubelet's replays too)
    gemini_vgpu_plugin_allocations_failed_total{code}      container requests Allocate refused,
                                                           by gRPC status: INVALID_ARGUMENT (IDs
                                                           not this node's), FAILED_PRECONDITION
                                                           (GPU unhealthy or changing its slice
                                                           count, no interposer), INTERNAL (the
                                                           state directory), UNKNOWN (a bug)
    gemini_vgpu_plugin_allocate_duration_seconds           one Allocate call, served or refused
                                                           (histogram)
    gemini_vgpu_plugin_placements_failed_total{code}       GetPreferredAllocation requests
                                                           refused (kubelet then fails the pod's
                                                           admission before any Allocate):
                                                           RESOURCE_EXHAUSTED (no GPU has room),
                                                           INVALID_ARGUMENT (a size no GPU can
                                                           take)
    gemini_vgpu_plugin_gpu_slices_advertised{gpu,model}    slices of the GPU in the device list
    gemini_vgpu_plugin_gpu_healthy{gpu,model}              1 healthy, 0 not (XIDs, probes:
                                                           device_plugin/health.py)
    gemini_vgpu_plugin_gpu_draining{gpu,model}             1 while the GPU waits to change its
                                                           slice count (advertised Unhealthy,
                                                           device_plugin/slicecounts.py)
    gemini_vgpu_plugin_listandwatch_streams                kubelet's open ListAndWatch streams
                                                           (0: kubelet is not listening)
    gemini_vgpu_build_info{version,interposer,program}     1 (vgpu_runtime/common/metrics.py)

Counters and the histogram are prometheus_client's (safe from any thread); the device rows are
a tuple the event loop replaces whole on each change (DeviceList), so a scrape, in the port's
own thread, reads one consistent list without asking the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from vgpu_runtime.common.metrics import (
    MetricsPort,
    build_info,
    new_registry,
    open_port,
    registry_answer,
)

PROGRAM = "gemini-device-plugin"
# Allocate writes one small file and fsyncs it: about a millisecond on local disk; the top
# buckets catch a slow or saturated state directory (kubelet gives the call minutes).
ALLOCATE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 10.0)
GPU_LABELS = ["gpu", "model"]


@dataclass(frozen=True)
class GpuRow:
    uuid: str
    model: str
    slices: int
    healthy: bool
    draining: bool


class _Devices:
    """The collector of the device list's gauges (read from `rows` and `streams`)."""

    def __init__(self, rows: Callable[[], tuple[GpuRow, ...]],
                 streams: Callable[[], int]) -> None:
        self.rows = rows
        self.streams = streams

    def collect(self) -> Iterable[Metric]:
        yield build_info(PROGRAM)
        slices = GaugeMetricFamily("gemini_vgpu_plugin_gpu_slices_advertised",
                                   "Slices of the GPU in the device list kubelet is sent",
                                   labels=GPU_LABELS)
        healthy = GaugeMetricFamily("gemini_vgpu_plugin_gpu_healthy",
                                    "1 if the plugin holds the GPU healthy (no critical XID, "
                                    "its probe answers), else 0", labels=GPU_LABELS)
        draining = GaugeMetricFamily("gemini_vgpu_plugin_gpu_draining",
                                     "1 while the GPU waits for its allocations to end to "
                                     "change its slice count (its slices advertised "
                                     "Unhealthy), else 0", labels=GPU_LABELS)
        for row in self.rows():
            values = [row.uuid, row.model]
            slices.add_metric(values, row.slices)
            healthy.add_metric(values, 1.0 if row.healthy else 0.0)
            draining.add_metric(values, 1.0 if row.draining else 0.0)
        yield from (slices, healthy, draining)
        streams = GaugeMetricFamily("gemini_vgpu_plugin_listandwatch_streams",
                                    "ListAndWatch streams open (kubelet's; 0 while kubelet "
                                    "does not listen)")
        streams.add_metric([], self.streams())
        yield streams


class PluginMetrics:
    """The plugin's series in a registry of their own (common/metrics.py's new_registry)."""

    def __init__(self) -> None:
        self.registry = new_registry()
        self.served = Counter("gemini_vgpu_plugin_allocations_served",
                              "Container requests Allocate answered (kubelet's replays too)",
                              registry=self.registry)
        self.failed = Counter("gemini_vgpu_plugin_allocations_failed",
                              "Container requests Allocate refused, by gRPC status code",
                              ["code"], registry=self.registry)
        self.placements_failed = Counter(
            "gemini_vgpu_plugin_placements_failed", "GetPreferredAllocation requests refused, "
            "by gRPC status code", ["code"], registry=self.registry)
        self.duration = Histogram("gemini_vgpu_plugin_allocate_duration_seconds",
                                  "Time to answer one Allocate call, served or refused",
                                  buckets=ALLOCATE_BUCKETS, registry=self.registry)
        self._rows: tuple[GpuRow, ...] = ()
        self._streams: Callable[[], int] = lambda: 0
        self.registry.register(_Devices(lambda: self._rows, lambda: self._streams()))
        self.answer = registry_answer(self.registry)

    def allocated(self, containers: int, seconds: float) -> None:
        self.served.inc(containers)
        self.duration.observe(seconds)

    def refused(self, code: str, containers: int, seconds: float) -> None:
        self.failed.labels(code=code).inc(containers)
        self.duration.observe(seconds)

    def placement_refused(self, code: str) -> None:
        self.placements_failed.labels(code=code).inc()

    def set_devices(self, rows: tuple[GpuRow, ...], streams: Callable[[], int]) -> None:
        """Called on the event loop after every change of the device list."""
        self._rows = rows
        self._streams = streams

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def serve_port(metrics: PluginMetrics, address: str, port: int) -> MetricsPort | None:
    """Start the port; None, with an error line, where it cannot be had (the plugin serves
    kubelet all the same: metrics are not worth a node without GPUs)."""
    return open_port(metrics.answer, address, port, "plugin-metrics")
