/*
 * profile.h: the launch path timed with the CPU's cycle counter, only in a build with
 * -DGM_PROFILE (vgpu_runtime/hook/build.py --profile; scripts/bench-hook --profile). A normal
 * build compiles every GM_PROFILE_* to nothing: the launch path stays as it is.
 *
 * Per gated launch: which entry point it came through (kind, _ptsz or not) and the cycles
 * before the driver's call (gate, token check), in it, and after it (activity, streams,
 * timing). The counter's rate is measured against CLOCK_MONOTONIC between the first launch and
 * the dump, so the exit dump (GEMINI_HOOK_STATS) gives nanoseconds. What the hook adds to a
 * launch is `before + after`; with `driver`, the whole is what the runtime waited on us.
 * Reading the counter costs a few ns itself, four times a launch: the shares are the point,
 * the ratio is measured on the normal build.
 */
#ifndef GEMINI_PROFILE_H
#define GEMINI_PROFILE_H

#include "gate.h"

#ifdef GM_PROFILE
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
static inline uint64_t gm_cycles(void) { return __rdtsc(); }
#elif defined(__aarch64__)
static inline uint64_t gm_cycles(void) {
    uint64_t value;
    __asm__ volatile("mrs %0, cntvct_el0" : "=r"(value));
    return value;
}
#else
static inline uint64_t gm_cycles(void) { return (uint64_t)gm_now_ns(); }
#endif

GM_HIDDEN void gm_profile_launch(const struct gm_launch *launch, uint64_t entered,
                                 uint64_t before_real, uint64_t after_real);
#define GM_PROFILE_POINT(name) uint64_t name = gm_cycles()
#define GM_PROFILE_LAUNCH(launch, entered, before_real, after_real) \
    gm_profile_launch(launch, entered, before_real, after_real)
#else
#define GM_PROFILE_POINT(name)
#define GM_PROFILE_LAUNCH(launch, entered, before_real, after_real)
#endif

#endif
