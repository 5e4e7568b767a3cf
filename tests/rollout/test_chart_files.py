"""daemonset/chart/gemini-vgpu without Helm: its version, image and default configuration are the
project's, and its values schema says what the code accepts. Rendering, linting and installing
it with the real Helm are the cluster lane's (tests/cluster/test_chart.py, test_helm.py), where
Helm is built."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.rollout import manifests as m
from vgpu_runtime import __version__
from vgpu_runtime.common.sizes import parse_size
from vgpu_runtime.contracts import paths

CHART = m.CHART


def chart_yaml(name: str) -> Any:
    return yaml.safe_load((CHART / name).read_text())


def validator() -> Any:
    jsonschema = pytest.importorskip(
        "jsonschema", reason="jsonschema (with kubernetes-validate, a test extra) is missing")
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_chart_version_and_app_version_are_the_package_version() -> None:
    chart = chart_yaml("Chart.yaml")
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__)


def test_default_image_is_the_bases() -> None:
    """The values name the base's image; an empty tag is the appVersion, the base's tag."""
    (image,) = yaml.safe_load((m.BASE / "node" / "kustomization.yaml").read_text())["images"]
    values = chart_yaml("values.yaml")["image"]
    assert values["repository"] == image["newName"]
    assert values["tag"] == "" and image["newTag"] == chart_yaml("Chart.yaml")["appVersion"]


def test_the_default_configuration_is_the_base_file_itself() -> None:
    """One file, not a copy: the chart's files/default.yaml links to the base's."""
    link = CHART / "files" / "default.yaml"
    assert link.is_symlink()
    assert link.resolve() == (m.BASE / "config" / "default.yaml").resolve()


def test_values_yaml_meets_its_schema_and_the_schema_refuses_unknown_keys() -> None:
    check = validator()
    values = chart_yaml("values.yaml")
    assert not list(check.iter_errors(values))
    assert not check.is_valid({**values, "slicesPerGPU": 4})           # a misspelt key
    assert not check.is_valid({**values, "image": {**values["image"], "tags": "1"}})


def test_schema_limits_are_the_codes() -> None:
    """slicesPerGpu's bounds and memoryReserve's grammar are what the programs accept."""
    check = validator()
    values = chart_yaml("values.yaml")
    for slices, ok in ((1, True), (paths.MAX_SLICES_PER_GPU, True), (0, False),
                       (paths.MAX_SLICES_PER_GPU + 1, False)):
        assert check.is_valid({**values, "slicesPerGpu": slices}) is ok, slices
    for size in ("2GiB", "1500MiB", "2G", "0.5Gi", "4096", "3tb", "7 KiB", 1 << 30, "lots",
                 "2 GiBs", "-1", "1.5.2G", "", "GiB"):
        try:
            parse_size(size)
            accepted = True
        except ValueError:
            accepted = False
        assert check.is_valid({**values, "memoryReserve": size}) is accepted, size
