/* ds4_cuda.cu -- the CUDA backend of ds4.
 *
 * What it is.  A complete implementation of the backend contract in
 * ds4_gpu.h for NVIDIA GPUs: device memory, weight upload, and every op the
 * forward pass calls, computed in f32 on weights stored exactly as the GGUF
 * file stores them (F32, F16, BF16, Q8_0; I32 for the hash-routing table;
 * the routed experts' Q2_K, Q4_K and IQ2_XXS, whose kernels live in
 * ds4_cuda_quant.cuh, included after the matvec section).
 * The CPU backend in ds4.c is the specification; tests/test_backend_ops.c
 * runs both side by side and states the tolerance of every op.
 *
 * Where the time goes, and how the file answers it.  Decoding a token reads
 * every active weight once, so decode speed is memory bandwidth: the
 * matrix-vector kernels (and the MoE kernels built on them) are written to
 * stream Q8_0 rows at close to the copy bandwidth of the device, with the
 * activation slice of each warp held in registers and the weight rows staged
 * through shared memory by asynchronous copies.  Prefill has many tokens per
 * weight, so it dequantizes weights to f32 and hands the products to cuBLAS
 * (f32 arithmetic, no TF32).  Everything else (norms, RoPE, mHC, attention,
 * the indexer, routing) is small next to the weights, but at decode each of
 * those kernels costs a few microseconds of latency, and a layer run op by op
 * takes about 45 of them.  So the contract has fused ops (ds4_gpu.h: hc_pre, matmul_multi,
 * head_norm_rope, matmul_swiglu, attention_step, compressor_step(s),
 * indexer_step, moe_gate),
 * each defined as a composition of plain ops, which this file runs as fewer
 * kernels at decode (~18 per layer) and as the composition where fusing does
 * not pay.  The mHC projection (24 rows of 16384 floats) is spread over
 * K instead of rows (split-K; the last block to finish, counted by an
 * integer counter, reduces the partials in a fixed order and finishes the
 * step).
 *
 * Streams and sessions (stages 0 and 1 of patches/series).  Every kernel
 * launch, memset, copy, cuBLAS call and event record goes to
 * ds4_current_stream() (ds4_stream.h); scripts/check_streams.py keeps it
 * that way.  Each context owns a session (ds4_gpu.h): a non-blocking stream,
 * which becomes the thread's current stream while the session is bound, a
 * cuBLAS handle with a fixed workspace, and every scratch buffer, sized from
 * the context's limits when it is made.  A decode step is therefore
 * replayable: no op allocates, frees or waits; the position is read from the
 * step block when a kernel runs, never passed by value, so each kernel's
 * grid is sized for the most a step of that shape can need (blocks with
 * nothing to do return at once) and a compressor's emit work runs or not on
 * the device; the launches of a step -- kernels, grids and argument bytes --
 * are the same at every position (DS4_LAUNCH_TRACE records them and
 * tests/test_gpu.py compares them).  The step's inputs go up through pinned
 * staging, its logits come down the same way, and that download is the one
 * wait of the step.  Kernel attributes and occupancies are settled at init.
 * A prompt's MoE layers still read the routing back to group tokens by
 * expert (one ordered read and wait per layer, never in a decode step).
 * Each kernel has exactly one launcher (a static host function that sizes
 * the grid), and every launch goes through DS4_LAUNCH, whose
 * ds4_launch_kernel holds the file's only `<<<>>>`.
 *
 * Graphs (stage 2).  With DS4_CUDA_GRAPHS=1 the core brackets a decode step
 * (or clusters of layers) as regions; the session records each region once
 * as a CUDA graph on its stream and replays it on every later step
 * (region_begin/region_end, in the Sessions banner): a capture is checked
 * node for node against the launches the region issued, and any failure
 * leaves that region eager for good (fail closed).
 *
 * Hooks (stage 3).  ds4_hooks.cu's emitter records activations inside the
 * same regions: producer kernels on a side stream copy them into device rings,
 * and a drain thread streams the rings to the host while the graphs replay.
 *
 * Determinism.  Same inputs give byte-identical outputs run to run: no
 * floating-point atomics, every reduction has a fixed shape (warp butterflies,
 * fixed trees, fixed-order sums of per-slice or per-expert partials), and
 * cuBLAS runs with atomics disallowed on one handle and one stream.
 *
 * Sections, in pipeline order:
 *   Errors, launch accounting      DS4_CUDA_CHECK, DS4_CUBLAS_CHECK, DS4_LAUNCH, the launch trace
 *   Device helpers                 number formats, warp sums, async copies
 *   Backend state and lifetime     init, sessions' state, counted allocations and waits, copies
 *   Embedding
 *   mHC                            hc_mix (Sinkhorn), hc_post, hc_pre (split-K, one launch)
 *   RMSNorm
 *   Matmul                         decode matvec (multi-matrix, normed input), generic
 *                                  matvec, prefill cuBLAS, matmul_multi, matmul_swiglu
 *   RoPE                           rope, head_norm_rope
 *   Attention                      window + compressed rows, split-row combine (ring store,
 *                                  de-rotation for attention_step), ring store
 *   Compressor                     ape bias (add_cyclic), gated pooling, compressor_step
 *   Indexer                        scores, exact top-k
 *   MoE                            routing (with the router: moe_gate), SwiGLU, experts
 *                                  (decode and prefill)
 *   Elementwise                    add, scale
 *   Sessions                       kernel set-up at init, recorded regions (CUDA graphs),
 *                                  session_new (every scratch sized), bind
 *   Hooks                          the hook emitter: device rings, producers, drain thread
 *                                  (ds4_hooks.cu, included there)
 *   The backend table
 */
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cublas_v2.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <pthread.h>

#include "ds4_gpu.h"
#include "ds4_hooks.h"
#include "ds4_stream.h"

#include <atomic>

/* ---------------------------------------------------------------------------
 * Errors and launch accounting
 *
 * A failure inside an op cannot be recovered (ds4_gpu.h), so every CUDA and
 * cuBLAS call is wrapped: on error the statement, file and line are printed
 * and the process exits.  DS4_LAUNCH(kernel, grid, block, smem, args...)
 * launches on the current stream (ds4_launch_kernel, the one `<<<>>>` of the
 * backend), times the host side, checks cudaGetLastError and counts it in
 * the bound session; with DS4_LAUNCH_TRACE it first writes the launch (its
 * source line, kernel, grid, block, shared memory and argument bytes) to the
 * session's trace.  DS4_CUBLAS sets the session's handle's stream to the
 * current one, then does the same for a cuBLAS call.
 * ------------------------------------------------------------------------- */

#define DS4_CUDA_CHECK(stmt) do {                                                   \
        cudaError_t e_ = (stmt);                                                    \
        if (e_ != cudaSuccess) {                                                    \
            fprintf(stderr, "ds4: CUDA error %s (%s) in `%s` at %s:%d\n",           \
                    cudaGetErrorName(e_), cudaGetErrorString(e_), #stmt,            \
                    __FILE__, __LINE__);                                            \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#define DS4_CUBLAS_CHECK(stmt) do {                                                 \
        cublasStatus_t s_ = (stmt);                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                          \
            fprintf(stderr, "ds4: cuBLAS error %s (%s) in `%s` at %s:%d\n",         \
                    cublasGetStatusName(s_), cublasGetStatusString(s_), #stmt,      \
                    __FILE__, __LINE__);                                            \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* Device memory and waits, process-wide (ds4_backend_stats): every
 * cudaMalloc/cudaHostAlloc, free and synchronisation of the backend goes
 * through the wrappers below, which count it. */
static std::atomic<uint64_t> g_n_malloc, g_n_free, g_n_dev_sync, g_n_stream_sync;
/* the hook drain thread's waits on its own stream (ds4_hooks.cu): counted apart, so the decode
 * step's counters stay the compute stream's, and reported as ds4_hooks_stats.drain_syncs */
static std::atomic<uint64_t> g_n_hook_sync;

/* The session bound to the calling thread (ds4_gpu.h session_bind); defined
 * with the backend state below. */
struct ds4_session;
static thread_local ds4_session *g_sess;
static ds4_session *sess(void);
static void sess_count_launch(double seconds);
static void sess_trace_launch(int line, const void *fn, dim3 grid, dim3 block, size_t smem,
                              const unsigned char *args, size_t n_args);
static bool sess_tracing(void);
/* A launch's error: fatal, except while a region is being recorded, where it
 * fails the recording (region_end then has the region issued again, eagerly,
 * and an error that is the kernel's own shows there). */
static void launch_check(cudaError_t e, const char *file, int line);

/* ds4_stream.h: the calling thread's stack of stream overrides (empty: stream 0). */
static thread_local cudaStream_t g_stream_stack[DS4_STREAM_DEPTH];
static thread_local int g_stream_depth;

extern "C" cudaStream_t ds4_current_stream(void) {
    return g_stream_depth > 0 ? g_stream_stack[g_stream_depth - 1] : (cudaStream_t)0;
}

extern "C" int ds4_stream_push(cudaStream_t s) {
    if (g_stream_depth >= DS4_STREAM_DEPTH) return -1;
    g_stream_stack[g_stream_depth++] = s;
    return 0;
}

extern "C" void ds4_stream_pop(void) {
    if (g_stream_depth > 0) g_stream_depth--;
}

static double ds4_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The launch trace (DS4_LAUNCH_TRACE): the argument bytes of a launch, each
 * argument converted to its parameter type first, as the launch converts it. */
template <typename... P>
struct ds4_arg_bytes {
    unsigned char b[4096];
    size_t n = 0;
    void put(const void *p, size_t sz) {
        if (n + sz <= sizeof b) memcpy(b + n, p, sz);
        n += sz;
    }
    void all(P... p) { (put(&p, sizeof p), ...); }
};

static bool sess_pdl(void);

/* The one place a kernel is launched: on the current stream.  The parameter packs are
 * separate so an argument converts to its parameter type as in a direct launch.  While a
 * region is recorded with DS4_CUDA_GRAPH_PDL (sess_pdl), the kernel is launched as a
 * programmatic dependent of the one before it: see ds4_grid_dep. */
template <typename... P, typename... A>
static cudaError_t ds4_launch_kernel(int line, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    if (sess_tracing()) {
        ds4_arg_bytes<P...> ab;
        ab.all(args...);
        sess_trace_launch(line, (const void *)kernel, grid, block, smem, ab.b, ab.n);
    }
#if CUDART_VERSION >= 11080
    if constexpr (sizeof...(P) > 0) {
        if (sess_pdl()) {
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = grid;
            cfg.blockDim = block;
            cfg.dynamicSmemBytes = smem;
            cfg.stream = ds4_current_stream();
            cfg.attrs = at;
            cfg.numAttrs = 1;
            return cudaLaunchKernelEx(&cfg, kernel, args...);
        }
    }
#endif
    kernel<<<grid, block, smem, ds4_current_stream()>>>(args...);
    return cudaSuccess;
}

/* Variadic: a kernel template's name (k<a, b>) contains top-level commas. */
#define DS4_LAUNCH(...) do {                                                        \
        const double t0_ = ds4_now();                                               \
        const cudaError_t e_ = ds4_launch_kernel(__LINE__, __VA_ARGS__);            \
        const cudaError_t l_ = cudaGetLastError();                                  \
        launch_check(e_ != cudaSuccess ? e_ : l_, __FILE__, __LINE__);              \
        sess_count_launch(ds4_now() - t0_);                                         \
    } while (0)

#define DS4_CUBLAS(...) do {                                                        \
        const double t0_ = ds4_now();                                               \
        DS4_CUBLAS_CHECK(cublasSetStream(sess_blas(), ds4_current_stream()));       \
        DS4_CUBLAS_CHECK(__VA_ARGS__);                                              \
        sess_count_launch(ds4_now() - t0_);                                         \
    } while (0)

/* ---------------------------------------------------------------------------
 * Device helpers
 *
 * Number formats as the file stores them, warp reductions, and the 16-byte
 * asynchronous global->shared copy the matvec kernels stage Q8_0 rows with.
 * ------------------------------------------------------------------------- */

#define FULL_MASK 0xffffffffu

/* Programmatic dependent launch (DS4_CUDA_GRAPH_PDL, stage 2).  In a recorded region each
 * kernel is launched as a programmatic dependent of the kernel before it
 * (ds4_launch_kernel), so the graph may schedule its blocks before that kernel has
 * finished, which shortens the gap between two dependent kernel nodes (bench/launch_floor
 * on an H200: 0.78 -> 0.51 us per node; flash16's step 8.39 -> 7.99 ms).  So every
 * kernel starts with ds4_grid_dep(), before it reads or writes anything:
 * griddepcontrol.wait returns once the grids it depends on have completed and their
 * memory is visible (at once for a kernel launched the ordinary way), and only then does
 * launch_dependents let the next kernel be scheduled -- so at most one kernel waits
 * ahead of the one running, and the order of memory effects is the plain stream's.
 * Compute capability 9.0 and up (the session uses PDL only there); below, it is empty.
 * scripts/check_streams.py checks that every kernel starts with it. */
__device__ __forceinline__ void ds4_grid_dep(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

/* Q2_K / Q4_K / IQ2_XXS elements: ds4_cuda_quant.cuh (included after the k_matvec section). */
__host__ __device__ __forceinline__ float dsq_elem(int type, const uint8_t *row, int64_t k);

/* Element k of a row of the given type (any k; Q8_0 rows are 2-byte aligned). */
__device__ __forceinline__ float weight_elem(int type, const uint8_t *row, int64_t k) {
    switch (type) {
    case DS4_TYPE_F32:  return ((const float *)row)[k];
    case DS4_TYPE_F16:  return f16_bits_to_f32(((const uint16_t *)row)[k]);
    case DS4_TYPE_BF16: return bf16_bits_to_f32(((const uint16_t *)row)[k]);
    case DS4_TYPE_Q8_0: {
        const uint8_t *blk = row + (k / DS4_QK8_0) * DS4_Q8_0_BLOCK_BYTES;
        const float d = f16_bits_to_f32(*(const uint16_t *)blk);
        return d * (float)(int8_t)blk[2 + k % DS4_QK8_0];
    }
    case DS4_TYPE_Q2_K: case DS4_TYPE_Q4_K: case DS4_TYPE_IQ2_XXS: return dsq_elem(type, row, k);
    default: return 0.0f;
    }
}

/* Butterfly sum: every lane ends with the same value (a+b == b+a exactly). */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float silu_mul(float g, float u, float limit) {
    if (limit > 1e-6f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

/* Streaming 16-byte load of weights: read once per token, keep out of L1. */
__device__ __forceinline__ uint4 ld_stream16(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

/* The same, 8 bytes. */
__device__ __forceinline__ uint2 ld_stream8(const void *p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

/* ---------------------------------------------------------------------------
 * Backend state, sessions and lifetime
 *
 * One device (0), whose properties, kernel attributes and occupancies are
 * settled once by cuda_init.  Everything per context is a session
 * (ds4_gpu.h): a non-blocking stream, a cuBLAS handle with a fixed
 * workspace, the counters of the kernels that count their own blocks,
 * scratch buffers sized from the context's limits when the session is made
 * (session_new, at the end of the file, where every op's sizes are known),
 * pinned staging for the step's copies, and the launch counters.  A thread
 * binds a session (session_bind), which also makes its stream the thread's
 * current stream (ds4_stream.h), so every launch, copy and wait of an op goes
 * to the context's stream.  Nothing inside an op allocates, frees or waits:
 * scratch_get only checks the size it was given at session creation, and
 * the wrappers below count every allocation, free and wait the backend
 * makes (ds4_backend_stats), so a run can show there were none.
 * ------------------------------------------------------------------------- */

/* Above this many tokens (a prompt) the split-K partials would re-read fn
 * once per token from L2 (512 tokens: ~0.8 GB per call, and prefill 512 fell
 * from 975 to 865 tok/s on an H200), so hc_pre (the mHC banner below) runs the CPU op's composition
 * instead, its projection through cuBLAS. */
#define HC_SPLIT_MAX_NT 8

typedef struct {
    void       *p;
    size_t      cap;
    const char *what;     /* named in the error when an op asks for more */
} scratch_t;

static struct {
    int            ready;
    int            n_sm;
    int            max_grid_yz;   /* the device's grid limit in y and z (65535 on every GPU so far) */
    int            cc_major;
    size_t         smem_optin;        /* max dynamic shared memory per block */
    int            att_bps[17];       /* resident k_attention<DM> blocks per SM, by DM (cuda_init) */
} g_cuda;

struct ds4_session {
    cudaStream_t   stream;
    cublasHandle_t blas;
    void          *blas_ws;           /* cuBLAS workspace (cublasSetWorkspace): no allocation inside a call */
    ds4_limits     lim;
    scratch_t      deq;               /* dequantized weight rows for cuBLAS, f32 */
    scratch_t      moe_h, moe_tmp;    /* MoE: swiglu activations, per-(token,expert) outputs */
    scratch_t      moe_xg, moe_gu;    /* MoE prefill: gathered inputs, gate|up products */
    scratch_t      moe_idx;           /* MoE prefill: perm and pos tables, int32 */
    scratch_t      att_part;          /* attention split-row partials */
    scratch_t      ix_scores;         /* indexer scores, [query chunk][ix_ld] */
    int64_t        ix_ld;             /* indexer score row: the most visible rows a context has */
    int64_t        ix_chunk;          /* queries scored per pass */
    unsigned      *hc_count;          /* hc_pre: blocks done per token, zero between launches */
    unsigned      *gate_count;        /* k_moe_gate: blocks done per token */
    int32_t       *host_idx;          /* MoE prefill host tables (pinned): sel, perm, pos, offsets */
    size_t         host_idx_cap;
    unsigned char *up_stage;          /* pinned staging of the step's uploads (bump, reset at each wait) */
    size_t         up_cap, up_used;
    unsigned char *down_stage;        /* pinned staging of a download */
    size_t         down_cap;
    uint64_t       launches;          /* kernel launches + cuBLAS calls */
    double         launch_seconds;    /* host time inside them */
    FILE          *trace;             /* DS4_LAUNCH_TRACE */
    uint64_t       trace_launches;
    /* recorded regions (CUDA graphs, region_begin/end; the Sessions banner) */
    struct region *reg;               /* [graph_cache] */
    int            n_reg;
    uint64_t       reg_clock;         /* use counter for the least recently used eviction */
    bool           capturing;         /* between a capture's begin and end */
    bool           pdl;               /* DS4_CUDA_GRAPH_PDL on a device that has it (cc >= 9.0) */
    uint64_t       cap_key, cap_launches0;
    cudaError_t    cap_err;           /* the first launch error while capturing */
    struct hk_emitter *hk;            /* DS4_HOOKS: the hook emitter (ds4_hooks.cu), NULL = hooks off */
    double         cap_t0;
    int            n_captures_tried;  /* for DS4_CUDA_GRAPH_FAIL */
    ds4_backend_stats gs;             /* the graph counters (captures ... instantiate_ms) */
};

static void launch_check(cudaError_t e, const char *file, int line) {
    if (e == cudaSuccess) return;
    if (g_sess && g_sess->capturing) {
        if (g_sess->cap_err == cudaSuccess) g_sess->cap_err = e;
        return;
    }
    fprintf(stderr, "ds4: CUDA error %s (%s) in a kernel launch at %s:%d\n", cudaGetErrorName(e),
            cudaGetErrorString(e), file, line);
    exit(1);
}

static ds4_session *sess(void) {
    if (!g_sess) {
        fprintf(stderr, "ds4: a CUDA op was called with no session bound (ds4_gpu.h: session_new, session_bind)\n");
        exit(1);
    }
    return g_sess;
}

static cublasHandle_t sess_blas(void) { return sess()->blas; }

static void sess_count_launch(double seconds) {
    ds4_session *S = sess();
    S->launches++;
    S->launch_seconds += seconds;
}

static bool sess_tracing(void) { return g_sess && g_sess->trace; }

/* recorded kernels launch as programmatic dependents (ds4_grid_dep) */
static bool sess_pdl(void) { return g_sess && g_sess->capturing && g_sess->pdl; }

/* One line per launch: source line of the DS4_LAUNCH, kernel address, grid,
 * block, shared memory and every argument byte in hex.  Two steps that
 * launch the same line sequence replay the same work. */
static void sess_trace_launch(int line, const void *fn, dim3 grid, dim3 block, size_t smem,
                              const unsigned char *args, size_t n_args) {
    FILE *f = g_sess->trace;
    fprintf(f, "launch L%d %p grid=%u,%u,%u block=%u,%u,%u smem=%zu args=", line, fn, grid.x, grid.y, grid.z,
            block.x, block.y, block.z, smem);
    const size_t n = n_args < 4096 ? n_args : 4096;
    for (size_t i = 0; i < n; i++) fprintf(f, "%02x", args[i]);
    fprintf(f, n < n_args ? " (+%zu bytes not shown)\n" : "\n", n_args - n);
    g_sess->trace_launches++;
}

static void sess_trace_line(const char *what, size_t bytes) {
    if (g_sess && g_sess->trace) fprintf(g_sess->trace, "%s %zu\n", what, bytes);
}

/* Size check only: every scratch was allocated when the session was made. */
static void *scratch_get(scratch_t *s, size_t bytes) {
    if (bytes > s->cap) {
        fprintf(stderr, "ds4: %s need %zu bytes, the context was sized for %zu (ds4_limits too small)\n",
                s->what, bytes, s->cap);
        exit(1);
    }
    return s->p;
}

/* The counted allocations, frees and waits. */
static cudaError_t dev_malloc(void **p, size_t bytes) {
    g_n_malloc++;
    return cudaMalloc(p, bytes);
}
static void dev_free(void *p) {
    if (!p) return;
    g_n_free++;
    DS4_CUDA_CHECK(cudaFree(p));
}
static cudaError_t host_alloc(void **p, size_t bytes) {
    g_n_malloc++;
    return cudaHostAlloc(p, bytes, cudaHostAllocDefault);
}
static void host_free(void *p) {
    if (!p) return;
    g_n_free++;
    DS4_CUDA_CHECK(cudaFreeHost(p));
}
/* The current stream's work is done; the session's upload staging is free again. */
static void stream_wait(void) {
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(step result) */
    if (g_sess) g_sess->up_used = 0;
    sess_trace_line("wait", 0);
}

__global__ void k_probe(void) { ds4_grid_dep(); }
static void ops_setup(void);   /* kernel attributes and occupancies, defined after the kernels */

static int cuda_init(void) {
    if (g_cuda.ready) return 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        /* no driver (cudaErrorInsufficientDriver) and no device (cudaErrorNoDevice) both mean the same to a user */
        fprintf(stderr, "ds4: no CUDA GPU found (the CUDA runtime says: %s); run on a machine with an NVIDIA GPU "
                "and its driver, or use --backend cpu\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        (void)cudaGetLastError();
        return -1;
    }
    e = cudaSetDevice(0);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: no CUDA device available: %s\n", cudaGetErrorString(e));
        return -1;
    }
    cudaDeviceProp prop;
    DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    /* A build without machine code for this GPU fails at the first launch;
     * say so here, with the fix, instead. */
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, k_probe);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: this build has no kernels for %s (sm_%d%d): rebuild with CUDA_ARCH=sm_%d%d (%s)\n",
                prop.name, prop.major, prop.minor, prop.major, prop.minor, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return -1;
    }
    g_cuda.n_sm = prop.multiProcessorCount;
    g_cuda.max_grid_yz = prop.maxGridSize[1] < prop.maxGridSize[2] ? prop.maxGridSize[1] : prop.maxGridSize[2];
    g_cuda.cc_major = prop.major;
    g_cuda.smem_optin = prop.sharedMemPerBlockOptin;
    ops_setup();
    fprintf(stderr, "ds4: CUDA device 0: %s (sm_%d%d, %d SMs, %.1f GiB)\n", prop.name,
            prop.major, prop.minor, prop.multiProcessorCount,
            (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    g_cuda.ready = 1;
    return 0;
}

/* Zero-filled, and finished before it returns: buffers are made when a
 * context is, never inside a step, and the context's stream must not race
 * the fill. */
static void *cuda_alloc(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 16;
    cudaError_t e = dev_malloc(&p, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cudaMalloc of %zu bytes failed: %s\n", bytes, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return NULL;
    }
    DS4_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ds4_current_stream()));
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(load time) */
    return p;
}

static void cuda_free(void *p) {
    dev_free(p);
}

/* Uploads are ordered on the current stream.  The step's small ones (the
 * step block, the tokens) are copied into the session's pinned staging and
 * go up asynchronously; anything that does not fit (a test's inputs, a
 * prompt larger than the staging) is copied and waited for. */
static void cuda_upload(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return;
    ds4_session *S = g_sess;
    sess_trace_line("upload", bytes);
    if (S && S->up_used + bytes <= S->up_cap) {
        unsigned char *st = S->up_stage + S->up_used;
        S->up_used += (bytes + 15) & ~(size_t)15;
        memcpy(st, src, bytes);
        DS4_CUDA_CHECK(cudaMemcpyAsync(dst, st, bytes, cudaMemcpyHostToDevice, ds4_current_stream()));
        return;
    }
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ds4_current_stream()));
    stream_wait();
}

/* The one wait of a step: after every op issued before it, the bytes come
 * down and are in dst on return.  Small results go through the session's
 * pinned staging.  A larger one (a row of logits is 517 KB on Flash) is
 * copied straight into dst: for pageable memory the driver stages it in
 * pieces and overlaps the DMA with its own copy out, where the pinned
 * staging would add a full host copy after the DMA (DOWN_STAGE_MAX). */
