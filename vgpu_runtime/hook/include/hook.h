/* hook.h: declarations shared by the interposer's families (internal). */
#ifndef GEMINI_HOOK_H
#define GEMINI_HOOK_H

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"
#include "gemini_hook.h"
#include "gemini_wire.h"
#include "lifecycle.h"

#define GM_EXPORT __attribute__((visibility("default")))
#define GM_HIDDEN __attribute__((visibility("hidden")))

/* From the table: a function-pointer type and an id per entry, and the wrappers' prototypes
 * (so a wrapper whose signature drifts from the table does not compile). */
#define GM_HOOK(name, family, ret, params, what) typedef ret(*gm_fn_##name) params;
#define GM_CALL(name, family, ret, params) typedef ret(*gm_fn_##name) params;
#include "../hooks.def"

#define GM_HOOK(name, family, ret, params, what) GM_EXPORT ret name params;
#include "../hooks.def"

enum gm_entry_id {
#define GM_HOOK(name, family, ret, params, what) GM_ID_##name,
#define GM_CALL(name, family, ret, params) GM_ID_##name,
#include "../hooks.def"
    GM_ENTRY_COUNT
};

enum gm_lib { GM_LIB_CUDA = 0, GM_LIB_NVML = 1 };

/* core/real.c */
GM_HIDDEN void *gm_real(enum gm_entry_id id);       /* never NULL: a "not found" stub instead */
GM_HIDDEN void *gm_real_raw(enum gm_entry_id id);   /* NULL when the driver lacks it */
GM_HIDDEN int gm_real_loaded(enum gm_lib lib);      /* loads it once; 0 from inside its load */
#define GM_REAL(name) ((gm_fn_##name)gm_real(GM_ID_##name))
#define GM_HAS_REAL(name) (gm_real_raw(GM_ID_##name) != NULL)

/* core/table.c */
GM_HIDDEN int gm_lookup_name(const char *name);     /* entry id of a hooked name, or -1 */
GM_HIDDEN void *gm_wrapper_for(const char *name, void *real); /* wrapper if real is that entry's */
GM_HIDDEN void *gm_wrapper_for_pointer(void *real);   /* wrapper of whichever variant it is */

/* fstat and lstat through the system call: glibc 2.33 made them symbols of that version,
 * older images have only __fxstat (see glibc_compat.h). Kernel and glibc agree on struct stat
 * on x86-64 and aarch64. */
static inline int gm_fstat(int fd, struct stat *st) {
    return (int)syscall(SYS_fstat, fd, st);
}
static inline int gm_lstat(const char *path, struct stat *st) {
    return (int)syscall(SYS_newfstatat, AT_FDCWD, path, st, AT_SYMLINK_NOFOLLOW);
}

/* CLOCK_MONOTONIC in ns: a vDSO read, no system call (the launch path reads it). */
static inline int64_t gm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* core/init.c */
/* The channel's place in a pod and the daemon's socket name: gemini_wire.h. */
GM_HIDDEN const char *gm_channel_dir(void);  /* the channel, or NULL: no channel, no hook */
GM_HIDDEN int gm_active(void);               /* a channel exists */
GM_HIDDEN void gm_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
GM_HIDDEN void gm_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* An environment number scaled to an integer (seconds to ns: 1e9; bytes: 1); -1 when unset.
 * Anything but a finite number >= 0 that stays within 9e18 scaled is ignored (-1) with a
 * warning, so a typo never turns into an endless or negative setting. */
GM_HIDDEN int64_t gm_env_number(const char *name, double scale);
GM_HIDDEN extern __thread int gm_in_loader;  /* this thread is resolving real symbols */
GM_HIDDEN void *gm_real_dlsym(void *handle, const char *name);

/* counters (core/stats.c) */
struct gm_counters {
#define GM_COUNTER_FIELD(name) _Atomic uint64_t name;
    GEMINI_HOOK_COUNTERS(GM_COUNTER_FIELD)
#undef GM_COUNTER_FIELD
};
GM_HIDDEN extern struct gm_counters gm_counters;
#define GM_COUNT(field, n) atomic_fetch_add_explicit(&gm_counters.field, (n), memory_order_relaxed)

