/*
 * init.c: switches, diagnostics, the real dlsym, and the dlsym override (README.md,
 * "Activation" and "Symbol resolution").
 *
 * Rules: the hook is active only where a channel exists, and a pod's mount point wins over the
 * environment; dlsym hands out a wrapper only for exactly the real symbol a table row hooks, and
 * RTLD_NEXT is resolved relative to the real caller, not to the hook.
 */
#include <dlfcn.h>
#include <link.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hook.h"

__thread int gm_in_loader;

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_ptr;
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;

static void find_real_dlsym(void) {
    real_dlsym_ptr = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (real_dlsym_ptr == NULL) real_dlsym_ptr = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", GM_GLIBC_BASE);
}

void *gm_real_dlsym(void *handle, const char *name) {
    pthread_once(&dlsym_once, find_real_dlsym);
    return real_dlsym_ptr ? real_dlsym_ptr(handle, name) : NULL;
}

/* ---- switches and diagnostics ---- */

static int active = -1;
static int debug = -1;
static const char *channel_dir;
static pthread_once_t channel_once = PTHREAD_ONCE_INIT;

static void find_channel(void) {
    struct stat st;
    if (gm_lstat(GM_POD_CHANNEL_DIR "/" GM_CHANNEL_SOCKET_NAME, &st) == 0 &&
        S_ISSOCK(st.st_mode)) {
        channel_dir = GM_POD_CHANNEL_DIR;
        return;
    }
    const char *dir = getenv("GEMINI_CHANNEL_DIR");
    if (dir != NULL && dir[0] != '\0') channel_dir = strdup(dir);
}

const char *gm_channel_dir(void) {
    pthread_once(&channel_once, find_channel);
    return channel_dir;
}

int gm_active(void) {
    int value = __atomic_load_n(&active, __ATOMIC_RELAXED);
    if (value < 0) {
        value = gm_channel_dir() != NULL;
        __atomic_store_n(&active, value, __ATOMIC_RELAXED);
        if (!value) gm_debug("no channel (" GM_POD_CHANNEL_DIR "/" GM_CHANNEL_SOCKET_NAME
                             ", GEMINI_CHANNEL_DIR): "
                             "passing every call through");
    }
    return value;
}

int64_t gm_env_number(const char *name, double scale) {
    const char *text = getenv(name);
    if (text == NULL || text[0] == '\0') return -1;
    char *end;
    double value = strtod(text, &end);
    if (*end != '\0' || !(value >= 0) || value * scale > 9e18) {
        gm_warn("%s=%s is not a number in [0, %g]; ignored", name, text, 9e18 / scale);
        return -1;
    }
    return (int64_t)(value * scale);
}

static void vlog(const char *level, const char *fmt, va_list ap) {
    char line[512];
    int n = snprintf(line, sizeof line, "gemini-hook[%d] %s: ", (int)getpid(), level);
    if (n < 0) return;
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    size_t len = strnlen(line, sizeof line - 2);
    line[len++] = '\n';
    (void)!write(2, line, len);
}

void gm_debug(const char *fmt, ...) {
    if (debug < 0) {
        const char *value = getenv("GEMINI_HOOK_DEBUG");
        debug = value != NULL && value[0] != '\0' && strcmp(value, "0") != 0;
    }
    if (!debug) return;
    va_list ap;
    va_start(ap, fmt);
    vlog("debug", fmt, ap);
    va_end(ap);
}

void gm_warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vlog("warning", fmt, ap);
    va_end(ap);
}

/* ---- dlsym(RTLD_NEXT, ...) relative to the real caller ---- */

#define MAX_OBJECTS 1024

struct object_span {
    const char *name;
    uintptr_t lo, hi;   /* lowest and highest address of its PT_LOAD segments */
};

struct link_map_copy {
    struct object_span objects[MAX_OBJECTS];
    int count;
};

static int copy_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct link_map_copy *copy = data;
    if (copy->count >= MAX_OBJECTS) return 1;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        uintptr_t start = info->dlpi_addr + ph->p_vaddr;
        if (start < lo) lo = start;
        if (start + ph->p_memsz > hi) hi = start + ph->p_memsz;
    }
    copy->objects[copy->count++] = (struct object_span){info->dlpi_name, lo, hi};
    return 0;
}

static void *next_symbol(const void *caller, const char *name) {
    static __thread struct link_map_copy *copy;   /* per thread: no lock, no stack blow-up */
    if (copy == NULL && (copy = malloc(sizeof *copy)) == NULL) return NULL;
    copy->count = 0;
    /* Copy first, look up after: dlopen must not run while dl_iterate_phdr holds its lock. */
    dl_iterate_phdr(copy_object, copy);
    uintptr_t at = (uintptr_t)caller;
    int i = 0;
    while (i < copy->count && !(copy->objects[i].lo <= at && at < copy->objects[i].hi)) i++;
    if (i == copy->count) return gm_real_dlsym(RTLD_NEXT, name);   /* caller unknown: best effort */
    for (i++; i < copy->count; i++) {
        const struct object_span *object = &copy->objects[i];
        if (object->name == NULL || object->name[0] == '\0') continue;
        void *handle = dlopen(object->name, RTLD_LAZY | RTLD_NOLOAD);
        if (handle == NULL) continue;   /* the vDSO, or gone meanwhile */
        void *symbol = gm_real_dlsym(handle, name);
        dlclose(handle);
        uintptr_t where = (uintptr_t)symbol;
        if (symbol != NULL && object->lo <= where && where < object->hi) return symbol;
    }
    return NULL;
}

GM_EXPORT void *dlsym(void *handle, const char *name) {
    void *found = handle == RTLD_NEXT ? next_symbol(__builtin_return_address(0), name)
                                      : gm_real_dlsym(handle, name);
    if (found == NULL || gm_lookup_name(name) < 0) return found;
    void *wrapper = gm_wrapper_for(name, found);
    if (wrapper != found) GM_COUNT(wrapped_by_dlsym, 1);
    return wrapper;
}
