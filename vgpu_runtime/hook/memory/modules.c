/*
 * modules.c: loading modules and libraries. A load reserves device memory the driver sizes
 * itself: the image's global variables (a PTX `.global` array of 4 GiB took 4 GiB past a
 * 4 GiB limit, uncounted), its code and constants.
 *
 * Each load is charged to the container as GM_MEM_DEVICE, booked with its context
 * (charges.c), and refused past the limit with CUDA_ERROR_OUT_OF_MEMORY:
 * 1. the globals read from the image (images.c) are reserved BEFORE the driver's call, so a
 *    module far past the limit is refused before the driver reserves anything;
 * 2. the call is measured (measure.c) and the charge settled to what it took (code, constants,
 *    what the image hides: a compressed fatbin), never below the globals. The measurement is
 *    not capped: a cap would let every load keep that much uncounted (a parser gap, many
 *    modules). Device-wide readings see other processes: one allocating during the load is
 *    charged to it, which errs towards refusing, never towards letting memory through;
 * 3. a settlement the daemon refuses unloads the module and returns the error.
 * Unloading releases the charge; so does the end of its context.
 *
 * cuLinkComplete builds a cubin in host memory; the device memory comes with the
 * cuModuleLoadData of that cubin, charged here. Libraries (cuLibraryLoad*, CUDA 12) are loaded
 * into the current context; with none current nothing is charged at the load, and a context
 * that loads one lazily at its first launch is not measured (the daemon's per-process figures
 * catch it where it has them).
 */
#include "memory.h"

struct load {
    uint32_t what;   /* GM_CHARGE_MODULE or GM_CHARGE_LIBRARY */
    CUcontext ctx;
    CUdevice dev;
    int gpu;
    uint64_t globals;
    int understood;
    struct gm_reading reading;
    uint64_t free_before;
    int measured;
    CUresult error;
};

/* 1: charge this load (the measure lock is then held and globals reserved); 0: pass it
 * through untouched; -1: refuse it with l->error. */
static int load_begin(struct load *l, uint32_t what, int has_output) {
    l->what = what;
    l->ctx = NULL;
    if (!gm_active() || !has_output || GM_REAL(cuCtxGetCurrent)(&l->ctx) != CUDA_SUCCESS ||
        l->ctx == NULL)
        return 0;   /* no context: nothing lands on a device now (or the driver says no) */
    l->error = CUDA_SUCCESS;
    l->gpu = gm_gpu_for_alloc(&l->dev, &l->error);
    return l->gpu < 0 ? -1 : 1;
}

/* The globals are known: reserve them, then take the first reading. */
static int load_reserve(struct load *l, uint64_t globals, int understood) {
    l->globals = globals;
    l->understood = understood;
    gm_measure_lock();
    if (globals != 0 && gm_reserve(l->gpu, GM_MEM_DEVICE, globals) != CUDA_SUCCESS) {
        gm_measure_unlock();
        gm_debug("a module whose globals take %llu bytes refused before loading",
                 (unsigned long long)globals);
        l->error = CUDA_ERROR_OUT_OF_MEMORY;
        return -1;
    }
    l->reading = (struct gm_reading)GM_READING_INIT;
    l->measured = gm_free_read(&l->reading, l->dev, &l->free_before) == 0;
    return 0;
}

