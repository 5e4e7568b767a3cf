"""`gemini-host serve`: the host daemon's start-up, each refusal saying what to do.

In order: root (it serves every user and makes each channel socket its user's); the group
exists; the state directory is root's and nobody else may write in it; it holds no Kubernetes
node's state (hoststate.py); no other daemon serves it (scheduler.lock); every GPU is claimed
host-wide (gpulock.py), refused where a user's own daemon holds one. Then it marks the state
directory as the host daemon's and serves: the node daemon (records, channels, tokens, the
ledger, the control socket, metrics on port 9402) and the host socket (server.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import grp
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from vgpu_runtime import gpulock, hoststate
from vgpu_runtime.common import cli, logs, securedir
from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.fdlimit import raise_open_file_limit
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon import lock
from vgpu_runtime.daemon.daemon import Daemon
from vgpu_runtime.daemon.host.config import HostConfig
from vgpu_runtime.daemon.host.server import HostServer
from vgpu_runtime.daemon.main import use_event_loop
from vgpu_runtime.daemon.pods.node import discover_gpus
from vgpu_runtime.gpus import GpuInfo

log = logging.getLogger("gemini-host")
PROG = "gemini-host serve"
READY_POLL = 0.01


class StartRefused(Exception):
    """The host daemon must not start; the message says why and what to do."""


def group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartRefused(
            f"no group {name!r}: the host daemon serves the members of one Unix group. Create "
            f"it and add its users (sudo groupadd --system {name}; sudo usermod -aG {name} "
            "<user>), or name another with --host-group") from None


def prepare(config: HostConfig) -> Path:
    state = Path(config.state_dir)
    try:
        state.mkdir(parents=True, exist_ok=True, mode=0o755)
        securedir.check_owned_dir(state, 0)
    except securedir.InsecureDirectory as err:
        raise StartRefused(f"refusing state directory {state}: {err}. Another user could "
                           "plant records in it. Fix: chown root:root it and chmod go-w it"
                           ) from None
    except OSError as err:
        raise StartRefused(f"cannot use state directory {state}: {err.strerror}") from None
    try:
        hoststate.refuse_node_state(state)
    except hoststate.MachineTaken as err:
        raise StartRefused(str(err)) from None
    return state


def claim_gpus(config: HostConfig, gpus: list[GpuInfo]) -> gpulock.GpuClaims | None:
    if not config.gpu_lock_dir:
        return None
    claims = gpulock.GpuClaims(config.gpu_lock_dir, None)
    try:
        for gpu in gpus:
            claims.claim(gpu.uuid)
    except gpulock.GpuLockError as err:
        claims.close()
        raise StartRefused(str(err)) from None
    return claims


def make_layout(state: Path) -> None:
    """allocations/ and the daemon's own directories are root's alone: users never read a
    record (it names a channel); host-channels/ lets them pass to their own channel."""
    for directory in (paths.allocations_dir(state), paths.bindings_dir(state),
                      paths.pages_dir(state)):
        securedir.make_dir(directory, 0o700)
    securedir.make_dir(paths.host_channels_dir(state), paths.HOST_CHANNELS_DIR_MODE)


async def serve(config: HostConfig, gpus: list[GpuInfo], gid: int) -> None:
    # The node daemon inside claims no GPU per allocation: the host daemon holds them all.
    daemon = Daemon(dataclasses.replace(config, gpu_lock_dir=None))
    daemon.program = "gemini-host"
    host = HostServer(daemon, config, gpus, gid)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    running = asyncio.create_task(daemon.run())
    sweeping: asyncio.Task[None] | None = None
    try:
        while not daemon.ready and not running.done():
            await asyncio.sleep(READY_POLL)
        if not running.done():
            await host.start()
            sweeping = asyncio.create_task(host.run())
            log.info("gemini-host serving", extra={
                "state_dir": config.state_dir, "group": config.host_group,
                "gpus": [g.uuid for g in gpus], "metrics_port": config.metrics_port})
        await running
    finally:
        if sweeping is not None:
            sweeping.cancel()
        await host.close()
        if not running.done():
            daemon.stop()
            await running


def main(argv: Sequence[str] | None = None) -> int:
    try:
        loaded = cfg.load_all(HostConfig, argv, prog=PROG,
                              description="gemini.ai/vgpu host daemon: one node daemon for "
                                          "every user of a machine, through a group's socket")
        config = loaded.config
        config.check()
        use_event_loop(config.event_loop)
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    logs.setup(config.log_level, config.log_format, native_stderr=True)
    for note in loaded.notes:
        log.warning(note)
    if os.geteuid() != 0:
        cli.error(PROG, "the host daemon runs as root: it serves every user of the machine and "
                        "makes each allocation's socket its user's (sudo gemini-host install)")
        return 1
    raise_open_file_limit()
    lock_fd: int | None = None
    claims: gpulock.GpuClaims | None = None
    try:
        gid = group_id(config.host_group)
        state = prepare(config)
        try:
            lock_fd = lock.acquire(state)
        except lock.AlreadyRunning as err:
            raise StartRefused(str(err)) from None
        gpus = discover_gpus(config.simulate_gpus, config.simulate_model)
        claims = claim_gpus(config, gpus)
        make_layout(state)
        hoststate.write_marker(state, config.host_group, config.metrics_port)
        asyncio.run(serve(config, gpus, gid))
    except StartRefused as err:
        cli.error(PROG, str(err))
        return 1
    except (OSError, securedir.InsecureDirectory) as err:
        cli.error(PROG, f"cannot prepare state directory {config.state_dir}: {err}")
        return 1
    finally:
        if claims is not None:
            claims.close()
        if lock_fd is not None:
            os.close(lock_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
