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
