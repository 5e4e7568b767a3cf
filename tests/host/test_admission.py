"""Admission across users (daemon/host/admission.py): shares and memory from one set of
allocations; --overcommit over one's own only; other users counted, never named."""

from __future__ import annotations

import pytest

from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.host.admission import Admitted, Ask, Held, Refused, admit
from vgpu_runtime.daemon.host.server import _ask
from vgpu_runtime.gpus import GpuInfo

GB = 1000**3
GPUS = [GpuInfo(index=i, uuid=f"GPU-{i}", model="m", memory_total=100 * GB, minor=i,
                numa_node=0) for i in range(2)]
ALICE, BOB = 1001, 1002


def part(text: str) -> Share:
    return Share.parse(text)


def held(*entries: tuple[str, int | None, float, int]) -> dict[str, list[Held]]:
    """(gpu uuid, uid, share, memory GB) each."""
    out: dict[str, list[Held]] = {}
    for n, (uuid, uid, share, memory) in enumerate(entries):
        out.setdefault(uuid, []).append(Held(f"r-{n:016x}", uid, Share.from_float(share),
                                                          memory * GB))
    return out


def test_the_default_gpu_is_the_first_with_room_for_share_and_memory() -> None:
    taken = held(("GPU-0", ALICE, 0.5, 90))
    # Time would fit on GPU 0, memory would not: GPU 1.
    assert admit(Ask(BOB, None, part("0.3"), None, 20 * GB), GPUS, taken) == Admitted(GPUS[1],
                                                                                     20 * GB)
    # The share's part of the memory when none is asked.
    assert admit(Ask(BOB, None, part("0.1"), None, None), GPUS, taken) == Admitted(GPUS[0], 10 * GB)


def test_another_users_allocations_bound_both_and_are_not_named() -> None:
    taken = held(("GPU-0", ALICE, 0.7, 80))
    for ask in (Ask(BOB, "0", part("0.4"), None, 10 * GB),
                Ask(BOB, "0", part("0.2"), None, 30 * GB),
                Ask(BOB, "GPU-0", part("0.4"), None, None, overcommit=True)):
        with pytest.raises(Refused) as refused:
            admit(ask, GPUS, taken)
        said = str(refused.value)
        assert "1 of other users: 0.7 (74.5 GiB)" in said and "r-0" not in said
        assert "--overcommit cannot help" in said


def test_overcommit_passes_the_bounds_over_ones_own_allocations_only() -> None:
    mine = held(("GPU-0", ALICE, 0.7, 80))
    asked = Ask(ALICE, "0", part("0.7"), None, 80 * GB, overcommit=True)
    assert admit(asked, GPUS, mine).gpu == GPUS[0]
    with pytest.raises(Refused) as refused:
        admit(Ask(ALICE, "0", part("0.7"), None, None), GPUS, mine)
    assert "yours: r-0000000000000000 0.7" in str(refused.value)
    assert "or pass --overcommit" in str(refused.value)


@pytest.mark.parametrize(("ask", "message"), [
    (Ask(ALICE, None, part("0.5"), part("0.4"), None), "must be in [share, 1]"),
    (Ask(ALICE, None, part("0.5"), None, 0), "more than 0 bytes"),
    (Ask(ALICE, "7", part("0.5"), None, None), "no GPU '7'"),
])
def test_bad_asks_are_refused_with_a_reason(ask: Ask, message: str) -> None:
    with pytest.raises(Refused) as refused:
        admit(ask, GPUS, {})
    assert message in str(refused.value)


@pytest.mark.parametrize(("request_", "message"), [
    ({"share": 0.0}, "share: 0.0 is outside (0, 1]"),
    ({"share": 1.5}, "share: 1.5 is outside (0, 1]"),
    ({"share": "half"}, "share: a share must be a number, got 'half'"),
    ({"share": True}, "share: a share must be a number"),
    ({"share": 0.5, "limit": 0.4}, "must be in [share, 1]"),
])
def test_bad_requests_are_refused_where_they_are_read(request_: dict[str, object],
                                                      message: str) -> None:
    """The host's edge reads a share once; admission then holds only valid ones."""
    with pytest.raises(Refused) as refused:
        _ask(request_, ALICE)
    assert message in str(refused.value)
    assert _ask({"share": 0.25}, ALICE) == Ask(ALICE, None, part("0.25"), None, None)
    assert _ask({}, ALICE).share == part("1")   # a whole GPU when none is asked
