/* gate.h: the one launch gate (internal to launch/). */
#ifndef GEMINI_GATE_H
#define GEMINI_GATE_H

#include "hook.h"

enum gm_launch_kind {
    GM_LAUNCH_KERNEL,
    GM_LAUNCH_KERNEL_EX,
    GM_LAUNCH_COOPERATIVE,
    GM_LAUNCH_GRAPH,
    GM_LAUNCH_LEGACY,        /* cuLaunch, cuLaunchGrid, cuLaunchGridAsync (pre-4.0 API) */
    GM_LAUNCH_KIND_COUNT
};
enum gm_legacy_call { GM_LEGACY_LAUNCH, GM_LEGACY_GRID, GM_LEGACY_GRID_ASYNC };

/* One launch, whichever entry point it came through: the gate calls `real` with `args`. */
struct gm_launch {
    enum gm_launch_kind kind;
    int per_thread;          /* a _ptsz entry point: stream 0 is the per-thread stream */
    CUstream stream;
    void *real;
    union {
        struct {
            CUfunction f;
            unsigned int grid[3], block[3], shared_mem;
            void **params, **extra;
        } kernel;            /* KERNEL and COOPERATIVE (extra unused) */
        struct {
            const CUlaunchConfig *config;
            CUfunction f;
            void **params, **extra;
        } ex;
        CUgraphExec graph;
        struct {
            enum gm_legacy_call call;
            CUfunction f;
            int width, height;
        } legacy;
    } args;
};

GM_HIDDEN CUresult gm_gate(const struct gm_launch *launch);
GM_HIDDEN void gm_capture_opened(CUresult result);
GM_HIDDEN void gm_capture_closed(CUresult result);
/* token.c: the GPU index whose token this launch runs under (then call gm_token_launched
 * with *at, the clock it read), or -1 when it goes ungated (gate open, daemon away, no
 * context). May block. An open gate reads no clock. */
GM_HIDDEN int gm_token_gate(int64_t *at);
GM_HIDDEN void gm_token_launched(int gpu, const struct gm_launch *launch, int64_t at);

#endif
