"""gemini-host install, uninstall and unit: the systemd unit verified by systemd itself, the
install and uninstall into temporary places (the test machines do not run systemd)."""

from __future__ import annotations

import dataclasses
import grp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.childenv import REPO
from tests.host.conftest import ENV, Members
from vgpu_runtime import hostctl, hoststate
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.devkit.daemon_process import make_record

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="install and uninstall run as root")


def gemini_host(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.hostctl", *args],
                          capture_output=True, text=True, cwd=REPO, env=ENV, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is missing (apt-get install systemd)")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    printed = gemini_host("unit", "--host-group", "gemini")
    assert printed.returncode == 0, printed.stderr
    unit = tmp_path / hostctl.UNIT_NAME
    unit.write_text(printed.stdout)
    verified = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                              capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are only warnings for systemd: none may be printed.
    assert verified.returncode == 0 and verified.stderr.strip() == "", verified.stderr
    text = printed.stdout
    assert f"ExecStart={sys.executable} -m vgpu_runtime.daemon.host --state-dir " \
           f"{paths.DEFAULT_STATE_DIR} --host-group gemini --metrics-port 9402" in text
    assert f"ReadWritePaths={paths.DEFAULT_STATE_DIR} -{paths.DEFAULT_GPU_LOCK_DIR}" in text
    # It would be caught: a broken unit is not verified.
    unit.write_text(text.replace(f"ExecStart={sys.executable}", "ExecStart=/nowhere/python"))
    broken = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, timeout=60)
    assert broken.returncode != 0


@needs_root
def test_install_then_uninstall_says_what_it_did_and_left(root_dir: Path) -> None:
    group = f"gmins{os.getpid() % 100000}"
    state, units = root_dir / "state", root_dir / "units"
    try:
        installed = gemini_host("install", "--state-dir", str(state), "--unit-dir", str(units),
                                "--host-group", group, "--no-start")
        assert installed.returncode == 0, installed.stderr
        assert f"group {group} created" in installed.stdout
        assert "not started (--no-start)" in installed.stdout
        unit = units / hostctl.UNIT_NAME
        assert f"--host-group {group}" in unit.read_text() and unit.stat().st_mode & 0o777 == 0o644
        marker = hoststate.read_marker(state)
        assert marker is not None and marker.group == group
        # Installed is enough for the node's programs to refuse, and for gemini-run to find it
        # (not running: it says how to start it).
        refused = subprocess.run([sys.executable, "-m", "vgpu_runtime.daemon", "--state-dir",
                                  str(state), "--metrics-port", "0"], capture_output=True,
                                 text=True, cwd=REPO, env=ENV, timeout=30)
        assert refused.returncode == 1 and "belongs to the host daemon" in refused.stderr
        run = subprocess.run([sys.executable, "-m", "vgpu_runtime.run", "--state-dir",
                              str(state), "--hook-library", sys.executable, "--", "true"],
                             capture_output=True, text=True, cwd=REPO, env=ENV, timeout=30)
        assert run.returncode == 125 and "systemctl start gemini-host" in run.stderr
        # A user's allocation left by a stopped daemon goes with the uninstall.
        paths.host_channels_dir(state).mkdir(mode=0o711)
        record = make_record(state, allocation_id="r-00000000000000aa", origin="gemini-run")
        allocation.write_record(state, dataclasses.replace(record, owner_uid=4242))
        removed = gemini_host("uninstall", "--state-dir", str(state), "--unit-dir", str(units),
                              "--host-group", group)
        assert removed.returncode == 0, removed.stderr
        said = removed.stdout
        assert f"removed {unit}" in said and not unit.exists()
        assert "removed 1 allocation(s) of users (r-00000000000000aa)" in said
        assert "removed the mark" in said and hoststate.read_marker(state) is None
        assert f"left group {group}" in said and f"sudo groupdel {group}" in said
        assert "left" in said and "GPU lock files" in said
        assert not paths.host_channels_dir(state).exists()
        grp.getgrnam(group)   # left, as it said
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


@needs_root
def test_install_refuses_a_nodes_state_and_code_another_user_can_change(
        root_dir: Path) -> None:
    state, units = root_dir / "state", root_dir / "units"
    state.mkdir()
    paths.health_file(state).write_text("{}")
    refused = gemini_host("install", "--state-dir", str(state), "--unit-dir", str(units),
                          "--host-group", "root", "--no-start")
    assert refused.returncode == 1 and "Kubernetes node's state" in refused.stderr
    theirs = root_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    (theirs / "python").symlink_to(sys.executable)
    refused = gemini_host("install", "--state-dir", str(root_dir / "other"), "--unit-dir",
                          str(units), "--host-group", "root", "--no-start", "--python",
                          str(theirs / "python"))
    assert refused.returncode == 1, refused.stderr
    assert f"{theirs} is owned by uid 4242" in refused.stderr
    assert "code that another user can change" in refused.stderr
    assert not (units / hostctl.UNIT_NAME).exists()


def test_install_and_uninstall_refuse_a_user(members: Members) -> None:
    for command in ("install", "uninstall"):
        refused = members.alice.run([sys.executable, "-m", "vgpu_runtime.hostctl", command])
        assert refused.returncode == 1 and f"{command} as root" in refused.stderr
