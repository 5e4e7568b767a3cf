"""The host daemon's settings: the node daemon's (daemon/config.py, same flags, environment and
file section `scheduler:`), with the defaults of a machine's one daemon for every user, and its
group. Flags > environment (GEMINI_*) > file, as everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.config import DaemonConfig


@dataclass(frozen=True)
class HostConfig(DaemonConfig):
    SECTION: ClassVar[str] = "scheduler"

    # The machine's state directory whoever starts it (root, always).
    state_dir: str = cfg.node_setting("state_dir", paths.DEFAULT_STATE_DIR)
    host_group: str = cfg.setting(
        paths.DEFAULT_HOST_GROUP, "the Unix group whose members the host daemon serves: its "
        "socket <state-dir>/host.sock is root's and this group's, mode 0660", cfg.text, "GROUP")
    # Its own port: a machine's node daemon has 9401. Local only unless an operator opens it:
    # /metrics shows every user's allocations, which users do not see of each other.
    metrics_port: int = cfg.setting(
        paths.HOST_METRICS_PORT, "HTTP port of /metrics, /healthz and /readyz (0 = off; the "
        "node daemon's is 9401)", cfg.integer(0, 65535), "PORT")
    metrics_address: str = cfg.setting(
        "127.0.0.1", "address the metrics port listens on (0.0.0.0 to let a Prometheus "
        "elsewhere read it)", cfg.text, "ADDRESS")
    def check(self) -> None:
        super().check()
        if self.mps:
            raise cfg.ConfigError("mps: one MPS server serves one Linux user, and the host "
                                  "daemon serves every user of its group: turn mps off here; "
                                  "a user's own daemon runs it (GEMINI_MPS=on gemini-run)")

    gpu_lock_dir: str | None = cfg.setting(
        paths.DEFAULT_GPU_LOCK_DIR, "host-wide GPU locks (vgpu_runtime/gpulock.py): the host "
        "daemon holds every GPU it serves there, so that no user's own daemon serves one too",
        cfg.optional(cfg.text), "DIR")
