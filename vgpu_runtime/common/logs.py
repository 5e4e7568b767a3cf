"""Structured logs: one JSON object per line (default) or `key=value` text for humans.

Fields go in `extra`: log.info("registered", extra={"resource": name, "endpoint": sock}).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        pairs = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        line = f"{line} {pairs}" if pairs else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: str = "info", fmt: str = "json", native_stderr: bool = False) -> None:
    """Configure the root logger once, for a program's main(). A daemon passes native_stderr:
    with JSON logs, what C libraries write to fd 2 is logged as JSON too (native_stderr.py).
    Never in a program whose children share its stderr (gemini-run)."""
    if native_stderr and fmt == "json":
        from vgpu_runtime.common import native_stderr as native

        native.capture()   # first: the handler below writes to the stream it keeps
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
