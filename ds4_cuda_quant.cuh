/* ds4_cuda_quant.cuh -- CUDA kernels for the super-block weight types Q2_K, Q4_K, IQ2_XXS.
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
 *   - k_matvec_q: the decode matvec for the three types, with exactly the interface and modes
 *     of k_matvec in ds4_cuda.cu (dense with 1..2 tokens, matmul_multi segments, the input
 *     RMSNorm, the ape table; MoE gate|up with SwiGLU; MoE down with per-slot activations).
 *     matvec_q_run is its entry (the counterpart of matvec_run), mvq_launch_t its one launcher.
 *
 * Why tensor cores, in a memory-bound kernel.  Decode streams each expert weight once, so
 * the goal is DRAM bandwidth (>= 2.5 TB/s of ~4.2 on an H200).  At 2.5 TB/s an H200 must
 * consume 9.7e12 IQ2_XXS weights per second (66 bytes per 256), i.e. 37 weights per SM per
 * clock, while an SM issues 4 warp instructions (128 lane operations) per clock: a budget of
 * ~3.4 lane instructions per weight for everything (Q2_K: ~4.4, Q4_K: ~7.5).  An f32 FFMA
 * per weight plus the instruction that turns the packed weight into an f32 register are
 * already 2; IQ2_XXS adds a sign per weight and a grid lookup per 8, and counted carefully
 * an f32 CUDA-core kernel needs ~3.9 lane instructions per IQ2_XXS weight (Q2_K ~3.5): more
 * than the budget, whatever its memory pipeline.  mma.sync (sm_80+) takes the multiply-adds
 * off the issue budget: the weights are decoded into f16 pairs (two weights per 32-bit
 * register, two or three lane instructions per pair) and a warp-wide m16n8k16 MMA does 16
 * rows x 16 weights at once.  Counted on this file's compiled PTX (sm_90, one loop step,
 * and+xor / and+or pairs counted as the one LOP3 they become) it needs ~3.1 (IQ2_XXS
 * gate|up), ~2.9 (Q2_K down) and ~2.1 (Q4_K) lane instructions per weight, so Q2_K and
 * Q4_K have room and IQ2_XXS reaches 2.5 TB/s only at ~90% issue efficiency: its sign and
 * scale (IMAD, LOP3, HMUL2 per pair of weights) are the floor, see dsq_iq2_group.
 *
 * Numerics: exact products, f32 sums.  Each weight is d * (an integer) [- dmin * m] with the
 * integer small enough to be an exact f16: Q2_K sc*q <= 45, Q4_K sc*q <= 945, IQ2_XXS
 * (2*ls+1) * (+-grid magnitude) <= 1333 (< 2048, the f16 integer limit).  Those integers are
 * the MMA's A operand, built with exact f16 arithmetic (fma.rn.f16x2 whose exact result is
 * representable, so no rounding happens).  The activations are the B operand: per super-block
 * of 256 the block scales x by a power of two 2^a so that 2^9 <= max|x 2^a| < 2^10, and splits
 * each scaled value into three f16 parts hi + mid + lo equal to it (24 significant bits in
 * 3 x 11; exact for |x 2^a| >= 1/2, below that within 2^-25, i.e. 2^-34 of the block's largest
 * value, where the parts reach f16's subnormal grid).  So every product in the MMA is exact
 * (11 x 11 bits) and the only rounding is the tensor core's f32 accumulation (one chain of
 * 16 MMAs per super-block; NVIDIA's tensor cores align the addends to the largest and may
 * truncate instead of rounding, an error of the order of f32 rounding -- the one part of
 * this arithmetic the host test cannot emulate, so test_backend_ops' comparison on the GPU
 * is its check), then f32 FFMAs: d * 2^-a * D per super-block, and for
 * Q2_K/Q4_K the min term dmin * sum_g m_g * (sum of x over group g), subtracted in f32.  The
 * weights are the exact values d*sc*q - dmin*m (ds4_quant.c rounds each once to f32), so the
 * result is an f32-accurate dot product in a different order, like every other matvec: the
 * expected error is ~1e-7 of ||y||, inside test_backend_ops' TOL_DOT (1e-5).  Columns of the
 * MMA are free, so the three parts (x two tokens in dense mode) are B's columns 0..5.
 *
 * How a block works (256 threads, 8 warps).  A row of K = 256 n is n super-blocks (SBs).
 * Like k_matvec, the warps split the SBs into S slices (S the largest power of two <= min(8,
 * n); warp w takes SBs w%S, w%S + S, ...) and G = 8/S row groups; a warp walks its tiles of
 * 16 rows (tile gr + G i of the block), and for each tile its SBs.
 *   - The block first puts the first weight tiles in flight (cp.async, a per-warp ring of
 *     stages of 16 rows x 1 SB per matrix), then stages the activations: the B
 *     fragments of every SB in the exact register order of the MMA (one 8-byte LDS per MMA
 *     and lane, conflict-free), the per-SB factor 2^-a, and the group sums for the min term.
 *   - Each lane of a warp owns, in every row of its tile pair (rows g and g+8, g = lane/4),
 *     the same quarter of the SB, chosen so that its scales are few and its bytes adjacent:
 *     IQ2_XXS records t and t+4 (t = lane%4: 2 x 32 weights, 2 scales), Q2_K quant run t
 *     (64 weights of 4 groups), Q4_K quant run t (64 weights of 2 groups).  The MMA's k index
 *     is a free permutation of the SB, so B is staged in whatever order the A decode yields
 *     (dsq_frag_elem / dsq_frag_slot, tested on the host).
 *   - Weights reach shared memory by cp.async in 16-byte chunks (4-byte when rows are not
 *     16-byte aligned): the aligned superset of the SB in each row (its first byte lands at
 *     offset (sb*BB) mod 16), a warp instruction copying 32 contiguous bytes of each of 16
 *     rows, one instruction per chunk; each lane then reads its bytes from shared memory
 *     with aligned 32-bit (Q4_K: 128-bit) loads and funnel shifts.
 *   - IQ2_XXS: the 256-entry grid is expanded once per block to f16 magnitude pairs
 *     (16 bytes per entry) and replicated 8 times so that the 8 lanes of each quarter-warp
 *     phase of a 128-bit load always hit different banks (a random lookup into one copy costs
 *     ~10 wavefronts per warp instead of 4, which alone would cap the kernel near 2 TB/s);
 *     the 128 sign bytes (7 stored signs + parity) are a shared table too.  A group's signs
 *     become the f16 sign bits of four pairs by one multiply each (sign bits 2p, 2p+1 land on
 *     bits 15 and 31, see dsq_iq2_group), the scale (2 ls + 1) by one f16x2 multiply.
 *   - After the last SB of a tile, the three part columns of each row are summed in a fixed
 *     order ((hi + mid) + lo), the min terms of the four lanes of a row added by a butterfly,
 *     and the warp's slice partial goes to shared memory; the block adds the S partials of a
 *     row in slice order, then writes y (dense: plus the ape row; gate|up: silu(g) * u).
 *
 * Determinism.  Fixed reduction shapes only (MMA chains in SB order, f32 accumulation in SB
 * order, butterflies, slice sums in order), no atomics.  A row's arithmetic depends only on
 * K and the type: not on the grid, the tile it shares, or the rows per warp.
 *
 * Grid.  As mv_plan: one wave of blocks (occupancy x SMs), rows per warp grown only when
 * every resident block slot has work.  Two blocks per SM fit (registers <= 128, shared
 * memory <= ~106 KB for the Flash shapes).  Bytes in flight: each warp keeps one (gate|up)
 * or two stages of 16 rows ahead (per SM: IQ2_XXS gate|up 34 KB, Q4_K gate|up 74 KB, Q2_K
 * down 43 KB), above the ~20-25 KB per SM that the H200's latency x bandwidth asks for.
 *
 * Shapes.  The fast kernel takes K = 256 n with rows 4-byte aligned (IQ2_XXS: n even) and
 * row_bytes, matrix stride and base 4-byte aligned, as long as the staged activations
 * (6 bytes per element and token) fit in shared memory (one token: K up to ~24k);
 * mvq_fast_ok says so.  Anything else takes ds4_cuda.cu's generic matvec through dsq_elem.
 *
 * Including.  ds4_cuda.cu includes this file after its k_matvec section (it uses mv_args,
 * MV_*, warp helpers, cp_async*, DS4_LAUNCH, g_cuda).  With DSQ_DECODERS_ONLY defined, only
 * the __host__ __device__ part (up to the kernels) is compiled, which is what the host test
 * includes.
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

__host__ __device__ __forceinline__ uint32_t dsq_grid(int i) {
#ifdef __CUDA_ARCH__
    return dsq_grid_dev[i];
#else
    return dsq_grid_host[i];
#endif
}

__host__ __device__ __forceinline__ uint32_t dsq_mag(int code) {
#ifdef __CUDA_ARCH__
    return dsq_mag_dev[code];
#else
    return dsq_mag_host[code];
#endif
}

/* IEEE binary16 -> binary32, exact.  The host path is ds4_quant.c's (NaN payloads kept,
 * quieted); the device uses the conversion instruction (valid blocks have finite scales,
 * where the two agree). */
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
 * The matvec's fragment layout (host and device)
 *
 * mma.m16n8k16 (PTX ISA, "matrix fragments for mma.m16n8k16"), lane = 4 g + t:
 *   A (16 x 16, row): reg0 = rows g, k 2t,2t+1; reg1 = row g+8, same k; reg2 = row g,
 *                     k 2t+8,2t+9; reg3 = row g+8, k 2t+8,2t+9 (low half = lower k).
 *   B (16 x 8, col):  reg0 = k 2t,2t+1 of column g; reg1 = k 2t+8,2t+9 of column g.
 *   C/D (16 x 8 f32): c0,c1 = row g, columns 2t,2t+1; c2,c3 = row g+8, same columns.
 * So per MMA a lane supplies 4 weights of row g and the same 4 of row g+8, in slots
 * r = 0..3 (k = 2t, 2t+1, 2t+8, 2t+9).  A super-block takes 16 MMAs (i = 0..15); which
 * element of the SB sits in (i, t, r) is the type's choice below, B is staged to match.
 * ------------------------------------------------------------------------- */

