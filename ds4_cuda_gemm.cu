/* ds4_cuda_gemm.cu -- prefill's matrix products on tensor cores: y = x W^T for a batch of
 * tokens, with exact products, f32 sums and no dequantised copy of the weights.
 *
 * What it is.  gemm_tc_rows, the engine behind gemm_rows (ds4_cuda_matmul.cu) for the weight
 * types whose elements are exact small integers (or halves) times a per-block factor: Q8_0
 * (d * q, q an int8), F16, and the super-block types of the published files' routed experts,
 * IQ2_XXS, Q2_K and Q4_K.  Every prefill product of those types goes through it: the dense
 * projections, the grouped output projection, the shared expert and each routed expert's
 * slice (ds4_cuda_moe.cu).  Other types (F32, BF16) keep the dequantise + cuBLAS path, and
 * DS4_CUDA_PREFILL_TC=0 sends every type there (to compare the two in one run).  Two kernels
 * do the products: k_tc_wgmma (sm_90's warpgroup MMAs, the default on an H100 or H200 with an
 * sm_90 build) and k_tc_gemm (mma.sync, sm_80 and later: every other card, and
 * DS4_CUDA_PREFILL_TC=1).  Both have the tile, the grid and the arithmetic described below;
 * "On sm_90" says what differs.
 *
 * Numerics.  The same scheme as the decode matvec's f16 path (ds4_cuda_matvec_q.cuh), with
 * the tokens as the MMA's columns:
 *   - A (the weights): an exact integer a per element, and a factor s per block of 32 that
 *     takes a to the weight (tc_frag_a): Q8_0 a = q, s = d; F16 the element itself, s = 1;
 *     IQ2_XXS a = +-(8, 25 or 43), s = d (2 ls + 1) / 8; Q2_K a = sc q (<= 45), s = d; Q4_K
 *     a = q, s = d sc.  Q2_K and Q4_K weights are s a - dmin m: their mins are a second A
 *     (m per element, factor -dmin; Q4_K: 1, factor -dmin m), a second pass of MMAs over the
 *     same B.  Each product is the weight ds4_quant.c computes (exactly rounded to f32 there,
 *     exact here), split in two sums where the format has mins.
 *   - B (the activations): each token's row x scaled by a power of two 2^a so that
 *     2^14 <= max|x 2^a| < 2^15, then split into three f16 parts hi + mid + lo that add up to
 *     it (k_tc_split): hi = f16(v), mid = f16(v - hi), lo = f16(v - hi - mid), 33 significant
 *     bits for x's 24, so the split is exact for every element down to 2^-7 of the row's
 *     largest (lo is then a normal f16) and within 2^-39 of that largest below it (half of
 *     f16's subnormal step), far under f32's own rounding of the dot product.
 *     Both kernels read hi and mid alone by default (DS4_CUDA_PREFILL_PLANES=2; the split then
 *     writes only those two, and a stage holds two parts): each element within
 *     2^-22 of itself where mid is a normal f16 (f32's own inputs carry 2^-24), 4 MMAs a block
 *     of 32 instead of 6.  The dot product stays within f32's accuracy; what it gives up is
 *     the last bits of an exact input, which decide only near-ties downstream (bench/RESULTS.md).
 *   - Every product in the MMA (at most 11 x 11 bits) is exact; the sums are the tensor
 *     core's f32 accumulation, which is not IEEE round-to-nearest (it truncates, and chained
 *     through a whole row its error grows with K: bench/RESULTS.md).  So the 6 (two planes: 4)
 *     MMAs of one block of 32 (and pass) start from zero, and the block's sum goes into the running sum
 *     with one f32 FMA by s (FADD for F16), blocks in order.  Then y = sum * 2^-a.
 * The result is an f32-accurate dot product in an order of its own, like every other matmul
 * of this backend: test_backend_ops holds it to TOL_DOT against the CPU.  A row's arithmetic
 * depends on K alone (not on the grid, the tile or the token count): the sum of a (row,
 * token) is the same whatever batch the token is in.
 *
 * How a block works (256 threads, 8 warps, TC_BM = 128 rows x TC_BN = 64 tokens).  Warp w
 * computes 32 rows (two m16 tiles) x 32 tokens (four n8 tiles): rows 32 (w % 4), tokens
 * 32 (w / 4); a lane's rows are spread so that its loads of A hit distinct banks (pg, in the
 * kernel), and the MMAs of two m tiles x two n tiles are issued interleaved (four accumulator
 * chains in flight, each in the order below).  Each thread's share of a stage's copies is
 * worked out once per block (tc_copy_plan): a stage differs from the last by its k offset.
 *   The block streams K in stages of TC_BK = 64 through a TC_ST-deep cp.async pipeline: a
 * stage is the raw weight bytes of its 128 rows (Q8_0: two 34-byte blocks per row; F16:
 * 128 bytes; a super-block type: the whole super-block the stage is a quarter of, the same
 * bytes four stages running, from L2; tc_traits) and the parts (three, or two) of its 64 tokens
 * (16-byte chunks, swizzled so a quarter-warp's reads fall on distinct banks).  From a stage
 * a lane takes, per block of 32 k, one 16-byte read per n tile and part for B (the 8 halves
 * it needs are adjacent because the k order inside the block is permuted, see below) and
 * its 8 weights (adjacent too: in every format a lane's 8 elements sit in one scale group
 * and in adjacent bytes or one grid entry) and the factors per A row, makes them exact f16
 * integers (Q8_0: a byte permute into 1024 + (q + 128), then one f16x2 subtraction;
 * IQ2_XXS: its grid entry, expanded per block into f16 magnitude pairs in shared memory,
 * with the sign bits flipped in), and issues 2 MMAs x PL parts per tile pair (and pass).
 *   The grid is row tiles x token tiles (a plain product's in groups of token tiles whose
 * activations fit L2, token tiles first: tc_pos_of).  The row tiles are those of up to
 * TC_SEG_MAX matrices of one type and K (segments, grid z): the projections of one input (matmul_multi,
 * gate|up), or the groups of a grouped projection, each group reading its own part of the
 * split.  So a batch's small projections fill the device together, in one launch, from one
 * split.  A grouped product (the MoE's experts) takes its token tiles from a table, each a run
 * of up to 64 rows of one expert, so every expert of a layer is in one launch.
 *   The k permutation: in m16n8k16 a lane (g = lane / 4, t = lane % 4) holds the k slots
 *   2t, 2t+1, 2t+8, 2t+9 of A's rows g and g+8 and of B's column g.  A sum over k does not
 *   care which element sits in which slot, as long as A and B agree, so for MMA j (0, 1) of a
 *   block the slots of lane t hold the elements 8t + 4j .. 8t + 4j + 3: a lane's 8 elements
 *   of the block are adjacent in memory in both operands.
 *
 * Shapes.  K a multiple of 256 and rows of a 16-byte multiple (Q8_0, F16 and Q4_K: any such
 * K; Q2_K's 84 bytes per 256: K a multiple of 1024; IQ2_XXS's 66: of 2048), any number of rows and tokens (rows past the end are read as row 0 and not stored; the split
 * activations are zero-padded by at least TC_BN tokens, so a tile starting anywhere reads
 * inside them).  Anything else returns false to gemm_rows (gemm_tc_ok).
 *
 * Splits.  A split holds parts: part p is columns p K .. p K + K - 1 of each token's row,
 * scaled by its own power of two, exactly as if it were split alone.  A segment's sums are
 * therefore the same bytes whether its matrix runs alone or beside others.
 *
 * On sm_90 (k_tc_wgmma).  wgmma.m64n64k16 issued by a warpgroup (4 warps) does what 32
 * mma.sync do, asynchronously: A (the weights, converted by tc_frag_a as above) comes from
 * registers in the m16n8k16 fragment layout, B (the parts) from shared memory through a
 * descriptor, so B's 16 slots of a k16 step must lie in shared memory in slot order: the split
 * writes each row permuted for it (k_tc_split's perm: the k permutation above, applied to the data),
 * and the stage holds it in the 128-byte swizzle the descriptor names.  Each block of 32 still
 * sums from zero in 2 PL MMAs (4, or 6 on three planes) and folds into the running sum with one FMA, blocks in order, so
 * the two kernels' results differ only by the tensor cores' own summation inside a block.
 * The instruction needs the sm_90a target: the Makefile builds this unit of an sm_90 build
 * for sm_90a (and compute_90 PTX for later cards, which take k_tc_gemm); DS4_WGMMA tells the
 * host, which also checks that the card is CC 9.0.
 *   A stage's B (its parts: three, 24 KiB, or two, 16 KiB) comes by one copy of the tensor
 * memory accelerator (two for stages of four blocks) that thread 0 issues, into the same
 * swizzled layout, completing on the stage's mbarrier.  A Q8_0 stage's A comes by a second
 * such copy (128 rows of 80 bytes, the 68 it needs from the 16-byte boundary at or below them:
 * see k_tc_wgmma), and so, on two planes, do the super-block types' (a super-block a row);
 * F16's A, and three planes', stay cp.async.
 * DS4_CUDA_PREFILL_TC=4 (the default) is that, with Q8_0's blocks 256 rows (four warpgroups: a
 * stage's B serves twice the rows) and, on two planes, stages of four blocks of 32 (A's box
 * 144 bytes for 136, B two copies), IQ2_XXS's on two planes the same way, and Q2_K's and
 * Q4_K's on two planes in 128-row blocks with stages of four blocks; 3 copies Q8_0's A with
 * cp.async like the others'; 2 copies B with every thread's cp.async too (and so does a
 * driver with no tensor-map encoder).  The arithmetic is the same, bit for bit.
 */

#include "ds4_cuda_common.cuh"

#include <cuda.h>             /* CUtensorMap (k_tc_wgmma's TMA stages) */
#include <cudaTypedefs.h>     /* PFN_cuTensorMapEncodeTiled */
#include <cuda_fp16.h>

#define TC_BM      128
#define TC_BK      64       /* k per pipeline stage: two Q8_0 blocks */
#define TC_ST      3        /* pipeline stages */
#define TC_THREADS 256
#define TC_L2_GROUP ((int64_t)16 << 20)   /* a plain product's activations a group of token tiles (tc_pos_of) */
#define TC_APITCH  80       /* k_tc_wgmma with A by tensor copies (TA): a Q8_0 row's staged bytes */
#define TC_APITCH4 144      /* the same for TA's stages of four blocks (tc_tile SJ = 4) */
#ifndef TC_WIDE
#define TC_WIDE    1        /* k_tc_wgmma TA on two planes: stages of four Q8_0 blocks (0: two, to measure) */
#endif
#ifndef TC_IQ2_NWG
#define TC_IQ2_NWG 3        /* k_tc_wgmma TA, IQ2_XXS: warpgroups a block (3: 192 rows, 144 registers; 4: 256, spills) */
#endif
#ifndef TC_ROUND
#define TC_ROUND   2        /* k_tc_wgmma TA: stages a round (1, 2 or 4; -DTC_ROUND=N at build time to measure) */
#endif
/* TC_SEG_MAX (ds4_cuda_common.cuh): matrices of one launch; TC_BN (there too): tokens of a tile */

bool gemm_tc_type(int type) {
    return type == DS4_TYPE_Q8_0 || type == DS4_TYPE_F16 || type == DS4_TYPE_IQ2_XXS || type == DS4_TYPE_Q2_K ||
           type == DS4_TYPE_Q4_K;
}

/* Bytes of one part of split activations, nt tokens of K elements: three f16 planes of
 * [ntp][K] and the per-token factors [ntp] (session_new sizes the scratch by it; a split of
 * P parts takes P of these, one after the other, each 16-byte aligned as ntp is a multiple of
 * 64). */
size_t gemm_tc_scratch_bytes(int64_t nt, int64_t K) {
    const int64_t ntp = (nt + TC_BN - 1) / TC_BN * TC_BN + TC_BN;
    return (size_t)(3 * ntp * K) * sizeof(__half) + (size_t)ntp * sizeof(float);
}

/* ---------------------------------------------------------------------------
 * The split: part p of x [nt][ldx] (columns p K ..) -> hi, mid, lo [3][ntp][K] (f16) and
 * inv [ntp] = 2^-a, at part_bytes p into xs
 * ------------------------------------------------------------------------- */

/* The wgmma kernel's split (perm) is in the slot order of its MMAs (see k_tc_wgmma), so that a
 * k16 step's 16 elements of a token are 32 adjacent bytes: inside each block of 32, element
 * pair 4 t + 2 hf + h (t < 4; hf, h < 2) moves to pair 8 hf + 4 h + t.  The mma.sync kernel
 * reads the row as it is (perm 0).
 * tc_split_src: the 8 elements of row xr that chunk c (16 bytes of each plane, slots 8 c ..
 * 8 c + 7) holds: elements 8 c + i, or with perm pair t = 0..3 of chunk q = c % 4 of a block
 * is the row's pair 4 t + q (elements 8 t + 2 q and + 1 of the block). */
__device__ __forceinline__ void tc_split_src(const float *xr, int c, int perm, float (&v)[8]) {
    if (!perm) {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = xr[8 * c + i];
        return;
    }
    const float *b = xr + 32 * (c >> 2) + 2 * (c & 3);
#pragma unroll
    for (int t = 0; t < 4; t++) {
        v[2 * t] = b[8 * t];
        v[2 * t + 1] = b[8 * t + 1];
    }
}

