"""Where per-process figures come from: the NVML backend's reading of pynvml's answers (driven
by a stand-in module with pynvml's names and error classes), the source chosen by the setting,
and the pid-namespace check that `auto` relies on."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.childenv import child_env
from tests.daemon.helpers import REPO
from vgpu_runtime.daemon.channel import process_memory
from vgpu_runtime.daemon.channel.process_memory import (
    NvmlProcessMemory,
    ProcessMemoryError,
    SimulatedProcessMemory,
    open_source,
)
from vgpu_runtime.daemon.config import DaemonConfig

UUID_A, UUID_B = "GPU-a", "GPU-b"


class NVMLError(Exception):
    pass


class NVMLError_NotFound(NVMLError):
    pass


@dataclass
class Process:
    pid: int
    usedGpuMemory: int | None


class StandInNvml:
    """pynvml's names for what the backend calls, answering from `processes`."""

    NVMLError = NVMLError
    NVMLError_NotFound = NVMLError_NotFound

    def __init__(self, processes: dict[str, list[Process]], init_error: bool = False) -> None:
        self.processes = processes
        self.init_error = init_error
        self.lookups: list[str] = []
        self.failing: set[str] = set()

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.lookups.append(uuid)
        if uuid not in self.processes:
            raise NVMLError_NotFound("Not Found")
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Process]:
        if handle in self.failing:
            raise NVMLError("GPU is lost")
        return self.processes[handle]


def test_nvml_figures_per_pid_skip_unavailable_and_foreign_gpus() -> None:
    nvml = StandInNvml({UUID_A: [Process(10, 500), Process(11, None), Process(10, 20)],
                        UUID_B: []})
    source = NvmlProcessMemory(nvml)
    # pid 10 twice (two contexts): summed; pid 11 without a figure: absent; GPU-x: not here.
    assert source.read([UUID_A, UUID_B, "GPU-x"]) == {UUID_A: {10: 520}, UUID_B: {}}
    source.read([UUID_A])
    assert nvml.lookups.count(UUID_A) == 1   # handles are kept


def test_nvml_failures_are_process_memory_errors() -> None:
    with pytest.raises(ProcessMemoryError, match="NVML unavailable: Driver Not Loaded"):
        NvmlProcessMemory(StandInNvml({}, init_error=True))
    nvml = StandInNvml({UUID_A: [Process(10, 5)]})
    source = NvmlProcessMemory(nvml)
    nvml.failing.add(UUID_A)
    with pytest.raises(ProcessMemoryError, match=f"NVML on {UUID_A}: GPU is lost"):
        source.read([UUID_A])


def test_simulated_figures_only_for_the_gpus_asked(tmp_path: Path) -> None:
    source = SimulatedProcessMemory(tmp_path / "figures.json")
    assert source.read([UUID_A]) == {}                      # no file: no figures
    (tmp_path / "figures.json").write_text('{"GPU-a": {"7": 3}, "GPU-b": {"8": 4}}')
    assert source.read([UUID_A]) == {UUID_A: {7: 3}}


def settings(**values: Any) -> DaemonConfig:
    return replace(DaemonConfig(), **values)


def test_setting_chooses_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    assert open_source(settings(process_memory="off")) is None
    simulated = open_source(settings(process_memory="simulated",
                                     process_memory_file=str(tmp_path / "f.json")))
    assert isinstance(simulated, SimulatedProcessMemory)
    monkeypatch.setattr(process_memory, "in_initial_pid_namespace", lambda: False)
    with caplog.at_level(logging.INFO, logger=process_memory.__name__):
        assert open_source(settings(process_memory="auto")) is None
    assert "not in the host's pid namespace" in caplog.text


def test_a_new_pid_namespace_is_not_the_initial_one() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    probe = ("from vgpu_runtime.daemon.channel import process_memory as p; "
             "print(p.in_initial_pid_namespace())")
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork",
                           "--mount-proc", sys.executable, "-c", probe], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"new pid namespaces are not permitted here: {proc.stderr.strip()[-200:]}")
    assert proc.stdout.strip() == "False"
