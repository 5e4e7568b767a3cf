/*
 * info.c: what the application is told about memory, and the devices it may use.
 *
 * cuMemGetInfo_v2: total = the limit (never more than the real total), free = limit -
 * container-wide use (never negative, never more than the real free). The container's use
 * comes from the daemon (a zero-byte reservation answers with it); with the daemon away,
 * this process's own use stands in. cuDeviceTotalMem_v2 reports the limit.
 * Contexts (refusal of foreign devices, their cost) are in context.c.
 */
#include "memory.h"

static uint64_t limit_of(int gpu) {
    struct gm_grant_view grants[GM_MAX_GPUS];
    int count = gm_channel_grants(grants, GM_MAX_GPUS, 1);
    return gpu < count ? grants[gpu].memory_limit : 0;
}

int gm_usage(int gpu, uint64_t *used, uint64_t *limit) {
    struct gm_mem_reply reply;
    /* A refused zero-byte reservation still answers with use and limit (use > limit). */
    if (gm_channel_mem(GM_MSG_MEM_RESERVE, (uint32_t)gpu, GM_MEM_DEVICE, 0, &reply, 1) == 0) {
        *used = reply.used;
        *limit = reply.limit;
        return 0;
    }
    *used = 0;
    for (uint32_t kind = 1; kind < GM_MEM_KIND_COUNT; kind++) *used += gm_held_get((uint32_t)gpu, kind);
    *limit = limit_of(gpu);
    return -1;
}

CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    CUresult result = GM_REAL(cuMemGetInfo_v2)(free, total);
    if (result != CUDA_SUCCESS || !gm_active() || free == NULL || total == NULL) return result;
    int gpu = gm_current_gpu(NULL);
    if (gpu < 0) return result;   /* unknown to the allocation: the real figures stand */
    uint64_t used, limit;
    gm_usage(gpu, &used, &limit);
    if (limit < *total) *total = (size_t)limit;
    uint64_t left = limit > used ? limit - used : 0;
    if (left < *free) *free = (size_t)left;
    if (*free > *total) *free = *total;
    return result;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult result = GM_REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (result != CUDA_SUCCESS || !gm_active() || bytes == NULL) return result;
    int gpu = gm_gpu_of_device(dev);
    if (gpu < 0) return result;
    uint64_t limit = limit_of(gpu);
    if (limit < *bytes) *bytes = (size_t)limit;
    return result;
}
