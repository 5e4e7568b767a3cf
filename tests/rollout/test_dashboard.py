"""The example Grafana dashboard against what the programs export, scraped over HTTP from the
real device plugin, node daemon and config manager of one emulated node (the config manager
over the fake API server): every series a panel queries is exported by one of them, and every
family they export has a panel. And the names a release
exported stay: a renamed metric keeps its old name for one release (README, "Metrics")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import REPO, child_env
from tests.scrape import free_port, scrape, series_names
from vgpu_runtime.devkit.fakeapi import FakeApiServer
from vgpu_runtime.devkit.plugin_node import plugin_node
from vgpu_runtime.devkit.podnode import PodNode

DASHBOARD = REPO / "daemonset/examples/monitoring/grafana-dashboard.json"
BASE_CONFIG = REPO / "daemonset/base/config/default.yaml"
NAME = re.compile(r"gemini_vgpu_[a-z_]+")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")
# Every series name of the release (0.3), by program. The rule for a rename: export the old name
# beside the new one for a release, move it to DEPRECATED with the release that drops it, and
# drop it from here then; a name may be added here freely.
RELEASED = {
    "gemini-device-plugin": {
        "gemini_vgpu_build_info",
        "gemini_vgpu_plugin_allocate_duration_seconds_bucket",
        "gemini_vgpu_plugin_allocate_duration_seconds_count",
        "gemini_vgpu_plugin_allocate_duration_seconds_sum",
        "gemini_vgpu_plugin_allocations_failed_total",
        "gemini_vgpu_plugin_allocations_served_total",
        "gemini_vgpu_plugin_gpu_draining",
        "gemini_vgpu_plugin_gpu_healthy",
        "gemini_vgpu_plugin_gpu_slices_advertised",
        "gemini_vgpu_plugin_listandwatch_streams",
        "gemini_vgpu_plugin_placements_failed_total",
    },
    "gemini-daemon": {
        "gemini_vgpu_build_info",
        "gemini_vgpu_container_achieved_ratio",
        "gemini_vgpu_container_gpu_seconds_total",
        "gemini_vgpu_container_limit_ratio",
        "gemini_vgpu_container_memory_limit_bytes",
        "gemini_vgpu_container_memory_used_bytes",
        "gemini_vgpu_container_request_ratio",
        "gemini_vgpu_gpu_healthy",
        "gemini_vgpu_gpu_slices",
        "gemini_vgpu_gpu_slices_allocated",
        "gemini_vgpu_gpu_unattributed_memory_bytes",
        "gemini_vgpu_memory_over_limit_kills_total",
        "gemini_vgpu_memory_over_limit_reports_total",
        "gemini_vgpu_memory_refusals_total",
        "gemini_vgpu_memory_unhooked_bytes",
        "gemini_vgpu_token_wait_seconds_bucket",
        "gemini_vgpu_token_wait_seconds_count",
        "gemini_vgpu_token_wait_seconds_sum",
    },
}
# Old name -> (its new name, the release that stops exporting it). None now.
DEPRECATED: dict[str, tuple[str, str]] = {}


def family_of(name: str, families: set[str]) -> str:
    """The family a series name belongs to (a histogram's _bucket, a counter's _total)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


def families_of(names: set[str]) -> set[str]:
    bases = {n[: -len(s)] for n in names for s in SUFFIXES if n.endswith(s)}
    return {family_of(n, bases) for n in names}


@contextlib.contextmanager
def config_manager(root: Path, port: int) -> Iterator[None]:
    """gemini-config-manager as the node pod's sidecar, over the fake API server, with the
    base's default configuration as its ConfigMap."""
    configs = root / "configs"
    configs.mkdir()
    (configs / "default.yaml").write_bytes(BASE_CONFIG.read_bytes())
    with FakeApiServer() as api, open(root / "manager.log", "wb") as log:
        api.add_node("node-1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "vgpu_runtime.configmanager", "--kube-api-url", api.url,
             "--node-name", "node-1", "--source-dir", str(configs), "--output",
             str(root / "config.yaml"), "--metrics-port", str(port), "--metrics-address",
             "127.0.0.1"], cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            yield
        finally:
            proc.terminate()
            assert proc.wait(20) == 0, (root / "manager.log").read_text()


async def exported(root: Path) -> dict[str, set[str]]:
    """Program -> the series names its /metrics offers, from one node of the three programs."""
    plugin_port, daemon_port, manager_port = free_port(), free_port(), free_port()
    async with plugin_node() as node:
        await node.start_plugin(args=["--metrics-port", str(plugin_port),
                                      "--metrics-address", "127.0.0.1"])
        pods = PodNode(node)
        await pods.start_daemon("--metrics-port", str(daemon_port),
                                "--metrics-address", "127.0.0.1", "--simulate-gpus", "2")
        try:
            with config_manager(root, manager_port):
                return {program: series_names(await asyncio.to_thread(scrape, port))
                        for program, port in (("gemini-device-plugin", plugin_port),
                                              ("gemini-daemon", daemon_port),
                                              ("gemini-config-manager", manager_port))}
        finally:
            assert pods.daemon is not None
            pods.daemon.stop()


@pytest.fixture(scope="module")
def by_program(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    return asyncio.run(exported(tmp_path_factory.mktemp("dashboard")))


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every panel's targets and of the template variables."""
    out = [(f"variable {v['name']}", v["query"]) for v in dashboard["templating"]["list"]
           if v.get("type") == "query"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        out += [(panel["title"], target["expr"]) for target in panel["targets"]]
    return out


def test_every_query_names_an_exported_series_and_every_family_has_a_panel(
        by_program: dict[str, set[str]]) -> None:
    assert set(by_program) == {"gemini-device-plugin", "gemini-daemon", "gemini-config-manager"}
    for program, names in by_program.items():
        assert "gemini_vgpu_build_info" in names, f"{program} exports no build info"
        for other, theirs in by_program.items():
            if other != program:
                assert names & theirs == {"gemini_vgpu_build_info"}, (
                    f"{program} and {other}: a name two programs export with different meanings")
    names = set().union(*by_program.values()) - set(DEPRECATED)
    families = families_of(names)
    dashboard = json.loads(DASHBOARD.read_text())
    used = set()
    for title, expr in queries(dashboard):
        for name in NAME.findall(expr):
            assert name in names, f"{title}: {name} is exported by no program ({expr})"
            used.add(family_of(name, families))
    assert used == families, f"series without a panel: {sorted(families - used)}"


def test_no_released_name_disappears(by_program: dict[str, set[str]]) -> None:
    for program, names in RELEASED.items():
        gone = names - by_program[program]
        assert not gone, (f"{program} no longer exports {sorted(gone)}: a renamed metric keeps "
                          "its old name for one release (export both; DEPRECATED says when the "
                          "old one goes)")
    for old, (new, _release) in DEPRECATED.items():
        assert any(old in n and new in n for n in by_program.values()), (old, new)


def test_series_names_map_to_their_families() -> None:
    """What the coverage check counts: a histogram by any of its series, a counter by _total."""
    families = families_of({"gemini_vgpu_a_seconds_bucket", "gemini_vgpu_a_seconds_sum",
                            "gemini_vgpu_a_seconds_count", "gemini_vgpu_b_total",
                            "gemini_vgpu_c"})
    assert families == {"gemini_vgpu_a_seconds", "gemini_vgpu_b", "gemini_vgpu_c"}
    assert family_of("gemini_vgpu_b_total", families) == "gemini_vgpu_b"
    assert family_of("gemini_vgpu_a_seconds_count", families) == "gemini_vgpu_a_seconds"
