"""Uninstall (vgpu_runtime/daemon/uninstall.py, vgpu_runtime/uninstall.py): the node daemon
clears what it put on the node as its DaemonSet is deleted, and only then; what running pods
use stays and an Event on the Node says so. The chart's hook program deletes the DaemonSet in
the foreground and waits for it. The whole node here: the kubelet emulator's PodResources, the
real plugin and daemon processes, the fake API server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.daemon.helpers import list_passes
from vgpu_runtime import hooklib
from vgpu_runtime.contracts import allocation, paths
from vgpu_runtime.contracts.allocation import AllocationRecord, GpuShare
from vgpu_runtime.contracts.share import Share
from vgpu_runtime.daemon import uninstall
from vgpu_runtime.daemon.pods.node import LABEL_COUNT, LABEL_SLICES
from vgpu_runtime.devkit.podnode import PodNode, until

if TYPE_CHECKING:
    from vgpu_runtime.devkit.fakeapi import FakeApiServer

NAMESPACE, DAEMONSET, POD = "gemini-system", "gemini-vgpu-node", "gemini-vgpu-node-x1"
FAST = ("--pod-resources-interval", "0.1", "--pod-resources-min-interval", "0.05")
OLD_LIBRARY = hooklib.LIBRARY_PREFIX + "0.0.1-0123456789ab"
A1, LIVE, GONE = "k-00000000000000a1", "k-000000000000011e", "k-0000000000000903"


# ---- clean_state alone ----

def record(state: Path, allocation_id: str, library: str) -> None:
    """A kubelet record of one GPU, with its channel directory, pages and binding."""
    allocation.write_record(state, AllocationRecord(
        allocation_id, "kubelet", (f"GPU-0::{allocation_id}",),
        (GpuShare("GPU-0", 0, Share.of_slices(3, 10), 1 << 30),),
        str(paths.channel_dir(state, allocation_id)), library, 1.0))
    paths.channel_dir(state, allocation_id).mkdir(parents=True)
    paths.pages_dir(state).mkdir(exist_ok=True)
    (paths.pages_dir(state) / f"{allocation_id}.token.0").write_bytes(b"\0" * 64)
    paths.bindings_dir(state).mkdir(exist_ok=True)
    (paths.bindings_dir(state) / f"{allocation_id}.json").write_text("{}")


def a_node(state: Path) -> None:
    """What a node's state directory holds: libraries, plugin files, the daemon's own."""
    lib = paths.default_hook_dir(state)
    lib.mkdir(parents=True)
    for name in (hooklib.library_name(), OLD_LIBRARY):
        (lib / name).write_bytes(b"\x7fELF")
    for name in (paths.HEALTH_FILE_NAME, paths.SLICES_FILE_NAME, paths.LOCK_NAME,
                 paths.RUN_LOCK_NAME):
        (state / name).write_text("{}")


def test_with_nothing_kept_every_known_entry_goes_and_an_unknown_one_stays(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    a_node(state)
    record(state, A1, hooklib.library_name())
    (state / "notes.txt").write_text("an operator's")
    # The daemon collected a1 already where no pod held it; here its record is still there
    # (its removal failed): it is kept, with its library, and said so.
    first = uninstall.clean_state(state, {})
    assert first.kept[f"allocations/{A1}.json"] == "its record could not be removed"
    assert first.kept[f"lib/{hooklib.library_name()}"] == "a kept allocation's interposer"
    assert not (paths.default_hook_dir(state) / OLD_LIBRARY).exists()
    assert (state / paths.HEALTH_FILE_NAME).exists() is False

    allocation.end_allocation(state, A1)
    cleanup = uninstall.clean_state(state, {})
    assert sorted(p.name for p in state.iterdir()) == ["notes.txt"]
    assert set(first.removed + cleanup.removed) >= {
        "allocations", "bindings", "channels", "pages", "lib", paths.HEALTH_FILE_NAME,
        paths.SLICES_FILE_NAME, paths.LOCK_NAME, paths.RUN_LOCK_NAME}
    assert cleanup.kept == {"notes.txt": "not the daemon's (an unknown name): left for the "
                                         "operator"}
    assert "removed" in cleanup.message([]) and "kept notes.txt" in cleanup.message([])


def test_a_running_pods_allocation_keeps_its_record_channel_pages_and_library(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    a_node(state)
    record(state, LIVE, OLD_LIBRARY)     # started before an upgrade: the old interposer
    record(state, GONE, hooklib.library_name())
    allocation.end_allocation(state, GONE)   # as the daemon's collect leaves it
    cleanup = uninstall.clean_state(state, {LIVE: "pod ml/train is running"})
    assert (paths.allocations_dir(state) / f"{LIVE}.json").is_file()
    assert paths.channel_dir(state, LIVE).is_dir()
    assert (paths.pages_dir(state) / f"{LIVE}.token.0").is_file()
    assert (paths.bindings_dir(state) / f"{LIVE}.json").is_file()
    assert sorted(p.name for p in paths.default_hook_dir(state).iterdir()) == [OLD_LIBRARY]
    for gone in (paths.pages_dir(state) / f"{GONE}.token.0",
                 paths.bindings_dir(state) / f"{GONE}.json",
                 state / paths.HEALTH_FILE_NAME, state / paths.LOCK_NAME):
        assert not gone.exists(), gone
    assert cleanup.kept == {f"allocations/{LIVE}.json": "pod ml/train is running",
                            f"lib/{OLD_LIBRARY}": "a kept allocation's interposer"}
    message = cleanup.message(["ml/train"])
    assert "ml/train" in message and "install again" in message and "delete" in message


def test_an_unreadable_record_keeps_every_library(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    a_node(state)
    paths.allocations_dir(state).mkdir()
    (paths.allocations_dir(state) / "bad.json").write_text("{not json")
    cleanup = uninstall.clean_state(state, {})
    assert "cannot be read" in cleanup.kept["allocations/bad.json"]
    assert sorted(p.name for p in paths.default_hook_dir(state).iterdir()) == sorted(
        [hooklib.library_name(), OLD_LIBRARY])


def test_only_the_daemons_labels_are_removed() -> None:
    labels = {LABEL_COUNT: "2", LABEL_SLICES: "10", "gemini.ai/vgpu.enabled": "true",
              "gemini.ai/vgpu.config": "four-slices", "kubernetes.io/hostname": "n"}
    assert uninstall.node_labels_to_remove(labels) == {LABEL_COUNT: None, LABEL_SLICES: None}


# ---- the daemon, stopping ----

async def node_with_pods(pods: PodNode, api: FakeApiServer) -> tuple[Any, Any]:
    """Two pods with slices, the daemon's own pod owned by its DaemonSet, libraries on disk,
    the daemon running with the API and its pod's name, its node labelled."""
    kubelet = pods.node.kubelet
    running = await kubelet.admit_pod("train", "ml", containers=[("main", 3)])
    ended = await kubelet.admit_pod("done", "ml", containers=[("main", 2)])
    api.add_daemonset(NAMESPACE, DAEMONSET)
    api.add_pod(NAMESPACE, POD, "uid-node-pod", daemonset=DAEMONSET)
    lib = paths.default_hook_dir(pods.state_dir)
    lib.mkdir(exist_ok=True)
    for name in {r.hook_library for r in pods.records().values()} | {OLD_LIBRARY}:
        (lib / name).write_bytes(b"\x7fELF")
    await pods.start_daemon(*FAST, "--kubernetes", "true", "--kube-api-url", api.url,
                            "--pod-name", POD, "--pod-namespace", NAMESPACE,
                            "--simulate-gpus", "2")
    await until(lambda: pods.bound_record(running, "main"), 10, "train bound")
    await until(lambda: pods.bound_record(ended, "main"), 10, "done bound")
    await until(lambda: LABEL_COUNT in api.node("node-1")["metadata"]["labels"], 10, "labels")
    return running, ended