/* channel/client.c: one connection per process to <channel>/sched.sock */
struct gm_grant_view {
    uint8_t uuid[GM_UUID_BYTES];
    uint64_t memory_limit;
};
GM_HIDDEN int gm_channel_grants(struct gm_grant_view *out, int max, int may_wait);
/* A memory request; returns 0 with *reply filled, or -1 when the daemon cannot be reached. */
GM_HIDDEN int gm_channel_mem(uint16_t type, uint32_t gpu, uint32_t kind, uint64_t bytes,
                             struct gm_mem_reply *reply, int may_wait);
/* Connected (hello answered, pages mapped)? The allocation's GPU count, or -1. */
GM_HIDDEN int gm_channel_ensure(int may_wait);
/* TOKEN_REQUEST (flags: enum gm_token_flags), then block (no busy wait) for its grant:
 * 0 granted, -1 daemon away or refused, -2 no grant within the token timeout. */
GM_HIDDEN int gm_channel_token(uint32_t gpu, uint32_t flags, int64_t burst_ns,
                               int64_t work_end_ns, struct gm_token_grant *out);
/* Enforcement settings: the daemon's from the last hello (its defaults before one), where
 * the environment may only ask for more safety (see gm_settings in gemini_wire.h). */
GM_HIDDEN int64_t gm_setting_token_timeout_ns(void);
GM_HIDDEN int64_t gm_setting_fallback_retry_ns(void);
GM_HIDDEN uint64_t gm_setting_context_bytes(void);
GM_HIDDEN uint64_t gm_setting_context_max_bytes(void);
/* A connection the daemon hung up is dropped and, without waiting, made again (a new daemon's
 * hello brings its pages); nothing while another thread talks to the daemon. */
GM_HIDDEN void gm_channel_revive(void);
/* A frame without reply (header type and length set), sent only if that costs no wait. */
GM_HIDDEN int gm_channel_notify(void *frame);

/* core/held.c: what this process holds, re-declared on every (re)connection */
GM_HIDDEN void gm_held_add(uint32_t gpu, uint32_t kind, int64_t delta);
GM_HIDDEN void gm_held_set(uint32_t gpu, uint32_t kind, uint64_t bytes);
GM_HIDDEN uint64_t gm_held_get(uint32_t gpu, uint32_t kind);
GM_HIDDEN uint64_t gm_held_total(void);
GM_HIDDEN void gm_held_reset(void);

/* launch/token.c */
GM_HIDDEN void gm_sync_observed(void);   /* a host synchronisation returned */
GM_HIDDEN int gm_capture_open(void);      /* some stream of the process is capturing */

/* memory/: what the other families tell the pools and ask of the memory accounts */
GM_HIDDEN void gm_pools_changed(void);   /* a call that may change what pools hold returned */
GM_HIDDEN void gm_account_graph_memory(CUstream stream, int per_thread);   /* a graph launched */
/* Before a graph's launch or upload: CUDA_ERROR_OUT_OF_MEMORY when its memory nodes cannot fit
 * next to the container's other use; no lock and no call unless some graph has memory nodes. */
GM_HIDDEN CUresult gm_graph_memory_check(CUgraphExec exec);
/* Container-wide use and limit on `gpu`; 0 when known from the daemon, -1 for a local guess. */
GM_HIDDEN int gm_usage(int gpu, uint64_t *used, uint64_t *limit);

/* memory/ledger.c: what each allocation booked, so its free releases exactly that */
GM_HIDDEN void gm_ledger_put(uint64_t key, uint64_t bytes, uint32_t kind, uint32_t gpu);
GM_HIDDEN int gm_ledger_take(uint64_t key, uint64_t *bytes, uint32_t *kind, uint32_t *gpu);

/* memory/devices.c: CUdevice <-> index into the hello reply's GPUs */
#define GM_NO_GPU (-1)
#define GM_UNKNOWN_GPU (-2)   /* the daemon cannot be reached, so the allocation is unknown */
#define GM_NO_CONTEXT (-3)    /* no current context: the driver call itself will say so */
GM_HIDDEN int gm_gpu_of_device(CUdevice dev);
GM_HIDDEN int gm_current_gpu(CUdevice *dev_out);

#endif
