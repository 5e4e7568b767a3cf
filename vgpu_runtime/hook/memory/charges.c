/*
 * charges.c: device memory the driver reserves for a context on the application's behalf,
 * outside any allocation call: context limits (limits.c) and loaded modules and libraries
 * (modules.c). Each charge was reserved with the daemon as GM_MEM_DEVICE and is booked here
 * under (what, handle) with the context it lives in, because it ends two ways: with its own
 * undo (a limit set lower, an unload) or with its context (destroy, last primary release,
 * reset), which takes every charge of that context with it.
 *
 * A limit's entry also keeps its base (what the limit held when the hook first saw it, which
 * the context's own charge already measured) and its drift (what the driver took past its rule
 * so far; negative where it took less, or takes it later).
 *
 * A plain array under one mutex: these calls are rare (a few per context), never on a launch.
 */
#include <stdlib.h>

#include "memory.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct charge {
    uint64_t handle;
    uint32_t what, gpu;
    CUcontext ctx;
    uint64_t bytes, base;
    int64_t drift;
} *charges;
static size_t count, capacity;

/* Books a charge already reserved; -1 (nothing booked) when out of host memory. */
int gm_charge_put(uint32_t what, uint64_t handle, CUcontext ctx, int gpu, uint64_t bytes,
                  uint64_t base, int64_t drift) {
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < count; i++) {
        if (charges[i].what == what && charges[i].handle == handle) {
            charges[i].ctx = ctx;
            charges[i].gpu = (uint32_t)gpu;
            charges[i].bytes = bytes;
            charges[i].base = base;
            charges[i].drift = drift;
            pthread_mutex_unlock(&lock);
            return 0;
        }
    }
    if (count == capacity) {
        size_t grown_capacity = capacity ? capacity * 2 : 64;
        struct charge *grown = realloc(charges, grown_capacity * sizeof *charges);
        if (grown == NULL) {
            pthread_mutex_unlock(&lock);
            return -1;
        }
        charges = grown;
        capacity = grown_capacity;
    }
    charges[count++] = (struct charge){handle, what, (uint32_t)gpu, ctx, bytes, base, drift};
    pthread_mutex_unlock(&lock);
    return 0;
}

/* What (what, handle) is charged, taken out of the table; 0 when nothing is. *base and *drift
 * (if not NULL) get what was booked with it, and stay as they were when there is no entry. */
uint64_t gm_charge_take(uint32_t what, uint64_t handle, int *gpu, CUcontext *ctx,
                        uint64_t *base, int64_t *drift) {
    uint64_t bytes = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < count; i++) {
        if (charges[i].what == what && charges[i].handle == handle) {
            bytes = charges[i].bytes;
            *gpu = (int)charges[i].gpu;
            if (ctx != NULL) *ctx = charges[i].ctx;
            if (base != NULL) *base = charges[i].base;
            if (drift != NULL) *drift = charges[i].drift;
            charges[i] = charges[--count];
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return bytes;
}

/* The context is gone: every charge in it is released. */
void gm_charges_context_gone(CUcontext ctx) {
    if (ctx == NULL) return;
    uint64_t freed[GM_MAX_GPUS] = {0};
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < count;) {
        if (charges[i].ctx == ctx) {
            if (charges[i].gpu < GM_MAX_GPUS) freed[charges[i].gpu] += charges[i].bytes;
            charges[i] = charges[--count];
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&lock);
    for (int gpu = 0; gpu < GM_MAX_GPUS; gpu++) gm_release(gpu, GM_MEM_DEVICE, freed[gpu]);
}

/* In a forked child: the parent's contexts are not the child's. */
static void charges_after_fork(void) {
    pthread_mutex_init(&lock, NULL);
    count = 0;
}
GM_AFTER_FORK(charges_after_fork);