async def pods_deleted(pods: PodNode, *names: str) -> None:
    """Delete pods of namespace ml, then wait until the daemon's last PodResources answer (the
    one its uninstall reuses) came after."""
    for name in names:
        await pods.node.kubelet.delete_pod(name, "ml")
    await list_passes(pods)


def stop(pods: PodNode) -> str:
    """Stop the daemon (SIGTERM, as kubelet does); its log."""
    assert pods.daemon is not None
    code = pods.daemon.stop()
    logs: str = pods.daemon.logs()
    assert code == 0, logs
    pods.daemon = None
    return logs


async def test_a_stop_while_the_daemonset_stands_removes_nothing(
        pods: PodNode, api: FakeApiServer) -> None:
    await node_with_pods(pods, api)

    def files() -> list[str]:
        """Every regular file and directory (a stopping daemon removes its sockets)."""
        return sorted(str(p.relative_to(pods.state_dir)) for p in pods.state_dir.rglob("*")
                      if not p.is_socket())
    before = files()
    await asyncio.to_thread(stop, pods)
    assert files() == before
    assert LABEL_COUNT in api.node("node-1")["metadata"]["labels"]
    assert api.node_events("node-1") == []
    assert ("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{DAEMONSET}") in \
        api.requests


async def test_an_uninstall_keeps_a_running_pods_allocation_and_says_so(
        pods: PodNode, api: FakeApiServer) -> None:
    running, ended = await node_with_pods(pods, api)
    kept: AllocationRecord = pods.record_of(running, "main")   # type: ignore[assignment]
    done: AllocationRecord = pods.record_of(ended, "main")     # type: ignore[assignment]
    await pods_deleted(pods, "done")
    # The hook's foreground delete: the DaemonSet stays, marked, while its pods stop.
    api.daemonsets[(NAMESPACE, DAEMONSET)]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00Z"
    logs = await asyncio.to_thread(stop, pods)

    state = pods.state_dir
    assert set(pods.records()) == {kept.id}, logs
    assert not Path(done.channel_dir).exists() and Path(kept.channel_dir).is_dir()
    assert sorted(p.name for p in paths.default_hook_dir(state).iterdir()) == [kept.hook_library]
    for name in (paths.LOCK_NAME, paths.CONTROL_SOCKET_NAME, paths.HEALTH_FILE_NAME):
        assert not (state / name).exists(), name
    labels = api.node("node-1")["metadata"]["labels"]
    assert not {LABEL_COUNT, LABEL_SLICES} & set(labels), labels
    (event,) = api.node_events("node-1")
    assert event["reason"] == uninstall.REASON and event["type"] == "Normal"
    assert "ml/train" in event["message"] and f"allocations/{kept.id}.json" in \
        event["message"], event["message"]


