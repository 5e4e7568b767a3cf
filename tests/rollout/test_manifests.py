"""daemonset/: every manifest and kustomize build is valid offline and says what the code says.

Schemas: kubernetes-validate's bundled JSON schemas for Kubernetes 1.30, strict (unknown fields
are errors), so nothing here touches the network.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from device_plugin.allocator import Allocator
from device_plugin.slices import SliceTable
from tests.childenv import REPO
from tests.rollout import manifests as m
from vgpu_runtime import __version__
from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.config import PROCESS_MEMORY_SOURCES, DaemonConfig
from vgpu_runtime.daemon.pods import annotations as pod_annotations
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.install import InstallConfig
from vgpu_runtime.mpscontrol import MpsControlConfig
from vgpu_runtime.pluginconfig import PluginConfig
from vgpu_runtime.pluginconfig import check as check_plugin_config

needs_kustomize = pytest.mark.skipif(
    m.kustomize_command() is None,
    reason="neither kubectl nor kustomize is installed; `kubectl kustomize` builds are not checked")



def metrics_port_default() -> int:
    return DaemonConfig().metrics_port


def console_scripts() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
    assert section is not None
    return set(re.findall(r"^([\w-]+)\s*=", section.group(1), re.M))


@pytest.fixture(scope="module")
def built() -> dict[Path, list[m.Obj]]:
    if m.kustomize_command() is None:
        pytest.skip("neither kubectl nor kustomize is installed")
    return {root: m.build(root) for root in m.KUSTOMIZE_ROOTS}


@pytest.fixture(scope="module")
def base(built: dict[Path, list[m.Obj]]) -> list[m.Obj]:
    return built[m.DAEMONSET]


@pytest.fixture(scope="module")
def node_ds(base: list[m.Obj]) -> m.Obj:
    return m.find(base, "DaemonSet", "gemini-vgpu-node")


def schemas() -> Any:
    """kubernetes-validate (a test extra): the schema tests skip, saying so, where it is missing."""
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install '.[test]')")


def validate(obj: m.Obj) -> None:
    schemas().validate(obj, m.SCHEMA_VERSION, strict=True)


# ---- schemas ----

def test_every_yaml_file_is_either_an_object_file_or_a_settings_file() -> None:
    """A new manifest cannot slip past the schema check by being classified as settings."""
    for path in m.yaml_files():
        if m.is_settings_file(path):
            data = yaml.safe_load(path.read_text())
            assert "apiVersion" not in data or path.name == "kustomization.yaml", path
        else:
            assert m.load_objects(path), f"{path} holds no object"
    assert len(m.object_files()) >= 8


@pytest.mark.parametrize("path", m.object_files(), ids=lambda p: str(p.relative_to(m.DAEMONSET)))
def test_manifest_validates_against_the_kubernetes_schema(path: Path) -> None:
    for obj in m.load_objects(path):
        if (obj["apiVersion"], obj["kind"]) in m.CUSTOM_KINDS:
            continue   # checked in test_servicemonitor_scrapes_the_metrics_services
        validate(obj)


def test_strict_validation_rejects_a_misspelled_field() -> None:
    """The check has teeth: an unknown field and a wrong type are both errors."""
    daemonset = m.load_objects(m.BASE / "node" / "daemonset.yaml")[0]
    validate(daemonset)
    misspelled = copy.deepcopy(daemonset)
    misspelled["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(schemas().ValidationError, match="hostPid"):
        validate(misspelled)
    wrong_type = copy.deepcopy(daemonset)
    wrong_type["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] = [1]
    with pytest.raises(schemas().ValidationError):
        validate(wrong_type)


@needs_kustomize
@pytest.mark.parametrize("root", m.KUSTOMIZE_ROOTS, ids=lambda p: str(p.relative_to(REPO)))
def test_kustomize_builds_and_every_object_validates(root: Path,
                                                     built: dict[Path, list[m.Obj]]) -> None:
    objects = built[root]
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Namespace",
                     "Role", "RoleBinding", "Service", "ServiceAccount"]
    for obj in objects:
        validate(obj)
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == "gemini-system", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gemini-vgpu"


@needs_kustomize
def test_a_broken_kustomization_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(AssertionError, match="failed"):
        m.build(tmp_path)


# ---- the node configurations: one file per name, a section per program ----

DEFAULT_FILE = m.BASE / "config" / "default.yaml"
FOUR_SLICES_FILE = m.DAEMONSET / "overlays" / "four-slices" / "config" / "four-slices.yaml"


def program_config(config_class: type[Any], path: Path,
                   environ: dict[str, str] | None = None) -> Any:
    """What `config_class`'s program resolves from a node file (and env), through its loader."""
    values, where = cfg.file_settings(config_class, cfg.load_file(str(path)), str(path))
    return cfg.resolve(config_class, {}, environ or {}, values, str(path), where)


