"""Allocation records have one deleter: vgpu_runtime.allocation.end_allocation. The programs that
end allocations ask it, and nothing else in the product removes a record or a channel directory
(three writers used to, each in its own order). Read from the source with ast,
as tests/test_layering.py reads imports.

That every case still deletes, through it, is shown where each case is tested:
- the device plugin, the records of an Allocate that failed part-way:
  tests/plugin/test_allocator.py::test_a_failed_allocate_of_several_containers_leaves_nothing
- gemini-run, as its command ends and for dead owners: tests/run/test_run.py
  (test_runs_the_command_with_its_allocation_and_cleans_up,
  test_stale_record_of_a_dead_owner_is_cleaned_by_the_next_run)
- the daemon, an ended pod's: tests/daemon/test_allocations.py (test_collect_*) and the pod
  watch's collection through the whole node in tests/daemon/test_pods.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.test_layering import PRODUCT, REPO, python_files

OWNER = ("vgpu_runtime/allocation.py", "end_allocation")
# What removes a record or a channel directory, besides end_allocation itself.
DELETERS = {"remove_record", "remove_channel_dir", "_remove_channel_dir"}
# Who asks the owner: one per program that ends allocations.
ASKERS = {
    ("device_plugin/allocator.py", "allocate_all"),
    ("vgpu_runtime/run.py", "clean_stale"),
    ("vgpu_runtime/run.py", "run"),
    ("vgpu_runtime/daemon/allocations.py", "collect"),
}


def calls(rel: str, source: str, names: set[str]) -> Iterator[tuple[str, str]]:
    """(file, enclosing function) of each call to a function of `names`, by name or attribute."""
    def walk(node: ast.AST, function: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, child.name)
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in names:
                    yield rel, function
            yield from walk(child, function)
    yield from walk(ast.parse(source), "<module>")


def product_sources() -> Iterator[tuple[str, str]]:
    for folder in PRODUCT:
        for path in python_files(REPO / folder):
            yield str(path.relative_to(REPO)), path.read_text()


def deleters_outside_the_owner(sources: Iterator[tuple[str, str]]) -> set[tuple[str, str]]:
    found = {site for rel, source in sources for site in calls(rel, source, DELETERS)}
    found.discard(OWNER)
    # remove_channel_dir is remove_tree_in's checked wrapper; it may call its own helper.
    found.discard(("vgpu_runtime/allocation.py", "remove_channel_dir"))
    return found


def test_only_end_allocation_deletes_records_and_channel_directories() -> None:
    stray = deleters_outside_the_owner(product_sources())
    assert not stray, f"these delete allocation files themselves; ask end_allocation: {stray}"


def test_the_programs_that_end_allocations_ask_the_owner() -> None:
    asking = {site for rel, source in product_sources()
              for site in calls(rel, source, {"end_allocation"})}
    assert asking == ASKERS


def test_the_check_sees_a_planted_deleter() -> None:
    rel = "device_plugin/allocator.py"
    source = (REPO / rel).read_text()
    planted = source + "\n\ndef undo(state_dir, i):\n    allocation.remove_record(state_dir, i)\n"
    assert deleters_outside_the_owner(iter([(rel, source)])) == set()
    assert deleters_outside_the_owner(iter([(rel, planted)])) == {(rel, "undo")}
    assert Path(REPO / OWNER[0]).is_file()
