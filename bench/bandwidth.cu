/* bandwidth.cu -- the device's copy bandwidth, the yardstick for decode.
 *
 * Decode reads every active weight once per token, so its speed is best
 * reported as a fraction of what the memory system can move.  This program
 * measures a plain device-to-device cudaMemcpy of 2 GiB (large against the
 * L2 cache), counts the bytes read plus the bytes written, and prints the
 * median of 10 timed copies after 3 warm-up copies:
 *
 *   copy_bw_GBps <value>
 *
 * Build: nvcc -O3 -arch=sm_90 bench/bandwidth.cu -o build/bandwidth
 * Usage: bandwidth [MiB]          (default 2048)
 */
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>

#define BENCH_NAME "bandwidth"
#include "bench_util.h"

#define WARMUP 3
#define RUNS   10

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* WARMUP copies, then RUNS timed ones (events around each); ms[] sorted; the median in ms. */
static double median_copy_ms(void *dst, const void *src, size_t n, cudaMemcpyKind kind, float *ms) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < WARMUP; i++) CHECK(cudaMemcpy(dst, src, n, kind));
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < RUNS; i++) {
        CHECK(cudaEventRecord(e0));
        CHECK(cudaMemcpy(dst, src, n, kind));
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        CHECK(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    qsort(ms, RUNS, sizeof ms[0], cmp_float);
    return 0.5 * (ms[RUNS / 2 - 1] + ms[RUNS / 2]);   /* RUNS is even */
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 2048;
    if (mib == 0) mib = 2048;
    const size_t bytes = mib << 20;

    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "bandwidth: no CUDA device available\n");
        return 1;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    CHECK(cudaSetDevice(0));

    void *src = NULL, *dst = NULL;
    CHECK(cudaMalloc(&src, bytes));
    CHECK(cudaMalloc(&dst, bytes));
    CHECK(cudaMemset(src, 1, bytes));
    CHECK(cudaMemset(dst, 0, bytes));

    float ms[RUNS];
    const double med = median_copy_ms(dst, src, bytes, cudaMemcpyDeviceToDevice, ms);
    const double gbps = 2.0 * (double)bytes / (med * 1e-3) / 1e9;  /* read + write */
    fprintf(stderr, "bandwidth: %s, %zu MiB copy, median %.3f ms (min %.3f, max %.3f)\n",
            prop.name, mib, med, ms[0], ms[RUNS - 1]);
    printf("copy_bw_GBps %.1f\n", gbps);

    /* device to pinned host memory, 256 MiB copies: the ceiling of the hook drain
     * (ds4_hooks.cu), which copies published spans of its rings into pinned staging */
    const size_t hb = (size_t)256 << 20 < bytes ? (size_t)256 << 20 : bytes;
    void *host = NULL;
    CHECK(cudaHostAlloc(&host, hb, cudaHostAllocDefault));
    const double hmed = median_copy_ms(host, src, hb, cudaMemcpyDeviceToHost, ms);
    fprintf(stderr, "bandwidth: device to pinned host, %zu MiB copy, median %.3f ms\n", hb >> 20, hmed);
    printf("d2h_pinned_GBps %.1f\n", (double)hb / (hmed * 1e-3) / 1e9);
    CHECK(cudaFreeHost(host));

    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
    return 0;
}
