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
