/*
 * fake_cuda.c: a stand-in libcuda.so.1 for the hook's tests (no GPU needed).
 *
 * Devices: FAKE_CUDA_UUIDS (comma-separated "GPU-<uuid>"; default one device),
 * FAKE_CUDA_TOTAL_MEM bytes each (default 16 GiB), FAKE_CUDA_CONTEXT_BYTES charged by every
 * cuCtxCreate and by a device's primary context while retained. Allocations are bookkept for real (cuMemGetInfo is consistent);
 * device pointers are invented addresses, never dereferenceable. Pools grow by 2 MiB
 * chunks and trim at synchronisation (release threshold 0) or cuMemPoolTrimTo. Graph memory:
 * cuGraphLaunch treats the graph handle's value as the bytes the graph allocates.
 * cuGetProcAddress answers by version and flags like the driver.
 *
 * GPU time (for tests of charging; off by default): fake_cuda_set_kernel_ns(ns), called
 * through ctypes, gives every later launch of the process (kernels, cooperative, Ex, graphs)
 * a duration of ns; 0 (the default) makes launches free and every call below behave as if
 * the GPU were infinitely fast. Each stream handle has a "busy until" time (CLOCK_MONOTONIC
 * ns): a launch sets it to max(now, busy until) + duration, so work queues on its stream.
 * The legacy default stream is NULL or CU_STREAM_LEGACY; a NULL stream given to a _ptsz
 * entry point is the per-thread default stream, one queue for the whole process. Streams do
 * not wait for each other (no implicit legacy-stream synchronisation). cuEventRecord takes
 * the stream's busy-until time; cuEventQuery (and cuStreamQuery for a stream) answers
 * CUDA_ERROR_NOT_READY before it, cuEventSynchronize and cuStreamSynchronize sleep until it,
 * cuCtxSynchronize(_v2) until the latest stream's. Blocking copies copy nothing and wait for nothing.
 * fake_cuda_set_copy_ns(ns) does the same for cuMemcpyHtoDAsync_v2, which the hook does not
 * gate (stream-ordered work a process queues without the token).
 * fake_cuda_busy_until(stream) says a stream's busy-until time (0 if never launched into).
 * One GPU shared by processes (FAKE_CUDA_ENGINE=<file>): every process naming the same file
 * queues its work on one engine as well, in launch order across processes (a kernel runs
 * whole once reached, as kernels of two contexts take turns on a time-sliced GPU): a launch
 * starts at max(now, its stream's busy-until, the engine's busy-until). Each piece of work's
 * [start, end) goes into a ring in the file (struct fake_engine below), from which
 * devkit/fakecuda/engine.py computes the device's utilisation as NVML samples it.
 * fake_cuda_calls(name) says how often an entry point was called.
 * Libraries loaded under CUDA_MODULE_LOADING=LAZY (the real driver's default since 12.2) take
 * their memory at the first launch after their load, in the context current then (load_pending).
 * What each process holds, for the fake NVML's running-process list of another process
 * (FAKE_CUDA_PROCESSES=<dir>): fake_processes.h.
 *
 * Built with -Bsymbolic so the pointers it hands out are its own, whatever is preloaded.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"
#include "fake_processes.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define MAX_CALL_NAMES 256
#define MAX_ALLOCS 4096
#define CHUNK (2ull << 20)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- call counters ---- */
static struct { const char *name; unsigned long count; } calls[MAX_CALL_NAMES];

static void record_call(const char *name) {
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < MAX_CALL_NAMES && calls[i].name != NULL && strcmp(calls[i].name, name) != 0) i++;
    if (i < MAX_CALL_NAMES) {
        calls[i].name = name;
        calls[i].count++;
    }
    pthread_mutex_unlock(&lock);
}
#define CALLED() record_call(__func__)

EXPORT unsigned long fake_cuda_calls(const char *name) {
    unsigned long count = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_CALL_NAMES && calls[i].name != NULL; i++)
        if (strcmp(calls[i].name, name) == 0) count = calls[i].count;
    pthread_mutex_unlock(&lock);
    return count;
}

/* ---- devices ---- */
static int device_count = -1;
static CUuuid uuids[MAX_DEVICES];
static uint64_t total_mem, context_bytes;
static uint64_t own_used[MAX_DEVICES];
static uint64_t *used_mem = own_used;   /* or the shared file's (publish_usage) */
static int current_device = -1;   /* one context per process is enough for the tests */
static int initialised;

static int hex(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* FAKE_CUDA_PROCESSES: this copy's use lives in a shared file the fake NVML reads. */
static void publish_usage(void) {
    const char *dir = getenv("FAKE_CUDA_PROCESSES");
    struct stat ns;
    if (dir == NULL || stat("/proc/self/ns/pid", &ns) != 0) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%d-%lu-%lx", dir, (int)getpid(), (unsigned long)ns.st_ino,
             (unsigned long)(uintptr_t)own_used);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) return;
    struct fake_process *shared = NULL;
    if (ftruncate(fd, sizeof *shared) == 0)
        shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (shared == NULL || shared == MAP_FAILED) return;
    shared->magic = FAKE_PROCESS_MAGIC;
    used_mem = shared->used;
}

static void load_devices(void) {
    if (device_count >= 0) return;
    _Static_assert(MAX_DEVICES == FAKE_PROCESS_DEVICES, "one slot per device");
    publish_usage();
    const char *env = getenv("FAKE_CUDA_UUIDS");
    const char *list = env ? env : "GPU-00000000-0000-4000-8000-000000000000";
    device_count = 0;
    while (*list && device_count < MAX_DEVICES) {
        if (strncmp(list, "GPU-", 4) == 0) list += 4;
        int n = 0;
        while (*list && *list != ',' && n < 16) {
            if (*list == '-') { list++; continue; }
            uuids[device_count].bytes[n++] = (char)(hex(list[0]) << 4 | hex(list[1]));
            list += 2;
        }
        device_count++;
        while (*list && *list != ',') list++;
        if (*list == ',') list++;
    }
    const char *total = getenv("FAKE_CUDA_TOTAL_MEM");
    total_mem = total ? strtoull(total, NULL, 10) : (16ull << 30);
    const char *ctx = getenv("FAKE_CUDA_CONTEXT_BYTES");
    context_bytes = ctx ? strtoull(ctx, NULL, 10) : 0;
}

