/*
 * zstd.c: zstd frames, for the fatbin entries compressed with nvcc's --compress-mode=size
 * (entry flag 0x8000; checked on nvFatbin 12.9's output), unpacked by the system's libzstd
 * where the process can load one: Debian and Ubuntu images carry it, as dpkg needs it. The hook
 * carries no zstd decoder of its own (LZ4, the default, it decodes itself: lz4.c). Without
 * libzstd the entry is not read and the load is measured instead. A library the workload put in
 * its own image can only make the hook read less before loading: the measurement after it
 * still charges the load whole.
 */
#include <dlfcn.h>
#include <pthread.h>

#include "memory.h"

typedef size_t (*decompress_fn)(void *dst, size_t capacity, const void *src, size_t size);
typedef unsigned (*is_error_fn)(size_t code);

static decompress_fn decompress;
static is_error_fn is_error;
static pthread_once_t loaded = PTHREAD_ONCE_INIT;

static void load_libzstd(void) {
    void *library = dlopen("libzstd.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (library == NULL) return;
    is_error = (is_error_fn)gm_real_dlsym(library, "ZSTD_isError");
    decompress = is_error ? (decompress_fn)gm_real_dlsym(library, "ZSTD_decompress") : NULL;
}

int64_t gm_zstd_decode(const unsigned char *src, size_t n, unsigned char *dst, size_t cap) {
    pthread_once(&loaded, load_libzstd);
    if (decompress == NULL || cap > (size_t)INT64_MAX) return -1;
    size_t got = decompress(dst, cap, src, n);
    return is_error(got) || got > cap ? -1 : (int64_t)got;
}
