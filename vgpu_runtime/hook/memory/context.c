/*
 * context.c: contexts. Creating one on a device outside the allocation is refused
 * (CUDA_ERROR_INVALID_DEVICE); what one costs is charged to the container.
 *
 * The cost is measured, not guessed: the device's free memory just before and just after
 * the driver creates the context. Both readings come from the same source:
 * - cuMemGetInfo, when a context on that device is already current (a second context);
 * - otherwise NVML by UUID (the usual case: the CUDA runtime retains the primary context
 *   with no context current, and cuMemGetInfo needs one).
 * With neither, the node's context_bytes setting (hello reply; default 0) is charged. The
 * readings are device-wide, so another process allocating in between skews them; a negative
 * difference counts as 0, and one context is charged at most the node's context_max_bytes
 * (1 GiB). The environment (GEMINI_HOOK_CONTEXT_BYTES, _MAX_BYTES) may only raise either: a
 * pod must not escape its context charge. Where the daemon can see per-process figures in
 * NVML, it may charge those instead; the hook reports what it measured.
 *
 * Charged as MEM_SET GM_MEM_CONTEXT (the sum over this process's contexts on that GPU):
 * it is never refused, only accounted (like graph memory); it goes with cuCtxDestroy, the
 * last cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxReset, and with the connection.
 */
#include "memory.h"

#define MAX_DEVICES 64

static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;
static int primary_refs[MAX_DEVICES];   /* retains this process holds, per device */
static CUcontext primary_ctx[MAX_DEVICES];   /* its handle: the charges made in it (charges.c) */

static uint64_t configured_cost(void) { return gm_setting_context_bytes(); }

/* The most one context is charged (the node's context_max_bytes): readings are device-wide,
 * so processes that start at the same time see each other's contexts in their difference. */
static uint64_t cost_cap(void) { return gm_setting_context_max_bytes(); }

static uint64_t measured_cost(uint64_t before, uint64_t after) {
    uint64_t cost = before > after ? before - after : 0;
    uint64_t cap = cost_cap();
    return cost < cap ? cost : cap;
}

static void charge(int gpu, int64_t delta, int may_wait) {
    if (delta == 0) return;
    uint64_t held = gm_held_get((uint32_t)gpu, GM_MEM_CONTEXT);
    uint64_t total = delta < 0 && (uint64_t)(-delta) > held ? 0 : held + (uint64_t)delta;
    struct gm_mem_reply reply;
    if (gm_channel_mem(GM_MSG_MEM_SET, (uint32_t)gpu, GM_MEM_CONTEXT, total, &reply, may_wait) ==
            0 &&
        reply.status != GM_OK)
        gm_debug("contexts (%llu bytes) take gpu %d past its memory limit",
                 (unsigned long long)total, gpu);
}

/* What `create` costs on `dev`: runs it between two readings of the device's free memory. */
#define MEASURED(dev, cost, create)                                                  \
    do {                                                                             \
        struct gm_reading reading_ = GM_READING_INIT;                                \
        uint64_t before_ = 0, after_ = 0;                                            \
        int measured_ = gm_free_read(&reading_, (dev), &before_) == 0;               \
        result = (create);                                                           \
        measured_ = measured_ && result == CUDA_SUCCESS &&                           \
                    gm_free_read(&reading_, (dev), &after_) == 0;                    \
        gm_free_done(&reading_);                                                     \
        (cost) = !measured_ ? configured_cost() : measured_cost(before_, after_);    \
    } while (0)

/* -1: pass the call through untouched; else the allocation's GPU index (refusals via *error). */
static int gpu_for_context(CUdevice dev, CUresult *error) {
    *error = CUDA_SUCCESS;
    if (!gm_active()) return -1;
    int gpu = gm_gpu_of_device(dev);
    if (gpu == GM_NO_GPU) *error = CUDA_ERROR_INVALID_DEVICE;
    return gpu;   /* GM_UNKNOWN_GPU (daemon away): created, nothing to charge it to */
}

static CUresult created(CUresult result, int gpu, CUcontext *pctx, uint64_t cost) {
    if (result != CUDA_SUCCESS || gpu < 0) return result;
    gm_ledger_put((uint64_t)(uintptr_t)*pctx, cost, KEY_CONTEXT, (uint32_t)gpu);
    gm_debug("context %p on gpu %d costs %llu bytes", (void *)*pctx, gpu,
             (unsigned long long)cost);
    charge(gpu, (int64_t)cost, 1);
    return result;
}

