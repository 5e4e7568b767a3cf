/*
 * timeshare_handoff.c: what a token handoff costs the native scheduler called from C, as the
 * daemon's token thread will call it: no Python, no socket.
 *
 * Usage: timeshare_handoff ROUNDS OUT
 * Three tenants at 0.3 each (as scripts/bench-token-rtt's `path` case); a and b both ask. Then
 * ROUNDS times for a, then b: release (the token goes to the other, waiting) and ask again.
 * Then ROUNDS alone rounds of the third tenant (a and b gone): request + release. OUT gets one
 * line per round, "handoff NS" or "alone NS", timed with CLOCK_MONOTONIC; the scheduler's
 * clock is the same clock, in seconds.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "timeshare.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double now_s(void) { return (double)now_ns() / 1e9; }

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s ROUNDS OUT\n", argv[0]);
        return 2;
    }
    long rounds = atol(argv[1]);
    FILE *out = fopen(argv[2], "w");
    if (rounds <= 0 || out == NULL) {
        fprintf(stderr, "%s: bad ROUNDS or OUT\n", argv[0]);
        return 2;
    }
    /* TimeshareSettings' defaults. */
    struct ts_settings settings = {10.0, 0.02, 0.2, 0.3, 0.25, 0.05, 0.0, 0.002, 3.0};
    ts_scheduler *s = ts_create(&settings, now_s());
    int32_t t[3];
    for (int i = 0; i < 3; i++) {
        if (ts_add(s, 0.3, 1.0, now_s(), &t[i], NULL) < 0) {
            fprintf(stderr, "%s: ts_add failed\n", argv[0]);
            return 1;
        }
    }
    ts_request(s, t[0], now_s(), NAN, NAN, false, NAN, NULL);
    ts_request(s, t[1], now_s(), NAN, NAN, false, NAN, NULL);
    int64_t *samples = malloc(sizeof *samples * (size_t)rounds * 2);
    for (long i = 0; i < rounds; i++) {
        for (int k = 0; k < 2; k++) {
            int64_t start = now_ns();
            ts_release(s, t[k], now_s(), NAN, NULL);
            ts_request(s, t[k], now_s(), NAN, NAN, false, NAN, NULL);
            samples[2 * i + k] = now_ns() - start;
        }
    }
    for (long i = 0; i < 2 * rounds; i++)
        fprintf(out, "handoff %lld\n", (long long)samples[i]);
    ts_remove(s, t[0], now_s(), NULL);
    ts_remove(s, t[1], now_s(), NULL);
    for (long i = 0; i < rounds; i++) {
        int64_t start = now_ns();
        ts_request(s, t[2], now_s(), NAN, NAN, false, NAN, NULL);
        ts_release(s, t[2], now_s(), NAN, NULL);
        samples[i] = now_ns() - start;
    }
    for (long i = 0; i < rounds; i++)
        fprintf(out, "alone %lld\n", (long long)samples[i]);
    free(samples);
    ts_destroy(s);
    return fclose(out) == 0 ? 0 : 1;
}
