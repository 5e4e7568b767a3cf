"""The host daemon's socket for every user: <state-dir>/host.sock, root's and its group's (0660).

One JSON object a line each way; a connection may ask any number of times. Who asks is the
connection's peer credentials (SO_PEERCRED), never anything it says.

  {"op": "allocate", "share": 0.3, "limit": null, "memory": null, "gpu": null,
   "overcommit": false, "hook_library": "<file name>"}
      -> {"allocation": <the record, as allocation.py writes it>}
      admitted across users (admission.py); the daemon writes the record itself (users write
      nothing under the state directory) naming the asker's uid and pid, makes the channel
      directory (root's, 0711) and answers once the channel serves: its socket is the asker's
      alone (0600). The connection is then the allocation's lease: when it closes, however its
      gemini-run ended, the allocation ends (channel closed, then record and directory
      removed: the daemon's collection, Allocations.collect, which asks end_allocation).
  {"op": "release", "id": "<id>"} -> {"released": "<id>"}: the asker's own allocations only.
  {"op": "status"} -> what this user may see (view.py); root sees everything.
  {"op": "stop"} -> refused: the machine's daemon is stopped through its unit.
Anything else is answered {"error": "..."}.

A lease does not outlive the daemon: after a restart an allocation lives while the process that
asked for it lives (its record's owner_pid; procs.alive_since), checked every SWEEP_INTERVAL,
and its command's hooks reconnect to its channel as after any daemon restart.

Bounds (security, S2): a request line is at most MAX_REQUEST bytes; one user holds at most
MAX_CONNECTIONS_PER_USER connections and MAX_ALLOCATIONS_PER_USER allocations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from vgpu_runtime.common import procs, securedir
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare, RecordError
from vgpu_runtime.contracts.share import WHOLE, Share, ShareError
from vgpu_runtime.daemon.allocations import Allocations
from vgpu_runtime.daemon.channel.peer import PeerCred, peer_cred
from vgpu_runtime.daemon.daemon import Daemon
from vgpu_runtime.daemon.host import admission, view
from vgpu_runtime.daemon.host.config import HostConfig
from vgpu_runtime.gpus import GpuInfo

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
MAX_REQUEST = 64 * 1024
MAX_CONNECTIONS_PER_USER = 64
MAX_ALLOCATIONS_PER_USER = 64
MAX_LIBRARY_NAME = 255
SWEEP_INTERVAL = 1.0


class HostServer:
    def __init__(self, daemon: Daemon, config: HostConfig, gpus: list[GpuInfo],
                 gid: int) -> None:
        self.daemon = daemon
        self.allocations: Allocations = daemon.allocations   # the records served, one ledger
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.path = paths.host_socket(self.state_dir)
        self.channels = paths.host_channels_dir(self.state_dir)
        self.gpus = gpus
        self.gid = gid
        self.leases: dict[str, int] = {}          # allocation id -> its lease's uid
        self.connections: dict[int, int] = {}     # uid -> open connections
        self._admit = asyncio.Lock()
        self._server: asyncio.AbstractServer | None = None
        self._closing = False

    # ---- the socket ----

    async def start(self) -> None:
        securedir.make_dir(self.channels, paths.HOST_CHANNELS_DIR_MODE)
        await self._sweep_channel_dirs()
        self._server = await asyncio.start_unix_server(self._serve, sock=self._listen(),
                                                       limit=MAX_REQUEST)
        log.info("host socket serving", extra={"socket": str(self.path), "group": self.gid})

    def _listen(self) -> socket.socket:
        """Bound, listening, root's and the group's under a temporary name, then renamed into
        place: nobody outside the group can connect at any instant."""
        temporary = self.path.with_name(".host.sock.tmp")
        for stale in (temporary, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)   # left by a daemon that died; we hold the state's lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(temporary))
            os.chown(temporary, 0, self.gid)
            os.chmod(temporary, SOCKET_MODE)
            sock.listen(128)
            os.rename(temporary, self.path)
        except OSError:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        finally:
            os.umask(old_umask)
        sock.setblocking(False)
        return sock

    async def run(self) -> None:
        """End the allocations whose lease was lost with a daemon restart once their owner
        process is gone."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            try:
                await self.sweep()
            except OSError as err:
                log.error("cannot sweep ended allocations; trying again", extra={
                    "error": str(err)})

    async def sweep(self) -> list[str]:
        ended = []
        for record in self.allocations.records():
            if record.id in self.leases or record.origin != "gemini-run" or not record.owner_pid:
                continue
            if not procs.alive_since(record.owner_pid, record.created_at):
                await self.end(record, "its owner process is gone")
                ended.append(record.id)
        return ended

    async def close(self) -> None:
        self._closing = True   # a stop keeps the allocations for the next daemon
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = peer_cred(writer.get_extra_info("socket"))
        except OSError:
            writer.close()
            return
        held: set[str] = set()     # the allocations this connection is the lease of
        count = self.connections.get(peer.uid, 0)
        if count >= MAX_CONNECTIONS_PER_USER and peer.uid != 0:
            log.warning("refusing host connection: too many", extra={"uid": peer.uid})
            await self._reply(writer, {"error": f"uid {peer.uid} holds "
                                                f"{MAX_CONNECTIONS_PER_USER} connections to "
                                                "the host daemon already"})
            writer.close()
            return
        self.connections[peer.uid] = count + 1
        try:
            while line := await reader.readline():
                await self._reply(writer, await self._answer(line, peer, held))
        except (ConnectionError, ValueError) as err:   # ValueError: a line over MAX_REQUEST
            log.info("host connection dropped", extra={"uid": peer.uid, "error": str(err)})
        finally:
            self.connections[peer.uid] -= 1
            if not self.connections[peer.uid]:
                del self.connections[peer.uid]
            if not self._closing:
                for allocation_id in sorted(held):
                    await self.end_id(allocation_id, "its gemini-run ended (lease closed)")
            writer.close()

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, answer: dict[str, Any]) -> None:
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()

    async def _answer(self, line: bytes, peer: PeerCred, held: set[str]) -> dict[str, Any]:
        try:
            request = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return {"error": f"request is not JSON: {err}"}
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            return {"error": 'request must be an object like {"op": "status"}'}
        try:
            return await self._op(request, peer, held)
        except (OSError, RecordError) as err:
            # Out of descriptors or space, a read-only state directory: this answer fails, the
            # daemon and every other allocation go on.
            log.error("host request failed", extra={"op": request["op"], "uid": peer.uid,
                                                     "error": str(err)})
            return {"error": f"the host daemon cannot {request['op']} now: {err}"}

    async def _op(self, request: dict[str, Any], peer: PeerCred,
                  held: set[str]) -> dict[str, Any]:
        op = request["op"]
        if op == "allocate":
            return await self.allocate(request, peer, held)
        if op == "release":
            return await self.release(request, peer, held)
        if op == "status":
            return view.for_user(await self.daemon.status_request({}), peer.uid)
        if op == "stop":
            return {"error": "the host daemon serves every user of this machine and is stopped "
                             "through its unit: sudo systemctl stop gemini-host"}
        return {"error": f"unknown op {op!r}; known: allocate, release, status, stop"}

    # ---- allocations ----

    async def allocate(self, request: dict[str, Any], peer: PeerCred,
                       held: set[str]) -> dict[str, Any]:
        try:
            ask = _ask(request, peer.uid)
            library = _library(request.get("hook_library"))
        except (admission.Refused, ValueError, TypeError) as err:
            return {"error": str(err)}
        async with self._admit:
            await self.allocations.sync()   # the records as they are now
            records = self.allocations.records()
            if peer.uid != 0 and sum(r.owner_uid == peer.uid for r in records) >= (
                    MAX_ALLOCATIONS_PER_USER):
                return {"error": f"uid {peer.uid} holds {MAX_ALLOCATIONS_PER_USER} allocations "
                                 "already"}
            try:
                admitted = admission.admit(ask, self.gpus, _held(records))
            except admission.Refused as err:
                log.info("allocation refused", extra={"uid": peer.uid, "reason": str(err)})
                return {"error": str(err)}
            record = self._record(ask, admitted, peer, library)
            try:
                os.mkdir(record.channel_dir, paths.HOST_CHANNELS_DIR_MODE)
                os.chmod(record.channel_dir, paths.HOST_CHANNELS_DIR_MODE)
                allocation.write_record(self.state_dir, record)
            except (OSError, RecordError) as err:
                await self.end(record, "its record cannot be written")
                return {"error": f"the host daemon cannot write the allocation: {err}"}
            held.add(record.id)
            self.leases[record.id] = peer.uid
            await self.allocations.sync()
        if record.id not in self.allocations.channels:
            path = str(allocation.record_path(self.state_dir, record.id))
            why = self.allocations.corrupt.get(path, "its channel is not served")
            held.discard(record.id)
            await self.end(record, "it cannot be served")
            return {"error": f"the host daemon cannot serve the allocation: {why}"}
        log.info("allocation admitted", extra={
            "allocation": record.id, "uid": peer.uid, "pid": peer.pid, "gpu": admitted.gpu.uuid,
            "share": ask.share.to_json(), "memory_limit": admitted.memory})
        return {"allocation": record.to_json()}

    def _record(self, ask: admission.Ask, admitted: admission.Admitted, peer: PeerCred,
                library: str) -> AllocationRecord:
        allocation_id = allocation.new_run_id()
        gpu = admitted.gpu
        return AllocationRecord(
            id=allocation_id, origin="gemini-run", device_ids=(),
            gpus=(GpuShare(uuid=gpu.uuid, index=gpu.index, share=ask.share,
                           memory_limit=admitted.memory),),
            channel_dir=str(self.channels / allocation_id), hook_library=library,
            created_at=time.time(), limit=ask.limit, owner_pid=peer.pid or None,
            owner_uid=peer.uid)

    async def release(self, request: dict[str, Any], peer: PeerCred,
                      held: set[str]) -> dict[str, Any]:
        allocation_id = request.get("id")
        channel = self.allocations.channels.get(allocation_id) \
            if isinstance(allocation_id, str) else None
        # Another user's allocation is answered as one that does not exist: nothing is told.
        if channel is None or (peer.uid != 0 and channel.record.owner_uid != peer.uid):
            return {"error": f"no allocation {allocation_id!r} of yours"}
        held.discard(channel.record.id)
        await self.end(channel.record, f"released by uid {peer.uid}")
        return {"released": channel.record.id}

    async def end_id(self, allocation_id: str, reason: str) -> None:
        channel = self.allocations.channels.get(allocation_id)
        if channel is not None:
            await self.end(channel.record, reason)
        else:   # not served (yet): its record and directory, if any, all the same
            await self._collect(allocation_id, None, reason)

    async def end(self, record: AllocationRecord, reason: str) -> None:
        """End an allocation: its channel closed, then its record and directory removed."""
        await self._collect(record.id, record.owner_uid, reason)

    async def _collect(self, allocation_id: str, uid: int | None, reason: str) -> None:
        # The daemon's collection (Allocations.collect): the one order in which allocations
        # end, and end_allocation, the records' one deleter. A record that cannot be removed
        # lives on, and the sweep ends it once its owner process is gone.
        self.leases.pop(allocation_id, None)
        try:
            await self.allocations.collect(allocation_id, reason)
        except (OSError, RecordError) as err:
            log.error("cannot end allocation; tried again once its process is gone", extra={
                "allocation": allocation_id, "uid": uid, "reason": reason, "error": str(err)})
            return
        log.info("allocation ended", extra={"allocation": allocation_id, "uid": uid,
                                            "reason": reason})

    async def _sweep_channel_dirs(self) -> None:
        """Channel directories no record names: left by a daemon that died between the two."""
        live = {path.stem for path, _ in allocation.scan_records(self.state_dir)}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.channels):
                if entry.name not in live and _is_id(entry.name):   # nothing else is ours
                    await self._collect(entry.name, None, "no record names its directory")


