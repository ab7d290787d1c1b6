/* tests/test_kernels.c -- every op of the CPU backend (ds4_gpu.h) against a
 * naive reference written from the header's text alone.
 *
 * The references compute in double wherever the header does not prescribe
 * float arithmetic (it does for RoPE's theta and for softplus's 1+expf(x)),
 * on fresh inputs from a fixed-seed splitmix64 generator.  Weights of every
 * type are built byte by byte here (our own f16/bf16 round-to-nearest-even
 * conversion, our own Q8_0 blocks) and the references dequantise the same
 * bytes in double.  Outputs that an op fully writes are poisoned with NaN
 * before the call; rows an op must not read (unreferenced ring/state slots,
 * compressed rows outside the selection) are NaN too, so reading one shows.
 *
 * Each check prints "ok   <name>" or "FAIL <name>: max_abs=.. at i=..", and
 * the last line is "N passed, M failed"; the exit status is 1 if M > 0.
 *
 * Tolerances are stated next to each check.  u = 2^-24 is the f32 unit
 * roundoff.  For a dot product of K terms accumulated in f32 the rounding
 * error is a random walk of K steps of at most u*|partial sum|, so
 * |err| <~ u*sqrt(K)*sum|terms|; we allow 16x that (>25 sigma), which is
 * still orders of magnitude below what any indexing error produces.
 *
 * Build: cc -std=c11 -O2 -g -Wall -Wextra -I. tests/test_kernels.c build/cpu/ds4.o \
 *          -o build/tests/test_kernels -lm -lpthread
 * Usage: test_kernels [threads]   (default 3: an odd split over the pool)
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ds4.h"
#include "ds4_gpu.h"

#define U 5.9604644775390625e-08 /* 2^-24: f32 unit roundoff */

static const ds4_backend *be;

/* The step block of a call at pos0 (ds4_gpu.h; host memory on the CPU backend). */
static ds4_step g_step;
static const ds4_step *at(int pos0) {
    g_step.pos0 = pos0;
    return &g_step;
}
static int n_pass, n_fail;

/* ------------------------------------------------------------------ PRNG */

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static uint64_t rnd64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rnd01(void) { return (double)(rnd64() >> 11) * (1.0 / 9007199254740992.0); }
static float rndf(float lo, float hi) { return (float)(lo + (hi - lo) * rnd01()); }
static int rndi(int n) { return (int)(rnd64() % (uint64_t)n); } /* [0, n) */
static void fill(float *a, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) a[i] = rndf(lo, hi);
}

/* ---------------------------------------------------------------- memory */

static void *xmalloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) { fprintf(stderr, "test_kernels: out of memory\n"); exit(2); }
    return p;
}
static float *fbuf(size_t n) { return xmalloc(n * sizeof(float)); }
static double *dbuf(size_t n) { return xmalloc(n * sizeof(double)); }

static void *dalloc(size_t bytes) {
    void *p = be->alloc(bytes ? bytes : 4);
    if (!p) { fprintf(stderr, "test_kernels: backend alloc of %zu bytes failed\n", bytes); exit(2); }
    return p;
}
static float *dev_from(const float *h, size_t n) {
    float *d = dalloc(n * 4);
    be->upload(d, h, n * 4);
    return d;
}
static int32_t *dev_from_i(const int32_t *h, size_t n) {
    int32_t *d = dalloc(n * 4);
    be->upload(d, h, n * 4);
    return d;
}
static float *dev_nan(size_t n) {              /* an output buffer poisoned with NaN */
    float *h = fbuf(n);
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    float *d = dev_from(h, n);
    free(h);
    return d;
}
static float *dl(const float *d, size_t n) {    /* download into a fresh host buffer */
    float *h = fbuf(n);
    be->synchronize();
    be->download(h, d, n * 4);
    return h;
}

/* ---------------------------------------------------------------- checks */

/* got vs ref with per-element tolerance tol[i] (NULL: exact).  A NaN in got
 * always fails.  Prints one line. */
static int report(const char *name, const float *got, const double *ref, const double *tol, size_t n) {
    size_t bad = 0, wi = 0;
    double wmax = -1;
    for (size_t i = 0; i < n; i++) {
        double e = isnan(got[i]) ? INFINITY : fabs((double)got[i] - ref[i]);
        double t = tol ? tol[i] : 0.0;
        if (!(e <= t)) {
            if (e > wmax || bad == 0) { wmax = e; wi = i; }
            bad++;
        }
    }
#ifdef TK_SHOW_MARGIN
    {   /* developer aid: how much of the tolerance the worst element used */
        double r = 0;
        for (size_t i = 0; i < n; i++) {
            double e = fabs((double)got[i] - ref[i]), t = tol ? tol[i] : 0.0;
            if (t > 0 && e / t > r) r = e / t;
        }
        printf("     margin: worst err/tol = %.3g\n", r);
    }
#endif
    if (!bad) { printf("ok   %s\n", name); n_pass++; return 1; }
    printf("FAIL %s: max_abs=%.3g at i=%zu (got %.9g ref %.9g tol %.3g; %zu of %zu elements out of tolerance)\n",
           name, wmax, wi, (double)got[wi], ref[wi], tol ? tol[wi] : 0.0, bad, n);
    n_fail++;
    return 0;
}

static int report_i(const char *name, const int32_t *got, const int32_t *ref, size_t n) {
    size_t bad = 0, wi = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i] != ref[i]) { if (!bad) wi = i; bad++; }
    if (!bad) { printf("ok   %s\n", name); n_pass++; return 1; }
    printf("FAIL %s: max_abs=%lld at i=%zu (got %d expected %d; %zu of %zu differ)\n", name,
           llabs((long long)got[wi] - ref[wi]), wi, got[wi], ref[wi], bad, n);
    n_fail++;
    return 0;
}

/* Bitwise equality of float arrays (for "left untouched" checks). */
static int report_bits(const char *name, const float *got, const float *expect, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &expect[i], 4) != 0) {
            printf("FAIL %s: max_abs=%.3g at i=%zu (got %.9g, must stay %.9g)\n", name,
                   fabs((double)got[i] - expect[i]), i, (double)got[i], (double)expect[i]);
            n_fail++;
            return 0;
        }
    }
    printf("ok   %s\n", name);
    n_pass++;
    return 1;
}

static void report_bool(const char *name, int ok, double max_abs, long at) {
    if (ok) { printf("ok   %s\n", name); n_pass++; }
    else { printf("FAIL %s: max_abs=%.3g at i=%ld\n", name, max_abs, at); n_fail++; }
}

/* ------------------------------------------------- f16 / bf16 / weights */

static uint16_t f16_from_f32(float f) {          /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0);
    if (ax >= 0x477ff000u) return sign | 0x7c00;         /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                              /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &ax, 4);
        double v = (double)a * 16777216.0;               /* in units of 2^-24, exact */
        double r = floor(v), fr = v - r;
        if (fr > 0.5 || (fr == 0.5 && fmod(r, 2.0) != 0.0)) r += 1.0;
        return sign | (uint16_t)r;                       /* r == 1024 encodes 2^-14 */
    }
    uint32_t e = (ax >> 23) - 127 + 15, m = ax & 0x7fffffu;
    uint32_t h = (e << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;   /* carry into e is right */
    return sign | (uint16_t)h;
}
static double f16_to_f64(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}
static uint16_t bf16_from_f32(float f) {         /* round to nearest even (finite inputs) */
    uint32_t x;
    memcpy(&x, &f, 4);
    x += 0x7fffu + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}
