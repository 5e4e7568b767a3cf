/* GpuTokens in C (tokens.h); each function names the tokens.py method it follows. */
#include "tokens.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gemini_wire.h"

#define NS 1000000000.0

static const double WAIT_BOUNDS[TD_WAIT_BUCKETS] = {
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0};

struct conn {
    int32_t slot;               /* -1: unbound */
    int32_t prev, next;         /* the slot's waiting list, in the order they came */
    uint32_t seq;
    bool waiting;
    bool asked;                 /* slot.asks holds it */
    bool running;               /* Ask.running */
    double release_before;      /* Ask.release_before; NaN: None */
    uint64_t granted_epoch;     /* in slot.granted while equal to the slot's epoch */
};

struct slot {
    bool used;
    int32_t tenant;             /* -1: detached */
    uint32_t index;
    struct gm_token_page *page;
    struct gm_activity_page *activity;
    int32_t first, last;        /* waiting connections */
    uint32_t waiting;
    double wait_started;        /* NaN: None */
    double last_pageless_ask;
    uint64_t grant_epoch;       /* starts at 1: a connection's 0 is in no grant */
    uint64_t wait_counts[TD_WAIT_BUCKETS + 1];
    double wait_sum;
    uint64_t wait_count;
};

struct td_gpu {
    ts_scheduler *scheduler;
    double idle_release;
    double timer_resolution;
    double max_quota;
    struct slot slots[TD_MAX_SLOTS];
    int32_t slot_of_tenant[TS_MAX_TENANTS];
    int32_t attached[TS_MAX_TENANTS];   /* the attached slots, in no order */
    int32_t attached_count;
    struct conn conns[TD_MAX_CONNECTIONS];
    bool published_valid;
    struct ts_grant published;
    double deadline_fires;      /* INFINITY: no deadline timer */
    double idle_fires;          /* INFINITY: no idle check */
    double idle_backoff;
    uint64_t grants;
    uint64_t idle_releases;
    int32_t gate;               /* -1: None */
    bool debug_events;          /* report TD_EVENT_GRANTED and TD_EVENT_IDLE_RELEASE */
};

/* ---- helpers: Python's numbers ---- */

static double timer_delay(const td_gpu *gpu, double delay) {
    double resolution = gpu->timer_resolution;
    if (!(resolution > 0))
        return delay > 0 ? delay : 0;   /* exact: the timerfd fires at the time itself */
    double ticks = ceil(delay / resolution - 1e-6);
    return (ticks > 1.0 ? ticks : 1.0) * resolution;
}

static int64_t to_ns(double seconds) {
    return (int64_t)llrint(seconds * NS);   /* round(): half to even, the default mode */
}

/* from_ns: NaN for a negative (unknown) value. int / int in Python is correctly rounded; the
 * long double quotient rounded again to double equals it but in rare double-rounding cases
 * (values past 2^53 ns, 104 days of uptime, and then by one ulp). */
static double from_ns(int64_t value) {
    if (value < 0)
        return NAN;
    if (value < (INT64_C(1) << 53))
        return (double)value / NS;
    return (double)((long double)value / 1000000000.0L);
}

static double expires_at(const struct ts_grant *g) {
    return g->granted_at + g->quota;
}

static bool grant_equal(const struct ts_grant *a, const struct ts_grant *b) {
    return a->tenant == b->tenant && a->generation == b->generation &&
           a->granted_at == b->granted_at && a->quota == b->quota;
}

/* ---- pages: the order pages.py writes them in ---- */

static void page_grant(struct gm_token_page *page, uint64_t generation, int64_t valid_until) {
    __atomic_store_n(&page->generation, generation, __ATOMIC_RELAXED);
    /* last: the fast path reads only this; release keeps every earlier store before it */
    __atomic_store_n(&page->valid_until_ns, valid_until, __ATOMIC_RELEASE);
}