/* Element (0..255 of the SB) in MMA i, lane quarter t, slot r. */
__host__ __device__ __forceinline__ int dsq_frag_elem(int type, int i, int t, int r) {
    const int b4 = ((r & 1) << 1) | (r >> 1);      /* slots 0,1,2,3 <- bytes 0,2,1,3 of a word */
    if (type == DS4_TYPE_IQ2_XXS)                  /* record t + 4(i/8), group (i/2)%4, half i%2 */
        return 32 * (t + 4 * (i >> 3)) + 8 * ((i >> 1) & 3) + 4 * (i & 1) + r;
    if (type == DS4_TYPE_Q4_K)                     /* run t: word i/2, nibble i%2 (group 2t + i%2) */
        return 32 * (2 * t + (i & 1)) + 4 * (i >> 1) + b4;
    /* Q2_K: run t = (h, k) = (t/2, t%2): word i/4, bit pair j = i%4 (group 8h + 2j + k) */
    return 128 * (t >> 1) + 32 * (i & 3) + 16 * (t & 1) + 4 * (i >> 2) + b4;
}

/* The inverse: where element e of the SB goes. */
__host__ __device__ __forceinline__ void dsq_frag_slot(int type, int e, int *i, int *t, int *r) {
    if (type == DS4_TYPE_IQ2_XXS) {
        const int rec = e >> 5;
        *t = rec & 3;
        *i = 8 * (rec >> 2) + 2 * ((e >> 3) & 3) + ((e >> 2) & 1);
        *r = e & 3;
    } else if (type == DS4_TYPE_Q4_K) {
        const int g = e >> 5, l = e & 31, b = l & 3;
        *t = g >> 1;
        *i = 2 * (l >> 2) + (g & 1);
        *r = ((b & 1) << 1) | (b >> 1);
    } else {
        const int l = e & 15, b = l & 3;
        *t = 2 * (e >> 7) + ((e >> 4) & 1);
        *i = 4 * (l >> 2) + ((e >> 5) & 3);
        *r = ((b & 1) << 1) | (b >> 1);
    }
}

/* Elements 4m .. 4m+3 of an SB share one (MMA, lane quarter) and take its 4 slots: element
 * 4m + b goes to slot dsq_quad_slot(type, b) (words are read as bytes 0,2 | 1,3). */
