"""One container node per module: starting it (hook build, plugin, daemon) costs seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.containers.node import ContainerNode, start_node, stop_node
from vgpu_runtime.devkit.kubelet_emulator.runtime import runc_refusal


@pytest.fixture(scope="module")
def container_node() -> Iterator[ContainerNode]:
    reason = runc_refusal()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("kubernetes", reason="the fake API server uses the official client")
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

    with FakeApiServer() as api:
        api.add_node("node-1")
        node = start_node(api)
        try:
            yield node
        finally:
            stop_node(node)
