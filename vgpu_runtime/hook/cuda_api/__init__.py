"""The CUDA driver API's entry points, as cuda.h headers declare them (generated lists in this
directory, one per CUDA release: scripts/cuda-entry-points), and the hook's table of those
that allocate device memory or run device work (../ENTRY_POINTS.md)."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE.parent / "ENTRY_POINTS.md"
CLASSES = ("hooked", "covered", "unhooked", "none")

_DECLARATION = re.compile(r"\bCUresult\s+CUDAAPI\s+(cu\w+)\s*\(")
# `#define cuName cuName_v2` and `#define cuName __CUDA_API_PTSZ(cuName_v2)`: the symbols the
# library exports under a declared name (with per-thread default streams: _ptds, _ptsz).
_VERSIONED = re.compile(r"^\s*#\s*define\s+cu\w+\s+(cu\w+)\s*$", re.M)
_PER_THREAD = re.compile(r"^\s*#\s*define\s+cu\w+\s+__CUDA_API_(PTDS|PTSZ)\((cu\w+)\)", re.M)
_ROW = re.compile(r"^\|\s*`(cu\w+)`\s*\|\s*(\w+)\s*\|(.*)\|\s*$")


def declared_names(header: str) -> list[str]:
    """Every function a cuda.h declares, and every symbol its macros turn a declared name into
    (versions, per-thread default stream variants); sorted, without duplicates."""
    names = set(_DECLARATION.findall(header)) | set(_VERSIONED.findall(header))
    names |= {f"{name}_{kind.lower()}" for kind, name in _PER_THREAD.findall(header)}
    return sorted(names)


def header_lists() -> dict[str, list[str]]:
    """Committed lists: file name -> names."""
    return {path.name: [line for line in path.read_text().splitlines()
                        if line and not line.startswith("#")]
            for path in sorted(HERE.glob("cuda-*.txt"))}


def table_rows(text: str | None = None) -> dict[str, tuple[str, str]]:
    """ENTRY_POINTS.md's rows: name -> (class, the rest of the row). Raises ValueError on a
    row named twice."""
    rows: dict[str, tuple[str, str]] = {}
    for line in (TABLE.read_text() if text is None else text).splitlines():
        match = _ROW.match(line)
        if match is None:
            continue
        name, kind, rest = match.groups()
        if name in rows:
            raise ValueError(f"{name} has two rows")
        rows[name] = (kind, rest.strip())
    return rows
