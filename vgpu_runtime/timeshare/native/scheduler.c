/* One GPU's token scheduler: policy.py's TokenScheduler, rule for rule and operation for
 * operation (the rules and why: policy.py's docstring and README.md beside it). Every function
 * here is named after the Python method it mirrors; keep them in step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct tenant {
    int32_t handle;
    double share;
    double limit;
    double effective;           /* the scaled share: TokenScheduler._shares */
    double vtime;
    double credit;
    double credit_at;
    double waiting_since;       /* NaN: None */
    double burst_hint;          /* NaN: None */
    double last_release;        /* NaN: None */
    double last_quota;          /* NaN: None */
    uint64_t revocations;
    uint32_t waits_head;
    uint32_t waits_count;
    double waits[TS_WAITS_KEPT];
    struct ts_window usage;
    struct ts_bursts bursts;
};

struct ts_scheduler {
    struct ts_settings cfg;
    double debt;                /* TimeshareSettings.debt */
    double started;
    bool has_holder;
    struct ts_grant holder;
    uint64_t generation;
    uint64_t preemptions;
    int count;
    int32_t order[TS_MAX_TENANTS];   /* handles in the order added: the dict's order */
    struct tenant *tenants[TS_MAX_TENANTS];   /* by handle; NULL: free (allocated by add) */
};

static const double NONE = NAN;

static bool is_none(double x) { return isnan(x); }

static struct tenant *find(ts_scheduler *s, int32_t handle) {
    if (handle < 0 || handle >= TS_MAX_TENANTS)
        return NULL;
    return s->tenants[handle];
}

static int32_t handle_of(const ts_scheduler *s, const struct tenant *t) {
    (void)s;
    return t->handle;
}

#define EACH(s, i, t) \
    for (int i = 0; i < (s)->count; i++) \
        for (struct tenant *t = (s)->tenants[(s)->order[i]]; t; t = NULL)

static bool holds(const ts_scheduler *s, int32_t handle) {
    return s->has_holder && s->holder.tenant == handle;
}

static bool waiting(const struct tenant *t) { return !is_none(t->waiting_since); }

/* ---- settings ---- */

static double credit_floor(const ts_scheduler *s, double limit) {
    return -py_max(limit * s->debt, s->cfg.revoke_grace + s->cfg.min_quota);
}

static double capacity(const ts_scheduler *s, const struct tenant *t) {
    return py_max(t->limit * s->cfg.cycle, s->cfg.min_quota);
}

static double least_grant(const ts_scheduler *s, const struct tenant *t) {
    return py_min(s->cfg.min_quota / 4, capacity(s, t));
}

/* ---- internals ---- */

static void refill(const ts_scheduler *s, struct tenant *t, double now) {
    if (now > t->credit_at) {
        t->credit = py_min(capacity(s, t), t->credit + t->limit * (now - t->credit_at));
        t->credit_at = now;
    }
}

static bool has_credit(const ts_scheduler *s, struct tenant *t, double now) {
    if (t->limit >= 1.0)
        return true;
    refill(s, t, now);
    return t->credit >= least_grant(s, t);
}

/* _floor: false for None. exclude: -1 for None. */
static bool floor_of(ts_scheduler *s, int32_t exclude, bool idle_too, double *out) {
    bool any = false;
    double least = 0.0;
    EACH(s, i, t) {
        int32_t h = handle_of(s, t);
        if (h == exclude || !(waiting(t) || holds(s, h)))
            continue;
        if (!any || t->vtime < least)
            least = t->vtime;
        any = true;
    }
    if (any) {
        *out = least;
        return true;
    }
    if (!idle_too)
        return false;
    bool seen = false;
    double most = 0.0;   /* default=0.0 */
    EACH(s, i, t) {
        if (handle_of(s, t) == exclude)
            continue;
        if (!seen || t->vtime > most)
            most = t->vtime;
        seen = true;
    }
    *out = most;
    return true;
}

