"""The wheel: tagged for the machine its interposer is built for, and installed it names that
interposer exactly as the source tree does (the name is the one the build wrote beside it)."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.childenv import REPO
from vgpu_runtime import __version__, hooklib

OLDEST_GLIBC = (2, 17)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("the interposer needs gcc")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    for name in ("device_plugin", "vgpu_runtime"):
        shutil.copytree(REPO / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "lib"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                             "--wheel-dir", str(work / "dist"), str(source)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and re.search(r"No matching distribution|Could not find a version|"
                                            r"Failed to establish a new connection",
                                            result.stderr):
        pytest.skip(f"pip cannot reach the package index for setuptools:\n{result.stderr}")
    assert result.returncode == 0, result.stderr
    (built,) = (work / "dist").glob("*.whl")
    return built


def test_the_wheel_is_tagged_for_the_machine_and_glibc_of_its_library(wheel: Path) -> None:
    tag = f"py3-none-manylinux2014_{platform.machine()}"
    assert wheel.name == f"gemini_vgpu-{__version__}-{tag}.whl"
    with zipfile.ZipFile(wheel) as archive:
        meta = archive.read(f"gemini_vgpu-{__version__}.dist-info/WHEEL").decode()
        library = archive.read(f"vgpu_runtime/lib/{hooklib.library_name()}")
    assert f"Tag: {tag}" in meta and "Root-Is-Purelib: false" in meta
    assert library.startswith(b"\x7fELF")
    scratch = wheel.parent / hooklib.library_name()
    scratch.write_bytes(library)
    symbols = subprocess.run(["objdump", "-T", str(scratch)], capture_output=True, text=True,
                             check=True).stdout
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"GLIBC_([0-9.]+)",
                                                                         symbols)}
    assert versions and max(versions) <= OLDEST_GLIBC, "manylinux2014 promises glibc 2.17"


def test_the_kit_ships_the_fake_driver_sources(wheel: Path) -> None:
    """The kit builds the fake libcuda and NVML from C sources when used: they are package data."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for source in ("fake_cuda.c", "fake_nvml.c", "builder.py"):
        assert f"vgpu_runtime/devkit/fakecuda/{source}" in names, source
    assert "vgpu_runtime/devkit/demo.py" in names


def test_installed_it_names_and_finds_the_library_it_carries(wheel: Path,
                                                            tmp_path: Path) -> None:
    """The plugin puts hooklib.library_name() in LD_PRELOAD and the installer copies the
    packaged file: both must agree with the file the wheel holds, outside the source tree.
    Installed, the name is read from the build's file: the build's digest is never asked."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")],
                   check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(tmp_path / "env/bin/python"),
                    "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    probe = ("from vgpu_runtime import hooklib; import vgpu_runtime; "
             "from vgpu_runtime.hook import build; build.sources_digest = None; "
             "print(hooklib.library_name()); print(hooklib.installed_library()); "
             "print(vgpu_runtime.__file__)")
    out = subprocess.run([str(tmp_path / "env/bin/python"), "-c", probe], cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    name, installed, package = out
    assert Path(package).is_relative_to(tmp_path / "env")
    assert name == hooklib.library_name()
    assert installed != "None" and Path(installed).name == name
    with zipfile.ZipFile(wheel) as archive:
        assert Path(installed).read_bytes() == archive.read(f"vgpu_runtime/lib/{name}")
        assert archive.read("vgpu_runtime/lib/hook-library-name").decode() == f"{name}\n"
