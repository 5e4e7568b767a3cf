"""gemini-config-manager, as a process, against the fake API server: a node's label chooses the
configuration written for the plugin and the daemon, and the daemon takes a changed file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.childenv import REPO, child_env
from tests.daemon.helpers import wait_for
from tests.scrape import fetch, free_port, samples, scrape
from vgpu_runtime.configmanager import CONFIG_LABEL

# The fake API server serves Kubernetes' own objects: without a working client (the GPU image
# lacks pydantic, which kubernetes 37 needs) these tests skip.
pytest.importorskip("kubernetes", reason="the Kubernetes client does not import here")
from vgpu_runtime.devkit.fakeapi import FakeApiServer

NODE = "gpu-node-1"
DEFAULT = """\
version: v1
node:
  slices_per_gpu: 10
devicePlugin:
  placement: best-fit
scheduler:
  limit_policy: work-conserving
"""
FOUR = DEFAULT.replace("slices_per_gpu: 10", "slices_per_gpu: 4")
STRICT = DEFAULT.replace("work-conserving", "strict")
TIMEOUT = 20.0


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node(NODE)
        yield server


@pytest.fixture
def configs(tmp_path: Path) -> Path:
    """A ConfigMap volume as kubelet lays it out: files are links into ..data."""
    root = tmp_path / "configs"
    data = root / "..2026_12_03"
    data.mkdir(parents=True)
    for name, text in (("default", DEFAULT), ("four-slices", FOUR), ("strict", STRICT)):
        (data / f"{name}.yaml").write_text(text)
    (root / "..data").symlink_to(data.name)
    for name in ("default", "four-slices", "strict"):
        (root / f"{name}.yaml").symlink_to(f"..data/{name}.yaml")
    return root


def manager_argv(api: FakeApiServer, configs: Path, output: Path, *extra: str) -> list[str]:
    """Metrics off unless `extra` names a port (the last flag wins): 9404 may be taken here."""
    return [sys.executable, "-m", "vgpu_runtime.configmanager", "--kube-api-url", api.url,
            "--node-name", NODE, "--source-dir", str(configs), "--output", str(output),
            "--source-interval", "0.2", "--log-format", "json", "--metrics-port", "0", *extra]


def oneshot(api: FakeApiServer, configs: Path, output: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(manager_argv(api, configs, output, "--oneshot", "true"), cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)


class Sidecar:
    def __init__(self, api: FakeApiServer, configs: Path, output: Path, *extra: str) -> None:
        self.log_path = output.parent / "manager.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the process
        self.proc = subprocess.Popen(manager_argv(api, configs, output, *extra), cwd=REPO,
                                     env=child_env(), stdout=self.log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(timeout=20)
        self.log.close()
        return code


def holds(output: Path, text: str) -> bool:
    try:
        return output.read_text() == text
    except FileNotFoundError:
        return False


def test_oneshot_writes_the_default_for_an_unlabelled_node(api: FakeApiServer, configs: Path,
                                                           tmp_path: Path) -> None:
    output = tmp_path / "node" / "config.yaml"
    output.parent.mkdir()
    done = oneshot(api, configs, output)
    assert done.returncode == 0, done.stderr
    assert output.read_text() == DEFAULT
    assert [name for name in output.parent.iterdir() if name.name != "config.yaml"] == []


def test_oneshot_writes_the_labelled_configuration(api: FakeApiServer, configs: Path,
                                                   tmp_path: Path) -> None:
    api.set_node_labels(NODE, {CONFIG_LABEL: "four-slices"})
    output = tmp_path / "config.yaml"
    assert oneshot(api, configs, output).returncode == 0
    assert output.read_text() == FOUR


def test_oneshot_with_a_missing_configuration_fails_with_an_event(
        api: FakeApiServer, configs: Path, tmp_path: Path) -> None:
    api.set_node_labels(NODE, {CONFIG_LABEL: "eight-slices"})
    output = tmp_path / "config.yaml"
    done = oneshot(api, configs, output)
    assert done.returncode == 1
    assert not output.exists()
    (event,) = api.node_events(NODE)
    assert event["reason"] == "ConfigNotFound" and event["type"] == "Warning"
    assert "no configuration 'eight-slices'" in event["message"]
    assert "default, four-slices, strict" in event["message"]     # what there is instead
    assert event["metadata"]["namespace"] == "default"
    assert "eight-slices" in done.stdout + done.stderr


def test_the_sidecar_follows_the_label(api: FakeApiServer, configs: Path,
                                       tmp_path: Path) -> None:
    """A real label change leads to the new file; a missing or invalid configuration keeps the
    file as it was, with an Event that says why; removing the label returns to the default."""
    output = tmp_path / "config.yaml"
    sidecar = Sidecar(api, configs, output)
    try:
        wait_for(lambda: holds(output, DEFAULT), TIMEOUT, "the default configuration")
        api.set_node_labels(NODE, {CONFIG_LABEL: "four-slices"})
        wait_for(lambda: holds(output, FOUR), TIMEOUT, "the labelled configuration")

        api.set_node_labels(NODE, {CONFIG_LABEL: "eight-slices"})
        wait_for(lambda: api.node_events(NODE), TIMEOUT, "an Event about the missing one")
        assert output.read_text() == FOUR
        (missing,) = api.node_events(NODE)
        assert missing["reason"] == "ConfigNotFound"
        assert "keeps its current configuration" in missing["message"]

        (configs / "..data").resolve().joinpath("broken.yaml").write_text(
            DEFAULT.replace("placement: best-fit", "placment: best-fit"))
        (configs / "broken.yaml").symlink_to("..data/broken.yaml")
        api.set_node_labels(NODE, {CONFIG_LABEL: "broken"})
        wait_for(lambda: len(api.node_events(NODE)) == 2, TIMEOUT, "an Event about the invalid")
        invalid = api.node_events(NODE)[1]
        assert invalid["reason"] == "ConfigInvalid"
        assert "section devicePlugin: unknown setting(s) placment" in invalid["message"]
        assert output.read_text() == FOUR

        api.set_node_labels(NODE, {CONFIG_LABEL: None})
        wait_for(lambda: holds(output, DEFAULT), TIMEOUT, "the default again")
        # An edit of the ConfigMap reaches the file too (kubelet updates the volume in place).
        (configs / "..data").resolve().joinpath("default.yaml").write_text(STRICT)
        wait_for(lambda: holds(output, STRICT), TIMEOUT, "the edited default")
        assert len(api.node_events(NODE)) == 2
    finally:
        assert sidecar.stop() == 0, sidecar.logs()
    assert api.watches >= 1     # it watched, it did not poll the node
    gets = [r for r in api.requests if r == ("GET", f"/api/v1/nodes/{NODE}")]
    assert len(gets) == 1, gets


def test_the_sidecar_rereads_the_node_after_the_api_server_fails(
        api: FakeApiServer, configs: Path, tmp_path: Path) -> None:
    output = tmp_path / "config.yaml"
    sidecar = Sidecar(api, configs, output)
    try:
        wait_for(lambda: holds(output, DEFAULT), TIMEOUT, "the default configuration")
        wait_for(lambda: api.watches >= 1, TIMEOUT, "a watch")
        api.fail_all = True
        api.set_node_labels(NODE, {CONFIG_LABEL: "strict"})   # missed by the broken watch
        wait_for(lambda: api.watches >= 2, TIMEOUT, "a refused watch")
        api.fail_all = False
        wait_for(lambda: holds(output, STRICT), TIMEOUT, "the label set while it failed")
    finally:
        assert sidecar.stop() == 0, sidecar.logs()


@pytest.mark.slow   # restarts the daemon under its sidecar, twice: a restart case, CI's lane
def test_the_daemon_restarts_for_its_changed_settings_only(api: FakeApiServer, configs: Path,
                                                           tmp_path: Path) -> None:
    """gemini-daemon reads the sidecar's file: a change of another program's section or an
    invalid file leaves it running; a change of its own settings restarts it in place (the
    same pid) with the new file."""
    output = tmp_path / "config.yaml"
    assert oneshot(api, configs, output).returncode == 0
    state = tmp_path / "state"
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state),
             "--metrics-port", "0", "--config", str(output)],
            cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        sidecar: Sidecar | None = None
        try:
            def logged(text: str, times: int = 1) -> bool:
                return log_path.read_text().count(text) >= times

            wait_for(lambda: logged("gemini-daemon started"), TIMEOUT, "the daemon")
            # An invalid file (written by hand: the sidecar writes only valid ones): logged,
            # and the daemon runs on.
            output.write_text(DEFAULT.replace("limit_policy", "limit_polcy"))
            wait_for(lambda: logged("changed but is invalid"), TIMEOUT, "the invalid file")
            assert daemon.poll() is None
            sidecar = Sidecar(api, configs, output)   # writes the default again
            wait_for(lambda: logged("none of this program's settings did"), TIMEOUT, "a check")
            # The plugin's section changes: the daemon's settings do not.
            (configs / "..data").resolve().joinpath("default.yaml").write_text(
                DEFAULT.replace("best-fit", "spread"))
            wait_for(lambda: logged("none of this program's settings did", 2), TIMEOUT,
                     "a second check")
            assert not logged("restarting")
            # Its own setting changes: it restarts, in this process, with the new file.
            api.set_node_labels(NODE, {CONFIG_LABEL: "strict"})
            wait_for(lambda: logged("gemini-daemon started", 2), TIMEOUT, "the restart")
            assert daemon.poll() is None
            # The restarted daemon runs on strict: a change of the plugin's section of the
            # strict configuration leaves it be.
            (configs / "..data").resolve().joinpath("strict.yaml").write_text(
                STRICT.replace("best-fit", "spread"))
            wait_for(lambda: logged("none of this program's settings did", 3), TIMEOUT,
                     "a check after the restart")
            daemon.terminate()
            assert daemon.wait(timeout=TIMEOUT) == 0
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()
            if sidecar is not None:
                assert sidecar.stop() == 0, sidecar.logs()
    restarts = [json.loads(line) for line in log_path.read_text().splitlines()
                if "restarting with it" in line]
    assert [entry["settings"] for entry in restarts] == [["limit_policy"]]


def applied(port: int) -> dict[str, float]:
    """configuration_applied's series: configuration name -> 1 or 0."""
    found = samples(scrape(port))
    return {s.labels["config"]: s.value
            for s in found.get("gemini_vgpu_config_manager_configuration_applied", [])}


