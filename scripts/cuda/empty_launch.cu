// Empty-kernel launch cost. Usage: empty_launch [N] [BATCH]
// Without BATCH (or 0): N empty kernels back to back, one sync at the end; prints ns per launch.
// Past the launch queue's depth the loop runs at the GPU's pace, not the host's.
// With BATCH: N launches in batches of BATCH, a sync after each batch that is not timed; prints
// the host's ns per launch call alone (the queue never fills), where an interposer's cost shows.
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
    long batch = argc > 2 ? atol(argv[2]) : 0;
    for (int i = 0; i < 1000; ++i) empty<<<1, 1>>>();   // warm up: module load, first launches
    if (cudaDeviceSynchronize() != cudaSuccess) { fprintf(stderr, "warm-up failed\n"); return 1; }
    double timed = 0;
    long launched = n;
    cudaError_t err = cudaSuccess;
    if (batch <= 0) {
        double start = now_ns();
        for (long i = 0; i < n; ++i) empty<<<1, 1>>>();
        err = cudaDeviceSynchronize();
        timed = now_ns() - start;
    } else {
        for (launched = 0; launched < n && err == cudaSuccess; launched += batch) {
            double start = now_ns();
            for (long i = 0; i < batch; ++i) empty<<<1, 1>>>();
            timed += now_ns() - start;
            err = cudaDeviceSynchronize();
        }
    }
    if (err != cudaSuccess) { fprintf(stderr, "%s\n", cudaGetErrorString(err)); return 1; }
    printf("%.3f\n", timed / launched);
    return 0;
}