__host__ __device__ __forceinline__ int dsq_quad_slot(int type, int b) {
    return type == DS4_TYPE_IQ2_XXS ? b : ((b & 1) << 1) | (b >> 1);
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

/* Scale exponent of a super-block of activations: x * 2^a has max |.| < 2^10 (a in
 * [-126, 126], so 2^a and 2^-a are normal floats).  mx = max |x| of the block. */
__host__ __device__ __forceinline__ int dsq_sb_exp(float mx) {
    uint32_t bits;
#ifdef __CUDA_ARCH__
    bits = __float_as_uint(mx);
#else
    memcpy(&bits, &mx, 4);
#endif
    int a = 136 - (int)((bits >> 23) & 0xffu);     /* mx < 2^(E-126): x 2^(136-E) < 2^10 */
    return a < -126 ? -126 : a > 126 ? 126 : a;
}

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
#define DSQ_H2_SIXTEENTH 0x2c002c00u  /* 1/16 */
#define DSQ_H2_M64      0xd400d400u   /* -64 */

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

/* ---- Q4_K A fragments ---------------------------------------------------------------- */

typedef struct {
    float    d, dmin;
    float    m0, m1;               /* mins of groups 2t, 2t+1 */
    uint32_t S0, N0, S1, N1;       /* f16 pairs: sc0, -1024 sc0; sc1/16, -64 sc1 */
} dsq_q4k_row;

/* Scales of the lane's groups 2t, 2t+1.  Bytes 0..3 of the packed scales are y, 4..7 z,
 * 8..11 w; groups 2t, 2t+1 use byte pair 2(t%2) of each: for t < 2 the 6-bit fields of y
 * (scales) and z (mins); for t >= 2 the nibbles of w plus the top two bits of y and z. */
__host__ __device__ __forceinline__ void dsq_q4k_setup(const uint8_t *blk, int t, dsq_q4k_row *r) {
    const uint32_t h = dsq_ld32(blk), y = dsq_ld32(blk + 4), z = dsq_ld32(blk + 8), w = dsq_ld32(blk + 12);
    const uint32_t sh = 16u * (uint32_t)(t & 1);
    const uint32_t Y = (y >> sh) & 0xffffu, Z = (z >> sh) & 0xffffu, W = (w >> sh) & 0xffffu;
    uint32_t SC, M;
    if (t < 2) {
        SC = Y & 0x3f3fu;
        M = Z & 0x3f3fu;
    } else {
        SC = (W & 0x0f0fu) | ((Y >> 2) & 0x3030u);
        M = ((W >> 4) & 0x0f0fu) | ((Z >> 2) & 0x3030u);
    }
    r->d = dsq_f16(h & 0xffffu);
    r->dmin = dsq_f16(h >> 16);
    r->m0 = (float)(M & 0xffu);
    r->m1 = (float)(M >> 8);
    r->S0 = dsq_h2_int(SC & 0xffu);
    r->N0 = dsq_h2mul(r->S0, DSQ_H2_M1024);
    const uint32_t s1 = dsq_h2_int(SC >> 8);
    r->S1 = dsq_h2mul(s1, DSQ_H2_SIXTEENTH);
    r->N1 = dsq_h2mul(s1, DSQ_H2_M64);
}

/* Word u of the lane's run (bytes 4u..4u+3, two groups in its nibbles): X[0], X[1] are MMA
 * 2u's row registers for slots (0,1) and (2,3) (low nibbles: group 2t, sc*q), X[2], X[3]
 * MMA 2u+1's (high nibbles: group 2t+1).  A nibble field or'ed into 1024's mantissa is
 * 1024 + q (or + 16 q); fma(that, sc, -1024 sc) = q sc exactly (or with sc/16, -64 sc). */
__host__ __device__ __forceinline__ void dsq_q4k_word(uint32_t W, const dsq_q4k_row *r, uint32_t X[4]) {
    const uint32_t W8 = W >> 8;
    X[0] = dsq_h2fma((W & 0x000f000fu) | DSQ_H2_1024OR, r->S0, r->N0);
    X[1] = dsq_h2fma((W8 & 0x000f000fu) | DSQ_H2_1024OR, r->S0, r->N0);
    X[2] = dsq_h2fma((W & 0x00f000f0u) | DSQ_H2_1024OR, r->S1, r->N1);
    X[3] = dsq_h2fma((W8 & 0x00f000f0u) | DSQ_H2_1024OR, r->S1, r->N1);
}

/* ---- Q2_K A fragments ---------------------------------------------------------------- */

typedef struct {
    float    d, dmin;
    float    m[4];                 /* mins of the lane's groups 8h + 2j + k, j = 0..3 */
    uint32_t S[4], N[4];           /* f16 pairs: sc_j 4^-j, -1024 sc_j 4^-j */
} dsq_q2k_row;

/* Scales of the lane's run t = (h, k): groups 8h + 2j + k, whose scale bytes are bytes k and
 * k+2 of the words at 8h and 8h+4. */
__host__ __device__ __forceinline__ void dsq_q2k_setup(const uint8_t *blk, int t, dsq_q2k_row *r) {
    const int h = t >> 1, k = t & 1;
    const uint32_t A = dsq_ld32(blk + 8 * h) >> (8 * k), B = dsq_ld32(blk + 8 * h + 4) >> (8 * k);
    const uint32_t dd = dsq_ld32(blk + 80);
    const uint32_t sb[4] = { A & 0xffu, (A >> 16) & 0xffu, B & 0xffu, (B >> 16) & 0xffu };
    /* 4^-j and -1024 4^-j as f16 pairs */
    const uint32_t P[4] = { 0x3c003c00u, 0x34003400u, 0x2c002c00u, 0x24002400u };
    const uint32_t Q[4] = { 0xe400e400u, 0xdc00dc00u, 0xd400d400u, 0xcc00cc00u };
    r->d = dsq_f16(dd & 0xffffu);
    r->dmin = dsq_f16(dd >> 16);
    for (int j = 0; j < 4; j++) {
        r->m[j] = (float)(sb[j] >> 4);
        r->S[j] = dsq_h2fma((sb[j] & 0xfu) * 0x10001u + DSQ_H2_1024OR, P[j], Q[j]);   /* sc 4^-j */
        r->N[j] = dsq_h2mul(r->S[j], DSQ_H2_M1024);
    }
}

/* Word u of the lane's run: four elements (bytes 4u..4u+3) of each of the four groups
 * (bit pairs j).  X[2j], X[2j+1] are MMA 4u+j's row registers for slots (0,1) = bytes 0,2
 * and (2,3) = bytes 1,3.  The field q at bits 2j of a half's low byte, or'ed into 1024,
 * is 1024 + q 4^j; fma(that, sc 4^-j, -1024 sc 4^-j) = q sc exactly. */
__host__ __device__ __forceinline__ void dsq_q2k_word(uint32_t W, const dsq_q2k_row *r, uint32_t X[8]) {
    const uint32_t W8 = W >> 8;
    for (int j = 0; j < 4; j++) {
        const uint32_t m = 0x00030003u << (2 * j);
        X[2 * j] = dsq_h2fma((W & m) | DSQ_H2_1024OR, r->S[j], r->N[j]);
        X[2 * j + 1] = dsq_h2fma((W8 & m) | DSQ_H2_1024OR, r->S[j], r->N[j]);
    }
}

/* The group (of NG per SB) whose min the lane's j-th min belongs to. */
__host__ __device__ __forceinline__ int dsq_min_group(int type, int t, int j) {
    return type == DS4_TYPE_Q4_K ? 2 * t + j : 8 * (t >> 1) + 2 * j + (t & 1);
}

#ifndef DSQ_DECODERS_ONLY

/* ---------------------------------------------------------------------------
 * The decode matvec (k_matvec_q)
 * ------------------------------------------------------------------------- */

/* Weight-ring depth (stages of 16 rows x 1 SB per matrix per warp, the one being computed
 * included): gate|up stages two matrices, so it keeps one stage ahead (34 KB per SM in flight
 * for IQ2_XXS, 74 KB for Q4_K, at two blocks per SM); the single-matrix modes keep two
 * ahead (Q2_K down: 43 KB).  Both fit two blocks per SM in shared memory.  They, and the
 * launch-bounds floor of resident blocks, can be set at build time to measure them.
 * MVQ_RPG_MAX: tiles of 16 rows per warp per block. */
#ifndef MVQ_ST_GATE_UP
#define MVQ_ST_GATE_UP 2
#endif
#ifndef MVQ_ST_ONE
#define MVQ_ST_ONE 3
#endif
template <int MODE> struct mvq_stages { enum { n = MODE == MV_GATE_UP ? MVQ_ST_GATE_UP : MVQ_ST_ONE }; };
#ifndef MVQ_MIN_BLOCKS
#define MVQ_MIN_BLOCKS 2
#endif
#define MVQ_RPG_MAX 8
#define MVQ_PART (MV_WARPS * MVQ_RPG_MAX * 16)   /* partials per plane: rows x slices */

/* Per type: block bytes, ring row stride (a 16-byte-chunk superset of an SB starting at
 * offset (sb BB) mod 16 always fits), groups with a min per SB, chunks per row when copying
 * in 16- and 4-byte pieces. */
template <int TYPE> struct mvq_traits;
template <> struct mvq_traits<DS4_TYPE_IQ2_XXS> { enum { BB = 66, RS = 80, NG = 0, CH16 = 5, CH4 = 17 }; };
template <> struct mvq_traits<DS4_TYPE_Q2_K>    { enum { BB = 84, RS = 96, NG = 16, CH16 = 6, CH4 = 21 }; };
template <> struct mvq_traits<DS4_TYPE_Q4_K>    { enum { BB = 144, RS = 144, NG = 8, CH16 = 9, CH4 = 36 }; };

/* Dynamic shared memory: (IQ2_XXS) the replicated grid and the sign bytes first, at offsets
 * the compiler knows (so a lookup is one load with an immediate base), then the B fragments
 * [nsb][16][3 NT][4] x 8 bytes, the per-SB factors [NT][nsb], the group sums [NT][nsb][NG],
 * and the weight rings [warp][stage][matrix][16 rows][RS]. */
#define MVQ_GRID_OFF 0
#define MVQ_KS_OFF   (256 * 8 * 16)
typedef struct { size_t xf, ps, sx, grid, ks, ring, total; } mvq_layout;

__host__ __device__ __forceinline__ size_t mvq_al16(size_t n) { return (n + 15) & ~(size_t)15; }

template <int TYPE, int MODE, int NT>
__host__ __device__ __forceinline__ mvq_layout mvq_layout_of(int nsb) {
    typedef mvq_traits<TYPE> T;
    const int nmat = MODE == MV_GATE_UP ? 2 : 1;
    mvq_layout L;
    size_t o = 0;
    L.grid = MVQ_GRID_OFF;
    L.ks = MVQ_KS_OFF;
    if (TYPE == DS4_TYPE_IQ2_XXS) o = MVQ_KS_OFF + 128;
    L.xf = o;   o += (size_t)nsb * 16 * (3 * NT) * 32;
    L.ps = o;   o += mvq_al16((size_t)NT * nsb * 4);
    L.sx = o;   o += mvq_al16((size_t)NT * nsb * T::NG * 4);
    L.ring = o; o += (size_t)MV_WARPS * mvq_stages<MODE>::n * nmat * 16 * T::RS;
    L.total = o;
    return L;
}

__device__ __forceinline__ void mvq_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint2 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
}

