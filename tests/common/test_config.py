"""Configuration precedence (flags > env > file) and errors that name the field."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from vgpu_runtime.common import config as cfg
from vgpu_runtime.common.sizes import format_size, parse_size


@dataclass(frozen=True)
class Sample:
    slices_per_gpu: int = cfg.setting(10, "slices", cfg.integer(1, 100))
    memory_reserve: int = cfg.setting(2 << 30, "reserve", cfg.size)
    placement: str = cfg.setting("best-fit", "policy", cfg.choice("best-fit", "spread"))
    ignored_xids: tuple[int, ...] = cfg.setting((13, 31), "xids", cfg.int_list)


def test_defaults() -> None:
    assert cfg.load(Sample, [], environ={}) == Sample()


def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("slices_per_gpu: 4\nplacement: spread\nmemory_reserve: 1GiB\n")
    env = {"GEMINI_SLICES_PER_GPU": "5", "GEMINI_PLACEMENT": "best-fit"}
    loaded = cfg.load(Sample, ["--config", str(conf), "--slices-per-gpu", "6"], environ=env)
    assert loaded.slices_per_gpu == 6          # flag
    assert loaded.placement == "best-fit"      # env over file
    assert loaded.memory_reserve == 1 << 30    # file over default
    assert cfg.load(Sample, [], environ={**env, "GEMINI_CONFIG": str(conf)}).slices_per_gpu == 5


@pytest.mark.parametrize("argv, env, text, needle", [
    (["--slices-per-gpu", "0"], {}, None, "flag --slices-per-gpu: must be at least 1"),
    ([], {"GEMINI_MEMORY_RESERVE": "lots"}, None, "environment GEMINI_MEMORY_RESERVE"),
    ([], {}, "placement: random\n", "key placement: must be one of best-fit, spread"),
    ([], {}, "slices_per_gpu: true\n", "key slices_per_gpu: expected an integer"),
    ([], {}, "slice_per_gpu: 3\n", "unknown setting(s) slice_per_gpu"),
    ([], {}, "- a\n- b\n", "must hold a mapping"),
    ([], {}, "a: [\n", "not valid YAML"),
    ([], {"GEMINI_IGNORED_XIDS": "13,x"}, None, "comma-separated list of integers"),
])
def test_malformed_values_name_the_field(argv: list[str], env: dict[str, str], text: str | None,
                                         needle: str, tmp_path: Path) -> None:
    if text is not None:
        conf = tmp_path / "c.yaml"
        conf.write_text(text)
        argv = [*argv, "--config", str(conf)]
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(Sample, argv, environ=env)
    assert needle in str(err.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="No such file"):
        cfg.load(Sample, ["--config", str(tmp_path / "absent.yaml")], environ={})


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 << 30), ("512Mi", 512 << 20), ("2G", 2_000_000_000), ("1.5GiB", 3 << 29),
    ("1048576", 1 << 20), (" 4 kib ", 4096), (0, 0),
])
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1.2.3G", "8 parsecs", "1e3"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(8 << 30) == "8.0 GiB"
    assert format_size(100) == "100 B"


@pytest.mark.parametrize("value, parse, shown", [
    (2 << 30, cfg.size, "2GiB"),
    (141 * 1000**3, cfg.size, "141GB"),
    (1536 * 1024, cfg.size, "1536KiB"),
    (1000, cfg.size, "1KB"),
    (0, cfg.size, "0"),
    (1234567, cfg.size, "1234567"),
    ((13, 31, 43), cfg.int_list, "13,31,43"),
    (None, cfg.optional(cfg.text), None),
    (0.002, cfg.number(), "0.002"),
    (300.0, cfg.number(), "300"),
    (False, cfg.boolean, "false"),
    (65536, cfg.integer(), "65536"),     # a count, not a size: shown as typed
    ("best-fit", cfg.text, "best-fit"),
])
def test_defaults_are_shown_as_a_person_types_them(value: object, parse: cfg.Parser,
                                                   shown: str | None) -> None:
    assert cfg.show_default(value, parse) == shown
    if shown is not None and parse is cfg.size:
        assert parse_size(shown) == value   # what --help shows can be typed back


def test_help_shows_readable_defaults_and_none_as_nothing() -> None:
    @dataclass(frozen=True)
    class WithOptional:
        reserve: int = cfg.setting(2 << 30, "reserve, 100% of it", cfg.size)
        xids: tuple[int, ...] = cfg.setting((13, 31), "xids", cfg.int_list)
        hook_dir: str | None = cfg.setting(None, "where", cfg.optional(cfg.text))

    parser = argparse.ArgumentParser(prog="x")
    cfg.add_arguments(parser, WithOptional)
    text = " ".join(parser.format_help().split())   # argparse wraps lines
    assert "(env GEMINI_RESERVE; default 2GiB)" in text and "100% of it" in text
    assert "(env GEMINI_XIDS; default 13,31)" in text
    assert "(env GEMINI_HOOK_DIR)" in text and "None" not in text


# ---- the node's versioned file: a node section and a section per program ----

@dataclass(frozen=True)
class PluginLike:
    SECTION: ClassVar[str] = "devicePlugin"
    state_dir: str = cfg.node_setting("state_dir")
    slices_per_gpu: int = cfg.node_setting("slices_per_gpu")
    placement: str = cfg.setting("best-fit", "policy", cfg.choice("best-fit", "spread"))


@dataclass(frozen=True)
class SchedulerLike:
    SECTION: ClassVar[str] = "scheduler"
    slices_per_gpu: int = cfg.node_setting("slices_per_gpu")
    limit_policy: str = cfg.setting("work-conserving", "policy",
                                    cfg.choice("work-conserving", "strict"))


NODE_FILE = """\
version: v1
node:
  slices_per_gpu: 4
  state_dir: /srv/gemini