async def test_an_uninstall_with_no_pod_left_empties_the_state_directory(
        pods: PodNode, api: FakeApiServer) -> None:
    await node_with_pods(pods, api)
    await pods_deleted(pods, "train", "done")
    api.finish_deletion(NAMESPACE, DAEMONSET)   # a background delete: already gone
    await asyncio.to_thread(stop, pods)
    assert list(pods.state_dir.iterdir()) == []
    (event,) = api.node_events("node-1")
    assert "removed everything" in event["message"], event["message"]


async def test_an_event_that_cannot_be_posted_is_logged_and_the_node_cleared_still(
        pods: PodNode, api: FakeApiServer) -> None:
    await node_with_pods(pods, api)
    await pods_deleted(pods, "train", "done")
    api.finish_deletion(NAMESPACE, DAEMONSET)
    api.fail_posts = True
    logs = await asyncio.to_thread(stop, pods)
    assert list(pods.state_dir.iterdir()) == []
    assert api.node_events("node-1") == []
    assert "cannot post the uninstall Event" in logs and "removed everything" in logs, logs


async def test_no_answer_from_the_api_keeps_everything(pods: PodNode,
                                                      api: FakeApiServer) -> None:
    await node_with_pods(pods, api)
    api.finish_deletion(NAMESPACE, DAEMONSET)
    api.fail_all = True
    records = set(pods.records())
    await asyncio.to_thread(stop, pods)
    assert set(pods.records()) == records
    assert paths.default_hook_dir(pods.state_dir).is_dir()


# ---- gemini-uninstall, the chart's pre-delete hook ----

@pytest.fixture(autouse=True)
def root_logger() -> Iterator[None]:
    """gemini-uninstall's main() sets up the root logger, as a program does: put it back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook looks at the DaemonSet every 0.1 s, not every second: what it does between
    looks is the same, and the tests wait on its looks, not on the clock."""
    import vgpu_runtime.uninstall

    monkeypatch.setattr(vgpu_runtime.uninstall, "POLL", 0.1)


def run_hook(api: FakeApiServer, *args: str) -> int:
    from vgpu_runtime.uninstall import main

    return main(["--kube-api-url", api.url, "--namespace", NAMESPACE, "--daemonset",
                 DAEMONSET, *args])


async def test_the_hook_deletes_in_the_foreground_and_waits_for_the_pods(
        api: FakeApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    api.add_daemonset(NAMESPACE, DAEMONSET)
    hook = asyncio.ensure_future(asyncio.to_thread(run_hook, api, "--timeout", "20"))
    await until(lambda: api.deletes, 10, "the delete")
    assert api.deletes[0][2] is not None and api.deletes[0][2]["propagationPolicy"] == \
        "Foreground"
    looks = ("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{DAEMONSET}")
    await until(lambda: api.requests.count(looks) >= 3, 10,
                "more looks at the DaemonSet its pods keep")
    assert not hook.done(), "returned while the DaemonSet's pods were still there"
    api.finish_deletion(NAMESPACE, DAEMONSET)
    assert await hook == 0
    assert "gone" in capsys.readouterr().out


def test_the_hook_without_a_daemonset_has_nothing_to_do(
        api: FakeApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_hook(api) == 0
    assert "nothing to stop" in capsys.readouterr().out


def test_the_hook_fails_when_the_pods_outlast_its_timeout(
        api: FakeApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    api.add_daemonset(NAMESPACE, DAEMONSET)
    assert run_hook(api, "--timeout", "1") == 1
    error = capsys.readouterr().err
    assert "still has pods after 1 s" in error and "--no-hooks" in error
