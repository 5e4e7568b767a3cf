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

#define GEMINI_HOOK_STATS_VERSION 2

struct gemini_hook_stats {
    uint32_t version;            /* GEMINI_HOOK_STATS_VERSION */
    uint32_t active;             /* 1 when GEMINI_CHANNEL_DIR is set */
    uint64_t kernel_launches;    /* cuLaunchKernel*, cuLaunchCooperativeKernel* through the gate */
    uint64_t graph_launches;     /* cuGraphLaunch* through the gate (one burst each) */
    uint64_t captured_launches;  /* launches into a capturing stream: passed straight through */
    uint64_t gate_ns;            /* host time in gated launches, ns (1 in 16 timed, scaled) */
    uint64_t wrapped_by_dlsym;   /* dlsym answers swapped for a wrapper */
    uint64_t wrapped_by_procaddress; /* cuGetProcAddress answers swapped for a wrapper */
    uint64_t mem_refused;        /* allocations answered CUDA_ERROR_OUT_OF_MEMORY by the limit */
    uint64_t daemon_connects;    /* successful hellos (first connection and reconnections) */
    uint64_t bytes_held;         /* what this process holds now, all kinds, all GPUs */
    /* version 2: GPU-time tokens (micro-benchmark counters: token waits and their cost) */
    uint64_t token_requests;     /* slow-path TOKEN_REQUESTs sent */
    uint64_t token_wait_ns;      /* host time launches spent in the slow path (settle + wait) */
    uint64_t token_timeouts;     /* requests that got no grant within GEMINI_HOOK_TOKEN_TIMEOUT */
    uint64_t ungated_launches;   /* launches passed ungated because the daemon was away */
    uint64_t frames_sent;        /* every frame written to the daemon, of any type */
    uint64_t usage_reports;      /* USAGE_REPORT frames (observed kernel bursts) */
    uint64_t syncs_observed;     /* host synchronisations seen returning */
    uint64_t drain_ns;           /* host time spent draining own streams before asking */
};

int gemini_hook_stats(struct gemini_hook_stats *out);

#endif
