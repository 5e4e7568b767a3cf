/* The native token code's wakeup: a timerfd on CLOCK_MONOTONIC (the clock of the pages and the
 * algorithm), set to an absolute time. The event loop's timers run on whole milliseconds, late
 * by up to two with uvloop's cached time; an idle check that late misses a tenant's idle gap
 * (a 2 ms think time behind a 2 ms idle release), so the loop only watches this descriptor. */
#define _GNU_SOURCE   /* CLOCK_MONOTONIC under -std=c11 */
#include "tokens.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

int td_wakeup_create(void) {
    int fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    return fd < 0 ? -errno : fd;
}

/* at: CLOCK_MONOTONIC seconds; NaN or infinite disarms. A time already past fires at once. */
int td_wakeup_set(int fd, double at) {
    struct itimerspec spec = {0};
    if (isfinite(at)) {
        if (at < 1e-9)
            at = 1e-9;   /* zero would disarm */
        double whole = floor(at);
        spec.it_value.tv_sec = (time_t)whole;
        spec.it_value.tv_nsec = (long)((at - whole) * 1e9);
        if (spec.it_value.tv_nsec >= 1000000000L)
            spec.it_value.tv_nsec = 999999999L;
        /* Never before `at`: the nanoseconds were truncated, so add one back. */
        if (spec.it_value.tv_nsec < 999999999L)
            spec.it_value.tv_nsec += 1;
    }
    return timerfd_settime(fd, TFD_TIMER_ABSTIME, &spec, NULL) == 0 ? 0 : -errno;
}

/* A timer has fired: read it, run what is due, and set it for the next wakeup, in one call,
 * so that an idle check that finds the holder still busy (most of them) costs the loop no Python
 * beyond this call. armed_at: what the timer was set for (INFINITY: nothing). fd: the timerfd,
 * or -1 for a timer of the caller's (the loop's, which may fire a little early), which this
 * neither reads nor sets. Returns td_on_timer's result, 0 when it did not run; out->wakeup is
 * then when the timer must fire next (NaN: never). */
int td_on_wakeup(td_gpu *gpu, int fd, double armed_at, double now, struct td_out *out) {
    uint64_t expirations;
    if (fd >= 0 && read(fd, &expirations, sizeof expirations) != (ssize_t)sizeof expirations) {
        out->grants = 0;   /* nothing fired (a wake-up already served): fd is as it was */
        out->events = 0;
        out->wakeup = isinf(armed_at) ? NAN : armed_at;
        return 0;
    }
    double wakeup = td_next_wakeup(gpu);
    int result = 0;
    if (wakeup <= armed_at) {   /* its time has come */
        result = td_on_timer(gpu, now, out);
    } else {                    /* later than fd was set for (or NaN: none): wait for it */
        out->grants = 0;
        out->events = 0;
        out->wakeup = wakeup;
    }
    if (fd >= 0 && !isnan(out->wakeup))
        td_wakeup_set(fd, out->wakeup);   /* cannot fail on a valid timerfd and a finite time */
    return result;
}