/* The 8 elements of chunk c of a row to split: x's (xr), or with u (the MoE's swiglu) each
 * silu_mul(x's, u's, limit), the value k_swiglu would have stored (the same function). */
__device__ __forceinline__ void tc_split_elems(const float *xr, const float *ur, float limit, int c, int perm,
                                               float (&v)[8]) {
    tc_split_src(xr, c, perm, v);
    if (!ur) return;
    float w[8];
    tc_split_src(ur, c, perm, w);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = silu_mul(v[i], w[i], limit);
}

/* Chunk v (8 elements) times s (a power of two: exact) split into its parts, one 16-byte store
 * per plane (lo only with three planes). */
__device__ __forceinline__ void tc_split_store(const float (&v)[8], float s, int planes, uint4 *d0, uint4 *d1,
                                               uint4 *d2) {
    uint32_t w[3][4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __half hi0, mi0, lo0, hi1, mi1, lo1;
        tc_split3(v[2 * i] * s, hi0, mi0, lo0);
        tc_split3(v[2 * i + 1] * s, hi1, mi1, lo1);
        const __half2 hh = __halves2half2(hi0, hi1), mm = __halves2half2(mi0, mi1), ll = __halves2half2(lo0, lo1);
        w[0][i] = *(const uint32_t *)&hh;
        w[1][i] = *(const uint32_t *)&mm;
        w[2][i] = *(const uint32_t *)&ll;
    }
    *d0 = make_uint4(w[0][0], w[0][1], w[0][2], w[0][3]);
    *d1 = make_uint4(w[1][0], w[1][1], w[1][2], w[1][3]);
    if (planes == 3) *d2 = make_uint4(w[2][0], w[2][1], w[2][2], w[2][3]);
}

#define TC_SPLIT_KEEP 2     /* chunks of 8 a thread keeps in registers: K <= 8 x 256 x 2 */

/* Block (t, p): token t's part p.  A thread takes 16-byte chunks of the planes (c = tid,
 * tid + 256, ...): the row's largest |element| first, then each chunk's 8 elements split and
 * stored as one 16-byte store per plane (tc_split_store).  A thread's first TC_SPLIT_KEEP
 * chunks are read once, kept in registers between the two passes.  Row t is src.x's row t, or with src.rows its row
 * rows[t] / rdiv (the MoE's gather of its pairs' tokens, the values k_moe_gather would have
 * copied); with src.u, swiglu(x, u) (tc_split_elems).  MADE: rows or u may be set (the
 * plain splits, every other product's, compile without them). */
template <bool MADE>
__global__ void k_tc_split(const tc_src src, int K, int nt, int ntp, uint8_t *xs, size_t part_bytes, int perm,
                           int planes) {
    ds4_grid_dep();
    const int t = blockIdx.x;
    const size_t plane = (size_t)ntp * K;
    __half *base = (__half *)(xs + part_bytes * blockIdx.y);
    float *inv = (float *)(base + 3 * plane);
    const float *x = src.x + (int64_t)K * blockIdx.y, *u = MADE && src.u ? src.u + (int64_t)K * blockIdx.y : NULL;
    const int64_t ldx = src.ldx;
    uint4 *h0 = (uint4 *)(base + (size_t)t * K), *h1 = (uint4 *)((__half *)h0 + plane),
          *h2 = (uint4 *)((__half *)h1 + plane);
    const int nc = K / 8;
    if (t >= nt) {                                  /* padding tokens: zero, never stored */
        const uint4 z = make_uint4(0, 0, 0, 0);
        for (int c = threadIdx.x; c < nc; c += blockDim.x) {
            h0[c] = h1[c] = z;
            if (planes == 3) h2[c] = z;
        }
        if (threadIdx.x == 0) inv[t] = 0.0f;
        return;
    }
    const int64_t row = MADE && src.rows ? src.rows[t] / src.rdiv : t;
    const float *xr = x + row * ldx, *ur = u ? u + row * ldx : NULL;
    /* a thread's first TC_SPLIT_KEEP chunks stay in registers between the two passes (every
     * chunk of K <= 4096, the most products); the rest are read again */
    float vk[TC_SPLIT_KEEP][8];
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < TC_SPLIT_KEEP; j++) {
        const int c = threadIdx.x + j * TC_THREADS;
        if (c < nc) {
            tc_split_elems(xr, ur, src.limit, c, perm, vk[j]);
#pragma unroll
            for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(vk[j][i]));
        }
    }
    for (int c = threadIdx.x + TC_SPLIT_KEEP * TC_THREADS; c < nc; c += TC_THREADS) {
        float v[8];
        tc_split_elems(xr, ur, src.limit, c, perm, v);
#pragma unroll
        for (int i = 0; i < 8; i++) m = fmaxf(m, fabsf(v[i]));
    }
    __shared__ float red[TC_THREADS / 32];
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); i++) m = fmaxf(m, red[i]);
    const int a = tc_part_exp(m);
    const float s = __int_as_float((127 + a) << 23);
#pragma unroll
    for (int j = 0; j < TC_SPLIT_KEEP; j++) {
        const int c = threadIdx.x + j * TC_THREADS;
        if (c < nc) tc_split_store(vk[j], s, planes, h0 + c, h1 + c, h2 + c);
    }
    for (int c = threadIdx.x + TC_SPLIT_KEEP * TC_THREADS; c < nc; c += TC_THREADS) {
        float v[8];
        tc_split_elems(xr, ur, src.limit, c, perm, v);
        tc_split_store(v, s, planes, h0 + c, h1 + c, h2 + c);
    }
    if (threadIdx.x == 0) inv[t] = __int_as_float((127 - a) << 23);
}

/* ---------------------------------------------------------------------------
 * The product
 * ------------------------------------------------------------------------- */

/* Four int8 (one word) -> two f16x2 pairs holding exactly those integers: each byte biased to
 * 0..255 becomes the low mantissa byte of 1024 (f16 0x6400), then 1024 + 128 comes off. */
__device__ __forceinline__ void tc_i8x4_f16(uint32_t q, uint32_t &p01, uint32_t &p23) {
    const uint32_t u = q ^ 0x80808080u;
    const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));   /* 1152 */
    uint32_t v01 = __byte_perm(u, 0x64646464u, 0x4140), v23 = __byte_perm(u, 0x64646464u, 0x4342);
    __half2 h01 = __hsub2(*(__half2 *)&v01, bias), h23 = __hsub2(*(__half2 *)&v23, bias);
    p01 = *(uint32_t *)&h01;
    p23 = *(uint32_t *)&h23;
}

/* The same for four unsigned bytes (0..255): 1024 + u, then 1024 comes off. */
__device__ __forceinline__ void tc_u8x4_f16(uint32_t u, uint32_t &p01, uint32_t &p23) {
    const __half2 bias = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));   /* 1024 */
    uint32_t v01 = __byte_perm(u, 0x64646464u, 0x4140), v23 = __byte_perm(u, 0x64646464u, 0x4342);
    __half2 h01 = __hsub2(*(__half2 *)&v01, bias), h23 = __hsub2(*(__half2 *)&v23, bias);
    p01 = *(uint32_t *)&h01;
    p23 = *(uint32_t *)&h23;
}

/* What a stage holds of a weight row, per type.  A stage is TC_BK = 64 elements of K:
 *   - Q8_0: its two raw 34-byte blocks (68 bytes, copied 4 bytes at a time);
 *   - F16: its 128 bytes, in 16-byte chunks, chunk c at c ^ 4 (row & 1) (tc_swz): the eight
 *     lanes of a quarter-warp read rows g, g + 1 at chunks t (+ 4 j), which then fall on
 *     different banks;
 *   - the super-block types (256 elements, SBB bytes), the whole super-block the stage is a
 *     quarter of, every stage (the same bytes four stages running: they come from L2): Q2_K
 *     84 bytes and IQ2_XXS 68 (its 66 bytes from the 4-byte boundary at or below them: a
 *     super-block at an odd index starts 2 bytes into a word), copied 4 bytes at a time;
 *     Q4_K 144 bytes in 16-byte chunks.
 * AROW bytes a row, in pieces of PS bytes; then B, PL parts (three or two) x TC_BN tokens x TC_BK halves
 * (128 bytes a token). */
template <int TYPE> struct tc_traits {
    enum {
        SBB = TYPE == DS4_TYPE_Q2_K ? 84 : TYPE == DS4_TYPE_Q4_K ? 144 : TYPE == DS4_TYPE_IQ2_XXS ? 66 : 0,
        AROW = TYPE == DS4_TYPE_Q8_0 || TYPE == DS4_TYPE_IQ2_XXS ? 68 : TYPE == DS4_TYPE_F16 ? 128 : SBB,
        PS = TYPE == DS4_TYPE_F16 || TYPE == DS4_TYPE_Q4_K ? 16 : 4,
        NP = AROW / PS,                 /* pieces a row */
        MIN = TYPE == DS4_TYPE_Q2_K || TYPE == DS4_TYPE_Q4_K,   /* a second A: the mins */
        SMEM_EXTRA = TYPE == DS4_TYPE_IQ2_XXS ? 256 * 16 + 128 : 0,   /* the grid and sign tables */
    };
};
/* A block's stages, per kernel (WG: k_tc_wgmma) and type; both kernels' blocks are TC_BM = 128
 * rows of TC_THREADS = 256 threads.  k_tc_gemm: TC_ST stages.  k_tc_wgmma: A rounded up to 1 KiB, so that B
 * (whose layout is the 128-byte swizzle the MMAs read: chunk c of token n at c ^ (n % 8))
 * starts on a 1 KiB boundary; three stages (101 KiB for Q8_0: two blocks per SM, so that one
 * block's folds and barriers overlap the other's MMAs), four for the types with mins (one block
 * per SM: their second accumulators take 250 registers; k_tc_wgmma takes their stages two a
 * round), five for k_tc_wgmma's blocks with A
 * by tensor copies (TA: NWG = 4 warpgroups, BM = 256 rows of 512 threads, one block per SM),
 * three where those stages are four blocks of 32 k (SJ = 4: TA on two planes, 68 KiB each),
 * four for IQ2_XXS's (47 KiB for 192 rows: A a super-block of 80 bytes a row; the tables beside) and
 * for the types with mins' in 128-row blocks (A a super-block: 96 bytes a row for Q2_K's 84,
 * 144 for Q4_K's);
 * 1 KiB more to align the dynamic shared memory's start.  RP rows one pass of the threads copies (4-byte or 16-byte pieces, NP a row), NPASS
 * passes. */
template <int TYPE, bool WG, bool TA = false, int PL = 3, int NWG = TA ? 4 : 2> struct tc_tile {
    typedef tc_traits<TYPE> TT;
    enum {
        RP = TC_THREADS / TT::NP,
        NPASS = (TC_BM + RP - 1) / RP,
        BM = 64 * NWG,                        /* the block's rows (TC_BM, but 256 for k_tc_wgmma with TA) */
        /* blocks of 32 k a stage: 4 for TA on two planes (the super-block types: always) */
        SJ = TA && PL == 2 && (TC_WIDE || TYPE != DS4_TYPE_Q8_0) ? 4 : 2,
        /* a staged row's bytes (TA: the tensor-copy box; IQ2_XXS: a super-block's 66 bytes
         * from the 16-byte boundary at or below them) */
        APITCH = TA ? (TYPE == DS4_TYPE_Q2_K ? 96 : TYPE == DS4_TYPE_Q4_K ? 144
                       : SJ == 4 && TYPE == DS4_TYPE_Q8_0 ? TC_APITCH4 : TC_APITCH) : TT::AROW,
        ABYTES = WG ? (BM * APITCH + 1023) / 1024 * 1024 : TC_BM * APITCH,
        BBOX = PL * TC_BN * 128,              /* one tensor copy of B: TC_BK = 64 k of the PL parts */
        STAGE = ABYTES + BBOX * (SJ / 2),
        ST = !WG ? TC_ST : TT::MIN ? 4 : NWG > 2 ? (TYPE == DS4_TYPE_IQ2_XXS ? 4 : SJ == 4 ? 3 : 5) : 3,
        SMEM = ST * STAGE + TT::SMEM_EXTRA + (WG ? 8 * ST + 1024 : 0),   /* WG: the stages' mbarriers */
    };
};
template <int TYPE, int PL = 3>
__host__ __device__ constexpr int tc_smem_bytes() { return tc_tile<TYPE, false, false, PL>::SMEM; }
template <int TYPE, bool TA = false, int PL = 3>
__host__ __device__ constexpr int tcw_smem_bytes() { return tc_tile<TYPE, true, TA, PL>::SMEM; }
/* IQ2_XXS's tile with A by tensor copies (two planes, TC_IQ2_NWG warpgroups) */
typedef tc_tile<DS4_TYPE_IQ2_XXS, true, true, 2, TC_IQ2_NWG> tc_iq2_ta;
/* The types with mins with A by tensor copies (two planes): 128-row blocks of two warpgroups */
template <int TYPE>
using tc_min_ta = tc_tile<TYPE, true, true, 2, 2>;
__device__ __forceinline__ int tc_swz(int row, int chunk) { return 16 * (chunk ^ ((row & 1) << 2)); }