static void page_clear(struct gm_token_page *page) {
    __atomic_store_n(&page->valid_until_ns, 0, __ATOMIC_RELEASE);
}

/* ---- out ---- */

static void out_reset(struct td_out *out) {
    out->grants = 0;
    out->events = 0;
    out->wakeup = NAN;
}

static void send_grant(struct td_out *out, int32_t connection, uint32_t seq, uint32_t index,
                       uint64_t generation, int64_t valid_until) {
    if (out->grants >= TD_MAX_GRANTS_OUT)
        abort();   /* cannot happen: at most two hand-overs of TD_MAX_CONNECTIONS each */
    out->grant[out->grants++] = (struct td_grant_out){
        .connection = connection, .seq = seq, .gpu_index = index, .generation = generation,
        .valid_until_ns = valid_until};
}

static void event(struct td_out *out, int32_t kind, int32_t slot, uint64_t generation,
                  double value) {
    if (out->events >= TD_MAX_EVENTS)
        abort();   /* cannot happen: at most four per call */
    out->event[out->events++] = (struct td_event){kind, slot, generation, value};
}

static double next_wakeup(const td_gpu *gpu) {
    double at = gpu->deadline_fires < gpu->idle_fires ? gpu->deadline_fires : gpu->idle_fires;
    return isinf(at) ? NAN : at;
}

static int finish(td_gpu *gpu, struct td_out *out) {
    out->wakeup = next_wakeup(gpu);
    return out->grants | out->events << TD_EVENTS_SHIFT;
}

/* ---- lookups ---- */

static struct slot *attached(td_gpu *gpu, int32_t slot) {
    if (slot < 0 || slot >= TD_MAX_SLOTS || !gpu->slots[slot].used ||
        gpu->slots[slot].tenant < 0)
        return NULL;
    return &gpu->slots[slot];
}

static struct ts_tenant_state tenant_state(td_gpu *gpu, int32_t tenant) {
    struct ts_tenant_state state;
    ts_tenant_state(gpu->scheduler, tenant, &state);
    return state;
}

/* ---- the waiting list ---- */

static void waiter_add(td_gpu *gpu, struct slot *s, int32_t c, uint32_t seq) {
    struct conn *conn = &gpu->conns[c];
    conn->seq = seq;   /* slot.waiters[waiter] = seq: a waiter keeps its place */
    if (conn->waiting)
        return;
    conn->waiting = true;
    conn->prev = s->last;
    conn->next = -1;
    if (s->last >= 0)
        gpu->conns[s->last].next = c;
    else
        s->first = c;
    s->last = c;
    s->waiting++;
}

static void waiter_pop(td_gpu *gpu, struct slot *s, int32_t c) {
    struct conn *conn = &gpu->conns[c];
    if (!conn->waiting)
        return;
    if (conn->prev >= 0)
        gpu->conns[conn->prev].next = conn->next;
    else
        s->first = conn->next;
    if (conn->next >= 0)
        gpu->conns[conn->next].prev = conn->prev;
    else
        s->last = conn->prev;
    conn->waiting = false;
    conn->prev = conn->next = -1;
    s->waiting--;
}

static void unbind(td_gpu *gpu, struct slot *s, int32_t c) {
    waiter_pop(gpu, s, c);
    struct conn *conn = &gpu->conns[c];
    conn->slot = -1;
    conn->asked = false;
    conn->running = false;
    conn->release_before = NAN;
    conn->granted_epoch = 0;
}

static void wait_observe(struct slot *s, double seconds) {
    int i = 0;
    while (i < TD_WAIT_BUCKETS && WAIT_BOUNDS[i] < seconds)   /* bisect_left */
        i++;
    s->wait_counts[i]++;
    s->wait_sum += seconds;
    s->wait_count++;
}

/* ---- timers ---- */

static void cancel_idle_check(td_gpu *gpu) {
    gpu->idle_fires = INFINITY;
}