static void bound_lead(ts_scheduler *s, struct tenant *t, bool has_floor, double floor) {
    if (has_floor)
        t->vtime = py_min(t->vtime, floor + s->debt / t->effective);
}

static void charge(ts_scheduler *s, struct tenant *t, double start, double end) {
    double added = ts_window_charge(&t->usage, start, end);
    if (added <= 0)
        return;
    t->vtime += added / t->effective;
    refill(s, t, end);
    t->credit = py_max(t->credit - added, credit_floor(s, t->limit));
    double floor;
    bool has = floor_of(s, handle_of(s, t), false, &floor);
    bound_lead(s, t, has, floor);
}

static void charge_overuse(ts_scheduler *s, struct tenant *t, double work_end, double now,
                           double since) {
    since = !is_none(since) ? since : t->last_release;
    if (is_none(work_end) || is_none(since) || work_end <= since)
        return;
    charge(s, t, since, py_min(work_end, now));
}

static void charge_work(ts_scheduler *s, struct tenant *t, double now, double work_end,
                        bool work_running, double work_since) {
    if (work_running) {
        if (!is_none(work_since))
            charge(s, t, work_since, now);
    } else {
        charge_overuse(s, t, work_end, now, work_since);
    }
}

static void end_grant(ts_scheduler *s, double now) {
    struct tenant *t = s->tenants[s->holder.tenant];
    charge(s, t, s->holder.granted_at, py_max(now, s->holder.granted_at));
    t->last_release = now;
    s->has_holder = false;
}

static void preempt_for(ts_scheduler *s, struct tenant *waiter, double now) {
    struct ts_grant *grant = &s->holder;
    if (s->cfg.preempt_after <= 0 || !s->has_holder || grant->tenant == handle_of(s, waiter)
            || !waiting(waiter) || waiter->waiting_since <= grant->granted_at
            || !has_credit(s, waiter, now))
        return;
    struct tenant *holder = s->tenants[grant->tenant];
    double running = holder->vtime + (now - grant->granted_at) / holder->effective;
    if (waiter->vtime >= running)
        return;
    double expires = py_max(now, grant->granted_at + s->cfg.preempt_after);
    if (expires < grant->granted_at + grant->quota) {
        grant->quota = expires - grant->granted_at;
        s->preemptions++;
    }
}

static void rescale(ts_scheduler *s) {
    double total = 0.0;
    EACH(s, i, t) total += t->share;
    double scale = total > 1.0 ? 1.0 / total : 1.0;
    EACH(s, i, t) t->effective = t->share * scale;
}

static double lag(ts_scheduler *s, const struct tenant *tenant) {
    bool any = false;
    double ahead = tenant->vtime;
    EACH(s, i, t) {
        if (!waiting(t))
            continue;
        if (!any || t->vtime > ahead)
            ahead = t->vtime;
        any = true;
    }
    return py_max(0.0, ahead - tenant->vtime) * tenant->effective;
}

static double eligible_at(ts_scheduler *s, struct tenant *t, double now) {
    if (has_credit(s, t, now))
        return now;
    return now + (least_grant(s, t) - t->credit) / t->limit + 1e-9;
}

/* Python's (vtime, waiting_since or 0.0) < (vtime, waiting_since or 0.0). */
static bool served_before(const struct tenant *a, const struct tenant *b) {
    if (a->vtime != b->vtime)
        return a->vtime < b->vtime;
    double wa = or_zero(a->waiting_since), wb = or_zero(b->waiting_since);
    return wa != wb && wa < wb;
}

static struct tenant *choose(ts_scheduler *s, double now) {
    bool eligible[TS_MAX_TENANTS] = {false};
    bool any = false;
    double floor = 0.0;
    EACH(s, i, t) {
        if (waiting(t) && has_credit(s, t, now)) {
            eligible[i] = true;
            if (!any || t->vtime < floor)
                floor = t->vtime;
            any = true;
        }
    }
    if (!any)
        return NULL;
    EACH(s, i, t) {
        if (waiting(t) && !eligible[i])
            t->vtime = py_max(t->vtime, floor);   /* waiting at its limit banks nothing */
    }
    double active;
    bool has_active = floor_of(s, -1, false, &active);
    struct tenant *chosen = NULL;
    EACH(s, i, t) {
        if (eligible[i])
            bound_lead(s, t, has_active, active);
    }
    EACH(s, i, t) {
        if (eligible[i] && (chosen == NULL || served_before(t, chosen)))
            chosen = t;
    }
    return chosen;
}

