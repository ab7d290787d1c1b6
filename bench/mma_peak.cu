/* mma_peak.cu -- the device's tensor-core peak through mma.sync, the yardstick for prefill.
 *
 * The prefill engine (ds4_cuda_gemm.cu) issues mma.sync.m16n8k16 with f16 operands and f32
 * accumulators; its TFLOP/s mean most against what that instruction can do on this device,
 * not against a datasheet number (which counts wgmma and sparsity).  This program runs, in
 * every SM at several blocks each, warps that issue only independent MMAs on register
 * operands (8 accumulators a warp, so no MMA waits for the one before), and prints the median
 * of 10 timed launches after 3 warm-up ones, 2 * 16 * 8 * 16 FLOP per f16 MMA:
 *
 *   mma_f16_tflops <value>       m16n8k16, f16 x f16 -> f32
 *   mma_s8_tops <value>          m16n8k32, s8 x s8 -> s32 (the integer path's instruction)
 *
 * Build: nvcc -O3 -arch=sm_90 bench/mma_peak.cu -o build/mma_peak  (sm_80 and later)
 * Usage: mma_peak
 */
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BENCH_NAME "mma_peak"
#include "bench_util.h"

#define WARMUP 3
#define RUNS   10
#define ACC    8          /* independent accumulators a warp */
#define ITERS  4096       /* MMAs per accumulator per launch */

__global__ void k_mma_f16(float *sink, int iters) {
    uint32_t a[4], b[2];
    const uint32_t seed = threadIdx.x * 2654435761u;
    for (int i = 0; i < 4; i++) a[i] = (seed >> i) & 0x3c003c00u;     /* small halves */
    for (int i = 0; i < 2; i++) b[i] = (seed >> (i + 5)) & 0x3c003c00u;
    float c[ACC][4] = {};
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int j = 0; j < ACC; j++)
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                         "{%0,%1,%2,%3};\n"
                         : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    float s = 0.0f;
    for (int j = 0; j < ACC; j++) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (s == 12345.0f) sink[0] = s;          /* keeps the MMAs; never true for these operands */
}

__global__ void k_mma_s8(int *sink, int iters) {
    uint32_t a[4], b[2];
    const uint32_t seed = threadIdx.x * 2654435761u;
    for (int i = 0; i < 4; i++) a[i] = (seed >> i) & 0x03030303u;
    for (int i = 0; i < 2; i++) b[i] = (seed >> (i + 5)) & 0x03030303u;
    int c[ACC][4] = {};
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int j = 0; j < ACC; j++)
            asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                         "{%0,%1,%2,%3};\n"
                         : "+r"(c[j][0]), "+r"(c[j][1]), "+r"(c[j][2]), "+r"(c[j][3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    int s = 0;
    for (int j = 0; j < ACC; j++) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (s == 0x7fffffff) sink[0] = s;
}

/* The median TFLOP/s (or TOPS) of RUNS launches of grid x 256 threads, flop_per_mma each MMA. */
template <typename K, typename T>
static double run(K kernel, T *sink, int grid, double flop_per_mma) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    double v[RUNS];
    for (int r = -WARMUP; r < RUNS; r++) {
        CHECK(cudaEventRecord(e0));
        kernel<<<grid, 256>>>(sink, ITERS);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) v[r] = (double)grid * 8 * ACC * ITERS * flop_per_mma / (ms * 1e-3) / 1e12;
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return median(v, RUNS);
}

int main(void) {
    int dev = 0, n_sm = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    void *sink;
    CHECK(cudaMalloc(&sink, 64));
    const int grid = n_sm * 8;           /* several resident blocks of 8 warps per SM */
    printf("mma_f16_tflops %.1f\n", run(k_mma_f16, (float *)sink, grid, 2.0 * 16 * 8 * 16));
    printf("mma_s8_tops %.1f\n", run(k_mma_s8, (int *)sink, grid, 2.0 * 16 * 8 * 32));
    CHECK(cudaFree(sink));
    return 0;
}