static double bf16_to_f64(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static const char *tname(int type) {
    switch (type) {
    case DS4_TYPE_F32: return "F32";
    case DS4_TYPE_F16: return "F16";
    case DS4_TYPE_BF16: return "BF16";
    case DS4_TYPE_Q8_0: return "Q8_0";
    case DS4_TYPE_I32: return "I32";
    }
    return "?";
}

typedef struct {
    ds4_weight w;
    uint8_t   *bytes;
    double    *val;     /* dequantised, [E][N][K] */
} tweight;

/* A {K, N, E} weight of the given type with values of magnitude <= amp. */
static void tw_make(tweight *t, const char *name, int type, int64_t K, int64_t N, int64_t E, float amp) {
    size_t rb = ds4_row_bytes(type, K), rows = (size_t)(N * E);
    t->bytes = xmalloc(rb * rows);
    t->val = dbuf((size_t)K * rows);
    for (size_t r = 0; r < rows; r++) {
        uint8_t *row = t->bytes + r * rb;
        double *v = t->val + r * (size_t)K;
        for (int64_t k = 0; k < K; k++) {
            float f = rndf(-amp, amp);
            switch (type) {
            case DS4_TYPE_F32:
                memcpy(row + 4 * k, &f, 4);
                v[k] = f;
                break;
            case DS4_TYPE_F16: {
                if (rndi(16) == 0) f = rndf(-3e-5f, 3e-5f);   /* f16 subnormals too */
                uint16_t h = f16_from_f32(f);
                memcpy(row + 2 * k, &h, 2);
                v[k] = f16_to_f64(h);
            } break;
            case DS4_TYPE_BF16: {
                uint16_t b = bf16_from_f32(f);
                memcpy(row + 2 * k, &b, 2);
                v[k] = bf16_to_f64(b);
            } break;
            case DS4_TYPE_Q8_0: {
                if (k % DS4_QK8_0) break;
                uint8_t *blk = row + (k / DS4_QK8_0) * DS4_Q8_0_BLOCK_BYTES;
                float d = rndf(0.5f, 1.0f) * amp / 127.0f;
                if (rndi(8) == 0) d = -d;
                uint16_t dh = f16_from_f32(d);
                memcpy(blk, &dh, 2);
                double dv = f16_to_f64(dh);
                for (int j = 0; j < DS4_QK8_0; j++) {
                    int q = rndi(255) - 127;
                    if (rndi(64) == 0) q = -128;
                    int8_t qq = (int8_t)q;
                    memcpy(blk + 2 + j, &qq, 1);
                    v[k + j] = dv * q;
                }
            } break;
            }
        }
    }
    memset(&t->w, 0, sizeof t->w);
    t->w.name = name;
    t->w.type = type;
    t->w.n_dims = E > 1 ? 3 : 2;
    t->w.ne[0] = K; t->w.ne[1] = N; t->w.ne[2] = E;
    t->w.nbytes = rb * rows;
    t->w.host = t->bytes;
    if (be->upload_weight(&t->w) != 0 || !t->w.dev) {
        fprintf(stderr, "test_kernels: upload_weight(%s) failed\n", name);
        exit(2);
    }
}
static void tw_free(tweight *t) {
    be->release_weight(&t->w);
    free(t->bytes);
    free(t->val);
}

/* ---------------------------------------------------- harness self-tests */

static void test_converters(void) {
    static const struct { float f; uint16_t h; } cases[] = {
        { 1.0f, 0x3c00 }, { -2.0f, 0xc000 }, { 65504.0f, 0x7bff }, { 65519.99f, 0x7bff },
        { 65520.0f, 0x7c00 }, { 0x1p-24f, 0x0001 }, { 0x1p-25f, 0x0000 }, { 0x3p-25f, 0x0002 },
        { 0x1p-14f, 0x0400 }, { 0x1p-14f - 0x1p-25f, 0x0400 }, { 1.0f + 0x1p-11f, 0x3c00 },
        { 1.0f + 0x3p-11f, 0x3c02 }, { 0.1f, 0x2e66 }, { -0.0f, 0x8000 },
    };
    int ok = 1; long at = -1;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (f16_from_f32(cases[i].f) != cases[i].h) { ok = 0; at = (long)i; break; }
    for (uint32_t h = 0; ok && h < 65536; h++) {
        if (((h >> 10) & 31) == 31 && (h & 1023)) continue;   /* NaN */
        if (f16_from_f32((float)f16_to_f64((uint16_t)h)) != h) { ok = 0; at = (long)h; }
    }
    report_bool("harness: f16 round-to-nearest-even converter (known values, all 65536 round trips)", ok, 0, at);

    ok = 1; at = -1;
    if (bf16_from_f32(1.0f) != 0x3f80 || bf16_from_f32(1.0f + 0x1p-8f) != 0x3f80 ||
        bf16_from_f32(1.0f + 0x3p-8f) != 0x3f82 || bf16_from_f32(-3.0f) != 0xc040) ok = 0;
    for (uint32_t b = 0; ok && b < 65536; b++) {
        if (((b >> 7) & 255) == 255) continue;                 /* inf/NaN */
        if (bf16_from_f32((float)bf16_to_f64((uint16_t)b)) != b) { ok = 0; at = (long)b; }
    }
    report_bool("harness: bf16 round-to-nearest-even converter", ok, 0, at);
}

/* ------------------------------------------------------------- lifetime */

/* ds4_ctx_plan_bytes, the plan a caller prints before a context is made, against what
 * ds4_ctx_new allocates: tiny and small, short and long contexts, batch 1 and large.  The
 * buffers that scale are planned exactly; a fixed remainder (a stage's step block) may not be. */
static void test_ctx_plan(void) {
    /* tiny+mtp: the MTP block's caches, its eh_proj input and its queue (ds4_mtp_queue) */
    static const char *const cfg[] = { "tiny/1048576", "small/1048576", "tiny+mtp/1048576" };
    static const int sizes[][2] = { { 16, 1 }, { 300, 300 }, { 70000, 64 }, { 1 << 20, 8 } };
    for (int ci = 0; ci < 3; ci++) {
        char err[512];
        ds4_model *m = ds4_synth_open(cfg[ci], 1, DS4_TYPE_F32, 2, err, sizeof err);
        if (!m) { printf("FAIL ctx plan: %s\n", err); n_fail++; continue; }
        for (int si = 0; si < (ci == 0 ? 4 : 3); si++) {      /* 1M positions on tiny alone: memory */
            ds4_ctx *c = ds4_ctx_new(m, be, sizes[si][0], sizes[si][1], err, sizeof err);
            char name[128];
            snprintf(name, sizeof name, "ctx plan = allocations (%s, n_ctx %d, batch %d)", cfg[ci], sizes[si][0], sizes[si][1]);
            if (!c) { printf("FAIL %s: %s\n", name, err); n_fail++; continue; }
            const size_t plan = ds4_ctx_plan_bytes(m, sizes[si][0], sizes[si][1]), got = ds4_ctx_bytes(c);
            const size_t diff = plan > got ? plan - got : got - plan;
            report_bool(name, diff <= 4096, (double)diff, 0);
            ds4_ctx_free(c);
        }
        ds4_model_close(m);
    }
}

static void test_lifetime(void) {
    const size_t n = 1000;
    uint8_t *d = dalloc(n), *h = xmalloc(n);
    memset(h, 0xA5, n);
    be->download(h, d, n);
    long at = -1;
    for (size_t i = 0; i < n; i++) if (h[i]) { at = (long)i; break; }
    report_bool("alloc returns zero-filled memory (1000 bytes)", at < 0, at < 0 ? 0 : 1, at);

    uint8_t *src = xmalloc(n), *back = xmalloc(n), *d2 = dalloc(n);
    for (size_t i = 0; i < n; i++) src[i] = (uint8_t)rnd64();
    be->upload(d, src, n);
    be->copy(d2, d, n);
    be->synchronize();
    be->download(back, d2, n);
    at = -1;
    for (size_t i = 0; i < n; i++) if (back[i] != src[i]) { at = (long)i; break; }
    report_bool("upload / copy / download round trip (1000 bytes)", at < 0, at < 0 ? 0 : 1, at);
    be->free(d); be->free(d2);
    free(h); free(src); free(back);

    tweight t;
    tw_make(&t, "w", DS4_TYPE_F32, 8, 2, 1, 1.0f);
    int ok = t.w.dev != NULL;
    be->release_weight(&t.w);
    ok = ok && t.w.dev == NULL;
    t.w.dev = NULL;
    free(t.bytes); free(t.val);
    report_bool("upload_weight sets dev, release_weight clears it", ok, 0, 0);
}

/* ---------------------------------------------------------------- embed */

static void test_embed(int type, int D, int V, int nt, int n_hc) {
    tweight t;
    tw_make(&t, "token_embd", type, D, V, 1, 1.0f);
    int32_t *tok = xmalloc((size_t)nt * 4);
    for (int i = 0; i < nt; i++) tok[i] = rndi(V);
    tok[0] = V - 1;
    if (nt > 1) tok[nt - 1] = 0;
    int32_t *dtok = dev_from_i(tok, (size_t)nt);
    size_t n = (size_t)nt * n_hc * D;
    float *dx = dev_nan(n);
    be->embed(&t.w, dtok, nt, n_hc, dx);
    float *x = dl(dx, n);
    double *ref = dbuf(n);
    for (int i = 0; i < nt; i++)
        for (int s = 0; s < n_hc; s++)
            for (int d = 0; d < D; d++)
                ref[((size_t)i * n_hc + s) * D + d] = t.val[(size_t)tok[i] * D + d];
    char name[160];
    snprintf(name, sizeof name, "embed %s D=%d V=%d nt=%d n_hc=%d", tname(type), D, V, nt, n_hc);
    /* tol 0: f16/bf16 values are f32 values, and Q8_0's d*q has <= 19 significant bits. */
    report(name, x, ref, NULL, n);
    be->free(dtok); be->free(dx);
    free(tok); free(x); free(ref);
    tw_free(&t);
}

/* -------------------------------------------------------------- rmsnorm */

static void test_rmsnorm(int rows, int n, int with_w, float eps, int inplace, float amp) {
    size_t N = (size_t)rows * n;
    float *x = fbuf(N), *w = fbuf((size_t)n);
    fill(x, N, -amp, amp);
    fill(w, (size_t)n, 0.5f, 1.5f);
    float *dx = dev_from(x, N), *dw = with_w ? dev_from(w, (size_t)n) : NULL;
    float *dy = inplace ? dx : dev_nan(N);
    be->rmsnorm(dx, dw, dy, rows, n, eps);
    float *y = dl(dy, N);
    double *ref = dbuf(N), *tol = dbuf(N);
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)x[(size_t)r * n + i] * x[(size_t)r * n + i];
        double inv = 1.0 / sqrt(ss / n + eps);
        for (int i = 0; i < n; i++) {
            size_t j = (size_t)r * n + i;
            ref[j] = x[j] * inv * (with_w ? w[i] : 1.0);
            /* sum of n positive squares in f32 errs by ~u*sqrt(n) relative (the sqrt halves
             * it), then a few roundings for rsqrt, *x, *w: (8 + 8 sqrt(n)) u relative. */
            tol[j] = (8.0 + 8.0 * sqrt((double)n)) * U * fabs(ref[j]) + 1e-30;
        }
    }
    char name[160];
    snprintf(name, sizeof name, "rmsnorm rows=%d n=%d %s eps=%g%s", rows, n,
             with_w ? "weighted" : "unweighted", (double)eps, inplace ? " in-place" : "");
    report(name, y, ref, tol, N);
    be->free(dx);
    if (dw) be->free(dw);
    if (!inplace) be->free(dy);
    free(x); free(w); free(y); free(ref); free(tol);
}

/* --------------------------------------------------------------- matmul */

static void test_matmul(int type, int K, int N, int E, int expert, int nt) {
    tweight t;
    tw_make(&t, "w", type, K, N, E, 1.0f);
    size_t nx = (size_t)nt * K, ny = (size_t)nt * N;
    float *x = fbuf(nx);
    fill(x, nx, -1, 1);
    float *dx = dev_from(x, nx), *dy = dev_nan(ny);
    be->matmul(&t.w, expert, dx, dy, nt);
    float *y = dl(dy, ny);
    double *ref = dbuf(ny), *tol = dbuf(ny);
    const double *W = t.val + (size_t)expert * N * K;
    for (int i = 0; i < nt; i++)
        for (int n = 0; n < N; n++) {
            double s = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double p = W[(size_t)n * K + k] * x[(size_t)i * K + k];
                s += p; mag += fabs(p);
            }
            ref[(size_t)i * N + n] = s;
            /* f32 dot of K terms: 16 u sqrt(K) sum|w x| (see top of file). */
            tol[(size_t)i * N + n] = 16.0 * U * sqrt((double)K) * mag + 1e-30;
        }
    char name[160];
    snprintf(name, sizeof name, "matmul %s K=%d N=%d E=%d expert=%d nt=%d", tname(type), K, N, E, expert, nt);
    report(name, y, ref, tol, ny);
    be->free(dx); be->free(dy);
    free(x); free(y); free(ref); free(tol);
    tw_free(&t);
}

