"""Pods in real containers (runc) on a node of the kubelet emulator, the real plugin and the real
daemon: what a workload sees and gets when its Allocate response is applied by a container
runtime, its channel read-only, its process a non-root uid, over the fake driver's modelled GPU.

The launch loops sync every 4 kernels of 1 ms: a holder keeps the token for its quota, so with
the fast path a process asks the daemon about once per grant, not once per launch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.node import SHARE_WINDOW_S, ContainerNode, Tenant
from tests.daemon.helpers import wait_for
from vgpu_runtime.contracts import allocation, paths, wire
from vgpu_runtime.contracts.allocation import AllocationRecord
from vgpu_runtime.daemon.control import control_socket
from vgpu_runtime.devkit.kubelet_emulator import Pod

GiB = 1 << 30
MiB = 1 << 20
OUT_OF_MEMORY = 2
KERNEL_NS = 1_000_000
SYNC_EVERY = 4
# With the fast path a process asks once per grant (a grant can be asked for, revoked and asked
# again), not once per sync: at most one ask per FAST_PATH_LAUNCHES launches, and few grants
# end in an idle release (the daemon sees the activity page move).
FAST_PATH_LAUNCHES = 10


@pytest.fixture
def pods(container_node: ContainerNode) -> Iterator[list[Pod]]:
    """Pods a test admits; deleted (their containers killed) when it ends."""
    admitted: list[Pod] = []
    yield admitted
    for pod in admitted:
        container_node.delete(pod)


def admit(node: ContainerNode, pods: list[Pod], name: str, slices: int,
          annotations: dict[str, str] | None = None) -> Pod:
    pod = node.admit(name, slices, annotations)
    pods.append(pod)
    return pod


def loop_together(tenants: list[Tenant], seconds: float, lead: float = 1.0
                  ) -> list[dict[str, object]]:
    """Every tenant runs its launch loop over the same wall-clock window."""
    start = time.time() + lead
    for tenant in tenants:
        tenant.send(f"loop {start} {seconds} {KERNEL_NS} {SYNC_EVERY}")
    return [tenant.read(timeout=seconds + lead + 60) for tenant in tenants]


def quit_and_read_stats(tenant: Tenant) -> dict[str, int]:
    tenant.send("quit")
    code = tenant.container.wait()
    assert code == 0, tenant.container.errors()
    stats = tenant.hook_stats_at_exit()
    assert stats, f"the hook wrote no GEMINI_HOOK_STATS:\n{tenant.container.errors()}"
    return stats


def check_fast_path(name: str, stats: dict[str, int], gpu: dict[str, int],
                    tenant: Tenant) -> None:
    """`gpu`: the GPU's grants and idle releases over the same time as the counters."""
    asks, launches = stats["token_requests"], stats["kernel_launches"]
    lost = (f"{name}: {asks} token requests for {launches} launches; its GPU made "
            f"{gpu['grants']} grants, {gpu['idle_releases']} of them ended idle: the token "
            "fast path is lost in the container. The hook said:\n"
            f"{tenant.container.errors()[-1500:]}")
    assert asks * FAST_PATH_LAUNCHES <= launches, lost
    assert gpu["idle_releases"] * 2 <= gpu["grants"], lost


def gpu_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in ("grants", "idle_releases")}


