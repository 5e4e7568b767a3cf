"""Byte sizes as people write them: 8GiB, 512Mi, 1.5G, 1048576. One grammar, wherever a size
is read (flags, annotations, files); GPU fractions (0.3 or 30%) are contracts/share.py's."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "ki": 1 << 10, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mi": 1 << 20, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gi": 1 << 30, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size; raises ValueError with the accepted forms on bad input."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as 8GiB, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"expected a size such as 8GiB, 512MiB, 2G or a number of bytes, got {text!r}"
        )
    try:
        # Exact arithmetic: a float overflows to infinity on long digit strings (fuzzing).
        return int(Fraction(match.group(1)) * _UNITS[unit])
    except ValueError:  # more digits than Python converts
        raise ValueError(f"size {text!r} has too many digits") from None


def format_size(n: int) -> str:
    """Render bytes in the largest binary unit that keeps one decimal honest."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def exact_size(n: int) -> str:
    """Render bytes exactly, in a form parse_size reads back: 2GiB, 64KiB, 141GB, 1000."""
    for units in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10),
                  ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        unit, scale = units
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)

