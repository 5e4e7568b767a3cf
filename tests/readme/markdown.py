"""The parts of README.md its test reads: fenced blocks, inline code, tables and command lines."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

# A fence may be indented (a block inside a list item); its lines keep the indentation.
FENCE = re.compile(r"^ {0,3}```(\w*)\n(.*?)^ {0,3}```$", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SHELL = {"bash", "sh", "shell"}


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int   # of the opening fence, 1-based


@dataclass(frozen=True)
class Command:
    """One command line the README shows: argv as a person would type it, and where."""

    argv: tuple[str, ...]
    where: str          # "README.md:<line>" and whether it is in a block or inline
    in_block: bool

    @property
    def text(self) -> str:
        return " ".join(self.argv)

    @property
    def flags(self) -> list[str]:
        """The long options given to the program itself (not those after `--`)."""
        mine = self.argv[:self.argv.index("--")] if "--" in self.argv else self.argv
        return [m.group(0) for word in mine for m in [FLAG.search(word.lstrip("["))]
                if m and word.lstrip("[").startswith("--")]


def blocks(text: str) -> list[Block]:
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The README without its fenced blocks (their lines blanked, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def split_line(line: str) -> list[tuple[str, ...]]:
    """The commands of one shell line: a trailing comment dropped, `&&` and `;` split."""
    line = re.sub(r"\s+#\s.*$", "", line).strip()
    if not line or line.startswith("#"):
        return []
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    commands: list[tuple[str, ...]] = []
    current: list[str] = []
    for word in words:
        if word in ("&&", ";", "||"):
            commands.append(tuple(current))
            current = []
        else:
            current.append(word)
    commands.append(tuple(current))
    return [c for c in commands if c]


def block_commands(text: str) -> list[Command]:
    found = []
    for block in blocks(text):
        if block.lang not in SHELL:
            continue
        for offset, line in enumerate(block.text.splitlines(), start=1):
            for argv in split_line(line):
                found.append(Command(argv, f"README.md:{block.line + offset}", True))
    return found


def inline_commands(text: str, programs: tuple[str, ...]) -> list[Command]:
    """Inline code in the prose that starts with one of `programs` (after `sudo`)."""
    body = prose(text)
    found = []
    for match in INLINE.finditer(body):
        line = body.count("\n", 0, match.start()) + 1
        for argv in split_line(match.group(1)):
            first = argv[1] if argv[0] == "sudo" and len(argv) > 1 else argv[0]
            if first.startswith(programs):
                found.append(Command(argv, f"README.md:{line}", False))
    return found


def table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells stripped, header and rule left out) of the first table after `marker`."""
    rest = text[text.index(marker):]
    lines = rest.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def section(text: str, heading: str) -> str:
    """The text under a `## heading` up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert match, f"README has no section {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, match.end())
    return text[match.end():end.start() if end else len(text)]
