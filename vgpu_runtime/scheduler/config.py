"""gemini-scheduler's settings: flags > environment (GEMINI_*) > YAML file."""

from __future__ import annotations

from dataclasses import dataclass

from vgpu_runtime import paths
from vgpu_runtime.common import config as cfg


@dataclass(frozen=True)
class SchedulerConfig:
    state_dir: str = cfg.setting(
        paths.default_state_dir(), "state directory holding allocations/ and channels/",
        cfg.text, "DIR")
    poll_interval: float = cfg.setting(
        0.2, "seconds between scans of the allocation records", cfg.number(0.01, 10), "SECONDS")
    default_limit: float = cfg.setting(
        1.0, "cap on an allocation's GPU-time share when its record sets none",
        cfg.number(0.000001, 1.0), "FRACTION")
    log_level: str = cfg.setting(
        "info", "log level", cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "log format", cfg.choice("json", "text"), "FORMAT")
