"""Every console program as installed: readable --help defaults, --version, one error prefix."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from vgpu_runtime import __version__, hooklib

PROGRAMS = ("gemini-device-plugin", "gemini-daemon", "gemini-run", "gemini-vgpu",
            "gemini-install-hook", "gemini-config-manager", "gemini-demo")
SCRIPTS = Path(sysconfig.get_path("scripts"))


def run(program: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = SCRIPTS / program
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e . puts it there)")
    # A wide terminal, so that argparse does not wrap a default across lines.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GEMINI_")}
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60,
                          env={**environ, "COLUMNS": "400", **env})


@pytest.mark.parametrize("program", PROGRAMS)
def test_version_names_the_package_and_the_interposer(program: str) -> None:
    result = run(program, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{program} {__version__} (interposer {hooklib.library_name()})\n"


@pytest.mark.parametrize("program, args", [
    ("gemini-device-plugin", ()), ("gemini-daemon", ()), ("gemini-install-hook", ()),
    ("gemini-run", ()), ("gemini-vgpu", ("status",)), ("gemini-config-manager", ()),
])
def test_help_shows_no_raw_defaults(program: str, args: tuple[str, ...]) -> None:
    result = run(program, *args, "--help")
    assert result.returncode == 0, result.stderr
    for raw in ("None", "2147483648", "1073741824", "141000000000", "(13,", "True", "False",
                "300.0", "10.0"):
        assert raw not in result.stdout, (raw, result.stdout)


def test_help_shows_sizes_lists_and_numbers_as_typed() -> None:
    plugin = run("gemini-device-plugin", "--help").stdout
    assert "(env GEMINI_MEMORY_RESERVE; default 2GiB)" in plugin
    assert "(env GEMINI_IGNORED_XIDS; default 13,31,43,45,68,109)" in plugin
    assert "(env GEMINI_SIMULATE_MEMORY; default 141GB)" in plugin
    assert "(env GEMINI_RECOVERY_QUIET_PERIOD; default 300)" in plugin
    assert "(env GEMINI_HOOK_DIR)\n" in plugin          # no default: nothing shown
    daemon = run("gemini-daemon", "--help").stdout
    assert "(env GEMINI_INTERPOSER_CONTEXT_MAX_BYTES; default 1GiB)" in daemon
    assert "(env GEMINI_IDLE_RELEASE; default 0.002)" in daemon
    assert "(env GEMINI_KUBERNETES; default false)" in daemon


@pytest.mark.parametrize("program, args, status, message", [
    ("gemini-device-plugin", ("--slices-per-gpu", "0"), 2,
     "flag --slices-per-gpu: must be at least 1, got 0"),
    ("gemini-daemon", ("--window", "soon"), 2, "flag --window: expected a number"),
    ("gemini-install-hook", ("--log-level", "loud"), 2, "flag --log-level: must be one of"),
    ("gemini-vgpu", ("status", "--state-dir", "/nonexistent/gemini"), 1,
     "no gemini-daemon serves /nonexistent/gemini"),
])
def test_errors_have_one_prefix(program: str, args: tuple[str, ...], status: int,
                                message: str) -> None:
    result = run(program, *args)
    assert result.returncode == status, result.stderr
    assert result.stderr.startswith(f"{program}: error: {message}"), result.stderr


def test_the_old_daemon_command_is_gone_and_the_state_files_keep_their_names(
        tmp_path: Path) -> None:
    """gemini-scheduler, the daemon's name until 0.3, was kept through 0.3 and goes in 0.4: no
    entry point names it. The daemon keeps the state directory's names, which 0.3 finds."""
    commands = {e.name for e in metadata.entry_points(group="console_scripts")
                if e.value.startswith(("vgpu_runtime.", "device_plugin."))}
    assert "gemini-daemon" in commands and "gemini-scheduler" not in commands, commands

    state = tmp_path / "state"
    served = run("gemini-daemon", "--state-dir", str(state), "--simulate-gpus", "1",
                 "--metrics-port", "0", "--idle-exit", "0.2", "--log-format", "json")
    assert served.returncode == 0, served.stderr
    assert '"gemini-daemon started"' in served.stderr, served.stderr
    assert (state / "scheduler.lock").exists()   # the state directory's names are kept
