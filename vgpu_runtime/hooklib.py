"""The interposer library's name, and where it is: the installed copy, or one built on demand.

`pip install .` puts the library in vgpu_runtime/lib/, with the build's file naming it beside
(hook/build.py, NAME_FILE). In a source tree or an editable install there is neither: the name
is what the sources build to, and library_path() builds the library into a per-user cache keyed
by a hash of the hook's sources (a changed source builds a new file; an unchanged one is reused).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from vgpu_runtime.hook import build

PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "lib"
# Every version's file starts with this (gemini-install-hook retires old versions by it).
LIBRARY_PREFIX = build.LIBRARY_PREFIX


class LibraryNameError(RuntimeError):
    """The package's record of its interposer's name is unreadable or names no version."""


@functools.cache
def library_name() -> str:
    """`libgemini-hook.so.<version>-<digest>`: the name every program gives the interposer (in
    LD_PRELOAD, records, the installed file). A file of that name is never rewritten: running
    pods keep the library they started with across upgrades."""
    # Rule: the build writes the name once, beside the library; only a source tree asks the build.
    record = PACKAGE_LIB_DIR / build.NAME_FILE
    try:
        name = record.read_text().strip()
    except FileNotFoundError:
        return build.library_name()
    if not name.startswith(LIBRARY_PREFIX) or "/" in name:
        raise LibraryNameError(f"{record} names {name!r}, not an interposer "
                               f"({LIBRARY_PREFIX}<version>-<digest>); reinstall the package")
    return name


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemini-vgpu" / "hook"


def installed_library() -> Path | None:
    candidate = PACKAGE_LIB_DIR / library_name()
    return candidate if candidate.is_file() else None


def library_path(rebuild: bool = False) -> Path:
    """The interposer to preload; builds it (gcc) when no installed copy exists."""
    installed = installed_library()
    if installed is not None and not rebuild:
        return installed
    out_dir = cache_root() / build.sources_digest()
    target = out_dir / build.library_name()
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
