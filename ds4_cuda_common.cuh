/* ds4_cuda_common.cuh -- what every translation unit of the CUDA backend shares.
 *
 * The backend is one entry point (ds4_cuda.cu: the device, sessions, recorded regions, the
 * backend table) and one file per op family (ds4_cuda_norm.cu, ds4_cuda_mhc.cu,
 * ds4_cuda_matmul.cu, ds4_cuda_attn.cu, ds4_cuda_compressor.cu, ds4_cuda_indexer.cu,
 * ds4_cuda_moe.cu) plus the hook emitter (ds4_hooks.cu).  Each includes this header and
 * nothing of the others: the launch path (DS4_LAUNCH, the one `<<<>>>`), the device helpers
 * every kernel uses, the device and session state, and the few launchers one family calls in
 * another, declared at the end with the file that defines them.  ds4_cuda.cu's essay
 * describes the backend as a whole.
 */
#ifndef DS4_CUDA_COMMON_CUH
#define DS4_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cublas_v2.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <atomic>

#include "ds4_gpu.h"
#include "ds4_hooks.h"
#include "ds4_msg.h"
#include "ds4_stream.h"
#include "ds4_cuda_quant.cuh"   /* the super-block types' element decoders (weight_elem) */

/* ---------------------------------------------------------------------------
 * Device and session state
 *
 * One device (0), settled once by cuda_init (ds4_cuda.cu).  Everything per context is a
 * session (ds4_gpu.h; made by session_new in ds4_cuda.cu, which sizes every scratch by the
 * constants below): its stream, cuBLAS handle, scratch buffers, pinned staging, counters and
 * recorded regions.  g_sess is the session bound to the calling thread.
 * ------------------------------------------------------------------------- */

/* Above this many tokens (a prompt) the split-K partials would re-read fn
 * once per token from L2 (512 tokens: ~0.8 GB per call, and prefill 512 fell
 * from 975 to 865 tok/s on an H200), so hc_pre (ds4_cuda_mhc.cu) runs the CPU op's composition
 * instead, its projection through cuBLAS. */
#define HC_SPLIT_MAX_NT 8

/* Sizes the session plans scratch by (and the ops ask within). */
#define MOE_DECODE_MAX_NT  8    /* MoE: no host copy of the routing up to here (ds4_cuda_moe.cu) */
#define IX_SCORE_CAP ((int64_t)64 << 20)    /* floats of score scratch */
#define IX_MIN_RATIO 4                      /* score rows hold n_ctx/4 + 1 entries */

typedef struct {
    void       *p;
    size_t      cap;
    const char *what;     /* named in the error when an op asks for more */
} scratch_t;

struct ds4_cuda_device {
    int            ready;
    int            n_sm;
    int            max_grid_yz;   /* the device's grid limit in y and z (65535 on every GPU so far) */
    int            cc_major;
    size_t         smem_optin;        /* max dynamic shared memory per block */
    int            att_bps[17];       /* resident k_attention<DM> blocks per SM, by DM (cuda_init) */
};
extern ds4_cuda_device g_cuda;   /* ds4_cuda.cu: settled by cuda_init */

/* A stream beside the compute stream, for work nothing after it reads until a join (the
 * MoE's shared expert, ds4_cuda_moe.cu; the hook emitter's producers, ds4_hooks.cu).
 * ds4_side_fork makes it wait for the work issued so far on the current stream and makes it
 * the current stream (ds4_stream_push), so the ops issued next go there; ds4_side_unfork
 * records where they end and pops back; ds4_side_join makes the current stream wait for that
 * end (a no-op when nothing was forked since the last join).  Under a capture the two events
 * become edges of the graph, not nodes.  An event call that fails fails a capture
 * (launch_check); outside one it is fatal, with one line naming `who`.  ds4_side_open: 0, or
 * the CUDA error with nothing left to free. */
