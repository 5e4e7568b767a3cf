"""The formats of the plugin's node files, which the daemon reads (names in paths.py).

    health.json  {"GPU-...": {"healthy": true, "reason": ""}, ...}
    slices.json  {"GPU-...": {"advertised": 10, "configured": 4, "waiting_for": ["k-..."]}}

Each decoder raises ValueError on a file that is not of its format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuHealth:
    healthy: bool
    reason: str = ""


@dataclass(frozen=True)
class SliceCount:
    """A GPU keeps `advertised` slices until `waiting_for` (allocation ids) end, then takes
    `configured`."""
    advertised: int
    configured: int
    waiting_for: tuple[str, ...] = ()


def encode_health(health: Mapping[str, GpuHealth]) -> bytes:
    return json.dumps({uuid: {"healthy": h.healthy, "reason": h.reason}
                       for uuid, h in health.items()}, sort_keys=True).encode()


def decode_health(raw: bytes) -> dict[str, GpuHealth]:
    try:
        return {str(uuid): GpuHealth(bool(entry["healthy"]), str(entry.get("reason", "")))
                for uuid, entry in json.loads(raw).items()}
    except (TypeError, KeyError, AttributeError, RecursionError) as err:
        raise ValueError(f"not a health file: {err!r}") from None


def encode_slice_counts(counts: Mapping[str, SliceCount]) -> bytes:
    return json.dumps({uuid: {"advertised": c.advertised, "configured": c.configured,
                              "waiting_for": list(c.waiting_for)}
                       for uuid, c in counts.items()}, sort_keys=True).encode()


def decode_slice_counts(raw: bytes) -> dict[str, SliceCount]:
    try:
        return {str(uuid): SliceCount(int(entry["advertised"]), int(entry["configured"]),
                                      tuple(str(i) for i in entry.get("waiting_for", ())))
                for uuid, entry in json.loads(raw).items()}
    except (TypeError, KeyError, AttributeError, RecursionError) as err:
        raise ValueError(f"not a slice counts file: {err!r}") from None
