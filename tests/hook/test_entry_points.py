"""The table of driver entry points (vgpu_runtime/hook/ENTRY_POINTS.md) against the cuda.h
headers' lists of names (vgpu_runtime/hook/cuda_api/cuda-*.txt) and hooks.def: a name a CUDA
release adds, a row without a name, a hook without a row fail here."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from vgpu_runtime.hook.cuda_api import CLASSES, HERE, declared_names, header_lists, table_rows

HOOKS_DEF = HERE.parent / "hooks.def"


def hooked_symbols() -> set[str]:
    return set(re.findall(r"^GM_HOOK\((cu\w+),", HOOKS_DEF.read_text(), re.M))


def test_the_lists_come_from_cuda_12_and_13_headers() -> None:
    lists = header_lists()
    assert any(name.startswith("cuda-12.") for name in lists)
    assert any(name.startswith("cuda-13.") for name in lists)
    for name, names in lists.items():
        head = (HERE / name).read_text().splitlines()[:4]
        assert head[0].startswith("# CUDA ") and head[1].startswith("# source: ")
        assert re.fullmatch(r"# sha256: [0-9a-f]{64}", head[2]), name
        assert len(names) > 400 and names == sorted(set(names)), name
        assert {"cuMemAlloc", "cuLaunchKernel", "cuCtxSetLimit", "cuModuleLoadData"} <= set(names)


def test_every_declared_entry_point_has_one_row_and_every_row_a_declared_name() -> None:
    rows = table_rows()
    declared = set().union(*header_lists().values())
    missing = sorted(declared - rows.keys())
    assert not missing, f"entry points without a row in ENTRY_POINTS.md: {missing}"
    stale = sorted(rows.keys() - declared)
    assert not stale, f"rows for names no header declares: {stale}"


def test_every_row_has_a_class_and_a_reason() -> None:
    for name, (kind, why) in table_rows().items():
        assert kind in CLASSES, f"{name}: class {kind!r}"
        assert why and why.strip() != "?", f"{name}: no reason"


def test_hooked_rows_and_hooks_def_agree() -> None:
    hooks = hooked_symbols()
    named: set[str] = set()
    for name, (kind, why) in table_rows().items():
        if kind != "hooked":
            assert "hooked as" not in why, f"{name} says hooked but is {kind}"
            continue
        symbols = set(re.findall(r"`(cu\w+)`", why.split(":")[0]))
        assert symbols, f"{name}: a hooked row names its hooks.def rows"
        assert symbols <= hooks, f"{name}: not in hooks.def: {sorted(symbols - hooks)}"
        assert all(s == name or s.startswith(name + "_") for s in symbols), name
        named |= symbols
    # Every hook is some declared entry point's (cuGetProcAddress included).
    assert hooks - named == set(), f"hooks.def rows no table row names: {sorted(hooks - named)}"


def test_the_attacks_of_issue_28_are_hooked() -> None:
    rows = table_rows()
    for name in ("cuCtxSetLimit", "cuModuleLoad", "cuModuleLoadData", "cuModuleLoadDataEx",
                 "cuModuleLoadFatBinary", "cuLibraryLoadData", "cuLibraryLoadFromFile",
                 "cuGraphInstantiate", "cuGraphInstantiateWithFlags", "cuGraphUpload", "cuLaunch",
                 "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunchCooperativeKernelMultiDevice"):
        assert rows[name][0] == "hooked", name
    assert rows["cuGraphAddMemAllocNode"][0] == "covered"
    assert rows["cuLinkComplete"][0] == "covered"


def local_headers() -> list[Path]:
    """A CUDA toolkit's or a pip-installed wheel's cuda.h on this machine, if any."""
    found = []
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include/cuda.h").is_file():
            found.append(Path(root) / "include/cuda.h")
    try:
        import nvidia  # type: ignore[import-not-found]
        for base in getattr(nvidia, "__path__", []):
            found += sorted(Path(base).glob("*/include/cuda.h"))
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("header", local_headers() or [None], ids=str)
def test_a_local_cuda_header_has_no_entry_point_the_table_lacks(header: Path | None) -> None:
    if header is None:
        pytest.skip("no cuda.h on this machine (CI has none: the committed lists stand in)")
    missing = sorted(set(declared_names(header.read_text(errors="replace"))) - table_rows().keys())
    assert not missing, f"{header} declares entry points without a row: {missing}"
