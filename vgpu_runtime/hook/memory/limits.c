/*
 * limits.c: cuCtxSetLimit. Several context limits are device memory that the driver reserves
 * at once, in no allocation call:
 * - CU_LIMIT_STACK_SIZE: the stack of every thread the device can hold resident, value x SMs
 *   x threads per SM (256 KiB took 66 GiB on an H200, past a 4 GiB limit);
 * - CU_LIMIT_MALLOC_HEAP_SIZE and CU_LIMIT_PRINTF_FIFO_SIZE: their value;
 * - the device runtime's sync depth and pending launch count, and limits this table does not
 *   know yet (a later CUDA's): sized by the driver alone.
 *
 * Each is charged to the container as GM_MEM_DEVICE (booked per context and limit in
 * charges.c) and refused past the limit with CUDA_ERROR_OUT_OF_MEMORY, the driver's own error.
 * What the limit held when the hook first saw it (the default 1 KiB stack: 264 MiB on an H200)
 * is in the context's measured charge already, so only more than that is charged:
 * 1. the driver's rule above (the estimate) is reserved BEFORE the call, so a value far past
 *    the limit is refused before the driver reserves anything;
 * 2. the call is measured (measure.c), and what it took past what the rule says it takes is
 *    the limit's drift, kept across calls: the charge is the rule's value plus the drift where
 *    that is positive. Where the estimate is a known rule the drift adds at most the node's
 *    context_max_bytes (device-wide readings see other processes); where there is no rule the
 *    measurement is charged whole. A negative drift is memory the rule counts that the driver
 *    has not taken: the H100 reserves a raised malloc heap only at a later launch, so setting
 *    it back frees nothing measurable, and the charge still falls to the old value's rule;
 * 3. a settlement the daemon refuses sets the old value back and returns the error.
 * Limits that hold no device memory (L2 hints, the shared-memory and CIG queries) pass through.
 */
#include "memory.h"

static int holds_memory(CUlimit limit) {
    switch (limit) {
    case CU_LIMIT_MAX_L2_FETCH_GRANULARITY:
    case CU_LIMIT_PERSISTING_L2_CACHE_SIZE:   /* a share of the L2 cache, not device memory */
    case CU_LIMIT_SHMEM_SIZE:
    case CU_LIMIT_CIG_ENABLED:
    case CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED: return 0;
    default: return limit >= 0 && limit < 64;
    }
}

static uint64_t attribute(CUdevice dev, CUdevice_attribute which) {
    int value = 0;
    if (GM_REAL(cuDeviceGetAttribute)(&value, which, dev) != CUDA_SUCCESS || value < 0) return 0;
    return (uint64_t)value;
}

/* The driver's own rule for what `value` reserves; 0 where only a measurement can say. */
static uint64_t estimate(CUlimit limit, size_t value, CUdevice dev) {
    switch (limit) {
    case CU_LIMIT_STACK_SIZE: {
        uint64_t threads = attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) *
                           attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR);
        return threads != 0 && value > UINT64_MAX / threads ? UINT64_MAX : value * threads;
    }
    case CU_LIMIT_MALLOC_HEAP_SIZE:
    case CU_LIMIT_PRINTF_FIFO_SIZE: return value;
    default: return 0;
    }
}

/* Moves the reservation from `from` bytes to `to`: 0, or -1 when the daemon refused more. */
static int settle(int gpu, uint64_t from, uint64_t to) {
    if (to > from) return gm_reserve(gpu, GM_MEM_DEVICE, to - from) == CUDA_SUCCESS ? 0 : -1;
    gm_release(gpu, GM_MEM_DEVICE, from - to);
    return 0;
}

/* What a value's rule gives above the base: the least the value is charged. */
static uint64_t above(uint64_t rule, uint64_t base) { return rule > base ? rule - base : 0; }

/* a - b, saturated to int64_t's range. */
static int64_t difference(uint64_t a, uint64_t b) {
    if (a >= b) return a - b > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)(a - b);
    return b - a > (uint64_t)INT64_MAX ? -INT64_MAX : -(int64_t)(b - a);
}

/* drift + d, saturated, and never below -floor: the driver cannot hold less than nothing. */
static int64_t drift_by(int64_t drift, int64_t d, uint64_t floor) {
    int64_t lowest = floor > (uint64_t)INT64_MAX ? -INT64_MAX : -(int64_t)floor;
    int64_t sum = d > 0 && drift > INT64_MAX - d ? INT64_MAX
                : d < 0 && drift < -INT64_MAX - d ? -INT64_MAX : drift + d;
    return sum < lowest ? lowest : sum;
}

