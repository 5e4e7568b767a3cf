"""Tools for the token tests: a rival container speaking the wire protocol, page readers,
and hooked programs that launch in loops and record when each launch returned."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.hook.conftest import PRELUDE, Hooked
from vgpu_runtime.contracts import paths, wire
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.channel.client import request

C = wire.const


def page_path(record: AllocationRecord, name: str, gpu: int = 0) -> Path:
    """An allocation's page in the state directory (the tests' records keep their channel in
    <state-dir>/channels/), read by path as only the daemon's user can."""
    return Path(record.channel_dir).parents[1] / "pages" / f"{record.id}.{name}.{gpu}"


def token_page_bytes(record: AllocationRecord, gpu: int = 0) -> bytes:
    """The allocation's token page as its daemon holds it: a sealed memfd, read through the
    daemon's own descriptor (/proc/<pid>/fd, as root or the daemon's user may), so reading
    opens no session; or the page file, where the kernel cannot seal."""
    file = page_path(record, "token", gpu)
    if file.exists():
        return file.read_bytes()
    pid = int(request(file.parents[1])["daemon"]["pid"])
    name = f"/memfd:gemini.{record.id}.token.{gpu} "
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(name):
                with open(f"/proc/{pid}/fd/{fd}", "rb") as page:
                    return page.read()
    raise FileNotFoundError(f"daemon {pid} holds no token page {gpu} of {record.id}")


def read_token_page(record: AllocationRecord, gpu: int = 0) -> tuple[int, int, int]:
    """(gate, generation, valid_until_ns) of the allocation's token page."""
    data = token_page_bytes(record, gpu)[:32]
    _magic, _version, gate, _reserved, generation, valid_until = struct.unpack("<IIIIQq", data)
    return gate, generation, valid_until


def read_activity_page(record: AllocationRecord, gpu: int = 0) -> tuple[int, int, int]:
    """(last_launch_ns, last_sync_ns, launches) the hooks wrote."""
    data = page_path(record, "activity", gpu).read_bytes()[:32]
    _magic, _version, last_launch, last_sync, launches = struct.unpack("<IIqqQ", data)
    return last_launch, last_sync, launches


class Rival:
    """Another container's process, without CUDA: asks for the token over its own channel and,
    once granted, says through its activity page that work is in flight, so the daemon lets it
    keep the token for its whole quota (then revokes it, since it never asks again)."""

    def __init__(self, record: AllocationRecord) -> None:
        self.record = record
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(paths.channel_socket(record.channel_dir)))
        self.seq = 0
        hello = self._exchange(wire.new(C("GM_MSG_HELLO"), proto_version=wire.VERSION, pid=1))
        assert hello.status == C("GM_OK")

    def _send(self, frame: Any) -> None:
        self.seq += 1
        frame.h.seq = self.seq
        self.sock.sendall(wire.encode(frame))

    def _read(self) -> Any:
        head = self._recv(wire.HEADER_SIZE)
        header = wire.parse_header(head)
        return wire.decode(head + self._recv(header.length - wire.HEADER_SIZE))

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "daemon closed the rival's connection"
            data += chunk
        return data

    def _exchange(self, frame: Any) -> Any:
        self._send(frame)
        return self._read()

    def request(self) -> None:
        self._send(wire.new(C("GM_MSG_TOKEN_REQUEST"), gpu=0, burst_ns=-1, work_end_ns=-1))

    def granted(self) -> int:
        """Blocks for the grant; returns valid_until_ns and marks work in flight."""
        grant = self._read()
        assert wire.frame_type(grant) == C("GM_MSG_TOKEN_GRANT")
        self.busy()
        return int(grant.valid_until_ns)

    def hold(self) -> int:
        self.request()
        return self.granted()

    def busy(self) -> None:
        with open(page_path(self.record, "activity"), "r+b") as page:
            page.seek(8)
            page.write(struct.pack("<qq", time.monotonic_ns(), -1))

    def close(self) -> None:
        self.sock.close()


def in_pod(channel_dir: str, argv: Sequence[str]) -> list[str]:
    """`argv` run as in a pod: in its own mount namespace, with `channel_dir` bound READ-ONLY at
    /run/gemini (the way Allocate's Mount is applied by runc). The environment passes through."""
    script = "\n".join([
        "set -eu", "mkdir -p /run/gemini",
        f"mount --bind {shlex.quote(channel_dir)} /run/gemini",
        "mount -o remount,bind,ro /run/gemini",
        "exec " + shlex.join(argv)])
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


LOOP = """
    import select, sys, time
    lib = cuda()
    context(lib)
    seconds, sync_each = float(sys.argv[1]), sys.argv[2] == "1"
    stoppable = sys.argv[3] == "1"
    print("ready", flush=True)
    sys.stdin.readline()
    returns = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(0x77), None, None)
        if sync_each:
            lib.cuStreamSynchronize(ctypes.c_void_p(0x77))
        returns.append(time.monotonic_ns())
        if stoppable and len(returns) % 256 == 0 and select.select([sys.stdin], [], [], 0)[0]:
            break
    print(json.dumps({"returns": returns, "stats": stats()}), flush=True)
"""


class Loop:
    """A hooked process launching (and optionally synchronising) in a loop for `seconds`; with
    `pod_channel`, inside a pod-like mount namespace with that channel read-only (`in_pod`).
    `stoppable`: `stop` ends it sooner (`seconds` is then a bound), for tests that wait on
    events while it runs instead of giving it a fixed time."""

    def __init__(self, hooked: Hooked, env: dict[str, str], seconds: float,
                 sync_each: bool = False, pod_channel: str | None = None,
                 stoppable: bool = False) -> None:
        argv = [sys.executable, "-c", PRELUDE + textwrap.dedent(LOOP), str(seconds),
                "1" if sync_each else "0", "1" if stoppable else "0"]
        self.proc = subprocess.Popen(
            in_pod(pod_channel, argv) if pod_channel else argv,
            env=hooked.env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", self.proc.stderr.read() if self.proc.stderr else ""

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """A stoppable loop ends within 256 launches."""
        self.go()

    def result(self, timeout: float = 30) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        result["stderr"] = err
        return result

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
