/* ds4_quant.c -- GGUF super-block quantisations: Q2_K, Q4_K, IQ2_XXS (and Q8_0).
 *
 * What it is.  The dequantisation of the block formats that the published
 * DeepSeek V4 Flash GGUF files store their large matrices in, written as the
 * specification: plain scalar C, one element at a time, with the float
 * operations in exactly the order ggml's to_float uses, so the results equal
 * ggml's bit for bit (tests/oracle/quant_oracle.c checks that with memcmp on
 * hundreds of thousands of blocks).  Also a deterministic generator of random
 * valid blocks, for synthetic models and tests.
 *
 * What it is not.  No quantiser (ds4 never writes these formats from floats),
 * no fast path (no SIMD, no fused dot products with an activation), and no
 * dependence on ds4.c: the f16 decode is its own, so this file stands alone.
 *
 * Why bit-exactness is robust.  Every product in these formulas is exact in
 * binary32: an f16 scale has 11 significant bits, and the integers it meets
 * are small (Q2_K: 4-bit scale times 2-bit quant, Q4_K: 6-bit times 4-bit,
 * IQ2_XXS: (2*ls+1)/2 with 5 bits, a power of two, and a magnitude of at most
 * 6 bits, Q8_0: 8 bits), so no product needs more than 22 of float's 24
 * bits, and no scale is small enough to leave the normal float range.  IQ2_XXS
 * and Q8_0 values are therefore exact; Q2_K and Q4_K round once, in the final
 * subtraction.  Any association of the products and FMA contraction (fma(dl,
 * q, -ml)) give the same bits, which is what lets a GPU kernel match this
 * file exactly.  (The code still follows ggml's order of operations.)  Only
 * -ffast-math-style rewrites that change the mathematical value (say,
 * dl*(q - ml/dl)) would break it.
 *
 * The layouts.  All multi-byte fields are little-endian; "f16" is IEEE
 * binary16.  Every type covers a super-block of 256 elements.
 *
 *   Q2_K, 84 bytes.  16 bytes of scales, then 64 bytes of 2-bit quants, then
 *   f16 d and f16 dmin.  The block is 16 groups of 16 elements; scale byte g
 *   belongs to group g: its low nibble is the group's scale s, its high nibble
 *   the group's min m.  The quants come in two halves of 128 elements, each
 *   half using 32 quant bytes: element 32*j + 16*k + l of half h (j < 4,
 *   k < 2, l < 16) is bits 2j..2j+1 of quant byte 32*h + 16*k + l.  So the
 *   first 32 elements of a half are the lowest bit pairs of its 32 bytes, the
 *   next 32 the next bit pairs, and so on.  Value: (d*s)*q - (dmin*m).
 *
 *   Q4_K, 144 bytes.  f16 d, f16 dmin, 12 bytes of packed 6-bit scales and
 *   mins, then 128 bytes of 4-bit quants.  Eight groups of 32 elements, each
 *   with a 6-bit scale s and a 6-bit min m: bytes 0..3 hold the scales of
 *   groups 0..3 in their low 6 bits, bytes 4..7 the mins of groups 0..3 the
 *   same way; the top two bits of bytes 0..3 are bits 4..5 of the scales of
 *   groups 4..7, those of bytes 4..7 bits 4..5 of their mins; bytes 8..11
 *   give bits 0..3 of the scale (low nibble) and of the min (high nibble) of
 *   groups 4..7.  Quant bytes go in four runs of 32: run c holds group 2c in
 *   its low nibbles and group 2c+1 in its high nibbles.  Value:
 *   (d*s)*q - (dmin*m).
 *
 *   IQ2_XXS, 66 bytes.  f16 d, then eight 8-byte records, one per 32
 *   elements.  A record's first four bytes index a fixed table of 256 "grid"
 *   vectors of 8 magnitudes each from {8, 25, 43}, one vector per 8
 *   elements.  Its last four bytes, read as a 32-bit word w, hold four 7-bit
 *   sign codes (bits 7i..7i+6 for the i-th 8 elements) and a 4-bit scale
 *   ls = w >> 28.  A sign code gives the signs of elements 0..6 (bit set =
 *   negative); element 7's sign makes the number of negatives even.  Value:
 *   ((d*(0.5 + ls))*0.25) * magnitude, negated where the sign says so.
 *
 *   Q8_0 (control type), 34 bytes per 32 elements: f16 d, 32 int8 q.
 *   Value: q*d.
 */
