/*
 * pools.c: memory that the driver holds on the application's behalf and that grows and
 * shrinks by itself: stream-ordered pools (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) and graph
 * memory nodes (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT).
 *
 * Both are accounted as an absolute amount per GPU (GM_MSG_MEM_SET of GM_MEM_POOL /
 * GM_MEM_GRAPH), measured after every call that can change it: allocations and frees from
 * pools, trims, and synchronisations (launch/sync.c: pools release memory above their
 * threshold there).
 * A message goes out only when the amount changed.
 *
 * A pool allocation whose growth turns out to pass the limit is undone: freed, the stream
 * synchronised, the pool trimmed back, and CUDA_ERROR_OUT_OF_MEMORY returned. Graph memory
 * is allocated by the driver at launch and cannot be refused after the fact: it is
 * accounted (so it counts against everything else) and a refusal is logged once.
 *
 * Nothing here runs for a stream that is being captured: there, allocations become graph
 * nodes and are accounted when the graph runs.
 */
#include <stdlib.h>

#include "memory.h"

/* Every pool the process allocated from, however many: a pool left out would never be
 * measured, and what it holds would escape the limit. The table grows; when it cannot, the
 * allocation is refused (fails closed). */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct pool_entry {
    CUmemoryPool pool;
    int gpu;
} *pools;
static int pool_capacity;
static _Atomic int pool_count;

int gm_track_pool(CUmemoryPool pool, int gpu) {
    if (pool == NULL) return 0;
    pthread_mutex_lock(&lock);
    int n = atomic_load(&pool_count), rc = 0;
    for (int i = 0; i < n; i++)
        if (pools[i].pool == pool) goto done;
    if (n == pool_capacity) {
        int capacity = pool_capacity == 0 ? 64 : pool_capacity < (1 << 24) ? pool_capacity * 2 : 0;
        struct pool_entry *grown =
            capacity ? realloc(pools, (size_t)capacity * sizeof *pools) : NULL;
        if (grown == NULL) {
            rc = -1;
            goto done;
        }
        pools = grown;
        pool_capacity = capacity;
    }
    pools[n].pool = pool;
    pools[n].gpu = gpu;
    atomic_store(&pool_count, n + 1);
done:
    pthread_mutex_unlock(&lock);
    return rc;
}

/* Measure the pools of `gpu` (or of every GPU for -1) and declare what changed. */
int gm_account_pools(int only_gpu, int may_wait) {
    if (atomic_load_explicit(&pool_count, memory_order_relaxed) == 0) return 0;
    uint64_t reserved[GM_MAX_GPUS] = {0};
    int seen[GM_MAX_GPUS] = {0};
    pthread_mutex_lock(&lock);
    int n = atomic_load(&pool_count);
    for (int i = 0; i < n; i++) {
        int gpu = pools[i].gpu;
        if (only_gpu >= 0 && gpu != only_gpu) continue;
        cuuint64_t value = 0;
        if (GM_REAL(cuMemPoolGetAttribute)(pools[i].pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                                           &value) == CUDA_SUCCESS)
            reserved[gpu] += value;
        seen[gpu] = 1;
    }
    pthread_mutex_unlock(&lock);
    int rc = 0;
    for (int gpu = 0; gpu < GM_MAX_GPUS; gpu++) {
        if (!seen[gpu] || reserved[gpu] == gm_held_get((uint32_t)gpu, GM_MEM_POOL)) continue;
        struct gm_mem_reply reply;
        if (gm_channel_mem(GM_MSG_MEM_SET, (uint32_t)gpu, GM_MEM_POOL, reserved[gpu], &reply,
                           may_wait) < 0 ||
            reply.status != GM_OK)
            rc = -1;
    }
    return rc;
}

