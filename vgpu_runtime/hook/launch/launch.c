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
    CUresult refused = gm_graph_memory_check(hGraphExec);   /* memory nodes past the limit */
    if (refused != CUDA_SUCCESS) return refused;
    struct gm_launch l = {GM_LAUNCH_GRAPH, 0, hStream, (void *)GM_REAL(cuGraphLaunch),
                          .args.graph = hGraphExec};
    CUresult result = gm_gate(&l);
    if (result == CUDA_SUCCESS) gm_account_graph_memory(hStream, 0);
    return result;
}

CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    CUresult refused = gm_graph_memory_check(hGraphExec);
    if (refused != CUDA_SUCCESS) return refused;
    struct gm_launch l = {GM_LAUNCH_GRAPH, 1, hStream, (void *)GM_REAL(cuGraphLaunch_ptsz),
                          .args.graph = hGraphExec};
    CUresult result = gm_gate(&l);
    if (result == CUDA_SUCCESS) gm_account_graph_memory(hStream, 1);
    return result;
}

/* ---- the legacy launches (before CUDA 4.0, still exported by CUDA 13): the function's
 * block shape and parameters were set beforehand (cuFuncSetBlockShape, cuParamSet*); the
 * launch itself runs a kernel, so it waits for the token like any other. ---- */

#define LEGACY(which, function, w, h) \
    {.call = (which), .f = (function), .width = (w), .height = (h)}

CUresult cuLaunch(CUfunction f) {
    struct gm_launch l = {GM_LAUNCH_LEGACY, 0, NULL, (void *)GM_REAL(cuLaunch),
                          .args.legacy = LEGACY(GM_LEGACY_LAUNCH, f, 1, 1)};
    return gm_gate(&l);
}

CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
    struct gm_launch l = {GM_LAUNCH_LEGACY, 0, NULL, (void *)GM_REAL(cuLaunchGrid),
                          .args.legacy = LEGACY(GM_LEGACY_GRID, f, grid_width, grid_height)};
    return gm_gate(&l);
}

CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream) {
    struct gm_launch l = {GM_LAUNCH_LEGACY, 0, hStream, (void *)GM_REAL(cuLaunchGridAsync),
                          .args.legacy = LEGACY(GM_LEGACY_GRID_ASYNC, f, grid_width, grid_height)};
    return gm_gate(&l);
}

/* One cooperative kernel per device in one call (deprecated since CUDA 11.3, still exported by
 * 13). Each device's launch waits for that device's token: its stream's context is made
 * current while the gate looks, since the gate gates the current device. Then the driver
 * launches them all, and each is recorded against its own device's grant. */
CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList,
                                              unsigned int numDevices, unsigned int flags) {
    gm_fn_cuLaunchCooperativeKernelMultiDevice real = GM_REAL(cuLaunchCooperativeKernelMultiDevice);
    if (!gm_active() || launchParamsList == NULL || numDevices == 0)
        return real(launchParamsList, numDevices, flags);
    if (numDevices > GM_MAX_GPUS) return CUDA_ERROR_INVALID_VALUE;   /* more than any allocation */
    int gpus[GM_MAX_GPUS];
    int64_t at[GM_MAX_GPUS];
    for (unsigned int i = 0; i < numDevices; i++) {
        CUcontext ctx = NULL, popped;
        int pushed = GM_REAL(cuStreamGetCtx)(launchParamsList[i].hStream, &ctx) == CUDA_SUCCESS &&
                     ctx != NULL && GM_REAL(cuCtxPushCurrent_v2)(ctx) == CUDA_SUCCESS;
        gpus[i] = gm_token_gate(&at[i]);   /* blocks while another container holds that GPU */
        if (pushed) GM_REAL(cuCtxPopCurrent_v2)(&popped);
    }
    GM_COUNT(kernel_launches, numDevices);
    CUresult result = real(launchParamsList, numDevices, flags);
    for (unsigned int i = 0; i < numDevices; i++) {
        if (gpus[i] < 0) continue;
        struct gm_launch l = {GM_LAUNCH_COOPERATIVE, 0, launchParamsList[i].hStream, (void *)real,
                              .args.kernel = {.f = launchParamsList[i].function}};
        gm_token_launched(gpus[i], &l, at[i]);
    }
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
