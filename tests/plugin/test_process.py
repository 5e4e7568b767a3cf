"""The plugin as a real process: `python -m device_plugin.main`, a fake kubelet, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc

from tests.plugin.fake_kubelet import FakeKubelet, wait_for
from vgpu_runtime.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def _start(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "device_plugin.main", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


async def test_process_registers_streams_health_and_stops_on_sigterm(short_dir: Path) -> None:
    kubelet_dir = short_dir / "kubelet"
    kubelet_dir.mkdir()
    control = short_dir / "control"
    kubelet = FakeKubelet(kubelet_dir)
    await kubelet.start()
    proc = _start("--simulate-gpus", "2", "--kubelet-dir", str(kubelet_dir),
                  "--state-dir", str(short_dir / "state"), "--simulate-control-dir", str(control),
                  "--health-recheck-interval", "0.05", "--recovery-quiet-period", "0.5",
                  "--metrics-port", "0")
    try:
        await asyncio.wait_for(kubelet.registered.wait(), 20)
        socket = kubelet_dir / "gemini-vgpu.sock"
        async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
            stream = stub.ListAndWatch(api_pb2.Empty())
            first = await asyncio.wait_for(stream.read(), 10)
            assert len(first.devices) == 20
            # Inject a critical XID on GPU 1: its 10 slices turn Unhealthy...
            (control / "0001.json").write_text(json.dumps({"gpu": 1, "xid": 79}))
            sick = await asyncio.wait_for(stream.read(), 10)
            assert [d.health for d in sick.devices].count("Unhealthy") == 10
            assert not (control / "0001.json").exists(), "consumed events are deleted"
            # ...and recover after the quiet period, since the probe still succeeds.
            healed = await asyncio.wait_for(stream.read(), 10)
            assert {d.health for d in healed.devices} == {"Healthy"}
            stream.cancel()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 10) == 0
        assert not socket.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await kubelet.stop()


async def test_rejected_control_file_is_kept_with_reason_logged(short_dir: Path) -> None:
    control = short_dir / "control"
    control.mkdir()
    (control / "0001.json").write_text('{"gpu": 7, "xid": 79}')
    kubelet_dir = short_dir / "kubelet"
    kubelet_dir.mkdir()
    proc = _start("--simulate-gpus", "1", "--kubelet-dir", str(kubelet_dir),
                  "--state-dir", str(short_dir / "state"), "--simulate-control-dir", str(control))
    try:
        await wait_for(lambda: (control / "0001.json.rejected").exists(), 20)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.to_thread(proc.communicate, timeout=10)
    assert proc.returncode == 0
    assert b"no simulated GPU with index 7" in err


def test_malformed_setting_stops_startup_naming_the_field(short_dir: Path) -> None:
    proc = _start("--slices-per-gpu", "ten", "--kubelet-dir", str(short_dir))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert b"--slices-per-gpu" in err and b"expected an integer" in err

    env = dict(os.environ, GEMINI_PLACEMENT="tightest")
    proc = subprocess.Popen([sys.executable, "-m", "device_plugin.main", "--simulate-gpus", "1"],
                            cwd=REPO, env=env, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and b"GEMINI_PLACEMENT" in err and b"best-fit" in err