static void test_matmul_grouped(int type, int K, int G, int R, int nt) {
    tweight t;
    tw_make(&t, "w_grouped", type, K, (int64_t)G * R, 1, 1.0f);
    size_t nx = (size_t)nt * G * K, ny = (size_t)nt * G * R;
    float *x = fbuf(nx);
    fill(x, nx, -1, 1);
    float *dx = dev_from(x, nx), *dy = dev_nan(ny);
    be->matmul_grouped(&t.w, G, dx, dy, nt);
    float *y = dl(dy, ny);
    double *ref = dbuf(ny), *tol = dbuf(ny);
    for (int i = 0; i < nt; i++)
        for (int j = 0; j < G * R; j++) {
            double s = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double p = t.val[(size_t)j * K + k] * x[(size_t)i * G * K + (size_t)(j / R) * K + k];
                s += p; mag += fabs(p);
            }
            ref[(size_t)i * G * R + j] = s;
            /* f32 dot of K terms, as for matmul. */
            tol[(size_t)i * G * R + j] = 16.0 * U * sqrt((double)K) * mag + 1e-30;
        }
    char name[160];
    snprintf(name, sizeof name, "matmul_grouped %s K=%d groups=%d R=%d nt=%d", tname(type), K, G, R, nt);
    report(name, y, ref, tol, ny);
    be->free(dx); be->free(dy);
    free(x); free(y); free(ref); free(tol);
    tw_free(&t);
}

/* --------------------------------------------------------------- hc_mix */

static double sigm(double z) { return 1.0 / (1.0 + exp(-z)); }

static void test_hc_mix(int nt, int D, int h, int head, int iters, float hc_eps, float mix_amp) {
    const int n_mix = head ? h : 2 * h + h * h, n_scale = head ? 1 : 3;
    size_t nm = (size_t)nt * n_mix, nx = (size_t)nt * h * D, ny = (size_t)nt * D;
    size_t np = (size_t)nt * h, nc = (size_t)nt * h * h;
    float *mix = fbuf(nm), *scale = fbuf((size_t)n_scale), *base = fbuf((size_t)n_mix), *x = fbuf(nx);
    fill(mix, nm, -mix_amp, mix_amp);
    fill(scale, (size_t)n_scale, 0.5f, 1.5f);
    fill(base, (size_t)n_mix, -mix_amp, mix_amp);
    fill(x, nx, -2, 2);
    float *dmix = dev_from(mix, nm), *dscale = dev_from(scale, (size_t)n_scale);
    float *dbase = dev_from(base, (size_t)n_mix), *dx = dev_from(x, nx);
    float *dy = dev_nan(ny), *dpost, *dcomb;
    float *sent_p = fbuf(np), *sent_c = fbuf(nc);
    for (size_t i = 0; i < np; i++) sent_p[i] = 4242.0f + (float)i;
    for (size_t i = 0; i < nc; i++) sent_c[i] = -4242.0f - (float)i;
    if (head) { dpost = dev_from(sent_p, np); dcomb = dev_from(sent_c, nc); }
    else { dpost = dev_nan(np); dcomb = dev_nan(nc); }

    be->hc_mix(dmix, dscale, dbase, dx, nt, D, h, head, hc_eps, iters, dy, dpost, dcomb);
    float *y = dl(dy, ny), *post = dl(dpost, np), *comb = dl(dcomb, nc);

    double *ry = dbuf(ny), *ty = dbuf(ny), *rp = dbuf(np), *tp = dbuf(np), *rc = dbuf(nc), *tc = dbuf(nc);
    for (int t = 0; t < nt; t++) {
        const float *m = mix + (size_t)t * n_mix;
        double pre[16];
        for (int s = 0; s < h; s++) pre[s] = sigm((double)m[s] * scale[0] + base[s]) + hc_eps;
        for (int d = 0; d < D; d++) {
            double acc = 0, mag = 0;
            for (int s = 0; s < h; s++) {
                double v = pre[s] * x[((size_t)t * h + s) * D + d];
                acc += v; mag += fabs(v);
            }
            ry[(size_t)t * D + d] = acc;
            /* pre = f32 sigmoid of a rounded logit (|z| <~ 10, so ~16 u relative) then h
             * products summed: 32 u * sum|pre x|. */
            ty[(size_t)t * D + d] = 32.0 * U * mag + 1e-30;
        }
        if (head) continue;
        for (int s = 0; s < h; s++) {
            rp[(size_t)t * h + s] = 2.0 * sigm((double)m[h + s] * scale[1] + base[h + s]);
            /* f32 sigmoid of a rounded logit: ~16 u relative; 1e-6 is ~17 u. */
            tp[(size_t)t * h + s] = 1e-6 * fabs(rp[(size_t)t * h + s]) + 1e-7;
        }
        double C[8][8];
        for (int b = 0; b < h; b++) {
            double z[8], mx = -INFINITY, sum = 0;
            for (int a = 0; a < h; a++) {
                z[a] = (double)m[2 * h + a + h * b] * scale[2] + base[2 * h + a + h * b];
                if (z[a] > mx) mx = z[a];
            }
            for (int a = 0; a < h; a++) sum += exp(z[a] - mx);
            for (int a = 0; a < h; a++) C[a][b] = exp(z[a] - mx) / sum + hc_eps;
        }
        for (int it = 0; it < 2 * iters - 1; it++) {
            if (it % 2 == 0) {                       /* "col": for each a, over b */
                for (int a = 0; a < h; a++) {
                    double s = 0;
                    for (int b = 0; b < h; b++) s += C[a][b];
                    for (int b = 0; b < h; b++) C[a][b] /= (s + hc_eps);
                }
            } else {                                 /* "row": for each b, over a */
                for (int b = 0; b < h; b++) {
                    double s = 0;
                    for (int a = 0; a < h; a++) s += C[a][b];
                    for (int a = 0; a < h; a++) C[a][b] /= (s + hc_eps);
                }
            }
        }
        for (int a = 0; a < h; a++)
            for (int b = 0; b < h; b++) {
                size_t j = (size_t)t * h * h + a + (size_t)h * b;
                rc[j] = C[a][b];
                /* softmax (few u) then 2*iters-1 normalisations, each <= (h+2) u relative and
                 * not amplified (Sinkhorn is non-expansive): 16 u per step, linear worst case. */
                tc[j] = (16.0 * (2 * iters) + 16.0) * U * fabs(C[a][b]) + 1e-7;
            }
    }
    char name[200];
    snprintf(name, sizeof name, "hc_mix y nt=%d D=%d n_hc=%d head=%d iters=%d", nt, D, h, head, iters);
    report(name, y, ry, ty, ny);
    if (head) {
        snprintf(name, sizeof name, "hc_mix head=%d n_hc=%d leaves post and comb untouched", head, h);
        int ok1 = 1;
        for (size_t i = 0; i < np; i++) if (memcmp(&post[i], &sent_p[i], 4)) ok1 = 0;
        if (ok1) report_bits(name, comb, sent_c, nc);
        else report_bits(name, post, sent_p, np);
    } else {
        snprintf(name, sizeof name, "hc_mix post nt=%d D=%d n_hc=%d iters=%d", nt, D, h, iters);
        report(name, post, rp, tp, np);
        snprintf(name, sizeof name, "hc_mix comb (Sinkhorn) nt=%d D=%d n_hc=%d iters=%d", nt, D, h, iters);
        report(name, comb, rc, tc, nc);
        if (iters >= 20) {
            /* Sanity: after 20 Sinkhorn iterations on well-conditioned logits every row and
             * column of comb sums to 1 up to hc_eps effects and residual non-convergence. */
            double worst = 0; long at = -1;
            for (int t = 0; t < nt; t++)
                for (int a = 0; a < h; a++) {
                    double sr = 0, sc = 0;
                    for (int b = 0; b < h; b++) {
                        sr += comb[(size_t)t * h * h + a + (size_t)h * b];
                        sc += comb[(size_t)t * h * h + b + (size_t)h * a];
                    }
                    double e = fmax(fabs(sr - 1), fabs(sc - 1));
                    if (!(e <= worst)) { worst = e; at = (long)(t * h + a); }
                }
            snprintf(name, sizeof name, "hc_mix comb rows and columns sum to 1 (|err| <= 1e-3) nt=%d n_hc=%d iters=%d",
                     nt, h, iters);
            report_bool(name, worst <= 1e-3, worst, at);
        }
    }
    be->free(dmix); be->free(dscale); be->free(dbase); be->free(dx);
    be->free(dy); be->free(dpost); be->free(dcomb);
    free(mix); free(scale); free(base); free(x); free(sent_p); free(sent_c);
    free(y); free(post); free(comb);
    free(ry); free(ty); free(rp); free(tp); free(rc); free(tc);
}

/* -------------------------------------------------------------- hc_post */

static void test_hc_post(int nt, int D, int h) {
    size_t nf = (size_t)nt * D, nx = (size_t)nt * h * D, np = (size_t)nt * h, nc = (size_t)nt * h * h;
    float *f = fbuf(nf), *xr = fbuf(nx), *post = fbuf(np), *comb = fbuf(nc);
    fill(f, nf, -2, 2); fill(xr, nx, -2, 2); fill(post, np, 0, 2); fill(comb, nc, 0, 1);
    float *df = dev_from(f, nf), *dxr = dev_from(xr, nx), *dp = dev_from(post, np), *dc = dev_from(comb, nc);
    float *dout = dev_nan(nx);
    be->hc_post(df, dxr, dp, dc, nt, D, h, dout);
    float *out = dl(dout, nx);
    double *ref = dbuf(nx), *tol = dbuf(nx);
    for (int t = 0; t < nt; t++)
        for (int a = 0; a < h; a++)
            for (int d = 0; d < D; d++) {
                double v = (double)post[(size_t)t * h + a] * f[(size_t)t * D + d], mag = fabs(v);
                for (int b = 0; b < h; b++) {
                    double w = (double)comb[(size_t)t * h * h + a + (size_t)h * b] * xr[((size_t)t * h + b) * D + d];
                    v += w; mag += fabs(w);
                }
                size_t j = ((size_t)t * h + a) * D + d;
                ref[j] = v;
                /* h+1 f32 products summed: 2(h+1) u sum|terms|, doubled. */
                tol[j] = 4.0 * (h + 1) * U * mag + 1e-30;
            }
    char name[160];
    snprintf(name, sizeof name, "hc_post nt=%d D=%d n_hc=%d", nt, D, h);
    report(name, out, ref, tol, nx);
    be->free(df); be->free(dxr); be->free(dp); be->free(dc); be->free(dout);
    free(f); free(xr); free(post); free(comb); free(out); free(ref); free(tol);
}

