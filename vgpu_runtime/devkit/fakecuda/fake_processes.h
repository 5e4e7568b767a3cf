/*
 * fake_processes.h: how the fake driver tells the fake NVML, in another process, what each
 * process holds (NVML's running-process list). With FAKE_CUDA_PROCESSES=<dir>, every copy of
 * the fake libcuda.so.1 (one per link-map namespace: a dlmopen'ed copy is a copy of its own)
 * keeps its per-device use in a file of that directory, mapped shared, named
 * "<pid>-<pid namespace inode>-<copy>". The fake NVML lists a process on a device while one of
 * its copies holds memory there, under the pid the reader's pid namespace gives it (a process
 * in a container's pid namespace is found through /proc/<pid>/status NSpid).
 */
#ifndef FAKE_PROCESSES_H
#define FAKE_PROCESSES_H

#include <stdint.h>

#define FAKE_PROCESS_MAGIC 0x50524F43U   /* "PROC" */
#define FAKE_PROCESS_DEVICES 8

struct fake_process {
    uint32_t magic;
    uint32_t reserved;
    uint64_t used[FAKE_PROCESS_DEVICES];   /* bytes this copy holds on each device */
};

#endif
