"""The Helm chart (daemonset/chart/gemini-vgpu) rendered and linted by the real Helm 4, built by
scripts/cluster/cluster.py like the cluster's binaries; none of these needs the cluster up.

With its default values the chart renders the objects of `kubectl kustomize daemonset/` (the
cluster build's kubectl), compared as parsed YAML, object by object, after two normalisations
and no other:
  1. Helm's own metadata: the labels helm.sh/chart, app.kubernetes.io/managed-by and
     app.kubernetes.io/version are removed from every object's metadata.labels (after checking
     that the chart put them on every object, with its name, Helm and its appVersion), and the
     annotation helm.sh/resource-policy (keep) from the Namespace's;
  2. generated ConfigMaps are named <name>-<hash of the content> by both, with different hash
     functions: the 10-character suffix is cut from their names and from the references to
     them (the DaemonSet's volume and envFrom); their contents are compared as they are.
The chart's uninstall hook (templates/uninstall.yaml: objects annotated helm.sh/hook) has no
kustomize counterpart: it is left out of the comparison and of the value tests, and tested on
its own.
Everything the comparison expects comes from the kustomize build, not from names written here,
so a rename in the base that the chart does not follow fails it.

Values change exactly the objects they should, and bad values fail with a message naming them.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import CHART, NAMESPACE, REPO, Tools, run
from vgpu_runtime.configmanager import check_node_file

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

Obj = dict[str, Any]
RELEASE = "gemini-vgpu"
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/version")
HASHED = re.compile(r"^(.+)-[a-z0-9]{10}$")
BASE_CONFIG = REPO / "daemonset" / "base" / "config" / "default.yaml"
SERVICE_MONITOR = REPO / "daemonset" / "examples" / "monitoring" / "servicemonitor.yaml"


def parse(text: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def is_hook(obj: Obj) -> bool:
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def render_all(tools: Tools, *args: str, namespace: str = NAMESPACE) -> list[Obj]:
    return parse(tools.helm_run("template", RELEASE, str(CHART), "--namespace", namespace,
                                *args).stdout)


def render(tools: Tools, *args: str, namespace: str = NAMESPACE) -> list[Obj]:
    """The release's objects, the uninstall hook's left out (hooks() has them)."""
    return [o for o in render_all(tools, *args, namespace=namespace) if not is_hook(o)]


def hooks(tools: Tools, *args: str, namespace: str = NAMESPACE) -> list[Obj]:
    return [o for o in render_all(tools, *args, namespace=namespace) if is_hook(o)]


def refused(tools: Tools, *args: str) -> str:
    """helm template's error for values it must refuse."""
    result = tools.helm_run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args,
                            check=False)
    assert result.returncode != 0, f"helm template {' '.join(args)} rendered:\n{result.stdout}"
    return result.stderr


@pytest.fixture(scope="module")
def defaults(tools: Tools) -> list[Obj]:
    return render(tools)


@pytest.fixture(scope="module")
def kustomize_base(tools: Tools) -> list[Obj]:
    return parse(run([tools.kubectl, "kustomize", str(REPO / "daemonset")]).stdout)


def base_name(name: str) -> str:
    match = HASHED.match(name)
    return match.group(1) if match else name


def without_hashes(objects: list[Obj]) -> list[Obj]:
    """Normalisation 2: generated ConfigMaps' names, and every reference to them, unhashed."""
    names = {o["metadata"]["name"]: base_name(o["metadata"]["name"])
             for o in objects if o["kind"] == "ConfigMap"}

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return names.get(value, value) if isinstance(value, str) else value
    return [walk(o) for o in objects]


def without_helm_metadata(objects: list[Obj]) -> list[Obj]:
    """Normalisation 1: Helm's labels off metadata.labels, the Namespace's resource policy off
    its metadata.annotations (nowhere else)."""
    out: list[Obj] = json.loads(json.dumps(objects))
    for obj in out:
        labels = obj["metadata"].get("labels", {})
        for label in HELM_LABELS:
            labels.pop(label, None)
        if obj["kind"] == "Namespace":
            annotations = obj["metadata"].pop("annotations")
            assert annotations == {"helm.sh/resource-policy": "keep"}, annotations
    return out


