/* The token of one physical GPU in C: vgpu_runtime/daemon/channel/tokens.py's GpuTokens, the
 * same rules line for line (tests/daemon/test_native_tokens.py compares the two step by step),
 * over the scheduler of timeshare.h, called C to C.
 *
 * What stays with the caller (the daemon's asyncio loop, nativetokens.py): the sockets and the
 * timers. This code owns no loop and no clock:
 * - every call takes `now` (double seconds, CLOCK_MONOTONIC as the hooks read it);
 * - what must be sent comes back in `struct td_out`: the TOKEN_GRANTs, in the order tokens.py
 *   sends them, and the events tokens.py logs;
 * - td_out.wakeup (and td_next_wakeup) is when td_on_timer must run next, already rounded up to
 *   whole milliseconds as tokens.timer_delay rounds; NaN: no timer.
 *
 * Handles:
 * - the scheduler's tenants are added and removed by the caller (NativeTokenScheduler, which
 *   keeps their names); every other call into the scheduler is made from here;
 * - a slot is one allocation on this GPU with its two pages; td_slot_new makes one (detached),
 *   td_attach binds it to a tenant, td_detach unbinds it and keeps its connections, as
 *   tokens.py's TenantSlot survives a remove and a re-add; td_slot_free forgets it;
 * - a connection is a small integer the caller picks, 0 <= id < TD_MAX_CONNECTIONS, bound to the
 *   slot it first asks through until it closes or the slot is freed; asking through another
 *   slot is refused (TD_EINVAL).
 * Calls that fill a td_out return how many grants (bits 0-15) and events (from bit
 * TD_EVENTS_SHIFT) it holds, so the caller reads only what is there; errors are negative TD_E*
 * codes, returned before anything changed. Not thread-safe.
 *
 * The part between TD_CDEF_BEGIN and TD_CDEF_END is what the Python binding (cffi, ABI mode)
 * reads: plain declarations only, no preprocessor. It uses timeshare.h's types.
 */
#ifndef GEMINI_TOKENS_H
#define GEMINI_TOKENS_H

#include "timeshare.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_API __attribute__((visibility("default")))

/* TD_CDEF_BEGIN */
enum {
    TD_MAX_SLOTS = 2048,          /* slots alive on one GPU, attached or not (2 x TS_MAX_TENANTS) */
    TD_MAX_CONNECTIONS = 8192,    /* connection ids 0 .. TD_MAX_CONNECTIONS - 1 on one GPU */
    TD_MAX_GRANTS_OUT = 16384,    /* grants one call may send: two hand-overs (td_on_timer) */
    TD_MAX_EVENTS = 8,            /* events one call may report */
    TD_WAIT_BUCKETS = 14,         /* finite bounds of the token-wait histogram */
    TD_EVENTS_SHIFT = 16          /* a call's result: grants | events << TD_EVENTS_SHIFT */
};

enum {
    TD_OK = 0,
    TD_EINVAL = -1,     /* a bad argument: a connection id out of range or bound elsewhere,
                           a slot still attached (free), a share or limit the scheduler refuses */
    TD_ENOENT = -2,     /* no such slot, or the slot is not attached */
    TD_EFULL = -3,      /* TD_MAX_SLOTS slots, or TS_MAX_TENANTS attached */
    TD_ENOMEM = -4
};

enum {   /* GRANTED and IDLE_RELEASE are debug lines: reported after td_debug_events(gpu, 1) */
    TD_EVENT_GRANTED = 1,       /* value: the grant's quota, seconds */
    TD_EVENT_REVOKED = 2,       /* not returned in time; value: the overrun, seconds */
    TD_EVENT_IDLE_RELEASE = 3,  /* value: how long it was held, seconds */
    TD_EVENT_HOLDER_GONE = 4    /* its last connection closed */
};

struct td_settings {
    double idle_release;
    double max_quota;           /* the scheduler's */
    double timer_resolution;    /* > 0: timers on whole multiples, rounded up, at least one (an
                                   event loop's timers: tokens.timer_delay); 0: exact (the
                                   daemon's timerfd, td_wakeup_set) */
};

struct td_grant_out {
    int32_t connection;
    uint32_t seq;
    uint32_t gpu_index;
    uint32_t reserved;
    uint64_t generation;
    int64_t valid_until_ns;
};

struct td_event {
    int32_t kind;
    int32_t slot;
    uint64_t generation;
    double value;
};

struct td_out {
    double wakeup;              /* td_next_wakeup after the call */
    int32_t grants;             /* how many of grant[] were filled */
    int32_t events;
    struct td_event event[8];   /* TD_MAX_EVENTS */
    struct td_grant_out grant[16384];  /* TD_MAX_GRANTS_OUT */
};

