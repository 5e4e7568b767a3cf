"""gemini-install-hook: versioned install, never overwrite, retire old versions no record uses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.childenv import REPO, child_env
from vgpu_runtime import hooklib, install
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare
from vgpu_runtime.contracts.share import Share

CURRENT = hooklib.library_name()
# The name every node held before the digest was added: records of running pods name it.
OLD = install.LIBRARY_PREFIX + "0.1.0"
OLDER = install.LIBRARY_PREFIX + "0.0.8"


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A state directory as on a node: lib/, allocations/."""
    state = tmp_path / "gemini"
    (state / "lib").mkdir(parents=True)
    return state


@pytest.fixture
def library(tmp_path: Path) -> Path:
    """The new version's bytes (any bytes do: the install step copies, it does not load)."""
    source = tmp_path / "build" / CURRENT
    source.parent.mkdir()
    source.write_bytes(b"\x7fELF new interposer " + os.urandom(64))
    return source


def config(state: Path, library: Path) -> install.InstallConfig:
    return install.InstallConfig(state_dir=str(state), library=str(library))


def record_using(state: Path, hook_library: str, seed: str) -> AllocationRecord:
    allocation_id = allocation.id_for_devices([seed])
    record = AllocationRecord(
        id=allocation_id, origin="kubelet", device_ids=(seed,),
        gpus=(GpuShare("GPU-0", 0, Share.from_float(0.3), 1 << 30),),
        channel_dir=str(paths.channel_dir(state, allocation_id)),
        hook_library=hook_library, created_at=time.time())
    allocation.write_record(state, record)
    return record


def lib_names(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "lib").iterdir())


def test_fresh_install_writes_the_versioned_file_readable_by_all(node: Path,
                                                                 library: Path) -> None:
    outcome = install.run(config(node, library))
    target = node / "lib" / CURRENT
    assert outcome.newly_installed and outcome.library == target
    assert target.read_bytes() == library.read_bytes()
    assert target.stat().st_mode & 0o777 == 0o755
    assert lib_names(node) == [CURRENT]   # no temporary file left behind


def test_identical_rerun_is_a_no_op(node: Path, library: Path) -> None:
    install.run(config(node, library))
    target = node / "lib" / CURRENT
    before = target.stat()
    time.sleep(0.01)
    outcome = install.run(config(node, library))
    after = target.stat()
    assert not outcome.newly_installed
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert lib_names(node) == [CURRENT]


def test_different_bytes_under_the_same_name_are_refused_and_kept(node: Path,
                                                                  library: Path) -> None:
    target = node / "lib" / CURRENT
    target.write_bytes(b"the library running pods use")
    with pytest.raises(install.InstallError, match="different content"):
        install.run(config(node, library))
    assert target.read_bytes() == b"the library running pods use"
    assert lib_names(node) == [CURRENT]


@pytest.mark.slow   # builds a changed hook, as the image build does
def test_a_refusal_names_what_differs(node: Path, tmp_path: Path) -> None:
    """Two real builds under one name, the second with other flags (as another compiler would
    do): the message shows size, sha256 and build ID of both, and the SONAME is the same."""
    from vgpu_runtime.hook import build

    first = build.build_library(tmp_path / "first")
    install.run(config(node, first))
    command = build.compile_command(tmp_path / CURRENT)
    subprocess.run([*command, "-fno-inline"], check=True, capture_output=True)
    with pytest.raises(install.InstallError) as refused:
        install.run(config(node, tmp_path / CURRENT))
    message = str(refused.value)
    facts = install.identity.describe(first)
    assert f"sha256: installed {facts['sha256']}, new " in message
    assert f"build-id: installed {facts['build-id']}, new " in message
    assert facts["soname"] == CURRENT and "soname:" not in message
    assert "GCC" in facts["compiler"] and "compiler:" not in message   # same gcc here
    assert (node / "lib" / CURRENT).read_bytes() == first.read_bytes()


def test_a_non_regular_file_under_the_name_is_refused(node: Path, library: Path) -> None:
    (node / "lib" / CURRENT).symlink_to(library)
    with pytest.raises(install.InstallError, match="not a regular file"):
        install.run(config(node, library))
    assert (node / "lib" / CURRENT).is_symlink()


def test_a_missing_source_is_a_clear_error(node: Path, tmp_path: Path) -> None:
    with pytest.raises(install.InstallError, match="not found"):
        install.run(config(node, tmp_path / "nowhere.so"))
    assert lib_names(node) == []


def test_upgrade_keeps_a_version_a_record_uses_and_deletes_it_once_the_record_goes(
        node: Path, library: Path) -> None:
    (node / "lib" / OLD).write_bytes(b"old interposer")
    running = record_using(node, OLD, "GPU-0::1")

    outcome = install.run(config(node, library))
    assert outcome.newly_installed
    assert outcome.removed == [] and OLD in outcome.kept
    assert lib_names(node) == sorted([CURRENT, OLD])   # running pod keeps its library
    assert (node / "lib" / OLD).read_bytes() == b"old interposer"

    allocation.remove_record(node, running.id)          # the pod is gone
    outcome = install.run(config(node, library))
    assert outcome.removed == [OLD] and not outcome.newly_installed
    assert lib_names(node) == [CURRENT]


def test_unused_old_versions_go_and_the_current_one_stays_without_records(
        node: Path, library: Path) -> None:
    (node / "lib" / OLD).write_bytes(b"old")
    (node / "lib" / OLDER).write_bytes(b"older")
    record_using(node, OLD, "GPU-0::1")
    outcome = install.run(config(node, library))
    assert outcome.removed == [OLDER]
    assert lib_names(node) == sorted([CURRENT, OLD])
    # No record names the current version: it is never deleted all the same.
    for path, _ in allocation.scan_records(node):
        path.unlink()
    install.run(config(node, library))
    assert lib_names(node) == [CURRENT]


