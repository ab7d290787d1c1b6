/* matvec_table.c -- the decode matvec shapes of flash16, timed on the CUDA backend.
 *
 * What it is.  One row per weight-streaming op of a flash16 decode step (one
 * token): the shape, the weight type a `--type q8_0` flash16 synth gives it
 * (Q8_0, except the mHC projections and the router, which synth keeps F32),
 * how many times one token calls it (43 layers: ratios 0, 0, then 4, 128, 4,
 * ... as ds4.c's synth_hparams sets them, so 2 uncompressed, 21 ratio-4 and 20
 * ratio-128 layers), the device time per call, the weight bandwidth that
 * time means (weight bytes read / time), and calls x time = microseconds per
 * token.  Section 1 times every weight on its own, through the plain op
 * (matmul; matmul_grouped for attn_output_a; moe_experts for the routed
 * experts): what the matvec kernels do per shape.  Section 2 times the fused
 * ops exactly as ds4.c's forward pass calls them (hc_pre, matmul_multi with
 * the compressor ape tables and the q_a norm, matmul_swiglu); section 2 plus
 * the rows of section 1 the forward pass calls directly (marked "fwd") is the
 * weight-streaming part of a decode step, summed at the end against what the
 * same bytes would take at the copy bandwidth.
 *
 * How it measures.  Only through the backend contract (ds4_gpu.h): weights go
 * up with upload_weight from valid host blocks (Q8_0: a finite f16 scale per
 * block, random int8 quants), so the table times whatever kernel the backend
 * picks for the shape.  Each row rotates among enough copies of its weights
 * that the bytes read between two uses of one copy exceed max(--pool-mb,
 * 3 x L2) (at least 2 copies): the weights come from DRAM, as in a real
 * decode, not from L2.  After a warm-up pass over every copy (one-time costs:
 * cudaFuncSetAttribute, scratch growth), each repetition records a CUDA event
 * on the backend's current stream (ds4_stream.h), issues --calls calls,
 * records another, and divides.
 * The reported time is the median over --reps repetitions.  Two timings per
 * row:
 *   us/call    the GPU's pace: the stream is held by a host function until all
 *              --calls calls are queued, so the kernels run back to back and
 *              host launch overhead is out of the number;
 *   issued     the same calls issued eagerly (no hold): when this is larger,
 *              the shape is bound by the host launching it, as the eager
 *              decode is.
 * If the hold ever times out (an op that waits on the host inside the call),
 * the row says so and the number is the issued pace.
 *
 * What it is not.  Not a correctness test (tests/test_backend_ops.c is), not
 * the whole decode step (attention, norms, RoPE, routing and the other small
 * kernels are left out: scripts/kernel_report.sh profiles a real step), and
 * not a kernel: it calls the backend and changes nothing in it.  The shapes are
 * flash16's, written out here from ds4.c's synth table; if that table
 * changes, change them here too.
 *
 * How to run it (GPU machine; CI only compiles and links it):
 *   make build/cuda-sm_90/matvec_table CUDA_ARCH=sm_90
 *   build/cuda-sm_90/matvec_table [--reps 7] [--calls 64] [--pool-mb 128]
 *                                 [--copy-bw GBps] [--only NAME] [--nt N] [--group G] [--copies C]
 * --copy-bw (from bench/bandwidth, read+write) adds a "% of copy BW" column;
 * --only runs the rows whose name contains NAME.  --nt N (1..4) calls the plain
 * ops of section 1 with N tokens, as a speculative check calls them (the routed
 * experts: token 0 on experts 1 4 6 9 12 15, the others on 6 of the 16 from a
 * fixed generator), with DS4_CUDA_DECODE_GROUP = G (--group 0 or 1, default 1);
 * the other rows are skipped, and GB/s stays one token's bytes per call (compare
 * us/call).  --copies C rotates among C copies whatever the pool: --copies 1 reads
 * the same weights every call, so a row whose weights fit in L2 streams them from
 * there (what a decode step would see if its weights were prefetched into L2 while
 * the small kernels before them run).  Output: markdown tables,
 * then one `RESULT bench=matvec_table ...` line per row and per total.  Without
 * a GPU it prints "skipped: no GPU" and exits 0.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "../ds4_gpu.h"
#include "../ds4_quant.h"
#include "../ds4_stream.h"
#include "bench_util.h"

#ifndef DS4_CUDA
#error "matvec_table measures the CUDA backend: build it with -DDS4_CUDA (make build/cuda-ARCH/matvec_table)"
#endif

/* ---- flash16, as ds4.c's synth_configs row and synth_hparams define it ---- */
enum {
    F_D = 4096, F_LAYERS = 43, F_HEADS = 64, F_HEAD_DIM = 512, F_Q_LORA = 1024, F_O_GROUPS = 8, F_O_LORA = 1024,
    F_IDX_HEADS = 64, F_IDX_DIM = 128, F_EXPERTS = 16, F_USED = 6, F_FF = 2048, F_SHARED = 1, F_VOCAB = 129280,
    F_HC = 4
};
static int f_ratio(int il) { return il < 2 ? 0 : (il % 2 == 0 ? 4 : 128); }