#define CREATE_CONTEXT(dev, call)                                  \
    do {                                                           \
        CUresult result;                                           \
        int gpu = gpu_for_context((dev), &result);                 \
        if (result != CUDA_SUCCESS) return result;                 \
        if (gpu < 0) return (call);                                \
        uint64_t cost;                                             \
        MEASURED((dev), cost, (call));                             \
        return created(result, gpu, pctx, cost);                   \
    } while (0)

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CREATE_CONTEXT(dev, GM_REAL(cuCtxCreate_v2)(pctx, flags, dev));
}

CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                        unsigned int flags, CUdevice dev) {
    CREATE_CONTEXT(dev, GM_REAL(cuCtxCreate_v3)(pctx, paramsArray, numParams, flags, dev));
}

CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                        CUdevice dev) {
    CREATE_CONTEXT(dev, GM_REAL(cuCtxCreate_v4)(pctx, ctxCreateParams, flags, dev));
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CUresult result = GM_REAL(cuCtxDestroy_v2)(ctx);
    if (result != CUDA_SUCCESS || !gm_active()) return result;
    gm_charges_context_gone(ctx);   /* its limits and modules went with it */
    uint64_t bytes = 0;
    uint32_t kind = KEY_CONTEXT, gpu = 0;
    if (gm_ledger_take((uint64_t)(uintptr_t)ctx, &bytes, &kind, &gpu))
        charge((int)gpu, -(int64_t)bytes, 0);
    return result;
}

/* ---- primary contexts: charged while this process holds at least one retain ---- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult result;
    int gpu = gpu_for_context(dev, &result);
    if (result != CUDA_SUCCESS) return result;
    if (gpu < 0) return GM_REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
    /* An allocated device past this table would go uncharged: refused instead (fails closed;
     * no node has so many GPUs). */
    if (dev < 0 || dev >= MAX_DEVICES) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&primary_lock);   /* two first retains must not both measure */
    if (primary_refs[dev] > 0) {
        result = GM_REAL(cuDevicePrimaryCtxRetain)(pctx, dev);
        if (result == CUDA_SUCCESS) {
            primary_refs[dev]++;
            primary_ctx[dev] = *pctx;
        }
        pthread_mutex_unlock(&primary_lock);
        return result;
    }
    uint64_t cost;
    MEASURED(dev, cost, GM_REAL(cuDevicePrimaryCtxRetain)(pctx, dev));
    if (result == CUDA_SUCCESS) {
        primary_refs[dev] = 1;
        primary_ctx[dev] = *pctx;
        gm_ledger_put((uint64_t)dev + 1, cost, KEY_PRIMARY, (uint32_t)gpu);
    }
    pthread_mutex_unlock(&primary_lock);
    if (result == CUDA_SUCCESS) {
        gm_debug("primary context of device %d costs %llu bytes", dev, (unsigned long long)cost);
        charge(gpu, (int64_t)cost, 1);
    }
    return result;
}

static void primary_gone(CUdevice dev, CUcontext ctx) {
    gm_charges_context_gone(ctx);   /* its limits and modules went with it */
    uint64_t bytes = 0;
    uint32_t kind = KEY_PRIMARY, gpu = 0;
    if (gm_ledger_take((uint64_t)dev + 1, &bytes, &kind, &gpu)) charge((int)gpu, -(int64_t)bytes, 0);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult result = GM_REAL(cuDevicePrimaryCtxRelease_v2)(dev);
    if (result != CUDA_SUCCESS || !gm_active() || dev < 0 || dev >= MAX_DEVICES) return result;
    pthread_mutex_lock(&primary_lock);
    int last = primary_refs[dev] > 0 && --primary_refs[dev] == 0;
    CUcontext ctx = primary_ctx[dev];
    pthread_mutex_unlock(&primary_lock);
    if (last) primary_gone(dev, ctx);
    return result;
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    CUresult result = GM_REAL(cuDevicePrimaryCtxReset_v2)(dev);
    if (result != CUDA_SUCCESS || !gm_active() || dev < 0 || dev >= MAX_DEVICES) return result;
    pthread_mutex_lock(&primary_lock);
    int held = primary_refs[dev] > 0;
    primary_refs[dev] = 0;
    CUcontext ctx = primary_ctx[dev];
    pthread_mutex_unlock(&primary_lock);
    if (held) primary_gone(dev, ctx);
    return result;
}

/* In a forked child: the parent's contexts are not the child's. */
static void contexts_after_fork(void) {
    pthread_mutex_init(&primary_lock, NULL);
    for (int i = 0; i < MAX_DEVICES; i++) {
        primary_refs[i] = 0;
        primary_ctx[i] = NULL;
    }
}
GM_AFTER_FORK(contexts_after_fork);