struct ds4_side {
    cudaStream_t s;                   /* NULL: not open */
    cudaEvent_t  fork, join;
    bool         pending;             /* unforked since the last join */
    const char  *who;
};
cudaError_t ds4_side_open(ds4_side *d, const char *who);
void ds4_side_close(ds4_side *d);     /* after the join: its work ended before the stream's */
void ds4_side_fork(ds4_side *d);
void ds4_side_unfork(ds4_side *d);
void ds4_side_join(ds4_side *d);

struct ds4_session {
    cudaStream_t   stream;
    ds4_side       shx;               /* the shared expert's stream (shared_begin); s NULL: DS4_CUDA_SHARED_STREAM=0 */
    ds4_side       axs;               /* the attention's compressors and indexer (side_begin); likewise */
    cublasHandle_t blas;
    void          *blas_ws;           /* cuBLAS workspace (cublasSetWorkspace): no allocation inside a call */
    ds4_limits     lim;
    scratch_t      deq;               /* dequantized weight rows for cuBLAS, f32 */
    scratch_t      tc_x;              /* prefill on tensor cores: split activations (ds4_cuda_gemm.cu) */
    scratch_t      moe_h, moe_tmp;    /* MoE: swiglu activations, per-(token,expert) outputs */
    scratch_t      moe_xg, moe_gu;    /* MoE prefill: gathered inputs, gate|up products */
    scratch_t      moe_idx;           /* MoE prefill: perm and pos tables, int32 */
    scratch_t      att_part;          /* attention split-row partials */
    scratch_t      att_split;         /* k_attention_mma: a prefill call's rows in f16 parts */
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
    uint64_t       n_tc_wgmma, n_tc_tma, n_tc_tma_a;   /* k_tc_wgmma launches; of those with tensor-copy
                                                        stages; of those with the weights' too */
    uint64_t       n_tc_pl2, n_att_mma, n_att_mma_pl2;   /* product launches on two planes; k_attention_mma
                                                          launches, and of those on two planes */
    double         launch_seconds;    /* host time inside them */
    FILE          *trace;             /* DS4_LAUNCH_TRACE */
    uint64_t       trace_launches;
    /* recorded regions (CUDA graphs, region_begin/end; ds4_cuda.cu's Sessions banner) */
    struct region *reg;               /* [graph_cache] */
    int            n_reg;
    uint64_t       reg_clock;         /* use counter for the least recently used eviction */
    bool           capturing;         /* between a capture's begin and end */
    bool           pdl;               /* DS4_CUDA_GRAPH_PDL on a device that has it (cc >= 9.0) */
    bool           eager_pdl;         /* DS4_CUDA_EAGER_PDL on such a device */
    uint64_t       cap_key, cap_launches0;
    int64_t        cap_other;         /* a recording's nodes that are not one a launch: its copies, and
                                         the nodes of a cuBLAS call beyond the one it counts */
    cudaError_t    cap_err;           /* the first launch error while capturing */
    struct ds4h_emitter *hk;          /* DS4_HOOKS: the hook emitter (ds4_hooks.cu), NULL = hooks off */
    double         cap_t0;
    int            n_captures_tried;  /* for DS4_CUDA_GRAPH_FAIL */
    ds4_backend_stats gs;             /* the graph counters (captures ... instantiate_ms) */
};

extern thread_local ds4_session *g_sess;

/* A launch's error: fatal, except while a region is being recorded, where it fails the
 * recording (region_end then has the region issued again, eagerly, and an error that is the
 * kernel's own shows there). */
static inline void launch_check(cudaError_t e, const char *file, int line) {
    if (e == cudaSuccess) return;
    if (g_sess && g_sess->capturing) {
        if (g_sess->cap_err == cudaSuccess) g_sess->cap_err = e;
        return;
    }
    ds4_fatal("CUDA error %s (%s) in a kernel launch at %s:%d", cudaGetErrorName(e),
              cudaGetErrorString(e), file, line);
}

static inline ds4_session *sess(void) {
    if (!g_sess) {
        ds4_fatal("a CUDA op was called with no session bound (ds4_gpu.h: session_new, session_bind)");
    }
    return g_sess;
}