static CUresult load_end(struct load *l, CUresult result, uint64_t handle,
                         CUresult (*unload)(uint64_t)) {
    uint64_t free_after = 0;
    int measured = l->measured && result == CUDA_SUCCESS &&
                   gm_free_read(&l->reading, l->dev, &free_after) == 0;
    gm_free_done(&l->reading);
    if (result != CUDA_SUCCESS) {
        gm_release(l->gpu, GM_MEM_DEVICE, l->globals);
        gm_measure_unlock();
        return result;
    }
    uint64_t charge = l->globals;
    if (measured) {
        uint64_t taken = l->free_before > free_after ? l->free_before - free_after : 0;
        charge = taken < l->globals ? l->globals : taken;
    }
    if (charge > l->globals &&
        gm_reserve(l->gpu, GM_MEM_DEVICE, charge - l->globals) != CUDA_SUCCESS) {
        unload(handle);   /* past the limit: the driver gives the memory back */
        gm_release(l->gpu, GM_MEM_DEVICE, l->globals);
        gm_measure_unlock();
        gm_debug("a module took %llu bytes: past the memory limit, unloaded",
                 (unsigned long long)charge);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (charge != 0 && gm_charge_put(l->what, handle, l->ctx, l->gpu, charge, 0, 0) < 0)
        gm_warn("out of host memory to book a module's %llu bytes; they stay charged until "
                "exit", (unsigned long long)charge);
    gm_measure_unlock();
    gm_debug("module %llx charged %llu bytes (globals %llu%s)", (unsigned long long)handle,
             (unsigned long long)charge, (unsigned long long)l->globals,
             l->understood ? "" : ", image not read whole");
    return CUDA_SUCCESS;
}

static CUresult unload_module(uint64_t handle) {
    return GM_REAL(cuModuleUnload)((CUmodule)(uintptr_t)handle);
}
static CUresult unload_library(uint64_t handle) {
    return GM_REAL(cuLibraryUnload)((CUlibrary)(uintptr_t)handle);
}

/* Run `call` charged as a load of `what` whose globals `globals_expr` reads (setting
 * `understood_`), with the handle it writes to *(out). */
#define CHARGED_LOAD(what, out, globals_expr, call, unload)                             \
    do {                                                                                \
        struct load l_;                                                                 \
        int go_ = load_begin(&l_, (what), (out) != NULL);                               \
        if (go_ == 0) return (call);                                                    \
        if (go_ < 0) return l_.error;                                                   \
        int understood_ = 0;                                                            \
        uint64_t globals_ = (globals_expr);                                             \
        if (load_reserve(&l_, globals_, understood_) < 0) return l_.error;              \
        CUresult result_ = (call);                                                      \
        uint64_t handle_ = result_ == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*(out) : 0;   \
        result_ = load_end(&l_, result_, handle_, (unload));                            \
        if (result_ == CUDA_ERROR_OUT_OF_MEMORY) *(out) = NULL;                         \
        return result_;                                                                 \
    } while (0)

CUresult cuModuleLoad(CUmodule *module, const char *fname) {
    CHARGED_LOAD(GM_CHARGE_MODULE, module, gm_image_file_globals(fname, &understood_),
                 GM_REAL(cuModuleLoad)(module, fname), unload_module);
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    CHARGED_LOAD(GM_CHARGE_MODULE, module, gm_image_globals(image, 0, &understood_),
                 GM_REAL(cuModuleLoadData)(module, image), unload_module);
}

CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                            CUjit_option *options, void **optionValues) {
    CHARGED_LOAD(GM_CHARGE_MODULE, module, gm_image_globals(image, 0, &understood_),
                 GM_REAL(cuModuleLoadDataEx)(module, image, numOptions, options, optionValues),
                 unload_module);
}

CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    CHARGED_LOAD(GM_CHARGE_MODULE, module, gm_image_globals(fatCubin, 0, &understood_),
                 GM_REAL(cuModuleLoadFatBinary)(module, fatCubin), unload_module);
}

CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                           void **jitOptionsValues, unsigned int numJitOptions,
                           CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions) {
    CHARGED_LOAD(GM_CHARGE_LIBRARY, library, gm_image_globals(code, 0, &understood_),
                 GM_REAL(cuLibraryLoadData)(library, code, jitOptions, jitOptionsValues,
                                            numJitOptions, libraryOptions, libraryOptionValues,
                                            numLibraryOptions),
                 unload_library);
}

CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               CUlibraryOption *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions) {
    CHARGED_LOAD(GM_CHARGE_LIBRARY, library, gm_image_file_globals(fileName, &understood_),
                 GM_REAL(cuLibraryLoadFromFile)(library, fileName, jitOptions, jitOptionsValues,
                                                numJitOptions, libraryOptions,
                                                libraryOptionValues, numLibraryOptions),
                 unload_library);
}

/* Unbook, unload, release; a failed unload books the charge again. */
static CUresult charged_unload(uint32_t what, uint64_t handle, CUresult (*unload)(uint64_t)) {
    if (!gm_active()) return unload(handle);
    int gpu = 0;
    CUcontext ctx = NULL;
    uint64_t bytes = gm_charge_take(what, handle, &gpu, &ctx, NULL, NULL);
    CUresult result = unload(handle);
    if (bytes == 0) return result;
    if (result == CUDA_SUCCESS) gm_release(gpu, GM_MEM_DEVICE, bytes);
    else gm_charge_put(what, handle, ctx, gpu, bytes, 0, 0);
    return result;
}

CUresult cuModuleUnload(CUmodule hmod) {
    return charged_unload(GM_CHARGE_MODULE, (uintptr_t)hmod, unload_module);
}

CUresult cuLibraryUnload(CUlibrary library) {
    return charged_unload(GM_CHARGE_LIBRARY, (uintptr_t)library, unload_library);
}
