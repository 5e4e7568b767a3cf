"""`kubectl describe node`-style text for the emulated node's extended resources."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vgpu_runtime.devkit.kubelet_emulator.emulator import KubeletEmulator


def _block(title: str, values: dict[str, int]) -> list[str]:
    width = max((len(name) for name in values), default=0) + 1
    lines = [f"{title}:"]
    lines += [f"  {name + ':':<{width}}  {value}" for name, value in sorted(values.items())]
    return lines


def describe_node(emulator: KubeletEmulator, node_name: str = "emulated-node") -> str:
    resources = sorted(emulator.resources())
    lines = [f"Name:               {node_name}"]
    lines += _block("Capacity", {r: emulator.capacity(r) for r in resources})
    lines += _block("Allocatable", {r: emulator.allocatable(r) for r in resources})
    pods = emulator.running_pods()
    lines.append(f"Non-terminated Pods:          ({len(pods)} in total)")
    if pods:
        lines.append("  Namespace                  Name                 " + "  ".join(resources))
        for pod in pods:
            counts = "  ".join(str(pod.requested()) if pod.resource == r else "0"
                               for r in resources)
            lines.append(f"  {pod.namespace:<26} {pod.name:<20} {counts}")
    lines.append("Allocated resources:")
    lines.append("  Resource        Requests  Limits")
    lines.append("  --------        --------  ------")
    for resource in resources:
        used = sum(p.requested() for p in pods if p.resource == resource)
        lines.append(f"  {resource:<15} {used:<9} {used}")
    return "\n".join(lines)