#define MB (1024.0 * 1024.0)
#define GATE_TIMEOUT_S 2.0

#define CK(stmt) do {                                                                          \
        cudaError_t e_ = (stmt);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "matvec_table: %s: %s (%s:%d)\n", #stmt, cudaGetErrorString(e_),   \
                    __FILE__, __LINE__);                                                       \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

/* ---- random host data ---- */
static uint64_t g_rng = 0x6d617476656374ull;
static uint64_t rnd_u64(void) {                 /* splitmix64 */
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static float rnd_f(void) { return (float)((rnd_u64() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }   /* [-1, 1) */

static float *rnd_vec(size_t n, float scale) {
    float *v = malloc(n * sizeof(float));
    if (!v) { fprintf(stderr, "matvec_table: out of host memory\n"); exit(1); }
    for (size_t i = 0; i < n; i++) v[i] = rnd_f() * scale;
    return v;
}

/* ---- the rows ---- */
enum { OP_MATMUL, OP_GROUPED, OP_EXPERTS, OP_HC_PRE, OP_MULTI, OP_SWIGLU };
static const char *op_name[] = { "matmul", "matmul_grouped", "moe_experts", "hc_pre", "matmul_multi", "matmul_swiglu" };

typedef struct { int type; int64_t K, N, E; } wspec;

typedef struct {
    const char *name;
    int section;                 /* 1: one weight, plain op; 2: a fused op as the forward pass calls it */
    int fwd;                     /* section 1: the forward pass calls exactly this op on this weight */
    int op;
    int nw;                      /* weights per copy */
    wspec w[DS4_MULTI_MAX];
    int tab[DS4_MULTI_MAX];      /* matmul_multi: this projection gets an ape table of `period` rows */
    int period, norm, groups, head;
    int calls;                   /* per decoded token */
    char calls_txt[40];
    /* measured */
    int done, ncopies, gate_timeouts;
    double read_bytes, us, us_issued;
} row_t;

static row_t g_rows[32];
static int g_nrows;

static row_t *add_row(const char *name, int section, int op, int calls, const char *calls_txt) {
    row_t *r = &g_rows[g_nrows++];
    memset(r, 0, sizeof *r);
    r->name = name;
    r->section = section;
    r->op = op;
    r->calls = calls;
    snprintf(r->calls_txt, sizeof r->calls_txt, "%s", calls_txt);
    r->period = 1;
    return r;
}
static void add_w(row_t *r, int type, int64_t K, int64_t N, int64_t E, int tab) {
    r->tab[r->nw] = tab;
    r->w[r->nw++] = (wspec){ type, K, N, E };
}

static void build_rows(void) {
    const int Q8 = DS4_TYPE_Q8_0, F32 = DS4_TYPE_F32;
    const int L = F_LAYERS, D = F_D, HC_K = F_HC * F_D, MIX = (2 + F_HC) * F_HC;
    int n0 = 0, n4 = 0, n128 = 0;
    for (int il = 0; il < L; il++) {
        const int r = f_ratio(il);
        n0 += r == 0; n4 += r == 4; n128 += r == 128;
    }
    static char t_2L[40], t_L[40], t_2n4[40], t_n4[40], t_2n128[40], t_n128[40], t_n0[40], t_n0n128[40];
    snprintf(t_2L, sizeof t_2L, "%d = 2x%d", 2 * L, L);
    snprintf(t_L, sizeof t_L, "%d", L);
    snprintf(t_2n4, sizeof t_2n4, "%d = 2x%d", 2 * n4, n4);
    snprintf(t_n4, sizeof t_n4, "%d", n4);
    snprintf(t_2n128, sizeof t_2n128, "%d = 2x%d", 2 * n128, n128);
    snprintf(t_n128, sizeof t_n128, "%d", n128);
    snprintf(t_n0, sizeof t_n0, "%d", n0);
    snprintf(t_n0n128, sizeof t_n0n128, "%d = %d+%d", n0 + n128, n0, n128);
    const int fs = F_FF * F_SHARED, cd4 = 2 * F_HEAD_DIM, cd128 = F_HEAD_DIM, icd = 2 * F_IDX_DIM;
    row_t *r;

    /* section 1: every decode weight through the plain op */
    r = add_row("hc_attn_fn + hc_ffn_fn", 1, OP_MATMUL, 2 * L, t_2L);     add_w(r, F32, HC_K, MIX, 1, 0);
    r = add_row("output_hc_fn", 1, OP_MATMUL, 1, "1");                     add_w(r, F32, HC_K, F_HC, 1, 0);
    r = add_row("attn_q_a", 1, OP_MATMUL, L, t_L);                        add_w(r, Q8, D, F_Q_LORA, 1, 0);
    r = add_row("attn_kv", 1, OP_MATMUL, L, t_L);                         add_w(r, Q8, D, F_HEAD_DIM, 1, 0);
    r = add_row("attn_q_b", 1, OP_MATMUL, L, t_L);                        add_w(r, Q8, F_Q_LORA, (int64_t)F_HEADS * F_HEAD_DIM, 1, 0);
    r = add_row("attn_output_a (8 groups)", 1, OP_GROUPED, L, t_L);       r->fwd = 1; r->groups = F_O_GROUPS;
    add_w(r, Q8, (int64_t)F_HEADS * F_HEAD_DIM / F_O_GROUPS, (int64_t)F_O_GROUPS * F_O_LORA, 1, 0);
    r = add_row("attn_output_b", 1, OP_MATMUL, L, t_L);                   r->fwd = 1;
    add_w(r, Q8, (int64_t)F_O_GROUPS * F_O_LORA, D, 1, 0);
    r = add_row("compressor kv, gate (ratio 4)", 1, OP_MATMUL, 2 * n4, t_2n4);       add_w(r, Q8, D, cd4, 1, 0);
    r = add_row("compressor kv, gate (ratio 128)", 1, OP_MATMUL, 2 * n128, t_2n128); add_w(r, Q8, D, cd128, 1, 0);
    r = add_row("indexer compressor kv, gate", 1, OP_MATMUL, 2 * n4, t_2n4);         add_w(r, Q8, D, icd, 1, 0);
    r = add_row("indexer attn_q_b", 1, OP_MATMUL, n4, t_n4);  add_w(r, Q8, F_Q_LORA, (int64_t)F_IDX_HEADS * F_IDX_DIM, 1, 0);
    r = add_row("indexer proj", 1, OP_MATMUL, n4, t_n4);      add_w(r, Q8, D, F_IDX_HEADS, 1, 0);
    r = add_row("ffn_gate_inp", 1, OP_MATMUL, L, t_L);        r->fwd = 1; add_w(r, F32, D, F_EXPERTS, 1, 0);
    r = add_row("shexp gate, up", 1, OP_MATMUL, 2 * L, t_2L); add_w(r, Q8, D, fs, 1, 0);
    r = add_row("shexp down", 1, OP_MATMUL, L, t_L);          r->fwd = 1; add_w(r, Q8, fs, D, 1, 0);
    r = add_row("output", 1, OP_MATMUL, 1, "1");              r->fwd = 1; add_w(r, Q8, D, F_VOCAB, 1, 0);
    r = add_row("routed experts (6 of 16)", 1, OP_EXPERTS, L, t_L); r->fwd = 1;
    add_w(r, Q8, D, F_FF, F_EXPERTS, 0); add_w(r, Q8, D, F_FF, F_EXPERTS, 0); add_w(r, Q8, F_FF, D, F_EXPERTS, 0);
    /* the published files' experts (not in flash16's step: fwd = 0): flash-q2, flash-q4 */
    r = add_row("routed experts iq2_xxs/q2_k (6 of 16)", 1, OP_EXPERTS, L, t_L);
    add_w(r, DS4_TYPE_IQ2_XXS, D, F_FF, F_EXPERTS, 0); add_w(r, DS4_TYPE_IQ2_XXS, D, F_FF, F_EXPERTS, 0);
    add_w(r, DS4_TYPE_Q2_K, F_FF, D, F_EXPERTS, 0);
    r = add_row("routed experts q4_k (6 of 16)", 1, OP_EXPERTS, L, t_L);
    add_w(r, DS4_TYPE_Q4_K, D, F_FF, F_EXPERTS, 0); add_w(r, DS4_TYPE_Q4_K, D, F_FF, F_EXPERTS, 0);
    add_w(r, DS4_TYPE_Q4_K, F_FF, D, F_EXPERTS, 0);

    /* section 2: the fused ops, as fwd_batch / fwd_attention / fwd_moe call them */
    r = add_row("hc_pre (attn, ffn sites)", 2, OP_HC_PRE, 2 * L, t_2L);   add_w(r, F32, HC_K, MIX, 1, 0);
    r = add_row("hc_pre (head)", 2, OP_HC_PRE, 1, "1");                   r->head = 1; add_w(r, F32, HC_K, F_HC, 1, 0);
    r = add_row("in-proj, ratio 0: q_a kv", 2, OP_MULTI, n0, t_n0);
    add_w(r, Q8, D, F_Q_LORA, 1, 0); add_w(r, Q8, D, F_HEAD_DIM, 1, 0);
    r = add_row("in-proj, ratio 4: q_a kv comp(2) idx(3)", 2, OP_MULTI, n4, t_n4); r->period = 4;
    add_w(r, Q8, D, F_Q_LORA, 1, 0); add_w(r, Q8, D, F_HEAD_DIM, 1, 0);
    add_w(r, Q8, D, cd4, 1, 0); add_w(r, Q8, D, cd4, 1, 1);
    add_w(r, Q8, D, icd, 1, 0); add_w(r, Q8, D, icd, 1, 1); add_w(r, Q8, D, F_IDX_HEADS, 1, 0);
    r = add_row("in-proj, ratio 128: q_a kv comp(2)", 2, OP_MULTI, n128, t_n128); r->period = 128;
    add_w(r, Q8, D, F_Q_LORA, 1, 0); add_w(r, Q8, D, F_HEAD_DIM, 1, 0);
    add_w(r, Q8, D, cd128, 1, 0); add_w(r, Q8, D, cd128, 1, 1);
    r = add_row("q_b (normed q_a), ratio 0/128", 2, OP_MULTI, n0 + n128, t_n0n128); r->norm = 1;
    add_w(r, Q8, F_Q_LORA, (int64_t)F_HEADS * F_HEAD_DIM, 1, 0);
    r = add_row("q_b + indexer q_b, ratio 4", 2, OP_MULTI, n4, t_n4); r->norm = 1;
    add_w(r, Q8, F_Q_LORA, (int64_t)F_HEADS * F_HEAD_DIM, 1, 0);
    add_w(r, Q8, F_Q_LORA, (int64_t)F_IDX_HEADS * F_IDX_DIM, 1, 0);
    r = add_row("shexp gate+up+swiglu", 2, OP_SWIGLU, L, t_L);
    add_w(r, Q8, D, fs, 1, 0); add_w(r, Q8, D, fs, 1, 0);
}

static const char *type_str(int t) {
    switch (t) {
    case DS4_TYPE_F32: return "f32";
    case DS4_TYPE_F16: return "f16";
    case DS4_TYPE_BF16: return "bf16";
    case DS4_TYPE_Q8_0: return "q8_0";
    case DS4_TYPE_Q2_K: return "q2_k";
    case DS4_TYPE_Q4_K: return "q4_k";
    case DS4_TYPE_IQ2_XXS: return "iq2_xxs";
    default: return "?";
    }
}

static size_t wbytes(const wspec *s) { return ds4_row_bytes(s->type, s->K) * (size_t)(s->N * s->E); }

/* Bytes one call reads from the weights (the routed experts: k of E matrices of each). */
static double read_bytes(const row_t *r) {
    double b = 0;
    for (int i = 0; i < r->nw; i++) b += (double)wbytes(&r->w[i]);
    if (r->op == OP_EXPERTS) b *= (double)F_USED / F_EXPERTS;
    return b;
}

static void shape_str(const row_t *r, char *buf, size_t n) {
    const wspec *w = &r->w[0];
    switch (r->op) {
    case OP_GROUPED:
        snprintf(buf, n, "%lldx%lld (%d x %lldx%lld)", (long long)w->K, (long long)w->N, r->groups,
                 (long long)w->K, (long long)(w->N / r->groups));
        break;
    case OP_EXPERTS:
        snprintf(buf, n, "3 x %lldx%lldx%lld, k=%d", (long long)w->K, (long long)w->N, (long long)w->E, F_USED);
        break;
    case OP_SWIGLU:
        snprintf(buf, n, "2 x %lldx%lld", (long long)w->K, (long long)w->N);
        break;
    case OP_MULTI: {
        int o = snprintf(buf, n, "%lldx{", (long long)w->K);
        for (int i = 0; i < r->nw && o < (int)n; i++)
            o += snprintf(buf + o, n - (size_t)o, "%s%lld%s", i ? "," : "", (long long)r->w[i].N, r->tab[i] ? "+ape" : "");
        if (o < (int)n) snprintf(buf + o, n - (size_t)o, "}%s", r->norm ? " normed" : "");
        break;
    }
    default:
        snprintf(buf, n, "%lldx%lld", (long long)w->K, (long long)w->N);
    }
}

/* Host image of a weight: valid blocks of its type. */
static void *make_host(const wspec *s) {
    const size_t nb = wbytes(s), rb = ds4_row_bytes(s->type, s->K);
    const int64_t rows = s->N * s->E;
    uint8_t *p = malloc(nb);
    if (!p) { fprintf(stderr, "matvec_table: out of host memory (%zu bytes)\n", nb); exit(1); }
    for (size_t i = 0; i + 8 <= nb; i += 8) {             /* random bytes: the Q8_0 quants */
        const uint64_t z = rnd_u64();
        memcpy(p + i, &z, 8);
    }
    const float sc = 1.0f / sqrtf((float)s->K);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = p + (size_t)r * rb;
        if (ds4_quant_block_elems(s->type) == DS4_QK_K) {   /* Q2_K, Q4_K, IQ2_XXS: valid super-blocks */
            uint64_t st = rnd_u64();
            for (int64_t b = 0; b < s->K / DS4_QK_K; b++)
                ds4_quant_random_block(s->type, &st, row + (size_t)b * ds4_quant_block_bytes(s->type));
        } else if (s->type == DS4_TYPE_Q8_0) {
            for (int64_t b = 0; b < s->K / DS4_QK8_0; b++) {  /* a normal f16 scale per block */
                const uint16_t d = ds4_f32_to_f16(sc * (0.5f + 0.25f * (rnd_f() + 1.0f)) / 127.0f);
                memcpy(row + b * DS4_Q8_0_BLOCK_BYTES, &d, 2);
            }
        } else {
            for (int64_t k = 0; k < s->K; k++) {
                const float v = rnd_f() * sc;
                if (s->type == DS4_TYPE_F32) memcpy(row + 4 * k, &v, 4);
                else {
                    const uint16_t h = s->type == DS4_TYPE_F16 ? ds4_f32_to_f16(v) : ds4_f32_to_bf16(v);
                    memcpy(row + 2 * k, &h, 2);
                }
            }
        }
    }
    return p;
}

static int g_nt = 1;                 /* --nt: tokens per call of the plain ops */
static int g_copies = 0;             /* --copies: weight copies per row (0: enough for the pool) */

/* ---- device buffers shared by all rows ---- */
static const ds4_backend *be;
static struct {
    float *x, *y[DS4_MULTI_MAX];                       /* activations, outputs */
    float *hf, *hxres, *hx, *hscale, *hbase, *hnorm, *hflat, *hmix, *hy, *hpost, *hcomb;   /* hc_pre */
    int32_t *sel;
    float *wts, *add, *out;                            /* moe_experts */
    float *qnorm;                                      /* matmul_multi's input norm */
    ds4_step *step;                                    /* the step block: position 517 */
} d;
#define X_FLOATS ((size_t)1 << 16)
#define Y_FLOATS ((size_t)1 << 17)

static void *dev_put(const void *h, size_t bytes) {
    void *p = be->alloc(bytes);
    if (!p) exit(1);
    be->upload(p, h, bytes);
    return p;
}
static float *dev_rnd(size_t n, float scale) {
    float *h = rnd_vec(n, scale);
    float *p = dev_put(h, n * sizeof(float));
    free(h);
    return p;
}

static void buffers_init(void) {
    const size_t K = (size_t)F_HC * F_D;
    d.x = dev_rnd(X_FLOATS, 1.0f);
    for (int i = 0; i < DS4_MULTI_MAX; i++) d.y[i] = dev_rnd(Y_FLOATS, 0.0f);
    d.hf = dev_rnd(F_D, 1.0f);
    d.hxres = dev_rnd(K, 1.0f);
    d.hx = dev_rnd(K, 1.0f);
    float sc[3] = { 1.0f, 1.0f, 1.0f };
    d.hscale = dev_put(sc, sizeof sc);
    d.hbase = dev_rnd(32, 0.5f);
    d.hnorm = dev_rnd(F_D, 1.0f);
    d.hflat = dev_rnd(K, 0.0f);
    d.hmix = dev_rnd(32, 0.0f);
    d.hy = dev_rnd(F_D, 0.0f);
    float post[F_HC], comb[F_HC * F_HC];
    for (int i = 0; i < F_HC; i++) post[i] = 1.0f;
    for (int i = 0; i < F_HC * F_HC; i++) comb[i] = i % (F_HC + 1) == 0 ? 1.0f : 0.0f;
    d.hpost = dev_put(post, sizeof post);
    d.hcomb = dev_put(comb, sizeof comb);
    /* token 0: six distinct experts of 16; tokens 1..3 (--nt): six of 16 from a fixed generator */
    int32_t sel[4 * F_USED] = { 1, 4, 6, 9, 12, 15 };
    uint32_t g = 12345u;
    for (int t = 1; t < 4; t++)
        for (int j = 0; j < F_USED; j++) {
            int e, dup;
            do {
                g = g * 1103515245u + 12345u;
                e = (int)((g >> 16) % F_EXPERTS);
                dup = 0;
                for (int i = 0; i < j; i++) dup |= sel[t * F_USED + i] == e;
            } while (dup);
            sel[t * F_USED + j] = e;
        }
    float wts[4 * F_USED];
    for (int j = 0; j < 4 * F_USED; j++) wts[j] = 1.0f / F_USED;
    d.sel = dev_put(sel, sizeof sel);
    d.wts = dev_put(wts, sizeof wts);
    d.add = dev_rnd(4 * F_D, 1.0f);
    d.out = dev_rnd(4 * F_D, 0.0f);
    float *ones = malloc(F_Q_LORA * sizeof(float));
    for (int i = 0; i < F_Q_LORA; i++) ones[i] = 1.0f;
    d.qnorm = dev_put(ones, F_Q_LORA * sizeof(float));
    free(ones);
    const ds4_step st = { 517, 1, 0, 0 };
    d.step = dev_put(&st, sizeof st);
}

/* One call of a row's op on weight copy W[0..nw). */
static void run_call(const row_t *r, ds4_weight *W, const float *const *tabs) {
    const float clamp = 10.0f, eps = 1e-6f;
    switch (r->op) {
    case OP_MATMUL:  be->matmul(&W[0], 0, d.x, d.y[0], g_nt); break;
    case OP_GROUPED: be->matmul_grouped(&W[0], r->groups, d.x, d.y[0], g_nt); break;
    case OP_EXPERTS:
        be->moe_experts(d.x, d.sel, d.wts, &W[0], &W[1], &W[2], g_nt, F_USED, clamp, d.add, d.out);
        break;
    case OP_HC_PRE:
        be->hc_pre(d.hf, d.hxres, d.hx, &W[0], d.hscale, d.hbase, d.hnorm, 1, F_D, F_HC, r->head, eps, eps, 20,
                   d.hflat, d.hmix, d.hy, d.hpost, d.hcomb);
        break;
    case OP_MULTI: {
        const ds4_weight *wp[DS4_MULTI_MAX];
        for (int i = 0; i < r->nw; i++) wp[i] = &W[i];
        be->matmul_multi(r->nw, wp, d.y, d.x, 1, r->norm ? d.qnorm : NULL, eps, tabs, d.step, r->period);
        break;
    }
    case OP_SWIGLU:
        be->matmul_swiglu(&W[0], &W[1], d.x, d.y[0], g_nt, clamp, d.y[1], d.y[2]);
        break;
    }
}

/* ---- the hold: a host function that keeps the current stream waiting while calls queue up ---- */
static atomic_int g_open, g_timed_out;
static void CUDART_CB hold_stream(void *arg) {
    (void)arg;
    const double t0 = now_s();
    while (!atomic_load_explicit(&g_open, memory_order_acquire))
        if (now_s() - t0 > GATE_TIMEOUT_S) { atomic_store(&g_timed_out, 1); return; }
}

static cudaEvent_t ev0, ev1;

/* Microseconds per call over `calls` calls, rotating through the copies. */
static double time_calls(row_t *r, ds4_weight *copies, const float *const *tabs, int ncopies, int *next,
                         int calls, int held) {
    if (held) {
        atomic_store(&g_open, 0);
        atomic_store(&g_timed_out, 0);
        CK(cudaLaunchHostFunc(ds4_current_stream(), hold_stream, NULL));
    }
    CK(cudaEventRecord(ev0, ds4_current_stream()));
    for (int i = 0; i < calls; i++) {
        run_call(r, copies + (size_t)(*next) * r->nw, tabs);
        *next = (*next + 1) % ncopies;
    }
    CK(cudaEventRecord(ev1, ds4_current_stream()));
    if (held) atomic_store_explicit(&g_open, 1, memory_order_release);
    CK(cudaEventSynchronize(ev1));
    if (held && atomic_load(&g_timed_out)) r->gate_timeouts++;
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev0, ev1));
    return (double)ms * 1e3 / calls;
}

