"""The hook <-> daemon wire protocol, read through cffi from its one C declaration.

vgpu_runtime/contracts/gemini_wire.h declares every frame; this module parses the part of it
between GM_CDEF_BEGIN and GM_CDEF_END and offers encode and decode on top. No layout or constant
is written here a second time.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import cffi

from vgpu_runtime.contracts.share import Share

HEADER_PATH = Path(__file__).parent / "gemini_wire.h"


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
VERSION_MIN = const("GM_WIRE_VERSION_MIN")
SUPPORTED_VERSIONS = frozenset(range(VERSION_MIN, VERSION + 1))
MAX_FRAME = const("GM_MAX_FRAME")
MAX_GPUS = const("GM_MAX_GPUS")
PPM = const("GM_PPM")
HEADER_SIZE: int = ffi.sizeof("struct gm_header")


def share_ppm(share: Share) -> int:
    """A share as the hello carries it: parts per million, exact, half a part to even, and
    never 0 (a share below half a part still gets its turn)."""
    return max(1, min(PPM, round(share.value * PPM)))

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


class WrongVersion(MalformedFrame):
    """A MalformedFrame whose header carries another protocol version."""


# ---- struct formats derived from the cdef: the daemon's hot path packs and parses frames with
# `struct` (one C call) instead of a cffi allocation plus a copy per frame. The formats come from
# ffi.offsetof/ffi.sizeof of the one C declaration, never written by hand.

def _primitive_code(ctype: Any) -> str:
    size = ffi.sizeof(ctype)
    signed = ffi.cast(ctype, -1) < 0
    code = {1: "b", 2: "h", 4: "i", 8: "q"}[size]
    return code if signed else code.upper()


def _flat_fields(ctype: Any, prefix: str = "", base: int = 0) -> list[tuple[str, int, str]]:
    """(dotted name, offset, struct code) of every field of a struct, nested structs flattened;
    char and uint8_t arrays become byte strings. Arrays of anything else have no flat layout."""
    fields: list[tuple[str, int, str]] = []
    for name, field in ctype.fields:
        offset, ftype = base + field.offset, field.type
        if ftype.kind == "struct":
            fields += _flat_fields(ftype, f"{prefix}{name}.", offset)
        elif ftype.kind == "primitive":
            fields.append((prefix + name, offset, _primitive_code(ftype)))
        elif ftype.kind == "array" and ffi.sizeof(ftype.item) == 1:
            fields.append((prefix + name, offset, f"{ftype.length}s"))
        else:
            raise TypeError(f"{ctype.cname}.{prefix}{name} has no flat struct layout")
    return fields


def flat_layout(cdecl: str) -> tuple[struct.Struct, tuple[str, ...]]:
    """A `struct.Struct` with the exact layout of C struct `cdecl` (host byte order, padding as
    the compiler lays it out) and the dotted names of the values it packs, in order."""
    fmt, position = "=", 0
    fields = _flat_fields(ffi.typeof(cdecl))
    for _name, offset, code in fields:
        if offset > position:
            fmt += f"{offset - position}x"
        fmt += code
        position = offset + struct.calcsize("=" + code)
    size = ffi.sizeof(cdecl)
    if size > position:
        fmt += f"{size - position}x"
    layout = struct.Struct(fmt)
    if layout.size != size:
        raise AssertionError(f"{cdecl}: struct format {fmt} is {layout.size} bytes, C says {size}")
    return layout, tuple(name for name, _offset, _code in fields)


HEADER, HEADER_FIELDS = flat_layout("struct gm_header")
_LENGTH, _TYPE = HEADER_FIELDS.index("length"), HEADER_FIELDS.index("type")
_VERSION, _SEQ = HEADER_FIELDS.index("version"), HEADER_FIELDS.index("seq")
_RESERVED = HEADER_FIELDS.index("reserved")
SIZE_OF_TYPE: dict[int, int] = {t: ffi.sizeof(s) for t, s in STRUCT_OF_TYPE.items()}
# What differs in older versions, which the daemon still serves: only the hello reply (see
# gemini_wire.h). A version missing here lays every frame out as STRUCT_OF_TYPE does.
OLDER_STRUCTS: dict[int, dict[int, str]] = {
    1: {const("GM_MSG_HELLO_REPLY"): "struct gm_hello_reply_v1"},
    2: {const("GM_MSG_HELLO_REPLY"): "struct gm_hello_reply_v2"},
}
# Per version served: frame type -> its exact size (one lookup per frame on the hot path).
SIZE_IN_VERSION: dict[int, dict[int, int]] = {
    v: {**SIZE_OF_TYPE, **{t: ffi.sizeof(s) for t, s in OLDER_STRUCTS.get(v, {}).items()}}
    for v in SUPPORTED_VERSIONS}
_POINTER_OF_TYPE: dict[int, Any] = {t: ffi.typeof(s + " *") for t, s in STRUCT_OF_TYPE.items()}


def struct_of(msg_type: int, version: int = VERSION) -> str:
    """The C struct a frame of `msg_type` carries in protocol `version`."""
    return OLDER_STRUCTS.get(version, {}).get(msg_type) or STRUCT_OF_TYPE[msg_type]


def check_header(data: bytes, offset: int = 0,
                 versions: frozenset[int] = frozenset((VERSION,))) -> tuple[int, int, int]:
    """Validate the header at `offset` once; returns (length, type, seq). The frame's body need
    not be there yet. Frames from hook to daemon have the same layout in every version in
    `versions`. Raises MalformedFrame (WrongVersion for a protocol version not in `versions`)."""
    if len(data) - offset < HEADER_SIZE:
        raise MalformedFrame(f"short header: {max(0, len(data) - offset)} of {HEADER_SIZE} bytes")
    header = HEADER.unpack_from(data, offset)
    version, msg_type, length = header[_VERSION], header[_TYPE], header[_LENGTH]
    if version not in versions:
        raise WrongVersion(f"protocol version {version}, this daemon speaks "
                           f"{' or '.join(map(str, sorted(versions)))}")
    size = SIZE_IN_VERSION.get(version, SIZE_OF_TYPE).get(msg_type)
    if size is None:
        raise MalformedFrame(f"unknown frame type {msg_type}")
    if length != size:
        raise MalformedFrame(f"frame type {msg_type} must be {size} bytes, header says {length}")
    if header[_RESERVED] != 0:
        raise MalformedFrame("reserved header field is not zero")
    return length, msg_type, header[_SEQ]


def view(msg_type: int, frame: bytes) -> Any:
    """The cffi struct of a frame whose header check_header passed, reading `frame` in place
    (no copy; the cdata keeps `frame` alive). Read-only by intent."""
    return ffi.from_buffer(_POINTER_OF_TYPE[msg_type], frame)


class Packer:
    """Packs one frame type from its body values (the struct's fields after the header, in
    declaration order: `fields`) into bytes, with one struct.pack call."""

    def __init__(self, msg_type: int, version: int = VERSION) -> None:
        self.msg_type = msg_type
        cdecl = struct_of(msg_type, version)
        self.size = ffi.sizeof(cdecl)
        self._struct, names = flat_layout(cdecl)
        header_names = tuple("h." + name for name in HEADER_FIELDS)
        if names[:len(header_names)] != header_names:
            raise TypeError(f"{cdecl} does not start with its header")
        self.fields = names[len(header_names):]
        head = [0] * len(HEADER_FIELDS)
        head[_LENGTH], head[_TYPE], head[_VERSION] = self.size, msg_type, version
        self._before_seq, self._after_seq = tuple(head[:_SEQ]), tuple(head[_SEQ + 1:])

    def pack(self, seq: int, *body: Any) -> bytes:
        return self._struct.pack(*self._before_seq, seq, *self._after_seq, *body)


class Unpacker:
    """Reads one frame type (hook to daemon: the same layout in every version) with one
    struct.unpack_from call: its seq and its body values (the struct's fields after the header,
    in declaration order: `fields`). No cffi object per frame, for the token frames."""

    def __init__(self, msg_type: int) -> None:
        cdecl = STRUCT_OF_TYPE[msg_type]
        self._struct, names = flat_layout(cdecl)
        header_names = tuple("h." + name for name in HEADER_FIELDS)
        if names[:len(header_names)] != header_names:
            raise TypeError(f"{cdecl} does not start with its header")
        self.fields = names[len(header_names):]
        self._body = len(header_names)

    def unpack_from(self, data: bytes, offset: int = 0) -> tuple[int, tuple[Any, ...]]:
        """(seq, body values) of the frame at `offset`, whose header check_header passed."""
        values = self._struct.unpack_from(data, offset)
        return values[_SEQ], values[self._body:]


def new(msg_type: int, seq: int = 0, version: int = VERSION, **fields: Any) -> Any:
    """A zeroed frame of `msg_type` with its header filled in and the given fields set."""
    cdecl = struct_of(msg_type, version)
    frame = ffi.new(cdecl + " *")
    frame.h.length = ffi.sizeof(cdecl)
    frame.h.type = msg_type
    frame.h.version = version
    frame.h.seq = seq
    for name, value in fields.items():
        setattr(frame, name, value)
    return frame


def encode(frame: Any) -> bytes:
    return bytes(ffi.buffer(frame))


def parse_header(data: bytes, versions: frozenset[int] = frozenset((VERSION,))) -> Any:
    """Validate a frame header; returns the cffi header. Checks length against the type."""
    check_header(data, 0, versions)
    header = ffi.new("struct gm_header *")
    ffi.memmove(header, data[:HEADER_SIZE], HEADER_SIZE)
    return header


def decode(data: bytes, versions: frozenset[int] = frozenset((VERSION,))) -> Any:
    """A whole frame (header included) as its cffi struct; raises MalformedFrame."""
    length, msg_type, _seq = check_header(data, 0, versions)
    if len(data) != length:
        raise MalformedFrame(f"frame is {len(data)} bytes, header says {length}")
    version = HEADER.unpack_from(data)[_VERSION]
    frame = ffi.new(struct_of(msg_type, version) + " *")
    ffi.memmove(frame, data, length)
    return frame


def frame_type(frame: Any) -> int:
    result: int = frame.h.type
    return result


def text_field(value: Any) -> str:
    """A NUL-padded char array as str."""
    raw: bytes = ffi.string(value)
    return raw.decode("utf-8", "replace")
