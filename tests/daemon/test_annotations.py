"""Per-pod annotations: what is accepted as an override, and that a bad value overrides nothing."""

from __future__ import annotations

import pytest

from tests.daemon.helpers import UUID_A
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon.pods.annotations import overrides_of, parse_limit
from vgpu_runtime.daemon.pods.node import label_value, node_labels
from vgpu_runtime.gpus import GpuInfo

GiB = 1 << 30


def _record(share: float = 0.3, memory: int = 12 * GiB) -> AllocationRecord:
    return AllocationRecord(id="k-0123456789abcdef", origin="kubelet", device_ids=("d",),
                            gpus=(GpuShare(UUID_A, 0, Share.from_float(share), memory),),
                            channel_dir="/x",
                            hook_library="lib", created_at=1.0)


@pytest.mark.parametrize(("text", "value"), [("0.5", (1, 2)), ("50%", (1, 2)), (" 1 ", (1, 1)),
                                             ("100%", (1, 1)), ("0.3", (3, 10)),
                                             ("33.3%", (333, 1000))])
def test_limit_forms(text: str, value: tuple[int, int]) -> None:
    """Exact: 30% is 3/10, as 0.3 is."""
    assert parse_limit(text) == Share.of_slices(*value)


@pytest.mark.parametrize("text", ["0", "-0.1", "1.5", "150%", "nan", "half", "", "%"])
def test_bad_limits_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"gemini\.ai/vgpu-limit"):
        parse_limit(text)


def test_valid_annotations_apply() -> None:
    overrides = overrides_of(_record(), {"gemini.ai/vgpu-limit": "0.6",
                                         "gemini.ai/vgpu-memory": "4GiB"})
    assert overrides.problems == ()
    assert overrides.limit == Share.parse("0.6") and overrides.memory_limit == 4 * GiB


@pytest.mark.parametrize(("annotations", "expect"), [
    ({"gemini.ai/vgpu-limit": "0.2"}, "below the pod's request of 0.3"),
    ({"gemini.ai/vgpu-memory": "13GiB"}, "at most the slices' default"),
    ({"gemini.ai/vgpu-memory": "0"}, "more than 0"),
    ({"gemini.ai/vgpu-memory": "four gigs"}, "expected a size"),
])
def test_invalid_annotations_change_nothing(annotations: dict[str, str], expect: str) -> None:
    overrides = overrides_of(_record(), annotations)
    assert overrides.limit is None and overrides.memory_limit is None
    (problem,) = overrides.problems
    assert expect in problem and "ignored" in problem


def test_one_bad_annotation_does_not_stop_the_other() -> None:
    overrides = overrides_of(_record(), {"gemini.ai/vgpu-limit": "2",
                                         "gemini.ai/vgpu-memory": "1GiB"})
    assert overrides.limit is None and overrides.memory_limit == GiB
    assert len(overrides.problems) == 1


def test_labels_are_valid_label_values() -> None:
    assert label_value("NVIDIA H200 NVL (141GB)") == "NVIDIA-H200-NVL-141GB"
    assert len(label_value("x" * 100)) == 63
    gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", model="NVIDIA H200", memory_total=1, minor=i,
                    numa_node=None) for i in range(2)]
    labels = node_labels(gpus, 10)
    assert labels["gemini.ai/gpu.model"] == "NVIDIA-H200"
    assert labels["gemini.ai/gpu.count"] == "2"
    assert labels["gemini.ai/vgpu.slices-per-gpu"] == "10"


def test_memory_annotation_is_checked_against_the_entitlement() -> None:
    assert overrides_of(_record(), {"gemini.ai/vgpu-memory": "12GiB"}).memory_limit == 12 * GiB
    (problem,) = overrides_of(_record(memory=2 * GiB),
                              {"gemini.ai/vgpu-memory": "4GiB"}).problems
    assert "at most the slices' default of 2.0 GiB (2147483648 bytes)" in problem
