/* test_cuda_quant_host.cu -- ds4_cuda_quant.cuh's decoders and fragment layout, on the CPU.
 *
 * The CUDA kernels for Q2_K, Q4_K and IQ2_XXS are built from __host__ __device__ pieces, so
 * their arithmetic can be checked here without a GPU, against ds4_quant_dequant (the
 * specification, itself bit-exact with ggml):
 *
 *   1. dsq_elem (every element of multi-block rows) and dsq_block8 (every 8-element part)
 *      equal ds4_quant_dequant bit for bit: on random valid blocks (ds4_quant_random_block),
 *      on random bytes with every edge-case scale (zero, +-0, the smallest subnormal, the
 *      largest finite, negative, inf, NaN -- NaN compared as NaN, see same()), on every
 *      IQ2_XXS grid index in every position,
 *      every sign code in every group, and every ls.
 *   2. The MMA fragment map (dsq_frag_elem) is a permutation of the 256 elements of a
 *      super-block, dsq_frag_slot is its inverse, and every aligned quad of elements fills
 *      one fragment in dsq_quad_slot order (the kernel stages B a quad at a time).
 *   3. The A fragments the matvec decodes (dsq_iq2_*, dsq_q4k_*, dsq_q2k_*) hold exact
 *      integers: for every element, its A value times the block scale (minus dmin times the
 *      group's min, for Q2_K/Q4_K, rounded once: fmaf) equals ds4_quant_dequant bit for bit.
 *      The block sits at every offset the staged rows can have (IQ2_XXS: any even offset mod
 *      16, Q2_K: any multiple of 4, Q4_K: 0).  Also dsq_h2_int for 0..1023.
 *   4. The activation split: for random super-blocks over a wide range of magnitudes,
 *      2^9 <= max |x 2^a| < 2^10, and hi + mid + lo == x 2^a exactly where |x 2^a| >= 1/2,
 *      within 2^-25 below (the f16 subnormal grid; 2^-34 of the block's largest value).
 *   5. A warp tile, end to end: the kernel's staging of B (split, fragment order), the A
 *      decode of two rows per lane, the m16n8k16 MMA emulated from its PTX fragment layout
 *      (exactly, in double), the per-SB scale, the min terms and the column combination,
 *      for 1 and 2 tokens, against a double dot product of dequantised weights.  Tolerance:
 *      |y - ref| <= 1e-6 sum|w x| per row.  What remains after exact products and exact
 *      split is f32 rounding: the per-SB fmaf accumulation (~n_sb ulps), the three column
 *      sums and the min subtraction (a few ulps of sum|w x|) -- ~1e-7; 1e-6 leaves a decade
 *      while any layout error gives an O(1) relative error.  (The device's tensor-core
 *      accumulation is not emulated: that is test_backend_ops' part, on a GPU.)
 *
 * Build and run (no GPU needed):
 *   mkdir -p build && nvcc -std=c++17 -O2 -I. tests/test_cuda_quant_host.cu ds4_quant.c \
 *       -o build/test_cuda_quant_host && ./build/test_cuda_quant_host
 * The last line is "N passed, M failed"; the exit status is non-zero on any failure.
 */
#define DSQ_DECODERS_ONLY
#include "ds4_cuda_quant.cuh"

extern "C" {
#include "ds4_quant.h"
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_pass, g_fail;

static void check(int ok, const char *what) {
    if (ok) g_pass++;
    else g_fail++;
    printf("%-4s %s\n", ok ? "ok" : "FAIL", what);
}

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }

static const int TYPES[3] = { DS4_TYPE_Q2_K, DS4_TYPE_Q4_K, DS4_TYPE_IQ2_XXS };
static const char *tname(int type) { return ds4_quant_type_name(type); }

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* Offsets of d (and dmin) inside a block. */
static void scale_offsets(int type, int *od, int *om) {
    *od = type == DS4_TYPE_Q2_K ? 80 : 0;
    *om = type == DS4_TYPE_Q2_K ? 82 : type == DS4_TYPE_Q4_K ? 2 : -1;
}

/* ---- 1. dequantisation, bit for bit ------------------------------------------------- */

