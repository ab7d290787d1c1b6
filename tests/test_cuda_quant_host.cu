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
 *   2. The MMA fragment maps are permutations of the 256 elements of a super-block: the f16
 *      path's (IQ2_XXS: dsq_frag_elem, dsq_frag_slot its inverse, quads in slot order) and the
 *      integer path's (Q2_K, Q4_K: dsq_i8_elem, a lane's 8 elements contiguous).
 *   3. The A fragments the matvec decodes hold exact values: IQ2_XXS (dsq_iq2_*) exact f16
 *      integers whose value times d/8 is ds4_quant_dequant's; Q2_K and Q4_K (dsq_q2k_i8_*,
 *      dsq_q4k_i8_*) bytes whose d x (byte x s32 scale) [/16] - dmin x min equals
 *      ds4_quant_dequant bit for bit.  The block sits at every offset the staged rows can
 *      have (IQ2_XXS: any even offset mod 16, Q2_K: any multiple of 4, Q4_K: 0).  Also
 *      dsq_h2_int for 0..1023.
 *   4. The activations: the f16 split (2^9 <= max |x 2^a| < 2^10; hi + mid + lo == x 2^a
 *      exactly where |x 2^a| >= 1/2, within 2^-25 below) and the integer path's digits
 *      (32 <= max |x 2^a| < 64, digits in [-64, 64], x 2^a within 2^-22 of their sum).
 *   5. A warp tile, end to end: the kernel's staging of B, the A decode of two rows per lane,
 *      the MMAs emulated from their PTX fragment layouts (m16n8k16 in double; m16n8k32 u8 x
 *      s8 in exact integers, checked to stay inside s32), the per-SB scales, the min terms
 *      and the column combinations, for 1 and 2 tokens, against a double dot product of
 *      dequantised weights.  Tolerance: |y - ref| <= 1e-6 sum|w x| per row.  What remains
 *      after exact products is f32 rounding: the per-SB accumulation (~n_sb ulps), the column
 *      combination and the min subtraction (a few ulps of sum|w x|) -- ~1e-7; 1e-6 leaves a
 *      decade while any layout error gives an O(1) relative error.  (The device's tensor-core
 *      f32 accumulation of the f16 path is not emulated: that is test_backend_ops' part, on a
 *      GPU; the integer path's s32 sums are exact.)
 *
 * Build and run (no GPU needed):
 *   mkdir -p build && nvcc -std=c++17 -O2 -I. tests/test_cuda_quant_host.cu ds4_quant.c \
 *       -o build/test_cuda_quant_host && ./build/test_cuda_quant_host
 * The last line is "N passed, M failed"; the exit status is non-zero on any failure.
 */
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

/* ---- 2. the fragment maps -------------------------------------------------------------- */

static void test_frag_map(void) {
    {   /* f16 path (IQ2_XXS): a permutation, dsq_frag_slot its inverse, quads in slot order */
        int seen[256] = { 0 }, ok = 1;
        for (int i = 0; i < 16; i++)
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 4; r++) {
                    const int e = dsq_frag_elem(i, t, r);
                    if (e < 0 || e > 255) { ok = 0; continue; }
                    seen[e]++;
                    int i2, t2, r2;
                    dsq_frag_slot(e, &i2, &t2, &r2);
                    if (i2 != i || t2 != t || r2 != r || (e & 3) != r) ok = 0;
                }
        for (int e = 0; e < 256; e++) if (seen[e] != 1) ok = 0;
        check(ok, "IQ2_XXS fragment map is a permutation of the super-block, dsq_frag_slot its inverse, quads in slot order");
    }
    {   /* integer path (Q2_K, Q4_K): per row, (MMA j, quarter t, k-half h, byte b) covers the SB
         * once, and a lane's 8 elements of MMA j are contiguous (its B is x[32j+8t .. +7]) */
        int seen[256] = { 0 }, ok = 1;
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 4; r += 2)
                    for (int b = 0; b < 4; b++) {
                        const int e = dsq_i8_elem(j, t, r, b);
                        if (e < 0 || e > 255 || e != 32 * j + 8 * t + 4 * (r >> 1) + b) { ok = 0; continue; }
                        seen[e]++;
                        if (dsq_i8_elem(j, t, r + 1, b) != e) ok = 0;   /* row g+8: the same k */
                    }
        for (int e = 0; e < 256; e++) if (seen[e] != 1) ok = 0;
        check(ok, "Q2_K/Q4_K integer fragment map is a permutation of the super-block, lanes' elements contiguous");
    }
}

