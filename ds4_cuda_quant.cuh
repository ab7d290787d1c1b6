/* ds4_cuda_quant.cuh -- the element decoders of the super-block weight types Q2_K, Q4_K, IQ2_XXS.
 *
 * What it is.  The CUDA side of the three block formats the published DeepSeek V4 Flash
 * files store their routed experts in (IQ2_XXS gate/up + Q2_K down, or Q4_K everywhere;
 * ds4_quant.c describes the layouts and is the specification):
 *   - dsq_elem / dsq_block8: element k of a row, and the eight elements 8p..8p+7 of a block,
 *     as floats bit-identical to ds4_quant_dequant (same float operations in the same order,
 *     explicitly rounded on the device so the compiler cannot contract them).  They serve the
 *     generic matvec, the prefill dequantisation (k_dequant_q, or weight_elem per element) and
 *     the host test.  They are __host__ __device__ so tests/test_cuda_quant_host.cu checks them
 *     on the CPU, bit for bit, without a GPU.
 *
 * Including.  The CUDA backend's shared header (ds4_cuda_common.cuh) includes it, so every
 * translation unit can read any weight type element by element (weight_elem); the host test
 * includes it alone.  The decode kernels for these types are ds4_cuda_matvec_q.cuh.
 */
#ifndef DS4_CUDA_QUANT_CUH
#define DS4_CUDA_QUANT_CUH

#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "ds4_gpu.h"
#include "ds4_quant.h"
#include "ds4_quant_tables.h"

/* ---------------------------------------------------------------------------
 * Format constants and number helpers (host and device)
 * ------------------------------------------------------------------------- */

__host__ __device__ __forceinline__ int dsq_is_type(int type) {
    return type == DS4_TYPE_Q2_K || type == DS4_TYPE_Q4_K || type == DS4_TYPE_IQ2_XXS;
}

__host__ __device__ __forceinline__ int dsq_block_bytes(int type) {
    return type == DS4_TYPE_Q2_K ? DS4_Q2_K_BLOCK_BYTES
         : type == DS4_TYPE_Q4_K ? DS4_Q4_K_BLOCK_BYTES
         : type == DS4_TYPE_IQ2_XXS ? DS4_IQ2_XXS_BLOCK_BYTES : 0;
}

/* The IQ2_XXS tables: one definition (ds4_quant_tables.h), one copy per memory space. */
static __constant__ uint16_t dsq_grid_dev[256] = DS4_IQ2XXS_GRID_CODES_INIT;
static __constant__ uint8_t dsq_mag_dev[4] = DS4_IQ2XXS_MAG_INIT;
static const uint16_t dsq_grid_host[256] = DS4_IQ2XXS_GRID_CODES_INIT;
static const uint8_t dsq_mag_host[4] = DS4_IQ2XXS_MAG_INIT;

/* The table's device copy on the device, its host copy on the host. */
#ifdef __CUDA_ARCH__
#define DSQ_TABLE(name) name##_dev
#else
#define DSQ_TABLE(name) name##_host
#endif
__host__ __device__ __forceinline__ uint32_t dsq_grid(int i) { return DSQ_TABLE(dsq_grid)[i]; }
__host__ __device__ __forceinline__ uint32_t dsq_mag(int code) { return DSQ_TABLE(dsq_mag)[code]; }

/* IEEE binary16 -> binary32, exact: the CUDA backend's one f16 converter (F16 weights, Q8_0
 * and super-block scales).  The host path is ds4_quant.c's (NaN payloads kept, quieted); the
 * device uses the conversion instruction.  The two agree on every finite value, and the
 * weights are checked finite when the model loads. */
__host__ __device__ __forceinline__ float dsq_f16(uint32_t h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half((unsigned short)h));
#else
    return ds4_quant_f16((uint16_t)h);
#endif
}