/* Byte offset in a weight row of what stage kb copies (the super-block types: rounded down
 * to 4 bytes), and where, in the staged row, its first element's data starts. */
template <int TYPE>
__device__ __forceinline__ size_t tc_stage_src(int kb) {
    if (TYPE == DS4_TYPE_Q8_0) return (size_t)kb * 68;
    if (TYPE == DS4_TYPE_F16) return (size_t)kb * 128;
    return ((size_t)(kb >> 2) * tc_traits<TYPE>::SBB) & ~(size_t)3;
}

/* A thread's share of a stage's copies, set up once per block: the stages then differ only by
 * their k offset.  A, 4-byte pieces: thread tid < RP NP copies piece tid % NP of the rows
 * tid / NP + RP i (i < NPASS, while the row is in the tile), which lands at PS tid + AROW RP i
 * of the stage; F16: chunk tid % 8 of the rows tid / 8 + 32 i, swizzled; Q4_K: chunk tid % 9
 * of the rows tid / 9 + 28 i.  B: chunk tid % 8 of the tokens tid / 8 + 32 h (h = 0, 1) of
 * each part.  Rows past the matrix read row row0. */
struct tc_copy {
    const uint8_t *ar;      /* the thread's piece of its first row, arow (row0 where arow is past
                               the tile), at offset 0 */
    const __half *b;        /* the thread's first B piece (part 0) at stage 0 */
    int arow;               /* the thread's first A row of the tile (TC_BM: none) */
    int nv;                 /* rows of the tile inside the matrix */
    int as, bs;             /* the first pieces' offsets in a stage */
};

template <int TYPE, bool WG>
__device__ __forceinline__ tc_copy tc_copy_plan(const uint8_t *w, size_t row_bytes, int row0, int nrows,
                                                const __half *xs, int K, int t0) {
    typedef tc_traits<TYPE> TT;
    typedef tc_tile<TYPE, WG> TL;
    tc_copy cp;
    const int tid = threadIdx.x;
    const uint8_t *a;
    if (TYPE == DS4_TYPE_F16) {
        cp.arow = tid >> 3;
        cp.as = 128 * cp.arow + tc_swz(cp.arow, tid & 7);
        a = w + (size_t)row0 * row_bytes + 16 * (tid & 7);
    } else {
        cp.arow = tid < TL::RP * TT::NP ? tid / TT::NP : TC_BM;
        cp.as = TT::PS * tid;
        a = w + (size_t)row0 * row_bytes + TT::PS * (tid - TT::NP * (tid / TT::NP));
    }
    cp.nv = nrows - row0;
    cp.ar = a + (size_t)(cp.arow < TC_BM ? cp.arow : 0) * row_bytes;
    const int n = tid >> 3;
    cp.b = xs + (size_t)(t0 + n) * K + 8 * (tid & 7);
    cp.bs = TL::ABYTES + 128 * n + (WG ? 16 * ((tid & 7) ^ (n & 7)) : tc_swz(n, tid & 7));
    return cp;
}

/* Stage kb's B: the PL parts of the tile's tokens, elements kb*TC_BK .. + TC_BK (cp.bs holds
 * the kernel's layout). */
template <int PL>
__device__ __forceinline__ void tc_load_b(uint8_t *st, const tc_copy &cp, size_t plane, int K, int kb) {
    const __half *b = cp.b + (size_t)kb * 64;
#pragma unroll
    for (int p = 0; p < PL; p++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            cp_async16(st + cp.bs + (p * TC_BN + 32 * h) * 128, b + p * plane + (size_t)(32 * h) * K);
}

/* Stage kb's A: the weight rows' data of elements kb*TC_BK .. + TC_BK. */
template <int TYPE, bool WG>
__device__ __forceinline__ void tc_load_a(uint8_t *st, const tc_copy &cp, size_t row_bytes, int kb) {
    typedef tc_traits<TYPE> TT;
    typedef tc_tile<TYPE, WG> TL;
    if (cp.nv >= TC_BM) {
        /* the whole tile inside the matrix (the block-uniform common case): pass i's row is RP i
         * rows (F16: 32 i) past the thread's first */
        const uint8_t *p = cp.ar + tc_stage_src<TYPE>(kb);
        const size_t astep = (size_t)(TYPE == DS4_TYPE_F16 ? 32 : TL::RP) * row_bytes;
        if (TYPE == DS4_TYPE_F16) {
#pragma unroll
            for (int i = 0; i < 4; i++, p += astep) cp_async16(st + cp.as + 4096 * i, p);
        } else {
#pragma unroll
            for (int i = 0; i < TL::NPASS; i++, p += astep)
                if (cp.arow + TL::RP * i < TC_BM) {
                    if (TT::PS == 16) cp_async16(st + cp.as + TT::AROW * TL::RP * i, p);
                    else cp_async4(st + cp.as + TT::AROW * TL::RP * i, p);
                }
        }
        return;
    }
    /* a tile reaching past the matrix: its rows past the end read row row0 */
    const uint8_t *a = cp.ar - (size_t)(cp.arow < TC_BM ? cp.arow : 0) * row_bytes + tc_stage_src<TYPE>(kb);
    if (TYPE == DS4_TYPE_F16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = cp.arow + 32 * i;
            cp_async16(st + cp.as + 4096 * i, a + (size_t)(r < cp.nv ? r : 0) * row_bytes);
        }
    } else {
#pragma unroll
        for (int i = 0; i < TL::NPASS; i++) {
            const int r = cp.arow + TL::RP * i;
            if (r < TC_BM) {
                const uint8_t *src = a + (size_t)(r < cp.nv ? r : 0) * row_bytes;
                if (TT::PS == 16) cp_async16(st + cp.as + TT::AROW * TL::RP * i, src);
                else cp_async4(st + cp.as + TT::AROW * TL::RP * i, src);
            }
        }
    }
}

/* One stage in flight: the weight rows' data of elements kb*TC_BK .. + TC_BK and the tokens'
 * elements. */
template <int TYPE, bool WG, int PL>
__device__ __forceinline__ void tc_load_stage(uint8_t *st, const tc_copy &cp, size_t row_bytes, size_t plane, int K,
                                              int kb) {
    tc_load_a<TYPE, WG>(st, cp, row_bytes, kb);
    tc_load_b<PL>(st, cp, plane, K, kb);
}

/* A lane's 8 elements 32 j + 8 t .. + 7 of stage kb's staged row r, as four f16x2 registers
 * (element pairs 0-1, 2-3, 4-5, 6-7) of exact integers, and the factor s that takes their
 * block of 32 to the weights; for the types with mins (tc_traits MIN) also the lane's min as
 * an f16 pair m (the same for its 8 elements) and its factor s2, the weight of those 8
 * elements being s a + s2 m:
 *   - Q8_0: a = q, s = d.                                  F16: a = the element, s = 1.
 *   - IQ2_XXS: a = +-mag (8, 25, 43; the group's sign bits flip the f16 signs), s =
 *     d (2 ls + 1) / 8 (exact: ds4_quant.c's ((d (0.5 + ls)) 0.25) mag sign).
 *   - Q2_K: a = sc q (<= 45, sc the 16-group's scale), s = d; m = the group's min, s2 = -dmin.
 *   - Q4_K: a = q, s = d sc; m = 1, s2 = -dmin mn (sc, mn the 32-group's).
 * grid, s8tab: IQ2_XXS's tables in shared memory.  Q8_0's staged rows are AP bytes apart, the
 * stage's first block ao bytes into each (AP = 68, ao = 0, except with A by tensor copies: 80
 * and (68 kb) % 16, or with stages of four blocks 144 and (136 kb) % 16, see k_tc_wgmma). */
template <int TYPE, int AP = 68, int SJ = 2>
__device__ __forceinline__ void tc_frag_a(const uint8_t *As, int r, int j, int t, int kb, const uint4 *grid,
                                          const uint8_t *s8tab, uint32_t (&a)[4], float &s, uint32_t &m, float &s2,
                                          int ao = 0) {
    m = 0;
    s2 = 0.0f;
    if (TYPE == DS4_TYPE_F16) {
        const uint4 v = *(const uint4 *)(As + 128 * r + tc_swz(r, 4 * j + t));
        a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
        s = 1.0f;
    } else if (TYPE == DS4_TYPE_Q8_0) {
        /* block j at 34 j of the row (AP r + ao: 4-byte aligned): quants at + 2, the lane's at
         * + 8 t, 2 past a word boundary for even j, on one for odd j */
        const uint8_t *blk = As + AP * r + ao + 34 * j;
        s = dsq_f16(*(const uint16_t *)blk);
        const uint8_t *q = blk + 2 + 8 * t;
        uint32_t lo, hi;
        if (j & 1) {
            lo = *(const uint32_t *)q;
            hi = *(const uint32_t *)(q + 4);
        } else {
            const uint32_t a0 = *(const uint16_t *)q, a1 = *(const uint32_t *)(q + 2), a2 = *(const uint16_t *)(q + 6);
            lo = a0 | (a1 << 16);
            hi = (a1 >> 16) | (a2 << 16);
        }
        tc_i8x4_f16(lo, a[0], a[1]);
        tc_i8x4_f16(hi, a[2], a[3]);
    } else if (TYPE == DS4_TYPE_IQ2_XXS) {
        /* the super-block starts o = 0 or 2 bytes into the staged row (tc_stage_src; SJ = 4, A
         * by tensor copies: ao, 0 to 14, into an AP-byte row, stage kb its half kb % 2); record
         * jj = the stage's 32-block j of it, the lane's group t */
        const int jj = SJ == 4 ? 4 * (kb & 1) + j : 2 * (kb & 3) + j;
        const uint32_t o = SJ == 4 ? (uint32_t)ao : 2u * ((uint32_t)kb >> 2 & 1u);
        const uint8_t *blk = As + AP * r + o;
        uint32_t iw, w;
        dsq_iq2_rec(blk, jj, SJ == 4 ? (o + 2u) & 3u : 2u - o, &iw, &w);
        s = dsq_f16(*(const uint16_t *)blk) * (float)((w >> 27) | 1u) * 0.125f;   /* exact */
        const uint32_t s8 = s8tab[(w >> (7 * t)) & 127u];
        const uint4 G = grid[dsq_byte(iw, t)];
        a[0] = G.x ^ ((s8 * 0x40008000u) & 0x80008000u);
        a[1] = G.y ^ ((s8 * 0x10002000u) & 0x80008000u);
        a[2] = G.z ^ ((s8 * 0x04000800u) & 0x80008000u);
        a[3] = G.w ^ ((s8 * 0x01000200u) & 0x80008000u);
    } else if (TYPE == DS4_TYPE_Q2_K) {
        /* 32-block jj: groups 2 jj, 2 jj + 1 of 16; the lane's 8 elements are in group
         * 2 jj + t / 2, qs bytes 16 + 32 (jj / 4) + 8 t .. + 7 at bit pair jj % 4 */
        const int jj = SJ == 4 ? 4 * (kb & 1) + j : 2 * (kb & 3) + j;
        const uint8_t *blk = SJ == 4 ? As + AP * r + ao : As + 84 * r;
        const uint32_t scb = blk[2 * jj + (t >> 1)];
        const uint32_t *qw = (const uint32_t *)(blk + 16 + 32 * (jj >> 2) + 8 * t);
        const int sh = 2 * (jj & 3);
        tc_u8x4_f16(((qw[0] >> sh) & 0x03030303u) * (scb & 15u), a[0], a[1]);
        tc_u8x4_f16(((qw[1] >> sh) & 0x03030303u) * (scb & 15u), a[2], a[3]);
        s = dsq_f16(*(const uint16_t *)(blk + 80));
        s2 = -dsq_f16(*(const uint16_t *)(blk + 82));
        uint32_t m1;
        tc_u8x4_f16(scb >> 4, m, m1);
        m = __byte_perm(m, m, 0x1010);                   /* (min, min) */
    } else {                                              /* Q4_K */
        /* 32-block jj = group jj: qs bytes 16 + 32 (jj / 2) + 8 t .. + 7, nibble jj % 2 */
        const int jj = SJ == 4 ? 4 * (kb & 1) + j : 2 * (kb & 3) + j;
        const uint8_t *blk = SJ == 4 ? As + AP * r : As + 144 * r;
        const uint32_t *qw = (const uint32_t *)(blk + 16 + 32 * (jj >> 1) + 8 * t);
        const int sh = 4 * (jj & 1);
        tc_u8x4_f16((qw[0] >> sh) & 0x0f0f0f0fu, a[0], a[1]);
        tc_u8x4_f16((qw[1] >> sh) & 0x0f0f0f0fu, a[2], a[3]);
        int sc, mn;
        dsq_q4k_scale_min(blk + 4, jj, &sc, &mn);
        s = dsq_mul(dsq_f16(*(const uint16_t *)blk), (float)sc);
        s2 = -dsq_mul(dsq_f16(*(const uint16_t *)(blk + 2)), (float)mn);
        m = 0x3c003c00u;                                  /* (1, 1) */
    }
}