static void measure(row_t *r, double pool_bytes, int reps, int calls) {
    r->read_bytes = read_bytes(r);
    /* one more than the pool needs: between two uses of a copy, all the others are read */
    int ncopies = (int)ceil(pool_bytes / r->read_bytes) + 1;
    if (ncopies < 2) ncopies = 2;
    if (ncopies > 4096) ncopies = 4096;
    if (g_copies > 0) ncopies = g_copies;
    r->ncopies = ncopies;

    void *host[DS4_MULTI_MAX];
    for (int i = 0; i < r->nw; i++) host[i] = make_host(&r->w[i]);
    ds4_weight *copies = calloc((size_t)ncopies * r->nw, sizeof(ds4_weight));
    for (int c = 0; c < ncopies; c++)
        for (int i = 0; i < r->nw; i++) {
            ds4_weight *w = &copies[(size_t)c * r->nw + i];
            w->name = r->name;
            w->type = r->w[i].type;
            w->n_dims = r->w[i].E > 1 ? 3 : 2;
            w->ne[0] = r->w[i].K; w->ne[1] = r->w[i].N; w->ne[2] = r->w[i].E;
            w->nbytes = wbytes(&r->w[i]);
            w->host = host[i];
            if (be->upload_weight(w) != 0) {
                fprintf(stderr, "matvec_table: upload of %s copy %d failed (lower --pool-mb?)\n", r->name, c);
                exit(1);
            }
        }
    float *tabs_dev[DS4_MULTI_MAX] = { 0 };
    int any_tab = 0;
    for (int i = 0; i < r->nw; i++)
        if (r->tab[i]) { tabs_dev[i] = dev_rnd((size_t)r->period * r->w[i].N, 0.5f); any_tab = 1; }
    const float *const *tabs = any_tab ? (const float *const *)tabs_dev : NULL;

    int next = 0;
    for (int c = 0; c < ncopies; c++) run_call(r, copies + (size_t)c * r->nw, tabs);   /* warm-up: every copy */
    be->synchronize();

    double *v = malloc(sizeof(double) * (size_t)reps);
    int n_held = calls;
    for (int k = 0; k < reps; k++) {
        const int before = r->gate_timeouts;
        v[k] = time_calls(r, copies, tabs, ncopies, &next, n_held, 1);
        if (r->gate_timeouts > before && n_held > 8) n_held /= 2;   /* queue too deep to hold: fewer calls */
    }
    r->us = median(v, reps);
    for (int k = 0; k < reps; k++) v[k] = time_calls(r, copies, tabs, ncopies, &next, calls, 0);
    r->us_issued = median(v, reps);
    free(v);

    for (size_t i = 0; i < (size_t)ncopies * r->nw; i++) be->release_weight(&copies[i]);
    for (int i = 0; i < r->nw; i++) { free(host[i]); if (tabs_dev[i]) be->free(tabs_dev[i]); }
    free(copies);
    r->done = 1;
}

