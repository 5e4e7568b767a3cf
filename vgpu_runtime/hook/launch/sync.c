/*
 * sync.c: host synchronisations that end a kernel burst (see token.c), besides the stream and
 * context ones in memory/pools.c: event synchronisation and blocking copies to the host.
 * cuMemcpy (unified addressing) blocks the host whatever the direction, so it counts too.
 */
#include "hook.h"

static CUresult observed(CUresult result) {
    if (result == CUDA_SUCCESS) gm_sync_observed();
    return result;
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