/* ---- allocations: address -> (size, device); pointers are invented ---- */
static struct { uint64_t key; uint64_t bytes; int dev; int pool; } allocs[MAX_ALLOCS];
static uint64_t next_address = 0x700000000000ull;

static CUresult take_memory(int dev, uint64_t bytes) {
    if (used_mem[dev] + bytes > total_mem) return CUDA_ERROR_OUT_OF_MEMORY;
    used_mem[dev] += bytes;
    return CUDA_SUCCESS;
}

static uint64_t book(uint64_t bytes, int dev, int pool) {
    uint64_t key = next_address;
    next_address += (bytes + CHUNK - 1) / CHUNK * CHUNK + CHUNK;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].key == 0) {
            allocs[i].key = key;
            allocs[i].bytes = bytes;
            allocs[i].dev = dev;
            allocs[i].pool = pool;
            return key;
        }
    }
    return 0;
}

static int unbook(uint64_t key, uint64_t *bytes, int *dev, int *pool) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].key == key && key != 0) {
            *bytes = allocs[i].bytes;
            *dev = allocs[i].dev;
            *pool = allocs[i].pool;
            allocs[i].key = 0;
            return 1;
        }
    }
    return 0;
}

/* ---- pools: pool i+1 is device i's default pool; created pools follow ---- */
#define MAX_POOLS 128   /* pool handles are 1..MAX_POOLS; 1+d is device d's default */
static struct { int dev; uint64_t used, reserved; } pools[MAX_POOLS + 1];
static uint64_t graph_reserved[MAX_DEVICES];

static void pool_trim(int p, uint64_t keep) {
    uint64_t target = pools[p].used > keep ? pools[p].used : keep;
    target = (target + CHUNK - 1) / CHUNK * CHUNK;
    if (target < pools[p].reserved) {
        used_mem[pools[p].dev] -= pools[p].reserved - target;
        pools[p].reserved = target;
    }
}

static void trim_all_pools(void) {
    for (int p = 1; p <= MAX_POOLS; p++) if (pools[p].reserved) pool_trim(p, 0);
}

/* ================= driver entry points ================= */

EXPORT CUresult cuInit(unsigned int flags) {
    CALLED();
    pthread_mutex_lock(&lock);
    load_devices();
    initialised = 1;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *version) { CALLED(); *version = 13000; return 0; }

EXPORT CUresult cuDeviceGetCount(int *count) {
    CALLED();
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *count = device_count;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    CALLED();
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    CALLED();
    snprintf(name, (size_t)len, "Fake GPU %d", dev);
    return CUDA_SUCCESS;
}

static CUresult get_uuid(CUuuid *uuid, CUdevice dev) {
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    *uuid = uuids[dev];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { CALLED(); return get_uuid(uuid, dev); }
EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { CALLED(); return get_uuid(uuid, dev); }

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CALLED();
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = total_mem;
    return CUDA_SUCCESS;
}

/* Every cuCtxCreate costs FAKE_CUDA_CONTEXT_BYTES; a primary context costs it once, from its
 * first retain to its last release (or a reset). */
static int primary_refs[MAX_DEVICES];

static CUresult make_current(CUcontext *pctx, CUdevice dev, int primary) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    if (!primary || primary_refs[dev]++ == 0) used_mem[dev] += context_bytes;
    if (!primary) current_device = dev;   /* a retain does not make the context current */
    pthread_mutex_unlock(&lock);
    *pctx = (CUcontext)(uintptr_t)(0x1000 + dev);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CALLED();
    return make_current(pctx, dev, 0);
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CALLED();
    return make_current(pctx, dev, 1);
}
EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CALLED();
    int dev = (int)((uintptr_t)ctx - 0x1000);
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    used_mem[dev] -= context_bytes;
    if (current_device == dev) current_device = -1;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CALLED();
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    if (primary_refs[dev] > 0 && --primary_refs[dev] == 0) used_mem[dev] -= context_bytes;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    CALLED();
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    if (primary_refs[dev] > 0) used_mem[dev] -= context_bytes;
    primary_refs[dev] = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
