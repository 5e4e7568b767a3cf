/* cuMemAlloc + cuMemFree round trip through the driver API; prints ns per pair.
 * Usage: alloc_loop [N] [BYTES] */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

#define CHECK(call) do { CUresult r = (call); if (r != CUDA_SUCCESS) { \
    fprintf(stderr, "%s failed: %d\n", #call, (int)r); return 1; } } while (0)

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 2000;
    size_t bytes = argc > 2 ? (size_t)atoll(argv[2]) : (1u << 20);
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr ptr;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    for (int i = 0; i < 50; ++i) { CHECK(cuMemAlloc(&ptr, bytes)); CHECK(cuMemFree(ptr)); }
    double start = now_ns();
    for (long i = 0; i < n; ++i) { CHECK(cuMemAlloc(&ptr, bytes)); CHECK(cuMemFree(ptr)); }
    double end = now_ns();
    printf("%.1f\n", (end - start) / n);
    return 0;
}
