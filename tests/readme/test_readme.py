"""README.md says what the programs do: its commands run, its flags exist, its figures of output
and its exit codes are what the code gives.

Each command the README shows is checked by one rule:
- the demo, `gemini-run` with simulated GPUs, `gemini-vgpu status` and `stop`, and the kustomize
  build run here as written (in a scratch state directory);
- commands that need a cluster, root or a GPU (`kubectl`, `scripts/build-image`, ...) are checked
  against their program's `--help` (or, for a script without one, its source): every `--flag` the
  README gives them must be there;
- `scripts/test`, the README's own test command, is only named (it would run this test).
A command in a README block that no rule covers fails the test, so a new one gets a rule.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.childenv import REPO
from tests.readme import markdown as md
from tests.rollout import manifests

README = (REPO / "README.md").read_text()
BIN = Path(sysconfig.get_path("scripts"))
# The console programs, from pyproject's [project.scripts] (tomllib is not in Python 3.10).
PROGRAMS = tuple(re.findall(r"^([\w-]+) = ", (REPO / "pyproject.toml").read_text().split(
    "[project.scripts]")[1].split("\n[")[0], re.M))
SUBCOMMANDS = {"gemini-vgpu": ("status", "stop"),
               "gemini-host": ("install", "uninstall", "unit", "serve")}
# The system's own administration tools, which the README only names (the host daemon's setup).
ADMIN_TOOLS = {"usermod", "systemctl"}
# Scripts with an argparse --help; the others' flags are looked for in their source.
HELP_SCRIPTS = {"demo", "build-image"}
KUBECTL_VERBS = {"apply", "label", "get", "describe", "delete", "kustomize"}
# helm: the chart's install, upgrade and uninstall, run by tests/cluster/test_chart_install.py
# with the real Helm (whose help tests/cluster/test_chart.py holds these commands' flags to).
HELM_VERBS = {"install", "upgrade", "uninstall"}
CHART = REPO / "daemonset" / "chart" / "gemini-vgpu"
# Flags of other programs that the README quotes (nvidia-ctk's, pytest's).
FOREIGN_FLAGS = {"--output"}
TIMEOUT = 120


def program_env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GEMINI_")}
    return {**environ, "COLUMNS": "400", "PATH": f"{BIN}{os.pathsep}{environ['PATH']}", **extra}


def script_of(word: str) -> Path | None:
    match = re.fullmatch(r"(?:\./)?scripts/([\w.-]+)", word)
    return REPO / "scripts" / match.group(1) if match else None


@functools.cache
def help_text(*argv: str) -> str:
    result = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=TIMEOUT,
                            env=program_env(), cwd=REPO)
    assert result.returncode == 0, f"{' '.join(argv)} --help failed:\n{result.stderr}"
    return result.stdout


def program_of(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The words naming the program (and subcommand) whose help lists the command's flags."""
    words = argv[1:] if argv[0] == "sudo" else argv
    first = words[0]
    if first in SUBCOMMANDS and len(words) > 1 and words[1] in SUBCOMMANDS[first]:
        return (first, words[1])
    return (first,)


def where_flags_live(program: tuple[str, ...]) -> str | None:
    """Help (or source) text for a program the README names; None where it is not installed."""
    first = program[0]
    if first in PROGRAMS:
        return help_text(str(BIN / first), *program[1:])
    script = script_of(first)
    if script is not None:
        assert script.is_file() and os.access(script, os.X_OK), f"{script} is not an executable"
        if script.name in HELP_SCRIPTS:
            return help_text(str(script))
        return script.read_text()
    return None


