"""Enforcement is not configured by the workload, and its fallback is bounded.

The settings come from the daemon's hello reply; the environment may only make them safer.
Without a grant (no daemon, no hello, a daemon away) the hook gates itself at its share: no
setting of the environment and no outage takes a tenant past its share over a window by more
than 0.05, and the daemon gates again within a second of its return.

GPU time is the fake driver's: every launch takes KERNEL_NS on its stream, so a process's GPU
time is its launches times KERNEL_NS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.daemon.helpers import DaemonProcess, wait_for, wait_served
from tests.hook.conftest import PRELUDE, DaemonNode, Hooked, MiB, start_node, stop_node
from tests.hook.tokenkit import Loop

CONTEXT = 300 * MiB
KERNEL_NS = 2_000_000
NS = 1_000_000_000

# Launches for `seconds` (sys.argv[1]) a 2 ms kernel and waits for it, in a loop; prints when
# each launch was made and when the work had all finished.
TIMED_LOOP = """
    import sys, time
    lib = cuda()
    context(lib)
    lib.fake_cuda_set_kernel_ns.argtypes = [ctypes.c_longlong]
    lib.fake_cuda_set_kernel_ns(KERNEL_NS)
    stream = ctypes.c_void_p(0x77)
    print("ready", flush=True)
    sys.stdin.readline()
    seconds = float(sys.argv[1])
    launched = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        launched.append(time.monotonic_ns())
        assert lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, stream, None, None) == 0
        assert lib.cuStreamSynchronize(stream) == 0
    print(json.dumps({"launched": launched, "done": time.monotonic_ns(), "stats": stats()}),
          flush=True)
""".replace("KERNEL_NS", str(KERNEL_NS))


class TimedLoop:
    def __init__(self, hooked: Hooked, env: dict[str, str], seconds: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(TIMED_LOOP), str(seconds)],
            env=hooked.env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", self.proc.stderr.read() if self.proc.stderr else ""
        self.started = time.monotonic_ns()
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 60) -> dict[str, object]:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, err
        result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
        result["stderr"] = err
        return result


def gpu_share(launched: list[int], start: int, end: int) -> float:
    """The GPU time of the launches made in [start, end), as a part of that window."""
    return sum(1 for t in launched if start <= t < end) * KERNEL_NS / (end - start)


def test_a_zero_token_timeout_in_the_environment_does_not_ungate_launches(
        hooked: Hooked, pair_node: DaemonNode) -> None:
    """S5: GEMINI_HOOK_TOKEN_TIMEOUT=0 with a huge retry gave 33,590 ungated launches."""
    node = pair_node
    attack = {"GEMINI_HOOK_TOKEN_TIMEOUT": "0", "GEMINI_HOOK_UNGATED_RETRY": "1e6",
              "GEMINI_HOOK_FALLBACK_RETRY": "1e6", "GEMINI_HOOK_IO_TIMEOUT": "0"}
    loops = [Loop(hooked, node.env(**attack), 1.5),
             Loop(hooked, node.env_of(node.others[0]), 1.5)]
    for loop in loops:
        loop.go()
    attacker, other = (loop.result() for loop in loops)
    stats = attacker["stats"]
    assert stats["token_requests"] >= 2, stats               # it did wait its turns
    assert stats["token_timeouts"] == 0 and stats["ungated_launches"] == 0, stats
    assert "ignored" not in attacker["stderr"]               # numbers: they parse, then lose
    assert other["stats"]["token_timeouts"] == 0


def test_a_zero_context_cap_in_the_environment_does_not_escape_the_context_charge(
        hooked: Hooked, node: DaemonNode) -> None:
    """S5: GEMINI_HOOK_CONTEXT_MAX_BYTES=0 made every context free."""
    result = hooked.python("""
        lib = cuda()
        context(lib)
        print(json.dumps({"held": stats()["bytes_held"]}))
    """, node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT), GEMINI_HOOK_CONTEXT_MAX_BYTES="0",
                  GEMINI_HOOK_CONTEXT_BYTES="0"))
    assert result["held"] == CONTEXT


def test_the_context_settings_come_from_the_daemon(hooked: Hooked, tmp_path: Path) -> None:
    """The node's --interposer-context-bytes is charged for an unmeasurable context, whatever the
    pod's environment says, and its --interposer-context-max-bytes caps a measured one."""
    node = start_node(0.5, "--interposer-context-bytes", "128MiB", "--interposer-context-max-bytes",
                      "200MiB")
    try:
        no_nvml = tmp_path / "lib"             # without libnvidia-ml: nothing to measure with
        no_nvml.mkdir()
        (no_nvml / "libcuda.so.1").symlink_to(hooked.fake / "libcuda.so.1")
        code = """
            lib = cuda()
            context(lib)
            print(json.dumps({"held": stats()["bytes_held"]}))
        """
        unmeasured = hooked.python(code, node.env(
            FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT), GEMINI_HOOK_CONTEXT_BYTES="0",
            LD_LIBRARY_PATH=str(no_nvml)))
        assert unmeasured["held"] == 128 * MiB
        capped = hooked.python(code, node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT)))
        assert capped["held"] == 200 * MiB
        raised = hooked.python(code, node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT),
                                              GEMINI_HOOK_CONTEXT_MAX_BYTES=str(CONTEXT)))
        assert raised["held"] == CONTEXT        # the environment may ask for more
    finally:
        stop_node(node)


