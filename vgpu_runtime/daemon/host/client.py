"""Asking the host daemon (server.py's protocol), for gemini-run and gemini-vgpu.

A connection that fails says what to do: a daemon installed but not running is started through
its unit; a user outside its group asks an administrator to be added.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from vgpu_runtime import hoststate
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.allocation import AllocationRecord, RecordError


class HostError(Exception):
    """The host daemon could not be asked, or refused; the message says why and what to do."""


class HostRefused(HostError):
    """The host daemon answered with a refusal (its message)."""


class HostConnection:
    """One connection to the host daemon; requests answered in turn. An allocation asked for on
    it lasts as long as the connection (its lease)."""

    def __init__(self, state_dir: str | Path, timeout: float = 30.0) -> None:
        self.state_dir = Path(state_dir)
        self.path = paths.host_socket(state_dir)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(self.path))
        except OSError as err:
            self.sock.close()
            raise HostError(unreachable(self.state_dir, err)) from None
        self._buffer = b""

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        """The daemon's answer; HostError for a refusal or a broken connection."""
        try:
            self.sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
            while b"\n" not in self._buffer:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    raise ConnectionError("the host daemon closed the connection")
                self._buffer += chunk
        except OSError as err:
            raise HostError(f"the host daemon on {self.path} did not answer {op}: {err}") \
                from None
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError as err:
            raise HostError(f"the host daemon gave no valid answer to {op}: {err}") from None
        if not isinstance(answer, dict):
            raise HostError(f"the host daemon gave no valid answer to {op}: {answer!r}")
        if "error" in answer:
            raise HostRefused(str(answer["error"]))
        return answer

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


def request(state_dir: str | Path, op: str, **fields: Any) -> dict[str, Any]:
    connection = HostConnection(state_dir, timeout=10.0)
    try:
        return connection.ask(op, **fields)
    finally:
        connection.close()


def unreachable(state_dir: Path, err: OSError) -> str:
    socket_path = paths.host_socket(state_dir)
    marker = hoststate.read_marker(state_dir)
    group = marker.group if marker else paths.DEFAULT_HOST_GROUP
    if isinstance(err, PermissionError):
        return (f"permission denied on {socket_path}: the host daemon serves the members of "
                f"group {group!r}, and uid {os.getuid()} is not one (or not since its last "
                f"login). Ask an administrator: sudo usermod -aG {group} <you>, then log in "
                "again")
    if isinstance(err, (FileNotFoundError, ConnectionRefusedError)):
        return (f"the host daemon is installed ({paths.host_marker(state_dir)}) but does not "
                f"run: nothing answers on {socket_path}. Start it: sudo systemctl start "
                f"{hoststate.HOST_UNIT} (journalctl -u {hoststate.HOST_UNIT} says why it "
                "stopped)")
    return f"cannot reach the host daemon on {socket_path}: {err}"


class Lease:
    """An allocation of the host daemon's, held by this process's connection: it ends when
    `end` is called or when this process exits however it exits (the kernel closes the
    connection)."""

    def __init__(self, state_dir: str | Path, **ask: Any) -> None:
        self.state_dir = Path(state_dir)
        self.connection = HostConnection(state_dir)
        try:
            answer = self.connection.ask("allocate", **ask)
            self.record = AllocationRecord.from_json(answer["allocation"])
        except HostError:
            self.connection.close()
            raise
        except (KeyError, RecordError) as err:
            self.connection.close()
            raise HostError(f"the host daemon gave no valid allocation: {err}") from None

    def end(self) -> None:
        """Release the allocation now: on the lease's own connection, or, where a restart of
        the daemon broke it, on a new one (the daemon would otherwise end it within a second
        of this process's exit)."""
        try:
            self.connection.ask("release", id=self.record.id)
        except HostError:
            with contextlib.suppress(HostError):
                request(self.state_dir, "release", id=self.record.id)
        finally:
            self.connection.close()
