/*
 * dlsym.c: the dlsym override (README.md, "Symbol resolution"). It sits above everything: it
 * reads the name -> wrapper table (table.c), and nothing in the hook calls it.
 *
 * Rules: dlsym hands out a wrapper only for exactly the real symbol a table row hooks, and
 * RTLD_NEXT is resolved relative to the real caller, not to the hook.
 */
#include <dlfcn.h>
#include <link.h>
#include <stdlib.h>

#include "hook.h"

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