def test_a_pod_of_3_next_to_a_pod_of_5_keeps_the_fast_path_its_memory_and_its_share(
        container_node: ContainerNode, pods: list[Pod]) -> None:
    node = container_node
    small, large = admit(node, pods, "small", 3), admit(node, pods, "large", 5)
    records = [node.record_of(small), node.record_of(large)]
    uuid = records[0].gpus[0].uuid
    assert records[1].gpus[0].uuid == uuid, "best fit puts both pods on one GPU"
    tenants = [node.start(small), node.start(large)]
    for tenant, record in zip(tenants, records, strict=True):
        assert tenant.step("init") == {"rc": 0, "rc_ctx": 0}, tenant.container.errors()
        limit = record.gpus[0].memory_limit
        assert tenant.step("meminfo")["total"] == limit
        assert tenant.step(f"alloc {limit // 2}")["rc"] == 0
        assert tenant.step(f"alloc {limit // 2 + MiB}")["rc"] == OUT_OF_MEMORY
        assert tenant.step(f"alloc {MiB}")["rc"] == 0   # refused once, not broken
    before = node.gpu_sample(uuid)
    loops = loop_together(tenants, seconds=SHARE_WINDOW_S)
    sample = node.gpu_sample(uuid)
    gpu = gpu_delta(before, sample)
    charged = {t["allocation"]: t["achieved"] for t in sample["tenants"]}
    stats = [quit_and_read_stats(t) for t in tenants]
    for name, tenant, loop, counters in zip(("3 slices", "5 slices"), tenants, loops, stats,
                                            strict=True):
        assert loop["failures"] == 0 and counters["ungated_launches"] == 0, counters
        assert counters["daemon_connects"] == 1 and counters["mem_refused"] == 1, counters
        check_fast_path(name, counters, gpu, tenant)
    # Both busy, limits 1.0: the GPU's time splits in proportion to the requests, 3/8 and 5/8.
    # The daemon's charge over the loop (its --window is the loop's length) says so. The split,
    # not each part of the window: the status is read after both loops answer, late on a loaded
    # host, and the window then takes in the holder's time after the loop (charged 0.349 /
    # 0.686, a split of 0.337 / 0.663, beside stress-ng).
    busy = [float(loop["busy"]) for loop in loops]   # type: ignore[arg-type]
    shares = [charged[r.id] for r in records]
    seen = f"charged {shares}, busy {busy}, {gpu}"
    assert shares[0] / sum(shares) == pytest.approx(3 / 8, abs=0.05), seen
    assert sum(shares) > 0.8, seen
    # Each container's work fits in the time it was charged (ungated, each would do about 1 on
    # its own modelled GPU), and its turns carried work. How much of a turn a container fills
    # is the host's CPU, not the scheduler: 0.77 of it beside stress-ng on two cores.
    for work, charge in zip(busy, shares, strict=True):
        assert 0.5 * charge < work < charge + 0.05, seen
    assert sum(busy) < 1.05, seen


def test_a_container_reaches_only_its_own_channel_cannot_write_it_and_works(
        container_node: ContainerNode, pods: list[Pod]) -> None:
    node = container_node
    mine, other = admit(node, pods, "mine", 2), admit(node, pods, "other", 2)
    record, other_record = node.record_of(mine), node.record_of(other)
    tenant = node.start(mine)
    channel = Path(record.channel_dir)
    host_listing = sorted(p.name for p in channel.iterdir())
    facts = tenant.step("facts")
    assert facts["uid"] == 1000 and facts["gid"] == 1000
    assert facts["channel"] == host_listing
    # The only socket anywhere in the container is its own channel's.
    assert facts["sockets"] == [paths.channel_socket(paths.CONTAINER_CHANNEL_DIR).as_posix()]
    for path in (paths.channel_socket(other_record.channel_dir),
                 control_socket(node.state_dir),
                 paths.channel_socket(record.channel_dir)):   # not even its own, by host path
        assert tenant.step(f"connect {path}") == {"result": "ENOENT"}, path
    attempts = tenant.step("write-attempts")
    assert attempts and all(result in ("EROFS", "EACCES", "EPERM")
                            for result in attempts.values()), attempts
    assert sorted(p.name for p in channel.iterdir()) == host_listing
    # ...and works anyway: hello, memory and gated launches over the read-only mount.
    assert tenant.step("init") == {"rc": 0, "rc_ctx": 0}, tenant.container.errors()
    assert tenant.step(f"alloc {64 * MiB}")["rc"] == 0
    (loop,) = loop_together([tenant], seconds=0.5, lead=0.2)
    assert loop["failures"] == 0 and int(loop["kernels"]) > 0  # type: ignore[call-overload]
    connections = node.daemon.allocation(record.id)["connections"]
    assert [(c["peer_pid"], c["uid"]) for c in connections] == [
        (tenant.container.pid(), 1000)], connections
    stats = quit_and_read_stats(tenant)
    assert stats["daemon_connects"] == 1 and stats["ungated_launches"] == 0, stats


