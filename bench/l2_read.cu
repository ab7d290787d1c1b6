/* l2_read.cu -- how fast the SMs can read from L2, the ceiling of k_tc_wgmma's copies.
 *
 * The prefill product kernel (ds4_cuda_gemm.cu) reads each stage's weights and activation
 * parts from L2 with cp.async, 33 KB per block and stage.  How fast the L2 can deliver that is
 * what this program measures, on a buffer that fits in L2 (MiB, default 24) and, for scale, on
 * one that does not (2 GiB):
 *   - ldcg: every thread of 2 blocks of 256 per SM loads 16-byte words with ld.global.cg (L2,
 *     not L1) over the buffer, grid-stride, PASSES passes;
 *   - cpasync: the same blocks copy the buffer into shared memory in 32 KiB stages with 16-byte
 *     cp.async, three stages in flight (the product kernel's pattern, without its MMAs).
 * Each prints the median of RUNS timed launches after a warm-up one, in TB/s of bytes read:
 *
 *   l2_ldcg_TBps <v>   l2_cpasync_TBps <v>   dram_ldcg_TBps <v>   dram_cpasync_TBps <v>
 *
 * Build: make build/cuda-sm_90/l2_read CUDA_ARCH=sm_90
 * Usage: l2_read [MiB]
 */
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BENCH_NAME "l2_read"
#include "bench_util.h"

#define THREADS 256
#define RUNS    9
#define STAGE   (32 * 1024)
#define NST     3

__global__ void __launch_bounds__(THREADS) k_ldcg(const uint4 *buf, size_t n16, int passes, uint4 *sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const size_t stride = (size_t)gridDim.x * THREADS;
    for (int p = 0; p < passes; p++)
        for (size_t i = (size_t)blockIdx.x * THREADS + threadIdx.x; i < n16; i += stride) {
            const uint4 v = __ldcg(buf + i);
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
        }
    if (acc.x == 0x12345678u && acc.y == 0x9abcdef0u) sink[0] = acc;   /* never: keeps the loads */
}

__device__ __forceinline__ void cp16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(src)
                 : "memory");
}

/* Block b copies stages b, b + grid, ... of the buffer (STAGE bytes each) into an NST-deep ring,
 * each thread its 16-byte pieces, and reads one word of each landed stage. */
__global__ void __launch_bounds__(THREADS) k_cpasync(const uint8_t *buf, size_t nstage, int passes, uint4 *sink) {
    extern __shared__ __align__(16) uint8_t sm[];
    uint32_t acc = 0;
    const size_t per = (nstage + gridDim.x - 1 - blockIdx.x) / gridDim.x;   /* this block's stages */
    const size_t total = per * (size_t)passes;
    auto issue = [&](size_t j) {
        const size_t s = (size_t)blockIdx.x + (j % per) * gridDim.x;
        const uint8_t *src = buf + s * STAGE;
        uint8_t *dst = sm + (j % NST) * STAGE;
        for (int o = threadIdx.x * 16; o < STAGE; o += THREADS * 16) cp16(dst + o, src + o);
    };
    for (size_t j = 0; j < NST - 1; j++) {
        if (j < total) issue(j);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (size_t j = 0; j < total; j++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(NST - 2) : "memory");
        __syncthreads();
        if (j + NST - 1 < total) issue(j + NST - 1);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        acc ^= *(const uint32_t *)(sm + (j % NST) * STAGE + threadIdx.x * 4);
    }
    if (acc == 0x12345678u) sink[0].x = acc;
}

/* The median TB/s of RUNS launches of one kernel reading `bytes` per launch. */
template <typename F>
static double tbps(F launch, double bytes) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    double v[RUNS];
    for (int r = 0; r < RUNS; r++) {
        CHECK(cudaEventRecord(e0));
        launch();
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        v[r] = bytes / (ms * 1e-3) / 1e12;
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return median(v, RUNS);
}

int main(int argc, char **argv) {
    const size_t mib = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 24;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "l2_read: no CUDA device available\n");
        return 1;
    }
    if (mib == 0 || mib > 4096) {
        fprintf(stderr, "l2_read: MiB %zu outside 1..4096\n", mib);
        return 2;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const size_t big = (size_t)2048 << 20, small = mib << 20;
    uint8_t *buf = NULL;
    uint4 *sink = NULL;
    CHECK(cudaMalloc(&buf, big));
    CHECK(cudaMalloc(&sink, 64));
    CHECK(cudaMemset(buf, 1, big));
    CHECK(cudaFuncSetAttribute(k_cpasync, cudaFuncAttributeMaxDynamicSharedMemorySize, NST * STAGE));
    const int grid = 2 * prop.multiProcessorCount;
    fprintf(stderr, "l2_read: %s, L2 %d MiB, %d SMs, %d blocks of %d; L2 buffer %zu MiB\n", prop.name,
            prop.l2CacheSize >> 20, prop.multiProcessorCount, grid, THREADS, mib);
    for (int pass = 0; pass < 2; pass++) {
        const size_t bytes = pass ? big : small;
        const int passes = pass ? 1 : (int)((size_t)8192 / mib > 0 ? (size_t)8192 / mib : 1);   /* ~8 GiB read */
        const double rd = (double)bytes * passes;
        const char *where = pass ? "dram" : "l2";
        const double a = tbps([&] { k_ldcg<<<grid, THREADS>>>((const uint4 *)buf, bytes / 16, passes, sink); }, rd);
        const size_t nstage = bytes / STAGE;
        const double b = tbps([&] { k_cpasync<<<grid, THREADS, NST * STAGE>>>(buf, nstage, passes, sink); },
                              (double)nstage * STAGE * passes);
        printf("%s_ldcg_TBps %.2f\n%s_cpasync_TBps %.2f\n", where, a, where, b);
    }
    CHECK(cudaFree(buf));
    CHECK(cudaFree(sink));
    return 0;
}