/* ---- 3. the A fragments: exact integers ------------------------------------------------ */

static uint4 g_grid[256];          /* one copy, entry stride 16 bytes */
static uint8_t g_s8[128];

static float f16v(uint32_t h) { return dsq_f16(h & 0xffffu); }

/* A values of one row (the IQ2_XXS block at blk) for lane quarter t: a[i][r]; d. */
static void decode_row(const uint8_t *blk, int t, float a[16][4], float *d) {
    uint32_t X[16][2];   /* [MMA][reg: slots (0,1), (2,3)] */
    *d = dsq_f16(dsq_rd16(blk));
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
    for (int i = 0; i < 16; i++)
        for (int r = 0; r < 4; r++) a[i][r] = f16v(X[i][r >> 1] >> (16 * (r & 1)));
}

static long check_afrag_iq2(const uint8_t *blk0) {
    float ref[256];
    ds4_quant_dequant(DS4_TYPE_IQ2_XXS, blk0, ref, 256);
    long bad = 0;
    for (int off = 0; off < 16; off += 2) {        /* every even offset mod 16 a staged row can have */
        alignas(16) uint8_t buf[192];
        memset(buf, 0xa5, sizeof buf);
        memcpy(buf + off, blk0, 66);
        for (int t = 0; t < 4; t++) {
            float a[16][4], d;
            decode_row(buf + off, t, a, &d);
            for (int i = 0; i < 16; i++)
                for (int r = 0; r < 4; r++) {
                    const float v = (d * a[i][r]) * 0.125f;      /* d (2 ls + 1) / 8 x (+-mag) */
                    if (a[i][r] != floorf(a[i][r]) || memcmp(&v, &ref[dsq_frag_elem(i, t, r)], 4) != 0) bad++;
                }
        }
    }
    return bad;
}

/* The integer path's decode of one row for lane quarter t, as mvq_sb_i8 reads the staged row
 * p: for MMA j, k-half h, byte b, the A byte, the integer scale it is multiplied by in s32
 * (Q4_K: dsq_q4k_i8_sc; Q2_K: 1, its scale is in A) and the min byte of its B column. */
static void decode_row_i8(int type, const uint8_t *p, int t, int A[8][2][4], int SCm[8], int MN[8][2][4],
                          float *d, float *dmin) {
    if (type == DS4_TYPE_Q2_K) {
        uint32_t S[4];
        for (int i = 0; i < 4; i++) S[i] = dsq_ld32(p + 4 * i);
        const uint32_t dd = dsq_ld32(p + 80);
        *d = dsq_f16(dd & 0xffffu);
        *dmin = dsq_f16(dd >> 16);
        for (int hq = 0; hq < 2; hq++) {
            const uint32_t W[2] = { dsq_ld32(p + 16 + 32 * hq + 8 * t), dsq_ld32(p + 20 + 32 * hq + 8 * t) };
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * hq + jj;
                const uint32_t sb = dsq_q2k_i8_scbyte(S, j, t);
                SCm[j] = 1;
                for (int h = 0; h < 2; h++) {
                    const uint32_t a = dsq_q2k_i8_a(W[h], j, sb & 15u), m = (sb >> 4) * 0x01010101u;
                    for (int b = 0; b < 4; b++) { A[j][h][b] = (int)dsq_byte(a, b); MN[j][h][b] = (int)dsq_byte(m, b); }
                }
            }
        }
    } else {
        const uint32_t h0 = dsq_ld32(p), y = dsq_ld32(p + 4), z = dsq_ld32(p + 8), w = dsq_ld32(p + 12);
        uint32_t SC[2], M[2];
        dsq_q4k_i8_scales(y, z, w, SC, M);
        *d = dsq_f16(h0 & 0xffffu);
        *dmin = dsq_f16(h0 >> 16);
        for (int jp = 0; jp < 4; jp++) {
            const uint32_t W[2] = { dsq_ld32(p + 16 + 32 * jp + 8 * t), dsq_ld32(p + 20 + 32 * jp + 8 * t) };
            for (int e = 0; e < 2; e++) {
                const int j = 2 * jp + e;
                SCm[j] = (int)dsq_q4k_i8_sc(SC, j);
                const uint32_t m = dsq_byte(M[j >> 2], j & 3) * 0x01010101u;
                for (int h = 0; h < 2; h++) {
                    const uint32_t a = dsq_q4k_i8_a(W[h], j);
                    for (int b = 0; b < 4; b++) { A[j][h][b] = (int)dsq_byte(a, b); MN[j][h][b] = (int)dsq_byte(m, b); }
                }
            }
        }
    }
}