def test_a_record_naming_the_current_version_does_not_protect_others(node: Path,
                                                                     library: Path) -> None:
    (node / "lib" / OLD).write_bytes(b"old")
    record_using(node, CURRENT, "GPU-0::2")
    assert install.run(config(node, library)).removed == [OLD]


@pytest.mark.parametrize("garbage", [b"{not json", b'{"version": 1, "id": "k-0"}', b"\xff\xfe"])
def test_an_unreadable_record_means_nothing_is_deleted(node: Path, library: Path,
                                                       garbage: bytes) -> None:
    (node / "lib" / OLD).write_bytes(b"old")
    allocations = paths.allocations_dir(node)
    allocations.mkdir()
    bad = allocations / f"{allocation.id_for_devices(['x'])}.json"
    bad.write_bytes(garbage)

    outcome = install.run(config(node, library))
    assert outcome.removed == [] and "unreadable" in outcome.kept[OLD]
    assert bad.name in outcome.kept[OLD]          # the reason names the record
    assert lib_names(node) == sorted([CURRENT, OLD])
    assert bad.read_bytes() == garbage             # the record itself is never touched

    bad.unlink()                                   # the operator removes the bad record
    assert install.run(config(node, library)).removed == [OLD]


def test_stale_temporary_files_go_fresh_ones_stay(node: Path, library: Path) -> None:
    stale = node / "lib" / f".{CURRENT}.abc{install.TEMP_SUFFIX}"
    fresh = node / "lib" / f".{CURRENT}.def{install.TEMP_SUFFIX}"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = time.time() - install.STALE_TEMP_AGE - 10
    os.utime(stale, (old, old))
    install.run(config(node, library))
    assert lib_names(node) == sorted([CURRENT, fresh.name])


def test_hook_dir_setting_overrides_the_state_dir_default(node: Path, library: Path,
                                                          tmp_path: Path) -> None:
    elsewhere = tmp_path / "hooks"
    cfg = install.InstallConfig(state_dir=str(node), hook_dir=str(elsewhere),
                                library=str(library))
    assert install.run(cfg).library == elsewhere / CURRENT
    assert lib_names(node) == []


# ---- the console entry point, as the init container runs it ----

def run_module(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.install", *args],
                          cwd=REPO, env=child_env(**env), capture_output=True, text=True,
                          timeout=60)


def log_lines(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_module_installs_from_env_then_refuses_changed_bytes(node: Path, library: Path) -> None:
    first = run_module(GEMINI_STATE_DIR=str(node), GEMINI_LIBRARY=str(library))
    assert first.returncode == 0, first.stderr
    assert [e["msg"] for e in log_lines(first.stderr)] == ["interposer installed"]

    again = run_module("--state-dir", str(node), "--library", str(library))
    assert again.returncode == 0, again.stderr
    assert [e["msg"] for e in log_lines(again.stderr)] == ["interposer already present"]

    library.write_bytes(b"rebuilt without a version bump")
    refused = run_module("--state-dir", str(node), "--library", str(library))
    assert refused.returncode == 1
    (entry,) = log_lines(refused.stderr)
    assert entry["level"] == "error" and "different content" in str(entry["reason"])
    assert (node / "lib" / CURRENT).read_bytes() != library.read_bytes()


def test_module_rejects_a_bad_setting_by_name(node: Path) -> None:
    result = run_module("--state-dir", str(node), "--log-level", "loud")
    assert result.returncode == 2
    assert "--log-level" in result.stderr and not (node / "lib" / CURRENT).exists()


def test_module_installs_the_packaged_interposer_by_default(node: Path) -> None:
    """From a source tree the interposer is built on demand (gcc), as hooklib does."""
    result = run_module("--state-dir", str(node), "--log-format", "text")
    assert result.returncode == 0, result.stderr
    installed = (node / "lib" / CURRENT).read_bytes()
    assert installed.startswith(b"\x7fELF")
    assert installed == hooklib.library_path().read_bytes()


def install_from(tree: Path, state: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """The init step of an image built from `tree` (its interposer built from its own sources)."""
    env = {**child_env(XDG_CACHE_HOME=str(cache)), "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-m", "vgpu_runtime.install", "--state-dir",
                           str(state), "--log-format", "text"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow   # builds a changed hook, as the image build does
def test_an_image_with_changed_hook_sources_installs_beside_the_running_one(
        node: Path, tmp_path: Path) -> None:
    """Upgrade, rollback and cleanup across a change to the hook: never a refusal, the running
    pod's file stays while its record does."""
    upgraded = tmp_path / "upgraded"
    shutil.copytree(REPO / "vgpu_runtime", upgraded / "vgpu_runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "lib"))
    gate = upgraded / "vgpu_runtime" / "hook" / "launch" / "gate.c"
    gate.write_text(gate.read_text() + "\n/* the next release's change */\n")

    first = install_from(REPO, node, tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    running = record_using(node, CURRENT, "GPU-0::1")

    upgrade = install_from(upgraded, node, tmp_path / "cache")
    assert upgrade.returncode == 0, upgrade.stderr
    (new,) = set(lib_names(node)) - {CURRENT}
    assert new.startswith(install.LIBRARY_PREFIX) and new in upgrade.stderr
    assert "kept an old interposer version" in upgrade.stderr

    rollback = install_from(REPO, node, tmp_path / "cache")
    assert rollback.returncode == 0 and "already present" in rollback.stderr, rollback.stderr

    allocation.remove_record(node, running.id)      # the old release's last pod is gone
    cleanup = install_from(upgraded, node, tmp_path / "cache")
    assert cleanup.returncode == 0, cleanup.stderr
    assert lib_names(node) == [new]