/* The matrices of one launch (gemm_tc_multi): segment s = blockIdx.z is w[s] (nrows[s] rows),
 * written to y[s] (row stride ldy[s]) from part part[s] of the split. */
struct tc_segs {
    const uint8_t *w[TC_SEG_MAX];
    float *y[TC_SEG_MAX];
    int64_t ldy[TC_SEG_MAX];
    size_t xoff[TC_SEG_MAX];            /* part * part_bytes */
    int part[TC_SEG_MAX];
    int nrows[TC_SEG_MAX];
    int tg;             /* a plain product's token tiles a group (tc_pos_of); 0 in a grouped one */
};

/* A block's row tile (x) and token tile (y).  A grouped product's grid is row tiles (x) x its
 * tiles (y).  A plain product's grid is its row tiles x token tiles flattened into x, in groups
 * of sg.tg token tiles, token tiles first within a group: the blocks that read a row tile's
 * weights run in one wave, where row tiles first would read a matrix larger than L2 from
 * memory once per token tile; a group's activations (gemm_tc_multi sizes sg.tg) stay in L2
 * while its row tiles go by.  Only which block does a tile changes, not its sums. */
__device__ __forceinline__ int2 tc_pos_of(const tc_segs &sg, const int4 *tiles, int nt) {
    if (tiles || sg.tg <= 0) return make_int2((int)blockIdx.x, (int)blockIdx.y);
    const int ntt = (nt + TC_BN - 1) / TC_BN, nrt = (int)gridDim.x / ntt;
    const int per = sg.tg * nrt, g = (int)blockIdx.x / per, l = (int)blockIdx.x - g * per;
    const int gs = min(sg.tg, ntt - g * sg.tg);     /* the last group may be short */
    return make_int2(l / gs, g * sg.tg + l % gs);
}

/* A block's matrix and tokens (both kernels): segment blockIdx.z's weights (matrix tiles[tt].x
 * of a grouped product), its part of the split, and tokens t0 .. t1 - 1 of token tile tt. */
struct tc_blk {
    const uint8_t *w;
    const __half *xs;
    int t0, t1;
    int mat;            /* the matrix of a grouped product (0 otherwise) */
};
__device__ __forceinline__ tc_blk tc_block_of(const tc_segs &sg, size_t mat_bytes, const uint8_t *xs_all,
                                              const int4 *tiles, int nt, int tt) {
    tc_blk b;
    const int si = blockIdx.z;
    b.w = sg.w[si];
    b.xs = (const __half *)(xs_all + sg.xoff[si]);
    b.t0 = tt * TC_BN;
    b.t1 = b.t0 + TC_BN < nt ? b.t0 + TC_BN : nt;
    b.mat = 0;
    if (tiles) {
        const int4 tl = tiles[tt];
        b.mat = tl.x;
        b.w += mat_bytes * (size_t)tl.x;
        b.t0 = tl.y;
        b.t1 = tl.z;
    }
    return b;
}

/* IQ2_XXS's tables in shared memory, by a block of NT >= 256 threads: the grid as f16
 * magnitude pairs and the sign bytes. */
template <int NT = TC_THREADS>
__device__ __forceinline__ void tc_iq2_tables(uint4 *grid, uint8_t *s8tab) {
    static_assert(NT >= 256, "tc_iq2_tables: a thread per grid entry");
    if (NT == 256 || threadIdx.x < 256) grid[threadIdx.x] = dsq_iq2_grid_entry(threadIdx.x);
    if (threadIdx.x < 128) s8tab[threadIdx.x] = (uint8_t)dsq_iq2_s8(threadIdx.x);
}

/* Block (TC_BM rows, a token tile tt, z: a segment; tc_pos_of) of y = x W^T.  A tile is
 * tiles[tt] (grouped: the matrix e = tile.x, tokens tile.y .. tile.z - 1, at most TC_BN, none
 * in the empty tiles that pad a grid sized before the grouping: ds4_cuda_moe.cu) or, with
 * tiles NULL, tokens TC_BN tt .. up to nt.  Matrix e of a segment starts mat_bytes * e into
 * its w. */
template <int TYPE, int PL>
__global__ void __launch_bounds__(TC_THREADS, 2)
k_tc_gemm(const tc_segs sg, size_t mat_bytes, size_t row_bytes, int K, const uint8_t *xs_all, int ntp,
          const int4 *tiles, int nt) {
    ds4_grid_dep();
    typedef tc_traits<TYPE> TT;
    extern __shared__ __align__(16) uint8_t tc_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int si = blockIdx.z;                      /* the block's segment */
    const int nrows = sg.nrows[si];
    const int2 pos = tc_pos_of(sg, tiles, nt);
    const int row0 = pos.x * TC_BM;
    if (row0 >= nrows) return;                      /* a segment with fewer row tiles than the grid's */
    const size_t plane = (size_t)ntp * K;
    const tc_blk bk = tc_block_of(sg, mat_bytes, xs_all, tiles, nt, pos.y);
    if (bk.t0 >= bk.t1) return;                     /* an empty tile (a grid sized for the most tiles) */
    const uint8_t *w = bk.w;
    const __half *xs = bk.xs;
    const int t0 = bk.t0, t1 = bk.t1;
    /* IQ2_XXS: the grid as f16 magnitude pairs and the sign bytes, after the stages (the main
     * loop's first barrier orders these stores before any read) */
    constexpr int SB = tc_tile<TYPE, false, false, PL>::STAGE;
    const uint4 *grid = (const uint4 *)(tc_smem + TC_ST * SB);
    const uint8_t *s8tab = (const uint8_t *)(grid + 256);
    if (TYPE == DS4_TYPE_IQ2_XXS) tc_iq2_tables((uint4 *)grid, (uint8_t *)s8tab);
    const int wr0 = (warp & 3) * 32, wn0 = (warp >> 2) * 32;    /* the warp's rows and tokens in the block */
    /* the lane's rows: tile row g of (mi, h) (h = 0: the m16 tile's row g, 1: row g + 8) is the
     * warp's row pg + 4 mi + 2 h, so that the 8 rows one load touches (pg = 0, 1, 8, 9, 16, 17,
     * 24, 25 plus a constant: 68-byte rows start on banks 17 pg mod 32 = 0, 17, 8, 25, 16, 1,
     * 24, 9; 84-byte Q2_K rows on 21 pg mod 32 = 0, 21, 8, 29, 16, 5, 24, 13) and the lanes'
     * word offsets 2 t fall on 32 distinct banks */
    const int pg = wr0 + (g & 1) + 8 * (g >> 1);
    const tc_copy cp = tc_copy_plan<TYPE, false>(w, row_bytes, row0, nrows, xs, K, t0);
    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[mi][ni][c] = 0.0f;

    const int nk = K / TC_BK;
#pragma unroll
    for (int s = 0; s < TC_ST - 1; s++) {
        if (s < nk) tc_load_stage<TYPE, false, PL>(tc_smem + s * SB, cp, row_bytes, plane, K, s);
        cp_async_commit();
    }
    for (int kb = 0; kb < nk; kb++) {
        cp_async_wait<TC_ST - 2>();
        __syncthreads();
        {
            const int nx = kb + TC_ST - 1;
            if (nx < nk) tc_load_stage<TYPE, false, PL>(tc_smem + (nx % TC_ST) * SB, cp, row_bytes, plane, K, nx);
            cp_async_commit();
        }
        const uint8_t *As = tc_smem + (kb % TC_ST) * SB, *Bs = As + TC_BM * TT::AROW;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            /* the lane's A of both m tiles for block j, then one n tile's PL parts at a time */
            uint32_t a[2][2][4], m[2][2];
            float d[2][2], d2[2][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                tc_frag_a<TYPE>(As, pg + 4 * mi, j, t, kb, grid, s8tab, a[mi][0], d[mi][0], m[mi][0], d2[mi][0]);
                tc_frag_a<TYPE>(As, pg + 4 * mi + 2, j, t, kb, grid, s8tab, a[mi][1], d[mi][1], m[mi][1], d2[mi][1]);
            }
#pragma unroll
            for (int n2 = 0; n2 < 4; n2 += 2) {
                uint4 bf[2][PL];
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int n = wn0 + 8 * (n2 + q) + g;
#pragma unroll
                    for (int p = 0; p < PL; p++) bf[q][p] = *(const uint4 *)(Bs + (p * TC_BN + n) * 128 + tc_swz(n, 4 * j + t));
                }
                /* pass 0: the weights' integers a; pass 1 (types with mins): the min m */
#pragma unroll
                for (int pass = 0; pass < 1 + TT::MIN; pass++) {
                    float c[2][2][4] = {};
#pragma unroll
                    for (int p = 0; p < PL; p++)
#pragma unroll
                        for (int hf = 0; hf < 2; hf++)
#pragma unroll
                            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                                for (int q = 0; q < 2; q++) {
                                    const uint2 b = hf ? make_uint2(bf[q][p].z, bf[q][p].w) : make_uint2(bf[q][p].x, bf[q][p].y);
                                    if (pass == 0)
                                        mma_f16_16816(c[mi][q], a[mi][0][2 * hf], a[mi][1][2 * hf], a[mi][0][2 * hf + 1],
                                                      a[mi][1][2 * hf + 1], b);
                                    else
                                        mma_f16_16816(c[mi][q], m[mi][0], m[mi][1], m[mi][0], m[mi][1], b);
                                }
#pragma unroll
                    for (int mi = 0; mi < 2; mi++)
#pragma unroll
                        for (int q = 0; q < 2; q++) {
                            float *ac = acc[mi][n2 + q];
                            if (TYPE == DS4_TYPE_F16) {
#pragma unroll
                                for (int e = 0; e < 4; e++) ac[e] += c[mi][q][e];
                            } else {
                                const float f0 = pass ? d2[mi][0] : d[mi][0], f1 = pass ? d2[mi][1] : d[mi][1];
                                ac[0] = fmaf(f0, c[mi][q][0], ac[0]);
                                ac[1] = fmaf(f0, c[mi][q][1], ac[1]);
                                ac[2] = fmaf(f1, c[mi][q][2], ac[2]);
                                ac[3] = fmaf(f1, c[mi][q][3], ac[3]);
                            }
                        }
                }
            }
        }
    }
    /* c0, c1: the lane's row pg + 4 mi (h = 0), tokens 2t, 2t+1; c2, c3: row pg + 4 mi + 2 (h = 1) */
    float *y = sg.y[si];
    const int64_t ldy = sg.ldy[si];
    const float *inv = (const float *)(xs + 3 * plane);
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int n = t0 + wn0 + 8 * ni + 2 * t + e;
            if (n >= t1) continue;
            const float f = inv[n];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = row0 + pg + 4 * mi + 2 * h;
                    if (r < nrows) y[(int64_t)n * ldy + r] = acc[mi][ni][2 * h + e] * f;
                }
        }
    }
}

/* ---------------------------------------------------------------------------
 * The product on sm_90's warpgroup MMAs (wgmma)
 * ------------------------------------------------------------------------- */

/* Built where the compiler targets sm_90a (the H100's and H200's own instruction set); the
 * compute_90 PTX of an sm_90 build, and every other architecture, has an empty kernel that the
 * host never launches (tc_wg_dev). */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TCW_ON 1
#endif

/* A shared-memory operand's descriptor: K-major rows of 128 bytes in the 128-byte swizzle,
 * groups of 8 rows 1 KiB apart (stride 1024 >> 4 = 64), the leading offset unused (1). A k16
 * step inside the 128 bytes is the start address plus 32 k16 (the swizzle is a function of
 * the address, the stage 1 KiB aligned). */
__device__ __forceinline__ uint64_t tcw_desc(const void *smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void tcw_fence(void) {
#ifdef TCW_ON
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void tcw_commit(void) {
#ifdef TCW_ON
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void tcw_wait(void) {
#ifdef TCW_ON
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
/* The TMA stages (DS4_CUDA_PREFILL_TC=3, 4): a stage's mbarrier, which completes when its
 * tensor copies (B; with 4 A too) have landed, and the copy of a box into this block's shared
 * memory. */
__device__ __forceinline__ uint32_t tcw_saddr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void tcw_mbar_init(uint64_t *bar, unsigned count) {
#ifdef TCW_ON
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tcw_saddr(bar)), "r"(count) : "memory");
#endif
}
/* The producer's arrival, with the bytes the phase waits for. */
__device__ __forceinline__ void tcw_mbar_expect(uint64_t *bar, unsigned bytes) {
#ifdef TCW_ON
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tcw_saddr(bar)), "r"(bytes)
                 : "memory");
#endif
}
/* Waits until the phase of the given parity has completed. */
__device__ __forceinline__ void tcw_mbar_wait(uint64_t *bar, unsigned parity) {
#ifdef TCW_ON
    uint32_t done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(tcw_saddr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
/* The box at (c0, c1, c2, c3) of the tensor map into dst, completing on bar. */
__device__ __forceinline__ void tcw_tma(void *dst, const CUtensorMap *tm, int c0, int c1, int c2, int c3,
                                        uint64_t *bar) {
#ifdef TCW_ON
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(tcw_saddr(dst)),
        "l"((uint64_t)tm), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(tcw_saddr(bar))
        : "memory");
#endif
}

/* The same from a 3-d map (the weights: byte c0 of row c1 of matrix c2). */
__device__ __forceinline__ void tcw_tma3(void *dst, const CUtensorMap *tm, int c0, int c1, int c2, uint64_t *bar) {
#ifdef TCW_ON
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(tcw_saddr(dst)),
        "l"((uint64_t)tm), "r"(c0), "r"(c1), "r"(c2), "r"(tcw_saddr(bar))
        : "memory");
#endif
}

