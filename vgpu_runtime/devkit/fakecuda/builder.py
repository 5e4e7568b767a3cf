"""Compiles the fake driver (libcuda.so.1 + libcuda.so) and fake NVML for the hook's tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOOK_INCLUDE = HERE.parents[1] / "hook" / "include"


def _compile(source: Path, output: Path, soname: str) -> None:
    # -Bsymbolic: the fake hands out its own function pointers, as the real driver does,
    # even though the hook preloaded in front of it exports the same names.
    cmd = ["gcc", "-std=gnu11", "-O1", "-g", "-fPIC", "-shared", "-Wall", "-Werror",
           "-Wno-unused-parameter", "-Wno-unused-variable", f"-I{HOOK_INCLUDE}",
           "-Wl,-Bsymbolic", f"-Wl,-soname,{soname}", "-pthread", str(source), "-o", str(output)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building {output.name} failed:\n{proc.stderr}")


def build_fake_driver(out_dir: Path) -> Path:
    """Writes libcuda.so.1, libcuda.so and libnvidia-ml.so.1 into out_dir; returns out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _compile(HERE / "fake_cuda.c", out_dir / "libcuda.so.1", "libcuda.so.1")
    (out_dir / "libcuda.so").unlink(missing_ok=True)
    (out_dir / "libcuda.so").symlink_to("libcuda.so.1")
    _compile(HERE / "fake_nvml.c", out_dir / "libnvidia-ml.so.1", "libnvidia-ml.so.1")
    return out_dir