/* Bitwise equality, except that two NaNs are equal: where a scale is NaN, the sign of the
 * CPU's NaN depends on how the C compiler optimised ds4_quant.c's x * (+-1.0f) (a multiply
 * keeps the NaN's sign, a negation flips it; gcc -O0 and -O2 differ), so only NaN-ness is a
 * property of the format.  Finite scales, the format's domain, are compared bit for bit. */
static int same(float a, float b) { return memcmp(&a, &b, 4) == 0 || (a != a && b != b); }

/* Compare every element of a row of nb blocks; returns the number of mismatching floats. */
static long compare_row(int type, const uint8_t *row, int nb) {
    const int K = nb * 256;
    float *ref = (float *)malloc((size_t)K * sizeof(float));
    ds4_quant_dequant(type, row, ref, K);
    long bad = 0;
    for (int k = 0; k < K; k++) {
        if (!same(dsq_elem(type, row, k), ref[k])) bad++;
    }
    const int bb = dsq_block_bytes(type);
    for (int b = 0; b < nb; b++)
        for (int p = 0; p < 32; p++) {
            float v[8];
            dsq_block8(type, row + (size_t)b * bb, p, v);
            for (int l = 0; l < 8; l++) if (!same(v[l], ref[256 * b + 8 * p + l])) bad++;
        }
    free(ref);
    return bad;
}

static const uint16_t EDGE_F16[] = {
    0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0xfbff, 0xbc00, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe37,
};
#define N_EDGE (int)(sizeof EDGE_F16 / sizeof EDGE_F16[0])

static void test_dequant(void) {
    for (int ti = 0; ti < 3; ti++) {
        const int type = TYPES[ti], bb = dsq_block_bytes(type);
        char what[160];
        /* random valid blocks, rows of 8 */
        {
            const int nb = 8, rows = 3000;
            uint8_t *row = (uint8_t *)malloc((size_t)nb * bb);
            uint64_t st = 0x1234 + (uint64_t)type;
            long bad = 0;
            for (int r = 0; r < rows; r++) {
                for (int b = 0; b < nb; b++) ds4_quant_random_block(type, &st, row + (size_t)b * bb);
                bad += compare_row(type, row, nb);
            }
            free(row);
            snprintf(what, sizeof what, "%-7s dsq_elem + dsq_block8 == ds4_quant_dequant on %d random valid blocks (%ld mismatches)",
                     tname(type), nb * rows, bad);
            check(bad == 0, what);
        }
        /* random bytes with every pair of edge scales */
        {
            int od, om;
            scale_offsets(type, &od, &om);
            uint8_t blk[256];
            long bad = 0, n = 0;
            for (int i = 0; i < N_EDGE; i++)
                for (int j = 0; j < (om >= 0 ? N_EDGE : 1); j++)
                    for (int rep = 0; rep < 8; rep++) {
                        for (int k = 0; k < bb; k++) blk[k] = (uint8_t)rnd();
                        if (rep == 1) memset(blk, 0xff, (size_t)bb);    /* every field at its maximum */
                        if (rep == 2) memset(blk, 0x00, (size_t)bb);
                        put16(blk + od, EDGE_F16[i]);
                        if (om >= 0) put16(blk + om, EDGE_F16[j]);
                        bad += compare_row(type, blk, 1);
                        n++;
                    }
            snprintf(what, sizeof what, "%-7s bit-exact with edge scales (zero, subnormal, max, negative, inf; NaN as NaN): %ld blocks, %ld mismatches",
                     tname(type), n, bad);
            check(bad == 0, what);
        }
    }
    /* IQ2_XXS: every grid index in every position, every sign code in every group, every ls */
    {
        const int type = DS4_TYPE_IQ2_XXS;
        uint8_t blk[66];
        long bad = 0, n = 0;
        for (int idx = 0; idx < 256; idx++) {
            uint64_t st = 99 + (uint64_t)idx;
            ds4_quant_random_block(type, &st, blk);
            for (int r = 0; r < 8; r++)
                for (int i = 0; i < 4; i++) blk[2 + 8 * r + i] = (uint8_t)(idx + 37 * (4 * r + i));
            bad += compare_row(type, blk, 1);
            n++;
        }
        for (int code = 0; code < 128; code++)
            for (int ls = 0; ls < 16; ls += 5) {
                uint64_t st = 7 + (uint64_t)code;
                ds4_quant_random_block(type, &st, blk);
                for (int r = 0; r < 8; r++) {
                    uint32_t w = (uint32_t)ls << 28;
                    for (int i = 0; i < 4; i++) w |= (uint32_t)((code + 13 * i + 29 * r) & 127) << (7 * i);
                    for (int k = 0; k < 4; k++) blk[2 + 8 * r + 4 + k] = (uint8_t)(w >> (8 * k));
                }
                bad += compare_row(type, blk, 1);
                n++;
            }
        char what[160];
        snprintf(what, sizeof what, "IQ2_XXS every grid index x position, every sign code x group, ls: %ld blocks, %ld mismatches",
                 n, bad);
        check(bad == 0, what);
    }
}

