"""Passing failures, logged once while they last: the daemon retries them at every poll, and a
line per poll would bury the one that matters."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Troubles:
    """What failed and was logged, by key (what failed), with its error."""

    def __init__(self) -> None:
        self._errors: dict[str, str] = {}

    def report(self, message: str, key: str, err: Exception) -> None:
        """Log `message` unless the same error of `key` was the last one logged."""
        if self._errors.get(key) != str(err):
            self._errors[key] = str(err)
            log.error(message, extra={"what": key, "error": str(err)})

    def clear(self, key: str) -> None:
        """`key` works again: its next failure is logged."""
        self._errors.pop(key, None)

    def __bool__(self) -> bool:
        return bool(self._errors)
