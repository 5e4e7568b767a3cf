"""The interposer installed where the plugin's Allocate expects it, as gemini-install-hook does:
Allocate refuses to answer without it (the pod would run ungated)."""

from __future__ import annotations

import os
from pathlib import Path

from vgpu_runtime import hooklib
from vgpu_runtime.install import install_library


def install_hook(hook_dir: Path) -> Path:
    """The real interposer (built once per source digest, then cached) in hook_dir, unless the
    test installed one there already (a strict build, a given library)."""
    target = Path(hook_dir) / hooklib.library_name()
    if os.path.lexists(target):
        return target
    installed, _ = install_library(hooklib.library_path(), Path(hook_dir))
    return installed