struct td_slot_info {
    int32_t tenant;             /* the scheduler's handle; -1: detached */
    uint32_t gpu_index;
    uint32_t connections_waiting;
    uint32_t reserved;
    double wait_started;        /* NaN: nobody waits */
    double last_pageless_ask;   /* -inf: never */
    uint64_t wait_counts[15];   /* TD_WAIT_BUCKETS + 1 (the last is +Inf), not cumulative */
    double wait_sum;
    uint64_t wait_count;
};

struct td_counters {
    uint64_t grants;
    uint64_t idle_releases;
    int32_t gate;               /* the gate every attached page shows; -1: not yet written */
    int32_t published_slot;     /* whose grant the pages show; -1: none */
    uint64_t published_generation;
    double deadline_fires;      /* when the deadline timer runs; NaN: not armed */
    double idle_fires;          /* when the idle check runs; NaN: not armed */
    double idle_backoff;
};

typedef struct td_gpu td_gpu;

/* NULL when out of memory. The scheduler is the caller's (it adds and removes the tenants,
 * through nativepolicy.py); it must outlive gpu. */
TD_API td_gpu *td_create(const struct td_settings *settings, ts_scheduler *scheduler);
TD_API void td_destroy(td_gpu *gpu);
/* The bounds (seconds) of the wait histogram's buckets, TD_WAIT_BUCKETS of them. */
TD_API const double *td_wait_bounds(void);

/* Slots. The pages must stay mapped while the slot is attached. */
TD_API int td_slot_new(td_gpu *gpu, uint32_t gpu_index, void *token_page, void *activity_page,
                       int32_t *slot);
TD_API int td_slot_free(td_gpu *gpu, int32_t slot);
TD_API int td_slot_info(const td_gpu *gpu, int32_t slot, struct td_slot_info *out);
/* The connection's slot; -1: unbound (or an id out of range). */
TD_API int32_t td_connection_slot(const td_gpu *gpu, int32_t connection);

/* GpuTokens' methods. `out` is filled on success and emptied on an error. */
/* add: the caller's ts_add, then td_attach with the tenant's handle. remove: td_detach (the
 * page cleared first), the caller's ts_remove, then td_publish. */
TD_API int td_attach(td_gpu *gpu, int32_t slot, int32_t tenant, double now, struct td_out *out);
TD_API int td_detach(td_gpu *gpu, int32_t slot);
TD_API int td_publish(td_gpu *gpu, double now, struct td_out *out);
TD_API int td_set_limit(td_gpu *gpu, int32_t slot, double limit, double now,
                        struct td_out *out);
/* burst_hint, work_end: NaN for none. */
TD_API int td_request(td_gpu *gpu, int32_t connection, bool has_activity_page, int32_t slot,
                      uint32_t seq, double burst_hint, double work_end, bool work_running,
                      double now, struct td_out *out);
TD_API int td_release(td_gpu *gpu, int32_t slot, double work_end, double now,
                      struct td_out *out);
/* The burst's end is clamped to now. */
TD_API int td_observe_burst(td_gpu *gpu, int32_t slot, double start, double end,
                            double now);
/* A connection closed (-1: one that never asked); `last`: the allocation's last one. A slot
 * not attached: nothing. */
TD_API int td_connection_closed(td_gpu *gpu, int32_t connection, int32_t slot, bool last,
                                double now, struct td_out *out);

/* Timers. td_on_timer: the earliest wakeup has come; runs it and whatever else is due by now,
 * the deadline before the idle check at the same time. */
TD_API double td_next_wakeup(const td_gpu *gpu);
TD_API int td_on_timer(td_gpu *gpu, double now, struct td_out *out);
/* Whether to report the events logged at debug level (off when made). */
TD_API void td_debug_events(td_gpu *gpu, bool on);
/* Disarm both timers (GpuTokens.close). */
TD_API void td_close(td_gpu *gpu);

/* The wakeup timer (wakeup.c): a timerfd on CLOCK_MONOTONIC for the event loop to watch, set to
 * an absolute time in seconds (NaN or infinite: disarmed). Negative errno on failure. */
TD_API int td_wakeup_create(void);
TD_API int td_wakeup_set(int fd, double at);
/* A timer's callback in one call: read `fd`, run what is due, set `fd` again (wakeup.c);
 * fd -1: the caller's own timer, neither read nor set. */
TD_API int td_on_wakeup(td_gpu *gpu, int fd, double armed_at, double now, struct td_out *out);
TD_API void td_counters(const td_gpu *gpu, struct td_counters *out);
/* TD_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif
