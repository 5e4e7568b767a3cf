/* The native token code's wakeup: a timerfd on CLOCK_MONOTONIC (the clock of the pages and the
 * algorithm), set to an absolute time. The event loop's timers run on whole milliseconds, late
 * by up to two with uvloop's cached time; an idle check that late misses a tenant's idle gap
 * (a 2 ms think time behind a 2 ms idle release), so the loop only watches this descriptor. */
#define _GNU_SOURCE   /* CLOCK_MONOTONIC under -std=c11 */
#include "tokens.h"

#include <errno.h>
#include <math.h>
#include <sys/timerfd.h>
#include <time.h>

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