def by_key(objects: list[Obj]) -> dict[str, Obj]:
    keyed = {f"{o['kind']}/{base_name(o['metadata']['name'])}": o for o in objects}
    assert len(keyed) == len(objects), "two objects of one kind and name"
    return keyed


def diff(a: Obj, b: Obj) -> str:
    return "\n".join(difflib.unified_diff(yaml.safe_dump(a).splitlines(),
                                          yaml.safe_dump(b).splitlines(),
                                          "kustomize", "helm", lineterm=""))


def changes(before: list[Obj], after: list[Obj]) -> dict[str, str]:
    """Which objects values changed: kind/name (generated names unhashed) -> added, removed
    or changed."""
    old, new = by_key(before), by_key(after)
    out = {k: "removed" for k in old.keys() - new.keys()}
    out |= {k: "added" for k in new.keys() - old.keys()}
    out |= {k: "changed" for k in old.keys() & new.keys() if old[k] != new[k]}
    return out


def find(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    (obj,) = [o for o in objects if o["kind"] == kind
              and (name is None or base_name(o["metadata"]["name"]) == name)]
    return obj


def pod_spec(objects: list[Obj]) -> Obj:
    spec: Obj = find(objects, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def all_containers(objects: list[Obj]) -> list[Obj]:
    spec = pod_spec(objects)
    return [*spec["initContainers"], *spec["containers"]]


def configs(objects: list[Obj], tmp_path: Path) -> dict[str, Any]:
    """The named configurations of the ConfigMap, each checked by both programs' loaders (as
    gemini-config-manager checks them on the node) and parsed."""
    data = find(objects, "ConfigMap", "gemini-vgpu-config")["data"]
    out = {}
    for file, text in data.items():
        path = tmp_path / file
        path.write_text(text)
        check_node_file(str(path))
        out[file.removesuffix(".yaml")] = yaml.safe_load(text)
    return out


# ---- lint, and the defaults against the kustomize base ----

def test_helm_lint_passes_strict(tools: Tools, tmp_path: Path) -> None:
    """With the defaults and with every optional object on."""
    tools.helm_run("lint", "--strict", str(CHART))
    values = tmp_path / "all.yaml"
    values.write_text(yaml.safe_dump({
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
        "nodeConfigs": {"four-slices": {"node": {"slices_per_gpu": 4}}},
        "mqtt": {"url": "mqtt://broker.example:1883", "topicPrefix": "lab", "interval": 2.5},
        "imagePullSecrets": [{"name": "regcred"}], "nodeSelector": {"gpu": "h200"}}))
    tools.helm_run("lint", "--strict", str(CHART), "--values", str(values))


def test_the_defaults_render_the_kustomize_bases_objects(defaults: list[Obj],
                                                         kustomize_base: list[Obj]) -> None:
    for obj in defaults:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", obj["metadata"]
        assert labels["helm.sh/chart"].startswith("gemini-vgpu-"), obj["metadata"]
        assert "app.kubernetes.io/version" in labels, obj["metadata"]
    base = by_key(without_hashes(kustomize_base))
    chart = by_key(without_hashes(without_helm_metadata(defaults)))
    assert sorted(chart) == sorted(base)
    for key, obj in base.items():
        assert chart[key] == obj, f"{key} differs:\n{diff(obj, chart[key])}"
    # Not vacuous: the base has the DaemonSet and both generated ConfigMaps.
    assert {k.split("/")[0] for k in base} >= {"DaemonSet", "ConfigMap", "Namespace"}
    assert sum(HASHED.match(o["metadata"]["name"]) is not None
               for o in kustomize_base if o["kind"] == "ConfigMap") == 2


def test_the_default_configuration_is_the_base_file_byte_for_byte(
        defaults: list[Obj]) -> None:
    data = find(defaults, "ConfigMap", "gemini-vgpu-config")["data"]
    assert data == {"default.yaml": BASE_CONFIG.read_text()}


# ---- values change exactly their objects ----

def config_change(tools: Tools, defaults: list[Obj], *args: str) -> list[Obj]:
    """Renders with `args`, which must change the configuration ConfigMap and, through its new
    name only, the DaemonSet (a new name rolls the nodes one by one)."""
    objects = render(tools, *args)
    assert changes(defaults, objects) == {"ConfigMap/gemini-vgpu-config": "changed",
                                          "DaemonSet/gemini-vgpu-node": "changed"}
    old = find(defaults, "ConfigMap", "gemini-vgpu-config")["metadata"]["name"]
    new = find(objects, "ConfigMap", "gemini-vgpu-config")["metadata"]["name"]
    assert old != new
    volumes = {v["name"]: v for v in pod_spec(objects)["volumes"]}
    assert [v for v in volumes.values() if v.get("configMap", {}).get("name") == new]
    return objects


def base_config() -> Any:
    return yaml.safe_load(BASE_CONFIG.read_text())


def test_mps_renders_the_mps_overlays_objects(tools: Tools, defaults: list[Obj]) -> None:
    """mps.enabled: the objects of `kubectl kustomize daemonset/overlays/mps` (the control
    daemon's DaemonSet, the plugin's and the daemon's settings and mounts); off, none of it."""
    overlay = parse(run([tools.kubectl, "kustomize", str(REPO / "daemonset/overlays/mps")]).stdout)
    chart = by_key(without_hashes(without_helm_metadata(render(tools, "--set",
                                                               "mps.enabled=true"))))
    expected = by_key(without_hashes(overlay))
    assert sorted(chart) == sorted(expected)
    for key, obj in expected.items():
        assert chart[key] == obj, f"{key} differs:\n{diff(obj, chart[key])}"
    assert "DaemonSet/gemini-vgpu-mps" in chart
    assert not [o for o in defaults if o["metadata"]["name"] == "gemini-vgpu-mps"]
    shm = render(tools, "--set", "mps.enabled=true", "--set", "mps.shmDir=/run/other")
    node = find(shm, "DaemonSet", "gemini-vgpu-node")
    plugin = {c["name"]: c for c in node["spec"]["template"]["spec"]["containers"]}[
        "device-plugin"]
    assert {"name": "GEMINI_MPS_SHM_DIR", "value": "/run/other"} in plugin["env"]
    assert "/mps/shmDir" in refused(tools, "--set", "mps.shmDir=relative")


def test_slices_memory_reserve_and_resource_name_go_into_the_default_configuration(
        tools: Tools, defaults: list[Obj], tmp_path: Path) -> None:
    objects = config_change(tools, defaults, "--set", "slicesPerGpu=4",
                            "--set", "memoryReserve=3GiB",
                            "--set", "resourceName=example.com/shared-gpu")
    # The DaemonSet changed in its ConfigMap's name alone.
    assert find(without_hashes(objects), "DaemonSet") == find(without_hashes(defaults),
                                                              "DaemonSet")
    (only,) = configs(objects, tmp_path).values()
    expected = base_config()
    expected["node"] |= {"slices_per_gpu": 4, "resource_name": "example.com/shared-gpu"}
    plugin = next(s for s, v in expected.items() if isinstance(v, dict)
                  and "memory_reserve" in v)
    expected[plugin]["memory_reserve"] = "3GiB"
    assert only == expected


def test_log_level_reaches_every_program(tools: Tools, defaults: list[Obj],
                                         tmp_path: Path) -> None:
    objects = config_change(tools, defaults, "--set", "logLevel=debug")
    (only,) = configs(objects, tmp_path).values()
    sections = [s for s, v in base_config().items() if isinstance(v, dict) and "log_level" in v]
    assert len(sections) >= 2 and all(only[s]["log_level"] == "debug" for s in sections)
    # The config manager (the container that reads the ConfigMap) has no section: its
    # environment says it.
    (manager,) = [c for c in all_containers(objects)
                  if {"name": "GEMINI_LOG_LEVEL", "value": "debug"} in c.get("env", [])]
    configmap = find(objects, "ConfigMap", "gemini-vgpu-config")["metadata"]["name"]
    (volume,) = [v["name"] for v in pod_spec(objects)["volumes"]
                 if v.get("configMap", {}).get("name") == configmap]
    assert volume in {m["name"] for m in manager["volumeMounts"]}


def test_config_and_named_configurations_merge_over_the_default(
        tools: Tools, defaults: list[Obj], tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "slicesPerGpu": 8,
        "config": {"scheduler": {"limit_policy": "strict"}, "devicePlugin": {"ignored_xids": []}},
        "nodeConfigs": {"four-slices": {"node": {"slices_per_gpu": 4}},
                        "spread": {"devicePlugin": {"placement": "spread"}}}}))
    objects = config_change(tools, defaults, "--values", str(values))
    named = configs(objects, tmp_path)
    assert sorted(named) == ["default", "four-slices", "spread"]
    default = base_config()
    default["node"]["slices_per_gpu"] = 8
    default["scheduler"]["limit_policy"] = "strict"
    default["devicePlugin"]["ignored_xids"] = []      # an empty list replaces, as it should
    assert named["default"] == default
    assert named["four-slices"] == {**default, "node": {**default["node"], "slices_per_gpu": 4}}
    assert named["spread"]["devicePlugin"]["placement"] == "spread"
    assert named["spread"]["node"]["slices_per_gpu"] == 8


