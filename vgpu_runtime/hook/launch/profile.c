/* profile.c: the counters of a -DGM_PROFILE build (see profile.h); empty otherwise. */
#include "profile.h"

#ifdef GM_PROFILE
#include <stdio.h>

#define KINDS GM_LAUNCH_KIND_COUNT
#define PARTS 3                 /* before the driver's call, in it, after it */
#define BUCKETS 1024            /* of BUCKET_CYCLES each; the last takes everything longer */
#define BUCKET_CYCLES 4
static _Atomic uint64_t launches[KINDS][2];   /* by enum gm_launch_kind, then _ptsz */
static _Atomic uint64_t cycles_total[PARTS];
/* Per part, launches by cycles taken: the median a preempted launch cannot move, where one
 * 20 ms preemption in 100 000 launches adds 200 ns to the mean. */
static _Atomic uint64_t histogram[PARTS][BUCKETS];
static _Atomic uint64_t first_cycles;         /* the first profiled launch: calibration */
static _Atomic int64_t first_ns;

static void count(int part, uint64_t cycles) {
    atomic_fetch_add_explicit(&cycles_total[part], cycles, memory_order_relaxed);
    uint64_t bucket = cycles / BUCKET_CYCLES;
    atomic_fetch_add_explicit(&histogram[part][bucket < BUCKETS ? bucket : BUCKETS - 1], 1,
                              memory_order_relaxed);
}

void gm_profile_launch(const struct gm_launch *launch, uint64_t entered, uint64_t before_real,
                       uint64_t after_real) {
    uint64_t left = gm_cycles();
    if (atomic_load_explicit(&first_cycles, memory_order_relaxed) == 0) {
        uint64_t none = 0;
        int64_t ns = gm_now_ns();
        if (atomic_compare_exchange_strong(&first_cycles, &none, left))
            atomic_store(&first_ns, ns);
    }
    atomic_fetch_add_explicit(&launches[launch->kind][launch->per_thread != 0], 1,
                              memory_order_relaxed);
    count(0, before_real - entered);
    count(1, after_real - before_real);
    count(2, left - after_real);
}

/* The middle of a part's histogram, in cycles (a bucket's midpoint). */
static double median_cycles(int part) {
    uint64_t total = 0, seen = 0;
    for (int b = 0; b < BUCKETS; b++) total += atomic_load(&histogram[part][b]);
    for (int b = 0; b < BUCKETS; b++) {
        seen += atomic_load(&histogram[part][b]);
        if (total > 0 && 2 * seen >= total) return (b + 0.5) * BUCKET_CYCLES;
    }
    return 0;
}

/* Appends the profile's key=value lines to the exit dump (core/stats.c): launches by entry
 * point, and per part its total and its median per launch (ns). */
int gm_profile_dump(char *text, size_t size, int n) {
    static const char *kinds[KINDS] = {"kernel", "kernel_ex", "cooperative", "graph", "legacy"};
    static const char *parts[PARTS] = {"before_driver", "driver", "after_driver"};
    uint64_t cycles = gm_cycles() - atomic_load(&first_cycles);
    int64_t ns = gm_now_ns() - atomic_load(&first_ns);
    /* ns per cycle; with no launch (or no time) cycles are reported as they are */
    double scale = atomic_load(&first_cycles) != 0 && cycles > 0 ? (double)ns / (double)cycles
                                                                  : 1.0;
    for (int k = 0; k < KINDS; k++)
        for (int p = 0; p < 2; p++)
            if (n >= 0 && (size_t)n < size)
                n += snprintf(text + n, size - (size_t)n, "profile_launches_%s%s=%llu\n",
                              kinds[k], p ? "_ptsz" : "",
                              (unsigned long long)atomic_load(&launches[k][p]));
    for (int part = 0; part < PARTS; part++)
        if (n >= 0 && (size_t)n < size)
            n += snprintf(text + n, size - (size_t)n,
                          "profile_%s_ns=%llu\nprofile_%s_p50_ps=%llu\n", parts[part],
                          (unsigned long long)(atomic_load(&cycles_total[part]) * scale),
                          parts[part], (unsigned long long)(median_cycles(part) * scale * 1000));
    if (n >= 0 && (size_t)n < size)
        n += snprintf(text + n, size - (size_t)n, "profile_cycles_per_us=%llu\n",
                      (unsigned long long)(scale > 0 ? 1000.0 / scale : 0));
    return n;
}
#else
typedef int gm_profile_off;   /* a translation unit is never empty */
#endif