/* ---- 2. the fragment map --------------------------------------------------------------- */

static void test_frag_map(void) {
    for (int ti = 0; ti < 3; ti++) {
        const int type = TYPES[ti];
        int seen[256] = { 0 }, ok = 1;
        for (int i = 0; i < 16; i++)
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 4; r++) {
                    const int e = dsq_frag_elem(type, i, t, r);
                    if (e < 0 || e > 255) { ok = 0; continue; }
                    seen[e]++;
                    int i2, t2, r2;
                    dsq_frag_slot(type, e, &i2, &t2, &r2);
                    if (i2 != i || t2 != t || r2 != r) ok = 0;
                }
        for (int e = 0; e < 256; e++) if (seen[e] != 1) ok = 0;
        /* the staging stores 4 elements at once: 4m .. 4m+3 share (MMA, t), slots dsq_quad_slot */
        for (int m = 0; m < 64; m++) {
            int i0, t0, r0;
            dsq_frag_slot(type, 4 * m, &i0, &t0, &r0);
            for (int b = 0; b < 4; b++) {
                int i1, t1, r1;
                dsq_frag_slot(type, 4 * m + b, &i1, &t1, &r1);
                if (i1 != i0 || t1 != t0 || r1 != dsq_quad_slot(type, b)) ok = 0;
            }
        }
        char what[160];
        snprintf(what, sizeof what, "%-7s fragment map is a permutation of the super-block, dsq_frag_slot its inverse, quads share a fragment",
                 tname(type));
        check(ok, what);
    }
}

/* ---- 3. the A fragments: exact integers ------------------------------------------------ */

static uint4 g_grid[256];          /* one copy, entry stride 16 bytes */
static uint8_t g_s8[128];

static float f16v(uint32_t h) { return dsq_f16(h & 0xffffu); }

/* A values of one row (the block at blk) for lane quarter t: a[i][r], and the min (as a
 * float) of each slot's group; d, dmin. */