def problems_of(command: md.Command) -> list[str]:
    """What is wrong with one command the README shows (an empty list where nothing is)."""
    program = program_of(command.argv)
    first = program[0]
    words = command.argv[1:] if command.argv[0] == "sudo" else command.argv
    if first in PROGRAMS or script_of(first) is not None:
        text = where_flags_live(program)
        assert text is not None
        return [f"{command.where}: `{command.text}`: {flag} is not in `{' '.join(program)}`'s "
                "help" for flag in command.flags
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    if first == "kubectl":
        verb = next((w for w in words[1:] if w in KUBECTL_VERBS), None)
        if verb is None:
            return [f"{command.where}: `{command.text}`: no rule for this kubectl command"]
        if shutil.which("kubectl") is None:
            return []   # nothing to check it against here; the kustomize build still runs
        text = help_text("kubectl", verb)
        return [f"{command.where}: `{command.text}`: kubectl {verb} has no {flag}"
                for flag in command.flags if flag not in text]
    if first == "helm":
        return helm_problems(command, words)
    if first == "kustomize" and len(words) > 1:   # not the bare name in prose
        # kubectl builds kustomizations itself; a kustomize binary is one more tool to install
        # (Debian has none): the image goes in an `images:` entry (step 4).
        return [f"{command.where}: `{command.text}` needs a kustomize binary: use kubectl "
                "kustomize, or an images: entry in the kustomization"]
    if first in ADMIN_TOOLS:
        return []
    if first == "cd":
        return [] if (REPO / words[1]).is_dir() else [f"{command.where}: no directory {words[1]}"]
    if command.in_block:
        return [f"{command.where}: `{command.text}`: no rule checks this command; add one to "
                "tests/readme/test_readme.py"]
    return []   # inline code that only mentions a program's name


def helm_problems(command: md.Command, words: tuple[str, ...]) -> list[str]:
    """A helm command names a verb the tests run, this chart, and values it has."""
    where = f"{command.where}: `{command.text}`"
    if not command.in_block and len(words) == 2 and words[1] in HELM_VERBS:
        return []   # the verb named in prose (`helm uninstall` first runs ...)
    if len(words) < 3 or words[1] not in HELM_VERBS:
        return [f"{where}: no rule for this helm command"]
    problems = []
    if words[1] != "uninstall" and (len(words) < 4 or (REPO / words[3]).resolve() != CHART):
        problems.append(f"{where}: the chart is {CHART.relative_to(REPO)}")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for flag, value in itertools.pairwise(words):
        if flag == "--set":
            node: object = values
            for key in re.sub(r"\[\d+\]", "", value.split("=", 1)[0]).split("."):
                if not isinstance(node, dict) or key not in node:
                    problems.append(f"{where}: the chart has no value {value.split('=')[0]}")
                    break
                node = node[key]
    if shutil.which("helm"):
        text = help_text("helm", words[1])
        problems += [f"{where}: helm {words[1]} has no {flag}" for flag in command.flags
                     if flag not in text]
    return problems


def all_commands() -> list[md.Command]:
    starts = (*PROGRAMS, "scripts/", "./scripts/", "kubectl", "kustomize", "helm", "sudo ")
    inline = [c for c in md.inline_commands(README, starts)
              if program_of(c.argv)[0] in (*PROGRAMS, "kubectl", "kustomize", "helm")
              or script_of(program_of(c.argv)[0]) is not None]
    return md.block_commands(README) + inline


# ---- every command and flag ----

def test_every_command_uses_only_flags_its_program_has() -> None:
    commands = all_commands()
    assert len([c for c in commands if c.in_block]) >= 7, "the README's blocks were not found"
    problems = [p for command in commands for p in problems_of(command)]
    assert not problems, "\n".join(problems)


def test_every_flag_the_readme_names_belongs_to_one_of_its_programs() -> None:
    """Flags in prose and tables too (`--idle-release`, `--placement`): a renamed or removed flag
    leaves the README, whichever program it belongs to."""
    known = "\n".join(filter(None, [where_flags_live((program, sub))
                                    for program, subs in SUBCOMMANDS.items() for sub in subs]
                             + [where_flags_live((p,)) for p in PROGRAMS]
                             + [where_flags_live((f"scripts/{s.name}",))
                                for s in (REPO / "scripts").iterdir()
                                if s.is_file() and os.access(s, os.X_OK)]))
    # helm's are held to the real Helm's help in the cluster lane (tests/cluster/test_chart.py),
    # kubectl's to kubectl's help by test_every_command_uses_only_flags_its_program_has.
    foreign = {f for c in all_commands() if c.argv[0] in ("helm", "kubectl") for f in c.flags}
    named = set(md.FLAG.findall(README)) - FOREIGN_FLAGS - foreign
    unknown = sorted(f for f in named
                     if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", known))
    assert not unknown, f"flags in README.md that no program has: {unknown}"


def test_every_repository_path_the_readme_names_exists() -> None:
    tops = {p.name for p in REPO.iterdir() if not p.name.startswith(".") or p.name == ".ci"}
    tops -= {"build", ".venv"}
    named = {word.rstrip("/.,:;)") for span in md.INLINE.findall(README)
             for word in span.split() if word.split("/")[0] in tops and "/" in word}
    missing = sorted(p for p in named if not re.search(r"[<*{$]|\.\.\.", p)
                     and not (REPO / p).exists())
    assert named, "no repository paths found in README.md"
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_the_readmes_own_test_command_is_named_not_run() -> None:
    tests = [c for c in md.block_commands(README) if script_of(c.argv[0]) == REPO / "scripts/test"]
    assert tests, "the README's first block names ./scripts/test"
    script = REPO / "scripts" / "test"
    assert os.access(script, os.X_OK) and "pytest" in script.read_text()
    assert script.name not in HELP_SCRIPTS, "its flags are read from its source; it never runs"


# ---- what runs here ----

@pytest.fixture(scope="module")
def demo_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each `scripts/demo` line of the README, run as written. scripts/demo would install the
    package into a virtualenv first; it is given one whose stamp says it is done and whose
    programs are this environment's (python and the console programs)."""
    venv = tmp_path_factory.mktemp("demo-venv")
    (venv / "bin").mkdir()
    programs = {"python": Path(sys.executable)}
    programs.update((p.name, p) for p in BIN.glob("gemini-*"))
    for name, target in programs.items():
        shim = venv / "bin" / name
        shim.write_text(f"#!/bin/sh\nexec {target} \"$@\"\n")
        shim.chmod(0o755)
    stamp = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".gemini-demo-installed").write_text(stamp + "\n")
    outputs = {}
    for command in md.block_commands(README):
        if script_of(command.argv[0]) != REPO / "scripts" / "demo":
            continue
        result = subprocess.run([str(REPO / "scripts/demo"), *command.argv[1:]],
                                capture_output=True, text=True, timeout=TIMEOUT,
                                env=program_env(GEMINI_DEMO_VENV=str(venv),
                                                PYTHONPATH=str(REPO)))
        assert result.returncode == 0, f"{command.text} failed:\n{result.stdout}{result.stderr}"
        assert "Traceback" not in result.stdout + result.stderr
        outputs[command.text] = result.stdout
    assert len(outputs) >= 2, "the README shows ./scripts/demo with and without simulated GPUs"
    return outputs


def excerpt_pattern(line: str) -> re.Pattern[str]:
    """A README output line as a pattern: `<...>` stands for anything without spaces."""
    parts = re.split(r"<[\w .-]+>", line.strip())
    return re.compile(r"\S+?".join(re.escape(p) for p in parts))


# The two tests of demo_outputs are slow (CI's lane, not the fast one): the fixture runs the demo
# twice, which tests/integration/test_demo.py runs in the fast lane.
@pytest.mark.slow
def test_the_demo_prints_what_the_readme_shows(demo_outputs: dict[str, str]) -> None:
    try_it = md.section(README, "Try it")
    (excerpt,) = [b for b in md.blocks(try_it) if b.lang == "text"]
    shown = re.search(r"`(\./scripts/demo[^`]*)` prints", try_it)
    assert shown, "the README says which demo command printed its excerpt"
    output = iter(line.strip() for line in demo_outputs[shown.group(1)].splitlines())
    # In order: each README line is found after the one before it (the excerpt skips lines).
    for line in excerpt.text.splitlines():
        pattern = excerpt_pattern(line)
        assert any(pattern.fullmatch(out) for out in output), (
            f"the demo does not print this README line (in this order):\n{line}")
    assert any("GEMINI_ALLOCATION_ID" in line for line in excerpt.text.splitlines())


def plugin_without_kubelet_dir() -> str:
    """The log of a plugin whose kubelet directory is missing, with the README's path in it
    (under a short scratch root: a Unix socket path has at most 107 bytes)."""
    from tests.plugin.test_socket_dir import start_plugin, stop, wait_for

    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        root = Path(scratch)
        log = root / "plugin.log"
        plugin = start_plugin(root / "var/lib/kubelet/device-plugins", root / "state", log)
        try:
            wait_for(log, "does not exist")
        finally:
            stop(plugin)
        return log.read_text().replace(scratch, "")


@pytest.mark.slow
def test_the_troubleshooting_quotes_are_the_programs_messages(
        demo_outputs: dict[str, str]) -> None:
    from device_plugin.placement import PlacementError, preferred
    from device_plugin.slices import SliceTable
    from vgpu_runtime.gpus.simulated import SimulatedBackend

    table = SliceTable(SimulatedBackend(2).discover(), 10)
    with pytest.raises(PlacementError) as whole_gpus:
        preferred(table, [s.id for g in table.gpus for s in table.slices_of(g.uuid)], [], 15)
    said = "\n".join([*demo_outputs.values(), str(whole_gpus.value),
                      plugin_without_kubelet_dir()])
    rows = md.table_after(md.section(README, "Troubleshooting"), "|")
    quotes = [q for row in rows for q in re.findall(r'"([^"]+)"', " ".join(row[:2]))]
    assert len(quotes) >= 4
    for quote in quotes:
        assert quote in said, f"README quotes {quote!r}; no program says it"


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A scratch state directory; the daemon gemini-run starts in it is stopped at the end."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    yield state
    subprocess.run([str(BIN / "gemini-vgpu"), "stop", "--force", "--state-dir", str(state)],
                   capture_output=True, timeout=TIMEOUT, env=program_env())


def run_shell(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=TIMEOUT)


def without_kubernetes_env(state: Path, tmp_path: Path) -> dict[str, str]:
    """gemini-run on one simulated GPU; `python` is this Python, wherever the README says it."""
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    (shims / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (shims / "python").chmod(0o755)
    env = program_env(GEMINI_STATE_DIR=str(state), GEMINI_SIMULATE_GPUS="1")
    env["PATH"] = f"{shims}{os.pathsep}{env['PATH']}"
    return env


def test_the_gemini_run_block_runs_as_written(state_dir: Path, tmp_path: Path) -> None:
    block = next(b for b in md.blocks(md.section(README, "Without Kubernetes: `gemini-run`"))
                 if b.lang in md.SHELL)
    env = without_kubernetes_env(state_dir, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(textwrap.dedent("""\
        import json, os
        json.dump({k: v for k, v in os.environ.items() if k.startswith("GEMINI_")},
                  open("seen.json", "w"))
        """))
    ran = []
    for line in block.text.splitlines():
        if "[" in line:
            continue   # the synopsis: its flags are checked against the help
        result = run_shell(line, work, env)
        assert result.returncode == 0, f"`{line}` exited {result.returncode}:\n{result.stderr}"
        assert "Traceback" not in result.stdout + result.stderr, result.stderr
        ran.append((line.split()[:2], result.stdout))
    seen = yaml.safe_load((work / "seen.json").read_text())
    run_line = next(line for line in block.text.splitlines()
                    if line.startswith("gemini-run --share"))
    share = re.search(r"--share (\S+)", run_line)
    assert share and seen["GEMINI_VGPU_SHARE"] == share.group(1)
    assert seen["GEMINI_VGPU_MEMORY_LIMIT"] == str(8 << 30) and "--memory 8GiB" in run_line
    assert seen["GEMINI_ALLOCATION_ID"]
    status = next(out for words, out in ran if words == ["gemini-vgpu", "status"])
    assert "FREE SHARE" in status and "FREE SLICES" in status and "gemini-vgpu stop" in status
    assert "no containers now" in status   # gemini-run's allocation ended with its command
    stop = next(out for words, out in ran if words == ["gemini-vgpu", "stop"])
    assert "stopped" in stop


def exit_scenarios(tmp_path: Path) -> dict[str, list[tuple[list[str], int]]]:
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("not a program\n")
    not_executable.chmod(stat.S_IRUSR | stat.S_IWUSR)
    return {
        "125": [(["--no-such-flag", "--", "true"], 125),
                (["--share", "0.5", "--limit", "0.3", "--", "true"], 125)],
        "126": [(["--", str(not_executable)], 126)],
        "127": [(["--", "no-such-command-anywhere"], 127)],
        "the command's": [(["--", "sh", "-c", "exit 3"], 3),
                          (["--", "sh", "-c", "kill -TERM $$"], 128 + 15)],
    }


def test_each_exit_status_the_readme_states(state_dir: Path, tmp_path: Path) -> None:
    rows = md.table_after(README, "Exit status of `gemini-run`")
    scenarios = exit_scenarios(tmp_path)
    assert {row[0] for row in rows} == set(scenarios), (
        "the README's exit statuses and this test's scenarios differ: give each row a scenario")
    env = without_kubernetes_env(state_dir, tmp_path)
    # "Checked before anything else": 126 and 127 without simulated GPUs, which on a machine
    # without one would be 125 (no GPU) had the GPUs been looked for first.
    no_gpus = {k: v for k, v in env.items() if k != "GEMINI_SIMULATE_GPUS"}
    for status, cases in scenarios.items():
        for args, expected in cases:
            result = subprocess.run([str(BIN / "gemini-run"), *args], capture_output=True,
                                    text=True, timeout=TIMEOUT, cwd=tmp_path,
                                    env=no_gpus if status in ("126", "127") else env)
            assert result.returncode == expected, (status, args, result.stderr)
            if status == "125":
                assert result.stderr.splitlines()[-1].startswith("gemini-run: error: ")


def test_the_kustomize_build_the_readme_applies() -> None:
    applies = [c for c in all_commands() if c.argv[:3] == ("kubectl", "apply", "-k")]
    assert applies, "the README applies the DaemonSet with kubectl apply -k"
    command = manifests.kustomize_command()
    if command is None:
        pytest.skip("neither kubectl nor kustomize is installed, so `kubectl apply -k` is not "
                    "built")
    for apply in applies:
        objects = manifests.build(REPO / apply.argv[3])
        kinds = {o["kind"] for o in objects}
        assert {"Namespace", "DaemonSet", "ConfigMap"} <= kinds, (apply.where, kinds)


def test_the_version_the_readme_prints_is_the_packages() -> None:
    from vgpu_runtime import __version__, hooklib

    shown = [span for span in md.INLINE.findall(README) if re.search(r"\(interposer ", span)]
    assert shown, "the README shows what --version prints"
    for span in shown:
        program = span.split()[0]
        result = subprocess.run([str(BIN / program), "--version"], capture_output=True,
                                text=True, timeout=TIMEOUT, env=program_env())
        digest = hooklib.library_name().rsplit("-", 1)[1]
        assert result.stdout.strip() == span.replace("<digest>", digest), (span, __version__)


def test_every_metric_the_readme_names_is_exported() -> None:
    """Names as the README writes them, `{a,b}` expanded; a counter's `_total` is added by the
    Prometheus client to the name the code declares."""
    sources = "\n".join(p.read_text() for root in ("vgpu_runtime", "device_plugin")
                         for p in (REPO / root).rglob("*.py"))
    names = []
    for written in re.findall(r"gemini_vgpu_[a-z_{},]+", README):
        match = re.search(r"\{([a-z_,]+)\}", written)
        options = match.group(1).split(",") if match else [""]
        names += [written.replace(match.group(0), o) if match else written for o in options]
    assert len(names) >= 10
    missing = [n for n in names if f'"{n.removesuffix("_total")}"' not in sources]
    assert not missing, f"README.md names metrics no program exports: {missing}"


def test_every_environment_variable_the_readme_names_is_read() -> None:
    """`GEMINI_*` names: in the code (Python, the hook's C, the scripts) or in a program's help,
    where settings' variables are listed (`GEMINI_<NAME>` families aside)."""
    roots = [REPO / "vgpu_runtime", REPO / "device_plugin", REPO / "scripts"]
    sources = "\n".join(p.read_text(errors="replace") for root in roots
                        for p in root.rglob("*") if p.is_file() and p.suffix in
                        ("", ".py", ".c", ".h", ".def"))
    helps = "\n".join(help_text(str(BIN / p)) for p in PROGRAMS)
    named = set(re.findall(r"GEMINI_[A-Z0-9_]*[A-Z0-9]\b", README))
    assert len(named) >= 10
    known = set(re.findall(r"GEMINI_[A-Z0-9_]*[A-Z0-9]\b", sources + helps))
    missing = sorted(named - known)
    assert not missing, f"README.md names environment variables nothing reads: {missing}"


@pytest.mark.parametrize("argv", [
    ("gemini-device-plugin", "--slices-per-gpu", "0"),
    ("gemini-daemon", "--window", "abc"),
    ("gemini-install-hook", "--hook-dir", "/proc/no-such-directory"),   # at run time
    ("gemini-run", "--share", "2", "--", "true"),
    ("gemini-vgpu", "status", "--state-dir", "/no-such-state-directory"),
], ids=lambda argv: argv[0])
def test_every_program_ends_an_error_with_its_prefix(argv: tuple[str, ...]) -> None:
    """The README: every program prints its errors as `<program>: error: <message>` (its JSON
    log may say more before it)."""
    assert "`<program>: error: <message>`" in README
    result = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                            timeout=TIMEOUT, env=program_env())
    assert result.returncode != 0
    assert result.stderr.splitlines()[-1].startswith(f"{argv[0]}: error: "), result.stderr
    assert "Traceback" not in result.stderr
