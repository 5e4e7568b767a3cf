"""The MPS control daemon in a container of its own (gemini-mps-control, daemonset/components/mps)
and the node daemon that adopts it (mps_manage off), on the fake control program: the program
marks its /dev/shm and becomes the control daemon; a second one refuses; the daemon adopts it,
never stops it, and says when tenants of several users share its server. On the GPU:
tests/gpu/test_mps_gpu.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.helpers import REPO, DaemonProcess, make_record, wait_for, wait_served
from tests.mpsfake import control_answers, fake_mps_control, quit_control
from vgpu_runtime.contracts import paths
from vgpu_runtime.daemon.channel.client import ChannelClient
from vgpu_runtime.daemon.mps import several_users, shm_refusal
from vgpu_runtime.devkit.childenv import child_env


def mps_control(state_dir: Path, program: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "vgpu_runtime.mpscontrol", "--state-dir", str(state_dir),
         "--mps-control", str(program), "--log-format", "text"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def status_text(state_dir: Path) -> str:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.cli", "status", "--state-dir",
                           str(state_dir)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, check=True, timeout=60).stdout


@pytest.fixture
def program(tmp_path: Path) -> Path:
    return fake_mps_control(tmp_path)


@pytest.fixture
def shm_mark(state_dir: Path) -> Iterator[Path]:
    mark = Path(paths.SHM_DIR) / paths.mps_shm_name(state_dir)
    yield mark
    mark.unlink(missing_ok=True)


def test_its_own_container_runs_it_and_the_daemon_adopts_without_stopping_it(
        state_dir: Path, program: Path, shm_mark: Path) -> None:
    runner = mps_control(state_dir, program)
    daemon = None
    try:
        wait_for(lambda: control_answers(state_dir, program), 20, "the control daemon")
        assert shm_mark.read_bytes() == paths.mps_shm_id(state_dir).read_bytes()
        assert runner.poll() is None, "the program became the control daemon (exec)"

        second = mps_control(state_dir, program)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 1 and "already answers" in out, out

        daemon = DaemonProcess(state_dir, "--simulate-gpus", "1", "--mps", "on",
                               "--mps-control", str(program), "--mps-manage", "false")
        mps = daemon.wait_ready().status()["daemon"]["mps"]
        assert mps["adopted"] is True and mps["managed"] is False
        assert daemon.stop() == 0
        assert control_answers(state_dir, program), "a daemon that does not manage it " \
            "leaves it running"
        assert shm_mark.exists(), "and leaves its mark"

        runner.send_signal(signal.SIGTERM)   # the container stops: so does the control daemon
        runner.wait(30)
        assert not control_answers(state_dir, program)
    finally:
        if daemon is not None and daemon.proc.poll() is None:
            daemon.stop()
        if runner.poll() is None:
            runner.kill()
        quit_control(state_dir, program)


def test_a_daemon_that_does_not_manage_it_starts_none_and_finds_it_once_it_runs(
        state_dir: Path, program: Path, shm_mark: Path) -> None:
    daemon = DaemonProcess(state_dir, "--simulate-gpus", "1", "--mps", "on",
                           "--mps-control", str(program), "--mps-manage", "false")
    try:
        mps = daemon.wait_ready().status()["daemon"]["mps"]
        assert mps["adopted"] is False and mps["managed"] is False
        assert not control_answers(state_dir, program)
        assert not shm_mark.exists() and not paths.mps_shm_id(state_dir).exists()
        assert "no MPS control daemon answers yet" in daemon.logs()
        assert "but none answers yet" in status_text(state_dir)
        # Its own container starts it later: the daemon's status finds it.
        runner = mps_control(state_dir, program)
        try:
            wait_for(lambda: control_answers(state_dir, program), 20, "the control daemon")
            wait_for(lambda: daemon.status()["daemon"]["mps"]["adopted"], 10, "adopted")
            assert "(its own container runs it: gemini-mps-control)" in status_text(state_dir)
        finally:
            runner.terminate()
            runner.wait(30)
    finally:
        daemon.stop()
        quit_control(state_dir, program)


# A tenant of another uid: it connects after setuid, so SO_PEERCRED names that uid. It enters
# the channel directory first, as the channels directory (0700) is root's.
OTHER_USER = textwrap.dedent("""
    import os, sys
    from vgpu_runtime.daemon.channel.client import ChannelClient
    os.chdir(sys.argv[1])
    os.setgid(65534)
    os.setuid(65534)
    with ChannelClient(sys.argv[2]) as client:
        client.hello()
        print("connected", flush=True)
        sys.stdin.read()
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a tenant as another uid")
def test_tenants_of_several_users_over_mps_are_reported_while_they_last(
        state_dir: Path, program: Path) -> None:
    daemon = DaemonProcess(state_dir, "--simulate-gpus", "1", "--mps", "on",
                           "--mps-control", str(program), "--mps-manage", "false").wait_ready()
    ours, theirs = make_record(state_dir), make_record(state_dir)
    other = None
    try:
        with ChannelClient(wait_served(ours)) as client:
            client.hello()
            socket_path = wait_served(theirs)
            other = subprocess.Popen(
                [sys.executable, "-c", OTHER_USER, str(socket_path.parent), socket_path.name],
                cwd=REPO, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True)
            assert other.stdout is not None and other.stdout.readline() == "connected\n"
            wait_for(lambda: "tenants of several users share one MPS server" in daemon.logs(),
                     10, "the report")
            assert "uids 0, 65534" in daemon.logs()
        # One user left: said once, and not again while it is one.
        other.communicate("", timeout=30)
        assert daemon.logs().count("tenants of several users share one MPS server") == 1
    finally:
        if other is not None and other.poll() is None:
            other.kill()
        daemon.stop()
        quit_control(state_dir, program)


