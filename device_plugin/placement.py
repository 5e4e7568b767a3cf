"""GetPreferredAllocation policy, as pure functions over slice IDs.

The default scheduler only counts slices per node, so the plugin decides where they go:
- k <= N (N slices per GPU): all k slices from one GPU. `best-fit` takes the GPU with the
  fewest available slices that still hold k, keeping large holes free for large requests;
  `spread` takes the GPU with the most available slices. Ties go to the lowest GPU index.
  Every must-include slice has to be on the chosen GPU.
- k > N: whole GPUs only, so k must be a multiple of N and each chosen GPU must have all N
  slices available (a GPU still cut into another count while it waits for a change of N,
  device_plugin.slicecounts, is not one of them). GPUs holding must-include slices are chosen
  first, then lowest index.
Within a GPU, the must-include slices plus the lowest-numbered available ones, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from device_plugin.slices import Slice, SliceTable, brief_ids


class PlacementError(ValueError):
    """No answer; the message says exactly why (kubelet shows it on the pod).

    `exhausted` is True when the request is sound but too few slices are free right now.
    """

    def __init__(self, message: str, exhausted: bool = False) -> None:
        super().__init__(message)
        self.exhausted = exhausted


def _group_by_gpu(slices: Sequence[Slice]) -> dict[str, list[Slice]]:
    """Slices already in table order, grouped by GPU (groups in GPU index order)."""
    groups: dict[str, list[Slice]] = {}
    for item in slices:
        groups.setdefault(item.gpu.uuid, []).append(item)
    return groups


def _check_known(table: SliceTable, ids: Sequence[str], what: str) -> None:
    unknown = table.unknown(ids)
    if unknown:
        raise PlacementError(f"{what} device ID(s) not served by this plugin: "
                             f"{brief_ids(sorted(unknown))}")


def _resolve(table: SliceTable, ids: Sequence[str], what: str) -> list[Slice]:
    """The slices named, once each, in the order given."""
    _check_known(table, ids, what)
    return [s for s in (table.get(d) for d in dict.fromkeys(ids)) if s is not None]


def _resolve_in_order(table: SliceTable, ids: Sequence[str], what: str) -> list[Slice]:
    """The slices named, once each, in table order (kubelet sends all available IDs, 800 on
    a full node: one sort by a precomputed rank, no per-ID key tuples)."""
    try:
        return table.in_order(set(ids))
    except KeyError:
        _check_known(table, ids, what)
        raise


def preferred(table: SliceTable, available_ids: Sequence[str], must_include_ids: Sequence[str],
              size: int, policy: str = "best-fit") -> list[str]:
    """The slice IDs to give a container asking for `size` slices; raises PlacementError."""
    per_gpu = table.per_gpu
    if size < 1:
        raise PlacementError(f"allocation size must be at least 1, got {size}")
    available = _resolve_in_order(table, available_ids, "available")
    must = _resolve(table, must_include_ids, "must-include")
    available_set = {s.id for s in available}
    missing = [s.id for s in must if s.id not in available_set]
    if missing:
        raise PlacementError(f"must-include device(s) are not available: "
                             f"{brief_ids(missing)}")
    if len(must) > size:
        raise PlacementError(f"{len(must)} must-include devices exceed the requested {size}")
    groups = _group_by_gpu(available)
    index = {g.uuid: g.index for g in table.gpus}
    if size <= per_gpu:
        return _one_gpu(groups, index, must, size, per_gpu, policy)
    return _whole_gpus(groups, index, must, size, per_gpu, table.counts)


def _pick(group: list[Slice], must: list[Slice], count: int) -> list[str]:
    must_ids = {s.id for s in must}
    rest = [s.id for s in group if s.id not in must_ids]
    chosen = must_ids | set(rest[: count - len(must_ids)])
    return [s.id for s in group if s.id in chosen]


def _one_gpu(groups: dict[str, list[Slice]], index: dict[str, int], must: list[Slice],
             size: int, per_gpu: int, policy: str) -> list[str]:
    must_gpus = {s.gpu.uuid for s in must}
    if len(must_gpus) > 1:
        raise PlacementError(f"must-include devices span {len(must_gpus)} GPUs, but a request of "
                             f"{size} slice(s) must come from one GPU")
    candidates = [u for u, g in groups.items() if len(g) >= size and
                  (not must_gpus or u in must_gpus)]
    if not candidates:
        most = max((len(g) for g in groups.values()), default=0)
        where = f" on GPU {next(iter(must_gpus))} (must-include)" if must_gpus else ""
        raise PlacementError(
            f"no GPU has {size} free slices{where}: the most free on one GPU is {most} of "
            f"{per_gpu}; a request of {size} must fit on one GPU. Ask for fewer slices or wait "
            "for running pods to finish", exhausted=True)
    if policy == "spread":
        chosen = min(candidates, key=lambda u: (-len(groups[u]), index[u]))
    else:
        chosen = min(candidates, key=lambda u: (len(groups[u]), index[u]))
    return _pick(groups[chosen], must, size)


def _whole_gpus(groups: dict[str, list[Slice]], index: dict[str, int], must: list[Slice],
                size: int, per_gpu: int, counts: dict[str, int]) -> list[str]:
    if size % per_gpu:
        raise PlacementError(
            f"a request of {size} slices is more than one GPU ({per_gpu} slices) and not a "
            f"multiple of {per_gpu}: ask for at most {per_gpu} slices, or for whole GPUs "
            f"({per_gpu}, {2 * per_gpu}, ...)")
    wanted = size // per_gpu
    free = sorted((u for u, g in groups.items() if len(g) == per_gpu == counts[u]),
                  key=index.__getitem__)
    must_gpus = sorted({s.gpu.uuid for s in must}, key=index.__getitem__)
    busy = [u for u in must_gpus if u not in free]
    if busy:
        raise PlacementError(f"must-include GPU(s) {', '.join(busy)} are not wholly free, but "
                             f"a request of {size} slices takes whole GPUs", exhausted=True)
    if len(must_gpus) > wanted:
        raise PlacementError(f"must-include devices span {len(must_gpus)} GPUs, more than the "
                             f"{wanted} whole GPU(s) requested")
    chosen = must_gpus + [u for u in free if u not in must_gpus][: wanted - len(must_gpus)]
    if len(chosen) < wanted:
        raise PlacementError(f"a request of {size} slices needs {wanted} wholly free GPUs; only "
                             f"{len(free)} GPU(s) have all {per_gpu} slices free", exhausted=True)
    return [s.id for u in sorted(chosen, key=index.__getitem__) for s in groups[u]]
