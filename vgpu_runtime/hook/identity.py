"""What identifies a built interposer file: size, sha256, ELF SONAME, build ID and compiler.

gemini-install-hook shows these for both files when it refuses to replace one, so an operator
sees at once whether the sources (SONAME, which carries their digest), the compiler or only
the bytes differ. Pure standard library; reads 64-bit little-endian ELF (x86-64, aarch64) and
reports what it cannot read as missing rather than failing.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

_SHT_NOTE = 7
_SHT_DYNAMIC = 6
_DT_SONAME = 14
_NT_GNU_BUILD_ID = 3


def _sections(data: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of each section; [] when data is not ELF64 LSB."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize != 64 or shoff + shnum * 64 > len(data) or shstrndx >= shnum:
        return []
    headers = [struct.unpack_from("<IIQQQQII", data, shoff + i * 64) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return data[start:data.index(b"\0", start)].decode(errors="replace")

    return [(name(h[0]), h[1], h[4], h[5], h[6]) for h in headers]


def _soname(data: bytes, sections: list[tuple[str, int, int, int, int]]) -> str | None:
    for _, kind, offset, size, link in sections:
        if kind != _SHT_DYNAMIC or link >= len(sections):
            continue
        strings_at = sections[link][2]
        for at in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == _DT_SONAME:
                start = strings_at + value
                return data[start:data.index(b"\0", start)].decode(errors="replace")
    return None


def _build_id(data: bytes, sections: list[tuple[str, int, int, int, int]]) -> str | None:
    for _, kind, offset, size, _link in sections:
        if kind != _SHT_NOTE or size < 12:
            continue
        namesz, descsz, note_type = struct.unpack_from("<III", data, offset)
        desc_at = offset + 12 + ((namesz + 3) & ~3)
        if note_type == _NT_GNU_BUILD_ID and desc_at + descsz <= offset + size:
            return data[desc_at:desc_at + descsz].hex()
    return None


def _compiler(data: bytes, sections: list[tuple[str, int, int, int, int]]) -> str | None:
    for name, _, offset, size, _link in sections:
        if name == ".comment":
            found = {s.decode(errors="replace") for s in data[offset:offset + size].split(b"\0")}
            return "; ".join(sorted(s for s in found if s)) or None
    return None


def describe(path: Path) -> dict[str, str]:
    """The identifying facts of one library file ("?" for what it does not carry)."""
    data = path.read_bytes()
    try:
        sections = _sections(data)
        soname, build_id, compiler = (_soname(data, sections), _build_id(data, sections),
                                      _compiler(data, sections))
    except (struct.error, ValueError, IndexError):   # a truncated or odd file: bytes only
        soname = build_id = compiler = None
    return {"size": str(len(data)), "sha256": hashlib.sha256(data).hexdigest()[:16],
            "soname": soname or "?", "build-id": build_id or "?", "compiler": compiler or "?"}


def differences(installed: Path, new: Path) -> str:
    """One line per fact that differs: `fact: installed X, new Y`."""
    old_facts, new_facts = describe(installed), describe(new)
    return "; ".join(f"{key}: installed {old_facts[key]}, new {new_facts[key]}"
                     for key in old_facts if old_facts[key] != new_facts[key])
