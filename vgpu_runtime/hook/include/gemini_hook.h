/*
 * gemini_hook.h: what the interposer exports besides the driver names, for tests and tools.
 *
 * gemini_hook_stats() fills a snapshot of the per-process counters. Set
 * GEMINI_HOOK_STATS=<path> to have the same counters written there (key=value lines)
 * when the process exits.
 */
#ifndef GEMINI_HOOK_PUBLIC_H
#define GEMINI_HOOK_PUBLIC_H

#include <stdint.h>

#define GEMINI_HOOK_STATS_VERSION 5

/* Every counter once, in struct order: the public snapshot, the hook's own atomics, the
 * snapshot code and the exit dump all expand this list (tests read it from this file too). */
#define GEMINI_HOOK_COUNTERS(X)                                                              \
    X(kernel_launches)        /* cuLaunchKernel*, cuLaunchCooperativeKernel* via the gate */ \
    X(graph_launches)         /* cuGraphLaunch* through the gate (one burst each) */         \
    X(captured_launches)      /* launches into a capturing stream: passed straight through */\
    X(gate_ns)                /* host time in gated launches, ns (1 in 16 timed, scaled) */  \
    X(wrapped_by_dlsym)       /* dlsym answers swapped for a wrapper */                      \
    X(wrapped_by_procaddress) /* cuGetProcAddress answers swapped for a wrapper */           \
    X(mem_refused)            /* allocations answered CUDA_ERROR_OUT_OF_MEMORY by the limit */\
    X(daemon_connects)        /* successful hellos (first connection and reconnections) */   \
    X(token_requests)         /* slow-path TOKEN_REQUESTs sent */                            \
    X(token_wait_ns)          /* host time launches spent in the slow path (settle + wait) */\
    X(token_timeouts)         /* requests with no grant within the token timeout */          \
    X(ungated_launches)       /* launches no grant covered (daemon away): self-gated */      \
    X(frames_sent)            /* every frame written to the daemon, of any type */           \
    X(usage_reports)          /* USAGE_REPORT frames (observed kernel bursts) */             \
    X(syncs_observed)         /* host synchronisations seen returning */                     \
    X(drain_ns)               /* host time spent draining own streams before asking */      \
    X(token_wait_max_ns)      /* the longest single slow-path wait of token_wait_ns, ns */  \
    X(bursts_observed_ns)     /* launch-to-synchronisation bursts seen, summed, ns */        \
    X(usage_reported_ns)      /* the bursts the usage reports sent cover, summed, ns */

struct gemini_hook_stats {
    uint32_t version;            /* GEMINI_HOOK_STATS_VERSION */
    uint32_t active;             /* 1 when a channel exists (/run/gemini, GEMINI_CHANNEL_DIR) */
    uint64_t bytes_held;         /* what this process holds now, all kinds, all GPUs */
#define GEMINI_HOOK_STATS_FIELD(name) uint64_t name;
    GEMINI_HOOK_COUNTERS(GEMINI_HOOK_STATS_FIELD)
#undef GEMINI_HOOK_STATS_FIELD
};

int gemini_hook_stats(struct gemini_hook_stats *out);

#endif
