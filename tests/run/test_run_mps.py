"""The MPS backend through gemini-run, on the fake MPS control program (devkit/fakecuda): the
daemon gemini-run starts with GEMINI_MPS=on starts a control daemon on its state directory before
it serves a channel, the command gets that pipe directory, a daemon restarted under a running
command adopts the control daemon instead of starting another, and it is quit once no allocation
is live. Without the control program the daemon refuses to start, naming it. On the GPU:
tests/gpu/test_mps_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for
from tests.mpsfake import control_answers, fake_mps_control, quit_control
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
def fake_control(tmp_path: Path) -> Path:
    return fake_mps_control(tmp_path)


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
        # It marked the /dev/shm it started the control daemon with, for the plugin's check.
        shm_mark = Path(paths.SHM_DIR) / paths.mps_shm_name(state_dir)
        assert shm_mark.read_bytes() == paths.mps_shm_id(state_dir).read_bytes()
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
        assert not shm_mark.exists() and not paths.mps_shm_id(state_dir).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        quit_control(state_dir, fake_control)   # a failure above leaves no daemon behind


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


def test_mps_is_refused_by_the_host_daemon_and_taken_by_a_node_daemon_in_a_pod(
        tmp_path: Path) -> None:
    """The host daemon serves every user of its group and one MPS server serves one user: it
    refuses mps on, saying why. A node daemon in a pod takes it (its pods get the pipes from
    the plugin: tests/plugin/test_allocator_mps.py)."""
    base = ["--state-dir", str(tmp_path)]
    with pytest.raises(cfg.ConfigError, match="one MPS server serves one Linux user"):
        cfg.load_all(HostConfig, [*base, "--mps", "on"], environ={}).config.check()
    cfg.load_all(HostConfig, base, environ={}).config.check()
    in_pod = cfg.load_all(DaemonConfig, [*base, "--pod-name", "gemini-node-x", "--mps", "on"],
                          environ={}).config
    in_pod.check()
    assert in_pod.mps and in_pod.mps_manage