/* ----------------------------------------------------------------- rope */

/* theta exactly as the header spells it, in float. */
static float rope_theta_hdr(const ds4_rope *rp, int p, int i) {
    const float theta_scale = powf(rp->freq_base, -2.0f / (float)rp->n_rot);
    float t = (float)p;
    for (int k = 0; k < i; k++) t *= theta_scale;
    float te = t, ti = rp->freq_scale * te;
    if (rp->ext_factor != 0.0f) {
        float y = ((float)i - rp->corr_lo) / fmaxf(0.001f, rp->corr_hi - rp->corr_lo);
        float r = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * rp->ext_factor;
        return ti * (1.0f - r) + te * r;
    }
    return ti;
}

/* theta computed directly in double: p * base^(-2i/n_rot), YaRN mixing in double.
 * *te_out gets the unscaled angle (the bound of the header's float error). */
static double rope_theta_direct(const ds4_rope *rp, int p, int i, double *te_out) {
    double te = (double)p * pow((double)rp->freq_base, -2.0 * i / rp->n_rot);
    double ti = (double)rp->freq_scale * te;
    *te_out = te;
    if (rp->ext_factor != 0.0f) {
        double y = (i - (double)rp->corr_lo) / fmax(0.001, (double)rp->corr_hi - rp->corr_lo);
        double r = (1.0 - fmin(1.0, fmax(0.0, y))) * rp->ext_factor;
        return ti * (1.0 - r) + te * r;
    }
    return ti;
}

static void test_rope(int nt, int nh, int dh, int n_rot, int pos0, int pos_step,
                      float base, float freq_scale, float ext, float lo, float hi) {
    ds4_rope rp = { n_rot, base, freq_scale, ext, lo, hi };
    size_t n = (size_t)nt * nh * dh;
    float *x = fbuf(n);
    fill(x, n, -2, 2);
    float *dx = dev_from(x, n);
    be->rope(dx, nt, nh, dh, at(pos0), pos_step, &rp, 0);
    float *y = dl(dx, n);
    be->rope(dx, nt, nh, dh, at(pos0), pos_step, &rp, 1);
    float *z = dl(dx, n);

    double *r1 = dbuf(n), *t1 = dbuf(n), *r2 = dbuf(n), *t2 = dbuf(n), *r3 = dbuf(n), *t3 = dbuf(n);
    for (int t = 0; t < nt; t++) {
        int p = pos0 + t * pos_step;
        for (int hh = 0; hh < nh; hh++) {
            size_t o = ((size_t)t * nh + hh) * dh;
            for (int j = 0; j < dh - n_rot; j++) {   /* unrotated dims: unchanged, exactly */
                r1[o + j] = r2[o + j] = r3[o + j] = x[o + j];
                t1[o + j] = t2[o + j] = t3[o + j] = 0;
            }
            for (int i = 0; i < n_rot / 2; i++) {
                size_t j = o + (size_t)(dh - n_rot) + 2 * (size_t)i;
                double x0 = x[j], x1 = x[j + 1], ax = fabs(x0) + fabs(x1), te;
                /* (1) direct double theta.  The header's theta is a float chain: powf and each
                 * of the i multiplies add <= ~3u relative to te, ti/mixing/r a few u more, so
                 * |theta_f - theta| <= (3i + 8) u te; an output moves by <= |dtheta|(|x0|+|x1|),
                 * plus ~8u (|x0|+|x1|) for f32 cos/sin and the rotation's roundings. */
                double th = rope_theta_direct(&rp, p, i, &te), c = cos(th), s = sin(th);
                r1[j] = x0 * c - x1 * s;
                r1[j + 1] = x0 * s + x1 * c;
                t1[j] = t1[j + 1] = ((3.0 * i + 8.0) * U * fabs(te) + 8.0 * U) * ax + 1e-30;
                /* (2) the header's float theta, cos/sin in double: only a reordering of the
                 * float formula (<= 4 ulp of theta) and f32 cos/sin/rotation (8u) remain. */
                float thf = rope_theta_hdr(&rp, p, i);
                double ulp = (double)nextafterf(fabsf(thf), INFINITY) - fabsf(thf);
                c = cos((double)thf); s = sin((double)thf);
                r2[j] = x0 * c - x1 * s;
                r2[j + 1] = x0 * s + x1 * c;
                t2[j] = t2[j + 1] = (4.0 * ulp + 8.0 * U) * ax + 1e-30;
                /* (3) inverse(forward(x)) == x: two f32 rotations by the same angle,
                 * each <= ~4u (|x0|+|x1|) with cos^2+sin^2 = 1 +- 2u: 16u. */
                r3[j] = x0; r3[j + 1] = x1;
                t3[j] = t3[j + 1] = 16.0 * U * ax + 1e-30;
            }
        }
    }
    char tag[200], name[260];
    snprintf(tag, sizeof tag, "nt=%d nh=%d dh=%d n_rot=%d pos0=%d step=%d base=%g%s", nt, nh, dh, n_rot,
             pos0, pos_step, (double)base, ext != 0 ? " YaRN(fs=0.25,ext=1,corr=2..7)" :
             freq_scale != 1.0f ? " fs=0.5 no-ext" : "");
    snprintf(name, sizeof name, "rope fwd vs direct double theta %s", tag);
    report(name, y, r1, t1, n);
    snprintf(name, sizeof name, "rope fwd vs header float theta %s", tag);
    report(name, y, r2, t2, n);
    snprintf(name, sizeof name, "rope inverse(forward(x)) == x %s", tag);
    report(name, z, r3, t3, n);
    be->free(dx);
    free(x); free(y); free(z); free(r1); free(t1); free(r2); free(t2); free(r3); free(t3);
}

/* ------------------------------------------------------------ attention */

/* topk_mode: 0 = entries then -1 padding; 1 = also a -1 in the middle of some rows. */
static void test_attention(int W, int pos0, int nt, int H, int d, int ratio, int k, int topk_mode, float sink_shift) {
    const int Pmax = pos0 + nt - 1;
    int ncomp = 0;
    if (ratio) ncomp = (Pmax + 1) / ratio + 1;           /* one extra row nobody may read */
    if (ratio == 0) k = 0;
    size_t nq = (size_t)nt * H * d, nkv = (size_t)nt * d, nr = (size_t)W * d, ncd = (size_t)(ncomp ? ncomp : 1) * d;
    float *q = fbuf(nq), *kv = fbuf(nkv), *ring = fbuf(nr), *comp = fbuf(ncd), *sinks = fbuf((size_t)H);
    int32_t *topk = xmalloc((size_t)nt * (k ? k : 1) * 4);
    fill(q, nq, -2, 2); fill(kv, nkv, -1, 1); fill(ring, nr, -1, 1); fill(comp, ncd, -1, 1);
    fill(sinks, (size_t)H, -2, 2);
    for (int h = 0; h < H; h++) sinks[h] += sink_shift;

    char *comp_used = xmalloc((size_t)(ncomp ? ncomp : 1));
    if (ratio == 4) {
        for (int t = 0; t < nt; t++) {
            int P = pos0 + t, nvis = (P + 1) / 4, m = nvis < k ? nvis : k;
            if (m > 1 && t % 3 == 1) m--;                /* some rows pad early */
            int32_t *row = topk + (size_t)t * k;
            for (int j = 0; j < k; j++) row[j] = -1;
            for (int j = 0; j < m; j++) {                /* distinct ids in random order */
                int id, dup;
                do {
                    id = rndi(nvis); dup = 0;
                    for (int jj = 0; jj < j; jj++) if (row[jj] == id) dup = 1;
                } while (dup);
                row[j] = id;
            }
            if (topk_mode == 1 && m >= 2 && m < k) { row[m] = row[1]; row[1] = -1; }
            for (int j = 0; j < k; j++) if (row[j] >= 0) comp_used[row[j]] = 1;
        }
    } else if (ratio == 128) {
        for (int w = 0; w < (Pmax + 1) / 128; w++) comp_used[w] = 1;
    }
    /* Poison what must not be read: ring slots outside every query's window, comp rows
     * outside every selection. */
    char *slot_used = xmalloc((size_t)W);
    for (int p = pos0 - W + 1 > 0 ? pos0 - W + 1 : 0; p < pos0; p++) slot_used[p % W] = 1;
    for (int s = 0; s < W; s++) if (!slot_used[s]) for (int j = 0; j < d; j++) ring[(size_t)s * d + j] = NAN;
    for (int w = 0; w < ncomp; w++) if (!comp_used[w]) for (int j = 0; j < d; j++) comp[(size_t)w * d + j] = NAN;

    float *dq = dev_from(q, nq), *dkv = dev_from(kv, nkv), *dring = dev_from(ring, nr);
    float *dcomp = ratio ? dev_from(comp, ncd) : NULL, *dsinks = dev_from(sinks, (size_t)H);
    int32_t *dtopk = ratio == 4 ? dev_from_i(topk, (size_t)nt * k) : NULL;
    float *dout = dev_nan(nq);
    const float scale = 1.0f / sqrtf((float)d);
    be->attention(dq, dkv, dring, W, at(pos0), nt, H, d, dcomp, ratio, dtopk, k, dsinks, scale, dout);
    float *out = dl(dout, nq);

    double *ref = dbuf(nq), *tol = dbuf(nq);
    const float **rows = xmalloc(sizeof(float *) * (size_t)(W + ncomp + k + 1));
    double *sc = dbuf((size_t)(W + ncomp + k + 1));
    for (int t = 0; t < nt; t++) {
        int P = pos0 + t, nrow = 0;
        for (int p = P - W + 1 > 0 ? P - W + 1 : 0; p <= P; p++)
            rows[nrow++] = p >= pos0 ? kv + (size_t)(p - pos0) * d : ring + (size_t)(p % W) * d;
        if (ratio == 128) for (int w = 0; w < (P + 1) / 128; w++) rows[nrow++] = comp + (size_t)w * d;
        if (ratio == 4)
            for (int j = 0; j < k; j++) if (topk[(size_t)t * k + j] != -1) rows[nrow++] = comp + (size_t)topk[(size_t)t * k + j] * d;
        for (int h = 0; h < H; h++) {
            const float *qh = q + ((size_t)t * H + h) * d;
            double m = sinks[h], ds_max = 0, rmax = 0;
            for (int i = 0; i < nrow; i++) {
                double s = 0, mag = 0;
                for (int j = 0; j < d; j++) { double v = (double)qh[j] * rows[i][j]; s += v; mag += fabs(v); }
                sc[i] = s * scale;
                double ds = 16.0 * U * sqrt((double)d) * mag * scale;
                if (ds > ds_max) ds_max = ds;
                if (sc[i] > m) m = sc[i];
                for (int j = 0; j < d; j++) if (fabs(rows[i][j]) > rmax) rmax = fabs(rows[i][j]);
            }
            double den = exp((double)sinks[h] - m);
            for (int i = 0; i < nrow; i++) den += exp(sc[i] - m);
            for (int j = 0; j < d; j++) {
                double num = 0;
                for (int i = 0; i < nrow; i++) num += exp(sc[i] - m) * rows[i][j];
                size_t o = ((size_t)t * H + h) * d + j;
                ref[o] = num / den;
                /* A score error ds shifts each softmax weight by <= 2 ds relative; f32 exp,
                 * the two sums over nrow terms and the division add ~(nrow+4) u each; the
                 * output is a convex combination of rows bounded by rmax. */
                tol[o] = (2.0 * ds_max + 8.0 * (nrow + 4) * U) * rmax + 1e-30;
            }
        }
    }
    char name[220];
    snprintf(name, sizeof name, "attention W=%d pos0=%d nt=%d H=%d d=%d ratio=%d k=%d%s%s", W, pos0, nt, H, d,
             ratio, k, topk_mode ? " (-1 inside topk rows)" : "",
             sink_shift > 3 ? " (dominant sinks)" : sink_shift < -3 ? " (negligible sinks)" : "");
    report(name, out, ref, tol, nq);
    be->free(dq); be->free(dkv); be->free(dring); be->free(dsinks); be->free(dout);
    if (dcomp) be->free(dcomp);
    if (dtopk) be->free(dtopk);
    free(q); free(kv); free(ring); free(comp); free(sinks); free(topk); free(comp_used); free(slot_used);
    free(out); free(ref); free(tol); free(rows); free(sc);
}

