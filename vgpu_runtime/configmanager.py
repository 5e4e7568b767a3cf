"""gemini-config-manager: the node's configuration, chosen by the node's label.

The ConfigMap holds several named configurations, `<name>.yaml`, each a version v1 node file
(vgpu_runtime.common.config). A node labelled `gemini.ai/vgpu.config=<name>` takes the named
one; an unlabelled node takes `default` (--default-config). This program, an init container
(--oneshot) and a sidecar of the node pod, writes the chosen file atomically to --output, a
file in an emptyDir that the device plugin and the node daemon read; they restart in place
when the settings they use change there (vgpu_runtime.common.configwatch).

It follows the label with a watch on its own Node (GET, then watch from that resourceVersion;
again after any error) and reads the chosen configuration again every --source-interval
seconds, since kubelet updates a mounted ConfigMap in place. A configuration is written only if
both programs accept it: a label naming a missing or invalid configuration keeps the file as it
is, logs why and posts a Warning Event on the Node. In --oneshot mode, with no file written
yet, that is exit status 1: the pod waits in its init step, and `kubectl describe node` and the
init container's log say why.

Metrics: the sidecar serves Prometheus' /metrics on its own port, 9404 (--metrics-port; 0 = off;
none with --oneshot, which exits at once), beside the plugin's 9403 and the daemon's 9401 in the
node pod:
    gemini_vgpu_config_manager_configuration_applied{config}  1 while the node's file holds the
                                                configuration the label names (config: that
                                                name), 0 while that one cannot be used (the
                                                file keeps the one before, or none)
    gemini_vgpu_config_manager_writes_total     the node's file written (another configuration
                                                chosen, or the chosen one edited)
    gemini_vgpu_config_manager_errors_total{reason}
                                                each failure the log reports, by reason: the
                                                Event's (ConfigNameInvalid, ConfigNotFound,
                                                ConfigInvalid: once per failure, as the Event),
                                                WriteFailed, NodeReadFailed, NodeWatchFailed,
                                                EventFailed (each try)
    gemini_vgpu_build_info{version,interposer,program}   1 (vgpu_runtime/common/metrics.py)

Exit status: 0 after SIGTERM or a --oneshot that wrote the file, 1 when --oneshot cannot
choose a configuration, 2 for a configuration error of its own.

For operators, two commands that need no cluster:
    gemini-config-manager check FILE...          both programs' loaders on each node file
    gemini-config-manager convert device-plugin.yaml scheduler.yaml > default.yaml
                                                 the two-file ConfigMap's files as one v1 file
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from vgpu_runtime.common import cli, logs
from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.atomicfile import write_atomic
from vgpu_runtime.common.metrics import (
    CONFIG_MANAGER_PORT,
    build_info,
    new_registry,
    open_port,
    registry_answer,
)
from vgpu_runtime.daemon.config import default_node_name
from vgpu_runtime.daemon.pods.kube import KubeApi, KubeError, NodeInfo

log = logging.getLogger("gemini-config-manager")
PROG = "gemini-config-manager"
CONFIG_LABEL = "gemini.ai/vgpu.config"
DEFAULT_NAME = "default"
# A label value (what a name can be), which also keeps a name a plain file name.
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class ManagerConfig:
    node_name: str = cfg.setting(
        default_node_name(), "this node's Kubernetes name (default $NODE_NAME, else the host "
        "name)", cfg.text, "NAME")
    source_dir: str = cfg.setting(
        "/etc/gemini/configs", "directory of the named configurations, <name>.yaml (the "
        "ConfigMap)", cfg.text, "DIR")
    output: str = cfg.setting(
        "/etc/gemini/node/config.yaml", "the file written with the chosen configuration, read "
        "by the plugin and the daemon", cfg.text, "FILE")
    label: str = cfg.setting(CONFIG_LABEL, "node label naming the configuration", cfg.text,
                             "LABEL")
    default_config: str = cfg.setting(
        DEFAULT_NAME, "configuration of a node without the label", cfg.text, "NAME")
    oneshot: bool = cfg.setting(
        False, "write the file once and exit (the init container)", cfg.boolean, "BOOL")
    watch_timeout: float = cfg.setting(
        300.0, "seconds one watch of the Node lasts before it is renewed",
        cfg.number(1, 3600), "SECONDS")
    source_interval: float = cfg.setting(
        10.0, "seconds between readings of the chosen configuration (a ConfigMap edit)",
        cfg.number(0.05, 3600), "SECONDS")
    kube_api_url: str | None = cfg.setting(
        None, "Kubernetes API URL instead of the in-cluster config (tests, debugging)",
        cfg.optional(cfg.text), "URL")
    kubeconfig: str | None = cfg.setting(
        None, "kubeconfig file instead of the in-cluster config", cfg.optional(cfg.text), "FILE")
    metrics_port: int = cfg.setting(
        CONFIG_MANAGER_PORT, "HTTP port of /metrics (0 = off; none with --oneshot; the "
        "plugin's is 9403, the node daemon's 9401)", cfg.integer(0, 65535), "PORT")
    metrics_address: str = cfg.setting("0.0.0.0", "address the metrics port listens on",
                                       cfg.text, "ADDRESS")
    log_level: str = cfg.setting(
        "info", "log level", cfg.choice("debug", "info", "warning", "error"), "LEVEL")
    log_format: str = cfg.setting("json", "log format", cfg.choice("json", "text"), "FORMAT")


class ManagerMetrics:
    """The series of the module's docstring, in a registry of their own. Counters are
    prometheus_client's (the node watch's thread counts too); the applied gauge reads one
    tuple that the event loop replaces whole."""

    def __init__(self) -> None:
        self.registry = new_registry()
        self.writes = Counter("gemini_vgpu_config_manager_writes",
                              "The node's configuration file written (another configuration "
                              "chosen, or the chosen one edited)", registry=self.registry)
        self.errors = Counter("gemini_vgpu_config_manager_errors",
                              "Failures the log reports, by reason (the Event's reason, "
                              "WriteFailed, NodeReadFailed, NodeWatchFailed, EventFailed)",
                              ["reason"], registry=self.registry)
        self.applied: tuple[str, bool] | None = None   # (the wanted name, whether it is held)
        self.registry.register(self)
        self.answer = registry_answer(self.registry)

    def failed(self, reason: str) -> None:
        self.errors.labels(reason=reason).inc()

    def collect(self) -> Iterable[Metric]:
        yield build_info(PROG)
        applied = GaugeMetricFamily(
            "gemini_vgpu_config_manager_configuration_applied",
            "1 while the node's file holds the configuration its label names (or the "
            "default), 0 while that one cannot be used", labels=["config"])
        if self.applied is not None:
            name, held = self.applied
            applied.add_metric([name], 1.0 if held else 0.0)
        yield applied


class Unusable(Exception):
    """The named configuration cannot be used; `reason` is the Event's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def check_node_file(path: str) -> None:
    """Raises ConfigError unless both programs accept the file (version v1 required)."""
    check_node_data(cfg.load_file(path), path)