#include "ds4_quant.h"
#include "ds4_quant_tables.h"

#include <string.h>

/* ---------------------------------------------------------------------------
 * Format constants
 * ------------------------------------------------------------------------- */

/* The IQ2_XXS grid: constants of the GGUF/ggml IQ2_XXS format, here in ds4's
 * own encoding.  Entry i is the 8-element magnitude vector selected by index
 * byte i; element j is the 2-bit code at bits 2j..2j+1, and the code maps to
 * a magnitude through iq2_mag (0 -> 8, 1 -> 25, 2 -> 43; code 3 never
 * occurs).  The tests/oracle/quant_oracle.c comparison with ggml over every
 * index value proves the table.  The values live in ds4_quant_tables.h, their
 * one definition, which the CUDA kernels (ds4_cuda_quant.cuh) share. */
static const uint16_t iq2xxs_grid_codes[256] = DS4_IQ2XXS_GRID_CODES_INIT;

static const uint8_t iq2_mag[4] = DS4_IQ2XXS_MAG_INIT;

/* ---------------------------------------------------------------------------
 * Little helpers
 * ------------------------------------------------------------------------- */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* IEEE binary16 -> binary32 (ds4_quant.h). */
float ds4_quant_f16(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* subnormal: man * 2^-24; shift the leading one up to bit 10 */
        uint32_t e = 113;
        while (!(man & 0x400u)) { man <<= 1; e--; }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---------------------------------------------------------------------------
 * Type table
 * ------------------------------------------------------------------------- */

int ds4_quant_is_kquant(int type)
{
    return type == DS4_TYPE_Q2_K || type == DS4_TYPE_Q4_K || type == DS4_TYPE_IQ2_XXS;
}

int64_t ds4_quant_block_elems(int type)
{
    if (ds4_quant_is_kquant(type)) return DS4_QK_K;
    if (type == DS4_QUANT_Q8_0) return DS4_QUANT_Q8_0_BLOCK;
    return 0;
}

size_t ds4_quant_block_bytes(int type)
{
    switch (type) {
    case DS4_TYPE_Q2_K:    return DS4_Q2_K_BLOCK_BYTES;
    case DS4_TYPE_Q4_K:    return DS4_Q4_K_BLOCK_BYTES;
    case DS4_TYPE_IQ2_XXS: return DS4_IQ2_XXS_BLOCK_BYTES;
    case DS4_QUANT_Q8_0:   return DS4_QUANT_Q8_0_BLOCK_BYTES;
    default:               return 0;
    }
}

size_t ds4_quant_row_bytes(int type, int64_t n)
{
    int64_t be = ds4_quant_block_elems(type);
    if (be == 0 || n <= 0 || n % be != 0) return 0;
    return (size_t)(n / be) * ds4_quant_block_bytes(type);
}

const char *ds4_quant_type_name(int type)
{
    switch (type) {
    case DS4_TYPE_Q2_K:    return "Q2_K";
    case DS4_TYPE_Q4_K:    return "Q4_K";
    case DS4_TYPE_IQ2_XXS: return "IQ2_XXS";
    case DS4_QUANT_Q8_0:   return "Q8_0";
    default:               return NULL;
    }
}

/* ---------------------------------------------------------------------------
 * Dequantisation, one block at a time.  Integers become float by plain
 * conversion (exact); each statement's float operations are written in the
 * order ggml evaluates them.
 * ------------------------------------------------------------------------- */

static void dequant_q2_k(const uint8_t *blk, float *y)
{
    const uint8_t *scales = blk;
    const uint8_t *qs = blk + 16;
    const float d = ds4_quant_f16(rd16(blk + 80));
    const float dmin = ds4_quant_f16(rd16(blk + 82));
    for (int g = 0; g < 16; g++) {
        /* group g = 8*half + 2*pair + k: bytes qs[32*half + 16*k ..], bits 2*pair */
        const uint8_t *q = qs + 32 * (g >> 3) + 16 * (g & 1);
        const int shift = 2 * ((g >> 1) & 3);
        const float dl = d * (float)(scales[g] & 0xf);
        const float ml = dmin * (float)(scales[g] >> 4);
        for (int l = 0; l < 16; l++)
            y[16 * g + l] = dl * (float)((q[l] >> shift) & 3) - ml;
    }
}

/* The 6-bit scale and min of group j (0..7) of a Q4_K block. */
static void q4_k_scale_min(const uint8_t *s, int j, int *sc, int *mn)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dequant_q4_k(const uint8_t *blk, float *y)
{
    const float d = ds4_quant_f16(rd16(blk));
    const float dmin = ds4_quant_f16(rd16(blk + 2));
    const uint8_t *s = blk + 4;
    const uint8_t *qs = blk + 16;
    for (int g = 0; g < 8; g++) {
        const uint8_t *q = qs + 32 * (g >> 1);
        const int shift = 4 * (g & 1);
        int sc, mn;
        q4_k_scale_min(s, g, &sc, &mn);
        const float dl = d * (float)sc;
        const float ml = dmin * (float)mn;
        for (int l = 0; l < 32; l++)
            y[32 * g + l] = dl * (float)((q[l] >> shift) & 0xf) - ml;
    }
}

static void dequant_iq2_xxs(const uint8_t *blk, float *y)
{
    const float d = ds4_quant_f16(rd16(blk));
    for (int r = 0; r < 8; r++) {
        const uint8_t *rec = blk + 2 + 8 * r;
        const uint32_t w = rd32(rec + 4);
        const float db = d * (0.5f + (float)(w >> 28)) * 0.25f;
        for (int i = 0; i < 4; i++) {
            const uint32_t code = (w >> (7 * i)) & 127u;
            uint32_t odd = code;           /* parity of the 7 explicit signs */
            odd ^= odd >> 4; odd ^= odd >> 2; odd ^= odd >> 1;
            const uint32_t signs = code | ((odd & 1u) << 7);
            const uint16_t cell = iq2xxs_grid_codes[rec[i]];
            for (int j = 0; j < 8; j++) {
                const float mag = (float)iq2_mag[(cell >> (2 * j)) & 3];
                y[32 * r + 8 * i + j] = db * mag * (((signs >> j) & 1u) ? -1.0f : 1.0f);
            }
        }
    }
}

static void dequant_q8_0(const uint8_t *blk, float *y)
{
    const float d = ds4_quant_f16(rd16(blk));
    for (int j = 0; j < 32; j++)
        y[j] = (float)(int8_t)blk[2 + j] * d;
}

void ds4_quant_dequant(int type, const void *src, float *dst, int64_t n)
{
    const int64_t be = ds4_quant_block_elems(type);
    if (be == 0 || n <= 0 || n % be != 0) return;
    const size_t bb = ds4_quant_block_bytes(type);
    const uint8_t *p = (const uint8_t *)src;
    for (int64_t b = 0; b < n / be; b++, p += bb, dst += be) {
        switch (type) {
        case DS4_TYPE_Q2_K:    dequant_q2_k(p, dst); break;
        case DS4_TYPE_Q4_K:    dequant_q4_k(p, dst); break;
        case DS4_TYPE_IQ2_XXS: dequant_iq2_xxs(p, dst); break;
        default:               dequant_q8_0(p, dst); break;
        }
    }
}

/* ---------------------------------------------------------------------------
 * Random valid blocks
 *
 * For all four types every bit pattern of the non-scale fields is in range:
 * Q2_K's 4-bit scales/mins and 2-bit quants, Q4_K's 6-bit scales/mins and
 * 4-bit quants, IQ2_XXS's 8-bit grid indices (the grid has 256 entries),
 * 7-bit sign codes and 4-bit scales, Q8_0's int8 quants.  So those bytes are
 * uniform random, and "valid" is a property of the f16 scales only: positive,
 * normal (never zero, subnormal, infinite or NaN), with the exponent fixed per
 * type and a random 10-bit mantissa, chosen so that the largest reachable
 * |value| is about 0.1-0.2 and typical values are a few hundredths:
 *   Q2_K     d, dmin in [2^-9, 2^-8)    max |x| ~ 45*d  < 0.18
 *   Q4_K     d, dmin in [2^-14, 2^-13)  max |x| ~ 945*d < 0.12
 *   IQ2_XXS  d in [2^-11, 2^-10)        max |x| ~ 167*d < 0.17
 *   Q8_0     d in [2^-11, 2^-10)        max |x| = 127*d < 0.13
 * ------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill_random(uint64_t *state, uint8_t *p, size_t n)
{
    uint64_t r = 0;
    for (size_t i = 0; i < n; i++) {
        if (i % 8 == 0) r = splitmix64(state);
        p[i] = (uint8_t)(r >> (8 * (i % 8)));
    }
}

/* A positive normal f16 with biased exponent field e (1..30), random mantissa. */
static void put_scale(uint64_t *state, uint8_t *p, unsigned e)
{
    uint16_t h = (uint16_t)((e << 10) | (splitmix64(state) & 0x3ffu));
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

void ds4_quant_random_block(int type, uint64_t *state, uint8_t *out)
{
    const size_t bb = ds4_quant_block_bytes(type);
    if (bb == 0) return;
    fill_random(state, out, bb);
    /* Q2_K and Q4_K compute d*sc*q - dmin*m with unsigned q (mean 1.5 and 7.5):
     * uniformly random m would give every block a mean of its own sign, and a
     * model built from such experts pushes every token the same way (a
     * small-q4 model's argmax was one token on nearly every row).  So dmin = d
     * and m = round(sc * mean q): each sub-block is centred on zero. */
    switch (type) {
    case DS4_TYPE_Q2_K:
        put_scale(state, out + 80, 15 - 9);
        out[82] = out[80];
        out[83] = out[81];
        for (int j = 0; j < 16; j++) {             /* sc 1..10 (4 bits), m = round(1.5 sc) <= 15 */
            const unsigned sc = 1 + (unsigned)(splitmix64(state) % 10), m = (3 * sc + 1) / 2;
            out[j] = (uint8_t)(sc | (m << 4));
        }
        break;
    case DS4_TYPE_Q4_K: {
        put_scale(state, out + 0, 15 - 10);
        out[2] = out[0];
        out[3] = out[1];
        unsigned sc[8], m[8];
        for (int j = 0; j < 8; j++) {              /* sc 1..8, m = round(7.5 sc) <= 60 (6 bits) */
            sc[j] = 1 + (unsigned)(splitmix64(state) % 8);
            m[j] = (15 * sc[j] + 1) / 2;
        }
        uint8_t *q = out + 4;                      /* the 12 packed bytes of 6-bit scales and mins */
        for (int j = 0; j < 4; j++) {
            q[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
            q[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
            q[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
        }
        break;
    }
    case DS4_TYPE_IQ2_XXS:
    case DS4_QUANT_Q8_0:
        put_scale(state, out, 15 - 11);
        break;
    }
}