int gm_stream_capturing(CUstream stream, int per_thread) {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult result = per_thread ? GM_REAL(cuStreamIsCapturing_ptsz)(stream, &status)
                                 : GM_REAL(cuStreamIsCapturing)(stream, &status);
    return result == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream,
                           int per_thread) {
    void *real = pool != NULL
                     ? (per_thread ? (void *)GM_REAL(cuMemAllocFromPoolAsync_ptsz)
                                   : (void *)GM_REAL(cuMemAllocFromPoolAsync))
                     : (per_thread ? (void *)GM_REAL(cuMemAllocAsync_ptsz)
                                   : (void *)GM_REAL(cuMemAllocAsync));
#define CALL_REAL()                                                                     \
    (pool != NULL ? ((gm_fn_cuMemAllocFromPoolAsync)real)(dptr, bytesize, pool, stream) \
                  : ((gm_fn_cuMemAllocAsync)real)(dptr, bytesize, stream))
    if (!gm_active() || dptr == NULL || gm_stream_capturing(stream, per_thread)) return CALL_REAL();
    CUdevice dev;
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(&dev, &error);
    if (gpu < 0) return error;
    CUmemoryPool used_pool = pool;
    if (used_pool == NULL && GM_REAL(cuDeviceGetMemPool)(&used_pool, dev) != CUDA_SUCCESS)
        used_pool = NULL;
    if (gm_track_pool(used_pool, gpu) < 0) {
        gm_warn("out of host memory to track memory pool %p; refusing its allocation",
                (void *)used_pool);
        GM_COUNT(mem_refused, 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    uint64_t before = gm_held_get((uint32_t)gpu, GM_MEM_POOL);
    CUresult result = CALL_REAL();
#undef CALL_REAL
    if (result != CUDA_SUCCESS) return result;
    if (gm_account_pools(gpu, 1) == 0) return CUDA_SUCCESS;
    /* Past the limit (or no daemon): undo, so the real allocation never leaks. */
    if (per_thread) {
        GM_REAL(cuMemFreeAsync_ptsz)(*dptr, stream);
        GM_REAL(cuStreamSynchronize_ptsz)(stream);
    } else {
        GM_REAL(cuMemFreeAsync)(*dptr, stream);
        GM_REAL(cuStreamSynchronize)(stream);
    }
    if (used_pool != NULL) GM_REAL(cuMemPoolTrimTo)(used_pool, before);
    gm_account_pools(gpu, 0);
    *dptr = 0;
    GM_COUNT(mem_refused, 1);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, 0);
}
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, 1);
}
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
    if (pool == NULL) return GM_REAL(cuMemAllocFromPoolAsync)(dptr, bytesize, pool, hStream);
    return pool_alloc(dptr, bytesize, pool, hStream, 0);
}
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    if (pool == NULL) return GM_REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytesize, pool, hStream);
    return pool_alloc(dptr, bytesize, pool, hStream, 1);
}

void gm_pools_changed(void) {
    if (gm_active()) gm_account_pools(-1, 0);
}

static CUresult after_pool_change(CUresult result) {
    if (result == CUDA_SUCCESS) gm_pools_changed();
    return result;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    CUresult result = GM_REAL(cuMemFreeAsync)(dptr, hStream);
    return gm_active() && gm_stream_capturing(hStream, 0) ? result : after_pool_change(result);
}
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    CUresult result = GM_REAL(cuMemFreeAsync_ptsz)(dptr, hStream);
    return gm_active() && gm_stream_capturing(hStream, 1) ? result : after_pool_change(result);
}
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    return after_pool_change(GM_REAL(cuMemPoolTrimTo)(pool, minBytesToKeep));
}
/* ---- graph memory ---- */

static void account_graph_memory(CUdevice dev) {
    int gpu = gm_gpu_of_device(dev);
    if (gpu < 0) return;
    cuuint64_t reserved = 0;
    if (GM_REAL(cuDeviceGetGraphMemAttribute)(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                                              &reserved) != CUDA_SUCCESS ||
        reserved == gm_held_get((uint32_t)gpu, GM_MEM_GRAPH))
        return;
    struct gm_mem_reply reply;
    static _Atomic int warned;
    if (gm_channel_mem(GM_MSG_MEM_SET, (uint32_t)gpu, GM_MEM_GRAPH, reserved, &reply, 0) == 0 &&
        reply.status != GM_OK && !atomic_exchange(&warned, 1))
        gm_warn("graph memory (%llu bytes) passes the memory limit; it is accounted, but a "
                "graph's memory cannot be refused after its launch",
                (unsigned long long)reserved);
}

void gm_account_graph_memory(CUstream stream, int per_thread) {
    (void)stream;
    (void)per_thread;
    if (!gm_active()) return;
    CUdevice dev;
    if (GM_REAL(cuCtxGetDevice)(&dev) == CUDA_SUCCESS) account_graph_memory(dev);
}

CUresult cuDeviceGraphMemTrim(CUdevice device) {
    CUresult result = GM_REAL(cuDeviceGraphMemTrim)(device);
    if (result == CUDA_SUCCESS && gm_active()) account_graph_memory(device);
    return result;
}
