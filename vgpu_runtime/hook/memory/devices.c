/*
 * devices.c: which GPU of the allocation a CUdevice is, by UUID (cuDeviceGetUuid_v2, else
 * cuDeviceGetUuid) against the UUIDs in the daemon's hello reply. Devices outside the
 * allocation are refused by the callers (CUDA_ERROR_INVALID_DEVICE).
 */
#include <string.h>

#include "memory.h"

#define MAX_DEVICES 64
#define NOT_CACHED (-100)

static _Atomic int cache[MAX_DEVICES];
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;

static void clear_cache(void) {
    for (int i = 0; i < MAX_DEVICES; i++) atomic_store(&cache[i], NOT_CACHED);
}

int gm_gpu_of_device(CUdevice dev) {
    pthread_once(&cache_once, clear_cache);
    if (dev >= 0 && dev < MAX_DEVICES) {
        int cached = atomic_load_explicit(&cache[dev], memory_order_relaxed);
        if (cached != NOT_CACHED) return cached;
    }
    struct gm_grant_view grants[GM_MAX_GPUS];
    int count = gm_channel_grants(grants, GM_MAX_GPUS, 1);
    if (count < 0) return GM_UNKNOWN_GPU;
    CUuuid uuid;
    CUresult result = GM_HAS_REAL(cuDeviceGetUuid_v2) ? GM_REAL(cuDeviceGetUuid_v2)(&uuid, dev)
                                                      : GM_REAL(cuDeviceGetUuid)(&uuid, dev);
    if (result != CUDA_SUCCESS) return GM_NO_GPU;
    int gpu = GM_NO_GPU;
    for (int i = 0; i < count; i++) {
        if (memcmp(grants[i].uuid, uuid.bytes, GM_UUID_BYTES) == 0) gpu = i;
    }
    if (gpu == GM_NO_GPU) gm_debug("device %d is outside this allocation: refused", dev);
    if (dev >= 0 && dev < MAX_DEVICES) atomic_store(&cache[dev], gpu);
    return gpu;
}

int gm_current_gpu(CUdevice *dev_out) {
    CUdevice dev;
    if (GM_REAL(cuCtxGetDevice)(&dev) != CUDA_SUCCESS) return GM_NO_CONTEXT;
    if (dev_out != NULL) *dev_out = dev;
    return gm_gpu_of_device(dev);
}

/* The GPU an allocation goes to, or -1 with the driver's error for why there is none. */
int gm_gpu_checked(int gpu, CUresult *error) {
    switch (gpu) {
    case GM_NO_CONTEXT: *error = CUDA_ERROR_INVALID_CONTEXT; return -1;
    case GM_NO_GPU: *error = CUDA_ERROR_INVALID_DEVICE; return -1;
    case GM_UNKNOWN_GPU:   /* the daemon is away: fail closed */
        GM_COUNT(mem_refused, 1);
        *error = CUDA_ERROR_OUT_OF_MEMORY;
        return -1;
    default: return gpu;
    }
}

int gm_gpu_for_alloc(CUdevice *dev, CUresult *error) {
    return gm_gpu_checked(gm_current_gpu(dev), error);
}
