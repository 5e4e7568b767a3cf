"""Host-wide GPU locks (vgpu_runtime/gpulock.py) with real processes: who holds a GPU comes from
the kernel's locks; a directory or file anyone could replace is refused (fail-safe)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.childenv import REPO, child_env
from vgpu_runtime import gpulock

UUID = "GPU-lock-test"
HOLD = """
    import sys, time
    from vgpu_runtime import gpulock
    uid = None if sys.argv[2] == "host" else int(sys.argv[2])
    claims = gpulock.GpuClaims(sys.argv[1], uid)
    claims.claim(sys.argv[3])
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def locks(tmp_path: Path) -> Path:
    directory = tmp_path / "locks"
    directory.mkdir()
    os.chmod(directory, 0o1777)
    return directory


class Holder:
    """Another process holding GPU `uuid` under `uid`'s byte (or the host daemon's)."""

    def __init__(self, locks: Path, uid: int | str, uuid: str = UUID) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLD), str(locks), str(uid), uuid],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
            env=child_env())
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "held\n"

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.proc.kill()
        holder.proc.wait()


def test_the_holder_is_named_from_the_kernel_and_gone_with_its_process(
        locks: Path, holders: list[Holder]) -> None:
    holder = Holder(locks, 4242)
    holders.append(holder)
    found = gpulock.holder(locks, UUID, os.geteuid())
    assert found == gpulock.Holder(UUID, 4242, holder.proc.pid)
    assert "uid 4242" in found.describe() and f"pid {holder.proc.pid}" in found.describe()
    assert gpulock.holder(locks, UUID, 4242) is None    # one user's daemons share a GPU
    claims = gpulock.GpuClaims(locks, os.geteuid())
    with pytest.raises(gpulock.GpuHeld) as refused:
        claims.claim(UUID)
    assert "uid 4242" in str(refused.value) and "gemini-host install" in str(refused.value)
    holder.end()
    assert gpulock.holder(locks, UUID, os.geteuid()) is None
    claims.claim(UUID)     # free now: taken
    other = gpulock.GpuClaims(locks, 4243)   # in this process locks never conflict: ask a child
    assert other.held == set()
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from vgpu_runtime import gpulock; "
         f"print(gpulock.holder({str(locks)!r}, {UUID!r}, 4243))"],
        capture_output=True, text=True, cwd=REPO, env=child_env(), check=True)
    assert f"uid={os.geteuid()}" in probe.stdout
    assert claims.keep(()) == [UUID]    # released
    assert gpulock.holder(locks, UUID, 4243) is None


def test_the_host_daemon_holds_against_every_user_and_every_user_against_it(
        locks: Path, holders: list[Holder]) -> None:
    host = Holder(locks, "host")
    holders.append(host)
    found = gpulock.holder(locks, UUID, 0)
    assert found is not None and found.is_host
    assert "served by the host daemon" in gpulock.refusal(found, 0)
    host.end()
    user = Holder(locks, 4242)
    holders.append(user)
    with pytest.raises(gpulock.GpuHeld) as refused:
        gpulock.GpuClaims(locks, None).claim(UUID)
    assert "uid 4242" in str(refused.value) and "gemini-vgpu stop" in str(refused.value)


@pytest.mark.parametrize(("mode", "owner", "message"), [
    (0o777, 0, "not sticky"),
    (0o1777, 4242, "owned by uid 4242"),
])
def test_a_lock_directory_someone_else_could_replace_locks_in_is_refused(
        tmp_path: Path, mode: int, owner: int, message: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory another owner")
    directory = tmp_path / "locks"
    directory.mkdir()
    os.chmod(directory, mode)
    os.chown(directory, owner, -1)
    with pytest.raises(gpulock.GpuLockError, match=message):
        gpulock.holder(directory, UUID, 0)
    with pytest.raises(gpulock.GpuLockError, match=message):
        gpulock.GpuClaims(directory, 0).claim(UUID)


def test_no_lock_directory_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(gpulock.GpuLockError) as refused:
        gpulock.GpuClaims(tmp_path / "none", 0).claim(UUID)
    said = str(refused.value)
    assert "install -d -m 1777" in said and "GEMINI_GPU_LOCK_DIR" in said
    assert "gemini-host install" in said
    assert gpulock.lock_dir() == Path(os.environ.get("GEMINI_GPU_LOCK_DIR", "/run/lock"))


def test_a_planted_link_or_fifo_is_refused_not_followed(locks: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    gpulock.lock_file(locks, "GPU-link").symlink_to(target)
    os.mkfifo(gpulock.lock_file(locks, "GPU-fifo"))
    for uuid in ("GPU-link", "GPU-fifo"):
        with pytest.raises(gpulock.GpuLockError):
            gpulock.GpuClaims(locks, 0).claim(uuid)
    assert target.read_text() == "keep"
    with pytest.raises(gpulock.GpuLockError):
        gpulock.lock_file(locks, "../escape")


def test_a_lock_file_is_made_readable_by_every_user_whatever_the_umask(locks: Path) -> None:
    old = os.umask(0o077)
    try:
        claims = gpulock.GpuClaims(locks, os.geteuid())
        claims.claim(UUID)
    finally:
        os.umask(old)
    assert os.stat(gpulock.lock_file(locks, UUID)).st_mode & 0o777 == 0o444
    claims.close()
