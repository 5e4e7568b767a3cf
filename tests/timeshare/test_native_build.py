"""The native scheduler builds with gcc alone, reproducibly, exports only its API, needs no
glibc newer than 2.17, and never rewrites a library file in place."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.librarybuild import build_in, copy_build_base
from vgpu_runtime import __version__
from vgpu_runtime.daemon.channel import nativetokens
from vgpu_runtime.timeshare import nativepolicy
from vgpu_runtime.timeshare.native import build

REPO = Path(__file__).resolve().parents[2]
OLDEST_GLIBC = (2, 17)


def checkout(root: Path) -> Path:
    """The scheduler's sources, the version file and the shared build recipe, as another
    checkout would hold them."""
    package = root / "vgpu_runtime"
    shutil.copytree(REPO / "vgpu_runtime" / "timeshare" / "native",
                    package / "timeshare" / "native", ignore=shutil.ignore_patterns("__pycache__"))
    # The daemon's token code, built into the same library, and the wire header it includes.
    shutil.copytree(REPO / "vgpu_runtime" / "daemon" / "channel" / "native",
                    package / "daemon" / "channel" / "native",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (package / "hook" / "include").mkdir(parents=True)
    shutil.copy2(REPO / "vgpu_runtime" / "hook" / "include" / "gemini_wire.h",
                 package / "hook" / "include" / "gemini_wire.h")
    copy_build_base(package)
    return package / "timeshare" / "native" / "build.py"


def test_two_checkouts_build_identical_bytes_under_the_versioned_name(tmp_path: Path) -> None:
    first = build_in(checkout(tmp_path / "a"), tmp_path / "out-a", tmp_path)
    second = build_in(checkout(tmp_path / "a-longer-directory" / "b"), tmp_path / "out-b",
                      tmp_path)
    assert first.name == second.name == build.library_name()
    assert first.name == f"libgemini-timeshare.so.{__version__}-{build.sources_digest()}"
    data = first.read_bytes()
    assert data == second.read_bytes()
    assert str(tmp_path).encode() not in data


def test_a_changed_source_or_flag_gives_a_new_name(tmp_path: Path) -> None:
    script = checkout(tmp_path / "changed")
    source = script.parent / "scheduler.c"
    source.write_text(source.read_text() + "\n/* a change */\n")
    changed = build_in(script, tmp_path / "out", tmp_path)
    assert changed.name != build.library_name()
    script.write_text(script.read_text().replace('"-O2"', '"-O1"'))
    flagged = build_in(script, tmp_path / "out", tmp_path)
    assert flagged.name not in (changed.name, build.library_name())
    # And the build machinery it shares with the hook's.
    recipe = script.parents[2] / "common" / "cbuild.py"
    recipe.write_text(recipe.read_text() + "\n# a change\n")
    assert build_in(script, tmp_path / "out", tmp_path).name not in (
        flagged.name, changed.name, build.library_name())


def test_only_the_api_is_exported_and_glibc_2_17_is_enough() -> None:
    library = nativepolicy.library_path()
    tool = shutil.which("objdump")
    if tool is None:
        pytest.skip("objdump is not installed (binutils)")
    table = subprocess.run([tool, "-T", str(library)], capture_output=True, text=True,
                           check=True).stdout
    defined = {row.split()[-1] for row in table.splitlines() if re.search(r"\.text\s", row)}
    declared = set(re.findall(r"\b(ts_[a-z_]+)\(", nativepolicy._cdef_text()))
    declared |= set(re.findall(r"\b(td_[a-z_]+)\(", nativetokens._cdef_text()))
    assert defined == declared
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)", table)}
    assert versions and max(versions) <= OLDEST_GLIBC, versions


def test_a_rebuild_keeps_the_file_and_a_different_one_is_replaced_by_rename(
        tmp_path: Path) -> None:
    built = build.build_library(tmp_path, strict=True)
    inode = os.stat(built).st_ino
    assert build.build_library(tmp_path, strict=True) == built
    assert os.stat(built).st_ino == inode              # same bytes: left alone
    built.chmod(0o644)
    built.write_bytes(b"an older build that a running daemon has mapped")
    older = os.stat(built).st_ino
    with built.open("rb") as mapped:
        again = build.build_library(tmp_path, strict=True)
        assert again == built and os.stat(again).st_ino != older   # a new inode
        assert mapped.read() == b"an older build that a running daemon has mapped"
    assert again.read_bytes().startswith(b"\x7fELF")


SANITIZED_RUN = """
import sys
import pytest
from vgpu_runtime.timeshare import nativepolicy
nativepolicy._lib = nativepolicy.ffi.dlopen(sys.argv[1])
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", "-k", "not max_tenants",
                      "tests/timeshare/test_native_equal.py"]))
"""


def test_the_equality_tests_pass_under_address_and_undefined_sanitizers(tmp_path: Path) -> None:
    # The rings and the handle table are index arithmetic: ASan and UBSan check every access
    # of the equality test's sequences (an out-of-bounds slot or an overflow aborts the run).
    runtimes = [subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                               text=True, check=True).stdout.strip()
                for name in ("libasan.so", "libubsan.so")]
    if not all(os.path.isabs(path) for path in runtimes):
        pytest.skip(f"gcc has no sanitizer runtimes here: {runtimes}")
    library = tmp_path / "libgemini-timeshare-sanitized.so"
    command = build.compile_command(library, strict=True)
    command[1:1] = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer"]
    subprocess.run(command, check=True, capture_output=True)
    env = {**os.environ, "LD_PRELOAD": ":".join(runtimes), "ASAN_OPTIONS": "detect_leaks=0"}
    proc = subprocess.run([sys.executable, "-c", SANITIZED_RUN, str(library)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def test_the_benchmark_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench-timeshare"), "--runs",
                           "1", "--rounds", "400", "--json", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report) == {f"{case}, {impl}" for case in ("handoff", "alone")
                           for impl in ("python", "native", "c")}
    assert all(figures["samples"] > 0 and figures["p50_us"] > 0 for figures in report.values())