def test_default_configuration_holds_each_programs_defaults() -> None:
    data = cfg.load_file(str(DEFAULT_FILE))
    assert data["version"] == cfg.FILE_VERSION
    plugin = check_plugin_config(program_config(PluginConfig, DEFAULT_FILE))
    assert plugin == PluginConfig(), "the shipped file must spell out the defaults, not change them"
    daemon = program_config(DaemonConfig, DEFAULT_FILE)
    daemon.check()
    # DaemonConfig's own default depends on the user (root: /var/lib/gemini); the node's is
    # the root one.
    assert daemon == dataclasses.replace(DaemonConfig(), state_dir=paths.DEFAULT_STATE_DIR)
    assert {"slices_per_gpu", "state_dir"} <= set(data["node"]), "named once, for both"
    for key in ("memory_reserve", "device_list_strategy", "kubelet_dir", "placement"):
        assert key in data["devicePlugin"], f"operators look for {key} in the ConfigMap"
    for key in ("limit_policy", "default_limit", "window", "min_quota", "max_quota", "cycle"):
        assert key in data["scheduler"]


def test_four_slices_is_the_default_with_four_slices() -> None:
    """The overlay's copy cannot drift from the base: only slices_per_gpu differs."""
    default, four = cfg.load_file(str(DEFAULT_FILE)), cfg.load_file(str(FOUR_SLICES_FILE))
    assert four["node"].pop("slices_per_gpu") == 4
    assert default["node"].pop("slices_per_gpu") == 10
    assert four == default
    for config_class in (PluginConfig, DaemonConfig):
        assert program_config(config_class, FOUR_SLICES_FILE).slices_per_gpu == 4


@needs_kustomize
def test_every_named_configuration_passes_the_config_managers_check(
        built: dict[Path, list[m.Obj]], tmp_path: Path) -> None:
    """What gemini-config-manager checks before writing a configuration for a node."""
    from vgpu_runtime.configmanager import check_node_file

    names = set()
    for objects in built.values():
        config_map = m.find(objects, "ConfigMap", None, prefix="gemini-vgpu-config")
        for name, text in config_map["data"].items():
            path = tmp_path / name
            path.write_text(text)
            check_node_file(str(path))
            names.add(name)
    assert names == {"default.yaml", "four-slices.yaml"}


def check_env_settings(config_class: type[Any], values: dict[str, str]) -> None:
    """Every GEMINI_* variable is a setting of the program, with a value it accepts."""
    fields = {cfg.env_name(f.name): f for f in dataclasses.fields(config_class)}
    for name, value in values.items():
        if not name.startswith(cfg.ENV_PREFIX) or name == cfg.CONFIG_FILE_ENV:
            continue
        assert name in fields, f"{name} is not a setting of {config_class.__name__}"
        fields[name].metadata["parse"](value)   # raises on a value the program rejects


def test_telemetry_env_names_scheduler_settings() -> None:
    lines = (m.BASE / "config" / "telemetry.env").read_text().splitlines()
    values = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert "GEMINI_MQTT_URL" in values and values["GEMINI_MQTT_URL"] == ""   # off by default
    check_env_settings(DaemonConfig, values)
    assert cfg.resolve(DaemonConfig, {}, values, {}).mqtt_url is None   # MQTT off


@needs_kustomize
def test_container_env_names_settings_of_its_program(built: dict[Path, list[m.Obj]]) -> None:
    from vgpu_runtime.configmanager import ManagerConfig

    programs: dict[str, type[Any]] = {"device-plugin": PluginConfig,
                                      "scheduler": DaemonConfig,
                                      "config-manager": ManagerConfig,
                                      "install-hook": InstallConfig,
                                      "mps-control": MpsControlConfig}
    for objects in built.values():
        for daemonset in (o for o in objects if o["kind"] == "DaemonSet"):
            for name, container in {**m.containers(daemonset),
                                    **m.containers(daemonset, init=True)}.items():
                values = {k: e["value"] for k, e in m.env(container).items() if "value" in e}
                check_env_settings(programs[name], values)
                if name in ("scheduler", "config-manager"):
                    node_name = m.env(container)["GEMINI_NODE_NAME"]["valueFrom"]
                    assert node_name == {"fieldRef": {"fieldPath": "spec.nodeName"}}


