"""Fixtures for the device plugin tests: short temp dirs (Unix socket paths), configs, GPUs."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from device_plugin.allocator import Allocator
from device_plugin.health import HealthTracker
from device_plugin.slices import SliceTable
from vgpu_runtime import pluginconfig as plugin_config
from vgpu_runtime.devkit.hookdir import install_hook
from vgpu_runtime.gpus import GpuInfo
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.pluginconfig import PluginConfig

GIB = 1 << 30
Make = Callable[..., tuple[Allocator, SliceTable, HealthTracker]]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A temp dir with a short path: Unix socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_config(short_dir: Path) -> Callable[..., PluginConfig]:
    def make(**overrides: Any) -> PluginConfig:
        (short_dir / "kubelet").mkdir(exist_ok=True)
        values: dict[str, Any] = {
            "kubelet_dir": str(short_dir / "kubelet"),
            "state_dir": str(short_dir / "state"),
            "simulate_gpus": 2,
            "simulate_memory": 100 * GIB,
            "memory_reserve": 2 * GIB,
            "slices_per_gpu": 10,
        }
        values.update(overrides)
        config = plugin_config.check(PluginConfig(**values))
        install_hook(config.host_hook_dir)   # as the node's install-hook step does
        return config
    return make


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend(2, memory=100 * GIB)


@pytest.fixture
def gpus(backend: SimulatedBackend) -> list[GpuInfo]:
    return backend.discover()


@pytest.fixture
def make(make_config: Callable[..., PluginConfig]) -> Make:
    def build(**overrides: object) -> tuple[Allocator, SliceTable, HealthTracker]:
        config = make_config(**overrides)
        gpus = SimulatedBackend(config.simulate_gpus, memory=config.simulate_memory).discover()
        table = SliceTable(gpus, config.slices_per_gpu)
        tracker = HealthTracker([g.uuid for g in gpus], config.ignored_xids, 300)
        return Allocator(config, table, tracker, clock=lambda: 1000.0), table, tracker
    return build