static inline cublasHandle_t sess_blas(void) { return sess()->blas; }

static inline void sess_count_launch(double seconds) {
    ds4_session *S = sess();
    S->launches++;
    S->launch_seconds += seconds;
}

static inline bool sess_tracing(void) { return g_sess && g_sess->trace; }

/* kernels launch as programmatic dependents (ds4_grid_dep): recorded ones with DS4_CUDA_GRAPH_PDL,
 * the others with DS4_CUDA_EAGER_PDL */
static inline bool sess_pdl(void) { return g_sess && (g_sess->capturing ? g_sess->pdl : g_sess->eager_pdl); }

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
        const cudaError_t e_ = (stmt);                                              \
        if (e_ != cudaSuccess) ds4_fatal("CUDA error %s (%s) in `%s` at %s:%d",     \
            cudaGetErrorName(e_), cudaGetErrorString(e_), #stmt, __FILE__, __LINE__); \
    } while (0)

#define DS4_CUBLAS_CHECK(stmt) do {                                                 \
        const cublasStatus_t s_ = (stmt);                                           \
        if (s_ != CUBLAS_STATUS_SUCCESS) ds4_fatal("cuBLAS error %s (%s) in `%s` at %s:%d", \
            cublasGetStatusName(s_), cublasGetStatusString(s_), #stmt, __FILE__, __LINE__); \
    } while (0)

/* Device memory and waits, process-wide (ds4_backend_stats): every
 * cudaMalloc/cudaHostAlloc, free and synchronisation of the backend goes
 * through the wrappers below, which count it. */
extern std::atomic<uint64_t> g_n_malloc, g_n_free, g_n_dev_sync, g_n_stream_sync;
/* the hook drain thread's waits on its own stream (ds4_hooks.cu): counted apart, so the decode
 * step's counters stay the compute stream's, and reported as ds4_hooks_stats.drain_syncs */
extern std::atomic<uint64_t> g_n_hook_sync;

