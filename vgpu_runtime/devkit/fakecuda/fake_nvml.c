/*
 * fake_nvml.c: a stand-in libnvidia-ml.so.1. Devices and UUIDs from FAKE_CUDA_UUIDS, total
 * from FAKE_CUDA_TOTAL_MEM, used from FAKE_NVML_USED (bytes, default 0) plus what the fake
 * libcuda.so.1 holds on that device, when the process has it loaded. The running-process list
 * (nvmlDeviceGetComputeRunningProcesses_v2/_v3) is what the fake libcuda copies of every
 * process publish under FAKE_CUDA_PROCESSES (fake_processes.h); empty without it.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_types.h"
#include "fake_processes.h"

#define EXPORT __attribute__((visibility("default")))

static const char *uuid_list(void) {
    const char *env = getenv("FAKE_CUDA_UUIDS");
    return env ? env : "GPU-00000000-0000-4000-8000-000000000000";
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return NVML_SUCCESS; }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return NVML_SUCCESS; }
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

/* ---- the running-process list (fake_processes.h) ---- */

typedef struct {   /* nvmlProcessInfo_v2_t, which _v3 shares */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} fake_process_info_t;

/* The pid, in this process's pid namespace, of process `nspid` of pid namespace `ns`; -1 when
 * no such process lives (or this namespace cannot see it). */
static int visible_pid(int nspid, unsigned long ns) {
    struct stat self;
    if (stat("/proc/self/ns/pid", &self) == 0 && self.st_ino == ns)
        return kill(nspid, 0) == 0 || errno == EPERM ? nspid : -1;
    DIR *proc = opendir("/proc");
    if (proc == NULL) return -1;
    int found = -1;
    for (struct dirent *entry; found < 0 && (entry = readdir(proc)) != NULL;) {
        int pid = atoi(entry->d_name);
        char path[64], line[256];
        struct stat st;
        snprintf(path, sizeof path, "/proc/%d/ns/pid", pid);
        if (pid <= 0 || stat(path, &st) != 0 || st.st_ino != ns) continue;
        snprintf(path, sizeof path, "/proc/%d/status", pid);
        FILE *status = fopen(path, "r");
        if (status == NULL) continue;
        while (fgets(line, sizeof line, status) != NULL) {
            if (strncmp(line, "NSpid:", 6) != 0) continue;
            const char *last = strrchr(line, '\t');
            if (last != NULL && atoi(last + 1) == nspid) found = pid;
        }
        fclose(status);
    }
    closedir(proc);
    return found;
}

static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *count,
                                      fake_process_info_t *infos) {
    unsigned int index = (unsigned int)(uintptr_t)device - 1, listed = 0;
    const char *dir = getenv("FAKE_CUDA_PROCESSES");
    DIR *entries = dir && index < FAKE_PROCESS_DEVICES ? opendir(dir) : NULL;
    fake_process_info_t found[256];
    for (struct dirent *entry; entries && (entry = readdir(entries)) != NULL;) {
        int nspid;
        unsigned long ns, copy;
        if (sscanf(entry->d_name, "%d-%lu-%lx", &nspid, &ns, &copy) != 3) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, entry->d_name);
        struct fake_process record;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = pread(fd, &record, sizeof record, 0);
        close(fd);
        if (n != (ssize_t)sizeof record || record.magic != FAKE_PROCESS_MAGIC ||
            record.used[index] == 0)
            continue;
        int pid = visible_pid(nspid, ns);
        if (pid <= 0) continue;
        unsigned int i = 0;   /* a process's copies are one process to the driver */
        while (i < listed && found[i].pid != (unsigned int)pid) i++;
        if (i == listed && listed < 256)
            found[listed++] = (fake_process_info_t){(unsigned int)pid, 0, 0xFFFFFFFF, 0xFFFFFFFF};
        if (i < listed) found[i].usedGpuMemory += record.used[index];
    }
    if (entries) closedir(entries);
    if (listed == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *count < listed) {
        *count = listed;
        return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    }
    memcpy(infos, found, listed * sizeof *infos);
    *count = listed;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *count,
                                                            fake_process_info_t *infos) {
    return running_processes(device, count, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                                            unsigned int *count,
                                                            fake_process_info_t *infos) {
    return running_processes(device, count, infos);
}
