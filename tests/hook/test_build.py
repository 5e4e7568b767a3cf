"""The interposer builds with gcc alone, under its versioned name, and loads on glibc 2.17+."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.librarybuild import build_in, copy_build_base
from vgpu_runtime import __version__, hooklib
from vgpu_runtime.hook import build

REPO = Path(__file__).resolve().parents[2]

OLDEST_GLIBC = (2, 17)


def test_library_has_the_versioned_name(hook_lib: Path) -> None:
    assert hook_lib.name == hooklib.library_name()
    assert build.library_name() == hooklib.library_name()
    digest = build.sources_digest()
    assert f"libgemini-hook.so.{__version__}-{digest}" == hooklib.library_name()
    assert hooklib.library_name().startswith(hooklib.LIBRARY_PREFIX)


def checkout(root: Path) -> Path:
    """A copy of the package as another checkout would hold it: the hook, the version file and
    the shared build recipe."""
    package = root / "vgpu_runtime"
    shutil.copytree(REPO / "vgpu_runtime" / "hook", package / "hook",
                    ignore=shutil.ignore_patterns("__pycache__"))
    copy_build_base(package)
    return package / "hook" / "build.py"


@pytest.mark.slow   # builds the hook from a fresh checkout, as the image build does
def test_two_checkouts_of_the_same_sources_build_identical_bytes(tmp_path: Path) -> None:
    """No build path, timestamp or debug info in the library: a rebuilt image of unchanged
    sources carries the very file a node already has under that name."""
    first = build_in(checkout(tmp_path / "a"), tmp_path / "out-a", tmp_path)
    second = build_in(checkout(tmp_path / "a-much-longer-directory" / "b"), tmp_path / "out-b",
                      tmp_path / "a-much-longer-directory")
    assert first.name == second.name == hooklib.library_name()
    data = first.read_bytes()
    assert data == second.read_bytes()
    assert str(tmp_path).encode() not in data
    sections = subprocess.run(["readelf", "-S", "-W", str(first)], capture_output=True,
                              text=True, check=True).stdout
    assert ".debug_" not in sections and ".note.gnu.build-id" in sections


@pytest.mark.slow   # builds the hook from a fresh checkout, as the image build does
def test_a_changed_source_gives_a_new_name(tmp_path: Path) -> None:
    script = checkout(tmp_path / "changed")
    gate = script.parent / "launch" / "gate.c"
    gate.write_text(gate.read_text() + "\n/* a change */\n")
    changed = build_in(script, tmp_path / "out", tmp_path)
    assert changed.name != hooklib.library_name()
    assert changed.name.startswith(f"{hooklib.LIBRARY_PREFIX}{__version__}-")
    # Flags live in build.py, which the digest covers too.
    script.write_text(script.read_text().replace('"-O2"', '"-O1"'))
    flagged = build_in(script, tmp_path / "out", tmp_path)
    assert flagged.name not in (changed.name, hooklib.library_name())
    # And the build machinery it shares with the native scheduler's.
    recipe = script.parents[1] / "common" / "cbuild.py"
    recipe.write_text(recipe.read_text() + "\n# a change\n")
    assert build_in(script, tmp_path / "out", tmp_path).name not in (
        flagged.name, changed.name, hooklib.library_name())


def required_glibc_versions(library: Path) -> set[tuple[int, ...]]:
    tool = shutil.which("objdump")
    if tool is None:
        pytest.skip("objdump is not installed")
    out = subprocess.run([tool, "-T", str(library)], capture_output=True, text=True,
                         check=True).stdout
    return {tuple(int(p) for p in m.split(".")) for m in re.findall(r"GLIBC_([0-9.]+)", out)}


def test_no_glibc_version_newer_than_2_17_is_required(hook_lib: Path) -> None:
    versions = required_glibc_versions(hook_lib)
    assert versions, "objdump found no GLIBC versions at all: the check would be vacuous"
    too_new = sorted(v for v in versions if v > OLDEST_GLIBC)
    assert not too_new, f"requires GLIBC {too_new}; CUDA 11 images ship glibc 2.31"


def test_dlsym_and_dlopen_are_bound_to_their_old_versions(hook_lib: Path) -> None:
    out = subprocess.run(["objdump", "-T", str(hook_lib)], capture_output=True, text=True).stdout
    for name in ("dlopen", "dlvsym", "pthread_once"):
        line = next(row for row in out.splitlines() if row.endswith(f" {name}"))
        assert "GLIBC_2.34" not in line and "GLIBC_2." in line, line
    # dlsym itself is defined (exported) by the hook, not imported.
    assert re.search(r"\.text.*\sdlsym$", out, re.M)


def test_the_check_catches_a_new_symbol_version(tmp_path: Path) -> None:
    """Proof the version test can fail: an unpinned dlsym caller requires GLIBC_2.34 here."""
    src = tmp_path / "unpinned.c"
    src.write_text('#include <dlfcn.h>\nvoid *f(void *h) { return dlsym(h, "x"); }\n')
    lib = tmp_path / "unpinned.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(lib), "-ldl"], check=True)
    version = os.confstr("CS_GNU_LIBC_VERSION") or "glibc 0.0"
    if tuple(int(p) for p in version.split()[1].split(".")[:2]) < (2, 34):
        pytest.skip("this machine's glibc predates 2.34")
    assert max(required_glibc_versions(lib)) >= (2, 34)


def test_rebuild_with_same_sources_keeps_the_file(hook_lib: Path) -> None:
    inode = os.stat(hook_lib).st_ino
    again = build.build_library(hook_lib.parent, strict=True)
    assert again == hook_lib and os.stat(again).st_ino == inode


def test_different_content_replaces_by_rename_never_in_place(tmp_path: Path) -> None:
    target = tmp_path / hooklib.library_name()
    target.write_bytes(b"an older build that a running program has mapped")
    with open(target, "rb") as mapped:
        built = build.build_library(tmp_path)
        assert mapped.read() == b"an older build that a running program has mapped"
    assert built.read_bytes().startswith(b"\x7fELF")
    assert not list(tmp_path.glob(".*.tmp")), "temporary files left behind"


def test_compiler_missing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(build.HookBuildError, match="C compiler"):
        build.build_library(tmp_path, compiler="no-such-gcc")
    assert not list(tmp_path.iterdir())


def test_hooklib_builds_into_a_cache_keyed_by_the_sources(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(hooklib, "installed_library", lambda: None)
    first = hooklib.library_path()
    assert first.is_file() and build.sources_digest() in first.parts
    assert hooklib.library_path() == first


def test_the_tests_read_the_stats_struct_as_c_lays_it_out(tmp_path: Path) -> None:
    """tests/hook/cudaprobe.py builds its ctypes struct from the header's counter list."""
    import ctypes

    from tests.hook.cudaprobe import COUNTERS, HookStats

    include = Path(build.__file__).parent / "include"
    lines = [f'printf("{name} %zu\\n", offsetof(struct gemini_hook_stats, {name}));'
             for name, _ in HookStats._fields_]
    source = tmp_path / "layout.c"
    source.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "gemini_hook.h"\n'
                      "int main(void) {\n" + "\n".join(lines)
                      + '\nprintf("size %zu\\n", sizeof(struct gemini_hook_stats));\n'
                      "return 0;\n}\n")
    subprocess.run(["gcc", "-I", str(include), "-o", str(tmp_path / "layout"), str(source)],
                   check=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True)
    c_layout = dict(line.split() for line in out.stdout.splitlines())
    assert len(COUNTERS) >= 16
    for name, _ in HookStats._fields_:
        assert int(c_layout[name]) == getattr(HookStats, name).offset, name
    assert int(c_layout["size"]) == ctypes.sizeof(HookStats)