/* _arm_deadline */
static void arm_deadline(td_gpu *gpu, double now) {
    double deadline = ts_next_deadline(gpu->scheduler, now);
    if (!isinf(gpu->deadline_fires)) {
        if (!isnan(deadline) && gpu->deadline_fires <= deadline)
            return;
        gpu->deadline_fires = INFINITY;
    }
    if (!isnan(deadline))
        gpu->deadline_fires = now + timer_delay(gpu, deadline - now);
}

/* _someone_else_waits */
static bool someone_else_waits(td_gpu *gpu, int32_t holder) {
    for (int32_t i = 0; i < gpu->attached_count; i++) {
        int32_t t = gpu->slots[gpu->attached[i]].tenant;
        if (t != holder && !isnan(tenant_state(gpu, t).waiting_since))
            return true;
    }
    return false;
}

struct idle_reference {
    double reference, last_launch, last_sync;
};

/* _idle_reference */
static struct idle_reference idle_reference(td_gpu *gpu, const struct ts_grant *holder) {
    struct slot *s = &gpu->slots[gpu->slot_of_tenant[holder->tenant]];
    double launch = from_ns(__atomic_load_n(&s->activity->last_launch_ns, __ATOMIC_RELAXED));
    double sync = from_ns(__atomic_load_n(&s->activity->last_sync_ns, __ATOMIC_RELAXED));
    double last_launch = isnan(launch) ? -INFINITY : launch;
    if (s->last_pageless_ask > last_launch)
        last_launch = s->last_pageless_ask;
    double last_sync = isnan(sync) ? -INFINITY : sync;
    double reference = holder->granted_at > last_launch ? holder->granted_at : last_launch;
    return (struct idle_reference){reference, last_launch, last_sync};
}

/* _arm_idle_check; at: NaN for None */
static void arm_idle_check(td_gpu *gpu, double now, double at) {
    struct ts_grant holder;
    if (!ts_holder(gpu->scheduler, &holder) || !someone_else_waits(gpu, holder.tenant)) {
        cancel_idle_check(gpu);
        return;
    }
    if (!isinf(gpu->idle_fires) && isnan(at))
        return;   /* one check is pending already */
    if (isnan(at))
        at = idle_reference(gpu, &holder).reference + gpu->idle_release;
    if (at >= expires_at(&holder)) {
        cancel_idle_check(gpu);   /* the quota ends first; the deadline timer handles it */
        return;
    }
    gpu->idle_fires = now + timer_delay(gpu, at - now);
}

/* ---- keeping pages and connections in line with the scheduler ---- */

/* _update_gates */
static void update_gates(td_gpu *gpu) {
    int32_t gate = ts_needs_token(gpu->scheduler) ? GM_GATE_TOKEN : GM_GATE_OPEN;
    if (gate == gpu->gate)
        return;
    for (int32_t i = 0; i < gpu->attached_count; i++) {
        struct slot *s = &gpu->slots[gpu->attached[i]];
        if (__atomic_load_n(&s->page->gate, __ATOMIC_RELAXED) != (uint32_t)gate)
            __atomic_store_n(&s->page->gate, (uint32_t)gate, __ATOMIC_RELAXED);
    }
    gpu->gate = gate;
}

/* _hand_over */
static void hand_over(td_gpu *gpu, const struct ts_grant *grant, int32_t slot, double now,
                      struct td_out *out) {
    struct slot *s = &gpu->slots[slot];
    int64_t valid_until = to_ns(expires_at(grant));
    page_grant(s->page, grant->generation, valid_until);
    gpu->published = *grant;
    gpu->published_valid = true;
    gpu->grants++;
    gpu->idle_backoff = gpu->idle_release;
    cancel_idle_check(gpu);   /* a pending check was about the previous holder */
    s->grant_epoch++;
    if (!isnan(s->wait_started)) {
        double waited = now - s->wait_started;
        wait_observe(s, 0.0 > waited ? 0.0 : waited);   /* max(0.0, waited) */
        s->wait_started = NAN;
    }
    int32_t c = s->first;
    s->first = s->last = -1;
    s->waiting = 0;
    while (c >= 0) {
        struct conn *conn = &gpu->conns[c];
        int32_t next = conn->next;
        conn->waiting = false;
        conn->prev = conn->next = -1;
        conn->granted_epoch = s->grant_epoch;
        send_grant(out, c, conn->seq, s->index, grant->generation, valid_until);
        c = next;
    }
    if (gpu->debug_events)
        event(out, TD_EVENT_GRANTED, slot, grant->generation, grant->quota);
}