static void decode_row(int type, const uint8_t *blk, int t, float a[16][4], float mn[16][4], float *d, float *dmin) {
    uint32_t X[16][2];   /* [MMA][reg: slots (0,1), (2,3)] */
    if (type == DS4_TYPE_IQ2_XXS) {
        *d = dsq_f16(dsq_rd16(blk));
        *dmin = 0.0f;
        for (int rho = 0; rho < 2; rho++) {
            uint32_t iw, w;
            dsq_iq2_rec(blk, t + 4 * rho, (uint32_t)(((uintptr_t)blk + 2) & 2u), &iw, &w);
            const uint32_t L = dsq_iq2_L(w);
            for (int q = 0; q < 4; q++) {
                uint32_t Xg[4];
                dsq_iq2_group((const uint8_t *)g_grid, 16, g_s8, iw, w, q, L, Xg);
                const int i = 8 * rho + 2 * q;
                X[i][0] = Xg[0]; X[i][1] = Xg[1]; X[i + 1][0] = Xg[2]; X[i + 1][1] = Xg[3];
            }
        }
        for (int i = 0; i < 16; i++) for (int r = 0; r < 4; r++) mn[i][r] = 0.0f;
    } else if (type == DS4_TYPE_Q4_K) {
        dsq_q4k_row R;
        dsq_q4k_setup(blk, t, &R);
        *d = R.d; *dmin = R.dmin;
        for (int u = 0; u < 8; u++) {
            uint32_t Xw[4];
            dsq_q4k_word(dsq_ld32(blk + 16 + 32 * t + 4 * u), &R, Xw);
            X[2 * u][0] = Xw[0]; X[2 * u][1] = Xw[1]; X[2 * u + 1][0] = Xw[2]; X[2 * u + 1][1] = Xw[3];
        }
        for (int i = 0; i < 16; i++) for (int r = 0; r < 4; r++) mn[i][r] = (i & 1) ? R.m1 : R.m0;
    } else {
        dsq_q2k_row R;
        dsq_q2k_setup(blk, t, &R);
        *d = R.d; *dmin = R.dmin;
        for (int u = 0; u < 4; u++) {
            uint32_t Xw[8];
            dsq_q2k_word(dsq_ld32(blk + 16 + 16 * t + 4 * u), &R, Xw);
            for (int j = 0; j < 4; j++) { X[4 * u + j][0] = Xw[2 * j]; X[4 * u + j][1] = Xw[2 * j + 1]; }
        }
        for (int i = 0; i < 16; i++) for (int r = 0; r < 4; r++) mn[i][r] = R.m[i & 3];
    }
    for (int i = 0; i < 16; i++)
        for (int r = 0; r < 4; r++) a[i][r] = f16v(X[i][r >> 1] >> (16 * (r & 1)));
}

/* The element's value from its A value: IQ2_XXS (d a) / 8; else fmaf(d, a, -(dmin m)). */
static float value_of(int type, float a, float m, float d, float dmin) {
    if (type == DS4_TYPE_IQ2_XXS) return (d * a) * 0.125f;
    return fmaf(d, a, -(dmin * m));
}

static int offsets_of(int type, int *o) {
    int n = 0;
    if (type == DS4_TYPE_IQ2_XXS) for (int k = 0; k < 16; k += 2) o[n++] = k;
    else if (type == DS4_TYPE_Q2_K) for (int k = 0; k < 16; k += 4) o[n++] = k;
    else o[n++] = 0;
    return n;
}

static long check_afrag_block(int type, const uint8_t *blk0) {
    const int bb = dsq_block_bytes(type);
    float ref[256];
    ds4_quant_dequant(type, blk0, ref, 256);
    int offs[16];
    const int no = offsets_of(type, offs);
    long bad = 0;
    for (int oi = 0; oi < no; oi++) {
        alignas(16) uint8_t buf[192];
        memset(buf, 0xa5, sizeof buf);
        memcpy(buf + offs[oi], blk0, (size_t)bb);
        for (int t = 0; t < 4; t++) {
            float a[16][4], mn[16][4], d, dmin;
            decode_row(type, buf + offs[oi], t, a, mn, &d, &dmin);
            for (int i = 0; i < 16; i++)
                for (int r = 0; r < 4; r++) {
                    const int e = dsq_frag_elem(type, i, t, r);
                    const float v = value_of(type, a[i][r], mn[i][r], d, dmin);
                    if (a[i][r] != floorf(a[i][r]) || memcmp(&v, &ref[e], 4) != 0) bad++;
                }
        }
    }
    return bad;
}

