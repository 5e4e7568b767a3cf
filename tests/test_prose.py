"""Code, tests and scripts cite no tracker issue: a comment states the rule or the bug it guards
against, and history lives in BENCHMARKS.md and RELIABILITY.md, where it can be read in order.

Every tracked file under the folders below is read; the word "issue" followed by a number (with
or without "#") fails the test with its file and line.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("device_plugin", "vgpu_runtime", "tests", "scripts", "daemonset")
# Written so that this file's own source does not match it.
ISSUE_REFERENCE = re.compile(r"\bissue\s?#?\s?[0-9]", re.IGNORECASE)


def tracked_files(repo: Path) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--", *FOLDERS], cwd=repo, check=True,
                            capture_output=True).stdout
    return [repo / name for name in listed.decode().split("\0") if name]


def issue_references(repo: Path) -> list[str]:
    """'path:line: text' for every issue reference in the tracked files (binary files skipped)."""
    found = []
    for path in tracked_files(repo):
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if ISSUE_REFERENCE.search(line):
                found.append(f"{path.relative_to(repo)}:{number}: {line.strip()}")
    return found


def test_no_issue_references_in_code_tests_or_scripts() -> None:
    assert issue_references(REPO) == []


def test_a_planted_issue_reference_is_found(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    clean = tmp_path / "vgpu_runtime" / "clean.py"
    planted = tmp_path / "tests" / "test_planted.py"
    untracked = tmp_path / "scripts" / "untracked"
    for path in (clean, planted, untracked):
        path.parent.mkdir(parents=True, exist_ok=True)
    clean.write_text("# The token is revoked after quota + grace.\n")
    reference = "Iss" + "ue #7"
    planted.write_text(f'"""Two holders at once.\n\nSeen in {reference}.\n"""\n')
    untracked.write_text(f"# {reference}\n")
    subprocess.run(["git", "add", "vgpu_runtime", "tests"], cwd=tmp_path, check=True)
    assert issue_references(tmp_path) == [f"tests/test_planted.py:3: Seen in {reference}."]