static inline double ds4_now(void) {
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

/* The one place a kernel is launched: on the current stream.  The parameter packs are
 * separate so an argument converts to its parameter type as in a direct launch.  While a
 * region is recorded with DS4_CUDA_GRAPH_PDL, and outside recordings with DS4_CUDA_EAGER_PDL
 * (sess_pdl), the kernel is launched as a programmatic dependent of the one before it: see
 * ds4_grid_dep. */
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

/* What-if builds (make cuda NVCCFLAGS="... -DDS4_WHATIF"; scripts/gpu-decode.sh whatif): the
 * environment variable WHATIF_SKIP, a comma-separated list of kernel names (k_hc_pre,
 * k_attention_combine, ...) and matvec modes (mv_dense, mv_gateup, mv_down: k_matvec and
 * k_matvec_q), drops those launches (and hcp_sinkhorn, hcp_finish, hcp_fence parts of k_hc_pre:
 * see launch_hc_pre_t), so that a decode step's time without them shows what
 * they cost on its critical path.  The outputs are then wrong: for timing only.  Normal
 * builds have none of it. */
#ifdef DS4_WHATIF
static inline bool ds4_whatif_skip(const char *launch) {
    static const char *list = NULL;
    static bool read = false;
    if (!read) { list = getenv("WHATIF_SKIP"); read = true; }
    if (!list || !*list) return false;
    while (*launch == '(' || *launch == ' ') launch++;
    size_t n = 0;                             /* the kernel's name: its leading identifier */
    while (launch[n] == '_' || (launch[n] >= 'a' && launch[n] <= 'z') || (launch[n] >= 'A' && launch[n] <= 'Z') ||
           (launch[n] >= '0' && launch[n] <= '9'))
        n++;
    for (const char *p = list;;) {
        const char *q = strchr(p, ',');
        const size_t m = q ? (size_t)(q - p) : strlen(p);
        if (m == n && !strncmp(p, launch, n)) return true;
        if (!q) return false;
        p = q + 1;
    }
}
#define DS4_WHATIF_SKIP(name) if (ds4_whatif_skip(name)) break
#else
#define DS4_WHATIF_SKIP(name) (void)0
#endif

/* Variadic: a kernel template's name (k<a, b>) contains top-level commas. */
#define DS4_LAUNCH(...) do {                                                        \
        DS4_WHATIF_SKIP(#__VA_ARGS__);                                              \
        const double t0_ = ds4_now();                                               \
        const cudaError_t e_ = ds4_launch_kernel(__LINE__, __VA_ARGS__);            \
        const cudaError_t l_ = cudaGetLastError();                                  \
        launch_check(e_ != cudaSuccess ? e_ : l_, __FILE__, __LINE__);              \
        sess_count_launch(ds4_now() - t0_);                                         \
    } while (0)

/* The nodes of the graph the calling thread's stream is recording into (0: none). */
static inline size_t capture_nodes(void) {
    if (!g_sess || !g_sess->capturing) return 0;
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaGraph_t g = NULL;
    size_t n = 0;
#if CUDART_VERSION >= 12000     /* the graph is the 4th argument in 12.x's and 13.x's signatures */
    const cudaError_t e = cudaStreamGetCaptureInfo(ds4_current_stream(), &st, NULL, &g);
#else
    const cudaError_t e = cudaStreamGetCaptureInfo_v2(ds4_current_stream(), &st, NULL, &g);
#endif
    if (e != cudaSuccess || st != cudaStreamCaptureStatusActive || !g || cudaGraphGetNodes(g, NULL, &n) != cudaSuccess)
        return 0;
    return n;
}

/* A cuBLAS call counts as one launch; recorded, the nodes it added are counted too (cuBLAS may
 * add a reduction or a memset), so that region_end's node check holds. */
#define DS4_CUBLAS(...) do {                                                        \
        const double t0_ = ds4_now();                                               \
        const size_t n0_ = capture_nodes();                                         \
        DS4_CUBLAS_CHECK(cublasSetStream(sess_blas(), ds4_current_stream()));       \
        DS4_CUBLAS_CHECK(__VA_ARGS__);                                              \
        sess_count_launch(ds4_now() - t0_);                                         \
        if (g_sess && g_sess->capturing) g_sess->cap_other += (int64_t)capture_nodes() - (int64_t)n0_ - 1; \
    } while (0)

/* ---------------------------------------------------------------------------
 * Device helpers
 *
 * Number formats as the file stores them, warp reductions, and the 16-byte
 * asynchronous global->shared copy the matvec kernels stage Q8_0 rows with.
 * ------------------------------------------------------------------------- */

#define FULL_MASK 0xffffffffu

/* Programmatic dependent launch (DS4_CUDA_GRAPH_PDL in recorded regions, stage 2;
 * DS4_CUDA_EAGER_PDL outside them: a prompt's chunks, eager steps).  Each kernel is launched
 * as a programmatic dependent of the kernel before it on its stream (ds4_launch_kernel), so
 * its blocks may be scheduled before that kernel has finished, which shortens the gap
 * between two dependent kernels (bench/launch_floor measures it; bench/RESULTS.md has the
 * numbers, in graphs and out of them).
 * A kernel after anything else (a copy, an event wait, a cuBLAS call, whose kernels never
 * trigger early) starts as an ordinary launch would.  So every kernel starts with
 * ds4_grid_dep(), before it reads or writes anything:
 * griddepcontrol.wait returns once the grids it depends on have completed and their
 * memory is visible (at once for a kernel launched the ordinary way), and only then does
 * launch_dependents let the next kernel be scheduled -- so at most one kernel waits
 * ahead of the one running, and the order of memory effects is the plain stream's.
 * Compute capability 9.0 and up (the session uses PDL only there); below, it is empty.
 * scripts/check_streams.py checks that every kernel starts with it, or with a reviewed
 * prologue marked NOTE(pdl prologue) that reads only the host's weights before its wait (the
 * dense k_matvec's first row copies, k_hc_pre's fn loads, k_moe_gate's L2 prefetch of its
 * router rows): those overlap the kernel before. */
