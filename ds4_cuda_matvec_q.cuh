/* ds4_cuda_matvec_q.cuh -- the decode matvec for the super-block weight types Q2_K, Q4_K,
 * IQ2_XXS (k_matvec_q).
 *
 * What it is.  The decode matvec for the three types, with exactly the interface and modes
 * of k_matvec in ds4_cuda_matmul.cu (dense with 1..2 tokens, matmul_multi segments, the input
 * RMSNorm, the ape table; MoE gate|up with SwiGLU; MoE down with per-slot activations).
 * matvec_run (ds4_cuda_matmul.cu) enters it through mvq_type, mvq_launch_t is its one launcher.
 * The element decoders it builds on (dsq_*) are ds4_cuda_quant.cuh.
 *
 * Why tensor cores, in a memory-bound kernel.  Decode streams each expert weight once, so
 * the goal is DRAM bandwidth (~4.2 TB/s copy on an H200).  At 2.5 TB/s an H200 must consume
 * 9.7e12 IQ2_XXS weights per second (66 bytes per 256), i.e. 37 weights per SM per clock,
 * while an SM issues 4 warp instructions (128 lane operations) per clock: a budget of ~3.4
 * lane instructions per weight for everything (Q2_K: ~4.4, Q4_K: ~7.5).  An f32 FFMA per
 * weight plus the instruction that turns the packed weight into a register are already 2;
 * IQ2_XXS adds a sign per weight and a grid lookup per 8 (~3.9 lane instructions per weight
 * on CUDA cores).  mma.sync (sm_80+) takes the multiply-adds off the issue budget; the rest
 * is decoding the weights into MMA operands, and the two paths below do that:
 *   - the f16 path (IQ2_XXS): weights as f16 pairs, m16n8k16, activations split into three
 *     f16 parts.  The grid expands to f16 magnitude pairs in shared memory, so a group of 8
 *     is one 128-bit lookup, its signs become f16 sign bits by one multiply per pair and its
 *     scale one f16x2 multiply (see dsq_iq2_group): ~3.1 lane instructions per weight in the
 *     compiled loop (ncu, sm_90), ~4.0 with everything.
 *   - the integer path (Q2_K, Q4_K): weights as u8, m16n8k32 (u8 x s8 -> s32), activations as
 *     four signed 7-bit digits.  A quant run is one shift and mask per four weights (Q2_K: and
 *     a multiply by its 4-bit scale, which fits the byte); ~3x fewer instructions per weight
 *     than the f16 form these types had, and sums that are exact integers.
 * Measured (bench/RESULTS.md), neither reaches 2.5 TB/s at decode: an expert matrix of these
 * types is 4-8 MB, a launch moves 16-57 MB, and the fixed cost of a launch (activations
 * staged per block, the pipeline filling, the tail) is a large part of 15-30 us; IQ2_XXS is
 * also issue-bound (46% of issue slots busy at 4 lane instructions per weight).
 *
 * Numerics: exact products, f32 sums.  Each weight is d * (an integer) [- dmin * m] with a
 * small integer, and that integer is the MMA's A operand:
 *   - f16 path: (2*ls+1) * (+-grid magnitude) <= 1333 (< 2048, the f16 integer limit), built
 *     with exact f16 arithmetic (fma.rn.f16x2 whose exact result is representable).  B: per
 *     super-block of 256, x scaled by a power of two 2^a so that 2^9 <= max|x 2^a| < 2^10 and
 *     split into three f16 parts hi + mid + lo equal to it (exact for |x 2^a| >= 1/2, below
 *     that within 2^-25, i.e. 2^-34 of the block's largest value).  Every product in the MMA is
 *     exact (11 x 11 bits); the only rounding is the tensor core's f32 accumulation (16 MMAs
 *     per super-block; it may truncate instead of rounding, an error of the order of f32
 *     rounding that the host test cannot emulate: test_backend_ops on the GPU checks it).
 *     Columns are free, so the three parts (x two tokens in dense mode) are B's columns 0..5.
 *   - integer path: A = sc*q (Q2_K, <= 45) or q / 16q (Q4_K, whose 6-bit scale multiplies the
 *     MMA's s32 result instead), and the min m broadcast in a second A; B: per super-block x
 *     scaled by 2^a so that 32 <= max|x 2^a| < 64, as four digits q0 + q1 2^-7 + q2 2^-14 +
 *     q3 2^-21 (each in [-64, 64]; x 2^a to within 2^-22, i.e. 2^-27 of the block's largest
 *     value, dsq_digits4).  Every MMA sum is an exact s32 (bounds at mvq_sb_i8).  Columns 4u +
 *     p hold digit p of token u.
 * Then f32: d * 2^-a * D per super-block (integer path: minus dmin * 2^-a * Dmin), and per row
 * the columns combined in a fixed order.  The weights are the exact values d*sc*q - dmin*m
 * (ds4_quant.c rounds each once to f32), so the result is an f32-accurate dot product in a
 * different order, like every other matvec: the expected error is ~1e-7 of ||y||, inside
 * test_backend_ops' TOL_DOT (1e-5).
 *
 * How a block works (256 threads, 8 warps).  A row of K = 256 n is n super-blocks (SBs).
 * Like k_matvec, the warps split the SBs into S slices (S the largest power of two <= min(8,
 * n); warp w takes SBs w%S, w%S + S, ...) and G = 8/S row groups; a warp walks its tiles of
 * 16 rows (tile gr + G i of the block), and for each tile its SBs.
 *   - The block first puts the first weight tiles in flight (cp.async, a per-warp ring of
 *     stages of 16 rows x 1 SB per matrix), then stages the activations: the B fragments of
 *     every SB in the exact register order of the MMA (one 8-byte LDS per MMA and lane,
 *     conflict-free) and the per-SB factor 2^-a.
 *   - Each lane of a warp owns, in every row of its tile pair (rows g and g+8, g = lane/4),
 *     a part of the SB chosen so that its scales are few and its bytes adjacent: IQ2_XXS
 *     records t and t+4 (t = lane%4: 2 x 32 weights, 2 scales; dsq_frag_elem / dsq_frag_slot
 *     say which k slot holds which element, and B is staged to match); Q2_K and Q4_K the 8
 *     elements 32j+8t.. of each MMA j (dsq_i8_elem: contiguous bytes of one quant run).
 *   - Weights reach shared memory by cp.async in 16-byte chunks (4-byte when rows are not
 *     16-byte aligned): the aligned superset of the SB in each row (its first byte lands at
 *     offset (sb*BB) mod 16), a warp instruction copying 32 contiguous bytes of each of 16
 *     rows, one instruction per chunk; each lane then reads its bytes from shared memory
 *     with aligned 32-bit (Q4_K: 64- and 128-bit) loads, IQ2_XXS's with funnel shifts.
 *   - IQ2_XXS: the 256-entry grid is expanded once per block to f16 magnitude pairs
 *     (16 bytes per entry) and replicated 8 times so that the 8 lanes of each quarter-warp
 *     phase of a 128-bit load always hit different banks (a random lookup into one copy costs
 *     ~10 wavefronts per warp instead of 4); the 128 sign bytes (7 stored signs + parity) are
 *     a shared table too.
 *   - After the last SB of a tile, each row's columns are combined in a fixed order (f16
 *     path: (hi + mid) + lo; integer path: (d0 + d1 2^-7) + (d2 + d3 2^-7) 2^-14), and the
 *     warp's slice partial goes to shared memory; the block adds the S partials of a row in
 *     slice order, then writes y (dense: plus the ape row; gate|up: silu(g) * u).
 *
 * Determinism.  Fixed reduction shapes only (MMA chains in SB order, f32 accumulation in SB
 * order, butterflies, slice sums in order), no atomics.  A row's arithmetic depends only on
 * K and the type: not on the grid, the tile it shares, or the rows per warp.
 *
 * Grid.  As mv_plan: one wave of blocks (occupancy x SMs), rows per warp grown only when
 * every resident block slot has work.  At least two blocks per SM fit (registers <= 128,
 * shared memory <= ~106 KB for the Flash shapes).  Bytes in flight: each warp keeps one
 * (gate|up) or two stages of 16 rows ahead (per SM: IQ2_XXS gate|up 34 KB, Q4_K gate|up
 * 74 KB, Q2_K down 43 KB), above the ~20-25 KB per SM that the H200's latency x bandwidth
 * asks for.
 *
 * Shapes.  The fast kernel takes K = 256 n with rows 4-byte aligned (IQ2_XXS: n even) and
 * row_bytes, matrix stride and base 4-byte aligned, as long as the staged activations
 * (IQ2_XXS: 6 bytes per element and token; Q2_K/Q4_K: 8 bytes per element) fit in shared
 * memory (K up to ~24k);
 * mvq_fast_ok says so.  Anything else takes ds4_cuda.cu's generic matvec through dsq_elem.
 *
 * Including.  ds4_cuda_matmul.cu includes it after its k_matvec section (it uses mv_args,
 * MV_*, the warp helpers, cp_async*, DS4_LAUNCH and g_cuda of ds4_cuda_common.cuh).
 */