/* Explicitly rounded float operations: on the device nvcc would otherwise contract a*b - c
 * into an FMA.  (Every product of the dequantisation is exact, so contraction would not
 * change a bit -- ds4_quant.c explains why -- but the decoders promise the CPU's operations,
 * so they say them.) */
__host__ __device__ __forceinline__ float dsq_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
__host__ __device__ __forceinline__ float dsq_add(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
__host__ __device__ __forceinline__ float dsq_sub(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

/* Little-endian reads at any alignment (the generic decoders' rows are only 2-aligned). */
__host__ __device__ __forceinline__ uint32_t dsq_rd16(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
}
__host__ __device__ __forceinline__ uint32_t dsq_rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Byte q (0..3) of w. */
__host__ __device__ __forceinline__ uint32_t dsq_byte(uint32_t w, int q) {
#ifdef __CUDA_ARCH__
    return __byte_perm(w, 0u, 0x4440u + (uint32_t)q);
#else
    return (w >> (8 * q)) & 0xffu;
#endif
}

__host__ __device__ __forceinline__ uint32_t dsq_popc(uint32_t v) {
#ifdef __CUDA_ARCH__
    return (uint32_t)__popc(v);
#else
    return (uint32_t)__builtin_popcount(v);
#endif
}

/* The IQ2_XXS sign byte of a 7-bit code: the code's 7 signs and, as bit 7, their parity
 * (the number of negative elements of a group is even). */
__host__ __device__ __forceinline__ uint32_t dsq_iq2_s8(uint32_t code) {
    return code | ((dsq_popc(code) & 1u) << 7);
}

/* Q4_K: the 6-bit scale and min of group j (0..7) from the 12 packed bytes s. */
__host__ __device__ __forceinline__ void dsq_q4k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---------------------------------------------------------------------------
 * Dequantisation, bit-exact with ds4_quant_dequant
 * ------------------------------------------------------------------------- */

/* Elements 8p..8p+7 (p < 32) of one super-block.  Each sits inside one scale group (16 for
 * Q2_K, 32 for Q4_K, an 8-element grid group for IQ2_XXS), so the group's scale is computed
 * once, with the CPU's operations: Q2_K and Q4_K (d*sc)*q - dmin*m, IQ2_XXS
 * ((d*(0.5+ls))*0.25)*mag*(+-1). */
__host__ __device__ __forceinline__ void dsq_block8(int type, const uint8_t *blk, int p, float *out) {
    if (type == DS4_TYPE_Q2_K) {
        const int g = p >> 1;                                  /* group of 16 */
        const uint8_t *q = blk + 16 + 32 * (g >> 3) + 16 * (g & 1) + 8 * (p & 1);
        const int shift = 2 * ((g >> 1) & 3);
        const float d = dsq_f16(dsq_rd16(blk + 80)), dmin = dsq_f16(dsq_rd16(blk + 82));
        const float dl = dsq_mul(d, (float)(blk[g] & 0xf));
        const float ml = dsq_mul(dmin, (float)(blk[g] >> 4));
        for (int l = 0; l < 8; l++) out[l] = dsq_sub(dsq_mul(dl, (float)((q[l] >> shift) & 3)), ml);
    } else if (type == DS4_TYPE_Q4_K) {
        const int g = p >> 2;                                  /* group of 32 */
        const uint8_t *q = blk + 16 + 32 * (g >> 1) + 8 * (p & 3);
        const int shift = 4 * (g & 1);
        int sc, mn;
        dsq_q4k_scale_min(blk + 4, g, &sc, &mn);
        const float d = dsq_f16(dsq_rd16(blk)), dmin = dsq_f16(dsq_rd16(blk + 2));
        const float dl = dsq_mul(d, (float)sc), ml = dsq_mul(dmin, (float)mn);
        for (int l = 0; l < 8; l++) out[l] = dsq_sub(dsq_mul(dl, (float)((q[l] >> shift) & 0xf)), ml);
    } else if (type == DS4_TYPE_IQ2_XXS) {
        const int r = p >> 2, i = p & 3;                       /* record, group in it */
        const uint8_t *rec = blk + 2 + 8 * r;
        const uint32_t w = dsq_rd32(rec + 4);
        const float d = dsq_f16(dsq_rd16(blk));
        const float db = dsq_mul(dsq_mul(d, dsq_add(0.5f, (float)(w >> 28))), 0.25f);
        const uint32_t signs = dsq_iq2_s8((w >> (7 * i)) & 127u);
        const uint32_t cell = dsq_grid(rec[i]);
        for (int j = 0; j < 8; j++) {
            const float mag = (float)dsq_mag((cell >> (2 * j)) & 3);
            out[j] = dsq_mul(dsq_mul(db, mag), ((signs >> j) & 1u) ? -1.0f : 1.0f);
        }
    } else {
        for (int l = 0; l < 8; l++) out[l] = 0.0f;
    }
}

/* Element k of a row (any k < K; rows are 2-byte aligned).  0 for other types. */
__host__ __device__ __forceinline__ float dsq_elem(int type, const uint8_t *row, int64_t k) {
    const int bb = dsq_block_bytes(type);
    if (bb == 0) return 0.0f;
    const uint8_t *blk = row + (size_t)(k >> 8) * bb;
    const int e = (int)(k & 255);
    if (type == DS4_TYPE_Q2_K) {
        const int g = e >> 4, l = e & 15;
        const uint8_t q = blk[16 + 32 * (g >> 3) + 16 * (g & 1) + l];
        const float d = dsq_f16(dsq_rd16(blk + 80)), dmin = dsq_f16(dsq_rd16(blk + 82));
        const float dl = dsq_mul(d, (float)(blk[g] & 0xf)), ml = dsq_mul(dmin, (float)(blk[g] >> 4));
        return dsq_sub(dsq_mul(dl, (float)((q >> (2 * ((g >> 1) & 3))) & 3)), ml);
    }
    if (type == DS4_TYPE_Q4_K) {
        const int g = e >> 5, l = e & 31;
        const uint8_t q = blk[16 + 32 * (g >> 1) + l];
        int sc, mn;
        dsq_q4k_scale_min(blk + 4, g, &sc, &mn);
        const float d = dsq_f16(dsq_rd16(blk)), dmin = dsq_f16(dsq_rd16(blk + 2));
        const float dl = dsq_mul(d, (float)sc), ml = dsq_mul(dmin, (float)mn);
        return dsq_sub(dsq_mul(dl, (float)((q >> (4 * (g & 1))) & 0xf)), ml);
    }
    float v[8];
    dsq_block8(type, blk, e >> 3, v);
    return v[e & 7];
}

/* ---------------------------------------------------------------------------
 * The f16 path's fragment layout (IQ2_XXS; host and device)
 *
 * mma.m16n8k16 (PTX ISA, "matrix fragments for mma.m16n8k16"), lane = 4 g + t:
 *   A (16 x 16, row): reg0 = rows g, k 2t,2t+1; reg1 = row g+8, same k; reg2 = row g,
 *                     k 2t+8,2t+9; reg3 = row g+8, k 2t+8,2t+9 (low half = lower k).
 *   B (16 x 8, col):  reg0 = k 2t,2t+1 of column g; reg1 = k 2t+8,2t+9 of column g.
 *   C/D (16 x 8 f32): c0,c1 = row g, columns 2t,2t+1; c2,c3 = row g+8, same columns.
 * So per MMA a lane supplies 4 weights of row g and the same 4 of row g+8, in slots
 * r = 0..3 (k = 2t, 2t+1, 2t+8, 2t+9).  A super-block takes 16 MMAs (i = 0..15); which
 * element of the SB sits in (i, t, r) is chosen below so a lane decodes whole records, and
 * B is staged to match.
 * ------------------------------------------------------------------------- */

/* Element (0..255 of the SB) in MMA i, lane quarter t, slot r (IQ2_XXS: record t + 4(i/8),
 * group (i/2)%4, half i%2). */
__host__ __device__ __forceinline__ int dsq_frag_elem(int i, int t, int r) {
    return 32 * (t + 4 * (i >> 3)) + 8 * ((i >> 1) & 3) + 4 * (i & 1) + r;
}

/* The inverse: where element e of the SB goes.  Elements 4m .. 4m+3 share one (MMA, lane
 * quarter) and take its slots 0..3 in order (the staging stores a quad at a time). */
__host__ __device__ __forceinline__ void dsq_frag_slot(int e, int *i, int *t, int *r) {
    const int rec = e >> 5;
    *t = rec & 3;
    *i = 8 * (rec >> 2) + 2 * ((e >> 3) & 3) + ((e >> 2) & 1);
    *r = e & 3;
}

/* Staged B fragments: index (in 8-byte units) of MMA i, column slot c (of cs = 3 x tokens),
 * lane quarter t, of SB sb.  A lane of column g reads slot g % cs: the 8 bytes are its two
 * f16x2 B registers (slots r = 0..3 at bytes 2r). */
__host__ __device__ __forceinline__ int dsq_xf_index(int sb, int i, int c, int t, int cs) {
    return ((sb * 16 + i) * cs + c) * 4 + t;
}

/* Which token and part a D column holds (columns >= 3 nt are unused duplicates). */
__host__ __device__ __forceinline__ int dsq_col_token(int col, int nt) {
    const int u = col / 3;
    return u < nt ? u : nt - 1;
}

/* top minus mx's biased exponent, clamped to [-126, 126] (so 2^a and 2^-a are normal floats):
 * the power of two that brings a block whose largest |x| is mx below 2^(top - 126). */
__host__ __device__ __forceinline__ int dsq_scale_exp(float mx, int top) {
    uint32_t bits;
#ifdef __CUDA_ARCH__
    bits = __float_as_uint(mx);
#else
    memcpy(&bits, &mx, 4);
#endif
    const int a = top - (int)((bits >> 23) & 0xffu);
    return a < -126 ? -126 : a > 126 ? 126 : a;
}

/* Scale exponent of a super-block of activations (f16 path): x * 2^a has max |.| < 2^10
 * (mx < 2^(E-126), so x 2^(136-E) < 2^10).  mx = max |x| of the block. */
__host__ __device__ __forceinline__ int dsq_sb_exp(float mx) { return dsq_scale_exp(mx, 136); }

__host__ __device__ __forceinline__ float dsq_pow2(int n) {   /* n in [-126, 127] */
    const uint32_t bits = (uint32_t)(127 + n) << 23;
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* xs = hi + mid + lo, each an f16 (returned as bits); |xs| < 2^10.  hi rounds xs to 11 bits;
 * xs - hi is exact in f32 and has <= 13 bits; mid rounds it to 11 bits (or, below 2^-14, to
 * the f16 subnormal grid of 2^-24); the remainder is exact in f32 and lo rounds it to f16.
 * Where |xs| >= 1/2 every bit of xs sits on or above 2^-24, so the sum is exact; below, the
 * error is at most 2^-25 absolute, 2^-34 of the SB's largest |xs| (>= 2^9). */
__host__ __device__ __forceinline__ void dsq_split3(float xs, uint32_t *hi, uint32_t *mid, uint32_t *lo) {
    const __half h = __float2half_rn(xs);
    const float r1 = dsq_sub(xs, __half2float(h));
    const __half m = __float2half_rn(r1);
    const float r2 = dsq_sub(r1, __half2float(m));
    const __half l = __float2half_rn(r2);
    *hi = __half_as_ushort(h);
    *mid = __half_as_ushort(m);
    *lo = __half_as_ushort(l);
}

/* f16x2 arithmetic on packed bits.  Device: the instructions.  Host (tests only): each half
 * in double, rounded once to f16 -- equal to the device wherever the exact result is
 * representable, which is the only way the decoders below use them (and what the host
 * test checks). */
__host__ __device__ __forceinline__ uint32_t dsq_h2fma(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#else
    uint32_t d = 0;
    for (int s = 0; s < 32; s += 16) {
        const double v = (double)dsq_f16((a >> s) & 0xffffu) * (double)dsq_f16((b >> s) & 0xffffu)
                       + (double)dsq_f16((c >> s) & 0xffffu);
        d |= (uint32_t)__half_as_ushort(__float2half_rn((float)v)) << s;
    }
    return d;
#endif
}
__host__ __device__ __forceinline__ uint32_t dsq_h2mul(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
#else
    return dsq_h2fma(a, b, 0x80008000u);   /* + (-0) keeps a product's sign */
#endif
}

/* f16 constants as pairs */
#define DSQ_H2_ONE      0x3c003c00u   /* 1 */
#define DSQ_H2_M1024    0xe400e400u   /* -1024 */
#define DSQ_H2_1024OR   0x64006400u   /* the bits of 1024 in both halves */

/* (v, v) as an f16 pair, exact for an integer 0 <= v < 1024: the bits 1024 + v in each half
 * (v below the implicit bit lands in the mantissa), minus 1024. */
__host__ __device__ __forceinline__ uint32_t dsq_h2_int(uint32_t v) {
    return dsq_h2fma(v * 0x10001u + DSQ_H2_1024OR, DSQ_H2_ONE, DSQ_H2_M1024);
}

/* Aligned 32-bit load, and one at a 2-byte-aligned address (two aligned words and a funnel
 * shift).  On the device these read shared memory. */
__host__ __device__ __forceinline__ uint32_t dsq_ld32(const uint8_t *p) {
#ifdef __CUDA_ARCH__
    return *(const uint32_t *)p;
#else
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#endif
}
__host__ __device__ __forceinline__ uint32_t dsq_fsr(uint32_t lo, uint32_t hi, uint32_t sh) {
#ifdef __CUDA_ARCH__
    return __funnelshift_r(lo, hi, sh);
#else
    return sh ? (lo >> sh) | (hi << (32 - sh)) : lo;
#endif
}

/* ---- IQ2_XXS A fragments ------------------------------------------------------------- */

/* Grid entry idx as four f16 pairs (magnitudes of elements 2p, 2p+1 in pair p). */
__host__ __device__ __forceinline__ uint4 dsq_iq2_grid_entry(int idx) {
    const uint32_t cell = dsq_grid(idx);
    uint32_t hm[4];                                         /* exact: 8, 25, 43, (0) */
    for (int c = 0; c < 4; c++) hm[c] = __half_as_ushort(__float2half_rn((float)dsq_mag(c)));
    uint32_t w[4];
    for (int p = 0; p < 4; p++) {
        uint32_t h[2];
        for (int k = 0; k < 2; k++) {
            const uint32_t c = (cell >> (4 * p + 2 * k)) & 3;
            h[k] = c == 0 ? hm[0] : c == 1 ? hm[1] : c == 2 ? hm[2] : hm[3];
        }
        w[p] = h[0] | (h[1] << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Record R (0..7) of the SB at blk (blk 2-byte aligned): the index word (grid bytes of the
 * record's 4 groups) and the sign/scale word.  odd = (blk + 2) mod 4, the same for every
 * record of the SB (0 or 2; the caller knows it without converting a shared-memory address).
 * A record 2 bytes past a word boundary takes three aligned words; an aligned one two (its
 * third load repeats the second, so no load reaches past the record's last word: the staged
 * rows end right after it). */
__host__ __device__ __forceinline__ void dsq_iq2_rec(const uint8_t *blk, int R, uint32_t odd, uint32_t *iw,
                                                     uint32_t *w) {
    const uint8_t *b = blk + 2 + 8 * R - odd;
    const uint32_t w0 = dsq_ld32(b), w1 = dsq_ld32(b + 4), w2 = dsq_ld32(b + 4 + 2 * odd);
    *iw = dsq_fsr(w0, w1, 8u * odd);
    *w = dsq_fsr(w1, w2, 8u * odd);
}

/* The record's scale 2 ls + 1 (odd, <= 31) as an f16 pair; (w >> 27) | 1 = 2 ls + 1. */
__host__ __device__ __forceinline__ uint32_t dsq_iq2_L(uint32_t w) {
    return dsq_h2_int((w >> 27) | 1u);
}

/* Group q (0..3) of a record: X[p] = (2ls+1) * (+-mag of elements 2p, 2p+1), exact f16.
 * grid: the (replicated) expanded table, entry idx at byte grid + idx * stride (16-aligned);
 * s8tab: sign bytes.
 * The signs of elements 2p and 2p+1 are bits 2p, 2p+1 of s8; s8 * (2^(15-2p) + 2^(30-2p))
 * puts them on bits 15 and 31 (the two copies of s8 cannot overlap or carry into each
 * other: one spans bits 15-2p..22-2p, the other starts at 30-2p), the mask keeps those two,
 * and the xor flips the f16 signs. */
__host__ __device__ __forceinline__ void dsq_iq2_group(const uint8_t *grid, uint32_t stride, const uint8_t *s8tab,
                                                       uint32_t iw, uint32_t w, int q, uint32_t L,
                                                       uint32_t X[4]) {
    const uint32_t s8 = s8tab[(w >> (7 * q)) & 127u];
#ifdef __CUDA_ARCH__
    const uint4 G = *(const uint4 *)(grid + dsq_byte(iw, q) * stride);
#else
    uint4 G;
    memcpy(&G, grid + dsq_byte(iw, q) * stride, sizeof G);
#endif
    X[0] = dsq_h2mul(G.x ^ ((s8 * 0x40008000u) & 0x80008000u), L);
    X[1] = dsq_h2mul(G.y ^ ((s8 * 0x10002000u) & 0x80008000u), L);
    X[2] = dsq_h2mul(G.z ^ ((s8 * 0x04000800u) & 0x80008000u), L);
    X[3] = dsq_h2mul(G.w ^ ((s8 * 0x01000200u) & 0x80008000u), L);
}

/* ---- the integer path (Q2_K, Q4_K) ---------------------------------------------------
 *
 * mma.m16n8k32 with u8 A (weights) and s8 B (activation digits), s32 accumulation (PTX ISA,
 * "matrix fragments for mma.m16n8k32"), lane = 4 g + t:
 *   A (16 x 32): reg0 = row g, k 4t..4t+3; reg1 = row g+8, same k; reg2 = row g, k 16+4t..16+4t+3;
 *                reg3 = row g+8, k 16+4t..   (byte b of a register = the lower k first)
 *   B (32 x 8):  reg0 = k 4t..4t+3 of column g; reg1 = k 16+4t..16+4t+3 of column g.
 *   C/D (s32):   c0,c1 = row g, columns 2t,2t+1; c2,c3 = row g+8, same columns.
 * MMA j (0..7) of a super-block takes its elements 32j..32j+31 (a Q4_K sub-block; two Q2_K
 * groups of 16), and k slot 4t+b holds element 32j+8t+b, slot 16+4t+b element 32j+8t+4+b: a
 * lane's eight elements of a row are contiguous, and so are the eight activations of its B.
 * Column c = 4u + p of B is digit p of token u (dsq_digits4); columns past the tokens are 0. */

/* Element (0..255 of the SB) in MMA j, lane quarter t, register r (0..3), byte b. */
__host__ __device__ __forceinline__ int dsq_i8_elem(int j, int t, int r, int b) {
    return 32 * j + 8 * t + 4 * (r >> 1) + b;
}

/* Scale exponent of a super-block of activations for the digits: 32 <= max |x 2^a| < 64
 * (mx in [2^(E-127), 2^(E-126)), so mx 2^(132-E) in [32, 64); clamped: an all-zero block, or
 * one of subnormals, gets small digits). */
__host__ __device__ __forceinline__ int dsq_i8_exp(float mx) { return dsq_scale_exp(mx, 132); }

/* |xs| < 64 as four signed digits: xs = q0 + q1 2^-7 + q2 2^-14 + q3 2^-21 + r, |r| <= 2^-22,
 * every q in [-64, 64].  Each step is exact: q = rint(r) (round half even), r - q is exact
 * (|r - q| <= 1/2 and both are multiples of r's last place), and scaling by 2^7 is exact.
 * So the digits carry xs to 2^-22 absolute, 2^-27 of the SB's largest |xs| (>= 32): below
 * f32 rounding of any dot product they enter.  Returned packed: byte p of the word = q_p. */
__host__ __device__ __forceinline__ uint32_t dsq_digits4(float xs) {
    uint32_t w = 0;
    float r = xs;
#pragma unroll
    for (int p = 0; p < 4; p++) {
#ifdef __CUDA_ARCH__
        const int q = __float2int_rn(r);
#else
        const int q = (int)rintf(r);
#endif
        w |= ((uint32_t)q & 0xffu) << (8 * p);
        r = dsq_mul(dsq_sub(r, (float)q), 128.0f);
    }
    return w;
}

/* Q2_K: the bytes of the lane's 8 groups (j = 0..7: group 2j + t/2: scale | min << 4) are
 * byte 2(j%2) + t/2 of word j/2 of the 16 scale bytes; its 8 weights of MMA j in a row are
 * qs bytes 32(j/4) + 8t .. +7 at bit pair j%4.  A register = ((W >> 2(j%4)) & 0x03030303) sc:
 * each byte sc q <= 45, no carry between bytes. */
__host__ __device__ __forceinline__ uint32_t dsq_q2k_i8_scbyte(const uint32_t S[4], int j, int t) {
    return dsq_byte(S[j >> 1], 2 * (j & 1) + (t >> 1));
}
__host__ __device__ __forceinline__ uint32_t dsq_q2k_i8_a(uint32_t W, int j, uint32_t sc) {
    return ((W >> (2 * (j & 3))) & 0x03030303u) * sc;
}

/* Q4_K: the 8 sub-blocks' 6-bit scales and mins, one byte each: SC[0] = scales 0..3, SC[1] =
 * scales 4..7, M[0], M[1] the mins (ds4_quant.c's packing of the 12 bytes y, z, w). */
__host__ __device__ __forceinline__ void dsq_q4k_i8_scales(uint32_t y, uint32_t z, uint32_t w, uint32_t SC[2],
                                                           uint32_t M[2]) {
    SC[0] = y & 0x3f3f3f3fu;
    M[0] = z & 0x3f3f3f3fu;
    SC[1] = (w & 0x0f0f0f0fu) | ((y >> 2) & 0x30303030u);
    M[1] = ((w >> 4) & 0x0f0f0f0fu) | ((z >> 2) & 0x30303030u);
}
/* Its 8 weights of MMA j in a row are qs bytes 32(j/2) + 8t .. +7, low nibbles for even j,
 * high for odd: the register keeps them in place (A = q or 16 q, both < 256), and the
 * sub-block's scale is taken x 16 for even j (dsq_q4k_i8_sc), so every product is 16 sc q. */
__host__ __device__ __forceinline__ uint32_t dsq_q4k_i8_a(uint32_t W, int j) {
    return W & ((j & 1) ? 0xf0f0f0f0u : 0x0f0f0f0fu);
}
__host__ __device__ __forceinline__ uint32_t dsq_q4k_i8_sc(const uint32_t SC[2], int j) {
    return dsq_byte(SC[j >> 2], j & 3) << ((j & 1) ? 0 : 4);
}

#endif /* DS4_CUDA_QUANT_CUH */