/* What the fake NVML reports as used: the same bookkeeping, device by device. */
EXPORT unsigned long long fake_cuda_used_bytes(int dev) {
    pthread_mutex_lock(&lock);
    unsigned long long used = dev >= 0 && dev < MAX_DEVICES ? used_mem[dev] : 0;
    pthread_mutex_unlock(&lock);
    return used;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    CALLED();
    current_device = ctx ? (int)((uintptr_t)ctx - 0x1000) : -1;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetDevice(CUdevice *dev) {
    CALLED();
    if (current_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = current_device;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    CALLED();
    if (current_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    *total = total_mem;
    *free = total_mem - used_mem[current_device];
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
/* The pre-3.2 variant, with 32-bit sizes: must never be taken for the _v2 one. */
EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total) {
    CALLED();
    *free = 1;
    *total = 2;
    return CUDA_SUCCESS;
}

static CUresult alloc_plain(CUdeviceptr *dptr, uint64_t bytes) {
    if (current_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult result = take_memory(current_device, bytes);
    if (result == CUDA_SUCCESS) *dptr = book(bytes, current_device, 0);
    pthread_mutex_unlock(&lock);
    return result;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { CALLED(); return alloc_plain(dptr, bytesize); }
EXPORT CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize) {
    CALLED();   /* the 32-bit original: distinct, never hooked */
    CUdeviceptr p;
    CUresult r = alloc_plain(&p, bytesize);
    if (r == CUDA_SUCCESS) *dptr = (unsigned int)p;
    return r;
}
EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    CALLED();
    return alloc_plain(dptr, bytesize);
}
EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                   unsigned int element) {
    CALLED();
    *pitch = (width + 255) / 256 * 256;
    return alloc_plain(dptr, (uint64_t)*pitch * height);
}

static CUresult free_any(uint64_t key) {
    uint64_t bytes;
    int dev, pool;
    pthread_mutex_lock(&lock);
    int found = unbook(key, &bytes, &dev, &pool);
    if (found && pool) pools[pool].used -= bytes;
    else if (found) used_mem[dev] -= bytes;
    pthread_mutex_unlock(&lock);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { CALLED(); return free_any(dptr); }


/* ---- GPU time: per-stream "busy until" (CLOCK_MONOTONIC ns), see the header ---- */
#define MAX_STREAMS 64
static _Atomic int64_t kernel_ns;   /* duration of each later launch; 0: launches are free */
static struct { uintptr_t handle; int64_t busy_until; } streams[MAX_STREAMS];

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_until(int64_t deadline) {
    if (deadline <= 0) return;
    struct timespec ts = {(time_t)(deadline / 1000000000LL), (long)(deadline % 1000000000LL)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {}
}

/* One key per queue: NULL and CU_STREAM_LEGACY are the same (legacy) stream. */
static uintptr_t stream_key(CUstream s, int per_thread) {
    if (s == NULL) return per_thread ? (uintptr_t)CU_STREAM_PER_THREAD : (uintptr_t)CU_STREAM_LEGACY;
    return (uintptr_t)s;
}

/* Caller holds the lock. The slot of a stream, made on first use; NULL if the table is full. */
static int64_t *stream_busy(uintptr_t key, int make) {
    for (int i = 0; i < MAX_STREAMS; i++) {
        if (streams[i].handle == key) return &streams[i].busy_until;
        if (streams[i].handle == 0) {
            if (!make) return NULL;
            streams[i].handle = key;
            streams[i].busy_until = 0;
            return &streams[i].busy_until;
        }
    }
    return NULL;
}

static _Atomic int64_t copy_ns;     /* duration of each later async copy; 0: free */

/* ---- the engine shared by processes (FAKE_CUDA_ENGINE), see the header ---- */
#define FAKE_ENGINE_MAGIC 0x454E474EU   /* "ENGN" */
#define FAKE_ENGINE_RING 8192
struct fake_engine {                    /* the file's layout; engine.py reads it */
    uint32_t magic;
    uint32_t ring_size;
    _Atomic int64_t busy_until;         /* CLOCK_MONOTONIC ns */
    _Atomic uint64_t appended;          /* pieces of work so far; the latest are in the ring */
    _Atomic int64_t ring[FAKE_ENGINE_RING][2];
};
static struct fake_engine *engine;
static pthread_once_t engine_once = PTHREAD_ONCE_INIT;

static void engine_open(void) {
    const char *path = getenv("FAKE_CUDA_ENGINE");
    if (path == NULL || *path == 0) return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    if (ftruncate(fd, sizeof(struct fake_engine)) != 0) {   /* zero-filled when new */
        close(fd);
        return;
    }
    void *page = mmap(NULL, sizeof(struct fake_engine), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (page == MAP_FAILED) return;
    engine = page;
    engine->magic = FAKE_ENGINE_MAGIC;
    engine->ring_size = FAKE_ENGINE_RING;
}

/* Work ready at `ready` for `duration`: when it ends, the engine's queue taken into account. */
static int64_t engine_queue(int64_t ready, int64_t duration) {
    pthread_once(&engine_once, engine_open);
    if (engine == NULL) return ready + duration;
    int64_t seen = atomic_load(&engine->busy_until), start, end;
    do {
        start = seen > ready ? seen : ready;
        end = start + duration;
    } while (!atomic_compare_exchange_weak(&engine->busy_until, &seen, end));
    uint64_t slot = atomic_fetch_add(&engine->appended, 1) % FAKE_ENGINE_RING;
    atomic_store(&engine->ring[slot][0], start);
    atomic_store(&engine->ring[slot][1], end);
    return end;
}

static void queue_for(CUstream s, int per_thread, int64_t duration) {
    if (duration <= 0) return;
    pthread_mutex_lock(&lock);
    int64_t *busy = stream_busy(stream_key(s, per_thread), 1);
    if (busy != NULL) {
        int64_t now = monotonic_ns();
        *busy = engine_queue(*busy > now ? *busy : now, duration);
    }
    pthread_mutex_unlock(&lock);
}

static void load_pending(void);
static _Atomic int pending_libraries;   /* lazily loaded, not yet in a context */

static void queue_work(CUstream s, int per_thread) {
    load_pending();
    queue_for(s, per_thread, atomic_load(&kernel_ns));
}

static int64_t busy_until(uintptr_t key) {
    pthread_mutex_lock(&lock);
    int64_t *busy = stream_busy(key, 0);
    int64_t until = busy != NULL ? *busy : 0;
    pthread_mutex_unlock(&lock);
    return until;
}

static int64_t latest_busy_until(void) {
    int64_t latest = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_STREAMS && streams[i].handle != 0; i++)
        if (streams[i].busy_until > latest) latest = streams[i].busy_until;
    pthread_mutex_unlock(&lock);
    return latest;
}

EXPORT void fake_cuda_set_kernel_ns(long long ns) { atomic_store(&kernel_ns, ns > 0 ? ns : 0); }
EXPORT void fake_cuda_set_copy_ns(long long ns) { atomic_store(&copy_ns, ns > 0 ? ns : 0); }
EXPORT long long fake_cuda_busy_until(CUstream s) { return busy_until(stream_key(s, 0)); }

/* ---- stream-ordered pools ---- */
static CUresult pool_alloc(CUdeviceptr *dptr, uint64_t bytes, int p) {
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_SUCCESS;
    uint64_t need = pools[p].used + bytes;
    if (need > pools[p].reserved) {
        uint64_t grow = (need - pools[p].reserved + CHUNK - 1) / CHUNK * CHUNK;
        result = take_memory(pools[p].dev, grow);
        if (result == CUDA_SUCCESS) pools[p].reserved += grow;
    }
    if (result == CUDA_SUCCESS) {
        pools[p].used += bytes;
        *dptr = book(bytes, pools[p].dev, p);
    }
    pthread_mutex_unlock(&lock);
    return result;
}
static int default_pool(void) {
    if (current_device < 0) return -1;
    pools[current_device + 1].dev = current_device;
    return current_device + 1;
}
#define ASYNC_ALLOC(name)                                                            \
    EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {       \
        CALLED();                                                                     \
        int p = default_pool();                                                       \
        return p < 0 ? CUDA_ERROR_INVALID_CONTEXT : pool_alloc(dptr, bytesize, p);    \
    }
ASYNC_ALLOC(cuMemAllocAsync)
ASYNC_ALLOC(cuMemAllocAsync_ptsz)
#define POOL_ALLOC(name)                                                                       \
    EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) { \
        CALLED();                                                                              \
        int p = (int)(uintptr_t)pool;                                                          \
        return p < 1 || p > MAX_POOLS ? CUDA_ERROR_INVALID_VALUE : pool_alloc(dptr, bytesize, p); \
    }
POOL_ALLOC(cuMemAllocFromPoolAsync)
POOL_ALLOC(cuMemAllocFromPoolAsync_ptsz)
EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) { CALLED(); return free_any(dptr); }
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s) { CALLED(); return free_any(dptr); }
EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    CALLED();
    pools[dev + 1].dev = dev;
    *pool = (CUmemoryPool)(uintptr_t)(dev + 1);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    CALLED();
    int p = (int)(uintptr_t)pool;
    if (p < 1 || p > MAX_POOLS || attr != CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *(cuuint64_t *)value = pools[p].reserved;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    CALLED();
    pthread_mutex_lock(&lock);
    pool_trim((int)(uintptr_t)pool, keep);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
#define SYNC(name, params, until)         \
    EXPORT CUresult name params {         \
        CALLED();                         \
        sleep_until(until);               \
        pthread_mutex_lock(&lock);        \
        trim_all_pools();                 \
        pthread_mutex_unlock(&lock);      \
        return CUDA_SUCCESS;              \
    }
SYNC(cuStreamSynchronize, (CUstream s), busy_until(stream_key(s, 0)))
EXPORT CUresult cuStreamQuery(CUstream s) {
    CALLED();
    return monotonic_ns() < busy_until(stream_key(s, 0)) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
SYNC(cuStreamSynchronize_ptsz, (CUstream s), busy_until(stream_key(s, 1)))
SYNC(cuCtxSynchronize, (void), latest_busy_until())
SYNC(cuCtxSynchronize_v2, (CUcontext c), latest_busy_until())

/* ---- VMM and arrays ---- */
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                            const CUmemAllocationProp *prop, unsigned long long flags) {
    CALLED();
    int dev = prop->location.id;
    pthread_mutex_lock(&lock);
    CUresult result = take_memory(dev, size);
    if (result == CUDA_SUCCESS) *handle = book(size, dev, 0);
    pthread_mutex_unlock(&lock);
    return result;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { CALLED(); return free_any(handle); }
EXPORT CUresult cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *d) {
    CALLED();
    CUdeviceptr p;
    CUresult r = alloc_plain(&p, (uint64_t)d->Width * (d->Height ? d->Height : 1) * d->NumChannels);
    *array = (CUarray)(uintptr_t)p;
    return r;
}
EXPORT CUresult cuArrayDestroy(CUarray array) { CALLED(); return free_any((uintptr_t)array); }

/* ---- graphs: the exec handle's value is the memory the graph allocates ---- */
#define GRAPH_LAUNCH(name, per_thread)                                       \
    EXPORT CUresult name(CUgraphExec exec, CUstream s) {                     \
        CALLED();                                                            \
        queue_work(s, per_thread);                                           \
        uint64_t bytes = (uintptr_t)exec;                                    \
        pthread_mutex_lock(&lock);                                           \
        if (current_device >= 0 && bytes > graph_reserved[current_device]) { \
            used_mem[current_device] += bytes - graph_reserved[current_device]; \
            graph_reserved[current_device] = bytes;                          \
        }                                                                    \
        pthread_mutex_unlock(&lock);                                         \
        return CUDA_SUCCESS;                                                 \
    }
GRAPH_LAUNCH(cuGraphLaunch, 0)
GRAPH_LAUNCH(cuGraphLaunch_ptsz, 1)
EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value) {
    CALLED();
    *(cuuint64_t *)value = attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT ? graph_reserved[dev] : 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev) {
    CALLED();
    pthread_mutex_lock(&lock);
    used_mem[dev] -= graph_reserved[dev];
    graph_reserved[dev] = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- launches and capture: the stream handle 0x5eed is "capturing" once begun ---- */
static int capturing;
#define LAUNCH(name, params, stream, per_thread) \
    EXPORT CUresult name params { CALLED(); queue_work(stream, per_thread); return CUDA_SUCCESS; }
LAUNCH(cuLaunchKernel, (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shm, CUstream s, void **p, void **e), s, 0)
LAUNCH(cuLaunchKernel_ptsz, (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e),
       s, 1)
LAUNCH(cuLaunchCooperativeKernel, (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned shm, CUstream s, void **p), s, 0)
LAUNCH(cuLaunchCooperativeKernel_ptsz, (CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                        unsigned bx, unsigned by, unsigned bz, unsigned shm,
                                        CUstream s, void **p), s, 1)
LAUNCH(cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction f, void **p, void **e),
       c ? c->hStream : NULL, 0)
LAUNCH(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *c, CUfunction f, void **p, void **e),
       c ? c->hStream : NULL, 1)
