"""The hook <-> daemon wire protocol, read through cffi from its one C declaration.

vgpu_runtime/hook/include/gemini_wire.h declares every frame; this module parses the part of it
between GM_CDEF_BEGIN and GM_CDEF_END and offers encode and decode on top. No layout or constant
is written here a second time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cffi

HEADER_PATH = Path(__file__).parent / "hook" / "include" / "gemini_wire.h"


def _cdef_text() -> str:
    text = HEADER_PATH.read_text()
    begin, end = "/* GM_CDEF_BEGIN */", "/* GM_CDEF_END */"
    return text[text.index(begin) + len(begin):text.index(end)]


ffi = cffi.FFI()
ffi.cdef(_cdef_text())
# ABI mode on the running process: nothing is compiled, the constants come from the cdef.
_consts: Any = ffi.dlopen(None)


def const(name: str) -> int:
    value: int = getattr(_consts, name)
    return value


VERSION = const("GM_WIRE_VERSION")
MAX_FRAME = const("GM_MAX_FRAME")
MAX_GPUS = const("GM_MAX_GPUS")
PPM = const("GM_PPM")
HEADER_SIZE: int = ffi.sizeof("struct gm_header")

# Frame type -> the struct it must carry, with its exact size.
STRUCT_OF_TYPE: dict[int, str] = {
    const("GM_MSG_HELLO"): "struct gm_hello",
    const("GM_MSG_HELLO_REPLY"): "struct gm_hello_reply",
    const("GM_MSG_MEM_RESERVE"): "struct gm_mem_request",
    const("GM_MSG_MEM_RELEASE"): "struct gm_mem_request",
    const("GM_MSG_MEM_SET"): "struct gm_mem_request",
    const("GM_MSG_MEM_REPLY"): "struct gm_mem_reply",
    const("GM_MSG_ERROR"): "struct gm_error",
    const("GM_MSG_TOKEN_REQUEST"): "struct gm_token_request",
    const("GM_MSG_TOKEN_GRANT"): "struct gm_token_grant",
    const("GM_MSG_TOKEN_RELEASE"): "struct gm_token_release",
    const("GM_MSG_USAGE_REPORT"): "struct gm_usage_report",
}


class MalformedFrame(ValueError):
    """The bytes are not a valid frame of this protocol version; the reason says why."""


def new(msg_type: int, seq: int = 0, **fields: Any) -> Any:
    """A zeroed frame of `msg_type` with its header filled in and the given fields set."""
    struct = STRUCT_OF_TYPE[msg_type]
    frame = ffi.new(struct + " *")
    frame.h.length = ffi.sizeof(struct)
    frame.h.type = msg_type
    frame.h.version = VERSION
    frame.h.seq = seq
    for name, value in fields.items():
        setattr(frame, name, value)
    return frame


def encode(frame: Any) -> bytes:
    return bytes(ffi.buffer(frame))


def parse_header(data: bytes) -> Any:
    """Validate a frame header; returns the cffi header. Checks length against the type."""
    if len(data) < HEADER_SIZE:
        raise MalformedFrame(f"short header: {len(data)} of {HEADER_SIZE} bytes")
    header = ffi.new("struct gm_header *")
    ffi.memmove(header, data[:HEADER_SIZE], HEADER_SIZE)
    if header.version != VERSION:
        raise MalformedFrame(f"protocol version {header.version}, this daemon speaks {VERSION}")
    struct = STRUCT_OF_TYPE.get(header.type)
    if struct is None:
        raise MalformedFrame(f"unknown frame type {header.type}")
    if header.length != ffi.sizeof(struct):
        raise MalformedFrame(
            f"frame type {header.type} must be {ffi.sizeof(struct)} bytes, "
            f"header says {header.length}"
        )
    if header.reserved != 0:
        raise MalformedFrame("reserved header field is not zero")
    return header


def decode(data: bytes) -> Any:
    """A whole frame (header included) as its cffi struct; raises MalformedFrame."""
    header = parse_header(data)
    if len(data) != header.length:
        raise MalformedFrame(f"frame is {len(data)} bytes, header says {header.length}")
    frame = ffi.new(STRUCT_OF_TYPE[header.type] + " *")
    ffi.memmove(frame, data, header.length)
    return frame


def frame_type(frame: Any) -> int:
    result: int = frame.h.type
    return result


def text_field(value: Any) -> str:
    """A NUL-padded char array as str."""
    raw: bytes = ffi.string(value)
    return raw.decode("utf-8", "replace")