devicePlugin:
  placement: spread
scheduler:
  limit_policy: strict
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "node.yaml"
    path.write_text(text)
    return str(path)


def test_each_program_reads_the_node_section_and_its_own(tmp_path: Path) -> None:
    path = write(tmp_path, NODE_FILE)
    plugin = cfg.load_all(PluginLike, ["--config", path], environ={})
    assert plugin.config == PluginLike(state_dir="/srv/gemini", slices_per_gpu=4,
                                       placement="spread")
    assert plugin.notes == ()     # a v1 file is not deprecated
    daemon = cfg.load(SchedulerLike, [], environ={"GEMINI_CONFIG": path})
    assert daemon == SchedulerLike(slices_per_gpu=4, limit_policy="strict")


def test_flags_and_env_still_beat_the_sections(tmp_path: Path) -> None:
    path = write(tmp_path, NODE_FILE)
    loaded = cfg.load(PluginLike, ["--config", path, "--placement", "best-fit"],
                      environ={"GEMINI_SLICES_PER_GPU": "6"})
    assert (loaded.slices_per_gpu, loaded.placement) == (6, "best-fit")


def test_keys_of_another_section_are_ignored(tmp_path: Path) -> None:
    """The scheduler section holds a key the plugin does not know (and a bad value for it):
    the plugin neither rejects nor parses it."""
    path = write(tmp_path, NODE_FILE.replace("limit_policy: strict", "limit_policy: whatever\n"
                                             "  window: 10"))
    assert cfg.load(PluginLike, ["--config", path], environ={}).placement == "spread"
    with pytest.raises(cfg.ConfigError, match=r"section scheduler: unknown setting\(s\) window"):
        cfg.load(SchedulerLike, ["--config", path], environ={})
    write(tmp_path, NODE_FILE.replace("limit_policy: strict", "limit_policy: whatever"))
    with pytest.raises(cfg.ConfigError, match="section scheduler key limit_policy"):
        cfg.load(SchedulerLike, ["--config", path], environ={})


