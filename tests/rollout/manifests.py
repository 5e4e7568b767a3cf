"""Reading daemonset/: which files are Kubernetes objects, kustomize builds, lookups by name."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.childenv import REPO

DAEMONSET = REPO / "daemonset"
BASE = DAEMONSET / "base"
OVERLAYS = sorted(p.parent for p in (DAEMONSET / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZE_ROOTS = [DAEMONSET, *OVERLAYS]
SCHEMA_VERSION = "1.30.0"

# Objects of custom resource kinds: no schema offline; the tests check them by hand.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

Obj = dict[str, Any]


def is_settings_file(path: Path) -> bool:
    """Program settings (ConfigMap sources) and kustomize's own files are not API objects."""
    return path.name == "kustomization.yaml" or "config" in path.relative_to(DAEMONSET).parts


# The Helm chart: templates, not objects (tests/cluster/test_chart.py renders and checks them).
CHART = DAEMONSET / "chart" / "gemini-vgpu"


def yaml_files() -> list[Path]:
    return sorted(p for p in DAEMONSET.rglob("*") if p.suffix in (".yaml", ".yml")
                  and CHART not in p.parents)


def object_files() -> list[Path]:
    return [p for p in yaml_files() if not is_settings_file(p)]


def load_objects(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def build(root: Path) -> list[Obj]:
    command = kustomize_command()
    assert command is not None
    result = subprocess.run([*command, str(root)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"kustomize build of {root} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[Obj], kind: str, name: str | None = None, prefix: str = "") -> Obj:
    """The one object of `kind` named `name` (any name if None) that starts with `prefix`
    (a generated ConfigMap's name carries a content hash)."""
    matches = [o for o in objects if o["kind"] == kind
               and (name is None or o["metadata"]["name"] == name)
               and o["metadata"]["name"].startswith(prefix)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def containers(daemonset: Obj, init: bool = False) -> dict[str, Obj]:
    spec = daemonset["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers" if init else "containers", [])}


def env(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container.get("env", [])}


def host_volumes(daemonset: Obj) -> dict[str, str]:
    """Volume name -> host path, for the pod's hostPath volumes."""
    return {v["name"]: v["hostPath"]["path"]
            for v in daemonset["spec"]["template"]["spec"]["volumes"] if "hostPath" in v}


def host_mounts(daemonset: Obj, container: Obj) -> Iterator[tuple[str, str, Obj]]:
    """(host path, path in the container, mount) for each hostPath mount of a container."""
    hosts = host_volumes(daemonset)
    for mount in container.get("volumeMounts", []):
        if mount["name"] in hosts:
            yield hosts[mount["name"]], mount["mountPath"], mount


def visible_at_same_path(daemonset: Obj, container: Obj, host_path: str) -> bool:
    """Whether host_path lies in a hostPath mount that the container sees at the same path."""
    path = Path(host_path)
    return any(host == inside and (path == Path(host) or Path(host) in path.parents)
               for host, inside, _ in host_mounts(daemonset, container))
