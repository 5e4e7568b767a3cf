/* Internals shared by the scheduler's C files: the window, the burst estimator, and Python's
 * min/max (which differ from fmin/fmax on ties of signed zeros: the first argument wins). */
#ifndef GEMINI_TIMESHARE_INTERNAL_H
#define GEMINI_TIMESHARE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "timeshare.h"

/* Python's min(a, b) and max(a, b): a unless b is strictly smaller (larger). */
static inline double py_min(double a, double b) { return b < a ? b : a; }
static inline double py_max(double a, double b) { return b > a ? b : a; }
/* Python's `x or 0.0` for a float x that is never None here: a zero of either sign is 0.0. */
static inline double or_zero(double x) { return x != 0.0 ? x : 0.0; }

struct ts_interval {
    double start;
    double end;
};

/* window.py's UsageWindow: charged intervals, sorted and disjoint, in a ring. */
struct ts_window {
    double span;
    double forgotten_until;     /* history before this was dropped */
    uint32_t head;
    uint32_t count;
    struct ts_interval at[TS_WINDOW_INTERVALS + 1];   /* one spare: see window.c */
};

void ts_window_init(struct ts_window *w, double span);
double ts_window_charge(struct ts_window *w, double start, double end);
/* ongoing_since: NaN for none. */
double ts_window_usage(struct ts_window *w, double now, double ongoing_since);

/* Sorts ascending, in place, allocating nothing. */
void ts_sort(double *v, size_t n);

/* estimator.py's BurstEstimator, in a ring of TS_BURSTS_KEPT. */
struct ts_bursts {
    double merge_gap;
    double history;
    double percentile;
    uint32_t head;
    uint32_t count;
    struct ts_interval at[TS_BURSTS_KEPT];
    double scratch[TS_BURSTS_KEPT];   /* the lengths, sorted by estimate() */
};

void ts_bursts_init(struct ts_bursts *b, double merge_gap, double history, double percentile);
void ts_bursts_observe(struct ts_bursts *b, double start, double end);
/* NaN: no recent burst. */
double ts_bursts_estimate(struct ts_bursts *b, double now);

#endif
