"""Environment for the real processes the kit starts (daemons, plugins, gemini-run)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import vgpu_runtime

# The folder holding the vgpu_runtime package: the repository in a source tree.
SOURCE_ROOT = Path(vgpu_runtime.__file__).resolve().parents[1]


def python_path(base: Mapping[str, str] | None = None) -> str:
    """The source root first, then whatever was there (the GPU machine carries cffi in it)."""
    inherited = (os.environ if base is None else base).get("PYTHONPATH")
    return os.pathsep.join(filter(None, [str(SOURCE_ROOT), inherited]))


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": python_path(), **extra}