/* ----------------------------------------------- ring_store / add_cyclic */

static void test_ring_store(int slots, int width, int pos0, int nt) {
    size_t nr = (size_t)slots * width, nb = (size_t)nt * width;
    float *ring = fbuf(nr), *rows = fbuf(nb);
    fill(ring, nr, -1, 1); fill(rows, nb, -1, 1);
    float *dring = dev_from(ring, nr), *drows = dev_from(rows, nb);
    be->ring_store(dring, drows, slots, width, at(pos0), nt);
    float *got = dl(dring, nr);
    double *ref = dbuf(nr);
    for (size_t i = 0; i < nr; i++) ref[i] = ring[i];
    for (int t = 0; t < nt; t++)
        if (pos0 + t >= pos0 + nt - slots)
            for (int j = 0; j < width; j++) ref[(size_t)((pos0 + t) % slots) * width + j] = rows[(size_t)t * width + j];
    char name[160];
    snprintf(name, sizeof name, "ring_store slots=%d width=%d pos0=%d nt=%d", slots, width, pos0, nt);
    report(name, got, ref, NULL, nr);   /* a copy: exact */
    be->free(dring); be->free(drows);
    free(ring); free(rows); free(got); free(ref);
}

static void test_add_cyclic(int period, int n, int pos0, int nt) {
    size_t nx = (size_t)nt * n, ntab = (size_t)period * n;
    float *x = fbuf(nx), *tab = fbuf(ntab);
    fill(x, nx, -2, 2); fill(tab, ntab, -2, 2);
    float *dx = dev_from(x, nx), *dtab = dev_from(tab, ntab);
    be->add_cyclic(dx, dtab, at(pos0), nt, period, n);
    float *got = dl(dx, nx);
    double *ref = dbuf(nx);
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < n; j++) {
            float v = x[(size_t)t * n + j] + tab[(size_t)((pos0 + t) % period) * n + j];
            ref[(size_t)t * n + j] = v;
        }
    char name[160];
    snprintf(name, sizeof name, "add_cyclic period=%d n=%d pos0=%d nt=%d", period, n, pos0, nt);
    report(name, got, ref, NULL, nx);   /* one correctly rounded f32 add: exact */
    be->free(dx); be->free(dtab);
    free(x); free(tab); free(got); free(ref);
}

/* -------------------------------------------------------- compress_pool */

static void test_compress_pool(int ratio, int c, int dc, int pos0, int nt) {
    const int cw = c * dc, S = c * ratio;
    size_t nb = (size_t)nt * cw, ns = (size_t)S * cw;
    float *kv = fbuf(nb), *sc = fbuf(nb), *skv = fbuf(ns), *ssc = fbuf(ns);
    fill(kv, nb, -1, 1); fill(sc, nb, -3, 3); fill(skv, ns, -1, 1); fill(ssc, ns, -3, 3);

    int w_first = -1, n_emit = 0;
    for (int w = 0; w * ratio <= pos0 + nt; w++) {
        int end = w * ratio + ratio - 1;
        if (pos0 <= end && end < pos0 + nt) { if (w_first < 0) w_first = w; n_emit++; }
    }
    /* Which (position, half) entries the emitted blocks read; everything else -> NaN. */
    char *bused = xmalloc((size_t)nt * c), *sused = xmalloc((size_t)S * c);
    for (int i = 0; i < n_emit; i++) {
        int s = (w_first + i) * ratio;
        for (int half = 0; half < c; half++)
            for (int j = 0; j < ratio; j++) {
                int p = c == 2 && half == 0 ? s - ratio + j : s + j, col = c == 2 ? half : 0;
                if (p < 0) continue;
                if (p >= pos0) bused[(size_t)(p - pos0) * c + col] = 1;
                else sused[(size_t)(p % S) * c + col] = 1;
            }
    }
    for (int t = 0; t < nt; t++)
        for (int h = 0; h < c; h++)
            if (!bused[(size_t)t * c + h])
                for (int j = 0; j < dc; j++) kv[(size_t)t * cw + h * dc + j] = sc[(size_t)t * cw + h * dc + j] = NAN;
    for (int sl = 0; sl < S; sl++)
        for (int h = 0; h < c; h++)
            if (!sused[(size_t)sl * c + h])
                for (int j = 0; j < dc; j++) skv[(size_t)sl * cw + h * dc + j] = ssc[(size_t)sl * cw + h * dc + j] = NAN;

    float *dkv = dev_from(kv, nb), *dsc = dev_from(sc, nb), *dskv = dev_from(skv, ns), *dssc = dev_from(ssc, ns);
    size_t nout = (size_t)(n_emit + 1) * dc;                /* + one guard row */
    float *hout = fbuf(nout);
    for (size_t i = 0; i < nout; i++) hout[i] = i < (size_t)n_emit * dc ? NAN : 777.0f + (float)i;
    float *dout = dev_from(hout, nout);
    be->compress_pool(dkv, dsc, dskv, dssc, at(pos0), nt, ratio, c, dc, dout);
    float *out = dl(dout, nout);

    size_t nr = (size_t)n_emit * dc;
    double *ref = dbuf(nr ? nr : 1), *tol = dbuf(nr ? nr : 1);
    for (int i = 0; i < n_emit; i++) {
        int s = (w_first + i) * ratio;
        for (int ch = 0; ch < dc; ch++) {
            double ev[512], es[512], mx = -INFINITY, kmax = 0;
            int ne = 0;
            for (int half = 0; half < c; half++)
                for (int j = 0; j < ratio; j++) {
                    int p = c == 2 && half == 0 ? s - ratio + j : s + j;
                    int col = (c == 2 && half == 1 ? dc : 0) + ch;
                    if (p < 0) { ev[ne] = 0; es[ne] = -INFINITY; ne++; continue; }
                    const float *bk = p >= pos0 ? kv + (size_t)(p - pos0) * cw : skv + (size_t)(p % S) * cw;
                    const float *bs = p >= pos0 ? sc + (size_t)(p - pos0) * cw : ssc + (size_t)(p % S) * cw;
                    ev[ne] = bk[col]; es[ne] = bs[col]; ne++;
                }
            for (int e = 0; e < ne; e++) { if (es[e] > mx) mx = es[e]; if (fabs(ev[e]) > kmax) kmax = fabs(ev[e]); }
            double num = 0, den = 0;
            for (int e = 0; e < ne; e++) { double w = exp(es[e] - mx); num += w * ev[e]; den += w; }
            ref[(size_t)i * dc + ch] = num / den;
            /* Convex combination of ne entries: f32 exp and two ne-term sums, ~(ne+4) u
             * relative each, on values bounded by kmax; 8x margin. */
            tol[(size_t)i * dc + ch] = 8.0 * (ne + 4) * U * kmax + 1e-30;
        }
    }
    char name[200];
    snprintf(name, sizeof name, "compress_pool ratio=%d c=%d dc=%d pos0=%d nt=%d (%d rows%s)", ratio, c, dc, pos0, nt,
             n_emit, c == 2 && w_first == 0 ? ", block 0: previous block before position 0" : "");
    if (n_emit) report(name, out, ref, tol, nr);
    char gname[240];
    snprintf(gname, sizeof gname, "compress_pool ratio=%d c=%d pos0=%d nt=%d writes no row beyond the %d emitted",
             ratio, c, pos0, nt, n_emit);
    report_bits(gname, out + nr, hout + nr, (size_t)dc);
    be->free(dkv); be->free(dsc); be->free(dskv); be->free(dssc); be->free(dout);
    free(kv); free(sc); free(skv); free(ssc); free(bused); free(sused); free(hout); free(out);
    free(ref); free(tol);
}

