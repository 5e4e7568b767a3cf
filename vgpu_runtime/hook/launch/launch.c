/* launch.c: the launch entry points of hooks.def, each a thin shell around gm_gate(). */
#include "gate.h"

#define KERNEL_ARGS(fn) \
    {.f = f, .grid = {gridDimX, gridDimY, gridDimZ}, .block = {blockDimX, blockDimY, blockDimZ}, \
     .shared_mem = sharedMemBytes, .params = kernelParams, .extra = fn}

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                        unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) {
    struct gm_launch l = {GM_LAUNCH_KERNEL, 0, hStream, (void *)GM_REAL(cuLaunchKernel),
                          .args.kernel = KERNEL_ARGS(extra)};
    return gm_gate(&l);
}

CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) {
    struct gm_launch l = {GM_LAUNCH_KERNEL, 1, hStream, (void *)GM_REAL(cuLaunchKernel_ptsz),
                          .args.kernel = KERNEL_ARGS(extra)};
    return gm_gate(&l);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                   unsigned int gridDimZ, unsigned int blockDimX,
                                   unsigned int blockDimY, unsigned int blockDimZ,
                                   unsigned int sharedMemBytes, CUstream hStream,
                                   void **kernelParams) {
    struct gm_launch l = {GM_LAUNCH_COOPERATIVE, 0, hStream,
                          (void *)GM_REAL(cuLaunchCooperativeKernel),
                          .args.kernel = KERNEL_ARGS(NULL)};
    return gm_gate(&l);
}

CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                        unsigned int gridDimZ, unsigned int blockDimX,
                                        unsigned int blockDimY, unsigned int blockDimZ,
                                        unsigned int sharedMemBytes, CUstream hStream,
                                        void **kernelParams) {
    struct gm_launch l = {GM_LAUNCH_COOPERATIVE, 1, hStream,
                          (void *)GM_REAL(cuLaunchCooperativeKernel_ptsz),
                          .args.kernel = KERNEL_ARGS(NULL)};
    return gm_gate(&l);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          void **extra) {
    struct gm_launch l = {GM_LAUNCH_KERNEL_EX, 0, config ? config->hStream : NULL,
                          (void *)GM_REAL(cuLaunchKernelEx),
                          .args.ex = {config, f, kernelParams, extra}};
    return gm_gate(&l);
}

CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    struct gm_launch l = {GM_LAUNCH_KERNEL_EX, 1, config ? config->hStream : NULL,
                          (void *)GM_REAL(cuLaunchKernelEx_ptsz),
                          .args.ex = {config, f, kernelParams, extra}};
    return gm_gate(&l);
}

CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    struct gm_launch l = {GM_LAUNCH_GRAPH, 0, hStream, (void *)GM_REAL(cuGraphLaunch),
                          .args.graph = hGraphExec};
    CUresult result = gm_gate(&l);
    if (result == CUDA_SUCCESS) gm_account_graph_memory(hStream, 0);
    return result;
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    struct gm_launch l = {GM_LAUNCH_GRAPH, 1, hStream, (void *)GM_REAL(cuGraphLaunch_ptsz),
                          .args.graph = hGraphExec};
    CUresult result = gm_gate(&l);
    if (result == CUDA_SUCCESS) gm_account_graph_memory(hStream, 1);
    return result;
}

/* ---- capture bookkeeping ---- */

CUresult cuStreamBeginCapture(CUstream hStream) {
    CUresult result = GM_REAL(cuStreamBeginCapture)(hStream);
    gm_capture_opened(result);
    return result;
}

CUresult cuStreamBeginCapture_ptsz(CUstream hStream) {
    CUresult result = GM_REAL(cuStreamBeginCapture_ptsz)(hStream);
    gm_capture_opened(result);
    return result;
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    CUresult result = GM_REAL(cuStreamBeginCapture_v2)(hStream, mode);
    gm_capture_opened(result);
    return result;
}

CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    CUresult result = GM_REAL(cuStreamBeginCapture_v2_ptsz)(hStream, mode);
    gm_capture_opened(result);
    return result;
}

CUresult cuStreamBeginCaptureToGraph(CUstream hStream, CUgraph hGraph,
                                     const CUgraphNode *dependencies,
                                     const CUgraphEdgeData *dependencyData,
                                     size_t numDependencies, CUstreamCaptureMode mode) {
    CUresult result = GM_REAL(cuStreamBeginCaptureToGraph)(hStream, hGraph, dependencies,
                                                           dependencyData, numDependencies, mode);
    gm_capture_opened(result);
    return result;
}

CUresult cuStreamBeginCaptureToGraph_ptsz(CUstream hStream, CUgraph hGraph,
                                          const CUgraphNode *dependencies,
                                          const CUgraphEdgeData *dependencyData,
                                          size_t numDependencies, CUstreamCaptureMode mode) {
    CUresult result = GM_REAL(cuStreamBeginCaptureToGraph_ptsz)(
        hStream, hGraph, dependencies, dependencyData, numDependencies, mode);
    gm_capture_opened(result);
    return result;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    CUresult result = GM_REAL(cuStreamEndCapture)(hStream, phGraph);
    gm_capture_closed(result);
    return result;
}

CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    CUresult result = GM_REAL(cuStreamEndCapture_ptsz)(hStream, phGraph);
    gm_capture_closed(result);
    return result;
}
