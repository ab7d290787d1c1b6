/* test_backend_ops.c -- every op of ds4_gpu.h on the CUDA backend against the
 * CPU backend (the specification), on fresh random inputs.
 *
 * For each op and each of several shapes (single token, odd token counts,
 * prefill-sized batches; widths that are and are not multiples of 256; every
 * weight type, Q8_0, Q2_K, Q4_K and IQ2_XXS built from random valid blocks) the
 * same inputs go to both
 * backends, the CUDA outputs are pre-filled with NaN so an element the kernel
 * never writes shows up, and the outputs are compared:
 *
 *   max|d|      the largest absolute difference
 *   rel         ||cuda - cpu|| / ||cpu|| over the whole output
 *
 * An op passes when rel is within the tolerance stated (and justified) at
 * the call, and no NaN appears where the CPU has a number.  Integer outputs
 * (routing, indexer selections) must match exactly, except that the indexer
 * may swap rows whose scores tie to within float rounding (see test_indexer).
 * Finally the reduction-heavy CUDA paths run twice and must agree bit for bit.
 * The last line is "N passed, M failed"; the exit status is non-zero on any
 * failure.  Without a GPU the program prints "skipped: no GPU" and exits 0.
 *
 * Build: make build/cuda-ARCH/test_backend_ops (it links the engine's objects and the CUDA units)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4_gpu.h"
#include "ds4.h"
#include "ds4_quant.h"

/* ---- tolerances (relative, ||d|| / ||ref||) ------------------------------
 * EXACT:   pure data movement, or one IEEE operation per element done the
 *          same way on both sides (copies, dequantization d*q, x + b, x * s).
 * ULP:     a few correctly or nearly correctly rounded operations per element
 *          whose order may differ, or libm-vs-CUDA transcendentals (expf,
 *          sinf, cosf: CUDA's are within 2 ulp, glibc's within 1).
 * DOT:     f32 dot products of up to 4096 terms summed in a different order
 *          (CPU: 8 strided partials; GPU: per-lane partials and a butterfly,
 *          or cuBLAS tiles), plus FMA contraction on the GPU.  The rounding
 *          error of each order is ~sqrt(K) * 2^-24 relative to sum|w x|; on
 *          random data that is below 1e-6 of the norm, so 1e-5 leaves a
 *          decade of margin while still catching any indexing error (which
 *          shows up as rel ~ 1).
 * CHAIN:   two dependent projections (MoE gate/up -> SwiGLU -> down), each
 *          with DOT error, and the attention softmax over hundreds of rows
 *          (exp of scores that already carry DOT error): 3e-5.
 */
#define TOL_EXACT 0.0
#define TOL_ULP   2e-6
#define TOL_DOT   1e-5
#define TOL_CHAIN 3e-5

static const ds4_backend *B[2];   /* 0: CPU (reference), 1: CUDA */
static int g_pass, g_fail;

/* ---- random inputs ---- */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd_u64(void) {
    g_rng ^= g_rng >> 12; g_rng ^= g_rng << 25; g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}
static float rnd_f(void) { return (float)((rnd_u64() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }
static int rnd_int(int n) { return (int)(rnd_u64() % (uint64_t)n); }

static float *rnd_vec(size_t n, float scale) {
    float *v = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = rnd_f() * scale;
    return v;
}

/* Ratio-4 picks for nt queries from pos0: visible rows, about 1 in 8 left at -1. */
static int32_t *rnd_topk(int pos0, int nt, int k) {
    int32_t *topk = malloc((size_t)nt * k * sizeof(int32_t));
    for (int t = 0; t < nt; t++) {
        const int vis = (pos0 + t + 1) / 4;
        for (int j = 0; j < k; j++)
            topk[(size_t)t * k + j] = (vis > 0 && rnd_int(8) != 0) ? rnd_int(vis) : -1;
    }
    return topk;
}

/* ---- backend buffers: every allocation of a test is freed at its end ---- */
#define MAX_BUFS 64
static void *g_bufs[2][MAX_BUFS];
static int g_nbufs[2];

static void *dev_alloc(int bi, size_t bytes) {
    void *p = B[bi]->alloc(bytes ? bytes : 4);
    if (!p) { fprintf(stderr, "test: allocation of %zu bytes failed\n", bytes); exit(2); }
    if (g_nbufs[bi] == MAX_BUFS) { fprintf(stderr, "test: too many buffers\n"); exit(2); }
    g_bufs[bi][g_nbufs[bi]++] = p;
    return p;
}
static void *dev_put(int bi, const void *host, size_t bytes) {
    void *p = dev_alloc(bi, bytes);
    if (bytes) B[bi]->upload(p, host, bytes);
    return p;
}
/* Output buffer pre-filled with NaN (on both backends: the CPU too must write
 * everything, or the reference itself would be NaN and the test would say so). */
static float *dev_poison(int bi, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    float *p = dev_put(bi, h, n * sizeof(float));
    free(h);
    return p;
}
static int32_t *dev_poison_i32(int bi, size_t n) {
    int32_t *h = malloc((n ? n : 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) h[i] = 0x7fffffff;
    int32_t *p = dev_put(bi, h, n * sizeof(int32_t));
    free(h);
    return p;
}
static void *dev_get(int bi, const void *dev, size_t bytes) {
    void *h = malloc(bytes ? bytes : 4);
    B[bi]->synchronize();
    if (bytes) B[bi]->download(h, dev, bytes);
    return h;
}
/* The step block of a call at position pos0 (ds4_gpu.h): a buffer of the test. */
static const ds4_step *at(int bi, int pos0) {
    const ds4_step st = { pos0, 0, 0, 0 };
    return dev_put(bi, &st, sizeof st);
}
static void dev_free_all(int bi) {
    for (int i = 0; i < g_nbufs[bi]; i++) B[bi]->free(g_bufs[bi][i]);
    g_nbufs[bi] = 0;
}

/* ---- weights built in memory ---- */
static ds4_weight make_weight(int type, int64_t K, int64_t N, int64_t E, float scale) {
    ds4_weight w;
    memset(&w, 0, sizeof w);
    w.name = "test";
    w.type = type;
    w.n_dims = E > 1 ? 3 : 2;
    w.ne[0] = K; w.ne[1] = N; w.ne[2] = E;
    const int64_t rows = N * E;
    w.nbytes = ds4_row_bytes(type, K) * (size_t)rows;
    uint8_t *p = malloc(w.nbytes);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = p + ds4_row_bytes(type, K) * (size_t)r;
        if (type == DS4_TYPE_Q2_K || type == DS4_TYPE_Q4_K || type == DS4_TYPE_IQ2_XXS) {
            /* random valid super-blocks (ds4_quant.c: values O(0.01..0.1), `scale` unused) */
            uint64_t st = rnd_u64();
            const size_t bb = ds4_quant_block_bytes(type);
            for (int64_t b = 0; b < K / ds4_quant_block_elems(type); b++)
                ds4_quant_random_block(type, &st, row + (size_t)b * bb);
        } else if (type == DS4_TYPE_Q8_0) {
            for (int64_t b = 0; b < K / DS4_QK8_0; b++) {
                uint8_t *blk = row + b * DS4_Q8_0_BLOCK_BYTES;
                /* a valid scale (normal f16) and quants in [-127, 127] */
                const uint16_t d = ds4_f32_to_f16(scale * (0.5f + 0.5f * (rnd_f() + 1.0f) * 0.5f) / 127.0f);
                memcpy(blk, &d, 2);
                for (int j = 0; j < DS4_QK8_0; j++) blk[2 + j] = (uint8_t)(int8_t)(rnd_int(255) - 127);
            }
        } else {
            for (int64_t k = 0; k < K; k++) {
                const float v = rnd_f() * scale;
                if (type == DS4_TYPE_F32) memcpy(row + 4 * k, &v, 4);
                else {
                    const uint16_t h = type == DS4_TYPE_F16 ? ds4_f32_to_f16(v) : ds4_f32_to_bf16(v);
                    memcpy(row + 2 * k, &h, 2);
                }
            }
        }
    }
    w.host = p;
    return w;
}
static void free_weight(ds4_weight *w) { free((void *)w->host); w->host = NULL; }

/* A backend's copy of w (CPU: dev == host). */
static ds4_weight weight_on(int bi, const ds4_weight *w) {
    ds4_weight c = *w;
    if (B[bi]->upload_weight(&c) != 0) { fprintf(stderr, "test: upload_weight failed\n"); exit(2); }
    return c;
}

static const char *type_name(int t) {
    switch (t) {
    case DS4_TYPE_F32: return "f32"; case DS4_TYPE_F16: return "f16";
    case DS4_TYPE_BF16: return "bf16"; case DS4_TYPE_Q8_0: return "q8_0"; case DS4_TYPE_I32: return "i32";
    case DS4_TYPE_Q2_K: return "q2_k"; case DS4_TYPE_Q4_K: return "q4_k"; case DS4_TYPE_IQ2_XXS: return "iq2_xxs";
    default: return "?";
    }
}

/* Engines byte for byte (DS4_CUDA_PREFILL_TC 4, the default, against 3 and 2, which
 * differ only in how a stage's weights and activations are copied): the first pass records each CUDA
 * output check_f32 sees, each later pass, on the same inputs (the generator restarted), compares its
 * own with the recorded one, case by case.  The CPU bound alone would pass a fault in the low
 * part (2^-22 of a value). */
static int g_same;                  /* 0 off, 1 record, 2 compare */
static float **g_same_out;
static size_t *g_same_n, g_same_cnt, g_same_cap, g_same_at;
static void same_take(const char *op, const char *shape, const float *got, size_t n) {
    if (g_same == 1) {
        if (g_same_cnt == g_same_cap) {
            g_same_cap = g_same_cap ? 2 * g_same_cap : 64;
            g_same_out = (float **)realloc(g_same_out, g_same_cap * sizeof *g_same_out);
            g_same_n = (size_t *)realloc(g_same_n, g_same_cap * sizeof *g_same_n);
            if (!g_same_out || !g_same_n) { fprintf(stderr, "test: out of memory\n"); exit(2); }
        }
        float *c = (float *)malloc(n * sizeof *c);
        if (!c) { fprintf(stderr, "test: out of memory\n"); exit(2); }
        memcpy(c, got, n * sizeof *c);
        g_same_out[g_same_cnt] = c;
        g_same_n[g_same_cnt++] = n;
        return;
    }
    size_t at = n;
    const int have = g_same_at < g_same_cnt && g_same_n[g_same_at] == n;
    if (have)
        for (size_t i = 0; i < n; i++)
            if (memcmp(&g_same_out[g_same_at][i], &got[i], sizeof *got)) { at = i; break; }
    const int ok = have && at == n;
    if (ok) printf("%-15s %-44s bytes equal to the first engine's  ok\n", op, shape);
    else if (!have) printf("%-15s %-44s no matching case in the first pass  FAIL\n", op, shape);
    else printf("%-15s %-44s differs from the first engine at element %zu  FAIL\n", op, shape, at);
    if (ok) g_pass++; else g_fail++;
    g_same_at++;
}

/* ---- comparison ---- */
static void check_f32(const char *op, const char *shape, const float *ref, const float *got, size_t n,
                      double tol) {
    double max_abs = 0.0, d2 = 0.0, r2 = 0.0;
    size_t bad_nan = 0, ref_nan = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(ref[i])) { ref_nan++; continue; }
        if (isnan(got[i]) || isinf(got[i]) != isinf(ref[i])) { bad_nan++; continue; }
        if (isinf(ref[i])) continue;
        const double d = (double)got[i] - (double)ref[i];
        if (fabs(d) > max_abs) max_abs = fabs(d);
        d2 += d * d;
        r2 += (double)ref[i] * ref[i];
    }
    const double rel = r2 > 0 ? sqrt(d2 / r2) : sqrt(d2);
    const int ok = bad_nan == 0 && ref_nan == 0 && rel <= tol;
    printf("%-15s %-44s max|d| %9.2e  rel %9.2e  tol %7.1e  %s", op, shape, max_abs, rel, tol,
           ok ? "ok" : "FAIL");
    if (bad_nan) printf("  (%zu unwritten/non-finite)", bad_nan);
    if (ref_nan) printf("  (%zu NaN in the CPU reference)", ref_nan);
    printf("\n");
    if (ok) g_pass++; else g_fail++;
    if (g_same) same_take(op, shape, got, n);
}

static void check_i32(const char *op, const char *shape, const int32_t *ref, const int32_t *got, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += ref[i] != got[i];
    printf("%-15s %-44s mismatches %zu / %zu  %s\n", op, shape, bad, n, bad ? "FAIL" : "ok");
    if (bad) g_fail++; else g_pass++;
}

/* ========================================================================== */

static void test_memory(void) {
    const size_t n = 100003;
    float *h = rnd_vec(n, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *a = dev_put(bi, h, n * 4);
        float *z = dev_alloc(bi, n * 4);            /* alloc must be zero-filled */
        float *zh = dev_get(bi, z, n * 4);
        size_t nz = 0;
        for (size_t i = 0; i < n; i++) nz += zh[i] != 0.0f;
        if (nz) { printf("alloc           %s: %zu non-zero elements  FAIL\n", B[bi]->name, nz); g_fail++; }
        free(zh);
        B[bi]->copy(z, a, n * 4);
        out[bi] = dev_get(bi, z, n * 4);
        dev_free_all(bi);
    }
    check_f32("upload/copy", "n=100003", h, out[1], n, TOL_EXACT);
    free(h); free(out[0]); free(out[1]);
}

static void test_embed(int type, int64_t D, int V, int nt, int n_hc) {
    ds4_weight w = make_weight(type, D, V, 1, 1.0f);
    int32_t *tok = malloc(nt * sizeof(int32_t));
    for (int t = 0; t < nt; t++) tok[t] = rnd_int(V);
    const size_t n = (size_t)nt * n_hc * D;
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight wb = weight_on(bi, &w);
        int32_t *dt = dev_put(bi, tok, nt * sizeof(int32_t));
        float *x = dev_poison(bi, n);
        B[bi]->embed(&wb, dt, nt, n_hc, x);
        out[bi] = dev_get(bi, x, n * 4);
        B[bi]->release_weight(&wb);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "%s D=%lld V=%d nt=%d hc=%d", type_name(type), (long long)D, V, nt, n_hc);
    check_f32("embed", shape, out[0], out[1], n, TOL_EXACT);   /* d*q or a plain conversion: exact */
    free(out[0]); free(out[1]); free(tok); free_weight(&w);
}

static void test_rmsnorm(int rows, int n, int with_w, int in_place) {
    float *x = rnd_vec((size_t)rows * n, 3.0f), *w = rnd_vec(n, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dx = dev_put(bi, x, (size_t)rows * n * 4);
        float *dw = with_w ? dev_put(bi, w, (size_t)n * 4) : NULL;
        float *dy = in_place ? dx : dev_poison(bi, (size_t)rows * n);
        B[bi]->rmsnorm(dx, dw, dy, rows, n, 1e-6f);
        out[bi] = dev_get(bi, dy, (size_t)rows * n * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "rows=%d n=%d%s%s", rows, n, with_w ? " w" : "", in_place ? " in-place" : "");
    /* squares summed in double on both sides; differences are the final roundings */
    check_f32("rmsnorm", shape, out[0], out[1], (size_t)rows * n, TOL_ULP);
    free(out[0]); free(out[1]); free(x); free(w);
}

static void test_matmul(int type, int64_t K, int64_t N, int64_t E, int expert, int nt) {
    ds4_weight w = make_weight(type, K, N, E, 1.0f / sqrtf((float)K));
    float *x = rnd_vec((size_t)nt * K, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight wb = weight_on(bi, &w);
        float *dx = dev_put(bi, x, (size_t)nt * K * 4);
        float *dy = dev_poison(bi, (size_t)nt * N);
        B[bi]->matmul(&wb, expert, dx, dy, nt);
        out[bi] = dev_get(bi, dy, (size_t)nt * N * 4);
        B[bi]->release_weight(&wb);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "%s K=%lld N=%lld E=%lld e=%d nt=%d", type_name(type), (long long)K,
             (long long)N, (long long)E, expert, nt);
    check_f32("matmul", shape, out[0], out[1], (size_t)nt * N, TOL_DOT);
    free(out[0]); free(out[1]); free(x); free_weight(&w);
}

/* A prefill product on activations of a wide dynamic range: each token row scaled by its own
 * power of two (2^-60 .. 2^60), elements within a row spread over 2^-30 .. 1, and one row of
 * zeros: the tensor-core engine's per-token scaling and three-part split (ds4_cuda_gemm.cu)
 * must stay within TOL_DOT of the CPU's f32 sums on all of them. */
static void test_matmul_range(int type, int64_t K, int64_t N, int nt) {
    ds4_weight w = make_weight(type, K, N, 1, 1.0f / sqrtf((float)K));
    float *x = rnd_vec((size_t)nt * K, 1.0f);
    for (int t = 0; t < nt; t++) {
        const float row = ldexpf(1.0f, rnd_int(121) - 60);
        for (int64_t k = 0; k < K; k++)
            x[(size_t)t * K + k] = t == nt / 2 ? 0.0f : x[(size_t)t * K + k] * row * ldexpf(1.0f, -rnd_int(31));
    }
    const size_t ny = (size_t)nt * N;
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight wb = weight_on(bi, &w);
        float *dx = dev_put(bi, x, (size_t)nt * K * 4);
        float *dy = dev_poison(bi, ny);
        B[bi]->matmul(&wb, 0, dx, dy, nt);
        out[bi] = dev_get(bi, dy, ny * 4);
        B[bi]->release_weight(&wb);
        dev_free_all(bi);
    }
    /* rows of different scales: compare each token row on its own */
    char shape[96];
    for (int t = 0; t < nt; t++) {
        snprintf(shape, sizeof shape, "%s K=%lld N=%lld nt=%d token %d (wide range)", type_name(type), (long long)K,
                 (long long)N, nt, t);
        if (t == nt / 2 || t == 0 || t == nt - 1 || t % 97 == 1)
            check_f32("matmul", shape, out[0] + (size_t)t * N, out[1] + (size_t)t * N, (size_t)N, TOL_DOT);
    }
    free(out[0]); free(out[1]); free(x); free_weight(&w);
}