OWN = "30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1048576k"
OF_RUN = "31 25 0:26 /gemini/mps/shm /dev/shm rw,nosuid - tmpfs tmpfs rw,size=2468378k,mode=755"
OF_DISK = "32 25 253:1 /var/tmp/shm /dev/shm rw - ext4 /dev/vda rw"


@pytest.mark.parametrize("mountinfo, refused, why", [
    (OWN, False, ""),
    (OF_RUN, True, "it is /gemini/mps/shm of a tmpfs filesystem"),
    (OF_DISK, True, "it is /var/tmp/shm of a ext4 filesystem"),
    ("", True, "nothing is mounted there"),
    (f"{OF_RUN}\n{OWN}", False, ""),            # the top mount counts
    (f"{OWN}\n{OF_RUN}", True, "of a tmpfs filesystem"),
])
def test_the_control_daemons_shm_must_be_a_tmpfs_of_its_own(
        mountinfo: str, refused: bool, why: str) -> None:
    refusal = shm_refusal(mountinfo=mountinfo)
    assert (refusal is not None) is refused, refusal
    if refused:
        assert refusal is not None and why in refusal and "allow_shared_shm" in refusal


IN_NAMESPACE = """set -eu
mount --bind "$1" /dev/shm
shift
exec "$@"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace")
def test_a_shared_shm_is_refused_unless_allowed(state_dir: Path, program: Path,
                                                tmp_path: Path) -> None:
    """gemini-mps-control with a directory of another filesystem as its /dev/shm (as a hostPath
    of the host's /run would be): refused, saying why, with nothing started or marked; with
    allow_shared_shm it runs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    base = ["unshare", "-m", "--propagation", "private", "sh", "-c", IN_NAMESPACE, "sh",
            str(shared), sys.executable, "-m", "vgpu_runtime.mpscontrol", "--state-dir",
            str(state_dir), "--mps-control", str(program), "--log-format", "text"]
    refused = subprocess.run(base, cwd=REPO, env=child_env(), capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 1, refused
    assert "/dev/shm is not a tmpfs of its own" in refused.stderr, refused.stderr
    assert not control_answers(state_dir, program)
    assert not paths.mps_shm_id(state_dir).exists() and not list(shared.iterdir())
    allowed = subprocess.Popen([*base, "--allow-shared-shm", "true"], cwd=REPO, env=child_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: control_answers(state_dir, program), 20, "the control daemon")
        assert (shared / paths.mps_shm_name(state_dir)).read_bytes() == \
            paths.mps_shm_id(state_dir).read_bytes()
    finally:
        allowed.terminate()
        allowed.wait(30)
        quit_control(state_dir, program)


def test_several_users_are_named_and_one_is_not() -> None:
    assert several_users([]) is None and several_users([1000, 1000]) is None
    error = several_users([1001, 0, 1001])
    assert error is not None and "uids 0, 1001" in str(error) and "runAsUser" in str(error)
