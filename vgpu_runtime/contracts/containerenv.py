"""What a container is given, built once for both allocators (the plugin's Allocate and
gemini-run): the memory its share entitles it to, and the environment of its processes.

Memory: a share of a GPU is entitled to floor((total - reserve) x share) bytes, computed exactly
(a Share is exact: 2/10 and 1/5 give the same bytes); whole GPUs to total - reserve each. The
plugin passes its memory_reserve, gemini-run none, so the same share of the same GPU gives the
same limit from either allocator.
"""

from __future__ import annotations

from vgpu_runtime.contracts import paths
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.contracts.share import Share


def entitled_memory(memory_total: int, reserve: int, share: Share) -> int:
    """The memory limit a share of a GPU gives: floor((total - reserve) x share)."""
    usable = memory_total - reserve
    if usable <= 0:
        raise ValueError(f"a reserve of {reserve} bytes leaves nothing of {memory_total} bytes")
    return usable * share.value.numerator // share.value.denominator


def container_environment(record: AllocationRecord, channel_dir: str) -> dict[str, str]:
    """The variables every allocation's processes get, from its record: the two the hook reads
    to find its channel (`channel_dir` as the container sees it), the GPUs CUDA may use, and the
    share and entitled memory limit of the first GPU, for the workload to read (the hook never
    does: see paths.ENV_SHARE)."""
    first = record.gpus[0]
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in record.gpus),
        paths.ENV_CHANNEL_DIR: channel_dir,
        paths.ENV_ALLOCATION_ID: record.id,
        paths.ENV_SHARE: repr(first.share.to_float()),
        paths.ENV_MEMORY_LIMIT: str(first.memory_limit),
    }