static void book(CUcontext ctx, CUlimit limit, int gpu, uint64_t bytes, uint64_t base,
                 int64_t drift) {
    if (gm_charge_put(GM_CHARGE_LIMIT + (uint32_t)limit, (uintptr_t)ctx, ctx, gpu, bytes, base,
                      drift) < 0)
        gm_warn("out of host memory to book a context limit's %llu bytes; they stay charged "
                "until exit", (unsigned long long)bytes);
}

CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    CUcontext ctx = NULL;
    if (!gm_active() || !holds_memory(limit) ||
        GM_REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS || ctx == NULL)
        return GM_REAL(cuCtxSetLimit)(limit, value);   /* no context: the driver says so */
    CUdevice dev;
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(&dev, &error);
    if (gpu < 0) return error;
    size_t old = 0;
    if (GM_REAL(cuCtxGetLimit)(&old, limit) != CUDA_SUCCESS)
        return GM_REAL(cuCtxSetLimit)(limit, value);   /* no such limit: the driver refuses it */
    gm_measure_lock();
    int charged_gpu = gpu;
    /* The base: what the rule gives the value the context had when the hook first saw this
     * limit. The context's own charge measured that much already; only more is charged. */
    uint64_t base = UINT64_MAX;
    int64_t drift = 0;
    uint64_t before_call = gm_charge_take(GM_CHARGE_LIMIT + (uint32_t)limit, (uintptr_t)ctx,
                                          &charged_gpu, NULL, &base, &drift);
    if (base == UINT64_MAX) base = estimate(limit, old, dev);
    uint64_t rule = estimate(limit, value, dev);
    uint64_t floor = above(rule, base);   /* the least the new value costs */
    uint64_t held = before_call > floor ? before_call : floor;
    if (settle(gpu, before_call, held) < 0) {   /* refused before the driver reserves anything */
        book(ctx, limit, gpu, before_call, base, drift);
        gm_measure_unlock();
        gm_debug("context limit %d = %zu (%llu bytes) refused before setting", limit, value,
                 (unsigned long long)floor);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct gm_reading reading = GM_READING_INIT;
    uint64_t free_before = 0, free_after = 0;
    int measured = gm_free_read(&reading, dev, &free_before) == 0;
    CUresult result = GM_REAL(cuCtxSetLimit)(limit, value);
    measured = measured && result == CUDA_SUCCESS &&
               gm_free_read(&reading, dev, &free_after) == 0;
    gm_free_done(&reading);
    if (result != CUDA_SUCCESS) {
        settle(gpu, held, before_call);
        book(ctx, limit, gpu, before_call, base, drift);
        gm_measure_unlock();
        return result;
    }
    int64_t new_drift = drift;
    if (measured) {   /* what the call took, less what the rule says it takes */
        uint64_t old_floor = above(estimate(limit, old, dev), base);
        new_drift = drift_by(drift_by(drift, difference(free_before, free_after), UINT64_MAX),
                             -difference(floor, old_floor), floor);
    }
    if (rule == 0 && new_drift < 0) new_drift = 0;   /* no rule: the measurement is the charge */
    uint64_t most = rule > 0 ? gm_setting_context_max_bytes() : UINT64_MAX;
    uint64_t past = new_drift <= 0 ? 0 : (uint64_t)new_drift > most ? most : (uint64_t)new_drift;
    uint64_t charge = floor > UINT64_MAX - past ? UINT64_MAX : floor + past;
    if (settle(gpu, held, charge) < 0) {
        GM_REAL(cuCtxSetLimit)(limit, old);   /* past the limit: give the memory back */
        settle(gpu, held, before_call);
        book(ctx, limit, gpu, before_call, base, drift);
        gm_measure_unlock();
        gm_debug("context limit %d = %zu took %llu bytes: past the memory limit, set back to %zu",
                 limit, value, (unsigned long long)charge, old);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    book(ctx, limit, gpu, charge, base, new_drift);
    gm_measure_unlock();
    gm_debug("context limit %d = %zu charged %llu bytes", limit, value,
             (unsigned long long)charge);
    return CUDA_SUCCESS;
}
