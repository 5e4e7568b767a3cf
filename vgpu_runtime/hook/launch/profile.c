/* profile.c: the counters of a -DGM_PROFILE build (see profile.h); empty otherwise. */
#include "profile.h"

#ifdef GM_PROFILE
#include <stdio.h>

#define KINDS 4
static _Atomic uint64_t launches[KINDS][2];   /* by enum gm_launch_kind, then _ptsz */
static _Atomic uint64_t before_cycles, driver_cycles, after_cycles;
static _Atomic uint64_t first_cycles;         /* the first profiled launch: calibration */
static _Atomic int64_t first_ns;

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
    atomic_fetch_add_explicit(&before_cycles, before_real - entered, memory_order_relaxed);
    atomic_fetch_add_explicit(&driver_cycles, after_real - before_real, memory_order_relaxed);
    atomic_fetch_add_explicit(&after_cycles, left - after_real, memory_order_relaxed);
}

/* Appends the profile's key=value lines to the exit dump (core/stats.c). */
int gm_profile_dump(char *text, size_t size, int n) {
    static const char *names[KINDS] = {"kernel", "kernel_ex", "cooperative", "graph"};
    uint64_t cycles = gm_cycles() - atomic_load(&first_cycles);
    int64_t ns = gm_now_ns() - atomic_load(&first_ns);
    /* ns per cycle as a ratio; no launch (or no time) reports cycles as they are */
    double scale = atomic_load(&first_cycles) != 0 && cycles > 0 ? (double)ns / (double)cycles
                                                                  : 1.0;
    for (int k = 0; k < KINDS; k++)
        for (int p = 0; p < 2; p++)
            if (n >= 0 && (size_t)n < size)
                n += snprintf(text + n, size - (size_t)n, "profile_launches_%s%s=%llu\n",
                              names[k], p ? "_ptsz" : "",
                              (unsigned long long)atomic_load(&launches[k][p]));
    if (n >= 0 && (size_t)n < size)
        n += snprintf(text + n, size - (size_t)n,
                      "profile_before_driver_ns=%llu\nprofile_driver_ns=%llu\n"
                      "profile_after_driver_ns=%llu\nprofile_cycles_per_us=%llu\n",
                      (unsigned long long)(atomic_load(&before_cycles) * scale),
                      (unsigned long long)(atomic_load(&driver_cycles) * scale),
                      (unsigned long long)(atomic_load(&after_cycles) * scale),
                      (unsigned long long)(scale > 0 ? 1000.0 / scale : 0));
    return n;
}
#else
typedef int gm_profile_off;   /* a translation unit is never empty */
#endif
