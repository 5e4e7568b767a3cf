"""scripts/build-image's choice of podman storage driver, without building: kept once made."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest

from tests.scriptmodule import load


@pytest.fixture(scope="module")
def build_image() -> ModuleType:
    return load("build-image")


def test_the_choice_is_kept_and_a_store_never_changes_driver(build_image: ModuleType,
                                                             tmp_path: Path) -> None:
    assert build_image.storage_driver(tmp_path, "vfs") == "vfs"
    assert (tmp_path / "storage-driver").read_text() == "vfs\n"
    assert build_image.storage_driver(tmp_path, "auto") == "vfs"        # kept
    with pytest.raises(build_image.BuildError, match="is on vfs, not overlay: remove"):
        build_image.storage_driver(tmp_path, "overlay")
    assert (tmp_path / "storage-driver").read_text() == "vfs\n"         # nothing lost


def test_a_store_from_before_the_choice_was_kept_stays_on_vfs(build_image: ModuleType,
                                                              tmp_path: Path) -> None:
    (tmp_path / "storage" / "vfs").mkdir(parents=True)
    assert build_image.storage_driver(tmp_path, "auto") == "vfs"
    assert (tmp_path / "storage-driver").read_text() == "vfs\n"


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
def test_auto_asks_podman_and_leaves_no_probe_behind(build_image: ModuleType,
                                                     tmp_path: Path) -> None:
    driver = build_image.storage_driver(tmp_path, "auto")
    assert driver in ("overlay", "vfs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["storage-driver"]
