"""Environment for the real processes the tests start (daemons, plugins, gemini-run)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_path(base: Mapping[str, str] | None = None) -> str:
    """The repository first, then whatever was there (the GPU machine carries cffi in it)."""
    inherited = (os.environ if base is None else base).get("PYTHONPATH")
    return os.pathsep.join(filter(None, [str(REPO), inherited]))


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": python_path(), **extra}


def as_user(uid: int, argv: list[str]) -> list[str]:
    """`argv` run as another uid (setpriv; the caller is root). It keeps CAP_DAC_READ_SEARCH
    only so that it can run this machine's Python wherever it lives (under /root here): the
    capability lets it read and search, never write, own or chmod."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *argv]


def in_mount_namespace(script: str) -> list[str]:
    """The command line that runs a shell `script` in a fresh, private mount namespace."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