/* --------------------------------------------------------- indexer_topk */

typedef struct { double s; int r; } scored;
static int scored_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->s != y->s) return x->s > y->s ? -1 : 1;
    return x->r < y->r ? -1 : x->r > y->r;
}

/* exact = 1: small-integer q/rows and w in 1/16 steps, so every score is exact in f32 in
 * any summation order and ties are real ties: the output must match exactly.
 * exact = 0: random floats; a swap is accepted only between scores within f32 error. */
static void test_indexer(int Hi, int di, int ratio, int k, int pos0, int nt, int exact, int n_dup) {
    const int nrows = (pos0 + nt) / ratio + 1;
    size_t nq = (size_t)nt * Hi * di, nw = (size_t)nt * Hi, nrw = (size_t)nrows * di;
    float *q = fbuf(nq), *w = fbuf(nw), *rows = fbuf(nrw);
    if (exact) {
        for (size_t i = 0; i < nq; i++) q[i] = (float)(rndi(5) - 2);
        for (size_t i = 0; i < nrw; i++) rows[i] = (float)(rndi(5) - 2);
        for (size_t i = 0; i < nw; i++) w[i] = (float)(rndi(33) - 12) / 16.0f;
    } else {
        fill(q, nq, -1, 1); fill(rows, nrw, -1, 1); fill(w, nw, -0.2f, 1);
    }
    /* deliberate ties: duplicate rows (identical scores for every query) */
    for (int i = 0; i < n_dup && nrows >= 2; i++) {
        int a = rndi(nrows - 1), b = a + 1 + rndi(nrows - 1 - a);
        memcpy(rows + (size_t)b * di, rows + (size_t)a * di, (size_t)di * 4);
    }
    /* the op scales w itself: feed 2w with w_scale 1/2 (exact) so the reference keeps w */
    float *w2 = fbuf(nw);
    for (size_t i = 0; i < nw; i++) w2[i] = 2.0f * w[i];
    float *dq = dev_from(q, nq), *dw = dev_from(w2, nw), *drows = dev_from(rows, nrw);
    free(w2);
    size_t no = (size_t)nt * k;
    int32_t *poison = xmalloc(no * 4);
    for (size_t i = 0; i < no; i++) poison[i] = 0x55555555;
    int32_t *dout = dev_from_i(poison, no);
    be->indexer_topk(dq, dw, 0.5f, drows, at(pos0), nt, Hi, di, ratio, k, dout);
    int32_t *out = xmalloc(no * 4), *ref = xmalloc(no * 4);
    be->synchronize();
    be->download(out, dout, no * 4);

    scored *sv = xmalloc(sizeof(scored) * (size_t)nrows);
    double *mag = dbuf((size_t)nrows);
    int tol_ok = 1; long bad_at = -1; double bad_d = 0;
    for (int t = 0; t < nt; t++) {
        int P = pos0 + t, nvis = (P + 1) / ratio;
        for (int r = 0; r < nvis; r++) {
            double s = 0, m = 0;
            for (int h = 0; h < Hi; h++) {
                double dot = 0, dm = 0;
                for (int j = 0; j < di; j++) {
                    double v = (double)q[((size_t)t * Hi + h) * di + j] * rows[(size_t)r * di + j];
                    dot += v; dm += fabs(v);
                }
                s += (double)w[(size_t)t * Hi + h] * (dot > 0 ? dot : 0);
                m += fabs((double)w[(size_t)t * Hi + h]) * dm;
            }
            sv[r].s = s; sv[r].r = r; mag[r] = m;
        }
        qsort(sv, (size_t)nvis, sizeof(scored), scored_desc);
        int m = nvis < k ? nvis : k;
        for (int j = 0; j < k; j++) ref[(size_t)t * k + j] = j < m ? sv[j].r : -1;
        if (!exact) {
            /* Accept out[j] != ref[j] when out[j] is a distinct visible row whose score is
             * within f32 dot-product error (16 u sqrt(di) * magnitude) of the reference's j-th. */
            for (int j = 0; j < k; j++) {
                size_t o = (size_t)t * k + j;
                int g = out[o];
                if (g == ref[o]) continue;
                int okj = j < m && g >= 0 && g < nvis;
                for (int jj = 0; okj && jj < j; jj++) if (out[(size_t)t * k + jj] == g) okj = 0;
                if (okj) {
                    double sg = 0;
                    for (int r = 0; r < nvis; r++) if (sv[r].r == g) sg = sv[r].s;
                    double tl = 16.0 * U * sqrt((double)di) * fmax(mag[g], mag[sv[j].r]) + 1e-30;
                    if (fabs(sg - sv[j].s) > tl) { okj = 0; bad_d = fabs(sg - sv[j].s); }
                }
                if (!okj && tol_ok) { tol_ok = 0; bad_at = (long)o; }
            }
        }
    }
    char name[220];
    snprintf(name, sizeof name, "indexer_topk Hi=%d di=%d ratio=%d k=%d pos0=%d nt=%d n_vis=%d..%d%s%s", Hi, di, ratio,
             k, pos0, nt, (pos0 + 1) / ratio, (pos0 + nt) / ratio, exact ? " exact scores with ties" : " float scores",
             n_dup ? " + duplicate rows" : "");
    if (exact) report_i(name, out, ref, no);
    else report_bool(name, tol_ok, bad_d, bad_at);
    be->free(dq); be->free(dw); be->free(drows); be->free(dout);
    free(q); free(w); free(rows); free(poison); free(out); free(ref); free(sv); free(mag);
}

/* ------------------------------------------------------------ moe_route */

/* softplus exactly as the header writes it: x > 20 ? x : logf(1 + expf(x)).  The f32
 * rounding of 1 + expf(x) is part of the definition (it moves the result by up to 100%
 * for x < -16), so it is kept; the log and the sqrt are taken in double. */
static double softplus_hdr(float x) { return x > 20.0f ? (double)x : log((double)(1.0f + expf(x))); }

/* The header says "then wts *= wscale" with no exception, so wscale == 0 must give zero
 * weights.  llama.cpp's build_moe_ffn instead skips the scaling when w_scale == 0 (its
 * "unset" value); the header adopted that rule, so 1 is the default. */
#ifndef DS4_TEST_WSCALE0_UNSCALED
#define DS4_TEST_WSCALE0_UNSCALED 1
#endif

static void test_moe_route(int E, int k, int nt, int hash, int norm, float wscale, int all_tiny) {
    size_t nl = (size_t)nt * E;
    float *logits = fbuf(nl), *bias = fbuf((size_t)E);
    for (size_t i = 0; i < nl; i++) logits[i] = all_tiny ? -30.0f : (float)(rndi(33) - 16) * 0.25f;
    for (int e = 0; e < E; e++) bias[e] = all_tiny ? 0.0f : (float)(rndi(21) - 10) * 0.01f;
    if (!all_tiny) {
        for (int t = 0; t < nt; t++) {   /* the softplus branches: x > 20, very negative */
            if (t % 4 == 0) logits[(size_t)t * E + rndi(E)] = 25.0f;
            if (t % 4 == 1) logits[(size_t)t * E + rndi(E)] = 20.5f;
            if (t % 4 == 2) logits[(size_t)t * E + rndi(E)] = -40.0f;
        }
        if (!hash && E >= 6) {          /* deliberate exact ties: equal bias and equal logits */
            bias[3] = bias[1];
            bias[5] = bias[4];
            for (int t = 0; t < nt; t += 2) {
                logits[(size_t)t * E + 3] = logits[(size_t)t * E + 1] = 3.0f;
                logits[(size_t)t * E + 5] = logits[(size_t)t * E + 4] = 2.0f + 0.25f * (float)(t % 3);
            }
        }
    }
    int V = 50;
    int32_t *tokens = xmalloc((size_t)nt * 4), *tab = xmalloc((size_t)V * k * 4);
    for (int t = 0; t < nt; t++) tokens[t] = rndi(V);
    for (int v = 0; v < V; v++)
        for (int j = 0; j < k; j++) {   /* distinct experts per row */
            int e, dup;
            do {
                e = rndi(E); dup = 0;
                for (int jj = 0; jj < j; jj++) if (tab[(size_t)v * k + jj] == e) dup = 1;
            } while (dup);
            tab[(size_t)v * k + j] = e;
        }

    double *probs = dbuf(nl);
    scored *sv = xmalloc(sizeof(scored) * (size_t)E);
    /* Avoid accidental near-ties (within f32 error of sqrt/log) between different inputs:
     * the selection of such pairs is float-rounding-defined, not header-defined. */
    for (int t = 0; t < nt && !hash; t++) {
        for (int guard = 0; guard < 1000; guard++) {
            int moved = 0;
            for (int a = 0; a < E; a++) probs[(size_t)t * E + a] = sqrt(softplus_hdr(logits[(size_t)t * E + a]));
            for (int a = 0; a < E && !moved; a++)
                for (int b = a + 1; b < E && !moved; b++) {
                    double sa = probs[(size_t)t * E + a] + bias[a], sb = probs[(size_t)t * E + b] + bias[b];
                    int same = logits[(size_t)t * E + a] == logits[(size_t)t * E + b] && bias[a] == bias[b];
                    if (!same && fabs(sa - sb) < 1e-4) { logits[(size_t)t * E + b] += 0.37f; moved = 1; }
                }
            if (!moved) break;
        }
    }
    for (size_t i = 0; i < nl; i++) probs[i] = sqrt(softplus_hdr(logits[i]));

    tweight tw;
    memset(&tw, 0, sizeof tw);
    tw.w.name = "ffn_gate_tid2eid";
    tw.w.type = DS4_TYPE_I32;
    tw.w.n_dims = 2;
    tw.w.ne[0] = k; tw.w.ne[1] = V; tw.w.ne[2] = 1;
    tw.w.nbytes = (size_t)V * k * 4;
    tw.w.host = tab;
    if (hash && be->upload_weight(&tw.w) != 0) { fprintf(stderr, "upload_weight(tid2eid) failed\n"); exit(2); }

    float *dlog = dev_from(logits, nl), *dbias = hash ? NULL : dev_from(bias, (size_t)E);
    int32_t *dtok = dev_from_i(tokens, (size_t)nt);
    size_t no = (size_t)nt * k;
    int32_t *poison = xmalloc(no * 4);
    for (size_t i = 0; i < no; i++) poison[i] = 0x55555555;
    int32_t *dsel = dev_from_i(poison, no);
    float *dwts = dev_nan(no);
    be->moe_route(dlog, dbias, hash ? &tw.w : NULL, dtok, nt, E, k, norm, wscale, dsel, dwts);
    int32_t *sel = xmalloc(no * 4), *rsel = xmalloc(no * 4);
    be->synchronize();
    be->download(sel, dsel, no * 4);
    float *wts = dl(dwts, no);
    double *rw = dbuf(no), *tl = dbuf(no);
    for (int t = 0; t < nt; t++) {
        if (hash) {
            for (int j = 0; j < k; j++) rsel[(size_t)t * k + j] = tab[(size_t)tokens[t] * k + j];
        } else {
            for (int e = 0; e < E; e++) { sv[e].s = probs[(size_t)t * E + e] + bias[e]; sv[e].r = e; }
            qsort(sv, (size_t)E, sizeof(scored), scored_desc);
            for (int j = 0; j < k; j++) rsel[(size_t)t * k + j] = sv[j].r;
        }
        double sum = 0;
        for (int j = 0; j < k; j++) {
            rw[(size_t)t * k + j] = probs[(size_t)t * E + rsel[(size_t)t * k + j]];
            sum += rw[(size_t)t * k + j];
        }
        for (int j = 0; j < k; j++) {
            double v = rw[(size_t)t * k + j];
            if (norm) v /= fmax(sum, 6.103515625e-5);
            rw[(size_t)t * k + j] = DS4_TEST_WSCALE0_UNSCALED && wscale == 0.0f ? v : v * wscale;
            /* f32 logf/sqrtf (1 ulp each), a k-term sum, a division and a product:
             * (k + 8) u relative, doubled. */
            tl[(size_t)t * k + j] = 2.0 * (k + 8) * U * fabs(rw[(size_t)t * k + j]) + 1e-30;
        }
    }
    char name[200];
    snprintf(name, sizeof name, "moe_route %s E=%d k=%d nt=%d norm=%d wscale=%g%s sel", hash ? "hash" : "scored",
             E, k, nt, norm, (double)wscale, all_tiny ? " all-probs-0 (norm clamp)" : hash ? "" : " with ties");
    report_i(name, sel, rsel, no);
    name[strlen(name) - 3] = 0;
    strcat(name, "wts");
    report(name, wts, rw, tl, no);
    be->free(dlog); if (dbias) be->free(dbias); be->free(dtok); be->free(dsel); be->free(dwts);
    if (hash) be->release_weight(&tw.w);
    free(logits); free(bias); free(tokens); free(tab); free(probs); free(sv); free(poison);
    free(sel); free(rsel); free(wts); free(rw); free(tl);
}

