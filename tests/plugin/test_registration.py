"""Serving, then registering with a (fake) kubelet over real sockets; restarts of kubelet."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from device_plugin.allocator import Allocator
from device_plugin.health import HealthTracker
from device_plugin.registration import Registrar
from device_plugin.server import DeviceList, DevicePluginService, PluginServer
from device_plugin.slices import SliceTable
from tests.plugin.fake_kubelet import FakeKubelet, wait_for
from vgpu_runtime.gpus.simulated import SimulatedBackend
from vgpu_runtime.pluginconfig import PluginConfig


@pytest.fixture
async def registrar(make_config: Callable[..., PluginConfig]
                    ) -> AsyncIterator[tuple[Registrar, PluginConfig]]:
    config = make_config()
    gpus = SimulatedBackend(2, memory=config.simulate_memory).discover()
    table = SliceTable(gpus, config.slices_per_gpu)
    tracker = HealthTracker([g.uuid for g in gpus], config.ignored_xids, 300)
    service = DevicePluginService(DeviceList(table, tracker), Allocator(config, table, tracker),
                                  config.placement)
    server = PluginServer(config.plugin_socket, service)
    registrar = Registrar(server, config.kubelet_socket, config.resource_name)
    task = asyncio.create_task(registrar.run())
    yield registrar, config
    registrar.stop()
    await asyncio.wait_for(task, 10)
    assert not config.plugin_socket.exists(), "the plugin socket is removed on stop"


async def test_registers_once_kubelet_appears_with_backoff(
        registrar: tuple[Registrar, PluginConfig]) -> None:
    plugin, config = registrar
    await asyncio.sleep(0.5)  # kubelet absent: the plugin serves and keeps retrying
    assert config.plugin_socket.exists() and plugin.registrations == 0
    kubelet = FakeKubelet(Path(config.kubelet_dir))
    await kubelet.start()
    try:
        await asyncio.wait_for(kubelet.registered.wait(), 10)
        (request,) = kubelet.requests
        assert request.version == "v1beta1"
        assert request.endpoint == config.socket_name
        assert request.resource_name == "gemini.ai/vgpu"
        assert request.options.get_preferred_allocation_available
        # kubelet's dial-back inside Register reached the already-serving plugin
        assert kubelet.options[0].pre_start_required
    finally:
        await kubelet.stop()


async def test_registers_again_after_kubelet_restart(
        registrar: tuple[Registrar, PluginConfig]) -> None:
    plugin, config = registrar
    kubelet = FakeKubelet(Path(config.kubelet_dir))
    await kubelet.start()
    try:
        # The plugin's own count, not the kubelet's event: the kubelet has the request before
        # the plugin has the answer, and a restart in between fails that Register.
        await wait_for(lambda: plugin.registrations == 1)
        await kubelet.restart()  # wipes the plugin socket, new kubelet.sock
        await asyncio.wait_for(kubelet.registered.wait(), 10)
        await wait_for(lambda: plugin.registrations == 2)
        assert config.plugin_socket.exists()
    finally:
        await kubelet.stop()


async def test_serves_and_registers_again_when_own_socket_disappears(
        registrar: tuple[Registrar, PluginConfig]) -> None:
    plugin, config = registrar
    kubelet = FakeKubelet(Path(config.kubelet_dir))
    await kubelet.start()
    try:
        await asyncio.wait_for(kubelet.registered.wait(), 10)
        os.unlink(config.plugin_socket)
        await wait_for(lambda: plugin.registrations == 2)
        assert config.plugin_socket.exists()
        assert len(kubelet.requests) == 2
    finally:
        await kubelet.stop()


async def test_waits_for_a_missing_kubelet_dir(make_config: Callable[..., PluginConfig]) -> None:
    config = make_config()
    kubelet_dir = Path(config.kubelet_dir)
    kubelet_dir.rmdir()
    gpus = SimulatedBackend(1, memory=config.simulate_memory).discover()
    table = SliceTable(gpus, config.slices_per_gpu)
    tracker = HealthTracker([g.uuid for g in gpus], (), 300)
    service = DevicePluginService(DeviceList(table, tracker), Allocator(config, table, tracker),
                                  config.placement)
    plugin = Registrar(PluginServer(config.plugin_socket, service), config.kubelet_socket,
                       config.resource_name)
    task = asyncio.create_task(plugin.run())
    try:
        await asyncio.sleep(0.4)
        assert not task.done(), "a missing kubelet dir is waited for, not fatal"
        kubelet_dir.mkdir()
        kubelet = FakeKubelet(kubelet_dir)
        await kubelet.start()
        await asyncio.wait_for(kubelet.registered.wait(), 15)
        await kubelet.stop()
    finally:
        plugin.stop()
        await asyncio.wait_for(task, 10)