def test_image_changes_every_container_and_nothing_else(tools: Tools,
                                                        defaults: list[Obj]) -> None:
    digest = "sha256:" + "ab" * 32
    objects = render(tools, "--set", "image.repository=registry.example.com/gemini/vgpu-node",
                     "--set", "image.tag=0.3.0", "--set", f"image.digest={digest}",
                     "--set", "image.pullPolicy=Always",
                     "--set", "imagePullSecrets[0].name=regcred")
    assert changes(defaults, objects) == {"DaemonSet/gemini-vgpu-node": "changed"}
    for container in all_containers(objects):
        assert container["image"] == f"registry.example.com/gemini/vgpu-node:0.3.0@{digest}"
        assert container["imagePullPolicy"] == "Always"
    assert pod_spec(objects)["imagePullSecrets"] == [{"name": "regcred"}]


def test_scheduling_values_change_the_pod_spec_alone(tools: Tools, defaults: list[Obj],
                                                     tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                         "effect": "NoExecute"}],
        "affinity": None, "runtimeClassName": "", "priorityClassName": "gpu-critical"}))
    objects = render(tools, "--values", str(values))
    assert changes(defaults, objects) == {"DaemonSet/gemini-vgpu-node": "changed"}
    spec, before = pod_spec(objects), pod_spec(defaults)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                    "effect": "NoExecute"}]
    assert "affinity" not in spec and "runtimeClassName" not in spec
    assert spec["priorityClassName"] == "gpu-critical"
    changed = {k for k in spec.keys() | before.keys() if spec.get(k) != before.get(k)}
    assert changed == {"nodeSelector", "tolerations", "affinity", "runtimeClassName",
                       "priorityClassName"}