#ifndef DS4_CUDA_MATVEC_Q_CUH
#define DS4_CUDA_MATVEC_Q_CUH


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
 * offset (sb BB) mod 16 always fits), chunks per row when copying in 16- and 4-byte pieces. */
template <int TYPE> struct mvq_traits;
template <> struct mvq_traits<DS4_TYPE_IQ2_XXS> { enum { BB = 66, RS = 80, CH16 = 5, CH4 = 17 }; };
template <> struct mvq_traits<DS4_TYPE_Q2_K>    { enum { BB = 84, RS = 96, CH16 = 6, CH4 = 21 }; };
template <> struct mvq_traits<DS4_TYPE_Q4_K>    { enum { BB = 144, RS = 144, CH16 = 9, CH4 = 36 }; };

/* Dynamic shared memory: (IQ2_XXS) the replicated grid and the sign bytes first, at offsets
 * the compiler knows (so a lookup is one load with an immediate base), then the B fragments
 * (f16 path: [nsb][16][3 NT][4] x 8 bytes; integer path: [nsb][8][32 lanes] x 8 bytes), the
 * per-SB factors [NT][nsb], and the weight rings [warp][stage][matrix][16 rows][RS]. */
#define MVQ_GRID_OFF 0
#define MVQ_KS_OFF   (256 * 8 * 16)
typedef struct { size_t xf, ps, grid, ks, ring, total; } mvq_layout;

