"""The wheel: tagged for the machine its interposer is built for, and installed it names that
interposer exactly as the source tree does (the name is the one the build wrote beside it)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.childenv import REPO
from vgpu_runtime import __version__, hooklib

OLDEST_GLIBC = (2, 17)


def build_wheel(tmp_path_factory: pytest.TempPathFactory, kind: str) -> Path:
    """`pip wheel` of a copy of the sources, as the image's builder runs it (GEMINI_WHEEL)."""
    if shutil.which("gcc") is None:
        pytest.skip("the interposer needs gcc")
    work = tmp_path_factory.mktemp(f"wheel-{kind}")
    source = work / "src"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    for name in ("device_plugin", "vgpu_runtime"):
        shutil.copytree(REPO / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "lib"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                             "--wheel-dir", str(work / "dist"), str(source)],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "GEMINI_WHEEL": kind})
    if result.returncode != 0 and re.search(r"No matching distribution|Could not find a version|"
                                            r"Failed to establish a new connection",
                                            result.stderr):
        pytest.skip(f"pip cannot reach the package index for setuptools:\n{result.stderr}")
    assert result.returncode == 0, result.stderr
    (built,) = (work / "dist").glob("*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory, "full")


@pytest.fixture(scope="module")
def node_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node image's (daemonset/image/Dockerfile)."""
    return build_wheel(tmp_path_factory, "node")


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


def package_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n for n in archive.namelist() if ".dist-info/" not in n}


def test_the_node_wheel_is_the_wheel_less_the_devkit(wheel: Path, node_wheel: Path) -> None:
    """The node image needs no kubelet emulator, fake API server or fake libcuda: the demo and
    the tests do, from the full wheel or the source tree."""
    devkit = {n for n in package_files(wheel) if n.startswith("vgpu_runtime/devkit/")}
    assert "vgpu_runtime/devkit/fakecuda/fake_cuda.c" in devkit   # the full wheel has it
    assert package_files(node_wheel) == package_files(wheel) - devkit


def test_the_node_programs_run_from_the_node_wheel_alone(node_wheel: Path,
                                                         tmp_path: Path) -> None:
    """Unpacked on its own path (-S: no site directory, so no editable install of this tree;
    the dependencies' directory added by hand), every command but gemini-demo imports, the
    image's four answer --help, and no devkit is found."""
    with zipfile.ZipFile(node_wheel) as archive:
        archive.extractall(tmp_path / "wheel")
        (entry_points,) = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
        scripts = dict(line.split(" = ") for line in
                       archive.read(entry_points).decode().splitlines() if " = " in line)
    assert scripts.pop("gemini-demo").startswith("vgpu_runtime.devkit.")   # removed by the image
    probe = ("import importlib, importlib.util, sys, vgpu_runtime\n"
             f"for target in {sorted(scripts.values())!r}:\n"
             "    importlib.import_module(target.split(':')[0])\n"
             "print(vgpu_runtime.__file__, importlib.util.find_spec('vgpu_runtime.devkit'))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": f"{tmp_path / 'wheel'}:{sysconfig.get_paths()['purelib']}"}
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / "wheel" / "vgpu_runtime" / "__init__.py"),
                                     "None"]
    for program in ("gemini-install-hook", "gemini-device-plugin", "gemini-daemon",
                    "gemini-config-manager"):
        module, function = scripts[program].split(":")
        run = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.argv = "
                              f"[{program!r}, '--help']; from {module} import {function}; "
                              f"{function}()"], cwd=tmp_path, env=env, capture_output=True,
                             text=True)
        assert run.returncode == 0 and "usage:" in run.stdout, (program, run.stderr)
