"""What a parser promises on any input, checked the same way by the hypothesis tests and the
atheris harnesses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import allocation
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.contracts.share import Share


def check_accepted_record(record: AllocationRecord) -> None:
    """An accepted record is one the daemon can rely on."""
    assert all(isinstance(g.share, Share) and g.memory_limit >= 0 for g in record.gpus), record
    assert record.limit is None or isinstance(record.limit, Share), record
    assert math.isfinite(record.created_at), record
    allocation.check_id(record.id)


def check_config_file(path: Path, config_class: type[Any]) -> None:
    """The file (flat, or a v1 node file) loads as `config_class` as the program loads it, or
    gives a ConfigError naming the file or the key."""
    try:
        values, where = cfg.file_settings(config_class, cfg.load_file(str(path)), str(path))
        loaded = cfg.resolve(config_class, {}, {}, values, str(path), where)
    except cfg.ConfigError as err:
        assert str(path) in str(err) or "key" in str(err), err
        return
    assert isinstance(loaded, config_class)
