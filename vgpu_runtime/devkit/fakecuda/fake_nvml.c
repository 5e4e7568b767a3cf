/*
 * fake_nvml.c: a stand-in libnvidia-ml.so.1. Devices and UUIDs from FAKE_CUDA_UUIDS, total
 * from FAKE_CUDA_TOTAL_MEM, used from FAKE_NVML_USED (bytes, default 0) plus what the fake
 * libcuda.so.1 holds on that device, when the process has it loaded.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_types.h"

#define EXPORT __attribute__((visibility("default")))

static const char *uuid_list(void) {
    const char *env = getenv("FAKE_CUDA_UUIDS");
    return env ? env : "GPU-00000000-0000-4000-8000-000000000000";
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    *device = (nvmlDevice_t)(uintptr_t)(index + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *out, unsigned int length) {
    unsigned int index = (unsigned int)(uintptr_t)device - 1;
    const char *p = uuid_list();
    for (unsigned int i = 0; i < index && p; i++) {
        p = strchr(p, ',');
        if (p) p++;
    }
    if (p == NULL) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    size_t n = strcspn(p, ",");
    if (n + 1 > length) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    memcpy(out, p, n);
    out[n] = '\0';
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    const char *p = uuid_list();
    size_t n = strlen(uuid);
    for (unsigned int index = 0; p && *p; index++) {
        if (strncmp(p, uuid, n) == 0 && (p[n] == ',' || p[n] == '\0')) {
            *device = (nvmlDevice_t)(uintptr_t)(index + 1);
            return NVML_SUCCESS;
        }
        p = strchr(p, ',');
        if (p) p++;
    }
    return 6; /* NVML_ERROR_NOT_FOUND */
}

static unsigned long long cuda_used(nvmlDevice_t device) {
    void *cuda = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (cuda == NULL) return 0;
    unsigned long long (*used)(int) = (unsigned long long (*)(int))dlsym(cuda, "fake_cuda_used_bytes");
    unsigned long long bytes = used ? used((int)(uintptr_t)device - 1) : 0;
    dlclose(cuda);
    return bytes;
}

static void figures(nvmlDevice_t device, unsigned long long *total, unsigned long long *free,
                    unsigned long long *used) {
    const char *t = getenv("FAKE_CUDA_TOTAL_MEM");
    const char *u = getenv("FAKE_NVML_USED");
    *total = t ? strtoull(t, NULL, 10) : (16ull << 30);
    *used = (u ? strtoull(u, NULL, 10) : 0) + cuda_used(device);
    *free = *total - *used;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    figures(device, &memory->total, &memory->free, &memory->used);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    figures(device, &memory->total, &memory->free, &memory->used);
    memory->reserved = 0;
    return NVML_SUCCESS;
}
