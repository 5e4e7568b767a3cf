"""Test helpers around the kit's daemon process (vgpu_runtime/devkit/daemon_process.py): hostile
clients' setups and the frames they read."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vgpu_runtime.contracts import wire
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.daemon.control import control_socket
from vgpu_runtime.devkit.daemon_process import (
    UUID_A,
    DaemonProcess,
    DaemonStatus,
    MiB,
    make_record,
    socket_of,
    wait_for,
    wait_served,
)
from vgpu_runtime.devkit.podnode import PodNode

REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "UUID_A", "UUID_B", "DaemonProcess", "MiB", "control_path",
           "daemon_with_bystander", "list_passes", "make_record", "read_until_closed",
           "record_scans", "rewrite_scans", "socket_of", "split_frames", "wait_for", "wait_served"]

UUID_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def control_path(state_dir: Path) -> Path:
    return control_socket(state_dir)


@contextlib.contextmanager
def daemon_with_bystander(
        bystander_bytes: int) -> Iterator[tuple[DaemonProcess, Path, client.ChannelClient]]:
    """A daemon serving one allocation, and a bystander connection on it holding
    `bystander_bytes`: what hostile clients of the same allocation must not disturb."""
    root = Path(tempfile.mkdtemp(prefix="gm-"))   # short: socket paths must fit 107 bytes
    state_dir = root / "state"
    state_dir.mkdir()
    # Hostile clients here open hundreds of connections a second on the one allocation on
    # purpose (a connection per case): no connect rate (tests/security/test_reconnects.py).
    daemon = DaemonProcess(state_dir, "--connect-rate", "0").wait_ready()
    path = wait_served(make_record(state_dir))
    bystander = client.ChannelClient(path)
    bystander.hello()
    bystander.reserve(0, bystander_bytes)
    try:
        yield daemon, path, bystander
    finally:
        bystander.close()
        assert daemon.stop() == 0, daemon.logs()
        shutil.rmtree(root, ignore_errors=True)


def record_scans(state_dir: Path, count: int = 2) -> None:
    """Wait until the daemon has scanned its records `count` more times: each scan serves a
    record written just before it. For what must NOT happen on a scan: counted, not timed, so a
    slow box cannot pass it unexercised."""
    for _ in range(count):
        wait_served(make_record(state_dir))


def rewrite_scans(daemon: DaemonStatus, record: AllocationRecord, count: int = 2) -> None:
    """record_scans where no new channel can be served: `record` (served, of make_record's
    default GPU) is rewritten with another memory limit before each scan, which applies it."""
    def applied(limit: int) -> bool:
        return bool(daemon.allocation(record.id)["gpus"][0]["memory_limit"] == limit)

    for step in range(1, count + 1):
        limit = 100 * MiB + step * MiB
        make_record(daemon.state_dir, allocation_id=record.id, gpus=((UUID_A, limit, 0.5),))
        wait_for(functools.partial(applied, limit), 5, "the rewrite applied")


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the daemon sends until it closes (a socket timeout fails the test: no hang)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def split_frames(received: bytes) -> list[Any]:
    """Whole daemon-to-hook frames, decoded, in the order they came."""
    frames = []
    while received:
        header = wire.parse_header(received, wire.SUPPORTED_VERSIONS)
        frames.append(wire.decode(received[:header.length], wire.SUPPORTED_VERSIONS))
        received = received[header.length:]
    return frames


async def list_passes(pods: PodNode, after: float = 0.0) -> None:
    """Wait `after` seconds (a grace the daemon times on its own clock), then until the daemon
    has begun two more PodResources Lists: the first began after the wait, so its pass was
    judged, and its answer is the one a later look reuses, by the time the second begins
    (passes run one at a time). Counting passes, not seconds, keeps a check of what must NOT
    happen from passing unexercised on a slow box."""
    async def lists() -> int:
        return int((await pods.status())["node"]["pod_resources_lists"])
    await asyncio.sleep(after)
    begun = await lists()
    deadline = time.monotonic() + 10
    while await lists() < begun + 2:
        assert time.monotonic() < deadline, "the daemon began no two PodResources Lists in 10 s"
        await asyncio.sleep(0.02)
