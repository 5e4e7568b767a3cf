"""Packages depend one way: kubelet → plugin → record → daemon ↔ hook, never back; the kit
(vgpu_runtime/devkit) serves scripts/ and tests/, and scripts/ never import tests/.

Every import in the product (vgpu_runtime, device_plugin) and in scripts/ is read with ast, lazy
ones inside functions and importlib.import_module("...") literals included, and checked against
the layers below. A new package under vgpu_runtime must be given a layer here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A unit of vgpu_runtime (its first two name parts) may import units of its own layer or lower.
LAYERS: dict[str, int] = {
    # The base: the package's version, shared helpers, the contracts between the node's programs
    # (contracts/README.md: names, files, the wire, shares, records), the interposer's build
    # recipe and its name (hooklib: every program's --version says it).
    "vgpu_runtime": 0,
    "vgpu_runtime.common": 0,
    "vgpu_runtime.contracts": 0,
    "vgpu_runtime.hook": 0,
    "vgpu_runtime.hooklib": 0,
    # What the node has.
    "vgpu_runtime.gpus": 1,
    "vgpu_runtime.kubeletapi": 1,
    # Whose a machine is (the host daemon's mark) and whose daemon serves each GPU.
    "vgpu_runtime.hoststate": 1,
    "vgpu_runtime.gpulock": 1,
    # The plugin's section of the node configuration file: the config manager checks it too.
    "vgpu_runtime.pluginconfig": 1,
    # The time-sharing algorithm, pure.
    "vgpu_runtime.timeshare": 2,
    # The node daemon.
    "vgpu_runtime.daemon": 3,
    # Programs built on the daemon.
    "vgpu_runtime.run": 4,
    "vgpu_runtime.cli": 4,
    "vgpu_runtime.install": 4,
    "vgpu_runtime.hostctl": 4,
    "vgpu_runtime.configmanager": 4,
    "vgpu_runtime.uninstall": 4,
    "vgpu_runtime.mpscontrol": 4,
    # The development kit (demo, benchmarks, tests): it may use anything, nothing uses it.
    "vgpu_runtime.devkit": 5,
}
# Rule: the contracts name what the build made, never build it: they import neither of these.
CONTRACTS = "vgpu_runtime.contracts"
CONTRACTS_NEVER_IMPORT = ("vgpu_runtime.hook", "vgpu_runtime.hooklib")
# The plugin sits beside the daemon, joined to it only by the allocation record: it may import
# the base (the contracts with it) and what the node has, nothing above them.
PLUGIN_MAY_IMPORT_UP_TO = 1
PRODUCT = ("vgpu_runtime", "device_plugin")
NOT_PRODUCT = ("tests", "scripts")


def python_files(folder: Path) -> Iterator[Path]:
    """The .py files, and the extensionless programs whose first line names python."""
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or "kubeletapi" in path.parts:
            continue
        first_line = path.read_bytes()[:64].split(b"\n")[0]
        if path.suffix == ".py" or (not path.suffix and b"python" in first_line):
            yield path


def imported_modules(source: str) -> Iterator[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def layer(module: str) -> int | None:
    """The layer of a vgpu_runtime module; None for a name not in the package (an attribute)."""
    name = unit(module)
    if name in LAYERS:
        return LAYERS[name]
    if (REPO / name.replace(".", "/")).exists() or (REPO / f"{name.replace('.', '/')}.py").exists():
        raise AssertionError(f"{name} has no layer in tests/test_layering.py: give it one")
    return None


def violations(rel: Path, source: str) -> Iterator[str]:
    """The imports of the file at rel (relative to the repository) that go the wrong way."""
    own = ".".join(rel.with_suffix("").parts) if rel.suffix == ".py" else str(rel)
    top = rel.parts[0]
    seen: set[str] = set()
    for module in sorted(set(imported_modules(source)), key=len):
        # One line per imported unit: "from a.b import c" also yields a.b.c.
        if unit(module) in seen:
            continue
        seen.add(unit(module))
        target = module.split(".")[0]
        if target in NOT_PRODUCT and top in PRODUCT:
            yield f"{rel} imports {module}: the product never imports {target}/"
        elif target == "tests" and top == "scripts":
            yield f"{rel} imports {module}: scripts use the kit (vgpu_runtime/devkit), not tests/"
        elif target == "device_plugin" and top == "vgpu_runtime":
            yield f"{rel} imports {module}: vgpu_runtime never imports the device plugin"
        elif unit(own) == CONTRACTS and unit(module) in CONTRACTS_NEVER_IMPORT:
            yield (f"{rel} imports {module}: a contract never imports the hook's build "
                   "(the interposer's name is hooklib.library_name())")
        elif target == "vgpu_runtime" and top == "vgpu_runtime":
            mine, theirs = layer(own), layer(module)
            if mine is not None and theirs is not None and theirs > mine:
                yield (f"{rel} imports {module}: layer {theirs} ({unit(module)}) is above "
                       f"layer {mine} ({unit(own)})")
        elif target == "vgpu_runtime" and top == "device_plugin":
            theirs = layer(module)
            if theirs is not None and theirs > PLUGIN_MAY_IMPORT_UP_TO:
                yield (f"{rel} imports {module}: the plugin reaches the daemon only through the "
                       "allocation record")


def checked_files() -> list[Path]:
    return [p for folder in (*PRODUCT, "scripts") for p in python_files(REPO / folder)]


def test_every_layer_names_a_real_unit() -> None:
    for name in LAYERS:
        path = REPO / name.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"{name} does not exist"


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_go_one_way(path: Path) -> None:
    found = list(violations(path.relative_to(REPO), path.read_text()))
    assert not found, "\n".join(found)


def test_the_check_sees_a_planted_bad_import() -> None:
    """The checker itself: each kind of bad import, planted in a real module's text."""
    planted = {
        "vgpu_runtime/contracts/allocation.py": "from vgpu_runtime.daemon import daemon\n",
        "vgpu_runtime/contracts/paths.py": "from vgpu_runtime.hook import build\n",
        "vgpu_runtime/contracts/wire.py": "def f():\n    from vgpu_runtime import hooklib\n",
        "vgpu_runtime/timeshare/window.py": "import device_plugin.server\n",
        "vgpu_runtime/common/sizes.py": "def f():\n    from tests.childenv import child_env\n",
        "device_plugin/slices.py": ("import importlib\n"
                                    "importlib.import_module('vgpu_runtime.daemon.main')\n"),
        "vgpu_runtime/run.py": "from vgpu_runtime.devkit.fakecuda import builder\n",
        "scripts/bench-gate": "from tests.hook.conftest import compile_program\n",
    }
    for rel, line in planted.items():
        source = (REPO / rel).read_text()
        assert not list(violations(Path(rel), source)), rel
        assert list(violations(Path(rel), source + "\n" + line)), (
            f"a planted {line.strip()!r} in {rel} went unseen")


