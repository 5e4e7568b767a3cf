"""The MPS backend through gemini-run, on the fake MPS control program (devkit/fakecuda): the
daemon gemini-run starts with GEMINI_MPS=on starts a control daemon on its state directory before
it serves a channel, the command gets that pipe directory, a daemon restarted under a running
command adopts the control daemon instead of starting another, and it is quit once no allocation
is live. Without the control program the daemon refuses to start, naming it. On the GPU:
tests/gpu/test_mps_gpu.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for
from tests.run.conftest import stop_daemon
from tests.run.test_run import ENV, finish, gemini_run, probe_started
from vgpu_runtime.common import config as cfg
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon import lock
from vgpu_runtime.daemon.channel import client
from vgpu_runtime.daemon.config import DaemonConfig
from vgpu_runtime.daemon.host.config import HostConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_control(tmp_path: Path) -> Iterator[Path]:
    """`nvidia-cuda-mps-control` as a program on disk: the fake, run from this checkout."""
    program = tmp_path / "nvidia-cuda-mps-control"
    program.write_text(f"#!/bin/sh\ncd {REPO} && exec {sys.executable} -m "
                       "vgpu_runtime.devkit.fakecuda.fake_mps_control \"$@\"\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    yield program


def control_answers(state_dir: Path, program: Path) -> bool:
    env = {**ENV, "CUDA_MPS_PIPE_DIRECTORY": str(paths.mps_pipe_dir(state_dir))}
    return subprocess.run([str(program)], input="get_server_list\n", text=True, env=env,
                          capture_output=True, check=False).returncode == 0


def control_starts(state_dir: Path) -> int:
    log = paths.mps_log_dir(state_dir) / "control.log"
    return log.read_text().count("control daemon started") if log.exists() else 0


def test_the_command_runs_over_the_daemons_mps_and_a_restart_adopts_it(
        state_dir: Path, hook_library: Path, fake_control: Path) -> None:
    env = {**ENV, "GEMINI_MPS": "on", "GEMINI_MPS_CONTROL": str(fake_control)}
    proc = gemini_run(state_dir, hook_library, "--share", "0.5", env=env)
    try:
        seen = probe_started(proc)
        pipe_dir = paths.mps_pipe_dir(state_dir)
        assert seen["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe_dir)
        assert control_answers(state_dir, fake_control) and control_starts(state_dir) == 1
        assert client.request(state_dir)["daemon"]["mps"]["adopted"] is False
        shown = subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "status",
                                "--state-dir", str(state_dir)], cwd=REPO, env=ENV,
                               capture_output=True, text=True, check=True).stdout
        assert f"commands run over MPS: the control daemon's pipes in {pipe_dir}" in shown, shown

        # The daemon stops under the running command: the control daemon stays, and the next
        # daemon adopts it.
        stop_daemon(state_dir)
        assert control_answers(state_dir, fake_control)
        again = DaemonProcess(state_dir, "--simulate-gpus", "2", "--mps", "on",
                              "--mps-control", str(fake_control)).wait_ready()
        try:
            assert client.request(state_dir)["daemon"]["mps"]["adopted"] is True
            assert control_starts(state_dir) == 1

            # The command ends; the daemon, stopping with nothing live, quits it.
            assert finish(proc)[0] == 0
            wait_for(lambda: not client.request(state_dir)["allocations"], 10,
                     "the allocation gone")
            assert again.stop() == 0
        finally:
            if again.proc.poll() is None:
                again.stop()
        assert not control_answers(state_dir, fake_control)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if control_answers(state_dir, fake_control):   # a failure above leaves no daemon behind
            subprocess.run([str(fake_control)], input="quit\n", text=True, check=False, env={
                **ENV, "CUDA_MPS_PIPE_DIRECTORY": str(paths.mps_pipe_dir(state_dir))})


def test_without_the_control_program_the_daemon_refuses_to_start(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    missing = tmp_path / "no-such-mps-control"
    daemon = subprocess.run(
        [sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir", str(state_dir),
         "--simulate-gpus", "1", "--mps", "on", "--mps-control", str(missing)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60, check=False)
    assert daemon.returncode == 1, daemon
    assert f"the MPS control program {str(missing)!r} is not found" in daemon.stderr, \
        daemon.stderr
    assert not lock.is_held(state_dir)
    assert not os.path.exists(paths.channels_dir(state_dir)), "served nothing"


@pytest.mark.parametrize("config, argv, why", [
    (DaemonConfig, ["--pod-name", "gemini-node-x"], "pods are not given the MPS"),
    (HostConfig, [], "one MPS server serves one Linux user"),
])
def test_mps_is_refused_where_its_tenants_could_not_use_it(
        tmp_path: Path, config: type[DaemonConfig], argv: list[str], why: str) -> None:
    """A node daemon in a pod (its pods do not get the pipes) and the host daemon (MPS serves
    one user) refuse mps on, saying why; off, both load."""
    base = ["--state-dir", str(tmp_path), *argv]
    with pytest.raises(cfg.ConfigError, match=why):
        cfg.load_all(config, [*base, "--mps", "on"], environ={}).config.check()
    cfg.load_all(config, base, environ={}).config.check()