EXPORT CUresult cuStreamBeginCapture_v2(CUstream s, int mode) { CALLED(); capturing = 1; return 0; }
EXPORT CUresult cuStreamEndCapture(CUstream s, CUgraph *g) { CALLED(); capturing = 0; return 0; }
static CUresult is_capturing(CUstream s, CUstreamCaptureStatus *status) {
    *status = capturing && (uintptr_t)s == 0x5eed;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) { CALLED(); return is_capturing(s, st); }
EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *st) { CALLED(); return is_capturing(s, st); }

/* ---- events (complete at their stream's busy-until time) and blocking copies ---- */
#define MAX_EVENTS 1024
static unsigned long events_live, events_made;
static int64_t event_done_at[MAX_EVENTS];   /* by handle; a handle is reused after 1024 */

static int64_t *event_slot(CUevent event) {
    return &event_done_at[((uintptr_t)event - 0xe0000) % MAX_EVENTS];
}
EXPORT CUresult cuEventCreate(CUevent *event, unsigned int flags) {
    CALLED();
    pthread_mutex_lock(&lock);
    events_live++;
    *event = (CUevent)(uintptr_t)(0xe0000 + ++events_made);
    *event_slot(*event) = 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent event, CUstream s) {
    CALLED();
    /* The hook must never record on the legacy default stream. */
    if (s == CU_STREAM_LEGACY || s == NULL) return CUDA_ERROR_INVALID_VALUE;
    int64_t until = busy_until(stream_key(s, 0));
    pthread_mutex_lock(&lock);
    *event_slot(event) = until;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
static int64_t event_done(CUevent event) {
    pthread_mutex_lock(&lock);
    int64_t done = *event_slot(event);
    pthread_mutex_unlock(&lock);
    return done;
}
EXPORT CUresult cuEventQuery(CUevent event) {
    CALLED();
    return monotonic_ns() < event_done(event) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
EXPORT CUresult cuEventSynchronize(CUevent event) {
    CALLED();
    sleep_until(event_done(event));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(CUevent event) {
    CALLED();
    pthread_mutex_lock(&lock);
    events_live--;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT unsigned long fake_cuda_events_live(void) { return events_live; }
#define COPY(name, params) EXPORT CUresult name params { CALLED(); return CUDA_SUCCESS; }
COPY(cuMemcpyDtoH_v2, (void *dst, CUdeviceptr src, size_t n))
COPY(cuMemcpyDtoH_v2_ptds, (void *dst, CUdeviceptr src, size_t n))
COPY(cuMemcpy, (CUdeviceptr dst, CUdeviceptr src, size_t n))
COPY(cuMemcpy_ptds, (CUdeviceptr dst, CUdeviceptr src, size_t n))
/* Stream-ordered work the hook does not gate (a real process queues such copies, memsets and
 * event records without the token): it takes copy_ns on its stream. */
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    CALLED();
    queue_for(s, 0, atomic_load(&copy_ns));
    return CUDA_SUCCESS;
}

/* An entry point the hook does not know: must pass through untouched. */
EXPORT CUresult cuGetExportTable(const void **table, const void *id) {
    CALLED();
    static const int export_table[4] = {0x5ec7e7, 1, 2, 3};
    *table = export_table;
    return CUDA_SUCCESS;
}

/* ================= memory the driver reserves outside allocation calls ====================
 * As the real driver does it, so the hook's tests can attack it:
 * - context limits (cuCtxSetLimit/cuCtxGetLimit, per device): CU_LIMIT_STACK_SIZE reserves
 *   value x SMs x threads per SM (FAKE_CUDA_SMS, default 132, x 2048: an H200), the malloc heap
 *   and the printf FIFO their value; the defaults (1 KiB, 8 MiB, 1 MiB) are part of the
 *   context's cost. A value the device cannot hold is CUDA_ERROR_OUT_OF_MEMORY. A raised heap
 *   is reserved at the next launch, not by the call, as on the H100 (driver 580: 1 GiB set and
 *   set back moved nothing in NVML's figure); a lowered one gives back what it held above.
 *   FAKE_CUDA_REPORTED_SMS makes cuDeviceGetAttribute report another SM count than the one
 *   the stack reservation uses (a driver that reserves more than its rule says).
 * - modules and libraries: a load reserves its image's globals (PTX text: each
 *   `.global <type> name[N]` declaration; "FAKEBIN <bytes>": an image no one else can read,
 *   as a compressed fatbin, reserving <bytes>) plus FAKE_CUDA_MODULE_BYTES (code, default 0);
 *   an unload gives it back. A library loads into the current context, if any.
 * - graphs: cuGraphAddMemAllocNode records a memory node; an instantiated graph's exec handle
 *   is the sum of its memory nodes' sizes (the convention of cuGraphLaunch above), and
 *   cuGraphUpload reserves it as a launch does.
 * - the legacy launches (cuLaunch, cuLaunchGrid, cuLaunchGridAsync,
 *   cuLaunchCooperativeKernelMultiDevice) run, taking kernel time like the others.
 */
#define FAKE_SM_THREADS 2048ull
static uint64_t limit_value[MAX_DEVICES][3] = {
    [0 ... MAX_DEVICES - 1] = {1024, 1ull << 20, 8ull << 20}};   /* stack, printf, heap */

static uint64_t heap_backed[MAX_DEVICES] = {[0 ... MAX_DEVICES - 1] = 8ull << 20};
static _Atomic int heap_pending;   /* a raised heap that no launch has reserved yet */

static uint64_t fake_sms(void) {
    const char *env = getenv("FAKE_CUDA_SMS");
    return env ? strtoull(env, NULL, 10) : 132;
}

static uint64_t limit_cost(int limit, uint64_t value) {
    return limit == CU_LIMIT_STACK_SIZE ? value * fake_sms() * FAKE_SM_THREADS : value;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    CALLED();
    *pctx = current_device < 0 ? NULL : (CUcontext)(uintptr_t)(0x1000 + current_device);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    CALLED();
    if (dev < 0 || dev >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    /* FAKE_CUDA_REPORTED_SMS: a driver whose reservation does not follow the rule it reports */
    const char *reported = getenv("FAKE_CUDA_REPORTED_SMS");
    uint64_t sms = reported ? strtoull(reported, NULL, 10) : fake_sms();
    *value = attribute == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? (int)sms
             : attribute == CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR ? (int)FAKE_SM_THREADS
             : 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetLimit(size_t *value, int limit) {
    CALLED();
    if (current_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (limit < 0 || limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE) return CUDA_ERROR_INVALID_VALUE;
    *value = limit <= CU_LIMIT_MALLOC_HEAP_SIZE ? limit_value[current_device][limit] : 0;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetLimit(int limit, size_t value) {
    CALLED();
    if (current_device < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (limit < 0 || limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE) return CUDA_ERROR_INVALID_VALUE;
    if (limit > CU_LIMIT_MALLOC_HEAP_SIZE) return CUDA_SUCCESS;   /* no memory behind it here */
    pthread_mutex_lock(&lock);
    uint64_t *held = &limit_value[current_device][limit];
    uint64_t before = limit_cost(limit, *held), after = limit_cost(limit, value);
    CUresult result = CUDA_SUCCESS;
    if (limit == CU_LIMIT_MALLOC_HEAP_SIZE) {
        uint64_t *backed = &heap_backed[current_device];
        if (value > *backed && used_mem[current_device] + (value - *backed) > total_mem)
            result = CUDA_ERROR_OUT_OF_MEMORY;
        else if (value > *backed)
            atomic_store(&heap_pending, 1);
        else {
            used_mem[current_device] -= *backed - value;
            *backed = value;
        }
    } else if (after > before) {
        result = take_memory(current_device, after - before);
    } else {
        used_mem[current_device] -= before - after;
    }
    if (result == CUDA_SUCCESS) *held = value;
    pthread_mutex_unlock(&lock);
    return result;
}

/* ---- modules and libraries ---- */
#define MAX_MODULES 256
static struct { uintptr_t handle; uint64_t bytes; int dev; int pending; } modules[MAX_MODULES];
static uintptr_t next_module = 0x30000;

static uint64_t ptx_type_bytes(const char *t) {
    if (strncmp(t, ".b8", 3) == 0 || strncmp(t, ".u8", 3) == 0 || strncmp(t, ".s8", 3) == 0) return 1;
    if (strncmp(t, ".b16", 4) == 0 || strncmp(t, ".u16", 4) == 0 || strncmp(t, ".f16", 4) == 0) return 2;
    if (strncmp(t, ".b32", 4) == 0 || strncmp(t, ".u32", 4) == 0 || strncmp(t, ".s32", 4) == 0 ||
        strncmp(t, ".f32", 4) == 0) return 4;
    if (strncmp(t, ".b64", 4) == 0 || strncmp(t, ".u64", 4) == 0 || strncmp(t, ".s64", 4) == 0 ||
        strncmp(t, ".f64", 4) == 0) return 8;
    return 0;
}

/* The device memory an image's globals take, the way the driver allocates them. */
static uint64_t image_bytes(const char *image) {
    const char *module = getenv("FAKE_CUDA_MODULE_BYTES");
    uint64_t total = module ? strtoull(module, NULL, 10) : 0;
    if (strncmp(image, "FAKEBIN ", 8) == 0) return total + strtoull(image + 8, NULL, 10);
    for (const char *p = strstr(image, ".global"); p != NULL; p = strstr(p + 7, ".global")) {
        if (p > image && p[-1] != ' ' && p[-1] != '\n' && p[-1] != '\t') continue;   /* ld.global */
        const char *line = p;
        while (line > image && line[-1] != '\n') line--;
        const char *comment = strstr(line, "//"), *external = strstr(line, ".extern");
        if ((comment != NULL && comment < p) || (external != NULL && external < p)) continue;
        const char *end = strchr(p, ';');
        if (end == NULL) break;
        uint64_t element = 0, count = 1;
        for (const char *q = p + 7; q < end; q++) {
            if (*q == '.' && ptx_type_bytes(q)) element = ptx_type_bytes(q);
            if (*q == '[') count = strtoull(q + 1, NULL, 10);
        }
        total += element * count;
    }
    return total;
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = size >= 0 ? calloc(1, (size_t)size + 1) : NULL;
    if (text != NULL && fread(text, 1, (size_t)size, f) != (size_t)size) {
        free(text);
        text = NULL;
    }
    fclose(f);
    return text;
}

/* CUDA_MODULE_LOADING=LAZY (the real driver's default since 12.2): a library takes its memory
 * in a context at the first launch there, not at its load (load_pending). */
static int lazy_libraries(void) {
    const char *mode = getenv("CUDA_MODULE_LOADING");
    return mode != NULL && strcmp(mode, "LAZY") == 0;
}

static CUresult load_image(uintptr_t *handle, const char *image, int need_context) {
    if (image == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (current_device < 0 && need_context) return CUDA_ERROR_INVALID_CONTEXT;
    int lazy = !need_context && lazy_libraries();
    uint64_t bytes = current_device < 0 && !lazy ? 0 : image_bytes(image);
    pthread_mutex_lock(&lock);
    CUresult result = bytes && !lazy ? take_memory(current_device, bytes) : CUDA_SUCCESS;
    int i = 0;
    while (result == CUDA_SUCCESS && i < MAX_MODULES && modules[i].handle != 0) i++;
    if (result == CUDA_SUCCESS && i == MAX_MODULES) {
        used_mem[current_device] -= bytes;
        result = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (result == CUDA_SUCCESS) {
        modules[i].handle = *handle = next_module++;
        modules[i].bytes = bytes;
        modules[i].dev = current_device;
        modules[i].pending = lazy;
        if (lazy) atomic_fetch_add(&pending_libraries, 1);
    }
    pthread_mutex_unlock(&lock);
    return result;
}

/* load_image of a file's contents, as cuModuleLoad and cuLibraryLoadFromFile read them. */
static CUresult load_file(uintptr_t *handle, const char *path, int need_context) {
    char *image = read_file(path);
    if (image == NULL) return CUDA_ERROR_NOT_FOUND;
    CUresult result = load_image(handle, image, need_context);
    free(image);
    return result;
}

static CUresult unload_image(uintptr_t handle) {
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < MAX_MODULES; i++) {
        if (modules[i].handle != handle || handle == 0) continue;
        if (modules[i].pending) atomic_fetch_sub(&pending_libraries, 1);
        else if (modules[i].bytes) used_mem[modules[i].dev] -= modules[i].bytes;
        modules[i].handle = 0;
        result = CUDA_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&lock);
    return result;
}

/* A launch: lazily loaded libraries take their memory in the current context now (a library
 * that does not fit stays pending, as if its kernels failed to load). */
static void load_pending(void) {
    if (atomic_load_explicit(&heap_pending, memory_order_relaxed) != 0) {
        pthread_mutex_lock(&lock);   /* a raised heap: reserved now, if it fits */
        int dev = current_device;
        if (dev >= 0 && limit_value[dev][CU_LIMIT_MALLOC_HEAP_SIZE] > heap_backed[dev] &&
            take_memory(dev, limit_value[dev][CU_LIMIT_MALLOC_HEAP_SIZE] - heap_backed[dev]) ==
                CUDA_SUCCESS) {
            heap_backed[dev] = limit_value[dev][CU_LIMIT_MALLOC_HEAP_SIZE];
            atomic_store(&heap_pending, 0);
        }
        pthread_mutex_unlock(&lock);
    }
    if (atomic_load_explicit(&pending_libraries, memory_order_relaxed) == 0) return;
    pthread_mutex_lock(&lock);
    for (int i = 0; current_device >= 0 && i < MAX_MODULES; i++) {
        if (modules[i].handle == 0 || !modules[i].pending) continue;
        if (take_memory(current_device, modules[i].bytes) == CUDA_SUCCESS) {
            modules[i].pending = 0;
            modules[i].dev = current_device;
            atomic_fetch_sub(&pending_libraries, 1);
        }
    }
    pthread_mutex_unlock(&lock);
}

EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    CALLED();
    return load_image((uintptr_t *)module, image, 1);
}
EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n,
                                   CUjit_option *options, void **values) {
    CALLED();
    return load_image((uintptr_t *)module, image, 1);
}
EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *image) {
    CALLED();
    return load_image((uintptr_t *)module, image, 1);
}
EXPORT CUresult cuModuleLoad(CUmodule *module, const char *path) {
    CALLED();
    return load_file((uintptr_t *)module, path, 1);
}
EXPORT CUresult cuModuleUnload(CUmodule module) { CALLED(); return unload_image((uintptr_t)module); }
EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *o,
                                  void **ov, unsigned int n, CUlibraryOption *lo, void **lov,
                                  unsigned int ln) {
    CALLED();
    return load_image((uintptr_t *)library, code, 0);
}
EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *path, CUjit_option *o,
                                      void **ov, unsigned int n, CUlibraryOption *lo, void **lov,
                                      unsigned int ln) {
    CALLED();
    return load_file((uintptr_t *)library, path, 0);
}
EXPORT CUresult cuLibraryUnload(CUlibrary library) { CALLED(); return unload_image((uintptr_t)library); }

/* ---- graphs built by hand: memory nodes ---- */
#define MAX_GRAPH_NODES 256
static struct { uintptr_t graph; int dev; uint64_t bytes; } graph_nodes[MAX_GRAPH_NODES];
static int graph_node_count;
static uintptr_t next_graph = 0x40000;

EXPORT CUresult cuGraphCreate(CUgraph *graph, unsigned int flags) {
    CALLED();
    pthread_mutex_lock(&lock);
    *graph = (CUgraph)next_graph++;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                       size_t n, CUDA_MEM_ALLOC_NODE_PARAMS *params) {
    CALLED();
    if (params == NULL || params->bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    CUresult result = CUDA_ERROR_OUT_OF_MEMORY;
    if (graph_node_count < MAX_GRAPH_NODES) {
        int i = graph_node_count++;
        graph_nodes[i].graph = (uintptr_t)graph;
        graph_nodes[i].dev = params->poolProps.location.id;
        graph_nodes[i].bytes = params->bytesize;
        *node = (CUgraphNode)(uintptr_t)(0x50000 + i);
        params->dptr = next_address;
        next_address += (params->bytesize + CHUNK - 1) / CHUNK * CHUNK + CHUNK;
        result = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return result;
}
EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *deps,
                                      size_t n, CUdeviceptr dptr) {
    CALLED();
    *node = (CUgraphNode)(uintptr_t)0x5ffff;   /* not a memory node: never listed */
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *count) {
    CALLED();
    size_t found = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < graph_node_count; i++) {
        if (graph_nodes[i].graph != (uintptr_t)graph) continue;
        if (nodes != NULL && found < *count) nodes[found] = (CUgraphNode)(uintptr_t)(0x50000 + i);
        found++;
    }
    pthread_mutex_unlock(&lock);
    if (nodes == NULL || found < *count) *count = found;
    return CUDA_SUCCESS;
}
static int graph_node(CUgraphNode node) {
    int i = (int)((uintptr_t)node - 0x50000);
    return i >= 0 && i < graph_node_count ? i : -1;
}
EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, int *type) {
    CALLED();
    if (graph_node(node) < 0) return CUDA_ERROR_INVALID_VALUE;
    *type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *out) {
    CALLED();
    int i = graph_node(node);
    if (i < 0) return CUDA_ERROR_INVALID_VALUE;
    memset(out, 0, sizeof *out);
    out->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    out->poolProps.location.id = graph_nodes[i].dev;
    out->bytesize = graph_nodes[i].bytes;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph,
                                            unsigned long long flags) {
    CALLED();
    uint64_t bytes = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < graph_node_count; i++)
        if (graph_nodes[i].graph == (uintptr_t)graph) bytes += graph_nodes[i].bytes;
    pthread_mutex_unlock(&lock);
    *exec = (CUgraphExec)(uintptr_t)bytes;   /* the exec handle's value is its memory */
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphExecDestroy(CUgraphExec exec) { CALLED(); return CUDA_SUCCESS; }
EXPORT CUresult cuGraphUpload(CUgraphExec exec, CUstream s) {
    CALLED();
    uint64_t bytes = (uintptr_t)exec;
    pthread_mutex_lock(&lock);
    if (current_device >= 0 && bytes > graph_reserved[current_device]) {
        used_mem[current_device] += bytes - graph_reserved[current_device];
        graph_reserved[current_device] = bytes;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* ---- the legacy launches ---- */
EXPORT CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name) {
    CALLED();
    *f = (CUfunction)(uintptr_t)0x60000;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncSetBlockShape(CUfunction f, int x, int y, int z) { CALLED(); return 0; }
EXPORT CUresult cuLaunch(CUfunction f) { CALLED(); queue_work(NULL, 0); return CUDA_SUCCESS; }
EXPORT CUresult cuLaunchGrid(CUfunction f, int w, int h) {
    CALLED();
    queue_work(NULL, 0);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s) {
    CALLED();
    queue_work(s, 0);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned int n,
                                                     unsigned int flags) {
    CALLED();
    if (list == NULL || n == 0) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned int i = 0; i < n; i++) queue_work(list[i].hStream, 0);
    return CUDA_SUCCESS;
}

/* ---- cuGetProcAddress: the answer depends on version and flags ---- */
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *status);

static const struct variant {
    const char *name;
    int min_version;      /* this row applies from this version on */
    int per_thread;       /* 1: only with the per-thread flag, 0: only without, -1: either */
    void *fn;
} variants[] = {
    /* later rows win; per-thread rows only with flag 2 */
    {"cuMemAlloc", 2000, -1, (void *)&cuMemAlloc},
    {"cuMemAlloc", 3020, -1, (void *)&cuMemAlloc_v2},
    {"cuMemGetInfo", 2000, -1, (void *)&cuMemGetInfo},
    {"cuMemGetInfo", 3020, -1, (void *)&cuMemGetInfo_v2},
    {"cuMemFree", 3020, -1, (void *)&cuMemFree_v2},
    {"cuMemAllocPitch", 3020, -1, (void *)&cuMemAllocPitch_v2},
    {"cuMemAllocManaged", 6000, -1, (void *)&cuMemAllocManaged},
    {"cuDeviceTotalMem", 3020, -1, (void *)&cuDeviceTotalMem_v2},
    {"cuCtxCreate", 3020, -1, (void *)&cuCtxCreate_v2},
    {"cuDeviceGetUuid", 9020, -1, (void *)&cuDeviceGetUuid},
    {"cuDeviceGetUuid", 11040, -1, (void *)&cuDeviceGetUuid_v2},
    {"cuLaunchKernel", 4000, 0, (void *)&cuLaunchKernel},
    {"cuLaunchKernel", 7000, 1, (void *)&cuLaunchKernel_ptsz},
    {"cuLaunchKernelEx", 11060, 0, (void *)&cuLaunchKernelEx},
    {"cuLaunchKernelEx", 11060, 1, (void *)&cuLaunchKernelEx_ptsz},
    {"cuLaunchCooperativeKernel", 9000, 0, (void *)&cuLaunchCooperativeKernel},
    {"cuLaunchCooperativeKernel", 9000, 1, (void *)&cuLaunchCooperativeKernel_ptsz},
    {"cuGraphLaunch", 10000, 0, (void *)&cuGraphLaunch},
    {"cuGraphLaunch", 10000, 1, (void *)&cuGraphLaunch_ptsz},
    {"cuMemAllocAsync", 11020, 0, (void *)&cuMemAllocAsync},
    {"cuMemAllocAsync", 11020, 1, (void *)&cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", 11020, 0, (void *)&cuMemAllocFromPoolAsync},
    {"cuMemAllocFromPoolAsync", 11020, 1, (void *)&cuMemAllocFromPoolAsync_ptsz},
    {"cuMemFreeAsync", 11020, 0, (void *)&cuMemFreeAsync},
    {"cuMemFreeAsync", 11020, 1, (void *)&cuMemFreeAsync_ptsz},
    {"cuStreamSynchronize", 2000, 0, (void *)&cuStreamSynchronize},
    {"cuStreamSynchronize", 7000, 1, (void *)&cuStreamSynchronize_ptsz},
    {"cuEventSynchronize", 2000, -1, (void *)&cuEventSynchronize},
    {"cuCtxSynchronize", 2000, -1, (void *)&cuCtxSynchronize},
    {"cuCtxSynchronize", 13000, -1, (void *)&cuCtxSynchronize_v2},   /* as CUDA 13's driver */
    {"cuMemcpyDtoH", 3020, 0, (void *)&cuMemcpyDtoH_v2},
    {"cuMemcpyDtoH", 7000, 1, (void *)&cuMemcpyDtoH_v2_ptds},
    {"cuMemcpy", 4000, 0, (void *)&cuMemcpy},
    {"cuMemcpy", 7000, 1, (void *)&cuMemcpy_ptds},
    {"cuStreamBeginCapture", 10010, 0, (void *)&cuStreamBeginCapture_v2},
    {"cuStreamEndCapture", 10000, 0, (void *)&cuStreamEndCapture},
    {"cuStreamIsCapturing", 10000, 0, (void *)&cuStreamIsCapturing},
    {"cuStreamIsCapturing", 10000, 1, (void *)&cuStreamIsCapturing_ptsz},
    {"cuGetProcAddress", 11030, -1, (void *)&cuGetProcAddress},
    {"cuGetProcAddress", 12000, -1, (void *)&cuGetProcAddress_v2},
    {"cuGetExportTable", 3000, -1, (void *)&cuGetExportTable},
    {"cuDeviceGetName", 2000, -1, (void *)&cuDeviceGetName},
    {"cuInit", 2000, -1, (void *)&cuInit},
    {"cuMemCreate", 10020, -1, (void *)&cuMemCreate},
    {"cuMemRelease", 10020, -1, (void *)&cuMemRelease},
    {"cuCtxSetLimit", 3010, -1, (void *)&cuCtxSetLimit},
    {"cuModuleLoadData", 2000, -1, (void *)&cuModuleLoadData},
    {"cuLaunchGrid", 2000, -1, (void *)&cuLaunchGrid},
};

static CUresult resolve(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status) {
    int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    void *found = NULL;
    int known = 0;
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        const struct variant *v = &variants[i];
        if (strcmp(v->name, symbol) != 0) continue;
        known = 1;
        if (version < v->min_version) continue;
        if (v->per_thread >= 0 && v->per_thread != per_thread) {
            /* a name with no per-thread variant falls back to its default one */
            int has_pt = 0;
            for (size_t j = 0; j < sizeof variants / sizeof variants[0]; j++)
                has_pt |= strcmp(variants[j].name, symbol) == 0 && variants[j].per_thread == 1;
            if (has_pt || v->per_thread == 1) continue;
        }
        found = v->fn;
    }
    *pfn = found;
    *status = found ? 0 : known ? 2 : 1;
    return found ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    CALLED();
    int status;
    return resolve(symbol, pfn, version, flags, &status);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
    CALLED();
    int st;
    CUresult r = resolve(symbol, pfn, version, flags, &st);
    if (status) *status = st;
    return r;
}
