/*
 * real.c: the driver's real functions, one slot per hooks.def row, expanded from it.
 *
 * Real symbols are resolved lazily, once per library (pthread_once), from libcuda.so.1
 * or libnvidia-ml.so.1 through the real dlsym. A missing symbol gets a stub that answers
 * "not found", so an exported wrapper never calls through NULL. Once a library is loaded,
 * a lookup is one acquire load and an array read: every launch makes one, and the TLS read
 * and pthread_once call of the first-time path cost more than the rest of the open gate.
 * The wrappers call down to here; the name -> wrapper table (table.c) sits above both.
 */
#include <dlfcn.h>

#include "hook.h"

struct gm_real_entry {
    const char *name;
    enum gm_lib lib;
};

#define GM_LIB_OF_core GM_LIB_CUDA
#define GM_LIB_OF_launch GM_LIB_CUDA
#define GM_LIB_OF_memory GM_LIB_CUDA
#define GM_LIB_OF_nvml GM_LIB_NVML

static const struct gm_real_entry entries[GM_ENTRY_COUNT] = {
#define GM_HOOK(name, family, ret, params, what) {#name, GM_LIB_OF_##family},
#define GM_CALL(name, family, ret, params) {#name, GM_LIB_OF_##family},
#include "../hooks.def"
};

static void *slots[GM_ENTRY_COUNT];
static pthread_once_t lib_once[2] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};
static _Atomic int lib_loaded[2];   /* set (release) once that library's slots are filled */
static const char *const lib_names[2] = {"libcuda.so.1", "libnvidia-ml.so.1"};

static void load_lib(enum gm_lib lib) {
    gm_in_loader = 1;   /* dlsym calls made while the driver loads pass straight through */
    void *handle = dlopen(lib_names[lib], RTLD_LAZY | RTLD_NOLOAD);
    if (handle == NULL) handle = dlopen(lib_names[lib], RTLD_LAZY);
    if (handle == NULL) {
        gm_debug("%s not loadable: its entry points answer not-found", lib_names[lib]);
    } else {
        for (int i = 0; i < GM_ENTRY_COUNT; i++) {
            if (entries[i].lib == lib) slots[i] = gm_real_dlsym(handle, entries[i].name);
        }
    }
    gm_in_loader = 0;
    atomic_store_explicit(&lib_loaded[lib], 1, memory_order_release);
}

static void load_cuda(void) { load_lib(GM_LIB_CUDA); }
static void load_nvml(void) { load_lib(GM_LIB_NVML); }

int gm_real_loaded(enum gm_lib lib) {
    if (gm_in_loader) return 0;   /* called back from inside a load: do not wait on ourselves */
    pthread_once(&lib_once[lib], lib == GM_LIB_CUDA ? load_cuda : load_nvml);
    return 1;
}

static CUresult missing_entry(void) { return CUDA_ERROR_NOT_FOUND; }
static nvmlReturn_t missing_nvml_entry(void) { return NVML_ERROR_FUNCTION_NOT_FOUND; }

void *gm_real_raw(enum gm_entry_id id) {
    if (atomic_load_explicit(&lib_loaded[entries[id].lib], memory_order_acquire)) return slots[id];
    if (!gm_real_loaded(entries[id].lib)) return NULL;
    return slots[id];
}

void *gm_real(enum gm_entry_id id) {
    void *fn = gm_real_raw(id);
    if (fn != NULL) return fn;
    /* Both stubs return int; callers pass arguments the stub ignores, as the C ABI allows. */
    return entries[id].lib == GM_LIB_NVML ? (void *)&missing_nvml_entry : (void *)&missing_entry;
}
