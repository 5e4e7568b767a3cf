"""gemini-daemon's settings: flags > environment (GEMINI_*) > YAML file.

The token scheduler's constants are settings too, with the algorithm's defaults
(`vgpu_runtime.timeshare.policy.TimeshareSettings`). Why each of the daemon's own defaults is
what it is: README.md beside this package. Two rules hold whatever the values:

* every resource one allocation's clients may use is capped (security, S2): past a cap the one
  connection is refused or dropped, with one log line;
* the `interposer_*` settings reach every hook in its hello reply; a pod's environment
  (GEMINI_HOOK_*) may only make them safer, and the daemon's own environment names them
  GEMINI_INTERPOSER_*, so hook variables a daemon inherits never configure the node.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import ClassVar

from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.mps import mps_control_setting
from vgpu_runtime.timeshare.policy import TimeshareSettings

_ALGORITHM = TimeshareSettings()


def default_node_name() -> str:
    """The Downward API's NODE_NAME in the DaemonSet; the host name elsewhere."""
    return os.environ.get("NODE_NAME") or socket.gethostname()
LIMIT_POLICIES = ("work-conserving", "strict")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
TOKEN_PATHS = ("auto", "native", "python")
PROCESS_MEMORY_SOURCES = ("auto", "nvml", "simulated", "off")


