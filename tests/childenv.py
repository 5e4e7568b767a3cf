"""Environment for the real processes the tests start (daemons, plugins, gemini-run): the kit's
child_env and python_path, and what only tests need (another uid, a private mount namespace)."""

from __future__ import annotations

from pathlib import Path

from vgpu_runtime.devkit.childenv import child_env, python_path

__all__ = ["REPO", "as_user", "child_env", "in_mount_namespace", "python_path"]

REPO = Path(__file__).resolve().parents[1]


def as_user(uid: int, argv: list[str]) -> list[str]:
    """`argv` run as another uid (setpriv; the caller is root). It keeps CAP_DAC_READ_SEARCH
    only so that it can run this machine's Python wherever it lives (under /root here): the
    capability lets it read and search, never write, own or chmod."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", *argv]


def in_mount_namespace(script: str) -> list[str]:
    """The command line that runs a shell `script` in a fresh, private mount namespace."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