static void test_matmul_grouped(int type, int64_t K, int G, int64_t R, int nt) {
    ds4_weight w = make_weight(type, K, (int64_t)G * R, 1, 1.0f / sqrtf((float)K));
    float *x = rnd_vec((size_t)nt * G * K, 1.0f);
    const size_t ny = (size_t)nt * G * R;
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight wb = weight_on(bi, &w);
        float *dx = dev_put(bi, x, (size_t)nt * G * K * 4);
        float *dy = dev_poison(bi, ny);
        B[bi]->matmul_grouped(&wb, G, dx, dy, nt);
        out[bi] = dev_get(bi, dy, ny * 4);
        B[bi]->release_weight(&wb);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "%s K=%lld G=%d R=%lld nt=%d", type_name(type), (long long)K, G,
             (long long)R, nt);
    check_f32("matmul_grouped", shape, out[0], out[1], ny, TOL_DOT);
    free(out[0]); free(out[1]); free(x); free_weight(&w);
}

static void test_hc_mix(int nt, int D, int h, int head, int iters) {
    const int n_mix = head ? h : (2 + h) * h;
    float *mix = rnd_vec((size_t)nt * n_mix, 2.0f), *scale = rnd_vec(3, 1.0f), *base = rnd_vec(n_mix, 0.5f);
    float *x = rnd_vec((size_t)nt * h * D, 1.0f);
    float *y[2], *post[2], *comb[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dm = dev_put(bi, mix, (size_t)nt * n_mix * 4);
        float *ds = dev_put(bi, scale, 12), *db = dev_put(bi, base, (size_t)n_mix * 4);
        float *dx = dev_put(bi, x, (size_t)nt * h * D * 4);
        float *dy = dev_poison(bi, (size_t)nt * D);
        float *dp = head ? NULL : dev_poison(bi, (size_t)nt * h);
        float *dc = head ? NULL : dev_poison(bi, (size_t)nt * h * h);
        B[bi]->hc_mix(dm, ds, db, dx, nt, D, h, head, 1e-6f, iters, dy, dp, dc);
        y[bi] = dev_get(bi, dy, (size_t)nt * D * 4);
        post[bi] = head ? NULL : dev_get(bi, dp, (size_t)nt * h * 4);
        comb[bi] = head ? NULL : dev_get(bi, dc, (size_t)nt * h * h * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "nt=%d D=%d hc=%d head=%d iters=%d", nt, D, h, head, iters);
    /* pre/post: sigmoid (expf) of an FMA-contracted affine map; y: 4-term sums */
    check_f32("hc_mix y", shape, y[0], y[1], (size_t)nt * D, TOL_ULP);
    if (!head) {
        check_f32("hc_mix post", shape, post[0], post[1], (size_t)nt * h, TOL_ULP);
        /* Sinkhorn: 2*iters normalisations, each a few roundings: still ~ulp-level */
        check_f32("hc_mix comb", shape, comb[0], comb[1], (size_t)nt * h * h, TOL_DOT);
    }
    for (int bi = 0; bi < 2; bi++) { free(y[bi]); free(post[bi]); free(comb[bi]); }
    free(mix); free(scale); free(base); free(x);
}

static void test_hc_post(int nt, int D, int h) {
    float *f = rnd_vec((size_t)nt * D, 1.0f), *xr = rnd_vec((size_t)nt * h * D, 1.0f);
    float *post = rnd_vec((size_t)nt * h, 1.0f), *comb = rnd_vec((size_t)nt * h * h, 1.0f);
    const size_t n = (size_t)nt * h * D;
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *df = dev_put(bi, f, (size_t)nt * D * 4), *dx = dev_put(bi, xr, n * 4);
        float *dp = dev_put(bi, post, (size_t)nt * h * 4), *dc = dev_put(bi, comb, (size_t)nt * h * h * 4);
        float *dy = dev_poison(bi, n);
        B[bi]->hc_post(df, dx, dp, dc, nt, D, h, dy);
        out[bi] = dev_get(bi, dy, n * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "nt=%d D=%d hc=%d", nt, D, h);
    /* five products summed in the same order; the GPU may fuse them into FMAs */
    check_f32("hc_post", shape, out[0], out[1], n, TOL_ULP);
    free(out[0]); free(out[1]); free(f); free(xr); free(post); free(comb);
}

/* RoPE parameters of a window layer, or of a compressed layer with YaRN. */
static ds4_rope test_rope_params(int n_rot, int yarn) {
    ds4_rope rp;
    rp.n_rot = n_rot;
    rp.freq_base = yarn ? 160000.0f : 10000.0f;
    rp.freq_scale = yarn ? 1.0f / 16.0f : 1.0f;
    rp.ext_factor = yarn ? 1.0f : 0.0f;
    rp.corr_lo = yarn ? 5.0f : 0.0f;
    rp.corr_hi = yarn ? 21.0f : 0.0f;
    return rp;
}

/* ---- fused ops: checked against the CPU backend's composition of the plain ops ---- */

/* hc_pre: the previous sublayer's update (with_f), the flattened norm, the
 * F32 projection (K = h*D: the long-K shape), hc_mix and the sublayer norm.
 * Head mode gets a 1-entry scale buffer, as the model has, so a read past
 * it is a sanitizer error. */
static void test_hc_pre_t(int type, int nt, int D, int h, int head, int with_f) {
    const int n_mix = head ? h : (2 + h) * h;
    const int64_t K = (int64_t)h * D;
    ds4_weight fn = make_weight(type, K, n_mix, 1, 2.0f / sqrtf((float)K));
    const int n_sc = head ? 1 : 3;
    float *scale = rnd_vec(n_sc, 1.0f), *base = rnd_vec(n_mix, 0.5f), *nw = rnd_vec(D, 1.0f);
    float *f = rnd_vec((size_t)nt * D, 1.0f), *xr = rnd_vec((size_t)nt * K, 1.0f), *x = rnd_vec((size_t)nt * K, 1.0f);
    float *post = rnd_vec((size_t)nt * h, 1.0f), *comb = rnd_vec((size_t)nt * h * h, 0.5f);
    float *ox[2], *oy[2], *op[2], *oc[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight fb = weight_on(bi, &fn);
        float *ds = dev_put(bi, scale, (size_t)n_sc * 4), *db = dev_put(bi, base, (size_t)n_mix * 4);
        float *dn = dev_put(bi, nw, (size_t)D * 4);
        float *df = with_f ? dev_put(bi, f, (size_t)nt * D * 4) : NULL;
        float *dxr = with_f ? dev_put(bi, xr, (size_t)nt * K * 4) : NULL;
        float *dx = with_f ? dev_poison(bi, (size_t)nt * K) : dev_put(bi, x, (size_t)nt * K * 4);
        float *dp = dev_put(bi, post, (size_t)nt * h * 4), *dc = dev_put(bi, comb, (size_t)nt * h * h * 4);
        float *dflat = dev_poison(bi, (size_t)nt * K), *dmix = dev_poison(bi, (size_t)nt * n_mix);
        float *dy = dev_poison(bi, (size_t)nt * D);
        B[bi]->hc_pre(df, dxr, dx, &fb, ds, db, dn, nt, D, h, head, 1e-6f, 1e-6f, 20, dflat, dmix, dy, dp, dc);
        ox[bi] = dev_get(bi, dx, (size_t)nt * K * 4);
        oy[bi] = dev_get(bi, dy, (size_t)nt * D * 4);
        op[bi] = dev_get(bi, dp, (size_t)nt * h * 4);
        oc[bi] = dev_get(bi, dc, (size_t)nt * h * h * 4);
        B[bi]->release_weight(&fb);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "%s%snt=%d D=%d hc=%d head=%d%s", type == DS4_TYPE_F32 ? "" : type_name(type),
             type == DS4_TYPE_F32 ? "" : " ", nt, D, h, head, with_f ? " +update" : "");
    /* the update: as hc_post (ULP); y, post, comb: sigmoids and a normalised
     * sum of the mix logits, which carry the DOT error of a K = h*D product;
     * comb also multiplies by hardware reciprocals (~2 ulp a step, Sinkhorn
     * does not amplify them): still far below DOT */
    if (with_f) check_f32("hc_pre x", shape, ox[0], ox[1], (size_t)nt * K, TOL_ULP);
    check_f32("hc_pre y", shape, oy[0], oy[1], (size_t)nt * D, TOL_DOT);
    if (!head) {
        check_f32("hc_pre post", shape, op[0], op[1], (size_t)nt * h, TOL_DOT);
        check_f32("hc_pre comb", shape, oc[0], oc[1], (size_t)nt * h * h, TOL_DOT);
    }
    for (int bi = 0; bi < 2; bi++) { free(ox[bi]); free(oy[bi]); free(op[bi]); free(oc[bi]); }
    free(scale); free(base); free(nw); free(f); free(xr); free(x); free(post); free(comb); free_weight(&fn);
}
static void test_hc_pre(int nt, int D, int h, int head, int with_f) { test_hc_pre_t(DS4_TYPE_F32, nt, D, h, head, with_f); }

/* matmul_multi: n projections of one x, optionally through the input norm and
 * with ape tables on some of them.  types[i] lets one call mix types (the
 * backend must split it); rows[i] the matrices' heights. */
static void test_matmul_multi(int n, const int *types, const int *rows, int64_t K, int nt, int with_norm,
                              int with_tab, int pos0, int period) {
    ds4_weight w[DS4_MULTI_MAX];
    float *tab[DS4_MULTI_MAX];
    for (int i = 0; i < n; i++) {
        w[i] = make_weight(types[i], K, rows[i], 1, 1.0f / sqrtf((float)K));
        tab[i] = with_tab && i % 2 == 1 ? rnd_vec((size_t)period * rows[i], 1.0f) : NULL;
    }
    float *x = rnd_vec((size_t)nt * K, 2.0f), *nw = rnd_vec(K, 1.0f);
    float *out[2][DS4_MULTI_MAX];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight wb[DS4_MULTI_MAX];
        const ds4_weight *wp[DS4_MULTI_MAX];
        float *dy[DS4_MULTI_MAX];
        const float *dt[DS4_MULTI_MAX];
        for (int i = 0; i < n; i++) {
            wb[i] = weight_on(bi, &w[i]);
            wp[i] = &wb[i];
            dy[i] = dev_poison(bi, (size_t)nt * rows[i]);
            dt[i] = tab[i] ? dev_put(bi, tab[i], (size_t)period * rows[i] * 4) : NULL;
        }
        float *dx = dev_put(bi, x, (size_t)nt * K * 4);
        float *dn = with_norm ? dev_put(bi, nw, (size_t)K * 4) : NULL;
        B[bi]->matmul_multi(n, wp, dy, dx, nt, dn, 1e-6f, with_tab ? dt : NULL, at(bi, pos0), period);
        for (int i = 0; i < n; i++) {
            out[bi][i] = dev_get(bi, dy[i], (size_t)nt * rows[i] * 4);
            B[bi]->release_weight(&wb[i]);
        }
        dev_free_all(bi);
    }
    for (int i = 0; i < n; i++) {
        char shape[96];
        snprintf(shape, sizeof shape, "%d/%d %s K=%lld N=%d nt=%d%s%s", i, n, type_name(types[i]), (long long)K,
                 rows[i], nt, with_norm ? " norm" : "", tab[i] ? " +ape" : "");
        check_f32("matmul_multi", shape, out[0][i], out[1][i], (size_t)nt * rows[i], TOL_DOT);
        free(out[0][i]); free(out[1][i]); free(tab[i]); free_weight(&w[i]);
    }
    free(x); free(nw);
}

/* nh2 > 0: a second tensor of nh2 heads with its own weights in the same
 * call (the layer's queries and key/value row). */
static void test_head_norm_rope(int nt, int nh, int dh, int n_rot, int pos0, int with_w, int yarn, int nh2) {
    const ds4_rope rp = test_rope_params(n_rot, yarn);
    const size_t n = (size_t)nt * nh * dh, n2 = (size_t)nt * nh2 * dh;
    float *x = rnd_vec(n, 3.0f), *w = rnd_vec(dh, 1.0f);
    float *x2 = rnd_vec(n2 ? n2 : 1, 2.0f), *w2 = rnd_vec(dh, 1.0f);
    float *out[2], *out2[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dx = dev_put(bi, x, n * 4);
        float *dw = with_w ? dev_put(bi, w, (size_t)dh * 4) : NULL;
        float *dx2 = nh2 > 0 ? dev_put(bi, x2, n2 * 4) : NULL;
        float *dw2 = nh2 > 0 ? dev_put(bi, w2, (size_t)dh * 4) : NULL;
        B[bi]->head_norm_rope(dx, dw, nt, nh, dx2, dw2, nh2, dh, 1e-6f, at(bi, pos0), &rp);
        out[bi] = dev_get(bi, dx, n * 4);
        out2[bi] = nh2 > 0 ? dev_get(bi, dx2, n2 * 4) : NULL;
        dev_free_all(bi);
    }
    char shape[112];
    snprintf(shape, sizeof shape, "nt=%d nh=%d dh=%d rot=%d pos=%d%s%s%s", nt, nh, dh, n_rot, pos0,
             with_w ? " w" : "", yarn ? " yarn" : "", nh2 > 0 ? " +x2" : "");
    /* the norm's final roundings, then rope's libm-vs-CUDA sin/cos (as test_rope) */
    check_f32("head_norm_rope", shape, out[0], out[1], n, TOL_ULP);
    if (nh2 > 0) check_f32("head_norm_rope x2", shape, out2[0], out2[1], n2, TOL_ULP);
    free(out[0]); free(out[1]); free(out2[0]); free(out2[1]); free(x); free(w); free(x2); free(w2);
}

/* compressor_step: pooled, normalised, rotated rows at their place in the
 * row buffer (every other row untouched), and both state rings. */