__device__ __forceinline__ void mvq_cp_async4(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(s), "l"(gmem) : "memory");
}

/* One SB of a 16-row tile, for each of the NMAT matrices of the step (gate and up share
 * every B fragment, so each is loaded once): D[m] = sum over the SB of A (integers) x B
 * (parts).  r0: row g of matrix 0's staged tile at the SB's first byte (row g+8 is 8 RS
 * later, matrix m 16 RS m later); odd = (r0 + 2) mod 4; xb: this lane's B fragments of the
 * SB (MMA i at xb[i * 4 cs]).  Also each row's d (and, with mins, dmin and the lane's min
 * sums per token: sum over its groups of m x group sum of x). */
template <int TYPE, int NT, int NMAT>
__device__ __forceinline__ void mvq_sb(const uint8_t *r0, uint32_t odd, const uint2 *xb, int t,
                                       const uint8_t *gridl, const uint8_t *s8tab, const float *sxp, int nsb,
                                       float (&D)[NMAT][4], float (&dr)[NMAT][2], float (&dminr)[NMAT][2],
                                       float (&mm)[NMAT][2][NT]) {
    typedef mvq_traits<TYPE> TR;
    constexpr int XS = 4 * 3 * NT;     /* uint2 stride between MMAs */
    constexpr int NR = 2 * NMAT;       /* staged rows this lane reads: [matrix][g, g+8] */
    const uint8_t *rp[NR];
#pragma unroll
    for (int k = 0; k < NR; k++) rp[k] = r0 + (size_t)((k >> 1) * 16 + 8 * (k & 1)) * TR::RS;
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int c = 0; c < 4; c++) D[m][c] = 0.0f;
    if (TYPE == DS4_TYPE_IQ2_XXS) {
#pragma unroll
        for (int k = 0; k < NR; k++) dr[k >> 1][k & 1] = dsq_f16(*(const uint16_t *)rp[k]);
#pragma unroll
        for (int rho = 0; rho < 2; rho++) {
            uint32_t iw[NR], w[NR], L[NR];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                dsq_iq2_rec(rp[k], t + 4 * rho, odd, &iw[k], &w[k]);
                L[k] = dsq_iq2_L(w[k]);
            }
#pragma unroll
            for (int q = 0; q < 4; q++) {
                uint32_t X[NR][4];
#pragma unroll
                for (int k = 0; k < NR; k++) dsq_iq2_group(gridl, 128, s8tab, iw[k], w[k], q, L[k], X[k]);
                const int i = 8 * rho + 2 * q;
                const uint2 b0 = xb[i * XS], b1 = xb[(i + 1) * XS];
#pragma unroll
                for (int m = 0; m < NMAT; m++) {
                    mvq_mma(D[m], X[2 * m][0], X[2 * m + 1][0], X[2 * m][1], X[2 * m + 1][1], b0);
                    mvq_mma(D[m], X[2 * m][2], X[2 * m + 1][2], X[2 * m][3], X[2 * m + 1][3], b1);
                }
            }
        }
    } else if (TYPE == DS4_TYPE_Q4_K) {
        dsq_q4k_row R[NR];
#pragma unroll
        for (int k = 0; k < NR; k++) {
            dsq_q4k_setup(rp[k], t, &R[k]);
            dr[k >> 1][k & 1] = R[k].d;
            dminr[k >> 1][k & 1] = R[k].dmin;
        }
#pragma unroll
        for (int v = 0; v < 2; v++) {
            uint4 qv[NR];
#pragma unroll
            for (int k = 0; k < NR; k++) qv[k] = *(const uint4 *)(rp[k] + 16 + 32 * t + 16 * v);
#pragma unroll
            for (int u = 0; u < 4; u++) {
                uint32_t X[NR][4];
#pragma unroll
                for (int k = 0; k < NR; k++) {
                    const uint32_t W = u == 0 ? qv[k].x : u == 1 ? qv[k].y : u == 2 ? qv[k].z : qv[k].w;
                    dsq_q4k_word(W, &R[k], X[k]);
                }
                const int i = 2 * (4 * v + u);
                const uint2 b0 = xb[i * XS], b1 = xb[(i + 1) * XS];
#pragma unroll
                for (int m = 0; m < NMAT; m++) {
                    mvq_mma(D[m], X[2 * m][0], X[2 * m + 1][0], X[2 * m][1], X[2 * m + 1][1], b0);
                    mvq_mma(D[m], X[2 * m][2], X[2 * m + 1][2], X[2 * m][3], X[2 * m + 1][3], b1);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < NT; u++) {
            const float *sx = sxp + (size_t)u * nsb * 8;
            const float s0 = sx[dsq_min_group(TYPE, t, 0)], s1 = sx[dsq_min_group(TYPE, t, 1)];
#pragma unroll
            for (int k = 0; k < NR; k++) mm[k >> 1][k & 1][u] = fmaf(R[k].m1, s1, R[k].m0 * s0);
        }
    } else {   /* Q2_K */
        dsq_q2k_row R[NR];
#pragma unroll
        for (int k = 0; k < NR; k++) {
            dsq_q2k_setup(rp[k], t, &R[k]);
            dr[k >> 1][k & 1] = R[k].d;
            dminr[k >> 1][k & 1] = R[k].dmin;
        }
#pragma unroll
        for (int u4 = 0; u4 < 4; u4++) {
            uint32_t X[NR][8];
#pragma unroll
            for (int k = 0; k < NR; k++) dsq_q2k_word(dsq_ld32(rp[k] + 16 + 16 * t + 4 * u4), &R[k], X[k]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const uint2 b = xb[(4 * u4 + j) * XS];
#pragma unroll
                for (int m = 0; m < NMAT; m++)
                    mvq_mma(D[m], X[2 * m][2 * j], X[2 * m + 1][2 * j], X[2 * m][2 * j + 1], X[2 * m + 1][2 * j + 1], b);
            }
        }
#pragma unroll
        for (int u = 0; u < NT; u++) {
            const float *sx = sxp + (size_t)u * nsb * 16;
            float s[4];
#pragma unroll
            for (int j = 0; j < 4; j++) s[j] = sx[dsq_min_group(TYPE, t, j)];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                float acc = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++) acc = fmaf(R[k].m[j], s[j], acc);
                mm[k >> 1][k & 1][u] = acc;
            }
        }
    }
}

