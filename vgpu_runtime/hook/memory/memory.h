/* memory.h: helpers shared by the memory family (internal). */
#ifndef GEMINI_MEMORY_H
#define GEMINI_MEMORY_H

#include "hook.h"

/* Ledger key spaces (stored as the slot's kind, so values never collide across spaces). */
#define KEY_POINTER GM_MEM_DEVICE
#define KEY_MANAGED GM_MEM_MANAGED
#define KEY_ARRAY GM_MEM_ARRAY
#define KEY_VMM GM_MEM_VMM
#define KEY_MIPMAPPED (GM_MEM_KIND_COUNT + 1)
#define KEY_CONTEXT (GM_MEM_KIND_COUNT + 2)   /* cuCtxCreate*: the context handle */
#define KEY_PRIMARY (GM_MEM_KIND_COUNT + 3)   /* a device's primary context: the device */

/* measure.c: the device's free memory around a driver call, both readings from one source. */
enum gm_source { GM_SOURCE_NONE, GM_SOURCE_CUDA, GM_SOURCE_NVML };
struct gm_reading {
    enum gm_source source;
    nvmlDevice_t nvml;
    int nvml_open;
};
#define GM_READING_INIT {GM_SOURCE_NONE, NULL, 0}
GM_HIDDEN int gm_free_read(struct gm_reading *r, CUdevice dev, uint64_t *free);   /* 0 or -1 */
GM_HIDDEN void gm_free_done(struct gm_reading *r);
GM_HIDDEN void gm_measure_lock(void);     /* one measured reservation at a time */
GM_HIDDEN void gm_measure_unlock(void);

/* charges.c: device memory the driver reserves for a context outside allocation calls, booked
 * by (what, handle) with its context; reserved with the daemon as GM_MEM_DEVICE. */
#define GM_CHARGE_MODULE 1u
#define GM_CHARGE_LIBRARY 2u
#define GM_CHARGE_LIMIT 16u   /* + the CUlimit */
GM_HIDDEN int gm_charge_put(uint32_t what, uint64_t handle, CUcontext ctx, int gpu, uint64_t bytes,
                            uint64_t base, int64_t drift);
GM_HIDDEN uint64_t gm_charge_take(uint32_t what, uint64_t handle, int *gpu, CUcontext *ctx,
                                  uint64_t *base, int64_t *drift);
GM_HIDDEN void gm_charges_context_gone(CUcontext ctx);

/* images.c: the device memory a module image's global variables take, read from the image
 * (PTX text, ELF cubin, fatbin of those, compressed entries included). *understood = 0 where
 * some part could not be read (a zstd entry without libzstd, an unknown format): then only a
 * measurement can tell. */
GM_HIDDEN uint64_t gm_image_globals(const void *image, size_t size_hint, int *understood);
GM_HIDDEN uint64_t gm_image_file_globals(const char *path, int *understood);
/* One LZ4 block (`n` bytes at `src`) decoded into at most `cap` bytes at `dst`: the bytes
 * written, or -1 where the block is not well formed or does not fit (lz4.c). */
GM_HIDDEN int64_t gm_lz4_decode(const unsigned char *src, size_t n, unsigned char *dst,
                                size_t cap);
/* The same for one zstd frame, through the system's libzstd; -1 where there is none (zstd.c). */
GM_HIDDEN int64_t gm_zstd_decode(const unsigned char *src, size_t n, unsigned char *dst,
                                 size_t cap);

/* The GPU an allocation lands on, or a CUresult to return at once (via *error). */
GM_HIDDEN int gm_gpu_for_alloc(CUdevice *dev, CUresult *error);
GM_HIDDEN int gm_gpu_checked(int gpu, CUresult *error);
/* Ask the daemon for `bytes` more of `kind`; CUDA_SUCCESS or CUDA_ERROR_OUT_OF_MEMORY. */
GM_HIDDEN CUresult gm_reserve(int gpu, uint32_t kind, uint64_t bytes);
GM_HIDDEN void gm_release(int gpu, uint32_t kind, uint64_t bytes);
/* pools.c */
GM_HIDDEN int gm_track_pool(CUmemoryPool pool, int gpu);   /* -1: out of memory */
GM_HIDDEN int gm_account_pools(int gpu, int may_wait);   /* 0 ok, -1 refused or unreachable */
GM_HIDDEN int gm_stream_capturing(CUstream stream, int per_thread);
/* arrays.c */
GM_HIDDEN uint64_t gm_array_bytes(size_t width, size_t height, size_t depth, CUarray_format format,
                                  unsigned int channels);

#endif