/* _publish */
static void publish(td_gpu *gpu, double now, struct td_out *out) {
    for (;;) {
        struct ts_grant holder;
        bool held = ts_holder(gpu->scheduler, &holder);
        if (gpu->published_valid && (!held || holder.generation != gpu->published.generation)) {
            int32_t old = gpu->slot_of_tenant[gpu->published.tenant];
            if (old >= 0)
                page_clear(gpu->slots[old].page);
            gpu->published_valid = false;
        } else if (gpu->published_valid && held && !grant_equal(&holder, &gpu->published)) {
            /* Same grant, cut short (a waking tenant preempts): the holder's next launch
             * reads the new end from its page and asks again. */
            struct slot *s = &gpu->slots[gpu->slot_of_tenant[holder.tenant]];
            page_grant(s->page, holder.generation, to_ns(expires_at(&holder)));
            gpu->published = holder;
        }
        if (!held || gpu->published_valid)
            break;
        int32_t slot = gpu->slot_of_tenant[holder.tenant];
        if (gpu->slots[slot].waiting == 0) {
            /* Granted to a tenant whose waiting connections all left: pass it on. */
            ts_release(gpu->scheduler, holder.tenant, now, NAN, NULL);
            continue;
        }
        hand_over(gpu, &holder, slot, now, out);
    }
    update_gates(gpu);
    arm_deadline(gpu, now);
    arm_idle_check(gpu, now, NAN);
}

/* ---- the API ---- */

td_gpu *td_create(const struct td_settings *settings, ts_scheduler *scheduler) {
    if (scheduler == NULL)
        return NULL;
    td_gpu *gpu = calloc(1, sizeof *gpu);
    if (gpu == NULL)
        return NULL;
    gpu->scheduler = scheduler;
    gpu->idle_release = settings->idle_release;
    gpu->timer_resolution = settings->timer_resolution;
    gpu->max_quota = settings->max_quota;
    for (int32_t t = 0; t < TS_MAX_TENANTS; t++)
        gpu->slot_of_tenant[t] = -1;
    for (int32_t c = 0; c < TD_MAX_CONNECTIONS; c++)
        gpu->conns[c] = (struct conn){.slot = -1, .prev = -1, .next = -1,
                                      .release_before = NAN};
    gpu->deadline_fires = INFINITY;
    gpu->idle_fires = INFINITY;
    gpu->idle_backoff = settings->idle_release;
    gpu->gate = -1;
    return gpu;
}

void td_destroy(td_gpu *gpu) {
    free(gpu);
}

const double *td_wait_bounds(void) {
    return WAIT_BOUNDS;
}

int td_slot_new(td_gpu *gpu, uint32_t gpu_index, void *token_page, void *activity_page,
                int32_t *slot) {
    if (token_page == NULL || activity_page == NULL)
        return TD_EINVAL;
    for (int32_t i = 0; i < TD_MAX_SLOTS; i++) {
        struct slot *s = &gpu->slots[i];
        if (s->used)
            continue;
        *s = (struct slot){.used = true, .tenant = -1, .index = gpu_index, .page = token_page,
                           .activity = activity_page, .first = -1, .last = -1,
                           .wait_started = NAN, .last_pageless_ask = -INFINITY,
                           .grant_epoch = 1};
        *slot = i;
        return TD_OK;
    }
    return TD_EFULL;
}

