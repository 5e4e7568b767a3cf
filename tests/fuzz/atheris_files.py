#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the parsers that read files and pod metadata.

The first input byte picks the target, the rest is its input:

0. an allocation record file (`allocation.read_record` on a real file named for a valid id):
   a record the daemon can rely on, or `RecordError`;
1. a YAML configuration file (`config.load_file` + `config.resolve` for the scheduler's and the
   plugin's settings): a config, or `ConfigError` naming the file or the key;
2. the pod annotations `gemini.ai/vgpu-limit` and `gemini.ai/vgpu-memory` applied to a record:
   never raises, never grants more than the defaults, and what it applies round-trips;
3. `parse_size` and `parse_limit` on one string: a value in range, or `ValueError` with a reason.

Any other exception, or a broken promise, is a crash and atheris saves the input.

    /work/venv/bin/python tests/fuzz/atheris_files.py -max_total_time=180 [CORPUS_DIR ...]

With no corpus directory a temporary one is seeded with a valid record, config and annotations.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import atheris

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

with atheris.instrument_imports(include=["vgpu_runtime", "vgpu_runtime.pluginconfig"]):
    from vgpu_runtime import hooklib
    from vgpu_runtime.common.sizes import parse_size
    from vgpu_runtime.contracts import allocation, paths
    from vgpu_runtime.contracts.allocation import (
        AllocationRecord,
        Binding,
        GpuShare,
        PodRef,
        RecordError,
    )
    from vgpu_runtime.contracts.share import Share
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.daemon.pods import annotations as pod_annotations
    from vgpu_runtime.pluginconfig import PluginConfig

from tests.fuzz.atheris_main import fuzz  # noqa: E402
from tests.fuzz.promises import check_accepted_record, check_config_file  # noqa: E402

GiB = 1 << 30
ROOT = Path(tempfile.mkdtemp(prefix="atheris-files-"))
RECORD = AllocationRecord(
    id=allocation.id_for_devices(("GPU-a::0",)), origin="kubelet", device_ids=("GPU-a::0",),
    gpus=(GpuShare("GPU-a", 0, Share.from_float(0.3), 3 * GiB),),
    channel_dir=str(paths.channel_dir(ROOT, allocation.id_for_devices(("GPU-a::0",)))),
    hook_library=hooklib.library_name(), created_at=1.0e9)
RECORD_PATH = allocation.record_path(ROOT, RECORD.id)
CONFIG_PATH = ROOT / "config.yaml"
SEPARATOR = b"\n--\n"   # splits the annotation target's input into its two values


def record_file(data: bytes) -> None:
    RECORD_PATH.parent.mkdir(parents=True, exist_ok=True)
    RECORD_PATH.write_bytes(data)
    try:
        record = allocation.read_record(RECORD_PATH)
    except RecordError as err:
        assert str(err)
        return
    assert record.id == RECORD.id
    check_accepted_record(record)
    assert AllocationRecord.from_json(json.loads(json.dumps(record.to_json()))) == record


def config_file(data: bytes) -> None:
    CONFIG_PATH.write_bytes(data)
    for config_class in (DaemonConfig, PluginConfig):
        check_config_file(CONFIG_PATH, config_class)


def annotations(data: bytes) -> None:
    limit, _, memory = data.decode("utf-8", "replace").partition(SEPARATOR.decode())
    given = {pod_annotations.LIMIT_ANNOTATION: limit, pod_annotations.MEMORY_ANNOTATION: memory}
    overrides = pod_annotations.overrides_of(RECORD, given)
    assert overrides.limit is None or 0.3 - 1e-9 <= overrides.limit <= 1, overrides
    assert overrides.memory_limit is None or 0 < overrides.memory_limit <= 3 * GiB, overrides
    binding = Binding(RECORD.id, PodRef("ns", "pod", "c"), overrides.limit,
                      overrides.memory_limit)
    assert Binding.from_json(json.loads(json.dumps(binding.to_json()))) == binding


def sizes(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        size = parse_size(text)
    except ValueError as err:
        assert "size" in str(err), err
    else:
        assert isinstance(size, int) and size >= 0
    try:
        limit = pod_annotations.parse_limit(text)
    except ValueError as err:
        assert pod_annotations.LIMIT_ANNOTATION in str(err), err
    else:
        assert 0 < limit <= 1


TARGETS = (record_file, config_file, annotations, sizes)


def test_one_input(data: bytes) -> None:
    if data:
        TARGETS[data[0] % len(TARGETS)](data[1:])


def seed_corpus(directory: Path) -> None:
    seeds = [
        bytes([0]) + json.dumps(RECORD.to_json()).encode(),
        bytes([1]) + b"slices_per_gpu: 10\nwindow: 0.1\nmin_quota: 0.002\nlog_level: info\n",
        bytes([1]) + b"state_dir: /var/lib/gemini\nplacement: spread\nmemory_reserve: 1GiB\n",
        bytes([2]) + b"50%" + SEPARATOR + b"2GiB",
        bytes([2]) + b"0.4" + SEPARATOR + b"512Mi",
        bytes([3]) + b"1.5GiB",
    ]
    for n, seed in enumerate(seeds):
        (directory / f"seed-{n}").write_bytes(seed)


def main() -> None:
    fuzz("atheris-files", test_one_input, seed_corpus, max_len=4096)


if __name__ == "__main__":
    main()
