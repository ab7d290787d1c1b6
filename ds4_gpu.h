/* ds4_gpu.h -- the contract between the ds4 core (ds4.c) and a compute backend.
 *
 * The core owns the model, the forward-pass orchestration (which op runs when,
 * on which buffers, with which positions) and the host-side bookkeeping (how
 * many compressed rows exist, which positions a batch covers).  A backend owns
 * memory and arithmetic: it allocates buffers, uploads weights, and runs the
 * ops below.  The CPU backend in ds4.c is the specification: every op here is
 * defined by its CPU implementation, and the CUDA backend (ds4_cuda.cu) must
 * compute the same function (bit-identity is not required across backends;
 * the tolerance is stated in the tests).
 *
 * Pointers passed to ops are backend pointers (host memory for the CPU
 * backend, device memory for CUDA) obtained from ->alloc() or from a weight's
 * ->dev field.  The core never dereferences them.
 *
 * Conventions, written down once:
 *  - Activations are f32, token-major: x[t][...] for t < nt.
 *  - A weight W with ggml shape {K, N} (ne0 = K, contiguous) holds N rows of K
 *    elements; "matmul" computes y[t][n] = sum_k W[n][k] * x[t][k].  A 3-D
 *    weight {K, N, E} holds E such matrices (experts).
 *  - Small tensors (norms, biases, sinks, mHC parameters, ape tables) are F32.
 *  - Return convention: lifetime calls that can fail (init, alloc,
 *    upload_weight) return 0 / non-NULL on success and -1 / NULL after
 *    printing one line to stderr.  Ops return nothing: a backend error inside
 *    an op is unrecoverable, so the backend's error macro prints the failing
 *    statement with file and line and exits the process.
 *  - Ops that take "in place allowed" may be called with y == x.
 *  - No op reads host state that the core changes between calls other than
 *    through its arguments.  The position is not an argument: it is read at
 *    run time from the step block (ds4_step, below), a backend buffer the
 *    core writes before each forward call, so that the same sequence of
 *    launches -- same kernels, grids and argument bytes -- serves every
 *    decode step and can be captured once and replayed (patches/series,
 *    stages 1 and 2).  Counts (nt, heads, widths) are arguments: they are the
 *    shape of a step, not its position.
 *  - A backend may keep per-context state (a stream, scratch sized up front,
 *    counters): a session.  Ops run in the session the calling thread has
 *    bound; the CPU backend has none to speak of.  Nothing an op does
 *    allocates or frees memory or waits for the device, except download and
 *    synchronize, which wait for the bound session's work.
 */
#ifndef DS4_GPU_H
#define DS4_GPU_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct ds4h_record;            /* ds4_hooks.h */