#define DOWN_STAGE_MAX ((size_t)64 << 10)
static void cuda_download(void *dst, const void *src, size_t bytes) {
    ds4_session *S = g_sess;
    sess_trace_line("download", bytes);
    if (S && bytes <= S->down_cap) {
        DS4_CUDA_CHECK(cudaMemcpyAsync(S->down_stage, src, bytes, cudaMemcpyDeviceToHost, ds4_current_stream()));
        stream_wait();
        memcpy(dst, S->down_stage, bytes);
        return;
    }
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ds4_current_stream()));
    stream_wait();
}

static void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return;
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ds4_current_stream()));
}

static int type_supported(int type);

/* Weights keep the file's byte layout (Q8_0 rows of 34-byte blocks included);
 * the kernels below read that layout directly. */
static int cuda_upload_weight(ds4_weight *w) {
    if (!type_supported(w->type) && w->type != DS4_TYPE_I32) {
        fprintf(stderr, "ds4: the CUDA backend has no kernels for weight type %d (tensor %s); use --backend cpu\n",
                w->type, w->name ? w->name : "?");
        return -1;
    }
    void *p = NULL;
    cudaError_t e = dev_malloc(&p, w->nbytes ? w->nbytes : 16);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cannot upload weight %s (%zu bytes): %s\n",
                w->name ? w->name : "?", w->nbytes, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return -1;
    }
    /* NOTE(load time): weights go up once, before any step; the copy is
     * complete when cudaMemcpy returns only up to the driver's staging, so
     * session_new waits for the device before a context's stream runs */
    if (w->nbytes) DS4_CUDA_CHECK(cudaMemcpy(p, w->host, w->nbytes, cudaMemcpyHostToDevice));
    w->dev = p;
    return 0;
}

static void cuda_release_weight(ds4_weight *w) {
    dev_free(w->dev);
    w->dev = NULL;
}

static void cuda_synchronize(void) {
    stream_wait();
}

/* Grid size for a grid-stride loop over n items with 256-thread blocks. */
static unsigned grid_for(int64_t n) {
    int64_t b = (n + 255) / 256;
    const int64_t cap = (int64_t)(g_cuda.n_sm > 0 ? g_cuda.n_sm : 132) * 32;
    if (b > cap) b = cap;
    if (b < 1) b = 1;
    return (unsigned)b;
}

/* ---------------------------------------------------------------------------
 * Embedding
 *
 * One block per token: dequantize the token's row of token_embd (any weight
 * type) and write it into each of the n_hc residual streams.
 * ------------------------------------------------------------------------- */

__global__ void k_embed(const uint8_t *table, int type, size_t row_bytes, int64_t D,
                        const int32_t *tokens, int n_hc, float *x) {
    ds4_grid_dep();
    const int t = blockIdx.x;
    const uint8_t *row = table + (size_t)tokens[t] * row_bytes;
    float *xt = x + (int64_t)t * n_hc * D;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = weight_elem(type, row, i);
        for (int s = 0; s < n_hc; s++) xt[s * D + i] = v;
    }
}

static void launch_embed(const ds4_weight *w, const int32_t *tokens, int nt, int n_hc, float *x) {
    if (nt <= 0) return;
    const int64_t D = w->ne[0];
    DS4_LAUNCH(k_embed, nt, 256, 0, (const uint8_t *)w->dev, w->type,
               ds4_row_bytes(w->type, D), D, tokens, n_hc, x);
}

static void cuda_embed(const ds4_weight *w, const int32_t *tokens, int nt, int n_hc, float *x) {
    launch_embed(w, tokens, nt, n_hc, x);
}

/* ---------------------------------------------------------------------------
 * mHC: mixing (with Sinkhorn) and the residual update
 *
 * hc_mix: one block per (1024 channels, token).  Every block turns the
 * token's logits into the n_hc pre weights and forms the weighted sum of the
 * streams over its channels; warp 0 of the token's first block also builds
 * post and the Sinkhorn-normalised comb matrix (hc_sinkhorn_lanes, one lane
 * per matrix entry, shared with hc_pre).  The arithmetic follows the CPU op
 * step for step, but for the sums' order and the reciprocals (a few ulp).
 * hc_post: one thread per (token, channel) computes all n_hc outputs from
 * values it has already read, so the op is safe even in place.
 * ------------------------------------------------------------------------- */

#define HC_MAX 4   /* = DS4_HC_MAX: the Sinkhorn warp holds one C entry per lane */

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

#define HC_TILE 1024   /* channels per hc_mix block (4 per thread) */
#define HC_NMIX_MAX ((2 + HC_MAX) * HC_MAX)   /* mix logits per token: 24 */

/* The hardware reciprocal (MUFU.RCP, ~1 ulp, flushes denormals), with no
 * range fix-up: the Sinkhorn sums it inverts lie in [eps, h + eps]. */
__device__ __forceinline__ float rcp_approx(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

/* Sum of H register values as a tree, (v0 + v1) + (v2 + v3): half the
 * dependent adds of the CPU's left-to-right chain. */
template <int H>
__device__ __forceinline__ float sum_tree(const float *v) {
    if (H == 1) return v[0];
    if (H == 2) return v[0] + v[1];
    if (H == 3) return (v[0] + v[1]) + v[2];
    return (v[0] + v[1]) + (v[2] + v[3]);
}

/* post and the Sinkhorn-normalised comb of one token by one warp (every
 * lane calls it): lane l < h*h holds C[a][b], l = a + H*b (the comb
 * layout).  A normalisation gathers its group's H entries with H
 * independent shuffles, sums them as a tree, and multiplies by one hardware
 * reciprocal issued once for all sixteen entries: the chain of forty steps
 * is shuffle latency + two adds + one MUFU, where one thread walking the
 * matrix issued sixteen multiplies, twelve adds and four reciprocals per
 * step.  m: the token's mix logits (shared memory), already scaled by rms. */
template <int H>
__device__ void hc_sinkhorn_lanes(const float *m, const float *base, float sc1, float sc2, float eps, int iters,
                                  float *post, float *comb) {
    const int l = threadIdx.x & 31, a = l % H, b = (l / H) % H;
    if (l < H) post[l] = 2.0f * sigmoid_f(m[H + l] * sc1 + base[H + l]);
    const int li = a + H * b;                       /* lanes >= H*H mirror an entry; they write nothing */
    float c = m[2 * H + li] * sc2 + base[2 * H + li];
    float g[H];
#pragma unroll
    for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, H * b + q);   /* over destinations a */
    float mx = g[0];
#pragma unroll
    for (int q = 1; q < H; q++) mx = fmaxf(mx, g[q]);
    c = expf(c - mx);
#pragma unroll
    for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, H * b + q);
    c = c * rcp_approx(sum_tree<H>(g)) + eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {                               /* "row": over destinations, for each source */
#pragma unroll
            for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, H * b + q);
            c *= rcp_approx(sum_tree<H>(g) + eps);
        }
#pragma unroll
        for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, a + H * q);   /* "col": over sources */
        c *= rcp_approx(sum_tree<H>(g) + eps);
    }
    if (l < H * H) comb[l] = c;
}

/* The standalone hc_mix op.  scale has 3 entries, or 1 in head mode (only
 * scale[0] is read then). */
__global__ void k_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                         int64_t D, int h, int head, float eps, int iters,
                         float *y, float *post, float *comb) {
    ds4_grid_dep();
    __shared__ float m_s[HC_NMIX_MAX], base_s[HC_NMIX_MAX];
    __shared__ float pre_s[HC_MAX];
    const int t = blockIdx.y;
    const int n_mix = head ? h : (2 + h) * h;
    const float *m = mix + (int64_t)t * n_mix;
    for (int i = threadIdx.x; i < n_mix; i += blockDim.x) { m_s[i] = m[i]; base_s[i] = base[i]; }
    __syncthreads();
    if (threadIdx.x < h) pre_s[threadIdx.x] = sigmoid_f(m_s[threadIdx.x] * scale[0] + base_s[threadIdx.x]) + eps;
    if (!head && blockIdx.x == 0 && threadIdx.x < 32) {
        float *pt = post + (int64_t)t * h, *ct = comb + (int64_t)t * h * h;
        const float sc1 = scale[1], sc2 = scale[2];
        switch (h) {                            /* warp-uniform */
        case 1: hc_sinkhorn_lanes<1>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        case 2: hc_sinkhorn_lanes<2>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        case 3: hc_sinkhorn_lanes<3>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        default: hc_sinkhorn_lanes<4>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        }
    }
    __syncthreads();
    const float *xt = x + (int64_t)t * h * D;
    float *yt = y + (int64_t)t * D;
#pragma unroll
    for (int j = 0; j < HC_TILE / 256; j++) {
        const int64_t i = (int64_t)blockIdx.x * HC_TILE + j * 256 + threadIdx.x;
        if (i < D) {
            float acc = 0.0f;
            for (int s = 0; s < h; s++) acc += pre_s[s] * xt[s * D + i];
            yt[i] = acc;
        }
    }
}

static void launch_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                          int nt, int D, int h, int head, float eps, int iters,
                          float *y, float *post, float *comb) {
    if (nt <= 0) return;
    if (h < 1 || h > HC_MAX) {
        fprintf(stderr, "ds4: hc_mix: n_hc = %d outside 1..%d\n", h, HC_MAX);
        exit(1);
    }
    dim3 grid((unsigned)((D + HC_TILE - 1) / HC_TILE > 0 ? (D + HC_TILE - 1) / HC_TILE : 1), (unsigned)nt);
    DS4_LAUNCH(k_hc_mix, grid, 256, 0, mix, scale, base, x, D, h, head, eps, iters, y, post, comb);
}

static void cuda_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                        int nt, int D, int n_hc, int head, float hc_eps, int sinkhorn_iters,
                        float *y, float *post, float *comb) {
    launch_hc_mix(mix, scale, base, x, nt, D, n_hc, head, hc_eps, sinkhorn_iters, y, post, comb);
}

__global__ void k_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                          int nt, int64_t D, int h, float *x_out) {
    ds4_grid_dep();
    const int64_t n = (int64_t)nt * D;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = idx / D, i = idx % D;
        float xr[HC_MAX];
        for (int b = 0; b < h; b++) xr[b] = x_res[(t * h + b) * D + i];
        const float fv = f[t * D + i];
        for (int a = 0; a < h; a++) {
            float acc = post[t * h + a] * fv;
            for (int b = 0; b < h; b++) acc += comb[t * h * h + a + h * b] * xr[b];
            x_out[(t * h + a) * D + i] = acc;
        }
    }
}

static void launch_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                           int nt, int D, int h, float *x_out) {
    if (nt <= 0 || D <= 0) return;
    if (h < 1 || h > HC_MAX) {
        fprintf(stderr, "ds4: hc_post: n_hc = %d outside 1..%d\n", h, HC_MAX);
        exit(1);
    }
    DS4_LAUNCH(k_hc_post, grid_for((int64_t)nt * D), 256, 0, f, x_res, post, comb, nt, D, h, x_out);
}

static void cuda_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                         int nt, int D, int n_hc, float *x_out) {
    launch_hc_post(f, x_res, post, comb, nt, D, n_hc, x_out);
}

/* hc_pre: the whole mHC pre step of a sublayer (decode: up to
 * HC_SPLIT_MAX_NT tokens) in one launch.
 *
 * The projection it contains (mix = fn . rmsnorm(x), fn {n_hc*D, n_mix}, 24
 * rows of 16384 for Flash) is the shape that starved the matvec kernels: few
 * rows, long K.  So K is spread over blocks instead of rows, and the blocks'
 * partials are reduced by the last block to finish:
 *
 *  Every block: one per (32 channels, token), 32 warps; warp (s, g) holds
 *    element (stream s, channel b*32 + lane).  It applies the previous
 *    sublayer's residual update to its elements (as k_hc_post computes it)
 *    and writes them to x, then forms the block's partial dot with each of
 *    the n_mix rows of fn (group g dots HCP_RPG of them) and its partial sum
 *    of squares (double, as the norm sums).  Warp butterflies, then the
 *    warps in stream order: a fixed shape.  The partials go to the op's flat
 *    scratch; then the block makes them visible (__threadfence) and counts
 *    itself done on the token's counter.
 *  The block that counts last (the counter reaches nb) resets the counter
 *    and finishes the token: warp r adds row r's partials in block order
 *    (lane-strided, then a butterfly), one more warp the squares; mix = rms
 *    * dot (the norm's scale applied after the dot: the same value up to
 *    rounding, ~1e-7 relative, well inside the tested bound); then pre,
 *    post and the Sinkhorn comb (warp 0, hc_sinkhorn_lanes), y = sum_s
 *    pre[s] x[s] and the sublayer's RMSNorm of y, by the other 31 warps.
 * Which block comes last depends on scheduling, but what it computes does
 * not: it reads every block's partials in block order, so the result is the
 * same bits on every run.  The counter is an integer (no float atomics).
 * A second launch for the finish cost its launch and ramp (~3 us on an
 * H200) 87 times per Flash token.  The partials live in the op's flat
 * scratch (nt * n_hc * D floats; this needs 26 per 32 channels), the
 * counters (one per token) are allocated once at init.
 * ------------------------------------------------------------------------- */

#define HCP_CH      32                  /* channels per block */
#define HCP_GROUPS  8                   /* row groups: warp (stream s, group g) dots rows of group g */
#define HCP_THREADS (HC_MAX * HCP_GROUPS * 32)
#define HCP_RPG     ((HC_NMIX_MAX + HCP_GROUPS - 1) / HCP_GROUPS)
#define HCF_CACHE   8                   /* y values per thread kept between the finish's passes */

/* fn is F32 (what ds4 synth writes) or F16 (the published Flash files). */
template <int WT>
__device__ __forceinline__ float hc_fn_elem(const void *fn, int64_t idx) {
    return WT == DS4_TYPE_F16 ? f16_bits_to_f32(((const uint16_t *)fn)[idx]) : ((const float *)fn)[idx];
}

/* The one hc_pre kernel (see the banner).  H is the stream count as a
 * template argument, so every input of the residual update (post, f, the H
 * comb entries and the H residual streams) is loaded in one round, before
 * any arithmetic: a runtime loop over the streams issued its loads one FMA
 * at a time, a memory latency each (6.1 us per call on an H200).  In the
 * finish, warp 0 runs post and Sinkhorn (a serial chain of ~40
 * normalisations) while warps 1..31 form y and its norm, so the block takes
 * the longer of the two, not their sum; the scales are read before the
 * first barrier and the norm weights with the y pass's loads, so no global
 * load waits behind a barrier.  What other blocks wrote (x, the partials)
 * is read through L2 (__ldcg). */
template <int H, int WT>
__global__ void __launch_bounds__(HCP_THREADS) k_hc_pre(const float *f, const float *x_res, float *x, const void *fn,
                                                       const float *scale, const float *base, const float *norm_w,
                                                       int64_t D, int head, float rms_eps, float hc_eps, int iters,
                                                       double *ss_part, float *dot_part, unsigned *count,
                                                       float *y, float *post, float *comb) {
    ds4_grid_dep();
    __shared__ float red[H][HC_NMIX_MAX];
    __shared__ double red_ss[H];
    __shared__ int last_s;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sw = warp % HC_MAX, g = warp / HC_MAX;
    const int b = blockIdx.x, t = blockIdx.y, nb = gridDim.x;
    const int n_mix = head ? H : (2 + H) * H;
    const int64_t i = (int64_t)b * HCP_CH + lane;
    const bool act = sw < H && i < D;
    const int64_t K = (int64_t)H * D;
    const int r0 = g * HCP_RPG;

    /* ---- every block: residual update, partial dots and squares ---- */
    float w[HCP_RPG];
#pragma unroll
    for (int j = 0; j < HCP_RPG; j++)             /* every load in flight before the math */
        w[j] = act && r0 + j < n_mix ? hc_fn_elem<WT>(fn, (int64_t)(r0 + j) * K + (int64_t)sw * D + i) : 0.0f;
    float v = 0.0f;
    if (act) {
        float *xe = x + ((int64_t)t * H + sw) * D + i;
        if (f) {
            const float *xr = x_res + (int64_t)t * H * D;
            const float pv = post[(int64_t)t * H + sw], fv = f[(int64_t)t * D + i];
            float cb[H], xv[H];
#pragma unroll
            for (int bb = 0; bb < H; bb++) {
                cb[bb] = comb[(int64_t)t * H * H + sw + H * bb];
                xv[bb] = xr[bb * D + i];
            }
            float acc = pv * fv;                  /* k_hc_post's order */
#pragma unroll
            for (int bb = 0; bb < H; bb++) acc += cb[bb] * xv[bb];
            if (g == 0) *xe = acc;
            v = acc;
        } else {
            v = *xe;
        }
    }
    if (sw < H) {
#pragma unroll
        for (int j = 0; j < HCP_RPG; j++) {
            if (r0 + j < n_mix) {                 /* warp-uniform: the butterflies interleave */
                const float p = warp_sum(w[j] * v);
                if (lane == 0) red[sw][r0 + j] = p;
            }
        }
        if (g == 0) {
            double ss = (double)(v * v);
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
            if (lane == 0) red_ss[sw] = ss;
        }
    }
    __syncthreads();
    const int64_t p0 = (int64_t)t * nb;
    if (threadIdx.x < n_mix) {
        float acc = 0.0f;
#pragma unroll
        for (int s = 0; s < H; s++) acc += red[s][threadIdx.x];
        dot_part[(p0 + b) * n_mix + threadIdx.x] = acc;
    } else if (threadIdx.x == HC_NMIX_MAX) {
        double acc = 0.0;
#pragma unroll
        for (int s = 0; s < H; s++) acc += red_ss[s];
        ss_part[p0 + b] = acc;
    }
    /* every read of post and comb above is done before this block counts
     * itself, so the last block may overwrite them.  Only the warps that
     * wrote global memory (x by group 0, the partials by warp 0) fence: a
     * fence in all 32 warps was 15% of the kernel's stall samples. */
    if (g == 0) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_s = atomicAdd(&count[t], 1u) == (unsigned)nb - 1u;
    __syncthreads();
    if (!last_s) return;
    __threadfence();

    /* ---- the last block: reduce, mix, Sinkhorn, y and its norm ---- */
    __shared__ float m_s[HC_NMIX_MAX], base_s[HC_NMIX_MAX];
    __shared__ double ss_s, red2[HCP_THREADS / 32];
    const float sc0 = scale[0];
    float sc1 = 0.0f, sc2 = 0.0f;
    if (threadIdx.x == 0) {
        count[t] = 0;                             /* ready for the next launch */
        if (!head) { sc1 = scale[1]; sc2 = scale[2]; }
    }
    if (warp < n_mix) {
        float acc = 0.0f;
        for (int bb = lane; bb < nb; bb += 32) acc += __ldcg(&dot_part[(p0 + bb) * n_mix + warp]);
        acc = warp_sum(acc);
        if (lane == 0) m_s[warp] = acc;
    } else if (warp == HC_NMIX_MAX) {
        double acc = 0.0;
        for (int bb = lane; bb < nb; bb += 32) acc += __ldcg(&ss_part[p0 + bb]);
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(FULL_MASK, acc, o);
        if (lane == 0) ss_s = acc;
    } else if (warp == HC_NMIX_MAX + 1) {
        for (int r = lane; r < n_mix; r += 32) base_s[r] = base[r];
    }
    __syncthreads();
    /* mix = rms * dot, and pre, computed the same way by every thread */
    const float rs = 1.0f / sqrtf((float)(ss_s / (double)(H * D)) + rms_eps);
    float pre[H];
#pragma unroll
    for (int s = 0; s < H; s++) pre[s] = sigmoid_f((m_s[s] * rs) * sc0 + base_s[s]) + hc_eps;

    const float *xt = x + (int64_t)t * H * D;
    float *yt = y + (int64_t)t * D;
    constexpr int YT = HCP_THREADS - 32;          /* the threads of warps 1..31 */
    const int yi = threadIdx.x - 32;
    float yc[HCF_CACHE], nw[HCF_CACHE];
    double ss = 0.0;
    if (warp == 0) {
        if (!head) {
            /* mix = rms * dot for the post and comb logits (entries >= H: the
             * other warps read only the pre logits, entries < H) */
            for (int r = H + lane; r < (2 + H) * H; r += 32) m_s[r] *= rs;
            __syncwarp();
            hc_sinkhorn_lanes<H>(m_s, base_s, __shfl_sync(FULL_MASK, sc1, 0), __shfl_sync(FULL_MASK, sc2, 0),
                                 hc_eps, iters, post + (int64_t)t * H, comb + (int64_t)t * H * H);
        }
    } else {
#pragma unroll
        for (int j = 0; j < HCF_CACHE; j++) {
            const int64_t e = (int64_t)j * YT + yi;
            float acc = 0.0f;
            nw[j] = 1.0f;
            if (e < D) {
                if (norm_w) nw[j] = norm_w[e];
#pragma unroll
                for (int s = 0; s < H; s++) acc += pre[s] * __ldcg(&xt[s * D + e]);
            }
            yc[j] = acc;
            ss += (double)(acc * acc);
        }
        for (int64_t e = (int64_t)HCF_CACHE * YT + yi; e < D; e += YT) {
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < H; s++) acc += pre[s] * __ldcg(&xt[s * D + e]);
            ss += (double)(acc * acc);
        }
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    if (lane == 0) red2[warp] = ss;
    __syncthreads();
    if (warp == 0) return;
    double tot = 0.0;
    for (int wv = 0; wv < HCP_THREADS / 32; wv++) tot += red2[wv];
    const float sc = 1.0f / sqrtf((float)(tot / (double)D) + rms_eps);
#pragma unroll
    for (int j = 0; j < HCF_CACHE; j++) {
        const int64_t e = (int64_t)j * YT + yi;
        if (e < D) yt[e] = norm_w ? yc[j] * sc * nw[j] : yc[j] * sc;
    }
    for (int64_t e = (int64_t)HCF_CACHE * YT + yi; e < D; e += YT) {
        float acc = 0.0f;
#pragma unroll
        for (int s = 0; s < H; s++) acc += pre[s] * __ldcg(&xt[s * D + e]);
        yt[e] = norm_w ? acc * sc * norm_w[e] : acc * sc;
    }
}

template <int H>
static void launch_hc_pre_t(const float *f, const float *x_res, float *x, const void *fn, int wt,
                            const float *scale, const float *base, const float *norm_w, int nt, int64_t D,
                            int head, float rms_eps, float hc_eps, int iters, int nb,
                            double *ss_part, float *dot_part, float *y, float *post, float *comb) {
    const dim3 grid((unsigned)nb, (unsigned)nt);
    if (wt == DS4_TYPE_F16)
        DS4_LAUNCH(k_hc_pre<H, DS4_TYPE_F16>, grid, HCP_THREADS, 0, f, x_res, x, fn, scale, base, norm_w, D, head,
                   rms_eps, hc_eps, iters, ss_part, dot_part,
                   sess()->hc_count, y, post, comb);
    else
        DS4_LAUNCH(k_hc_pre<H, DS4_TYPE_F32>, grid, HCP_THREADS, 0, f, x_res, x, fn, scale, base, norm_w, D, head,
                   rms_eps, hc_eps, iters, ss_part, dot_part,
                   sess()->hc_count, y, post, comb);
}

/* The one launcher of k_hc_pre (a template over H and the fn type). */
static void launch_hc_pre(const float *f, const float *x_res, float *x, const void *fn, int wt,
                          const float *scale, const float *base, const float *norm_w, int nt, int64_t D, int h,
                          int head, float rms_eps, float hc_eps, int iters, int nb,
                          double *ss_part, float *dot_part, float *y, float *post, float *comb) {
    switch (h) {
    case 1: launch_hc_pre_t<1>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    case 2: launch_hc_pre_t<2>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    case 3: launch_hc_pre_t<3>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    default: launch_hc_pre_t<4>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    }
}

static void cuda_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps);
static void cuda_matmul(const ds4_weight *w, int expert, const float *x, float *y, int nt);

static void cuda_hc_pre(const float *f, const float *x_res, float *x,
                        const ds4_weight *fn, const float *scale, const float *base, const float *norm_w,
                        int nt, int D, int n_hc, int head, float rms_eps, float hc_eps, int iters,
                        float *flat, float *mix, float *y, float *post, float *comb) {
    if (nt <= 0 || D <= 0) return;
    const int h = n_hc, n_mix = head ? h : (2 + h) * h;
    if (h < 1 || h > HC_MAX) {
        fprintf(stderr, "ds4: hc_pre: n_hc = %d outside 1..%d\n", h, HC_MAX);
        exit(1);
    }
    if (fn->ne[0] != (int64_t)h * D || fn->ne[1] != n_mix) {
        fprintf(stderr, "ds4: hc_pre: %s must be {%d, %d}\n", fn->name ? fn->name : "fn", h * D, n_mix);
        exit(1);
    }
    const int nb = (int)((D + HCP_CH - 1) / HCP_CH);
    if (nt > HC_SPLIT_MAX_NT || (fn->type != DS4_TYPE_F32 && fn->type != DS4_TYPE_F16) ||
        (int64_t)nb * (n_mix + 2) > (int64_t)h * D) {
        /* the CPU op's composition: the projection through the matmul op
         * (cuBLAS for a prompt, any weight type) */
        if (f) launch_hc_post(f, x_res, post, comb, nt, D, h, x);
        cuda_rmsnorm(x, NULL, flat, nt, h * D, rms_eps);
        cuda_matmul(fn, 0, flat, mix, nt);
        launch_hc_mix(mix, scale, base, x, nt, D, h, head, hc_eps, iters, y, post, comb);
        cuda_rmsnorm(y, norm_w, y, nt, D, rms_eps);
        return;
    }
    /* flat holds nt*h*D floats: the squares (doubles) first, then the dots */
    double *ss_part = (double *)flat;
    float *dot_part = flat + 2 * (int64_t)nt * nb;
    launch_hc_pre(f, x_res, x, fn->dev, fn->type, scale, base, norm_w, nt, D, h, head, rms_eps, hc_eps, iters, nb,
                  ss_part, dot_part, y, post, comb);
}

