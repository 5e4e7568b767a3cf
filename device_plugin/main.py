"""gemini-device-plugin: advertise every GPU as N gemini.ai/vgpu slices to kubelet.

    python -m device_plugin.main --simulate-gpus 2 --kubelet-dir /tmp/kubelet

Exit status: 0 after SIGTERM/SIGINT, 2 for a configuration error, 1 when GPUs cannot be found.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from device_plugin.allocator import Allocator
from device_plugin.health import HealthTracker
from device_plugin.health_events import NvmlXidWatcher, SimulatedControl, recheck_forever
from device_plugin.healthfile import publish_health
from device_plugin.metrics import PluginMetrics, serve_port
from device_plugin.registration import Registrar
from device_plugin.server import DeviceList, DevicePluginService, PluginServer
from device_plugin.slicecounts import SETTLE_INTERVAL, SliceCounts
from device_plugin.statedir import prepare as prepare_state_dir
from vgpu_runtime import hoststate
from vgpu_runtime import pluginconfig as plugin_config
from vgpu_runtime.common import cli, configwatch, logs
from vgpu_runtime.common.atomicfile import DirectorySyncer
from vgpu_runtime.gpus import Backend, DiscoveryError
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.pluginconfig import ConfigError, PluginConfig

log = logging.getLogger("device_plugin")
PROG = "gemini-device-plugin"


def make_backend(config: PluginConfig) -> Backend:
    if config.simulate_gpus:
        return SimulatedBackend(config.simulate_gpus, config.simulate_model,
                                config.simulate_memory)
    from vgpu_runtime.gpus.nvml import NvmlBackend

    return NvmlBackend()


async def serve(config: PluginConfig, backend: Backend,
                watch: configwatch.ConfigWatch[PluginConfig] | None = None) -> None:
    """`watch`: the configuration file's watch; a change of the plugin's settings there
    stops it (and `main` starts it again)."""
    gpus = backend.discover()
    if not gpus:
        log.warning("no usable GPU found: advertising no devices")
    prepare_state_dir(config.state_dir)
    counts = SliceCounts(config.state_dir, gpus, config.slices_per_gpu)
    table = counts.start()
    tracker = HealthTracker((g.uuid for g in gpus), config.ignored_xids,
                            config.recovery_quiet_period)
    publish_health(config.state_dir, tracker)   # for the node daemon's telemetry
    # Directory fsyncs after Allocate answers, batched (the rule: device_plugin.allocator);
    # its log line is written once the answer is on its way (the loop's next turn).
    syncer = DirectorySyncer()
    allocator = Allocator(config, table, tracker, syncer=syncer,
                          defer=asyncio.get_running_loop().call_soon)
    metrics = PluginMetrics()
    devices = DeviceList(table, tracker, counts.draining, metrics)
    allocator.draining = counts.draining
    service = DevicePluginService(devices, allocator, config.placement, metrics)
    server = PluginServer(config.plugin_socket, service)
    registrar = Registrar(server, config.kubelet_socket, config.resource_name)
    log.info("starting", extra={
        "backend": backend.name, "gpus": [g.uuid for g in gpus], "devices": len(table),
        "slices_per_gpu": config.slices_per_gpu, "placement": config.placement,
        "strategy": config.device_list_strategy, "state_dir": config.state_dir})

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, registrar.stop)

    tasks = [asyncio.create_task(recheck_forever(tracker, backend,
                                                 config.health_recheck_interval))]
    tasks.append(asyncio.create_task(settle_forever(counts, allocator, devices)))
    if watch is not None:
        watch.stop = registrar.stop
        tasks.append(asyncio.create_task(watch.run()))
    watcher: NvmlXidWatcher | None = None
    if isinstance(backend, SimulatedBackend):
        control = SimulatedControl(config.control_dir, backend, tracker)
        tasks.append(asyncio.create_task(control.run()))
        log.info("simulated health events read from", extra={"dir": str(config.control_dir)})
    elif gpus:
        def deliver(uuid: str | None, xid: int) -> None:
            loop.call_soon_threadsafe(tracker.xid, uuid, xid)

        watcher = NvmlXidWatcher(getattr(backend, "nvml"), gpus, deliver)  # noqa: B009
        watcher.start()
    port = (serve_port(metrics, config.metrics_address, config.metrics_port)
            if config.metrics_port else None)
    try:
        await registrar.run()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if watcher is not None:
            watcher.stop()
        if port is not None:
            port.close()
        await asyncio.to_thread(syncer.close)
    log.info("stopped cleanly")


async def settle_forever(counts: SliceCounts, allocator: Allocator, devices: DeviceList,
                         interval: float = SETTLE_INTERVAL) -> None:
    """Give a GPU waiting to change slice count its new slices once nothing lives on it. The
    scan and the switch run in one step of the loop, so no Allocate falls between them."""
    while True:
        await asyncio.sleep(interval)
        table = counts.settle()
        if table is not None:
            allocator.table = devices.table = table
            allocator.draining = devices.draining = counts.draining
            devices.changed()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        loaded = plugin_config.load_all(argv)
    except ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    config = loaded.config
    logs.setup(config.log_level, config.log_format, native_stderr=True)
    for note in loaded.notes:
        log.warning(note)
    try:
        hoststate.refuse_node_program(config.state_dir)
    except hoststate.MachineTaken as err:
        cli.error(PROG, str(err))
        return 1
    try:
        backend = make_backend(config)
        watch = configwatch.ConfigWatch(loaded, lambda: None, plugin_config.check)
        asyncio.run(serve(config, backend, watch))
    except DiscoveryError as err:
        log.error("cannot discover GPUs", extra={"error": str(err)})
        cli.error(PROG, str(err))
        return 1
    except ValueError as err:  # e.g. memory_reserve larger than a GPU, UUID too long
        cli.error(PROG, str(err))
        return 2
    if watch.changed:
        configwatch.restart()
    return 0


if __name__ == "__main__":
    sys.exit(main())