#ifdef __cplusplus
extern "C" {
#endif

/* Tensor element types, numbered as in GGUF/ggml. */
enum {
    DS4_TYPE_F32  = 0,
    DS4_TYPE_F16  = 1,
    DS4_TYPE_Q8_0 = 8,   /* blocks of 32: f16 scale d, int8 q[32]; value = d*q */
    DS4_TYPE_Q2_K = 10,  /* super-blocks of 256 (84 bytes): the real Flash files' expert down */
    DS4_TYPE_Q4_K = 12,  /* super-blocks of 256 (144 bytes): the Q4_K Flash file's experts */
    DS4_TYPE_IQ2_XXS = 16, /* super-blocks of 256 (66 bytes): expert gate and up */
    DS4_TYPE_I32  = 26,
    DS4_TYPE_BF16 = 30,
};
#define DS4_QK8_0 32
#define DS4_Q8_0_BLOCK_BYTES 34
#define DS4_QK_K 256                 /* elements of a k-quant / i-quant super-block */
#define DS4_Q2_K_BLOCK_BYTES 84
#define DS4_Q4_K_BLOCK_BYTES 144
#define DS4_IQ2_XXS_BLOCK_BYTES 66
#define DS4_MULTI_MAX 8    /* projections one matmul_multi call takes */

/* One weight tensor.  host points into the mapped model (always valid while
 * the model is open); dev is the backend's copy (== host on the CPU backend). */
typedef struct ds4_weight {
    const char *name;
    int         type;          /* DS4_TYPE_* */
    int         n_dims;
    int64_t     ne[3];         /* ggml order, ne[0] contiguous; unused dims = 1 */
    size_t      nbytes;
    const void *host;
    void       *dev;
} ds4_weight;

/* Bytes of one row of ne0 elements of the given type (ne0 % 32 == 0 for Q8_0,
 * % 256 for the super-block types). */
static inline size_t ds4_row_bytes(int type, int64_t ne0) {
    switch (type) {
    case DS4_TYPE_F32: case DS4_TYPE_I32: return (size_t)ne0 * 4;
    case DS4_TYPE_F16: case DS4_TYPE_BF16: return (size_t)ne0 * 2;
    case DS4_TYPE_Q8_0: return (size_t)(ne0 / DS4_QK8_0) * DS4_Q8_0_BLOCK_BYTES;
    case DS4_TYPE_Q2_K: return (size_t)(ne0 / DS4_QK_K) * DS4_Q2_K_BLOCK_BYTES;
    case DS4_TYPE_Q4_K: return (size_t)(ne0 / DS4_QK_K) * DS4_Q4_K_BLOCK_BYTES;
    case DS4_TYPE_IQ2_XXS: return (size_t)(ne0 / DS4_QK_K) * DS4_IQ2_XXS_BLOCK_BYTES;
    default: return 0;
    }
}

/* Exact f16/bf16 <-> f32 conversions (round-to-nearest-even), from ds4.c. */
float    ds4_f16_to_f32(uint16_t h);
uint16_t ds4_f32_to_f16(float f);
float    ds4_bf16_to_f32(uint16_t h);
uint16_t ds4_f32_to_bf16(float f);

/* RoPE parameters for one use site (GPT-J style: adjacent pairs).
 * The rotated part is the LAST n_rot dims of each head of width dh.  For pair
 * i (0 <= i < n_rot/2) at position p, as ggml computes it:
 *   theta_scale = powf(freq_base, -2.0f/n_rot)
 *   te = p * theta_scale^i, accumulated in float: t = (float)p; t *= theta_scale per pair
 *   ti = freq_scale * te
 *   if ext_factor != 0:  r = (1 - clamp((i - corr_lo)/max(0.001f, corr_hi - corr_lo), 0, 1)) * ext_factor
 *                        theta = ti*(1-r) + te*r
 *   else                 theta = ti
 *   (x0, x1) -> (x0*cos - x1*sin, x0*sin + x1*cos); inverse rotation negates sin.
 * YaRN's magnitude scaling is cancelled in DeepSeek V4, so no mscale. */
typedef struct ds4_rope {
    int   n_rot;
    float freq_base;
    float freq_scale;   /* 1/scaling factor with YaRN, 1 otherwise */
    float ext_factor;   /* 1 with YaRN, 0 otherwise */
    float corr_lo;      /* YaRN ramp, precomputed by the core */
    float corr_hi;
} ds4_rope;

/* Marks the position helpers below as callable from device code too. */
#ifdef __CUDACC__
#define DS4_HD __host__ __device__
#else
#define DS4_HD
#endif

/* The step block: what changes from one forward call to the next.  The core
 * fills it ({position of the batch's first token, tokens in the batch}) and
 * uploads it to the context's block before the call; an op is given the
 * block's backend pointer and reads pos0 there when it runs.  Everything
 * derived from the position -- window ring slots and fill, compressed rows
 * visible, the blocks a compressor emits and their destination rows, the
 * indexer's visible rows, how attention splits its rows -- is computed from
 * pos0 at run time with the helpers below (one definition for both
 * backends; a few integer operations each). */
typedef struct ds4_step {
    int32_t pos0;   /* position of the first token of the batch */
    int32_t nt;     /* tokens in the batch (== the ops' nt argument) */
    int32_t call;   /* the context's forward-call index (hook records' step field) */
    int32_t reserved;
} ds4_step;

/* Window rows a query at position P attends (positions max(0, P-W+1) .. P). */
static inline DS4_HD int ds4_win_rows(int P, int W) { return W < P + 1 ? W : P + 1; }
/* Compressed rows of ratio r that exist once position P is in: blocks [w*r, w*r + r) with w*r + r - 1 <= P. */
static inline DS4_HD int ds4_comp_rows(int P, int r) { return r > 0 ? (P + 1) / r : 0; }
/* Rows a query at P attends: its window, then every compressed row (ratio 128) or its k picks (ratio 4). */
static inline DS4_HD int ds4_att_rows(int P, int W, int ratio, int k) {
    return ds4_win_rows(P, W) + (ratio == 128 ? ds4_comp_rows(P, 128) : ratio == 4 ? k : 0);
}
/* The first block a batch at pos0 closes (w0: its row index, its first position w0*r)... */
static inline DS4_HD int ds4_emit_first(int pos0, int r) { return pos0 / r; }
/* ...and how many blocks it closes (0 on most decode steps). */
static inline DS4_HD int ds4_emit_count(int pos0, int nt, int r) { return (pos0 + nt) / r - pos0 / r; }

/* What a session is sized for (ds4_ctx_new fills it from the model and its
 * arguments).  An op asked for more than its session holds is a bug in the
 * caller; the backend says which limit and exits. */
typedef struct ds4_limits {
    int     max_batch;        /* tokens of one forward call (the ops' nt) */
    int     n_ctx;            /* positions */
    int     n_embd;           /* D */
    int     n_head, head_dim; /* attention */
    int     idx_topk;         /* ratio-4 picks per query */
    int     n_swa;            /* the sliding window's rows */
    int     n_expert, n_expert_used, n_ff_exp;   /* routed experts {D, F, E}, k used per token */
    int     n_vocab;
    int64_t max_k;            /* the longest weight row (K) of any matmul */
    int     max_rows;         /* the most activation rows of one matmul, when above max_batch: the
                               * MTP head's eh_proj takes a row per token and stream (0: max_batch) */
    int64_t max_matrix;       /* the most elements of one weight matrix (K x N) */
    /* recorded regions (region_begin/region_end): 0 = never record */
    int     graphs;           /* DS4_CUDA_GRAPHS */
    int     graph_cache;      /* the most recordings kept (DS4_CUDA_GRAPH_CACHE) */
    int     graph_fail;       /* debug: the Nth recording fails (DS4_CUDA_GRAPH_FAIL; 0 = none) */
    int     graph_pdl;        /* recorded kernels launch as programmatic dependents (DS4_CUDA_GRAPH_PDL;
                               * the backend uses it only where the device supports it) */
    int     eager_pdl;        /* kernels launched outside a recording are programmatic dependents too
                               * (DS4_CUDA_EAGER_PDL; where the device supports it) */
    int     prefill_tc;       /* batches of the types it takes on tensor cores, not through cuBLAS
                               * (DS4_CUDA_PREFILL_TC; CUDA): 4, with wgmma where the build and the
                               * card have it (sm_90), else 1's, the activations' and the Q8_0
                               * weights' stage copies by the tensor memory accelerator; 3, the
                               * activations' alone; 2, 3's with cp.async copies;
                               * 1, mma.sync; 0, never */
    int     prefill_attn;     /* attention of a batch that fills the device in row tiles shared by a
                               * block's heads (DS4_CUDA_PREFILL_ATTN; CUDA): 2, on tensor cores where d
                               * and the card allow, else 1's; 1, in f32; 0, never */
    int     prefill_planes;   /* f16 parts of an activation in the tensor-core products and in
                               * k_attention_mma (DS4_CUDA_PREFILL_PLANES; CUDA): 2 (hi + mid: each
                               * element kept to 2^-22 of itself) or 3 (hi + mid + lo); 0 reads as 3 */
    int     prefill_attn_all; /* tests: the tile kernels take every batch they can, not only those
                               * that fill the device */
    int     decode_group;     /* DS4_CUDA_DECODE_GROUP (CUDA): 1, a call of up to 4 tokens (a speculative
                               * check) takes its dense products in one launch; 0, chunks of 4, 2, 1 */
    int     shared_stream;    /* DS4_CUDA_SHARED_STREAM (CUDA): 1, a decode step's shared expert runs
                               * beside the routed experts (shared_begin), and its compressors and
                               * indexer beside the queries (side_begin); 0, in order */
} ds4_limits;

/* What a session has done: kernel launches and cuBLAS calls (and the host
 * time inside them), and the device allocations, frees and waits the backend
 * made process-wide since the counters were last reset. */
typedef struct ds4_backend_stats {
    uint64_t launches;
    double   launch_seconds;
    uint64_t mallocs, frees;          /* cudaMalloc/cudaHostAlloc, cudaFree/cudaFreeHost */
    uint64_t device_syncs;            /* cudaDeviceSynchronize */
    uint64_t stream_syncs;            /* cudaStreamSynchronize */
    /* recorded regions (CUDA graphs), since the session was made or reset */
    uint64_t captures, replays;       /* recordings made; regions replayed from one */
    uint64_t fallbacks;               /* regions run eagerly because their recording failed */
    uint64_t graphs, graph_nodes;     /* recordings held now, and their nodes */
    uint64_t graph_bytes;             /* device memory the held recordings took (instantiation) */
    double   capture_ms, instantiate_ms;   /* summed over the captures */
    uint64_t graph_pdl;               /* 1: recorded kernels launch as programmatic dependents
                                       * (DS4_CUDA_GRAPH_PDL on a device that has it) */
    /* which engine a switch sent the prefill products to, in launches (tests check the path
     * they ask for ran) */
    uint64_t tc_wgmma;                /* k_tc_wgmma (sm_90a on a CC 9.0 card) */
    uint64_t tc_tma;                  /* of those, with tensor-copy stages (DS4_CUDA_PREFILL_TC=3, 4) */
    uint64_t tc_tma_a;                /* of those, with the Q8_0 weights' too (4) */
    uint64_t tc_pl2;                  /* product launches (k_tc_wgmma and k_tc_gemm) on two planes
                                       * (DS4_CUDA_PREFILL_PLANES=2) */
    uint64_t att_mma;                 /* k_attention_mma launches (DS4_CUDA_PREFILL_ATTN=2) */
    uint64_t att_mma_pl2;             /* of those, on two planes */
} ds4_backend_stats;

/* A device hook emitter (ds4_hooks.h; CUDA: ds4_hooks.cu), opened on a session.  Records go
 * to f, after the header the core wrote. */
typedef struct ds4h_emitter_cfg {
    FILE       *f;
    const char *path;           /* for messages */
    int         drop;           /* DS4_HOOKS_POLICY=drop: never wait, count and mark what is dropped */
    uint64_t    ring_bytes;     /* the payload ring (a multiple of 8) */
    uint64_t    ring_slots;     /* the control ring, in 64-byte descriptors */
    uint32_t    throttle_us;    /* debug: the drain pauses this long after each batch (DS4_HOOKS_THROTTLE_US) */
} ds4h_emitter_cfg;

/* One record to produce (hook_put).  Its payload is d0 x d1 x d2 four-byte elements,
 * element (i0, i1, i2) read from src[i0 * s0 + i1 * s1 + i2] (strides in elements).  Its
 * position is step->pos0 + pos_add and its step field step->call, both read on the device
 * when the producer runs.  dyn: d1 is the row count an attention query at that position saw
 * plus the sink, ds4_att_rows(pos, W, ratio, k) + 1 (attn_probs). */
typedef struct ds4h_put {
    int             hook, layer, dtype, ndim;
    uint32_t        d0, d1, d2;
    const void     *src;
    int64_t         s0, s1;
    int             pos_add;
    int             dyn, W, ratio, k;
    const ds4_step *step;
} ds4h_put;
#define DS4H_PUT_MAX 4

/* What an emitter has done since it was opened. */
typedef struct ds4_hooks_stats {
    uint64_t produced;          /* records the producers made (each took a sequence number) */
    uint64_t written;           /* records written to the file */
    uint64_t rejected;          /* records of a speculative check that kept no row (not written,
                                   no sequence number; not in produced) */
    uint64_t dropped;           /* records dropped (DS4_HOOKS_POLICY=drop) */
    uint64_t gaps;              /* gap records written (each stands for one or more dropped) */
    uint64_t waits;             /* producers that waited for ring space (wait policy) */
    uint64_t payload_bytes;     /* payload bytes written */
    uint64_t batches;           /* drain batches (published spans taken) */
    double   copy_seconds;      /* the drain's device-to-host copies (payload), waited for */
    uint64_t drain_syncs;       /* the drain thread's waits for its copies (the process's; CPU: 0) */
    int      err;               /* errno of a failed write (0: none) */
} ds4_hooks_stats;

/* region_begin's and region_end's answers (the recorded regions, ds4_backend). */
enum { DS4_REGION_ISSUE = 0, DS4_REGION_REPLAYED = 1, DS4_REGION_REISSUE = 2 };

/* One compressor's buffers and shape, for compressor_steps (the arguments of
 * compressor_step but the step, nt, eps and rope, which a layer's compressors share). */
typedef struct ds4_compressor {
    const float *kv, *sc;     /* [nt][c*dc] this batch's rows (ape added) */
    float       *st_kv, *st_sc;
    int          ratio, c, dc;
    const float *norm_w;
    float       *rows;
} ds4_compressor;

typedef struct ds4_backend {
    const char *name;

    /* ---- lifetime ---- */
    int   (*init)(void);
    void *(*alloc)(size_t bytes);                          /* zero-filled */
    void  (*free)(void *p);
    /* host -> backend, ordered with the ops; src may change as soon as it returns */
    void  (*upload)(void *dst, const void *src, size_t bytes);
    /* backend -> host after every op issued before it; complete on return (it waits) */
    void  (*download)(void *dst, const void *src, size_t bytes);
    void  (*copy)(void *dst, const void *src, size_t bytes);      /* backend -> backend, ordered */
    int   (*upload_weight)(ds4_weight *w);                 /* sets w->dev */
    void  (*release_weight)(ds4_weight *w);
    void  (*synchronize)(void);                            /* wait for every op issued */
    int   (*supports_type)(int type);                      /* 1: upload_weight and the ops take DS4_TYPE_type */
    size_t (*mem_available)(void);                         /* bytes free for weights and contexts (after init) */

    /* ---- sessions ----
     * session_new sizes and allocates everything the ops will need for these
     * limits (NULL after one line when it cannot); session_bind makes s the
     * calling thread's session and returns the one it replaces (NULL: none).
     * Ops, copies and synchronize run in the bound session.  session_stats
     * reads (and with reset, zeroes) the counters. */
    void *(*session_new)(const ds4_limits *lim);
    void  (*session_free)(void *s);
    void *(*session_bind)(void *s);
    void  (*session_stats)(void *s, ds4_backend_stats *st, int reset);

    /* ---- recorded regions (stage 2 of patches/series: CUDA graphs) ----
     * A region is a run of ops that the core issues the same way -- the same
     * ops, buffers and shapes; the position comes from the step block --
     * every time it enters the region under the same key.  The core brackets it:
     *   r = region_begin(key)
     *   if (r != DS4_REGION_REPLAYED) {
     *       issue the region's ops
     *       if (region_end(key) == DS4_REGION_REISSUE) issue the region's ops again
     *   }
     * DS4_REGION_REPLAYED: the backend ran its recording of the region (issue
     * nothing).  DS4_REGION_ISSUE: issue the ops; the backend may be recording
     * them instead of running them, and region_end then runs the recording.
     * DS4_REGION_REISSUE: the recording failed; the backend dropped it (and
     * runs the key eagerly from then on) and the ops must be issued again.
     * Without a session, or with limits.graphs == 0, begin returns ISSUE and
     * end 0.  session_reset drops every recording (the context was reset). */
    int   (*region_begin)(uint64_t key);
    int   (*region_end)(uint64_t key);
    void  (*session_reset)(void *s);

    /* ---- hooks (stage 3; NULL in a backend that writes records itself: the CPU) ----
     * hooks_open starts the bound session's emitter: device rings, pinned staging and a
     * drain thread that writes published records to cfg->f; 0, or -1 with one line in err.
     * hook_put enqueues the producer of n records (1..DS4H_PUT_MAX, made at the same
     * point of the step), ordered after the work issued so far on the current stream
     * (captured into a recording like any op) but possibly running beside the work issued
     * after it; hooks_join orders the work issued after it on the current stream after every
     * producer enqueued so far: the core calls it before an op overwrites a tensor a record
     * was made from (but moe_experts, which joins itself before it writes out), and at the
     * end of every span of layers (a recorded region must end joined).  hooks_publish (which
     * joins first) makes everything produced so far visible to the drain.  hooks_stats: the
     * counters; flush != 0 first waits until every record produced so far is written (a
     * host wait: never inside a step).  session_free drains and closes the emitter, writes a
     * last gap record for drops at the end and says in one line how many records were
     * dropped.  hooks_sink (ds4 collect): the drain thread also hands each record it writes
     * (its descriptor as the file has it, and its payload) to fn, on the drain thread, in
     * sequence order; set between steps (it waits for what is in flight first), NULL to stop.
     * A caller reads what fn gathered after hooks_stats with flush.  hooks_hold and
     * hooks_commit (between calls; ds4_hooks.h ds4h_hold): the records produced after
     * hooks_hold and before hooks_commit(pos_end) are written cut to the rows at positions
     * below pos_end (ds4h_cut), and one that keeps none is not written nor numbered; the
     * drain keeps them back (host memory: the rings' space goes back as usual) until the
     * commit names pos_end. */
    int   (*hooks_open)(const ds4h_emitter_cfg *cfg, char *err, size_t errlen);
    void  (*hooks_sink)(void (*fn)(void *user, const struct ds4h_record *r, const void *payload), void *user);
    void  (*hook_put)(const ds4h_put *p, int n);
    void  (*hooks_publish)(void);
    void  (*hooks_join)(void);
    void  (*hooks_stats)(ds4_hooks_stats *st, int flush);
    void  (*hooks_hold)(void);
    void  (*hooks_commit)(int pos_end);

    /* ---- ops ---- */

    /* x[t][s][:] = row tokens[t] of tok_embd ({D, V}), for every stream s < n_hc. */
    void (*embed)(const ds4_weight *tok_embd, const int32_t *tokens, int nt, int n_hc, float *x);

    /* y[r][i] = x[r][i] / sqrt(mean_i(x[r][i]^2) + eps) * (w ? w[i] : 1).  In place allowed. */
    void (*rmsnorm)(const float *x, const float *w, float *y, int rows, int n, float eps);

    /* y[t][n] = sum_k W_e[n][k] x[t][k]; expert e selects the matrix of a 3-D weight (0 for 2-D). */
    void (*matmul)(const ds4_weight *w, int expert, const float *x, float *y, int nt);

    /* Block-diagonal projection: W is {K, G*R}; x is [nt][G*K]; y is [nt][G*R];
     * y[t][j] = sum_k W[j][k] * x[t][(j/R)*K + k]. */
    void (*matmul_grouped)(const ds4_weight *w, int groups, const float *x, float *y, int nt);

    /* mHC mixing.  mix is [nt][n_mix] (the fn projection of the rms-normed
     * flattened streams).  With h = n_hc:
     *   pre[s]  = sigmoid(mix[s]*scale[0] + base[s]) + hc_eps                 (s < h)
     *   y[t][:] = sum_s pre[s] * x[t][s][:]
     * Unless head != 0 (then n_mix == h and only the above is computed):
     *   post[t][s] = 2*sigmoid(mix[h+s]*scale[1] + base[h+s])
     *   C[a][b] = mix[2h + a + h*b]*scale[2] + base[2h + a + h*b]   (a = destination, b = source stream)
     *   C[:][b] = softmax over a of C[:][b], then C += hc_eps
     *   "col":  for each a: C[a][b] /= (sum_b C[a][b] + hc_eps)
     *   "row":  for each b: C[a][b] /= (sum_a C[a][b] + hc_eps)
     *   col once, then (iters-1) times: row, col
     *   comb[t][a + h*b] = C[a][b] */
    void (*hc_mix)(const float *mix, const float *scale, const float *base, const float *x,
                   int nt, int D, int n_hc, int head, float hc_eps, int sinkhorn_iters,
                   float *y, float *post, float *comb);

    /* x_out[t][a][:] = post[t][a]*f[t][:] + sum_b comb[t][a + h*b] * x_res[t][b][:]. */
    void (*hc_post)(const float *f, const float *x_res, const float *post, const float *comb,
                    int nt, int D, int n_hc, float *x_out);

    /* ---- fused ops: each is defined as the composition of the ops above,
     * in the order written (the CPU backend computes exactly that); a backend
     * may fuse them into fewer kernels.  Scratch arguments hold unspecified
     * contents afterwards. */

    /* mHC pre step of a sublayer, with the residual update of the sublayer before it
     * and the sublayer's input RMSNorm:
     *   if f != NULL:  hc_post(f, x_res, post, comb, nt, D, n_hc, x)      (x: [nt][n_hc][D])
     *   rmsnorm(x, NULL, flat, nt, n_hc*D, rms_eps)                        (flat: scratch [nt][n_hc*D])
     *   matmul(fn, 0, flat, mix, nt)                                        (mix: scratch [nt][n_mix])
     *   hc_mix(mix, scale, base, x, nt, D, n_hc, head, hc_eps, iters, y, post, comb)
     *   rmsnorm(y, norm_w, y, nt, D, rms_eps)
     * post and comb are read (the previous step's) before they are overwritten.
     * scale has 3 entries (1 in head mode), base n_mix = head ? n_hc : (2+n_hc)*n_hc. */
    void (*hc_pre)(const float *f, const float *x_res, float *x,
                   const ds4_weight *fn, const float *scale, const float *base, const float *norm_w,
                   int nt, int D, int n_hc, int head, float rms_eps, float hc_eps, int iters,
                   float *flat, float *mix, float *y, float *post, float *comb);

    /* Several projections of one input x [nt][K]: for i < n, all w[i] with ne[0] == K,
     *   matmul(w[i], 0, xn, y[i], nt);  if add_tab[i]: add_cyclic(y[i], add_tab[i], step, nt, period, w[i]->ne[1])
     * where xn = x, or, when norm_w != NULL, xn = rmsnorm(x, norm_w, eps) (x may be left
     * normalised in place or unchanged: read it again only through this op).  add_tab may be
     * NULL (no tables).  n <= DS4_MULTI_MAX. */
    void (*matmul_multi)(int n, const ds4_weight *const *w, float *const *y, float *x, int nt,
                         const float *norm_w, float eps, const float *const *add_tab, const ds4_step *step,
                         int period);

    /* Per-row RMSNorm then RoPE of nh heads of width dh per token (x [nt][nh][dh], in place),
     * and the same for a second tensor x2 [nt][nh2][dh] with its own weights w2 when nh2 > 0
     * (the queries and the key/value row of a layer in one call):
     *   rmsnorm(x, w, x, nt*nh, dh, eps); rope(x, nt, nh, dh, step, 1, rp, 0)
     *   if nh2 > 0: rmsnorm(x2, w2, x2, nt*nh2, dh, eps); rope(x2, nt, nh2, dh, step, 1, rp, 0) */
    void (*head_norm_rope)(float *x, const float *w, int nt, int nh, float *x2, const float *w2, int nh2,
                           int dh, float eps, const ds4_step *step, const ds4_rope *rp);

    /* Attention of a layer, then the window ring update and the de-rotation of the output:
     *   attention(q, kv, ring, W, step, nt, H, d, comp, ratio, topk, k, sinks, scale, out)
     *   ring_store(ring, kv, W, d, step, nt)
     *   rope(out, nt, H, d, step, 1, rp, 1) */
    void (*attention_step)(const float *q, const float *kv, float *ring, int W,
                           const ds4_step *step, int nt, int H, int d,
                           const float *comp, int ratio, const int32_t *topk, int k,
                           const float *sinks, float scale, const ds4_rope *rp, float *out);

    /* A compressor after its projections (kv, sc [nt][c*dc], ape added): with
     * w0 = ds4_emit_first(pos0, ratio) and n_emit = ds4_emit_count(pos0, nt, ratio),
     *   if n_emit > 0: out = rows + w0*dc;
     *                  compress_pool(kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, out)
     *                  rmsnorm(out, norm_w, out, n_emit, dc, eps)
     *                  rope out's rows i < n_emit at positions (w0 + i)*ratio (rope's formula, forward)
     *   ring_store(st_kv, kv, c*ratio, c*dc, step, nt); ring_store(st_sc, sc, c*ratio, c*dc, step, nt)
     * Whether a step emits is decided when the op runs: a backend issues the
     * same launches either way. */
    void (*compressor_step)(const float *kv, const float *sc, float *st_kv, float *st_sc,
                            const ds4_step *step, int nt, int ratio, int c, int dc, const float *norm_w, float eps,
                            const ds4_rope *rp, float *rows);

    /* Several independent compressors (no buffer shared) of one step, n <= DS4_MULTI_MAX:
     *   for i < n: compressor_step(cs[i].kv, cs[i].sc, cs[i].st_kv, cs[i].st_sc, step, nt,
     *                              cs[i].ratio, cs[i].c, cs[i].dc, cs[i].norm_w, eps, rp, cs[i].rows)
     * (a ratio-4 layer's kv compressor and its indexer's: one launch at decode). */
    void (*compressor_steps)(int n, const ds4_compressor *cs, const ds4_step *step, int nt, float eps,
                             const ds4_rope *rp);

    /* The indexer of a layer after its projections:
     *   rope(q, nt, Hi, di, step, 1, rp, 0)
     *   indexer_topk(q, w, w_scale, rows, step, nt, Hi, di, ratio, k, out)
     * q's contents are unspecified afterwards (a backend may rotate a copy). */
    void (*indexer_step)(float *q, const float *w, float w_scale, const float *rows, const ds4_step *step, int nt,
                         int Hi, int di, int ratio, int k, const ds4_rope *rp, int32_t *out);

    /* Shared-expert style gated projection: y = swiglu(matmul(gate, x), matmul(up, x), limit),
     * y [nt][F] with F = gate->ne[1]; g_scratch, u_scratch: [nt][F] scratch. */
    void (*matmul_swiglu)(const ds4_weight *gate, const ds4_weight *up, const float *x, float *y, int nt,
                          float limit, float *g_scratch, float *u_scratch);

    /* The MoE router and the routing of a layer in one call:
     *   matmul(gate_inp, 0, x, logits, nt)        (logits: [nt][E], left holding the logits)
     *   moe_route(logits, bias, tid2eid, tokens, nt, E, k, norm, wscale, sel, wts) */
    void (*moe_gate)(const ds4_weight *gate_inp, const float *x, float *logits, const float *bias,
                     const ds4_weight *tid2eid, const int32_t *tokens, int nt, int E, int k, int norm,
                     float wscale, int32_t *sel, float *wts);

    /* Rotate the last rp->n_rot dims of x[t][h][0:dh] (nh heads) in place, at
     * position step->pos0 + t*pos_step; inverse != 0 rotates by -theta. */
    void (*rope)(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                 int inverse);

    /* Attention with sinks for nt queries at positions P = pos0 + t (pos0 = step->pos0).
     *   q       [nt][H][d]
     *   kv      [nt][d]      this batch's key/value rows (one shared head, key == value)
     *   ring    [W][d]       window ring: the row of position p < pos0 sits at slot p % W
     *   comp    [*][d]       compressed rows (NULL when ratio == 0)
     *   topk    [nt][k]      for ratio 4: compressed-row ids to attend, -1 = none
     * Rows attended by query t (ds4_att_rows of them): window positions p in [max(0, P-W+1), P] (row =
     * p >= pos0 ? kv[p-pos0] : ring[p % W]), in increasing p; then for ratio 128
     * the compressed rows w < (P+1)/128 in increasing w; for ratio 4 the rows
     * topk[t][j] != -1 in j order.  s_i = scale * q.row_i; the head's sink
     * logit joins the softmax denominator only:
     *   out[t][h] = sum_i exp(s_i - m) row_i / (sum_i exp(s_i - m) + exp(sink[h] - m)),
     *   m = max(max_i s_i, sink[h]). */
    void (*attention)(const float *q, const float *kv, const float *ring, int W,
                      const ds4_step *step, int nt, int H, int d,
                      const float *comp, int ratio, const int32_t *topk, int k,
                      const float *sinks, float scale, float *out);

    /* The weights the attention op gives each row, for the attn_probs hook (optional: NULL
     * in a backend without it).  For query t at P = pos0 + t and head h, probs[t][h][0:ld]
     * holds, in order: the window rows (ds4_win_rows(P, W) of them, increasing position), then
     * for ratio 128 the compressed rows w < ds4_comp_rows(P, 128), for ratio 4 the k pick
     * slots of topk[t] (0 where the pick is -1), then the sink's share exp(sink - m) /
     * denominator: ds4_att_rows(P, W, ratio, k) + 1 columns, summing to 1.  Each row's value
     * is the weight attention multiplies that row by. */
    void (*attention_probs)(const float *q, const float *kv, const float *ring, int W,
                            const ds4_step *step, int nt, int H, int d,
                            const float *comp, int ratio, const int32_t *topk, int k,
                            const float *sinks, float scale, float *probs, int ld);

    /* Ring update after a batch (pos0 = step->pos0): for each t with pos0+t >= pos0+nt-slots:
     * ring[(pos0+t) % slots][:] = rows[t][:] (width floats per row). */
    void (*ring_store)(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt);

    /* x[t][:] += table[(pos0+t) % period][:], rows of width n (ape positional bias; pos0 = step->pos0). */
    void (*add_cyclic)(float *x, const float *table, const ds4_step *step, int nt, int period, int n);

    /* Compressor pooling (pos0 = step->pos0).  kv, sc: [nt][c*dc] this batch's compressor rows
     * (scores with ape already added); st_kv, st_sc: state rings of c*ratio
     * slots, the row of position p < pos0 at slot p % (c*ratio).  For every
     * block w with pos0 <= w*ratio + ratio - 1 < pos0 + nt, in increasing w,
     * writes one pooled row out[i][0:dc] (i counts emitted blocks from 0), with
     * s = w*ratio and row(p) = p >= pos0 ? batch[p-pos0] : state[p % (c*ratio)]:
     *   c == 1: entries j < ratio: (kv, score) = row(s+j)[ch]
     *   c == 2: entries j < ratio: row(s-ratio+j)[ch] (kv 0, score -inf if s-ratio+j < 0),
     *           then entries j < ratio: row(s+j)[dc + ch]
     *   out[ch] = sum_e softmax_e(score_e) * kv_e   (per channel, over the entries). */
    void (*compress_pool)(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                          const ds4_step *step, int nt, int ratio, int c, int dc, float *out);

    /* Lightning indexer.  q [nt][Hi][di] (rope applied), w [nt][Hi] raw head
     * weights, used as w' = w*w_scale (one float product, as scale() computes
     * it; the forward pass passes 1/sqrt(di*Hi)), rows [*][di] indexer
     * compressed rows.  For query t at P = pos0+t, n_vis = ds4_comp_rows(P, ratio) rows are
     * visible; score(r) = sum_h w'[t][h] * max(0, q[t][h].rows[r]).  out[t][0:k]
     * = the min(k, n_vis) visible rows of highest score (ties: lower r first),
     * in descending score order, then -1 padding. */
    void (*indexer_topk)(const float *q, const float *w, float w_scale, const float *rows,
                         const ds4_step *step, int nt, int Hi, int di, int ratio, int k, int32_t *out);

    /* MoE routing.  probs = sqrt(softplus(logits)) with softplus(x) = x > 20 ? x : logf(1+expf(x)).
     * Scored layers (tid2eid == NULL): sel = top-k of probs + bias (ties: lower expert first,
     * in descending order).  Hash layers: sel[t][j] = tid2eid row tokens[t] (I32 {k, V}).
     * wts[t][j] = probs[t][sel[t][j]]; if norm: wts /= max(sum_j wts, 6.103515625e-5);
     * then, when wscale != 0, wts *= wscale (as llama.cpp: a zero scale means "unscaled"). */
    void (*moe_route)(const float *logits, const float *bias, const ds4_weight *tid2eid,
                      const int32_t *tokens, int nt, int E, int k, int norm, float wscale,
                      int32_t *sel, float *wts);

    /* The MoE's shared expert beside the routing and the routed experts.  shared_begin(nt)
     * returns 1 when the backend takes it: the ops issued from then until shared_end see
     * every op issued before shared_begin and may run concurrently with the ops issued after
     * shared_end, up to moe_experts, which reads their output (its add) only after they end.
     * Nothing else may read or write their buffers in between.  0 (or a NULL op): the caller
     * issues them in order as usual.  CUDA takes a decode call (nt <= 8) on a second stream
     * unless DS4_CUDA_SHARED_STREAM=0; a capture records the fork and the join as edges. */
    int  (*shared_begin)(int nt);
    void (*shared_end)(void);

    /* The attention's compressors and indexer beside its query projection and norms.
     * side_begin(nt) returns 1 when the backend takes it: the ops issued from then until
     * side_end see every op issued before side_begin (and the ops of an earlier side_begin ..
     * side_end span) and may run concurrently with the ops issued after side_end, up to
     * side_join, after which every op waits for them.  Nothing else may read or write their
     * buffers in between.  0 (or a NULL op): the caller issues them in order as usual.  CUDA
     * takes a decode call (nt <= 8) on a stream of its own unless DS4_CUDA_SHARED_STREAM=0; a
     * capture records the forks and the join as edges. */
    int  (*side_begin)(int nt);
    void (*side_end)(void);
    void (*side_join)(void);

    /* Routed experts: out[t][:] = sum_j wts[t][j] * down_e(swiglu(gate_e x[t], up_e x[t], clamp)),
     * e = sel[t][j], summed from 0 in slot order; then, when add != NULL, out += add
     * (add [nt][D], e.g. the shared expert).  gate/up {D, F, E}, down {F, D, E}.
     * A backend with hooks_join writes out only in its last op, after joining the hook
     * producers (hooks_join): out is the attention's output, the attn record's source, and
     * the producers of that record run beside the whole MoE. */
    void (*moe_experts)(const float *x, const int32_t *sel, const float *wts,
                        const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                        int nt, int k, float clamp, const float *add, float *out);

    /* y = silu(g') * u' with g' = min(g, L), u' = clamp(u, -L, L) when L > 1e-6,
     * plain silu(g)*u otherwise; n elements.  In place (y == g) allowed. */
    void (*swiglu)(const float *g, const float *u, float *y, int64_t n, float limit);

    /* y = a + b, n elements.  In place allowed. */
    void (*add)(const float *a, const float *b, float *y, int64_t n);

    /* x *= s, n elements. */
    void (*scale)(float *x, float s, int64_t n);

    /* y[r] = a[r / rep] then b[r] (rows of 2 n) for r < rows: a row of a beside each of rep rows
     * of b in turn (the MTP head's eh_proj input: enorm(e) beside each stream's hnorm(h)).  y
     * must not overlap a or b. */
    void (*pair_rows)(const float *a, const float *b, float *y, int rows, int rep, int64_t n);
} ds4_backend;

/* The CPU backend (ds4.c): the specification. */
const ds4_backend *ds4_backend_cpu(void);
/* Threads used by the CPU backend (default: online cores). */
void ds4_cpu_set_threads(int n);

#ifdef DS4_CUDA
/* The CUDA backend (ds4_cuda.cu). */
const ds4_backend *ds4_backend_cuda(void);
#endif

#ifdef __cplusplus
}
#endif
#endif /* DS4_GPU_H */
