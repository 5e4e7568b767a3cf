/* GPU time charged to one tenant over a sliding window: window.py, operation for operation. */
#include <math.h>
#include <string.h>

#include "internal.h"

/* One slot more than are kept: a charge inserts before the oldest is dropped, as in Python. */
#define RING (TS_WINDOW_INTERVALS + 1)
#define SLOT(w, i) ((w)->at[((w)->head + (i)) % RING])

void ts_window_init(struct ts_window *w, double span) {
    w->span = span;
    w->forgotten_until = -INFINITY;
    w->head = 0;
    w->count = 0;
}

/* Python's bisect_left(intervals, (start, start)) on (lo, hi) tuples. */
static uint32_t bisect_left(const struct ts_window *w, double start) {
    uint32_t lo = 0, hi = w->count;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        const struct ts_interval *iv = &SLOT(w, mid);
        bool less = iv->start != start ? iv->start < start : iv->end < start;
        if (less)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void drop_oldest(struct ts_window *w) {
    w->forgotten_until = py_max(w->forgotten_until, SLOT(w, 0).end);
    w->head = (w->head + 1) % RING;
    w->count--;
}

static void expire(struct ts_window *w, double now) {
    double horizon = now - w->span;
    uint32_t gone = 0;
    while (gone < w->count && SLOT(w, gone).end <= horizon)
        gone++;
    if (gone) {
        w->forgotten_until = py_max(w->forgotten_until, SLOT(w, gone - 1).end);
        w->head = (w->head + gone) % RING;
        w->count -= gone;
    }
}

double ts_window_charge(struct ts_window *w, double start, double end) {
    start = py_max(start, w->forgotten_until);
    if (end <= start)
        return 0.0;
    uint32_t first = bisect_left(w, start);
    if (first > 0 && SLOT(w, first - 1).end >= start)
        first--;
    uint32_t last = first;
    while (last < w->count && SLOT(w, last).start <= end) {
        start = py_min(start, SLOT(w, last).start);
        end = py_max(end, SLOT(w, last).end);
        last++;
    }
    double covered = 0.0;
    for (uint32_t i = first; i < last; i++)
        covered += SLOT(w, i).end - SLOT(w, i).start;
    double added = (end - start) - covered;
    /* intervals[first:last] = [(start, end)] */
    uint32_t merged = last - first;
    if (merged > 0) {
        SLOT(w, first) = (struct ts_interval){start, end};
        for (uint32_t i = last; i < w->count; i++)
            SLOT(w, i - (merged - 1)) = SLOT(w, i);
        w->count -= merged - 1;
    } else {
        for (uint32_t i = w->count; i > first; i--)
            SLOT(w, i) = SLOT(w, i - 1);
        SLOT(w, first) = (struct ts_interval){start, end};
        w->count++;
    }
    /* Charges end no later than the present: what ended a window before is dropped. */
    expire(w, end);
    if (w->count > TS_WINDOW_INTERVALS)
        drop_oldest(w);
    return added;
}

static double overlap_sum(double total, double start, double end, double now, double horizon) {
    double hi = py_min(end, now), lo = py_max(start, horizon);
    return hi > lo ? total + (hi - lo) : total;
}

double ts_window_usage(struct ts_window *w, double now, double ongoing_since) {
    expire(w, now);
    double horizon = now - w->span;
    uint32_t kept = w->count;
    double until = now;
    bool ongoing = !isnan(ongoing_since) && ongoing_since < now;
    if (ongoing) {
        while (kept > 0 && ongoing_since < SLOT(w, kept - 1).end) {
            const struct ts_interval *iv = &SLOT(w, kept - 1);
            ongoing_since = py_min(iv->start, ongoing_since);
            until = py_max(iv->end, until);
            kept--;
        }
    }
    double total = 0.0;
    for (uint32_t i = 0; i < kept; i++)
        total = overlap_sum(total, SLOT(w, i).start, SLOT(w, i).end, now, horizon);
    if (ongoing)
        total = overlap_sum(total, ongoing_since, until, now, horizon);
    return total;
}