def test_the_contracts_load_without_the_hooks_build() -> None:
    """What they import in turn counts too: loading every contract leaves the build unloaded,
    so no program hashes the hook's sources for a name it could read."""
    contracts = sorted(module_name(p) for p in (REPO / "vgpu_runtime" / "contracts").glob("*.py"))
    assert len(contracts) >= 7
    probe = ("import sys\n" + "".join(f"import {name}\n" for name in contracts)
             + "print(sorted(m for m in sys.modules if m.startswith(('vgpu_runtime.hook', "
             "'vgpu_runtime.hooklib'))))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_shell_scripts_run_no_test_module() -> None:
    python = set(python_files(REPO / "scripts"))
    for path in sorted((REPO / "scripts").iterdir()):
        if path.is_file() and path not in python and path.read_bytes().startswith(b"#!"):
            assert not re.search(r"-m\s+tests\.", path.read_text()), (
                f"{path.relative_to(REPO)} runs a module of tests/")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def file_cycles(sources: dict[str, str], packages: frozenset[str] = frozenset()) -> list[
        list[str]]:
    """Modules (name -> source) that import each other, directly or round a circle, imports
    under TYPE_CHECKING included: each such circle is a seam in the wrong place. An import of
    a package (its __init__, which may gather its modules' names) is not an edge."""
    return circles({name: {t for t in imported_modules(source) if t in sources and t != name
                           and t not in packages} for name, source in sources.items()})


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node: files depending on each
    other, directly or round a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(name: str) -> None:   # Tarjan's strongly connected components
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph[name]):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            circle = []
            while True:
                member = stack.pop()
                circle.append(member)
                if member == name:
                    break
            if len(circle) > 1:
                circles.append(sorted(circle))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return circles