/* ---------------------------------------------------------------------------
 * RMSNorm
 *
 * One block per row (1024 threads for wide rows, which at decode are a single
 * row and so a single block: its loads must all be in flight together).
 * Squares are summed in double (as the CPU op and ggml do) through a
 * fixed-shape block reduction; each thread keeps its first RMS_PER elements
 * in registers for the scaling pass (as float4 when everything is aligned).  All reads of x (but the tail beyond
 * RMS_PER per thread, which each thread rereads just before writing it)
 * happen before the barrier, so y == x is safe.
 * ------------------------------------------------------------------------- */

/* The rows a compressor emits in a step (the composition path of
 * compressor_step): with er.step set, a kernel over rows handles row i <
 * ds4_emit_count(pos0, er.nt, er.ratio) at row offset w0 + i, w0 =
 * ds4_emit_first(pos0, er.ratio); rows past the count do nothing.  The grid
 * is sized for the most a batch of er.nt tokens can emit. */
typedef struct {
    const ds4_step *step;     /* NULL: the plain op */
    int ratio, nt;
} emit_rows;

static emit_rows no_emit(void) { emit_rows e = { NULL, 0, 0 }; return e; }
static int emit_rows_max(int nt, int ratio) { return (nt + ratio - 1) / ratio; }

/* Rows of the launch (all of them, or this step's emitted ones) and the first row's index. */
__device__ __forceinline__ int emit_span(const emit_rows &e, int rows, int *first) {
    if (!e.step) { *first = 0; return rows; }
    const int p0 = e.step->pos0;
    *first = ds4_emit_first(p0, e.ratio);
    return ds4_emit_count(p0, e.nt, e.ratio);
}

#define RMS_PER 16   /* elements per thread kept in registers between the passes */

/* VEC: rows, x, y and w are 16-byte aligned, so the cached elements move as
 * float4 (four times fewer load/store instructions: a decode row is a single
 * block, and its issue rate is the limit). */
template <int THREADS, bool VEC>
__global__ void __launch_bounds__(THREADS) k_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps,
                                                     emit_rows er) {
    ds4_grid_dep();
    __shared__ double part[THREADS / 32];
    int first;
    if ((int)blockIdx.x >= emit_span(er, gridDim.x, &first)) return;
    const float *xr = x + ((int64_t)first + blockIdx.x) * n;
    float *yr = y + ((int64_t)first + blockIdx.x) * n;
    constexpr int STEP = VEC ? 4 : 1;
    constexpr int NV = RMS_PER / STEP;
    /* element i of vector j of thread tid: (j * THREADS + tid) * STEP + i */
    float v[RMS_PER];
#pragma unroll
    for (int j = 0; j < NV; j++) {               /* all loads in flight at once */
        const int64_t e = ((int64_t)j * THREADS + threadIdx.x) * STEP;
        if (VEC) {
            const float4 q = e < n ? *(const float4 *)(xr + e) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[4 * j] = q.x; v[4 * j + 1] = q.y; v[4 * j + 2] = q.z; v[4 * j + 3] = q.w;
        } else {
            v[j] = e < n ? xr[e] : 0.0f;
        }
    }
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < RMS_PER; j++) ss += (double)(v[j] * v[j]);
    const int64_t cached = (int64_t)RMS_PER * THREADS;
    for (int64_t i = cached + threadIdx.x; i < n; i += THREADS) {
        const float u = xr[i];
        ss += (double)(u * u);
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();                            /* every read of x is done: y == x is safe */
    double tot = 0.0;
    for (int i = 0; i < THREADS / 32; i++) tot += part[i];
    const float scale = 1.0f / sqrtf((float)(tot / (double)n) + eps);
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int64_t e = ((int64_t)j * THREADS + threadIdx.x) * STEP;
        if (e >= n) continue;
        if (VEC) {
            float4 q = make_float4(v[4 * j] * scale, v[4 * j + 1] * scale, v[4 * j + 2] * scale, v[4 * j + 3] * scale);
            if (w) {
                const float4 g = *(const float4 *)(w + e);
                q.x *= g.x; q.y *= g.y; q.z *= g.z; q.w *= g.w;
            }
            *(float4 *)(yr + e) = q;
        } else {
            yr[e] = w ? v[j] * scale * w[e] : v[j] * scale;
        }
    }
    for (int64_t i = cached + threadIdx.x; i < n; i += THREADS) {
        const float u = xr[i] * scale;
        yr[i] = w ? u * w[i] : u;
    }
}

/* rows: the rows to normalise, or with er.step the most a step can emit
 * (the row offset w0*n keeps the float4 alignment of x and y when n % 4 == 0). */
static void launch_rmsnorm_rows(const float *x, const float *w, float *y, int rows, int n, float eps, emit_rows er) {
    if (rows <= 0 || n <= 0) return;
    const bool vec = n % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)w % 16 == 0;
    if (n >= 4096) {
        if (vec) DS4_LAUNCH(k_rmsnorm<1024, true>, rows, 1024, 0, x, w, y, n, eps, er);
        else DS4_LAUNCH(k_rmsnorm<1024, false>, rows, 1024, 0, x, w, y, n, eps, er);
    } else {
        if (vec) DS4_LAUNCH(k_rmsnorm<256, true>, rows, 256, 0, x, w, y, n, eps, er);
        else DS4_LAUNCH(k_rmsnorm<256, false>, rows, 256, 0, x, w, y, n, eps, er);
    }
}

static void launch_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps) {
    launch_rmsnorm_rows(x, w, y, rows, n, eps, no_emit());
}

static void cuda_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps) {
    launch_rmsnorm(x, w, y, rows, n, eps);
}

/* ---------------------------------------------------------------------------
 * Matmul
 *
 * Three engines behind one interface:
 *
 *  1. The fast matvec (k_matvec), for nt <= MV_MAX_NT on rows of a multiple of
 *     1024 elements.  A row is cut into slices of 1024 elements; each warp
 *     owns one slice and keeps the matching activations in registers (32 per
 *     lane, for up to 4 tokens), then walks down rows.  A block of 8 warps
 *     covers S = K/1024 slices x 8/S row groups; each warp writes its slice's
 *     partial sum to shared memory and the block adds the S partials of a row
 *     in slice order at the end.
 *     The activations reach the registers through shared memory: a lane's 32
 *     values are contiguous, so reading them straight from global memory
 *     touches 32 cache lines per instruction and costs more than reading the
 *     weights.  The block loads
 *     them coalesced into a padded (bank-conflict-free) buffer instead, while
 *     the first weight rows are already in flight.
 *     Q8_0 rows (34-byte blocks, only 16-byte aligned per 1024 elements) are
 *     copied into a per-warp shared-memory ring with cp.async, several rows
 *     ahead, so the loads are coalesced 16-byte transactions; each lane then
 *     reads its own 34-byte block from shared memory (9 aligned words and a
 *     funnel shift).  int8 -> f32 goes through a byte permute into the
 *     mantissa of 2^23 and one subtraction, which is exact and cheaper than
 *     the conversion instruction.  F32/F16/BF16 rows are read straight into
 *     registers with coalesced 16-byte loads.
 *     Measured on an H200 (copy bandwidth 4.23 TB/s read+write): the
 *     4096x129280 Q8_0 head streams at 4.0 TB/s, 4096x8192 at 2.6 TB/s;
 *     matrices of a few MB are bound by launch and latency (~5 us).
 *     The same kernel serves the MoE decode path: "gate|up" mode dots two
 *     matrices per row and writes swiglu(gate, up); "down" mode takes its
 *     activations per (token, expert slot).  The expert id is read from sel
 *     on the device.
 *  2. The generic matvec (k_matvec_generic): a warp per row for any K, any
 *     type; slower, and used only for shapes the fast kernel does not take.
 *  3. Prefill (nt > MV_MAX_NT): dequantize row tiles into an f32 scratch and
 *     call cublasSgemm.  cuBLAS is column-major: y[nt][N] = x[nt][K] W^T is
 *     C(N x nt) = A^T B with A the K x N column-major view of W.
 * ------------------------------------------------------------------------- */

#define MV_MAX_NT      8       /* up to this many tokens the matvec beats dequant + GEMM */
#define MV_THREADS     256
#define MV_WARPS       8
#define MV_SLICE       1024    /* elements of a row one warp owns */
#define MV_Q8_SLICE    1088    /* bytes of a Q8_0 slice: 32 blocks x 34 */
#define MV_RPG_MAX     16      /* rows per warp per block */
#define MV_PART        (MV_WARPS * MV_RPG_MAX)  /* partials per output plane */
#define DEQ_CAP_FLOATS ((int64_t)64 << 20)      /* 256 MiB of dequantized rows at most */

enum { MV_DENSE = 0, MV_GATE_UP = 1, MV_DOWN = 2 };

typedef struct {
    const uint8_t *w;          /* matrix; expert 0 of a 3-D weight in the MoE modes */
    const uint8_t *w2;         /* up matrix (MV_GATE_UP) */
    size_t   mat_bytes;        /* bytes between problems' matrices (group rows / one expert) */
    size_t   row_bytes;
    int      K, S, rows, rpg;  /* row length, slices, rows per problem, rows per warp */
    const float *x;
    int64_t  x_prob, x_tok;    /* float offsets of x per problem (blockIdx.y) and per token */
    float   *y;
    int64_t  y_prob, y_tok;
    const int32_t *sel;        /* MoE: [nt][k] expert ids; NULL in gate|up mode = matrix 0 (shared expert) */
    int      k;
    float    clamp;            /* MV_GATE_UP: swiglu limit */
    /* dense mode, several matrices of one K and type sharing x (matmul_multi):
     * segment i owns blocks [seg_tile0[i], seg_tile0[i+1]) of blockIdx.x and
     * writes y = seg_y[i] (token stride seg_ytok[i]), optionally adding row
     * (pos0 + token) % period of seg_tab[i], pos0 read from *tab_step when the
     * kernel runs.  n_seg == 0: the single matrix above. */
    int      n_seg;
    int      seg_tile0[DS4_MULTI_MAX + 1];
    int      seg_rows[DS4_MULTI_MAX];
    const uint8_t *seg_w[DS4_MULTI_MAX];
    float   *seg_y[DS4_MULTI_MAX];
    const float *seg_tab[DS4_MULTI_MAX];
    const ds4_step *tab_step;  /* the step block (seg_tab rows follow its position) */
    int      tok0, tab_period;  /* tok0: first token of this launch's chunk */
    const float *in_norm;      /* dense: use rmsnorm(x)*in_norm in place of x (NULL: x) */
    float    in_eps;
} mv_args;

/* Shared-memory ring depth for Q8_0 staging: rows in flight per warp (the
 * gate|up mode stages two rows per step).  MV_MIN_BLOCKS: the launch-bounds
 * floor of resident blocks per SM for one-token launches, which caps the
 * registers.  Both can be set at build time (-DMV_ST_DENSE=...) to measure
 * them.  A sweep on an H200 (bench/RESULTS.md, 2026-12-01: dense 3..8,
 * gate|up 2..6, floor 1..4) moved no shape by more than a few percent: the
 * kernel is bound by instruction issue (~160 per 1088-byte row slice) as
 * much as by memory.  The shallowest ring was best on the large shapes
 * (q_b, the output projections, the experts: 2-4% faster) and within 2% on
 * the small ones, so it is the default. */
#ifndef MV_ST_DENSE
#define MV_ST_DENSE 3
#endif
#ifndef MV_ST_GATE_UP
#define MV_ST_GATE_UP 2
#endif
#ifndef MV_MIN_BLOCKS
#define MV_MIN_BLOCKS 2
#endif
template <int MODE> struct mv_stages { static const int n = (MODE == MV_GATE_UP) ? MV_ST_GATE_UP : MV_ST_DENSE; };

/* Activations of one token, staged for the register load: S slices of 1024
 * floats, each 32-float group followed by 4 floats of padding so that lanes
 * reading 16 bytes at 32-float strides hit distinct banks. */
#define MV_XS_FLOATS (MV_SLICE + MV_SLICE / 8)
__host__ __device__ __forceinline__ int mv_xs_addr(int e) { return e + 4 * (e >> 5); }

/* Dynamic shared memory: [S][MV_XS_FLOATS] activations, then the Q8_0 ring,
 * then (in_norm only) the norm weights staged like the activations. */
template <int TYPE, int MODE>
__host__ __device__ constexpr size_t mv_ring_bytes() {
    return TYPE == DS4_TYPE_Q8_0
        ? (size_t)MV_WARPS * mv_stages<MODE>::n * (MODE == MV_GATE_UP ? 2 : 1) * MV_Q8_SLICE
        : 0;
}
template <int TYPE, int MODE>
static size_t mv_smem_bytes(int S, bool in_norm) {
    return (size_t)S * MV_XS_FLOATS * sizeof(float) * (in_norm ? 2 : 1) + mv_ring_bytes<TYPE, MODE>();
}

/* Which element of its slice lane `lane` multiplies into its m-th product:
 * it mirrors how each type's row bytes land in the lane. */
template <int TYPE>
__device__ __forceinline__ int mv_xidx(int lane, int m) {
    if (TYPE == DS4_TYPE_Q8_0) return 32 * lane + m;                        /* one block per lane */
    if (TYPE == DS4_TYPE_F32)  return 4 * (lane + 32 * (m >> 2)) + (m & 3); /* float4 chunks */
    return 8 * (lane + 32 * (m >> 3)) + (m & 7);                            /* 8 halves per chunk */
}

/* Dot of the lane's Q8_0 block (in the staged slice) with its activations. */
template <int NT>
__device__ __forceinline__ void mv_dot_q8(const uint8_t *slot, int lane, const float (&xr)[NT][32],
                                          float (&acc)[NT]) {
    /* Block `lane` starts at byte 34*lane: 4-aligned for even lanes, 2 past a
     * 4-byte boundary for odd ones.  Load 9 aligned words from the boundary at
     * or before it; the scale is the low or high half of word 0, and quant
     * word i is the funnel shift of words i, i+1 by 16 (even) or 32 (odd). */
    const int odd = lane & 1;
    const uint32_t *wp = (const uint32_t *)(slot + 34 * lane - 2 * odd);
    uint32_t wd[9];
#pragma unroll
    for (int i = 0; i < 9; i++) wd[i] = wp[i];
    const float d = f16_bits_to_f32((uint16_t)(odd ? (wd[0] >> 16) : (wd[0] & 0xffffu)));
    const unsigned sh = odd ? 32u : 16u;
    float s[NT];
#pragma unroll
    for (int u = 0; u < NT; u++) s[u] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        /* bias the signed bytes to 0..255 and place each in the mantissa of
         * 2^23: the float is 2^23 + q + 128 exactly */
        const uint32_t q = __funnelshift_rc(wd[i], wd[i + 1], sh) ^ 0x80808080u;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const float f = __int_as_float((int)__byte_perm(q, 0x4B000000u, 0x7440u + b)) - 8388736.0f;
#pragma unroll
            for (int u = 0; u < NT; u++) s[u] = fmaf(f, xr[u][4 * i + b], s[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < NT; u++) acc[u] = d * s[u];
}

/* Dot of the lane's F32/F16/BF16 chunks of a slice with its activations. */
template <int TYPE, int NT>
__device__ __forceinline__ void mv_dot_vec(const uint4 *v, const float (&xr)[NT][32], float (&acc)[NT]) {
    constexpr int NV = TYPE == DS4_TYPE_F32 ? 8 : 4;
#pragma unroll
    for (int u = 0; u < NT; u++) acc[u] = 0.0f;
#pragma unroll
    for (int c = 0; c < NV; c++) {
        const uint32_t wd[4] = { v[c].x, v[c].y, v[c].z, v[c].w };
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (TYPE == DS4_TYPE_F32) {
                const float f = __uint_as_float(wd[j]);
#pragma unroll
                for (int u = 0; u < NT; u++) acc[u] = fmaf(f, xr[u][4 * c + j], acc[u]);
            } else {
                float f0, f1;
                if (TYPE == DS4_TYPE_F16) {
                    f0 = f16_bits_to_f32((uint16_t)(wd[j] & 0xffffu));
                    f1 = f16_bits_to_f32((uint16_t)(wd[j] >> 16));
                } else {
                    f0 = __uint_as_float(wd[j] << 16);
                    f1 = __uint_as_float(wd[j] & 0xffff0000u);
                }
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    acc[u] = fmaf(f0, xr[u][8 * c + 2 * j], acc[u]);
                    acc[u] = fmaf(f1, xr[u][8 * c + 2 * j + 1], acc[u]);
                }
            }
        }
    }
}

template <int TYPE, int NT, int MODE>
__global__ void __launch_bounds__(MV_THREADS, NT >= 4 ? 1 : NT >= 2 ? 2 : MV_MIN_BLOCKS) k_matvec(const mv_args a) {
    /* NOTE(pdl prologue): dense mode reads nothing another kernel writes until its grid wait
     * below -- the weights and the step block are the host's -- so its first rows' copies can
     * be in flight while the kernel before it finishes */
    if (MODE != MV_DENSE) ds4_grid_dep();   /* NOTE(pdl prologue): the MoE modes read the experts chosen */
    constexpr bool DUAL = MODE == MV_GATE_UP;
    constexpr int NMAT = DUAL ? 2 : 1;
    constexpr int NPLANE = DUAL ? 2 : NT;
    static_assert(!(DUAL && NT != 1), "gate|up mode is single-token");
    extern __shared__ __align__(16) uint8_t mv_smem[];
    __shared__ float part[NPLANE][MV_PART];   /* [plane][local row * S + slice] */

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = a.S, G = MV_WARPS / S;
    const int s = warp % S, g = warp / S;
    const int tile = G * a.rpg;
    const int prob = blockIdx.y, tok = blockIdx.z;
    float *xs = (float *)mv_smem;                                    /* [S][MV_XS_FLOATS] */
    uint8_t *stage = mv_smem + (size_t)S * MV_XS_FLOATS * sizeof(float);
    float *ws = (float *)(stage + mv_ring_bytes<TYPE, MODE>());      /* in_norm: [S][MV_XS_FLOATS] */

    const size_t mat = (MODE == MV_DENSE || !a.sel) ? (size_t)prob
                                                    : (size_t)a.sel[(int64_t)tok * a.k + prob];
    const uint8_t *W[NMAT];
    W[0] = a.w + mat * a.mat_bytes;
    if (DUAL) W[NMAT - 1] = a.w2 + mat * a.mat_bytes;
    const float *x = a.x + (int64_t)tok * a.x_tok + (int64_t)prob * a.x_prob;
    float *y = a.y + (int64_t)tok * a.y_tok + (int64_t)prob * a.y_prob;
    int rows = a.rows, bx = blockIdx.x;
    int64_t y_tok = a.y_tok;
    const float *tab = NULL;
    int tab_pos0 = 0;                           /* read now: its latency hides behind the main loop */
    if (MODE == MV_DENSE && a.n_seg > 0) {      /* matmul_multi: find this block's matrix */
        int sg = 0;
        while (sg + 1 < a.n_seg && bx >= a.seg_tile0[sg + 1]) sg++;
        bx -= a.seg_tile0[sg];
        rows = a.seg_rows[sg];
        W[0] = a.seg_w[sg];
        y = a.seg_y[sg];
        y_tok = rows;
        tab = a.seg_tab[sg];
        if (tab) tab_pos0 = a.tab_step->pos0;
    }

    /* my rows: first + G*i, i < n_mine */
    const int first = bx * tile + g;
    const int n_mine = first < rows ? min(a.rpg, (rows - 1 - first) / G + 1) : 0;

    /* Q8_0: put the first rows in flight before anything else */
    constexpr int ST = mv_stages<MODE>::n;
    uint8_t *ring = stage + (size_t)warp * ST * NMAT * MV_Q8_SLICE;
    if (TYPE == DS4_TYPE_Q8_0) {
#pragma unroll
        for (int p = 0; p < ST - 1; p++) {     /* one commit group per row, even if empty */
            if (p < n_mine) {
                const size_t off = (size_t)(first + G * p) * a.row_bytes + (size_t)s * MV_Q8_SLICE;
#pragma unroll
                for (int mt = 0; mt < NMAT; mt++) {
                    uint8_t *dst = ring + (size_t)(p * NMAT + mt) * MV_Q8_SLICE;
                    for (int c = lane; c < MV_Q8_SLICE / 16; c += 32)
                        cp_async16(dst + 16 * c, W[mt] + off + 16 * c);
                }
            }
            cp_async_commit();
        }
    }
    if (MODE == MV_DENSE) ds4_grid_dep();   /* NOTE(pdl prologue): x, written by the kernel before */

    /* activations: coalesced loads of all S slices by the block, one token
     * at a time, then each lane takes its 32 values in 16-byte reads */
    float xr[NT][32];
    __shared__ double nred[MV_WARPS];
#pragma unroll
    for (int u = 0; u < NT; u++) {
        const float *xu = x + (int64_t)u * a.x_tok;
        double ss = 0.0;
#pragma unroll 8
        for (int e = threadIdx.x; e < S * MV_SLICE; e += MV_THREADS) {
            const float v = xu[e];
            xs[mv_xs_addr(e)] = v;
            if (a.in_norm) {
                ss += (double)(v * v);
                if (u == 0) ws[mv_xs_addr(e)] = a.in_norm[e];   /* coalesced, like x */
            }
        }
        float nsc = 1.0f;
        if (a.in_norm) {            /* the input's RMSNorm, as k_rmsnorm computes it */
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
            if (lane == 0) nred[warp] = ss;
        }
        __syncthreads();
        if (a.in_norm) {
            double tot = 0.0;
            for (int wv = 0; wv < MV_WARPS; wv++) tot += nred[wv];
            nsc = 1.0f / sqrtf((float)(tot / (double)a.K) + a.in_eps);
        }
        const float *xw = xs + s * MV_XS_FLOATS;
#pragma unroll
        for (int m = 0; m < 32; m += 4) {
            const float4 v = *(const float4 *)(xw + mv_xs_addr(mv_xidx<TYPE>(lane, m)));
            xr[u][m] = v.x; xr[u][m + 1] = v.y; xr[u][m + 2] = v.z; xr[u][m + 3] = v.w;
        }
        if (a.in_norm) {
            const float *ww = ws + s * MV_XS_FLOATS;
#pragma unroll
            for (int m = 0; m < 32; m += 4) {
                const float4 g = *(const float4 *)(ww + mv_xs_addr(mv_xidx<TYPE>(lane, m)));
                xr[u][m]     = __fmul_rn(__fmul_rn(xr[u][m], nsc), g.x);
                xr[u][m + 1] = __fmul_rn(__fmul_rn(xr[u][m + 1], nsc), g.y);
                xr[u][m + 2] = __fmul_rn(__fmul_rn(xr[u][m + 2], nsc), g.z);
                xr[u][m + 3] = __fmul_rn(__fmul_rn(xr[u][m + 3], nsc), g.w);
            }
        }
        __syncthreads();
    }

    if (TYPE == DS4_TYPE_Q8_0) {
        for (int i = 0; i < n_mine; i++) {
            const int ahead = i + ST - 1;
            if (ahead < n_mine) {
                const size_t off = (size_t)(first + G * ahead) * a.row_bytes + (size_t)s * MV_Q8_SLICE;
#pragma unroll
                for (int mt = 0; mt < NMAT; mt++) {
                    uint8_t *dst = ring + (size_t)((ahead % ST) * NMAT + mt) * MV_Q8_SLICE;
                    for (int c = lane; c < MV_Q8_SLICE / 16; c += 32)
                        cp_async16(dst + 16 * c, W[mt] + off + 16 * c);
                }
            }
            cp_async_commit();
            cp_async_wait<ST - 1>();   /* row i's group has landed (for this lane) */
            __syncwarp();              /* ... and for every lane */
            const int lr = g + G * i;
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
                float acc[NT];
                mv_dot_q8<NT>(ring + (size_t)((i % ST) * NMAT + mt) * MV_Q8_SLICE, lane, xr, acc);
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    const float r = warp_sum(acc[u]);
                    if (lane == 0) part[DUAL ? mt : u][lr * S + s] = r;
                }
            }
            __syncwarp();              /* slot (i % ST) is refilled next iteration */
        }
        cp_async_wait<0>();
    } else {
        constexpr int NV = TYPE == DS4_TYPE_F32 ? 8 : 4;
        const size_t slice_bytes = (size_t)MV_SLICE * (TYPE == DS4_TYPE_F32 ? 4 : 2);
        for (int i = 0; i < n_mine; i++) {
            const size_t off = (size_t)(first + G * i) * a.row_bytes + (size_t)s * slice_bytes;
            uint4 v[NMAT][NV];
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++)
#pragma unroll
                for (int c = 0; c < NV; c++)
                    v[mt][c] = ld_stream16(W[mt] + off + 16 * (size_t)(lane + 32 * c));
            const int lr = g + G * i;
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
                float acc[NT];
                mv_dot_vec<TYPE, NT>(v[mt], xr, acc);
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    const float r = warp_sum(acc[u]);
                    if (lane == 0) part[DUAL ? mt : u][lr * S + s] = r;
                }
            }
        }
    }
    __syncthreads();

    /* sum each row's S slice partials in slice order */
    constexpr int NOUT = DUAL ? 1 : NT;
    for (int idx = threadIdx.x; idx < tile * NOUT; idx += MV_THREADS) {
        const int lr = idx % tile, u = idx / tile;
        const int row = bx * tile + lr;
        if (row >= rows) continue;
        float v0 = 0.0f;
        for (int q = 0; q < S; q++) v0 += part[DUAL ? 0 : u][lr * S + q];
        if (DUAL) {
            float v1 = 0.0f;
            for (int q = 0; q < S; q++) v1 += part[NPLANE - 1][lr * S + q];
            y[row] = silu_mul(v0, v1, a.clamp);
        } else {
            if (tab) v0 = __fadd_rn(v0, tab[(int64_t)((tab_pos0 + a.tok0 + u) % a.tab_period) * rows + row]);
            y[(int64_t)u * y_tok + row] = v0;
        }
    }

}

