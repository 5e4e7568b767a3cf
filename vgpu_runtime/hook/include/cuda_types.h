/*
 * cuda_types.h: the few CUDA driver-API and NVML types the interposer needs.
 *
 * Declared here (layouts and values from the public cuda.h / nvml.h) so the hook
 * builds with gcc alone, without a CUDA toolkit. Only what the hook reads is
 * spelled out; everything else stays an opaque pointer.
 */
#ifndef GEMINI_CUDA_TYPES_H
#define GEMINI_CUDA_TYPES_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUarray_st *CUarray;
typedef struct CUevent_st *CUevent;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;   /* never read by the hook */
typedef struct CUgraphEdgeData_st CUgraphEdgeData;       /* never read by the hook */
typedef struct CUexecAffinityParam_st CUexecAffinityParam;
typedef struct CUctxCreateParams_st CUctxCreateParams;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUlinkState_st *CUlinkState;
typedef int CUlimit;
typedef int CUjit_option;
typedef int CUlibraryOption;
typedef int CUdevice_attribute;
typedef int CUgraphNodeType;
typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st CUDA_GRAPH_INSTANTIATE_PARAMS;   /* not read */

typedef struct { char bytes[16]; } CUuuid;

/* cuLaunchKernelEx's config: the hook reads only hStream. */
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef int CUarray_format;
typedef struct {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

typedef struct {
    int type;      /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct {
    int type;                  /* CUmemAllocationType */
    int requestedHandleTypes;  /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

/* cuLaunchCooperativeKernelMultiDevice's per-device launch: the hook reads function and
 * stream (each stream's context is the device it runs on). */
typedef struct {
    CUfunction function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

/* A graph memory node (CUDA_MEM_ALLOC_NODE_PARAMS_v1; the same layout in CUDA 11.4-13): the
 * hook reads bytesize and the location. CUmemPoolProps is 88 bytes in every release (its
 * reserved tail shrank as fields were added). */
typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct CUmemAccessDesc_st CUmemAccessDesc;
typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

typedef int CUmemPool_attribute;
typedef int CUgraphMem_attribute;
typedef int CUstreamCaptureStatus;
typedef int CUstreamCaptureMode;
typedef int CUdriverProcAddressQueryResult;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600

/* Stream handles with a meaning of their own. */
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

#define CU_EVENT_BLOCKING_SYNC 0x1
#define CU_EVENT_DISABLE_TIMING 0x2

#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

#define CU_STREAM_CAPTURE_STATUS_NONE 0

#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2

#define CU_MEM_LOCATION_TYPE_DEVICE 1

/* CUlimit values (cuCtxSetLimit). */
#define CU_LIMIT_STACK_SIZE 0x00
#define CU_LIMIT_PRINTF_FIFO_SIZE 0x01
#define CU_LIMIT_MALLOC_HEAP_SIZE 0x02
#define CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH 0x03
#define CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT 0x04
#define CU_LIMIT_MAX_L2_FETCH_GRANULARITY 0x05
#define CU_LIMIT_PERSISTING_L2_CACHE_SIZE 0x06
#define CU_LIMIT_SHMEM_SIZE 0x07
#define CU_LIMIT_CIG_ENABLED 0x08
#define CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED 0x09

#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39

#define CU_GRAPH_NODE_TYPE_GRAPH 4
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10

/* CUarray_format values the array size estimate knows. */
#define CU_AD_FORMAT_UNSIGNED_INT8 0x01
#define CU_AD_FORMAT_UNSIGNED_INT16 0x02
#define CU_AD_FORMAT_UNSIGNED_INT32 0x03
#define CU_AD_FORMAT_SIGNED_INT8 0x08
#define CU_AD_FORMAT_SIGNED_INT16 0x09
#define CU_AD_FORMAT_SIGNED_INT32 0x0a
#define CU_AD_FORMAT_HALF 0x10
#define CU_AD_FORMAT_FLOAT 0x20

/* ---- NVML ---- */
typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96

#endif /* GEMINI_CUDA_TYPES_H */