@dataclass(frozen=True)
class DaemonConfig:
    SECTION: ClassVar[str] = "scheduler"

    # The node's root default (/var/lib/gemini) for root; elsewhere the user's own.
    state_dir: str = cfg.node_setting("state_dir", paths.default_state_dir())
    poll_interval: float = cfg.setting(
        0.2, "seconds between scans of the allocation records", cfg.number(0.01, 10), "SECONDS")
    default_limit: float = cfg.setting(
        1.0, "cap on an allocation's GPU-time share when its record sets none "
        "(work-conserving policy)", cfg.number(0.000001, 1.0), "FRACTION")
    idle_exit: float = cfg.setting(
        0.0, "exit after this long without any allocation (0 = never; the daemon gemini-run "
        "starts gets 600)", cfg.number(0.0, 86400 * 366), "SECONDS")
    limit_policy: str = cfg.setting(
        "work-conserving", "limit of an allocation whose record sets none: work-conserving "
        "(default_limit) or strict (its request)", cfg.choice(*LIMIT_POLICIES), "POLICY")
    window: float = cfg.setting(
        _ALGORITHM.window, "seconds of history a GPU-time share is measured over",
        cfg.number(0.1, 3600), "SECONDS")
    min_quota: float = cfg.setting(
        _ALGORITHM.min_quota, "shortest token quota, seconds", cfg.number(0.0001, 10), "SECONDS")
    max_quota: float = cfg.setting(
        _ALGORITHM.max_quota, "longest token quota, seconds", cfg.number(0.0001, 10), "SECONDS")
    cycle: float = cfg.setting(
        _ALGORITHM.cycle, "seconds of one round; a tenant's base quota is its part of it",
        cfg.number(0.0001, 60), "SECONDS")
    catch_up: float = cfg.setting(
        _ALGORITHM.catch_up, "part of its lag behind the others (GPU seconds at its request) "
        "added to a quota",
        cfg.number(0.0, 1.0), "FRACTION")
    revoke_grace: float = cfg.setting(
        _ALGORITHM.revoke_grace, "seconds a holder may overrun its quota before revocation",
        cfg.number(0.0, 10), "SECONDS")
    preempt_after: float = cfg.setting(
        _ALGORITHM.preempt_after, "a holder keeps the token at least this long once a tenant "
        "that woke up behind it waits, then gives way (e.g. 0.005); 0 = off, seconds",
        cfg.number(0.0, 10), "SECONDS")
    burst_merge_gap: float = cfg.setting(
        _ALGORITHM.burst_merge_gap, "kernel bursts closer than this are one burst, seconds",
        cfg.number(0.0, 1.0), "SECONDS")
    burst_history: float = cfg.setting(
        _ALGORITHM.burst_history, "seconds of bursts a quota estimate looks at",
        cfg.number(0.01, 3600), "SECONDS")
    co_schedule: bool = cfg.setting(
        _ALGORITHM.co_schedule, "grant several tenants at once while their busy fractions "
        "(NVML, measured while each holds alone) leave the GPU room; off: one holder at a time",
        cfg.boolean, "BOOL")
    co_room: float = cfg.setting(
        _ALGORITHM.co_room, "the most the co-holders' busy fractions may add up to",
        cfg.number(0.1, 8), "FRACTION")
    co_busy_max: float = cfg.setting(
        _ALGORITHM.co_busy_max, "a tenant busier than this alone is GPU-bound and gets "
        "exclusive turns only", cfg.number(0.0, 1.0), "FRACTION")
    co_refresh: float = cfg.setting(
        _ALGORITHM.co_refresh, "seconds a busy fraction stays good; an older one means "
        "exclusive turns until measured again", cfg.number(0.1, 3600), "SECONDS")
    co_starved: float = cfg.setting(
        _ALGORITHM.co_starved, "a co-holder whose pace beside others, of its pace alone, is "
        "below this times its part of the turns is starved: no one joins holders that "
        "over-fill the GPU while it is behind; 0 = off", cfg.number(0.0, 4.0), "FACTOR")
    mps: bool = cfg.node_setting("mps")
    mps_control: str = mps_control_setting()
    mps_manage: bool = cfg.setting(
        True, "with mps: start the MPS control daemon when none answers and quit it once "
        "nothing is live; false where a container of its own runs it (gemini-mps-control, "
        "daemonset/components/mps), so a daemon's rollout never stops its tenants' server",
        cfg.boolean, "BOOL")
    idle_release: float = cfg.setting(
        0.002, "a holder that launched nothing this long after its last sync gives the token "
        "back early when another tenant waits, seconds", cfg.number(0.0001, 10), "SECONDS")
    first_launch_grace: float = cfg.setting(
        0.02, "a fresh grant's holder that has launched nothing yet is given this long, where "
        "longer than the idle release, before it gives the token back early (0: the idle "
        "release; for hosts whose busy CPUs wake holders late), seconds", cfg.number(0.0, 10),
        "SECONDS")
    event_loop: str = cfg.setting(
        "auto", "event loop of the daemon: auto (uvloop when it is installed, else asyncio's), "
        "uvloop or asyncio", cfg.choice(*EVENT_LOOPS), "LOOP")
    # Deprecated, kept one release so that configurations naming it still load: one token
    # implementation remains (Python; BENCHMARKS.md, "One token implementation").
    token_path: str = cfg.setting(
        "auto", "deprecated and ignored (the token code is Python alone); a value other than "
        "auto logs a warning", cfg.choice(*TOKEN_PATHS), "PATH")
    # ---- what one allocation's clients may use (security, S2) ----
    max_connections: int = cfg.setting(
        1024, "connections one allocation may hold at once; past it a new one is refused with "
        "an error frame", cfg.integer(1, 1_000_000), "N")
    connect_rate: float = cfg.setting(
        50.0, "new connections per second one allocation may open, after connect_burst at "
        "once; past it a connection is refused with an error frame (0: no limit)",
        cfg.number(0, 1_000_000), "PER_SECOND")
    connect_burst: int = cfg.setting(
        200, "connections one allocation may open at once before connect_rate applies",
        cfg.integer(1, 1_000_000), "N")
    client_send_buffer: int = cfg.setting(
        64 * 1024, "bytes of replies queued to one client that is not reading (its frames in "
        "flight); past it the daemon waits up to client_write_timeout", cfg.integer(
            4096, 64 << 20), "BYTES")
    client_write_timeout: float = cfg.setting(
        5.0, "seconds the daemon waits for one client to read its replies before dropping "
        "the connection", cfg.number(0.01, 600), "SECONDS")
    gpu_lock_dir: str | None = cfg.setting(
        None, "host-wide GPU locks (vgpu_runtime/gpulock.py): claim each GPU in this directory "
        "before serving an allocation on it, and refuse one another user's daemon holds "
        "(gemini-run starts its daemon with it; a node's daemon takes none)",
        cfg.optional(cfg.text), "DIR")
    # ---- pod awareness ----
    node_name: str = cfg.setting(
        default_node_name(), "this node's Kubernetes name (default $NODE_NAME, else the host "
        "name)", cfg.text, "NAME")
    pod_name: str | None = cfg.setting(
        None, "this daemon's own pod (the DaemonSet sets it from the downward API): as it stops "
        "it asks whether the pod's DaemonSet is being deleted, an uninstall, and if so removes "
        "what it put on the node but what running pods use (daemon/uninstall.py); unset: never",
        cfg.optional(cfg.text), "NAME")
    pod_namespace: str | None = cfg.setting(
        None, "the namespace of pod_name", cfg.optional(cfg.text), "NAMESPACE")
    pod_resources_socket: str = cfg.setting(
        paths.DEFAULT_POD_RESOURCES_SOCKET, "kubelet PodResources socket", cfg.text, "PATH")
    pod_resources_interval: float = cfg.setting(
        5.0, "seconds between PodResources Lists that look for ended pods",
        cfg.number(0.05, 3600), "SECONDS")
    pod_resources_min_interval: float = cfg.setting(
        0.1, "shortest time between two PodResources Lists (kubelet rate-limits the API)",
        cfg.number(0.0, 60), "SECONDS")
    bind_timeout: float = cfg.setting(
        5.0, "seconds a kubelet allocation's hello waits for its pod to be known (0 = never "
        "waits)", cfg.number(0.0, 60), "SECONDS")
    collect_grace: float = cfg.setting(
        60.0, "seconds a pod must be absent from PodResources before its allocation is "
        "collected", cfg.number(0.0, 86400), "SECONDS")
    kubernetes: bool = cfg.setting(
        False, "use the Kubernetes API (in-cluster config): pod annotations, Events, node "
        "labels", cfg.boolean, "BOOL")
    kube_api_url: str | None = cfg.setting(
        None, "Kubernetes API URL instead of the in-cluster config (tests, debugging)",
        cfg.optional(cfg.text), "URL")
    kubeconfig: str | None = cfg.setting(
        None, "kubeconfig file instead of the in-cluster config", cfg.optional(cfg.text), "FILE")
    node_label_interval: float = cfg.setting(
        300.0, "seconds between checks of this node's gemini.ai labels",
        cfg.number(0.05, 86400), "SECONDS")
    slices_per_gpu: int = cfg.node_setting(
        "slices_per_gpu", help="slices per GPU where no allocation record says (the plugin's "
        "records name the count they were cut with, and the node label follows them)")
    simulate_gpus: int = cfg.node_setting(
        "simulate_gpus", help="simulated GPUs for labels and metrics instead of NVML")
    simulate_model: str = cfg.node_setting("simulate_model")
    resource_name: str = cfg.node_setting(
        "resource_name", help="extended resource whose devices PodResources lists for the "
        "allocations' pods (the plugin's)")
    # ---- per-process memory (the context charge) ----
    process_memory: str = cfg.setting(
        "auto", "per-process GPU memory figures for the context charge: auto (NVML when it "
        "loads and pids match the host's), nvml, simulated (process_memory_file) or off (the "
        "hook's measurement)", cfg.choice(*PROCESS_MEMORY_SOURCES), "SOURCE")
    process_memory_interval: float = cfg.setting(
        1.0, "seconds between readings of per-process GPU memory", cfg.number(0.01, 3600),
        "SECONDS")
    process_memory_file: str | None = cfg.setting(
        None, "JSON file of simulated per-process figures, {GPU UUID: {pid: bytes}}, read at "
        "every interval (process_memory=simulated)", cfg.optional(cfg.text), "FILE")
    over_limit_tolerance: int = cfg.setting(
        64 << 20, "bytes an allocation may hold past its memory limit, by the per-process "
        "figures, before the daemon reports the process that holds more than the hook declared",
        cfg.size, "SIZE")
    over_limit_action: str = cfg.setting(
        "report", "what the daemon does to the process it names when per-process figures find "
        "its allocation past the memory limit: report (a log line, the metric, an Event on the "
        "pod) or kill (the same, then SIGKILL; needs CAP_KILL for another uid's process)",
        cfg.choice("report", "kill"), "ACTION")
    # ---- the device's utilisation (co-scheduling's busy fractions) ----
    gpu_busy: str = cfg.setting(
        "auto", "device utilisation for co-scheduling: auto (NVML when it loads), nvml, "
        "simulated (gpu_busy_file) or off (exclusive turns)",
        cfg.choice(*PROCESS_MEMORY_SOURCES), "SOURCE")
    gpu_busy_file: str | None = cfg.setting(
        None, "JSON file of simulated device utilisation, {GPU UUID: [[end, busy], ...]} (end: "
        "CLOCK_MONOTONIC seconds of a 0.2 s period's end), read every 0.2 s "
        "(gpu_busy=simulated)", cfg.optional(cfg.text), "FILE")
    # ---- the hooks' enforcement settings (sent in every hello reply) ----
    interposer_token_timeout: float = cfg.setting(
        30.0, "seconds a launch waits for a token grant before the hook gates itself at its "
        "share", cfg.number(0.001, 3600), "SECONDS")
    interposer_fallback_retry: float = cfg.setting(
        1.0, "seconds between a self-gating hook's attempts to reach the daemon again",
        cfg.number(0.01, 60), "SECONDS")
    interposer_io_timeout: float = cfg.setting(
        10.0, "the hooks' socket send and receive timeout, seconds", cfg.number(0.1, 3600),
        "SECONDS")
    interposer_context_bytes: int = cfg.setting(
        0, "what a context is charged when its cost cannot be measured", cfg.size, "SIZE")
    interposer_context_max_bytes: int = cfg.setting(
        1 << 30, "the most one measured context is charged", cfg.size, "SIZE")
    # ---- telemetry ----
    metrics_port: int = cfg.setting(
        9401, "HTTP port of /metrics, /healthz and /readyz (0 = off)", cfg.integer(0, 65535),
        "PORT")
    metrics_address: str = cfg.setting(
        "0.0.0.0", "address the metrics port listens on", cfg.text, "ADDRESS")
    mqtt_url: str | None = cfg.setting(
        None, "MQTT broker, mqtt://host[:port] (empty = no MQTT)", cfg.optional(cfg.text), "URL")
    mqtt_topic_prefix: str = cfg.setting(
        "gemini", "first level of every MQTT topic", cfg.text, "PREFIX")
    mqtt_interval: float = cfg.setting(
        5.0, "seconds between MQTT usage snapshots", cfg.number(0.05, 3600), "SECONDS")
    mqtt_queue: int = cfg.setting(
        1000, "MQTT messages kept while the broker is away (the oldest are dropped)",
        cfg.integer(1, 1_000_000), "N")
    log_level: str = cfg.setting(
        "info", "log level", cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "log format", cfg.choice("json", "text"), "FORMAT")

    def algorithm(self) -> TimeshareSettings:
        """The token scheduler's constants, from the settings of the same names; co-held
        kernels overlap where the tenants are clients of one MPS server (`mps`)."""
        names = [f.name for f in dataclasses.fields(TimeshareSettings) if f.name != "co_overlap"]
        return TimeshareSettings(**{name: getattr(self, name) for name in names},
                                 co_overlap=bool(self.mps))

    def check(self) -> None:
        """Relations between settings; raises cfg.ConfigError naming them."""
        if self.min_quota > self.max_quota:
            raise cfg.ConfigError(f"min_quota ({self.min_quota}) must not exceed max_quota "
                                  f"({self.max_quota})")
        if self.max_quota >= self.window:
            raise cfg.ConfigError(f"max_quota ({self.max_quota}) must be shorter than window "
                                  f"({self.window})")
        if self.gpu_busy == "simulated" and not self.gpu_busy_file:
            raise cfg.ConfigError("gpu_busy=simulated needs gpu_busy_file (the simulated "
                                  "figures)")
        if self.process_memory == "simulated" and not self.process_memory_file:
            raise cfg.ConfigError("process_memory=simulated needs process_memory_file (the "
                                  "JSON file of per-process figures)")
        if self.mqtt_url:
            from vgpu_runtime.daemon.telemetry.mqtt import parse_broker_url

            try:
                parse_broker_url(self.mqtt_url)
            except ValueError as err:
                raise cfg.ConfigError(f"mqtt_url: {err}") from None

    def limit_for(self, record_limit: Share | None, share: Share) -> Share:
        """The cap on one allocation's share of one GPU: its own, else the policy's."""
        if record_limit is not None:
            limit = record_limit
        elif self.limit_policy == "strict":
            limit = share
        else:
            limit = Share.from_float(self.default_limit)
        return max(limit, share)   # never below what it is guaranteed