template <int TYPE, int MODE, int NT>
__global__ void __launch_bounds__(MV_THREADS, MVQ_MIN_BLOCKS) k_matvec_q(const mv_args a) {
    typedef mvq_traits<TYPE> TR;
    constexpr bool DUAL = MODE == MV_GATE_UP;
    constexpr int NMAT = DUAL ? 2 : 1;
    constexpr int NPLANE = DUAL ? 2 : NT;
    constexpr int CS = 3 * NT;
    constexpr bool MINS = TR::NG > 0;
    constexpr int ST = mvq_stages<MODE>::n;
    static_assert(!(MODE != MV_DENSE && NT != 1), "the MoE modes are single-token");
    extern __shared__ __align__(16) uint8_t mvq_smem[];
    __shared__ float part[NPLANE][MVQ_PART];     /* [plane][local row * S + slice] */
    __shared__ double nred[MV_WARPS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int S = a.S, G = MV_WARPS / S;
    const int s = warp % S, gr = warp / S;
    const int nsb = a.K >> 8;
    const mvq_layout L = mvq_layout_of<TYPE, MODE, NT>(nsb);
    uint8_t *xf = mvq_smem + L.xf;
    float *ps = (float *)(mvq_smem + L.ps);
    float *sxs = (float *)(mvq_smem + L.sx);
    uint4 *grid = (uint4 *)(mvq_smem + MVQ_GRID_OFF);
    uint8_t *s8tab = mvq_smem + MVQ_KS_OFF;
    uint8_t *ring = mvq_smem + L.ring + (size_t)warp * ST * NMAT * 16 * TR::RS;

    const int prob = blockIdx.y, tok = blockIdx.z;
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
    if (MODE == MV_DENSE && a.n_seg > 0) {      /* matmul_multi: find this block's matrix */
        int sg = 0;
        while (sg + 1 < a.n_seg && bx >= a.seg_tile0[sg + 1]) sg++;
        bx -= a.seg_tile0[sg];
        rows = a.seg_rows[sg];
        W[0] = a.seg_w[sg];
        y = a.seg_y[sg];
        y_tok = rows;
        tab = a.seg_tab[sg];
    }
    const size_t rbytes = a.row_bytes;
    const bool cg16 = ((((uintptr_t)W[0]) | ((uintptr_t)W[NMAT - 1]) | (uintptr_t)rbytes) & 15u) == 0;

    /* my tiles: block tile gr + G i (i < rpg) while in range; my SBs: s + S j */
    const int ntiles = (rows + 15) >> 4;
    const int T0 = bx * G * a.rpg;
    int ntw = 0;
    if (T0 + gr < ntiles) ntw = min(a.rpg, (ntiles - 1 - T0 - gr) / G + 1);
    const int nsbw = (nsb - s + S - 1) / S;
    const int steps = ntw * nsbw;

    /* put step q's weights in flight: 16 rows (the last tile clamps to the last row), each the
     * CG-aligned superset of its SB.  Lane l copies row l % 16, chunks l / 16 + 2 k: its
     * addresses are one base plus immediates, so a chunk costs one instruction. */
    auto issue = [&](int q) {
        if (q < steps) {
            const int tile = T0 + gr + G * (q / nsbw), sb = s + S * (q % nsbw);
            const int row = min(tile * 16 + (lane & 15), rows - 1);
            const size_t so = (size_t)row * rbytes + (size_t)sb * TR::BB;
            uint8_t *dst = ring + (size_t)((q % ST) * NMAT * 16 + (lane & 15)) * TR::RS;
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
                uint8_t *d = dst + (size_t)mt * 16 * TR::RS;
                const uint8_t *src = W[mt] + so;
                if (cg16) {
                    src -= (uintptr_t)src & 15u;
#pragma unroll
                    for (int k = 0; k < (TR::CH16 + 1) / 2; k++) {
                        const int ch = (lane >> 4) + 2 * k;
                        if (ch < TR::CH16) cp_async16(d + 16 * ch, src + 16 * ch);
                    }
                } else {
                    src -= (uintptr_t)src & 3u;
#pragma unroll
                    for (int k = 0; k < (TR::CH4 + 1) / 2; k++) {
                        const int ch = (lane >> 4) + 2 * k;
                        if (ch < TR::CH4) mvq_cp_async4(d + 4 * ch, src + 4 * ch);
                    }
                }
            }
        }
        cp_async_commit();                     /* one group per step, even if empty */
    };
#pragma unroll
    for (int p = 0; p < ST - 1; p++) issue(p);

    /* tables (IQ2_XXS): the grid as f16 pairs, copy c of entry i at grid[8 i + c] (each thread
     * expands one entry: one constant-memory read per thread), and the sign bytes */
    static_assert(MV_THREADS == 256, "one grid entry per thread");
    if (TYPE == DS4_TYPE_IQ2_XXS) {
        const uint4 ge = dsq_iq2_grid_entry(threadIdx.x);
#pragma unroll
        for (int c = 0; c < 8; c++) grid[8 * threadIdx.x + c] = ge;
        if (threadIdx.x < 128) s8tab[threadIdx.x] = (uint8_t)dsq_iq2_s8(threadIdx.x);
    }

    /* activations: per token, per SB (a warp each): the input norm, the scale 2^a, the three
     * parts into B-fragment order, the group sums (of the unscaled values) for the mins */
#pragma unroll 1
    for (int u = 0; u < NT; u++) {
        const float *xu = x + (int64_t)u * a.x_tok;
        float nsc = 1.0f;
        const bool norm = MODE == MV_DENSE && a.in_norm;
        if (norm) {            /* the input's RMSNorm, summed exactly as k_matvec sums it */
            double ss = 0.0;
            for (int e = threadIdx.x; e < a.K; e += MV_THREADS) {
                const float v = xu[e];
                ss += (double)(v * v);
            }
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
            if (lane == 0) nred[warp] = ss;
            __syncthreads();
            double tot = 0.0;
            for (int wv = 0; wv < MV_WARPS; wv++) tot += nred[wv];
            nsc = 1.0f / sqrtf((float)(tot / (double)a.K) + a.in_eps);
            __syncthreads();
        }
        const bool vec = ((uintptr_t)xu & 15u) == 0 && (!norm || ((uintptr_t)a.in_norm & 15u) == 0);
        for (int sb = warp; sb < nsb; sb += MV_WARPS) {
            const int e0 = sb * 256 + 8 * lane;
            float v[8];
            if (vec) {
                const float4 p0 = *(const float4 *)(xu + e0), p1 = *(const float4 *)(xu + e0 + 4);
                v[0] = p0.x; v[1] = p0.y; v[2] = p0.z; v[3] = p0.w;
                v[4] = p1.x; v[5] = p1.y; v[6] = p1.z; v[7] = p1.w;
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) v[k] = xu[e0 + k];
            }
            if (norm) {
#pragma unroll
                for (int k = 0; k < 8; k++) v[k] = __fmul_rn(__fmul_rn(v[k], nsc), a.in_norm[e0 + k]);
            }
            float mx = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++) mx = fmaxf(mx, fabsf(v[k]));
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
            const int ea = dsq_sb_exp(mx);
            const float sc = dsq_pow2(ea);
            /* the 4 elements 8 lane + 4 h .. + 3 share one B fragment (MMA, lane quarter) and
             * fill its 4 slots, so each part is one 8-byte store */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int fi, ft, fr;
                dsq_frag_slot(TYPE, 8 * lane + 4 * h, &fi, &ft, &fr);
                uint32_t hp[3][4];
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    const int r = dsq_quad_slot(TYPE, b);
                    dsq_split3(__fmul_rn(v[4 * h + b], sc), &hp[0][r], &hp[1][r], &hp[2][r]);
                }