/* The 128 threads of warpgroup wg (warps 4 wg .. 4 wg + 3) wait for one another: named barrier
 * 1 + wg (0 is the block's). */
__device__ __forceinline__ void tcw_wg_sync(int wg) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

/* Keeps the compiler from moving reads of an accumulator across a wait (the registers are
 * written by the tensor core, not by any instruction it sees after the MMA). */
__device__ __forceinline__ void tcw_hold(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* d = A B (+ d where ACC): A the warpgroup's 64 rows x 16 k from registers (each warp its 16
 * rows, the m16n8k16 A fragment), B 64 tokens x 16 k at descriptor b. */
template <int ACC>
__device__ __forceinline__ void tcw_mma(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint64_t b) {
#ifdef TCW_ON
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "n"(ACC)
        : "memory");
#endif
}

/* One block of 32 k (and pass) for the warpgroup: 2 PL MMAs, k16 steps hf x parts p, the first
 * from zero.  db: the descriptor of the stage's B (tcw_desc), whose address field takes the
 * offsets of part p and step hf of block j as a sum (an address in shared memory stays under
 * 2^18); a[h]: the lane's rows g (h = 0) and g + 8 (h = 1). */
template <int PL>
__device__ __forceinline__ void tcw_block(float (&c)[32], const uint32_t (&a0)[4], const uint32_t (&a1)[4],
                                          uint64_t db, int j) {
#pragma unroll
    for (int hf = 0; hf < 2; hf++)
#pragma unroll
        for (int p = 0; p < PL; p++) {
            const uint64_t b = db + (uint64_t)((p * TC_BN * 128 + 32 * (2 * j + hf)) >> 4);
            if (hf == 0 && p == 0) tcw_mma<0>(c, a0[0], a1[0], a0[1], a1[1], b);
            else tcw_mma<1>(c, a0[2 * hf], a1[2 * hf], a0[2 * hf + 1], a1[2 * hf + 1], b);
        }
}
/* The same with one register pair for all of A (the mins' pass: m per row, all k). */
template <int PL>
__device__ __forceinline__ void tcw_block_min(float (&c)[32], uint32_t m0, uint32_t m1, uint64_t db, int j) {
    const uint32_t a0[4] = { m0, m0, m0, m0 }, a1[4] = { m1, m1, m1, m1 };
    tcw_block<PL>(c, a0, a1, db, j);
}

/* acc += s c, row g (elements 4 i, 4 i + 1) by s0 and row g + 8 by s1 (F16: plain sums). */
template <int TYPE>
__device__ __forceinline__ void tcw_fold(float (&acc)[32], float (&c)[32], float s0, float s1) {
    tcw_hold(c);
#pragma unroll
    for (int i = 0; i < 32; i++) {
        if (TYPE == DS4_TYPE_F16) acc[i] += c[i];
        else acc[i] = fmaf((i & 2) ? s1 : s0, c[i], acc[i]);
    }
}

/* TA: the byte of a weight row where stage kb's data starts (its box starts at the 16-byte
 * boundary at or below it): Q8_0, SJ blocks of 34 bytes a stage; the super-block types (SJ =
 * 4), the super-block whose half the stage is (IQ2_XXS 66 bytes a 256, Q2_K 84, Q4_K 144). */
template <int TYPE, int SJ>
__device__ __forceinline__ int tcw_a_src(int kb) {
    return TYPE == DS4_TYPE_IQ2_XXS ? 66 * (kb >> 1)
           : TYPE == DS4_TYPE_Q2_K  ? 84 * (kb >> 1)
           : TYPE == DS4_TYPE_Q4_K  ? 144 * (kb >> 1)
                                    : kb * 34 * SJ;
}

/* The weights' tensor maps of a launch (TA): segment s's matrices as [nmat][nrows][row_bytes]
 * bytes, a box of APITCH bytes (tc_tile) x the block's 256 rows x 1 matrix (tc_a_maps). */
struct tc_amaps {
    CUtensorMap m[TC_SEG_MAX];
};

/* k_tc_gemm's block on wgmma: the same tile (TC_BM = 128 rows x TC_BN = 64 tokens; 256 rows
 * with TA, below), grid, segments, tiles, A fragments and sums, the MMAs issued by warpgroups.
 * Warpgroup wg (warps 4 wg .. 4 wg + 3) computes rows 64 wg .. + 63 of the tile for all 64
 * tokens: m64n64k16, A
 * (the converted weights) from registers, B (the parts) from the stage by descriptor.
 *   A warp's accumulator rows g and g + 8 of its 16 are the tile rows pr and pr + DR (DR = 2,
 *   pr k_tc_gemm's pg spread over the 4 warps of a warpgroup, so that a warp's loads of the
 *   68-byte rows hit 32 banks; with A by tensor copies, TA below, DR = 8).
 *   Per stage (two blocks of 32 k): both blocks' A fragments, a fence, each block's 2 PL MMAs
 *   into its own accumulator set c from zero and a commit per block; a wait for the first
 *   block and its fold into acc (one FMA by s per element), then a wait for the second and its
 *   fold.  Blocks fold in order, as in k_tc_gemm.  The first fold is written to overlap the
 *   second block's MMAs, but ptxas may schedule it after the second wait (it does for Q8_0:
 *   bench/RESULTS.md, fourteenth session); the SM's other warpgroups keep the tensor pipe busy
 *   meanwhile.  (A wait that leaves a group of the next stage in flight makes ptxas serialise
 *   every wgmma.)
 *   Stages: ST buffers, stage kb + ST - 1 copied while kb is read, into kb - 1's buffer, whose
 *   MMAs every warpgroup waited for before the barrier.  cp.async writes through the generic
 *   proxy and wgmma reads through the async one: a proxy fence after each stage lands, before
 *   the barrier.
 *   TA (Q8_0 with TB, DS4_CUDA_PREFILL_TC=4): the thread that issues the stage's B copies its A
 *   too, as a second tensor copy on the same mbarrier: the TC_APITCH = 80 bytes from (68 kb)
 *   rounded down to 16 of each of the tile's rows (a box's inner size is a multiple of 16 bytes, and its start
 *   is kept on 16), packed 80 bytes apart; the stage's data starts ao = (68 kb) % 16 into each
 *   row, and the last stage's box ends at the row's end (K is a multiple of 256: four stages
 *   are 272 bytes).  Rows past the matrix are zeros (never stored).  At an 80-byte pitch the
 *   A fragments' rows g and g + 8 are tile rows 16 w4 + g and + 8 of the warpgroup's 64 (rows
 *   0..7 at word offsets 20 g mod 32, eight distinct multiples of 4: a 4-byte load of the
 *   lanes' t = 0..3 is two-way on the banks, against four ways for the 68-byte layout's rows).
 *   The buffer a tensor copy refills was last read by the threads (A) and the MMAs (B) before
 *   the barrier (TA: its warpgroups' barriers, below); every thread's proxy fence before it
 *   orders its reads before the async proxy's writes.
 *   TA on two planes (SJ = 4; TC_WIDE 0 at build time keeps two): a stage is four blocks of 32
 *   k, 136 bytes of each row, boxed as the 144 from (136 kb) rounded down to 16 (ao 0 or 8;
 *   the last stage's box again ends at the row's end), and its B two tensor copies of 64 k
 *   (blocks 2 and 3 read the second).  A row's 128 k then cost 5 sectors of L2, not 6 (the
 *   144-byte pitch puts rows 0..7 at word offsets 4 g: two-way, as at 80), and a stage's
 *   refill, wait and release serve twice the MMAs.
 *   IQ2_XXS with TA (two planes): the same releases by warpgroup, in blocks of three
 *   warpgroups (TC_IQ2_NWG: 192 rows, 384 threads), stages of four blocks (a super-block's
 *   half, kb % 2), A the whole super-block's 66 bytes as the 80 from the 16-byte boundary at
 *   or below them (ao = (66 (kb / 2)) % 16, 0 to 14: the record loads stay inside the box;
 *   tc_frag_a, SJ = 4), copied twice a super-block where the 128-row blocks' cp.async copy
 *   it four times.  Its A fragments take more registers than Q8_0's: three warpgroups take
 *   144 of their 168, where four (TC_IQ2_NWG 4 at build time) spill 48 bytes at 128 and
 *   measured slower (LEAN keeps the block's coordinates in shared memory, so that none is
 *   held through the loop).
 *   Q2_K and Q4_K with TA (two planes) keep 128-row blocks (their mins' second accumulator
 *   set takes 226-230 registers): A the super-block as the box from the 16-byte boundary at or
 *   below it (Q2_K 96 bytes, ao 0 to 12; Q4_K 144, ao 0), stages of four blocks, four
 *   buffers, one stage a round with a block barrier (every warpgroup done with stage kb - 1,
 *   whose buffer then takes kb + 3), its four blocks and their mins' passes in the ping-pong,
 *   folded in order: the same sums as the cp.async blocks, whose every thread copied each
 *   super-block four times in 4-byte (Q2_K) or 16-byte pieces.
 *   TA's blocks are wide: NWG = 4 warpgroups (IQ2_XXS: 3), BM = 256 rows, 512 threads, one block
 *   per SM, so that a stage's B (the activations' planes, 16 KiB on two) serves twice the rows:
 *   a block-stage reads 36 KiB for 2.1 M multiply-adds where two 128-row blocks read 52 KiB (on
 *   an H100 these reads bound the products in part; on an H200, with more bandwidth, they do
 *   not: bench/RESULTS.md).  Such a block has no barrier per stage: a warpgroup done with stage
 *   x (its MMAs waited for, its threads' reads of A fenced) syncs its own 128 threads (named
 *   barrier 1 + wg), and its first thread counts the release in shared memory (rel: NWG a
 *   refill, never reset); the warpgroup that counts last issues stage x + ST's copies into that
 *   buffer.  So the prologue copies all ST stages (every buffer is free), and each warpgroup
 *   waits only for its stage's data (the mbarrier): the NWG drift apart by up to ST - 1 stages.
 *   A warpgroup takes two stages a round (SJ = 4: one), their four blocks in a ping-pong (the
 *   next block's MMAs issued before the last one is folded), so that its MMAs are in flight
 *   through all folds but the round's last.  The MMAs, folds and their order are each
 *   warpgroup's as in a 128-row block: the same sums. */