static void test_afrag(void) {
    for (int i = 0; i < 256; i++) g_grid[i] = dsq_iq2_grid_entry(i);
    for (int c = 0; c < 128; c++) g_s8[c] = (uint8_t)dsq_iq2_s8((uint32_t)c);
    {
        int ok = 1;
        for (uint32_t v = 0; v < 1024; v++) {
            const uint32_t p = dsq_h2_int(v);
            if (f16v(p) != (float)v || f16v(p >> 16) != (float)v) ok = 0;
        }
        check(ok, "dsq_h2_int(v) is (v, v) exactly for 0 <= v < 1024");
    }
    for (int ti = 0; ti < 3; ti++) {
        const int type = TYPES[ti], bb = dsq_block_bytes(type);
        int od, om;
        scale_offsets(type, &od, &om);
        uint8_t blk[256];
        long bad = 0, n = 0;
        uint64_t st = 0x777 + (uint64_t)type;
        for (int k = 0; k < 4000; k++) {
            ds4_quant_random_block(type, &st, blk);
            bad += check_afrag_block(type, blk);
            n++;
        }
        /* random bytes (every scale / min / quant / index / sign / ls) with finite edge scales */
        static const uint16_t fin[] = { 0x0000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0xfbff, 0x8001 };
        for (int k = 0; k < 4000; k++) {
            for (int j = 0; j < bb; j++) blk[j] = (uint8_t)rnd();
            if (k % 7 == 0) memset(blk, 0xff, (size_t)bb);
            put16(blk + od, fin[k % 8]);
            if (om >= 0) put16(blk + om, fin[(k / 8) % 8]);
            bad += check_afrag_block(type, blk);
            n++;
        }
        if (type == DS4_TYPE_IQ2_XXS) {      /* every grid index in every position */
            for (int idx = 0; idx < 256; idx++) {
                ds4_quant_random_block(type, &st, blk);
                for (int r = 0; r < 8; r++)
                    for (int i = 0; i < 4; i++) blk[2 + 8 * r + i] = (uint8_t)(idx + 53 * (4 * r + i));
                bad += check_afrag_block(type, blk);
                n++;
            }
        }
        char what[200];
        snprintf(what, sizeof what, "%-7s A fragments: exact integers, value == ds4_quant_dequant bit for bit, every staging offset: %ld blocks, %ld mismatches",
                 tname(type), n, bad);
        check(bad == 0, what);
    }
}

/* ---- 4. the activation split ------------------------------------------------------------ */

static void test_split(void) {
    long bad = 0, n = 0, rng_bad = 0;
    float x[256];
    for (int blk = 0; blk < 20000; blk++) {
        const int e0 = (int)(rnd() % 240) - 120;            /* block magnitude 2^-120 .. 2^119 */
        for (int k = 0; k < 256; k++) {
            const int e = e0 - (int)(rnd() % 40);            /* elements down to 2^-40 of the largest */
            x[k] = (float)ldexp(rnd_unit() * 2.0 - 1.0, e);
            if (blk % 11 == 0 && k % 3 == 0) x[k] = 0.0f;
        }
        float mx = 0.0f;
        for (int k = 0; k < 256; k++) mx = fmaxf(mx, fabsf(x[k]));
        const int a = dsq_sb_exp(mx);
        const float sc = dsq_pow2(a), inv = dsq_pow2(-a);
        if ((double)sc * (double)inv != 1.0) rng_bad++;
        if (mx > 0.0f && a < 126 && !(mx * sc >= 512.0f)) rng_bad++;   /* a = 126: clamped, tiny block */
        for (int k = 0; k < 256; k++) {
            const float xs = x[k] * sc;
            if (!(fabsf(xs) < 1024.0f)) rng_bad++;
            if ((double)xs != (double)x[k] * (double)sc) rng_bad++;   /* the scaling is exact */
            uint32_t h, m, l;
            dsq_split3(xs, &h, &m, &l);
            const double sum = (double)f16v(h) + (double)f16v(m) + (double)f16v(l);
            const double err = fabs(sum - (double)xs);
            if (fabsf(xs) >= 0.5f ? err != 0.0 : err > 0x1p-25) bad++;
            n++;
        }
    }
    char what[160];
    snprintf(what, sizeof what, "activation split: 2^9 <= max|x 2^a| < 2^10, 2^a exact, hi + mid + lo == x 2^a on %ld values (%ld, %ld bad)",
             n, rng_bad, bad);
    check(bad == 0 && rng_bad == 0, what);
}

/* ---- 5. a warp tile end to end ---------------------------------------------------------- */