def test_a_container_cannot_write_the_sealed_token_page_its_hello_brings(
        container_node: ContainerNode, pods: list[Pod]) -> None:
    """A6 under runc (as the pod's non-root uid: the runtime runs no root container): the
    container's own hello brings a descriptor of its token page; reopened through
    /proc/self/fd for writing (a memfd's mode lets anyone), nothing written reaches the page.
    Its hooked launches then go gated, on the page the daemon still writes."""
    node = container_node
    pod = admit(node, pods, "forger", 2)
    admit(node, pods, "neighbour", 2)   # launches need the token
    tenant = node.start(pod)
    hello = wire.new(wire.const("GM_MSG_HELLO"), proto_version=wire.VERSION, pid=1)
    hello.h.seq = 1
    forged = tenant.step(f"forge {wire.encode(hello).hex()}")
    attempts = forged["attempts"]
    assert attempts.pop("reopen O_RDWR") == "ok", forged
    assert attempts and all(v in ("EPERM", "EACCES", "EBADF") for v in attempts.values()), forged
    assert forged["forged"] is False, forged
    assert tenant.step("init") == {"rc": 0, "rc_ctx": 0}, tenant.container.errors()
    (loop,) = loop_together([tenant], seconds=0.5, lead=0.2)
    assert loop["failures"] == 0 and int(loop["kernels"]) > 0  # type: ignore[call-overload]
    stats = quit_and_read_stats(tenant)
    # Gated, and on the fast path: the grants the daemon wrote to the page were read there.
    assert stats["ungated_launches"] == 0 and stats["token_requests"] > 0, stats
    assert stats["token_requests"] * FAST_PATH_LAUNCHES <= stats["kernel_launches"], stats


def test_pod_annotations_hold_from_the_first_cuda_call_in_the_container(
        container_node: ContainerNode, pods: list[Pod]) -> None:
    node = container_node
    pod = admit(node, pods, "annotated", 4, {"gemini.ai/vgpu-limit": "0.6",
                                             "gemini.ai/vgpu-memory": "1GiB"})
    record = node.record_of(pod)
    assert record.gpus[0].memory_limit > GiB   # the slices' default is larger
    tenant = node.start(pod)
    assert tenant.step("init") == {"rc": 0, "rc_ctx": 0}, tenant.container.errors()
    assert tenant.step("meminfo")["total"] == GiB
    assert tenant.step(f"alloc {GiB + 1}")["rc"] == OUT_OF_MEMORY
    assert tenant.step(f"alloc {GiB // 2}")["rc"] == 0
    (entry,) = [t for g in node.daemon.status()["gpus"] for t in g["tenants"]
                if t["allocation"] == record.id]
    assert entry["limit"] == 0.6 and entry["memory_limit"] == GiB
    # Alone on its GPU, the cap (a rate) holds it to 0.6 of the modelled GPU.
    (loop,) = loop_together([tenant], seconds=SHARE_WINDOW_S)
    charged = node.charged(record)
    assert charged == pytest.approx(0.6, abs=0.05), (charged, loop)
    assert float(loop["busy"]) < 0.65, (charged, loop)   # type: ignore[arg-type]