template <int TYPE, bool TB, bool TA, int PL = 3, int NWG = TA ? 4 : 2>
__global__ void __launch_bounds__(128 * NWG, tc_traits<TYPE>::MIN || NWG > 2 ? 1 : 2)
k_tc_wgmma(const tc_segs sg, size_t mat_bytes, size_t row_bytes, int K, const uint8_t *xs_all, int ntp,
           const int4 *tiles, int nt, const __grid_constant__ CUtensorMap tm, const __grid_constant__ tc_amaps am) {
    ds4_grid_dep();
#ifdef TCW_ON
    typedef tc_traits<TYPE> TT;
    extern __shared__ __align__(16) uint8_t tcw_smem_raw[];
    uint8_t *smem = tcw_smem_raw + ((1024u - ((uint32_t)__cvta_generic_to_shared(tcw_smem_raw) & 1023u)) & 1023u);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int si = blockIdx.z;
    const int nrows = sg.nrows[si];
    static_assert(!TA || (TB && (TYPE == DS4_TYPE_Q8_0 || (TYPE != DS4_TYPE_F16 && PL == 2))),
                  "k_tc_wgmma: A by tensor copies is Q8_0's and the super-block types' on two planes, with B's");
    static_assert(PL == 2 || PL == 3, "k_tc_wgmma: two or three planes");
    static_assert(TC_ROUND == 1 || TC_ROUND == 2 || TC_ROUND == 4, "k_tc_wgmma: 1, 2 or 4 stages a round");
    static_assert(TA ? (TT::MIN ? NWG == 2 : NWG == 4 || (TYPE == DS4_TYPE_IQ2_XXS && NWG == 3)) : NWG == 2,
                  "k_tc_wgmma: four warpgroups with A by tensor copies (IQ2_XXS: or three; the types with "
                  "mins: two), else two");
    typedef tc_tile<TYPE, true, TA, PL, NWG> TL;
    constexpr bool REL = NWG > 2;           /* the stages released by warpgroup, no block barrier */
    /* PP: the types with mins (one block an SM, registers to spare) take two stages a round, a
     * block barrier each round (IQ2_XXS's 128 registers, two blocks an SM, would spill) */
    constexpr bool PP = !REL && TT::MIN;
    const int2 pos = tc_pos_of(sg, tiles, nt);
    const int row0 = pos.x * TL::BM;
    if (row0 >= nrows) return;
    const size_t plane = (size_t)ntp * K;
    const tc_blk bk = tc_block_of(sg, mat_bytes, xs_all, tiles, nt, pos.y);
    if (bk.t0 >= bk.t1) return;                     /* an empty tile (a grid sized for the most tiles) */
    const uint8_t *w = bk.w;
    const __half *xs = bk.xs;
    const int t0 = bk.t0, t1 = bk.t1;
    constexpr int SB = TL::STAGE, AB = TL::ABYTES, ST = TL::ST, SJ = TL::SJ;
    static_assert(SJ == 2 || TA, "k_tc_wgmma: stages of four blocks are TA's");
    const uint4 *grid = (const uint4 *)(smem + ST * SB);
    const uint8_t *s8tab = (const uint8_t *)(grid + 256);
    if (TYPE == DS4_TYPE_IQ2_XXS) tc_iq2_tables<128 * NWG>((uint4 *)grid, (uint8_t *)s8tab);
    const int w4 = warp & 3;
    /* the lane's A rows: pr (fragment row g) and pr + DR (g + 8) */
    constexpr int DR = TA ? 8 : 2;
    const int pr = TA ? 64 * (warp >> 2) + 16 * w4 + g
                      : 64 * (warp >> 2) + (g & 1) + 8 * (g >> 1) + 4 * (w4 & 1) + 32 * (w4 >> 1);
    const tc_copy cp = tc_copy_plan<TYPE, true>(w, row_bytes, row0, nrows, xs, K, t0);
    float acc[32], c[2][32], cm[2][32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = c[0][i] = c[1][i] = cm[0][i] = cm[1][i] = 0.0f;

    const uint64_t db0 = tcw_desc(smem + AB);      /* stage 0's B */
    const int nk = K / (32 * SJ);
    /* TB: full[s] completes when buffer s's B has landed (thread 0 arrives with its bytes) */
    uint64_t *full = (uint64_t *)(smem + ST * SB + TT::SMEM_EXTRA);
    const int part = sg.part[si];
    /* REL: rel[s] counts the warpgroups' releases of buffer s (NWG a refill, never reset) */
    __shared__ int rel[REL ? ST : 1];
    /* LEAN (IQ2_XXS with TA, whose A fragments take more registers than Q8_0's): the block's
     * first token, end, first row and matrix, read from shared memory by the copies' issue and
     * the stores after the loop, so that no register holds them through it */
    constexpr bool LEAN = REL && TYPE == DS4_TYPE_IQ2_XXS;
    __shared__ int bc[LEAN ? 4 : 1];
    if (TB) {
        if (threadIdx.x == 0) {
            if (LEAN) {
                bc[0] = t0;
                bc[1] = t1;
                bc[2] = row0;
                bc[3] = bk.mat;
            }
#pragma unroll
            for (int st = 0; st < ST; st++) tcw_mbar_init(full + st, 1);
            if (REL)
                for (int st = 0; st < ST; st++) rel[st] = 0;
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
    }
    /* TB: stage kb's tensor copies, by one thread: the PL parts (B) and, with TA, A */
    auto issue = [&](int kb) {
        uint8_t *st = smem + (kb % ST) * SB;
        tcw_mbar_expect(full + kb % ST, TL::BBOX * (SJ / 2) + (TA ? TL::BM * TL::APITCH : 0));
#pragma unroll
        for (int h = 0; h < SJ / 2; h++)
            tcw_tma(st + AB + h * TL::BBOX, &tm, (kb * (SJ / 2) + h) * TC_BK, LEAN ? bc[0] : t0, 0, part,
                    full + kb % ST);
        if (TA)
            tcw_tma3(st, &am.m[si], tcw_a_src<TYPE, SJ>(kb) & ~15, LEAN ? bc[2] : row0, LEAN ? bc[3] : bk.mat,
                     full + kb % ST);
    };
    /* stage kb's copies into buffer kb % ST: A by every thread (cp.async), B by every thread
     * too or, with TB, by thread 0's one tensor copy of the PL parts; with TA, A by a
     * second tensor copy of thread 0's */
    auto load = [&](int kb) {
        uint8_t *st = smem + (kb % ST) * SB;
        if (!TB) {
            tc_load_stage<TYPE, true, PL>(st, cp, row_bytes, plane, K, kb);
            return;
        }
        if (!TA) tc_load_a<TYPE, true>(st, cp, row_bytes, kb);
        if (threadIdx.x == 0) issue(kb);
    };
    /* the first stages' copies: ST - 1, the last buffer filled in the loop's first stage; REL:
     * all ST; PP: the first round's two */
#pragma unroll
    for (int st = 0; st < (REL ? ST : PP && !TA ? 2 : ST - 1); st++) {
        if (st < nk) load(st);
        cp_async_commit();
    }
    if constexpr (REL) {
        /* TC_ROUND stages a round, their blocks in a ping-pong: block b + 1's MMAs are issued
         * before block b is waited for and folded, so a warpgroup has a block's MMAs in flight
         * through each fold but the round's last, and the blocks are folded in order: the
         * same sums.  A block's A registers (a[b % 2]) are rewritten only after its MMAs
         * completed (wgmma reads them asynchronously).  A stage's buffer is released once both
         * its blocks' MMAs have completed.  (A ping-pong across rounds would leave a block in
         * flight over the loop's back edge, which ptxas answers by serialising every wgmma.) */
        uint32_t a[2][2][4], m[2][2];
        float s[2][2], s2[2][2];
        /* block j of stage kb, into accumulator set q: its A fragments, then its MMAs (one
         * commit group); with four blocks a stage, blocks 2 and 3 read B's second box */
        auto frag_issue = [&](int kb, int j, int q) {
            const uint8_t *As = smem + (kb % ST) * SB;
            const int ao = tcw_a_src<TYPE, SJ>(kb) & 15;
            tc_frag_a<TYPE, TL::APITCH, SJ>(As, pr, j, t, kb, grid, s8tab, a[q][0], s[q][0], m[q][0], s2[q][0], ao);
            tc_frag_a<TYPE, TL::APITCH, SJ>(As, pr + DR, j, t, kb, grid, s8tab, a[q][1], s[q][1], m[q][1], s2[q][1],
                                            ao);
            tcw_fence();
            tcw_block<PL>(c[q], a[q][0], a[q][1], db0 + (uint64_t)(((kb % ST) * SB + (j >> 1) * TL::BBOX) >> 4), j & 1);
            tcw_commit();
        };
        /* this warpgroup is done with stage x (its threads' reads of A, its MMAs): the last of
         * the NWG to say so refills the buffer with stage x + ST */
        auto release = [&](int x) {
            if (x + ST >= nk) return;
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            tcw_wg_sync(warp >> 2);
            if ((threadIdx.x & 127) == 0) {
                __threadfence_block();
                if (atomicAdd(&rel[x % ST], 1) == NWG * (x / ST) + NWG - 1) {
                    __threadfence_block();
                    issue(x + ST);
                }
            }
        };
        /* RS stages a round: TC_ROUND of two blocks, one of four */
        constexpr int RS = SJ == 4 ? 1 : TC_ROUND;
        for (int kb = 0; kb < nk; kb += RS) {   /* nk is a multiple of 4 (two blocks a stage) or 2 (four): K of 256 */
            /* step b: block b of the round issued (stage kb + b / SJ, block b % SJ, in c[b % 2]),
             * then block b - 1 waited for and folded; with two blocks a stage, from step 3 on,
             * each odd step releases the stage whose blocks completed the step before (here,
             * where one block's A is live, not two) */
#pragma unroll
            for (int b = 0; b < SJ * RS; b++) {
                const int x = kb + b / SJ, j = b % SJ, q = b & 1;
                if (j == 0) tcw_mbar_wait(full + x % ST, (unsigned)(x / ST) & 1u);
                frag_issue(x, j, q);
                if (b > 0) {
                    tcw_wait<1>();
                    tcw_fold<TYPE>(acc, c[q ^ 1], s[q ^ 1][0], s[q ^ 1][1]);
                }
                if (SJ == 2 && b >= 3 && j == 1) release(kb + ((b - 3) >> 1));
            }
            tcw_wait<0>();                      /* the round's last block */
            tcw_fold<TYPE>(acc, c[1], s[1][0], s[1][1]);
            release(kb + RS - 1);
        }
    } else if constexpr (PP && TA) {
        /* The types with mins, A by tensor copies (two planes): one stage of four blocks a
         * round, in the ping-pong below (each block's two passes, then the last block's folds,
         * in order: the same sums), and a block barrier each round: every warpgroup is done
         * with stage kb - 1 (its MMAs waited for, its reads of A fenced), whose buffer then
         * takes kb + ST - 1 (the prologue copied ST - 1). */
        static_assert(SJ == 4, "k_tc_wgmma: the types with mins take A by tensor copies in stages of four blocks");
        uint32_t a[2][2][4], m[2][2];
        float s[2][2], s2[2][2];
        for (int kb = 0; kb < nk; kb++) {
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            if (threadIdx.x == 0 && kb + ST - 1 < nk) issue(kb + ST - 1);
            tcw_mbar_wait(full + kb % ST, (unsigned)(kb / ST) & 1u);
            const uint8_t *As = smem + (kb % ST) * SB;
            const int ao = tcw_a_src<TYPE, SJ>(kb) & 15;
#pragma unroll
            for (int b = 0; b < SJ; b++) {
                const int q = b & 1;
                tc_frag_a<TYPE, TL::APITCH, SJ>(As, pr, b, t, kb, grid, s8tab, a[q][0], s[q][0], m[q][0], s2[q][0],
                                                ao);
                tc_frag_a<TYPE, TL::APITCH, SJ>(As, pr + DR, b, t, kb, grid, s8tab, a[q][1], s[q][1], m[q][1],
                                                s2[q][1], ao);
                tcw_fence();
                const uint64_t db = db0 + (uint64_t)(((kb % ST) * SB + (b >> 1) * TL::BBOX) >> 4);
                tcw_block<PL>(c[q], a[q][0], a[q][1], db, b & 1);
                tcw_block_min<PL>(cm[q], m[q][0], m[q][1], db, b & 1);
                tcw_commit();
                if (b > 0) {
                    tcw_wait<1>();              /* block b - 1 done: fold it */
                    tcw_fold<TYPE>(acc, c[q ^ 1], s[q ^ 1][0], s[q ^ 1][1]);
                    tcw_fold<TYPE>(acc, cm[q ^ 1], s2[q ^ 1][0], s2[q ^ 1][1]);
                }
            }
            tcw_wait<0>();                      /* the round's last block */
            tcw_fold<TYPE>(acc, c[1], s[1][0], s[1][1]);
            tcw_fold<TYPE>(acc, cm[1], s2[1][0], s2[1][1]);
        }
    } else if constexpr (PP) {
        /* Two stages a round, their four blocks in a ping-pong as with REL (block b + 1's MMAs,
         * and the mins' pass, issued before block b is waited for and folded; the blocks folded
         * in order: the same sums), and a block barrier each round: stages kb and kb + 1 have
         * landed, every warpgroup is done with kb - 2 and kb - 1, whose buffers then take kb + 2
         * and kb + 3 (ST = 4). */
        static_assert(ST >= 4, "k_tc_wgmma: a round's two stages and the next round's two");
        uint32_t a[2][2][4], m[2][2];
        float s[2][2], s2[2][2];
        for (int kb = 0; kb < nk; kb += 2) {    /* nk is a multiple of 4: K of 256 */
            cp_async_wait<0>();
            /* !TB: cp.async's B, read by wgmma */
            if (!TB) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            if (kb + 2 < nk) load(kb + 2);
            cp_async_commit();
            if (kb + 3 < nk) load(kb + 3);
            cp_async_commit();
#pragma unroll
            for (int b = 0; b < 4; b++) {
                const int x = kb + (b >> 1), j = b & 1;
                const uint8_t *As = smem + (x % ST) * SB;
                tc_frag_a<TYPE, TL::APITCH>(As, pr, j, t, x, grid, s8tab, a[j][0], s[j][0], m[j][0], s2[j][0]);
                tc_frag_a<TYPE, TL::APITCH>(As, pr + DR, j, t, x, grid, s8tab, a[j][1], s[j][1], m[j][1], s2[j][1]);
                if (TB && j == 0) tcw_mbar_wait(full + x % ST, (unsigned)(x / ST) & 1u);
                tcw_fence();
                const uint64_t db = db0 + (uint64_t)((x % ST) * SB >> 4);
                tcw_block<PL>(c[j], a[j][0], a[j][1], db, j);
                if (TT::MIN) tcw_block_min<PL>(cm[j], m[j][0], m[j][1], db, j);
                tcw_commit();
                if (b > 0) {
                    tcw_wait<1>();              /* block b - 1 done: fold it */
                    tcw_fold<TYPE>(acc, c[j ^ 1], s[j ^ 1][0], s[j ^ 1][1]);
                    if (TT::MIN) tcw_fold<TYPE>(acc, cm[j ^ 1], s2[j ^ 1][0], s2[j ^ 1][1]);
                }
            }
            tcw_wait<0>();                      /* the round's last block */
            tcw_fold<TYPE>(acc, c[1], s[1][0], s[1][1]);
            if (TT::MIN) tcw_fold<TYPE>(acc, cm[1], s2[1][0], s2[1][1]);
        }
    } else {
        /* a block barrier each stage: every warpgroup's MMAs of stage kb - 1 were waited for */
        for (int kb = 0; kb < nk; kb++) {
            cp_async_wait<ST - 2>();
            /* !TB: cp.async's B, read by wgmma */
            if (!TB) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads();
            {
                const int nx = kb + ST - 1;
                if (nx < nk) load(nx);
                cp_async_commit();
            }
            const uint8_t *As = smem + (kb % ST) * SB;
            uint32_t a[2][2][4], m[2][2];
            float s[2][2], s2[2][2];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                tc_frag_a<TYPE, TL::APITCH>(As, pr, j, t, kb, grid, s8tab, a[j][0], s[j][0], m[j][0], s2[j][0]);
                tc_frag_a<TYPE, TL::APITCH>(As, pr + DR, j, t, kb, grid, s8tab, a[j][1], s[j][1], m[j][1], s2[j][1]);
            }
            if (TB) tcw_mbar_wait(full + kb % ST, (unsigned)(kb / ST) & 1u);
            tcw_fence();
            const uint64_t db = db0 + (uint64_t)((kb % ST) * SB >> 4);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                tcw_block<PL>(c[j], a[j][0], a[j][1], db, j);
                if (TT::MIN) tcw_block_min<PL>(cm[j], m[j][0], m[j][1], db, j);
                tcw_commit();
            }
            tcw_wait<1>();                      /* block 0 done: fold it (block 1 may still run) */
            tcw_fold<TYPE>(acc, c[0], s[0][0], s[0][1]);
            if (TT::MIN) tcw_fold<TYPE>(acc, cm[0], s2[0][0], s2[0][1]);
            tcw_wait<0>();
            tcw_fold<TYPE>(acc, c[1], s[1][0], s[1][1]);
            if (TT::MIN) tcw_fold<TYPE>(acc, cm[1], s2[1][0], s2[1][1]);
        }
    }
    /* acc[4 i + 2 h + e]: row pr + DR h, token 8 i + 2 t + e */
    float *y = sg.y[si];
    const int64_t ldy = sg.ldy[si];
    const float *inv = (const float *)(xs + 3 * plane);
    const int e0 = LEAN ? bc[0] : t0, e1 = LEAN ? bc[1] : t1, er = LEAN ? bc[2] : row0;
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int n = e0 + 8 * i + 2 * t + e;
            if (n >= e1) continue;
            const float f = inv[n];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = er + pr + DR * h;
                if (r < nrows) y[(int64_t)n * ldy + r] = acc[4 * i + 2 * h + e] * f;
            }
        }
