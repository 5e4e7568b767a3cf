/*
 * alloc.c: allocations and frees that carry their size (device, pitch, managed, VMM, arrays).
 *
 * Order: reserve with the daemon, then allocate for real; a failed real allocation gives
 * the reservation back, and a free releases exactly what its allocation booked. The daemon
 * is the authority on the container-wide limit; a refusal is CUDA_ERROR_OUT_OF_MEMORY,
 * which PyTorch turns into torch.cuda.OutOfMemoryError.
 */
#include "memory.h"

CUresult gm_reserve(int gpu, uint32_t kind, uint64_t bytes) {
    struct gm_mem_reply reply;
    if (gm_channel_mem(GM_MSG_MEM_RESERVE, (uint32_t)gpu, kind, bytes, &reply, 1) < 0 ||
        reply.status != GM_OK) {
        GM_COUNT(mem_refused, 1);
        gm_debug("refused %llu bytes of kind %u on gpu %d", (unsigned long long)bytes, kind, gpu);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

void gm_release(int gpu, uint32_t kind, uint64_t bytes) {
    struct gm_mem_reply reply;
    if (bytes != 0) gm_channel_mem(GM_MSG_MEM_RELEASE, (uint32_t)gpu, kind, bytes, &reply, 0);
}

/* Reserve, run the allocation, book it under (key space, *key) or give the bytes back. */
#define RESERVED_ALLOCATION(gpu, kind, space, bytes, call, key_expr)            \
    do {                                                                        \
        CUresult reserved_ = gm_reserve((gpu), (kind), (bytes));                \
        if (reserved_ != CUDA_SUCCESS) return reserved_;                        \
        CUresult result_ = (call);                                              \
        if (result_ != CUDA_SUCCESS) {                                          \
            gm_release((gpu), (kind), (bytes));                                 \
            return result_;                                                     \
        }                                                                       \
        gm_ledger_put((uint64_t)(key_expr), (bytes), (space), (uint32_t)(gpu)); \
        return CUDA_SUCCESS;                                                    \
    } while (0)

/* Unbook, run the free, release; a failed free books the allocation again. */
static CUresult booked_free(uint64_t key, uint32_t space, CUresult (*call)(uint64_t, void *),
                            void *real, int *was_booked) {
    uint64_t bytes = 0;
    uint32_t kind = space, gpu = 0;
    *was_booked = gm_ledger_take(key, &bytes, &kind, &gpu);
    CUresult result = call(key, real);
    if (!*was_booked) return result;
    uint32_t mem_kind = space == KEY_MIPMAPPED ? GM_MEM_ARRAY : space;
    if (result == CUDA_SUCCESS) gm_release((int)gpu, mem_kind, bytes);
    else gm_ledger_put(key, bytes, space, gpu);
    return result;
}

/* ---- device memory ---- */

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!gm_active() || dptr == NULL || bytesize == 0) return GM_REAL(cuMemAlloc_v2)(dptr, bytesize);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(NULL, &error);
    if (gpu < 0) return error;
    RESERVED_ALLOCATION(gpu, GM_MEM_DEVICE, KEY_POINTER, bytesize,
                        GM_REAL(cuMemAlloc_v2)(dptr, bytesize), *dptr);
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (!gm_active() || dptr == NULL || bytesize == 0)
        return GM_REAL(cuMemAllocManaged)(dptr, bytesize, flags);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(NULL, &error);
    if (gpu < 0) return error;
    RESERVED_ALLOCATION(gpu, GM_MEM_MANAGED, KEY_MANAGED, bytesize,
                        GM_REAL(cuMemAllocManaged)(dptr, bytesize, flags), *dptr);
}