__host__ __device__ __forceinline__ size_t mvq_al16(size_t n) { return (n + 15) & ~(size_t)15; }

template <int TYPE, int MODE, int NT>
__host__ __device__ __forceinline__ mvq_layout mvq_layout_of(int nsb) {
    typedef mvq_traits<TYPE> T;
    const int nmat = MODE == MV_GATE_UP ? 2 : 1;
    mvq_layout L;
    size_t o = 0;
    L.grid = MVQ_GRID_OFF;
    L.ks = MVQ_KS_OFF;
    constexpr bool I8 = TYPE != DS4_TYPE_IQ2_XXS;     /* the integer path: B digits */
    if (TYPE == DS4_TYPE_IQ2_XXS) o = MVQ_KS_OFF + 128;
    L.xf = o;   o += I8 ? (size_t)nsb * 8 * 32 * 8 : (size_t)nsb * 16 * (3 * NT) * 32;
    L.ps = o;   o += mvq_al16((size_t)NT * nsb * 4);
    L.ring = o; o += (size_t)MV_WARPS * mvq_stages<MODE>::n * nmat * 16 * T::RS;
    L.total = o;
    return L;
}

__device__ __forceinline__ void mvq_mma_i8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint2 b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
}

/* Zeroed MMA accumulators of NMAT matrices. */
template <typename T, int NMAT>
__device__ __forceinline__ void mvq_zero(T (&D)[NMAT][4]) {
#pragma unroll
    for (int m = 0; m < NMAT; m++)
#pragma unroll
        for (int c = 0; c < 4; c++) D[m][c] = (T)0;
}

/* The staged rows a lane reads of a 16-row tile of NMAT matrices: [matrix][g, g+8], from r0 =
 * row g of matrix 0 (row g+8 is 8 RS later, matrix m 16 RS m later). */
template <int TYPE, int NMAT>
__device__ __forceinline__ void mvq_rows(const uint8_t *r0, const uint8_t *(&rp)[2 * NMAT]) {
#pragma unroll
    for (int k = 0; k < 2 * NMAT; k++) rp[k] = r0 + (size_t)((k >> 1) * 16 + 8 * (k & 1)) * mvq_traits<TYPE>::RS;
}

