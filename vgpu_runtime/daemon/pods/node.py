"""What this node has: its GPUs (NVML or simulated, through vgpu_runtime.gpus), their
health as the plugin last wrote it (<state-dir>/health.json), and the node labels they give.

Labels, as GPU feature discovery sets them (values sanitized to valid label values):
    gemini.ai/gpu.model              e.g. NVIDIA-H200 (from "NVIDIA H200")
    gemini.ai/gpu.count              GPUs this node shares
    gemini.ai/vgpu.slices-per-gpu    N
    gemini.ai/version                the package version
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from vgpu_runtime import __version__
from vgpu_runtime.contracts import nodefiles, paths
from vgpu_runtime.gpus import DiscoveryError, GpuInfo

log = logging.getLogger(__name__)

LABEL_MODEL = "gemini.ai/gpu.model"
LABEL_COUNT = "gemini.ai/gpu.count"
LABEL_SLICES = "gemini.ai/vgpu.slices-per-gpu"
LABEL_VERSION = "gemini.ai/version"
MAX_LABEL_VALUE = 63


def discover_gpus(simulate: int, model: str) -> list[GpuInfo]:
    """The node's GPUs; an empty list (logged) where NVML is missing, as on a laptop."""
    try:
        if simulate:
            from vgpu_runtime.gpus.simulated import SimulatedBackend

            found = SimulatedBackend(simulate, model).discover()
        else:
            from vgpu_runtime.gpus.nvml import NvmlBackend

            found = NvmlBackend().discover()
    except (DiscoveryError, ImportError, OSError) as err:
        log.info("no GPU discovered: labels and metrics show allocations only",
                 extra={"error": str(err)})
        return []
    return found


def label_value(text: str) -> str:
    """A valid label value: [A-Za-z0-9._-], at most 63, starting and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip())[:MAX_LABEL_VALUE]
    return value.strip("-._")


def node_labels(gpus: list[GpuInfo], slices_per_gpu: int) -> dict[str, str]:
    models = sorted({g.model for g in gpus})
    labels = {LABEL_COUNT: str(len(gpus)), LABEL_SLICES: str(slices_per_gpu),
              LABEL_VERSION: label_value(__version__)}
    if models:
        # Mixed nodes are rare; the label names them all, joined, like GFD's product label.
        labels[LABEL_MODEL] = label_value("_".join(models))
    return labels


class HealthFile:
    """Reads health.json again only when it changed; a bad file keeps the last good view."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = paths.health_file(state_dir)
        self._signature: tuple[int, int] | None = None
        self.health: dict[str, tuple[bool, str]] = {}   # uuid -> (healthy, reason)

    def read(self) -> dict[str, tuple[bool, str]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self.health
        signature = (st.st_ino, st.st_mtime_ns)
        if signature == self._signature:
            return self.health
        try:
            health = {uuid: (h.healthy, h.reason)
                      for uuid, h in nodefiles.decode_health(self.path.read_bytes()).items()}
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable health file", extra={"path": str(self.path),
                                                                  "error": str(err)})
            return self.health
        self._signature = signature
        self.health = health
        return health


SliceCount = nodefiles.SliceCount


class SliceCountsFile:
    """Reads slices.json (each GPU's advertised and configured slice count, and the allocations
    a waiting change waits for) again only when it changed; a bad file keeps the last view."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = paths.slices_file(state_dir)
        self._signature: tuple[int, int] | None = None
        self.counts: dict[str, SliceCount] = {}

    def read(self) -> dict[str, SliceCount]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self.counts
        signature = (st.st_ino, st.st_mtime_ns)
        if signature == self._signature:
            return self.counts
        try:
            counts = nodefiles.decode_slice_counts(self.path.read_bytes())
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable slice counts", extra={"path": str(self.path),
                                                                   "error": str(err)})
            return self.counts
        self._signature = signature
        self.counts = counts
        return counts
