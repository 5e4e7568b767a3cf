/* One process's CUDA start: init, primary context, a 1 MiB allocation. Prints the
 * CLOCK_MONOTONIC time (ns) at which it was ready, so a launcher can see when all were. */
#include <cuda.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr ptr;
    struct timespec ts;
    CUresult r;
    const char *step = "cuInit";
    if ((r = cuInit(0)) || (step = "cuDeviceGet", r = cuDeviceGet(&dev, 0)) ||
        (step = "cuDevicePrimaryCtxRetain", r = cuDevicePrimaryCtxRetain(&ctx, dev)) ||
        (step = "cuCtxSetCurrent", r = cuCtxSetCurrent(ctx)) ||
        (step = "cuMemAlloc", r = cuMemAlloc(&ptr, 1 << 20))) {
        fprintf(stderr, "CUDA start failed at %s: %d\n", step, (int)r);
        return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &ts);
    printf("%lld\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    cuMemFree(ptr);
    return 0;
}