/* Rows per warp and the grid of a fast launch.  One wave: aim for as many
 * blocks as fit on the device at once (blocks_per_sm, from the occupancy of
 * this instantiation and its shared memory), since a launch of 1.3 waves
 * takes two block times; rows per warp grow only once every resident slot
 * has a block.  Segments (matmul_multi) get whole tiles of their own. */
static dim3 mv_plan(mv_args &a, int n_prob, int n_tok_grid, int blocks_per_sm) {
    const int G = MV_WARPS / a.S;
    const int64_t want_blocks = (int64_t)blocks_per_sm * g_cuda.n_sm;
    const int64_t probs = (int64_t)n_prob * n_tok_grid;
    int64_t all_rows = a.rows;
    if (a.n_seg > 0) {
        all_rows = 0;
        for (int i = 0; i < a.n_seg; i++) all_rows += a.seg_rows[i];
    }
    int64_t per_prob = (want_blocks + probs - 1) / probs;
    if (per_prob < 1) per_prob = 1;
    int64_t rpg = (all_rows + G * per_prob - 1) / (G * per_prob);
    if (rpg < 1) rpg = 1;
    if (rpg > MV_RPG_MAX) rpg = MV_RPG_MAX;
    a.rpg = (int)rpg;
    const int tile = G * a.rpg;
    int64_t tiles = (a.rows + tile - 1) / tile;
    if (a.n_seg > 0) {
        tiles = 0;
        for (int i = 0; i < a.n_seg; i++) {
            a.seg_tile0[i] = (int)tiles;
            tiles += (a.seg_rows[i] + tile - 1) / tile;
        }
        a.seg_tile0[a.n_seg] = (int)tiles;
    }
    return dim3((unsigned)tiles, (unsigned)n_prob, (unsigned)n_tok_grid);
}

/* Resident blocks per SM of each k_matvec instantiation, by (S, norm):
 * asked once, at init (mv_setup_t, from ops_setup), never inside a step. */
template <int TYPE, int NT, int MODE> struct mv_occ { static int bps[MV_WARPS + 1][2]; };
template <int TYPE, int NT, int MODE> int mv_occ<TYPE, NT, MODE>::bps[MV_WARPS + 1][2];

/* Raise the instantiation's shared-memory limit (for the largest S, with the
 * norm buffer) and ask its occupancy for every S the fast path takes. */
template <int TYPE, int NT, int MODE>
static void mv_setup_t(void) {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_matvec<TYPE, NT, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)mv_smem_bytes<TYPE, MODE>(MV_WARPS, MODE == MV_DENSE)));
    for (int S = 1; S <= MV_WARPS; S *= 2)
        for (int norm = 0; norm < 2; norm++) {
            int n = 0;
            DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_matvec<TYPE, NT, MODE>, MV_THREADS,
                                                                         mv_smem_bytes<TYPE, MODE>(S, norm != 0)));
            mv_occ<TYPE, NT, MODE>::bps[S][norm] = n > 0 ? n : 1;
        }
}

template <int TYPE>
static void mv_setup_type(void) {
    mv_setup_t<TYPE, 1, MV_GATE_UP>();
    mv_setup_t<TYPE, 1, MV_DOWN>();
    mv_setup_t<TYPE, 1, MV_DENSE>();
    mv_setup_t<TYPE, 2, MV_DENSE>();
    mv_setup_t<TYPE, 4, MV_DENSE>();
}

/* The one launcher of k_matvec (a template over its instantiations). */
template <int TYPE, int NT, int MODE>
static void launch_matvec_fast_t(mv_args a, int n_prob, int n_tok_grid) {
    const bool norm = a.in_norm != NULL;
    const size_t smem = mv_smem_bytes<TYPE, MODE>(a.S, norm);
    const int bps = mv_occ<TYPE, NT, MODE>::bps[a.S][norm];
    if (bps < 1) {
        fprintf(stderr, "ds4: matvec: no occupancy for S = %d (ops_setup did not run)\n", a.S);
        exit(1);
    }
    const dim3 grid = mv_plan(a, n_prob, n_tok_grid, bps);
    DS4_LAUNCH(k_matvec<TYPE, NT, MODE>, grid, MV_THREADS, smem, a);
}

template <int TYPE>
static void matvec_fast_type(const mv_args &a, int n_prob, int n_tok_grid, int mode, int nt) {
    if (mode == MV_GATE_UP) launch_matvec_fast_t<TYPE, 1, MV_GATE_UP>(a, n_prob, n_tok_grid);
    else if (mode == MV_DOWN) launch_matvec_fast_t<TYPE, 1, MV_DOWN>(a, n_prob, n_tok_grid);
    else if (nt == 4) launch_matvec_fast_t<TYPE, 4, MV_DENSE>(a, n_prob, n_tok_grid);
    else if (nt == 2) launch_matvec_fast_t<TYPE, 2, MV_DENSE>(a, n_prob, n_tok_grid);
    else launch_matvec_fast_t<TYPE, 1, MV_DENSE>(a, n_prob, n_tok_grid);
}

/* A dense launch over nt_dense tokens in chunks: each the largest power of two <= max_chunk
 * that fits what is left (the fast kernels keep a chunk's activations on chip); fn gets the
 * chunk's arguments and its token count. */
template <typename F>
static void mv_token_chunks(const mv_args &a, int nt_dense, int max_chunk, F fn) {
    int done = 0;
    while (done < nt_dense) {
        int chunk = 1;
        while (chunk * 2 <= max_chunk && chunk * 2 <= nt_dense - done) chunk *= 2;
        mv_args c = a;
        c.x = a.x + (int64_t)done * a.x_tok;
        c.y = a.y + (int64_t)done * a.y_tok;
        c.tok0 = done;
        for (int i = 0; i < a.n_seg; i++) c.seg_y[i] = a.seg_y[i] + (int64_t)done * a.seg_rows[i];
        fn(c, chunk);
        done += chunk;
    }
}

#include "ds4_cuda_quant.cuh"

/* Generic fallback: one warp per row, any K (multiple of 32 for Q8_0). */
template <int TYPE>
__device__ __forceinline__ float mv_row_dot_generic(const uint8_t *row, const float *x, int K, int lane) {
    float acc = 0.0f;
    if (TYPE == DS4_TYPE_Q8_0) {
        for (int b = 0; b < K / DS4_QK8_0; b++) {
            const uint8_t *blk = row + (size_t)b * DS4_Q8_0_BLOCK_BYTES;
            const float d = f16_bits_to_f32(*(const uint16_t *)blk);
            acc = fmaf(d * (float)(int8_t)blk[2 + lane], x[b * DS4_QK8_0 + lane], acc);
        }
    } else {
        for (int k = lane; k < K; k += 32) acc = fmaf(weight_elem(TYPE, row, k), x[k], acc);
    }
    return warp_sum(acc);
}

template <int TYPE, int MODE>
__global__ void __launch_bounds__(MV_THREADS) k_matvec_generic(const mv_args a, int n_tok_loop) {
    ds4_grid_dep();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    if (row >= a.rows) return;
    const int prob = blockIdx.y, tok = blockIdx.z;
    const size_t mat = (MODE == MV_DENSE || !a.sel) ? (size_t)prob
                                                    : (size_t)a.sel[(int64_t)tok * a.k + prob];
    const uint8_t *r0 = a.w + mat * a.mat_bytes + (size_t)row * a.row_bytes;
    const float *x = a.x + (int64_t)tok * a.x_tok + (int64_t)prob * a.x_prob;
    float *y = a.y + (int64_t)tok * a.y_tok + (int64_t)prob * a.y_prob;
    if (MODE == MV_GATE_UP) {
        const uint8_t *r1 = a.w2 + mat * a.mat_bytes + (size_t)row * a.row_bytes;
        const float gv = mv_row_dot_generic<TYPE>(r0, x, a.K, lane);
        const float uv = mv_row_dot_generic<TYPE>(r1, x, a.K, lane);
        if (lane == 0) y[row] = silu_mul(gv, uv, a.clamp);
    } else {
        for (int u = 0; u < n_tok_loop; u++) {
            const float v = mv_row_dot_generic<TYPE>(r0, x + (int64_t)u * a.x_tok, a.K, lane);
            if (lane == 0) y[(int64_t)u * a.y_tok + row] = v;
        }
    }
}

template <int TYPE, int MODE>
static void launch_matvec_generic_t(const mv_args &a, dim3 grid, int n_tok_loop) {
    DS4_LAUNCH(k_matvec_generic<TYPE, MODE>, grid, MV_THREADS, 0, a, n_tok_loop);
}

template <int TYPE>
static void matvec_generic_type(const mv_args &a, dim3 grid, int mode, int n_tok_loop) {
    if (mode == MV_GATE_UP) launch_matvec_generic_t<TYPE, MV_GATE_UP>(a, grid, 1);
    else if (mode == MV_DOWN) launch_matvec_generic_t<TYPE, MV_DOWN>(a, grid, 1);
    else launch_matvec_generic_t<TYPE, MV_DENSE>(a, grid, n_tok_loop);
}

static int type_supported(int type) {
    return type == DS4_TYPE_F32 || type == DS4_TYPE_F16 || type == DS4_TYPE_BF16 || type == DS4_TYPE_Q8_0 ||
           dsq_is_type(type);
}

static void check_matrix_type(int type, const char *what) {
    if (!type_supported(type)) {
        fprintf(stderr, "ds4: %s: unsupported weight type %d\n", what, type);
        exit(1);
    }
}

static void launch_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n);
static void launch_swiglu(const float *g, const float *u, float *y, int64_t rows, int64_t cols,
                          int64_t ld_in, int64_t ld_out, float limit);

/* Does the fast kernel take this shape?  K a multiple of 1024 with 1, 2, 4 or
 * 8 slices; rows and matrices 16-byte aligned. */
static bool mv_fast_ok(int64_t K, size_t row_bytes, size_t mat_bytes, const void *w, const void *w2) {
    const int64_t S = K % MV_SLICE == 0 ? K / MV_SLICE : 0;
    return (S == 1 || S == 2 || S == 4 || S == 8) && (uintptr_t)w % 16 == 0 &&
           (!w2 || (uintptr_t)w2 % 16 == 0) && row_bytes % 16 == 0 && mat_bytes % 16 == 0;
}

/* Run a matvec problem set: n_prob problems (blockIdx.y) x n_tok_grid tokens
 * (blockIdx.z, MoE modes) x nt_dense tokens inside (dense mode). */
static void matvec_run(int type, int mode, mv_args a, int n_prob, int n_tok_grid, int nt_dense) {
    if ((a.n_seg == 0 && a.rows <= 0) || n_prob <= 0 || n_tok_grid <= 0 || nt_dense <= 0) return;
    if (dsq_is_type(type) && mvq_fast_ok(type, mode, a.K, a.row_bytes, a.mat_bytes, a.w, a.w2)) {
        matvec_q_run(type, mode, a, n_prob, n_tok_grid, nt_dense);
        return;
    }
    const bool fast = !dsq_is_type(type) && mv_fast_ok(a.K, a.row_bytes, a.mat_bytes, a.w, a.w2);
    if (a.n_seg > 0 && !fast) {
        fprintf(stderr, "ds4: matvec: a multi-matrix launch needs the fast kernel's shapes\n");
        exit(1);
    }
    const int S = fast ? a.K / MV_SLICE : 0;
    if (!fast) {
        dim3 grid((unsigned)((a.rows + MV_WARPS - 1) / MV_WARPS), (unsigned)n_prob, (unsigned)n_tok_grid);
        switch (type) {
        case DS4_TYPE_F32:  matvec_generic_type<DS4_TYPE_F32>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_F16:  matvec_generic_type<DS4_TYPE_F16>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_BF16: matvec_generic_type<DS4_TYPE_BF16>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_Q2_K: matvec_generic_type<DS4_TYPE_Q2_K>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_Q4_K: matvec_generic_type<DS4_TYPE_Q4_K>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_IQ2_XXS: matvec_generic_type<DS4_TYPE_IQ2_XXS>(a, grid, mode, nt_dense); break;
        default:            matvec_generic_type<DS4_TYPE_Q8_0>(a, grid, mode, nt_dense); break;
        }
        return;
    }
    a.S = S;
    /* dense tokens in chunks of 4, 2, 1 (the activations of a chunk live in registers) */
    mv_token_chunks(a, nt_dense, 4, [&](const mv_args &c, int chunk) {
        switch (type) {
        case DS4_TYPE_F32:  matvec_fast_type<DS4_TYPE_F32>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_F16:  matvec_fast_type<DS4_TYPE_F16>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_BF16: matvec_fast_type<DS4_TYPE_BF16>(c, n_prob, n_tok_grid, mode, chunk); break;
        default:            matvec_fast_type<DS4_TYPE_Q8_0>(c, n_prob, n_tok_grid, mode, chunk); break;
        }
    });
}

/* Dequantize nrows rows of K elements (any type) into dst[nrows][K]. */
__global__ void k_dequant(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                          float *dst) {
    ds4_grid_dep();
    const int64_t n = nrows * K;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = idx / K, c = idx % K;
        dst[idx] = weight_elem(type, src + (size_t)r * row_bytes, c);
    }
}

static void launch_dequant(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                           float *dst) {
    if (nrows <= 0 || K <= 0) return;
    if (dsq_is_type(type)) {
        launch_dequant_q(src, type, row_bytes, K, nrows, dst);
        return;
    }
    DS4_LAUNCH(k_dequant, grid_for(nrows * K), 256, 0, src, type, row_bytes, K, nrows, dst);
}

/* y[t][r] (row stride ldy) = sum_k W[row0 + r][k] x[t][k] (row stride ldx) for
 * r < nrows, t < nt, with W the matrix at byte offset mat_off of w.  Row tiles
 * are dequantized into scratch (F32 weights are used in place) and multiplied
 * by cuBLAS: C(nr x nt, ld ldy) = A^T(nr x K) B(K x nt, ld ldx). */
static void gemm_rows(const ds4_weight *w, size_t mat_off, int64_t row0, int64_t nrows,
                      const float *x, int64_t ldx, float *y, int64_t ldy, int nt) {
    if (nrows <= 0 || nt <= 0) return;
    const int64_t K = w->ne[0];
    const size_t rb = ds4_row_bytes(w->type, K);
    const uint8_t *base = (const uint8_t *)w->dev + mat_off + (size_t)row0 * rb;
    const float one = 1.0f, zero = 0.0f;
    int64_t tile = w->type == DS4_TYPE_F32 ? nrows : DEQ_CAP_FLOATS / K;
    if (tile < 1) tile = 1;
    if (tile > nrows) tile = nrows;
    float *deq = w->type == DS4_TYPE_F32 ? NULL
                                        : (float *)scratch_get(&sess()->deq, (size_t)(tile * K) * sizeof(float));
    for (int64_t r0 = 0; r0 < nrows; r0 += tile) {
        const int64_t nr = nrows - r0 < tile ? nrows - r0 : tile;
        const float *A;
        if (w->type == DS4_TYPE_F32) {
            A = (const float *)(base + (size_t)r0 * rb);
        } else {
            launch_dequant(base + (size_t)r0 * rb, w->type, rb, K, nr, deq);
            A = deq;
        }
        DS4_CUBLAS(cublasSgemm(sess_blas(), CUBLAS_OP_T, CUBLAS_OP_N, (int)nr, nt, (int)K,
                               &one, A, (int)K, x, (int)ldx, &zero, y + r0, (int)ldy));
    }
}

static void cuda_matmul(const ds4_weight *w, int expert, const float *x, float *y, int nt) {
    if (nt <= 0) return;
    check_matrix_type(w->type, "matmul");
    const int64_t K = w->ne[0], N = w->ne[1];
    const size_t rb = ds4_row_bytes(w->type, K);
    const size_t mat_off = (size_t)expert * (size_t)N * rb;
    if (nt <= MV_MAX_NT) {
        mv_args a;
        memset(&a, 0, sizeof a);
        a.w = (const uint8_t *)w->dev + mat_off;
        a.mat_bytes = (size_t)N * rb;
        a.row_bytes = rb;
        a.K = (int)K;
        a.rows = (int)N;
        a.x = x; a.x_tok = K;
        a.y = y; a.y_tok = N;
        matvec_run(w->type, MV_DENSE, a, 1, 1, nt);
    } else {
        gemm_rows(w, mat_off, 0, N, x, K, y, N, nt);
    }
}

static void cuda_matmul_grouped(const ds4_weight *w, int groups, const float *x, float *y, int nt) {
    if (nt <= 0 || groups <= 0) return;
    check_matrix_type(w->type, "matmul_grouped");
    const int64_t K = w->ne[0], R = w->ne[1] / groups;
    const size_t rb = ds4_row_bytes(w->type, K);
    if (nt <= MV_MAX_NT) {
        mv_args a;
        memset(&a, 0, sizeof a);
        a.w = (const uint8_t *)w->dev;
        a.mat_bytes = (size_t)R * rb;       /* group g's rows start g*R rows in */
        a.row_bytes = rb;
        a.K = (int)K;
        a.rows = (int)R;
        a.x = x; a.x_prob = K; a.x_tok = (int64_t)groups * K;
        a.y = y; a.y_prob = R; a.y_tok = (int64_t)groups * R;
        matvec_run(w->type, MV_DENSE, a, groups, 1, nt);
    } else {
        for (int g = 0; g < groups; g++)
            gemm_rows(w, 0, (int64_t)g * R, R, x + (int64_t)g * K, (int64_t)groups * K,
                      y + (int64_t)g * R, (int64_t)groups * R, nt);
    }
}

/* matmul_multi: the fast kernel takes every matrix of one type in one launch
 * (decode: the seven projections of an attention input are one launch
 * instead of seven), normalising x in each block when asked and adding the
 * ape row in the epilogue.  Whatever it cannot take (prefill, other shapes)
 * runs as the composition the contract defines, after the fast launches,
 * since that path normalises x in place. */
static void cuda_matmul_multi(int n, const ds4_weight *const *w, float *const *y, float *x, int nt,
                              const float *norm_w, float eps, const float *const *add_tab, const ds4_step *step,
                              int period) {
    if (n <= 0 || nt <= 0) return;
    if (n > DS4_MULTI_MAX) {
        fprintf(stderr, "ds4: matmul_multi: %d matrices above %d\n", n, DS4_MULTI_MAX);
        exit(1);
    }
    const int64_t K = w[0]->ne[0];
    bool done[DS4_MULTI_MAX] = { false };
    for (int i = 0; i < n; i++) {
        check_matrix_type(w[i]->type, "matmul_multi");
        if (w[i]->ne[0] != K) {
            fprintf(stderr, "ds4: matmul_multi: %s has K = %lld, not %lld\n", w[i]->name ? w[i]->name : "?",
                    (long long)w[i]->ne[0], (long long)K);
            exit(1);
        }
    }
    if (add_tab && period <= 0) {
        fprintf(stderr, "ds4: matmul_multi: table period %d\n", period);
        exit(1);
    }
    if (nt <= MV_MAX_NT) {
        for (int i = 0; i < n; i++) {
            if (done[i]) continue;
            const int type = w[i]->type;
            const size_t rb = ds4_row_bytes(type, K);
            mv_args a;
            memset(&a, 0, sizeof a);
            for (int j = i; j < n; j++) {
                const size_t mb = (size_t)w[j]->ne[1] * rb;
                if (done[j] || w[j]->type != type) continue;
                if (!(dsq_is_type(type) ? mvq_fast_ok(type, MV_DENSE, K, rb, mb, w[j]->dev, NULL)
                                        : mv_fast_ok(K, rb, mb, w[j]->dev, NULL))) continue;
                a.seg_w[a.n_seg] = (const uint8_t *)w[j]->dev;
                a.seg_y[a.n_seg] = y[j];
                a.seg_rows[a.n_seg] = (int)w[j]->ne[1];
                a.seg_tab[a.n_seg] = add_tab ? add_tab[j] : NULL;
                a.n_seg++;
                done[j] = true;
            }
            if (a.n_seg == 0) continue;
            a.w = a.seg_w[0];
            a.row_bytes = rb;
            a.K = (int)K;
            a.x = x; a.x_tok = K;
            a.in_norm = norm_w; a.in_eps = eps;
            a.tab_step = step; a.tab_period = period > 0 ? period : 1;
            matvec_run(type, MV_DENSE, a, 1, 1, nt);
        }
    }
    bool normed = false;
    for (int i = 0; i < n; i++) {
        if (done[i]) continue;
        if (norm_w && !normed) {
            launch_rmsnorm(x, norm_w, x, nt, (int)K, eps);
            normed = true;
        }
        cuda_matmul(w[i], 0, x, y[i], nt);
        if (add_tab && add_tab[i]) launch_add_cyclic(y[i], add_tab[i], step, nt, period, (int)w[i]->ne[1]);
    }
}

/* Shared expert: gate|up mode of the fast kernel with matrix 0 (sel NULL)
 * for decode, the composition otherwise. */
static void cuda_matmul_swiglu(const ds4_weight *gate, const ds4_weight *up, const float *x, float *y, int nt,
                               float limit, float *g, float *u) {
    if (nt <= 0) return;
    check_matrix_type(gate->type, "matmul_swiglu");
    if (up->type != gate->type || up->ne[0] != gate->ne[0] || up->ne[1] != gate->ne[1]) {
        fprintf(stderr, "ds4: matmul_swiglu: gate and up weights differ in type or shape\n");
        exit(1);
    }
    const int64_t K = gate->ne[0], F = gate->ne[1];
    if (nt <= MV_MAX_NT) {
        mv_args a;
        memset(&a, 0, sizeof a);
        a.w = (const uint8_t *)gate->dev;
        a.w2 = (const uint8_t *)up->dev;
        a.row_bytes = ds4_row_bytes(gate->type, K);
        a.mat_bytes = (size_t)F * a.row_bytes;
        a.K = (int)K;
        a.rows = (int)F;
        a.x = x; a.x_tok = K;
        a.y = y; a.y_tok = F;
        a.clamp = limit;
        matvec_run(gate->type, MV_GATE_UP, a, 1, nt, 1);
        return;
    }
    cuda_matmul(gate, 0, x, g, nt);
    cuda_matmul(up, 0, x, u, nt);
    launch_swiglu(g, u, y, 1, (int64_t)nt * F, (int64_t)nt * F, (int64_t)nt * F, limit);
}

/* ---------------------------------------------------------------------------
 * RoPE
 *
 * One thread per (token, head, pair).  The angle is built exactly as the CPU
 * op builds it: te starts at (float)p and is multiplied by theta_scale once
 * per pair (so pair i repeats the i multiplications), and the YaRN blend uses
 * explicitly rounded products so the compiler cannot fuse them into an FMA
 * the CPU does not do.  theta_scale itself comes from the host's powf.
 * ------------------------------------------------------------------------- */

typedef struct {
    int   n_rot;
    float theta_scale, freq_scale, ext_factor, corr_lo, corr_hi;
} rope_args;

/* cos and sin (negated for the inverse rotation) of pair i at position p,
 * exactly as the CPU op builds them. */
__device__ __forceinline__ void rope_cs(const rope_args &r, int p, int i, int inverse, float *c, float *s) {
    float te = (float)p;
    for (int j = 0; j < i; j++) te = __fmul_rn(te, r.theta_scale);
    const float ti = __fmul_rn(r.freq_scale, te);
    float theta = ti;
    if (r.ext_factor != 0.0f) {
        const float yv = ((float)i - r.corr_lo) / fmaxf(0.001f, r.corr_hi - r.corr_lo);
        const float ramp = __fmul_rn(1.0f - fminf(1.0f, fmaxf(0.0f, yv)), r.ext_factor);
        theta = __fadd_rn(__fmul_rn(ti, 1.0f - ramp), __fmul_rn(te, ramp));
    }
    *c = cosf(theta);
    *s = inverse ? -sinf(theta) : sinf(theta);
}

/* The rotated pair: element 0 and element 1 of (x0, x1). */
__device__ __forceinline__ float rope_rot0(float x0, float x1, float c, float s) {
    return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
}
__device__ __forceinline__ float rope_rot1(float x0, float x1, float c, float s) {
    return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

/* Rotate pair i (v[0], v[1]) at position p, exactly as the CPU op does. */
__device__ __forceinline__ void rope_pair(float *v, const rope_args &r, int p, int i, int inverse) {
    float c, s;
    rope_cs(r, p, i, inverse, &c, &s);
    const float x0 = v[0], x1 = v[1];
    v[0] = rope_rot0(x0, x1, c, s);
    v[1] = rope_rot1(x0, x1, c, s);
}

/* Rotation of rows at positions pos0 + t*pos_step (pos0 from the step block),
 * or, for emitted compressor rows (er.step), of row w0 + t at position
 * (w0 + t)*ratio. */
__global__ void k_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, emit_rows er,
                       rope_args r, int inverse) {
    ds4_grid_dep();
    const int half = r.n_rot / 2;
    int first;
    const int rows = emit_span(er, nt, &first);
    const int p0 = er.step ? first * er.ratio : step->pos0;
    const int64_t n = (int64_t)(rows < nt ? rows : nt) * nh * half;
    x += (int64_t)first * nh * dh;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const int64_t th = idx / half;          /* t * nh + head */
        const int t = (int)(th / nh);
        rope_pair(x + th * dh + (dh - r.n_rot) + 2 * i, r, p0 + t * pos_step, i, inverse);
    }
}

static rope_args rope_args_of(const ds4_rope *rp) {
    rope_args r;
    r.n_rot = rp->n_rot;
    r.theta_scale = powf(rp->freq_base, -2.0f / (float)rp->n_rot);
    r.freq_scale = rp->freq_scale;
    r.ext_factor = rp->ext_factor;
    r.corr_lo = rp->corr_lo;
    r.corr_hi = rp->corr_hi;
    return r;
}