@needs_kustomize
def test_plugin_and_daemon_agree_on_slices_per_gpu(built: dict[Path, list[m.Obj]],
                                                   tmp_path: Path) -> None:
    """The daemon labels the node with the count the plugin advertises: for every named
    configuration a node can take, with each container's environment over the file."""
    counts = set()
    for objects in built.values():
        daemonset = m.find(objects, "DaemonSet", "gemini-vgpu-node")
        pod = m.containers(daemonset)
        config_map = m.find(objects, "ConfigMap", None, prefix="gemini-vgpu-config")
        for name, text in config_map["data"].items():
            path = tmp_path / name
            path.write_text(text)
            plugin, daemon = (
                program_config(cls, path, {k: e["value"] for k, e in m.env(pod[c]).items()
                                           if "value" in e})
                for cls, c in ((PluginConfig, "device-plugin"), (DaemonConfig, "scheduler")))
            assert plugin.slices_per_gpu == daemon.slices_per_gpu, name
            assert plugin.mps == daemon.mps, name
            assert plugin.state_dir == daemon.state_dir == paths.DEFAULT_STATE_DIR
            counts.add(plugin.slices_per_gpu)
    assert counts == {10, 4}


# ---- paths, ports, names: the manifests against the code ----

def test_allocate_host_paths_are_mounted_at_the_same_path(node_ds: m.Obj) -> None:
    """Every directory a real Allocate response names, for every device-list strategy."""
    plugin = m.containers(node_ds)["device-plugin"]
    scheduler = m.containers(node_ds)["scheduler"]
    file_config = program_config(PluginConfig, DEFAULT_FILE)
    gpus = SimulatedBackend(2).discover()
    for strategy in ("cdi", "envvar", "device-nodes"):
        config = dataclasses.replace(file_config, device_list_strategy=strategy)
        allocator = Allocator(config, SliceTable(gpus, config.slices_per_gpu))
        slices = allocator.validate([s.id for s in allocator.table.slices_of(gpus[1].uuid)[:3]])
        record = allocator.build_record(slices, time.time())
        response = allocator.response(record, slices)
        assert len(response.mounts) == 2
        for mount in response.mounts:
            assert m.visible_at_same_path(node_ds, plugin, mount.host_path), mount.host_path
        # The daemon creates each channel's socket in the directory the container mounts.
        assert m.visible_at_same_path(node_ds, scheduler, record.channel_dir)


def test_host_paths_match_the_code_defaults(node_ds: m.Obj) -> None:
    plugin_defaults = PluginConfig()
    assert m.host_volumes(node_ds) == {
        "device-plugins": plugin_defaults.kubelet_dir,
        "pod-resources": os.path.dirname(paths.DEFAULT_POD_RESOURCES_SOCKET),
        "state": paths.DEFAULT_STATE_DIR,
    }
    for name, container in {**m.containers(node_ds), **m.containers(node_ds, init=True)}.items():
        for host, inside, _ in m.host_mounts(node_ds, container):
            assert host == inside, f"{name} sees {host} at {inside}"
    state_users = {name for name, c in {**m.containers(node_ds),
                                        **m.containers(node_ds, init=True)}.items()
                   if m.visible_at_same_path(node_ds, c, paths.DEFAULT_STATE_DIR)}
    assert state_users == {"install-hook", "device-plugin", "scheduler"}