int td_slot_free(td_gpu *gpu, int32_t slot) {
    if (slot < 0 || slot >= TD_MAX_SLOTS || !gpu->slots[slot].used)
        return TD_ENOENT;
    struct slot *s = &gpu->slots[slot];
    if (s->tenant >= 0)
        return TD_EINVAL;
    for (int32_t c = 0; c < TD_MAX_CONNECTIONS; c++)
        if (gpu->conns[c].slot == slot)
            unbind(gpu, s, c);
    s->used = false;
    return TD_OK;
}

int td_slot_info(const td_gpu *gpu, int32_t slot, struct td_slot_info *out) {
    if (slot < 0 || slot >= TD_MAX_SLOTS || !gpu->slots[slot].used)
        return TD_ENOENT;
    const struct slot *s = &gpu->slots[slot];
    memset(out, 0, sizeof *out);
    out->tenant = s->tenant;
    out->gpu_index = s->index;
    out->connections_waiting = s->waiting;
    out->wait_started = s->wait_started;
    out->last_pageless_ask = s->last_pageless_ask;
    memcpy(out->wait_counts, s->wait_counts, sizeof s->wait_counts);
    out->wait_sum = s->wait_sum;
    out->wait_count = s->wait_count;
    return TD_OK;
}

int32_t td_connection_slot(const td_gpu *gpu, int32_t connection) {
    if (connection < 0 || connection >= TD_MAX_CONNECTIONS)
        return -1;
    return gpu->conns[connection].slot;
}

/* add, after the caller's ts_add gave the tenant its handle */
int td_attach(td_gpu *gpu, int32_t slot, int32_t tenant, double now, struct td_out *out) {
    out_reset(out);
    if (slot < 0 || slot >= TD_MAX_SLOTS || !gpu->slots[slot].used)
        return TD_ENOENT;
    struct slot *s = &gpu->slots[slot];
    if (s->tenant >= 0 || tenant < 0 || tenant >= TS_MAX_TENANTS ||
        gpu->slot_of_tenant[tenant] >= 0)
        return TD_EINVAL;
    struct ts_tenant_state state;
    if (ts_tenant_state(gpu->scheduler, tenant, &state) != TS_OK)
        return TD_ENOENT;
    s->tenant = tenant;
    gpu->slot_of_tenant[tenant] = slot;
    gpu->attached[gpu->attached_count++] = slot;
    gpu->gate = -1;
    publish(gpu, now, out);
    return finish(gpu, out);
}

/* remove, before the caller's ts_remove: the page is cleared first */
int td_detach(td_gpu *gpu, int32_t slot) {
    struct slot *s = attached(gpu, slot);
    if (s == NULL)
        return TD_ENOENT;
    page_clear(s->page);
    int32_t tenant = s->tenant;
    s->tenant = -1;
    gpu->slot_of_tenant[tenant] = -1;
    for (int32_t i = 0; i < gpu->attached_count; i++)
        if (gpu->attached[i] == slot) {
            gpu->attached[i] = gpu->attached[--gpu->attached_count];
            break;
        }
    if (gpu->published_valid && gpu->published.tenant == tenant)
        gpu->published_valid = false;
    return TD_OK;
}

/* remove, after ts_remove */
int td_publish(td_gpu *gpu, double now, struct td_out *out) {
    out_reset(out);
    publish(gpu, now, out);
    return finish(gpu, out);
}

/* set_limit */
int td_set_limit(td_gpu *gpu, int32_t slot, double limit, double now, struct td_out *out) {
    out_reset(out);
    struct slot *s = attached(gpu, slot);
    if (s == NULL)
        return TD_ENOENT;
    if (tenant_state(gpu, s->tenant).limit != limit) {
        if (ts_set_limit(gpu->scheduler, s->tenant, limit, now, NULL) < 0)
            return TD_EINVAL;
        publish(gpu, now, out);
    }
    return finish(gpu, out);
}

