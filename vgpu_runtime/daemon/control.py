"""The control socket <state-dir>/scheduler.sock: one JSON request per connection.

Request: one line of JSON, {"op": "status"}. Answer: one line of JSON, then the daemon closes.
`status` returns the daemon, every allocation with its GPUs (share, limits, memory used), its
connections (peer credentials, what each holds), every GPU's token (holder, and per tenant:
request, limit, achieved share over the window, token waits p50/p99, revocations, memory) and
the corrupt records. `stop` ({"op": "stop", "force": false}) stops the daemon, refused while an
allocation is live unless forced (`gemini-vgpu stop`). A bad request gets {"error": "..."}.
An op may be a coroutine: `status` and `stop` read the records again first, so an allocation
whose record was just removed (a gemini-run whose command has ended) is neither shown nor holds
the daemon up.

Who may ask: the socket is 0600, owned by the daemon's user. On a node the daemon runs as root
in /var/lib/gemini, so only root reaches it (it shows every tenant's usage). A non-root user of
gemini-run gets a per-user state directory (paths.default_state_dir: $XDG_RUNTIME_DIR/gemini or
/tmp/gemini-<uid>) in which gemini-run starts a daemon of that user's own, so the same mode lets
that user, and only that user (and root), read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpu_runtime.contracts import paths

log = logging.getLogger(__name__)

CONTROL_MODE = 0o600
MAX_REQUEST = 64 * 1024


control_socket = paths.control_socket


class ControlServer:
    def __init__(self, path: Path, ops: dict[str, Callable[[dict[str, Any]], Any]]) -> None:
        self.path = path
        self.ops = ops
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by a daemon that died; we hold the lock
        # Created under a umask that leaves it private from the first instant, not after chmod.
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path),
                                                           limit=MAX_REQUEST)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, CONTROL_MODE)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answer = self._answer(await reader.readline())
            if inspect.isawaitable(answer):
                answer = await answer
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, ValueError) as err:  # ValueError: line over the limit
            log.warning("control request failed", extra={"error": str(err)})
        finally:
            writer.close()

    def _answer(self, line: bytes) -> Any:
        try:
            request = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return {"error": f"request is not JSON: {err}"}
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            return {"error": 'request must be an object like {"op": "status"}'}
        handler = self.ops.get(request["op"])
        if handler is None:
            return {"error": f"unknown op {request['op']!r}; known: {', '.join(sorted(self.ops))}"}
        return handler(request)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