#pragma unroll
                for (int pt = 0; pt < 3; pt++)
                    ((uint2 *)xf)[dsq_xf_index(sb, fi, 3 * u + pt, ft, CS)] =
                        make_uint2(hp[pt][0] | (hp[pt][1] << 16), hp[pt][2] | (hp[pt][3] << 16));
            }
            if (lane == 0)   /* IQ2_XXS: its (2 ls + 1) / 8 scale's 1/8 rides along (exact) */
                ps[u * nsb + sb] = TYPE == DS4_TYPE_IQ2_XXS ? dsq_pow2(-ea) * 0.125f : dsq_pow2(-ea);
            if (MINS) {
                const float s8 = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
                const float s16 = s8 + __shfl_xor_sync(FULL_MASK, s8, 1);
                float *sx = sxs + ((size_t)u * nsb + sb) * TR::NG;
                if (TR::NG == 16) {
                    if ((lane & 1) == 0) sx[lane >> 1] = s16;
                } else {
                    const float s32 = s16 + __shfl_xor_sync(FULL_MASK, s16, 2);
                    if ((lane & 3) == 0) sx[lane >> 2] = s32;
                }
            }
        }
    }
    __syncthreads();

    /* main loop: step q = (tile q / nsbw, SB s + S (q % nsbw)) */
    const uint2 *xl = (const uint2 *)xf;
    const uint8_t *gridl = (const uint8_t *)grid + 16 * (lane & 7);   /* this lane's copy of the grid */
    const int tk0 = dsq_col_token(2 * t, NT), tk1 = dsq_col_token(2 * t + 1, NT);
    float acc[NMAT][4], accm[NMAT][2][NT];
#pragma unroll
    for (int mt = 0; mt < NMAT; mt++) {
#pragma unroll
        for (int c = 0; c < 4; c++) acc[mt][c] = 0.0f;
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int u = 0; u < NT; u++) accm[mt][r][u] = 0.0f;
    }