/* The kernel's staging of one token's SB (as k_matvec_q does it, one lane = 8 elements). */
static void stage_sb(int type, const float *xsb, int sb, int u, int cs, uint16_t *xf, float *ps, float *sx, int nsb) {
    float mx = 0.0f;
    for (int k = 0; k < 256; k++) mx = fmaxf(mx, fabsf(xsb[k]));
    const int ea = dsq_sb_exp(mx);
    const float sc = dsq_pow2(ea);
    for (int e = 0; e < 256; e++) {
        int fi, ft, fr;
        dsq_frag_slot(type, e, &fi, &ft, &fr);
        uint32_t hp[3];
        dsq_split3(xsb[e] * sc, &hp[0], &hp[1], &hp[2]);
        for (int pt = 0; pt < 3; pt++) xf[(size_t)dsq_xf_index(sb, fi, 3 * u + pt, ft, cs) * 4 + fr] = (uint16_t)hp[pt];
    }
    ps[u * nsb + sb] = type == DS4_TYPE_IQ2_XXS ? dsq_pow2(-ea) * 0.125f : dsq_pow2(-ea);
    const int ng = type == DS4_TYPE_Q2_K ? 16 : type == DS4_TYPE_Q4_K ? 8 : 0;
    for (int gi = 0; gi < ng; gi++) {
        const int len = 256 / ng;
        /* lanes of 8: ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)), then pairs, then quads */
        float s8[4];
        for (int l = 0; l < len / 8; l++) {
            const float *v = xsb + gi * len + 8 * l;
            s8[l] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        }
        float s = s8[0] + s8[1];
        if (len == 32) s = s + (s8[2] + s8[3]);
        sx[((size_t)u * nsb + sb) * ng + gi] = s;
    }
}

/* mma.m16n8k16 from the lanes' fragments (PTX layout), exactly (double sums). */
static void mma_emulate(const uint32_t A[32][4], const uint32_t B[32][2], double D[32][4]) {
    double a[16][16], b[16][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int h = 0; h < 2; h++) {
            a[g][2 * t + h] = f16v(A[lane][0] >> (16 * h));
            a[g + 8][2 * t + h] = f16v(A[lane][1] >> (16 * h));
            a[g][2 * t + 8 + h] = f16v(A[lane][2] >> (16 * h));
            a[g + 8][2 * t + 8 + h] = f16v(A[lane][3] >> (16 * h));
            b[2 * t + h][g] = f16v(B[lane][0] >> (16 * h));
            b[2 * t + 8 + h][g] = f16v(B[lane][1] >> (16 * h));
        }
    }
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int c = 0; c < 4; c++) {
            const int row = g + 8 * (c >> 1), col = 2 * t + (c & 1);
            double s = 0.0;
            for (int k = 0; k < 16; k++) s += a[row][k] * b[k][col];
            D[lane][c] += s;
        }
    }
}

