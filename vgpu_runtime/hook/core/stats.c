/* stats.c: the per-process counters, readable in-process and dumped at exit on request. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"

struct gm_counters gm_counters;

#define LOAD(field) atomic_load_explicit(&gm_counters.field, memory_order_relaxed)

GM_EXPORT int gemini_hook_stats(struct gemini_hook_stats *out) {
    if (out == NULL) return -1;
    memset(out, 0, sizeof *out);
    out->version = GEMINI_HOOK_STATS_VERSION;
    out->active = (uint32_t)gm_active();
    out->kernel_launches = LOAD(kernel_launches);
    out->graph_launches = LOAD(graph_launches);
    out->captured_launches = LOAD(captured_launches);
    out->gate_ns = LOAD(gate_ns);
    out->wrapped_by_dlsym = LOAD(wrapped_by_dlsym);
    out->wrapped_by_procaddress = LOAD(wrapped_by_procaddress);
    out->mem_refused = LOAD(mem_refused);
    out->daemon_connects = LOAD(daemon_connects);
    out->bytes_held = gm_held_total();
    out->token_requests = LOAD(token_requests);
    out->token_wait_ns = LOAD(token_wait_ns);
    out->token_timeouts = LOAD(token_timeouts);
    out->ungated_launches = LOAD(ungated_launches);
    out->frames_sent = LOAD(frames_sent);
    out->usage_reports = LOAD(usage_reports);
    out->syncs_observed = LOAD(syncs_observed);
    out->drain_ns = LOAD(drain_ns);
    return 0;
}

/* GEMINI_HOOK_STATS=<path>: key=value lines at exit, for tools that cannot call in. */
__attribute__((destructor)) static void dump_stats_at_exit(void) {
    const char *path = getenv("GEMINI_HOOK_STATS");
    if (path == NULL || path[0] == '\0') return;
    struct gemini_hook_stats s;
    gemini_hook_stats(&s);
    char text[2048];
    int n = snprintf(text, sizeof text,
                     "pid=%d\nactive=%u\nkernel_launches=%llu\ngraph_launches=%llu\n"
                     "captured_launches=%llu\ngate_ns=%llu\nwrapped_by_dlsym=%llu\n"
                     "wrapped_by_procaddress=%llu\nmem_refused=%llu\ndaemon_connects=%llu\n"
                     "bytes_held=%llu\ntoken_requests=%llu\ntoken_wait_ns=%llu\n"
                     "token_timeouts=%llu\nungated_launches=%llu\nframes_sent=%llu\n"
                     "usage_reports=%llu\nsyncs_observed=%llu\ndrain_ns=%llu\n",
                     (int)getpid(), s.active, (unsigned long long)s.kernel_launches,
                     (unsigned long long)s.graph_launches, (unsigned long long)s.captured_launches,
                     (unsigned long long)s.gate_ns, (unsigned long long)s.wrapped_by_dlsym,
                     (unsigned long long)s.wrapped_by_procaddress,
                     (unsigned long long)s.mem_refused, (unsigned long long)s.daemon_connects,
                     (unsigned long long)s.bytes_held, (unsigned long long)s.token_requests,
                     (unsigned long long)s.token_wait_ns, (unsigned long long)s.token_timeouts,
                     (unsigned long long)s.ungated_launches, (unsigned long long)s.frames_sent,
                     (unsigned long long)s.usage_reports, (unsigned long long)s.syncs_observed,
                     (unsigned long long)s.drain_ns);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || n < 0) return;
    (void)!write(fd, text, (size_t)n);
    close(fd);
}