static double quota_for(ts_scheduler *s, struct tenant *t, double now) {
    const struct ts_settings *cfg = &s->cfg;
    double quota;
    if (s->count == 1) {
        quota = cfg->max_quota;
    } else {
        double total = 0.0;
        EACH(s, i, other) total += other->effective;
        double part = t->effective / total;
        quota = part * cfg->cycle + lag(s, t) * cfg->catch_up;
        double burst = !is_none(t->burst_hint) ? t->burst_hint
                                               : ts_bursts_estimate(&t->bursts, now);
        if (!is_none(burst) && burst < cfg->max_quota)
            quota = py_max(quota, burst);
        quota = py_min(py_max(quota, cfg->min_quota), cfg->max_quota);
    }
    if (t->limit < 1.0)
        quota = py_min(quota, py_max(t->credit, least_grant(s, t)));
    return quota;
}

static int dispatch(ts_scheduler *s, double now, struct ts_grant *granted) {
    if (s->has_holder)
        return TS_OK;
    struct tenant *chosen = choose(s, now);
    if (chosen == NULL)
        return TS_OK;
    s->generation++;
    double quota = quota_for(s, chosen, now);
    s->holder = (struct ts_grant){handle_of(s, chosen), s->generation, now, quota};
    s->has_holder = true;
    chosen->last_quota = quota;
    if (waiting(chosen)) {
        if (chosen->waits_count == TS_WAITS_KEPT) {   /* deque(maxlen): the oldest goes */
            chosen->waits_head = (chosen->waits_head + 1) % TS_WAITS_KEPT;
            chosen->waits_count--;
        }
        chosen->waits[(chosen->waits_head + chosen->waits_count) % TS_WAITS_KEPT] =
            now - chosen->waiting_since;
        chosen->waits_count++;
    }
    chosen->waiting_since = NONE;
    if (granted)
        *granted = s->holder;
    return TS_GRANTED;
}

/* ---- the API ---- */

TS_API ts_scheduler *ts_create(const struct ts_settings *settings, double now) {
    if (settings == NULL)
        return NULL;
    ts_scheduler *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->cfg = *settings;
    s->debt = settings->cycle + settings->max_quota + settings->revoke_grace;
    s->started = now;
    return s;
}

TS_API void ts_destroy(ts_scheduler *s) {
    if (s == NULL)
        return;
    for (int i = 0; i < TS_MAX_TENANTS; i++)
        free(s->tenants[i]);
    free(s);
}

TS_API int ts_add(ts_scheduler *s, double share, double limit, double now, int32_t *tenant,
                  struct ts_grant *granted) {
    if (!(0 < share && share <= 1) || !(share <= limit && limit <= 1))
        return TS_EINVAL;
    if (s->count >= TS_MAX_TENANTS)
        return TS_EFULL;
    int32_t handle = 0;
    while (s->tenants[handle] != NULL)
        handle++;
    double vtime;
    floor_of(s, -1, true, &vtime);
    /* Each tenant's histories are allocated when it joins (about 100 KiB), never on the token
     * path; calloc'd pages a tenant never fills stay untouched. */
    struct tenant *t = calloc(1, sizeof *t);
    if (t == NULL)
        return TS_ENOMEM;
    s->tenants[handle] = t;
    t->handle = handle;
    t->share = share;
    t->limit = limit;
    t->effective = share;
    t->vtime = or_zero(vtime);
    t->credit = 0.0;
    t->credit_at = now;
    t->waiting_since = NONE;
    t->burst_hint = NONE;
    t->last_release = NONE;
    t->last_quota = NONE;
    t->revocations = 0;
    t->waits_head = 0;
    t->waits_count = 0;
    ts_window_init(&t->usage, s->cfg.window);
    ts_bursts_init(&t->bursts, s->cfg.burst_merge_gap, s->cfg.burst_history, 0.9);
    s->order[s->count++] = handle;
    t->credit = capacity(s, t);
    rescale(s);
    if (tenant)
        *tenant = handle;
    return dispatch(s, now, granted);
}

