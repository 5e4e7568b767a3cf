/*
 * sync.c: every host synchronisation the hook watches. Each one that returns ends a kernel
 * burst (token.c); the stream and context ones also let pools release memory above their
 * threshold, so the pools are measured after them (memory/pools.c). cuMemcpy (unified
 * addressing) blocks the host whatever the direction, so it counts too.
 */
#include "hook.h"

static CUresult observed(CUresult result) {
    if (result == CUDA_SUCCESS) gm_sync_observed();
    return result;
}

static CUresult observed_pools_may_shrink(CUresult result) {
    if (result == CUDA_SUCCESS) {
        gm_sync_observed();
        gm_pools_changed();
    }
    return result;
}

CUresult cuStreamSynchronize(CUstream hStream) {
    return observed_pools_may_shrink(GM_REAL(cuStreamSynchronize)(hStream));
}

CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    return observed_pools_may_shrink(GM_REAL(cuStreamSynchronize_ptsz)(hStream));
}

CUresult cuCtxSynchronize(void) { return observed_pools_may_shrink(GM_REAL(cuCtxSynchronize)()); }

CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    return observed_pools_may_shrink(GM_REAL(cuCtxSynchronize_v2)(ctx));
}

CUresult cuEventSynchronize(CUevent hEvent) {
    return observed(GM_REAL(cuEventSynchronize)(hEvent));
}

CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return observed(GM_REAL(cuMemcpyDtoH_v2)(dstHost, srcDevice, ByteCount));
}

CUresult cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return observed(GM_REAL(cuMemcpyDtoH_v2_ptds)(dstHost, srcDevice, ByteCount));
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return observed(GM_REAL(cuMemcpy)(dst, src, ByteCount));
}

CUresult cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return observed(GM_REAL(cuMemcpy_ptds)(dst, src, ByteCount));
}
