"""Fixtures for the fault scenarios: a whole node of real processes.

The kubelet emulator and the real plugin come from the integration suite (`node`), the fake
libcuda and the strict hook from the hook suite (`hooked`); this file re-exports them and adds
the node daemon on the plugin's own state directory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.daemon.helpers import DaemonProcess
from tests.hook.conftest import fake_dir, hook_lib, hooked  # noqa: F401 (fixtures)
from tests.integration.conftest import PluginNode, node  # noqa: F401 (fixture)


@pytest.fixture
def daemon(node: PluginNode) -> Iterator[DaemonProcess]:  # noqa: F811
    """gemini-daemon serving the records the plugin writes (no PodResources binding)."""
    node.state_dir.mkdir(parents=True, exist_ok=True)
    proc = DaemonProcess(node.state_dir).wait_ready()
    yield proc
    if proc.proc.poll() is None:
        assert proc.stop() == 0, proc.logs()
