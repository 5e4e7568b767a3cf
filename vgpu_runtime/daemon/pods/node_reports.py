"""What the daemon tells Kubernetes about its node: the node labels (node.py says which), kept
set, and an Event on the Node when a GPU's change of slices_per_gpu waits for allocations and
when it is done (the plugin, which has no API access, writes what it waits for in slices.json).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vgpu_runtime.daemon.pods.node import SliceCount, SliceCountsFile, node_labels
from vgpu_runtime.gpus import GpuInfo

if TYPE_CHECKING:
    from vgpu_runtime.daemon.pods.kube import KubeApi

log = logging.getLogger(__name__)

LABEL_RETRY_MAX = 30.0   # seconds between tries at most, while the API refuses the labels


@dataclass(frozen=True)
class NodeEvent:
    reason: str
    kind: str      # "Normal" or "Warning"
    message: str


def slice_count_event(uuid: str, before: SliceCount | None, count: SliceCount
                      ) -> NodeEvent | None:
    """The Event GPU `uuid`'s slice count calls for, from what was last reported (None:
    nothing yet) to what slices.json says now; None when there is nothing to say."""
    waiting = count.advertised != count.configured
    if before == count or (before is None and not waiting):
        return None
    if waiting:
        return NodeEvent(
            "SlicesPerGpuChangeWaiting", "Warning",
            f"GPU {uuid} keeps {count.advertised} slices, not the configured "
            f"{count.configured}, until allocation(s) "
            f"{', '.join(count.waiting_for) or '(unreadable records)'} end: kubelet names its "
            "devices in running pods; it takes no new pod meanwhile")
    if before is not None and before.advertised != count.advertised:
        return NodeEvent("SlicesPerGpuChanged", "Normal",
                         f"GPU {uuid} is now cut into {count.configured} slices")
    return None


class NodeReports:
    def __init__(self, kube: KubeApi, node_name: str) -> None:
        self.kube = kube
        self.node_name = node_name

    async def keep_labels(self, gpus: list[GpuInfo], slices_per_gpu: Callable[[], int],
                          interval: float) -> None:
        """Set the labels that differ, every `interval` (sooner again after a failure)."""
        while True:
            wanted = node_labels(gpus, slices_per_gpu())
            try:
                current = await self.kube.node_labels(self.node_name)
                change = {k: v for k, v in wanted.items() if current.get(k) != v}
                if change:
                    await self.kube.patch_node_labels(self.node_name, change)
                    log.info("node labels set", extra={"node": self.node_name,
                                                       "labels": change})
                delay = interval
            except Exception as err:
                log.warning("cannot label the node; trying again", extra={
                    "node": self.node_name, "error": str(err)})
                delay = min(LABEL_RETRY_MAX, interval)
            await asyncio.sleep(delay)

    async def report_slice_counts(self, counts: SliceCountsFile, interval: float = 1.0) -> None:
        """Post slice_count_event's Events as slices.json changes; one that cannot be posted
        is tried again at the next look."""
        reported: dict[str, SliceCount] = {}
        while True:
            for uuid, count in counts.read().items():
                event = slice_count_event(uuid, reported.get(uuid), count)
                if event is not None:
                    try:
                        await self.kube.post_node_event(self.node_name, event.reason,
                                                        event.message, kind=event.kind)
                    except Exception as err:
                        log.warning("cannot post an Event on the node; trying again", extra={
                            "error": str(err), "reason": event.reason})
                        break
                    log.info("node event posted", extra={"reason": event.reason, "gpu": uuid})
                reported[uuid] = count
            await asyncio.sleep(interval)
