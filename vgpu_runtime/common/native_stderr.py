"""Lines that C libraries write straight to fd 2 become JSON log records, so that a daemon's
stderr stays one JSON object per line.

gRPC C-core prints its own errors there (`E1203 10:26:02.363014 15093 add_port.cc:83] Failed to
add port ...`), outside Python's logging, and NVML can too. A daemon that logs JSON turns fd 2
into a pipe read by a thread, which logs each line (logger `native`, the level its letter says,
the C source as `source`). Python's own writes (the log handler, tracebacks, `<program>: error:`)
keep the original stream through `sys.stderr`. The lines are kept rather than silenced
(GRPC_VERBOSITY=NONE would drop them, and only if set before grpc is imported).
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading

log = logging.getLogger("native")

# glog's form, which gRPC C-core (absl) uses: level letter, MMDD time, thread id, file:line.
_GLOG = re.compile(r"^([FEWID])\d{4} [\d:.]+\s+\d+ ([^\s\]]+)\] ?(.*)$")
_LEVELS = {"F": logging.CRITICAL, "E": logging.ERROR, "W": logging.WARNING, "I": logging.INFO,
           "D": logging.DEBUG}
_JOIN_TIMEOUT = 2.0


def record_of(line: str) -> tuple[int, str, dict[str, str]]:
    """The level, message and fields one native stderr line is logged with."""
    match = _GLOG.match(line)
    if match:
        return _LEVELS[match.group(1)], match.group(3), {"source": match.group(2)}
    return logging.WARNING, line, {}


class NativeStderr:
    """fd 2 through a pipe into the log; stop() (also at exit) puts it back and drains."""

    def __init__(self) -> None:
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._saved = saved
        # Python's stderr keeps the original stream: the handler's JSON must not loop back.
        sys.stderr = open(os.dup(saved), "w", buffering=1,  # noqa: SIM115 (lives as long as we)
                          encoding="utf-8", errors="backslashreplace")
        self._thread = threading.Thread(target=self._pump, args=(read_end,),
                                        name="native-stderr", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def _pump(self, read_end: int) -> None:
        with open(read_end, "rb") as pipe:
            for raw in pipe:
                line = raw.decode("utf-8", "backslashreplace").rstrip("\n")
                if line.strip():
                    level, message, fields = record_of(line)
                    log.log(level, message, extra=fields)

    def stop(self) -> None:
        """fd 2 is the original stream again; lines already written are logged first."""
        if self._saved is None:
            return
        os.dup2(self._saved, 2)   # closes the pipe's only write end: the reader sees its end
        os.close(self._saved)
        self._saved = None
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT)


_installed: NativeStderr | None = None


def capture() -> None:
    """Once per process: fd 2's lines go into the log from now on."""
    global _installed
    if _installed is None:
        _installed = NativeStderr()
        _installed.start()


def release() -> None:
    """fd 2 is the original stream again (before an exec: the pipe's reader does not survive it)."""
    global _installed
    if _installed is not None:
        _installed.stop()
        _installed = None