#pragma unroll 1
    for (int q = 0; q < steps; q++) {
        issue(q + ST - 1);
        cp_async_wait<ST - 1>();   /* step q's group has landed (for this lane) */
        __syncwarp();                  /* ... and for every lane */
        const int ti = q / nsbw, sj = q % nsbw, sb = s + S * sj;
        const int o0 = (sb * TR::BB) & (cg16 ? 15 : 3);
        const uint8_t *slot = ring + (size_t)(q % ST) * NMAT * 16 * TR::RS;
        const uint2 *xb = xl + dsq_xf_index(sb, 0, g % CS, t, CS);
        const float ps0 = ps[tk0 * nsb + sb], ps1 = ps[tk1 * nsb + sb];
        float D[NMAT][4], dr[NMAT][2], dminr[NMAT][2], mm[NMAT][2][NT];
        mvq_sb<TYPE, NT, NMAT>(slot + (size_t)g * TR::RS + o0, (uint32_t)((o0 + 2) & 2), xb, t, gridl, s8tab,
                               sxs + (size_t)sb * TR::NG, nsb, D, dr, dminr, mm);
#pragma unroll
        for (int mt = 0; mt < NMAT; mt++) {
            acc[mt][0] = fmaf(dr[mt][0] * ps0, D[mt][0], acc[mt][0]);
            acc[mt][1] = fmaf(dr[mt][0] * ps1, D[mt][1], acc[mt][1]);
            acc[mt][2] = fmaf(dr[mt][1] * ps0, D[mt][2], acc[mt][2]);
            acc[mt][3] = fmaf(dr[mt][1] * ps1, D[mt][3], acc[mt][3]);
            if (MINS) {
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int u = 0; u < NT; u++)
                        accm[mt][r][u] = fmaf(dminr[mt][r], mm[mt][r][u], accm[mt][r][u]);
            }
        }
        if (sj == nsbw - 1) {
            /* the tile is done: per row (g, g+8) and token, ((hi + mid) + lo) - min, where
             * column c of a row is D register c%2 of lane quarter c/2 */
            const int base = lane & ~3;
            const int lr0 = (gr + G * ti) * 16 + g;
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float v0 = acc[mt][2 * r], v1 = acc[mt][2 * r + 1];
                    float res[NT];
                    const float c2 = __shfl_sync(FULL_MASK, v0, base + 1);
                    res[0] = (v0 + v1) + c2;
                    if (NT == 2) {
                        const float c3 = __shfl_sync(FULL_MASK, v1, base + 1);
                        const float c4 = __shfl_sync(FULL_MASK, v0, base + 2);
                        const float c5 = __shfl_sync(FULL_MASK, v1, base + 2);
                        res[NT - 1] = (c3 + c4) + c5;
                    }
                    if (MINS) {
#pragma unroll
                        for (int u = 0; u < NT; u++) {
                            float m = accm[mt][r][u];
                            m += __shfl_xor_sync(FULL_MASK, m, 1);
                            m += __shfl_xor_sync(FULL_MASK, m, 2);
                            res[u] -= m;
                        }
                    }
                    if (t == 0) {
#pragma unroll
                        for (int u = 0; u < NT; u++)
                            part[DUAL ? mt : u][(lr0 + 8 * r) * S + s] = res[u];
                    }
                }
#pragma unroll
                for (int c = 0; c < 4; c++) acc[mt][c] = 0.0f;
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int u = 0; u < NT; u++) accm[mt][r][u] = 0.0f;
            }
        }
        __syncwarp();                  /* slot q % ST is refilled next iteration */
    }
    cp_async_wait<0>();
    __syncthreads();

    /* sum each row's S slice partials in slice order */
    constexpr int NOUT = DUAL ? 1 : NT;
    const int tile_rows = G * a.rpg * 16;
    for (int idx = threadIdx.x; idx < tile_rows * NOUT; idx += MV_THREADS) {
        const int lr = idx % tile_rows, u = idx / tile_rows;
        const int row = T0 * 16 + lr;
        if (row >= rows) continue;
        float v0 = 0.0f;
        for (int qq = 0; qq < S; qq++) v0 += part[DUAL ? 0 : u][lr * S + qq];
        if (DUAL) {
            float v1 = 0.0f;
            for (int qq = 0; qq < S; qq++) v1 += part[NPLANE - 1][lr * S + qq];
            y[row] = silu_mul(v0, v1, a.clamp);
        } else {
            if (tab) v0 = __fadd_rn(v0, tab[(int64_t)((a.tab_pos0 + a.tok0 + u) % a.tab_period) * rows + row]);
            y[(int64_t)u * y_tok + row] = v0;
        }
    }
}

/* Slices, rows per warp and the grid of a launch (as mv_plan: aim for one wave of
 * blocks_per_sm x SMs; rows per warp grow only once every resident slot has a block).
 * Tiles are 16 rows; a block covers G x rpg tiles; segments get whole blocks. */
static dim3 mvq_plan(mv_args &a, int n_prob, int n_tok_grid, int blocks_per_sm) {
    const int nsb = a.K / DS4_QK_K;
    int S = 1;
    while (S * 2 <= nsb && S * 2 <= MV_WARPS) S *= 2;
    a.S = S;
    const int G = MV_WARPS / S;
    const int64_t want_blocks = (int64_t)blocks_per_sm * (g_cuda.n_sm > 0 ? g_cuda.n_sm : 132);
    const int64_t probs = (int64_t)n_prob * n_tok_grid;
    int64_t all_tiles = (a.rows + 15) / 16;
    if (a.n_seg > 0) {
        all_tiles = 0;
        for (int i = 0; i < a.n_seg; i++) all_tiles += (a.seg_rows[i] + 15) / 16;
    }
    int64_t per_prob = (want_blocks + probs - 1) / probs;
    if (per_prob < 1) per_prob = 1;
    int64_t rpg = (all_tiles + G * per_prob - 1) / (G * per_prob);
    if (rpg < 1) rpg = 1;
    if (rpg > MVQ_RPG_MAX) rpg = MVQ_RPG_MAX;
    a.rpg = (int)rpg;
    const int64_t blk_tiles = (int64_t)G * a.rpg;
    int64_t blocks = ((a.rows + 15) / 16 + blk_tiles - 1) / blk_tiles;
    if (a.n_seg > 0) {
        blocks = 0;
        for (int i = 0; i < a.n_seg; i++) {
            a.seg_tile0[i] = (int)blocks;
            blocks += ((a.seg_rows[i] + 15) / 16 + blk_tiles - 1) / blk_tiles;
        }
        a.seg_tile0[a.n_seg] = (int)blocks;
    }
    if (blocks < 1) blocks = 1;
    return dim3((unsigned)blocks, (unsigned)n_prob, (unsigned)n_tok_grid);
}

template <int TYPE, int MODE, int NT>
static size_t mvq_smem_bytes(int nsb) {
    return mvq_layout_of<TYPE, MODE, NT>(nsb).total;
}

