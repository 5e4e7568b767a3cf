"""Hostile configuration files: alias bombs, huge files and huge values are
refused at once with a short message, by the library and by the programs that read them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.childenv import child_env
from vgpu_runtime.common import config as cfg
from vgpu_runtime.daemon.config import DaemonConfig


def alias_bomb(levels: int = 9) -> str:
    """The 404-byte shape of the review's file: each level lists the previous one 10 times."""
    lines = ["version: v1", 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, levels):
        refs = ",".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append(f"node: {{slices_per_gpu: *a{levels - 1}}}")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 1024
    started = time.monotonic()
    with pytest.raises(cfg.ConfigError) as raised:
        cfg.load_file(str(path))
    assert time.monotonic() - started < 1
    assert "aliases" in str(raised.value) and len(str(raised.value)) < 300


def test_aliases_within_reason_still_load(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text("version: v1\ndefaults: &d {slices_per_gpu: 4}\nnode: *d\n")
    assert cfg.load_file(str(path))["node"] == {"slices_per_gpu": 4}


def test_recursive_aliases_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("version: v1\nnode: {slices_per_gpu: &x [*x, *x]}\n")
    with pytest.raises(cfg.ConfigError, match="contains it"):
        cfg.load_file(str(path))


def test_a_file_past_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("version: v1\n# " + "x" * cfg.MAX_FILE_BYTES + "\n")
    with pytest.raises(cfg.ConfigError, match="larger than 1024 KiB"):
        cfg.load_file(str(path))


def test_an_error_quotes_only_a_short_prefix_of_the_value(tmp_path: Path) -> None:
    path = tmp_path / "long.yaml"
    path.write_text("slices_per_gpu: " + "9x" * 200_000 + "\n")   # a flat file
    data = cfg.load_file(str(path))
    values, where = cfg.file_settings(DaemonConfig, data, str(path))
    with pytest.raises(cfg.ConfigError) as raised:
        cfg.resolve(DaemonConfig, {}, {}, values, str(path), where)
    message = str(raised.value)
    assert "slices_per_gpu" in message and "9x9x" in message and len(message) < 300


def test_quote_is_bounded_for_shared_structures() -> None:
    value: list[object] = ["lol"] * 10
    for _ in range(40):          # 10^40 leaves if expanded
        value = [value] * 10
    started = time.monotonic()
    shown = cfg.quote(value)
    assert time.monotonic() - started < 0.1 and len(shown) <= cfg.QUOTE_CHARS


@pytest.mark.parametrize("program", ["vgpu_runtime.daemon.main", "vgpu_runtime.configmanager"])
def test_the_programs_refuse_the_bomb_within_seconds(tmp_path: Path, program: str) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    argv = [sys.executable, "-m", program]
    argv += (["check", str(path)] if program.endswith("configmanager") else ["--config", str(path)])
    started = time.monotonic()
    proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=30)
    assert time.monotonic() - started < 15
    assert proc.returncode != 0, proc.stdout
    assert "aliases" in proc.stderr and len(proc.stderr) < 2000, proc.stderr[-2000:]
