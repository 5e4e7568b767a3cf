/*
 * token.c: the hook's side of GPU-time tokens: the pages, the gate's fast and slow paths,
 * settling the last grant's work, bursts and the bounded fallback. The contract is in
 * gemini_wire.h (above struct gm_token_page), the design in README.md ("The launch gate").
 *
 * Rules: the fast path costs no system call and no lock; a token page is mapped read-only (and
 * sealed by the daemon), so the container cannot forge a grant; a grant's work is charged up to
 * its end, never the idle time after it; without a daemon the hook gates itself at its last
 * known share, which no environment setting can widen; the gate never deadlocks the
 * application; an open gate is believed only while its daemon lives (checked every
 * REVIVE_EVERY launches: a daemon's page dies with it, a new daemon's comes with a hello).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gate.h"

#define MAX_STREAMS 16
#define MERGE_GAP_NS 2000000LL
#define REPORT_INTERVAL_NS 100000000LL
#define MAX_REPORTS 16
#define FALLBACK_AHEAD_NS 100000000LL       /* how far the self-gating clock may run ahead */
#define UNKNOWN_SHARE_PPM 40000               /* before any hello: below the 0.05 bound */
#define REVIVE_EVERY 4096                     /* open-gate launches per check of the daemon */

struct gpu_token {
    const struct gm_token_page *page;      /* NULL until mapped (atomic pointer loads) */
    struct gm_activity_page *activity;
    dev_t page_dev;                        /* the files mapped, to know a re-hello's pages */
    ino_t page_ino;
    _Atomic uint32_t share_ppm;            /* from the last hello: what the fallback allows */
    _Atomic int64_t fallback_until;        /* no grant to be had: self-gated until then */
    _Atomic int64_t fallback_ns;           /* the self-gating clock when there is no page */
    _Atomic uintptr_t streams[MAX_STREAMS]; /* own streams launched into since the last ask */
    _Atomic int legacy_used;               /* a launch went to the legacy default stream */
    _Atomic int streams_overflowed;        /* a launch went to a stream past the table */
    _Atomic int64_t burst_start;           /* first launch after the last sync, or -1 */
    _Atomic int64_t last_sync;             /* this process's last synchronisation's return */
    pthread_mutex_t lock;                  /* slow path: one asker, the others wait */
    pthread_cond_t cond;
    int requesting;
    CUevent pending[MAX_STREAMS];          /* report mode: events not yet seen complete, */
    CUstream pending_stream[MAX_STREAMS];  /* one per stream, on that stream */
    int pending_count;
    pthread_mutex_t burst_lock;            /* bursts: touched at synchronisations only */
    int64_t merged_start, merged_end;
    uint32_t merged_bursts;                /* sync-delimited bursts in the merged one */
    int64_t reports[MAX_REPORTS][2];
    uint32_t report_bursts[MAX_REPORTS];
    int report_count;
    int64_t last_report;
    int64_t longest_unmerged, last_unmerged;  /* sync-delimited bursts, for burst_ns */
};

/* Initialised statically, not by a constructor: a hello made from another library's
 * constructor, before this one's ran, must not be undone. */
static struct gpu_token gpus[GM_MAX_GPUS] = {
    [0 ... GM_MAX_GPUS - 1] = {.share_ppm = UNKNOWN_SHARE_PPM, .burst_start = -1,
                               .lock = PTHREAD_MUTEX_INITIALIZER,
                               .cond = PTHREAD_COND_INITIALIZER,
                               .burst_lock = PTHREAD_MUTEX_INITIALIZER, .merged_start = -1}};
static _Atomic int gpu_count = -1;
static _Atomic int64_t no_daemon_until;   /* no hello at all: self-gated until then */
static _Atomic int warned;
static __thread int fallback_launch;      /* this thread's launch is self-gated */
static __thread unsigned open_launches;   /* this thread's launches through an open gate */

/* An open gate holds until the daemon that opened it goes; nobody writes its page after
 * that (a sealed page is the dead daemon's alone), so now and then its connection is checked
 * and, hung up, made again: the next daemon's hello brings the page it writes. */
