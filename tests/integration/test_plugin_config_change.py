"""The plugin as a process, reading the node's file: a change of another program's section or
an invalid file leaves it serving; a change of its own settings restarts it in place (the same
process, registered again) with the new file."""

from __future__ import annotations

from tests.integration.conftest import START_TIMEOUT, PluginNode
from vgpu_runtime.devkit.podnode import until

NODE_FILE = """\
version: v1
node:
  slices_per_gpu: 10
devicePlugin:
  placement: best-fit
scheduler:
  limit_policy: work-conserving
"""


async def test_the_plugin_restarts_for_its_own_changed_settings_only(node: PluginNode) -> None:
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
    await until(lambda: node.kubelet.registrations == 2, START_TIMEOUT, "a new registration")
    await node.wait_registered(20)
    assert not plugin.exited()
    assert "restarting with it" in plugin.log_text()
    assert "placement" in plugin.log_text().split("restarting with it")[1].splitlines()[0]
    # It places as the new file says: spread puts the second pod on the other GPU, where
    # best-fit would have packed both on one.
    first = await node.kubelet.admit_pod("first", containers=[("main", 3)])
    second = await node.kubelet.admit_pod("second", containers=[("main", 3)])
    assert len({d.split("::")[0] for d in first.device_ids() | second.device_ids()}) == 2
    assert await plugin.stop() == 0