def test_metrics_port_service_and_service_monitor(tools: Tools, defaults: list[Obj]) -> None:
    objects = render(tools, "--set", "metrics.port=9500")
    assert changes(defaults, objects) == {"DaemonSet/gemini-vgpu-node": "changed",
                                          "Service/gemini-vgpu-metrics": "changed"}
    (daemon,) = [c for c in all_containers(objects) if c["name"] == "scheduler"]
    assert daemon["ports"][0]["containerPort"] == 9500
    assert {"name": "GEMINI_METRICS_PORT", "value": "9500"} in daemon["env"]
    service = find(objects, "Service", "gemini-vgpu-metrics")
    assert service["spec"]["ports"][0]["port"] == 9500
    for scraped in (service["metadata"],
                    find(objects, "DaemonSet")["spec"]["template"]["metadata"]):
        assert scraped["annotations"]["prometheus.io/port"] == "9500"

    # The plugin's and the config manager's: each its container and its own Service, nothing else.
    for value, container, service_name, port in (
            ("pluginPort", "device-plugin", "gemini-vgpu-plugin-metrics", 9501),
            ("configManagerPort", "config-manager", "gemini-vgpu-config-metrics", 9502)):
        objects = render(tools, "--set", f"metrics.{value}={port}")
        assert changes(defaults, objects) == {"DaemonSet/gemini-vgpu-node": "changed",
                                              f"Service/{service_name}": "changed"}
        (program,) = [c for c in all_containers(objects) if c["name"] == container]
        assert program["ports"][0]["containerPort"] == port
        assert {"name": "GEMINI_METRICS_PORT", "value": str(port)} in program["env"]
        service = find(objects, "Service", service_name)
        assert service["spec"]["ports"][0]["port"] == port
        assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)

    assert changes(defaults, render(tools, "--set", "metrics.service.enabled=false")) == {
        "Service/gemini-vgpu-metrics": "removed", "Service/gemini-vgpu-plugin-metrics": "removed",
        "Service/gemini-vgpu-config-metrics": "removed"}

    objects = render(tools, "--set", "metrics.serviceMonitor.enabled=true",
                     "--set", "metrics.serviceMonitor.labels.release=prometheus")
    assert changes(defaults, objects) == {"ServiceMonitor/gemini-vgpu": "added"}
    monitor = find(objects, "ServiceMonitor")
    (example,) = parse(SERVICE_MONITOR.read_text())
    assert monitor["spec"] == example["spec"]     # what the kustomize users apply by hand
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert "needs metrics.service.enabled" in refused(
        tools, "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.service.enabled=false")