def counted(port: int, name: str, **labels: str) -> float:
    """A counter's value, 0 while it has no series yet."""
    return sum(s.value for s in samples(scrape(port)).get(name, [])
               if all(s.labels.get(k) == v for k, v in labels.items()))


def test_the_sidecars_metrics_follow_what_it_applies(api: FakeApiServer, configs: Path,
                                                     tmp_path: Path) -> None:
    """Its own port: build info, the configuration the label names and whether the file holds
    it, the writes, and each failure by reason (a missing configuration once, as its Event; a
    failed watch each time)."""
    port = free_port()
    output = tmp_path / "config.yaml"
    sidecar = Sidecar(api, configs, output, "--metrics-port", str(port),
                      "--metrics-address", "127.0.0.1")
    writes, errors = ("gemini_vgpu_config_manager_writes_total",
                      "gemini_vgpu_config_manager_errors_total")
    try:
        wait_for(lambda: holds(output, DEFAULT), TIMEOUT, "the default configuration")
        (info,) = samples(scrape(port))["gemini_vgpu_build_info"]
        assert info.labels["program"] == "gemini-config-manager" and info.value == 1
        assert applied(port) == {"default": 1.0}
        assert counted(port, writes) == 1
        assert counted(port, errors) == 0

        api.set_node_labels(NODE, {CONFIG_LABEL: "eight-slices"})
        wait_for(lambda: applied(port) == {"eight-slices": 0.0}, TIMEOUT, "the missing one")
        wait_for(lambda: counted(port, errors, reason="ConfigNotFound") == 1, TIMEOUT,
                 "its error counted")
        assert holds(output, DEFAULT) and counted(port, writes) == 1
        # Tried again each source interval (0.2 s), reported and counted once.
        time.sleep(1.0)
        assert counted(port, errors, reason="ConfigNotFound") == 1

        api.set_node_labels(NODE, {CONFIG_LABEL: "four-slices"})
        wait_for(lambda: holds(output, FOUR), TIMEOUT, "the labelled configuration")
        wait_for(lambda: applied(port) == {"four-slices": 1.0}, TIMEOUT, "it applied")
        assert counted(port, writes) == 2

        api.fail_all = True
        api.set_node_labels(NODE, {CONFIG_LABEL: "strict"})   # ends the watch, refused again
        wait_for(lambda: counted(port, errors, reason="NodeWatchFailed") >= 1, TIMEOUT,
                 "a failed watch counted")
        api.fail_all = False
        wait_for(lambda: applied(port) == {"strict": 1.0}, TIMEOUT, "the label set meanwhile")
        assert counted(port, writes) == 3
        status, text = fetch(f"http://127.0.0.1:{port}/nope")
        assert status == 404 and "/metrics" in text
    finally:
        assert sidecar.stop() == 0, sidecar.logs()


