"""Allocate: validate kubelet's slice IDs, write the allocation record, answer the container.

The record (vgpu_runtime.contracts.allocation) is keyed by the set of slice IDs, so Allocate is
idempotent: kubelet hands an init container's slices to the app containers and replays kept
responses, and the same IDs always give the same record id, channel directory and response.

The record holds the entitlement (share, memory limit, the GPU's slice count) and nothing
else: the daemon keeps the pod binding and the pod's overrides in its own file. Memory: k of N
slices get floor((GPU memory - memory_reserve) x k / N) bytes, whole GPUs all of it
(vgpu_runtime.contracts.containerenv, the rule gemini-run shares).

Durability (the rule; vgpu_runtime.common.atomicfile has the details): Allocate answers only
after the record's data is fsynced and renamed into place, so a record kubelet was told about
survives any crash of the plugin, and no crash or power loss leaves half a record. The fsync
of the directories (allocations/, channels/, the channel's own) that makes new names survive
a POWER LOSS is batched in a background thread and done just after the answer: a power loss
in that window (about a millisecond) loses the new record, as it would lose kubelet's own
checkpoint of the answer, which kubelet writes after Allocate returns and never fsyncs the
directory of. After a reboot the daemon re-creates any channel directory that was lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import grpc

from device_plugin.health import HealthTracker
from device_plugin.slices import Slice, SliceTable, brief_ids
from vgpu_runtime import hooklib
from vgpu_runtime.common.atomicfile import DirectorySyncer, write_atomic
from vgpu_runtime.contracts import allocation, containerenv, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare, RecordError
from vgpu_runtime.contracts.share import WHOLE, Share
from vgpu_runtime.gpus import GpuInfo
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2
from vgpu_runtime.pluginconfig import PluginConfig

log = logging.getLogger(__name__)

ALLOCATION_ANNOTATION = "gemini.ai/allocation-id"
CONTAINER_HOOK = f"{paths.CONTAINER_LIB_DIR}/{hooklib.library_name()}"
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
# Answers kept for replays (a node holds a few hundred allocations; this only bounds memory).
KEPT_ANSWERS = 4096

Defer = Callable[[Callable[[], None]], object]


def _now(work: Callable[[], None]) -> None:
    work()


@dataclass(frozen=True)
class _Layout:
    """One state dir's paths as strings, made once: an Allocate joins strings where pathlib
    cost about 10 us per path (str(Path(d) / name) is d + "/" + name for a plain name)."""
    state_dir: str
    records: str
    channels: str
    socket_fits: bool   # the same for every channel: allocation IDs have one length

    @classmethod
    def of(cls, state_dir: str) -> _Layout:
        sample = paths.channel_socket(paths.channel_dir(state_dir, "k-" + "0" * 16))
        return cls(state_dir, str(paths.allocations_dir(state_dir)),
                   str(paths.channels_dir(state_dir)), paths.fits_unix_socket(sample))

    def record(self, allocation_id: str) -> str:
        return f"{self.records}/{allocation_id}.json"

    def channel(self, allocation_id: str) -> str:
        return f"{self.channels}/{allocation_id}"


@dataclass(frozen=True)
class _Kept:
    """A record's bytes as this process last wrote or read them, and the answer they give.
    Equal bytes in the file mean an unchanged record, so a replay reads the file and compares
    instead of parsing, rebuilding and re-checking it (a file changed since, by an upgrade or a
    hand, takes the full path)."""
    payload: bytes
    answer: api_pb2.ContainerAllocateResponse


class AllocationError(Exception):
    """A rejected Allocate: a gRPC status code and a message for the operator."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> AllocationError:
    return AllocationError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _precondition(message: str) -> AllocationError:
    return AllocationError(grpc.StatusCode.FAILED_PRECONDITION, message)


def mps_mounts(config: PluginConfig) -> list[api_pb2.Mount]:
    """Over MPS a container's CUDA is a client of the node daemon's MPS server: it needs the
    control daemon's pipes and the server's own /dev/shm. Both writable, as MPS's clients
    create files in them; every tenant of one server is trusted alike (README, "MPS")."""
    return [api_pb2.Mount(container_path=paths.CONTAINER_MPS_PIPE_DIR,
                          host_path=str(paths.mps_pipe_dir(config.state_dir))),
            api_pb2.Mount(container_path=paths.SHM_DIR, host_path=config.mps_shm_dir)]