static double tile_rel_err(int type, int nt, int nsb, int seed) {
    const int bb = dsq_block_bytes(type), K = 256 * nsb, cs = 3 * nt;
    const int ng = type == DS4_TYPE_Q2_K ? 16 : type == DS4_TYPE_Q4_K ? 8 : 0;
    uint8_t *w = (uint8_t *)malloc((size_t)16 * nsb * bb);
    float *x = (float *)malloc((size_t)nt * K * sizeof(float));
    uint16_t *xf = (uint16_t *)calloc((size_t)nsb * 16 * cs * 4 * 4, sizeof(uint16_t));
    float *ps = (float *)calloc((size_t)nt * nsb, sizeof(float));
    float *sx = (float *)calloc((size_t)nt * nsb * (ng ? ng : 1), sizeof(float));
    uint64_t st = (uint64_t)seed * 1000003u + (uint64_t)type;
    for (int b = 0; b < 16 * nsb; b++) ds4_quant_random_block(type, &st, w + (size_t)b * bb);
    for (int u = 0; u < nt; u++)
        for (int k = 0; k < K; k++) {
            const double sbscale = ldexp(1.0, (int)((k >> 8) * 3 % 11) - 5);   /* SBs of different magnitude */
            x[u * K + k] = (float)((rnd_unit() * 2.0 - 1.0) * sbscale);
        }
    for (int u = 0; u < nt; u++)
        for (int sb = 0; sb < nsb; sb++) stage_sb(type, x + u * K + sb * 256, sb, u, cs, xf, ps, sx, nsb);

    /* the warp: lane (g, t) owns rows g, g+8; acc per D register, accm per row and token */
    float acc[32][4] = { { 0 } }, accm[32][2][2] = { { { 0 } } };
    for (int sb = 0; sb < nsb; sb++) {
        uint32_t A[16][32][4], B[16][32][2];
        float dr[32][2], dminr[32][2], mmv[32][2][2];
        for (int lane = 0; lane < 32; lane++) {
            const int g = lane >> 2, t = lane & 3;
            alignas(16) uint8_t rowbuf[2][192];
            uint32_t X[2][16][2];
            float mins[2][4];
            for (int r = 0; r < 2; r++) {
                const uint8_t *blk = w + ((size_t)(g + 8 * r) * nsb + sb) * bb;
                const int o0 = type == DS4_TYPE_IQ2_XXS ? (sb * 66) & 15 : type == DS4_TYPE_Q2_K ? (sb * 84) & 15 : 0;
                memset(rowbuf[r], 0x5a, 192);
                memcpy(rowbuf[r] + o0, blk, (size_t)bb);
                const uint8_t *p = rowbuf[r] + o0;
                if (type == DS4_TYPE_IQ2_XXS) {
                    dr[lane][r] = dsq_f16(dsq_rd16(p));
                    dminr[lane][r] = 0.0f;
                    for (int rho = 0; rho < 2; rho++) {
                        uint32_t iw, ww;
                        dsq_iq2_rec(p, t + 4 * rho, (uint32_t)((o0 + 2) & 2), &iw, &ww);
                        const uint32_t L = dsq_iq2_L(ww);
                        for (int q = 0; q < 4; q++) {
                            uint32_t Xg[4];
                            dsq_iq2_group((const uint8_t *)g_grid, 16, g_s8, iw, ww, q, L, Xg);
                            const int i = 8 * rho + 2 * q;
                            X[r][i][0] = Xg[0]; X[r][i][1] = Xg[1]; X[r][i + 1][0] = Xg[2]; X[r][i + 1][1] = Xg[3];
                        }
                    }
                } else if (type == DS4_TYPE_Q4_K) {
                    dsq_q4k_row R;
                    dsq_q4k_setup(p, t, &R);
                    dr[lane][r] = R.d; dminr[lane][r] = R.dmin;
                    mins[r][0] = R.m0; mins[r][1] = R.m1;
                    for (int u4 = 0; u4 < 8; u4++) {
                        uint32_t Xw[4];
                        dsq_q4k_word(dsq_ld32(p + 16 + 32 * t + 4 * u4), &R, Xw);
                        X[r][2 * u4][0] = Xw[0]; X[r][2 * u4][1] = Xw[1];
                        X[r][2 * u4 + 1][0] = Xw[2]; X[r][2 * u4 + 1][1] = Xw[3];
                    }
                } else {
                    dsq_q2k_row R;
                    dsq_q2k_setup(p, t, &R);
                    dr[lane][r] = R.d; dminr[lane][r] = R.dmin;
                    for (int j = 0; j < 4; j++) mins[r][j] = R.m[j];
                    for (int u4 = 0; u4 < 4; u4++) {
                        uint32_t Xw[8];
                        dsq_q2k_word(dsq_ld32(p + 16 + 16 * t + 4 * u4), &R, Xw);
                        for (int j = 0; j < 4; j++) { X[r][4 * u4 + j][0] = Xw[2 * j]; X[r][4 * u4 + j][1] = Xw[2 * j + 1]; }
                    }
                }
            }
            for (int i = 0; i < 16; i++) {
                A[i][lane][0] = X[0][i][0]; A[i][lane][1] = X[1][i][0];
                A[i][lane][2] = X[0][i][1]; A[i][lane][3] = X[1][i][1];
                const uint16_t *bp = xf + (size_t)dsq_xf_index(sb, i, g % cs, t, cs) * 4;
                B[i][lane][0] = bp[0] | ((uint32_t)bp[1] << 16);
                B[i][lane][1] = bp[2] | ((uint32_t)bp[3] << 16);
            }
            /* the min sums, as mvq_sb forms them */
            for (int r = 0; r < 2; r++)
                for (int u = 0; u < nt; u++) {
                    const float *sxu = sx + ((size_t)u * nsb + sb) * (ng ? ng : 1);
                    if (type == DS4_TYPE_Q4_K) {
                        mmv[lane][r][u] = fmaf(mins[r][1], sxu[dsq_min_group(type, t, 1)], mins[r][0] * sxu[dsq_min_group(type, t, 0)]);
                    } else if (type == DS4_TYPE_Q2_K) {
                        float s = 0.0f;
                        for (int j = 0; j < 4; j++) s = fmaf(mins[r][j], sxu[dsq_min_group(type, t, j)], s);
                        mmv[lane][r][u] = s;
                    } else {
                        mmv[lane][r][u] = 0.0f;
                    }
                }
        }
        double Dd[32][4] = { { 0 } };
        for (int i = 0; i < 16; i++) mma_emulate(A[i], B[i], Dd);
        for (int lane = 0; lane < 32; lane++) {
            const int t = lane & 3;
            const float p0 = ps[dsq_col_token(2 * t, nt) * nsb + sb], p1 = ps[dsq_col_token(2 * t + 1, nt) * nsb + sb];
            acc[lane][0] = fmaf(dr[lane][0] * p0, (float)Dd[lane][0], acc[lane][0]);
            acc[lane][1] = fmaf(dr[lane][0] * p1, (float)Dd[lane][1], acc[lane][1]);
            acc[lane][2] = fmaf(dr[lane][1] * p0, (float)Dd[lane][2], acc[lane][2]);
            acc[lane][3] = fmaf(dr[lane][1] * p1, (float)Dd[lane][3], acc[lane][3]);
            for (int r = 0; r < 2; r++)
                for (int u = 0; u < nt; u++) accm[lane][r][u] = fmaf(dminr[lane][r], mmv[lane][r][u], accm[lane][r][u]);
        }
    }
    /* combine as the kernel does, compare with a double dot of the dequantised rows */
    double worst = 0.0;
    float *wd = (float *)malloc((size_t)K * sizeof(float));
    for (int lane = 0; lane < 32; lane += 4) {
        const int g = lane >> 2;
        for (int r = 0; r < 2; r++) {
            const int row = g + 8 * r;
            ds4_quant_dequant(type, w + (size_t)row * nsb * bb, wd, K);
            for (int u = 0; u < nt; u++) {
                float res;
                if (u == 0) res = (acc[lane][2 * r] + acc[lane][2 * r + 1]) + acc[lane + 1][2 * r];
                else res = (acc[lane + 1][2 * r + 1] + acc[lane + 2][2 * r]) + acc[lane + 2][2 * r + 1];
                const float m = (accm[lane][r][u] + accm[lane + 1][r][u]) + (accm[lane + 2][r][u] + accm[lane + 3][r][u]);
                res -= m;
                double ref = 0.0, mag = 0.0;
                for (int k = 0; k < K; k++) {
                    ref += (double)wd[k] * (double)x[u * K + k];
                    mag += fabs((double)wd[k] * (double)x[u * K + k]);
                }
                const double rel = fabs((double)res - ref) / (mag > 0 ? mag : 1.0);
                if (!(rel <= worst)) worst = rel;     /* NaN stays */
            }
        }
    }
    free(wd); free(w); free(x); free(xf); free(ps); free(sx);
    return worst;
}

static void test_tile(void) {
    for (int ti = 0; ti < 3; ti++) {
        const int type = TYPES[ti];
        for (int nt = 1; nt <= 2; nt++) {
            double worst = 0.0;
            const int shapes[3] = { 1, 8, 16 };
            for (int si = 0; si < 3; si++)
                for (int seed = 0; seed < 6; seed++) {
                    const double e = tile_rel_err(type, nt, shapes[si], seed);
                    if (!(e <= worst)) worst = e;
                }
            char what[160];
            snprintf(what, sizeof what, "%-7s warp tile end to end (%d token%s, K = 256/2048/4096): max |y - ref| / sum|w x| = %.2e (tol 1e-6)",
                     tname(type), nt, nt > 1 ? "s" : "", worst);
            check(worst <= 1e-6, what);
        }
    }
}

int main(void) {
    test_dequant();
    test_frag_map();
    test_afrag();
    test_split();
    test_tile();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