def test_a_missing_channel_gates_launches_at_a_small_bounded_share(hooked: Hooked) -> None:
    """S5: a channel that does not exist gave 96,164 ungated, uncharged launches. Before any
    hello the hook knows no share it can trust: it gates itself at 0.04."""
    loop = TimedLoop(hooked, {"GEMINI_CHANNEL_DIR": "/nonexistent-gemini-channel",
                              "GEMINI_HOOK_DAEMON_WAIT": "0", "GEMINI_HOOK_FALLBACK_RETRY": "1e6"},
                     3.0)
    result = loop.result()
    launched = result["launched"]
    assert isinstance(launched, list) and len(launched) > 10
    share = gpu_share(launched, launched[0], int(result["done"]))  # type: ignore[call-overload]
    assert share <= 0.05, (share, len(launched))
    assert share >= 0.02, (share, len(launched))     # gated, not starved
    assert "gates its launches itself" in str(result["stderr"])


# A grant made before the daemon died runs to its end: the tenant, alone on the GPU, is granted
# all of it for up to max_quota + revoke_grace (0.2 + 0.05 s). The outage starts where that grant
# ends at the latest. Measured from the kill instead, a kill 0.02 s after the hellos (the first
# grant, max_quota long) read 0.356 against 0.294 at 0.5 s: the last grant, not the self-gating.
LAST_GRANT_NS = 250_000_000
KILL_AFTER = float(os.environ.get("GEMINI_TEST_KILL_AFTER", "0.02"))


@pytest.mark.slow   # an outage case: CI's lane
def test_a_daemon_outage_keeps_the_tenant_within_its_share_and_gating_resumes_within_a_second(
        hooked: Hooked) -> None:
    """While the daemon is away after a hello (killed just after the hellos, the case the
    triage suspected, by default), the container gates itself at the share that hello gave it
    (0.3), its two launching processes together (they share the clock on their activity page);
    back, the daemon gates it again within its fallback retry (0.5 s here)."""
    node = start_node(0.3, "--interposer-fallback-retry", "0.5")
    try:
        env = node.env(GEMINI_HOOK_DAEMON_WAIT="0.2", GEMINI_HOOK_FALLBACK_RETRY="1e6")
        def connected() -> bool:
            entry = node.daemon.allocation(node.record.id)
            return bool(entry and len(entry["connections"]) == 2)

        loops = [TimedLoop(hooked, env, 5.0) for _ in range(2)]
        # After their hellos (before one, a hook knows no share and gates itself at 0.04), and
        # a while gated by the daemon (KILL_AFTER; how long does not matter, see LAST_GRANT).
        wait_for(connected, 3, "both processes say hello")
        time.sleep(KILL_AFTER)
        killed = time.monotonic_ns()
        node.daemon.stop(signal.SIGKILL)
        time.sleep(2.5)                                  # the outage, measured below
        node.daemon = DaemonProcess(node.state_dir).wait_ready()
        back = time.monotonic_ns()
        wait_served(node.record)
        wait_for(connected, 3, "both processes say hello to the returning daemon")
        reconnected = time.monotonic_ns()
        results = [loop.result() for loop in loops]
        launched = [t for result in results for t in result["launched"]]  # type: ignore[attr-defined]
        outage = gpu_share(launched, killed + LAST_GRANT_NS, back)
        assert outage <= 0.3 + 0.05, outage
        assert outage >= 0.15, outage                    # it ran, at about its share
        assert (reconnected - back) / NS < 1.0, (reconnected - back) / NS
        for result in results:
            stats = result["stats"]
            assert isinstance(stats, dict) and stats["daemon_connects"] == 2, stats
            assert stats["ungated_launches"] > 0, stats
    finally:
        stop_node(node)
