"""Shared pytest setup: GPU tests run only where a GPU answers; a module that imports a test
extra which is not installed (hypothesis) is skipped, saying which, instead of failing collection
(the GPU machine carries only what its tests need)."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests import sharedbuild

# Host-wide GPU locks (vgpu_runtime/gpulock.py) in a directory of this run's own, inherited by
# every process the tests start: runs beside each other (and real users' daemons) hold the same
# simulated GPUs' UUIDs, and must not refuse each other; nor need the machine have /run/lock.
# Each pytest-xdist worker is a run of its own: it replaces the directory the controller set
# (and passed down in the environment) with one of its own.
_LOCKS = tempfile.mkdtemp(prefix="gm-locks-")
os.chmod(_LOCKS, 0o1777)   # the shape of /run/lock: tests' other users lock here too
_INHERITED = os.environ.get("GEMINI_TEST_LOCKS")
if os.environ.get("GEMINI_GPU_LOCK_DIR", _INHERITED) == _INHERITED:
    os.environ["GEMINI_GPU_LOCK_DIR"] = os.environ["GEMINI_TEST_LOCKS"] = _LOCKS
atexit.register(shutil.rmtree, _LOCKS, True)
# The libraries every worker preloads are built once per run into one directory (tests/
# sharedbuild.py): made here by the controller (or the one process of a serial run), inherited by
# its workers, removed when the controller exits.
if not os.environ.get("PYTEST_XDIST_WORKER"):
    _BUILT = tempfile.mkdtemp(prefix="gm-built-")
    os.chmod(_BUILT, 0o755)   # other uids and containers read what is built there
    os.environ[sharedbuild.ROOT_VARIABLE] = _BUILT
    atexit.register(shutil.rmtree, _BUILT, True)
# No kubelet's PodResources unless a test gives one (--pod-resources-socket wins): on a machine
# with a real kubelet (the cluster lane's leaves its socket) every daemon the tests start would
# otherwise List it, find no pod, and make each kubelet record's hello wait its bind timeout
# (5 s). The cluster lane starts no daemon here: its DaemonSet sets this in its pod spec.
os.environ.setdefault("GEMINI_POD_RESOURCES_SOCKET", os.path.join(_LOCKS, "no-kubelet.sock"))

# Test extras that whole modules import at their top.
OPTIONAL_MODULES = ("hypothesis",)


@functools.cache
def gpu_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return bool(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_present():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class _MissingExtra(pytest.Module):
    missing = ""

    def collect(self) -> Any:
        pytest.skip(f"{self.missing} is not installed (a test extra: pip install -e '.[test]')",
                    allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    text = module_path.read_text(errors="replace")
    for name in OPTIONAL_MODULES:
        if (re.search(rf"^(from|import) {name}\b", text, re.M)
                and importlib.util.find_spec(name) is None):
            module = _MissingExtra.from_parent(parent, path=module_path)
            module.missing = name
            return module
    return None