/* The integer path's SB of a 16-row tile (Q2_K, Q4_K), for each of the NMAT matrices: Dm = the
 * integer sums of (scale x quant) x digit (Q4_K: 16 sc q), Dn = those of min x digit, both
 * exact in s32 (|Dm| <= 8 x 32 x 45 x 64 for Q2_K, 8 x 32 x 16 x 15 x 63 x 64 for Q4_K; |Dn|
 * <= 8 x 32 x 63 x 64); d, dmin of each row.  r0: row g of matrix 0's staged tile at the SB's
 * first byte (4-byte aligned; Q4_K: 8-byte); xb: this lane's B fragment of MMA 0 (MMA j at
 * xb[32 j]).  Q2_K carries its 4-bit scales in A, so its MMAs chain; Q4_K's 6-bit scales do
 * not fit a byte next to the quant, so each sub-block's MMA starts at 0 and is scaled in s32. */
template <int TYPE, int NMAT>
__device__ __forceinline__ void mvq_sb_i8(const uint8_t *r0, const uint2 *xb, int t, int (&Dm)[NMAT][4],
                                          int (&Dn)[NMAT][4], float (&dr)[NMAT][2], float (&dminr)[NMAT][2]) {
    typedef mvq_traits<TYPE> TR;
    constexpr int NR = 2 * NMAT;       /* staged rows this lane reads: [matrix][g, g+8] */
    const uint8_t *rp[NR];
    mvq_rows<TYPE, NMAT>(r0, rp);
    mvq_zero(Dm);
    mvq_zero(Dn);
    if (TYPE == DS4_TYPE_Q2_K) {
        uint32_t S[NR][4];
#pragma unroll
        for (int k = 0; k < NR; k++) {
#pragma unroll
            for (int i = 0; i < 4; i++) S[k][i] = dsq_ld32(rp[k] + 4 * i);
            const uint32_t dd = dsq_ld32(rp[k] + 80);
            dr[k >> 1][k & 1] = dsq_f16(dd & 0xffffu);
            dminr[k >> 1][k & 1] = dsq_f16(dd >> 16);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t W0[NR], W1[NR];
#pragma unroll
            for (int k = 0; k < NR; k++) {
                W0[k] = dsq_ld32(rp[k] + 16 + 32 * h + 8 * t);
                W1[k] = dsq_ld32(rp[k] + 20 + 32 * h + 8 * t);
            }
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * h + jj;
                const uint2 b = xb[32 * j];
#pragma unroll
                for (int m = 0; m < NMAT; m++) {
                    const uint32_t s0 = dsq_q2k_i8_scbyte(S[2 * m], j, t), s1 = dsq_q2k_i8_scbyte(S[2 * m + 1], j, t);
                    const uint32_t sc0 = s0 & 15u, sc1 = s1 & 15u;
                    mvq_mma_i8(Dm[m], dsq_q2k_i8_a(W0[2 * m], j, sc0), dsq_q2k_i8_a(W0[2 * m + 1], j, sc1),
                               dsq_q2k_i8_a(W1[2 * m], j, sc0), dsq_q2k_i8_a(W1[2 * m + 1], j, sc1), b);
                    const uint32_t m0 = (s0 >> 4) * 0x01010101u, m1 = (s1 >> 4) * 0x01010101u;
                    mvq_mma_i8(Dn[m], m0, m1, m0, m1, b);
                }
            }
        }
    } else {   /* Q4_K */
        uint32_t SC[NR][2], M[NR][2];
#pragma unroll
        for (int k = 0; k < NR; k++) {
            const uint4 hd = *(const uint4 *)rp[k];           /* d, dmin | the 12 scale bytes */
            dr[k >> 1][k & 1] = dsq_f16(hd.x & 0xffffu);
            dminr[k >> 1][k & 1] = dsq_f16(hd.x >> 16);
            dsq_q4k_i8_scales(hd.y, hd.z, hd.w, SC[k], M[k]);
        }
#pragma unroll
        for (int jp = 0; jp < 4; jp++) {
            uint2 W[NR];
#pragma unroll
            for (int k = 0; k < NR; k++) W[k] = *(const uint2 *)(rp[k] + 16 + 32 * jp + 8 * t);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int j = 2 * jp + e;
                const uint2 b = xb[32 * j];
#pragma unroll
                for (int m = 0; m < NMAT; m++) {
                    int D[4] = { 0, 0, 0, 0 };
                    mvq_mma_i8(D, dsq_q4k_i8_a(W[2 * m].x, j), dsq_q4k_i8_a(W[2 * m + 1].x, j),
                               dsq_q4k_i8_a(W[2 * m].y, j), dsq_q4k_i8_a(W[2 * m + 1].y, j), b);
                    const int sc0 = (int)dsq_q4k_i8_sc(SC[2 * m], j), sc1 = (int)dsq_q4k_i8_sc(SC[2 * m + 1], j);
                    Dm[m][0] += D[0] * sc0;
                    Dm[m][1] += D[1] * sc0;
                    Dm[m][2] += D[2] * sc1;
                    Dm[m][3] += D[3] * sc1;
                    const uint32_t m0 = dsq_byte(M[2 * m][j >> 2], j & 3) * 0x01010101u;
                    const uint32_t m1 = dsq_byte(M[2 * m + 1][j >> 2], j & 3) * 0x01010101u;
                    mvq_mma_i8(Dn[m], m0, m1, m0, m1, b);
                }
            }
        }
    }
}

