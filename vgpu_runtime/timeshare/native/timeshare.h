/* The token scheduler (vgpu_runtime/timeshare/policy.py) in C: the same rules, the same
 * floating-point operations in the same order, so every decision and every charged figure is
 * bit-identical to the Python one (tests/timeshare/test_native_equal.py keeps it so).
 *
 * Conventions:
 * - Times are double seconds on the caller's clock (CLOCK_MONOTONIC in the daemon).
 * - "None" (no value) is NaN in every double of this API: pass NAN for an absent burst hint,
 *   work end or work start; read-outs return NAN where Python returns None.
 * - Tenants are small integer handles, 0 <= handle < TS_MAX_TENANTS, returned by ts_add (the
 *   lowest free one; a removed tenant's handle is reused by a later add).
 * - Calls that may hand the token over return TS_GRANTED (1) and fill *granted (when not NULL)
 *   with the new holder, TS_OK (0) when the token did not change hands, or a negative TS_E*
 *   code, in which case nothing changed. Nothing aborts.
 * - Only ts_create and ts_add allocate (a tenant's histories, about 100 KiB, when it joins):
 *   the token path (request, release, tick, next_deadline) allocates nothing.
 * - Not thread-safe: one caller at a time per scheduler (the daemon's token thread).
 *
 * The part between TS_CDEF_BEGIN and TS_CDEF_END is what the Python binding (cffi, ABI mode)
 * reads: plain declarations only, no preprocessor.
 */
#ifndef GEMINI_TIMESHARE_H
#define GEMINI_TIMESHARE_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TS_API __attribute__((visibility("default")))

/* TS_CDEF_BEGIN */
enum {
    TS_MAX_TENANTS = 1024,        /* tenants on one GPU (slices go to 1000); more: TS_EFULL */
    TS_WAITS_KEPT = 1024,         /* token waits kept per tenant for p50/p99 */
    TS_BURSTS_KEPT = 1024,        /* kernel bursts kept per tenant (the oldest dropped) */
    TS_WINDOW_INTERVALS = 4096    /* charged intervals kept per tenant (the oldest dropped) */
};

enum {
    TS_OK = 0,          /* done; the token did not change hands */
    TS_GRANTED = 1,     /* done; the token went to *granted */
    TS_EINVAL = -1,     /* need 0 < share <= limit <= 1 (add), 0 < limit <= 1 (set_limit) */
    TS_ENOENT = -2,     /* no tenant with that handle */
    TS_EFULL = -3,      /* TS_MAX_TENANTS tenants already */
    TS_ENOMEM = -4      /* no memory for a new tenant's histories */
};

struct ts_settings {            /* TimeshareSettings, field for field */
    double window;
    double min_quota;
    double max_quota;
    double cycle;
    double catch_up;
    double revoke_grace;
    double preempt_after;
    double burst_merge_gap;
    double burst_history;
};

struct ts_grant {
    int32_t tenant;
    uint64_t generation;
    double granted_at;
    double quota;               /* expires at granted_at + quota */
};

/* One tenant's state: TenantView's fields, and the internals the tests compare. */
struct ts_tenant_state {
    double share;               /* the request as added */
    double effective_share;     /* scaled down where requests add up to more than 1 */
    double limit;
    double vtime;
    double credit;
    double credit_at;
    double waiting_since;       /* NaN: not waiting */
    double burst_hint;          /* NaN: none */
    double last_release;        /* NaN: never released */
    double last_quota;          /* NaN: never granted */
    uint64_t revocations;
    uint32_t waits;             /* token waits kept (at most TS_WAITS_KEPT) */
    bool waiting;
    bool holder;
};

/* What a snapshot shows of one tenant (policy.TenantView). */
struct ts_tenant_view {
    double share;               /* effective */
    double limit;
    double used;                /* share of the window used, the grant in progress included */
    double wait_p50;            /* NaN: no wait yet */
    double wait_p99;
    double burst;               /* the burst quota sizing takes; NaN: none */
    double last_quota;          /* NaN: never granted */
    uint64_t revocations;
    bool waiting;
    bool holder;
};

typedef struct ts_scheduler ts_scheduler;

/* NULL when out of memory. The settings are copied. */
TS_API ts_scheduler *ts_create(const struct ts_settings *settings, double now);
TS_API void ts_destroy(ts_scheduler *s);

/* Membership. ts_add writes the new tenant's handle to *tenant. Removing an unknown handle
 * only re-dispatches, as Python's remove of an absent tenant does. */
TS_API int ts_add(ts_scheduler *s, double share, double limit, double now, int32_t *tenant,
                  struct ts_grant *granted);
TS_API int ts_remove(ts_scheduler *s, int32_t tenant, double now, struct ts_grant *granted);
TS_API int ts_set_limit(ts_scheduler *s, int32_t tenant, double limit, double now,
                        struct ts_grant *granted);

/* The token. ts_release of an unknown handle changes nothing and returns TS_ENOENT. */
TS_API int ts_request(ts_scheduler *s, int32_t tenant, double now, double burst_hint,
                      double work_end, bool work_running, double work_since,
                      struct ts_grant *granted);
TS_API int ts_release(ts_scheduler *s, int32_t tenant, double now, double work_end,
                      struct ts_grant *granted);
TS_API int ts_observe_burst(ts_scheduler *s, int32_t tenant, double start, double end);
TS_API int ts_tick(ts_scheduler *s, double now, struct ts_grant *granted);
/* When ts_tick must run next; NaN: no deadline. */
TS_API double ts_next_deadline(ts_scheduler *s, double now);

/* Read-outs. ts_holder: false when nobody holds the token. */
TS_API bool ts_holder(const ts_scheduler *s, struct ts_grant *holder);
TS_API bool ts_needs_token(const ts_scheduler *s);
TS_API uint64_t ts_generation(const ts_scheduler *s);
TS_API uint64_t ts_preemptions(const ts_scheduler *s);
/* The handles in the order the tenants were added; returns how many (at most max). */
TS_API int ts_tenants(const ts_scheduler *s, int32_t *handles, int max);
TS_API int ts_tenant_state(const ts_scheduler *s, int32_t tenant, struct ts_tenant_state *out);
/* The token waits kept, oldest first; returns how many were written (at most max), or
 * TS_ENOENT. */
TS_API int ts_tenant_waits(const ts_scheduler *s, int32_t tenant, double *out, int max);
/* These read the clock `now` and, like Python's, forget history older than the window (and
 * bursts older than burst_history), so they are not const. */
TS_API int ts_tenant_view(ts_scheduler *s, int32_t tenant, double now,
                          struct ts_tenant_view *out);
TS_API double ts_used(ts_scheduler *s, int32_t tenant, double now);   /* NaN: unknown */
/* Charged seconds in [now - window, now], and the charge running since `ongoing_since`
 * (NaN: none) counted once: UsageWindow.usage. NaN for an unknown tenant. */
TS_API double ts_tenant_usage(ts_scheduler *s, int32_t tenant, double now,
                              double ongoing_since);
/* Whether the tenant has credit for a grant now (refills it): TokenScheduler._has_credit.
 * 1, 0 or TS_ENOENT. */
TS_API int ts_has_credit(ts_scheduler *s, int32_t tenant, double now);
/* TS_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif
