"""One source for every figure the daemon reports: `gemini-vgpu status`, `/metrics` and MQTT.

The daemon's status answer (Daemon.status, also what the control socket returns) holds the
allocations, every GPU's token state and the node's GPUs; the functions here only reshape it
into rows, so the three views always agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ContainerRow:
    """One allocation on one GPU: a container's figures there."""
    pod: str
    namespace: str
    container: str
    allocation: str
    gpu: str
    share: float
    limit: float
    achieved: float
    memory_used: int
    memory_limit: int
    memory_refusals: int
    waits: dict[str, Any]           # WaitHistogram.snapshot()
    holder: bool
    over_limit_reports: int = 0     # processes found past the limit by per-process figures
    over_limit_kills: int = 0       # processes killed for it (over_limit_action kill)
    unhooked_bytes: int = 0         # charged for processes with no connection (NVML's figure)
    gpu_seconds: float = 0.0        # GPU time charged since it joined the GPU (a counter)

    def usage(self) -> dict[str, Any]:
        """The MQTT usage document."""
        return {"pod": self.pod, "namespace": self.namespace, "container": self.container,
                "allocation": self.allocation, "gpu": self.gpu, "request": self.share,
                "limit": self.limit, "achieved": self.achieved,
                "memory_used_bytes": self.memory_used, "memory_limit_bytes": self.memory_limit,
                "memory_refusals": self.memory_refusals, "token_waits": self.waits["count"],
                "token_wait_seconds": self.waits["sum"]}


@dataclass(frozen=True)
class GpuRow:
    uuid: str
    model: str
    slices: int
    slices_allocated: int
    healthy: bool
    reason: str
    unattributed_bytes: int = 0     # held by processes of no allocation (NVML's figures)


def container_rows(status: dict[str, Any]) -> list[ContainerRow]:
    allocations = {a["id"]: a for a in status.get("allocations", [])}
    rows = []
    for gpu in status.get("gpus", []):
        for tenant in gpu["tenants"]:
            entry = allocations.get(tenant["allocation"])
            if entry is None:
                continue
            pod = entry.get("pod") or {}
            index = tenant["gpu_index"]
            refusals = entry["gpus"][index].get("memory_refusals", 0)
            shown = entry["gpus"][index]
            over_limit = shown.get("over_limit_reports", 0)
            rows.append(ContainerRow(
                pod=pod.get("name", ""), namespace=pod.get("namespace", ""),
                container=pod.get("container", "") or _unbound_name(entry),
                allocation=entry["id"], gpu=gpu["uuid"], share=tenant["request"],
                limit=tenant["limit"], achieved=tenant["achieved"],
                memory_used=tenant["memory_used"], memory_limit=tenant["memory_limit"],
                memory_refusals=refusals, waits=tenant["waits"], holder=tenant["holder"],
                over_limit_reports=over_limit, over_limit_kills=shown.get("over_limit_kills", 0),
                unhooked_bytes=sum(p["process_bytes"] for p in shown.get("unhooked", [])),
                gpu_seconds=tenant["charged_s"]))
    return rows


def _unbound_name(entry: dict[str, Any]) -> str:
    """No pod (gemini-run, or not bound yet): name what it is."""
    if entry.get("owner_pid"):
        return f"{entry['origin']}-{entry['owner_pid']}"
    return str(entry.get("origin", ""))


def gpu_rows(status: dict[str, Any]) -> list[GpuRow]:
    node = status.get("node", {})
    unattributed: dict[str, int] = {}
    for process in status.get("unattributed", []):
        unattributed[process["gpu"]] = unattributed.get(process["gpu"], 0) + process[
            "process_bytes"]
    return [GpuRow(g["uuid"], g.get("model", ""), g["slices"], g["slices_allocated"],
                   g["healthy"], g.get("reason", ""), unattributed.get(g["uuid"], 0))
            for g in node.get("gpus", [])]
