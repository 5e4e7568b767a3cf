/*
 * capture.c: how many stream captures are open in the process, counted by the
 * cuStreamBeginCapture* / cuStreamEndCapture* wrappers (launch.c). The gate asks the driver
 * whether a launch's stream is capturing only while one is open; the token's settling
 * (token.c) synchronises nothing while one is, since a synchronisation breaks a capture.
 */
#include "gate.h"

static _Atomic long captures_open;

void gm_capture_opened(CUresult result) {
    if (result == CUDA_SUCCESS) atomic_fetch_add_explicit(&captures_open, 1, memory_order_relaxed);
}

void gm_capture_closed(CUresult result) {
    /* An invalidated or unjoined capture still ends (errors 900-907); a stream that was not
     * capturing, or the wrong thread (908), ends nothing. */
    if (result != CUDA_SUCCESS && !(result >= 900 && result <= 907)) return;
    long open = atomic_load_explicit(&captures_open, memory_order_relaxed);
    while (open > 0 && !atomic_compare_exchange_weak_explicit(
                           &captures_open, &open, open - 1, memory_order_relaxed,
                           memory_order_relaxed)) {
    }
}

int gm_capture_open(void) {
    return atomic_load_explicit(&captures_open, memory_order_relaxed) != 0;
}