/* Every element, from its A byte, s32 scale and min: d (A sc) / f - dmin m equals
 * ds4_quant_dequant bit for bit (f = 16 for Q4_K, whose A sc is 16 sc q; 1 for Q2_K).  d A sc
 * is exact (an f16 times an integer below 2^14, or 16 times one), as is dmin m, so the one
 * rounding is the subtraction, as in the CPU's (d sc) q - dmin m. */
static long check_afrag_i8(int type, const uint8_t *blk0) {
    const int bb = dsq_block_bytes(type);
    float ref[256];
    ds4_quant_dequant(type, blk0, ref, 256);
    long bad = 0;
    for (int off = 0; off < 16; off += type == DS4_TYPE_Q2_K ? 4 : 16) {
        alignas(16) uint8_t buf[192];
        memset(buf, 0xa5, sizeof buf);
        memcpy(buf + off, blk0, (size_t)bb);
        for (int t = 0; t < 4; t++) {
            int A[8][2][4], SCm[8], MN[8][2][4];
            float d, dmin;
            decode_row_i8(type, buf + off, t, A, SCm, MN, &d, &dmin);
            for (int j = 0; j < 8; j++)
                for (int h = 0; h < 2; h++)
                    for (int b = 0; b < 4; b++) {
                        const float f = type == DS4_TYPE_Q4_K ? 0.0625f : 1.0f;
                        const float v = dsq_sub(dsq_mul(dsq_mul(d, (float)(A[j][h][b] * SCm[j])), f),
                                                dsq_mul(dmin, (float)MN[j][h][b]));
                        if (A[j][h][b] < 0 || A[j][h][b] > 255 || memcmp(&v, &ref[dsq_i8_elem(j, t, 2 * h, b)], 4) != 0)
                            bad++;
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
            bad += type == DS4_TYPE_IQ2_XXS ? check_afrag_iq2(blk) : check_afrag_i8(type, blk);
            n++;
        }
        /* random bytes (every scale / min / quant / index / sign / ls) with finite edge scales */
        static const uint16_t fin[] = { 0x0000, 0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0xfbff, 0x8001 };
        for (int k = 0; k < 4000; k++) {
            for (int j = 0; j < bb; j++) blk[j] = (uint8_t)rnd();
            if (k % 7 == 0) memset(blk, 0xff, (size_t)bb);
            put16(blk + od, fin[k % 8]);
            if (om >= 0) put16(blk + om, fin[(k / 8) % 8]);
            bad += type == DS4_TYPE_IQ2_XXS ? check_afrag_iq2(blk) : check_afrag_i8(type, blk);
            n++;
        }
        if (type == DS4_TYPE_IQ2_XXS) {      /* every grid index in every position */
            for (int idx = 0; idx < 256; idx++) {
                ds4_quant_random_block(type, &st, blk);
                for (int r = 0; r < 8; r++)
                    for (int i = 0; i < 4; i++) blk[2 + 8 * r + i] = (uint8_t)(idx + 53 * (4 * r + i));
                bad += check_afrag_iq2(blk);
                n++;
            }
        }
        char what[200];
        snprintf(what, sizeof what, "%-7s A fragments: %s, value == ds4_quant_dequant bit for bit, every staging offset: %ld blocks, %ld mismatches",
                 tname(type), type == DS4_TYPE_IQ2_XXS ? "exact f16 integers" : "bytes x s32 scales", n, bad);
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

/* The digits (integer path): 32 <= max|x 2^a| < 64 (unless clamped), every digit in
 * [-64, 64], and |x 2^a - sum_p q_p 2^-7p| <= 2^-22. */
static void test_digits(void) {
    long bad = 0, n = 0, rng_bad = 0;
    float x[256];
    for (int blk = 0; blk < 20000; blk++) {
        const int e0 = (int)(rnd() % 240) - 120;
        for (int k = 0; k < 256; k++) {
            const int e = e0 - (int)(rnd() % 40);
            x[k] = (float)ldexp(rnd_unit() * 2.0 - 1.0, e);
            if (blk % 11 == 0 && k % 3 == 0) x[k] = 0.0f;
            if (blk % 13 == 0 && k % 5 == 0) x[k] = (float)ldexp((double)(rnd() % 129) - 64.0, e0 - 7) * 0.5;  /* ties */
        }
        float mx = 0.0f;
        for (int k = 0; k < 256; k++) mx = fmaxf(mx, fabsf(x[k]));
        const int a = dsq_i8_exp(mx);
        const float sc = dsq_pow2(a);
        if (mx > 0.0f && a < 126 && !(mx * sc >= 32.0f && mx * sc < 64.0f)) rng_bad++;
        for (int k = 0; k < 256; k++) {
            const float xs = x[k] * sc;
            const uint32_t w = dsq_digits4(xs);
            double sum = 0.0;
            for (int p = 0; p < 4; p++) {
                const int q = (int)(int8_t)dsq_byte(w, p);
                if (q < -64 || q > 64) rng_bad++;
                sum += ldexp((double)q, -7 * p);
            }
            if (fabs(sum - (double)xs) > 0x1p-22) bad++;
            n++;
        }
    }
    char what[160];
    snprintf(what, sizeof what, "digits: 32 <= max|x 2^a| < 64, q in [-64, 64], |x 2^a - digits| <= 2^-22 on %ld values (%ld, %ld bad)",
             n, rng_bad, bad);
    check(bad == 0 && rng_bad == 0, what);
}

/* ---- 5. a warp tile end to end ---------------------------------------------------------- */

/* The kernel's staging of one token's SB, f16 path (IQ2_XXS; one lane = 8 elements). */
static void stage_sb(const float *xsb, int sb, int u, int cs, uint16_t *xf, float *ps, int nsb) {
    float mx = 0.0f;
    for (int k = 0; k < 256; k++) mx = fmaxf(mx, fabsf(xsb[k]));
    const int ea = dsq_sb_exp(mx);
    const float sc = dsq_pow2(ea);
    for (int e = 0; e < 256; e++) {
        int fi, ft, fr;
        dsq_frag_slot(e, &fi, &ft, &fr);
        uint32_t hp[3];
        dsq_split3(xsb[e] * sc, &hp[0], &hp[1], &hp[2]);
        for (int pt = 0; pt < 3; pt++) xf[(size_t)dsq_xf_index(sb, fi, 3 * u + pt, ft, cs) * 4 + fr] = (uint16_t)hp[pt];
    }
    ps[u * nsb + sb] = dsq_pow2(-ea) * 0.125f;
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

/* mma.m16n8k32 (u8 x s8 -> s32) from the lanes' fragments (PTX layout), exactly. */
static void mma_i8_emulate(const uint32_t A[32][4], const uint32_t B[32][2], int64_t D[32][4]) {
    int a[16][32], b[32][8];
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int y = 0; y < 4; y++) {
            a[g][4 * t + y] = (int)dsq_byte(A[lane][0], y);
            a[g + 8][4 * t + y] = (int)dsq_byte(A[lane][1], y);
            a[g][16 + 4 * t + y] = (int)dsq_byte(A[lane][2], y);
            a[g + 8][16 + 4 * t + y] = (int)dsq_byte(A[lane][3], y);
            b[4 * t + y][g] = (int)(int8_t)dsq_byte(B[lane][0], y);
            b[16 + 4 * t + y][g] = (int)(int8_t)dsq_byte(B[lane][1], y);
        }
    }
    for (int lane = 0; lane < 32; lane++) {
        const int g = lane >> 2, t = lane & 3;
        for (int c = 0; c < 4; c++) {
            const int row = g + 8 * (c >> 1), col = 2 * t + (c & 1);
            int64_t s = 0;
            for (int k = 0; k < 32; k++) s += (int64_t)a[row][k] * b[k][col];
            D[lane][c] = s;
        }
    }
}

/* Random weights (16 rows) and activations (SBs of different magnitude). */
static void tile_data(int type, int nt, int nsb, int seed, uint8_t *w, float *x) {
    const int bb = dsq_block_bytes(type), K = 256 * nsb;
    uint64_t st = (uint64_t)seed * 1000003u + (uint64_t)type;
    for (int b = 0; b < 16 * nsb; b++) ds4_quant_random_block(type, &st, w + (size_t)b * bb);
    for (int u = 0; u < nt; u++)
        for (int k = 0; k < K; k++) {
            const double sbscale = ldexp(1.0, (int)((k >> 8) * 3 % 11) - 5);
            x[u * K + k] = (float)((rnd_unit() * 2.0 - 1.0) * sbscale);
        }
}

/* max over the 16 rows and nt tokens of |y - ref| / sum|w x|, ref in double. */
static double tile_worst(int type, int nt, int nsb, const uint8_t *w, const float *x, float y[16][2]) {
    const int bb = dsq_block_bytes(type), K = 256 * nsb;
    float *wd = (float *)malloc((size_t)K * sizeof(float));
    double worst = 0.0;
    for (int row = 0; row < 16; row++) {
        ds4_quant_dequant(type, w + (size_t)row * nsb * bb, wd, K);
        for (int u = 0; u < nt; u++) {
            double ref = 0.0, mag = 0.0;
            for (int k = 0; k < K; k++) {
                ref += (double)wd[k] * (double)x[u * K + k];
                mag += fabs((double)wd[k] * (double)x[u * K + k]);
            }
            const double rel = fabs((double)y[row][u] - ref) / (mag > 0 ? mag : 1.0);
            if (!(rel <= worst)) worst = rel;     /* NaN stays */
        }
    }
    free(wd);
    return worst;
}

static double tile_rel_err_iq2(int nt, int nsb, int seed) {
    const int type = DS4_TYPE_IQ2_XXS, bb = 66, K = 256 * nsb, cs = 3 * nt;
    uint8_t *w = (uint8_t *)malloc((size_t)16 * nsb * bb);
    float *x = (float *)malloc((size_t)nt * K * sizeof(float));
    uint16_t *xf = (uint16_t *)calloc((size_t)nsb * 16 * cs * 4 * 4, sizeof(uint16_t));
    float *ps = (float *)calloc((size_t)nt * nsb, sizeof(float));
    tile_data(type, nt, nsb, seed, w, x);
    for (int u = 0; u < nt; u++)
        for (int sb = 0; sb < nsb; sb++) stage_sb(x + u * K + sb * 256, sb, u, cs, xf, ps, nsb);

    /* the warp: lane (g, t) owns rows g, g+8; acc per D register */
    float acc[32][4] = { { 0 } };
    for (int sb = 0; sb < nsb; sb++) {
        uint32_t A[16][32][4], B[16][32][2];
        float dr[32][2];
        for (int lane = 0; lane < 32; lane++) {
            const int g = lane >> 2, t = lane & 3;
            alignas(16) uint8_t rowbuf[2][192];
            uint32_t X[2][16][2];
            for (int r = 0; r < 2; r++) {
                const uint8_t *blk = w + ((size_t)(g + 8 * r) * nsb + sb) * bb;
                const int o0 = (sb * 66) & 15;
                memset(rowbuf[r], 0x5a, 192);
                memcpy(rowbuf[r] + o0, blk, (size_t)bb);
                const uint8_t *p = rowbuf[r] + o0;
                dr[lane][r] = dsq_f16(dsq_rd16(p));
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
            }
            for (int i = 0; i < 16; i++) {
                A[i][lane][0] = X[0][i][0]; A[i][lane][1] = X[1][i][0];
                A[i][lane][2] = X[0][i][1]; A[i][lane][3] = X[1][i][1];
                const uint16_t *bp = xf + (size_t)dsq_xf_index(sb, i, g % cs, t, cs) * 4;
                B[i][lane][0] = bp[0] | ((uint32_t)bp[1] << 16);
                B[i][lane][1] = bp[2] | ((uint32_t)bp[3] << 16);
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
        }
    }
    /* combine as the kernel does */
    float y[16][2];
    for (int lane = 0; lane < 32; lane += 4) {
        const int g = lane >> 2;
        for (int r = 0; r < 2; r++)
            for (int u = 0; u < nt; u++)
                y[g + 8 * r][u] = u == 0 ? (acc[lane][2 * r] + acc[lane][2 * r + 1]) + acc[lane + 1][2 * r]
                                         : (acc[lane + 1][2 * r + 1] + acc[lane + 2][2 * r]) + acc[lane + 2][2 * r + 1];
    }
    const double worst = tile_worst(type, nt, nsb, w, x, y);
    free(w); free(x); free(xf); free(ps);
    return worst;
}

/* The integer path (Q2_K, Q4_K): B staged as the kernel stages it (lane l of SB sb holds
 * x[256 sb + 8 l .. +7]: MMA l/4, quarter l%4; column 4u + p = digit p of token u), A from
 * the decoders, the s32 MMAs emulated exactly, then the kernel's f32 operations. */
static double tile_rel_err_i8(int type, int nt, int nsb, int seed) {
    const int bb = dsq_block_bytes(type), K = 256 * nsb;
    uint8_t *w = (uint8_t *)malloc((size_t)16 * nsb * bb);
    float *x = (float *)malloc((size_t)nt * K * sizeof(float));
    uint32_t (*xq)[8][32][2] = (uint32_t (*)[8][32][2])calloc((size_t)nsb, sizeof *xq);
    float *ps = (float *)calloc((size_t)nt * nsb, sizeof(float));
    tile_data(type, nt, nsb, seed, w, x);
    for (int u = 0; u < nt; u++)
        for (int sb = 0; sb < nsb; sb++) {
            const float *xs = x + u * K + sb * 256;
            float mx = 0.0f;
            for (int k = 0; k < 256; k++) mx = fmaxf(mx, fabsf(xs[k]));
            const int ea = dsq_i8_exp(mx);
            const float sc = dsq_pow2(ea);
            for (int l = 0; l < 32; l++)
                for (int h = 0; h < 2; h++)
                    for (int y = 0; y < 4; y++) {
                        const uint32_t dg = dsq_digits4(xs[8 * l + 4 * h + y] * sc);
                        for (int p = 0; p < 4; p++)
                            xq[sb][l >> 2][4 * (4 * u + p) + (l & 3)][h] |= dsq_byte(dg, p) << (8 * y);
                    }
            ps[u * nsb + sb] = dsq_pow2(-ea);
        }
    float acc[32][4] = { { 0 } };
    for (int sb = 0; sb < nsb; sb++) {
        static uint32_t A[8][32][4], An[8][32][4], B[8][32][2];
        static int SCm[32][2][8];
        float dq[32][2], dmq[32][2];
        for (int lane = 0; lane < 32; lane++) {
            const int g = lane >> 2, t = lane & 3;
            for (int r = 0; r < 2; r++) {
                alignas(16) uint8_t rowbuf[192];
                const int o0 = type == DS4_TYPE_Q2_K ? (sb * 84) & 15 : 0;
                memset(rowbuf, 0x5a, sizeof rowbuf);
                memcpy(rowbuf + o0, w + ((size_t)(g + 8 * r) * nsb + sb) * bb, (size_t)bb);
                int Ab[8][2][4], MN[8][2][4];
                decode_row_i8(type, rowbuf + o0, t, Ab, SCm[lane][r], MN, &dq[lane][r], &dmq[lane][r]);
                for (int j = 0; j < 8; j++)
                    for (int h = 0; h < 2; h++) {
                        uint32_t a = 0, m = 0;
                        for (int y = 0; y < 4; y++) { a |= (uint32_t)Ab[j][h][y] << (8 * y); m |= (uint32_t)MN[j][h][y] << (8 * y); }
                        A[j][lane][r + 2 * h] = a;        /* reg0/1: k-half 0 of rows g/g+8, reg2/3: half 1 */
                        An[j][lane][r + 2 * h] = m;
                    }
            }
            for (int j = 0; j < 8; j++) { B[j][lane][0] = xq[sb][j][lane][0]; B[j][lane][1] = xq[sb][j][lane][1]; }
        }
        int64_t Dm[32][4] = { { 0 } }, Dn[32][4] = { { 0 } };
        for (int j = 0; j < 8; j++) {
            int64_t D[32][4], E[32][4];
            mma_i8_emulate(A[j], B[j], D);
            mma_i8_emulate(An[j], B[j], E);
            for (int lane = 0; lane < 32; lane++)
                for (int c = 0; c < 4; c++) {
                    Dm[lane][c] += D[lane][c] * SCm[lane][c >> 1][j];
                    Dn[lane][c] += E[lane][c];
                }
        }
        for (int lane = 0; lane < 32; lane++) {
            const int t = lane & 3;
            const float pm = ps[(nt == 1 ? 0 : (t >> 1)) * nsb + sb];
            const float pq = type == DS4_TYPE_Q4_K ? pm * 0.0625f : pm;
            for (int c = 0; c < 4; c++) {
                if (Dm[lane][c] != (int32_t)Dm[lane][c] || Dn[lane][c] != (int32_t)Dn[lane][c]) return 1.0;   /* s32 overflow */
                acc[lane][c] = fmaf(dq[lane][c >> 1] * pq, (float)Dm[lane][c],
                                    fmaf(-(dmq[lane][c >> 1] * pm), (float)Dn[lane][c], acc[lane][c]));
            }
        }
    }
    float y[16][2];
    for (int lane = 0; lane < 32; lane += 4) {
        const int g = lane >> 2;
        for (int r = 0; r < 2; r++)
            for (int u = 0; u < nt; u++) {
                const float lo = fmaf(acc[lane + 2 * u][2 * r + 1], 0x1p-7f, acc[lane + 2 * u][2 * r]);
                const float hi = fmaf(acc[lane + 2 * u + 1][2 * r + 1], 0x1p-7f, acc[lane + 2 * u + 1][2 * r]);
                y[g + 8 * r][u] = fmaf(hi, 0x1p-14f, lo);
            }
    }
    const double worst = tile_worst(type, nt, nsb, w, x, y);
    free(w); free(x); free(xq); free(ps);
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
                    const double e = type == DS4_TYPE_IQ2_XXS ? tile_rel_err_iq2(nt, shapes[si], seed)
                                                               : tile_rel_err_i8(type, nt, shapes[si], seed);
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
    test_digits();
    test_tile();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