@pytest.mark.parametrize("text, needle", [
    (NODE_FILE.replace("placement: spread", "placment: spread"),
     "node.yaml, section devicePlugin: unknown setting(s) placment; known: placement"),
    (NODE_FILE.replace("state_dir: /srv/gemini", "stat_dir: /srv/gemini"),
     "node.yaml, section node: unknown setting(s) stat_dir; known: "),
    (NODE_FILE.replace("placement: spread", "slices_per_gpu: 3"),
     "node.yaml, section devicePlugin: slices_per_gpu is a node setting; set it once, under "
     "node:"),
    (NODE_FILE.replace("placement: spread", "placement: random"),
     "node.yaml, section devicePlugin key placement: must be one of best-fit, spread"),
    (NODE_FILE.replace("slices_per_gpu: 4", "slices_per_gpu: 0"),
     "node.yaml, section node key slices_per_gpu: must be at least 1"),
    (NODE_FILE.replace("version: v1", "version: v2"),
     "version 'v2' is not supported; this program reads version: v1"),
    (NODE_FILE.replace("version: v1", "version: 1"),
     "version 1 is not supported"),
    (NODE_FILE.replace("devicePlugin:", "devicePlugn:"),
     "unknown section(s) devicePlugn; a version v1 file has version, node, devicePlugin, "
     "scheduler"),
    ("version: v1\ndevicePlugin: [spread]\n",
     "section devicePlugin: must be a mapping of settings, got list"),
])
def test_a_bad_node_file_names_file_section_and_key(tmp_path: Path, text: str,
                                                    needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(PluginLike, ["--config", path], environ={})
    assert needle in str(err.value)
    assert path in str(err.value)


def test_a_flat_file_without_version_is_read_as_before_with_a_deprecation_note(
        tmp_path: Path) -> None:
    path = write(tmp_path, "slices_per_gpu: 4\nplacement: spread\n")
    loaded = cfg.load_all(PluginLike, ["--config", path], environ={})
    assert loaded.config == PluginLike(slices_per_gpu=4, placement="spread")
    (note,) = loaded.notes
    assert path in note and "deprecated" in note and "version v1" in note
    # A flat file still holds only the program's own keys.
    write(tmp_path, "slices_per_gpu: 4\nlimit_policy: strict\n")
    with pytest.raises(cfg.ConfigError, match="unknown setting"):
        cfg.load(PluginLike, ["--config", path], environ={})


def test_reread_sees_the_file_as_it_is_now_with_the_same_flags(tmp_path: Path) -> None:
    path = write(tmp_path, NODE_FILE)
    loaded = cfg.load_all(PluginLike, ["--config", path, "--placement", "best-fit"], environ={})
    write(tmp_path, NODE_FILE.replace("slices_per_gpu: 4", "slices_per_gpu: 8"))
    assert loaded.reread() == PluginLike(state_dir="/srv/gemini", slices_per_gpu=8,
                                         placement="best-fit")


def test_the_programs_declare_every_shared_setting_in_the_node_section() -> None:
    """One declaration per shared setting: a key both programs read is a node setting (the log
    and metrics settings excepted: each program has its own level, and its own port), and each
    program's node keys are NodeSettings' own, with its parser."""
    from vgpu_runtime.daemon.config import DaemonConfig
    from vgpu_runtime.pluginconfig import PluginConfig

    node = {f.name: f for f in dataclasses.fields(cfg.NodeSettings)}
    plugin = {f.name: f for f in dataclasses.fields(PluginConfig)}
    daemon = {f.name: f for f in dataclasses.fields(DaemonConfig)}
    own = {"log_level", "log_format", "metrics_port", "metrics_address"}
    assert (set(plugin) & set(daemon)) - own == set(node)
    assert PluginConfig().metrics_port != DaemonConfig().metrics_port
    for program in (plugin, daemon):
        for name in node:
            assert program[name].metadata["node"] is True
            assert program[name].metadata["parse"] is node[name].metadata["parse"]
    assert {PluginConfig.SECTION, DaemonConfig.SECTION} == set(cfg.PROGRAM_SECTIONS)


def test_the_install_step_takes_the_state_dir_from_the_node_section(tmp_path: Path) -> None:
    from vgpu_runtime.install import InstallConfig

    path = write(tmp_path, NODE_FILE)
    assert cfg.load(InstallConfig, ["--config", path], environ={}).state_dir == "/srv/gemini"
