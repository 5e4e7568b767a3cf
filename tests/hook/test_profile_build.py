"""The hook's profiling build (launch/profile.h, for scripts/bench-hook --profile): it counts
launches by the entry point they came through and splits their time around the driver's call;
the normal build has none of it on its launch path."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.hook.conftest import DaemonNode, Hooked, compile_program
from vgpu_runtime.hook import build
from vgpu_runtime.hooklib import read_stats_file

LOOP = r"""
#include <stdlib.h>
#include "cuda_types.h"
CUresult cuInit(unsigned int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void **, void **);
int main(int argc, char **argv) {
    CUcontext ctx;
    if (cuInit(0) || cuCtxCreate_v2(&ctx, 0, 0)) return 1;
    for (int i = 0; i < atoi(argv[1]); i++) cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int i = 0; i < atoi(argv[2]); i++) cuLaunchKernel_ptsz(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    return 0;
}
"""


def test_profiling_build_counts_entry_points_and_times_the_driver_call(
        hooked: Hooked, node: DaemonNode, tmp_path: Path) -> None:
    library = build.build_library(tmp_path / "hook", strict=True, profile=True)
    assert library.name == build.library_name() + ".profile"   # never an installed name
    program = compile_program(LOOP, tmp_path / "loop", hooked.fake, f"-L{hooked.fake}", "-lcuda")
    stats = tmp_path / "stats"
    env = hooked.env(node.env(GEMINI_HOOK_STATS=str(stats)))
    env["LD_PRELOAD"] = str(library)
    done = subprocess.run([str(program), "3000", "1000"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    counters = read_stats_file(stats)
    assert counters["kernel_launches"] == 4000
    assert counters["profile_launches_kernel"] == 3000
    assert counters["profile_launches_kernel_ptsz"] == 1000
    assert counters["profile_launches_kernel_ex"] == counters["profile_launches_graph"] == 0
    # Each part took some time; the token check (share 0.5: every launch reads the clock)
    # took some before the driver's call, whose own time the fake driver's mutex takes.
    for part in ("before_driver", "driver", "after_driver"):
        assert counters[f"profile_{part}_ns"] > 0, counters
        # the median per launch, in ps: no more than the mean (preemptions only add to that)
        assert 0 < counters[f"profile_{part}_p50_ps"] / 1000 <= (
            counters[f"profile_{part}_ns"] / 4000 * 1.5), counters
    assert counters["profile_cycles_per_us"] > 0


def test_the_normal_build_has_no_profiling(hook_lib: Path, hooked: Hooked, node: DaemonNode,
                                           tmp_path: Path) -> None:
    symbols = subprocess.run(["nm", str(hook_lib)], capture_output=True, text=True,
                             check=True).stdout
    assert "gm_profile" not in symbols
    program = compile_program(LOOP, tmp_path / "loop", hooked.fake, f"-L{hooked.fake}", "-lcuda")
    stats = tmp_path / "stats"
    done = hooked.run([str(program), "30", "10"], node.env(GEMINI_HOOK_STATS=str(stats)))
    assert done.returncode == 0, done.stderr
    counters = read_stats_file(stats)
    assert counters["kernel_launches"] == 40
    assert not any(key.startswith("profile_") for key in counters)