def check_node_data(data: dict[str, Any], path: str) -> None:
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.pluginconfig import PluginConfig
    from vgpu_runtime.pluginconfig import check as check_plugin

    if "version" not in data:
        raise cfg.ConfigError(f"{path}: a named configuration needs version: {cfg.FILE_VERSION} "
                              "(flat files are for one program only)")
    values, where = cfg.file_settings(PluginConfig, data, path)
    check_plugin(cfg.resolve(PluginConfig, {}, {}, values, path, where))
    values, where = cfg.file_settings(DaemonConfig, data, path)
    cfg.resolve(DaemonConfig, {}, {}, values, path, where).check()


def read_named(source_dir: str, name: str) -> bytes:
    """The named configuration's bytes, checked; raises Unusable saying why not."""
    if not _NAME.match(name):
        raise Unusable("ConfigNameInvalid", f"configuration name {name!r} is not a label value")
    path = os.path.join(source_dir, f"{name}.yaml")
    # A ConfigMap volume's files are links into its ..data directory: follow them, but only
    # to files inside the mounted directory.
    real_dir = os.path.realpath(source_dir)
    if os.path.commonpath([os.path.realpath(path), real_dir]) != real_dir:
        raise Unusable("ConfigNotFound", f"{path} leads out of {source_dir}")
    try:
        with open(path, "rb") as handle:
            payload = handle.read(cfg.MAX_FILE_BYTES + 1)   # more is refused by the check below
    except FileNotFoundError:
        known = sorted(n[:-5] for n in os.listdir(source_dir) if n.endswith(".yaml")
                       and not n.startswith("."))
        raise Unusable("ConfigNotFound", f"no configuration {name!r} ({path}); the ConfigMap "
                       f"has {', '.join(known) or 'none'}") from None
    except OSError as err:
        raise Unusable("ConfigNotFound", f"cannot read {path}: {err.strerror}") from None
    try:
        check_node_file(path)
    except cfg.ConfigError as err:
        raise Unusable("ConfigInvalid", f"configuration {name!r} is invalid: {err}") from None
    return payload