/* request */
int td_request(td_gpu *gpu, int32_t connection, bool has_activity_page, int32_t slot,
               uint32_t seq, double burst_hint, double work_end, bool work_running,
               double now, struct td_out *out) {
    out_reset(out);
    struct slot *s = attached(gpu, slot);
    if (s == NULL)
        return TD_ENOENT;
    if (connection < 0 || connection >= TD_MAX_CONNECTIONS)
        return TD_EINVAL;
    struct conn *conn = &gpu->conns[connection];
    if (conn->slot >= 0 && conn->slot != slot)
        return TD_EINVAL;
    conn->slot = slot;
    if (!has_activity_page)
        s->last_pageless_ask = now;
    double since = conn->asked && (work_running || conn->running) ? conn->release_before : NAN;
    struct ts_grant holder;
    bool held = ts_holder(gpu->scheduler, &holder);
    bool granted = held && holder.tenant == s->tenant && now < expires_at(&holder);
    if (!granted) {
        waiter_add(gpu, s, connection, seq);
        if (isnan(s->wait_started))
            s->wait_started = now;
    } else if (conn->granted_epoch == s->grant_epoch && isnan(since)) {
        /* Asking during the grant it was sent itself (a hook never does; a client that asks
         * ahead may): its work end is of this grant, which is charged when it ends. */
        work_end = NAN;
    }
    /* With the tenant's grant still valid this only charges: another process's work launched
     * before that grant, running past the release before it. */
    ts_request(gpu->scheduler, s->tenant, now, burst_hint, work_end, work_running, since, NULL);
    conn->asked = true;
    conn->release_before = tenant_state(gpu, s->tenant).last_release;
    conn->running = work_running;
    if (granted) {
        send_grant(out, connection, seq, s->index, holder.generation,
                   to_ns(expires_at(&holder)));
        return finish(gpu, out);
    }
    publish(gpu, now, out);
    return finish(gpu, out);
}

/* release */
int td_release(td_gpu *gpu, int32_t slot, double work_end, double now, struct td_out *out) {
    out_reset(out);
    struct slot *s = attached(gpu, slot);
    if (s == NULL)
        return TD_ENOENT;
    ts_release(gpu->scheduler, s->tenant, now, work_end, NULL);
    publish(gpu, now, out);
    return finish(gpu, out);
}

/* observe_burst */
int td_observe_burst(td_gpu *gpu, int32_t slot, double start, double end, double now) {
    struct slot *s = attached(gpu, slot);
    if (s == NULL)
        return TD_ENOENT;
    /* A burst cannot end after now: a claimed future end would stretch quotas and stay in
     * the history; clamped, a burst wholly in the future ends before it starts and is dropped. */
    ts_observe_burst(gpu->scheduler, s->tenant, start, now < end ? now : end);
    return TD_OK;
}

/* connection_closed */
int td_connection_closed(td_gpu *gpu, int32_t connection, int32_t slot, bool last,
                         double now, struct td_out *out) {
    out_reset(out);
    if (connection < -1 || connection >= TD_MAX_CONNECTIONS)
        return TD_EINVAL;
    struct slot *s = attached(gpu, slot);
    if (s == NULL)
        return finish(gpu, out);
    if (connection >= 0 && gpu->conns[connection].slot == slot)
        unbind(gpu, s, connection);
    if (s->waiting == 0)
        s->wait_started = NAN;
    struct ts_grant holder;
    if (last && ts_holder(gpu->scheduler, &holder) && holder.tenant == s->tenant) {
        event(out, TD_EVENT_HOLDER_GONE, slot, holder.generation, 0.0);
        ts_release(gpu->scheduler, s->tenant, now, NAN, NULL);
        publish(gpu, now, out);
    }
    return finish(gpu, out);
}

