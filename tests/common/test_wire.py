"""The wire protocol as Python sees it through cffi, checked against the C compiler's view."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_runtime.contracts import wire


def test_round_trip_of_every_frame_type() -> None:
    for msg_type in wire.STRUCT_OF_TYPE:
        frame = wire.new(msg_type, seq=42)
        decoded = wire.decode(wire.encode(frame))
        assert wire.frame_type(decoded) == msg_type and decoded.h.seq == 42


@given(st.binary(max_size=700))
def test_random_bytes_are_malformed_or_a_valid_frame(data: bytes) -> None:
    try:
        frame = wire.decode(data)
    except wire.MalformedFrame:
        return
    assert wire.encode(frame) == data


def test_each_defect_has_its_own_reason() -> None:
    good = wire.encode(wire.new(wire.const("GM_MSG_HELLO"), proto_version=wire.VERSION))
    cases = {
        "short header": good[:8],
        "protocol version": good[:6] + b"\x09\x00" + good[8:],
        "unknown frame type": good[:4] + b"\x63\x00" + good[6:],
        "must be 32 bytes": b"\x40\x00\x00\x00" + good[4:],
        "reserved": good[:12] + b"\x01\x00\x00\x00" + good[16:],
        "frame is 31 bytes": good[:-1],
    }
    for reason, data in cases.items():
        with pytest.raises(wire.MalformedFrame, match=reason):
            wire.decode(data)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_c_and_python_agree_on_every_layout(tmp_path: Path) -> None:
    older = {s for structs in wire.OLDER_STRUCTS.values() for s in structs.values()}
    structs = sorted(set(wire.STRUCT_OF_TYPE.values()) | older | {"struct gm_header"})
    lines = [f'printf("%s %zu\\n", "{s}", sizeof({s}));' for s in structs]
    source = tmp_path / "sizes.c"
    source.write_text(
        f'#include <stdio.h>\n#include "{wire.HEADER_PATH}"\nint main(void) {{\n'
        + "\n".join(lines) + "\nreturn 0;\n}\n"
    )
    subprocess.run(["gcc", "-o", str(tmp_path / "sizes"), str(source)], check=True)
    out = subprocess.run([str(tmp_path / "sizes")], check=True, capture_output=True, text=True)
    sizes = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines())
    assert sorted(sizes) == structs, out.stdout   # every layout printed: none passes unchecked
    for name, size in sizes.items():
        assert wire.ffi.sizeof(name) == int(size), name


# ---- the daemon's fast path: struct layouts derived from the cdef, one header check per frame


def _cffi_value(frame: Any, dotted: str) -> Any:
    value = frame
    for part in dotted.split("."):
        value = getattr(value, part)
    if isinstance(value, wire.ffi.CData):   # a byte array: its raw bytes, NULs included
        return bytes(wire.ffi.buffer(value))
    return value


FLAT_TYPES = sorted(t for t in wire.STRUCT_OF_TYPE if t != wire.const("GM_MSG_HELLO_REPLY"))


@given(st.sampled_from(FLAT_TYPES), st.data())
def test_flat_layouts_read_every_field_where_cffi_does(msg_type: int, data: st.DataObject) -> None:
    cdecl = wire.STRUCT_OF_TYPE[msg_type]
    raw = data.draw(st.binary(min_size=wire.ffi.sizeof(cdecl), max_size=wire.ffi.sizeof(cdecl)))
    layout, names = wire.flat_layout(cdecl)
    frame = wire.ffi.new(cdecl + " *")
    wire.ffi.memmove(frame, raw, len(raw))
    assert list(layout.unpack(raw)) == [_cffi_value(frame, name) for name in names]


def test_packer_builds_the_frame_cffi_builds() -> None:
    for msg_type in FLAT_TYPES:
        packer = wire.Packer(msg_type)
        frame = wire.new(msg_type, seq=77)
        body = []
        for index, name in enumerate(packer.fields):
            value: Any = b"why" if name == "reason" else (index + 1) << (8 * index % 24)
            setattr(frame, name, value)
            body.append(value)
        assert packer.pack(77, *body) == wire.encode(frame), wire.STRUCT_OF_TYPE[msg_type]


def test_a_struct_with_an_array_of_structs_has_no_packer() -> None:
    with pytest.raises(TypeError, match="no flat struct layout"):
        wire.Packer(wire.const("GM_MSG_HELLO_REPLY"))


@given(st.binary(min_size=0, max_size=40))
def test_check_header_agrees_with_parse_header(data: bytes) -> None:
    try:
        header = wire.parse_header(data)
    except wire.MalformedFrame as err:
        with pytest.raises(wire.MalformedFrame) as caught:
            wire.check_header(data)
        assert str(caught.value) == str(err)
        assert isinstance(caught.value, wire.WrongVersion) == ("protocol version" in str(err))
        return
    assert wire.check_header(data) == (header.length, header.type, header.seq)


def test_check_header_at_an_offset_and_view_in_place() -> None:
    frames = [wire.encode(wire.new(wire.const("GM_MSG_TOKEN_REQUEST"), seq=5, gpu=1,
                                   burst_ns=-1, work_end_ns=123)),
              wire.encode(wire.new(wire.const("GM_MSG_MEM_SET"), seq=6, gpu=2, kind=7, bytes=9))]
    stream = b"".join(frames)
    length, msg_type, seq = wire.check_header(stream, len(frames[0]))
    assert (length, msg_type, seq) == (len(frames[1]), wire.const("GM_MSG_MEM_SET"), 6)
    with pytest.raises(wire.MalformedFrame, match="short header: 4 of 16 bytes"):
        wire.check_header(stream, len(stream) - 4)
    view = wire.view(msg_type, frames[1])
    assert (view.h.seq, view.gpu, view.kind, view.bytes) == (6, 2, 7, 9)
    token = wire.view(wire.const("GM_MSG_TOKEN_REQUEST"), frames[0])
    assert (token.burst_ns, token.work_end_ns) == (-1, 123)


def test_the_channels_place_and_socket_name_are_defined_once() -> None:
    """The hook finds its channel where Allocate mounts it, and the daemon's socket by the name
    the daemon binds: both are defined in the wire header, which paths.py reads; no hook source
    spells either again."""
    from vgpu_runtime.contracts import paths

    header = wire.HEADER_PATH.read_text()
    assert f'#define GM_POD_CHANNEL_DIR "{paths.CONTAINER_CHANNEL_DIR}"' in header
    assert f'#define GM_CHANNEL_SOCKET_NAME "{paths.CHANNEL_SOCKET_NAME}"' in header
    hook = wire.HEADER_PATH.parents[1]
    for source in [*hook.rglob("*.c"), *hook.rglob("*.h")]:
        if source != wire.HEADER_PATH:
            text = source.read_text()
            for literal in (f'"{paths.CHANNEL_SOCKET_NAME}"', f'/{paths.CHANNEL_SOCKET_NAME}"',
                            f'"{paths.CONTAINER_CHANNEL_DIR}"'):
                assert literal not in text, f"{source.name} spells {literal} again"