def test_mqtt_goes_into_the_telemetry_configmap(tools: Tools, defaults: list[Obj]) -> None:
    objects = render(tools, "--set", "mqtt.url=mqtt://broker.example:1883",
                     "--set", "mqtt.topicPrefix=lab", "--set", "mqtt.interval=2.5")
    assert changes(defaults, objects) == {"ConfigMap/gemini-vgpu-telemetry": "changed",
                                          "DaemonSet/gemini-vgpu-node": "changed"}
    telemetry = find(objects, "ConfigMap", "gemini-vgpu-telemetry")
    assert telemetry["data"] == {"GEMINI_MQTT_URL": "mqtt://broker.example:1883",
                                 "GEMINI_MQTT_TOPIC_PREFIX": "lab",
                                 "GEMINI_MQTT_INTERVAL": "2.5"}
    (daemon,) = [c for c in all_containers(objects) if c.get("envFrom")]
    assert daemon["envFrom"] == [{"configMapRef": {"name": telemetry["metadata"]["name"]}}]


def test_the_release_namespace_and_an_existing_one(tools: Tools, defaults: list[Obj]) -> None:
    assert changes(defaults, render(tools, "--set", "namespace.create=false")) == {
        "Namespace/gemini-system": "removed"}
    objects = render(tools, namespace="gpu-sharing")
    assert find(objects, "Namespace")["metadata"]["name"] == "gpu-sharing"
    for obj in objects:
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == "gpu-sharing", obj["metadata"]
    (subject,) = find(objects, "ClusterRoleBinding")["subjects"]
    assert subject["namespace"] == "gpu-sharing"


# ---- the uninstall hook ----