def test_a_container_restart_keeps_its_allocation_and_library(
        container_node: ContainerNode, pods: list[Pod]) -> None:
    node = container_node
    pod = admit(node, pods, "restarted", 2)
    # Its slices may be an ended pod's (the same allocation id): the allocation is bound to
    # this pod, with no other pod's overrides, before the container starts.
    def bound_here() -> AllocationRecord | None:
        record = node.record_of(pod)
        binding = allocation.load_binding(node.state_dir, record.id)
        return record if binding is not None and binding.pod.name == "restarted" else None
    record = wait_for(bound_here, 15, "the allocation bound to this pod")
    assert record is not None
    binding = allocation.load_binding(node.state_dir, record.id)
    assert binding is not None and binding.memory_limit is None and binding.limit is None
    first = node.start(pod)
    facts = first.step("facts")
    assert first.step("init")["rc"] == 0 and first.step(f"alloc {256 * MiB}")["rc"] == 0
    assert node.daemon.allocation(record.id)["gpus"][0]["memory_used"] >= 256 * MiB
    allocations = node.plugin.log_text().count(" allocated ")
    second = node.restart_container(first)
    # The killed process's memory is given back; the allocation itself stays.
    wait_for(lambda: node.daemon.allocation(record.id)["gpus"][0]["memory_used"] == 0, 10,
             "the killed container's memory given back")
    again = second.step("facts")
    assert pod.containers["main"].starts == 2
    for key in ("preloaded", "hook_sha256", "env", "channel"):
        assert again[key] == facts[key], key
    assert Path(again["preloaded"][0]).name == record.hook_library
    assert second.step("init")["rc"] == 0
    assert second.step("meminfo")["total"] == record.gpus[0].memory_limit
    assert second.step(f"alloc {256 * MiB}")["rc"] == 0
    assert node.plugin.log_text().count(" allocated ") == allocations, (
        "a restart must reuse the kept response, not call Allocate again")
    stats = quit_and_read_stats(second)
    assert stats["daemon_connects"] == 1 and stats["ungated_launches"] == 0


def test_a_daemon_restart_under_running_containers_keeps_them_gated(
        container_node: ContainerNode, pods: list[Pod]) -> None:
    node = container_node
    steady, rival = admit(node, pods, "steady", 3), admit(node, pods, "rival", 5)
    uuid = node.record_of(steady).gpus[0].uuid
    tenants = [node.start(steady), node.start(rival)]
    for tenant in tenants:
        assert tenant.step("init")["rc"] == 0, tenant.container.errors()
    # The daemon goes away and comes back while both launch.
    start = time.time() + 0.5
    for tenant in tenants:
        tenant.send(f"loop {start} 3.0 {KERNEL_NS} {SYNC_EVERY}")
    time.sleep(1.5)
    node.restart_daemon()
    for tenant in tenants:
        assert tenant.read(timeout=60)["failures"] == 0
    earlier = [tenant.step("stats") for tenant in tenants]
    for tenant, counters in zip(tenants, earlier, strict=True):
        assert counters["daemon_connects"] == 2, counters   # reconnected, never restarted
        record = node.record_of(tenant.pod)
        pids = [c["peer_pid"] for c in node.daemon.allocation(record.id)["connections"]]
        assert pids == [tenant.container.pid()]
    # Gated again by the new daemon: never both at once (each has its own modelled GPU, so
    # ungated they would add up to about 2), and the fast path is back.
    before = node.gpu_sample(uuid)
    loops = loop_together(tenants, seconds=2.0)
    gpu = gpu_delta(before, node.gpu_sample(uuid))
    busy = [float(loop["busy"]) for loop in loops]   # type: ignore[arg-type]
    assert sum(busy) < 1.05 and gpu["grants"] > 0, (busy, gpu)
    for name, tenant, then in zip(("steady", "rival"), tenants, earlier, strict=True):
        now = tenant.step("stats")
        counters = {key: now[key] - then[key] for key in now}
        assert counters["ungated_launches"] == 0, counters
        check_fast_path(f"{name} after the daemon restart", counters, gpu, tenant)
