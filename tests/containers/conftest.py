"""One container node per module: starting it (hook build, plugin, daemon) costs seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.containers.node import ContainerNode, node_on_fake_api


@pytest.fixture(scope="module")
def container_node() -> Iterator[ContainerNode]:
    with node_on_fake_api() as node:
        yield node
