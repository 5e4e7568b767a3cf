// Empty-kernel launch cost: launches N empty kernels back to back, syncs once, prints ns/launch.
// Usage: empty_launch [N]
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cuda_runtime.h>

__global__ void empty() {}

static double now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    for (int i = 0; i < 1000; ++i) empty<<<1, 1>>>();   // warm up: module load, first launches
    if (cudaDeviceSynchronize() != cudaSuccess) { fprintf(stderr, "warm-up failed\n"); return 1; }
    double start = now_ns();
    for (long i = 0; i < n; ++i) empty<<<1, 1>>>();
    cudaError_t err = cudaDeviceSynchronize();
    double end = now_ns();
    if (err != cudaSuccess) { fprintf(stderr, "%s\n", cudaGetErrorString(err)); return 1; }
    printf("%.3f\n", (end - start) / n);
    return 0;
}