static void test_compressor_step(int pos0, int nt, int ratio, int c, int dc, int n_rot) {
    const ds4_rope rp = test_rope_params(n_rot, 1);
    const int width = c * dc, slots = c * ratio;
    const int n_rows = (pos0 + nt) / ratio + 2;
    float *kv = rnd_vec((size_t)nt * width, 1.0f), *sc = rnd_vec((size_t)nt * width, 3.0f);
    float *skv = rnd_vec((size_t)slots * width, 1.0f), *ssc = rnd_vec((size_t)slots * width, 3.0f);
    float *rows = rnd_vec((size_t)n_rows * dc, 1.0f), *nw = rnd_vec(dc, 1.0f);
    float *o_rows[2], *o_kv[2], *o_sc[2];
    for (int bi = 0; bi < 2; bi++) {
        float *a = dev_put(bi, kv, (size_t)nt * width * 4), *b = dev_put(bi, sc, (size_t)nt * width * 4);
        float *sa = dev_put(bi, skv, (size_t)slots * width * 4), *sb = dev_put(bi, ssc, (size_t)slots * width * 4);
        float *dr = dev_put(bi, rows, (size_t)n_rows * dc * 4), *dn = dev_put(bi, nw, (size_t)dc * 4);
        B[bi]->compressor_step(a, b, sa, sb, at(bi, pos0), nt, ratio, c, dc, dn, 1e-6f, &rp, dr);
        o_rows[bi] = dev_get(bi, dr, (size_t)n_rows * dc * 4);
        o_kv[bi] = dev_get(bi, sa, (size_t)slots * width * 4);
        o_sc[bi] = dev_get(bi, sb, (size_t)slots * width * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "pos0=%d nt=%d ratio=%d c=%d dc=%d emit=%d", pos0, nt, ratio, c, dc,
             (pos0 + nt) / ratio - pos0 / ratio);
    /* compress_pool's ULP error, a norm and a rotation: still ULP-sized */
    check_f32("compressor_step rows", shape, o_rows[0], o_rows[1], (size_t)n_rows * dc, TOL_ULP);
    check_f32("compressor_step st", shape, o_kv[0], o_kv[1], (size_t)slots * width, TOL_EXACT);
    check_f32("compressor_step st", shape, o_sc[0], o_sc[1], (size_t)slots * width, TOL_EXACT);
    for (int bi = 0; bi < 2; bi++) { free(o_rows[bi]); free(o_kv[bi]); free(o_sc[bi]); }
    free(kv); free(sc); free(skv); free(ssc); free(rows); free(nw);
}

/* A decode run on fixed buffers, as a captured step replays it: one step
 * block per backend, rewritten before every step, and the same op arguments
 * (every pointer, count and shape) at every position.  Each step draws new
 * q, kv and compressor rows, runs compressor_steps (ratio > 0) and
 * attention_step, and keeps the output.  `steps` positions from 0 cross the
 * window wrap (p = W), every block the compressor closes (p % ratio ==
 * ratio - 1: the emit steps) and the position at which attention first
 * splits its rows (more than 32 rows), and, for ratio 4, the picks of
 * visible rows as they appear.  Compared at the end: every step's output,
 * the window ring, the compressed rows and the compressor state. */
static void test_decode_run(int W, int H, int d, int ratio, int k, int steps) {
    const ds4_rope rp = test_rope_params(d >= 128 ? 64 : 16, ratio != 0);
    const int c = ratio == 4 ? 2 : 1, width = c * d, slots = c * ratio;
    const int n_comp = ratio ? steps / ratio + 1 : 1;
    const size_t nq = (size_t)H * d;
    float *sinks = rnd_vec(H, 2.0f), *nw = rnd_vec(d, 1.0f);
    float *outs[2];
    float *q[2], *kv[2], *ckv[2], *csc[2], *ring[2], *comp[2], *skv[2], *ssc[2], *sk[2], *nwd[2], *y[2];
    int32_t *tk[2];
    ds4_step *st[2];
    for (int bi = 0; bi < 2; bi++) {
        outs[bi] = malloc((size_t)steps * nq * sizeof(float));
        q[bi] = dev_poison(bi, nq);
        kv[bi] = dev_poison(bi, d);
        ckv[bi] = dev_poison(bi, width > 0 ? width : 1);
        csc[bi] = dev_poison(bi, width > 0 ? width : 1);
        float *z = calloc((size_t)W * d + (size_t)n_comp * d + 2 * (size_t)(slots > 0 ? slots : 1) * (width > 0 ? width : 1), 4);
        ring[bi] = dev_put(bi, z, (size_t)W * d * 4);
        comp[bi] = dev_put(bi, z, (size_t)n_comp * d * 4);
        skv[bi] = dev_put(bi, z, (size_t)(slots > 0 ? slots : 1) * (width > 0 ? width : 1) * 4);
        ssc[bi] = dev_put(bi, z, (size_t)(slots > 0 ? slots : 1) * (width > 0 ? width : 1) * 4);
        free(z);
        sk[bi] = dev_put(bi, sinks, (size_t)H * 4);
        nwd[bi] = dev_put(bi, nw, (size_t)d * 4);
        tk[bi] = (int32_t *)dev_poison_i32(bi, k > 0 ? k : 1);
        y[bi] = dev_poison(bi, nq);
        st[bi] = (ds4_step *)dev_alloc(bi, sizeof(ds4_step));
    }
    for (int p = 0; p < steps; p++) {
        float *hq = rnd_vec(nq, 1.0f), *hkv = rnd_vec(d, 1.0f);
        float *hckv = rnd_vec(width, 1.0f), *hcsc = rnd_vec(width, 3.0f);
        int32_t *htk = ratio == 4 ? rnd_topk(p, 1, k) : NULL;
        const ds4_step hs = { p, 1, 0, 0 };
        for (int bi = 0; bi < 2; bi++) {
            B[bi]->upload(st[bi], &hs, sizeof hs);
            B[bi]->upload(q[bi], hq, nq * 4);
            B[bi]->upload(kv[bi], hkv, (size_t)d * 4);
            if (ratio) {
                B[bi]->upload(ckv[bi], hckv, (size_t)width * 4);
                B[bi]->upload(csc[bi], hcsc, (size_t)width * 4);
                const ds4_compressor cp = { ckv[bi], csc[bi], skv[bi], ssc[bi], ratio, c, d, nwd[bi], comp[bi] };
                B[bi]->compressor_steps(1, &cp, st[bi], 1, 1e-6f, &rp);
            }
            if (htk) B[bi]->upload(tk[bi], htk, (size_t)k * 4);
            B[bi]->attention_step(q[bi], kv[bi], ring[bi], W, st[bi], 1, H, d, ratio ? comp[bi] : NULL, ratio,
                                  ratio == 4 ? tk[bi] : NULL, ratio == 4 ? k : 0, sk[bi], 1.0f / sqrtf((float)d),
                                  &rp, y[bi]);
            B[bi]->download(outs[bi] + (size_t)p * nq, y[bi], nq * 4);
        }
        free(hq); free(hkv); free(hckv); free(hcsc); free(htk);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "W=%d H=%d d=%d ratio=%d k=%d steps=0..%d", W, H, d, ratio, k, steps - 1);
    /* as attention_step (CHAIN), on compressed rows that carry compressor_step's ULP error */
    check_f32("decode run: attention_step", shape, outs[0], outs[1], (size_t)steps * nq, TOL_CHAIN);
    float *r0 = dev_get(0, ring[0], (size_t)W * d * 4), *r1 = dev_get(1, ring[1], (size_t)W * d * 4);
    check_f32("decode run: window ring", shape, r0, r1, (size_t)W * d, TOL_EXACT);
    free(r0); free(r1);
    if (ratio) {
        float *c0 = dev_get(0, comp[0], (size_t)n_comp * d * 4), *c1 = dev_get(1, comp[1], (size_t)n_comp * d * 4);
        check_f32("decode run: compressed rows", shape, c0, c1, (size_t)n_comp * d, TOL_ULP);
        free(c0); free(c1);
        float *s0 = dev_get(0, ssc[0], (size_t)slots * width * 4), *s1 = dev_get(1, ssc[1], (size_t)slots * width * 4);
        check_f32("decode run: compressor state", shape, s0, s1, (size_t)slots * width, TOL_EXACT);
        free(s0); free(s1);
    }
    for (int bi = 0; bi < 2; bi++) { free(outs[bi]); dev_free_all(bi); }
    free(sinks); free(nw);
}

/* compressor_steps: a ratio-4 layer's two compressors (kv: ratio, c = 2 for
 * ratio 4, width dc0; indexer: ratio 4, c = 2, dc1) in one call, each checked as
 * test_compressor_step checks one. */
static void test_compressor_steps(int pos0, int nt, int ratio, int dc0, int dc1) {
    const ds4_rope rp = test_rope_params(64 <= dc1 ? 64 : dc1 / 2, 1);
    const int rt[2] = { ratio, 4 }, cc[2] = { ratio == 4 ? 2 : 1, 2 }, dcs[2] = { dc0, dc1 };
    float *kv[2], *sc[2], *skv[2], *ssc[2], *rows[2], *nw[2];
    int width[2], slots[2], n_rows[2];
    for (int j = 0; j < 2; j++) {
        width[j] = cc[j] * dcs[j]; slots[j] = cc[j] * rt[j]; n_rows[j] = (pos0 + nt) / rt[j] + 2;
        kv[j] = rnd_vec((size_t)nt * width[j], 1.0f); sc[j] = rnd_vec((size_t)nt * width[j], 3.0f);
        skv[j] = rnd_vec((size_t)slots[j] * width[j], 1.0f); ssc[j] = rnd_vec((size_t)slots[j] * width[j], 3.0f);
        rows[j] = rnd_vec((size_t)n_rows[j] * dcs[j], 1.0f); nw[j] = rnd_vec(dcs[j], 1.0f);
    }
    float *o_rows[2][2], *o_kv[2][2], *o_sc[2][2];   /* [backend][compressor] */
    for (int bi = 0; bi < 2; bi++) {
        ds4_compressor cs[2];
        for (int j = 0; j < 2; j++) {
            cs[j].kv = dev_put(bi, kv[j], (size_t)nt * width[j] * 4);
            cs[j].sc = dev_put(bi, sc[j], (size_t)nt * width[j] * 4);
            cs[j].st_kv = dev_put(bi, skv[j], (size_t)slots[j] * width[j] * 4);
            cs[j].st_sc = dev_put(bi, ssc[j], (size_t)slots[j] * width[j] * 4);
            cs[j].rows = dev_put(bi, rows[j], (size_t)n_rows[j] * dcs[j] * 4);
            cs[j].norm_w = dev_put(bi, nw[j], (size_t)dcs[j] * 4);
            cs[j].ratio = rt[j]; cs[j].c = cc[j]; cs[j].dc = dcs[j];
        }
        B[bi]->compressor_steps(2, cs, at(bi, pos0), nt, 1e-6f, &rp);
        for (int j = 0; j < 2; j++) {
            o_rows[bi][j] = dev_get(bi, cs[j].rows, (size_t)n_rows[j] * dcs[j] * 4);
            o_kv[bi][j] = dev_get(bi, cs[j].st_kv, (size_t)slots[j] * width[j] * 4);
            o_sc[bi][j] = dev_get(bi, cs[j].st_sc, (size_t)slots[j] * width[j] * 4);
        }
        dev_free_all(bi);
    }
    for (int j = 0; j < 2; j++) {
        char shape[96];
        snprintf(shape, sizeof shape, "[%d] pos0=%d nt=%d ratio=%d dc=%d emit=%d", j, pos0, nt, rt[j], dcs[j],
                 (pos0 + nt) / rt[j] - pos0 / rt[j]);
        /* as compressor_step */
        check_f32("compressor_steps rows", shape, o_rows[0][j], o_rows[1][j], (size_t)n_rows[j] * dcs[j], TOL_ULP);
        check_f32("compressor_steps st", shape, o_kv[0][j], o_kv[1][j], (size_t)slots[j] * width[j], TOL_EXACT);
        check_f32("compressor_steps st", shape, o_sc[0][j], o_sc[1][j], (size_t)slots[j] * width[j], TOL_EXACT);
        for (int bi = 0; bi < 2; bi++) { free(o_rows[bi][j]); free(o_kv[bi][j]); free(o_sc[bi][j]); }
        free(kv[j]); free(sc[j]); free(skv[j]); free(ssc[j]); free(rows[j]); free(nw[j]);
    }
}

static void test_matmul_swiglu(int type, int64_t K, int64_t F, int nt, float limit) {
    ds4_weight g = make_weight(type, K, F, 1, 3.0f / sqrtf((float)K)), u = make_weight(type, K, F, 1, 3.0f / sqrtf((float)K));
    float *x = rnd_vec((size_t)nt * K, 2.0f);
    const size_t n = (size_t)nt * F;
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight gb = weight_on(bi, &g), ub = weight_on(bi, &u);
        float *dx = dev_put(bi, x, (size_t)nt * K * 4);
        float *dy = dev_poison(bi, n), *dg = dev_poison(bi, n), *du = dev_poison(bi, n);
        B[bi]->matmul_swiglu(&gb, &ub, dx, dy, nt, limit, dg, du);
        out[bi] = dev_get(bi, dy, n * 4);
        B[bi]->release_weight(&gb); B[bi]->release_weight(&ub);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "%s K=%lld F=%lld nt=%d L=%g", type_name(type), (long long)K, (long long)F, nt, limit);
    /* two DOT-error products through silu(g)*u: relative error stays DOT-sized */
    check_f32("matmul_swiglu", shape, out[0], out[1], n, TOL_DOT);
    free(out[0]); free(out[1]); free(x); free_weight(&g); free_weight(&u);
}

