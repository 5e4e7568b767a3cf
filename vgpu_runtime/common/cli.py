"""What every gemini program says the same way: its version and its errors.

Errors read `<program>: error: <message>`, the form argparse already uses for usage errors, so a
user (or a script) sees one prefix whatever went wrong.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vgpu_runtime import __version__, hooklib


def version_text(prog: str) -> str:
    """`gemini-run 0.4.0 (interposer libgemini-hook.so.0.4.0-<digest>)`."""
    return f"{prog} {__version__} (interposer {hooklib.library_name()})"


class _PrintVersion(argparse.Action):
    """argparse's own version action rewraps the text to the terminal; this prints one line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_text(parser.prog))
        parser.exit()


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action=_PrintVersion, nargs=0, default=argparse.SUPPRESS,
                        help="print the version and the interposer library's name, and exit")


def error(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