static void launch_rope_rows(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, emit_rows er,
                             const ds4_rope *rp, int inverse) {
    if (nt <= 0 || nh <= 0 || rp->n_rot <= 0) return;
    const rope_args r = rope_args_of(rp);
    const int64_t n = (int64_t)nt * nh * (rp->n_rot / 2);
    DS4_LAUNCH(k_rope, grid_for(n), 256, 0, x, nt, nh, dh, step, pos_step, er, r, inverse);
}

static void launch_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                        int inverse) {
    launch_rope_rows(x, nt, nh, dh, step, pos_step, no_emit(), rp, inverse);
}

static void cuda_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                      int inverse) {
    launch_rope(x, nt, nh, dh, step, pos_step, rp, inverse);
}

/* head_norm_rope: one block per (token, head) row: the row's RMSNorm (squares
 * in double, a fixed-shape reduction) and then RoPE of its last n_rot dims,
 * with the row held in shared memory between the two.  The rows of the
 * second tensor (a layer's key/value row beside its queries) follow in the
 * same grid: one launch instead of two (a launch of this size costs ~3.5 us
 * on an H200, 43 times per Flash token). */
#define HNR_THREADS 128
#define HNR_MAX_DH  4096

__global__ void __launch_bounds__(HNR_THREADS) k_head_norm_rope(float *x, const float *w, int nh, float *x2,
                                                               const float *w2, int nh2, int nt, int dh,
                                                               float eps, const ds4_step *step, rope_args r) {
    ds4_grid_dep();
    extern __shared__ float row_s[];
    __shared__ double red[HNR_THREADS / 32];
    const int pos0 = step->pos0;    /* read first: its latency hides behind the row's loads */
    /* blocks [0, nt*nh): rows of x; the next nt*nh2: rows of x2 */
    int64_t row = blockIdx.x;
    int t;
    if (row >= (int64_t)nt * nh) {
        row -= (int64_t)nt * nh;
        t = (int)(row / nh2);
        x = x2;
        w = w2;
    } else {
        t = (int)(row / nh);
    }
    float *xr = x + row * dh;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dh; i += HNR_THREADS) {
        const float v = xr[i];
        row_s[i] = v;
        ss += (double)(v * v);
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    double tot = 0.0;
    for (int i = 0; i < HNR_THREADS / 32; i++) tot += red[i];
    const float scale = 1.0f / sqrtf((float)(tot / (double)dh) + eps);
    for (int i = threadIdx.x; i < dh; i += HNR_THREADS)
        row_s[i] = w ? row_s[i] * scale * w[i] : row_s[i] * scale;
    __syncthreads();
    for (int i = threadIdx.x; i < r.n_rot / 2; i += HNR_THREADS)
        rope_pair(row_s + (dh - r.n_rot) + 2 * i, r, pos0 + t, i, 0);
    __syncthreads();
    for (int i = threadIdx.x; i < dh; i += HNR_THREADS) xr[i] = row_s[i];
}

static void launch_head_norm_rope(float *x, const float *w, int nt, int nh, float *x2, const float *w2, int nh2,
                                  int dh, float eps, const ds4_step *step, const ds4_rope *rp) {
    if (nh2 < 0 || !x2) nh2 = 0;
    if (nt <= 0 || nh < 0 || nh + nh2 <= 0 || dh <= 0) return;
    if (dh > HNR_MAX_DH || rp->n_rot > dh) {
        fprintf(stderr, "ds4: head_norm_rope: head width %d (rope %d) outside 1..%d\n", dh, rp->n_rot, HNR_MAX_DH);
        exit(1);
    }
    DS4_LAUNCH(k_head_norm_rope, (unsigned)((int64_t)nt * (nh + nh2)), HNR_THREADS, (size_t)dh * sizeof(float),
               x, w, nh, x2, w2, nh2, nt, dh, eps, step, rope_args_of(rp));
}

static void cuda_head_norm_rope(float *x, const float *w, int nt, int nh, float *x2, const float *w2, int nh2,
                                int dh, float eps, const ds4_step *step, const ds4_rope *rp) {
    launch_head_norm_rope(x, w, nt, nh, x2, w2, nh2, dh, eps, step, rp);
}

/* ---------------------------------------------------------------------------
 * Attention
 *
 * Query t at position P attends, in order, to its window rows (from this
 * batch's kv or from the ring), then to the compressed rows (all visible ones
 * for ratio 128, the indexer's picks for ratio 4), plus the head's sink in
 * the denominator.
 *
 * k_attention: one block per (head group of ATT_HB heads, row chunk, query).
 * The key/value head is shared by all heads (MQA), so a block loads each row
 * once for its ATT_HB heads.  Each of the 8 warps takes every 8th row of the
 * chunk, two rows per step so that their loads overlap, computes the ATT_HB
 * scores (lane-strided dims, butterfly sums) and keeps an online softmax
 * state (max, sum, output) per head in registers.
 * The warps' states are merged by a fixed 3-level tree through shared memory.
 * With one chunk the block applies the sink and writes the output; decode
 * (few queries) splits the rows into chunks so that enough blocks run, and
 * k_attention_combine merges the chunk partials in chunk order.
 * A block stages its heads' queries and its chunk's ratio-4 picks in shared
 * memory first, so each row costs one memory round trip.
 * Shared memory for d = 512: q 8 KiB + merge buffer 32 KiB + picks 4 KiB.
 * Decode on an H200 (64 heads x 512, 640 rows): 14.5 us + 3.9 us combine.
 * That is instruction issue (~90 instructions per head and row: q from
 * shared memory, a butterfly per score, the rescale), not memory; scoring a
 * tile of rows with one transposed reduction and applying the softmax per
 * tile is the next step if attention shows up in a profile.
 * ------------------------------------------------------------------------- */

#define ATT_HB         4
#define ATT_WARPS      8
#define ATT_THREADS    (ATT_WARPS * 32)
#define ATT_MAX_CHUNKS 32
#define ATT_MAX_D      512
#define ATT_MAX_TOPK   1024    /* ratio-4 picks per query staged in shared memory */

typedef struct {
    const float *q, *kv, *ring, *comp, *sinks;
    const int32_t *topk;
    float *out, *part_o, *part_ml;
    const ds4_step *step;   /* pos0 is read from here when the kernel runs */
    int W, H, d, ratio, k;
    int want;               /* row chunks wanted (the grid's y); the chunking of a step: att_chunks */
    float scale;
    int nt;
    int derot;          /* attention_step: de-rotate the output (inverse RoPE at P) as it is written */
    rope_args rope;
    float *ring_out;    /* attention_step with split rows: k_attention_combine stores kv into the ring */
} attn_args;

/* Element e of an output head row as written: v, or, with a.derot, its
 * inverse rotation at position P.  The partner of a pair sits in lane ^ 1
 * (the rotated dims start at an even offset), so every lane of the warp
 * must call this. */
__device__ __forceinline__ float att_derot(const attn_args &a, float v, int e, int P) {
    const float pv = __shfl_xor_sync(FULL_MASK, v, 1);
    const int r0 = a.d - a.rope.n_rot;
    if (!a.derot || e < r0 || e >= a.d) return v;
    const int j = e - r0;
    float c, s;
    rope_cs(a.rope, P, j >> 1, 1, &c, &s);
    return (j & 1) ? rope_rot1(pv, v, c, s) : rope_rot0(v, pv, c, s);
}

/* Row i of a query's list (window, then compressed), or NULL for a -1 pick;
 * ids_s holds the query's ratio-4 picks. */
__device__ __forceinline__ const float *att_row(const attn_args &a, int pos0, const int *ids_s, int n_win,
                                                int p_first, int i) {
    if (i < n_win) {
        const int p = p_first + i;
        return p >= pos0 ? a.kv + (int64_t)(p - pos0) * a.d : a.ring + (int64_t)(p % a.W) * a.d;
    }
    if (a.ratio == 4) {
        const int id = ids_s[i - n_win];
        return id < 0 ? NULL : a.comp + (int64_t)id * a.d;
    }
    return a.comp + (int64_t)(i - n_win) * a.d;
}

/* Online softmax step for two rows at once (scores sa, sb uniform across the
 * warp; -inf for a missing row, whose values are 0).  Branch-free, so the
 * compiler can interleave the heads' chains. */
template <int DM>
__device__ __forceinline__ void att_online2(float sa, float sb, const float (&va)[DM], const float (&vb)[DM],
                                            float &m, float &l, float (&o)[DM]) {
    const float mn = fmaxf(m, fmaxf(sa, sb));
    if (mn == -INFINITY) return;                  /* nothing seen yet and both rows missing */
    const float corr = expf(m - mn);              /* 0 when m was -inf */
    const float pa = expf(sa - mn), pb = expf(sb - mn);
    m = mn;
    l = l * corr + pa + pb;
#pragma unroll
    for (int k = 0; k < DM; k++) o[k] = fmaf(pb, vb[k], fmaf(pa, va[k], o[k] * corr));
}

/* How a step's rows are split: the longest row list of the batch (its last
 * query's) into chunks of a multiple of 16 rows (two per warp per step), at
 * least 32, so that about `want` chunks run; one chunk when the list is
 * short or want is 1.  A function of the position, computed where it runs. */
__host__ __device__ __forceinline__ void att_chunks(int pos0, int nt, int W, int ratio, int k, int want,
                                                   int *chunks, int *chunk_rows) {
    const int Lmax = ds4_att_rows(pos0 + nt - 1, W, ratio, k);
    int c = 1, rows = Lmax > 0 ? Lmax : 1;
    if (want > 1 && Lmax > 32) {
        rows = (Lmax + want - 1) / want;
        rows = (rows + 15) / 16 * 16;
        if (rows < 32) rows = 32;
        c = (Lmax + rows - 1) / rows;
    }
    *chunks = c;
    *chunk_rows = rows;
}

template <int DM>
__global__ void __launch_bounds__(ATT_THREADS) k_attention(const attn_args a) {
    ds4_grid_dep();
    __shared__ float q_s[ATT_HB][32 * DM];
    __shared__ float red_o[ATT_WARPS / 2][ATT_HB][32 * DM];
    __shared__ float red_m[ATT_WARPS / 2][ATT_HB], red_l[ATT_WARPS / 2][ATT_HB];
    __shared__ int ids_s[ATT_MAX_TOPK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * ATT_HB, c = blockIdx.y, t = blockIdx.z;
    const int pos0 = a.step->pos0;               /* in flight with the query loads below */
#pragma unroll
    for (int idx = threadIdx.x; idx < ATT_HB * 32 * DM; idx += ATT_THREADS) {
        const int hb = idx / (32 * DM), e = idx % (32 * DM), h = h0 + hb;
        q_s[hb][e] = (h < a.H && e < a.d) ? a.q[((int64_t)t * a.H + h) * a.d + e] : 0.0f;
    }
    int chunks, chunk_rows;
    att_chunks(pos0, a.nt, a.W, a.ratio, a.k, a.want, &chunks, &chunk_rows);
    if (c >= chunks) return;                     /* the grid is sized for `want` chunks */
    const int P = pos0 + t;
    const int n_win = ds4_win_rows(P, a.W);
    const int p_first = P - n_win + 1;
    const int L = ds4_att_rows(P, a.W, a.ratio, a.k);
    const int i0 = c * chunk_rows;
    const int i1 = min(L, i0 + chunk_rows);

    if (a.ratio == 4) {      /* this chunk's picks, so a row costs one round trip, not two */
        const int j0 = max(i0 - n_win, 0), j1 = max(i1 - n_win, 0);
        for (int j = j0 + threadIdx.x; j < j1; j += ATT_THREADS) ids_s[j] = a.topk[(int64_t)t * a.k + j];
    }
    __syncthreads();

    float m_r[ATT_HB], l_r[ATT_HB], o[ATT_HB][DM];
#pragma unroll
    for (int hb = 0; hb < ATT_HB; hb++) {
        m_r[hb] = -INFINITY;
        l_r[hb] = 0.0f;
#pragma unroll
        for (int m = 0; m < DM; m++) o[hb][m] = 0.0f;
    }

    /* two rows per step (i and i + 8), loaded together so their latencies overlap */
    for (int i = i0 + warp; i < i1; i += 2 * ATT_WARPS) {
        const float *ra = att_row(a, pos0, ids_s, n_win, p_first, i);
        const float *rb = i + ATT_WARPS < i1 ? att_row(a, pos0, ids_s, n_win, p_first, i + ATT_WARPS) : NULL;
        float va[DM], vb[DM];
#pragma unroll
        for (int m = 0; m < DM; m++) {
            const int e = lane + 32 * m;
            va[m] = ra && e < a.d ? ra[e] : 0.0f;
            vb[m] = rb && e < a.d ? rb[e] : 0.0f;
        }
#pragma unroll
        for (int hb = 0; hb < ATT_HB; hb++) {
            float sa = 0.0f, sb = 0.0f;
#pragma unroll
            for (int m = 0; m < DM; m++) {
                const float qv = q_s[hb][lane + 32 * m];
                sa = fmaf(qv, va[m], sa);
                sb = fmaf(qv, vb[m], sb);
            }
            sa = ra ? warp_sum(sa) * a.scale : -INFINITY;
            sb = rb ? warp_sum(sb) * a.scale : -INFINITY;
            att_online2(sa, sb, va, vb, m_r[hb], l_r[hb], o[hb]);
        }
    }

    /* merge the 8 warp states: 4+4, then 2+2, then 1+1 (fixed order) */
    for (int half = ATT_WARPS / 2; half >= 1; half >>= 1) {
        if (warp >= half && warp < 2 * half) {
            const int sl = warp - half;
#pragma unroll
            for (int hb = 0; hb < ATT_HB; hb++) {
                if (lane == 0) { red_m[sl][hb] = m_r[hb]; red_l[sl][hb] = l_r[hb]; }
#pragma unroll
                for (int m = 0; m < DM; m++) red_o[sl][hb][lane + 32 * m] = o[hb][m];
            }
        }
        __syncthreads();
        if (warp < half) {
#pragma unroll
            for (int hb = 0; hb < ATT_HB; hb++) {
                const float mb = red_m[warp][hb], lb = red_l[warp][hb];
                const float M = fmaxf(m_r[hb], mb);
                const float fa = m_r[hb] == -INFINITY ? 0.0f : expf(m_r[hb] - M);
                const float fb = mb == -INFINITY ? 0.0f : expf(mb - M);
                m_r[hb] = M;
                l_r[hb] = l_r[hb] * fa + lb * fb;
#pragma unroll
                for (int m = 0; m < DM; m++)
                    o[hb][m] = o[hb][m] * fa + red_o[warp][hb][lane + 32 * m] * fb;
            }
        }
        __syncthreads();
    }

    if (warp != 0) return;
#pragma unroll
    for (int hb = 0; hb < ATT_HB; hb++) {
        const int h = h0 + hb;
        if (h >= a.H) break;
        const int64_t oh = (int64_t)t * a.H + h;
        if (chunks == 1) {
            const float sink = a.sinks[h];
            const float M = fmaxf(m_r[hb], sink);
            const float f = m_r[hb] == -INFINITY ? 0.0f : expf(m_r[hb] - M);
            const float denom = l_r[hb] * f + expf(sink - M);
#pragma unroll
            for (int m = 0; m < DM; m++) {
                const int e = lane + 32 * m;
                const float v = att_derot(a, o[hb][m] * f / denom, e, P);
                if (e < a.d) a.out[oh * a.d + e] = v;
            }
        } else {
            const int64_t pidx = oh * a.want + c;   /* partials of a (query, head): want slots */
            if (lane == 0) { a.part_ml[2 * pidx] = m_r[hb]; a.part_ml[2 * pidx + 1] = l_r[hb]; }
#pragma unroll
            for (int m = 0; m < DM; m++) {
                const int e = lane + 32 * m;
                if (e < a.d) a.part_o[pidx * a.d + e] = o[hb][m];
            }
        }
    }
}

template <int DM>
static void launch_attention_t(const attn_args &a, dim3 grid) {
    DS4_LAUNCH(k_attention<DM>, grid, ATT_THREADS, 0, a);
}

/* One block per (head, query), one thread per dim: merge the chunk partials
 * in chunk order.  Warp 0 turns the chunk maxima and sums into weights with
 * fixed butterflies; every thread then issues all its chunk loads at once.
 * For attention_step the output is de-rotated as it is written, and the
 * head-0 blocks store the batch's kv rows into the window ring: every
 * k_attention block has finished reading the ring by then.  It is launched
 * whenever the rows may be split (want > 1); on a step whose rows fit one
 * chunk k_attention has written the output, and only the ring store is left. */
__global__ void k_attention_combine(const attn_args a) {
    ds4_grid_dep();
    __shared__ float f_s[ATT_MAX_CHUNKS];
    __shared__ float denom_s;
    const int h = blockIdx.x, t = blockIdx.y;
    const int pos0 = a.step->pos0;
    const int H = a.H, d = a.d;
    const int64_t base = ((int64_t)t * H + h) * a.want;   /* this (query, head)'s want partial slots */
    /* the chunk maxima and sums, loaded with the position (slots past this step's chunks are dropped) */
    float mc = -INFINITY, lc = 0.0f;
    if (threadIdx.x < a.want) {
        mc = a.part_ml[2 * (base + threadIdx.x)];
        lc = a.part_ml[2 * (base + threadIdx.x) + 1];
    }
    const int e = threadIdx.x;                  /* blockDim.x = d rounded up to a warp */
    float v[ATT_MAX_CHUNKS];                    /* every slot's partial row, in flight at once */
#pragma unroll
    for (int c = 0; c < ATT_MAX_CHUNKS; c++) v[c] = c < a.want && e < d ? a.part_o[(base + c) * d + e] : 0.0f;
    int chunks, chunk_rows;
    att_chunks(pos0, a.nt, a.W, a.ratio, a.k, a.want, &chunks, &chunk_rows);
    if (chunks == 1) {
        if (a.ring_out && h == 0 && e < d && t >= a.nt - a.W)
            a.ring_out[(int64_t)((pos0 + t) % a.W) * d + e] = a.kv[(int64_t)t * d + e];
        return;
    }
    if (threadIdx.x < 32) {
        const int c = threadIdx.x;
        if (c >= chunks) { mc = -INFINITY; lc = 0.0f; }
        const float sink = a.sinks[h];
        float M = mc;
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, o));
        M = fmaxf(M, sink);
        const float f = mc == -INFINITY ? 0.0f : expf(mc - M);
        const float denom = warp_sum(lc * f);
        if (c < chunks) f_s[c] = f;
        if (c == 0) denom_s = denom + expf(sink - M);
    }
    __syncthreads();
    const float denom = denom_s;
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < ATT_MAX_CHUNKS; c++) acc = fmaf(c < chunks ? v[c] : 0.0f, c < chunks ? f_s[c] : 0.0f, acc);
    const float o = att_derot(a, acc / denom, e, pos0 + t);
    if (e < d) a.out[((int64_t)t * H + h) * d + e] = o;
    if (a.ring_out && h == 0 && e < d && t >= a.nt - a.W)
        a.ring_out[(int64_t)((pos0 + t) % a.W) * d + e] = a.kv[(int64_t)t * d + e];
}

static void launch_attention_combine(const attn_args &a) {
    const unsigned threads = (unsigned)((a.d + 31) / 32 * 32);
    DS4_LAUNCH(k_attention_combine, dim3((unsigned)a.H, (unsigned)a.nt), threads, 0, a);
}

/* Resident k_attention blocks per SM (registers and shared memory decide): asked at init. */
static void attention_setup(void) {
    int n = 0;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<2>, ATT_THREADS, 0));
    g_cuda.att_bps[2] = n > 0 ? n : 1;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<4>, ATT_THREADS, 0));
    g_cuda.att_bps[4] = n > 0 ? n : 1;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<8>, ATT_THREADS, 0));
    g_cuda.att_bps[8] = n > 0 ? n : 1;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<16>, ATT_THREADS, 0));
    g_cuda.att_bps[16] = n > 0 ? n : 1;
}

static int attention_dm(int d) { return d <= 64 ? 2 : d <= 128 ? 4 : d <= 256 ? 8 : 16; }

/* Row chunks a launch of nt queries of H heads asks for: decode has few
 * (query, head group) blocks, so its rows are split until the launch fills
 * one wave of resident blocks (at most ATT_MAX_CHUNKS); 1 when the blocks
 * fill the device already.  A shape, not a position. */
static int attention_want(int nt, int H, int d) {
    const int64_t hgroups = (H + ATT_HB - 1) / ATT_HB;
    const int64_t base_blocks = hgroups * nt;
    const int64_t wave = (int64_t)g_cuda.att_bps[attention_dm(d)] * g_cuda.n_sm;
    if (base_blocks >= wave) return 1;
    int64_t want = wave / base_blocks;
    if (want > ATT_MAX_CHUNKS) want = ATT_MAX_CHUNKS;
    return (int)want;
}

/* Partial rows (one per query, head and chunk) of the largest split: nt*H*want
 * <= H*wave/hgroups <= ATT_HB*wave, whatever nt and H. */
static size_t attention_part_floats(int d) {
    int64_t wave = 0;
    for (int dm = 2; dm <= 16; dm *= 2)
        if ((int64_t)g_cuda.att_bps[dm] * g_cuda.n_sm > wave) wave = (int64_t)g_cuda.att_bps[dm] * g_cuda.n_sm;
    return (size_t)(ATT_HB * wave) * (size_t)(d + 2);
}

static void launch_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt);

/* attention, and for attention_step (ring_out != NULL) the ring update and
 * the de-rotation by rp, fused into the output writes where the shapes allow. */
static void attention_run(const float *q, const float *kv, const float *ring, int W,
                          const ds4_step *step, int nt, int H, int d,
                          const float *comp, int ratio, const int32_t *topk, int k,
                          const float *sinks, float scale, float *out, float *ring_out, const ds4_rope *rp) {
    if (nt <= 0 || H <= 0) return;
    if (d < 1 || d > ATT_MAX_D) {
        fprintf(stderr, "ds4: attention: head dim %d outside 1..%d\n", d, ATT_MAX_D);
        exit(1);
    }
    if (ratio == 4 && k > ATT_MAX_TOPK) {
        fprintf(stderr, "ds4: attention: %d top-k rows above %d\n", k, ATT_MAX_TOPK);
        exit(1);
    }
    attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q; a.kv = kv; a.ring = ring; a.comp = comp; a.sinks = sinks; a.topk = topk; a.out = out;
    a.W = W; a.step = step; a.H = H; a.d = d; a.ratio = ratio; a.k = k; a.scale = scale; a.nt = nt;
    /* fused de-rotation needs the rotated dims to start at an even offset (pairs in lanes 2i, 2i+1) */
    const bool derot_fused = rp && rp->n_rot > 0 && rp->n_rot <= d && (d - rp->n_rot) % 2 == 0;
    if (derot_fused) { a.derot = 1; a.rope = rope_args_of(rp); }
    const int hgroups = (H + ATT_HB - 1) / ATT_HB;
    const int DM = attention_dm(d);
    /* The launches depend on the shape only: k_attention over `want` row
     * chunks (the blocks of chunks a step does not use return at once), and
     * the combine whenever a step may split its rows. */
    a.want = attention_want(nt, H, d);
    if (a.want > 1) {
        const int64_t np = (int64_t)nt * H * a.want;
        float *p = (float *)scratch_get(&sess()->att_part, (size_t)np * (d + 2) * sizeof(float));
        a.part_o = p;
        a.part_ml = p + np * d;
    }
    dim3 grid((unsigned)hgroups, (unsigned)a.want, (unsigned)nt);
    switch (DM) {
    case 2:  launch_attention_t<2>(a, grid); break;
    case 4:  launch_attention_t<4>(a, grid); break;
    case 8:  launch_attention_t<8>(a, grid); break;
    default: launch_attention_t<16>(a, grid); break;
    }
    if (a.want > 1) {
        a.ring_out = ring_out;
        launch_attention_combine(a);
    } else if (ring_out) {
        launch_ring_store(ring_out, kv, W, d, step, nt);
    }
    if (rp && !derot_fused) launch_rope(out, nt, H, d, step, 1, rp, 1);
}

static void cuda_attention(const float *q, const float *kv, const float *ring, int W,
                           const ds4_step *step, int nt, int H, int d,
                           const float *comp, int ratio, const int32_t *topk, int k,
                           const float *sinks, float scale, float *out) {
    attention_run(q, kv, ring, W, step, nt, H, d, comp, ratio, topk, k, sinks, scale, out, NULL, NULL);
}

#include "ds4_cuda_probs.cuh"

static void cuda_attention_step(const float *q, const float *kv, float *ring, int W,
                                const ds4_step *step, int nt, int H, int d,
                                const float *comp, int ratio, const int32_t *topk, int k,
                                const float *sinks, float scale, const ds4_rope *rp, float *out) {
    attention_run(q, kv, ring, W, step, nt, H, d, comp, ratio, topk, k, sinks, scale, out, ring, rp);
}

/* Window ring update: the last min(nt, slots) rows of the batch. */
__global__ void k_ring_store(float *ring, const float *rows, int slots, int64_t width, const ds4_step *step,
                             int t_first, int n_rows) {
    ds4_grid_dep();
    const int pos0 = step->pos0;
    const int64_t n = (int64_t)n_rows * width;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int t = t_first + (int)(idx / width);
        const int64_t col = idx % width;
        ring[(int64_t)((pos0 + t) % slots) * width + col] = rows[(int64_t)t * width + col];
    }
}

static void launch_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt) {
    const int t_first = nt - slots > 0 ? nt - slots : 0;
    const int n_rows = nt - t_first;
    if (n_rows <= 0 || width <= 0) return;
    DS4_LAUNCH(k_ring_store, grid_for((int64_t)n_rows * width), 256, 0, ring, rows, slots, width, step,
               t_first, n_rows);
}