static void test_rope(int nt, int nh, int dh, int n_rot, int pos0, int step, int yarn, int inverse) {
    const ds4_rope rp = test_rope_params(n_rot, yarn);
    const size_t n = (size_t)nt * nh * dh;
    float *x = rnd_vec(n, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dx = dev_put(bi, x, n * 4);
        B[bi]->rope(dx, nt, nh, dh, at(bi, pos0), step, &rp, inverse);
        out[bi] = dev_get(bi, dx, n * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "nt=%d nh=%d dh=%d rot=%d pos0=%d step=%d%s%s", nt, nh, dh, n_rot, pos0, step,
             yarn ? " yarn" : "", inverse ? " inv" : "");
    /* identical angles (same float sequence); cosf/sinf within 2 ulp */
    check_f32("rope", shape, out[0], out[1], n, TOL_ULP);
    free(out[0]); free(out[1]); free(x);
}

/* Attention.  ratio 0: window only; 4: top-k picks (random visible ids, some
 * -1, in random order); 128: every visible compressed row. */
/* rp == NULL: the attention op.  Otherwise attention_step, which also stores
 * the ring and de-rotates by rp (d - n_rot odd, e.g. d = 49, takes the
 * unfused de-rotation). */
/* Random inputs of an attention call of nt queries at pos0: queries, kv rows, the window
 * ring, the compressed rows it may see, sinks and (ratio 4) picks. */
typedef struct {
    float *q, *kv, *ring, *comp, *sinks;
    int32_t *topk;
    int n_comp;
    float scale;
} att_inputs;

/* With g_att_spread, each kv row is scaled by its own power of two in 2^-8 .. 2^8 and the
 * queries by 8, so the rows' magnitudes differ by 2^16 and the softmax is peaked: the
 * tensor-core kernel's per-row scales and its output units (k_attention_mma) are exercised. */
static int g_att_spread;

static void att_spread_rows(float *x, int rows, int d, unsigned salt) {
    for (int r = 0; r < rows; r++) {
        const float s = ldexpf(1.0f, (int)(((unsigned)r * 2654435761u + salt) % 17u) - 8);
        for (int e = 0; e < d; e++) x[(size_t)r * d + e] *= s;
    }
}

static att_inputs att_inputs_new(int W, int pos0, int nt, int H, int d, int ratio, int k) {
    att_inputs a;
    a.n_comp = ratio ? (pos0 + nt) / ratio + 1 : 0;
    a.q = rnd_vec((size_t)nt * H * d, g_att_spread ? 8.0f : 1.0f);
    a.kv = rnd_vec((size_t)nt * d, 1.0f);
    a.ring = rnd_vec((size_t)W * d, 1.0f);
    a.comp = ratio ? rnd_vec((size_t)a.n_comp * d, 1.0f) : NULL;
    if (g_att_spread) {
        att_spread_rows(a.kv, nt, d, 1);
        att_spread_rows(a.ring, W, d, 2);
        if (a.comp) att_spread_rows(a.comp, a.n_comp, d, 3);
    }
    a.sinks = rnd_vec(H, 2.0f);
    a.topk = ratio == 4 ? rnd_topk(pos0, nt, k) : NULL;
    a.scale = 1.0f / sqrtf((float)d);
    return a;
}

static void att_inputs_free(att_inputs *a) {
    free(a->q); free(a->kv); free(a->ring); free(a->comp); free(a->sinks); free(a->topk);
}

static void test_attention_rp(int W, int pos0, int nt, int H, int d, int ratio, int k, const ds4_rope *rp) {
    att_inputs in = att_inputs_new(W, pos0, nt, H, d, ratio, k);
    const int n_comp = in.n_comp;
    float *q = in.q, *kv = in.kv, *ring = in.ring, *comp = in.comp, *sinks = in.sinks;
    int32_t *topk = in.topk;
    const float scale = in.scale;
    const size_t n = (size_t)nt * H * d;
    float *out[2], *rg[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dq = dev_put(bi, q, n * 4), *dkv = dev_put(bi, kv, (size_t)nt * d * 4);
        float *dr = dev_put(bi, ring, (size_t)W * d * 4);
        float *dc = ratio ? dev_put(bi, comp, (size_t)n_comp * d * 4) : NULL;
        int32_t *dt = topk ? dev_put(bi, topk, (size_t)nt * k * 4) : NULL;
        float *ds = dev_put(bi, sinks, (size_t)H * 4);
        float *dy = dev_poison(bi, n);
        if (rp) B[bi]->attention_step(dq, dkv, dr, W, at(bi, pos0), nt, H, d, dc, ratio, dt, ratio == 4 ? k : 0, ds, scale, rp, dy);
        else B[bi]->attention(dq, dkv, dr, W, at(bi, pos0), nt, H, d, dc, ratio, dt, ratio == 4 ? k : 0, ds, scale, dy);
        out[bi] = dev_get(bi, dy, n * 4);
        rg[bi] = dev_get(bi, dr, (size_t)W * d * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "W=%d pos0=%d nt=%d H=%d d=%d ratio=%d k=%d%s", W, pos0, nt, H, d, ratio,
             ratio == 4 ? k : 0, rp ? " step" : "");
    /* softmax CHAIN error (then, for the step, one rotation: ULP) */
    check_f32(rp ? "attention_step" : "attention", shape, out[0], out[1], n, TOL_CHAIN);
    if (rp) check_f32("attention_step ring", shape, rg[0], rg[1], (size_t)W * d, TOL_EXACT);
    for (int bi = 0; bi < 2; bi++) { free(out[bi]); free(rg[bi]); }
    att_inputs_free(&in);
}

static void test_attention(int W, int pos0, int nt, int H, int d, int ratio, int k) {
    test_attention_rp(W, pos0, nt, H, d, ratio, k, NULL);
}

static void test_attention_step(int W, int pos0, int nt, int H, int d, int ratio, int k, int n_rot, int yarn) {
    const ds4_rope rp = test_rope_params(n_rot, yarn);
    test_attention_rp(W, pos0, nt, H, d, ratio, k, &rp);
}

/* A batch of nt queries through attention_step against nt one-token calls at its positions, on
 * the CUDA backend alone, byte for byte: the outputs and the ring.  A speculative check (ds4
 * --mtp-draft) is such a batch, and its rows must be the one-token steps' (tests/test_mtp_cuda.py
 * checks whole runs on models whose head counts do not show it; Flash's 64 heads do).  pos0 is
 * chosen so that the queries of one batch see different row counts (ratio 4: a compressed row
 * more for the last). */
static void test_attention_rows_as_steps(int W, int pos0, int nt, int H, int d, int ratio, int k) {
    const int bi = 1;
    const ds4_rope rp = test_rope_params(64, 1);
    att_inputs in = att_inputs_new(W, pos0, nt, H, d, ratio, k);
    const int n_comp = in.n_comp;
    const float *q = in.q, *kv = in.kv, *ring = in.ring, *comp = in.comp, *sinks = in.sinks;
    const int32_t *topk = in.topk;
    const float scale = in.scale;
    const size_t n = (size_t)nt * H * d, row = (size_t)H * d;
    float *out[2], *rg[2];
    for (int one = 0; one < 2; one++) {
        float *dr = dev_put(bi, ring, (size_t)W * d * 4);
        float *dc = ratio ? dev_put(bi, comp, (size_t)n_comp * d * 4) : NULL;
        float *ds = dev_put(bi, sinks, (size_t)H * 4);
        out[one] = malloc(n * 4);
        for (int t0 = 0; t0 < nt; t0 += one ? 1 : nt) {
            const int m = one ? 1 : nt;
            float *dq = dev_put(bi, q + (size_t)t0 * row, (size_t)m * row * 4);
            float *dkv = dev_put(bi, kv + (size_t)t0 * d, (size_t)m * d * 4);
            int32_t *dt = topk ? dev_put(bi, topk + (size_t)t0 * k, (size_t)m * k * 4) : NULL;
            float *dy = dev_poison(bi, (size_t)m * row);
            B[bi]->attention_step(dq, dkv, dr, W, at(bi, pos0 + t0), m, H, d, dc, ratio, dt, ratio == 4 ? k : 0, ds,
                                  scale, &rp, dy);
            float *y = dev_get(bi, dy, (size_t)m * row * 4);
            memcpy(out[one] + (size_t)t0 * row, y, (size_t)m * row * 4);
            free(y);
        }
        rg[one] = dev_get(bi, dr, (size_t)W * d * 4);
        dev_free_all(bi);
    }
    char shape[120];
    snprintf(shape, sizeof shape, "rows as steps W=%d pos0=%d nt=%d H=%d d=%d ratio=%d", W, pos0, nt, H, d, ratio);
    const int ok = memcmp(out[0], out[1], n * 4) == 0 && memcmp(rg[0], rg[1], (size_t)W * d * 4) == 0;
    printf("%-15s %-44s %s\n", "attention_step", shape, ok ? "ok" : "FAIL (a batch's rows differ from one-token calls)");
    if (ok) g_pass++; else g_fail++;
    for (int i = 0; i < 2; i++) { free(out[i]); free(rg[i]); }
    att_inputs_free(&in);
}

static void test_attention_rows(void) {
    for (int nt = 2; nt <= 4; nt++) {
        test_attention_rows_as_steps(128, 37, nt, 64, 512, 0, 0);      /* the window filling */
        test_attention_rows_as_steps(128, 300, nt, 64, 512, 0, 0);
        test_attention_rows_as_steps(128, 301, nt, 64, 512, 4, 512);   /* picks among 75 or 76 visible rows */
        test_attention_rows_as_steps(128, 2046, nt, 64, 512, 128, 0);  /* a ratio-128 row more for the last */
    }
}

/* The weight products of a speculative check (2..8 tokens at decode: dense matmul, the shared
 * expert's matmul_swiglu, the routed experts) against nt one-token calls, on the CUDA backend
 * alone, byte for byte.  A check call takes its dense products in chunks of up to 4 tokens a
 * launch, and every token's row must still be a one-token step's.  which: 0 matmul, 1 matmul_swiglu,
 * 2 moe_experts (gate|up of type, down of tdown; E experts, k per token, routing skew as
 * test_routing). */
static void test_routing(int nt, int k, int E, int skew, int32_t *sel, float *wts);
static void test_products_rows_as_steps(int which, int type, int tdown, int64_t K, int64_t N, int E, int k,
                                        int nt_lo, int nt_hi, int skew) {
    const int bi = 1;
    const int ne = which == 2 ? E : 1;
    ds4_weight w = make_weight(type, K, N, ne, 1.0f / sqrtf((float)K));
    ds4_weight u = make_weight(type, K, N, ne, 1.0f / sqrtf((float)K));
    ds4_weight dn = which == 2 ? make_weight(tdown, N, K, E, 1.0f / sqrtf((float)N)) : w;
    ds4_weight wb = weight_on(bi, &w), ub = weight_on(bi, &u), db = which == 2 ? weight_on(bi, &dn) : wb;
    const int64_t nin = K, nout = which == 2 ? K : N;
    static const char *op[3] = { "matmul", "matmul_swiglu", "moe_experts" };
    char tn[32];
    if (which < 2 || tdown == type) snprintf(tn, sizeof tn, "%s", type_name(type));
    else snprintf(tn, sizeof tn, "%s/%s", type_name(type), type_name(tdown));
    for (int nt = nt_lo; nt <= nt_hi; nt++) {
        float *x = rnd_vec((size_t)nt * nin, 2.0f);
        int32_t *sel = malloc((size_t)nt * k * sizeof(int32_t));
        float *wts = malloc((size_t)nt * k * sizeof(float));
        if (which == 2) test_routing(nt, k, E, skew, sel, wts);
        float *out[2];
        for (int one = 0; one < 2; one++) {
            out[one] = malloc((size_t)nt * nout * 4);
            for (int t0 = 0; t0 < nt; t0 += one ? 1 : nt) {
                const int m = one ? 1 : nt;
                float *dx = dev_put(bi, x + (size_t)t0 * nin, (size_t)m * nin * 4);
                float *dy = dev_poison(bi, (size_t)m * nout);
                if (which == 0) {
                    B[bi]->matmul(&wb, 0, dx, dy, m);
                } else if (which == 1) {
                    float *dg = dev_poison(bi, (size_t)m * N), *du = dev_poison(bi, (size_t)m * N);
                    B[bi]->matmul_swiglu(&wb, &ub, dx, dy, m, 10.0f, dg, du);
                } else {
                    int32_t *ds = dev_put(bi, sel + (size_t)t0 * k, (size_t)m * k * 4);
                    float *dw = dev_put(bi, wts + (size_t)t0 * k, (size_t)m * k * 4);
                    B[bi]->moe_experts(dx, ds, dw, &wb, &ub, &db, m, k, 10.0f, NULL, dy);
                }
                float *y = dev_get(bi, dy, (size_t)m * nout * 4);
                memcpy(out[one] + (size_t)t0 * nout, y, (size_t)m * nout * 4);
                free(y);
                dev_free_all(bi);
            }
        }
        char shape[120];
        if (which == 2)
            snprintf(shape, sizeof shape, "rows as steps %s D=%lld F=%lld E=%d k=%d nt=%d%s", tn, (long long)K,
                     (long long)N, E, k, nt, skew == 1 ? " same experts" : "");
        else
            snprintf(shape, sizeof shape, "rows as steps %s K=%lld N=%lld nt=%d", tn, (long long)K, (long long)N, nt);
        const int ok = memcmp(out[0], out[1], (size_t)nt * nout * 4) == 0;
        printf("%-15s %-44s %s\n", op[which], shape, ok ? "ok" : "FAIL (a batch's rows differ from one-token calls)");
        if (ok) g_pass++; else g_fail++;
        free(out[0]); free(out[1]); free(x); free(sel); free(wts);
    }
    B[bi]->release_weight(&wb); B[bi]->release_weight(&ub);
    if (which == 2) { B[bi]->release_weight(&db); free_weight(&dn); }
    free_weight(&w); free_weight(&u);
}

static void test_products_rows(void) {
    const int dense[7] = { DS4_TYPE_Q8_0, DS4_TYPE_F16, DS4_TYPE_F32, DS4_TYPE_BF16,
                           DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, DS4_TYPE_Q4_K };
    for (int ti = 0; ti < 7; ti++) test_products_rows_as_steps(0, dense[ti], dense[ti], 4096, 300, 1, 1, 2, 8, 0);
    for (int ti = 0; ti < 4; ti++) test_products_rows_as_steps(1, dense[ti], dense[ti], 4096, 1024, 1, 1, 2, 4, 0);
    /* Flash's experts (D = 4096, F = 2048) at 16 of them, as flash16 has: tokens share experts;
     * 64 experts at a smaller F; the published types */
    test_products_rows_as_steps(2, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 2, 8, 0);
    test_products_rows_as_steps(2, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 2, 4, 1);   /* all on experts 0..5 */
    test_products_rows_as_steps(2, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, 4096, 512, 64, 6, 2, 4, 0);
    test_products_rows_as_steps(2, DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 16, 6, 2, 4, 0);
    test_products_rows_as_steps(2, DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, 4096, 1024, 16, 6, 2, 4, 0);
    test_products_rows_as_steps(2, DS4_TYPE_F32, DS4_TYPE_F32, 1024, 1024, 8, 4, 2, 4, 0);
    test_products_rows_as_steps(2, DS4_TYPE_F16, DS4_TYPE_F16, 1024, 1024, 8, 4, 2, 4, 1);
    test_products_rows_as_steps(2, DS4_TYPE_BF16, DS4_TYPE_BF16, 1024, 1024, 8, 4, 2, 4, 0);
}

/* attention_probs (the attn_probs hook): the weight attention gives each row a query
 * attended, then the sink's share, in rows of pitch ld sized as the core sizes them (ds4.c
 * hooks_open: W + max(k, n_ctx/128 + 1) + 1 for the session's n_ctx; the CUDA op checks the
 * pitch against its session).  Run as a captured step replays it: fixed buffers and
 * arguments, one step block rewritten for each position of `pos`, fresh inputs each time.
 * Checked per position, on the ds4_att_rows + 1 columns of every (query, head) (the rest
 * stays NaN and is not compared):
 *   - CUDA against the CPU with the attention op's tolerance (CHAIN): a weight is the very
 *     exp(s_i - m) / den the attention op multiplies row i by, with the same error sources
 *     (scores with DOT error through expf; both backends sum den in double);
 *   - each row of weights sums to 1 within PROBS_SUM_TOL, on both backends: every weight is
 *     fl(e_i * inv) with inv = fl(1/den) and den the (double, near-exact) sum of the e_i and
 *     the sink's term, so sum_i w_i = (1 + d_inv)(1 + a weighted mean of the products'
 *     roundings), |sum - 1| <= ~2 * 2^-24 = 1.2e-7 whatever the row count; 1e-6 leaves a
 *     factor of 8 and still catches a dropped or doubled column (an error ~ its weight);
 *   - an empty ratio-4 pick (-1) weighs exactly 0 on both;
 *   - a second CUDA run on the same inputs is bit-identical. */
#define PROBS_SUM_TOL 1e-6
static int g_n_ctx;   /* the sessions' n_ctx (main) */
static void check_same(const char *what, const void *a, const void *b, size_t bytes);

static void test_attention_probs(int W, int H, int d, int ratio, int k, int nt, int n_pos, const int *pos) {
    if (!B[0]->attention_probs || !B[1]->attention_probs) {
        printf("%-15s %-44s FAIL (the %s backend has no attention_probs)\n", "attention_probs", "",
               B[0]->attention_probs ? B[1]->name : B[0]->name);
        g_fail++;
        return;
    }
    const int kk = ratio == 4 ? k : 0, n128 = g_n_ctx / 128 + 1;
    const int ld = W + (kk > n128 ? kk : n128) + 1;
    int P_last = 0;
    for (int i = 0; i < n_pos; i++)
        if (pos[i] + nt - 1 > P_last) P_last = pos[i] + nt - 1;
    const int n_comp = ratio ? (P_last + 1) / ratio + 1 : 1;
    const size_t nq = (size_t)nt * H * d, np = (size_t)nt * H * ld;
    const float scale = 1.0f / sqrtf((float)d);
    float *sinks = rnd_vec(H, 2.0f);
    float *nan_h = malloc(np * sizeof(float));
    for (size_t i = 0; i < np; i++) nan_h[i] = NAN;
    float *q[2], *kv[2], *ring[2], *comp[2], *sk[2], *pr[2];
    int32_t *tk[2];
    ds4_step *st[2];
    for (int bi = 0; bi < 2; bi++) {
        q[bi] = dev_alloc(bi, nq * 4);
        kv[bi] = dev_alloc(bi, (size_t)nt * d * 4);
        ring[bi] = dev_alloc(bi, (size_t)W * d * 4);
        comp[bi] = dev_alloc(bi, (size_t)n_comp * d * 4);
        tk[bi] = dev_alloc(bi, (size_t)nt * (kk > 0 ? kk : 1) * 4);
        sk[bi] = dev_put(bi, sinks, (size_t)H * 4);
        pr[bi] = dev_alloc(bi, np * 4);
        st[bi] = dev_alloc(bi, sizeof(ds4_step));
    }
    for (int pi = 0; pi < n_pos; pi++) {
        const int pos0 = pos[pi];
        float *hq = rnd_vec(nq, 1.0f), *hkv = rnd_vec((size_t)nt * d, 1.0f);
        float *hr = rnd_vec((size_t)W * d, 1.0f), *hc = rnd_vec((size_t)n_comp * d, 1.0f);
        int32_t *htk = ratio == 4 ? rnd_topk(pos0, nt, k) : NULL;
        ds4_step hs;
        memset(&hs, 0, sizeof hs);
        hs.pos0 = pos0;
        hs.nt = nt;
        float *out[3];
        for (int run = 0; run < 3; run++) {    /* CPU, CUDA, CUDA again */
            const int bi = run ? 1 : 0;
            B[bi]->upload(st[bi], &hs, sizeof hs);
            B[bi]->upload(q[bi], hq, nq * 4);
            B[bi]->upload(kv[bi], hkv, (size_t)nt * d * 4);
            B[bi]->upload(ring[bi], hr, (size_t)W * d * 4);
            B[bi]->upload(comp[bi], hc, (size_t)n_comp * d * 4);
            if (htk) B[bi]->upload(tk[bi], htk, (size_t)nt * k * 4);
            B[bi]->upload(pr[bi], nan_h, np * 4);
            B[bi]->attention_probs(q[bi], kv[bi], ring[bi], W, st[bi], nt, H, d, ratio ? comp[bi] : NULL, ratio,
                                   htk ? tk[bi] : NULL, kk, sk[bi], scale, pr[bi], ld);
            out[run] = dev_get(bi, pr[bi], np * 4);
        }
        /* the used columns, gathered; the row sums; the empty picks */
        size_t n_used = 0;
        for (int t = 0; t < nt; t++) n_used += (size_t)H * (ds4_att_rows(pos0 + t, W, ratio, kk) + 1);
        float *ref = malloc(n_used * sizeof(float)), *got = malloc(n_used * sizeof(float));
        double worst[2] = { 0.0, 0.0 };
        size_t o = 0, n_empty = 0, bad_empty = 0;
        for (int t = 0; t < nt; t++) {
            const int P = pos0 + t, cols = ds4_att_rows(P, W, ratio, kk) + 1, n_win = ds4_win_rows(P, W);
            for (int h = 0; h < H; h++) {
                const size_t row = ((size_t)t * H + h) * ld;
                for (int bi = 0; bi < 2; bi++) {
                    double s = 0.0;
                    for (int c = 0; c < cols; c++) s += out[bi][row + c];
                    const double e = fabs(s - 1.0);
                    if (isnan(e) || e > worst[bi]) worst[bi] = isnan(e) ? INFINITY : e;
                }
                for (int j = 0; htk && j < k; j++) {
                    if (htk[(size_t)t * k + j] >= 0) continue;
                    n_empty++;
                    bad_empty += out[0][row + n_win + j] != 0.0f || out[1][row + n_win + j] != 0.0f;
                }
                memcpy(ref + o, out[0] + row, (size_t)cols * sizeof(float));
                memcpy(got + o, out[1] + row, (size_t)cols * sizeof(float));
                o += (size_t)cols;
            }
        }
        char shape[96];
        snprintf(shape, sizeof shape, "W=%d pos0=%d nt=%d H=%d d=%d ratio=%d k=%d", W, pos0, nt, H, d, ratio, kk);
        /* the attention op's tolerance (CHAIN), see above */
        check_f32("attention_probs", shape, ref, got, n_used, TOL_CHAIN);
        const int ok = worst[0] <= PROBS_SUM_TOL && worst[1] <= PROBS_SUM_TOL && bad_empty == 0;
        printf("%-15s %-44s max|sum-1| cpu %8.2e cuda %8.2e  tol %7.1e  empty picks 0: %zu/%zu  %s\n",
               "probs sum", shape, worst[0], worst[1], PROBS_SUM_TOL, n_empty - bad_empty, n_empty,
               ok ? "ok" : "FAIL");
        if (ok) g_pass++; else g_fail++;
        char what[128];
        snprintf(what, sizeof what, "attention_probs %s", shape);
        check_same(what, out[1], out[2], np * sizeof(float));
        free(ref); free(got);
        for (int run = 0; run < 3; run++) free(out[run]);
        free(hq); free(hkv); free(hr); free(hc); free(htk);
    }
    for (int bi = 0; bi < 2; bi++) dev_free_all(bi);
    free(sinks); free(nan_h);
}

static void test_ring_store(int slots, int width, int pos0, int nt) {
    float *ring0 = rnd_vec((size_t)slots * width, 1.0f), *rows = rnd_vec((size_t)nt * width, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dr = dev_put(bi, ring0, (size_t)slots * width * 4);
        float *dx = dev_put(bi, rows, (size_t)nt * width * 4);
        B[bi]->ring_store(dr, dx, slots, width, at(bi, pos0), nt);
        out[bi] = dev_get(bi, dr, (size_t)slots * width * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "slots=%d width=%d pos0=%d nt=%d", slots, width, pos0, nt);
    check_f32("ring_store", shape, out[0], out[1], (size_t)slots * width, TOL_EXACT);
    free(out[0]); free(out[1]); free(ring0); free(rows);
}

static void test_add_cyclic(int pos0, int nt, int period, int n) {
    float *x = rnd_vec((size_t)nt * n, 1.0f), *table = rnd_vec((size_t)period * n, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dx = dev_put(bi, x, (size_t)nt * n * 4);
        float *dt = dev_put(bi, table, (size_t)period * n * 4);
        B[bi]->add_cyclic(dx, dt, at(bi, pos0), nt, period, n);
        out[bi] = dev_get(bi, dx, (size_t)nt * n * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "pos0=%d nt=%d period=%d n=%d", pos0, nt, period, n);
    check_f32("add_cyclic", shape, out[0], out[1], (size_t)nt * n, TOL_EXACT);   /* one add each */
    free(out[0]); free(out[1]); free(x); free(table);
}

static void test_compress_pool(int pos0, int nt, int ratio, int c, int dc) {
    const int width = c * dc, slots = c * ratio;
    const int n_out = (pos0 + nt) / ratio - pos0 / ratio;
    float *kv = rnd_vec((size_t)nt * width, 1.0f), *sc = rnd_vec((size_t)nt * width, 3.0f);
    float *skv = rnd_vec((size_t)slots * width, 1.0f), *ssc = rnd_vec((size_t)slots * width, 3.0f);
    const size_t n = (size_t)(n_out > 0 ? n_out : 0) * dc;
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *a = dev_put(bi, kv, (size_t)nt * width * 4), *b = dev_put(bi, sc, (size_t)nt * width * 4);
        float *sa = dev_put(bi, skv, (size_t)slots * width * 4), *sb = dev_put(bi, ssc, (size_t)slots * width * 4);
        float *dy = dev_poison(bi, n + 1);
        B[bi]->compress_pool(a, b, sa, sb, at(bi, pos0), nt, ratio, c, dc, dy);
        out[bi] = dev_get(bi, dy, n * 4 + 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "pos0=%d nt=%d ratio=%d c=%d dc=%d rows=%d", pos0, nt, ratio, c, dc, n_out);
    /* softmax over at most 2*ratio entries: expf ulps and a short sum */
    check_f32("compress_pool", shape, out[0], out[1], n, TOL_ULP);
    /* the element after the last row must stay untouched (NaN) on both */
    if (!isnan(out[1][n])) { printf("compress_pool   wrote past its %d rows  FAIL\n", n_out); g_fail++; }
    free(out[0]); free(out[1]); free(kv); free(sc); free(skv); free(ssc);
}

/* Indexer: the selections must match, except where the two rows' scores tie
 * to within float rounding (scores are f32 dot products summed in different
 * orders on the two sides, so a near-tie can break either way).  Such swaps
 * are checked against scores recomputed in double and accepted only when the
 * two rows' true scores differ by less than 1e-5 of the largest score. */
static double ix_score_d(const float *q, const float *w, const float *rows, int t, int r, int Hi, int di) {
    double acc = 0.0;
    for (int h = 0; h < Hi; h++) {
        double dot = 0.0;
        for (int c = 0; c < di; c++) dot += (double)q[((size_t)t * Hi + h) * di + c] * rows[(size_t)r * di + c];
        acc += (double)w[(size_t)t * Hi + h] * (dot > 0 ? dot : 0);
    }
    return acc;
}

/* n_rot > 0: indexer_step (the queries rotated first, as the forward pass
 * does); the tie check then scores with the CPU's rotated queries. */
static void test_indexer_rp(int pos0, int nt, int Hi, int di, int ratio, int k, int n_rot) {
    const ds4_rope rp = test_rope_params(n_rot, 1);
    const int n_rows = (pos0 + nt) / ratio + 1;
    /* raw head weights and the forward pass's scale, applied inside the op */
    const float w_scale = 1.0f / sqrtf((float)di * (float)Hi);
    float *q = rnd_vec((size_t)nt * Hi * di, 1.0f), *w = rnd_vec((size_t)nt * Hi, 1.0f);
    float *rows = rnd_vec((size_t)n_rows * di, 1.0f);
    float *qs = NULL;                /* the queries as scored (indexer_step: rotated) */
    int32_t *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dq = dev_put(bi, q, (size_t)nt * Hi * di * 4), *dw = dev_put(bi, w, (size_t)nt * Hi * 4);
        float *dr = dev_put(bi, rows, (size_t)n_rows * di * 4);
        int32_t *dy = dev_poison_i32(bi, (size_t)nt * k);
        if (n_rot > 0) {
            B[bi]->indexer_step(dq, dw, w_scale, dr, at(bi, pos0), nt, Hi, di, ratio, k, &rp, dy);
            if (bi == 0) qs = dev_get(bi, dq, (size_t)nt * Hi * di * 4);   /* rotated in place: what was scored */
        } else {
            B[bi]->indexer_topk(dq, dw, w_scale, dr, at(bi, pos0), nt, Hi, di, ratio, k, dy);
        }
        out[bi] = dev_get(bi, dy, (size_t)nt * k * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "pos0=%d nt=%d Hi=%d di=%d ratio=%d k=%d%s", pos0, nt, Hi, di, ratio, k,
             n_rot > 0 ? " step" : "");
    size_t exact_bad = 0, near_ties = 0;
    for (int t = 0; t < nt; t++) {
        for (int j = 0; j < k; j++) {
            const int32_t a = out[0][(size_t)t * k + j], b = out[1][(size_t)t * k + j];
            if (a == b) continue;
            if (a < 0 || b < 0) { exact_bad++; continue; }
            double smax = 1e-30;
            for (int jj = 0; jj < k && out[0][(size_t)t * k + jj] >= 0; jj++) {
                const double s = fabs(ix_score_d(qs ? qs : q, w, rows, t, out[0][(size_t)t * k + jj], Hi, di));
                if (s > smax) smax = s;
            }
            const double sa = ix_score_d(qs ? qs : q, w, rows, t, a, Hi, di), sb = ix_score_d(qs ? qs : q, w, rows, t, b, Hi, di);
            if (fabs(sa - sb) <= 1e-5 * smax) near_ties++; else exact_bad++;
        }
    }
    printf("%-15s %-44s mismatches %zu (+%zu near-tie swaps) / %zu  %s\n", n_rot > 0 ? "indexer_step" : "indexer_topk", shape,
           exact_bad, near_ties, (size_t)nt * k, exact_bad ? "FAIL" : "ok");
    if (exact_bad) g_fail++; else g_pass++;
    free(out[0]); free(out[1]); free(q); free(qs); free(w); free(rows);
}

static void test_indexer(int pos0, int nt, int Hi, int di, int ratio, int k) {
    test_indexer_rp(pos0, nt, Hi, di, ratio, k, 0);
}

/* A batch of nt queries against nt one-query calls at their positions, on the CUDA backend
 * alone: the selections byte for byte.  A prompt's batch (from 8 queries) is scored by
 * k_indexer_tiles, a single query by k_indexer_scores; the two compute the same score bits, so
 * even rows whose scores nearly tie come out in the same order.  n_rot > 0: indexer_step. */
static void test_indexer_rows_as_steps(int pos0, int nt, int Hi, int di, int k, int n_rot) {
    const int bi = 1, ratio = 4;
    const ds4_rope rp = test_rope_params(n_rot, 1);
    const int n_rows = (pos0 + nt) / ratio + 1;
    const float w_scale = 1.0f / sqrtf((float)di * (float)Hi);
    float *q = rnd_vec((size_t)nt * Hi * di, 1.0f), *w = rnd_vec((size_t)nt * Hi, 1.0f);
    float *rows = rnd_vec((size_t)n_rows * di, 1.0f);
    ds4_step *st = calloc((size_t)nt, sizeof *st);
    for (int t = 0; t < nt; t++) st[t].pos0 = pos0 + t;
    int32_t *out[2];
    for (int one = 0; one < 2; one++) {
        float *dq = dev_put(bi, q, (size_t)nt * Hi * di * 4), *dw = dev_put(bi, w, (size_t)nt * Hi * 4);
        float *dr = dev_put(bi, rows, (size_t)n_rows * di * 4);
        const ds4_step *ds = dev_put(bi, st, (size_t)nt * sizeof *st);
        int32_t *dy = dev_poison_i32(bi, (size_t)nt * k);
        for (int t0 = 0; t0 < nt; t0 += one ? 1 : nt) {
            const int m = one ? 1 : nt;
            float *qt = dq + (size_t)t0 * Hi * di, *wt = dw + (size_t)t0 * Hi;
            if (n_rot > 0) B[bi]->indexer_step(qt, wt, w_scale, dr, ds + t0, m, Hi, di, ratio, k, &rp, dy + (size_t)t0 * k);
            else B[bi]->indexer_topk(qt, wt, w_scale, dr, ds + t0, m, Hi, di, ratio, k, dy + (size_t)t0 * k);
        }
        out[one] = dev_get(bi, dy, (size_t)nt * k * 4);
        dev_free_all(bi);
    }
    char shape[120];
    snprintf(shape, sizeof shape, "rows as steps pos0=%d nt=%d Hi=%d di=%d k=%d%s", pos0, nt, Hi, di, k,
             n_rot > 0 ? " step" : "");
    const int ok = memcmp(out[0], out[1], (size_t)nt * k * 4) == 0;
    printf("%-15s %-44s %s\n", n_rot > 0 ? "indexer_step" : "indexer_topk", shape,
           ok ? "ok" : "FAIL (a batch's selections differ from one-query calls)");
    if (ok) g_pass++; else g_fail++;
    free(out[0]); free(out[1]); free(q); free(w); free(rows); free(st);
}

/* A hash layer's tid2eid table, I32 {k, V}: row v = (v*mult + 3j) % E, or an
 * empty weight (host NULL) when !hash. */
static ds4_weight make_tid2eid(int V, int k, int E, int mult, int hash) {
    ds4_weight tid;
    memset(&tid, 0, sizeof tid);
    if (!hash) return tid;
    int32_t *table = malloc((size_t)k * V * sizeof(int32_t));
    for (int v = 0; v < V; v++)
        for (int j = 0; j < k; j++) table[(size_t)v * k + j] = (v * mult + j * 3) % E;
    tid.name = "tid2eid"; tid.type = DS4_TYPE_I32; tid.n_dims = 2;
    tid.ne[0] = k; tid.ne[1] = V; tid.ne[2] = 1;
    tid.nbytes = (size_t)k * V * 4; tid.host = table;
    return tid;
}

/* moe_gate: the router matmul and the routing in one op (the CUDA decode
 * path fuses them, and its logits sum K in another order than the matmul
 * op: hence TOL_DOT on the logits).  The weights and inputs are small
 * integers over powers of two in half the cases, so that the logits are exact
 * in any order and the picks cannot flip on a rounding difference; the
 * random cases check the bound. */
static void test_moe_gate(int type, int64_t K, int nt, int E, int k, int hash, int exact) {
    const int V = 300;
    ds4_weight w = make_weight(type, K, E, 1, 1.0f / sqrtf((float)K));
    float *x = rnd_vec((size_t)nt * K, 1.0f), *bias = rnd_vec(E, 0.3f);
    if (exact) {          /* w = i/64, x = j/64, |i|, |j| < 8: every partial sum is exact in f32 */
        float *wf = (float *)w.host;
        uint16_t *wh = (uint16_t *)w.host;
        for (int64_t i = 0; i < K * E; i++) {
            const float v = (float)(rnd_int(15) - 7) / 64.0f;
            if (type == DS4_TYPE_F32) wf[i] = v;
            else wh[i] = ds4_f32_to_f16(v);
        }
        for (int64_t i = 0; i < (int64_t)nt * K; i++) x[i] = (float)(rnd_int(15) - 7) / 64.0f;
    }
    int32_t *tok = malloc(nt * sizeof(int32_t));
    for (int t = 0; t < nt; t++) tok[t] = rnd_int(V);
    ds4_weight tid = make_tid2eid(V, k, E, 5, hash);
    int32_t *sel[2];
    float *wts[2], *lg[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight wb = weight_on(bi, &w), tb;
        if (hash) tb = weight_on(bi, &tid);
        float *dx = dev_put(bi, x, (size_t)nt * K * 4);
        float *dl = dev_poison(bi, (size_t)nt * E);
        float *db = hash ? NULL : dev_put(bi, bias, (size_t)E * 4);
        int32_t *dt = dev_put(bi, tok, (size_t)nt * 4);
        int32_t *ds = dev_poison_i32(bi, (size_t)nt * k);
        float *dw = dev_poison(bi, (size_t)nt * k);
        B[bi]->moe_gate(&wb, dx, dl, db, hash ? &tb : NULL, dt, nt, E, k, 1, 1.5f, ds, dw);
        sel[bi] = dev_get(bi, ds, (size_t)nt * k * 4);
        wts[bi] = dev_get(bi, dw, (size_t)nt * k * 4);
        lg[bi] = dev_get(bi, dl, (size_t)nt * E * 4);
        B[bi]->release_weight(&wb);
        if (hash) B[bi]->release_weight(&tb);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "%s K=%lld nt=%d E=%d k=%d %s%s", type_name(type), (long long)K, nt, E, k,
             hash ? "hash" : "scored", exact ? " exact" : "");
    check_f32("moe_gate logits", shape, lg[0], lg[1], (size_t)nt * E, exact ? 0.0 : TOL_DOT);
    if (exact) {
        check_i32("moe_gate sel", shape, sel[0], sel[1], (size_t)nt * k);
        check_f32("moe_gate wts", shape, wts[0], wts[1], (size_t)nt * k, TOL_ULP);
    }
    for (int bi = 0; bi < 2; bi++) { free(sel[bi]); free(wts[bi]); free(lg[bi]); }
    free(x); free(bias); free(tok); free((void *)tid.host); free_weight(&w);
}

static void test_moe_route(int nt, int E, int k, int hash, int norm, float wscale) {
    const int V = 300;
    float *logits = rnd_vec((size_t)nt * E, 4.0f), *bias = rnd_vec(E, 0.3f);
    for (int i = 0; i < nt * E && nt * E > 8; i += 7) logits[i] = 25.0f + (float)(i % 3);  /* softplus x > 20 branch */
    int32_t *tok = malloc(nt * sizeof(int32_t));
    for (int t = 0; t < nt; t++) tok[t] = rnd_int(V);
    ds4_weight tid = make_tid2eid(V, k, E, 7, hash);
    int32_t *sel[2];
    float *wts[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight tb;
        if (hash) tb = weight_on(bi, &tid);
        float *dl = dev_put(bi, logits, (size_t)nt * E * 4);
        float *db = hash ? NULL : dev_put(bi, bias, (size_t)E * 4);
        int32_t *dt = dev_put(bi, tok, (size_t)nt * 4);
        int32_t *ds = dev_poison_i32(bi, (size_t)nt * k);
        float *dw = dev_poison(bi, (size_t)nt * k);
        B[bi]->moe_route(dl, db, hash ? &tb : NULL, dt, nt, E, k, norm, wscale, ds, dw);
        sel[bi] = dev_get(bi, ds, (size_t)nt * k * 4);
        wts[bi] = dev_get(bi, dw, (size_t)nt * k * 4);
        if (hash) B[bi]->release_weight(&tb);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "nt=%d E=%d k=%d %s norm=%d scale=%g", nt, E, k, hash ? "hash" : "scored",
             norm, wscale);
    check_i32("moe_route sel", shape, sel[0], sel[1], (size_t)nt * k);
    /* sqrt(softplus) with libm vs CUDA logf/expf, a k-term sum, a division */
    check_f32("moe_route wts", shape, wts[0], wts[1], (size_t)nt * k, TOL_ULP);
    for (int bi = 0; bi < 2; bi++) { free(sel[bi]); free(wts[bi]); }
    free(logits); free(bias); free(tok); free((void *)tid.host);
}

/* A valid routing of nt tokens (k distinct experts of E each) and its weights.  skew 1: every
 * token picks experts 0..k-1; skew 2: the tokens pick among 0..E-3, then token 0's first pick
 * becomes E-1, so expert E-2 gets no token and E-1 exactly one; 0: random starts. */
static void test_routing(int nt, int k, int E, int skew, int32_t *sel, float *wts) {
    const int Er = skew == 2 ? E - 2 : E;
    for (int t = 0; t < nt; t++) {
        const int start = skew == 1 ? 0 : rnd_int(Er);
        for (int j = 0; j < k; j++) {
            sel[(size_t)t * k + j] = (start + j * (skew == 1 ? 1 : 3)) % Er;
            wts[(size_t)t * k + j] = 0.1f + 0.9f * (rnd_f() + 1.0f) * 0.5f;
        }
    }
    /* make the per-token ids distinct even when 3*j wraps onto itself */
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < k; j++)
            for (int jj = 0; jj < j; jj++)
                if (sel[(size_t)t * k + jj] == sel[(size_t)t * k + j]) {
                    sel[(size_t)t * k + j] = (sel[(size_t)t * k + j] + 1) % Er;
                    jj = -1;
                }
    if (skew == 2) sel[0] = E - 1;
}

/* Routed experts.  sel/wts are a valid routing (k distinct experts per
 * token); `skew` concentrates tokens on few experts, which moves a large
 * batch from the per-token kernels to the grouped GEMM path. */
/* gate and up of type `type`, down of type `tdown` (the Flash files: IQ2_XXS / Q2_K) */
static void test_moe_experts_t(int type, int tdown, int64_t D, int64_t F, int E, int k, int nt, float clamp,
                               int skew, int with_add) {
    ds4_weight g = make_weight(type, D, F, E, 1.0f / sqrtf((float)D));
    ds4_weight u = make_weight(type, D, F, E, 1.0f / sqrtf((float)D));
    ds4_weight dn = make_weight(tdown, F, D, E, 1.0f / sqrtf((float)F));
    float *x = rnd_vec((size_t)nt * D, 2.0f);
    int32_t *sel = malloc((size_t)nt * k * sizeof(int32_t));
    float *wts = malloc((size_t)nt * k * sizeof(float));
    test_routing(nt, k, E, skew, sel, wts);
    const size_t n = (size_t)nt * D;
    float *add = rnd_vec(n, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        ds4_weight gb = weight_on(bi, &g), ub = weight_on(bi, &u), db = weight_on(bi, &dn);
        float *dx = dev_put(bi, x, n * 4);
        int32_t *ds = dev_put(bi, sel, (size_t)nt * k * 4);
        float *dw = dev_put(bi, wts, (size_t)nt * k * 4);
        float *da = with_add ? dev_put(bi, add, n * 4) : NULL;
        float *dy = dev_poison(bi, n);
        B[bi]->moe_experts(dx, ds, dw, &gb, &ub, &db, nt, k, clamp, da, dy);
        out[bi] = dev_get(bi, dy, n * 4);
        B[bi]->release_weight(&gb); B[bi]->release_weight(&ub); B[bi]->release_weight(&db);
        dev_free_all(bi);
    }
    char shape[128];
    char tn[32];
    if (tdown == type) snprintf(tn, sizeof tn, "%s", type_name(type));
    else snprintf(tn, sizeof tn, "%s/%s", type_name(type), type_name(tdown));
    snprintf(shape, sizeof shape, "%s D=%lld F=%lld E=%d k=%d nt=%d L=%g%s%s", tn, (long long)D,
             (long long)F, E, k, nt, clamp, skew == 1 ? " skew" : skew == 2 ? " 0/1-token experts" : "",
             with_add ? " +add" : "");
    check_f32("moe_experts", shape, out[0], out[1], n, TOL_CHAIN);
    free(out[0]); free(out[1]); free(x); free(sel); free(wts); free(add);
    free_weight(&g); free_weight(&u); free_weight(&dn);
}

static void test_moe_experts_add(int type, int64_t D, int64_t F, int E, int k, int nt, float clamp, int skew,
                                 int with_add) {
    test_moe_experts_t(type, type, D, F, E, k, nt, clamp, skew, with_add);
}

static void test_moe_experts(int type, int64_t D, int64_t F, int E, int k, int nt, float clamp, int skew) {
    test_moe_experts_t(type, type, D, F, E, k, nt, clamp, skew, 0);
}

static void test_swiglu(int64_t n, float limit, int in_place) {
    float *g = rnd_vec(n, 12.0f), *u = rnd_vec(n, 12.0f);   /* beyond the clamp on purpose */
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *dg = dev_put(bi, g, (size_t)n * 4), *du = dev_put(bi, u, (size_t)n * 4);
        float *dy = in_place ? dg : dev_poison(bi, (size_t)n);
        B[bi]->swiglu(dg, du, dy, n, limit);
        out[bi] = dev_get(bi, dy, (size_t)n * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "n=%lld L=%g%s", (long long)n, limit, in_place ? " in-place" : "");
    check_f32("swiglu", shape, out[0], out[1], (size_t)n, TOL_ULP);   /* expf ulps */
    free(out[0]); free(out[1]); free(g); free(u);
}

static void test_add_scale(int64_t n) {
    float *a = rnd_vec(n, 1.0f), *b = rnd_vec(n, 1.0f);
    float *sum[2], *sc[2], *ip[2];
    for (int bi = 0; bi < 2; bi++) {
        float *da = dev_put(bi, a, (size_t)n * 4), *db = dev_put(bi, b, (size_t)n * 4);
        float *dy = dev_poison(bi, (size_t)n);
        B[bi]->add(da, db, dy, n);
        sum[bi] = dev_get(bi, dy, (size_t)n * 4);
        B[bi]->scale(dy, -0.37f, n);
        sc[bi] = dev_get(bi, dy, (size_t)n * 4);
        B[bi]->add(da, db, da, n);                    /* in place */
        ip[bi] = dev_get(bi, da, (size_t)n * 4);
        dev_free_all(bi);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "n=%lld", (long long)n);
    check_f32("add", shape, sum[0], sum[1], (size_t)n, TOL_EXACT);
    check_f32("scale", shape, sc[0], sc[1], (size_t)n, TOL_EXACT);
    check_f32("add in-place", shape, ip[0], ip[1], (size_t)n, TOL_EXACT);
    for (int bi = 0; bi < 2; bi++) { free(sum[bi]); free(sc[bi]); free(ip[bi]); }
    free(a); free(b);
}

/* pair_rows (the MTP head's eh_proj input): rows rows of [a[r / rep], b[r]], exact copies. */
static void test_pair_rows(int rows, int rep, int64_t n) {
    const int ra = (rows + rep - 1) / rep;
    float *a = rnd_vec((size_t)ra * n, 1.0f), *b = rnd_vec((size_t)rows * n, 1.0f);
    float *out[2];
    for (int bi = 0; bi < 2; bi++) {
        float *da = dev_put(bi, a, (size_t)ra * n * 4), *db = dev_put(bi, b, (size_t)rows * n * 4);
        float *dy = dev_poison(bi, (size_t)rows * 2 * n);
        B[bi]->pair_rows(da, db, dy, rows, rep, n);
        out[bi] = dev_get(bi, dy, (size_t)rows * 2 * n * 4);
        dev_free_all(bi);
    }
    /* the CPU's own rows against the definition, then CUDA's against the CPU's */
    int bad = 0;
    for (int r = 0; r < rows; r++)
        bad += memcmp(out[0] + (size_t)r * 2 * n, a + (size_t)(r / rep) * n, (size_t)n * 4) != 0 ||
               memcmp(out[0] + (size_t)r * 2 * n + n, b + (size_t)r * n, (size_t)n * 4) != 0;
    char shape[96];
    snprintf(shape, sizeof shape, "rows=%d rep=%d n=%lld", rows, rep, (long long)n);
    printf("%-15s %-44s CPU rows against the definition: %d wrong  %s\n", "pair_rows", shape, bad, bad ? "FAIL" : "ok");
    if (bad) g_fail++; else g_pass++;
    check_f32("pair_rows", shape, out[0], out[1], (size_t)rows * 2 * n, TOL_EXACT);
    free(out[0]); free(out[1]); free(a); free(b);
}

/* Run to run, the CUDA backend must give byte-identical outputs (no
 * order-dependent atomics): the reduction-heavy paths run twice on the same
 * inputs and are compared bit for bit. */
static void check_same(const char *what, const void *a, const void *b, size_t bytes) {
    const int ok = memcmp(a, b, bytes) == 0;
    printf("%-15s %-44s %s\n", "deterministic", what, ok ? "ok" : "FAIL (outputs differ between runs)");
    if (ok) g_pass++; else g_fail++;
}

static void test_determinism(void) {
    const int bi = 1;
    /* matmul: decode matvec and prefill GEMM */
    {
        ds4_weight w = make_weight(DS4_TYPE_Q8_0, 4096, 300, 1, 0.02f);
        float *x = rnd_vec((size_t)64 * 4096, 1.0f);
        ds4_weight wb = weight_on(bi, &w);
        float *dx = dev_put(bi, x, (size_t)64 * 4096 * 4), *dy = dev_poison(bi, (size_t)64 * 300);
        for (int nt = 1; nt <= 64; nt += 63) {
            float *r[2];
            for (int rep = 0; rep < 2; rep++) {
                B[bi]->matmul(&wb, 0, dx, dy, nt);
                r[rep] = dev_get(bi, dy, (size_t)nt * 300 * 4);
            }
            check_same(nt == 1 ? "matmul q8_0 4096x300 nt=1" : "matmul q8_0 4096x300 nt=64", r[0], r[1],
                       (size_t)nt * 300 * 4);
            free(r[0]); free(r[1]);
        }
        B[bi]->release_weight(&wb);
        dev_free_all(bi);
        free(x); free_weight(&w);
    }
    /* the quant types' tensor-core matvec (dense, two tokens per launch) and experts */
    {
        const int qt[3] = { DS4_TYPE_Q2_K, DS4_TYPE_Q4_K, DS4_TYPE_IQ2_XXS };
        for (int ti = 0; ti < 3; ti++) {
            ds4_weight w = make_weight(qt[ti], 4096, 300, 1, 0.0f);
            float *x = rnd_vec((size_t)2 * 4096, 1.0f);
            ds4_weight wb = weight_on(bi, &w);
            float *dx = dev_put(bi, x, (size_t)2 * 4096 * 4), *dy = dev_poison(bi, (size_t)2 * 300);
            float *r[2];
            for (int rep = 0; rep < 2; rep++) {
                B[bi]->matmul(&wb, 0, dx, dy, 2);
                r[rep] = dev_get(bi, dy, (size_t)2 * 300 * 4);
            }
            char what[64];
            snprintf(what, sizeof what, "matmul %s 4096x300 nt=2", type_name(qt[ti]));
            check_same(what, r[0], r[1], (size_t)2 * 300 * 4);
            free(r[0]); free(r[1]);
            B[bi]->release_weight(&wb);
            dev_free_all(bi);
            free(x); free_weight(&w);
        }
        const int D = 4096, F = 2048, E = 16, k = 6;
        ds4_weight g = make_weight(DS4_TYPE_IQ2_XXS, D, F, E, 0.0f), u = make_weight(DS4_TYPE_IQ2_XXS, D, F, E, 0.0f);
        ds4_weight dn = make_weight(DS4_TYPE_Q2_K, F, D, E, 0.0f);
        float *x = rnd_vec(D, 1.0f), *wts = rnd_vec(k, 1.0f);
        int32_t sel[6] = { 3, 0, 15, 7, 8, 12 };
        ds4_weight gb = weight_on(bi, &g), ub = weight_on(bi, &u), db = weight_on(bi, &dn);
        float *dx = dev_put(bi, x, (size_t)D * 4), *dw = dev_put(bi, wts, (size_t)k * 4);
        int32_t *dsl = dev_put(bi, sel, sizeof sel);
        float *dy = dev_poison(bi, D);
        float *r[2];
        for (int rep = 0; rep < 2; rep++) {
            B[bi]->moe_experts(dx, dsl, dw, &gb, &ub, &db, 1, k, 10.0f, NULL, dy);
            r[rep] = dev_get(bi, dy, (size_t)D * 4);
        }
        check_same("moe_experts iq2_xxs/q2_k nt=1", r[0], r[1], (size_t)D * 4);
        free(r[0]); free(r[1]);
        B[bi]->release_weight(&gb); B[bi]->release_weight(&ub); B[bi]->release_weight(&db);
        dev_free_all(bi);
        free(x); free(wts); free_weight(&g); free_weight(&u); free_weight(&dn);
    }
    /* attention: decode with split rows (chunk partials + combine) */
    {
        const int H = 64, d = 512, W = 128, pos0 = 2000, k = 512;
        float *q = rnd_vec((size_t)H * d, 1.0f), *kv = rnd_vec(d, 1.0f), *ring = rnd_vec((size_t)W * d, 1.0f);
        float *comp = rnd_vec((size_t)600 * d, 1.0f), *sinks = rnd_vec(H, 1.0f);
        int32_t *topk = malloc(k * sizeof(int32_t));
        for (int j = 0; j < k; j++) topk[j] = rnd_int(500);
        float *dq = dev_put(bi, q, (size_t)H * d * 4), *dkv = dev_put(bi, kv, (size_t)d * 4);
        float *dr = dev_put(bi, ring, (size_t)W * d * 4), *dc = dev_put(bi, comp, (size_t)600 * d * 4);
        float *ds = dev_put(bi, sinks, (size_t)H * 4), *dy = dev_poison(bi, (size_t)H * d);
        int32_t *dt = dev_put(bi, topk, (size_t)k * 4);
        float *r[2];
        for (int rep = 0; rep < 2; rep++) {
            B[bi]->attention(dq, dkv, dr, W, at(bi, pos0), 1, H, d, dc, 4, dt, k, ds, 0.044f, dy);
            r[rep] = dev_get(bi, dy, (size_t)H * d * 4);
        }
        check_same("attention decode ratio=4 k=512", r[0], r[1], (size_t)H * d * 4);
        free(r[0]); free(r[1]);
        dev_free_all(bi);
        free(q); free(kv); free(ring); free(comp); free(sinks); free(topk);
    }
    /* hc_pre: split-K partials and their fixed-order reduction */
    {
        const int D = 4096, h = 4, n_mix = 24, K = D * h;
        ds4_weight fn = make_weight(DS4_TYPE_F32, K, n_mix, 1, 0.01f);
        ds4_weight fb = weight_on(bi, &fn);
        float *x = rnd_vec(K, 1.0f), *sc = rnd_vec(3, 1.0f), *ba = rnd_vec(n_mix, 0.5f), *nw = rnd_vec(D, 1.0f);
        float *dx = dev_put(bi, x, (size_t)K * 4), *ds = dev_put(bi, sc, 12), *db = dev_put(bi, ba, n_mix * 4);
        float *dn = dev_put(bi, nw, (size_t)D * 4), *dflat = dev_poison(bi, K), *dmix = dev_poison(bi, n_mix);
        float *dy = dev_poison(bi, D), *dp = dev_poison(bi, h), *dc = dev_poison(bi, h * h);
        float *r[2];
        for (int rep = 0; rep < 2; rep++) {
            B[bi]->hc_pre(NULL, NULL, dx, &fb, ds, db, dn, 1, D, h, 0, 1e-6f, 1e-6f, 20, dflat, dmix, dy, dp, dc);
            r[rep] = dev_get(bi, dy, (size_t)D * 4);
        }
        check_same("hc_pre D=4096 nt=1", r[0], r[1], (size_t)D * 4);
        free(r[0]); free(r[1]);
        B[bi]->release_weight(&fb);
        dev_free_all(bi);
        free(x); free(sc); free(ba); free(nw); free_weight(&fn);
    }
    /* experts: decode kernels and the grouped GEMM path */
    {
        const int D = 1024, F = 1024, E = 8, k = 4, nt = 64;
        ds4_weight g = make_weight(DS4_TYPE_Q8_0, D, F, E, 0.03f), u = make_weight(DS4_TYPE_Q8_0, D, F, E, 0.03f);
        ds4_weight dn = make_weight(DS4_TYPE_Q8_0, F, D, E, 0.03f);
        float *x = rnd_vec((size_t)nt * D, 1.0f), *wts = rnd_vec((size_t)nt * k, 1.0f);
        int32_t *sel = malloc((size_t)nt * k * sizeof(int32_t));
        for (int i = 0; i < nt * k; i++) sel[i] = i % k;
        ds4_weight gb = weight_on(bi, &g), ub = weight_on(bi, &u), db = weight_on(bi, &dn);
        float *dx = dev_put(bi, x, (size_t)nt * D * 4), *dw = dev_put(bi, wts, (size_t)nt * k * 4);
        int32_t *dsl = dev_put(bi, sel, (size_t)nt * k * 4);
        float *dy = dev_poison(bi, (size_t)nt * D);
        for (int n = 1; n <= nt; n += nt - 1) {
            float *r[2];
            for (int rep = 0; rep < 2; rep++) {
                B[bi]->moe_experts(dx, dsl, dw, &gb, &ub, &db, n, k, 10.0f, NULL, dy);
                r[rep] = dev_get(bi, dy, (size_t)n * D * 4);
            }
            check_same(n == 1 ? "moe_experts q8_0 nt=1" : "moe_experts q8_0 nt=64 (GEMM)", r[0], r[1],
                       (size_t)n * D * 4);
            free(r[0]); free(r[1]);
        }
        B[bi]->release_weight(&gb); B[bi]->release_weight(&ub); B[bi]->release_weight(&db);
        dev_free_all(bi);
        free(x); free(wts); free(sel); free_weight(&g); free_weight(&u); free_weight(&dn);
    }
}

/* Q2_K, Q4_K and IQ2_XXS, the routed experts of the published Flash files (random valid
 * super-blocks).  Their decode kernel (ds4_cuda_matvec_q.cuh) takes K = 256 n with 4-byte
 * aligned rows, two dense tokens per launch, 16-row tiles; so: token counts 1..8 (odd
 * counts leave a one-token launch), rows that are not a multiple of 16, K = 256 x odd
 * (IQ2_XXS rows of 66 x odd bytes are 2-byte aligned: the generic path), one super-block,
 * a K whose staged activations nearly fill shared memory, 64 tokens (dequantisation +
 * GEMM), an expert of a 3-D weight, every op that takes a weight.  Tolerances as for the
 * other types: the products are exact in the tensor-core kernel and the sums f32 (see its
 * essay), so the error is DOT-sized. */
static void test_quant_types(void) {
    const int qt[3] = { DS4_TYPE_Q2_K, DS4_TYPE_Q4_K, DS4_TYPE_IQ2_XXS };
    for (int ti = 0; ti < 3; ti++) {
        const int t = qt[ti];
        for (int nt = 1; nt <= 8; nt++) test_matmul(t, 4096, 300, 1, 0, nt);
        test_matmul(t, 4096, 300, 1, 0, 64);
        test_matmul(t, 2048, 4099, 1, 0, 1);     /* many rows: several tiles per warp */
        test_matmul(t, 2048, 4096, 1, 0, 2);
        test_matmul(t, 256, 37, 1, 0, 1);        /* one super-block, a partial tile */
        test_matmul(t, 256, 37, 1, 0, 3);
        test_matmul(t, 768, 515, 1, 0, 2);       /* K = 3 x 256 */
        test_matmul(t, 1280, 77, 1, 0, 1);       /* K = 5 x 256 */
        test_matmul(t, 1280, 77, 1, 0, 64);
        test_matmul(t, 7168, 9, 1, 0, 1);        /* 28 super-blocks, fewer rows than a tile */
        test_matmul(t, 24576, 20, 1, 0, 1);      /* 96 super-blocks of staged activations */
        test_matmul(t, 24576, 20, 1, 0, 2);
        test_matmul(t, 1024, 64, 3, 2, 1);
        test_matmul(t, 1024, 64, 3, 1, 64);
        for (int ni = 0; ni < 3; ni++) {
            const int nts[3] = { 1, 3, 64 };
            test_matmul_grouped(t, 1024, 4, 96, nts[ni]);
            test_matmul_grouped(t, 768, 3, 50, nts[ni]);
        }
        test_matmul_swiglu(t, 4096, 2048, 1, 10.0f);
        test_matmul_swiglu(t, 4096, 2048, 3, 10.0f);
        test_matmul_swiglu(t, 768, 48, 2, 0.0f);
        test_matmul_swiglu(t, 1024, 512, 64, 7.0f);
        test_moe_experts(t, 1024, 1024, 8, 4, 1, 10.0f, 0);
        test_moe_experts(t, 1024, 1024, 8, 4, 3, 10.0f, 0);
        test_moe_experts(t, 1024, 1024, 8, 4, 64, 10.0f, 1);
        test_moe_experts(t, 768, 1280, 4, 2, 3, 0.0f, 0);
        {
            const int mixed[4] = { t, DS4_TYPE_Q8_0, t, DS4_TYPE_F16 };
            const int r4[4] = { 300, 64, 515, 100 };
            const int two[2] = { t, t };
            const int r2[2] = { 1024, 37 };
            test_matmul_multi(4, mixed, r4, 4096, 1, 1, 1, 5, 128);
            test_matmul_multi(4, mixed, r4, 4096, 2, 0, 1, 3, 4);
            test_matmul_multi(2, two, r2, 1024, 1, 1, 1, 126, 128);
            test_matmul_multi(2, two, r2, 1024, 3, 1, 0, 0, 1);
            test_matmul_multi(2, two, r2, 768, 64, 1, 1, 2, 4);
        }
    }
    /* the 81 GB file's experts: IQ2_XXS gate|up, Q2_K down, at Flash's D and F */
    test_moe_experts_t(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 16, 6, 1, 10.0f, 0, 0);
    test_moe_experts_t(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 16, 6, 1, 10.0f, 0, 1);
    test_moe_experts_t(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 16, 6, 4, 10.0f, 0, 1);
    test_moe_experts_t(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 16, 6, 64, 10.0f, 1, 0);
    test_moe_experts_t(DS4_TYPE_Q4_K, DS4_TYPE_Q4_K, 4096, 2048, 16, 6, 1, 10.0f, 0, 1);
    test_moe_experts_t(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q8_0, 1024, 1024, 8, 4, 2, 10.0f, 0, 0);
    for (int ti = 0; ti < 3; ti++) {          /* dsq_elem: bit-exact like the CPU's dequantisation */
        test_embed(qt[ti], 4096, 20, 2, 1);
        test_embed(qt[ti], 768, 50, 3, 4);
    }
}

/* A session of each backend for lim (a larger batch than main's), bound in place of the
 * current one, kept in prev: 0, or -1 with a line. */
static int session_push(const ds4_limits *lim, void *ps[2], void *prev[2]) {
    for (int bi = 0; bi < 2; bi++) {
        ps[bi] = B[bi]->session_new(lim);
        if (!ps[bi]) {
            fprintf(stderr, "test: a %d-token session of backend %s failed\n", lim->max_batch, B[bi]->name);
            return -1;
        }
        prev[bi] = B[bi]->session_bind(ps[bi]);
    }
    return 0;
}

static void session_pop(void *ps[2], void *prev[2]) {
    for (int bi = 0; bi < 2; bi++) {
        B[bi]->session_bind(prev[bi]);
        B[bi]->session_free(ps[bi]);
    }
}

/* A prompt's per-token ops at the batch sizes 1, 2, 7, 64, 512 and 4096, in a session sized for
 * 4096-token batches: the compressor's pool (ratio 4 with its overlapping windows and ratio 128,
 * from inside a block, so the state ring is read too) and hc_pre (k_hc_pre up to 8 tokens, the
 * two batch kernels above). */
static int test_prompt_batches(const ds4_limits *lim0) {
    ds4_limits pl = *lim0;
    pl.max_batch = 4096;
    pl.n_ctx = 8192;
    void *ps[2], *prev[2];
    if (session_push(&pl, ps, prev) != 0) return 2;
    const int in[6] = { 1, 2, 7, 64, 512, 4096 };
    for (int ni = 0; ni < 6; ni++) {
        test_compress_pool(3, in[ni], 4, 2, 512);
        test_compress_pool(100, in[ni], 128, 1, 512);
        test_hc_pre(in[ni], 4096, 4, 0, 1);
    }
    session_pop(ps, prev);
    return 0;
}

/* The indexer at a prompt's batch sizes, 1, 2, 7, 64, 512 and 4096 queries of Flash's 64 x 128
 * heads with k = 512 (from position 0: the early queries see fewer rows than k, the sort-only
 * select, the later ones more), against the CPU, then a batch against one-query calls; in a
 * session sized for 4096-token batches (`test_backend_ops ix` runs this alone). */
static int test_indexer_batches(const ds4_limits *lim0) {
    ds4_limits pl = *lim0;
    pl.max_batch = 4096;
    pl.n_ctx = 8192;
    pl.idx_topk = 512;
    void *ps[2], *prev[2];
    if (session_push(&pl, ps, prev) != 0) return 2;
    const int in[6] = { 1, 2, 7, 64, 512, 4096 };
    for (int ni = 0; ni < 6; ni++) {
        test_indexer_rp(0, in[ni], 64, 128, 4, 512, 64);
        test_indexer(8192 - in[ni] - 1, in[ni], 64, 128, 4, 512);
    }
    test_indexer_rows_as_steps(2000, 512, 64, 128, 512, 64);
    session_pop(ps, prev);
    return 0;
}

/* Prefill on tensor cores, in a session sized for 4096-token batches (`test_backend_ops tc`
 * runs this alone, e.g. under compute-sanitizer). */
static int test_tc_engine(const ds4_limits *lim0, int eng_first, int eng_last) {
    const ds4_limits lim = *lim0;
    /* prefill on tensor cores (ds4_cuda_gemm.cu, Q8_0, F16, then the super-block types): the batch sizes 1, 2, 7, 64, 512
     * and 4096, rows that do not fill a tile, the grouped and expert paths with experts that get
     * 0 or 1 token, wide-range activations; several matrices in one launch (matmul_multi with
     * types mixed, gate|up, the groups of a grouped product, more groups than one launch or
     * the split scratch takes); in a session sized for 4096-token batches.  With each
     * prefill_tc from eng_first down to eng_last: 4 (the default: 3 with the Q8_0 weights' stage
     * copies by the tensor memory accelerator too, in 256-row blocks), 3 (k_tc_wgmma on an sm_90 build and card,
     * the activations' stage copies by the tensor memory accelerator, else k_tc_gemm), 2
     * (k_tc_wgmma with cp.async copies), each on the same inputs and every output byte for byte
     * against the first engine's (g_same), then 1 (k_tc_gemm), all on the session's planes
     * (DS4_CUDA_PREFILL_PLANES).  The plain run and `test_backend_ops tc` take 4 to 1, tc4 4
     * and 3, tc3 3 and 2, tc2 2 alone, tc1 1 alone. */
    const int same = eng_first >= 3 && eng_last < eng_first;    /* the first, then the others to 2 byte for byte */
    const uint64_t rng0 = g_rng;
    for (int eng = eng_first; eng >= eng_last; eng--) {
        ds4_limits pl = lim;
        pl.prefill_tc = eng;
        g_same = same ? (eng == eng_first ? 1 : eng >= 2 ? 2 : 0) : 0;
        printf("(prefill products: DS4_CUDA_PREFILL_TC=%d, %d planes%s)\n", eng, pl.prefill_planes == 2 ? 2 : 3,
               g_same == 1 ? ", outputs recorded" : g_same == 2 ? ", compared with the first's byte for byte" : "");
        g_same_at = 0;
        g_rng = rng0;                                      /* every pass on the same inputs */
        pl.max_batch = 4096;
        pl.n_ctx = 8192;
        pl.n_embd = 4096;
        pl.n_head = 8;
        pl.head_dim = 128;
        pl.idx_topk = 0;
        pl.n_expert = 64;
        pl.n_expert_used = 6;
        pl.n_ff_exp = 1024;
        pl.max_k = 4096;
        pl.max_matrix = (int64_t)4096 * 4096;
        void *ps[2], *prev[2];
        if (session_push(&pl, ps, prev) != 0) return 2;
        const int tcn[6] = { 1, 2, 7, 64, 512, 4096 };
        const int tct[2] = { DS4_TYPE_Q8_0, DS4_TYPE_F16 };
        for (int ti = 0; ti < 2; ti++) {
            for (int ni = 0; ni < 6; ni++) test_matmul(tct[ti], 4096, 1000, 1, 0, tcn[ni]);
            test_matmul(tct[ti], 1024, 129, 3, 2, 77);      /* an expert's slice, rows not a tile multiple */
            test_matmul(tct[ti], 2048, 4096, 1, 0, 512);
            test_matmul_grouped(tct[ti], 1024, 8, 128, 512);
            test_matmul_grouped(tct[ti], 256, 12, 100, 512);       /* 12 groups: two launches of 6 */
            test_matmul_swiglu(tct[ti], 1024, 640, 512, 7.0f);
            test_matmul_range(tct[ti], 4096, 256, 200);
            test_moe_experts(tct[ti], 4096, 1024, 64, 6, 512, 10.0f, 2);
            /* the attention input's seven projections of a ratio-4 layer, one launch */
            const int t7[7] = { tct[ti], tct[ti], tct[ti], tct[ti], tct[ti], tct[ti], tct[ti] };
            const int r7[7] = { 1024, 512, 1024, 1024, 256, 256, 64 };
            test_matmul_multi(7, t7, r7, 4096, 512, 0, 1, 37, 4);
        }
        {
            const int mixed[4] = { DS4_TYPE_Q8_0, DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_Q8_0 };
            const int r4[4] = { 300, 64, 515, 100 };
            test_matmul_multi(4, mixed, r4, 2048, 512, 1, 1, 5, 128);   /* two launches and cuBLAS */
            test_matmul_multi(4, mixed, r4, 2048, 77, 0, 1, 3, 4);
        }
        /* the super-block types (the published files' routed experts) on the engine: the same
         * batch sizes, an expert's slice, grouped products, gate|up, the MoE with experts that
         * get 0 or 1 token, a multi-matrix launch; K = 2048 n, so that IQ2_XXS rows (66 bytes
         * per 256) are 16-byte multiples (Q2_K's 84 need K = 1024 n) */
        const int sbt[3] = { DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, DS4_TYPE_Q4_K };
        for (int ti = 0; ti < 3; ti++) {
            for (int ni = 0; ni < 6; ni++) test_matmul(sbt[ti], 4096, 300, 1, 0, tcn[ni]);
            test_matmul(sbt[ti], 2048, 129, 3, 2, 77);
            test_matmul_grouped(sbt[ti], 2048, 8, 128, 512);
            test_matmul_swiglu(sbt[ti], 2048, 640, 512, 7.0f);
            test_matmul_range(sbt[ti], 4096, 256, 200);
            test_moe_experts(sbt[ti], 2048, 2048, 64, 6, 512, 10.0f, 2);
            const int t3[3] = { sbt[ti], sbt[ti], sbt[ti] };
            const int r3[3] = { 1024, 77, 256 };
            test_matmul_multi(3, t3, r3, 4096, 200, 0, 1, 37, 4);
        }
        /* Q4_K at K = 256 and 512: no more stages than a block's buffers (k_tc_wgmma's stages of
         * four blocks: 2 and 4 of 4) */
        test_matmul(DS4_TYPE_Q4_K, 256, 300, 1, 0, 512);
        test_matmul(DS4_TYPE_Q4_K, 512, 300, 1, 0, 77);
        /* the published Flash layout's experts at its D and F: IQ2_XXS gate|up, Q2_K down */
        test_moe_experts_t(DS4_TYPE_IQ2_XXS, DS4_TYPE_Q2_K, 4096, 2048, 64, 6, 512, 10.0f, 2, 1);
        /* the split scratch (sized for the MoE's 6 x 4096 rows of 4096) holds 5 parts of
         * 4096 x 4096: the 8 groups go as two launches of 4 */
        test_matmul_grouped(DS4_TYPE_Q8_0, 4096, 8, 64, 4096);
        test_moe_experts(DS4_TYPE_Q8_0, 2048, 512, 16, 6, 4096, 10.0f, 0);
        /* a clamp the gate and up values cross (the swiglu the down projection's split makes) */
        test_moe_experts(DS4_TYPE_Q8_0, 2048, 512, 16, 6, 512, 0.5f, 0);
        /* the engine the switch asks for ran: with 3 and 4, k_tc_wgmma's launches copy their
         * stages with the tensor memory accelerator (where the build and card have k_tc_wgmma at
         * all), with 4 the Q8_0 launches their weights too (some of every pass's launches are
         * Q8_0); with 2 none does */
        ds4_backend_stats st;
        B[1]->session_stats(ps[1], &st, 0);
        if (eng >= 2 && !st.tc_wgmma) {
            printf("tc engine       DS4_CUDA_PREFILL_TC=%d: no k_tc_wgmma launch (not an sm_90a build on a CC 9.0 "
                   "card): k_tc_gemm ran\n", eng);
        } else if (eng >= 2) {
            /* every launch on two planes (DS4_CUDA_PREFILL_PLANES=2), or none */
            const uint64_t pl2 = pl.prefill_planes == 2 ? st.tc_wgmma : 0;
            const int ok = (eng >= 3 ? st.tc_tma == st.tc_wgmma : st.tc_tma == 0) &&
                           (eng == 4 ? st.tc_tma_a > 0 && st.tc_tma_a < st.tc_wgmma : st.tc_tma_a == 0) &&
                           st.tc_pl2 == pl2;
            printf("tc engine       DS4_CUDA_PREFILL_TC=%d: %llu k_tc_wgmma launches, %llu with tensor copies, %llu of "
                   "the weights too, %llu on two planes  %s\n", eng, (unsigned long long)st.tc_wgmma,
                   (unsigned long long)st.tc_tma, (unsigned long long)st.tc_tma_a, (unsigned long long)st.tc_pl2,
                   ok ? "ok" : "FAIL");
            if (ok) g_pass++; else g_fail++;
        }
        if (eng == 1 || !st.tc_wgmma) {     /* k_tc_gemm: on the planes asked for too */
            const int ok = (st.tc_pl2 > 0) == (pl.prefill_planes == 2);
            printf("tc engine       DS4_CUDA_PREFILL_TC=%d: k_tc_gemm, %llu launches on two planes  %s\n", eng,
                   (unsigned long long)st.tc_pl2, ok ? "ok" : "FAIL");
            if (ok) g_pass++; else g_fail++;
        }
        if (g_same == 2 && g_same_at != g_same_cnt) {
            printf("tc engine       %zu cases of the first pass, %zu compared  FAIL\n", g_same_cnt, g_same_at);
            g_fail++;
        }
        session_pop(ps, prev);
    }
    g_same = 0;
    for (size_t i = 0; i < g_same_cnt; i++) free(g_same_out[i]);
    g_same_cnt = 0;
    return 0;
}

static int test_prefill_attention(const ds4_limits *lim) {
    /* prefill attention, the tile kernels: the Flash shape (64 heads x 512, window 128, ratio 4
     * with 512 picks, ratio 128) at the batch sizes 1, 2, 7, 64, 512 and 4096 (16 heads there, to
     * keep the CPU side short), from position 0 and from inside a long context, with the fused
     * de-rotation of attention_step.  On tensor cores (k_attention_mma, prefill_attn = 2) in a
     * session that sends every batch the kernels take to them (prefill_attn_all), then the default
     * one for the large batches; in f32 (k_attention_tiles, 1) at 7, 64 and 512.  Then both on
     * rows whose magnitudes differ by 2^16 under a peaked softmax (g_att_spread), and the
     * tensor-core kernel at d = 64, 192 and 320 (its other instantiations). */
    static const struct { int kern, all, n0, n1; } pa[] = { { 2, 1, 0, 6 }, { 2, 0, 4, 6 }, { 1, 1, 2, 5 } };
    for (size_t pi = 0; pi < sizeof pa / sizeof pa[0]; pi++) {
        ds4_limits pl = *lim;
        pl.max_batch = 4096;
        pl.n_ctx = 8192;
        pl.n_head = 64;
        pl.head_dim = 512;
        pl.idx_topk = 512;
        pl.prefill_attn = pa[pi].kern;
        pl.prefill_attn_all = pa[pi].all;
        void *ps[2], *prev[2];
        if (session_push(&pl, ps, prev) != 0) return 2;
        printf("(prefill attention: %s, %s)\n", pa[pi].kern == 2 ? "tensor cores" : "f32 tiles",
               pa[pi].all ? "every batch" : "batches that fill the device");
        const int an[6] = { 1, 2, 7, 64, 512, 4096 };
        for (int ni = pa[pi].n0; ni < pa[pi].n1; ni++) {
            const int nt = an[ni], H = nt == 4096 ? 16 : 64;
            test_attention(128, 0, nt, H, 512, 0, 0);
            test_attention_step(128, 0, nt, H, 512, 4, 512, 64, 1);
            test_attention_step(128, 4096 - nt, nt, H, 512, 4, 512, 64, 1);
            test_attention(128, 8192 - nt, nt, H, 512, 128, 0);
        }
        if (pa[pi].all) {
            g_att_spread = 1;
            test_attention(128, 300, 200, 64, 512, 0, 0);
            test_attention_step(128, 3000, 200, 64, 512, 4, 512, 64, 1);
            test_attention(128, 5000, 200, 64, 512, 128, 0);
            g_att_spread = 0;
        }
        if (pa[pi].kern == 2 && pa[pi].all) {
            test_attention(16, 200, 150, 5, 64, 0, 0);
            test_attention_step(32, 10, 150, 3, 192, 4, 40, 32, 1);
            test_attention(64, 300, 150, 40, 320, 128, 0);
        }
        /* the tensor-core kernel ran, on the planes the session asks for */
        ds4_backend_stats st;
        B[1]->session_stats(ps[1], &st, 0);
        if (pa[pi].kern == 2) {
            const int ok = st.att_mma > 0 && st.att_mma_pl2 == (pl.prefill_planes == 2 ? st.att_mma : 0);
            printf("attention mma   %llu k_attention_mma launches, %llu on two planes  %s\n",
                   (unsigned long long)st.att_mma, (unsigned long long)st.att_mma_pl2, ok ? "ok" : "FAIL");
            if (ok) g_pass++; else g_fail++;
        }
        session_pop(ps, prev);
    }
    return 0;
}

/* hc_pre, fused ("hc" runs only these): decode and prefill token counts, Flash shapes and odd
 * ones (D = 8,192 and 1,000 at three streams take the finish's unstaged partials). */
static void test_hc_pre_cases(void) {
    const int nts[3] = { 1, 3, 64 };
    for (int ni = 0; ni < 3; ni++) {
        test_hc_pre(nts[ni], 4096, 4, 0, 1);
        test_hc_pre(nts[ni], 4096, 4, 0, 0);
        test_hc_pre(nts[ni], 4096, 4, 1, 1);
        test_hc_pre(nts[ni], 96, 4, 0, 1);
    }
    test_hc_pre(2, 100, 4, 1, 0);
    test_hc_pre(1, 1000, 3, 0, 1);
    test_hc_pre(5, 8192, 4, 0, 1);
    /* a prompt's batch (k_hcb_dots: 16 tokens a block, 128 channels a chunk): token counts and
     * widths that fill neither, three streams, head mode */
    test_hc_pre(200, 4096, 4, 0, 1);
    test_hc_pre(100, 4096, 4, 1, 0);
    test_hc_pre(37, 1000, 3, 0, 1);
    test_hc_pre(37, 1000, 3, 1, 0);        /* head mode and no update on a part-filled chunk */
    test_hc_pre(20, 96, 4, 0, 0);
    test_hc_pre(40, 8192, 4, 0, 1);        /* wider than k_hcb_finish's kept values: its second reads */
    /* the published files' fn weights are F16 (k_hcb_dots<H, F16>, k_hc_pre<H, F16>); another
     * type takes the chain of ops (hc_post, the norms, the product, hc_mix) */
    test_hc_pre_t(DS4_TYPE_F16, 37, 1000, 3, 0, 1);
    test_hc_pre_t(DS4_TYPE_F16, 200, 4096, 4, 0, 1);
    test_hc_pre_t(DS4_TYPE_F16, 5, 4096, 4, 0, 1);
    test_hc_pre_t(DS4_TYPE_F16, 1, 4096, 4, 1, 1);
    test_hc_pre_t(DS4_TYPE_Q8_0, 20, 4096, 4, 0, 1);
}

int main(int argc, char **argv) {
    if (argc > 2 || (argc == 2 && strcmp(argv[1], "tc") != 0 && strcmp(argv[1], "tc2") != 0 &&
                     strcmp(argv[1], "tc3") != 0 && strcmp(argv[1], "tc4") != 0 && strcmp(argv[1], "tc1") != 0 &&
                     strcmp(argv[1], "rows") != 0 && strcmp(argv[1], "hc") != 0 &&
                     strcmp(argv[1], "ix") != 0 && strcmp(argv[1], "att") != 0 && strcmp(argv[1], "pl3") != 0)) {
        fprintf(stderr, "usage: test_backend_ops [tc|tc1|tc2|tc3|tc4|rows|hc|ix|att|pl3]   (tc: only the tensor-core engine's cases, "
                        "with DS4_CUDA_PREFILL_TC 4, then 3 and 2 byte for byte against 4, then 1; tc1, tc2: those with 1 or 2 alone; tc3: 3 "
                        "and 2; tc4: 4 and 3; rows: "
                        "only a batch's rows against one-token calls: attention, the weight products; ix: only the "
                        "indexer at a prompt's batch sizes; att: only the prefill attention kernels; pl3: the prefill attention, "
                        "then tc4's cases, with DS4_CUDA_PREFILL_PLANES=3)\n");
        return 2;
    }
    B[0] = ds4_backend_cpu();
    B[1] = ds4_backend_cuda();
    if (B[1]->init() != 0) {
        printf("skipped: no GPU\n");
        return 0;
    }
    if (B[0]->init() != 0) { fprintf(stderr, "test: CPU backend init failed\n"); return 2; }
    /* one session per backend, sized for the largest case below (ds4_gpu.h: an
     * op asked for more than its session holds exits, naming the limit) */
    ds4_limits lim;
    memset(&lim, 0, sizeof lim);
    lim.max_batch = 256;                 /* test_compress_pool(0, 256, ...) */
    lim.prefill_tc = 4;                  /* the default (DS4_CUDA_PREFILL_TC) */
    lim.prefill_attn = 2;                /* the default (DS4_CUDA_PREFILL_ATTN) */
    lim.prefill_planes = 2;              /* the default (DS4_CUDA_PREFILL_PLANES) */
    lim.decode_group = 1;                /* the default (DS4_CUDA_DECODE_GROUP) */
    lim.n_ctx = 32768;                   /* attention and indexer at position 20000 */
    lim.n_swa = 128;                     /* the largest window of the attention cases */
    lim.n_embd = 8192;
    lim.n_head = 64;
    lim.head_dim = 512;
    lim.idx_topk = 1024;
    lim.n_expert = 256;
    lim.n_expert_used = 8;
    lim.n_ff_exp = 4096;
    lim.n_vocab = 1;
    lim.max_k = 16384;
    lim.max_matrix = (int64_t)64 << 20;
    for (int bi = 0; bi < 2; bi++) {
        void *s = B[bi]->session_new(&lim);
        if (!s) { fprintf(stderr, "test: session of backend %s failed\n", B[bi]->name); return 2; }
        B[bi]->session_bind(s);
    }
    g_n_ctx = lim.n_ctx;
    if (argc == 2 && !strcmp(argv[1], "hc")) {
        test_hc_pre_cases();
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (argc == 2 && !strcmp(argv[1], "rows")) {
        test_attention_rows();
        test_products_rows();
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (argc == 2 && !strcmp(argv[1], "att")) {
        if (test_prefill_attention(&lim) != 0) return 2;
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (argc == 2 && !strcmp(argv[1], "pl3")) {     /* the activations on three planes, not the default two */
        lim.prefill_planes = 3;
        if (test_prefill_attention(&lim) != 0 || test_tc_engine(&lim, 4, 3) != 0) return 2;
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (argc == 2 && !strcmp(argv[1], "ix")) {
        if (test_indexer_batches(&lim) != 0) return 2;
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (argc == 2) {
        const int first = !strcmp(argv[1], "tc1") ? 1 : !strcmp(argv[1], "tc2") ? 2 : !strcmp(argv[1], "tc3") ? 3 : 4,
                  last = !strcmp(argv[1], "tc") || !strcmp(argv[1], "tc1") ? 1 : !strcmp(argv[1], "tc4") ? 3 : 2;
        if (test_tc_engine(&lim, first, last) != 0) return 2;
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }

    const int types[4] = { DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_BF16, DS4_TYPE_Q8_0 };
    const int nts[3] = { 1, 3, 64 };

    test_memory();

    for (int ti = 0; ti < 4; ti++)
        for (int ni = 0; ni < 3; ni++) test_embed(types[ti], 160, 50, nts[ni], 4);
    test_embed(DS4_TYPE_Q8_0, 4096, 20, 2, 1);

    for (int ni = 0; ni < 3; ni++) {
        test_rmsnorm(nts[ni], 4096, 1, 0);
        test_rmsnorm(nts[ni], 1000, 0, 0);
    }
    test_rmsnorm(3, 96, 1, 1);
    test_rmsnorm(2, 1001, 1, 0);            /* not a multiple of 4: scalar path */
    test_rmsnorm(1, 16384, 0, 1);           /* the flattened mHC state, in place */
    test_rmsnorm(64, 512, 0, 0);            /* per-head norm shape */

    /* matmul: fast-path shapes (K a multiple of 1024 with K/1024 in 1,2,4,8),
     * generic shapes (K = 96, 160, 3072), every type, decode / small batch /
     * prefill token counts, and an expert of a 3-D weight */
    for (int ti = 0; ti < 4; ti++) {
        const int t = types[ti];
        test_matmul(t, 4096, 300, 1, 0, 1);
        test_matmul(t, 4096, 300, 1, 0, 3);
        test_matmul(t, 4096, 300, 1, 0, 64);
        test_matmul(t, 1024, 515, 1, 0, 1);
        test_matmul(t, 1024, 515, 1, 0, 8);
        test_matmul(t, 2048, 77, 1, 0, 5);
        test_matmul(t, 8192, 40, 1, 0, 1);
        test_matmul(t, 96, 37, 1, 0, 1);
        test_matmul(t, 160, 100, 1, 0, 3);
        test_matmul(t, 160, 100, 1, 0, 64);
        test_matmul(t, 3072, 50, 1, 0, 2);
        test_matmul(t, 1024, 64, 3, 2, 1);
        test_matmul(t, 1024, 64, 3, 1, 64);
    }
    test_matmul(DS4_TYPE_Q8_0, 4096, 4099, 1, 0, 1);    /* many rows: rows per warp > 1 */
    test_matmul(DS4_TYPE_Q8_0, 2048, 4096, 1, 0, 2);

    for (int ti = 0; ti < 4; ti++)
        for (int ni = 0; ni < 3; ni++) {
            test_matmul_grouped(types[ti], 1024, 4, 96, nts[ni]);
            test_matmul_grouped(types[ti], 96, 3, 50, nts[ni]);
        }
    test_matmul_grouped(DS4_TYPE_Q8_0, 4096, 8, 128, 1);

    for (int ni = 0; ni < 3; ni++) {
        test_hc_mix(nts[ni], 4096, 4, 0, 20);
        test_hc_mix(nts[ni], 100, 4, 1, 20);
        test_hc_post(nts[ni], 4096, 4);
        test_hc_post(nts[ni], 100, 4);
    }
    test_hc_mix(3, 96, 4, 0, 1);

    for (int ni = 0; ni < 3; ni++) {
        test_rope(nts[ni], 5, 512, 64, 0, 1, 0, 0);
        test_rope(nts[ni], 5, 512, 64, 1000, 1, 1, 0);
        test_rope(nts[ni], 3, 96, 32, 77, 4, 1, 1);
    }
    test_rope(16, 2, 128, 64, 3, 128, 0, 1);

    /* attention: window only (ring/batch splits: pos0 > 0 with nt < W, nt > W,
     * and a batch that starts inside the window), ratio 4 with top-k, ratio
     * 128; decode (split rows) and prefill; d = 512, 128, 96; H = 64, 5, 3 */
    test_attention(128, 0, 1, 64, 512, 0, 0);
    test_attention(128, 300, 1, 64, 512, 0, 0);
    test_attention(128, 37, 3, 64, 512, 0, 0);
    test_attention(16, 200, 64, 5, 128, 0, 0);
    test_attention(32, 5, 40, 3, 96, 0, 0);
    test_attention_rows();
    test_products_rows();
    test_attention(128, 2000, 1, 64, 512, 4, 512);
    test_attention(128, 130, 3, 8, 512, 4, 16);
    test_attention(32, 10, 64, 5, 128, 4, 40);
    test_attention(128, 1000, 1, 64, 512, 128, 0);
    test_attention(128, 700, 3, 5, 512, 128, 0);
    test_attention(16, 300, 64, 3, 96, 128, 0);
    test_attention(128, 20000, 1, 4, 128, 128, 0);   /* many compressed rows */
    /* batches whose blocks fill the device take the tile kernels (DS4_CUDA_PREFILL_ATTN=2: d =
     * 128 k_attention_mma, 96 k_attention_tiles):
     * H = 5 and 3 (blocks of 32 heads not full), d = 96 (lanes past d), 49 (not whole float4s:
     * k_attention), the fused and the separate de-rotation */
    test_attention(16, 200, 200, 5, 128, 0, 0);
    test_attention(32, 10, 200, 5, 128, 4, 40);
    test_attention(16, 300, 256, 3, 96, 128, 0);
    test_attention_step(32, 5, 200, 3, 96, 4, 40, 32, 1);
    test_attention_step(16, 0, 200, 3, 49, 128, 0, 16, 0);

    /* attention_probs, each case at several positions on fixed buffers (a replayed step):
     * decode inside the first window, at and across its wrap (W = 128: p = 126..129), ratio 4
     * with empty picks (p = 3: one visible row; k = 512 above the visible rows), ratio 128
     * before, at and past its block boundaries (p = 127, 255), many compressed rows; and
     * batches that straddle the window and a ratio-128 boundary, an odd head width */
    {
        static const int dec0[] = { 0, 37, 126, 127, 128, 129, 300 };
        static const int dec4[] = { 3, 127, 128, 2000 };
        static const int dec4s[] = { 30, 31, 32, 64 };
        static const int dec128[] = { 126, 127, 128, 255, 256, 1000 };
        static const int far128[] = { 20000 };
        static const int pre0[] = { 0, 200 }, pre4[] = { 10, 300 }, pre128[] = { 100, 300 };
        static const int odd128[] = { 254 }, small4[] = { 130 };
        test_attention_probs(128, 64, 512, 0, 0, 1, 7, dec0);
        test_attention_probs(128, 64, 512, 4, 512, 1, 4, dec4);
        test_attention_probs(32, 8, 128, 4, 16, 1, 4, dec4s);
        test_attention_probs(128, 64, 512, 128, 0, 1, 6, dec128);
        test_attention_probs(128, 4, 128, 128, 0, 1, 1, far128);
        test_attention_probs(16, 5, 128, 0, 0, 64, 2, pre0);
        test_attention_probs(32, 5, 128, 4, 40, 64, 2, pre4);
        test_attention_probs(16, 3, 96, 128, 0, 64, 2, pre128);
        test_attention_probs(16, 3, 49, 128, 0, 2, 1, odd128);
        test_attention_probs(128, 8, 512, 4, 16, 3, 1, small4);
    }

    test_ring_store(16, 96, 14, 3);
    test_ring_store(16, 96, 5, 40);
    test_ring_store(128, 512, 0, 1);

    test_add_cyclic(0, 1, 4, 1024);
    test_add_cyclic(6, 64, 128, 96);

    /* compressor: c = 1 (ratio 128) and c = 2 (ratio 4, overlapping windows),
     * from position 0 and from inside a block (state ring rows in use) */
    test_compress_pool(0, 64, 4, 2, 128);
    test_compress_pool(7, 1, 4, 2, 128);
    test_compress_pool(5, 3, 4, 2, 512);
    test_compress_pool(0, 3, 4, 2, 96);
    test_compress_pool(0, 256, 128, 1, 512);
    test_compress_pool(127, 1, 128, 1, 96);
    test_compress_pool(100, 64, 128, 1, 512);
    test_compress_pool(6, 1, 4, 1, 96);
    /* more entries than the kernel stages at once (c ratio > 128): staged in chunks, twice */
    test_compress_pool(300, 256, 256, 1, 96);
    test_compress_pool(0, 256, 128, 2, 64);

    test_indexer(100, 1, 64, 128, 4, 512);    /* fewer visible rows than k: -1 padding */
    test_indexer(4000, 1, 64, 128, 4, 512);
    test_indexer(0, 64, 64, 128, 4, 16);
    test_indexer(300, 3, 32, 64, 4, 40);
    test_indexer(20000, 2, 64, 128, 4, 512);  /* 5000 visible rows: chunked selection */
    /* a prompt's batch (k_indexer_tiles): against the CPU, then against one-query calls */
    test_indexer(1000, 250, 64, 128, 4, 512);  /* 250..312 rows: tiles of 64, fewer rows than k */
    test_indexer(2040, 100, 64, 128, 4, 512);  /* 510..535 rows: the selection begins inside the batch */
    test_indexer_rp(300, 40, 32, 64, 4, 40, 32);
    test_indexer_rp(61, 19, 8, 64, 4, 16, 64);  /* 16 queries a block, the last block partial */
    test_indexer_rows_as_steps(2040, 40, 64, 128, 512, 64);
    test_indexer_rows_as_steps(4000, 24, 64, 128, 512, 0);
    test_indexer_rows_as_steps(300, 33, 32, 64, 40, 32);

    for (int ni = 0; ni < 3; ni++) {
        test_moe_route(nts[ni], 16, 6, 0, 1, 1.5f);
        test_moe_route(nts[ni], 256, 6, 0, 1, 2.5f);
        test_moe_route(nts[ni], 16, 6, 1, 1, 1.5f);
    }
    test_moe_route(3, 64, 8, 0, 0, 0.0f);
    /* the fused router: decode (fused on CUDA) and a prompt (composition) */
    for (int ni = 0; ni < 3; ni++) {
        test_moe_gate(DS4_TYPE_F32, 4096, nts[ni], 16, 6, 0, 1);
        test_moe_gate(DS4_TYPE_F16, 4096, nts[ni], 256, 6, 0, 1);
        test_moe_gate(DS4_TYPE_F32, 4096, nts[ni], 16, 6, 1, 1);
        test_moe_gate(DS4_TYPE_F32, 4096, nts[ni], 64, 6, 0, 0);
    }
    test_moe_gate(DS4_TYPE_F16, 1000, 2, 16, 6, 0, 1);    /* K not a multiple of 1024: composition */

    /* experts: decode kernels (nt <= 8), a batch with few tokens per expert
     * (host count, decode kernels) and a skewed batch (grouped GEMMs);
     * fast shapes (D, F multiples of 1024) and generic ones */
    for (int ti = 0; ti < 4; ti++) {
        test_moe_experts(types[ti], 1024, 1024, 8, 4, 1, 10.0f, 0);
        test_moe_experts(types[ti], 1024, 1024, 8, 4, 3, 10.0f, 0);
        test_moe_experts(types[ti], 96, 64, 4, 2, 3, 0.0f, 0);
    }
    test_moe_experts(DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 1, 10.0f, 0);
    test_moe_experts(DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 2, 10.0f, 0);    /* a speculative check's widths */
    test_moe_experts(DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 4, 10.0f, 0);
    test_moe_experts(DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 3, 10.0f, 1);
    test_moe_experts(DS4_TYPE_Q8_0, 1024, 1024, 32, 4, 12, 10.0f, 0);
    test_moe_experts(DS4_TYPE_Q8_0, 1024, 1024, 8, 4, 64, 10.0f, 1);
    test_moe_experts(DS4_TYPE_F16, 1024, 1024, 8, 4, 64, 10.0f, 1);
    test_moe_experts(DS4_TYPE_Q8_0, 96, 64, 4, 2, 64, 0.0f, 1);

    test_swiglu(1000, 10.0f, 0);
    test_swiglu(3 * 4096, 0.0f, 0);
    test_swiglu(4097, 7.0f, 1);

    test_add_scale(1);
    test_add_scale(100003);
    test_pair_rows(4, 4, 4096);          /* one head row of Flash's 4 streams */
    test_pair_rows(16, 4, 4096);
    test_pair_rows(7, 3, 1000);

    /* fused ops: decode and prefill token counts, Flash shapes and odd ones */
    test_hc_pre_cases();
    {
        /* the attention input's seven projections (ratio-4 layer of Flash) */
        const int q8[7] = { DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0, DS4_TYPE_Q8_0,
                            DS4_TYPE_Q8_0, DS4_TYPE_Q8_0 };
        const int r7[7] = { 1024, 512, 1024, 1024, 256, 256, 64 };
        const int mixed[4] = { DS4_TYPE_Q8_0, DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_Q8_0 };
        const int r4[4] = { 300, 64, 515, 100 };
        const int two[2] = { DS4_TYPE_Q8_0, DS4_TYPE_Q8_0 };
        const int r2[2] = { 4096, 1024 };
        for (int ni = 0; ni < 3; ni++) {
            test_matmul_multi(7, q8, r7, 4096, nts[ni], 0, 1, 37, 4);
            test_matmul_multi(4, mixed, r4, 2048, nts[ni], 0, 1, 5, 128);
            test_matmul_multi(2, two, r2, 1024, nts[ni], 1, 0, 0, 1);   /* q_b + indexer q_b, normed input */
            test_matmul_multi(4, mixed, r4, 96, nts[ni], 1, 1, 3, 4);   /* generic K: the composition */
        }
        test_matmul_multi(2, two, r2, 1024, 2, 1, 0, 0, 1);
        test_matmul_multi(2, two, r2, 1024, 4, 1, 1, 126, 128);
        test_matmul_multi(4, mixed, r4, 8192, 1, 1, 1, 1, 4);
    }
    for (int ni = 0; ni < 3; ni++) {
        test_head_norm_rope(nts[ni], 64, 512, 64, 1000, 0, 1, 0);
        test_head_norm_rope(nts[ni], 1, 512, 64, 3, 1, 0, 0);
        test_head_norm_rope(nts[ni], 3, 96, 16, 77, 1, 1, 0);
        test_head_norm_rope(nts[ni], 64, 512, 64, 1000, 0, 1, 1);   /* a layer's q and kv */
        test_head_norm_rope(nts[ni], 3, 96, 16, 77, 1, 0, 2);
    }
    for (int ti = 0; ti < 4; ti++) {
        test_matmul_swiglu(types[ti], 4096, 2048, 1, 10.0f);
        test_matmul_swiglu(types[ti], 4096, 2048, 3, 10.0f);
        test_matmul_swiglu(types[ti], 96, 48, 2, 0.0f);
        test_matmul_swiglu(types[ti], 1024, 512, 64, 7.0f);
    }
    /* decode (split rows: the combine kernel stores the ring and de-rotates),
     * a batch (one chunk), the unfused de-rotation (d - n_rot odd) */
    test_attention_step(128, 2000, 1, 64, 512, 4, 512, 64, 1);
    test_attention_step(128, 1000, 1, 64, 512, 128, 0, 64, 1);
    test_attention_step(128, 300, 1, 64, 512, 0, 0, 64, 0);
    test_attention_step(128, 37, 3, 64, 512, 0, 0, 64, 0);
    test_attention_step(16, 200, 64, 5, 128, 4, 40, 32, 1);
    test_attention_step(32, 5, 40, 3, 96, 0, 0, 16, 0);
    test_attention_step(16, 30, 1, 3, 49, 0, 0, 16, 0);
    test_attention_step(16, 300, 2, 3, 49, 128, 0, 16, 1);
    /* one token (fused kernel) with and without an emitted row, and batches */
    /* decode runs on fixed buffers (the replay of a captured step): window
     * wrap, emit steps of ratio 4 and 128, the first split of attention's rows */
    test_decode_run(48, 8, 128, 0, 0, 80);
    test_decode_run(32, 8, 128, 4, 16, 90);
    test_decode_run(32, 4, 64, 128, 0, 300);
    /* block boundaries: the steps just before, at and after a ratio-4 block
     * closes, and the indexer's visible rows reaching k (16 at p = 63) */
    test_compressor_step(11, 1, 4, 2, 128, 64);
    test_compressor_step(12, 1, 4, 2, 128, 64);
    test_compressor_step(126, 1, 128, 1, 128, 64);
    test_compressor_step(128, 1, 128, 1, 128, 64);
    test_compressor_steps(11, 1, 4, 512, 128);      /* one launch at decode: an emit step */
    test_compressor_steps(12, 1, 4, 512, 128);      /* and one that does not emit */
    test_compressor_steps(127, 1, 128, 512, 128);   /* ratio 128 beside a ratio-4 indexer */
    test_compressor_steps(5, 6, 4, 128, 64);        /* a batch: the composition, each in turn */
    test_indexer_rp(63, 1, 64, 128, 4, 16, 64);      /* indexer_step: the rope folded into the scores */
    test_indexer_rp(4000, 1, 64, 128, 4, 512, 64);
    test_indexer_rp(300, 3, 32, 64, 4, 40, 32);
    test_indexer(62, 1, 8, 64, 4, 16);
    test_indexer(63, 1, 8, 64, 4, 16);
    test_indexer(64, 1, 8, 64, 4, 16);
    test_compressor_step(7, 1, 4, 2, 512, 64);
    test_compressor_step(8, 1, 4, 2, 512, 64);
    test_compressor_step(3, 1, 4, 2, 128, 64);
    test_compressor_step(127, 1, 128, 1, 512, 64);
    test_compressor_step(300, 1, 128, 1, 512, 64);
    test_compressor_step(255, 1, 128, 1, 96, 16);
    test_compressor_step(0, 64, 4, 2, 128, 64);
    test_compressor_step(100, 64, 128, 1, 512, 64);
    test_compressor_step(5, 3, 4, 2, 96, 16);

    test_moe_experts_add(DS4_TYPE_Q8_0, 4096, 2048, 16, 6, 1, 10.0f, 0, 1);
    test_moe_experts_add(DS4_TYPE_F32, 96, 64, 4, 2, 3, 0.0f, 0, 1);
    test_moe_experts_add(DS4_TYPE_Q8_0, 1024, 1024, 8, 4, 64, 10.0f, 1, 1);

    test_quant_types();

    if (test_tc_engine(&lim, 4, 1) != 0) return 2;
    if (test_indexer_batches(&lim) != 0) return 2;
    if (test_prompt_batches(&lim) != 0) return 2;

    if (test_prefill_attention(&lim) != 0) return 2;

    test_determinism();

    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
