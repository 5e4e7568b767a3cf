"""Allocate over MPS (the node setting mps): a container gets the control daemon's pipes and the
/dev/shm its server runs with, and only where the control daemon that runs marked that
directory (vgpu_runtime.daemon.mps). Without the marks the container's CUDA would wait for a
server it cannot reach, so the Allocate is refused, saying why, and writes nothing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from device_plugin.allocator import AllocationError
from tests.plugin.conftest import Make
from tests.plugin.test_allocator import slice_ids
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.daemon.mps import MpsControl


def marked(state_dir: str, shm_dir: Path) -> MpsControl:
    """The marks a starting control daemon leaves, made by the code that makes them."""
    control = MpsControl(state_dir, "nvidia-cuda-mps-control", shm_dir=shm_dir)
    control.make_dirs()
    control.mark_shm()
    return control


def test_a_container_gets_the_pipes_and_the_servers_shm(make: Make, tmp_path: Path) -> None:
    allocator, table, _ = make(mps=True, mps_shm_dir=str(tmp_path))
    state = allocator.config.state_dir
    marked(state, tmp_path)
    answer = allocator.allocate(slice_ids(table, 0, 3))
    assert answer.envs["CUDA_MPS_PIPE_DIRECTORY"] == paths.CONTAINER_MPS_PIPE_DIR
    mounts = {m.container_path: m for m in answer.mounts}
    assert mounts[paths.CONTAINER_MPS_PIPE_DIR].host_path == str(paths.mps_pipe_dir(state))
    assert mounts[paths.SHM_DIR].host_path == str(tmp_path)
    assert not mounts[paths.CONTAINER_MPS_PIPE_DIR].read_only
    assert not mounts[paths.SHM_DIR].read_only
    # The share and the memory limit are still the tokens' and the hook's, not MPS's.
    assert not any(k.startswith("CUDA_MPS_ACTIVE") for k in answer.envs)


def test_without_mps_a_container_keeps_its_own_shm(make: Make) -> None:
    allocator, table, _ = make()
    answer = allocator.allocate(slice_ids(table, 0, 1))
    assert "CUDA_MPS_PIPE_DIRECTORY" not in answer.envs
    assert {m.container_path for m in answer.mounts} == {paths.CONTAINER_LIB_DIR,
                                                         paths.CONTAINER_CHANNEL_DIR}


def refused(make: Make, shm_dir: Path, ids_of: int = 2) -> tuple[AllocationError, str, list[str]]:
    allocator, table, _ = make(mps=True, mps_shm_dir=str(shm_dir))
    ids = slice_ids(table, 0, ids_of)
    with pytest.raises(AllocationError) as caught:
        allocator.allocate(ids)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    state = allocator.config.state_dir
    assert not paths.channel_dir(state, allocation.id_for_devices(ids)).exists()
    assert not paths.allocations_dir(state).exists() or not any(
        paths.allocations_dir(state).iterdir()), "a refused Allocate writes no record"
    return caught.value, state, ids


def test_refused_before_any_control_daemon_started(make: Make, tmp_path: Path) -> None:
    err, state, _ = refused(make, tmp_path)
    assert "no MPS control daemon has started" in err.message
    assert str(paths.mps_shm_id(state)) in err.message and "gemini-mps-control" in err.message


def test_refused_where_mps_shm_dir_is_not_the_servers(make: Make, tmp_path: Path) -> None:
    """The control daemon ran with another /dev/shm (its mark is there, not in mps_shm_dir)."""
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    allocator, table, _ = make(mps=True, mps_shm_dir=str(ours))
    marked(allocator.config.state_dir, theirs)
    ids = slice_ids(table, 0, 2)
    with pytest.raises(AllocationError) as caught:
        allocator.allocate(ids)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"mps_shm_dir {ours} is not the /dev/shm" in caught.value.message
    assert not paths.channel_dir(allocator.config.state_dir,
                                 allocation.id_for_devices(ids)).exists()
    # A control daemon started again, with that directory: the same request is served.
    marked(allocator.config.state_dir, ours)
    assert allocator.allocate(ids).envs["CUDA_MPS_PIPE_DIRECTORY"]


def test_a_stale_mark_from_an_earlier_control_daemon_is_refused(make: Make,
                                                                 tmp_path: Path) -> None:
    """A mark left in mps_shm_dir by an earlier start does not match a later start's."""
    allocator, table, _ = make(mps=True, mps_shm_dir=str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    state = allocator.config.state_dir
    marked(state, tmp_path / "shm")
    earlier = (tmp_path / "shm" / paths.mps_shm_name(state)).read_bytes()
    (tmp_path / "elsewhere").mkdir()
    marked(state, tmp_path / "elsewhere")     # restarted with another /dev/shm
    assert (tmp_path / "shm" / paths.mps_shm_name(state)).read_bytes() == earlier
    with pytest.raises(AllocationError, match="is not the /dev/shm"):
        allocator.allocate(slice_ids(table, 1, 1))