static void cuda_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt) {
    launch_ring_store(ring, rows, slots, width, step, nt);
}

/* ---------------------------------------------------------------------------
 * Compressor
 *
 * add_cyclic adds the learned position bias (ape) to the gate scores.
 * compress_pool: one block per emitted compressed row, threads over channels.
 * Each channel's entries (ratio of them, or 2*ratio with the overlapping
 * previous window for c == 2) come from this batch or from the state ring;
 * the row is the softmax(score)-weighted sum of the kv entries, computed in
 * two passes (max, then exp-sum and weighted sum) in entry order.
 * ------------------------------------------------------------------------- */

__global__ void k_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int64_t n) {
    ds4_grid_dep();
    const int pos0 = step->pos0;
    const int64_t total = (int64_t)nt * n;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(idx / n);
        x[idx] += table[(int64_t)((pos0 + t) % period) * n + idx % n];
    }
}

static void launch_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n) {
    if (nt <= 0 || n <= 0) return;
    DS4_LAUNCH(k_add_cyclic, grid_for((int64_t)nt * n), 256, 0, x, table, step, nt, period, n);
}

static void cuda_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n) {
    launch_add_cyclic(x, table, step, nt, period, n);
}

/* Pooled value of channel ch of the block starting at position s. */
__device__ __forceinline__ float pool_channel(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                                              int pos0, int ratio, int c, int dc, int s, int ch) {
    const int64_t width = (int64_t)c * dc;
    const int slots = c * ratio;
    const int n_e = c * ratio;
    /* entry e: first the previous window (c == 2), then the current one */
    float mx = -INFINITY;
#pragma unroll 4
    for (int e = 0; e < n_e; e++) {
        const int half = c == 2 ? e / ratio : 1;
        const int p = (half == 0 ? s - ratio : s) + e % ratio;
        if (p < 0) continue;
        const int64_t col = (c == 2 && half == 1) ? dc + ch : ch;
        const float *rs = p >= pos0 ? sc + (int64_t)(p - pos0) * width : st_sc + (int64_t)(p % slots) * width;
        mx = fmaxf(mx, rs[col]);
    }
    float sum = 0.0f, acc = 0.0f;
#pragma unroll 4
    for (int e = 0; e < n_e; e++) {
        const int half = c == 2 ? e / ratio : 1;
        const int p = (half == 0 ? s - ratio : s) + e % ratio;
        if (p < 0) continue;             /* score -inf: weight exactly 0 */
        const int64_t col = (c == 2 && half == 1) ? dc + ch : ch;
        const int64_t ro = p >= pos0 ? (int64_t)(p - pos0) * width : (int64_t)(p % slots) * width;
        const float *rs = p >= pos0 ? sc : st_sc;
        const float *rk = p >= pos0 ? kv : st_kv;
        const float w = expf(rs[ro + col] - mx);
        sum += w;
        acc += w * rk[ro + col];
    }
    return acc / sum;
}

/* One block per block the batch may close (the grid is sized for the most
 * nt tokens can close); those past this step's count return.  Row i goes to
 * out + i*dc, or with at_w0 (compressor_step's rows) to row w0 + i of out. */
__global__ void k_compress_pool(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                                const ds4_step *step, int nt, int ratio, int c, int dc, int at_w0, float *out) {
    ds4_grid_dep();
    const int pos0 = step->pos0;
    const int i = blockIdx.x;
    if (i >= ds4_emit_count(pos0, nt, ratio)) return;
    const int w0 = ds4_emit_first(pos0, ratio);
    const int s = (w0 + i) * ratio;
    float *o = out + ((int64_t)(at_w0 ? w0 : 0) + i) * dc;
    for (int ch = threadIdx.x; ch < dc; ch += blockDim.x)
        o[ch] = pool_channel(kv, sc, st_kv, st_sc, pos0, ratio, c, dc, s, ch);
}

static void launch_compress_pool(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                                 const ds4_step *step, int nt, int ratio, int c, int dc, int at_w0, float *out) {
    if (nt <= 0 || ratio <= 0 || dc <= 0) return;
    DS4_LAUNCH(k_compress_pool, emit_rows_max(nt, ratio), 128, 0, kv, sc, st_kv, st_sc, step, nt, ratio, c, dc,
               at_w0, out);
}

static void cuda_compress_pool(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                               const ds4_step *step, int nt, int ratio, int c, int dc, float *out) {
    launch_compress_pool(kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, 0, out);
}

/* compressor_step for one token: one block does the whole step.  When the
 * token closes a block (emit, decided from the step block when the kernel
 * runs: the launch is the same on every step) it pools the row into shared memory, applies
 * its RMSNorm (squares in double, fixed reduction) and RoPE at the row's
 * position, and writes it; after a barrier it stores the token's kv and
 * gate rows into the state rings (the slot it overwrites, position
 * pos0 - c*ratio, is older than any entry the pool reads).  Batches run the
 * composition. */
#define CST_THREADS 512
#define CST_MAX_DC  4096
#define CST_PRE     2      /* state-row floats per thread loaded up front (widths up to 1024) */

/* The compressors of one launch: block b steps cs[b] (compressor_steps: a
 * ratio-4 layer's kv compressor and its indexer's run side by side). */
typedef struct {
    ds4_compressor cs[DS4_MULTI_MAX];
} cst_set;

__global__ void __launch_bounds__(CST_THREADS) k_compressor_step(const cst_set set, const ds4_step *step, float eps,
                                                                rope_args r) {
    ds4_grid_dep();
    extern __shared__ float cst_row[];
    __shared__ double red[CST_THREADS / 32];
    const int pos0 = step->pos0;
    const ds4_compressor &cp = set.cs[blockIdx.x];
    const float *kv = cp.kv, *sc = cp.sc, *norm_w = cp.norm_w;
    float *st_kv = cp.st_kv, *st_sc = cp.st_sc, *rows = cp.rows;
    const int ratio = cp.ratio, c = cp.c, dc = cp.dc;
    const int width = c * dc;
    /* the token's rows for the state store, loaded with the position (most
     * steps emit nothing and only store them) */
    float kv_r[CST_PRE], sc_r[CST_PRE];
#pragma unroll
    for (int j = 0; j < CST_PRE; j++) {
        const int i = threadIdx.x + j * CST_THREADS;
        kv_r[j] = i < width ? kv[i] : 0.0f;
        sc_r[j] = i < width ? sc[i] : 0.0f;
    }
    const int w0 = ds4_emit_first(pos0, ratio);
    if (ds4_emit_count(pos0, 1, ratio) > 0) {
        double ss = 0.0;
        for (int ch = threadIdx.x; ch < dc; ch += CST_THREADS) {
            const float v = pool_channel(kv, sc, st_kv, st_sc, pos0, ratio, c, dc, w0 * ratio, ch);
            cst_row[ch] = v;
            ss += (double)(v * v);
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
        __syncthreads();
        double tot = 0.0;
        for (int i = 0; i < CST_THREADS / 32; i++) tot += red[i];
        const float scale = 1.0f / sqrtf((float)(tot / (double)dc) + eps);
        for (int ch = threadIdx.x; ch < dc; ch += CST_THREADS)
            cst_row[ch] = norm_w ? cst_row[ch] * scale * norm_w[ch] : cst_row[ch] * scale;
        __syncthreads();
        for (int i = threadIdx.x; i < r.n_rot / 2; i += CST_THREADS)
            rope_pair(cst_row + (dc - r.n_rot) + 2 * i, r, w0 * ratio, i, 0);
        __syncthreads();
        for (int ch = threadIdx.x; ch < dc; ch += CST_THREADS) rows[(int64_t)w0 * dc + ch] = cst_row[ch];
    }
    __syncthreads();
    const int slot = pos0 % (c * ratio);
#pragma unroll
    for (int j = 0; j < CST_PRE; j++) {
        const int i = threadIdx.x + j * CST_THREADS;
        if (i < width) {
            st_kv[(int64_t)slot * width + i] = kv_r[j];
            st_sc[(int64_t)slot * width + i] = sc_r[j];
        }
    }
    for (int i = threadIdx.x + CST_PRE * CST_THREADS; i < width; i += CST_THREADS) {
        st_kv[(int64_t)slot * width + i] = kv[i];
        st_sc[(int64_t)slot * width + i] = sc[i];
    }
}

static void launch_compressor_step(const cst_set &set, int n, int max_dc, const ds4_step *step, float eps,
                                   const ds4_rope *rp) {
    DS4_LAUNCH(k_compressor_step, n, CST_THREADS, (size_t)max_dc * sizeof(float), set, step, eps, rope_args_of(rp));
}

/* Batches: the composition, each launch over the most rows the batch can
 * emit, the emitted ones (and their destination, row w0 on) found from the
 * step block when the kernels run. */
static void cuda_compressor_step(const float *kv, const float *sc, float *st_kv, float *st_sc,
                                 const ds4_step *step, int nt, int ratio, int c, int dc, const float *norm_w,
                                 float eps, const ds4_rope *rp, float *rows) {
    if (nt <= 0 || ratio <= 0 || dc <= 0) return;
    if (nt == 1 && dc <= CST_MAX_DC && rp->n_rot <= dc) {
        cst_set set;
        memset(&set, 0, sizeof set);
        set.cs[0] = (ds4_compressor){ kv, sc, st_kv, st_sc, ratio, c, dc, norm_w, rows };
        launch_compressor_step(set, 1, dc, step, eps, rp);
        return;
    }
    const emit_rows er = { step, ratio, nt };
    const int max_rows = emit_rows_max(nt, ratio);
    launch_compress_pool(kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, 1, rows);
    launch_rmsnorm_rows(rows, norm_w, rows, max_rows, dc, eps, er);
    launch_rope_rows(rows, max_rows, 1, dc, step, ratio, er, rp, 0);
    launch_ring_store(st_kv, kv, c * ratio, c * dc, step, nt);
    launch_ring_store(st_sc, sc, c * ratio, c * dc, step, nt);
}

/* A step's compressors: at decode, every one the one-token kernel takes in
 * one launch (a block each); otherwise each as compressor_step. */
static void cuda_compressor_steps(int n, const ds4_compressor *cs, const ds4_step *step, int nt, float eps,
                                  const ds4_rope *rp) {
    if (n <= 0 || nt <= 0) return;
    if (n > DS4_MULTI_MAX) {
        fprintf(stderr, "ds4: compressor_steps: %d compressors above %d\n", n, DS4_MULTI_MAX);
        exit(1);
    }
    bool one_launch = nt == 1;
    int max_dc = 0;
    for (int i = 0; i < n; i++) {
        if (cs[i].ratio <= 0 || cs[i].dc <= 0 || cs[i].dc > CST_MAX_DC || rp->n_rot > cs[i].dc) one_launch = false;
        if (cs[i].dc > max_dc) max_dc = cs[i].dc;
    }
    if (!one_launch) {
        for (int i = 0; i < n; i++)
            cuda_compressor_step(cs[i].kv, cs[i].sc, cs[i].st_kv, cs[i].st_sc, step, nt, cs[i].ratio, cs[i].c,
                                 cs[i].dc, cs[i].norm_w, eps, rp, cs[i].rows);
        return;
    }
    cst_set set;
    memset(&set, 0, sizeof set);
    for (int i = 0; i < n; i++) set.cs[i] = cs[i];
    launch_compressor_step(set, n, max_dc, step, eps, rp);
}

/* ---------------------------------------------------------------------------
 * Indexer
 *
 * k_indexer_scores: one block per (tile of IX_RT visible rows, query).  The
 * query's Hi x di heads sit in shared memory (rows padded by one float, so
 * lanes on consecutive heads hit distinct banks) next to the row tile stored
 * transposed; a thread computes one head's dots with 4 rows, then the
 * weighted ReLU terms are summed over heads in head order, as the CPU does.
 * k_indexer_select: one block per query.  A radix select over the scores'
 * order-preserving bit patterns (four 8-bit histogram passes) finds the k-th
 * largest score T; the rows above T and the lowest-numbered rows equal to T
 * (an ordered ballot scan) are collected, and only those k keys are sorted by
 * a bitonic network.  The key is the score's bits above the complement of the
 * row id, so descending keys = higher score first, lower row on ties.  Any
 * number of visible rows works; the first 4096 keys stay in registers across
 * the passes, the rest are reread from L2.
 * ------------------------------------------------------------------------- */

#define IX_RT        16
#define IX_THREADS   256
#define IX_QREGS     32                     /* q floats per thread loaded in one batch */
#define IX_SEL       1024                   /* max k; also the select block size */
#define IX_CACHE     4                      /* keys per select thread held in registers */
#define IX_SCORE_CAP ((int64_t)64 << 20)    /* floats of score scratch */
#define IX_MIN_RATIO 4                      /* score rows hold n_ctx/4 + 1 entries */

static size_t ix_smem_bytes(int Hi, int di) {
    size_t f = (size_t)Hi * (di + 1) + Hi;
    f = (f + 3) & ~(size_t)3;                      /* 16-byte align the row tile */
    f += (size_t)di * (IX_RT + 4) + (size_t)IX_RT * (Hi + 1);
    return f * sizeof(float);
}

__global__ void __launch_bounds__(IX_THREADS) k_indexer_scores(const float *q, const float *w, float w_scale,
                                                               const float *rows,
                                                               const ds4_step *step, int t0, int Hi, int di, int ratio,
                                                               float *scores, int64_t ld, int do_rope, rope_args rr) {
    ds4_grid_dep();
    extern __shared__ __align__(16) float ix_s[];
    const int t = t0 + blockIdx.y;
    const int n_vis = ds4_comp_rows(step->pos0 + t, ratio);
    if ((int)blockIdx.x * IX_RT >= n_vis) return;    /* the grid is sized for the context, not the step */
    const int qld = di + 1, rld = IX_RT + 4, vld = Hi + 1;
    float *q_s = ix_s;
    float *w_s = q_s + (size_t)Hi * qld;
    float *r_s = ix_s + (((size_t)Hi * qld + Hi + 3) & ~(size_t)3);
    float *v_s = r_s + (size_t)di * rld;

    /* every load of the prologue in flight at once */
    const float *qt = q + (int64_t)t * Hi * di;
    const int nq = Hi * di;
    /* element idx = h*di + c; step IX_THREADS = hs*di + cs, carried by hand */
    const int hs = IX_THREADS / di, cs = IX_THREADS % di;
    int qh = threadIdx.x / di, qc = threadIdx.x % di;
#pragma unroll
    for (int j = 0; j < IX_QREGS; j++) {
        const int idx = threadIdx.x + j * IX_THREADS;
        if (idx < nq) q_s[qh * qld + qc] = qt[idx];
        qh += hs; qc += cs;
        if (qc >= di) { qc -= di; qh++; }
    }
    for (int idx = threadIdx.x + IX_QREGS * IX_THREADS; idx < nq; idx += IX_THREADS) {
        q_s[qh * qld + qc] = qt[idx];
        qh += hs; qc += cs;
        if (qc >= di) { qc -= di; qh++; }
    }
    for (int h = threadIdx.x; h < Hi; h += IX_THREADS) w_s[h] = __fmul_rn(w[(int64_t)t * Hi + h], w_scale);
    if (do_rope) {
        /* indexer_step: the query's rotation (the rope op's rope_pair, on the staged copy) */
        __syncthreads();
        const int half = rr.n_rot / 2;
        for (int task = threadIdx.x; task < Hi * half; task += IX_THREADS) {
            const int h = task / half, i = task % half;
            rope_pair(q_s + (size_t)h * qld + (di - rr.n_rot) + 2 * i, rr, step->pos0 + t, i, 0);
        }
    }
    /* the block's tiles of IX_RT rows: blockIdx.x, then every gridDim.x-th */
    for (int r0 = blockIdx.x * IX_RT; r0 < n_vis; r0 += gridDim.x * IX_RT) {
        if (r0 != (int)blockIdx.x * IX_RT) __syncthreads();   /* the previous tile's readers are done */
        int rr = threadIdx.x / di, rc = threadIdx.x % di;
#pragma unroll 16
        for (int idx = threadIdx.x; idx < IX_RT * di; idx += IX_THREADS) {
            r_s[rc * rld + rr] = r0 + rr < n_vis ? rows[(int64_t)(r0 + rr) * di + rc] : 0.0f;
            rr += hs; rc += cs;
            if (rc >= di) { rc -= di; rr++; }
        }
        __syncthreads();

        for (int task = threadIdx.x; task < Hi * (IX_RT / 4); task += IX_THREADS) {
            const int h = task % Hi, rq = task / Hi;
            float acc[4] = { 0, 0, 0, 0 };
            const float *qh = q_s + (size_t)h * qld;
            for (int cc = 0; cc < di; cc++) {
                const float qv = qh[cc];
                const float4 rv = *(const float4 *)(r_s + (size_t)cc * rld + 4 * rq);
                acc[0] = fmaf(qv, rv.x, acc[0]); acc[1] = fmaf(qv, rv.y, acc[1]);
                acc[2] = fmaf(qv, rv.z, acc[2]); acc[3] = fmaf(qv, rv.w, acc[3]);
            }
#pragma unroll
            for (int j = 0; j < 4; j++)
                v_s[(4 * rq + j) * vld + h] = __fmul_rn(w_s[h], acc[j] > 0.0f ? acc[j] : 0.0f);
        }
        __syncthreads();
        for (int r = threadIdx.x; r < IX_RT; r += IX_THREADS) {
            if (r0 + r >= n_vis) continue;
            float sacc = 0.0f;
            for (int h = 0; h < Hi; h++) sacc += v_s[r * vld + h];
            scores[(int64_t)blockIdx.y * ld + r0 + r] = sacc;
        }
    }
}

/* The grid covers the most rows a context can have visible (ld), at most two
 * blocks per SM; each block takes every gridDim.x-th tile of the rows its
 * query sees on this step, and the rest return at once. */
static void launch_indexer_scores(const float *q, const float *w, float w_scale, const float *rows,
                                  const ds4_step *step, int t0, int n_q, int Hi, int di, int ratio, int64_t ld,
                                  float *scores, const ds4_rope *rp) {
    const size_t smem = ix_smem_bytes(Hi, di);
    if (smem > g_cuda.smem_optin) {
        fprintf(stderr, "ds4: indexer: %d heads x %d dims need %zu bytes of shared memory (device max %zu)\n",
                Hi, di, smem, g_cuda.smem_optin);
        exit(1);
    }
    int64_t tiles = (ld + IX_RT - 1) / IX_RT;
    if (tiles > 2 * (int64_t)g_cuda.n_sm) tiles = 2 * (int64_t)g_cuda.n_sm;
    dim3 grid((unsigned)(tiles > 0 ? tiles : 1), (unsigned)n_q);
    rope_args r;
    memset(&r, 0, sizeof r);
    if (rp) r = rope_args_of(rp);
    DS4_LAUNCH(k_indexer_scores, grid, IX_THREADS, smem, q, w, w_scale, rows, step, t0, Hi, di, ratio,
               scores, ld, rp ? 1 : 0, r);
}

/* Order-preserving bits of a score (-0 counts as +0, so equal scores tie). */
__device__ __forceinline__ uint32_t ix_ukey(float s) {
    const uint32_t u = __float_as_uint(s + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Compare-exchange of bitonic stage (size, i <-> j): the value position i keeps. */
__device__ __forceinline__ uint64_t ix_cmpx(uint64_t mine, uint64_t other, int i, int j, int size) {
    const bool desc = (i & size) == 0;       /* this run sorts descending */
    const bool keep_max = desc == (i < j);
    return keep_max ? (mine > other ? mine : other) : (mine < other ? mine : other);
}

/* Sort keys[0, sz) descending, sz a power of two <= IX_SEL, one position per
 * thread.  Strides below 32 pair lanes of one warp (shuffles); the others go
 * through shared memory (write, barrier, read partner, barrier). */
__device__ void ix_bitonic(uint64_t *keys, int sz) {
    const int i = threadIdx.x;
    uint64_t kr = i < sz ? keys[i] : 0ull;
    for (int size = 2; size <= sz; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (stride >= 32) {
                __syncthreads();                  /* previous readers of keys are done */
                if (i < sz) keys[i] = kr;
                __syncthreads();
                if (i < sz) kr = ix_cmpx(kr, keys[i ^ stride], i, i ^ stride, size);
            } else if (i - (i & 31) < sz) {       /* warps wholly past sz sit out */
                const uint64_t other = __shfl_xor_sync(FULL_MASK, kr, stride);
                if (i < sz) kr = ix_cmpx(kr, other, i, i ^ stride, size);
            }
        }
    }
    __syncthreads();
    if (i < sz) keys[i] = kr;
    __syncthreads();
}

__global__ void __launch_bounds__(IX_SEL) k_indexer_select(const float *scores, int64_t ld, const ds4_step *step,
                                                           int t0, int ratio, int k, int32_t *out) {
    ds4_grid_dep();
    __shared__ uint32_t hist[256];
    __shared__ uint64_t sel[IX_SEL];
    __shared__ uint32_t wsum[IX_SEL / 32];
    __shared__ uint32_t s_prefix, s_remaining, n_sel;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = t0 + blockIdx.x;
    const float *sc = scores + (int64_t)blockIdx.x * ld;
    /* the first IX_CACHE*IX_SEL scores of the row, in flight with the position
     * (entries past this step's visible rows are dropped below) */
    float sv[IX_CACHE];
#pragma unroll
    for (int c = 0; c < IX_CACHE; c++) {
        const int i = c * IX_SEL + tid;
        sv[c] = i < ld ? sc[i] : 0.0f;
    }
    const int n = ds4_comp_rows(step->pos0 + t, ratio);
    const int kk = k < n ? k : n;
    if (kk > 0) {
        /* radix select: T = the kk-th largest key; `remaining` of the keys
         * equal to T belong to the top kk */
        uint32_t uk[IX_CACHE];                      /* the first IX_CACHE*IX_SEL keys, read once */
#pragma unroll
        for (int c = 0; c < IX_CACHE; c++) {
            const int i = c * IX_SEL + tid;
            uk[c] = i < n ? ix_ukey(sv[c]) : 0u;
        }
        uint32_t prefix = 0, mask = 0, remaining = (uint32_t)kk;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += IX_SEL) hist[b] = 0;
            __syncthreads();
            /* scores share their top bits, so many lanes hit one bin: one
             * atomic per distinct bin per warp */
#define IX_COUNT(valid_, u_) do {                                                          \
                const uint32_t uu_ = (u_);                                                 \
                const uint32_t bin_ = (valid_) && (uu_ & mask) == prefix ? (uu_ >> shift) & 255u : 256u; \
                const uint32_t same_ = __match_any_sync(FULL_MASK, bin_);                  \
                if (bin_ < 256u && lane == __ffs(same_) - 1) atomicAdd(&hist[bin_], (uint32_t)__popc(same_)); \
            } while (0)
#pragma unroll
            for (int c = 0; c < IX_CACHE; c++)
                if (c * IX_SEL < n) IX_COUNT(c * IX_SEL + tid < n, uk[c]);
            for (int base = IX_CACHE * IX_SEL; base < n; base += IX_SEL)
                IX_COUNT(base + tid < n, base + tid < n ? ix_ukey(sc[base + tid]) : 0u);
#undef IX_COUNT
            __syncthreads();
            if (warp == 0) {
                /* lane l owns bins 255-8l .. 248-8l, scanned from the top */
                uint32_t c[8], tot = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) { c[j] = hist[255 - 8 * lane - j]; tot += c[j]; }
                uint32_t incl = tot;
                for (int o = 1; o < 32; o <<= 1) {
                    const uint32_t v = __shfl_up_sync(FULL_MASK, incl, o);
                    if (lane >= o) incl += v;
                }
                uint32_t above = incl - tot;
                if (above < remaining && remaining <= incl) {
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        if (above + c[j] >= remaining) {
                            s_prefix = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                            s_remaining = remaining - above;
                            break;
                        }
                        above += c[j];
                    }
                }
            }
            __syncthreads();
            prefix = s_prefix;
            remaining = s_remaining;
            mask |= 255u << shift;
        }
        /* collect: every key above T, and the first `remaining` keys equal to
         * T in row order (ballot ranks + per-warp counts, chunk by chunk) */
        if (tid == 0) n_sel = 0;
        uint32_t eq_before = 0;
        for (int base = 0, c = 0; base < n; base += IX_SEL, c++) {
            const int i = base + tid;
            uint32_t u = 0u;
#pragma unroll
            for (int cc = 0; cc < IX_CACHE; cc++) if (cc == c) u = uk[cc];
            if (c >= IX_CACHE && i < n) u = ix_ukey(sc[i]);
            const bool gt = i < n && u > prefix, eq = i < n && u == prefix;
            const uint32_t bal = __ballot_sync(FULL_MASK, eq);
            if (lane == 0) wsum[warp] = __popc(bal);
            __syncthreads();
            uint32_t rank = eq_before + __popc(bal & ((1u << lane) - 1u)), chunk_eq = 0;
            for (int wv = 0; wv < IX_SEL / 32; wv++) {
                if (wv < warp) rank += wsum[wv];
                chunk_eq += wsum[wv];
            }
            const bool take = gt || (eq && rank < remaining);
            const uint32_t tb = __ballot_sync(FULL_MASK, take);
            uint32_t at = 0;
            if (lane == 0 && tb) at = atomicAdd(&n_sel, (uint32_t)__popc(tb));
            at = __shfl_sync(FULL_MASK, at, 0) + __popc(tb & ((1u << lane) - 1u));
            if (take) sel[at] = ((uint64_t)u << 32) | (uint64_t)(0xffffffffu - (uint32_t)i);
            eq_before += chunk_eq;
            __syncthreads();
        }
        /* n_sel == kk; the insertion order above does not matter: keys are unique */
        int sz = 1;
        while (sz < kk) sz <<= 1;
        if (tid >= kk && tid < sz) sel[tid] = 0ull;
        __syncthreads();
        ix_bitonic(sel, sz);
    }
    for (int j = tid; j < k; j += IX_SEL)
        out[(int64_t)t * k + j] = j < kk ? (int32_t)(0xffffffffu - (uint32_t)sel[j]) : -1;
}

