/*
 * measure.c: what a driver call reserved on a device, read as the device's free memory just
 * before and just after it (contexts, context limits, modules and libraries).
 *
 * Both readings come from the same source: cuMemGetInfo when a context on that device is
 * current, else NVML by UUID. The readings are device-wide, so another process allocating in
 * between inflates the difference and one freeing deflates it; callers bound the result by
 * what they know of the reservation (a context's cap, a limit's or a module's own size).
 */
#include <stdio.h>

#include "memory.h"

static int nvml_free(nvmlDevice_t device, uint64_t *free) {
    nvmlMemory_t memory;
    if (GM_REAL(nvmlDeviceGetMemoryInfo)(device, &memory) != NVML_SUCCESS) return -1;
    *free = memory.free;
    return 0;
}

static int cuda_free(uint64_t *free) {
    size_t f = 0, t = 0;
    if (GM_REAL(cuMemGetInfo_v2)(&f, &t) != CUDA_SUCCESS) return -1;
    *free = f;
    return 0;
}

/* The first reading picks the source; the second must use the same one. */
int gm_free_read(struct gm_reading *r, CUdevice dev, uint64_t *free) {
    if (r->source == GM_SOURCE_CUDA) return cuda_free(free);
    if (r->source == GM_SOURCE_NVML) return nvml_free(r->nvml, free);
    CUdevice current;
    if (GM_REAL(cuCtxGetDevice)(&current) == CUDA_SUCCESS && current == dev &&
        cuda_free(free) == 0) {
        r->source = GM_SOURCE_CUDA;
        return 0;
    }
    CUuuid uuid;
    if (GM_REAL(cuDeviceGetUuid)(&uuid, dev) != CUDA_SUCCESS) return -1;
    if (GM_REAL(nvmlInit_v2)() != NVML_SUCCESS) return -1;
    r->nvml_open = 1;
    const unsigned char *b = (const unsigned char *)uuid.bytes;
    char text[48];
    snprintf(text, sizeof text,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
    if (GM_REAL(nvmlDeviceGetHandleByUUID)(text, &r->nvml) != NVML_SUCCESS ||
        nvml_free(r->nvml, free) != 0)
        return -1;
    r->source = GM_SOURCE_NVML;
    return 0;
}

void gm_free_done(struct gm_reading *r) {
    if (r->nvml_open) GM_REAL(nvmlShutdown)();
    r->nvml_open = 0;
}

/* Reservations measured one at a time in the process: two overlapping measurements would each
 * count the other's. */
static pthread_mutex_t measure_lock = PTHREAD_MUTEX_INITIALIZER;
void gm_measure_lock(void) { pthread_mutex_lock(&measure_lock); }
void gm_measure_unlock(void) { pthread_mutex_unlock(&measure_lock); }

static void measure_after_fork(void) { pthread_mutex_init(&measure_lock, NULL); }
GM_AFTER_FORK(measure_after_fork);