def _is_id(name: str) -> bool:
    try:
        allocation.check_id(name)
    except RecordError:
        return False
    return True


def _ask(request: dict[str, Any], uid: int) -> admission.Ask:
    def share(key: str) -> Share | None:
        value = request.get(key)
        if value is None:
            return None
        try:
            return Share.from_json(value)
        except ShareError as err:
            raise admission.Refused(f"{key}: {err}") from None

    memory = request.get("memory")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)):
        raise admission.Refused(f"memory must be a number of bytes, got {memory!r}")
    gpu = request.get("gpu")
    if gpu is not None and not isinstance(gpu, (str, int)):
        raise admission.Refused(f"gpu must be an index or a UUID, got {gpu!r}")
    ask = admission.Ask(uid=uid, gpu=None if gpu is None else str(gpu),
                        share=share("share") or WHOLE, limit=share("limit"), memory=memory,
                        overcommit=request.get("overcommit") is True)
    admission.check(ask)
    return ask


def _library(name: Any) -> str:
    """The interposer's file name, for the record (what the user's gemini-run preloads)."""
    if name is None:
        return ""
    if not isinstance(name, str) or "/" in name or len(name) > MAX_LIBRARY_NAME:
        raise ValueError(f"hook_library must be a file name, got {name!r}")
    return name


def _held(records: list[AllocationRecord]) -> dict[str, list[admission.Held]]:
    held: dict[str, list[admission.Held]] = {}
    for record in records:
        for gpu in record.gpus:
            held.setdefault(gpu.uuid, []).append(
                admission.Held(record.id, record.owner_uid, gpu.share, gpu.memory_limit))
    return held
