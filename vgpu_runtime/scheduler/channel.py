"""One allocation's channel: its Unix socket, its connected sessions and its memory ledger.

Socket modes: the channel directory is created 0755 when missing (an allocator that wants it
private, like gemini-run, creates it 0700 first; existing modes are left alone) and the socket is
made 0666, so the container's user, whatever its uid, can connect. Isolation between containers
comes from the directory: each container has only its own channel directory mounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
from pathlib import Path
from typing import Any

from vgpu_runtime import paths, wire
from vgpu_runtime.allocation import AllocationRecord, RecordError
from vgpu_runtime.scheduler.grants import GpuGrant
from vgpu_runtime.scheduler.ledger import MemoryLedger
from vgpu_runtime.scheduler.peer import peer_cred
from vgpu_runtime.scheduler.session import Session

log = logging.getLogger(__name__)

CHANNEL_DIR_MODE = 0o755
SOCKET_MODE = 0o666


class AllocationChannel:
    def __init__(self, record: AllocationRecord, grants: tuple[GpuGrant, ...]) -> None:
        self.record = record
        self.grants = grants
        self.ledger = MemoryLedger([g.memory_limit for g in grants])
        self.sessions: set[Session] = set()
        self.socket_path = paths.channel_socket(record.channel_dir)
        self._server: asyncio.AbstractServer | None = None
        self._created_dir = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Bind the socket; raises RecordError when the record's channel cannot be served."""
        if not paths.fits_unix_socket(self.socket_path):
            raise RecordError(f"channel socket path {self.socket_path} is longer than "
                              f"{paths.UNIX_PATH_MAX} bytes")
        directory = Path(self.record.channel_dir)
        try:
            if not directory.is_dir():
                directory.mkdir(parents=True, mode=CHANNEL_DIR_MODE)
                os.chmod(directory, CHANNEL_DIR_MODE)  # mkdir's mode is filtered by the umask
                self._created_dir = True
            self._remove_stale_socket()
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.socket_path))
            os.chmod(self.socket_path, SOCKET_MODE)
        except OSError as err:
            raise RecordError(f"cannot serve channel {self.socket_path}: {err}") from None
        log.info("serving allocation", extra={
            "allocation": self.record.id, "origin": self.record.origin,
            "socket": str(self.socket_path), "gpus": [g.uuid for g in self.grants]})

    def _remove_stale_socket(self) -> None:
        """A socket left by a daemon that died; we hold the lock, so nobody serves it."""
        try:
            mode = os.lstat(self.socket_path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise RecordError(f"{self.socket_path} exists and is not a socket; not replacing it")
        os.unlink(self.socket_path)

    def update(self, record: AllocationRecord, grants: tuple[GpuGrant, ...]) -> None:
        """The record was rewritten (limits, pod reference): new values, same connections."""
        if [g.uuid for g in grants] != [g.uuid for g in self.grants]:
            raise RecordError(f"allocation {record.id} changed its GPUs; an allocation's GPUs "
                              "are fixed for its life")
        self.ledger.set_limits([g.memory_limit for g in grants])
        self.record, self.grants = record, grants
        log.info("allocation updated", extra={"allocation": record.id})

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = peer_cred(writer.get_extra_info("socket"))
        except OSError as err:  # gone before we could ask who it was
            log.info("client left before identification", extra={"error": str(err)})
            writer.close()
            return
        session = Session(self, reader, writer, peer)
        self.sessions.add(session)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            if task is not None:
                self._tasks.discard(task)

    async def close(self, reason: str) -> None:
        """Stop serving: no new clients, current ones told why and disconnected, socket gone."""
        if self._server is not None:
            self._server.close()
        status = wire.const("GM_ERR_NO_ALLOCATION")
        await asyncio.gather(*(s.close(status, reason) for s in list(self.sessions)),
                             return_exceptions=True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if self._created_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.record.channel_dir)  # only if empty
        log.info("stopped serving allocation", extra={"allocation": self.record.id,
                                                      "reason": reason})

    def snapshot(self) -> dict[str, Any]:
        record = self.record
        return {
            "id": record.id, "origin": record.origin, "owner_pid": record.owner_pid,
            "limit": record.limit, "channel_dir": record.channel_dir,
            "socket": str(self.socket_path), "created_at": record.created_at,
            "device_ids": list(record.device_ids),
            "pod": None if record.pod is None else dataclasses.asdict(record.pod),
            "gpus": [{"index": g.index, "uuid": g.uuid, "share": g.share,
                      "share_ppm": grant.share_ppm, "limit_ppm": grant.limit_ppm,
                      "memory_limit": self.ledger.limit(i), "memory_used": self.ledger.used(i)}
                     for i, (g, grant) in enumerate(zip(record.gpus, self.grants, strict=True))],
            "connections": [s.snapshot() for s in self.sessions],
        }
