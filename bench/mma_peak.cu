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
 *   wgmma_f16_tflops <value>     sm_90a builds on a CC 9.0 card: wgmma m64n64k16, A from registers,
 *                                B from shared memory, f32 accumulators (k_tc_wgmma's instruction),
 *                                two warpgroups a block, chains of 16 MMAs between waits
 *   wgmma_fold_tflops <value>    the same instruction in the pattern of k_tc_wgmma's exact sums
 *                                (ds4_cuda_gemm.cu, DS4_CUDA_PREFILL_TC=4): per block of 32 k,
 *                                4 MMAs (two k16 steps x two planes) into an accumulator set of
 *                                their own from zero, one commit; the next block's MMAs issued
 *                                before the last block's are waited for (ping-pong over two
 *                                sets, four blocks a round); each waited block folded into a
 *                                running sum, one FMA by a row factor per element (tcw_fold);
 *                                four warpgroups a block, one block an SM.  The ceiling of the
 *                                engine's arithmetic, with no copies and no weight decoding.
 *                                (Without the folds ptxas drops the MMAs whose sums a later
 *                                from-zero MMA overwrites, so a "waits only" variant measures
 *                                nothing: the folds are what keep every MMA.)
 *   wgmma_fold_q8_tflops <value> that, with each block's A fragments and factors decoded from
 *                                Q8_0 rows in shared memory first, as k_tc_wgmma does: what the
 *                                weights' decoding costs, without the stages' copies and waits
 *
 * Build: nvcc -O3 -arch=sm_90 bench/mma_peak.cu -o build/mma_peak  (sm_80 and later; the Makefile
 * builds sm_90 as sm_90a, as it does ds4_cuda_gemm.cu)
 * Usage: mma_peak
 */
#include <cuda_fp16.h>
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

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* d = A B (+ d where SC): m64n64k16, A from registers, B by descriptor (as tcw_mma) */
template <int SC>
__device__ __forceinline__ void wg_mma(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(SC)
        : "memory");
}
__device__ __forceinline__ void wg_hold(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

#define WG_CHAIN 16       /* wgmma between two waits */

__global__ void __launch_bounds__(256) k_wgmma_f16(float *sink, int iters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ __align__(1024) uint8_t bs[64 * 128];
    for (int i = threadIdx.x; i < 64 * 128 / 4; i += blockDim.x) ((uint32_t *)bs)[i] = 0x3c003c00u & (i * 2654435761u);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint32_t sa = (uint32_t)__cvta_generic_to_shared(bs);
    const uint64_t desc = (uint64_t)((sa & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
    const uint32_t a = (threadIdx.x * 2654435761u) & 0x3c003c00u;
    const uint32_t af[4] = { a, a, a, a };
    float d[32] = {};
    for (int it = 0; it < iters; it += WG_CHAIN) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int j = 0; j < WG_CHAIN; j++)
            wg_mma<1>(d, af, desc);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += d[i];
    if (s == 12345.0f) sink[0] = s;
#else
    (void)sink;
    (void)iters;
#endif
}

/* Q8_0's A fragment of row r, block j (k_tc_wgmma's tc_frag_a with TA: rows of 80 bytes, the
 * stage's data ao bytes in): the factor, then the lane's 8 quants as f16 (1024 + 128 + q) - 1152 */
__device__ __forceinline__ void q8_frag(const uint8_t *As, int r, int j, int t, int ao, uint32_t (&a)[4], float &s) {
    const uint8_t *blk = As + 80 * r + ao + 34 * j;
    s = __half2float(__ushort_as_half(*(const uint16_t *)blk));
    const uint8_t *q = blk + 2 + 8 * t;
    uint32_t lo, hi;
    if (j) {
        lo = *(const uint32_t *)q;
        hi = *(const uint32_t *)(q + 4);
    } else {
        const uint32_t a0 = *(const uint16_t *)q, a1 = *(const uint32_t *)(q + 2), a2 = *(const uint16_t *)(q + 6);
        lo = a0 | (a1 << 16);
        hi = (a1 >> 16) | (a2 << 16);
    }
    const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));
    const uint32_t w[2] = { lo ^ 0x80808080u, hi ^ 0x80808080u };
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t v01 = __byte_perm(w[h], 0x64646464u, 0x4140), v23 = __byte_perm(w[h], 0x64646464u, 0x4342);
        const __half2 h01 = __hsub2(*(__half2 *)&v01, bias), h23 = __hsub2(*(__half2 *)&v23, bias);
        a[2 * h] = *(const uint32_t *)&h01;
        a[2 * h + 1] = *(const uint32_t *)&h23;
    }
}

/* k_tc_wgmma's pattern (REL, TC_ROUND = 2: four blocks of 32 k a round), without its copies:
 * per block 4 MMAs into c[j] from zero and a commit; from the second block on, a wait that
 * leaves the newest block in flight, then the other set folded into acc; the round's last
 * block waited for and folded at its end.  Four warpgroups.  DEC: each block's A fragments
 * and factors decoded from Q8_0 rows in shared memory first, as the engine does (rows pr and
 * pr + 8 of the warpgroup's 64, 80 bytes apart, the stage's data 0, 4, 8 or 12 bytes in by
 * round); otherwise A and the factors are constants in registers. */