/* ---------------------------------------------------------- moe_experts */

static double silu_d(double x) { return x / (1.0 + exp(-x)); }

static void test_moe_experts(int type, int D, int F, int E, int k, int nt, float clamp) {
    tweight g, u, dn;
    tw_make(&g, "gate_exps", type, D, F, E, 0.3f);
    tw_make(&u, "up_exps", type, D, F, E, 0.3f);
    tw_make(&dn, "down_exps", type, F, D, E, 0.3f);
    size_t nx = (size_t)nt * D, ns = (size_t)nt * k;
    float *x = fbuf(nx), *wts = fbuf(ns);
    int32_t *sel = xmalloc(ns * 4);
    fill(x, nx, -1, 1);
    fill(wts, ns, 0.05f, 1.0f);
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                e = (j == 0 && t == 0) ? E - 1 : rndi(E); dup = 0;
                for (int jj = 0; jj < j; jj++) if (sel[(size_t)t * k + jj] == e) dup = 1;
            } while (dup);
            sel[(size_t)t * k + j] = e;
        }
    /* odd token counts also get the op's final "+ add" (the shared expert's slot) */
    float *add = fbuf(nx);
    fill(add, nx, -1, 1);
    const int with_add = nt % 2;
    float *dx = dev_from(x, nx), *dw = dev_from(wts, ns), *dout = dev_nan(nx), *dadd = dev_from(add, nx);
    int32_t *dsel = dev_from_i(sel, ns);
    be->moe_experts(dx, dsel, dw, &g.w, &u.w, &dn.w, nt, k, clamp, with_add ? dadd : NULL, dout);
    float *out = dl(dout, nx);

    double *ref = dbuf(nx), *tol = dbuf(nx), *hv = dbuf((size_t)F), *dh = dbuf((size_t)F);
    const double L = clamp;
    for (int t = 0; t < nt; t++) {
        for (int d = 0; d < D; d++) ref[(size_t)t * D + d] = tol[(size_t)t * D + d] = 0;
        for (int j = 0; j < k; j++) {
            int e = sel[(size_t)t * k + j];
            double wj = wts[(size_t)t * k + j];
            for (int f = 0; f < F; f++) {
                const double *G = g.val + ((size_t)e * F + f) * D, *Up = u.val + ((size_t)e * F + f) * D;
                double gs = 0, gm = 0, us = 0, um = 0;
                for (int i = 0; i < D; i++) {
                    double a = G[i] * x[(size_t)t * D + i], b = Up[i] * x[(size_t)t * D + i];
                    gs += a; gm += fabs(a); us += b; um += fabs(b);
                }
                if (L > 1e-6) { if (gs > L) gs = L; if (us > L) us = L; if (us < -L) us = -L; }
                hv[f] = silu_d(gs) * us;
                /* error of h_f: the two f32 dots (16 u sqrt(D) * magnitude) through
                 * |d silu/dg| <= 1.1 and |silu|, plus 16 u for silu and the product. */
                double eg = 16.0 * U * sqrt((double)D) * gm, eu = 16.0 * U * sqrt((double)D) * um;
                dh[f] = 1.1 * fabs(us) * eg + fabs(silu_d(gs)) * eu + 16.0 * U * fabs(hv[f]);
            }
            for (int d = 0; d < D; d++) {
                const double *Dw = dn.val + ((size_t)e * D + d) * F;
                double s = 0, m = 0, prop = 0;
                for (int f = 0; f < F; f++) { s += Dw[f] * hv[f]; m += fabs(Dw[f] * hv[f]); prop += fabs(Dw[f]) * dh[f]; }
                ref[(size_t)t * D + d] += wj * s;
                /* the propagated h error plus the down projection's own f32 dot error */
                tol[(size_t)t * D + d] += fabs(wj) * (prop + 16.0 * U * sqrt((double)F) * m) + 8.0 * U * fabs(wj * s);
            }
        }
        for (int d = 0; d < D; d++) {
            if (with_add) {   /* one more f32 rounding of the sum */
                ref[(size_t)t * D + d] += add[(size_t)t * D + d];
                tol[(size_t)t * D + d] += U * (fabs(ref[(size_t)t * D + d]) + fabs((double)add[(size_t)t * D + d]));
            }
            tol[(size_t)t * D + d] += 1e-30;
        }
    }
    char name[200];
    snprintf(name, sizeof name, "moe_experts%s %s D=%d F=%d E=%d k=%d nt=%d clamp=%g", with_add ? "+add" : "", tname(type), D, F, E, k, nt, (double)clamp);
    report(name, out, ref, tol, nx);
    be->free(dx); be->free(dw); be->free(dout); be->free(dsel); be->free(dadd);
    free(x); free(wts); free(sel); free(out); free(ref); free(tol); free(hv); free(dh); free(add);
    tw_free(&g); tw_free(&u); tw_free(&dn);
}

/* ------------------------------------------------ swiglu / add / scale */

