"""How many examples a property test draws: its own number in CI and the default lane, a third
of it (at least 10) in the developers' fast lane (scripts/test --fast sets GEMINI_TEST_FAST=1),
which trades depth for a lane of a few minutes."""

from __future__ import annotations

import os

FAST = os.environ.get("GEMINI_TEST_FAST") == "1"


def examples(count: int) -> int:
    return max(10, count // 3) if FAST else count