static double g_copy_bw;

static void table_header(int section) {
    if (section == 1)
        printf("\n### 1. Each decode weight through the plain op (fwd: the forward pass calls exactly this)\n\n");
    else
        printf("\n### 2. The fused ops, as the forward pass calls them\n\n");
    printf("| name | op | shape K x N | type | MB/call | calls/token | us/call | GB/s |%s us/token | issued us/call | copies |\n",
           g_copy_bw > 0 ? " % copy BW |" : "");
    printf("|---|---|---|---|---:|---:|---:|---:|%s---:|---:|---:|\n", g_copy_bw > 0 ? "---:|" : "");
}

static void table_row(const row_t *r) {
    char shape[96];
    shape_str(r, shape, sizeof shape);
    const double gbs = r->read_bytes / (r->us * 1e-6) / 1e9;
    char bwcol[32] = "";
    if (g_copy_bw > 0) snprintf(bwcol, sizeof bwcol, " %.1f%% |", 100.0 * gbs / g_copy_bw);
    printf("| %s%s | %s | %s | %s | %.2f | %s | %.2f%s | %.0f |%s %.1f | %.2f | %d |\n", r->name,
           r->fwd ? " (fwd)" : "", op_name[r->op], shape, type_str(r->w[0].type), r->read_bytes / MB,
           r->calls_txt, r->us, r->gate_timeouts ? " (hold timed out)" : "", gbs, bwcol, r->calls * r->us,
           r->us_issued, r->ncopies);
}

