"""The device plugin's settings: one declaration gives flags, GEMINI_* env vars and YAML keys.

Defaults that needed a choice:
- memory_reserve 2GiB: NVML's "total" includes memory the driver keeps for itself (page tables,
  ECC and row-remap reserves, the driver's own context), several hundred MiB on an H200, plus
  per-context overhead that no container is charged for (NVML probes, the persistence daemon).
  2GiB is about 1.4 % of an H200 and keeps the N slices of a GPU really allocatable together.
- device_list_strategy cdi: CDI device names are resolved by the container runtime from the
  node's CDI spec; a pod cannot widen them. With `envvar`, a pod that sets
  NVIDIA_VISIBLE_DEVICES=all itself may receive every GPU unless the NVIDIA runtime is set to
  ignore that variable from unprivileged pods. `envvar` stays available for nodes without CDI.
- injection ld-preload: the LD_PRELOAD variable works on every runtime, gVisor included, and
  leaves an image's own /etc/ld.so.preload alone. A pod can replace it with its own LD_PRELOAD,
  which a mounted /etc/ld.so.preload (`preload-file`) prevents; but that file replaces the image's
  own preload file and gVisor ignores it. Neither stops a hostile process (static linking, raw
  ioctls), so the portable method is the default and `both` is there for nodes that want it.
- health_recheck_interval 10s: an NVML probe costs well under a millisecond; 10 s returns a
  recovered GPU to the scheduler quickly without polling the driver hard.
- recovery_quiet_period 300s: critical XIDs come in bursts (ECC, row remapping, bus errors);
  five minutes without one, with a working probe, is strong evidence the fault has passed.
- metrics_port 9403: a port of its own beside the node daemon's 9401 and the host daemon's
  9402 (and clear of DCGM exporter's 9400, often on the same GPU nodes).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.config import ConfigError, setting
from vgpu_runtime.common.metrics import PLUGIN_PORT
from vgpu_runtime.contracts import paths

DEFAULT_SOCKET_NAME = "gemini-vgpu.sock"
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)
PLACEMENTS = ("best-fit", "spread")
STRATEGIES = ("envvar", "cdi", "device-nodes")
INJECTIONS = ("ld-preload", "preload-file", "both")


def _file_name(value: Any) -> str:
    name = cfg.text(value)
    if "/" in name or name in (".", ".."):
        raise ValueError(f"expected a file name without '/', got {value!r}")
    return name


@dataclass(frozen=True)
class PluginConfig:
    SECTION: ClassVar[str] = "devicePlugin"

    kubelet_dir: str = setting(paths.DEFAULT_KUBELET_DIR,
                               "directory where kubelet serves kubelet.sock", cfg.text, "DIR")
    state_dir: str = cfg.node_setting("state_dir")
    socket_name: str = setting(DEFAULT_SOCKET_NAME,
                               "file name of the plugin's socket in the kubelet dir", _file_name)
    resource_name: str = cfg.node_setting("resource_name")
    slices_per_gpu: int = cfg.node_setting("slices_per_gpu")
    placement: str = setting("best-fit", "GetPreferredAllocation policy: best-fit|spread",
                             cfg.choice(*PLACEMENTS), "POLICY")
    simulate_gpus: int = cfg.node_setting("simulate_gpus")
    simulate_model: str = cfg.node_setting("simulate_model")
    mps: bool = cfg.node_setting("mps", help="give each container the node daemon's MPS "
                                 "control daemon: its pipes and the /dev/shm it runs with")
    mps_shm_dir: str = setting(paths.DEFAULT_MPS_SHM_DIR, "with mps: the host directory the "
                               "MPS control daemon runs with as /dev/shm, mounted at /dev/shm in "
                               "every container", cfg.text, "DIR")
    simulate_memory: int = setting(141 * 1000**3, "memory of each simulated GPU, e.g. 141GiB",
                                   cfg.size, "SIZE")
    simulate_control_dir: str | None = setting(
        None, "directory polled for simulated XID/usable events (default <state-dir>/simulate)",
        cfg.optional(cfg.text), "DIR")
    memory_reserve: int = setting(2 << 30, "memory per GPU kept out of the slices (contexts)",
                                  cfg.size, "SIZE")
    device_list_strategy: str = setting("cdi", "how a container gets its GPU: envvar|cdi|"
                                        "device-nodes", cfg.choice(*STRATEGIES), "STRATEGY")
    cdi_kind: str = setting("nvidia.com/gpu", "CDI kind of the GPU devices", cfg.resource_name,
                            "KIND")
    injection: str = setting("ld-preload", "how the interposer is loaded: ld-preload (env), "
                             "preload-file (a mounted /etc/ld.so.preload) or both",
                             cfg.choice(*INJECTIONS), "METHOD")
    hook_dir: str | None = setting(None, "host directory holding the interposer library "
                                   "(default <state-dir>/lib)", cfg.optional(cfg.text), "DIR")
    ignored_xids: tuple[int, ...] = setting(DEFAULT_IGNORED_XIDS,
                                            "XIDs that do not make a GPU unhealthy",
                                            cfg.int_list, "LIST")
    health_recheck_interval: float = setting(10.0, "seconds between probes of the GPUs",
                                             cfg.number(minimum=0.01), "SECONDS")
    recovery_quiet_period: float = setting(300.0, "seconds without a critical XID before an "
                                           "unhealthy GPU may recover", cfg.number(minimum=0),
                                           "SECONDS")
    metrics_port: int = setting(PLUGIN_PORT, "HTTP port of the plugin's /metrics (0 = off; the "
                                "node daemon's is 9401)", cfg.integer(0, 65535), "PORT")
    metrics_address: str = setting("0.0.0.0", "address the metrics port listens on", cfg.text,
                                   "ADDRESS")
    log_level: str = setting("info", "debug|info|warning|error",
                             cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = setting("json", "json|text", cfg.choice("json", "text"), "FORMAT")

    @property
    def plugin_socket(self) -> Path:
        return Path(self.kubelet_dir) / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return Path(self.kubelet_dir) / "kubelet.sock"

    @property
    def control_dir(self) -> Path:
        return Path(self.simulate_control_dir or Path(self.state_dir) / "simulate")

    @property
    def host_hook_dir(self) -> Path:
        return Path(self.hook_dir) if self.hook_dir else paths.default_hook_dir(self.state_dir)


def check(config: PluginConfig) -> PluginConfig:
    """Checks that involve more than one field, so a bad node setup fails at start-up."""
    if not paths.fits_unix_socket(config.plugin_socket):
        raise ConfigError(f"kubelet_dir/socket_name: socket path {config.plugin_socket} is "
                          f"longer than {paths.UNIX_PATH_MAX} bytes; use a shorter directory")
    longest = paths.channel_socket(paths.channel_dir(config.state_dir, "k-" + "0" * 16))
    if not paths.fits_unix_socket(longest):
        raise ConfigError(f"state_dir: channel sockets such as {longest} would be longer than "
                          f"{paths.UNIX_PATH_MAX} bytes; use a shorter state directory")
    if config.simulate_gpus and config.memory_reserve >= config.simulate_memory:
        raise ConfigError(f"memory_reserve: {config.memory_reserve} bytes leaves nothing of the "
                          f"simulated GPUs' {config.simulate_memory} bytes")
    return config


def load_all(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
             ) -> cfg.Loaded[PluginConfig]:
    """Flags > environment > YAML file (--config or $GEMINI_CONFIG); raises ConfigError."""
    loaded = cfg.load_all(PluginConfig, argv, os.environ if environ is None else environ,
                          prog="gemini-device-plugin",
                          description="Kubernetes device plugin advertising every GPU as N "
                                      "gemini.ai/vgpu slices")
    check(loaded.config)
    return loaded


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
         ) -> PluginConfig:
    return load_all(argv, environ).config


__all__ = ["ConfigError", "PluginConfig", "check", "load", "load_all"]