/* _on_deadline */
static void on_deadline(td_gpu *gpu, double now, struct td_out *out) {
    gpu->deadline_fires = INFINITY;
    struct ts_grant holder;
    bool held = ts_holder(gpu->scheduler, &holder);
    uint64_t revocations = held ? tenant_state(gpu, holder.tenant).revocations : 0;
    ts_tick(gpu->scheduler, now, NULL);
    if (held && tenant_state(gpu, holder.tenant).revocations > revocations)
        event(out, TD_EVENT_REVOKED, gpu->slot_of_tenant[holder.tenant], holder.generation,
              now - expires_at(&holder));
    publish(gpu, now, out);
}

/* _on_idle_check */
static void on_idle_check(td_gpu *gpu, double now, struct td_out *out) {
    gpu->idle_fires = INFINITY;
    struct ts_grant holder;
    if (!ts_holder(gpu->scheduler, &holder) || !someone_else_waits(gpu, holder.tenant))
        return;
    struct idle_reference ref = idle_reference(gpu, &holder);
    if (now - ref.reference < gpu->idle_release) {
        arm_idle_check(gpu, now, ref.reference + gpu->idle_release);   /* launched since */
    } else if (ref.last_sync < ref.last_launch) {
        /* Work in flight (no sync since the last launch): look again later, backing off so
         * that a long kernel costs a few wake-ups (at most one per 16 x idle_release), not a
         * poll loop, and a finished one is still noticed within that. min() as Python's. */
        double backoff = gpu->idle_backoff * 2;
        double cap = 16 * gpu->idle_release;
        if (cap < backoff)
            backoff = cap;
        if (gpu->max_quota < backoff)
            backoff = gpu->max_quota;
        gpu->idle_backoff = backoff;
        arm_idle_check(gpu, now, now + gpu->idle_backoff);
    } else {
        gpu->idle_releases++;
        if (gpu->debug_events)
            event(out, TD_EVENT_IDLE_RELEASE, gpu->slot_of_tenant[holder.tenant], holder.generation,
                  now - holder.granted_at);
        ts_release(gpu->scheduler, holder.tenant, now, NAN, NULL);
        publish(gpu, now, out);
    }
}

double td_next_wakeup(const td_gpu *gpu) {
    return next_wakeup(gpu);
}

int td_on_timer(td_gpu *gpu, double now, struct td_out *out) {
    out_reset(out);
    double due = next_wakeup(gpu);
    if (isnan(due) || due < now)
        due = now;
    /* Each runs at most once a call: a timer re-armed by the other is at least 1 ms on. */
    bool deadline_ran = false, idle_ran = false;
    for (;;) {
        if (!deadline_ran && gpu->deadline_fires <= due &&
            (gpu->deadline_fires <= gpu->idle_fires || idle_ran)) {
            deadline_ran = true;
            on_deadline(gpu, now, out);
        } else if (!idle_ran && gpu->idle_fires <= due) {
            idle_ran = true;
            on_idle_check(gpu, now, out);
        } else {
            break;
        }
    }
    return finish(gpu, out);
}

void td_debug_events(td_gpu *gpu, bool on) {
    gpu->debug_events = on;
}

void td_close(td_gpu *gpu) {
    cancel_idle_check(gpu);
    gpu->deadline_fires = INFINITY;
}

void td_counters(const td_gpu *gpu, struct td_counters *out) {
    out->grants = gpu->grants;
    out->idle_releases = gpu->idle_releases;
    out->gate = gpu->gate;
    out->published_slot = gpu->published_valid ? gpu->slot_of_tenant[gpu->published.tenant] : -1;
    out->published_generation = gpu->published_valid ? gpu->published.generation : 0;
    out->deadline_fires = isinf(gpu->deadline_fires) ? NAN : gpu->deadline_fires;
    out->idle_fires = isinf(gpu->idle_fires) ? NAN : gpu->idle_fires;
    out->idle_backoff = gpu->idle_backoff;
}
