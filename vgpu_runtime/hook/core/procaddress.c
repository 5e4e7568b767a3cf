/*
 * procaddress.c: cuGetProcAddress (4 args, CUDA 11.3+) and cuGetProcAddress_v2 (5 args,
 * CUDA 12+), through which the CUDA runtime resolves every driver entry point.
 *
 * The driver decides which variant a (name, version, flags) means: cuMemAlloc at 3020 is
 * cuMemAlloc_v2, cuLaunchKernel with the per-thread flag is cuLaunchKernel_ptsz,
 * cuGetProcAddress at 12000 is the 5-argument one. So we never guess: we ask the real
 * resolver with the same arguments and compare the pointer it returns with the real
 * pointer of every hooked symbol; the wrapper of exactly that symbol replaces it, and
 * anything else (cuGetExportTable included) is returned untouched.
 */
#include "hook.h"

static void wrap_answer(void **pfn) {
    if (pfn == NULL || *pfn == NULL) return;
    void *wrapper = gm_wrapper_for_pointer(*pfn);
    if (wrapper != *pfn) {
        *pfn = wrapper;
        GM_COUNT(wrapped_by_procaddress, 1);
    }
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    CUresult result = GM_REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    if (result == CUDA_SUCCESS) wrap_answer(pfn);
    return result;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    CUresult result = GM_REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (result == CUDA_SUCCESS) wrap_answer(pfn);
    return result;
}