static void open_gate_launch(void) {
    if ((++open_launches & (REVIVE_EVERY - 1)) == 0) gm_channel_revive();
}

static int drain_by_sync(void) {
    static int mode = -1;
    if (mode < 0) {
        const char *text = getenv("GEMINI_HOOK_DRAIN");
        mode = text == NULL || strcmp(text, "report") != 0;
        if (text != NULL && strcmp(text, "report") != 0 && strcmp(text, "sync") != 0)
            gm_warn("GEMINI_HOOK_DRAIN=%s is neither sync nor report; using sync", text);
    }
    return mode;
}

/* ---- pages ---- */

static void *map_fd(int fd, int writable) {
    void *page = mmap(NULL, GM_PAGE_BYTES, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                      MAP_SHARED, fd, 0);
    return page == MAP_FAILED ? NULL : page;
}

/* Every hello: its shares, and its pages mapped (the channel closes the descriptors). */
static void token_hello(const struct gm_hello_view *hello) {
    const int *fds = hello->page_fds;
    const uint32_t *share_ppm = hello->share_ppm;
    int nfds = hello->page_fd_count, count = hello->gpu_count;
    for (int i = 0; i < count && i < GM_MAX_GPUS; i++) {
        struct gpu_token *g = &gpus[i];
        atomic_store(&g->share_ppm, share_ppm[i] > UNKNOWN_SHARE_PPM ? share_ppm[i]
                                                                     : UNKNOWN_SHARE_PPM);
        struct stat st;
        if (2 * i + 1 >= nfds || fds[2 * i] < 0 || gm_fstat(fds[2 * i], &st) != 0) continue;
        if (g->page != NULL && st.st_dev == g->page_dev && st.st_ino == g->page_ino) continue;
        const struct gm_token_page *page = map_fd(fds[2 * i], 0);
        /* No activity page (a version-1 daemon's, in a read-only channel): launches write
         * none; that daemon's idle check is its own affair. */
        int has_activity = fds[2 * i + 1] >= 0;
        struct gm_activity_page *activity = has_activity ? map_fd(fds[2 * i + 1], 1) : NULL;
        if (page != NULL && page->magic != GM_TOKEN_PAGE_MAGIC) {
            munmap((void *)page, GM_PAGE_BYTES);
            page = NULL;
        }
        if (page == NULL || (has_activity && activity == NULL)) {
            gm_warn("cannot map the token pages of gpu %d: each of its launches asks the daemon",
                    i);
            if (page != NULL) munmap((void *)page, GM_PAGE_BYTES);
            if (activity != NULL) munmap(activity, GM_PAGE_BYTES);
            continue;
        }
        /* A previous mapping stays mapped: a launch may be reading it right now. */
        g->page_dev = st.st_dev;
        g->page_ino = st.st_ino;
        __atomic_store_n(&g->activity, activity, __ATOMIC_RELEASE);
        __atomic_store_n(&g->page, page, __ATOMIC_RELEASE);
    }
    atomic_store(&gpu_count, count);
}
GM_ON_HELLO(token_hello);

/* A forked child drops its parent's mappings and maps its own after its own hello. */
static void token_after_fork(void) {
    for (int i = 0; i < GM_MAX_GPUS; i++) {
        struct gpu_token *g = &gpus[i];
        if (g->page != NULL) munmap((void *)g->page, GM_PAGE_BYTES);
        if (g->activity != NULL) munmap(g->activity, GM_PAGE_BYTES);
        g->page = NULL;
        g->activity = NULL;
        pthread_mutex_init(&g->lock, NULL);
        pthread_cond_init(&g->cond, NULL);
        pthread_mutex_init(&g->burst_lock, NULL);
        g->page_dev = 0;
        g->page_ino = 0;
        atomic_store(&g->fallback_ns, 0);
        atomic_store(&g->fallback_until, 0);
        g->requesting = 0;
        g->pending_count = 0;   /* the parent's events are not the child's */
        g->report_count = 0;
        g->merged_start = -1;
        g->longest_unmerged = g->last_unmerged = 0;
        atomic_store(&g->burst_start, -1);
        atomic_store(&g->last_sync, 0);
        atomic_store(&g->legacy_used, 0);
        atomic_store(&g->streams_overflowed, 0);
        for (int s = 0; s < MAX_STREAMS; s++) atomic_store(&g->streams[s], 0);
    }
    atomic_store(&gpu_count, -1);
    atomic_store(&no_daemon_until, 0);
}
GM_AFTER_FORK(token_after_fork);