def test_pod_resources_is_mounted_as_a_directory(node_ds: m.Obj) -> None:
    scheduler = m.containers(node_ds)["scheduler"]
    socket = paths.DEFAULT_POD_RESOURCES_SOCKET
    assert m.env(scheduler)["GEMINI_POD_RESOURCES_SOCKET"]["value"] == socket
    assert m.visible_at_same_path(node_ds, scheduler, socket)
    volume = next(v for v in node_ds["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "pod-resources")
    assert volume["hostPath"] == {"path": os.path.dirname(socket), "type": "Directory"}


def test_plugin_probes_check_the_plugins_socket(node_ds: m.Obj) -> None:
    plugin = m.containers(node_ds)["device-plugin"]
    socket = str(PluginConfig().plugin_socket)
    for probe in ("readinessProbe", "livenessProbe"):
        assert plugin[probe]["exec"]["command"] == ["test", "-S", socket]
    assert m.visible_at_same_path(node_ds, plugin, socket)


def test_metrics_port_is_one_number_everywhere(base: list[m.Obj], node_ds: m.Obj) -> None:
    port = metrics_port_default()
    scheduler = m.containers(node_ds)["scheduler"]
    assert scheduler["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    assert m.env(scheduler)["GEMINI_METRICS_PORT"]["value"] == str(port)
    assert scheduler["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert scheduler["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = node_ds["spec"]["template"]["metadata"]["annotations"]
    service = m.find(base, "Service", "gemini-vgpu-metrics")
    for notes in (annotations, service["metadata"]["annotations"]):
        assert notes["prometheus.io/port"] == str(port)
        assert notes["prometheus.io/path"] == "/metrics"
    assert service["spec"]["ports"] == [{"name": "metrics", "port": port,
                                         "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = node_ds["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def own_metrics_ports() -> dict[str, tuple[int, bool, str, str]]:
    """container -> (its program's default port, whether an init container, the port's name,
    its Service)."""
    from vgpu_runtime.configmanager import ManagerConfig

    return {"device-plugin": (PluginConfig().metrics_port, False, "plugin-metrics",
                              "gemini-vgpu-plugin-metrics"),
            "config-manager": (ManagerConfig().metrics_port, True, "config-metrics",
                               "gemini-vgpu-config-metrics")}


@pytest.mark.parametrize("name", ["device-plugin", "config-manager"])
def test_the_plugins_and_config_managers_metrics_ports_are_their_own_and_one_number_everywhere(
        base: list[m.Obj], node_ds: m.Obj, name: str) -> None:
    port, init, port_name, service_name = own_metrics_ports()[name]
    others = [p for other, (p, *_rest) in own_metrics_ports().items() if other != name]
    assert port not in (metrics_port_default(), paths.HOST_METRICS_PORT, *others)
    container = m.containers(node_ds, init=init)[name]
    assert container["ports"] == [{"name": port_name, "containerPort": port,
                                   "protocol": "TCP"}]
    assert m.env(container)["GEMINI_METRICS_PORT"]["value"] == str(port)
    if init:   # a Service finds an init container's named port only in a sidecar's
        assert container["restartPolicy"] == "Always"
    # Its own Service: scrape configs read one port a Service from its annotations.
    service = m.find(base, "Service", service_name)
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["spec"]["ports"] == [{"name": port_name, "port": port,
                                         "targetPort": port_name, "protocol": "TCP"}]
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = node_ds["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_servicemonitor_scrapes_the_metrics_services(base: list[m.Obj]) -> None:
    (monitor,) = m.load_objects(m.DAEMONSET / "examples" / "monitoring" / "servicemonitor.yaml")
    ports = []
    services = [o for o in base if o["kind"] == "Service"]
    assert sorted(s["metadata"]["name"] for s in services) == [
        "gemini-vgpu-config-metrics", "gemini-vgpu-metrics", "gemini-vgpu-plugin-metrics"]
    for service in services:
        assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
            "labels"].items()
        ports += [p["name"] for p in service["spec"]["ports"]]
    assert sorted(e["port"] for e in monitor["spec"]["endpoints"]) == sorted(ports)


def test_hook_dir_agrees_between_install_and_plugin(node_ds: m.Obj) -> None:
    init = m.containers(node_ds, init=True)["install-hook"]
    install_config = cfg.load(InstallConfig, init["args"], environ={})
    plugin_config = program_config(PluginConfig, DEFAULT_FILE)
    assert install_config.host_hook_dir == plugin_config.host_hook_dir
    assert install_config.host_hook_dir == paths.default_hook_dir(paths.DEFAULT_STATE_DIR)


def test_commands_are_the_packages_console_scripts(node_ds: m.Obj) -> None:
    scripts = console_scripts()
    commands = {name: c["command"] for name, c in {**m.containers(node_ds),
                                                   **m.containers(node_ds, init=True)}.items()}
    assert commands == {"install-hook": ["gemini-install-hook"],
                        "device-plugin": ["gemini-device-plugin"],
                        "scheduler": ["gemini-daemon"],
                        "config-manager": ["gemini-config-manager"]}
    # gemini-install-hook = "vgpu_runtime.install:main" is requested for pyproject.toml; until it
    # is there, the image's build script (scripts/build-image) fails, so this is not hidden.
    assert {"gemini-device-plugin", "gemini-daemon", "gemini-config-manager"} <= scripts


def test_image_tag_is_the_package_version(built: dict[Path, list[m.Obj]]) -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M), "one version: vgpu_runtime's"
    assert 'version = { attr = "vgpu_runtime.__version__" }' in pyproject
    for objects in built.values():
        for daemonset in (o for o in objects if o["kind"] == "DaemonSet"):
            pod = daemonset["spec"]["template"]["spec"]
            for container in pod["containers"] + pod.get("initContainers", []):
                assert container["image"] == f"ghcr.io/gemini-ai/vgpu-node:{__version__}"


def readme_images_entries() -> dict[str, str]:
    """The `images:` entry each README shows for pointing kustomize at a pushed image (README.md
    step 4, a yaml block; daemonset/README.md step 3, a heredoc appended to the kustomization),
    with its placeholders filled in as an operator would."""
    found = {}
    for name, path in (("README.md", REPO / "README.md"),
                       ("daemonset/README.md", m.DAEMONSET / "README.md")):
        text = path.read_text()
        blocks = re.findall(r"^( *)```(\w*)\n(.*?)^ *```$", text, re.M | re.S)
        bodies = [textwrap.dedent(body) for _, _, body in blocks]
        entries = [body for body in bodies if re.search(r"^images:$", body, re.M)]
        if name == "daemonset/README.md":
            heredocs = [re.search(r"<<'EOF'.*?\n(.*?)^EOF$", e, re.M | re.S) for e in entries]
            entries = [h.group(1) for h in heredocs if h]
        assert len(entries) == 1, f"{name}: expected one block with an images: entry"
        found[name] = entries[0]
    return found


@pytest.mark.parametrize("readme", ["README.md", "daemonset/README.md"])
def test_the_readmes_images_entry_replaces_every_image(readme: str, tmp_path: Path) -> None:
    """The `images:` entry the README tells operators to add to daemonset/kustomization.yaml
    reaches all four containers, by digest, with kubectl's own kustomize (no kustomize
    binary)."""
    entry = readme_images_entries()[readme]
    if m.kustomize_command() is None:
        pytest.skip("neither kubectl nor kustomize is installed")
    digest = "sha256:" + "0123456789abcdef" * 4
    entry = (entry.replace("<version>", __version__).replace("sha256:...", digest)
             .replace("sha256:D", digest).replace("REGISTRY", "registry.example.com/gemini"))
    assert yaml.safe_load(entry)["images"][0]["name"] == "ghcr.io/gemini-ai/vgpu-node"
    tree = tmp_path / "daemonset"
    shutil.copytree(REPO / "daemonset", tree)
    with open(tree / "kustomization.yaml", "a") as top:
        top.write(entry)
    (daemonset,) = [o for o in m.build(tree) if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    # The tag stays for people; the runtime pulls by the digest.
    assert images == {f"registry.example.com/gemini/vgpu-node:{__version__}@{digest}"}


def test_the_config_manager_writes_the_file_the_programs_read(base: list[m.Obj],
                                                              node_ds: m.Obj) -> None:
    """The sidecar starts first, reads the ConfigMap where its source_dir default says, and
    writes its output default into the emptyDir the plugin and daemon read (GEMINI_CONFIG)."""
    from vgpu_runtime.configmanager import ManagerConfig

    defaults = ManagerConfig()
    pod = node_ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(m.find(base, "ConfigMap", volumes["configs"]["configMap"]["name"])["data"]) == {
        "default.yaml"}
    assert "emptyDir" in volumes["node-config"]
    manager = pod["initContainers"][0]
    assert manager["name"] == "config-manager" and manager["restartPolicy"] == "Always"
    assert manager["startupProbe"]["exec"]["command"] == ["test", "-s", defaults.output]
    assert "args" not in manager    # not --oneshot: it follows the label
    mounts = {v["name"]: v for v in manager["volumeMounts"]}
    assert mounts["configs"]["mountPath"] == defaults.source_dir
    assert mounts["node-config"]["mountPath"] == os.path.dirname(defaults.output)
    assert not mounts["node-config"].get("readOnly")
    for name in ("device-plugin", "scheduler"):
        container = m.containers(node_ds)[name]
        assert m.env(container)["GEMINI_CONFIG"]["value"] == defaults.output
        (mount,) = [v for v in container["volumeMounts"] if v["name"] == "node-config"]
        assert mount == {"name": "node-config", "mountPath": os.path.dirname(defaults.output),
                         "readOnly": True}
        assert all(v["name"] != "configs" for v in container["volumeMounts"])


# ---- the DaemonSet's rollout and privileges ----

def test_daemonset_rollout_and_placement(node_ds: m.Obj) -> None:
    spec = node_ds["spec"]
    pod = spec["template"]["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxUnavailable": 1}}
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": "gemini.ai/vgpu.enabled", "operator": "In", "values": ["true"]} in term[
        "matchExpressions"]
    for container in pod["containers"] + pod["initContainers"]:
        resources = container["resources"]
        assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_no_container_is_privileged_or_keeps_a_capability(node_ds: m.Obj) -> None:
    pod = node_ds["spec"]["template"]["spec"]
    assert not pod.get("hostPID") and not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod["initContainers"]:
        context = container["securityContext"]
        assert context["privileged"] is False
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["readOnlyRootFilesystem"] is True
    # Only the scheduler talks to the API server, so only it mounts a token.
    token_users = {c["name"] for c in pod["containers"] + pod["initContainers"]
                   if any(v["name"] == "api-token" for v in c.get("volumeMounts", []))}
    assert token_users == {"scheduler", "config-manager"}
    # Only the plugin and the daemon get the GPUs, for NVML alone (no CUDA capability).
    gpu_users = {c["name"] for c in pod["containers"] + pod["initContainers"]
                 if "NVIDIA_VISIBLE_DEVICES" in m.env(c)}
    assert gpu_users == {"device-plugin", "scheduler"}
    for name in gpu_users:
        assert m.env(m.containers(node_ds)[name])["NVIDIA_DRIVER_CAPABILITIES"]["value"] == (
            "utility")


def test_rbac_grants_only_the_justified_verbs(base: list[m.Obj]) -> None:
    role = m.find(base, "ClusterRole", "gemini-vgpu-node")
    grants = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
              for resource in rule["resources"] for verb in rule["verbs"]}
    assert grants == {("", "pods", "get"), ("", "events", "create"), ("", "nodes", "get"),
                      ("", "nodes", "patch"), ("", "nodes", "watch")}
    binding = m.find(base, "ClusterRoleBinding", "gemini-vgpu-node")
    account = m.find(base, "ServiceAccount", "gemini-vgpu")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gemini-vgpu",
                                    "namespace": account["metadata"]["namespace"]}]


def test_every_rbac_verb_has_a_justifying_comment() -> None:
    text = (m.BASE / "rbac.yaml").read_text()
    for rule in re.finditer(r"((?:^ *#.*\n)*)^  - apiGroups:", text, re.M):
        assert rule.group(1).strip(), f"rule at offset {rule.start()} has no comment"


# ---- the overlay: per-node slice counts, by label ----

@needs_kustomize
def test_four_slices_overlay_adds_a_named_configuration_to_one_daemonset(
        built: dict[Path, list[m.Obj]], node_ds: m.Obj) -> None:
    objects = built[m.DAEMONSET / "overlays" / "four-slices"]
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    config_map = m.find(objects, "ConfigMap", None, prefix="gemini-vgpu-config")
    assert set(config_map["data"]) == {"default.yaml", "four-slices.yaml"}
    assert config_map["data"]["four-slices.yaml"] == FOUR_SLICES_FILE.read_text()
    # The same DaemonSet as the base's but for the ConfigMap's name (its content hash rolls
    # the pods out when the configurations change).
    overlay_ds = copy.deepcopy(daemonset)
    volume = next(v for v in overlay_ds["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "configs")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    volume["configMap"]["name"] = next(
        v for v in node_ds["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "configs")["configMap"]["name"]
    assert overlay_ds == node_ds


# ---- the context charge from NVML: hostPID only where it is asked for ----

NVML_OVERLAY = m.DAEMONSET / "overlays" / "nvml-context-charge"
NVML_COMPONENT = m.DAEMONSET / "components" / "nvml-context-charge"


def pod_config_map(objects: list[m.Obj], daemonset: m.Obj, volume_name: str) -> m.Obj:
    """The ConfigMap a DaemonSet's pods mount as `volume_name`, by its hashed name."""
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    return m.find(objects, "ConfigMap", volumes[volume_name]["configMap"]["name"])


def daemon_config_in_pod(objects: list[m.Obj], daemonset: m.Obj, scratch: Path,
                         name: str = "default") -> DaemonConfig:
    """What gemini-daemon would load in this DaemonSet's pod on a node that takes the
    configuration `name`: its own loader, given the container's env (and envFrom ConfigMap)
    and that configuration, as the config manager writes it."""
    container = m.containers(daemonset)["scheduler"]
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environ.update(m.find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    environ.update({k: e["value"] for k, e in m.env(container).items() if "value" in e})
    settings_file = scratch / "config.yaml"
    settings_file.write_text(pod_config_map(objects, daemonset, "configs")["data"][
        f"{name}.yaml"])
    environ[cfg.CONFIG_FILE_ENV] = str(settings_file)
    config = cfg.load(DaemonConfig, [], environ)
    config.check()
    return config


@needs_kustomize
def test_only_the_nvml_overlay_shares_the_hosts_pid_namespace(
        built: dict[Path, list[m.Obj]]) -> None:
    daemonsets = 0
    for root, objects in built.items():
        for daemonset in (o for o in objects if o["kind"] == "DaemonSet"):
            pod = daemonset["spec"]["template"]["spec"]
            node = daemonset["metadata"]["name"] == "gemini-vgpu-node"
            assert pod.get("hostPID", False) is (node and root == NVML_OVERLAY), \
                (root, pod.get("hostPID"))
            assert not pod.get("hostNetwork") and not pod.get("hostIPC")
            daemonsets += node
    assert daemonsets == len(built)   # one per build: settings per node come from a label


def nvml_env(daemonset: m.Obj) -> list[m.Obj]:
    scheduler = m.containers(daemonset)["scheduler"]
    return [e for e in scheduler["env"] if e["name"] == "GEMINI_PROCESS_MEMORY"]


@needs_kustomize
def test_nvml_overlay_changes_nothing_else_in_the_daemonset(
        built: dict[Path, list[m.Obj]], node_ds: m.Obj) -> None:
    """hostPID and the scheduler's GEMINI_PROCESS_MEMORY are the whole difference."""
    overlay_ds = copy.deepcopy(m.find(built[NVML_OVERLAY], "DaemonSet", "gemini-vgpu-node"))
    pod = overlay_ds["spec"]["template"]["spec"]
    assert pod.pop("hostPID") is True
    assert nvml_env(overlay_ds) == [{"name": "GEMINI_PROCESS_MEMORY", "value": "nvml"}]
    scheduler = m.containers(overlay_ds)["scheduler"]
    scheduler["env"] = [e for e in scheduler["env"] if e["name"] != "GEMINI_PROCESS_MEMORY"]
    assert overlay_ds == node_ds
    others = [o for o in built[NVML_OVERLAY] if o["kind"] != "DaemonSet"]
    assert others == [o for o in built[m.DAEMONSET] if o["kind"] != "DaemonSet"]


@needs_kustomize
def test_daemon_loads_process_memory_nvml_in_the_overlay_and_auto_in_the_base(
        built: dict[Path, list[m.Obj]], node_ds: m.Obj, tmp_path: Path) -> None:
    """Through the daemon's loader, from the ConfigMap and env of the pods: the overlay's
    settings are the base's with process_memory=nvml."""
    in_base = daemon_config_in_pod(built[m.DAEMONSET], node_ds, tmp_path)
    overlay = built[NVML_OVERLAY]
    overlay_ds = m.find(overlay, "DaemonSet", "gemini-vgpu-node")
    in_overlay = daemon_config_in_pod(overlay, overlay_ds, tmp_path)
    assert in_base.process_memory == "auto"   # chooses NVML only in the host's pid namespace
    assert in_overlay.process_memory == "nvml"
    assert in_overlay.process_memory in PROCESS_MEMORY_SOURCES
    assert in_overlay == dataclasses.replace(in_base, process_memory="nvml")


@needs_kustomize
def test_a_misspelled_process_memory_in_the_component_is_refused_by_name(
        built: dict[Path, list[m.Obj]], tmp_path: Path) -> None:
    """The loader the last test relies on rejects a value the daemon would not run with."""
    overlay = copy.deepcopy(built[NVML_OVERLAY])
    overlay_ds = m.find(overlay, "DaemonSet", "gemini-vgpu-node")
    (entry,) = nvml_env(overlay_ds)
    entry["value"] = "nvlm"
    with pytest.raises(cfg.ConfigError, match="GEMINI_PROCESS_MEMORY"):
        daemon_config_in_pod(overlay, overlay_ds, tmp_path)


@needs_kustomize
def test_nvml_component_composes_with_the_four_slices_overlay(tmp_path: Path) -> None:
    """As the README says: an overlay that takes the component gets hostPID and
    process_memory=nvml on its DaemonSet, whichever configuration a node takes."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(m.DAEMONSET / "overlays" / "four-slices", tmp_path)],
        "components": [os.path.relpath(NVML_COMPONENT, tmp_path)]}))
    objects = m.build(tmp_path)
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    validate(daemonset)
    assert daemonset["spec"]["template"]["spec"]["hostPID"] is True
    for name, slices in (("default", 10), ("four-slices", 4)):
        config = daemon_config_in_pod(objects, daemonset, tmp_path, name)
        assert (config.process_memory, config.slices_per_gpu) == ("nvml", slices)


# ---- examples ----

def example(name: str) -> m.Obj:
    (obj,) = m.load_objects(m.DAEMONSET / "examples" / name)
    return obj


def pod_spec(obj: m.Obj) -> m.Obj:
    spec: m.Obj = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
    return spec


def slices_asked(obj: m.Obj) -> list[int]:
    return [c["resources"]["limits"][paths.RESOURCE_NAME] for c in pod_spec(obj)["containers"]]


def test_examples_ask_for_the_documented_slices() -> None:
    per_gpu = PluginConfig().slices_per_gpu
    assert slices_asked(example("pod-3-slices.yaml")) == [3]
    deployment = example("deployment-shared-gpu.yaml")
    assert deployment["spec"]["replicas"] == 3
    assert 3 * sum(slices_asked(deployment)) <= per_gpu    # the replicas fit on one GPU
    assert slices_asked(example("job-two-gpus.yaml")) == [2 * per_gpu]


def test_annotated_example_is_applied_by_the_daemon_without_complaint() -> None:
    """The example's slices allocated on a simulated H200, then its annotations applied."""
    annotated = example("pod-with-limits.yaml")
    notes = annotated["metadata"]["annotations"]
    assert set(notes) == {pod_annotations.LIMIT_ANNOTATION, pod_annotations.MEMORY_ANNOTATION}
    gpus = SimulatedBackend(1).discover()
    allocator = Allocator(PluginConfig(), SliceTable(gpus, PluginConfig().slices_per_gpu))
    (k,) = slices_asked(annotated)
    slices = allocator.validate([s.id for s in allocator.table.slices_of(gpus[0].uuid)[:k]])
    overrides = pod_annotations.overrides_of(allocator.build_record(slices, time.time()), notes)
    assert overrides.problems == ()
    assert overrides.limit == Share.parse(notes[pod_annotations.LIMIT_ANNOTATION])
    assert overrides.memory_limit == cfg.size(notes[pod_annotations.MEMORY_ANNOTATION])


# ---- the MPS backend (components/mps) ----

MPS_OVERLAY = m.DAEMONSET / "overlays" / "mps"


def host_mounts(daemonset: m.Obj, container: str) -> dict[str, str]:
    """The container's mounts of hostPath volumes: mount path -> host path."""
    volumes = {v["name"]: v["hostPath"]["path"]
               for v in daemonset["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}
    return {v["mountPath"]: volumes[v["name"]]
            for v in m.containers(daemonset)[container]["volumeMounts"] if v["name"] in volumes}


@needs_kustomize
def test_the_mps_overlay_gives_the_control_daemon_a_daemonset_of_its_own(
        built: dict[Path, list[m.Obj]]) -> None:
    """Its control daemon outlives the node pods' rollouts, its /dev/shm is the directory the
    plugin mounts into pods (and reads its mark from, at the same path), and the daemon adopts
    it rather than starting one."""
    objects = built[MPS_OVERLAY]
    node = m.find(objects, "DaemonSet", "gemini-vgpu-node")
    control_ds = m.find(objects, "DaemonSet", "gemini-vgpu-mps")
    control = m.containers(control_ds)["mps-control"]
    assert control["command"] == ["gemini-mps-control"]
    assert "gemini-mps-control" in console_scripts()
    assert control_ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert control_ds["spec"]["template"]["spec"]["affinity"] == \
        node["spec"]["template"]["spec"]["affinity"]
    assert control["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                          "add": ["SETUID", "SETGID"]}
    assert not control["securityContext"]["privileged"]
    assert "compute" in m.env(control)["NVIDIA_DRIVER_CAPABILITIES"]["value"]

    file = DEFAULT_FILE
    values = {k: e["value"] for k, e in m.env(m.containers(node)["device-plugin"]).items()
              if "value" in e}
    plugin = check_plugin_config(program_config(PluginConfig, file, values))
    scheduler = m.containers(node)["scheduler"]
    daemon = program_config(DaemonConfig, file, {k: e["value"] for k, e in
                                                 m.env(scheduler).items() if "value" in e})
    daemon.check()
    mps = cfg.load(MpsControlConfig, control["args"], {})
    assert plugin.mps and daemon.mps and not daemon.mps_manage
    assert "compute" in m.env(scheduler)["NVIDIA_DRIVER_CAPABILITIES"]["value"]
    assert plugin.state_dir == daemon.state_dir == mps.state_dir
    shm = host_mounts(control_ds, "mps-control")[paths.SHM_DIR]
    assert plugin.mps_shm_dir == shm == paths.DEFAULT_MPS_SHM_DIR
    assert host_mounts(node, "device-plugin")[shm] == shm
    assert host_mounts(control_ds, "mps-control")[mps.state_dir] == mps.state_dir


@needs_kustomize
def test_mps_is_off_in_every_other_build(built: dict[Path, list[m.Obj]]) -> None:
    for root, objects in built.items():
        if root == MPS_OVERLAY:
            continue
        assert not [o for o in objects if o["metadata"]["name"] == "gemini-vgpu-mps"], root
        node = m.find(objects, "DaemonSet", "gemini-vgpu-node")
        for container in m.containers(node).values():
            assert not any(k.startswith("GEMINI_MPS") for k in m.env(container)), root
