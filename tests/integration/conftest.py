"""A node for each test: the kubelet emulator and the real plugin process (the kit's
PluginNode), in a temporary directory."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from vgpu_runtime.devkit.plugin_node import FAST_HEALTH, START_TIMEOUT, PluginNode, plugin_node

__all__ = ["FAST_HEALTH", "START_TIMEOUT", "PluginNode", "node"]


@pytest.fixture
async def node() -> AsyncIterator[PluginNode]:
    async with plugin_node() as started:
        yield started