static void test_swiglu(int64_t n, float limit, int inplace) {
    float *g = fbuf((size_t)n), *u = fbuf((size_t)n);
    fill(g, (size_t)n, -20, 20); fill(u, (size_t)n, -20, 20);
    if (n > 4) { g[0] = limit; u[1] = -limit; g[2] = -30; u[3] = limit; }
    float *dg = dev_from(g, (size_t)n), *du = dev_from(u, (size_t)n), *dy = inplace ? dg : dev_nan((size_t)n);
    be->swiglu(dg, du, dy, n, limit);
    float *y = dl(dy, (size_t)n);
    double *ref = dbuf((size_t)n), *tol = dbuf((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        double gg = g[i], uu = u[i];
        if (limit > 1e-6f) { gg = fmin(gg, limit); uu = fmax(-(double)limit, fmin(uu, limit)); }
        ref[i] = silu_d(gg) * uu;
        /* f32 expf (1-2 ulp), 1+e, the division and the product: ~5 u relative; 16 u. */
        tol[i] = 16.0 * U * fabs(ref[i]) + 1e-37;
    }
    char name[160];
    snprintf(name, sizeof name, "swiglu n=%lld limit=%g%s (|g|,|u| up to 20)", (long long)n, (double)limit,
             inplace ? " in-place y==g" : "");
    report(name, y, ref, tol, (size_t)n);
    be->free(dg); be->free(du);
    if (!inplace) be->free(dy);
    free(g); free(u); free(y); free(ref); free(tol);
}

static void test_add(int64_t n, int mode /* 0: y new, 1: y == a, 2: y == b */) {
    float *a = fbuf((size_t)n), *b = fbuf((size_t)n);
    fill(a, (size_t)n, -3, 3); fill(b, (size_t)n, -3, 3);
    float *da = dev_from(a, (size_t)n), *db = dev_from(b, (size_t)n);
    float *dy = mode == 1 ? da : mode == 2 ? db : dev_nan((size_t)n);
    be->add(da, db, dy, n);
    float *y = dl(dy, (size_t)n);
    double *ref = dbuf((size_t)n);
    for (int64_t i = 0; i < n; i++) { float v = a[i] + b[i]; ref[i] = v; }
    char name[120];
    snprintf(name, sizeof name, "add n=%lld%s", (long long)n, mode == 1 ? " in-place y==a" : mode == 2 ? " in-place y==b" : "");
    report(name, y, ref, NULL, (size_t)n);   /* one correctly rounded f32 add: exact */
    be->free(da); be->free(db);
    if (!mode) be->free(dy);
    free(a); free(b); free(y); free(ref);
}

static void test_scale(int64_t n, float s) {
    float *x = fbuf((size_t)n);
    fill(x, (size_t)n, -3, 3);
    float *dx = dev_from(x, (size_t)n);
    be->scale(dx, s, n);
    float *y = dl(dx, (size_t)n);
    double *ref = dbuf((size_t)n);
    for (int64_t i = 0; i < n; i++) { float v = x[i] * s; ref[i] = v; }
    char name[120];
    snprintf(name, sizeof name, "scale n=%lld s=%g", (long long)n, (double)s);
    report(name, y, ref, NULL, (size_t)n);   /* one correctly rounded f32 multiply: exact */
    be->free(dx);
    free(x); free(y); free(ref);
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ds4_cpu_set_threads(argc > 1 ? atoi(argv[1]) : 3);
    be = ds4_backend_cpu();
    if (!be || be->init() != 0) { fprintf(stderr, "test_kernels: CPU backend init failed\n"); return 2; }

    test_converters();
    test_lifetime();
    test_ctx_plan();

    static const int types[] = { DS4_TYPE_F32, DS4_TYPE_F16, DS4_TYPE_BF16, DS4_TYPE_Q8_0 };
    for (int ti = 0; ti < 4; ti++) {
        int ty = types[ti], q8 = ty == DS4_TYPE_Q8_0;
        test_embed(ty, q8 ? 64 : 40, 50, 1, 1);
        test_embed(ty, q8 ? 96 : 37, 50, 3, 4);
        test_embed(ty, q8 ? 32 : 72, 7, 17, 4);
    }

    test_rmsnorm(1, 7, 0, 1e-6f, 0, 2);
    test_rmsnorm(3, 40, 1, 1e-6f, 0, 2);
    test_rmsnorm(17, 4099, 1, 1e-6f, 0, 2);
    test_rmsnorm(17, 4099, 0, 1e-6f, 1, 2);
    test_rmsnorm(3, 72, 1, 1e-2f, 1, 0.05f);     /* eps comparable to mean(x^2) */

    for (int ti = 0; ti < 4; ti++) {
        int ty = types[ti], q8 = ty == DS4_TYPE_Q8_0;
        test_matmul(ty, q8 ? 32 : 37, 5, 1, 0, 1);
        test_matmul(ty, q8 ? 96 : 71, 17, 1, 0, 3);
        test_matmul(ty, q8 ? 256 : 250, 33, 3, 2, 17);   /* 3-D, expert > 0 */
        test_matmul(ty, q8 ? 64 : 40, 9, 4, 1, 1);        /* 3-D, middle expert */
        test_matmul(ty, 512, 300, 1, 0, 17);             /* many rows: threads split */
    }
    test_matmul(DS4_TYPE_F32, 1, 3, 1, 0, 3);
    test_matmul_grouped(DS4_TYPE_F32, 40, 3, 5, 3);
    test_matmul_grouped(DS4_TYPE_F32, 37, 1, 4, 1);
    test_matmul_grouped(DS4_TYPE_F16, 72, 4, 9, 17);
    test_matmul_grouped(DS4_TYPE_BF16, 40, 2, 3, 3);
    test_matmul_grouped(DS4_TYPE_Q8_0, 64, 8, 7, 17);

    test_hc_mix(1, 40, 4, 0, 20, 1e-6f, 0.5f);
    test_hc_mix(17, 72, 4, 0, 20, 1e-6f, 0.5f);
    test_hc_mix(3, 40, 4, 0, 1, 1e-6f, 2.0f);
    test_hc_mix(3, 37, 3, 0, 3, 1e-3f, 2.0f);
    test_hc_mix(3, 40, 4, 0, 2, 0.3f, 2.0f);     /* large eps: the col-first order matters */
    test_hc_mix(17, 40, 2, 0, 20, 1e-6f, 1.0f);
    test_hc_mix(17, 40, 4, 1, 20, 1e-6f, 1.0f);
    test_hc_mix(3, 72, 1, 1, 20, 1e-6f, 1.0f);
    test_hc_post(1, 40, 4);
    test_hc_post(17, 72, 4);
    test_hc_post(3, 37, 3);
    test_hc_post(3, 40, 1);

    test_rope(3, 1, 40, 16, 0, 1, 10000.0f, 1.0f, 0.0f, 0, 0);
    test_rope(17, 5, 72, 64, 1000, 1, 10000.0f, 1.0f, 0.0f, 0, 0);
    test_rope(1, 5, 16, 16, 77, 1, 10000.0f, 1.0f, 0.0f, 0, 0);        /* whole head rotated */
    test_rope(3, 5, 40, 16, 12, 1, 10000.0f, 0.5f, 0.0f, 0, 0);        /* freq_scale, no ext */
    test_rope(17, 5, 72, 64, 50000, 1, 160000.0f, 0.25f, 1.0f, 2, 7);  /* YaRN */
    test_rope(3, 1, 40, 16, 8, 4, 160000.0f, 0.25f, 1.0f, 2, 7);       /* YaRN, compressed-row step */
    test_rope(3, 1, 72, 64, 0, 128, 160000.0f, 0.25f, 1.0f, 2, 7);
    test_rope(17, 1, 40, 24, 3, 1, 10000.0f, 0.25f, 1.0f, 2, 7);       /* n_rot not a power of 2 */

    /*            W  pos0 nt  H   d  ratio k mode sink */
    test_attention(8,   0,  3, 1, 40,   0, 0, 0, 0);
    test_attention(8,   0, 17, 5, 72,   0, 0, 0, 0);
    test_attention(8,  21,  3, 5, 40,   0, 0, 0, 0);
    test_attention(8,  13, 17, 1, 72,   0, 0, 0, 0);
    test_attention(8,   5,  1, 5, 40,   0, 0, 0, 0);
    test_attention(8,  40,  1, 5, 72,   0, 0, 0, 6);
    test_attention(8,  40,  3, 5, 40,   0, 0, 0, -40);
    test_attention(16, 250, 17, 5, 40, 128, 0, 0, 0);
    test_attention(16,  0,  3, 1, 72, 128, 0, 0, 0);
    test_attention(8,  127, 1, 5, 40, 128, 0, 0, 0);
    test_attention(8,  600, 3, 1, 72, 128, 0, 0, 0);
    test_attention(8,  30, 17, 5, 72,   4, 6, 0, 0);
    test_attention(8,   0, 17, 1, 40,   4, 4, 0, 0);
    test_attention(8,  11,  3, 5, 40,   4, 5, 1, 0);

    test_ring_store(8, 40, 0, 3);
    test_ring_store(8, 72, 5, 17);
    test_ring_store(8, 7, 13, 1);
    test_ring_store(128, 40, 120, 17);
    test_ring_store(4, 7, 3, 4);
    test_ring_store(8, 80, 9, 17);
    test_add_cyclic(4, 80, 0, 17);
    test_add_cyclic(128, 40, 250, 17);
    test_add_cyclic(4, 7, 5, 3);
    test_add_cyclic(128, 14, 127, 1);

    /*                ratio c  dc pos0 nt */
    test_compress_pool(4,   1, 40,  0, 17);
    test_compress_pool(4,   1,  7,  6,  3);
    test_compress_pool(128, 1, 40, 120, 17);
    test_compress_pool(4,   1, 40,  5,  1);   /* no block ends: nothing written */
    test_compress_pool(4,   2, 40,  0, 17);
    test_compress_pool(4,   2,  7,  2,  3);
    test_compress_pool(4,   2, 40,  9, 17);
    test_compress_pool(4,   2, 40,  7,  1);
    test_compress_pool(4,   2,  7,  3,  1);
    test_compress_pool(4,   2, 40,  0,  1);   /* nothing emitted */

    /*           Hi  di ratio k pos0 nt exact dup */
    test_indexer(1, 40, 4, 8,   0, 17, 1, 0);
    test_indexer(5, 72, 4, 8,  40,  3, 1, 4);
    test_indexer(5, 40, 4, 8,  25, 17, 1, 3);
    test_indexer(1, 72, 4, 1,   7,  3, 1, 1);
    test_indexer(3, 40, 4, 16, 60, 17, 1, 6);
    test_indexer(4, 64, 4, 16, 200, 3, 0, 0);
    test_indexer(2, 40, 4, 16, 2040, 17, 1, 40);  /* the queries' rows end either side of a 512-row tile */
    test_indexer(1, 32, 4, 64, 5000, 33, 1, 200); /* three tiles, many ties, queries over threads */

    /*            E  k nt hash norm wscale tiny */
    test_moe_route(16, 6, 17, 0, 1, 1.5f, 0);
    test_moe_route(8, 8, 3, 0, 1, 1.0f, 0);
    test_moe_route(6, 2, 3, 0, 0, 2.5f, 0);
    test_moe_route(16, 6, 17, 1, 1, 1.5f, 0);
    test_moe_route(16, 6, 3, 1, 0, 1.0f, 0);
    test_moe_route(16, 6, 3, 0, 1, 1.5f, 1);
    test_moe_route(8, 2, 3, 0, 1, 0.0f, 0);      /* header: wts *= wscale, also for 0 */

    test_moe_experts(DS4_TYPE_F32, 40, 24, 8, 2, 3, 0.7f);
    test_moe_experts(DS4_TYPE_F32, 37, 17, 5, 3, 1, 0.0f);
    test_moe_experts(DS4_TYPE_F16, 40, 24, 8, 6, 17, 10.0f);
    test_moe_experts(DS4_TYPE_BF16, 72, 40, 4, 2, 3, 0.7f);
    test_moe_experts(DS4_TYPE_Q8_0, 64, 96, 8, 6, 17, 0.7f);

    test_swiglu(1037, 7.0f, 0);
    test_swiglu(1037, 0.0f, 0);
    test_swiglu(100003, 10.0f, 1);
    test_swiglu(5, 0.5f, 0);
    test_add(1037, 0);
    test_add(100003, 1);
    test_add(7, 2);
    test_scale(1037, 1.5f);
    test_scale(100003, -0.3f);

    be->synchronize();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("runtime %.2f s\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail > 0;
}