def check_mps_shm(config: PluginConfig) -> None:
    """A container gets mps_shm_dir as its /dev/shm only where the running MPS control daemon
    was started with it (its mark there and in the state directory agree): with another, the
    container's CUDA would wait for a server it cannot reach."""
    expected = paths.mps_shm_id(config.state_dir)
    found = os.path.join(config.mps_shm_dir, paths.mps_shm_name(config.state_dir))
    try:
        with open(expected, "rb") as ours:
            token = ours.read()
    except OSError:
        raise _precondition(
            f"mps is on but no MPS control daemon has started on {config.state_dir} (no "
            f"{expected}): the node's gemini-mps-control container, or the daemon with "
            "mps_manage, starts it; a pod created once it runs is admitted") from None
    try:
        with open(found, "rb") as theirs:
            same = theirs.read() == token
    except OSError:
        same = False
    if not same:
        raise _precondition(
            f"mps_shm_dir {config.mps_shm_dir} is not the /dev/shm the MPS control daemon of "
            f"{config.state_dir} runs with (its mark {found} is missing or differs): mount the "
            "same host directory at /dev/shm in its container and set mps_shm_dir to it")


class Allocator:
    def __init__(self, config: PluginConfig, table: SliceTable,
                 health: HealthTracker | None = None,
                 clock: Callable[[], float] = time.time,
                 syncer: DirectorySyncer | None = None, defer: Defer = _now) -> None:
        self.config = config
        self.table = table
        self.health = health
        self.clock = clock
        # None: every directory fsync is done before Allocate answers (tests, tools).
        self.syncer = syncer
        # Runs work that the answer does not wait for (the log line); the server passes the
        # event loop's call_soon, so it runs once the answer is on its way.
        self.defer = defer
        self._kept: dict[str, _Kept] = {}
        # GPUs waiting to change slice count: no new allocation (device_plugin.slicecounts).
        self.draining: frozenset[str] = frozenset()
        self._layout_cache = _Layout.of(config.state_dir)
        for gpu in table.gpus:
            if gpu.memory_total <= config.memory_reserve:
                raise ValueError(f"memory_reserve ({config.memory_reserve} bytes) leaves nothing "
                                 f"of GPU {gpu.index} ({gpu.uuid}, {gpu.memory_total} bytes)")

    # ---- memory ----

    def entitled_memory(self, gpu: GpuInfo, slices: int) -> int:
        return containerenv.entitled_memory(gpu.memory_total, self.config.memory_reserve,
                                            Share.of_slices(slices, self.table.count_of(gpu.uuid)))

    # ---- validation ----

    def validate(self, device_ids: Sequence[str]) -> list[Slice]:
        """The slices, in GPU and slice order; raises AllocationError saying what is wrong."""
        per_gpu = self.table.per_gpu
        if not device_ids:
            raise _invalid("Allocate named no devices; kubelet should send at least one "
                           f"{self.config.resource_name} device ID")
        if len(set(device_ids)) != len(device_ids):
            duplicates = sorted(d for d, n in Counter(device_ids).items() if n > 1)
            raise _invalid(f"device ID(s) {brief_ids(duplicates)} appear more than once in one "
                           "Allocate; each slice can be given once")
        try:
            slices = self.table.in_order(device_ids)
        except KeyError:
            raise _invalid(
                f"unknown device ID(s) {brief_ids(self.table.unknown(device_ids))}: this plugin "
                f"serves {len(self.table)} slices named <GPU UUID>::<0..{per_gpu - 1}> on "
                f"{len(self.table.gpus)} GPU(s). If the node's GPUs or --slices-per-gpu changed, "
                "delete the pod so kubelet allocates again from the current devices") from None
        k = len(slices)
        if slices[0].gpu is slices[-1].gpu:     # in GPU order: one GPU (the usual request)
            return slices                       # distinct known IDs: at most all of its slices
        by_gpu: dict[str, list[Slice]] = {}
        for item in slices:
            by_gpu.setdefault(item.gpu.uuid, []).append(item)
        if k <= per_gpu:
            raise _precondition(
                f"the {k} slices come from {len(by_gpu)} GPUs ({', '.join(by_gpu)}); a request of "
                f"at most {per_gpu} slices must be on one GPU. Kubelet did not follow this "
                "plugin's preferred allocation (is get_preferred_allocation_available honoured?)"
                "; delete the pod to retry")
        counts = {u: self.table.count_of(u) for u in by_gpu}
        if k > per_gpu:
            if k % per_gpu and set(counts.values()) == {per_gpu}:
                raise _precondition(
                    f"{k} slices is more than one GPU ({per_gpu} slices) and not a multiple of "
                    f"{per_gpu}: request at most {per_gpu} slices, or whole GPUs "
                    f"({per_gpu}, {2 * per_gpu}, ...)")
            partial = [f"{u} ({len(s)} of {counts[u]})" for u, s in by_gpu.items()
                       if len(s) != counts[u]]
            if partial:
                raise _precondition(
                    f"a request of {k} slices must take whole GPUs, but got part of "
                    f"{', '.join(partial)}; delete the pod to retry when whole GPUs are free")
        return slices

    def _check_health(self, slices: list[Slice]) -> None:
        """A new allocation needs healthy GPUs that are not waiting to change slice count."""
        changing = sorted({s.gpu.uuid for s in slices if s.gpu.uuid in self.draining})
        if changing:
            raise _precondition(
                f"GPU(s) {', '.join(changing)} take no new allocation: slices_per_gpu changed "
                f"to {self.table.per_gpu} and each keeps its old slices until the allocations "
                "live on it end; delete the pod so it is placed on another GPU")
        if self.health is None:
            return
        sick = sorted({s.gpu.uuid for s in slices if not self.health.is_healthy(s.gpu.uuid)})
        if sick:
            reasons = self.health.unhealthy()
            detail = "; ".join(f"{u}: {reasons.get(u, 'unhealthy')}" for u in sick)
            raise _precondition(f"GPU(s) unhealthy ({detail}); delete the pod so it is placed on "
                                "a healthy GPU, and check the node's GPU (nvidia-smi, dmesg XIDs)")

    # ---- the record and the response ----

    def build_record(self, slices: list[Slice], created_at: float,
                     allocation_id: str | None = None) -> AllocationRecord:
        """`allocation_id`: id_for_devices of the slices, when the caller has it already."""
        device_ids = tuple(s.id for s in slices)
        if allocation_id is None:
            allocation_id = allocation.id_for_devices(device_ids)
        gpus: dict[str, GpuInfo] = {s.gpu.uuid: s.gpu for s in slices}
        k = len(slices)
        if len(gpus) == 1:
            gpu = next(iter(gpus.values()))
            per_gpu = self.table.count_of(gpu.uuid)
            shares: tuple[GpuShare, ...] = (GpuShare(
                gpu.uuid, gpu.index, Share.of_slices(k, per_gpu), self.entitled_memory(gpu, k),
                per_gpu),)
        else:
            shares = tuple(GpuShare(g.uuid, g.index, WHOLE, self.entitled_memory(g, n), n)
                           for g in gpus.values()
                           for n in (self.table.count_of(g.uuid),))
        return AllocationRecord(
            id=allocation_id, origin="kubelet", device_ids=device_ids, gpus=shares,
            channel_dir=self._layout().channel(allocation_id),
            hook_library=hooklib.library_name(), created_at=created_at,
        )

    def response(self, record: AllocationRecord,
                 slices: list[Slice]) -> api_pb2.ContainerAllocateResponse:
        uuids = [g.uuid for g in record.gpus]
        gpus = {s.gpu.uuid: s.gpu for s in slices}
        strategy = self.config.device_list_strategy
        envs = containerenv.container_environment(record, paths.CONTAINER_CHANNEL_DIR)
        # "void" overrides an image's NVIDIA_VISIBLE_DEVICES=all (CUDA images set it) when the
        # GPU is given as CDI devices or device nodes.
        envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids) if strategy == "envvar" else "void"
        answer = api_pb2.ContainerAllocateResponse(
            envs=envs,
            mounts=[
                api_pb2.Mount(container_path=paths.CONTAINER_LIB_DIR,
                              host_path=str(self.config.host_hook_dir), read_only=True),
                # Read-only: connecting to the socket needs no write access to the directory,
                # and the container cannot replace its socket or fill the node's state dir.
                api_pb2.Mount(container_path=paths.CONTAINER_CHANNEL_DIR,
                              host_path=record.channel_dir, read_only=True),
            ],
            annotations={ALLOCATION_ANNOTATION: record.id},
        )
        injection = self.config.injection
        if injection in ("ld-preload", "both"):
            answer.envs["LD_PRELOAD"] = CONTAINER_HOOK
        if injection in ("preload-file", "both"):
            answer.mounts.append(api_pb2.Mount(
                container_path=paths.CONTAINER_PRELOAD_FILE,
                host_path=os.path.join(record.channel_dir, paths.CHANNEL_PRELOAD_NAME),
                read_only=True))
        if self.config.mps:
            answer.envs["CUDA_MPS_PIPE_DIRECTORY"] = paths.CONTAINER_MPS_PIPE_DIR
            answer.mounts.extend(mps_mounts(self.config))
        if strategy == "cdi":
            answer.cdi_devices.extend(api_pb2.CDIDevice(name=f"{self.config.cdi_kind}={u}")
                                      for u in uuids)
        elif strategy == "device-nodes":
            nodes = [f"/dev/nvidia{gpus[u].minor}" for u in uuids] + list(CONTROL_DEVICES)
            answer.devices.extend(api_pb2.DeviceSpec(container_path=n, host_path=n,
                                                     permissions="rw") for n in nodes)
        return answer

    def allocate(self, device_ids: Sequence[str]) -> api_pb2.ContainerAllocateResponse:
        """Validate, write the record (atomically, idempotently) and build the response."""
        return self._allocate(self.validate(device_ids))[0]

    def _allocate(self, slices: list[Slice]) -> tuple[api_pb2.ContainerAllocateResponse, bool]:
        """For validated slices: the response, and whether this call created the record.
        The response may be one kept from an earlier call: callers must not change it."""
        self._check_interposer()
        if self.config.mps:
            check_mps_shm(self.config)
        allocation_id = allocation.id_for_devices(s.id for s in slices)
        layout = self._layout()
        if not layout.socket_fits:
            socket = paths.channel_socket(layout.channel(allocation_id))
            raise _precondition(
                f"channel socket path {socket} is longer than {paths.UNIX_PATH_MAX} bytes; "
                "configure a shorter --state-dir and restart the plugin")
        try:
            raw = allocation.read_record_bytes(layout.record(allocation_id))
            kept = self._kept.get(allocation_id)
            if raw is not None and kept is not None and raw == kept.payload:
                self._restore_preload_file(allocation_id)
                self._log_allocated(allocation_id, slices, replay=True)
                return kept.answer, False
            existing = None if raw is None else allocation.decode_record(
                layout.record(allocation_id), raw)
        except RecordError as err:
            raise AllocationError(grpc.StatusCode.INTERNAL,
                                  f"{err}; move the file aside and delete the pod to retry"
                                  ) from None
        if existing is None:
            self._check_health(slices)
            record = self.build_record(slices, self.clock(), allocation_id)
        elif existing.carried is not None:
            # A version-1 record an older daemon wrote its pod into: left as it is for its
            # allocation's life (the daemon moves that pod into its binding file).
            record = existing
        else:
            # A replay keeps the creation time and the entitled memory, fixed for the
            # allocation's life; the pod binding is the daemon's (daemon/pods/pods.py).
            record = self._replayed(self.build_record(slices, existing.created_at,
                                                      allocation_id), existing)
        if record != existing:
            payload = self._store(record, layout)
        else:
            assert raw is not None
            payload = raw
            self._restore_preload_file(allocation_id)
        answer = self.response(record, slices)
        self._keep(allocation_id, _Kept(payload, answer))
        self._log_allocated(allocation_id, slices, replay=existing is not None)
        return answer, existing is None

    @staticmethod
    def _replayed(fresh: AllocationRecord, existing: AllocationRecord) -> AllocationRecord:
        memory = {g.uuid: g.memory_limit for g in existing.gpus}
        return replace(fresh, gpus=tuple(replace(g, memory_limit=memory.get(g.uuid,
                                                                             g.memory_limit))
                                         for g in fresh.gpus))

    def _check_interposer(self) -> None:
        """The library the answer names in LD_PRELOAD or the preload file must be in the hook
        directory: without it the loader skips it and the pod runs ungated."""
        library = os.path.join(self.config.host_hook_dir, hooklib.library_name())
        try:
            mode = os.lstat(library).st_mode
        except FileNotFoundError:
            problem = "does not exist"
        except OSError as err:
            problem = f"cannot be read ({err.strerror})"
        else:
            if stat.S_ISREG(mode):
                return
            problem = "is not a regular file"
        raise _precondition(
            f"the interposer library {library} {problem}, so the pod would run without GPU "
            "sharing enforcement; run gemini-install-hook (the node DaemonSet's install-hook "
            "step) with this plugin's state dir, or point --hook-dir at where it installed "
            f"{hooklib.library_name()}, then delete the pod to retry")

    def _layout(self) -> _Layout:
        if self._layout_cache.state_dir != self.config.state_dir:    # config replaced
            self._layout_cache = _Layout.of(self.config.state_dir)
        return self._layout_cache

    def _restore_preload_file(self, allocation_id: str) -> None:
        """On a replay: the preload file the response points to, if it is missing (the node
        switched injection since the first call, or it was removed)."""
        if self.config.injection != "ld-preload":
            channel = self._layout().channel(allocation_id)
            if not os.path.exists(os.path.join(channel, paths.CHANNEL_PRELOAD_NAME)):
                self._write_preload_file(channel)

    def _keep(self, allocation_id: str, kept: _Kept) -> None:
        self._kept.pop(allocation_id, None)
        if len(self._kept) >= KEPT_ANSWERS:
            del self._kept[next(iter(self._kept))]     # the oldest
        self._kept[allocation_id] = kept

    def _log_allocated(self, allocation_id: str, slices: list[Slice], replay: bool) -> None:
        """Logged after the answer (self.defer): the slice count and GPUs, not every slice ID
        (the record has them), so a 200-slice request costs no more to log than one."""
        def emit() -> None:
            log.info("allocated", extra={
                "allocation_id": allocation_id, "slices": len(slices),
                "gpus": list(dict.fromkeys(s.gpu.uuid for s in slices)),
                "replay": replay})
        self.defer(emit)

    def allocate_all(self, requests: Sequence[Sequence[str]]
                     ) -> list[api_pb2.ContainerAllocateResponse]:
        """Several containers in one call, all or nothing: every request is validated before
        any record is written, and records this call created are removed if a later one
        fails to store. (Kubelet sends one container per call; other clients may not.)"""
        validated = [self.validate(ids) for ids in requests]
        answers, created = [], []
        try:
            for slices in validated:
                answer, new = self._allocate(slices)
                answers.append(answer)
                if new:
                    created.append(allocation.id_for_devices(s.id for s in slices))
        except AllocationError:
            for allocation_id in created:
                allocation.end_allocation(self.config.state_dir, allocation_id)
            raise
        return answers

    def _write_preload_file(self, channel: str) -> None:
        """For the preload-file injection: the line the loader reads in the container (the
        library's container path, whose versioned name never changes for this allocation)."""
        if self.config.injection != "ld-preload":
            write_atomic(os.path.join(channel, paths.CHANNEL_PRELOAD_NAME),
                         f"{CONTAINER_HOOK}\n".encode(),
                         syncer=self.syncer)

    def _make_channel(self, channel: str) -> bool:
        """Create the channel directory; True if this call created it."""
        try:
            os.mkdir(channel, 0o755)
        except FileExistsError:
            return False
        except FileNotFoundError:   # the first allocation on this node: channels/ too
            os.makedirs(os.path.dirname(channel), paths.CHANNELS_DIR_MODE, exist_ok=True)
            os.makedirs(channel, 0o755, exist_ok=True)
        if self.syncer is not None:
            self.syncer.request(os.path.dirname(channel))
        # Without a syncer the new name is not fsynced: the daemon re-creates a lost channel
        # directory when it serves the record.
        return True

    def _store(self, record: AllocationRecord, layout: _Layout) -> bytes:
        """Write the channel directory and the record; returns the record's bytes."""
        created = False
        channel = layout.channel(record.id)
        try:
            created = self._make_channel(channel)
            self._write_preload_file(channel)
            payload = allocation.encode_record(record)
            allocation.write_record_bytes(layout.record(record.id), payload, self.syncer)
        except (OSError, RecordError) as err:
            if created:
                with contextlib.suppress(OSError):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(channel, paths.CHANNEL_PRELOAD_NAME))
                    os.rmdir(channel)
            detail = err.strerror if isinstance(err, OSError) else str(err)
            raise AllocationError(
                grpc.StatusCode.INTERNAL,
                f"cannot store allocation {record.id} under state dir {self.config.state_dir}: "
                f"{detail}. Check that the node's state directory is writable and has free "
                "space, then delete the pod to retry") from None
        return payload