/* The f16 path's SB of a 16-row tile (IQ2_XXS), for each of the NMAT matrices of the step
 * (gate and up share every B fragment, so each is loaded once): D[m] = sum over the SB of A
 * (integers) x B (parts).  r0: row g of matrix 0's staged tile at the SB's first byte (row g+8
 * is 8 RS later, matrix m 16 RS m later); odd = (r0 + 2) mod 4; xb: this lane's B fragments
 * of the SB (MMA i at xb[i * 4 cs]).  Also each row's d. */
template <int TYPE, int NT, int NMAT>
__device__ __forceinline__ void mvq_sb(const uint8_t *r0, uint32_t odd, const uint2 *xb, int t,
                                       const uint8_t *gridl, const uint8_t *s8tab, float (&D)[NMAT][4],
                                       float (&dr)[NMAT][2]) {
    typedef mvq_traits<TYPE> TR;
    static_assert(TYPE == DS4_TYPE_IQ2_XXS, "Q2_K and Q4_K take the integer path (mvq_sb_i8)");
    constexpr int XS = 4 * 3 * NT;     /* uint2 stride between MMAs */
    constexpr int NR = 2 * NMAT;       /* staged rows this lane reads: [matrix][g, g+8] */
    const uint8_t *rp[NR];
    mvq_rows<TYPE, NMAT>(r0, rp);
    mvq_zero(D);
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
                    mma_f16_16816(D[m], X[2 * m][0], X[2 * m + 1][0], X[2 * m][1], X[2 * m + 1][1], b0);
                    mma_f16_16816(D[m], X[2 * m][2], X[2 * m + 1][2], X[2 * m][3], X[2 * m + 1][3], b1);
                }
            }
        }
    }
}