template <bool DEC>
__global__ void __launch_bounds__(512, 1) k_wgmma_fold(float *sink, int iters) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ __align__(1024) uint8_t bs[2 * 64 * 128];   /* two planes of 64 tokens x 64 halves */
    __shared__ __align__(16) uint8_t as[DEC ? 256 * 80 : 16];   /* DEC: 256 Q8_0 rows of a stage */
    for (int i = threadIdx.x; i < 2 * 64 * 128 / 4; i += blockDim.x) ((uint32_t *)bs)[i] = 0x3c003c00u & (i * 2654435761u);
    for (int i = threadIdx.x; i < (int)sizeof(as) / 4; i += blockDim.x)   /* factors stay finite */
        ((uint32_t *)as)[i] = (i * 2654435761u) & 0x3bff3bffu;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint32_t sa = (uint32_t)__cvta_generic_to_shared(bs);
    const uint64_t desc = (uint64_t)((sa & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pr = 64 * (warp >> 2) + 16 * (warp & 3) + g;
    uint32_t a[2][2][4];   /* block j's A, rows pr and pr + 8: distinct registers, as the engine's */
    float sf[2][2];        /* block j's factors of the two rows */
    for (int i = 0; i < 16; i++) (&a[0][0][0])[i] = ((threadIdx.x + 977u * i) * 2654435761u) & 0x3c003c00u;
    for (int j = 0; j < 2; j++) {
        sf[j][0] = 1.0f + (float)(threadIdx.x & 7) * 0x1p-20f;
        sf[j][1] = 1.0f - (float)(threadIdx.x & 3) * 0x1p-20f;
    }
    float acc[32] = {}, c[2][32] = {};
    for (int it = 0; it < iters; it += 16) {       /* a round: 4 blocks x 4 MMAs */
        const int ao = (it >> 2) & 12;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int j = b & 1;
            if (DEC) {
                q8_frag(as, pr, j, t, ao, a[j][0], sf[j][0]);
                q8_frag(as, pr + 8, j, t, ao, a[j][1], sf[j][1]);
            }
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const uint32_t af[4] = { a[j][0][2 * hf], a[j][1][2 * hf], a[j][0][2 * hf + 1], a[j][1][2 * hf + 1] };
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    const uint64_t bd = desc + (uint64_t)((p * 64 * 128 + 32 * (2 * j + hf)) >> 4);
                    if (hf == 0 && p == 0) wg_mma<0>(c[j], af, bd);
                    else wg_mma<1>(c[j], af, bd);
                }
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (b > 0) {
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                wg_hold(c[j ^ 1]);
#pragma unroll
                for (int i = 0; i < 32; i++) acc[i] = fmaf((i & 2) ? sf[j ^ 1][1] : sf[j ^ 1][0], c[j ^ 1][i], acc[i]);
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_hold(c[1]);
#pragma unroll
        for (int i = 0; i < 32; i++) acc[i] = fmaf((i & 2) ? sf[1][1] : sf[1][0], c[1][i], acc[i]);
    }
    float s = 0.0f;
    for (int i = 0; i < 32; i++) s += acc[i];
    if (s == 12345.0f) sink[0] = s;
#else
    (void)sink;
    (void)iters;
#endif
}

/* The median TFLOP/s (or TOPS) of RUNS launches of grid x 256 threads, flop_per_mma each MMA. */
template <typename K, typename T>
static double run(K kernel, T *sink, int grid, double flop_per_mma, int per_block = 8 * ACC, int threads = 256) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    double v[RUNS];
    for (int r = -WARMUP; r < RUNS; r++) {
        CHECK(cudaEventRecord(e0));
        kernel<<<grid, threads>>>(sink, ITERS);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) v[r] = (double)grid * per_block * ITERS * flop_per_mma / (ms * 1e-3) / 1e12;
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
#ifdef DS4_WGMMA
    int major = 0, minor = 0;
    CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major == 9 && minor == 0) {   /* each warpgroup ITERS MMAs of 64 x 64 x 16 */
        printf("wgmma_f16_tflops %.1f\n", run(k_wgmma_f16, (float *)sink, n_sm * 2, 2.0 * 64 * 64 * 16, 2));
        printf("wgmma_fold_tflops %.1f\n", run(k_wgmma_fold<false>, (float *)sink, n_sm, 2.0 * 64 * 64 * 16, 4, 512));
        printf("wgmma_fold_q8_tflops %.1f\n", run(k_wgmma_fold<true>, (float *)sink, n_sm, 2.0 * 64 * 64 * 16, 4, 512));
    }
#endif
    CHECK(cudaFree(sink));
    return 0;
}