/* ---- settling the last grant's work ---- */

static int take_streams(struct gpu_token *g, CUstream out[MAX_STREAMS]) {
    int n = 0;
    for (int i = 0; i < MAX_STREAMS; i++) {
        uintptr_t s = atomic_exchange_explicit(&g->streams[i], 0, memory_order_relaxed);
        if (s != 0) out[n++] = (CUstream)s;
    }
    return n;
}

/* Work still queued on any of them (the legacy stream too, when `legacy`). */
static int streams_busy(const CUstream *streams, int n, int legacy) {
    int busy = legacy && GM_REAL(cuStreamQuery)(NULL) == CUDA_ERROR_NOT_READY;
    for (int i = 0; i < n && !busy; i++)
        busy = GM_REAL(cuStreamQuery)(streams[i]) == CUDA_ERROR_NOT_READY;
    return busy;
}

/* Report mode: an event on `stream` behind everything launched into it so far; one event per
 * stream is kept, re-recorded (FIFO: when the newer record is done, so is the older). */
static void record_pending(struct gpu_token *g, CUstream stream) {
    for (int i = 0; i < g->pending_count; i++)
        if (g->pending_stream[i] == stream) {
            GM_REAL(cuEventRecord)(g->pending[i], stream);
            return;
        }
    if (g->pending_count == MAX_STREAMS) return;   /* the rest go unmeasured */
    CUevent event;
    if (GM_REAL(cuEventCreate)(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return;
    if (GM_REAL(cuEventRecord)(event, stream) != CUDA_SUCCESS) {
        GM_REAL(cuEventDestroy_v2)(event);
        return;
    }
    g->pending_stream[g->pending_count] = stream;
    g->pending[g->pending_count++] = event;
}

/* The last grant's work, as the asker finds it. */
struct grant_work {
    CUstream streams[MAX_STREAMS];   /* own streams launched into since the last ask */
    int count;
    int legacy;                      /* a launch went to the legacy default stream */
    int overflowed;                  /* a launch went to a stream past the table */
    int64_t asked;                   /* when the asker started settling */
    int64_t done_by;                 /* a sync returned after the last launch: then; else -1 */
};

static void take_work(struct gpu_token *g, struct grant_work *w) {
    w->count = take_streams(g, w->streams);
    w->legacy = atomic_exchange(&g->legacy_used, 0);
    w->overflowed = atomic_exchange(&g->streams_overflowed, 0);
    w->asked = gm_now_ns();
    int64_t synced = atomic_load(&g->last_sync);
    w->done_by = synced > 0 && atomic_load(&g->burst_start) < 0 ? synced : -1;
}

/* Launches went to more streams than the table holds: the streams past it are unknown, so the
 * whole context is waited for, in either drain mode (report mode's events need their stream).
 * Its work ended now if the wait blocked, else by the ask (unknown: nothing past the release is
 * charged, as for known streams found done), or at the last sync if quiet since. */
#define CONTEXT_IDLE_WAIT_NS 50000LL   /* a context synchronisation with nothing to wait for */
static int64_t settle_context(struct gpu_token *g, const struct grant_work *w) {
    GM_REAL(cuCtxSynchronize)();
    int64_t end = gm_now_ns();
    for (int i = 0; i < g->pending_count; i++) GM_REAL(cuEventDestroy_v2)(g->pending[i]);
    g->pending_count = 0;   /* all done by now */
    if (end - w->asked < CONTEXT_IDLE_WAIT_NS) return w->done_by;
    GM_COUNT(drain_ns, (uint64_t)(end - w->asked));
    return w->done_by >= 0 ? w->done_by : end;
}

/* Sync mode: what is still queued is waited for and ended now. Work found done ended at the
 * last synchronisation if one returned after the last launch, else at a time unknown: "now"
 * would charge the idle time since the grant ended (an idle release, a revocation) as overuse.
 * Work queued after that synchronisation ran without the token (a copy, an event record): it
 * is waited for all the same (the next holder's time is its own) but ended at that return. */
static int64_t settle_by_sync(const struct grant_work *w) {
    if (w->count == 0 && !w->legacy) return -1;
    /* cuStreamQuery enqueues nothing, so it says whether the work itself is done (an event
     * recorded just now may not have been reached yet even on an idle stream). */
    if (!streams_busy(w->streams, w->count, w->legacy)) return w->done_by;
    for (int i = 0; i < w->count; i++) {
        CUevent event;
        if (GM_REAL(cuEventCreate)(&event, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) !=
            CUDA_SUCCESS)
            continue;
        if (GM_REAL(cuEventRecord)(event, w->streams[i]) == CUDA_SUCCESS)
            GM_REAL(cuEventSynchronize)(event);
        GM_REAL(cuEventDestroy_v2)(event);
    }
    if (w->legacy) GM_REAL(cuStreamSynchronize)(NULL);
    int64_t end = gm_now_ns();
    GM_COUNT(drain_ns, (uint64_t)(end - w->asked));
    return w->done_by >= 0 ? w->done_by : end;
}

/* Report mode: nothing waits. The events recorded at the previous ask, if done by now, ended
 * by now (an upper bound) or at the last synchronisation if quiet since; if not, *running says
 * so and they are kept. This grant's streams get events for the next ask. */
static int64_t settle_by_report(struct gpu_token *g, const struct grant_work *w, int *running) {
    int64_t work_end = -1;
    if (g->pending_count > 0) {
        int done = 1;
        for (int i = 0; i < g->pending_count; i++)
            done &= GM_REAL(cuEventQuery)(g->pending[i]) != CUDA_ERROR_NOT_READY;
        if (done) {
            work_end = w->done_by >= 0 ? w->done_by : gm_now_ns();
            for (int i = 0; i < g->pending_count; i++) GM_REAL(cuEventDestroy_v2)(g->pending[i]);
            g->pending_count = 0;
        } else {
            *running = 1;
        }
    }
    int outstanding = g->pending_count;
    for (int i = 0; i < w->count; i++) record_pending(g, w->streams[i]);
    /* Nothing older outstanding, this grant's work already done, and a synchronisation
     * returned after its last launch: the work ended by that return (exact for a host that
     * waited on it; no later than what the idle release assumes). */
    if (work_end < 0 && outstanding == 0 && g->pending_count > 0 && w->done_by >= 0 &&
        !streams_busy(w->streams, w->count, 0))
        work_end = w->done_by;
    return work_end;
}

/* When the last grant's work ended, -1 when unknown; *running: work queued before the previous
 * ask is still running (report mode only). Nothing is settled while a capture is open. */
static int64_t settle(struct gpu_token *g, int *running) {
    *running = 0;
    if (gm_capture_open()) return -1;
    struct grant_work work;
    take_work(g, &work);
    if (work.overflowed) return settle_context(g, &work);
    return drain_by_sync() ? settle_by_sync(&work) : settle_by_report(g, &work, running);
}

/* ---- bursts ---- */

static int64_t burst_estimate(struct gpu_token *g) {
    pthread_mutex_lock(&g->burst_lock);
    if (g->longest_unmerged > 0) g->last_unmerged = g->longest_unmerged;
    g->longest_unmerged = 0;
    int64_t estimate = g->last_unmerged;
    pthread_mutex_unlock(&g->burst_lock);
    return estimate > 0 ? estimate : -1;
}

static int gpu_now(void) {
    int n = atomic_load_explicit(&gpu_count, memory_order_relaxed);
    if (n == 1) return 0;
    if (n <= 0) return -1;
    int gpu = gm_current_gpu(NULL);
    return gpu < n ? gpu : -1;
}

/* A finished (merged) burst of `bursts`, kept for the next report. With the table full the last
 * one is stretched over it, gap included: busy time is over-reported then, never dropped. */
static void keep_burst(struct gpu_token *g, int64_t start, int64_t end, uint32_t bursts) {
    if (g->report_count < MAX_REPORTS) {
        g->reports[g->report_count][0] = start;
        g->report_bursts[g->report_count] = bursts;
        g->reports[g->report_count++][1] = end;
    } else {
        g->reports[MAX_REPORTS - 1][1] = end;
        g->report_bursts[MAX_REPORTS - 1] += bursts;
    }
}

void gm_sync_observed(void) {
    if (!gm_active() || gm_capture_open()) return;
    int gpu = gpu_now();
    if (gpu < 0) return;
    struct gpu_token *g = &gpus[gpu];
    struct gm_activity_page *activity = __atomic_load_n(&g->activity, __ATOMIC_ACQUIRE);
    if (activity == NULL) return;
    int64_t end = gm_now_ns();
    __atomic_store_n(&activity->last_sync_ns, end, __ATOMIC_RELAXED);
    atomic_store_explicit(&g->last_sync, end, memory_order_relaxed);
    int64_t start = atomic_exchange(&g->burst_start, -1);
    GM_COUNT(syncs_observed, 1);
    if (start < 0) return;   /* nothing launched since the last synchronisation */
    GM_COUNT(bursts_observed_ns, (uint64_t)(end - start));
    int64_t to_send[MAX_REPORTS][2];
    uint32_t bursts_of[MAX_REPORTS];
    int sending = 0;
    pthread_mutex_lock(&g->burst_lock);
    if (end - start > g->longest_unmerged) g->longest_unmerged = end - start;
    if (g->merged_start >= 0 && start - g->merged_end < MERGE_GAP_NS) {
        g->merged_end = end;
        g->merged_bursts++;
    } else {
        if (g->merged_start >= 0) keep_burst(g, g->merged_start, g->merged_end, g->merged_bursts);
        g->merged_start = start;
        g->merged_end = end;
        g->merged_bursts = 1;
    }
    if (end - g->last_report >= REPORT_INTERVAL_NS) {
        /* the burst in progress goes too; the daemon merges its continuation with it */
        keep_burst(g, g->merged_start, g->merged_end, g->merged_bursts);
        g->merged_start = -1;
        memcpy(to_send, g->reports, sizeof to_send);
        memcpy(bursts_of, g->report_bursts, sizeof bursts_of);
        sending = g->report_count;
        g->report_count = 0;
        g->last_report = end;
    }
    pthread_mutex_unlock(&g->burst_lock);
    for (int i = 0; i < sending; i++) {
        struct gm_usage_report report = {.gpu = (uint32_t)gpu, .bursts = bursts_of[i],
                                          .burst_start_ns = to_send[i][0],
                                          .burst_end_ns = to_send[i][1]};
        report.h.type = GM_MSG_USAGE_REPORT;
        report.h.length = sizeof report;
        if (gm_channel_notify(&report) == 0) {
            GM_COUNT(usage_reports, 1);
            GM_COUNT(usage_reported_ns, (uint64_t)(to_send[i][1] - to_send[i][0]));
        }
    }
}

/* ---- the fallback: self-gating at the known share (README.md, "Fallback") ---- */

static void warn_fallback(const char *why) {
    if (!atomic_exchange(&warned, 1))
        gm_warn("%s: this process gates its launches itself at its share until the daemon "
                "grants again", why);
}

static void enter_fallback(_Atomic int64_t *until) {
    atomic_store(until, gm_now_ns() + gm_setting_fallback_retry_ns());
}

/* The self-gating clock: the container's, on its activity page, else this process's own. */
static _Atomic int64_t *fallback_clock(struct gpu_token *g) {
    struct gm_activity_page *activity = __atomic_load_n(&g->activity, __ATOMIC_ACQUIRE);
    return activity != NULL ? (_Atomic int64_t *)&activity->fallback_ns : &g->fallback_ns;
}

/* Wait until this process may launch again on `gpu` (then the launch runs self-gated: returns
 * gpu), or until `retry_at`, when the daemon is to be asked again first (returns -3). */
static int fallback_gate(int gpu, int64_t retry_at, int64_t *at) {
    struct gpu_token *g = &gpus[gpu];
    int64_t now = gm_now_ns();
    int64_t wait = atomic_load_explicit(fallback_clock(g), memory_order_relaxed) -
                   FALLBACK_AHEAD_NS - now;
    if (wait > 0) {   /* the container is ahead of its share: wait until it is not */
        int retry = now + wait > retry_at;
        if (retry) wait = retry_at > now ? retry_at - now : 0;
        struct timespec pause = {wait / 1000000000LL, wait % 1000000000LL};
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
        }
        if (retry) return -3;
    }
    GM_COUNT(ungated_launches, 1);
    fallback_launch = 1;
    *at = gm_now_ns();
    return gpu;
}

/* After a self-gated launch: wait for it and move the clock by what it ran over the share. */
static void fallback_launched(struct gpu_token *g, const struct gm_launch *launch, int64_t at) {
    fallback_launch = 0;
    if (!gm_capture_open()) {   /* a synchronisation would break a global-mode capture */
        CUstream stream = launch->stream;
        if (stream == NULL && launch->per_thread) stream = CU_STREAM_PER_THREAD;
        GM_REAL(cuStreamSynchronize)(stream);
    }
    int64_t now = gm_now_ns();
    int64_t share = atomic_load(&g->share_ppm);
    int64_t cost = (now - at) * GM_PPM / share;
    _Atomic int64_t *clock = fallback_clock(g);
    int64_t seen = atomic_load_explicit(clock, memory_order_relaxed), next;
    do {
        next = (seen > now - FALLBACK_AHEAD_NS ? seen : now - FALLBACK_AHEAD_NS) + cost;
    } while (!atomic_compare_exchange_weak_explicit(clock, &seen, next, memory_order_relaxed,
                                                    memory_order_relaxed));
}

/* ---- the gate ---- */

/* The GPU index when granted, -1 when the gate is open, -2 when no grant is to be had. */
static int slow_path(int gpu) {
    struct gpu_token *g = &gpus[gpu];
    int64_t entered = gm_now_ns();
    int result = -1;
    pthread_mutex_lock(&g->lock);
    for (;;) {
        int64_t now = gm_now_ns();
        const struct gm_token_page *page = __atomic_load_n(&g->page, __ATOMIC_ACQUIRE);
        if (page != NULL && __atomic_load_n(&page->gate, __ATOMIC_RELAXED) == GM_GATE_OPEN) break;
        if (page != NULL && now < __atomic_load_n(&page->valid_until_ns, __ATOMIC_ACQUIRE)) {
            result = gpu;
            break;
        }
        if (now < atomic_load(&g->fallback_until)) {
            result = -2;
            break;
        }
        if (g->requesting) {   /* another thread of this process asks for all of them */
            pthread_cond_wait(&g->cond, &g->lock);
            continue;
        }
        g->requesting = 1;
        pthread_mutex_unlock(&g->lock);
        int running;
        int64_t work_end = settle(g, &running);
        struct gm_token_grant grant;
        GM_COUNT(token_requests, 1);
        int rc = gm_channel_token((uint32_t)gpu, running ? GM_TOKEN_WORK_RUNNING : 0,
                                  burst_estimate(g), work_end, &grant);
        pthread_mutex_lock(&g->lock);
        g->requesting = 0;
        pthread_cond_broadcast(&g->cond);
        if (rc == 0) {
            result = gpu;   /* granted: this launch goes, later ones check the page */
            break;
        }
        if (rc == -2) GM_COUNT(token_timeouts, 1);
        enter_fallback(&g->fallback_until);
        warn_fallback(rc == -2 ? "no token grant in time" : "the node daemon is away");
        result = -2;
        break;
    }
    pthread_mutex_unlock(&g->lock);
    uint64_t waited = (uint64_t)(gm_now_ns() - entered);
    GM_COUNT(token_wait_ns, waited);
    uint64_t longest = atomic_load_explicit(&gm_counters.token_wait_max_ns, memory_order_relaxed);
    while (waited > longest &&
           !atomic_compare_exchange_weak_explicit(&gm_counters.token_wait_max_ns, &longest, waited,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
    return result;
}

int gm_token_gate(int64_t *at) {
    for (;;) {
        int n = atomic_load_explicit(&gpu_count, memory_order_relaxed);
        if (n < 0) {
            int64_t until = atomic_load_explicit(&no_daemon_until, memory_order_relaxed);
            if (gm_now_ns() >= until) {
                if (gm_channel_ensure(1) >= 0) continue;
                enter_fallback(&no_daemon_until);
                warn_fallback("the node daemon is away");
                until = atomic_load(&no_daemon_until);
            }
            int result = fallback_gate(0, until, at);
            if (result == -3) continue;
            return result;
        }
        int gpu = gpu_now();
        if (gpu < 0) return -1;   /* no context or a device outside the allocation: the driver says */
        struct gpu_token *g = &gpus[gpu];
        const struct gm_token_page *page = __atomic_load_n(&g->page, __ATOMIC_ACQUIRE);
        int64_t until = atomic_load_explicit(&g->fallback_until, memory_order_relaxed);
        if (page != NULL) {
            if (__atomic_load_n(&page->gate, __ATOMIC_RELAXED) == GM_GATE_OPEN) {
                open_gate_launch();
                return -1;
            }
            int64_t now = gm_now_ns();
            if (now < __atomic_load_n(&page->valid_until_ns, __ATOMIC_ACQUIRE)) {
                *at = now;
                return gpu;
            }
        }
        int result = gm_now_ns() < until ? -2 : slow_path(gpu);
        if (result == -2) {
            result = fallback_gate(gpu, atomic_load(&g->fallback_until), at);
            if (result == -3) continue;   /* time to ask the daemon again */
            return result;
        }
        *at = gm_now_ns();
        return result;
    }
}

void gm_token_launched(int gpu, const struct gm_launch *launch, int64_t at) {
    struct gpu_token *g = &gpus[gpu];
    if (fallback_launch) {
        fallback_launched(g, launch, at);
        return;
    }
    struct gm_activity_page *activity = __atomic_load_n(&g->activity, __ATOMIC_RELAXED);
    if (activity != NULL) {
        __atomic_store_n(&activity->last_launch_ns, at, __ATOMIC_RELAXED);
        __atomic_store_n(&activity->launches,
                         __atomic_load_n(&activity->launches, __ATOMIC_RELAXED) + 1,
                         __ATOMIC_RELAXED);   /* advisory: a lost increment harms nobody */
    }
    if (atomic_load_explicit(&g->burst_start, memory_order_relaxed) < 0)
        atomic_store_explicit(&g->burst_start, at, memory_order_relaxed);
    CUstream stream = launch->stream;
    if (stream == NULL) stream = launch->per_thread ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY;
    if (stream == CU_STREAM_LEGACY) {
        if (!atomic_load_explicit(&g->legacy_used, memory_order_relaxed))
            atomic_store_explicit(&g->legacy_used, 1, memory_order_relaxed);
        return;
    }
    uintptr_t value = (uintptr_t)stream;
    for (int i = 0; i < MAX_STREAMS; i++) {
        uintptr_t seen = atomic_load_explicit(&g->streams[i], memory_order_relaxed);
        if (seen == value) return;
        if (seen == 0 && (atomic_compare_exchange_strong_explicit(
                              &g->streams[i], &seen, value, memory_order_relaxed,
                              memory_order_relaxed) ||
                          seen == value))
            return;
    }
    /* More than MAX_STREAMS streams in one quota: the next ask waits for the whole context
     * (settle), so no stream's work goes unmeasured. */
    if (!atomic_load_explicit(&g->streams_overflowed, memory_order_relaxed))
        atomic_store_explicit(&g->streams_overflowed, 1, memory_order_relaxed);
}