def product_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for folder in PRODUCT
            for p in python_files(REPO / folder) if p.suffix == ".py"
            and "kubeletapi" not in p.parts}


def product_packages() -> frozenset[str]:
    return frozenset(module_name(p) for folder in PRODUCT
                     for p in (REPO / folder).rglob("__init__.py"))


def test_no_files_import_each_other() -> None:
    assert file_cycles(product_sources(), product_packages()) == []


def test_the_circle_check_sees_a_planted_back_import() -> None:
    sources = product_sources()
    back = "vgpu_runtime.daemon.channel.tokens"
    sources["vgpu_runtime.daemon.channel.pages"] += (
        "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        f"    from {back} import GpuTokens\n")
    assert ["vgpu_runtime.daemon.channel.pages", back] in file_cycles(sources,
                                                                      product_packages())


def hook_call_graph(out: Path) -> dict[str, set[str]]:
    """Which of the interposer's C files calls or reads what another defines: each source
    compiled alone with the build's flags, its defined and undefined symbols read by nm."""
    from vgpu_runtime.hook import build

    include = build.HOOK_DIR / "include"
    defined: dict[str, str] = {}
    wanted: dict[str, set[str]] = {}
    for source in build.source_files():
        name = f"{source.parent.name}/{source.name}"
        obj = out / name.replace("/", "_").replace(".c", ".o")
        subprocess.run(["gcc", "-c", *build.CFLAGS, *build.include_flags(),
                        f"-include{include / 'glibc_compat.h'}", str(source), "-o", str(obj)],
                       check=True, cwd=build.HOOK_DIR)
        symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True,
                                 check=True).stdout.splitlines()
        wanted[name] = set()
        for line in symbols:
            fields = line.split()
            if len(fields) == 3 and fields[1] in "TDBR":
                defined[fields[2]] = name
            elif len(fields) == 2 and fields[0] == "U":
                wanted[name].add(fields[1])
    return {name: {defined[s] for s in symbols if s in defined and defined[s] != name}
            for name, symbols in wanted.items()}


def test_no_hook_files_call_each_other(tmp_path: Path) -> None:
    """The interposer's files call one way: the dlsym override and the table above the
    wrappers, the wrappers above the channel, the real functions and the switches."""
    graph = hook_call_graph(tmp_path)
    assert len(graph) > 20 and sum(map(len, graph.values())) > 40   # the graph is read at all
    assert circles(graph) == []
    # The check sees circles planted in it: token.c calling back into gate.c, and the
    # switches (init.c) calling up into the table.
    pair = {name: set(targets) for name, targets in graph.items()}
    pair["launch/token.c"].add("launch/gate.c")
    assert circles(pair) == [["launch/gate.c", "launch/token.c"]]
    longer = {name: set(targets) for name, targets in graph.items()}
    longer["core/init.c"].add("core/table.c")
    (circle,) = circles(longer)
    assert {"core/init.c", "core/table.c", "core/real.c"} <= set(circle)