#else
    __trap();
#endif
}

/* The shared memory a block of each type needs, set where the device allows it: a device
 * with less per block (sm_86, sm_89: 99 KB) sends that type to cuBLAS (gemm_tc_ok). */
static int tc_smem_opt;     /* the device's largest opt-in shared memory per block */
static bool tc_wg_dev;      /* the build has k_tc_wgmma (DS4_WGMMA: sm_90a) and the device is CC 9.0 */
static PFN_cuTensorMapEncodeTiled_v12000 tc_encode;   /* the driver's tensor-map encoder, where it has one */

/* Whether this session's products go to k_tc_wgmma (DS4_CUDA_PREFILL_TC = 4, the default, 3 or
 * 2, where the build and the device have it) or k_tc_gemm.  A split is laid out for one of the
 * two.  tc_tb: k_tc_wgmma's B by the tensor memory accelerator (3 and 4, where the driver
 * encodes tensor maps). */
static bool tc_wg(void) { return tc_wg_dev && sess()->lim.prefill_tc >= 2; }
static bool tc_tb(void) { return tc_wg() && tc_encode && sess()->lim.prefill_tc >= 3; }
/* tc_ta: Q8_0's weights by tensor copies too (4), in 256-row blocks. */
static bool tc_ta(void) { return tc_tb() && sess()->lim.prefill_tc == 4; }
/* The activations' planes the products read (DS4_CUDA_PREFILL_PLANES: 2, else 3), every engine. */
static int tc_planes(void) { return sess()->lim.prefill_planes == 2 ? 2 : 3; }

/* The dynamic shared memory of a type's block: k_tc_wgmma's (wg) or k_tc_gemm's.  Q8_0 with TA
 * asks for the three planes' blocks, the larger of its two. */
static_assert(tcw_smem_bytes<DS4_TYPE_Q8_0, true, 2>() <= tcw_smem_bytes<DS4_TYPE_Q8_0, true>(),
              "k_tc_wgmma: TA's two-plane block the smaller");
template <int TYPE>
static int tc_smem_of(bool wg) { return wg ? tcw_smem_bytes<TYPE>() : tc_smem_bytes<TYPE>(); }
static int tc_smem_need(int type, bool wg) {
    switch (type) {
    case DS4_TYPE_Q8_0:    return wg && tc_ta() ? tcw_smem_bytes<DS4_TYPE_Q8_0, true>() : tc_smem_of<DS4_TYPE_Q8_0>(wg);
    case DS4_TYPE_F16:     return tc_smem_of<DS4_TYPE_F16>(wg);
    case DS4_TYPE_IQ2_XXS:
        return wg && tc_ta() ? std::max((int)tc_iq2_ta::SMEM, tc_smem_of<DS4_TYPE_IQ2_XXS>(wg))
                             : tc_smem_of<DS4_TYPE_IQ2_XXS>(wg);
    case DS4_TYPE_Q2_K:
        return wg && tc_ta() ? std::max((int)tc_min_ta<DS4_TYPE_Q2_K>::SMEM, tc_smem_of<DS4_TYPE_Q2_K>(wg))
                             : tc_smem_of<DS4_TYPE_Q2_K>(wg);
    case DS4_TYPE_Q4_K:
        return wg && tc_ta() ? std::max((int)tc_min_ta<DS4_TYPE_Q4_K>::SMEM, tc_smem_of<DS4_TYPE_Q4_K>(wg))
                             : tc_smem_of<DS4_TYPE_Q4_K>(wg);
    default:               return 0;
    }
}

template <int TYPE>
static void tc_smem_setup(void) {
    if (tc_smem_bytes<TYPE>() <= tc_smem_opt) {
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_gemm<TYPE, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tc_smem_bytes<TYPE>()));
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_gemm<TYPE, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tc_smem_bytes<TYPE, 2>()));
    }
    if (tc_wg_dev && tcw_smem_bytes<TYPE>() <= tc_smem_opt) {
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<TYPE, false, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tcw_smem_bytes<TYPE>()));
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<TYPE, true, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tcw_smem_bytes<TYPE>()));
    }
    if (tc_wg_dev && tcw_smem_bytes<TYPE, false, 2>() <= tc_smem_opt) {
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<TYPE, false, false, 2>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, tcw_smem_bytes<TYPE, false, 2>()));
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<TYPE, true, false, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tcw_smem_bytes<TYPE, false, 2>()));
    }
    if (TYPE == DS4_TYPE_Q8_0 && tc_wg_dev && tcw_smem_bytes<DS4_TYPE_Q8_0, true>() <= tc_smem_opt) {
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<DS4_TYPE_Q8_0, true, true>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tcw_smem_bytes<DS4_TYPE_Q8_0, true>()));
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<DS4_TYPE_Q8_0, true, true, 2>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            tcw_smem_bytes<DS4_TYPE_Q8_0, true, 2>()));
    }
    if constexpr (TYPE == DS4_TYPE_Q2_K || TYPE == DS4_TYPE_Q4_K)
        if (tc_wg_dev && tc_min_ta<TYPE>::SMEM <= tc_smem_opt)
            DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<TYPE, true, true, 2, 2>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, (int)tc_min_ta<TYPE>::SMEM));
    if (TYPE == DS4_TYPE_IQ2_XXS && tc_wg_dev && tc_iq2_ta::SMEM <= tc_smem_opt)
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_tc_wgmma<DS4_TYPE_IQ2_XXS, true, true, 2, TC_IQ2_NWG>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)tc_iq2_ta::SMEM));
}

void gemm_tc_setup(void) {
    int dev = 0;
    DS4_CUDA_CHECK(cudaGetDevice(&dev));
    DS4_CUDA_CHECK(cudaDeviceGetAttribute(&tc_smem_opt, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
#ifdef DS4_WGMMA
    int major = 0, minor = 0;
    DS4_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    DS4_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    tc_wg_dev = major == 9 && minor == 0;
    if (tc_wg_dev) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
                cudaSuccess && q == cudaDriverEntryPointSuccess)
            tc_encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
        else
            (void)cudaGetLastError();
    }
#endif
    tc_smem_setup<DS4_TYPE_Q8_0>();
    tc_smem_setup<DS4_TYPE_F16>();
    tc_smem_setup<DS4_TYPE_IQ2_XXS>();
    tc_smem_setup<DS4_TYPE_Q2_K>();
    tc_smem_setup<DS4_TYPE_Q4_K>();
}

/* Whether gemm_tc_* takes this matrix: the type, K a multiple of 256, rows 16-byte multiples
 * that start 16-byte aligned (F16 and Q4_K rows are copied in 16-byte pieces, the others in
 * 4-byte pieces at offsets the stage rounds to 4 within the row; one rule for all).  Q4_K's
 * stages (43 KB) leave one block per SM instead of two. */
bool gemm_tc_ok(int type, const void *w, size_t row_bytes, int64_t K) {
    return sess()->lim.prefill_tc != 0 && gemm_tc_type(type) && tc_smem_need(type, tc_wg()) <= tc_smem_opt &&
           K % 256 == 0 && K <= (1 << 24) &&
           ((uintptr_t)w & 15) == 0 && (row_bytes & 15) == 0;
}

/* The split of n rows of x (row stride ldx) into the session's scratch: parts parts of K
 * columns each, part p from column p K. */
static tc_split launch_tc_split(const tc_src &src, int64_t K, int64_t n, int parts) {
    tc_split sp;
    sp.K = K;
    sp.n = n;
    sp.ntp = (n + TC_BN - 1) / TC_BN * TC_BN + TC_BN;   /* a grouped tile may start anywhere */
    sp.parts = parts;
    sp.planes = tc_planes();
    sp.part_bytes = gemm_tc_scratch_bytes(n, K);
    sp.xs = scratch_get(&sess()->tc_x, sp.part_bytes * (size_t)parts);
    if (src.rows || src.u)      /* MADE: the rows made as they are read; plain splits keep 32 registers */
        DS4_LAUNCH(k_tc_split<true>, dim3((unsigned)sp.ntp, (unsigned)parts), TC_THREADS, 0, src, (int)K, (int)n,
                   (int)sp.ntp, (uint8_t *)sp.xs, sp.part_bytes, (int)tc_wg(), sp.planes);
    else
        DS4_LAUNCH(k_tc_split<false>, dim3((unsigned)sp.ntp, (unsigned)parts), TC_THREADS, 0, src, (int)K, (int)n,
                   (int)sp.ntp, (uint8_t *)sp.xs, sp.part_bytes, (int)tc_wg(), sp.planes);
    return sp;
}

tc_split gemm_tc_split(const float *x, int64_t ldx, int64_t K, int64_t n, int parts) {
    const tc_src src = { x, NULL, ldx, NULL, 1, 0.0f };
    return launch_tc_split(src, K, n, parts);
}

/* One part of n rows made on the fly (ds4_cuda_common.cuh, tc_src): gathered through rows /
 * rdiv, and/or swiglu(x, u) with limit. */
tc_split gemm_tc_split_from(const tc_src &src, int64_t K, int64_t n) {
    if (src.rows && src.rdiv < 1) ds4_fatal("gemm_tc_split_from: row divisor %d below 1", src.rdiv);
    return launch_tc_split(src, K, n, 1);
}

/* How many parts of n tokens x K the session's scratch holds. */
int gemm_tc_parts_fit(int64_t n, int64_t K) {
    const size_t one = gemm_tc_scratch_bytes(n, K), cap = sess()->tc_x.cap;
    return one ? (int)(cap / one) : 0;
}

/* The split as k_tc_wgmma's tensor copies read it (TB): f16 [parts][3][ntp][K] (the planes
 * of a part 2 K ntp bytes apart, the parts part_bytes apart: the inverse factors sit between
 * them), a stage's box TC_BK elements x TC_BN tokens x the split's planes (3, or 2: hi and mid),
 * 128-byte swizzled as the MMAs read it. */