template <int TYPE, int MODE, int NT>
__global__ void __launch_bounds__(MV_THREADS, MVQ_MIN_BLOCKS) k_matvec_q(const mv_args a) {
    ds4_grid_dep();
    typedef mvq_traits<TYPE> TR;
    constexpr bool DUAL = MODE == MV_GATE_UP;
    constexpr int NMAT = DUAL ? 2 : 1;
    constexpr int NPLANE = DUAL ? 2 : NT;
    constexpr int CS = 3 * NT;
    constexpr int ST = mvq_stages<MODE>::n;
    constexpr bool I8 = TYPE != DS4_TYPE_IQ2_XXS;   /* Q2_K, Q4_K: the integer path */
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
    uint4 *grid = (uint4 *)(mvq_smem + MVQ_GRID_OFF);
    uint8_t *s8tab = mvq_smem + MVQ_KS_OFF;
    uint8_t *ring = mvq_smem + L.ring + (size_t)warp * ST * NMAT * 16 * TR::RS;

    const int prob = blockIdx.y, tok = blockIdx.z;
    const uint8_t *W[NMAT];            /* the block's problem (mv_problem) */
    const float *x, *tab; float *y; int rows, bx, tab_pos0; int64_t y_tok;
    mv_problem<MODE, NMAT>(a, prob, tok, W, x, y, rows, bx, y_tok, tab, tab_pos0);
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
                        if (ch < TR::CH4) cp_async4(d + 4 * ch, src + 4 * ch);
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

    /* activations: per token, per SB (a warp each): the input norm, the scale 2^a, and the B
     * fragments (integer path: four digits; f16 path: three parts) in the MMA's order */
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
            ss = warp_sum(ss);
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
            mx = warp_max(mx);
            if constexpr (I8) {
                /* four digits per value; the lane's 8 values are the B fragment of MMA lane/4,
                 * quarter lane%4: transpose the digit bytes into one word per digit and half */
                const int ea = dsq_i8_exp(mx);
                const float sc = dsq_pow2(ea);
                uint32_t dg[8];
#pragma unroll
                for (int k = 0; k < 8; k++) dg[k] = dsq_digits4(__fmul_rn(v[k], sc));
                uint32_t col[2][4];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const uint32_t a0 = __byte_perm(dg[4 * h], dg[4 * h + 1], 0x5140);
                    const uint32_t b0 = __byte_perm(dg[4 * h], dg[4 * h + 1], 0x7362);
                    const uint32_t a1 = __byte_perm(dg[4 * h + 2], dg[4 * h + 3], 0x5140);
                    const uint32_t b1 = __byte_perm(dg[4 * h + 2], dg[4 * h + 3], 0x7362);
                    col[h][0] = __byte_perm(a0, a1, 0x5410);
                    col[h][1] = __byte_perm(a0, a1, 0x7632);
                    col[h][2] = __byte_perm(b0, b1, 0x5410);
                    col[h][3] = __byte_perm(b0, b1, 0x7632);
                }
                uint2 *xq = (uint2 *)xf + ((size_t)sb * 8 + (lane >> 2)) * 32 + (lane & 3);
#pragma unroll
                for (int p = 0; p < 4; p++) xq[4 * (4 * u + p)] = make_uint2(col[0][p], col[1][p]);
                if (NT == 1) {
#pragma unroll
                    for (int p = 4; p < 8; p++) xq[4 * p] = make_uint2(0u, 0u);
                }
                if (lane == 0) ps[u * nsb + sb] = dsq_pow2(-ea);
                continue;
            }
            const int ea = dsq_sb_exp(mx);
            const float sc = dsq_pow2(ea);
            /* the 4 elements 8 lane + 4 h .. + 3 share one B fragment (MMA, lane quarter) and
             * fill its 4 slots, so each part is one 8-byte store */
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int fi, ft, fr;
                dsq_frag_slot(8 * lane + 4 * h, &fi, &ft, &fr);
                uint32_t hp[3][4];
#pragma unroll
                for (int b = 0; b < 4; b++) dsq_split3(__fmul_rn(v[4 * h + b], sc), &hp[0][b], &hp[1][b], &hp[2][b]);
#pragma unroll
                for (int pt = 0; pt < 3; pt++)
                    ((uint2 *)xf)[dsq_xf_index(sb, fi, 3 * u + pt, ft, CS)] =
                        make_uint2(hp[pt][0] | (hp[pt][1] << 16), hp[pt][2] | (hp[pt][3] << 16));
            }
            if (lane == 0)   /* IQ2_XXS: its (2 ls + 1) / 8 scale's 1/8 rides along (exact) */
                ps[u * nsb + sb] = dsq_pow2(-ea) * 0.125f;
        }
    }
    __syncthreads();

    /* main loop: step q = (tile q / nsbw, SB s + S (q % nsbw)) */
    const uint2 *xl = (const uint2 *)xf;
    const uint8_t *gridl = (const uint8_t *)grid + 16 * (lane & 7);   /* this lane's copy of the grid */
    float acc[NMAT][4];