def convert(plugin_path: str, scheduler_path: str) -> dict[str, Any]:
    """A version v1 node file from the two flat files of the two-file ConfigMap: the shared keys
    once under node (they must agree), the rest under their program's section."""
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.pluginconfig import PluginConfig

    node: dict[str, Any] = {}
    document: dict[str, Any] = {"version": cfg.FILE_VERSION, cfg.NODE_SECTION: node}
    shared = {f.name for f in dataclasses.fields(cfg.NodeSettings)}
    for path, cls in ((plugin_path, PluginConfig), (scheduler_path, DaemonConfig)):
        data = cfg.load_file(path)
        if "version" in data:
            raise cfg.ConfigError(f"{path} has a version already: it is not a flat file")
        own: dict[str, Any] = {}
        for key, value in data.items():
            if key in shared:
                if key in node and node[key] != value:
                    raise cfg.ConfigError(f"{path}: {key} is {cfg.quote(value)} here but "
                                          f"{cfg.quote(node[key])} in {plugin_path}; the node "
                                          "has one value")
                node[key] = value
            else:
                own[key] = value
        document[cfg.section_of(cls) or ""] = own
    check_node_data(document, f"{plugin_path} + {scheduler_path}")
    return document


def _tool(argv: Sequence[str]) -> int | None:
    """`check FILE...` and `convert PLUGIN_FILE SCHEDULER_FILE`, for operators; None for the
    program's own command line."""
    if not argv or argv[0] not in ("check", "convert"):
        return None
    command, files = argv[0], list(argv[1:])
    try:
        if command == "check" and files:
            for path in files:
                check_node_file(path)
                print(f"{path}: valid for gemini-device-plugin and gemini-daemon")
            return 0
        if command == "convert" and len(files) == 2:
            sys.stdout.write(yaml.safe_dump(convert(*files), sort_keys=False))
            return 0
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    cli.error(PROG, f"usage: {PROG} check FILE... | {PROG} convert DEVICE_PLUGIN_FILE "
                    "SCHEDULER_FILE")
    return 2


