"""The node image: scripts/build-image runs the Dockerfile's steps without Docker."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.childenv import REPO
from vgpu_runtime import paths

SCRIPT = REPO / "scripts" / "build-image"
DOCKERFILE = REPO / "daemonset" / "image" / "Dockerfile"
INSTALL_ENTRY = 'gemini-install-hook = "vgpu_runtime.install:main"'


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("build_image", str(SCRIPT))
    spec = importlib.util.spec_from_loader("build_image", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


build_image = load_script()


def pyproject_has_install_script() -> bool:
    return INSTALL_ENTRY in (REPO / "pyproject.toml").read_text()


# ---- the Dockerfile, read the way the script reads it ----

def test_the_builder_copies_what_the_wheel_is_built_from() -> None:
    assert build_image.builder_copies(DOCKERFILE) == [
        (["pyproject.toml", "setup.py", "README.md"], "./"),
        (["device_plugin"], "./device_plugin"),
        (["vgpu_runtime"], "./vgpu_runtime"),
    ]
    assert build_image.workdir(DOCKERFILE) == "/src"


def test_dockerfile_and_script_run_the_same_build_commands() -> None:
    text = DOCKERFILE.read_text()
    assert "RUN pip wheel --no-deps --wheel-dir /dist /src" in text
    assert re.search(r'pip install --no-cache-dir "\$\(ls /dist/\*\.whl\)\[kubernetes\]"', text)
    for script in build_image.REQUIRED_SCRIPTS:   # the runtime stage checks the same commands
        assert f"{script} --help" in text
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M)
    assert stages == [("${PYTHON_IMAGE}", "builder"), ("${PYTHON_IMAGE}", "")]
    assert "cuda" not in re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.M).group(1)  # type: ignore[union-attr]


def test_copy_context_follows_dockers_copy_rules(tmp_path: Path) -> None:
    build_image.copy_context(DOCKERFILE, tmp_path)
    assert (tmp_path / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml").read_bytes()
    assert (tmp_path / "device_plugin" / "allocator.py").is_file()   # contents, not a nested dir
    assert (tmp_path / "vgpu_runtime" / "hook" / "build.py").is_file()
    assert not list(tmp_path.rglob("__pycache__"))


def test_a_copy_of_a_missing_source_fails_clearly(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python AS builder\nWORKDIR /src\nCOPY no-such-dir ./x\n")
    with pytest.raises(build_image.BuildError, match="no-such-dir is not in the repository"):
        build_image.copy_context(broken, tmp_path / "src")


def fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    path.write_bytes(buffer.getvalue())
    return path


ENTRY_POINTS = "gemini_vgpu-0.1.0.dist-info/entry_points.txt"
ALL_SCRIPTS = (b"[console_scripts]\ngemini-device-plugin = a:b\ngemini-scheduler = a:b\n"
               b"gemini-install-hook = a:b\n")


def test_a_wheel_without_the_interposer_is_rejected(tmp_path: Path) -> None:
    wheel = fake_wheel(tmp_path / "w.whl", {ENTRY_POINTS: ALL_SCRIPTS})
    with pytest.raises(build_image.BuildError, match="did not build the interposer"):
        build_image.check_wheel(wheel, paths.HOOK_LIBRARY_NAME, tmp_path)


def test_a_wheel_without_a_console_script_is_rejected(tmp_path: Path) -> None:
    library = f"vgpu_runtime/lib/{paths.HOOK_LIBRARY_NAME}"
    scripts = ALL_SCRIPTS.replace(b"gemini-install-hook = a:b\n", b"")
    wheel = fake_wheel(tmp_path / "w.whl", {ENTRY_POINTS: scripts, library: b"\x7fELF"})
    with pytest.raises(build_image.BuildError, match=re.escape(INSTALL_ENTRY)):
        build_image.check_wheel(wheel, paths.HOOK_LIBRARY_NAME, tmp_path)
    not_elf = fake_wheel(tmp_path / "x.whl", {ENTRY_POINTS: ALL_SCRIPTS, library: b"text"})
    with pytest.raises(build_image.BuildError, match="not an ELF"):
        build_image.check_wheel(not_elf, paths.HOOK_LIBRARY_NAME, tmp_path)


def test_pyproject_declares_the_init_steps_console_script() -> None:
    assert pyproject_has_install_script()


# ---- the whole build ----

def source_copy(tmp_path: Path) -> Path:
    """The files the build reads."""
    root = tmp_path / "repo"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    for name in ("device_plugin", "vgpu_runtime"):
        shutil.copytree(REPO / name, root / name, ignore=build_image.IGNORED)
    (root / "scripts").mkdir()
    shutil.copy2(SCRIPT, root / "scripts" / SCRIPT.name)
    (root / "daemonset" / "image").mkdir(parents=True)
    shutil.copy2(DOCKERFILE, root / "daemonset" / "image" / "Dockerfile")
    return root


def test_build_image_produces_an_installed_node_image(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("the builder stage needs gcc")
    root = source_copy(tmp_path)
    work = tmp_path / "work"
    result = subprocess.run([sys.executable, str(root / "scripts" / "build-image"),
                             "--work", str(work)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    if result.returncode != 0 and re.search(r"No matching distribution|Could not find a version|"
                                            r"Failed to establish a new connection",
                                            result.stderr):
        pytest.skip(f"pip cannot reach the package index for setuptools:\n{result.stderr}")
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("build-image: ")]
    assert [s.split()[1] for s in steps] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    image = Path(result.stdout.splitlines()[-1])
    assert image == work / "root"
    for script in build_image.REQUIRED_SCRIPTS:
        assert (image / "bin" / script).is_file()
    (packaged,) = image.glob(
        f"lib/python*/site-packages/vgpu_runtime/lib/{paths.HOOK_LIBRARY_NAME}")
    host_copy = work / "host" / "lib" / paths.HOOK_LIBRARY_NAME
    assert host_copy.read_bytes() == packaged.read_bytes()
    assert packaged.read_bytes().startswith(b"\x7fELF")
