from __future__ import annotations

from pathlib import Path

import pytest

from vgpu_runtime import pluginconfig as plugin_config
from vgpu_runtime.contracts import paths
from vgpu_runtime.pluginconfig import ConfigError, PluginConfig


def test_defaults() -> None:
    config = plugin_config.load([], environ={})
    assert config.kubelet_dir == paths.DEFAULT_KUBELET_DIR
    assert config.state_dir == paths.DEFAULT_STATE_DIR
    assert (config.socket_name, config.resource_name) == ("gemini-vgpu.sock", "gemini.ai/vgpu")
    assert (config.slices_per_gpu, config.placement) == (10, "best-fit")
    assert config.ignored_xids == (13, 31, 43, 45, 68, 109)
    assert config.memory_reserve == 2 << 30
    assert config.device_list_strategy == "cdi" and config.cdi_kind == "nvidia.com/gpu"
    assert config.host_hook_dir == Path(paths.DEFAULT_STATE_DIR) / "lib"
    assert config.control_dir == Path(paths.DEFAULT_STATE_DIR) / "simulate"


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    file = tmp_path / "plugin.yaml"
    file.write_text("slices_per_gpu: 4\nplacement: spread\nmemory_reserve: 1GiB\n"
                    "ignored_xids: [13, 48]\n")
    env = {"GEMINI_CONFIG": str(file), "GEMINI_SLICES_PER_GPU": "6",
           "GEMINI_PLACEMENT": "best-fit"}
    config = plugin_config.load(["--slices-per-gpu", "8"], environ=env)
    assert config.slices_per_gpu == 8           # flag
    assert config.placement == "best-fit"       # env over file
    assert config.memory_reserve == 1 << 30     # file
    assert config.ignored_xids == (13, 48)
    assert plugin_config.load(["--config", str(file)], environ={}).slices_per_gpu == 4


@pytest.mark.parametrize(("argv", "env", "names"), [
    (["--slices-per-gpu", "zero"], {}, "--slices-per-gpu"),
    (["--slices-per-gpu", "0"], {}, "--slices-per-gpu"),
    ([], {"GEMINI_PLACEMENT": "random"}, "GEMINI_PLACEMENT"),
    (["--memory-reserve", "lots"], {}, "--memory-reserve"),
    (["--ignored-xids", "13,x"], {}, "--ignored-xids"),
    (["--device-list-strategy", "all"], {}, "--device-list-strategy"),
    (["--health-recheck-interval", "-1"], {}, "--health-recheck-interval"),
    (["--socket-name", "a/b.sock"], {}, "--socket-name"),
    (["--resource-name", "vgpu"], {}, "--resource-name"),
])
def test_malformed_values_name_the_field(argv: list[str], env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        plugin_config.load(argv, environ=env)


def test_malformed_file_value_names_key(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("simulate_memory: huge\n")
    with pytest.raises(ConfigError, match="key simulate_memory"):
        plugin_config.load(["--config", str(file)], environ={})
    file.write_text("slices: 3\n")
    with pytest.raises(ConfigError, match=r"unknown setting.*slices"):
        plugin_config.load(["--config", str(file)], environ={})


def test_state_dir_too_long_for_channel_sockets_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"state_dir.*107 bytes"):
        plugin_config.check(PluginConfig(state_dir="/" + "d" * 90))


def test_reserve_larger_than_simulated_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="memory_reserve"):
        plugin_config.load(["--simulate-gpus", "1", "--simulate-memory", "1GiB"], environ={})


# ---- the node's one file (version v1), read by both programs ----

NODE_FILE = """\
version: v1
node:
  slices_per_gpu: 4
  state_dir: /srv/gemini
devicePlugin:
  placement: spread
  memory_reserve: 1GiB
scheduler:
  limit_policy: strict
  window: 5.0
"""


def test_both_programs_read_one_node_file(tmp_path: Path) -> None:
    from vgpu_runtime.common import config as cfg
    from vgpu_runtime.daemon.config import DaemonConfig

    file = tmp_path / "config.yaml"
    file.write_text(NODE_FILE)
    plugin = plugin_config.load(["--config", str(file)], environ={})
    assert (plugin.slices_per_gpu, plugin.state_dir) == (4, "/srv/gemini")
    assert (plugin.placement, plugin.memory_reserve) == ("spread", 1 << 30)
    daemon = cfg.load(DaemonConfig, ["--config", str(file)], environ={})
    assert (daemon.slices_per_gpu, daemon.state_dir) == (4, "/srv/gemini")
    assert (daemon.limit_policy, daemon.window) == ("strict", 5.0)


def test_the_plugin_names_a_scheduler_key_put_in_its_section(tmp_path: Path) -> None:
    file = tmp_path / "config.yaml"
    file.write_text(NODE_FILE.replace("  placement: spread", "  limit_policy: strict"))
    with pytest.raises(ConfigError) as err:
        plugin_config.load(["--config", str(file)], environ={})
    assert f"{file}, section devicePlugin: unknown setting(s) limit_policy" in str(err.value)


def test_a_deprecated_flat_file_is_logged_once_by_the_running_program(tmp_path: Path) -> None:
    """The daemon, as a process, with its old flat file: it runs on those settings and logs
    one warning, in its JSON log, that says what to do."""
    import json
    import subprocess
    import sys

    from tests.childenv import REPO, child_env

    file = tmp_path / "scheduler.yaml"
    file.write_text("limit_policy: strict\nidle_exit: 0.3\n")
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state),
         "--metrics-port", "0", "--log-format", "json", "--config", str(file)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (done.stdout + done.stderr).splitlines()
             if line.startswith("{")]
    notes = [entry for entry in lines if "deprecated" in entry.get("msg", "")]
    assert len(notes) == 1, lines
    assert notes[0]["level"] == "warning" and str(file) in notes[0]["msg"]
