/*
 * table.c: the name -> wrapper table, expanded from hooks.def, the lookups that answer dlsym
 * (init.c) with a wrapper, and cuGetProcAddress itself. It names every wrapper and reads the
 * real functions (real.c); only dlsym's override calls up into it.
 *
 * cuGetProcAddress (4 args, CUDA 11.3+) and cuGetProcAddress_v2 (5 args, CUDA 12+) are how
 * the CUDA runtime resolves every driver entry point. The driver decides which variant a
 * (name, version, flags) means: cuMemAlloc at 3020 is cuMemAlloc_v2, cuLaunchKernel with the
 * per-thread flag is cuLaunchKernel_ptsz, cuGetProcAddress at 12000 is the 5-argument one.
 * So we never guess: we ask the real resolver with the same arguments and compare the
 * pointer it returns with the real pointer of every hooked symbol; the wrapper of exactly
 * that symbol replaces it, and anything else (cuGetExportTable included) is returned
 * untouched.
 */
#include <string.h>

#include "hook.h"

struct gm_entry {
    const char *name;
    enum gm_lib lib;
    void *wrapper;   /* NULL for GM_CALL rows */
};

#define GM_LIB_OF_core GM_LIB_CUDA
#define GM_LIB_OF_launch GM_LIB_CUDA
#define GM_LIB_OF_memory GM_LIB_CUDA
#define GM_LIB_OF_nvml GM_LIB_NVML

static const struct gm_entry entries[GM_ENTRY_COUNT] = {
#define GM_HOOK(name, family, ret, params, what) {#name, GM_LIB_OF_##family, (void *)&name},
#define GM_CALL(name, family, ret, params) {#name, GM_LIB_OF_##family, NULL},
#include "../hooks.def"
};

int gm_lookup_name(const char *name) {
    if (name == NULL || (name[0] != 'c' && name[0] != 'n')) return -1;   /* cu* / nvml* only */
    for (int i = 0; i < GM_ENTRY_COUNT; i++) {
        if (entries[i].wrapper != NULL && strcmp(entries[i].name, name) == 0) return i;
    }
    return -1;
}

void *gm_wrapper_for(const char *name, void *real) {
    int id = gm_lookup_name(name);
    if (id < 0 || real == NULL) return real;
    if (real == entries[id].wrapper) return real;
    void *slot = gm_real_raw((enum gm_entry_id)id);
    if (slot != NULL && slot == real) return entries[id].wrapper;
    return real;   /* another library's symbol of that name: not ours to wrap */
}

void *gm_wrapper_for_pointer(void *real) {
    if (real == NULL || !gm_real_loaded(GM_LIB_CUDA)) return real;
    for (int i = 0; i < GM_ENTRY_COUNT; i++) {
        if (entries[i].wrapper != NULL && entries[i].lib == GM_LIB_CUDA &&
            gm_real_raw((enum gm_entry_id)i) == real)
            return entries[i].wrapper;
    }
    return real;
}

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