# The hook's families, lowest first: each may call the ones before it, never one after it
# (vgpu_runtime/hook/README.md, "Layout").
FAMILY_ORDER = ("core", "channel", "memory", "launch", "nvml")


def compiled_objects(out: Path) -> dict[Path, str]:
    """Every source compiled on its own, as the library's build compiles it: object -> family."""
    objects: dict[Path, str] = {}
    include = build.HOOK_DIR / "include"
    for source in build.source_files():
        family = source.parent.name
        obj = out / family / source.with_suffix(".o").name
        obj.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", *build.CFLAGS, *build.include_flags(),
                        f"-include{include / 'glibc_compat.h'}", "-c", str(source), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        objects[obj] = family
    return objects


def symbols(obj: Path, *flags: str) -> set[str]:
    out = subprocess.run(["nm", *flags, str(obj)], check=True, capture_output=True,
                         text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("gm_")}


@pytest.mark.slow   # compiles every object of the hook, as the image build does
def test_the_families_depend_one_way(tmp_path: Path) -> None:
    """The channel once called up into launch/ and memory/ (pages, fork resets, what is held),
    and token.c back into the channel: now news goes up only through the lifecycle. Checked on
    the compiled objects, so every call counts, whatever the headers declare."""
    objects = compiled_objects(tmp_path)
    assert set(objects.values()) == set(FAMILY_ORDER)
    defined_in = {name: objects[obj] for obj in objects
                  for name in symbols(obj, "--defined-only", "--extern-only")}
    upward = sorted(
        f"{obj.parent.name}/{obj.stem}.c calls {name} ({defined_in[name]})"
        for obj, family in objects.items() for name in symbols(obj, "--undefined-only")
        if name in defined_in and defined_in[name] != family
        and FAMILY_ORDER.index(defined_in[name]) > FAMILY_ORDER.index(family))
    assert upward == []
    unresolved = {name for obj in objects for name in symbols(obj, "--undefined-only")
                  if name not in defined_in}
    assert unresolved == set()                                 # every gm_ call was seen


def test_the_package_step_writes_the_name_the_installed_code_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py's step writes the library and its name once; an installed package (a lib/ with
    that file) reads the name there and never asks the build for a digest."""
    library = build.build_into_package(tmp_path / "lib")
    assert (tmp_path / "lib" / build.NAME_FILE).read_text() == f"{library.name}\n"
    monkeypatch.setattr(hooklib, "PACKAGE_LIB_DIR", tmp_path / "lib")
    monkeypatch.setattr(build, "sources_digest", lambda: pytest.fail("the build was asked"))
    hooklib.library_name.cache_clear()
    try:
        assert hooklib.library_name() == library.name
        assert hooklib.installed_library() == library
    finally:
        hooklib.library_name.cache_clear()


def test_a_name_file_naming_no_interposer_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / build.NAME_FILE).write_text("../../etc/passwd\n")
    monkeypatch.setattr(hooklib, "PACKAGE_LIB_DIR", tmp_path)
    hooklib.library_name.cache_clear()
    try:
        with pytest.raises(hooklib.LibraryNameError, match="not an interposer"):
            hooklib.library_name()
    finally:
        hooklib.library_name.cache_clear()