#pragma unroll
    for (int mt = 0; mt < NMAT; mt++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[mt][c] = 0.0f;
#pragma unroll 1
    for (int q = 0; q < steps; q++) {
        issue(q + ST - 1);
        cp_async_wait<ST - 1>();   /* step q's group has landed (for this lane) */
        __syncwarp();                  /* ... and for every lane */
        const int ti = q / nsbw, sj = q % nsbw, sb = s + S * sj;
        const int o0 = (sb * TR::BB) & (cg16 ? 15 : 3);
        const uint8_t *slot = ring + (size_t)(q % ST) * NMAT * 16 * TR::RS;
        const int base = lane & ~3;
        const int lr0 = (gr + G * ti) * 16 + g;
        if constexpr (I8) {
            /* columns 2t, 2t+1 hold digits of token t/2 (NT = 2; with one token, lanes t >= 2
             * hold zero columns); Q4_K's products carry a factor 16 (dsq_q4k_i8_sc).  The
             * mins enter each SB's sum: d ps Dm - dmin ps Dn. */
            const float pm = ps[(NT == 1 ? 0 : (t >> 1)) * nsb + sb];
            const float pq = TYPE == DS4_TYPE_Q4_K ? pm * 0.0625f : pm;
            int Dm[NMAT][4], Dn[NMAT][4];
            float dq[NMAT][2], dmq[NMAT][2];
            mvq_sb_i8<TYPE, NMAT>(slot + (size_t)g * TR::RS + o0, xl + (size_t)sb * 8 * 32 + lane, t, Dm, Dn, dq, dmq);
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    acc[mt][c] = fmaf(dq[mt][c >> 1] * pq, (float)Dm[mt][c],
                                      fmaf(-(dmq[mt][c >> 1] * pm), (float)Dn[mt][c], acc[mt][c]));
            if (sj == nsbw - 1) {
                /* the tile is done: per row and token u, the digit columns 4u..4u+3 sit in lanes
                 * 2u (digits 0, 1) and 2u+1 (digits 2, 3) of the row's quarter:
                 * (d0 + d1 2^-7) + (d2 + d3 2^-7) 2^-14 */
#pragma unroll
                for (int mt = 0; mt < NMAT; mt++) {
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const float v = fmaf(acc[mt][2 * r + 1], 0x1p-7f, acc[mt][2 * r]);
#pragma unroll
                        for (int u = 0; u < NT; u++) {
                            const float lo = __shfl_sync(FULL_MASK, v, base + 2 * u);
                            const float hi = __shfl_sync(FULL_MASK, v, base + 2 * u + 1);
                            if (t == 0) part[DUAL ? mt : u][(lr0 + 8 * r) * S + s] = fmaf(hi, 0x1p-14f, lo);
                        }
                    }
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[mt][c] = 0.0f;
                }
            }
        } else {
            const int tk0 = dsq_col_token(2 * t, NT), tk1 = dsq_col_token(2 * t + 1, NT);
            const float ps0 = ps[tk0 * nsb + sb], ps1 = ps[tk1 * nsb + sb];
            const uint2 *xb = xl + dsq_xf_index(sb, 0, g % CS, t, CS);
            float D[NMAT][4], dr[NMAT][2];
            mvq_sb<TYPE, NT, NMAT>(slot + (size_t)g * TR::RS + o0, (uint32_t)((o0 + 2) & 2), xb, t, gridl, s8tab,
                                   D, dr);
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
                acc[mt][0] = fmaf(dr[mt][0] * ps0, D[mt][0], acc[mt][0]);
                acc[mt][1] = fmaf(dr[mt][0] * ps1, D[mt][1], acc[mt][1]);
                acc[mt][2] = fmaf(dr[mt][1] * ps0, D[mt][2], acc[mt][2]);
                acc[mt][3] = fmaf(dr[mt][1] * ps1, D[mt][3], acc[mt][3]);
            }
            if (sj == nsbw - 1) {
                /* the tile is done: per row (g, g+8) and token, (hi + mid) + lo, where column c
                 * of a row is D register c%2 of lane quarter c/2 */
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
                        if (t == 0) {
#pragma unroll
                            for (int u = 0; u < NT; u++)
                                part[DUAL ? mt : u][(lr0 + 8 * r) * S + s] = res[u];
                        }
                    }
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[mt][c] = 0.0f;
                }
            }
        }
        __syncwarp();                  /* slot q % ST is refilled next iteration */
    }
    cp_async_wait<0>();
    __syncthreads();

    mv_write_rows<DUAL, NT>(part, G * a.rpg * 16, T0 * 16, rows, S, a, y, y_tok, tab, tab_pos0);
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
    a.rpg = mv_rpg(all_tiles, G, want_blocks, probs, MVQ_RPG_MAX);
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
#define MVQ_MAX_NSB 64   /* the longest row the fast kernel takes: 64 super-blocks (K = 16384) */
static bool mvq_shape_ok(int type, int mode, int nt, int64_t K, size_t row_bytes, size_t mat_bytes,
                         const void *w, const void *w2) {
    if (!dsq_is_type(type) || K <= 0 || K % DS4_QK_K != 0 || K / DS4_QK_K > MVQ_MAX_NSB) return false;
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

/* Resident blocks per SM of each k_matvec_q instantiation by super-blocks per row (K/256,
 * up to MVQ_MAX_NSB): asked once, at init (mvq_setup_t), never inside a step. */
template <int TYPE, int MODE, int NT> struct mvq_occ { static int bps[MVQ_MAX_NSB + 1]; };
template <int TYPE, int MODE, int NT> int mvq_occ<TYPE, MODE, NT>::bps[MVQ_MAX_NSB + 1];

/* Raise the instantiation's shared-memory limit and ask its occupancy for every K it takes. */
template <int TYPE, int MODE, int NT>
static void mvq_setup_t(void) {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_matvec_q<TYPE, MODE, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(g_cuda.smem_optin - sizeof(float) * 2 * MVQ_PART
                                              - sizeof(double) * MV_WARPS)));
    for (int nsb = 1; nsb <= MVQ_MAX_NSB; nsb++) {
        const size_t smem = mvq_smem_bytes<TYPE, MODE, NT>(nsb);
        int n = 0;
        if (smem + sizeof(float) * 2 * MVQ_PART + sizeof(double) * MV_WARPS <= g_cuda.smem_optin)
            DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_matvec_q<TYPE, MODE, NT>,
                                                                         MV_THREADS, smem));
        mvq_occ<TYPE, MODE, NT>::bps[nsb] = n > 0 ? n : 1;
    }
}