class ConfigManager:
    def __init__(self, config: ManagerConfig, kube: KubeApi,
                 metrics: ManagerMetrics | None = None) -> None:
        self.config = config
        self.kube = kube
        self.metrics = metrics or ManagerMetrics()
        self.node: NodeInfo | None = None
        self._reported: tuple[str, str] | None = None   # the last Event's reason and message
        self._stopping = asyncio.Event()
        self._updates: asyncio.Queue[NodeInfo] = asyncio.Queue()

    def stop(self) -> None:
        self._stopping.set()

    def wanted(self, node: NodeInfo) -> str:
        return node.labels.get(self.config.label) or self.config.default_config

    def current(self) -> bytes | None:
        try:
            with open(self.config.output, "rb") as handle:
                return handle.read()
        except OSError:
            return None

    async def apply(self, node: NodeInfo) -> bool:
        """Write the configuration the node's label names; True if the file now holds it."""
        name = self.wanted(node)
        try:
            payload = read_named(self.config.source_dir, name)
        except Unusable as err:
            self.metrics.applied = (name, False)
            await self._report(node, err.reason, err.message)
            return False
        self._reported = None
        if payload != self.current():
            try:
                write_atomic(self.config.output, payload, durable=False)
            except OSError as err:   # retried at the next change or source interval
                self.metrics.applied = (name, False)
                self.metrics.failed("WriteFailed")
                log.error("cannot write the node's configuration", extra={
                    "output": self.config.output, "error": str(err)})
                return False
            self.metrics.writes.inc()
            log.info("configuration written", extra={
                "config": name, "labelled": self.config.label in node.labels,
                "output": self.config.output})
        self.metrics.applied = (name, True)
        return True

    async def _report(self, node: NodeInfo, reason: str, message: str) -> None:
        kept = ("; the node keeps its current configuration" if self.current() is not None
                else "; the node's GPU sharing waits for a usable configuration")
        message += kept
        if self._reported == (reason, message):
            return
        self._reported = (reason, message)
        self.metrics.failed(reason)
        log.error("cannot use the node's configuration", extra={"reason": reason,
                                                                "error": message})
        try:
            await self.kube.post_node_event(self.config.node_name, reason, message,
                                            component=PROG)
        except KubeError as err:
            self.metrics.failed("EventFailed")
            log.warning("cannot post an Event on the node", extra={"error": str(err)})

    async def read_node(self) -> NodeInfo | None:
        """The Node, retried with backoff until it is read; None if stopped first."""
        delay = 1.0
        while not self._stopping.is_set():
            try:
                return await self.kube.node(self.config.node_name)
            except KubeError as err:
                self.metrics.failed("NodeReadFailed")
                log.warning("cannot read the node; trying again", extra={
                    "node": self.config.node_name, "error": str(err), "retry_in": delay})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(MAX_BACKOFF, delay * 2)
        return None

    async def run(self) -> int:
        node = await self.read_node()
        if node is None:
            return 0
        self.node = node
        written = await self.apply(node)
        if self.config.oneshot:
            return 0 if written or self.current() is not None else 1
        loop = asyncio.get_running_loop()
        # The client's watch blocks: it runs in a daemon thread that ends with the process.
        threading.Thread(target=self._watch_forever, args=(loop, node.resource_version),
                         name="node-watch", daemon=True).start()
        stopping = asyncio.ensure_future(self._stopping.wait())
        while not self._stopping.is_set():
            update = asyncio.ensure_future(self._updates.get())
            await asyncio.wait({update, stopping}, timeout=self.config.source_interval,
                               return_when=asyncio.FIRST_COMPLETED)
            if update.done():
                self.node = update.result()
            else:
                update.cancel()
            if not self._stopping.is_set():
                await self.apply(self.node)
        stopping.cancel()
        return 0

    def _watch_forever(self, loop: asyncio.AbstractEventLoop, version: str) -> None:
        try:
            self._watch(loop, version)
        except RuntimeError:   # the event loop closed: the program is exiting
            return

    def _watch(self, loop: asyncio.AbstractEventLoop, version: str) -> None:
        delay = 1.0
        while True:
            try:
                for kind, node in self.kube.watch_node(self.config.node_name, version,
                                                       self.config.watch_timeout):
                    version = node.resource_version or version
                    if kind != "DELETED":
                        loop.call_soon_threadsafe(self._updates.put_nowait, node)
                    delay = 1.0
                continue   # the server ended this watch: the next one starts where it stopped
            except KubeError as err:
                self.metrics.failed("NodeWatchFailed")
                log.warning("node watch failed; reading the node again", extra={
                    "error": str(err), "retry_in": delay})
            threading.Event().wait(delay)
            delay = min(MAX_BACKOFF, delay * 2)
            try:
                node = asyncio.run_coroutine_threadsafe(
                    self.kube.node(self.config.node_name), loop).result()
            except (KubeError, RuntimeError):   # RuntimeError: the loop has closed
                continue
            version = node.resource_version
            loop.call_soon_threadsafe(self._updates.put_nowait, node)


async def _serve(config: ManagerConfig) -> int:
    kube = KubeApi(config.kube_api_url, config.kubeconfig)
    manager = ConfigManager(config, kube)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, manager.stop)
    log.info("starting", extra={"node": config.node_name, "label": config.label,
                                "default": config.default_config, "oneshot": config.oneshot,
                                "source_dir": config.source_dir, "output": config.output})
    # A oneshot exits within seconds: nothing would scrape it.
    port = (open_port(manager.metrics.answer, config.metrics_address, config.metrics_port,
                      "config-metrics")
            if config.metrics_port and not config.oneshot else None)
    try:
        return await manager.run()
    finally:
        if port is not None:
            port.close()


def main(argv: Sequence[str] | None = None) -> int:
    tool = _tool(sys.argv[1:] if argv is None else argv)
    if tool is not None:
        return tool
    try:
        config = cfg.load(ManagerConfig, argv, prog=PROG,
                          description="writes the node's gemini.ai/vgpu configuration, chosen "
                                      f"by its {CONFIG_LABEL} label, for the plugin and daemon. "
                                      f"For operators, with no cluster: '{PROG} check FILE...' "
                                      "runs both programs' loaders on each node file; "
                                      f"'{PROG} convert DEVICE_PLUGIN_FILE SCHEDULER_FILE' "
                                      "writes the two-file ConfigMap's files as one v1 file")
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    logs.setup(config.log_level, config.log_format)
    try:
        return asyncio.run(_serve(config))
    except Exception as err:   # no in-cluster config: not in a pod and no --kube-api-url
        log.error("cannot start", extra={"error": str(err)})
        cli.error(PROG, str(err))
        return 1


if __name__ == "__main__":
    sys.exit(main())
