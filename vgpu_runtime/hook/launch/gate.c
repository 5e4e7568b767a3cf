/*
 * gate.c: THE launch gate. Every kernel and graph launch passes through gm_gate().
 *
 * The gate counts, times (a sample), and holds each launch to the container's GPU-time
 * token (token.c). Fast path: relaxed atomics, one acquire load and CLOCK_MONOTONIC (a vDSO
 * read) while a token is needed, no clock at all while the gate is open; no system call and
 * no lock.
 *
 * Stream capture: a launch into a capturing stream only records a graph node, so it is
 * passed straight through, neither gated nor counted as a burst. Asking the driver costs
 * a call per launch, so we only ask while a capture is open somewhere in the process
 * (capture.c counts them); with no capture open no stream can be capturing.
 */
#include "gate.h"
#include "profile.h"

static int stream_capturing(const struct gm_launch *launch) {
    if (!gm_capture_open()) return 0;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult result = launch->per_thread
                          ? GM_REAL(cuStreamIsCapturing_ptsz)(launch->stream, &status)
                          : GM_REAL(cuStreamIsCapturing)(launch->stream, &status);
    return result == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static CUresult call_real(const struct gm_launch *l) {
    switch (l->kind) {
    case GM_LAUNCH_KERNEL:
        return ((gm_fn_cuLaunchKernel)l->real)(
            l->args.kernel.f, l->args.kernel.grid[0], l->args.kernel.grid[1],
            l->args.kernel.grid[2], l->args.kernel.block[0], l->args.kernel.block[1],
            l->args.kernel.block[2], l->args.kernel.shared_mem, l->stream, l->args.kernel.params,
            l->args.kernel.extra);
    case GM_LAUNCH_COOPERATIVE:
        return ((gm_fn_cuLaunchCooperativeKernel)l->real)(
            l->args.kernel.f, l->args.kernel.grid[0], l->args.kernel.grid[1],
            l->args.kernel.grid[2], l->args.kernel.block[0], l->args.kernel.block[1],
            l->args.kernel.block[2], l->args.kernel.shared_mem, l->stream, l->args.kernel.params);
    case GM_LAUNCH_KERNEL_EX:
        return ((gm_fn_cuLaunchKernelEx)l->real)(l->args.ex.config, l->args.ex.f,
                                                 l->args.ex.params, l->args.ex.extra);
    case GM_LAUNCH_GRAPH:
        return ((gm_fn_cuGraphLaunch)l->real)(l->args.graph, l->stream);
    case GM_LAUNCH_LEGACY:
        switch (l->args.legacy.call) {
        case GM_LEGACY_LAUNCH: return ((gm_fn_cuLaunch)l->real)(l->args.legacy.f);
        case GM_LEGACY_GRID:
            return ((gm_fn_cuLaunchGrid)l->real)(l->args.legacy.f, l->args.legacy.width,
                                                 l->args.legacy.height);
        case GM_LEGACY_GRID_ASYNC:
            return ((gm_fn_cuLaunchGridAsync)l->real)(l->args.legacy.f, l->args.legacy.width,
                                                      l->args.legacy.height, l->stream);
        }
        break;
    case GM_LAUNCH_KIND_COUNT: break;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* Timing every launch would cost two clock reads per launch (a system call where the
 * clock source has no vDSO path, as in some VMs); one launch in TIME_EVERY is timed and
 * gate_ns is scaled up to estimate the total. */
#define TIME_EVERY 16

CUresult gm_gate(const struct gm_launch *launch) {
    GM_PROFILE_POINT(entered);
    if (!gm_active()) return call_real(launch);
    if (stream_capturing(launch)) {
        GM_COUNT(captured_launches, 1);
        return call_real(launch);
    }
    uint64_t seen = launch->kind == GM_LAUNCH_GRAPH ? GM_COUNT(graph_launches, 1)
                                                    : GM_COUNT(kernel_launches, 1);
    int timed = seen % TIME_EVERY == 0;
    int64_t start = timed ? gm_now_ns() : 0;
    int64_t at = 0;
    int gpu = gm_token_gate(&at);   /* blocks while another container holds the token */
    GM_PROFILE_POINT(before_real);
    CUresult result = call_real(launch);
    GM_PROFILE_POINT(after_real);
    if (gpu >= 0) gm_token_launched(gpu, launch, at);
    if (timed) GM_COUNT(gate_ns, (uint64_t)(gm_now_ns() - start) * TIME_EVERY);
    GM_PROFILE_LAUNCH(launch, entered, before_real, after_real);
    return result;
}