__device__ __forceinline__ void ds4_grid_dep(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* f16: dsq_f16 (ds4_cuda_quant.cuh), host and device. */
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

/* Element k of a row of the given type (any k; Q8_0 rows are 2-byte aligned). */
__device__ __forceinline__ float weight_elem(int type, const uint8_t *row, int64_t k) {
    switch (type) {
    case DS4_TYPE_F32:  return ((const float *)row)[k];
    case DS4_TYPE_F16:  return dsq_f16(((const uint16_t *)row)[k]);
    case DS4_TYPE_BF16: return bf16_bits_to_f32(((const uint16_t *)row)[k]);
    case DS4_TYPE_Q8_0: {
        const uint8_t *blk = row + (k / DS4_QK8_0) * DS4_Q8_0_BLOCK_BYTES;
        const float d = dsq_f16(*(const uint16_t *)blk);
        return d * (float)(int8_t)blk[2 + k % DS4_QK8_0];
    }
    case DS4_TYPE_Q2_K: case DS4_TYPE_Q4_K: case DS4_TYPE_IQ2_XXS: return dsq_elem(type, row, k);
    default: return 0.0f;
    }
}

/* Butterfly sum and maximum over a warp (float or double): every lane ends with the same
 * value (a+b == b+a exactly), in the same order on every lane and every run. */
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float silu_mul(float g, float u, float limit) {
    if (limit > 1e-6f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

/* The exact parts of the tensor-core paths (k_tc_split in ds4_cuda_gemm.cu, the attention's
 * rows in ds4_cuda_attn.cu): a row whose largest |element| is m is scaled by 2^a, a the
 * exponent that puts m in [2^14, 2^15) (0 for a zero or non-finite row, whose NaN and Inf
 * then reach the sums as they are), and each scaled element v splits into three f16 parts
 * hi + mid + lo (v - hi and its remainder are f32-exact). */
__device__ __forceinline__ int tc_part_exp(float m) {
    int a = 0;
    if (m > 0.0f && isfinite(m)) {
        int e;
        frexpf(m, &e);
        a = 15 - e;
        a = a < -126 ? -126 : a > 126 ? 126 : a;
    }
    return a;
}

__device__ __forceinline__ void tc_split3(float v, __half &hi, __half &mid, __half &lo) {
    hi = __float2half_rn(v);
    const float r = v - __half2float(hi);
    mid = __float2half_rn(r);
    lo = __float2half_rn(r - __half2float(mid));
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem) : "memory");
}
/* The same, 4 bytes (through L1: .cg takes only 16). */
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

/* d += A B on the tensor cores: mma.m16n8k16 with f16 operands and f32 accumulation (PTX ISA,
 * "matrix fragments for mma.m16n8k16"; sm_80+).  a0..a3: A's four f16x2 registers, b: B's two. */
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint2 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
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

/* 32 values per lane in, one whole sum out: lane j gets the sum over the warp of every lane's
 * s[j] (31 shuffles, where 32 butterflies take 160).  Each halving step keeps the half its
 * lane bit selects and adds the partner's copy of it; the order is fixed. */
template <int W>
__device__ __forceinline__ void warp_xstep(float (&s)[32], int lane) {
    const bool up = (lane & W) != 0;
#pragma unroll
    for (int i = 0; i < W; i++) {
        const float send = up ? s[i] : s[i + W];
        const float keep = up ? s[i + W] : s[i];
        s[i] = keep + __shfl_xor_sync(FULL_MASK, send, W);
    }
}

__device__ __forceinline__ float warp_xsum32(float (&s)[32], int lane) {
    warp_xstep<16>(s, lane);
    warp_xstep<8>(s, lane);
    warp_xstep<4>(s, lane);
    warp_xstep<2>(s, lane);
    warp_xstep<1>(s, lane);
    return s[0];
}

/* Ask for the 128-byte line at p to be brought into L2 (no register, no wait): what a
 * programmatic dependent's prologue does with weights it will read after its grid wait. */
__device__ __forceinline__ void prefetch_l2(const void *p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

/* Grid size for a grid-stride loop over n items with 256-thread blocks. */
static inline unsigned grid_for(int64_t n) {
    int64_t b = (n + 255) / 256;
    const int64_t cap = (int64_t)(g_cuda.n_sm > 0 ? g_cuda.n_sm : 132) * 32;
    if (b > cap) b = cap;
    if (b < 1) b = 1;
    return (unsigned)b;
}

/* ---------------------------------------------------------------------------
 * Rows a step emits, and RoPE's rotation
 *
 * Shared by the norm, RoPE, compressor, attention and indexer kernels.
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

/* A row in shared memory normed, then its last n_rot elements rotated to position p: the
 * block's THREADS threads each bring ss, their partial sum of squares (double, as the CPU op);
 * a fixed-shape reduction through red[THREADS / 32]; every element times 1/sqrt(mean + eps)
 * (and w[i] unless w is NULL); then one thread per rotated pair.  Ends with the row complete. */
template <int THREADS>
__device__ __forceinline__ void block_norm_rope(float *row, int n, const float *w, float eps, double ss,
                                                double *red, const rope_args &r, int p) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    double tot = 0.0;
    for (int i = 0; i < THREADS / 32; i++) tot += red[i];
    const float scale = 1.0f / sqrtf((float)(tot / (double)n) + eps);
    for (int i = threadIdx.x; i < n; i += THREADS) row[i] = w ? row[i] * scale * w[i] : row[i] * scale;
    __syncthreads();
    for (int i = threadIdx.x; i < r.n_rot / 2; i += THREADS) rope_pair(row + (n - r.n_rot) + 2 * i, r, p, i, 0);
    __syncthreads();
}

static inline rope_args rope_args_of(const ds4_rope *rp) {
    rope_args r;
    r.n_rot = rp->n_rot;
    r.theta_scale = powf(rp->freq_base, -2.0f / (float)rp->n_rot);
    r.freq_scale = rp->freq_scale;
    r.ext_factor = rp->ext_factor;
    r.corr_lo = rp->corr_lo;
    r.corr_hi = rp->corr_hi;
    return r;
}

/* ---------------------------------------------------------------------------
 * Matrix-vector problems
 *
 * The arguments of the decode matvec kernels (ds4_cuda_matmul.cu),
 * which the MoE decode path (ds4_cuda_moe.cu) also fills.
 * ------------------------------------------------------------------------- */

#define MV_MAX_NT      8       /* up to this many tokens the matvec beats dequant + GEMM */
#define MV_THREADS     256
#define MV_WARPS       8
#define MV_SLICE       1024    /* elements of a row one warp owns */
#define MV_Q8_SLICE    1088    /* bytes of a Q8_0 slice: 32 blocks x 34 */
#ifndef MV_RPG_MAX
#define MV_RPG_MAX     32      /* rows per warp per block: enough that a ratio-4 layer's queries'
                                  call (q_b and the indexer's: 40,960 rows of 1,024, 20 a warp)
                                  fits one wave of two blocks an SM */
#endif
#define MV_PART        (MV_WARPS * MV_RPG_MAX)  /* partials per output plane */
#define DEQ_CAP_FLOATS ((int64_t)64 << 20)      /* 256 MiB of dequantized rows at most */

enum { MV_DENSE = 0, MV_GATE_UP = 1, MV_DOWN = 2 };

/* A what-if build's check for a matvec launcher (k_matvec, k_matvec_q): its mode's name in
 * WHATIF_SKIP (mv_dense, mv_gateup, mv_down) drops the launch (see DS4_LAUNCH). */
#ifdef DS4_WHATIF
#define DS4_WHATIF_SKIP_MV(mode) \
    if (ds4_whatif_skip((mode) == MV_DENSE ? "mv_dense" : (mode) == MV_GATE_UP ? "mv_gateup" : "mv_down")) return
#else
#define DS4_WHATIF_SKIP_MV(mode) (void)0
#endif

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

/* A matvec block's problem (blockIdx.y) and token (blockIdx.z): its NMAT matrices (the expert
 * sel names in the MoE modes; gate and up in gate|up mode), input and output; for
 * matmul_multi the segment that owns blockIdx.x (bx: the block within it), its rows, matrix,
 * output and table, whose position is read now so its latency hides behind the main loop. */
template <int MODE, int NMAT>
__device__ __forceinline__ void mv_problem(const mv_args &a, int prob, int tok, const uint8_t *(&W)[NMAT],
                                           const float *&x, float *&y, int &rows, int &bx, int64_t &y_tok,
                                           const float *&tab, int &tab_pos0) {
    const size_t mat = (MODE == MV_DENSE || !a.sel) ? (size_t)prob
                                                    : (size_t)a.sel[(int64_t)tok * a.k + prob];
    W[0] = a.w + mat * a.mat_bytes;
    if (NMAT == 2) W[NMAT - 1] = a.w2 + mat * a.mat_bytes;
    x = a.x + (int64_t)tok * a.x_tok + (int64_t)prob * a.x_prob;
    y = a.y + (int64_t)tok * a.y_tok + (int64_t)prob * a.y_prob;
    rows = a.rows;
    bx = blockIdx.x;
    y_tok = a.y_tok;
    tab = NULL;
    tab_pos0 = 0;
    if (MODE == MV_DENSE && a.n_seg > 0) {
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
}

/* A matvec block's outputs, after its warps left their partials in part[plane][local row * S +
 * slice]: the n_rows rows from row0 (those below rows), each row's S partials summed in slice
 * order, then written as swiglu(gate, up) in gate|up mode, or per token u with the table row
 * of position tab_pos0 + tok0 + u added (matmul_multi). */
template <bool DUAL, int NT, int NPLANE, int PART>
__device__ __forceinline__ void mv_write_rows(const float (&part)[NPLANE][PART], int n_rows, int row0, int rows, int S,
                                              const mv_args &a, float *y, int64_t y_tok, const float *tab,
                                              int tab_pos0) {
    constexpr int NOUT = DUAL ? 1 : NT;
    for (int idx = threadIdx.x; idx < n_rows * NOUT; idx += MV_THREADS) {
        const int lr = idx % n_rows, u = idx / n_rows;
        const int row = row0 + lr;
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

/* ---------------------------------------------------------------------------
 * Between files
 *
 * Defined in ds4_cuda.cu unless said otherwise.
 * ------------------------------------------------------------------------- */

/* counted allocations, frees and waits; the scratch size check; the launch trace */
void *scratch_get(scratch_t *s, size_t bytes);
cudaError_t dev_malloc(void **p, size_t bytes);
void dev_free(void *p);
cudaError_t host_alloc(void **p, size_t bytes);
void host_free(void *p);
void stream_wait(void);
void *cuda_session_bind(void *s);
void sess_trace_launch(int line, const void *fn, dim3 grid, dim3 block, size_t smem, const unsigned char *args,
                       size_t n_args);

/* ds4_cuda_norm.cu */
void launch_rmsnorm_rows(const float *x, const float *w, float *y, int rows, int n, float eps, emit_rows er);
void launch_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps);
void cuda_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps);
void launch_rope_rows(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, emit_rows er,
                      const ds4_rope *rp, int inverse);
void launch_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                 int inverse);
void ds4_cuda_ops_norm(ds4_backend *b);
/* ds4_cuda_mhc.cu */
void ds4_cuda_ops_mhc(ds4_backend *b);
/* ds4_cuda_matmul.cu */
int type_supported(int type);
void check_matrix_type(int type, const char *what);
void matvec_run(int type, int mode, mv_args a, int n_prob, int n_tok_grid, int nt_dense);
void gemm_rows(const ds4_weight *w, size_t mat_off, int64_t row0, int64_t nrows, const float *x, int64_t ldx,
               float *y, int64_t ldy, int nt);
void cuda_matmul(const ds4_weight *w, int expert, const float *x, float *y, int nt);
void matmul_setup(void);
void ds4_cuda_ops_matmul(ds4_backend *b);
/* ds4_cuda_gemm.cu: prefill products on tensor cores */
#define TC_SEG_MAX 8   /* matrices of one launch */
#define TC_BN      64  /* tokens of a product tile (a grouped product's tile: up to this many rows of one expert) */
struct tc_split { void *xs; size_t part_bytes; int64_t K, n, ntp; int parts, planes; };   /* activations split for them
                                                                                     (planes: 3, or 2 written) */
struct tc_seg { const uint8_t *w; int64_t nrows; float *y; int64_t ldy; int part; };   /* one matrix of a launch */
bool gemm_tc_type(int type);
bool gemm_tc_ok(int type, const void *w, size_t row_bytes, int64_t K);
size_t gemm_tc_scratch_bytes(int64_t nt, int64_t K);
void gemm_tc_setup(void);
tc_split gemm_tc_split(const float *x, int64_t ldx, int64_t K, int64_t n, int parts);
/* A split's rows made as they are split: row t is x's row t (row stride ldx), or with rows its
 * row rows[t] / rdiv (rows on the device); with u each element is silu_mul(x, u, limit), u's
 * row at the same offset (the MoE's gather and swiglu, without their copies). */
struct tc_src { const float *x, *u; int64_t ldx; const int32_t *rows; int rdiv; float limit; };
tc_split gemm_tc_split_from(const tc_src &src, int64_t K, int64_t n);
int gemm_tc_parts_fit(int64_t n, int64_t K);
void gemm_tc_multi(int type, size_t mat_bytes, int nmat, size_t row_bytes, const tc_split &sp, int n,
                   const tc_seg *seg, const int4 *tiles, int n_tiles);
int gemm_tc_tiles(const int32_t *off, int E, int32_t *out);
int64_t gemm_tc_max_tiles(int64_t rows, int64_t E);
bool gemm_tc_rows(int type, const uint8_t *w, size_t row_bytes, int64_t K, int64_t nrows, const float *x,
                  int64_t ldx, float *y, int64_t ldy, int nt);
/* ds4_cuda_attn.cu */
void attention_setup(void);
size_t attention_part_floats(int d);
size_t attention_split_scratch(const ds4_limits *lim);
int64_t attention_probs_chunks(const ds4_limits *lim);
void launch_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt);
void ds4_cuda_ops_attn(ds4_backend *b);
/* ds4_cuda_compressor.cu */
void launch_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n);
void ds4_cuda_ops_compressor(ds4_backend *b);
/* ds4_cuda_indexer.cu */
void indexer_setup(void);
void ds4_cuda_ops_indexer(ds4_backend *b);
/* ds4_cuda_moe.cu */
void launch_swiglu(const float *g, const float *u, float *y, int64_t rows, int64_t cols, int64_t ld_in,
                   int64_t ld_out, float limit);
void ds4_cuda_ops_moe(ds4_backend *b);
/* ds4_hooks.cu: the emitter's close (session_free) and its entries in the backend table */
void ds4h_emitter_close(ds4_session *S);
int cuda_hooks_open(const ds4h_emitter_cfg *cfg, char *err, size_t errlen);
void cuda_hook_put(const ds4h_put *p, int n);
void cuda_hooks_publish(void);
void cuda_hooks_join(void);
void cuda_hooks_stats(ds4_hooks_stats *st, int flush);
void cuda_hooks_sink(void (*fn)(void *user, const ds4h_record *r, const void *payload), void *user);
void cuda_hooks_hold(void);
void cuda_hooks_commit(int pos_end);

#endif /* DS4_CUDA_COMMON_CUH */
