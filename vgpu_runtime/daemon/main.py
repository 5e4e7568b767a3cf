"""gemini-daemon's entry point: configuration, the single-instance lock, signals, the loop.

The command was `gemini-scheduler` until 0.3 (0.3 ran both names; 0.4 has only this one). The
files it keeps in the state directory keep their names (scheduler.lock, scheduler.sock,
gemini-run's scheduler.log): daemons of either release find each other's lock, and gemini-vgpu
and gemini-run of either release find the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

from vgpu_runtime import hoststate
from vgpu_runtime.common import cli, configwatch, logs
from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.fdlimit import raise_open_file_limit
from vgpu_runtime.daemon import lock
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.daemon import Daemon
from vgpu_runtime.daemon.mps import MpsError

log = logging.getLogger("gemini-daemon")
PROG = "gemini-daemon"


def use_event_loop(choice: str) -> None:
    """Make asyncio.run use the loop `event_loop` names; auto is uvloop when installed. Each
    token frame costs a loop wake-up, which uvloop makes about three times cheaper (config.py).
    """
    if choice == "asyncio":
        return
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise cfg.ConfigError("event_loop uvloop: uvloop is not installed") from None
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def _serve(loaded: cfg.Loaded[DaemonConfig]) -> list[str]:
    """Serve until stopped; the settings whose change in the file stopped it, if any."""
    daemon = Daemon(loaded.config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.stop)
    watch = configwatch.ConfigWatch(loaded, daemon.stop, DaemonConfig.check)
    watcher = asyncio.create_task(watch.run())
    try:
        await daemon.run()
    finally:
        watcher.cancel()
    return watch.changed


def main(argv: Sequence[str] | None = None) -> int:
    try:
        loaded = cfg.load_all(DaemonConfig, argv, prog=PROG,
                              description="gemini.ai/vgpu node daemon: per-allocation channels"
                                          ", the memory ledger and GPU-time tokens")
        config = loaded.config
        config.check()
        use_event_loop(config.event_loop)
    except cfg.ConfigError as err:
        cli.error(PROG, str(err))
        return 2
    logs.setup(config.log_level, config.log_format, native_stderr=True)
    for note in loaded.notes:
        log.warning(note)
    raise_open_file_limit()   # one socket per client process, past the usual 1024
    try:
        hoststate.refuse_node_program(config.state_dir)   # the host daemon's, not ours
        os.makedirs(config.state_dir, mode=0o755, exist_ok=True)
        lock_fd = lock.acquire(config.state_dir)
    except (lock.AlreadyRunning, hoststate.MachineTaken) as err:
        cli.error(PROG, str(err))
        return 1
    except OSError as err:
        cli.error(PROG, f"cannot use state directory {config.state_dir}: {err}")
        return 1
    try:
        changed = asyncio.run(_serve(loaded))
    except MpsError as err:
        cli.error(PROG, str(err))
        return 1
    finally:
        os.close(lock_fd)
    if changed:
        configwatch.restart()   # with the new file, in this process (the lock is released)
    return 0


if __name__ == "__main__":
    sys.exit(main())
