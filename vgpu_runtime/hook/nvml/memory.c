/*
 * memory.c (nvml): nvmlDeviceGetMemoryInfo and _v2 report the slice, so nvidia-smi inside
 * the container shows the limit. used = container-wide use capped at the limit; free =
 * limit - used, so nothing underflows when use passes the limit; free is never more than
 * the real free. Devices outside the allocation keep their real figures.
 */
#include <stdio.h>
#include <string.h>

#include "hook.h"

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* "GPU-6f1c2d0e-5b7a-4c39-9e8d-2a4b6c8d0e1f" -> 16 bytes; 0 on success. */
static int parse_uuid(const char *text, uint8_t out[GM_UUID_BYTES]) {
    const char *p = strncmp(text, "GPU-", 4) == 0 ? text + 4 : text;
    int n = 0;
    while (*p != '\0' && n < GM_UUID_BYTES) {
        if (*p == '-') {
            p++;
            continue;
        }
        int hi = hex_value(p[0]), lo = hi < 0 ? -1 : hex_value(p[1]);
        if (hi < 0 || lo < 0) return -1;
        out[n++] = (uint8_t)(hi << 4 | lo);
        p += 2;
    }
    return n == GM_UUID_BYTES ? 0 : -1;
}

static int gpu_of_nvml_device(nvmlDevice_t device) {
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    uint8_t uuid[GM_UUID_BYTES];
    if (GM_REAL(nvmlDeviceGetUUID)(device, text, sizeof text) != NVML_SUCCESS ||
        parse_uuid(text, uuid) != 0)
        return GM_NO_GPU;
    struct gm_grant_view grants[GM_MAX_GPUS];
    int count = gm_channel_grants(grants, GM_MAX_GPUS, 1);
    for (int i = 0; i < count; i++) {
        if (memcmp(grants[i].uuid, uuid, GM_UUID_BYTES) == 0) return i;
    }
    return GM_NO_GPU;
}

/* Rewrites total/free/used in place; 0 when the device belongs to the allocation. */
static int slice_view(nvmlDevice_t device, unsigned long long *total, unsigned long long *free,
                      unsigned long long *used) {
    int gpu = gpu_of_nvml_device(device);
    if (gpu < 0) return -1;
    uint64_t container_used, limit;
    gm_usage(gpu, &container_used, &limit);
    if (limit > *total) limit = *total;
    uint64_t shown_used = container_used < limit ? container_used : limit;
    uint64_t shown_free = limit - shown_used;
    if (shown_free > *free) shown_free = *free;
    *total = limit;
    *used = shown_used;
    *free = shown_free;
    return 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlReturn_t result = GM_REAL(nvmlDeviceGetMemoryInfo)(device, memory);
    if (result == NVML_SUCCESS && gm_active() && memory != NULL)
        slice_view(device, &memory->total, &memory->free, &memory->used);
    return result;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlReturn_t result = GM_REAL(nvmlDeviceGetMemoryInfo_v2)(device, memory);
    if (result == NVML_SUCCESS && gm_active() && memory != NULL &&
        slice_view(device, &memory->total, &memory->free, &memory->used) == 0)
        memory->reserved = 0;   /* driver-reserved memory is outside the slice */
    return result;
}
