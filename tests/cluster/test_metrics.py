"""The node pod's three metrics ports on the real cluster, reached as Prometheus reaches them:
through each headless metrics Service's EndpointSlices (the pod's IP, and the port the
endpoints controller resolved from the container's port name: the config manager's is a
sidecar's), scraped from the host over the pod network. Each program says
gemini_vgpu_build_info with the image's version and interposer, and what it does on this node:
the plugin its slices and the real kubelet's ListAndWatch stream, the daemon its GPUs, the
config manager the configuration it applied."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.conftest import (
    NAMESPACE,
    SIMULATED_GPUS,
    SLICES_PER_GPU,
    Cluster,
    node_pod,
    wait_until,
)
from tests.scrape import fetch, samples, value
from vgpu_runtime import __version__, hooklib

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(5400)]

# Service -> the program behind its port (daemonset/base/service.yaml).
SERVICES = {"gemini-vgpu-metrics": "gemini-daemon",
            "gemini-vgpu-plugin-metrics": "gemini-device-plugin",
            "gemini-vgpu-config-metrics": "gemini-config-manager"}


def ready_endpoints(cluster: Cluster, service: str) -> list[tuple[str, int]]:
    """(address, port) of every ready endpoint of the Service's EndpointSlices."""
    slices = cluster.get("endpointslices", "-n", NAMESPACE, "-l",
                         f"kubernetes.io/service-name={service}")
    found = []
    for piece in slices["items"]:
        ports = [int(p["port"]) for p in piece.get("ports") or []]
        for endpoint in piece.get("endpoints") or []:
            if endpoint.get("conditions", {}).get("ready"):
                found += [(address, port) for address in endpoint["addresses"]
                          for port in ports]
    return found


def scraped(cluster: Cluster, service: str) -> tuple[str, dict[str, Any]]:
    """The Service's one endpoint (the node pod's IP, the Service's port) and its samples."""
    pod = node_pod(cluster)
    assert pod is not None
    spec = cluster.get("service", "-n", NAMESPACE, service)
    (port,) = [int(p["port"]) for p in spec["spec"]["ports"]]
    assert spec["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    (endpoint,) = wait_until(f"{service}'s endpoint", lambda: ready_endpoints(cluster, service),
                             60, lambda: str(cluster.get("endpointslices", "-n", NAMESPACE)))
    assert endpoint == (pod["status"]["podIP"], port), endpoint

    url = f"http://{endpoint[0]}:{endpoint[1]}/metrics"

    def answer() -> str | None:
        try:
            status, text = fetch(url)
        except OSError as err:
            raise AssertionError(f"{url}: {err}") from None
        return text if status == 200 else None
    return url, samples(wait_until(f"{url} ({service})", answer, 60))


@pytest.mark.parametrize("service", list(SERVICES))
def test_each_programs_metrics_port_is_reached_through_its_service(gemini_node: Cluster,
                                                                   service: str) -> None:
    url, found = scraped(gemini_node, service)
    (info,) = found["gemini_vgpu_build_info"]
    assert info.labels == {"version": __version__, "interposer": hooklib.library_name(),
                           "program": SERVICES[service]}, (url, info)
    assert info.value == 1
    slices = SIMULATED_GPUS * SLICES_PER_GPU
    if service == "gemini-vgpu-plugin-metrics":
        advertised = found["gemini_vgpu_plugin_gpu_slices_advertised"]
        assert sum(s.value for s in advertised) == slices, advertised
        # The real kubelet listens to the plugin it registered.
        assert value(found, "gemini_vgpu_plugin_listandwatch_streams") >= 1
    elif service == "gemini-vgpu-metrics":
        assert sum(s.value for s in found["gemini_vgpu_gpu_slices"]) == slices
    else:
        # The overlay's node has no gemini.ai/vgpu.config label: the default, in its file.
        assert value(found, "gemini_vgpu_config_manager_configuration_applied",
                     config="default") == 1