static CUtensorMap tc_split_map(const tc_split &sp) {
    CUtensorMap tm;
    const cuuint64_t dim[4] = { (cuuint64_t)sp.K, (cuuint64_t)sp.ntp, (cuuint64_t)sp.planes, (cuuint64_t)sp.parts };
    const cuuint64_t stride[3] = { (cuuint64_t)sp.K * 2, (cuuint64_t)sp.ntp * (cuuint64_t)sp.K * 2,
                                   (cuuint64_t)sp.part_bytes };
    const cuuint32_t box[4] = { TC_BK, TC_BN, (cuuint32_t)sp.planes, 1 }, es[4] = { 1, 1, 1, 1 };
    const CUresult r = tc_encode(&tm, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, (void *)sp.xs, dim, stride, box, es,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        ds4_fatal("gemm_tc: cuTensorMapEncodeTiled failed (%d) for K %lld, %lld tokens, %d parts", (int)r,
                  (long long)sp.K, (long long)sp.ntp, sp.parts);
    return tm;
}

/* The weights of a launch's n segments as k_tc_wgmma's A copies read them (TA): matrix e of
 * segment s is nmat [e][nrows_s][row_bytes] bytes at w_s (mat_bytes apart; nmat 1: one
 * matrix), a box TC_APITCH bytes x bm rows (the kernel's BM) x 1 matrix, packed (no swizzle); rows past
 * nrows_s read as zeros. */
static tc_amaps tc_a_maps(const tc_segs &sg, int n, size_t mat_bytes, int nmat, size_t row_bytes, int bm,
                          int apitch) {
    tc_amaps am;
    memset(&am, 0, sizeof am);
    for (int i = 0; i < n; i++) {
        const cuuint64_t dim[3] = { (cuuint64_t)row_bytes, (cuuint64_t)sg.nrows[i], (cuuint64_t)nmat };
        const cuuint64_t stride[2] = { (cuuint64_t)row_bytes,
                                       nmat > 1 ? (cuuint64_t)mat_bytes : (cuuint64_t)row_bytes * sg.nrows[i] };
        const cuuint32_t box[3] = { (cuuint32_t)apitch, (cuuint32_t)bm, 1 }, es[3] = { 1, 1, 1 };
        const CUresult r = tc_encode(&am.m[i], CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, (void *)sg.w[i], dim, stride, box, es,
                                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS)
            ds4_fatal("gemm_tc: cuTensorMapEncodeTiled failed (%d) for %d rows of %zu bytes, %d matrices", (int)r,
                      sg.nrows[i], row_bytes, nmat);
    }
    return am;
}

/* grid: row tiles (of the kernel's and type's BM) x ny token tiles x n segments, the first two
 * flattened in x for a plain product (sg.tg > 0: tc_pos_of); blocks past a segment's rows
 * return at once (a launch's segments are of similar sizes) */
static dim3 tc_grid(int64_t rows, int bm, unsigned ny, unsigned n, const tc_segs &sg) {
    const unsigned rt = (unsigned)((rows + bm - 1) / bm);
    return sg.tg > 0 ? dim3(rt * ny, 1, n) : dim3(rt, ny, n);
}

template <int TYPE>
static void tc_launch(int64_t rows, unsigned ny, unsigned n, const tc_segs &sg, size_t mat_bytes, int nmat,
                      size_t row_bytes, const tc_split &sp, const int4 *tiles) {
    if (tc_wg()) {
        typedef tc_tile<TYPE, true> TL;
        const dim3 grid = tc_grid(rows, TC_BM, ny, n, sg);
        static const CUtensorMap none = {};
        static const tc_amaps anone = {};
        ds4_session *S = sess();
        S->n_tc_wgmma++;
        if (S->lim.prefill_tc >= 3 && !tc_encode) {
            static bool said;
            if (!said) fprintf(stderr, "ds4: DS4_CUDA_PREFILL_TC=%d: the driver has no tensor-map encoder "
                                       "(cuTensorMapEncodeTiled); the products run as 2\n", S->lim.prefill_tc);
            said = true;
        }
        const bool tb = tc_tb();
        S->n_tc_tma += tb;
        const bool pl2 = sp.planes == 2;
        /* A by tensor copies: Q8_0, and the super-block types on two planes */
        const bool ta = (TYPE == DS4_TYPE_Q8_0 || (TYPE != DS4_TYPE_F16 && pl2)) && tc_ta();
        S->n_tc_tma_a += ta;
        S->n_tc_pl2 += pl2;
        /* TA: 256-row blocks of 512 threads (tc_tile's BM) */
        typedef tc_tile<DS4_TYPE_Q8_0, true, true> TW;
        const dim3 gw = tc_grid(rows, TW::BM, ny, n, sg);
        if constexpr (TYPE == DS4_TYPE_Q2_K || TYPE == DS4_TYPE_Q4_K) {
            if (ta) {   /* 128-row blocks */
                DS4_LAUNCH((k_tc_wgmma<TYPE, true, true, 2, 2>), grid, TC_THREADS, (int)tc_min_ta<TYPE>::SMEM, sg,
                           mat_bytes, row_bytes, (int)sp.K, (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n,
                           tc_split_map(sp),
                           tc_a_maps(sg, (int)n, mat_bytes, nmat, row_bytes, TC_BM, tc_min_ta<TYPE>::APITCH));
                return;
            }
        }
        if (ta && TYPE == DS4_TYPE_IQ2_XXS)   /* blocks of tc_iq2_ta::BM rows */
            DS4_LAUNCH((k_tc_wgmma<DS4_TYPE_IQ2_XXS, true, true, 2, TC_IQ2_NWG>),
                       tc_grid(rows, tc_iq2_ta::BM, ny, n, sg), 128 * TC_IQ2_NWG, (int)tc_iq2_ta::SMEM, sg, mat_bytes,
                       row_bytes, (int)sp.K, (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n,
                       tc_split_map(sp),
                       tc_a_maps(sg, (int)n, mat_bytes, nmat, row_bytes, tc_iq2_ta::BM, tc_iq2_ta::APITCH));
        else if (ta && pl2)
            DS4_LAUNCH((k_tc_wgmma<DS4_TYPE_Q8_0, true, true, 2>), gw, 128 * (TW::BM / 64),
                       (tcw_smem_bytes<DS4_TYPE_Q8_0, true, 2>()), sg, mat_bytes, row_bytes, (int)sp.K,
                       (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n, tc_split_map(sp),
                       tc_a_maps(sg, (int)n, mat_bytes, nmat, row_bytes, TW::BM,
                                 tc_tile<DS4_TYPE_Q8_0, true, true, 2>::APITCH));
        else if (ta)
            DS4_LAUNCH((k_tc_wgmma<DS4_TYPE_Q8_0, true, true>), gw, 128 * (TW::BM / 64),
                       (tcw_smem_bytes<DS4_TYPE_Q8_0, true>()), sg, mat_bytes, row_bytes, (int)sp.K,
                       (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n, tc_split_map(sp),
                       tc_a_maps(sg, (int)n, mat_bytes, nmat, row_bytes, TW::BM, TW::APITCH));
        else if (tb && pl2)
            DS4_LAUNCH((k_tc_wgmma<TYPE, true, false, 2>), grid, TC_THREADS, (tcw_smem_bytes<TYPE, false, 2>()), sg,
                       mat_bytes, row_bytes, (int)sp.K, (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n,
                       tc_split_map(sp), anone);
        else if (tb)
            DS4_LAUNCH((k_tc_wgmma<TYPE, true, false>), grid, TC_THREADS, TL::SMEM, sg, mat_bytes, row_bytes, (int)sp.K,
                       (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n, tc_split_map(sp), anone);
        else if (pl2)
            DS4_LAUNCH((k_tc_wgmma<TYPE, false, false, 2>), grid, TC_THREADS, (tcw_smem_bytes<TYPE, false, 2>()), sg,
                       mat_bytes, row_bytes, (int)sp.K, (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n, none,
                       anone);
        else
            DS4_LAUNCH((k_tc_wgmma<TYPE, false, false>), grid, TC_THREADS, TL::SMEM, sg, mat_bytes, row_bytes, (int)sp.K,
                       (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n, none, anone);
    } else {
        const dim3 grid = tc_grid(rows, TC_BM, ny, n, sg);
        sess()->n_tc_pl2 += sp.planes == 2;
        if (sp.planes == 2)
            DS4_LAUNCH((k_tc_gemm<TYPE, 2>), grid, TC_THREADS, (tc_smem_bytes<TYPE, 2>()), sg, mat_bytes, row_bytes,
                       (int)sp.K, (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n);
        else
            DS4_LAUNCH((k_tc_gemm<TYPE, 3>), grid, TC_THREADS, tc_smem_bytes<TYPE>(), sg, mat_bytes, row_bytes, (int)sp.K,
                       (const uint8_t *)sp.xs, (int)sp.ntp, tiles, (int)sp.n);
    }
}

/* One launch over the segments seg[0 .. n - 1] (n <= TC_SEG_MAX, one type, K = sp.K, rows
 * row_bytes apart): y_s[t][r] (row stride ldy_s) = sum_k W_s,e[r][k] x_part_s[t][k] over the
 * tiles (grouped: tiles on the device, n_tiles of them; matrix e < nmat of a segment
 * mat_bytes * e in) or over tokens 0 .. sp.n - 1 (tiles NULL, nmat 1). */
void gemm_tc_multi(int type, size_t mat_bytes, int nmat, size_t row_bytes, const tc_split &sp, int n,
                   const tc_seg *seg, const int4 *tiles, int n_tiles) {
    if (n <= 0 || sp.n <= 0) return;
    if (n > TC_SEG_MAX) ds4_fatal("gemm_tc_multi: %d matrices above %d", n, TC_SEG_MAX);
    const unsigned ny = tiles ? (unsigned)n_tiles : (unsigned)((sp.n + TC_BN - 1) / TC_BN);
    if (ny == 0) return;
    tc_segs sg;
    memset(&sg, 0, sizeof sg);
    int64_t rows = 0;
    for (int i = 0; i < n; i++) {
        if (seg[i].part < 0 || seg[i].part >= sp.parts) ds4_fatal("gemm_tc_multi: part %d of %d", seg[i].part, sp.parts);
        sg.w[i] = seg[i].w;
        sg.y[i] = seg[i].y;
        sg.ldy[i] = seg[i].ldy;
        sg.nrows[i] = (int)seg[i].nrows;
        sg.xoff[i] = sp.part_bytes * (size_t)seg[i].part;
        sg.part[i] = seg[i].part;
        if (seg[i].nrows > rows) rows = seg[i].nrows;
    }
    if (rows <= 0) return;
    if (nmat < 1 || (nmat > 1 && !tiles)) ds4_fatal("gemm_tc_multi: %d matrices a segment", nmat);
    if (!tiles) {   /* token tiles a group: their parts of the split within TC_L2_GROUP bytes */
        const int64_t tile_bytes = (int64_t)TC_BN * sp.K * sp.planes * (int64_t)sizeof(__half);
        int64_t tg = TC_L2_GROUP / (tile_bytes > 0 ? tile_bytes : 1);
        sg.tg = (int)(tg < 1 ? 1 : tg > (int64_t)ny ? (int64_t)ny : tg);
    }
    const unsigned ns = (unsigned)n;
    switch (type) {
    case DS4_TYPE_Q8_0:    tc_launch<DS4_TYPE_Q8_0>(rows, ny, ns, sg, mat_bytes, nmat, row_bytes, sp, tiles); break;
    case DS4_TYPE_F16:     tc_launch<DS4_TYPE_F16>(rows, ny, ns, sg, mat_bytes, nmat, row_bytes, sp, tiles); break;
    case DS4_TYPE_IQ2_XXS: tc_launch<DS4_TYPE_IQ2_XXS>(rows, ny, ns, sg, mat_bytes, nmat, row_bytes, sp, tiles); break;
    case DS4_TYPE_Q2_K:    tc_launch<DS4_TYPE_Q2_K>(rows, ny, ns, sg, mat_bytes, nmat, row_bytes, sp, tiles); break;
    case DS4_TYPE_Q4_K:    tc_launch<DS4_TYPE_Q4_K>(rows, ny, ns, sg, mat_bytes, nmat, row_bytes, sp, tiles); break;
    default: ds4_fatal("gemm_tc_multi: weight type %d is not one the engine takes", type);
    }
}

/* The tiles of a grouped product: expert e's rows off[e] .. off[e+1] - 1 in chunks of TC_BN,
 * as {e, first row, end row, 0}; out holds 4 gemm_tc_max_tiles(off[E], E) ints.  Returns the
 * count. */
int gemm_tc_tiles(const int32_t *off, int E, int32_t *out) {
    int n = 0;
    for (int e = 0; e < E; e++)
        for (int r = off[e]; r < off[e + 1]; r += TC_BN, n++) {
            out[4 * n] = e;
            out[4 * n + 1] = r;
            out[4 * n + 2] = r + TC_BN < off[e + 1] ? r + TC_BN : off[e + 1];
            out[4 * n + 3] = 0;
        }
    return n;
}
int64_t gemm_tc_max_tiles(int64_t rows, int64_t E) { return rows / TC_BN + E + 1; }

/* y[t][r] (row stride ldy) = sum_k W[r][k] x[t][k] for r < nrows, t < nt, W's rows starting
 * at w (row_bytes apart); false when the type or shape is not one this engine takes (the
 * caller then uses cuBLAS). */
bool gemm_tc_rows(int type, const uint8_t *w, size_t row_bytes, int64_t K, int64_t nrows, const float *x,
                  int64_t ldx, float *y, int64_t ldy, int nt) {
    if (!gemm_tc_ok(type, w, row_bytes, K)) return false;
    if (nrows <= 0 || nt <= 0) return true;
    const tc_split sp = gemm_tc_split(x, ldx, K, nt, 1);
    const tc_seg seg = { w, nrows, y, ldy, 0 };
    gemm_tc_multi(type, 0, 1, row_bytes, sp, 1, &seg, NULL, 0);
    return true;
}