TS_API int ts_remove(ts_scheduler *s, int32_t tenant, double now, struct ts_grant *granted) {
    struct tenant *t = find(s, tenant);
    if (t != NULL) {
        if (holds(s, tenant))
            end_grant(s, now);
        s->tenants[tenant] = NULL;
        free(t);
        int at = 0;
        while (s->order[at] != tenant)
            at++;
        memmove(&s->order[at], &s->order[at + 1],
                sizeof s->order[0] * (size_t)(s->count - at - 1));
        s->count--;
    }
    rescale(s);
    return dispatch(s, now, granted);
}

TS_API int ts_set_limit(ts_scheduler *s, int32_t tenant, double limit, double now,
                        struct ts_grant *granted) {
    struct tenant *t = find(s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    if (!(0 < limit && limit <= 1))
        return TS_EINVAL;
    refill(s, t, now);   /* what it earned so far, at the old rate */
    t->limit = py_max(limit, t->share);
    t->credit = py_min(py_max(t->credit, credit_floor(s, t->limit)), capacity(s, t));
    return dispatch(s, now, granted);
}

TS_API bool ts_needs_token(const ts_scheduler *s) {
    return !(s->count == 1 && s->tenants[s->order[0]]->share >= 1.0);
}

TS_API int ts_request(ts_scheduler *s, int32_t tenant, double now, double burst_hint,
                      double work_end, bool work_running, double work_since,
                      struct ts_grant *granted) {
    struct tenant *t = find(s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    t->burst_hint = !is_none(burst_hint) && burst_hint > 0 ? burst_hint : NONE;
    bool was_active = waiting(t);
    if (holds(s, tenant)) {
        if (now < s->holder.granted_at + s->holder.quota) {
            charge_work(s, t, now, work_end, work_running, work_since);
            return TS_OK;
        }
        end_grant(s, now);
        was_active = true;
    }
    charge_work(s, t, now, work_end, work_running, work_since);
    if (!was_active) {
        double floor;
        floor_of(s, tenant, true, &floor);
        t->vtime = py_max(t->vtime, or_zero(floor));
    }
    double floor;
    bool has = floor_of(s, tenant, false, &floor);
    bound_lead(s, t, has, floor);
    if (!waiting(t))
        t->waiting_since = now;
    preempt_for(s, t, now);
    return dispatch(s, now, granted);
}

TS_API int ts_release(ts_scheduler *s, int32_t tenant, double now, double work_end,
                      struct ts_grant *granted) {
    struct tenant *t = find(s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    if (holds(s, tenant))
        end_grant(s, now);
    charge_overuse(s, t, work_end, now, NONE);
    return dispatch(s, now, granted);
}

TS_API int ts_observe_burst(ts_scheduler *s, int32_t tenant, double start, double end) {
    struct tenant *t = find(s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    ts_bursts_observe(&t->bursts, start, end);
    return TS_OK;
}

TS_API int ts_tick(ts_scheduler *s, double now, struct ts_grant *granted) {
    if (s->has_holder
            && now >= s->holder.granted_at + s->holder.quota + s->cfg.revoke_grace) {
        s->tenants[s->holder.tenant]->revocations++;
        end_grant(s, now);
    }
    return dispatch(s, now, granted);
}

TS_API double ts_next_deadline(ts_scheduler *s, double now) {
    if (s->has_holder)
        return s->holder.granted_at + s->holder.quota + s->cfg.revoke_grace;
    bool any = false;
    double soonest = NONE;
    EACH(s, i, t) {
        if (!waiting(t))
            continue;
        double at = eligible_at(s, t, now);
        if (!any || at < soonest)
            soonest = at;
        any = true;
    }
    return soonest;
}

/* ---- read-outs ---- */

TS_API bool ts_holder(const ts_scheduler *s, struct ts_grant *holder) {
    if (s->has_holder && holder)
        *holder = s->holder;
    return s->has_holder;
}

TS_API uint64_t ts_generation(const ts_scheduler *s) { return s->generation; }

TS_API uint64_t ts_preemptions(const ts_scheduler *s) { return s->preemptions; }

TS_API int ts_tenants(const ts_scheduler *s, int32_t *handles, int max) {
    int n = s->count < max ? s->count : max;
    for (int i = 0; i < n; i++)
        handles[i] = s->order[i];
    return n;
}

TS_API int ts_tenant_state(const ts_scheduler *s, int32_t tenant, struct ts_tenant_state *out) {
    struct tenant *t = find((ts_scheduler *)s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    *out = (struct ts_tenant_state){
        .share = t->share, .effective_share = t->effective, .limit = t->limit,
        .vtime = t->vtime, .credit = t->credit, .credit_at = t->credit_at,
        .waiting_since = t->waiting_since, .burst_hint = t->burst_hint,
        .last_release = t->last_release, .last_quota = t->last_quota,
        .revocations = t->revocations, .waits = t->waits_count, .waiting = waiting(t),
        .holder = holds(s, tenant)};
    return TS_OK;
}

TS_API int ts_tenant_waits(const ts_scheduler *s, int32_t tenant, double *out, int max) {
    struct tenant *t = find((ts_scheduler *)s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    int n = (int)t->waits_count < max ? (int)t->waits_count : max;
    for (int i = 0; i < n; i++)
        out[i] = t->waits[(t->waits_head + (uint32_t)i) % TS_WAITS_KEPT];
    return n;
}

TS_API double ts_used(ts_scheduler *s, int32_t tenant, double now) {
    struct tenant *t = find(s, tenant);
    if (t == NULL)
        return NONE;
    double span = py_min(s->cfg.window, now - s->started);
    if (span <= 0)
        return 0.0;
    double running = holds(s, tenant) ? s->holder.granted_at : NONE;
    return ts_window_usage(&t->usage, now, running) / span;
}

TS_API double ts_tenant_usage(ts_scheduler *s, int32_t tenant, double now,
                              double ongoing_since) {
    struct tenant *t = find(s, tenant);
    return t == NULL ? NONE : ts_window_usage(&t->usage, now, ongoing_since);
}

TS_API int ts_has_credit(ts_scheduler *s, int32_t tenant, double now) {
    struct tenant *t = find(s, tenant);
    return t == NULL ? TS_ENOENT : has_credit(s, t, now);
}

TS_API int ts_tenant_view(ts_scheduler *s, int32_t tenant, double now,
                          struct ts_tenant_view *out) {
    struct tenant *t = find(s, tenant);
    if (t == NULL)
        return TS_ENOENT;
    double waits[TS_WAITS_KEPT];
    int n = ts_tenant_waits(s, tenant, waits, TS_WAITS_KEPT);
    ts_sort(waits, (size_t)n);
    double p50 = NONE, p99 = NONE;
    if (n > 0) {
        /* statistics.median, and waits[min(n - 1, int(0.99 * n))] */
        p50 = n % 2 == 1 ? waits[n / 2] : (waits[n / 2 - 1] + waits[n / 2]) / 2;
        int at = (int)(0.99 * n);
        p99 = waits[at < n - 1 ? at : n - 1];
    }
    double used = ts_used(s, tenant, now);
    double burst = !is_none(t->burst_hint) ? t->burst_hint : ts_bursts_estimate(&t->bursts, now);
    *out = (struct ts_tenant_view){
        .share = t->effective, .limit = t->limit, .used = used, .wait_p50 = p50,
        .wait_p99 = p99, .burst = burst, .last_quota = t->last_quota,
        .revocations = t->revocations, .waiting = waiting(t), .holder = holds(s, tenant)};
    return TS_OK;
}
