"""One allocation's channel: its Unix socket, its sessions, its memory ledger and its tokens.

For each GPU i of the allocation the channel owns the shared token and activity pages (pages.py,
in the state directory's pages/, passed to each hook with its hello) and is a tenant of that
GPU's token scheduler (tokens.py) for as long as it exists.

Socket modes: the channel directory is created 0755 when missing (an allocator that wants it
private, like gemini-run, creates it 0700 first; existing modes are left alone) and the socket is
made 0666, so the container's user, whatever its uid, can connect. Isolation between containers
comes from the directories: each container has only its own channel directory mounted, and the
host's <state-dir>/channels is 0700 (paths.CHANNELS_DIR_MODE), so no host user reaches any.
Where the allocation's user is known (gemini-run's, whose directory that user made), a peer of
another uid (SO_PEERCRED) is refused too; so is a connection past max_connections (config.py),
and one past the allocation's connect rate (reconnects.py), whose log lines are summarised.
The host daemon's allocations name their user (the record's owner_uid): their socket is chowned
to that user and 0600, in a directory of root's that others may pass but not list.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vgpu_runtime.contracts import paths, wire
from vgpu_runtime.contracts.allocation import AllocationRecord, Binding, PodRef, RecordError
from vgpu_runtime.contracts.share import optional_json
from vgpu_runtime.daemon.channel.ledger import MemoryLedger
from vgpu_runtime.daemon.channel.pages import (
    GATE_TOKEN,
    ActivityPage,
    TokenPage,
    activity_page_path,
    ensure_pages_dir,
    pages_dir,
    retire_legacy_pages,
    token_page_path,
)
from vgpu_runtime.daemon.channel.peer import PeerCred, peer_cred
from vgpu_runtime.daemon.channel.process_memory import ContextCharger, charger_for
from vgpu_runtime.daemon.channel.reconcile import ProcessMemory
from vgpu_runtime.daemon.channel.reconnects import WINDOW_SECONDS, ConnectMeter
from vgpu_runtime.daemon.channel.session import Session, TokenFastPath
from vgpu_runtime.daemon.channel.terms import GpuTerms
from vgpu_runtime.daemon.channel.tokens import TenantSlot, TokenService

if TYPE_CHECKING:
    from vgpu_runtime.daemon.channel.tokens import GpuTokens

log = logging.getLogger(__name__)

CHANNEL_DIR_MODE = 0o755
SOCKET_MODE = 0o666
OWNED_SOCKET_MODE = 0o600
REFUSED = wire.Packer(wire.const("GM_MSG_ERROR"))
OVER_LIMIT_REASON = "GPUMemoryPastLimit"


class ChannelUnavailable(RecordError):
    """The record is sound but its channel cannot be made now (no descriptors, no space, a
    read-only state directory): the daemon tries again, unlike for a record that is wrong."""


class AllocationChannel:
    def __init__(self, record: AllocationRecord, terms: tuple[GpuTerms, ...],
                 tokens: TokenService, bind_timeout: Callable[[], float] = lambda: 0.0,
                 want_binding: Callable[[], None] = lambda: None,
                 binding: Binding | None = None,
                 pod_event: Callable[[PodRef, str, str], None] = lambda *_: None) -> None:
        self.record = record
        self.binding = binding
        self.terms = terms
        self.tokens = tokens
        self.token_gpus: list[GpuTokens] = []   # by GPU index, once started
        self.slots: list[TenantSlot] = []
        self.ledger = MemoryLedger([g.memory_limit for g in terms])
        self.sessions: set[Session] = set()
        self.socket_path = paths.channel_socket(record.channel_dir)
        self.pages_dir = pages_dir(tokens.config.state_dir)
        self._server: asyncio.AbstractServer | None = None
        self._created_dir = False
        # Only this uid (and root) may connect, where the allocation's user is known.
        self.owner_uid: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.memory_refusals = [0] * len(terms)
        # Per GPU: the process reported past the limit (reconcile), how often, how many killed;
        # the processes without a connection charged at the last reading.
        self.over_limit: dict[int, dict[str, Any]] = {}
        self.over_limit_reports = [0] * len(terms)
        self.over_limit_kills = [0] * len(terms)
        self.unhooked: list[list[ProcessMemory]] = [[] for _ in terms]
        self._kill_failures: set[tuple[int, int, str]] = set()
        self._charger: ContextCharger | None = None
        self.pod_event = pod_event   # (pod, reason, message): a Warning Event on the pod
        self._connect_meter: ConnectMeter | None = None   # made at the first accept
        self._summary_timer: asyncio.TimerHandle | None = None
        # A kubelet allocation is bound once the daemon has its pod binding (pods.py finds the
        # pod and its annotations); until then a hello may wait (see `wait_bound`).
        self.bound = asyncio.Event()
        if not needs_binding(record, binding):
            self.bound.set()
        self.bind_timeout = bind_timeout
        self.want_binding = want_binding
        self.bind_waiting = 0

    async def wait_bound(self) -> bool:
        """Wait (bounded by `bind_timeout`) until the pod is known; True if it is."""
        timeout = self.bind_timeout()
        if self.bound.is_set() or timeout <= 0:
            return self.bound.is_set()
        self.bind_waiting += 1
        self.want_binding()
        try:
            await asyncio.wait_for(self.bound.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("pod not known in time; the defaults hold", extra={
                "allocation": self.record.id, "waited_s": timeout})
        finally:
            self.bind_waiting -= 1
        return self.bound.is_set()

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
            retire_legacy_pages(directory, len(self.terms))
            self._open_pages()
            # Pages are right (gate, tenant registered) before the socket appears: a client
            # that can connect finds them current.
            self._join_token_schedulers()
            self._charger = charger_for(self.tokens, self.tokens.config)
            self._charger.add_channel(self)
            if self.record.owner_uid is not None:
                # The host daemon's: the user it admitted, known by that user's connection.
                self.owner_uid = self.record.owner_uid
            elif self.record.origin == "gemini-run":
                # gemini-run made the directory as the user whose command connects.
                self.owner_uid = os.stat(directory).st_uid
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: TokenFastPath(asyncio.StreamReader(loop=loop), self._accept),
                sock=self._listening_socket())
        except OSError as err:
            self._leave_reconciliation()
            self._leave_token_schedulers()
            self._close_pages(remove=True)
            raise ChannelUnavailable(f"cannot serve channel {self.socket_path}: {err}") from None
        log.info("serving allocation", extra={
            "allocation": self.record.id, "origin": self.record.origin,
            "socket": str(self.socket_path), "gpus": [g.uuid for g in self.terms]})

    def _listening_socket(self) -> socket.socket:
        """Bound, listening and 0666 under a temporary name, then renamed into place: a client
        that sees the path can connect at once (no window between bind and listen)."""
        temporary = self.socket_path.with_name(".sched.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(temporary))
            sock.listen(128)
            if self.record.owner_uid is None:
                os.chmod(temporary, SOCKET_MODE)
            else:   # a host allocation: its user's alone (the directory is root's, 0711)
                os.chown(temporary, self.record.owner_uid, -1)
                os.chmod(temporary, OWNED_SOCKET_MODE)
            os.rename(temporary, self.socket_path)
        except OSError:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        sock.setblocking(False)
        return sock

    def _open_pages(self) -> None:
        ensure_pages_dir(self.pages_dir)
        for index in range(len(self.terms)):
            self.slots.append(TenantSlot(
                self.record.id, index,
                TokenPage(token_page_path(self.pages_dir, self.record.id, index), GATE_TOKEN),
                ActivityPage(activity_page_path(self.pages_dir, self.record.id, index)),
                self.ledger))

    def page_descriptors(self) -> list[int]:
        """New descriptors of this allocation's pages for a hook: per GPU, token (read-only)
        then activity (writable). The caller closes them."""
        fds: list[int] = []
        try:
            for slot in self.slots:
                fds.append(slot.page.open_for_hook())
                fds.append(slot.activity.open_for_hook())
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _close_pages(self, remove: bool) -> None:
        for slot in self.slots:
            slot.page.close(remove)
            slot.activity.close(remove)
        self.slots = []

    def _join_token_schedulers(self) -> None:
        for terms, slot in zip(self.terms, self.slots, strict=True):
            gpu = self.tokens.gpu(terms.uuid)
            gpu.add(slot, terms.share.to_float(), terms.limit.to_float())
            self.token_gpus.append(gpu)

    def _leave_token_schedulers(self) -> None:
        for gpu in self.token_gpus:
            gpu.remove(self.record.id)
        self.token_gpus = []

    # ---- what sessions ask of the tokens (the session has checked the GPU index) ----

    # A frame read while the channel is closing finds it gone from the schedulers: ignored,
    # the client is about to be told GM_ERR_NO_ALLOCATION.

    def token_request(self, session: Session, gpu: int, seq: int, burst: float | None,
                      work_end: float | None, work_running: bool) -> None:
        if self.token_gpus:
            self.token_gpus[gpu].request(session, self.record.id, seq, burst, work_end,
                                         work_running)

    def token_release(self, gpu: int, work_end: float | None) -> None:
        if self.token_gpus:
            self.token_gpus[gpu].release(self.record.id, work_end)

    def usage_report(self, gpu: int, start: float, end: float, bursts: int) -> None:
        if self.token_gpus:
            self.token_gpus[gpu].observe_burst(self.record.id, start, end, bursts)

    # ---- NVML reconciliation (reconcile.Reconciled) ----

    def _leave_reconciliation(self) -> None:
        if self._charger is not None:
            self._charger.remove_channel(self)
            self._charger = None

    def peer_pids(self) -> set[int]:
        """The processes connected now (a hello answered or not): they speak for themselves."""
        return {s.peer.pid for s in self.sessions if s.peer.pid > 0}

    def _connected_memory(self, gpu: int) -> list[ProcessMemory]:
        processes = []
        for session in self.sessions:
            total = session.process_memory.get(gpu)
            if total is not None:
                declared = sum(amount for (g, kind), amount in
                               self.ledger.holdings(session).items()
                               if g == gpu and kind != wire.const("GM_MEM_CONTEXT"))
                processes.append(ProcessMemory(session.peer.pid, total, declared, True))
        return processes

    def reconcile(self, gpu: int, unhooked: list[ProcessMemory]) -> ProcessMemory | None:
        """After a per-process reading charged this allocation (its connections' contexts and
        its processes without a connection, `unhooked`): past its limit plus
        over_limit_tolerance, the memory went past the hook (another API, an old ABI, a static
        driver, a process that never connected). Returns the process to blame: the unconnected
        one holding most, else the connected one holding most it did not declare. Reported
        once when it goes over, naming the process, what it holds, what it declared and the
        limit; once more when it is back within."""
        self.unhooked[gpu] = unhooked
        used, limit = self.ledger.used(gpu), self.ledger.limit(gpu)
        over = used > limit + self.tokens.config.over_limit_tolerance
        if not over:
            if used <= limit and gpu in self.over_limit:
                report = self.over_limit.pop(gpu)
                log.info("the allocation is within its memory limit again", extra={
                    "allocation": self.record.id, "gpu": gpu, "pid": report["pid"],
                    "used": used, "limit": limit})
            return None
        candidates = unhooked or self._connected_memory(gpu)
        if not candidates:
            return None
        blamed = max(candidates, key=lambda p: (p.undeclared, -p.pid))
        if gpu not in self.over_limit:
            report = {"pid": blamed.pid, "process_bytes": blamed.process_bytes,
                      "declared_bytes": blamed.declared_bytes, "connected": blamed.connected,
                      "used": used, "limit": limit}
            self.over_limit[gpu] = report
            self.over_limit_reports[gpu] += 1
            log.warning("a process holds GPU memory the hook did not declare: the allocation is "
                        "past its memory limit", extra={"allocation": self.record.id, "gpu": gpu,
                                                        **report})
            how = ("of it declared to the interposer" if blamed.connected else
                   "with no connection to the interposer (none of it declared)")
            self._pod_event(f"process {blamed.pid} holds {blamed.process_bytes >> 20} MiB on "
                            f"GPU {self.terms[gpu].uuid}, {blamed.declared_bytes >> 20} MiB {how}"
                            f"; the container uses {used >> 20} MiB against its limit of "
                            f"{limit >> 20} MiB")
        return blamed

    def killed(self, gpu: int, blamed: ProcessMemory, failure: str | None) -> None:
        """over_limit_action=kill acted on the process `reconcile` blamed (`failure`: why the
        signal was not sent, or None)."""
        fields = {"allocation": self.record.id, "gpu": gpu, "pid": blamed.pid,
                  "process_bytes": blamed.process_bytes, "connected": blamed.connected}
        if failure is not None:
            if (gpu, blamed.pid, failure) not in self._kill_failures:
                self._kill_failures.add((gpu, blamed.pid, failure))
                log.error("cannot kill the process past the memory limit (over_limit_action "
                          "kill; another uid's process needs CAP_KILL)",
                          extra={**fields, "error": failure})
            return
        self.over_limit_kills[gpu] += 1
        if gpu in self.over_limit:
            self.over_limit[gpu]["killed"] = blamed.pid
        log.warning("killed the process past the memory limit (over_limit_action kill)",
                    extra=fields)
        self._pod_event(f"killed process {blamed.pid} (over_limit_action kill): it held "
                        f"{blamed.process_bytes >> 20} MiB on GPU {self.terms[gpu].uuid}, "
                        f"{blamed.declared_bytes >> 20} MiB of it declared, and the container "
                        "was past its memory limit")

    def _pod_event(self, message: str) -> None:
        if self.binding is not None:
            self.pod_event(self.binding.pod, OVER_LIMIT_REASON, message)

    def connection_closed(self, session: Session) -> None:
        last = not (self.sessions - {session})
        for gpu in self.token_gpus:
            gpu.connection_closed(session, self.record.id, last)

    def _remove_stale_socket(self) -> None:
        """A socket left by a daemon that died; we hold the lock, so nobody serves it."""
        try:
            mode = os.lstat(self.socket_path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise RecordError(f"{self.socket_path} exists and is not a socket; not replacing it")
        os.unlink(self.socket_path)

    def update(self, record: AllocationRecord, binding: Binding | None,
               terms: tuple[GpuTerms, ...]) -> None:
        """The record was rewritten or the pod bound: new terms, same connections."""
        if [g.uuid for g in terms] != [g.uuid for g in self.terms]:
            raise RecordError(f"allocation {record.id} changed its GPUs; an allocation's GPUs "
                              "are fixed for its life")
        self.ledger.set_limits([g.memory_limit for g in terms])
        for gpu, slot, old, new in zip(self.token_gpus, self.slots, self.terms, terms,
                                       strict=True):
            if old.share != new.share:
                # The algorithm has no way to change a request in place: rejoin (the tenant's
                # usage history on this GPU starts again).
                gpu.remove(record.id)
                gpu.add(slot, new.share.to_float(), new.limit.to_float())
            elif old.limit != new.limit:
                gpu.set_limit(record.id, new.limit.to_float())
        self.record, self.binding, self.terms = record, binding, terms
        if not needs_binding(record, binding):
            self.bound.set()
        log.info("allocation updated", extra={
            "allocation": record.id, "limits": [g.limit.to_json() for g in terms],
            "memory_limits": [g.memory_limit for g in terms]})

    def _meter(self) -> ConnectMeter:
        meter = self._connect_meter
        if meter is None:
            config = self.tokens.config
            meter = self._connect_meter = ConnectMeter(config.connect_rate, config.connect_burst)
        return meter

    def _watch_summary(self) -> None:
        """Some connection went unlogged: its window's summary comes when the window ends."""
        if self._meter().summarising and self._summary_timer is None:
            self._summary_timer = asyncio.get_running_loop().call_later(
                WINDOW_SECONDS, self._summarise_connections)

    def _refuse(self, writer: asyncio.StreamWriter, level: int, why: str, reason: str,
                **fields: Any) -> None:
        log.log(logging.WARNING if level == logging.INFO else level, "refusing client: %s", why,
                extra={"allocation": self.record.id, "connections": len(self.sessions),
                       **fields})
        self._watch_summary()
        refuse(writer, reason)

    def _summarise_connections(self) -> None:
        """The end of a window in which connections went unlogged: one line for all of them."""
        self._summary_timer = None
        summary = self._meter().close_window()
        if summary is not None:
            log.warning("%s", summary, extra={"allocation": self.record.id,
                                              "connections": len(self.sessions)})

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        meter = self._meter()
        if meter.window_over() and self._summary_timer is None:
            self._summarise_connections()
        if not meter.admit():
            self._refuse(writer, meter.log_level(refused=True), "reconnecting too fast",
                         f"allocation {self.record.id} opens more than {meter.rate:g} "
                         "connections a second (connect_rate)")
            return
        try:
            peer = peer_cred(writer.get_extra_info("socket"))
        except OSError as err:  # gone before we could ask who it was
            log.info("client left before identification", extra={"error": str(err)})
            writer.close()
            return
        config = self.tokens.config
        refusal = self._refusal(peer)
        if refusal is not None:
            self._refuse(writer, meter.log_level(refused=True), refusal, refusal,
                         peer_pid=peer.pid, peer_uid=peer.uid)
            return
        level = meter.log_level()
        self._watch_summary()
        writer.transport.set_write_buffer_limits(high=config.client_send_buffer)
        session = Session(self, reader, writer, peer)
        session.log_level = level
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

    def _refusal(self, peer: PeerCred) -> str | None:
        """Why this connection may not be served, or None."""
        if self.owner_uid is not None and peer.uid not in (0, os.geteuid(), self.owner_uid):
            return (f"uid {peer.uid} is not the owner (uid {self.owner_uid}) of allocation "
                    f"{self.record.id}")
        cap = self.tokens.config.max_connections
        if len(self.sessions) >= cap:
            return f"allocation {self.record.id} holds {cap} connections (max_connections)"
        return None

    async def close(self, reason: str, removed: bool = True) -> None:
        """Stop serving: no new clients, current ones told why and disconnected, socket gone.

        `removed`: the record is gone, so its pages go too. A daemon that merely stops leaves
        them (cleared) for the next one, which reuses the same files so hook mappings stay live.
        """
        if self._server is not None:
            self._server.close()
        timer = self._summary_timer
        if timer is not None:
            timer.cancel()
            self._summarise_connections()
        self._leave_reconciliation()
        self._leave_token_schedulers()
        status = wire.const("GM_ERR_NO_ALLOCATION")
        await asyncio.gather(*(s.close(status, reason) for s in list(self.sessions)),
                             return_exceptions=True)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        self._close_pages(remove=removed)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if self._created_dir and removed:
            with contextlib.suppress(OSError):
                os.rmdir(self.record.channel_dir)  # only if empty
        log.info("stopped serving allocation", extra={"allocation": self.record.id,
                                                      "reason": reason})

    def snapshot(self) -> dict[str, Any]:
        record = self.record
        return {
            "id": record.id, "origin": record.origin, "owner_pid": record.owner_pid,
            "owner_uid": record.owner_uid,
            "limit": optional_json(self.binding.limit if self.binding
                                   and self.binding.limit is not None else record.limit),
            "channel_dir": record.channel_dir,
            "socket": str(self.socket_path), "created_at": record.created_at,
            "device_ids": list(record.device_ids),
            "pod": None if self.binding is None else dataclasses.asdict(self.binding.pod),
            "gpus": [{"index": g.index, "uuid": g.uuid, "share": g.share.to_json(),
                      "share_ppm": wire.share_ppm(e.share), "limit_ppm": wire.share_ppm(e.limit),
                      "limit": e.limit.to_json(),
                      "memory_limit": self.ledger.limit(i), "memory_used": self.ledger.used(i),
                      "memory_refusals": self.memory_refusals[i],
                      "over_limit": self.over_limit.get(i),
                      "over_limit_reports": self.over_limit_reports[i],
                      "over_limit_kills": self.over_limit_kills[i],
                      "unhooked": [{"pid": p.pid, "process_bytes": p.process_bytes}
                                   for p in self.unhooked[i]]}
                     for i, (g, e) in enumerate(zip(record.gpus, self.terms, strict=True))],
            "connections": [s.snapshot() for s in self.sessions],
            "connects_refused": (0 if self._connect_meter is None
                                 else self._connect_meter.refused_total),
            "bound": self.bound.is_set(),
        }


def refuse(writer: asyncio.StreamWriter, reason: str) -> None:
    """One error frame, then the connection is closed (aborted if the client does not read)."""
    transport = writer.transport
    transport.write(REFUSED.pack(0, wire.const("GM_ERR_OVER_LIMIT"), 0,
                                 reason.encode()[:wire.const("GM_REASON_BYTES") - 1]))
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        transport.close()


def needs_binding(record: AllocationRecord, binding: Binding | None) -> bool:
    """Only kubelet allocations have a pod to find; gemini-run's need none."""
    return record.origin == "kubelet" and binding is None
