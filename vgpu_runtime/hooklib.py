"""Where the interposer library is: the installed copy, or one built on demand.

`pip install .` puts the library in vgpu_runtime/lib/. In a source tree or an editable
install there is none, so library_path() builds it into a per-user cache keyed by a hash
of the hook's sources (a changed source builds a new file; an unchanged one is reused).
"""

from __future__ import annotations

import os
from pathlib import Path

from vgpu_runtime import paths
from vgpu_runtime.hook import build

PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "lib"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemini-vgpu" / "hook"


def installed_library() -> Path | None:
    candidate = PACKAGE_LIB_DIR / paths.HOOK_LIBRARY_NAME
    return candidate if candidate.is_file() else None


def library_path(rebuild: bool = False) -> Path:
    """The interposer to preload; builds it (gcc) when no installed copy exists."""
    installed = installed_library()
    if installed is not None and not rebuild:
        return installed
    out_dir = cache_root() / build.sources_digest()
    target = out_dir / paths.HOOK_LIBRARY_NAME
    if target.is_file() and not rebuild:
        return target
    return build.build_library(out_dir)


def read_stats_file(path: str | Path) -> dict[str, int]:
    """The counters the hook writes at exit to GEMINI_HOOK_STATS=<path> (core/stats.c:
    `key=value` lines); {} when the process wrote none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key: int(value) for key, value in pairs if value.strip().isdigit()}