def test_the_metrics_port_is_its_own_and_a_oneshot_serves_none(
        api: FakeApiServer, configs: Path, tmp_path: Path) -> None:
    from vgpu_runtime.common.metrics import CONFIG_MANAGER_PORT, PLUGIN_PORT
    from vgpu_runtime.configmanager import ManagerConfig
    from vgpu_runtime.contracts import paths
    from vgpu_runtime.daemon.config import DaemonConfig

    assert ManagerConfig().metrics_port == CONFIG_MANAGER_PORT == 9404
    assert CONFIG_MANAGER_PORT not in (PLUGIN_PORT, DaemonConfig().metrics_port,
                                       paths.HOST_METRICS_PORT)
    port = free_port()
    done = subprocess.run(manager_argv(api, configs, tmp_path / "config.yaml", "--oneshot",
                                       "true", "--metrics-port", str(port), "--log-format",
                                       "text"),
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "configuration written" in done.stderr + done.stdout
    assert "metrics served" not in done.stderr + done.stdout


# ---- the operator's commands: check a node file, convert the two-file ConfigMap ----

PLUGIN_FLAT = "slices_per_gpu: 4\nstate_dir: /srv/gemini\nplacement: spread\nmemory_reserve: 1GiB\n"
SCHEDULER_FLAT = "slices_per_gpu: 4\nstate_dir: /srv/gemini\nlimit_policy: strict\nwindow: 5.0\n"


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.configmanager", *args], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)


def test_convert_gives_each_program_the_settings_its_flat_file_gave(tmp_path: Path) -> None:
    from vgpu_runtime.common import config as cfg
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.pluginconfig import PluginConfig

    plugin_file, scheduler_file = tmp_path / "device-plugin.yaml", tmp_path / "scheduler.yaml"
    plugin_file.write_text(PLUGIN_FLAT)
    scheduler_file.write_text(SCHEDULER_FLAT)
    done = tool("convert", str(plugin_file), str(scheduler_file))
    assert done.returncode == 0, done.stderr
    converted = tmp_path / "default.yaml"
    converted.write_text(done.stdout)
    assert "version: v1" in done.stdout and done.stdout.count("slices_per_gpu") == 1
    for cls, flat in ((PluginConfig, plugin_file), (DaemonConfig, scheduler_file)):
        assert (cfg.load(cls, ["--config", str(converted)], environ={})
                == cfg.load(cls, ["--config", str(flat)], environ={}))
    assert tool("check", str(converted)).returncode == 0


def test_convert_refuses_files_that_disagree_and_check_names_the_key(tmp_path: Path) -> None:
    plugin_file, scheduler_file = tmp_path / "device-plugin.yaml", tmp_path / "scheduler.yaml"
    plugin_file.write_text(PLUGIN_FLAT)
    scheduler_file.write_text(SCHEDULER_FLAT.replace("slices_per_gpu: 4", "slices_per_gpu: 10"))
    done = tool("convert", str(plugin_file), str(scheduler_file))
    assert done.returncode == 2 and done.stdout == ""
    assert "slices_per_gpu is 10 here but 4" in done.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(DEFAULT.replace("limit_policy", "limit_polcy"))
    done = tool("check", str(broken))
    assert done.returncode == 2
    assert done.stderr.startswith("gemini-config-manager: error: ")
    assert "section scheduler: unknown setting(s) limit_polcy" in done.stderr


def test_an_output_it_cannot_write_is_logged_and_fails_the_oneshot(
        api: FakeApiServer, configs: Path, tmp_path: Path) -> None:
    output = tmp_path / "missing-directory" / "config.yaml"
    done = oneshot(api, configs, output)
    assert done.returncode == 1
    assert "cannot write the node's configuration" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_help_names_the_operators_commands() -> None:
    """--help lists check and convert, which take no flags and so have no line of their own."""
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "vgpu_runtime.configmanager", "--help"],
                           capture_output=True, text=True, check=True).stdout
    flat = " ".join(shown.split())
    assert "gemini-config-manager check FILE..." in flat
    assert "gemini-config-manager convert DEVICE_PLUGIN_FILE SCHEDULER_FILE" in flat
