"""The node daemon in the test process: the real `Daemon` (vgpu_runtime/daemon/daemon.py), built
from the same command line as the kit's DaemonProcess and run on its own event loop in a thread.
Clients reach it through the same Unix sockets, records and token pages; what is saved is the
interpreter start-up and imports of a process per test. DaemonProcess stays for what only a
process shows: start-up, signals and kills, the single-instance lock, descriptor limits."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.logs import JsonFormatter
from vgpu_runtime.daemon import lock
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.daemon import Daemon
from vgpu_runtime.devkit.daemon_process import DaemonStatus, wait_for


class _Lines(logging.Handler):
    """The daemon's log lines, formatted as its JSON log (tests search them as they would the
    process's log file)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _new_loop(choice: str) -> asyncio.AbstractEventLoop:
    """The loop the program would run on (main.use_event_loop: auto is uvloop where installed),
    made for this thread only: the test process's own loops are left as they are."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class InProcessDaemon(DaemonStatus):
    """Same interface as DaemonProcess where tests use it: status, allocation, logs, stop."""

    def __init__(self, state_dir: Path, *extra: str) -> None:
        self.state_dir = state_dir
        # No metrics port unless a test asks: the test process binds no host port by default.
        argv = ["--state-dir", str(state_dir), "--poll-interval", "0.05", "--log-format",
                "json", "--metrics-port", "0", *extra]
        self.config = cfg.load_all(DaemonConfig, argv, prog="gemini-daemon").config
        self.config.check()
        os.makedirs(state_dir, mode=0o755, exist_ok=True)
        self._lock_fd = lock.acquire(state_dir)   # as main() does: one daemon per directory
        self._log = _Lines()
        root = logging.getLogger()
        self._root_level = root.level
        root.setLevel(self.config.log_level.upper())
        root.addHandler(self._log)
        self.daemon: Daemon | None = None
        self.error: BaseException | None = None
        self._loop = _new_loop(self.config.event_loop)
        self._thread = threading.Thread(target=self._main, name="gemini-daemon",
                                        daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as err:   # reported by stop() as a failed exit, with the logs
            self.error = err
            logging.getLogger(__name__).exception("in-process daemon failed")
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self.daemon = Daemon(self.config)
        await self.daemon.run()

    def running(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self, timeout: float = 10.0) -> InProcessDaemon:
        def ready() -> bool:
            if not self.running():
                raise AssertionError(f"daemon ended ({self.error!r}):\n{self.logs()}")
            try:
                return bool(client.request(self.state_dir)["daemon"]["ready"])
            except OSError:
                return False
        wait_for(ready, timeout, "daemon ready")
        return self

    def logs(self) -> str:
        return "\n".join(self._log.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """As SIGTERM or SIGINT to the process: 0 when the daemon shut down cleanly. A kill
        needs a process (DaemonProcess)."""
        if sig not in (signal.SIGTERM, signal.SIGINT):
            raise ValueError(f"an in-process daemon stops as on SIGTERM; {sig} needs a process")
        wait_for(lambda: self.daemon is not None or not self.running(), timeout,
                 "the daemon object")   # made on the loop's thread
        if self.running() and self.daemon is not None:
            self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.logs()}")
        root = logging.getLogger()
        root.removeHandler(self._log)
        root.setLevel(self._root_level)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        return 0 if self.error is None else 1
