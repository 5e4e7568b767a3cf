"""Which allocation a process without a connection belongs to (attribution.py): the readers of
/proc on a planted tree (mountinfo, cgroup, stat as the kernel writes them), and the kill's
start-time check on real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from vgpu_runtime.daemon.channel import attribution
from vgpu_runtime.daemon.channel.attribution import Candidate, ProcessId

POD = Candidate("k-aaaa", "kubelet", None, "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0")
OTHER_POD = Candidate("k-bbbb", "kubelet", None, "11111111-2222-3333-4444-555555555555")
RUN = Candidate("r-cccc", "gemini-run", 40, "")
SELF_MOUNTS = ("22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
               "23 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n")


def plant(proc: Path, pid: int, parent: int, mountinfo: str = SELF_MOUNTS,
          cgroup: str = "0::/user.slice\n", start: int = 1000) -> None:
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    # comm may hold spaces and parentheses: fields are counted after the last ')'.
    rest = ["S", str(parent)] + ["0"] * 17 + [str(start)] + ["0"] * 10
    (entry / "stat").write_text(f"{pid} (a (b) c) " + " ".join(rest) + "\n")
    (entry / "mountinfo").write_text(mountinfo)
    (entry / "cgroup").write_text(cgroup)


def test_the_pods_channel_mount_names_its_allocation(tmp_path: Path) -> None:
    mounts = SELF_MOUNTS + (
        "31 23 0:40 /var/lib/gemini/channels/k-aaaa /run/gemini ro,nosuid - ext4 /dev/sda1 "
        "rw\n")
    plant(tmp_path, 100, 1, mounts)
    # The state directory on its own filesystem: the root is relative to it.
    plant(tmp_path, 101, 1, SELF_MOUNTS + "31 23 0:41 /gemini/channels/k-bbbb /run/gemini ro "
          "- xfs /dev/sdb rw\n")
    # Mounted elsewhere, or a directory that is no channel: nothing.
    plant(tmp_path, 102, 1, SELF_MOUNTS + "31 23 0:40 /var/lib/gemini/channels/k-aaaa /mnt "
          "ro - ext4 /dev/sda1 rw\n")
    plant(tmp_path, 103, 1, SELF_MOUNTS + "31 23 0:40 /tmp/k-aaaa /run/gemini ro - ext4 "
          "/dev/sda1 rw\n")
    pods = [POD, OTHER_POD]
    assert attribution.attribute(100, pods, tmp_path) == "k-aaaa"
    assert attribution.attribute(101, pods, tmp_path) == "k-bbbb"
    assert attribution.attribute(102, pods, tmp_path) is None
    assert attribution.attribute(103, pods, tmp_path) is None
    assert attribution.attribute(999, pods, tmp_path) is None   # gone


def test_a_pods_cgroup_names_it_where_one_allocation_is_that_pods(tmp_path: Path) -> None:
    systemd = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b1c2d3e_"
               "4f50_6172_8394_a5b6c7d8e9f0.slice/cri-containerd-0123.scope\n")
    cgroupfs = "0::/kubepods/besteffort/pod0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0/0123abcd\n"
    plant(tmp_path, 200, 1, cgroup=systemd)
    plant(tmp_path, 201, 1, cgroup=cgroupfs)
    assert attribution.attribute(200, [POD, OTHER_POD], tmp_path) == "k-aaaa"
    assert attribution.attribute(201, [POD, OTHER_POD], tmp_path) == "k-aaaa"
    # Two allocations of that pod (two GPU containers): the cgroup cannot tell which.
    second = Candidate("k-dddd", "kubelet", None, POD.pod_uid)
    assert attribution.attribute(200, [POD, second], tmp_path) is None


def test_gemini_runs_command_tree_is_its_allocation(tmp_path: Path) -> None:
    plant(tmp_path, 40, 1)       # gemini-run
    plant(tmp_path, 41, 40)      # its command
    plant(tmp_path, 42, 41)      # a worker of the command
    plant(tmp_path, 50, 1)       # someone else's
    plant(tmp_path, 51, 51)      # a loop in the parents (a broken tree) ends
    assert attribution.attribute(41, [RUN], tmp_path) == "r-cccc"
    assert attribution.attribute(42, [RUN], tmp_path) == "r-cccc"
    assert attribution.attribute(50, [RUN], tmp_path) is None
    assert attribution.attribute(51, [RUN], tmp_path) is None
    # A kubelet record's owner_pid (none) never makes a tree.
    assert attribution.attribute(42, [Candidate("k-x", "kubelet", 40, "")], tmp_path) is None


def test_a_kill_checks_the_start_time_so_a_reused_pid_is_spared() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = attribution.identify(sleeper.pid)
        assert now is not None
        assert attribution.kill(ProcessId(sleeper.pid, now.start + 1)) == "gone"
        assert sleeper.poll() is None
        assert attribution.kill(now) is None
        assert sleeper.wait(5) == -signal.SIGKILL
        assert attribution.kill(now) == "gone"
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
