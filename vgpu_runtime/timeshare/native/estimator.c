/* Kernel-burst estimation: estimator.py, operation for operation, in a bounded ring. */
#include <math.h>
#include <stddef.h>

#include "internal.h"

#define BURST(b, i) ((b)->at[((b)->head + (i)) % TS_BURSTS_KEPT])

void ts_bursts_init(struct ts_bursts *b, double merge_gap, double history, double percentile) {
    b->merge_gap = merge_gap;
    b->history = history;
    b->percentile = percentile;
    b->head = 0;
    b->count = 0;
}

void ts_bursts_observe(struct ts_bursts *b, double start, double end) {
    if (end < start)
        return;
    if (b->count && start - BURST(b, b->count - 1).end < b->merge_gap) {
        double first = BURST(b, b->count - 1).start;
        b->count--;
        start = py_min(first, start);
    }
    if (b->count == TS_BURSTS_KEPT) {   /* deque(maxlen): the oldest goes */
        b->head = (b->head + 1) % TS_BURSTS_KEPT;
        b->count--;
    }
    BURST(b, b->count) = (struct ts_interval){start, end};
    b->count++;
}

static void sift_down(double *v, size_t root, size_t n) {
    for (size_t child; (child = 2 * root + 1) < n; root = child) {
        if (child + 1 < n && v[child] < v[child + 1])
            child++;
        if (!(v[root] < v[child]))
            return;
        double swap = v[root];
        v[root] = v[child];
        v[child] = swap;
    }
}

void ts_sort(double *v, size_t n) {
    /* Heapsort: in place, O(n log n), and no allocation (glibc's qsort mallocs a buffer). */
    for (size_t i = n / 2; i-- > 0;)
        sift_down(v, i, n);
    for (size_t end = n; end-- > 1;) {
        double top = v[0];
        v[0] = v[end];
        v[end] = top;
        sift_down(v, 0, end);
    }
}

double ts_bursts_estimate(struct ts_bursts *b, double now) {
    while (b->count && BURST(b, 0).end < now - b->history) {
        b->head = (b->head + 1) % TS_BURSTS_KEPT;
        b->count--;
    }
    if (!b->count)
        return NAN;
    for (uint32_t i = 0; i < b->count; i++)
        b->scratch[i] = BURST(b, i).end - BURST(b, i).start;
    ts_sort(b->scratch, b->count);
    size_t index = (size_t)(b->percentile * (double)b->count);
    return b->scratch[index < b->count - 1 ? index : b->count - 1];
}
