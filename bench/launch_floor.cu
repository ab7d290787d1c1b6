/* launch_floor.cu -- what a chain of dependent kernels costs per kernel, with no work in them.
 *
 * A decode step is a chain of N dependent kernels (tiny: 141).  Eagerly, each costs a host
 * launch; replayed from a CUDA graph, each costs the device's node-to-node latency; with
 * programmatic dependent launch (PDL, compute capability 9.0+) the next kernel is scheduled
 * while the one before it drains.  These floors bound what graphs can gain on a model whose
 * kernels are tiny: speed-up <= eager per-launch cost / graph per-node cost, even with kernels
 * that take no time.  This program measures the floors on a chain of N kernels, each one block
 * of 128 threads that reads the float the kernel before it wrote and writes the next (a true
 * dependency, as in the step):
 *
 *   eager_us_per_kernel        N launches on a stream, then one wait (host-bound when small)
 *   graph_us_per_node          the chain captured once, replayed
 *   graph_pdl_us_per_node      the same, each kernel a programmatic dependent of the one before
 *
 * Medians of RUNS timed repetitions (after WARMUP), host clock around launch + wait.
 * Build: nvcc -O3 -std=c++17 -arch=sm_90 bench/launch_floor.cu -o build/launch_floor
 * Usage: launch_floor [N]          (default 141)
 */
#include <cuda_runtime.h>

#include <stdio.h>
#include <stdlib.h>

#define BENCH_NAME "launch_floor"
#include "bench_util.h"

#define WARMUP 20
#define RUNS   101

/* One link: wait for the kernel before (PDL), let the next be scheduled, pass the value on. */
__global__ void k_link(const float *in, float *out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    if (threadIdx.x == 0) out[0] = in[0] + 1.0f;
}

/* The chain: kernel i reads buf[i % 2] and writes buf[(i + 1) % 2]. */
static void chain(cudaStream_t s, float *buf, int n, bool pdl) {
    for (int i = 0; i < n; i++) {
        const float *in = buf + (i & 1);
        float *out = buf + ((i + 1) & 1);
        if (pdl) {
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(1);
            cfg.blockDim = dim3(128);
            cfg.stream = s;
            cfg.attrs = at;
            cfg.numAttrs = 1;
            CHECK(cudaLaunchKernelEx(&cfg, k_link, in, out));
        } else {
            k_link<<<1, 128, 0, s>>>(in, out);
            CHECK(cudaGetLastError());
        }
    }
}

/* mode 0: eager; 1: graph; 2: graph with PDL.  The median microseconds per kernel. */
static double measure(cudaStream_t s, float *buf, int n, int mode) {
    cudaGraphExec_t exec = NULL;
    if (mode > 0) {
        cudaGraph_t g;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        chain(s, buf, n, mode == 2);
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
        CHECK(cudaGraphDestroy(g));
    }
    double t[RUNS];
    for (int r = 0; r < WARMUP + RUNS; r++) {
        const double t0 = now_s();
        if (exec) CHECK(cudaGraphLaunch(exec, s));
        else chain(s, buf, n, false);
        CHECK(cudaStreamSynchronize(s));
        if (r >= WARMUP) t[r - WARMUP] = (now_s() - t0) * 1e6 / n;
    }
    if (exec) CHECK(cudaGraphExecDestroy(exec));
    return median(t, RUNS);
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 141;
    if (n < 1 || n > 100000) {
        fprintf(stderr, "launch_floor: N must be in [1, 100000]\n");
        return 2;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *buf;
    CHECK(cudaMalloc(&buf, 2 * sizeof(float)));
    CHECK(cudaMemsetAsync(buf, 0, 2 * sizeof(float), s));
    const double e = measure(s, buf, n, 0), g = measure(s, buf, n, 1);
    const double p = prop.major >= 9 ? measure(s, buf, n, 2) : 0.0;
    printf("chain of %d dependent kernels on %s (median of %d)\n", n, prop.name, RUNS);
    printf("eager_us_per_kernel %.3f\n", e);
    printf("graph_us_per_node %.3f\n", g);
    if (prop.major >= 9) printf("graph_pdl_us_per_node %.3f\n", p);
    else printf("graph_pdl_us_per_node (needs compute capability 9.0)\n");
    CHECK(cudaFree(buf));
    CHECK(cudaStreamDestroy(s));
    return 0;
}
