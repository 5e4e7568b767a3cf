"""The plugin as a process, reading the node's file: a change of another program's section or
an invalid file leaves it serving; a change of its own settings stops it cleanly (exit 0), for
kubelet to start it again with the file."""

from __future__ import annotations

from tests.integration.conftest import START_TIMEOUT, Node
from tests.scheduler.podnode import until

NODE_FILE = """\
version: v1
node:
  slices_per_gpu: 10
devicePlugin:
  placement: best-fit
scheduler:
  limit_policy: work-conserving
"""


async def test_the_plugin_stops_for_its_own_changed_settings_only(node: Node) -> None:
    config = node.root / "config.yaml"
    config.write_text(NODE_FILE)
    plugin = await node.start_plugin(args=["--config", str(config)])
    config.write_text(NODE_FILE.replace("work-conserving", "strict"))
    await until(lambda: "none of this program's settings did" in plugin.log_text(),
                START_TIMEOUT, "the plugin's check")
    config.write_text(NODE_FILE.replace("placement", "placment"))
    await until(lambda: "changed but is invalid" in plugin.log_text(), START_TIMEOUT,
                "the invalid file")
    assert not plugin.exited()
    assert node.kubelet.allocatable() == 20
    config.write_text(NODE_FILE.replace("best-fit", "spread"))
    await until(plugin.exited, START_TIMEOUT, "the plugin's exit")
    assert await plugin.stop() == 0
    assert "stopping so that the container restarts with it" in plugin.log_text()
    assert "placement" in plugin.log_text().split("stopping so that")[1].splitlines()[0]