/* Does the fast kernel take this shape (for NT tokens per launch)?  Rows, matrices and bases
 * 4-byte aligned (IQ2_XXS rows are 66 n bytes: n even), and the staged activations fit. */
static bool mvq_shape_ok(int type, int mode, int nt, int64_t K, size_t row_bytes, size_t mat_bytes,
                         const void *w, const void *w2) {
    if (!dsq_is_type(type) || K <= 0 || K % DS4_QK_K != 0) return false;
    if (((uintptr_t)w | (uintptr_t)w2 | row_bytes | mat_bytes) & 3u) return false;
    const int nsb = (int)(K / DS4_QK_K);
    size_t smem;
#define MVQ_SMEM_CASE(T) \
    smem = mode == MV_GATE_UP ? mvq_smem_bytes<T, MV_GATE_UP, 1>(nsb) \
         : nt == 2 ? mvq_smem_bytes<T, MV_DENSE, 2>(nsb) : mvq_smem_bytes<T, MV_DENSE, 1>(nsb)
    if (type == DS4_TYPE_Q2_K) { MVQ_SMEM_CASE(DS4_TYPE_Q2_K); }
    else if (type == DS4_TYPE_Q4_K) { MVQ_SMEM_CASE(DS4_TYPE_Q4_K); }
    else { MVQ_SMEM_CASE(DS4_TYPE_IQ2_XXS); }
#undef MVQ_SMEM_CASE
    const size_t cap = g_cuda.smem_optin ? g_cuda.smem_optin : 48 * 1024;
    return smem + sizeof(float) * 2 * MVQ_PART + sizeof(double) * MV_WARPS <= cap;
}

static bool mvq_fast_ok(int type, int mode, int64_t K, size_t row_bytes, size_t mat_bytes,
                        const void *w, const void *w2) {
    return mvq_shape_ok(type, mode, 1, K, row_bytes, mat_bytes, w, w2);
}

/* The one launcher of k_matvec_q (a template over its instantiations).  The shared-memory
 * limit is raised once per instantiation; the occupancy of each K is asked once. */
template <int TYPE, int MODE, int NT>
static void mvq_launch_t(mv_args a, int n_prob, int n_tok_grid) {
    const int nsb = a.K / DS4_QK_K;
    const size_t smem = mvq_smem_bytes<TYPE, MODE, NT>(nsb);
    static bool raised = false;
    static int occ[65];
    if (!raised) {
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_matvec_q<TYPE, MODE, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)(g_cuda.smem_optin - sizeof(float) * 2 * MVQ_PART
                                                  - sizeof(double) * MV_WARPS)));
        raised = true;
    }
    int bps = nsb < 65 ? occ[nsb] : 0;
    if (!bps) {
        DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, k_matvec_q<TYPE, MODE, NT>, MV_THREADS, smem));
        if (bps < 1) bps = 1;
        if (nsb < 65) occ[nsb] = bps;
    }
    const dim3 grid = mvq_plan(a, n_prob, n_tok_grid, bps);
    DS4_LAUNCH(k_matvec_q<TYPE, MODE, NT><<<grid, MV_THREADS, smem>>>(a));
}

template <int TYPE>
static void mvq_type(const mv_args &a, int n_prob, int n_tok_grid, int mode, int nt) {
    if (mode == MV_GATE_UP) mvq_launch_t<TYPE, MV_GATE_UP, 1>(a, n_prob, n_tok_grid);
    else if (mode == MV_DOWN) mvq_launch_t<TYPE, MV_DOWN, 1>(a, n_prob, n_tok_grid);
    else if (nt == 2) mvq_launch_t<TYPE, MV_DENSE, 2>(a, n_prob, n_tok_grid);
    else mvq_launch_t<TYPE, MV_DENSE, 1>(a, n_prob, n_tok_grid);
}

/* Run a matvec problem set of a Q2_K / Q4_K / IQ2_XXS matrix: the semantics of matvec_run
 * (n_prob problems on blockIdx.y, n_tok_grid tokens on blockIdx.z in the MoE modes, nt_dense
 * tokens inside a dense launch), for shapes mvq_fast_ok accepts.  Dense tokens go two per
 * launch (three f16 parts per token fill 6 of the MMA's 8 columns). */
static void matvec_q_run(int type, int mode, const mv_args &a0, int n_prob, int n_tok_grid, int nt_dense) {
    if ((a0.n_seg == 0 && a0.rows <= 0) || n_prob <= 0 || n_tok_grid <= 0 || nt_dense <= 0) return;
    if (mode != MV_DENSE) nt_dense = 1;
    const bool two = mode == MV_DENSE &&
                     mvq_shape_ok(type, mode, 2, a0.K, a0.row_bytes, a0.mat_bytes, a0.w, a0.w2);
    mv_token_chunks(a0, nt_dense, two ? 2 : 1, [&](const mv_args &c, int chunk) {
        switch (type) {
        case DS4_TYPE_Q2_K: mvq_type<DS4_TYPE_Q2_K>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_Q4_K: mvq_type<DS4_TYPE_Q4_K>(c, n_prob, n_tok_grid, mode, chunk); break;
        default:            mvq_type<DS4_TYPE_IQ2_XXS>(c, n_prob, n_tok_grid, mode, chunk); break;
        }
    });
}

/* ---------------------------------------------------------------------------
 * Prefill dequantisation (a faster k_dequant for these types)
 *
 * One warp per super-block, lane p writing elements 8p..8p+7 (two coalesced float4 stores
 * when dst is 16-byte aligned), with dsq_block8's bit-exact values.
 * ------------------------------------------------------------------------- */

__global__ void k_dequant_q(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                            float *dst) {
    const int lane = threadIdx.x & 31;
    const int64_t nsb = K / DS4_QK_K, total = nrows * nsb;
    const int bb = dsq_block_bytes(type);
    const bool vec = ((uintptr_t)dst & 15u) == 0;
    for (int64_t wb = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); wb < total;
         wb += (int64_t)gridDim.x * (blockDim.x >> 5)) {
        const int64_t r = wb / nsb, b = wb % nsb;
        float v[8];
        dsq_block8(type, src + (size_t)r * row_bytes + (size_t)b * bb, lane, v);
        float *o = dst + r * K + b * DS4_QK_K + 8 * lane;
        if (vec) {
            ((float4 *)o)[0] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4 *)o)[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            for (int k = 0; k < 8; k++) o[k] = v[k];
        }
    }
}

static void launch_dequant_q(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                             float *dst) {
    if (nrows <= 0 || K <= 0) return;
    DS4_LAUNCH(k_dequant_q<<<grid_for(nrows * (K / DS4_QK_K) * 32), 256>>>(src, type, row_bytes, K, nrows, dst));
}

#endif /* DSQ_DECODERS_ONLY */

#endif /* DS4_CUDA_QUANT_CUH */