template <int TYPE>
static void mvq_setup_type(void) {
    mvq_setup_t<TYPE, MV_GATE_UP, 1>();
    mvq_setup_t<TYPE, MV_DOWN, 1>();
    mvq_setup_t<TYPE, MV_DENSE, 1>();
    mvq_setup_t<TYPE, MV_DENSE, 2>();
}

/* The one launcher of k_matvec_q (a template over its instantiations). */
template <int TYPE, int MODE, int NT>
static void mvq_launch_t(mv_args a, int n_prob, int n_tok_grid) {
    const int nsb = a.K / DS4_QK_K;
    const size_t smem = mvq_smem_bytes<TYPE, MODE, NT>(nsb);
    const int bps = nsb <= MVQ_MAX_NSB ? mvq_occ<TYPE, MODE, NT>::bps[nsb] : 0;
    if (bps < 1) {
        ds4_fatal("matvec_q: no occupancy for %d super-blocks per row", nsb);
    }
    const dim3 grid = mvq_plan(a, n_prob, n_tok_grid, bps);
    DS4_WHATIF_SKIP_MV(MODE);
    DS4_LAUNCH(k_matvec_q<TYPE, MODE, NT>, grid, MV_THREADS, smem, a);
}

template <int TYPE>
static void mvq_type(const mv_args &a, int n_prob, int n_tok_grid, int mode, int nt) {
    if (mode == MV_GATE_UP) mvq_launch_t<TYPE, MV_GATE_UP, 1>(a, n_prob, n_tok_grid);
    else if (mode == MV_DOWN) mvq_launch_t<TYPE, MV_DOWN, 1>(a, n_prob, n_tok_grid);
    else if (nt == 2) mvq_launch_t<TYPE, MV_DENSE, 2>(a, n_prob, n_tok_grid);
    else mvq_launch_t<TYPE, MV_DENSE, 1>(a, n_prob, n_tok_grid);
}

/* ---------------------------------------------------------------------------
 * Prefill dequantisation (a faster k_dequant for these types)
 *
 * One warp per super-block, lane p writing elements 8p..8p+7 (two coalesced float4 stores
 * when dst is 16-byte aligned), with dsq_block8's bit-exact values.
 * ------------------------------------------------------------------------- */

__global__ void k_dequant_q(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                            float *dst) {
    ds4_grid_dep();
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
    DS4_LAUNCH(k_dequant_q, grid_for(nrows * (K / DS4_QK_K) * 32), 256, 0, src, type, row_bytes, K, nrows, dst);
}

#endif /* DS4_CUDA_MATVEC_Q_CUH */
