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
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) ||
        cuCtxSetCurrent(ctx) || cuMemAlloc(&ptr, 1 << 20)) {
        fprintf(stderr, "CUDA start failed\n");
        return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &ts);
    printf("%lld\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    cuMemFree(ptr);
    return 0;
}