def test_the_uninstall_hook_stops_the_node_pods_with_rights_to_that_alone(
        tools: Tools, defaults: list[Obj]) -> None:
    """A pre-delete Job that deletes the node DaemonSet in the foreground and waits; its
    ServiceAccount's Role grants exactly what gemini-uninstall's calls need, on that DaemonSet
    by name (tests/rollout/test_rbac.py derives the calls)."""
    from tests.rollout.test_rbac import HOOK_CALLERS, needed

    objects = hooks(tools)
    assert sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects) == [
        "Job/gemini-vgpu-uninstall", "Role/gemini-vgpu-uninstall",
        "RoleBinding/gemini-vgpu-uninstall", "ServiceAccount/gemini-vgpu-uninstall"]
    daemonset = find(defaults, "DaemonSet")
    for obj in objects:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert annotations["helm.sh/hook-delete-policy"] == \
            "before-hook-creation,hook-succeeded"
        # The Job after its ServiceAccount and RBAC.
        assert annotations["helm.sh/hook-weight"] == ("0" if obj["kind"] == "Job" else "-5")
        assert obj["metadata"]["namespace"] == NAMESPACE
    (rule,) = find(objects, "Role")["rules"]
    assert rule["resourceNames"] == [daemonset["metadata"]["name"]]
    assert {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]} == needed(HOOK_CALLERS)
    assert find(objects, "RoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "gemini-vgpu-uninstall", "namespace": NAMESPACE}]
    job = find(objects, "Job")["spec"]["template"]["spec"]
    assert job["serviceAccountName"] == "gemini-vgpu-uninstall"
    (container,) = job["containers"]
    assert container["command"] == [
        "gemini-uninstall", f"--namespace={NAMESPACE}",
        f"--daemonset={daemonset['metadata']['name']}", "--timeout=240", "--log-level=info"]
    assert container["image"] == all_containers(defaults)[0]["image"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert job["securityContext"]["runAsNonRoot"] is True
    # Not the node pods' labels: nothing that selects them selects this one.
    assert job.get("nodeSelector") is None
    labels = find(objects, "Job")["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] != \
        daemonset["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]


def test_the_uninstall_hook_follows_the_values_and_can_be_left_out(tools: Tools) -> None:
    objects = hooks(tools, "--set", "image.repository=registry.example.com/vgpu-node",
                    "--set", "uninstall.timeoutSeconds=60", "--set", "logLevel=debug",
                    "--set", "imagePullSecrets[0].name=regcred", namespace="gpu-sharing")
    job = find(objects, "Job")["spec"]["template"]["spec"]
    (container,) = job["containers"]
    assert container["image"].startswith("registry.example.com/vgpu-node:")
    assert "--timeout=60" in container["command"] and "--log-level=debug" in container["command"]
    assert "--namespace=gpu-sharing" in container["command"]
    assert job["imagePullSecrets"] == [{"name": "regcred"}]
    assert hooks(tools, "--set", "uninstall.clearNodes=false") == []
    assert render(tools, "--set", "uninstall.clearNodes=false") == render(tools)


# ---- bad values ----

BAD_VALUES: list[tuple[list[str], str]] = [
    (["--set", "slicesPerGpu=0"], "/slicesPerGpu': minimum"),
    (["--set", "slicesPerGpu=1001"], "/slicesPerGpu': maximum"),
    (["--set", "logLevel=loud"], "/logLevel': value must be one of"),
    (["--set", "memoryReserve=lots"], "'lots' does not match pattern"),
    (["--set", "resourceName=vgpu"], "/resourceName'"),
    (["--set", "resourceName=kubernetes.io/vgpu"], "kubernetes.io is Kubernetes' own domain"),
    (["--set", "image.digest=latest"], "/image/digest'"),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy'"),
    (["--set", "metrics.port=70000"], "/metrics/port': maximum"),
    (["--set", "metrics.configManagerPort=0"], "/metrics/configManagerPort': minimum"),
    (["--set", "mqtt.url=http://broker"], "/mqtt/url'"),
    (["--set", "slicesPerGPU=4"], "additional properties 'slicesPerGPU' not allowed"),
    (["--set", "nodeConfigs.Bad_Name-.node.slices_per_gpu=4"],
     "'Bad_Name-' does not match pattern"),
    (["--set", "mqtt.interval=often"], "/mqtt/interval'"),
    (["--set", "uninstall.timeoutSeconds=1"], "/uninstall/timeoutSeconds': minimum"),
    (["--set", "nodeConfigs.default.node.slices_per_gpu=4"],
     "\"default\" is the default configuration"),
]


@pytest.mark.parametrize(("args", "message"), BAD_VALUES, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_bad_values_fail_naming_the_value(tools: Tools, args: list[str], message: str) -> None:
    error = refused(tools, *args)
    assert message in error, error


def test_lint_refuses_bad_values_too(tools: Tools) -> None:
    result = tools.helm_run("lint", "--strict", str(CHART), "--set", "slicesPerGpu=0",
                            check=False)
    assert result.returncode != 0 and "slicesPerGpu" in result.stdout + result.stderr



def test_the_readmes_helm_commands_use_flags_the_real_helm_has(tools: Tools) -> None:
    """README.md's install, upgrade and uninstall (tests/readme checks their chart and values
    where no helm is built)."""
    from tests.readme import markdown as md

    readme = (REPO / "README.md").read_text()
    commands = [c for c in md.block_commands(readme) + md.inline_commands(readme, ("helm",))
                if c.argv[0] == "helm"]
    assert {c.argv[1] for c in commands} == {"install", "upgrade", "uninstall"}
    # Those with flags (an inline `helm uninstall` only names the verb); the block's three
    # have some, and the inline --no-hooks.
    commands = [c for c in commands if c.flags]
    assert len(commands) >= 4, commands
    for command in commands:
        text = tools.helm_run(command.argv[1], "--help").stdout
        assert command.flags and all(f"{flag} " in text or f"{flag}=" in text
                                     for flag in command.flags), command.text