/* The pitch is the driver's choice; reserve with the widest alignment in use (512 B), then
 * settle the difference once the real pitch is known. */
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes) {
    if (!gm_active() || dptr == NULL || pPitch == NULL || WidthInBytes == 0 || Height == 0)
        return GM_REAL(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(NULL, &error);
    if (gpu < 0) return error;
    uint64_t estimate = (uint64_t)((WidthInBytes + 511) / 512 * 512) * Height;
    CUresult result = gm_reserve(gpu, GM_MEM_DEVICE, estimate);
    if (result != CUDA_SUCCESS) return result;
    result = GM_REAL(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (result != CUDA_SUCCESS) {
        gm_release(gpu, GM_MEM_DEVICE, estimate);
        return result;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > estimate && gm_reserve(gpu, GM_MEM_DEVICE, actual - estimate) != CUDA_SUCCESS) {
        GM_REAL(cuMemFree_v2)(*dptr);   /* never leak the real allocation */
        gm_release(gpu, GM_MEM_DEVICE, estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate) gm_release(gpu, GM_MEM_DEVICE, estimate - actual);
    gm_ledger_put(*dptr, actual, KEY_POINTER, (uint32_t)gpu);
    return CUDA_SUCCESS;
}

static CUresult free_pointer(uint64_t key, void *real) {
    return ((gm_fn_cuMemFree_v2)real)((CUdeviceptr)key);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    if (!gm_active() || dptr == 0) return GM_REAL(cuMemFree_v2)(dptr);
    int booked;
    /* Device and managed pointers share one address space: try both key spaces. */
    uint64_t bytes = 0;
    uint32_t kind = KEY_MANAGED, gpu = 0;
    if (gm_ledger_take(dptr, &bytes, &kind, &gpu)) {
        gm_ledger_put(dptr, bytes, KEY_MANAGED, gpu);
        return booked_free(dptr, KEY_MANAGED, free_pointer, (void *)GM_REAL(cuMemFree_v2), &booked);
    }
    CUresult result = booked_free(dptr, KEY_POINTER, free_pointer, (void *)GM_REAL(cuMemFree_v2),
                                  &booked);
    /* Not booked: stream-ordered memory freed synchronously; the pools say what changed. */
    if (!booked && result == CUDA_SUCCESS) gm_account_pools(-1, 0);
    return result;
}

/* ---- VMM ---- */

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
    if (!gm_active() || handle == NULL || prop == NULL || size == 0 ||
        prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)   /* host VMM is not GPU memory */
        return GM_REAL(cuMemCreate)(handle, size, prop, flags);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_checked(gm_gpu_of_device(prop->location.id), &error);
    if (gpu < 0) return error;
    RESERVED_ALLOCATION(gpu, GM_MEM_VMM, KEY_VMM, size,
                        GM_REAL(cuMemCreate)(handle, size, prop, flags), *handle);
}

static CUresult release_vmm(uint64_t key, void *real) {
    return ((gm_fn_cuMemRelease)real)((CUmemGenericAllocationHandle)key);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    if (!gm_active()) return GM_REAL(cuMemRelease)(handle);
    int booked;
    return booked_free(handle, KEY_VMM, release_vmm, (void *)GM_REAL(cuMemRelease), &booked);
}

/* ---- arrays (sizes estimated, see arrays.c) ---- */

CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    if (!gm_active() || pHandle == NULL || desc == NULL)
        return GM_REAL(cuArrayCreate_v2)(pHandle, desc);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(NULL, &error);
    if (gpu < 0) return error;
    uint64_t bytes = gm_array_bytes(desc->Width, desc->Height, 0, desc->Format, desc->NumChannels);
    RESERVED_ALLOCATION(gpu, GM_MEM_ARRAY, KEY_ARRAY, bytes,
                        GM_REAL(cuArrayCreate_v2)(pHandle, desc), (uintptr_t)*pHandle);
}

CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    if (!gm_active() || pHandle == NULL || desc == NULL)
        return GM_REAL(cuArray3DCreate_v2)(pHandle, desc);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(NULL, &error);
    if (gpu < 0) return error;
    uint64_t bytes =
        gm_array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels);
    RESERVED_ALLOCATION(gpu, GM_MEM_ARRAY, KEY_ARRAY, bytes,
                        GM_REAL(cuArray3DCreate_v2)(pHandle, desc), (uintptr_t)*pHandle);
}

static CUresult destroy_array(uint64_t key, void *real) {
    return ((gm_fn_cuArrayDestroy)real)((CUarray)(uintptr_t)key);
}

CUresult cuArrayDestroy(CUarray hArray) {
    if (!gm_active()) return GM_REAL(cuArrayDestroy)(hArray);
    int booked;
    return booked_free((uintptr_t)hArray, KEY_ARRAY, destroy_array,
                       (void *)GM_REAL(cuArrayDestroy), &booked);
}

CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                unsigned int numMipmapLevels) {
    if (!gm_active() || pHandle == NULL || desc == NULL)
        return GM_REAL(cuMipmappedArrayCreate)(pHandle, desc, numMipmapLevels);
    CUresult error = CUDA_SUCCESS;
    int gpu = gm_gpu_for_alloc(NULL, &error);
    if (gpu < 0) return error;
    /* Every level halves each dimension (never below 1): sum the levels' estimates. */
    uint64_t bytes = 0;
    size_t w = desc->Width, h = desc->Height, d = desc->Depth;
    for (unsigned int level = 0; level < (numMipmapLevels ? numMipmapLevels : 1); level++) {
        bytes += gm_array_bytes(w, h, d, desc->Format, desc->NumChannels);
        w = w > 1 ? w / 2 : 1;
        h = h > 1 ? h / 2 : h;
        d = d > 1 ? d / 2 : d;
    }
    RESERVED_ALLOCATION(gpu, GM_MEM_ARRAY, KEY_MIPMAPPED, bytes,
                        GM_REAL(cuMipmappedArrayCreate)(pHandle, desc, numMipmapLevels),
                        (uintptr_t)*pHandle);
}

static CUresult destroy_mipmapped(uint64_t key, void *real) {
    return ((gm_fn_cuMipmappedArrayDestroy)real)((CUmipmappedArray)(uintptr_t)key);
}

CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    if (!gm_active()) return GM_REAL(cuMipmappedArrayDestroy)(hMipmappedArray);
    int booked;
    return booked_free((uintptr_t)hMipmappedArray, KEY_MIPMAPPED, destroy_mipmapped,
                       (void *)GM_REAL(cuMipmappedArrayDestroy), &booked);
}
