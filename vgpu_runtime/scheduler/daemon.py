"""The daemon: keeps one AllocationChannel per live allocation record, and the control socket.

State lives in the state directory only. On start (including a restart) every record is served
again; clients reconnect and re-declare what they hold with MEM_SET, so nothing is doubled: the
new daemon starts from an empty ledger. Tokens start afresh too: every page is cleared, and a
hook whose token vanished asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from vgpu_runtime import __version__, paths
from vgpu_runtime.allocation import AllocationRecord, RecordError
from vgpu_runtime.scheduler.channel import AllocationChannel
from vgpu_runtime.scheduler.config import SchedulerConfig
from vgpu_runtime.scheduler.control import ControlServer, control_socket
from vgpu_runtime.scheduler.grants import grants_of
from vgpu_runtime.scheduler.records import RecordWatcher
from vgpu_runtime.scheduler.tokens import TokenService

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.channels: dict[str, AllocationChannel] = {}
        self.tokens = TokenService(config)
        self.watcher = RecordWatcher(self.state_dir)
        self.corrupt: dict[str, str] = {}
        self.started_at = time.time()
        self.control = ControlServer(control_socket(self.state_dir), {"status": self.status})
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        paths.allocations_dir(self.state_dir).mkdir(parents=True, exist_ok=True)
        await self.control.start()
        log.info("gemini-scheduler started", extra={"state_dir": str(self.state_dir),
                                                    "pid": os.getpid()})
        try:
            while not self._stop.is_set():
                await self.sync()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.config.poll_interval)
        finally:
            await self.shutdown()

    async def sync(self) -> None:
        """Bring the served channels in line with the records on disk."""
        scan = self.watcher.scan()
        self.corrupt = dict(scan.corrupt)
        for allocation_id in set(self.channels) - set(scan.records):
            await self.channels.pop(allocation_id).close("allocation record removed")
        for allocation_id, record in scan.records.items():
            current = self.channels.get(allocation_id)
            if current is not None and current.record == record:
                continue
            try:
                await self._serve(current, record)
            except RecordError as err:
                self.watcher.mark_unservable(record, err)
                self.corrupt[str(paths.allocations_dir(self.state_dir) / f"{record.id}.json")] = (
                    str(err))

    async def _serve(self, current: AllocationChannel | None, record: AllocationRecord) -> None:
        grants = grants_of(record, self.config.limit_for)
        if current is not None:
            current.update(record, grants)
            return
        channel = AllocationChannel(record, grants, self.tokens)
        await channel.start()
        self.channels[record.id] = channel

    async def shutdown(self) -> None:
        await self.control.close()
        await asyncio.gather(*(c.close("gemini-scheduler stopping", removed=False)
                               for c in self.channels.values()), return_exceptions=True)
        self.channels.clear()
        self.tokens.close()
        log.info("gemini-scheduler stopped")

    def status(self, _request: dict[str, Any]) -> dict[str, Any]:
        return {
            "daemon": {"pid": os.getpid(), "version": __version__,
                       "state_dir": str(self.state_dir), "started_at": self.started_at,
                       "default_limit": self.config.default_limit,
                       "limit_policy": self.config.limit_policy,
                       "token_settings": dataclasses.asdict(self.config.algorithm())
                       | {"idle_release": self.config.idle_release}},
            "allocations": [c.snapshot() for _, c in sorted(self.channels.items())],
            "gpus": self.tokens.snapshot(),
            "corrupt_records": [{"path": p, "error": e} for p, e in sorted(self.corrupt.items())],
        }
