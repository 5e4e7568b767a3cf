"""The hook's LZ4 block decoder (vgpu_runtime/hook/memory/lz4.c), alone, under ASan and UBSan:
nvFatbin's real block decodes to ptxas's cubin byte for byte, a block that does not fit is
refused, and 200,000 mutations of it (cut, extended, bytes flipped, any output size) never read
or write out of bounds. Through the hook: tests/hook/test_driver_reservations.py."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tests.hook.images import REAL_CUBIN, REAL_LZ4_FATBIN
from vgpu_runtime.hook import build

HERE = Path(__file__).resolve().parent


def lz4_block(fatbin: bytes) -> bytes:
    """The first entry's packed bytes: its header's size at +4, packed size at +16."""
    entry = fatbin[16:]
    header, packed = struct.unpack_from("<I", entry, 4)[0], struct.unpack_from("<Q", entry, 16)[0]
    return entry[header:header + packed]


def test_the_decoder_holds_under_sanitizers(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing")
    program = tmp_path / "lz4_fuzz"
    subprocess.run(["gcc", "-O1", "-g", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", *build.include_flags(),
                    f"-I{build.HOOK_DIR / 'memory'}", str(HERE / "lz4_fuzz.c"),
                    str(build.HOOK_DIR / "memory" / "lz4.c"), "-o", str(program)],
                   check=True, capture_output=True)
    block = tmp_path / "block.lz4"
    block.write_bytes(lz4_block(REAL_LZ4_FATBIN.read_bytes()))
    done = subprocess.run([str(program), str(block), str(REAL_CUBIN), "200000"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    iterations, decoded = map(int, done.stdout.split())
    assert iterations == 200_000 and decoded > 0, done.stdout   # some mutants still decode