static void launch_indexer_select(const float *scores, int64_t ld, const ds4_step *step, int t0, int n_q, int ratio,
                                  int k, int32_t *out) {
    DS4_LAUNCH(k_indexer_select, n_q, IX_SEL, 0, scores, ld, step, t0, ratio, k, out);
}

/* Scores go to the session's buffer: rows of ld = the most rows the context
 * can have visible, for ix_chunk queries at a time (both fixed when the
 * session was made, so the launches do not depend on the position). */
static void indexer_run(const float *q, const float *w, float w_scale, const float *rows,
                        const ds4_step *step, int nt, int Hi, int di, int ratio, int k, const ds4_rope *rp,
                        int32_t *out) {
    if (nt <= 0 || k <= 0) return;
    if (rp && (rp->n_rot < 0 || rp->n_rot > di || rp->n_rot % 2)) {
        fprintf(stderr, "ds4: indexer: rope of %d dims on heads of %d\n", rp->n_rot, di);
        exit(1);
    }
    if (k > IX_SEL) {
        fprintf(stderr, "ds4: indexer: top-k %d above %d\n", k, IX_SEL);
        exit(1);
    }
    ds4_session *S = sess();
    if (ratio < IX_MIN_RATIO) {
        fprintf(stderr, "ds4: indexer: ratio %d below %d (the score rows are sized for it)\n", ratio, IX_MIN_RATIO);
        exit(1);
    }
    if (nt > S->lim.max_batch) {
        fprintf(stderr, "ds4: indexer: %d queries above the context's batch %d\n", nt, S->lim.max_batch);
        exit(1);
    }
    const int64_t chunk = S->ix_chunk;
    float *scores = (float *)scratch_get(&S->ix_scores, (size_t)(chunk * S->ix_ld) * sizeof(float));
    for (int t0 = 0; t0 < nt; t0 += (int)chunk) {
        const int n_q = nt - t0 < chunk ? nt - t0 : (int)chunk;
        launch_indexer_scores(q, w, w_scale, rows, step, t0, n_q, Hi, di, ratio, S->ix_ld, scores, rp);
        launch_indexer_select(scores, S->ix_ld, step, t0, n_q, ratio, k, out);
    }
}

static void cuda_indexer_topk(const float *q, const float *w, float w_scale, const float *rows,
                              const ds4_step *step, int nt, int Hi, int di, int ratio, int k, int32_t *out) {
    indexer_run(q, w, w_scale, rows, step, nt, Hi, di, ratio, k, NULL, out);
}

/* indexer_step: the rope op is folded into the scores kernel, which rotates
 * its staged copy of the query (q itself is left as it was) -- one launch
 * less per ratio-4 layer. */
static void cuda_indexer_step(float *q, const float *w, float w_scale, const float *rows, const ds4_step *step,
                              int nt, int Hi, int di, int ratio, int k, const ds4_rope *rp, int32_t *out) {
    indexer_run(q, w, w_scale, rows, step, nt, Hi, di, ratio, k, rp && rp->n_rot > 0 ? rp : NULL, out);
}

/* ---------------------------------------------------------------------------
 * MoE
 *
 * Routing: one warp per token.  probs = sqrt(softplus(logits)) in shared
 * memory; scored layers take k rounds of a warp arg-max (ties: lower expert)
 * over the biased probs, hash layers copy the token's tid2eid row; lane j
 * then holds slot j's weight, normalised by the sum taken in slot order, as
 * the CPU does.  At decode the router's matvec runs in the same launch
 * (k_moe_gate, the op moe_gate).
 *
 * Experts, decode (nt <= MOE_DECODE_MAX_NT): no host round trip.  k_matvec
 * in gate|up mode computes h = swiglu(gate x, up x) for every (token, slot)
 * into [nt][k][F], reading the expert id from sel on the device; down mode
 * computes each slot's output into [nt][k][D]; k_moe_combine adds them with
 * the routing weights in slot order.  Three launches, which stream the
 * selected experts' weights near the copy bandwidth.  The combine stays a
 * launch of its own: folded into the down launch (its last block per row
 * tile adding the slots after a fence and a counter) it slows that launch
 * by more than the launch it saves.
 * Experts, prefill: sel is copied to the host and (token, slot) pairs are
 * counted per expert.  Dequantizing an expert costs about as much as eight
 * matvecs over it, so with fewer than MOE_GEMM_MIN_AVG tokens per used expert
 * the decode kernels run anyway.  Otherwise the pairs are grouped by expert
 * (in token order), their inputs gathered, and each expert's three
 * projections run as cuBLAS GEMMs on its dequantized slice; k_moe_combine
 * then reads the outputs back in (token, slot) order through the pair -> row
 * table.
 * ------------------------------------------------------------------------- */

#define MOE_DECODE_MAX_NT  8    /* no host copy of the routing up to here */
#define MOE_GEMM_MIN_AVG   8    /* GEMMs pay once experts average this many tokens */
#define ROUTE_MAX_E        1024
#define ROUTE_MAX_K        64

/* The routing of one token by one warp (every lane calls it): l the
 * token's E logits (read through L2: k_moe_gate's other blocks wrote them),
 * probs/selp shared buffers of E floats each, tid_row the token's tid2eid
 * row (hash layers) or NULL. */
__device__ void moe_route_warp(const float *l, const float *bias, const int32_t *tid_row, int E, int k,
                               int norm, float wscale, float *probs, float *selp, int32_t *sel_t, float *wts_t) {
    const int lane = threadIdx.x & 31;
    for (int e = lane; e < E; e += 32) {
        const float x = __ldcg(&l[e]);
        const float sp = x > 20.0f ? x : logf(1.0f + expf(x));
        probs[e] = sqrtf(sp);
        selp[e] = bias ? probs[e] + bias[e] : probs[e];
    }
    __syncwarp();
    /* The chosen ids live in registers: lane j keeps pick j (j < 32; pick
     * 32 + j goes to mine_hi), and lane e % 32 marks expert e in its taken
     * bits (bit e / 32; E <= 1024).  Nothing shared is written during the
     * selection, so no lane can read a pick before it is made. */
    int mine = -1, mine_hi = -1;
    uint32_t taken = 0;
    if (tid_row) {
        if (lane < k) mine = tid_row[lane];
        if (lane + 32 < k) mine_hi = tid_row[lane + 32];
    } else {
        for (int j = 0; j < k; j++) {
            float bv = 0.0f;
            int be = -1;
            for (int e = lane, bit = 0; e < E; e += 32, bit++) {
                if (taken >> bit & 1u) continue;
                if (be < 0 || selp[e] > bv) { bv = selp[e]; be = e; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
                const int oe = __shfl_xor_sync(FULL_MASK, be, o);
                if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) { bv = ov; be = oe; }
            }
            /* every lane now holds the same be */
            if (be >= 0 && lane == (be & 31)) taken |= 1u << (be >> 5);
            if (lane == (j & 31)) { if (j < 32) mine = be; else mine_hi = be; }
        }
    }
    /* weights: lane j < 32 owns slot j (and 32 + j), so the k probabilities
     * are gathered and scaled in parallel; the normalising sum is added in
     * slot order by every lane (k shuffles), as the CPU adds it */
    const float w_lo = mine >= 0 && mine < E ? probs[mine] : 0.0f;
    const float w_hi = mine_hi >= 0 && mine_hi < E ? probs[mine_hi] : 0.0f;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += __shfl_sync(FULL_MASK, j < 32 ? w_lo : w_hi, j & 31);
    if (norm && sum < 6.103515625e-5f) sum = 6.103515625e-5f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = lane + 32 * h;
        if (j >= k) break;
        float wv = h ? w_hi : w_lo;
        if (norm) wv /= sum;
        if (wscale != 0.0f) wv *= wscale;
        sel_t[j] = h ? mine_hi : mine;
        wts_t[j] = wv;
    }
}

__global__ void k_moe_route(const float *logits, const float *bias, const int32_t *tid2eid, int64_t tid_ld,
                            const int32_t *tokens, int E, int k, int norm, float wscale,
                            int32_t *sel, float *wts) {
    ds4_grid_dep();
    extern __shared__ float rt_s[];
    const int t = blockIdx.x;
    moe_route_warp(logits + (int64_t)t * E, bias, tid2eid ? tid2eid + (int64_t)tokens[t] * tid_ld : NULL, E, k,
                   norm, wscale, rt_s, rt_s + E, sel + (int64_t)t * k, wts + (int64_t)t * k);
}

static void launch_moe_route(const float *logits, const float *bias, const int32_t *tid2eid, int64_t tid_ld,
                             const int32_t *tokens, int nt, int E, int k, int norm, float wscale,
                             int32_t *sel, float *wts) {
    DS4_LAUNCH(k_moe_route, nt, 32, (size_t)2 * E * sizeof(float), logits, bias, tid2eid, tid_ld, tokens,
               E, k, norm, wscale, sel, wts);
}

/* moe_gate at decode: the router's logits and the routing in one launch.
 * Block (bx, t) computes logits MG_ROWS*bx .. +MG_ROWS of token t: the 8
 * warps take K/8 each (16-byte loads, all in flight), and the warps'
 * partials are added in warp order.  Then the block counts itself done on
 * the token's counter, and the last one routes the token with its warp 0
 * (moe_route_warp).  A separate router matvec and route kernel cost two
 * launches (~4 + 6 us on an H200, 43 times per Flash token).  The logits
 * differ from the matmul op's by the order of the K sum (a few ulp; the
 * tested bound is the matmul's). */
#define MG_THREADS 256
#define MG_ROWS    2
static_assert(MOE_DECODE_MAX_NT <= HC_SPLIT_MAX_NT, "a session's gate_count holds HC_SPLIT_MAX_NT counters");
template <int WT>
__global__ void __launch_bounds__(MG_THREADS) k_moe_gate(const void *gw, const float *x, int64_t K, int E,
                                                        float *logits, const float *bias,
                                                        const int32_t *tid2eid, int64_t tid_ld,
                                                        const int32_t *tokens, int k, int norm, float wscale,
                                                        unsigned *count, int32_t *sel, float *wts) {
    ds4_grid_dep();
    extern __shared__ float mg_s[];                 /* probs, selp: [E] each */
    __shared__ float part[MG_ROWS][MG_THREADS / 32];
    __shared__ int last_s;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bx = blockIdx.x, t = blockIdx.y;
    const int64_t slice = K / (MG_THREADS / 32), k0 = (int64_t)warp * slice;
    const float *xt = x + (int64_t)t * K;
    float acc[MG_ROWS];
#pragma unroll
    for (int r = 0; r < MG_ROWS; r++) acc[r] = 0.0f;
#pragma unroll 4
    for (int64_t e = k0 + 4 * lane; e < k0 + slice; e += 128) {
        const float4 xv = *(const float4 *)(xt + e);
#pragma unroll
        for (int r = 0; r < MG_ROWS; r++) {
            const int row = bx * MG_ROWS + r;
            if (row >= E) break;
            float w0, w1, w2, w3;
            if (WT == DS4_TYPE_F16) {
                const uint2 h = ld_stream8((const uint8_t *)gw + ((int64_t)row * K + e) * 2);
                w0 = f16_bits_to_f32((uint16_t)(h.x & 0xffffu)); w1 = f16_bits_to_f32((uint16_t)(h.x >> 16));
                w2 = f16_bits_to_f32((uint16_t)(h.y & 0xffffu)); w3 = f16_bits_to_f32((uint16_t)(h.y >> 16));
            } else {
                const uint4 v = ld_stream16((const uint8_t *)gw + ((int64_t)row * K + e) * 4);
                w0 = __uint_as_float(v.x); w1 = __uint_as_float(v.y);
                w2 = __uint_as_float(v.z); w3 = __uint_as_float(v.w);
            }
            acc[r] = fmaf(w0, xv.x, acc[r]); acc[r] = fmaf(w1, xv.y, acc[r]);
            acc[r] = fmaf(w2, xv.z, acc[r]); acc[r] = fmaf(w3, xv.w, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MG_ROWS; r++) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) part[r][warp] = v;
    }
    __syncthreads();
    if (threadIdx.x < MG_ROWS && bx * MG_ROWS + (int)threadIdx.x < E) {
        float v = 0.0f;
        for (int w = 0; w < MG_THREADS / 32; w++) v += part[threadIdx.x][w];
        logits[(int64_t)t * E + bx * MG_ROWS + threadIdx.x] = v;
    }
    if (warp == 0) __threadfence();                 /* the only writer */
    __syncthreads();
    if (threadIdx.x == 0) last_s = atomicAdd(&count[t], 1u) == gridDim.x - 1u;
    __syncthreads();
    if (!last_s || warp != 0) return;
    __threadfence();
    if (lane == 0) count[t] = 0;
    moe_route_warp(logits + (int64_t)t * E, bias, tid2eid ? tid2eid + (int64_t)tokens[t] * tid_ld : NULL, E, k,
                   norm, wscale, mg_s, mg_s + E, sel + (int64_t)t * k, wts + (int64_t)t * k);
}

static void launch_moe_gate(const void *gw, int wt, const float *x, int64_t K, int E, int nt, float *logits,
                            const float *bias, const int32_t *tid2eid, int64_t tid_ld, const int32_t *tokens,
                            int k, int norm, float wscale, int32_t *sel, float *wts) {
    const dim3 grid((unsigned)((E + MG_ROWS - 1) / MG_ROWS), (unsigned)nt);
    const size_t smem = (size_t)2 * E * sizeof(float);
    if (wt == DS4_TYPE_F16)
        DS4_LAUNCH(k_moe_gate<DS4_TYPE_F16>, grid, MG_THREADS, smem, gw, x, K, E, logits, bias, tid2eid, tid_ld,
                   tokens, k, norm, wscale, sess()->gate_count,
                   sel, wts);
    else
        DS4_LAUNCH(k_moe_gate<DS4_TYPE_F32>, grid, MG_THREADS, smem, gw, x, K, E, logits, bias, tid2eid, tid_ld,
                   tokens, k, norm, wscale, sess()->gate_count,
                   sel, wts);
}

static void cuda_moe_route(const float *logits, const float *bias, const ds4_weight *tid2eid,
                           const int32_t *tokens, int nt, int E, int k, int norm, float wscale,
                           int32_t *sel, float *wts) {
    if (nt <= 0) return;
    if (E < 1 || E > ROUTE_MAX_E || k < 1 || k > ROUTE_MAX_K || k > E) {
        fprintf(stderr, "ds4: moe_route: E = %d, k = %d outside the supported 1..%d, 1..%d\n",
                E, k, ROUTE_MAX_E, ROUTE_MAX_K);
        exit(1);
    }
    launch_moe_route(logits, bias, tid2eid ? (const int32_t *)tid2eid->dev : NULL,
                     tid2eid ? tid2eid->ne[0] : 0, tokens, nt, E, k, norm, wscale, sel, wts);
}

static void cuda_moe_gate(const ds4_weight *gate_inp, const float *x, float *logits, const float *bias,
                          const ds4_weight *tid2eid, const int32_t *tokens, int nt, int E, int k, int norm,
                          float wscale, int32_t *sel, float *wts) {
    if (nt <= 0) return;
    const int64_t K = gate_inp->ne[0];
    const bool fused = nt <= MOE_DECODE_MAX_NT && gate_inp->ne[1] == E && gate_inp->ne[2] <= 1 &&
                       (gate_inp->type == DS4_TYPE_F32 || gate_inp->type == DS4_TYPE_F16) &&
                       K % (4 * MG_THREADS) == 0 && (uintptr_t)gate_inp->dev % 16 == 0 &&
                       E >= 1 && E <= ROUTE_MAX_E && k >= 1 && k <= ROUTE_MAX_K && k <= E;
    if (!fused) {
        cuda_matmul(gate_inp, 0, x, logits, nt);
        cuda_moe_route(logits, bias, tid2eid, tokens, nt, E, k, norm, wscale, sel, wts);
        return;
    }
    launch_moe_gate(gate_inp->dev, gate_inp->type, x, K, E, nt, logits, bias,
                    tid2eid ? (const int32_t *)tid2eid->dev : NULL, tid2eid ? tid2eid->ne[0] : 0, tokens,
                    k, norm, wscale, sel, wts);
}

/* y[r][c] = swiglu(g[r][c], u[r][c]) with row strides ld_in / ld_out. */
__global__ void k_swiglu(const float *g, const float *u, float *y, int64_t rows, int64_t cols,
                         int64_t ld_in, int64_t ld_out, float limit) {
    ds4_grid_dep();
    const int64_t n = rows * cols;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = idx / cols, c = idx % cols;
        y[r * ld_out + c] = silu_mul(g[r * ld_in + c], u[r * ld_in + c], limit);
    }
}

static void launch_swiglu(const float *g, const float *u, float *y, int64_t rows, int64_t cols,
                          int64_t ld_in, int64_t ld_out, float limit) {
    if (rows <= 0 || cols <= 0) return;
    DS4_LAUNCH(k_swiglu, grid_for(rows * cols), 256, 0, g, u, y, rows, cols, ld_in, ld_out, limit);
}

static void cuda_swiglu(const float *g, const float *u, float *y, int64_t n, float limit) {
    launch_swiglu(g, u, y, 1, n, n, n, limit);
}

/* out[t][:] = sum_j wts[t][j] * slot_out[row(t, j)][:], j in order; row is
 * t*k + j (decode layout) or pos[t*k + j] (prefill, grouped by expert). */
__global__ void k_moe_combine(const float *slot_out, const int32_t *pos, const float *wts, int nt, int k,
                              int64_t D, const float *add, float *out) {
    ds4_grid_dep();
    const int64_t n = (int64_t)nt * D;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = idx / D, i = idx % D;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            const int64_t pr = t * k + j;
            const int64_t row = pos ? pos[pr] : pr;
            acc += wts[pr] * slot_out[row * D + i];
        }
        out[idx] = add ? __fadd_rn(acc, add[idx]) : acc;
    }
}

static void launch_moe_combine(const float *slot_out, const int32_t *pos, const float *wts, int nt, int k,
                               int64_t D, const float *add, float *out) {
    DS4_LAUNCH(k_moe_combine, grid_for((int64_t)nt * D), 256, 0, slot_out, pos, wts, nt, k, D, add, out);
}

/* xg[i][:] = x[perm[i] / k][:] */
__global__ void k_moe_gather(const float *x, const int32_t *perm, int k, int64_t n_pairs, int64_t D, float *xg) {
    ds4_grid_dep();
    const int64_t n = n_pairs * D;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = idx / D, c = idx % D;
        xg[idx] = x[(int64_t)(perm[i] / k) * D + c];
    }
}

static void launch_moe_gather(const float *x, const int32_t *perm, int k, int64_t n_pairs, int64_t D, float *xg) {
    DS4_LAUNCH(k_moe_gather, grid_for(n_pairs * D), 256, 0, x, perm, k, n_pairs, D, xg);
}

static void moe_decode(const float *x, const int32_t *sel, const float *wts,
                       const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                       int nt, int k, float clamp, const float *add, float *out) {
    const int64_t D = gate->ne[0], F = gate->ne[1];
    const size_t rb_g = ds4_row_bytes(gate->type, D), rb_d = ds4_row_bytes(down->type, F);
    const int64_t pairs = (int64_t)nt * k;
    float *h = (float *)scratch_get(&sess()->moe_h, (size_t)(pairs * F) * sizeof(float));
    float *tmp = (float *)scratch_get(&sess()->moe_tmp, (size_t)(pairs * D) * sizeof(float));

    mv_args a;
    memset(&a, 0, sizeof a);
    a.w = (const uint8_t *)gate->dev;
    a.w2 = (const uint8_t *)up->dev;
    a.mat_bytes = (size_t)F * rb_g;
    a.row_bytes = rb_g;
    a.K = (int)D;
    a.rows = (int)F;
    a.x = x; a.x_prob = 0; a.x_tok = D;
    a.y = h; a.y_prob = F; a.y_tok = (int64_t)k * F;
    a.sel = sel; a.k = k; a.clamp = clamp;
    matvec_run(gate->type, MV_GATE_UP, a, k, nt, 1);

    mv_args b;
    memset(&b, 0, sizeof b);
    b.w = (const uint8_t *)down->dev;
    b.mat_bytes = (size_t)D * rb_d;
    b.row_bytes = rb_d;
    b.K = (int)F;
    b.rows = (int)D;
    b.x = h; b.x_prob = F; b.x_tok = (int64_t)k * F;
    b.y = tmp; b.y_prob = D; b.y_tok = (int64_t)k * D;
    b.sel = sel; b.k = k;
    matvec_run(down->type, MV_DOWN, b, k, nt, 1);

    launch_moe_combine(tmp, NULL, wts, nt, k, D, add, out);
}

static void cuda_moe_experts(const float *x, const int32_t *sel, const float *wts,
                             const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                             int nt, int k, float clamp, const float *add, float *out) {
    if (nt <= 0 || k <= 0) return;
    check_matrix_type(gate->type, "moe_experts gate");
    check_matrix_type(down->type, "moe_experts down");
    if (up->type != gate->type) {
        fprintf(stderr, "ds4: moe_experts: gate and up weights must share a type\n");
        exit(1);
    }
    if (nt <= MOE_DECODE_MAX_NT) {
        moe_decode(x, sel, wts, gate, up, down, nt, k, clamp, add, out);
        return;
    }
    const int64_t D = gate->ne[0], F = gate->ne[1], E = gate->ne[2];
    const int64_t pairs = (int64_t)nt * k;

    /* host tables (the session's pinned buffer): sel | perm (pairs grouped by
     * expert) | pos (pair -> row) | expert offsets */
    ds4_session *S = sess();
    if ((size_t)(3 * pairs + E + 1) > S->host_idx_cap) {
        fprintf(stderr, "ds4: moe_experts: %lld (token, expert) pairs of %lld experts above the context's %zu entries\n",
                (long long)pairs, (long long)E, S->host_idx_cap);
        exit(1);
    }
    int32_t *hs = S->host_idx;
    int32_t *hperm = hs + pairs, *hpos = hs + 2 * pairs, *off = hs + 3 * pairs;
    /* NOTE(prefill): a prompt's routing is grouped by expert on the host, so
     * the GEMM sizes are known: one ordered read and one wait per MoE layer
     * of a batch above MOE_DECODE_MAX_NT tokens (never in a decode step) */
    DS4_CUDA_CHECK(cudaMemcpyAsync(hs, sel, (size_t)pairs * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                   ds4_current_stream()));
    stream_wait();
    for (int64_t e = 0; e <= E; e++) off[e] = 0;
    for (int64_t i = 0; i < pairs; i++) {
        if (hs[i] < 0 || hs[i] >= E) {
            fprintf(stderr, "ds4: moe_experts: expert id %d outside 0..%lld\n", hs[i], (long long)E - 1);
            exit(1);
        }
        off[hs[i] + 1]++;
    }
    int64_t used = 0;
    for (int64_t e = 0; e < E; e++) { used += off[e + 1] > 0; off[e + 1] += off[e]; }
    if (pairs < (int64_t)MOE_GEMM_MIN_AVG * used) {
        /* too few tokens per expert for dequantization to pay */
        moe_decode(x, sel, wts, gate, up, down, nt, k, clamp, add, out);
        return;
    }
    for (int64_t i = 0; i < pairs; i++) {      /* stable: token order within an expert */
        const int32_t e = hs[i];
        const int32_t r = off[e]++;
        hperm[r] = (int32_t)i;
        hpos[i] = r;
    }
    for (int64_t e = E; e > 0; e--) off[e] = off[e - 1];   /* restore starts */
    off[0] = 0;

    int32_t *dperm = (int32_t *)scratch_get(&S->moe_idx, (size_t)(2 * pairs) * sizeof(int32_t));
    int32_t *dpos = dperm + pairs;
    /* the grouping goes back ordered on the stream; the pinned tables are not
     * written again before the next layer's wait, after this copy */
    DS4_CUDA_CHECK(cudaMemcpyAsync(dperm, hperm, (size_t)(2 * pairs) * sizeof(int32_t), cudaMemcpyHostToDevice,
                                   ds4_current_stream()));

    float *xg = (float *)scratch_get(&sess()->moe_xg, (size_t)(pairs * D) * sizeof(float));
    float *gu = (float *)scratch_get(&sess()->moe_gu, (size_t)(pairs * 2 * F) * sizeof(float));
    float *h = (float *)scratch_get(&sess()->moe_h, (size_t)(pairs * F) * sizeof(float));
    float *tmp = (float *)scratch_get(&sess()->moe_tmp, (size_t)(pairs * D) * sizeof(float));
    launch_moe_gather(x, dperm, k, pairs, D, xg);

    const size_t gbytes = (size_t)F * ds4_row_bytes(gate->type, D);
    const size_t dbytes = (size_t)D * ds4_row_bytes(down->type, F);
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = off[e], cnt = off[e + 1] - off[e];
        if (cnt == 0) continue;
        gemm_rows(gate, (size_t)e * gbytes, 0, F, xg + r0 * D, D, gu + r0 * 2 * F, 2 * F, (int)cnt);
        gemm_rows(up, (size_t)e * gbytes, 0, F, xg + r0 * D, D, gu + r0 * 2 * F + F, 2 * F, (int)cnt);
    }
    launch_swiglu(gu, gu + F, h, pairs, F, 2 * F, F, clamp);
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = off[e], cnt = off[e + 1] - off[e];
        if (cnt == 0) continue;
        gemm_rows(down, (size_t)e * dbytes, 0, D, h + r0 * F, F, tmp + r0 * D, D, (int)cnt);
    }
    launch_moe_combine(tmp, dpos, wts, nt, k, D, add, out);
}

