"""The wire protocol as Python sees it through cffi, checked against the C compiler's view."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu_runtime import wire


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
    structs = sorted(set(wire.STRUCT_OF_TYPE.values()) | {"struct gm_header"})
    lines = [f'printf("%s %zu\\n", "{s}", sizeof({s}));' for s in structs]
    source = tmp_path / "sizes.c"
    source.write_text(
        f'#include <stdio.h>\n#include "{wire.HEADER_PATH}"\nint main(void) {{\n'
        + "\n".join(lines) + "\nreturn 0;\n}\n"
    )
    subprocess.run(["gcc", "-o", str(tmp_path / "sizes"), str(source)], check=True)
    out = subprocess.run([str(tmp_path / "sizes")], check=True, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        name, size = line.rsplit(" ", 1)
        assert wire.ffi.sizeof(name) == int(size), name
