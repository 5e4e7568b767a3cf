"""Module images for the hook's tests: PTX text, a 64-bit ELF cubin and a fatbin around one,
built byte by byte (no CUDA toolkit), with global variables of a chosen size."""

from __future__ import annotations

import struct
from pathlib import Path


def ptx(*globals_: tuple[str, str, int]) -> bytes:
    """PTX with module-scope `.global` arrays (name, type, count), an `.extern` one that takes
    nothing, and a kernel whose body reads global memory (`ld.global`, no declaration)."""
    lines = [".version 8.0", ".target sm_90", ".address_size 64", "",
             ".extern .global .align 4 .b8 elsewhere[1073741824];"]
    lines += [f".visible .global .align 8 {kind} {name}[{count}];"
              for name, kind, count in globals_]
    lines += ["", "// .global .b8 commented_out[1073741824];",
              ".visible .entry k(.param .u64 .ptr.global.align 4 p)", "{",
              "  .reg .b32 %r<2>;", "  ld.global.u32 %r1, [p];", "  ret;", "}", ""]
    return "\n".join(lines).encode() + b"\0"


REAL_CUBIN = Path(__file__).resolve().parent / "data" / "global-4gib-sm90.cubin"
# nvFatbin 12.9 (the nvidia-nvfatbin-cu12 wheel, nvFatbinAddCubin of REAL_CUBIN as arch 90,
# name "big"): its default compression (-compress-all: LZ4, entry flag 0x2000) and
# -compress-mode=size (zstd, flag 0x8000).
REAL_LZ4_FATBIN = REAL_CUBIN.with_name("global-4gib-sm90.lz4.fatbin")
REAL_ZSTD_FATBIN = REAL_CUBIN.with_name("global-4gib-sm90.zstd.fatbin")


def cubin(global_bytes: int, in_symbol: bool = True) -> bytes:
    """An ELF64 image as ptxas makes one: an empty `.nv.global` section (NOBITS) and the
    variable's size in its OBJECT symbol (`in_symbol`), or the size in the section itself."""
    names = b"\0.shstrtab\0.nv.global\0.text.k\0.symtab\0.strtab\0"
    strings = b"\0big\0"
    symbols = bytes(24) + struct.pack("<IBBHQQ", 1, 0x11, 0, 2, 0,   # GLOBAL OBJECT in [2]
                                      global_bytes if in_symbol else 0)
    at_names = 64
    at_text = at_names + len(names)
    at_strings = at_text + 16
    at_symbols = at_strings + len(strings)
    at_symbols += -at_symbols % 8
    sections = [  # (name offset, type, flags, offset, size, link, entsize)
        (0, 0, 0, 0, 0, 0, 0),
        (1, 3, 0, at_names, len(names), 0, 0),                             # .shstrtab
        (11, 8, 3, at_text, 0 if in_symbol else global_bytes, 0, 0),       # .nv.global, WA
        (22, 1, 6, at_text, 16, 0, 0),                                     # .text.k
        (30, 2, 0, at_symbols, len(symbols), 5, 24),                       # .symtab
        (38, 3, 0, at_strings, len(strings), 0, 0),                        # .strtab
    ]
    body = names + b"\0" * 16 + strings
    body += b"\0" * (at_symbols - 64 - len(body)) + symbols
    shoff = 64 + len(body)
    shoff += -shoff % 8
    header = b"\x7fELF" + bytes([2, 1, 1, 0x33, 7]) + b"\0" * 7
    header += struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0x5a055a, 64, 0, 0, 64,
                          len(sections), 1)
    image = header + body
    image += b"\0" * (shoff - len(image))
    for name, kind, flags, offset, size, link, entsize in sections:
        image += struct.pack("<IIQQQQIIQQ", name, kind, flags, 0, offset, size, link, 0, 8,
                             entsize)
    return image


def fatbin(*entries: tuple[int, bytes, int]) -> bytes:
    """A fatbin container (magic 0xBA55ED50) of (kind, payload, flags) entries: kind 1 PTX,
    2 ELF; flag 0x2000 marks an LZ4 payload (this builder leaves its packed size 0)."""
    body = b""
    for kind, payload, flags in entries:
        payload += b"\0" * (-len(payload) % 8)
        entry = struct.pack("<HHIQIIHHIIIQQQ", kind, 0x101, 64, len(payload), 0, 0, 0, 8, 90,
                            0, 0, flags, 0, 0)
        body += entry + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