/* ---------------------------------------------------------------------------
 * Elementwise
 * ------------------------------------------------------------------------- */

__global__ void k_add(const float *a, const float *b, float *y, int64_t n) {
    ds4_grid_dep();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

static void launch_add(const float *a, const float *b, float *y, int64_t n) {
    if (n <= 0) return;
    DS4_LAUNCH(k_add, grid_for(n), 256, 0, a, b, y, n);
}

static void cuda_add(const float *a, const float *b, float *y, int64_t n) {
    launch_add(a, b, y, n);
}

__global__ void k_scale(float *x, float s, int64_t n) {
    ds4_grid_dep();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

static void launch_scale(float *x, float s, int64_t n) {
    if (n <= 0) return;
    DS4_LAUNCH(k_scale, grid_for(n), 256, 0, x, s, n);
}

static void cuda_scale(float *x, float s, int64_t n) {
    launch_scale(x, s, n);
}

/* ---------------------------------------------------------------------------
 * Sessions
 *
 * ops_setup settles every kernel attribute and occupancy once, at init.
 * session_new sizes each scratch from the context's limits with the same
 * rules the ops use to ask for it (named next to each), so an op never finds
 * its buffer short; allocates the stream, the cuBLAS handle and workspace,
 * the block counters and the pinned staging; and waits once for the device
 * (the weights' copies, the zero fills) before the stream is used.
 * ------------------------------------------------------------------------- */

static void ops_setup(void) {
    mv_setup_type<DS4_TYPE_F32>();
    mv_setup_type<DS4_TYPE_F16>();
    mv_setup_type<DS4_TYPE_BF16>();
    mv_setup_type<DS4_TYPE_Q8_0>();
    mvq_setup_type<DS4_TYPE_Q2_K>();
    mvq_setup_type<DS4_TYPE_Q4_K>();
    mvq_setup_type<DS4_TYPE_IQ2_XXS>();
    attention_setup();
    /* k_indexer_scores has only dynamic shared memory: allow all of it */
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_indexer_scores, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)g_cuda.smem_optin));
}

/* ---- recorded regions: CUDA graphs (stage 2 of patches/series) ----
 *
 * region_begin(key) replays the key's graph on the session's stream, or
 * starts a capture of the ops the core then issues (cudaStreamBeginCapture,
 * thread-local mode); region_end(key) ends it, checks it and instantiates
 * and launches the graph (a capture records the work, it does not run it).
 * With graphs on, the session's stream is a blocking one, so that a stray
 * operation on the legacy stream during a capture fails loudly instead of
 * running once outside the graph.  A capture counts as good only when no
 * launch failed, capture and instantiation succeeded, and the graph holds
 * exactly one node per launch the region issued (cudaGraphGetNodes: a
 * launch missing from the graph would be missing from every replay).  Any
 * failure -- or DS4_CUDA_GRAPH_FAIL's injected one -- clears the error, keeps
 * the key as dead (it runs eagerly from then on; the first failure prints one
 * line) and answers DS4_REGION_REISSUE: the region's ops were recorded, not
 * run, so the core issues them again.  The cache holds at most graph_cache
 * keys, the least recently used evicted first. */
struct region {
    uint64_t        key;
    cudaGraphExec_t exec;       /* NULL: the key is dead (its recording failed) */
    uint64_t        nodes, bytes, last_use;
};

static void region_drop(ds4_session *S, int i) {
    struct region *r = &S->reg[i];
    if (r->exec) {
        DS4_CUDA_CHECK(cudaGraphExecDestroy(r->exec));
        S->gs.graphs--;
        S->gs.graph_nodes -= r->nodes;
        S->gs.graph_bytes -= r->bytes;
    }
    S->reg[i] = S->reg[--S->n_reg];
}

static struct region *region_find(ds4_session *S, uint64_t key) {
    for (int i = 0; i < S->n_reg; i++)
        if (S->reg[i].key == key) return &S->reg[i];
    return NULL;
}

/* A new entry for key (the least recently used one makes room when the cache is full). */
static struct region *region_add(ds4_session *S, uint64_t key) {
    if (S->n_reg >= S->lim.graph_cache) {
        int lru = 0;
        for (int i = 1; i < S->n_reg; i++)
            if (S->reg[i].last_use < S->reg[lru].last_use) lru = i;
        region_drop(S, lru);
    }
    struct region *r = &S->reg[S->n_reg++];
    memset(r, 0, sizeof *r);
    r->key = key;
    r->last_use = ++S->reg_clock;
    return r;
}

static void region_dead(ds4_session *S, uint64_t key, const char *what, const char *why) {
    struct region *r = region_find(S, key);
    if (!r) r = region_add(S, key);
    if (r->exec) {
        DS4_CUDA_CHECK(cudaGraphExecDestroy(r->exec));
        S->gs.graphs--;
        S->gs.graph_nodes -= r->nodes;
        S->gs.graph_bytes -= r->bytes;
        r->exec = NULL;
    }
    static std::atomic<int> said;
    if (said++ == 0)
        fprintf(stderr, "ds4: CUDA graph %s of region %llx failed (%s): it runs eagerly from now on "
                "(fallbacks are counted in --stats)\n", what, (unsigned long long)key, why);
    S->gs.fallbacks++;
}

static int cuda_region_begin(uint64_t key) {
    ds4_session *S = g_sess;
    if (!S || !S->lim.graphs) return DS4_REGION_ISSUE;
    if (S->capturing) {
        fprintf(stderr, "ds4: region_begin(%llx) inside the recording of %llx\n", (unsigned long long)key,
                (unsigned long long)S->cap_key);
        exit(1);
    }
    struct region *r = region_find(S, key);
    if (r) {
        r->last_use = ++S->reg_clock;
        if (!r->exec) {
            S->gs.fallbacks++;
            return DS4_REGION_ISSUE;
        }
        const cudaError_t e = cudaGraphLaunch(r->exec, ds4_current_stream());
        if (e == cudaSuccess) {
            S->gs.replays++;
            sess_trace_line("replay", (size_t)r->nodes);
            return DS4_REGION_REPLAYED;
        }
        (void)cudaGetLastError();
        region_dead(S, key, "launch", cudaGetErrorName(e));
        return DS4_REGION_ISSUE;
    }
    const cudaError_t e = cudaStreamBeginCapture(ds4_current_stream(), cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        region_dead(S, key, "capture", cudaGetErrorName(e));
        return DS4_REGION_ISSUE;
    }
    S->capturing = true;
    S->cap_key = key;
    S->cap_launches0 = S->launches;
    S->cap_err = cudaSuccess;
    S->cap_t0 = ds4_now();
    return DS4_REGION_ISSUE;
}

static int cuda_region_end(uint64_t key) {
    ds4_session *S = g_sess;
    if (!S || !S->lim.graphs || !S->capturing) return 0;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(ds4_current_stream(), &g);
    S->capturing = false;
    const double t1 = ds4_now();
    const uint64_t launched = S->launches - S->cap_launches0;
    char why[160] = "";
    S->n_captures_tried++;
    size_t n_nodes = 0;
    if (key != S->cap_key)
        snprintf(why, sizeof why, "region_end(%llx) ends the recording of %llx", (unsigned long long)key,
                 (unsigned long long)S->cap_key);
    else if (S->cap_err != cudaSuccess)
        snprintf(why, sizeof why, "a launch failed: %s", cudaGetErrorName(S->cap_err));
    else if (e != cudaSuccess || !g)
        snprintf(why, sizeof why, "%s", cudaGetErrorName(e));
    else if (S->lim.graph_fail == S->n_captures_tried)
        snprintf(why, sizeof why, "injected by DS4_CUDA_GRAPH_FAIL=%d", S->lim.graph_fail);
    else if ((e = cudaGraphGetNodes(g, NULL, &n_nodes)) != cudaSuccess)
        snprintf(why, sizeof why, "%s", cudaGetErrorName(e));
    else if ((uint64_t)n_nodes != launched)
        snprintf(why, sizeof why, "the graph has %zu nodes for %llu launches", n_nodes, (unsigned long long)launched);
    cudaGraphExec_t exec = NULL;
    size_t bytes = 0;
    if (!why[0]) {
        size_t f0 = 0, f1 = 0, total = 0;
        DS4_CUDA_CHECK(cudaMemGetInfo(&f0, &total));
#if CUDART_VERSION >= 12000
        e = cudaGraphInstantiate(&exec, g, 0);
#else
        e = cudaGraphInstantiate(&exec, g, NULL, NULL, 0);   /* CUDA 11's signature */
#endif
        DS4_CUDA_CHECK(cudaMemGetInfo(&f1, &total));
        bytes = f0 > f1 ? f0 - f1 : 0;
        if (e != cudaSuccess) {
            snprintf(why, sizeof why, "instantiate: %s", cudaGetErrorName(e));
            exec = NULL;
        }
    }
    const double t2 = ds4_now();
    if (g) DS4_CUDA_CHECK(cudaGraphDestroy(g));
    if (!why[0] && (e = cudaGraphLaunch(exec, ds4_current_stream())) != cudaSuccess)
        snprintf(why, sizeof why, "launch: %s", cudaGetErrorName(e));
    if (why[0]) {
        (void)cudaGetLastError();
        if (exec) DS4_CUDA_CHECK(cudaGraphExecDestroy(exec));
        region_dead(S, key, "recording", why);
        return DS4_REGION_REISSUE;
    }
    struct region *r = region_add(S, key);
    r->exec = exec;
    r->nodes = n_nodes;
    r->bytes = bytes;
    S->gs.captures++;
    S->gs.graphs++;
    S->gs.graph_nodes += n_nodes;
    S->gs.graph_bytes += bytes;
    S->gs.capture_ms += (t1 - S->cap_t0) * 1e3;
    S->gs.instantiate_ms += (t2 - t1) * 1e3;
    sess_trace_line("capture", n_nodes);
    return 0;
}

static void cuda_session_reset(void *s) {
    ds4_session *S = (ds4_session *)s;
    while (S->n_reg > 0) region_drop(S, S->n_reg - 1);
}

static void hk_close(ds4_session *S);   /* ds4_hooks.cu */

static void session_release(ds4_session *S) {
    if (!S) return;
    hk_close(S);            /* the hook emitter drains first: its producers ran on the stream */
    while (S->n_reg > 0) region_drop(S, S->n_reg - 1);
    free(S->reg);
    if (S->stream) {
        g_n_stream_sync++;
        DS4_CUDA_CHECK(cudaStreamSynchronize(S->stream));   /* NOTE(load time): a context ends */
    }
    scratch_t *all[] = { &S->deq, &S->moe_h, &S->moe_tmp, &S->moe_xg, &S->moe_gu, &S->moe_idx, &S->att_part,
                         &S->ix_scores };
    for (scratch_t *x : all) dev_free(x->p);
    dev_free(S->hc_count);
    dev_free(S->gate_count);
    dev_free(S->blas_ws);
    host_free(S->host_idx);
    host_free(S->up_stage);
    host_free(S->down_stage);
    if (S->blas) DS4_CUBLAS_CHECK(cublasDestroy(S->blas));
    if (S->stream) DS4_CUDA_CHECK(cudaStreamDestroy(S->stream));
    if (S->trace) fclose(S->trace);
    if (g_sess == S) g_sess = NULL;
    free(S);
}

static bool session_scratch(scratch_t *x, const char *what, size_t bytes) {
    x->what = what;
    if (bytes == 0) return true;
    const cudaError_t e = dev_malloc(&x->p, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cannot allocate the context's %s (%zu bytes): %s\n", what, bytes, cudaGetErrorString(e));
        (void)cudaGetLastError();
        x->p = NULL;
        return false;
    }
    x->cap = bytes;
    /* zeroed once (session_new waits for it): kernels may read slots a step did not write
     * (k_attention_combine loads every partial slot before it knows how many are used) */
    DS4_CUDA_CHECK(cudaMemsetAsync(x->p, 0, bytes, ds4_current_stream()));
    return true;
}

static bool session_pinned(void **p, const char *what, size_t bytes) {
    const cudaError_t e = host_alloc(p, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cannot allocate the context's %s (%zu bytes of pinned memory): %s\n", what, bytes,
                cudaGetErrorString(e));
        (void)cudaGetLastError();
        *p = NULL;
        return false;
    }
    return true;
}

static void *cuda_session_new(const ds4_limits *lim) {
    if (!g_cuda.ready && cuda_init() != 0) return NULL;
    if (lim->max_batch < 1 || lim->n_ctx < 1) {
        fprintf(stderr, "ds4: a CUDA session needs a batch and a context of at least 1 (got %d, %d)\n",
                lim->max_batch, lim->n_ctx);
        return NULL;
    }
    /* The launch bounds, checked once for the largest chunk and context.  The token count of a
     * call rides in grid.y or grid.z of the hc, matvec, attention, indexer, gate and attn_probs
     * launches, and attn_probs's column chunks in grid.y; every other dimension is a
     * grid-stride loop, a capped grid.x, or a fixed count. */
    {
        const int64_t yz = g_cuda.max_grid_yz;
        const int64_t n128 = (int64_t)lim->n_ctx / 128 + 1, k = lim->idx_topk > 0 ? lim->idx_topk : 0;
        const int64_t probs_chunks = ((int64_t)lim->n_swa + (k > n128 ? k : n128) + PROBS_ROWS - 1) / PROBS_ROWS;
        if (lim->max_batch > yz || probs_chunks > yz) {
            fprintf(stderr, "ds4: a batch of %d tokens on a context of %d positions exceeds this GPU's grid limit "
                    "%lld in y and z (give a smaller DS4_UBATCH or -c)\n", lim->max_batch, lim->n_ctx, (long long)yz);
            return NULL;
        }
    }
    ds4_session *S = (ds4_session *)calloc(1, sizeof *S);
    if (!S) {
        fprintf(stderr, "ds4: out of host memory\n");
        return NULL;
    }
    S->lim = *lim;
    S->pdl = lim->graphs && lim->graph_pdl && g_cuda.cc_major >= 9;
    const int64_t B = lim->max_batch, k = lim->n_expert_used > 0 ? lim->n_expert_used : 0;
    const int64_t D = lim->n_embd, F = lim->n_ff_exp, E = lim->n_expert;
    bool ok = true;
    const char *trace = getenv("DS4_LAUNCH_TRACE");
    if (trace && *trace) {
        S->trace = fopen(trace, "w");
        if (!S->trace) {
            fprintf(stderr, "ds4: DS4_LAUNCH_TRACE: cannot write %s: %s\n", trace, strerror(errno));
            free(S);
            return NULL;
        }
    }
    /* a blocking stream when graphs are on (a stray legacy-stream operation then fails a
     * capture loudly: the Sessions banner), a non-blocking one otherwise */
    DS4_CUDA_CHECK(cudaStreamCreateWithFlags(&S->stream, lim->graphs ? cudaStreamDefault : cudaStreamNonBlocking));
    if (lim->graphs) {
        S->reg = (struct region *)calloc((size_t)(lim->graph_cache > 0 ? lim->graph_cache : 1), sizeof *S->reg);
        if (!S->reg) {
            fprintf(stderr, "ds4: out of host memory\n");
            DS4_CUDA_CHECK(cudaStreamDestroy(S->stream));
            free(S);
            return NULL;
        }
        if (S->lim.graph_cache < 1) S->lim.graph_cache = 1;
    }
    DS4_CUBLAS_CHECK(cublasCreate(&S->blas));
    /* f32 products stay f32: default math never uses TF32 for Sgemm. */
    DS4_CUBLAS_CHECK(cublasSetMathMode(S->blas, CUBLAS_DEFAULT_MATH));
    DS4_CUBLAS_CHECK(cublasSetAtomicsMode(S->blas, CUBLAS_ATOMICS_NOT_ALLOWED));
    DS4_CUBLAS_CHECK(cublasSetPointerMode(S->blas, CUBLAS_POINTER_MODE_HOST));
    DS4_CUBLAS_CHECK(cublasSetStream(S->blas, S->stream));
    /* cuBLAS's recommended workspace (32 MiB on Hopper and later, 4 MiB before),
     * given up front so that no call allocates one */
    const size_t ws = g_cuda.cc_major >= 9 ? ((size_t)32 << 20) : ((size_t)4 << 20);
    if (dev_malloc(&S->blas_ws, ws) != cudaSuccess) {
        fprintf(stderr, "ds4: cannot allocate the context's cuBLAS workspace (%zu bytes)\n", ws);
        (void)cudaGetLastError();
        S->blas_ws = NULL;
        session_release(S);
        return NULL;
    }
    DS4_CUBLAS_CHECK(cublasSetWorkspace(S->blas, S->blas_ws, ws));
    /* the counters hc_pre and k_moe_gate leave at zero */
    ok = ok && dev_malloc((void **)&S->hc_count, HC_SPLIT_MAX_NT * sizeof(unsigned)) == cudaSuccess;
    ok = ok && dev_malloc((void **)&S->gate_count, HC_SPLIT_MAX_NT * sizeof(unsigned)) == cudaSuccess;
    if (!ok) {
        fprintf(stderr, "ds4: cannot allocate the context's block counters\n");
        (void)cudaGetLastError();
        session_release(S);
        return NULL;
    }
    DS4_CUDA_CHECK(cudaMemsetAsync(S->hc_count, 0, HC_SPLIT_MAX_NT * sizeof(unsigned), ds4_current_stream()));
    DS4_CUDA_CHECK(cudaMemsetAsync(S->gate_count, 0, HC_SPLIT_MAX_NT * sizeof(unsigned), ds4_current_stream()));
    /* attention partials: attention_run asks nt*H*want*(d+2) floats, at most attention_part_floats */
    ok = ok && session_scratch(&S->att_part, "attention partials",
                               lim->head_dim > 0 ? attention_part_floats(lim->head_dim) * sizeof(float) : 0);
    /* indexer scores: cuda_indexer_topk asks ix_chunk rows of ix_ld */
    if (lim->idx_topk > 0) {
        S->ix_ld = (int64_t)lim->n_ctx / IX_MIN_RATIO + 1;
        S->ix_chunk = IX_SCORE_CAP / S->ix_ld;
        if (S->ix_chunk < 1) S->ix_chunk = 1;
        if (S->ix_chunk > B) S->ix_chunk = B;
        ok = ok && session_scratch(&S->ix_scores, "indexer scores",
                                   (size_t)(S->ix_chunk * S->ix_ld) * sizeof(float));
    }
    /* MoE: moe_decode asks [pairs][F] and [pairs][D] (pairs = nt*k), the prefill path
     * also the gathered inputs [pairs][D], gate|up [pairs][2F] and the tables */
    if (k > 0 && D > 0 && F > 0) {
        const int64_t pairs = B * k;
        ok = ok && session_scratch(&S->moe_h, "MoE activations", (size_t)(pairs * F) * sizeof(float));
        ok = ok && session_scratch(&S->moe_tmp, "MoE expert outputs", (size_t)(pairs * D) * sizeof(float));
        if (B > MOE_DECODE_MAX_NT) {
            ok = ok && session_scratch(&S->moe_xg, "MoE gathered inputs", (size_t)(pairs * D) * sizeof(float));
            ok = ok && session_scratch(&S->moe_gu, "MoE gate|up products", (size_t)(pairs * 2 * F) * sizeof(float));
            ok = ok && session_scratch(&S->moe_idx, "MoE pair tables", (size_t)(2 * pairs) * sizeof(int32_t));
            S->host_idx_cap = (size_t)(3 * pairs + E + 1);
            ok = ok && session_pinned((void **)&S->host_idx, "MoE host tables", S->host_idx_cap * sizeof(int32_t));
        }
    }
    /* dequantised rows for cuBLAS (gemm_rows: tiles of at most DEQ_CAP_FLOATS, whole rows) */
    if (B > MV_MAX_NT) {
        int64_t deq = lim->max_matrix < DEQ_CAP_FLOATS ? lim->max_matrix : DEQ_CAP_FLOATS;
        if (deq < lim->max_k) deq = lim->max_k;
        ok = ok && session_scratch(&S->deq, "dequantised weight rows", (size_t)deq * sizeof(float));
    }
    /* staging: the step block and tokens up, small results down */
    S->up_cap = 64 * 1024 + (size_t)B * sizeof(int32_t);
    ok = ok && session_pinned((void **)&S->up_stage, "upload staging", S->up_cap);
    S->down_cap = DOWN_STAGE_MAX;
    ok = ok && session_pinned((void **)&S->down_stage, "download staging", S->down_cap);
    if (!ok) {
        session_release(S);
        return NULL;
    }
    g_n_dev_sync++;
    DS4_CUDA_CHECK(cudaDeviceSynchronize());   /* NOTE(load time): weights and fills are in place */
    return S;
}

static void cuda_session_free(void *s) {
    session_release((ds4_session *)s);
}

/* The session's stream becomes the thread's current stream while it is bound. */
static void *cuda_session_bind(void *s) {
    ds4_session *prev = g_sess;
    if (prev) ds4_stream_pop();
    g_sess = (ds4_session *)s;
    if (g_sess && ds4_stream_push(g_sess->stream) != 0) {
        fprintf(stderr, "ds4: session_bind: the thread's stream overrides are %d deep already\n", DS4_STREAM_DEPTH);
        exit(1);
    }
    return prev;
}

static void cuda_session_stats(void *s, ds4_backend_stats *st, int reset) {
    ds4_session *S = (ds4_session *)s;
    memset(st, 0, sizeof *st);
    st->launches = S->launches;
    st->launch_seconds = S->launch_seconds;
    st->mallocs = g_n_malloc;
    st->frees = g_n_free;
    st->device_syncs = g_n_dev_sync;
    st->stream_syncs = g_n_stream_sync;
    st->captures = S->gs.captures;
    st->replays = S->gs.replays;
    st->fallbacks = S->gs.fallbacks;
    st->graphs = S->gs.graphs;
    st->graph_nodes = S->gs.graph_nodes;
    st->graph_bytes = S->gs.graph_bytes;
    st->capture_ms = S->gs.capture_ms;
    st->instantiate_ms = S->gs.instantiate_ms;
    st->graph_pdl = S->pdl;
    if (reset) {
        S->gs.captures = S->gs.replays = S->gs.fallbacks = 0;
        S->gs.capture_ms = S->gs.instantiate_ms = 0.0;
        S->launches = 0;
        S->launch_seconds = 0.0;
        g_n_malloc = 0;
        g_n_free = 0;
        g_n_dev_sync = 0;
        g_n_stream_sync = 0;
    }
}

/* ---------------------------------------------------------------------------
 * Hooks: the emitter of ds4_hooks.h's records (stage 3 of patches/series)
 * ------------------------------------------------------------------------- */

#include "ds4_hooks.cu"

/* ---------------------------------------------------------------------------
 * The backend table
 * ------------------------------------------------------------------------- */

/* Device memory free now (cudaMemGetInfo): ds4_ctx_new's plan is checked against it. */
static size_t cuda_mem_available(void) {
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) { (void)cudaGetLastError(); return (size_t)-1; }
    return free_b;
}

/* What upload_weight and the ops take: the matrix types, and I32 (tid2eid, read by moe_route). */
static int cuda_supports_type(int type) { return type_supported(type) || type == DS4_TYPE_I32; }

static ds4_backend make_cuda_backend(void) {
    ds4_backend b;
    memset(&b, 0, sizeof b);
    b.name = "cuda";
    b.init = cuda_init;
    b.alloc = cuda_alloc;
    b.free = cuda_free;
    b.upload = cuda_upload;
    b.download = cuda_download;
    b.copy = cuda_copy;
    b.upload_weight = cuda_upload_weight;
    b.release_weight = cuda_release_weight;
    b.synchronize = cuda_synchronize;
    b.supports_type = cuda_supports_type;
    b.mem_available = cuda_mem_available;
    b.session_new = cuda_session_new;
    b.session_free = cuda_session_free;
    b.session_bind = cuda_session_bind;
    b.session_stats = cuda_session_stats;
    b.region_begin = cuda_region_begin;
    b.region_end = cuda_region_end;
    b.session_reset = cuda_session_reset;
    b.embed = cuda_embed;
    b.rmsnorm = cuda_rmsnorm;
    b.matmul = cuda_matmul;
    b.matmul_grouped = cuda_matmul_grouped;
    b.hc_mix = cuda_hc_mix;
    b.hc_post = cuda_hc_post;
    b.rope = cuda_rope;
    b.attention = cuda_attention;
    b.attention_probs = cuda_attention_probs;
    b.ring_store = cuda_ring_store;
    b.add_cyclic = cuda_add_cyclic;
    b.compress_pool = cuda_compress_pool;
    b.indexer_topk = cuda_indexer_topk;
    b.moe_route = cuda_moe_route;
    b.moe_gate = cuda_moe_gate;
    b.moe_experts = cuda_moe_experts;
    b.swiglu = cuda_swiglu;
    b.add = cuda_add;
    b.scale = cuda_scale;
    b.hc_pre = cuda_hc_pre;
    b.matmul_multi = cuda_matmul_multi;
    b.head_norm_rope = cuda_head_norm_rope;
    b.matmul_swiglu = cuda_matmul_swiglu;
    b.attention_step = cuda_attention_step;
    b.compressor_step = cuda_compressor_step;
    b.compressor_steps = cuda_compressor_steps;
    b.indexer_step = cuda_indexer_step;
    b.hooks_open = cuda_hooks_open;
    b.hook_put = cuda_hook_put;
    b.hooks_publish = cuda_hooks_publish;
    b.hooks_join = cuda_hooks_join;
    b.hooks_stats = cuda_hooks_stats;
    return b;
}

static const ds4_backend g_cuda_backend = make_cuda_backend();

extern "C" const ds4_backend *ds4_backend_cuda(void) { return &g_cuda_backend; }