/* A RESULT value without spaces or '=': anything but [A-Za-z0-9.+{},-] becomes '_'. */
static void result_token(char *s) {
    for (char *p = s; *p; p++) {
        const char c = *p;
        const int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '.' || c == '+' || c == '-' || c == ',' || c == '{' || c == '}';
        if (!ok) *p = '_';
    }
}

static void usage(FILE *f) {
    fprintf(f, "usage: matvec_table [--reps N] [--calls N] [--pool-mb MB] [--copy-bw GBps] [--only NAME] [--nt N] "
               "[--group G] [--copies C]\n");
}

int main(int argc, char **argv) {
    int reps = 7, calls = 64;
    double pool_mb = 128;
    const char *only = NULL;
    int group = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (i + 1 >= argc) { fprintf(stderr, "matvec_table: %s needs a value\n", a); usage(stderr); return 2; }
        const char *v = argv[++i];
        if (!strcmp(a, "--reps")) reps = atoi(v);
        else if (!strcmp(a, "--calls")) calls = atoi(v);
        else if (!strcmp(a, "--pool-mb")) pool_mb = atof(v);
        else if (!strcmp(a, "--copy-bw")) g_copy_bw = atof(v);
        else if (!strcmp(a, "--only")) only = v;
        else if (!strcmp(a, "--nt")) g_nt = atoi(v);
        else if (!strcmp(a, "--group")) group = atoi(v);
        else if (!strcmp(a, "--copies")) g_copies = atoi(v);
        else { fprintf(stderr, "matvec_table: unknown option %s\n", a); usage(stderr); return 2; }
    }
    if (reps < 1 || calls < 1 || pool_mb < 0 || g_nt < 1 || g_nt > 4 || group < 0 || group > 1 || g_copies < 0 ||
        g_copies > 4096) {
        fprintf(stderr, "matvec_table: --reps and --calls must be >= 1, --pool-mb >= 0, --nt in 1..4, --group in 0..1, "
                        "--copies in 0..4096\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);   /* rows survive a time limit */

    be = ds4_backend_cuda();
    if (be->init() != 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
            printf("skipped: no GPU (matvec_table)\n");
            return 0;
        }
        fprintf(stderr, "matvec_table: the CUDA backend failed to start on a machine with %d GPU(s)\n", n);
        return 1;
    }
    /* one session (ds4_gpu.h), sized for one flash16 token; its stream is the current one */
    ds4_limits lim;
    memset(&lim, 0, sizeof lim);
    lim.max_batch = g_nt;
    lim.decode_group = group;            /* DS4_CUDA_DECODE_GROUP (default 1) */
    lim.n_ctx = 1024;
    lim.n_embd = F_D;
    lim.n_head = F_HEADS;
    lim.head_dim = F_HEAD_DIM;
    lim.n_expert = F_EXPERTS;
    lim.n_expert_used = F_USED;
    lim.n_ff_exp = F_FF;
    lim.n_vocab = F_VOCAB;
    lim.max_k = (int64_t)F_HC * F_D;
    lim.max_matrix = (int64_t)F_VOCAB * F_D;
    void *sess = be->session_new(&lim);
    if (!sess) return 1;
    be->session_bind(sess);
    int l2 = 0;
    CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    double pool = pool_mb * MB;
    if (pool < 3.0 * l2) pool = 3.0 * l2;
    CK(cudaEventCreate(&ev0));
    CK(cudaEventCreate(&ev1));
    buffers_init();
    build_rows();

    printf("matvec_table: flash16 decode (%d token%s a call, DS4_CUDA_DECODE_GROUP=%d), CUDA backend; L2 %.0f MB; "
           "each row rotates weight copies so >= %.0f MB are read between two uses of one copy; median of %d "
           "repetitions of %d calls%s\n", g_nt, g_nt > 1 ? "s" : "", group, l2 / MB, pool / MB, reps, calls,
           g_copies > 0 ? "; --copies overrides the rotation (1: the same weights every call, from L2 when they fit)" : "");
    printf("us/call: GPU pace (calls queued behind a host hold, then run back to back); issued: the same calls "
           "issued eagerly; GB/s: weight bytes read per call / us/call\n");

    int section = 0;
    for (int i = 0; i < g_nrows; i++) {
        row_t *r = &g_rows[i];
        if (only && !strstr(r->name, only)) continue;
        if (g_nt > 1 && (r->section != 1 || r->op == OP_GROUPED ||
                         (size_t)g_nt * (size_t)(r->op == OP_EXPERTS ? F_D : r->w[0].N) > Y_FLOATS)) continue;
        if (r->section != section) { section = r->section; table_header(section); }
        measure(r, pool, reps, calls);
        table_row(r);
    }

    /* totals */
    double us1 = 0, b1 = 0, usf = 0, bf = 0;
    int n1 = 0, nf = 0, n_f_expected = 0, n1_expected = 0;
    for (int i = 0; i < g_nrows; i++) {
        const row_t *r = &g_rows[i];
        const int in_fwd = r->section == 2 || r->fwd;
        if (r->section == 1) n1_expected++;
        if (in_fwd) n_f_expected++;
        if (!r->done) continue;
        if (r->section == 1) { us1 += r->calls * r->us; b1 += r->calls * r->read_bytes; n1++; }
        if (in_fwd) { usf += r->calls * r->us; bf += r->calls * r->read_bytes; nf++; }
    }
    printf("\n");
    if (n1 == n1_expected && n1 > 0)
        printf("per token, every weight through its plain op (section 1): %.1f us for %.3f GB -> %.0f GB/s\n",
               us1, b1 / 1e9, b1 / (us1 * 1e-6) / 1e9);
    if (nf == n_f_expected && nf > 0) {
        printf("per token, the weight-streaming ops as the forward pass calls them (section 2 + fwd rows): "
               "%.1f us for %.3f GB -> %.0f GB/s", usf, bf / 1e9, bf / (usf * 1e-6) / 1e9);
        if (g_copy_bw > 0)
            printf(" = %.1f%% of the %.0f GB/s copy bandwidth; those bytes take %.1f us at the copy bandwidth",
                   100.0 * (bf / (usf * 1e-6) / 1e9) / g_copy_bw, g_copy_bw, bf / (g_copy_bw * 1e9) * 1e6);
        printf("\n");
    }

    for (int i = 0; i < g_nrows; i++) {
        const row_t *r = &g_rows[i];
        if (!r->done) continue;
        char shape[96], name[64];
        shape_str(r, shape, sizeof shape);
        snprintf(name, sizeof name, "%s", r->name);
        result_token(shape);
        result_token(name);
        printf("RESULT bench=matvec_table section=%d name=%s op=%s shape=%s type=%s calls_per_token=%d "
               "metric=us_per_call value=%.3f GBps=%.1f us_per_token=%.1f issued_us_per_call=%.3f copies=%d%s\n",
               r->section, name, op_name[r->op], shape, type_str(r->w[0].type), r->calls, r->us,
               r->read_bytes / (r->us * 1e-6) / 1e9, r->calls * r->us, r->us_issued, r->ncopies,
               r->gate_timeouts ? " hold_timed_out=1" : "");
    }
    if (n1 == n1_expected && n1 > 0)
        printf("RESULT bench=matvec_table metric=plain_us_per_token value=%.1f GB_per_token=%.4f\n", us1, b1 / 1e9);
    if (nf == n_f_expected && nf > 0) {
        printf("RESULT bench=matvec_table metric=forward_us_per_token value=%.1f GB_per_token=%.4f GBps=%.1f",
               usf, bf / 1e9, bf / (usf * 1e-6) / 1e9);
        if (g_copy_bw > 0) printf(" copy_bw_fraction=%.3f copy_bw_GBps=%.0f", bf / (usf * 1e-6) / 1e9 / g_copy_bw, g_copy_bw);
        printf("\n");
    }

    CK(cudaEventDestroy(ev0));
    CK(cudaEventDestroy(ev1));
    return 0;
}
