"""What a context costs is measured when it is created and charged to the container."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.daemon.helpers import wait_for
from tests.hook.conftest import LIMIT, PRELUDE, DaemonNode, Hooked, MiB

CONTEXT = 300 * MiB


def test_primary_context_cost_is_measured_through_nvml_and_charged(
        hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        assert lib.cuInit(0) == 0
        ctx = ctypes.c_void_p()
        out = {"retain": lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)}
        out["held_after_retain"] = stats()["bytes_held"]
        out["second_retain"] = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
        out["held_after_second"] = stats()["bytes_held"]
        assert lib.cuCtxSetCurrent(ctx) == 0
        out["over"] = alloc(lib, 800 * 2**20)[0]        # 300 + 800 > 1024
        out["fits"] = alloc(lib, 700 * 2**20)[0]        # 300 + 700 fits
        out["info"] = mem_info(lib)
        lib.cuDevicePrimaryCtxRelease_v2(0)
        out["held_after_one_release"] = stats()["bytes_held"]
        lib.cuDevicePrimaryCtxRelease_v2(0)
        out["held_after_last_release"] = stats()["bytes_held"]
        print(json.dumps(out))
    """, node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT)))
    assert result["retain"] == 0 and result["second_retain"] == 0
    assert result["held_after_retain"] == CONTEXT
    assert result["held_after_second"] == CONTEXT          # one primary context, one charge
    assert result["over"] == 2 and result["fits"] == 0
    assert result["info"] == [LIMIT - CONTEXT - 700 * MiB, LIMIT]
    assert result["held_after_one_release"] == CONTEXT + 700 * MiB
    assert result["held_after_last_release"] == 700 * MiB


def test_created_contexts_are_charged_each_and_uncharged_on_destroy(
        hooked: Hooked, node: DaemonNode) -> None:
    result = hooked.python("""
        lib = cuda()
        first = context(lib)       # no context current: measured through NVML
        second = context(lib)      # a context current on the device: through cuMemGetInfo
        out = {"held": stats()["bytes_held"], "info": mem_info(lib)}
        out["destroy"] = lib.cuCtxDestroy_v2(second)
        out["held_after_destroy"] = stats()["bytes_held"]
        print(json.dumps(out))
    """, node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT)))
    assert result["held"] == 2 * CONTEXT
    assert result["info"] == [LIMIT - 2 * CONTEXT, LIMIT]
    assert result["destroy"] == 0 and result["held_after_destroy"] == CONTEXT


def test_the_daemon_charges_the_context_while_the_process_lives(
        hooked: Hooked, node: DaemonNode) -> None:
    source = PRELUDE + textwrap.dedent("""
        import sys
        lib = cuda()
        context(lib)
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", source], text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            env=hooked.env(node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT))))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert node.used() == CONTEXT
        proc.kill()
        proc.wait()
        wait_for(lambda: node.used() == 0, what="the context's charge released with the process")
    finally:
        proc.kill()
        proc.wait()


def test_without_a_measurement_the_configured_cost_is_charged(
        hooked: Hooked, node: DaemonNode, tmp_path: Path) -> None:
    no_nvml = tmp_path / "lib"                 # the fake driver without libnvidia-ml next to it
    no_nvml.mkdir()
    (no_nvml / "libcuda.so.1").symlink_to(hooked.fake / "libcuda.so.1")
    result = hooked.python("""
        lib = cuda()
        context(lib)               # no context current and no NVML: nothing to measure with
        print(json.dumps({"held": stats()["bytes_held"]}))
    """, node.env(FAKE_CUDA_CONTEXT_BYTES=str(CONTEXT), GEMINI_HOOK_CONTEXT_BYTES=str(64 * MiB),
                  LD_LIBRARY_PATH=str(no_nvml)))
    assert result["held"] == 64 * MiB
