"""Module images for the hook's tests: PTX text, a 64-bit ELF cubin and a fatbin around one,
built byte by byte (no CUDA toolkit), with global variables of a chosen size."""

from __future__ import annotations

import struct


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


def cubin(global_bytes: int) -> bytes:
    """An ELF64 relocatable image whose `.nv.global` section (NOBITS, as nvcc makes it) takes
    `global_bytes`; no other content the hook reads."""
    names = b"\0.shstrtab\0.nv.global\0.text.k\0"
    sections = [  # (name offset, type, flags, offset, size)
        (0, 0, 0, 0, 0),
        (1, 3, 0, 64, len(names)),                 # .shstrtab
        (11, 8, 3, 0, global_bytes),               # .nv.global: SHT_NOBITS, WA
        (22, 1, 6, 64 + len(names), 16),           # .text.k
    ]
    body = names + b"\0" * 16
    shoff = 64 + len(body)
    shoff += -shoff % 8
    header = b"\x7fELF" + bytes([2, 1, 1, 0x33, 7]) + b"\0" * 7
    header += struct.pack("<HHIQQQIHHHHHH", 1, 190, 1, 0, 0, shoff, 0x5a055a, 64, 0, 0, 64,
                          len(sections), 1)
    image = header + body
    image += b"\0" * (shoff - len(image))
    for name, kind, flags, offset, size in sections:
        image += struct.pack("<IIQQQQIIQQ", name, kind, flags, 0, offset, size, 0, 0, 8, 0)
    return image


def fatbin(*entries: tuple[int, bytes, int]) -> bytes:
    """A fatbin container (magic 0xBA55ED50) of (kind, payload, flags) entries: kind 1 PTX,
    2 ELF; flag 0x2000 marks a compressed payload."""
    body = b""
    for kind, payload, flags in entries:
        payload += b"\0" * (-len(payload) % 8)
        entry = struct.pack("<HHIQIIHHIIIQQQ", kind, 0x101, 64, len(payload), 0, 0, 0, 8, 90,
                            0, 0, flags, 0, 0)
        body += entry + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
