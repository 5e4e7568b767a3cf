"""A plugin that cannot make its socket says why in words, and its stderr stays JSON: gRPC
C-core's own line about the failed bind (`E... add_port.cc] ...`) is logged as JSON too."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from device_plugin.socketdir import why_unbindable
from tests.childenv import child_env
from vgpu_runtime.devkit.hookdir import install_hook

WAIT = 30.0


def start_plugin(kubelet_dir: Path, state_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    install_hook(state_dir / "lib")
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "device_plugin.main", "--simulate-gpus", "1",
             "--kubelet-dir", str(kubelet_dir), "--state-dir", str(state_dir),
             "--metrics-port", "0"],
            stdout=subprocess.DEVNULL, stderr=out, env=child_env())


def wait_for(log: Path, text: str) -> None:
    deadline = time.monotonic() + WAIT
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not logged:\n{log.read_text()}"
        time.sleep(0.05)


def stop(plugin: subprocess.Popen[bytes]) -> None:
    plugin.send_signal(signal.SIGTERM)
    try:
        plugin.wait(WAIT)
    except subprocess.TimeoutExpired:
        plugin.kill()
        plugin.wait()
        raise


def records(log: Path) -> list[dict[str, object]]:
    """Every line of the plugin's stderr, each of which must be one JSON object."""
    found = []
    for line in log.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"a stderr line that is not JSON: {line!r}")
    return found


def test_a_missing_kubelet_directory_is_named_and_served_once_it_exists(tmp_path: Path) -> None:
    kubelet_dir = tmp_path / "device-plugins"
    log = tmp_path / "plugin.log"
    plugin = start_plugin(kubelet_dir, tmp_path / "state", log)
    try:
        wait_for(log, f"kubelet directory {kubelet_dir} does not exist")
        kubelet_dir.mkdir()
        deadline = time.monotonic() + WAIT
        while not (kubelet_dir / "gemini-vgpu.sock").exists():
            assert time.monotonic() < deadline, "the plugin never served once the directory came"
            time.sleep(0.05)
    finally:
        stop(plugin)
    logged = records(log)
    refusals = [r for r in logged if r["msg"] == "cannot serve on the plugin socket; retrying"]
    assert refusals and all("does not exist" in str(r["error"]) for r in refusals)
    # gRPC C-core's own words about the bind, where this grpc prints them, are a JSON record.
    native = [r for r in logged if r["logger"] == "native"]
    assert all(r["level"] in ("error", "warning", "info", "debug") for r in native), native
    assert any("add_port" in str(r.get("source", "")) for r in native), logged


def test_a_kubelet_path_that_is_a_file_is_named(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "device-plugins"
    not_a_directory.write_text("")
    log = tmp_path / "plugin.log"
    plugin = start_plugin(not_a_directory, tmp_path / "state", log)
    try:
        wait_for(log, f"kubelet directory {not_a_directory} is not a directory")
    finally:
        stop(plugin)
    records(log)


def test_why_unbindable_names_each_cause(tmp_path: Path) -> None:
    assert "does not exist" in str(why_unbindable(tmp_path / "absent" / "p.sock"))
    (tmp_path / "file").write_text("")
    assert "is not a directory" in str(why_unbindable(tmp_path / "file" / "p.sock"))
    assert why_unbindable(tmp_path / "p.sock") is None
    assert not (tmp_path / "p.sock").exists(), "the probe leaves no socket behind"
