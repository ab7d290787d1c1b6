/* ds4_cuda_matmul.cu -- the CUDA backend's matrix products: the decode matvec (k_matvec; the
 * super-block types' k_matvec_q in ds4_cuda_matvec_q.cuh), the generic matvec, prefill through
 * dequantisation and cuBLAS, and the fused matmul_multi and matmul_swiglu.
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * Matmul
 *
 * Three engines behind one interface:
 *
 *  1. The fast matvec (k_matvec), for nt <= MV_MAX_NT on rows of a multiple of
 *     1024 elements.  A row is cut into slices of 1024 elements; each warp
 *     owns one slice and keeps the matching activations in registers (32 per
 *     lane, for up to 4 tokens), then walks down rows.  A block of 8 warps
 *     covers S = K/1024 slices x 8/S row groups; each warp writes its slice's
 *     partial sum to shared memory and the block adds the S partials of a row
 *     in slice order at the end.
 *     The activations reach the registers through shared memory: a lane's 32
 *     values are contiguous, so reading them straight from global memory
 *     touches 32 cache lines per instruction and costs more than reading the
 *     weights.  The block loads
 *     them coalesced into a padded (bank-conflict-free) buffer instead, while
 *     the first weight rows are already in flight.
 *     Q8_0 rows (34-byte blocks, only 16-byte aligned per 1024 elements) are
 *     copied into a per-warp shared-memory ring with cp.async, several rows
 *     ahead, so the loads are coalesced 16-byte transactions; each lane then
 *     reads its own 34-byte block from shared memory (9 aligned words and a
 *     funnel shift).  int8 -> f32 goes through a byte permute into the
 *     mantissa of 2^23 and one subtraction, which is exact and cheaper than
 *     the conversion instruction.  F32/F16/BF16 rows are read straight into
 *     registers with coalesced 16-byte loads.
 *     Measured on an H200 (copy bandwidth 4.23 TB/s read+write): the
 *     4096x129280 Q8_0 head streams at 4.0 TB/s, 4096x8192 at 2.6 TB/s;
 *     matrices of a few MB are bound by launch and latency (~5 us).
 *     The same kernel serves the MoE decode path: "gate|up" mode dots two
 *     matrices per row and writes swiglu(gate, up); "down" mode takes its
 *     activations per (token, expert slot).  The expert id is read from sel
 *     on the device.  A call of several tokens (a speculative check) keeps a
 *     block per (token, slot) pair even where tokens share an expert: a block
 *     taking one expert for two tokens streams fewer bytes but issues more per
 *     byte, and measured slower (bench/RESULTS.md); its dense products do take
 *     up to 4 tokens a launch.
 *  2. The generic matvec (k_matvec_generic): a warp per row for any K, any
 *     type; slower, and used only for shapes the fast kernel does not take.
 *  3. Prefill (nt > MV_MAX_NT): dequantize row tiles into an f32 scratch and
 *     call cublasSgemm.  cuBLAS is column-major: y[nt][N] = x[nt][K] W^T is
 *     C(N x nt) = A^T B with A the K x N column-major view of W.
 * ------------------------------------------------------------------------- */

/* Shared-memory ring depth for Q8_0 staging: rows in flight per warp (the
 * gate|up mode stages two rows per step).  MV_MIN_BLOCKS: the launch-bounds
 * floor of resident blocks per SM for one-token launches, which caps the
 * registers.  Both can be set at build time (-DMV_ST_DENSE=...) to measure
 * them.  A sweep on an H200 (bench/RESULTS.md, 2026-12-01: dense 3..8,
 * gate|up 2..6, floor 1..4) moved no shape by more than a few percent: the
 * kernel is bound by instruction issue (~160 per 1088-byte row slice) as
 * much as by memory.  The shallowest ring was best on the large shapes
 * (q_b, the output projections, the experts: 2-4% faster) and within 2% on
 * the small ones, so it is the default. */
#ifndef MV_ST_DENSE
#define MV_ST_DENSE 3
#endif
#ifndef MV_ST_GATE_UP
#define MV_ST_GATE_UP 2
#endif
#ifndef MV_MIN_BLOCKS
#define MV_MIN_BLOCKS 2
#endif
template <int MODE> struct mv_stages { static const int n = (MODE == MV_GATE_UP) ? MV_ST_GATE_UP : MV_ST_DENSE; };

/* Activations of one token, staged for the register load: S slices of 1024
 * floats, each 32-float group followed by 4 floats of padding so that lanes
 * reading 16 bytes at 32-float strides hit distinct banks. */
#define MV_XS_FLOATS (MV_SLICE + MV_SLICE / 8)
__host__ __device__ __forceinline__ int mv_xs_addr(int e) { return e + 4 * (e >> 5); }

/* Dynamic shared memory: [S][MV_XS_FLOATS] activations, then the Q8_0 ring,
 * then (in_norm only) the norm weights staged like the activations. */
template <int TYPE, int MODE>
__host__ __device__ constexpr size_t mv_ring_bytes() {
    return TYPE == DS4_TYPE_Q8_0
        ? (size_t)MV_WARPS * mv_stages<MODE>::n * (MODE == MV_GATE_UP ? 2 : 1) * MV_Q8_SLICE
        : 0;
}
template <int TYPE, int MODE>
static size_t mv_smem_bytes(int S, bool in_norm) {
    return (size_t)S * MV_XS_FLOATS * sizeof(float) * (in_norm ? 2 : 1) + mv_ring_bytes<TYPE, MODE>();
}

/* Which element of its slice lane `lane` multiplies into its m-th product:
 * it mirrors how each type's row bytes land in the lane. */
template <int TYPE>
__device__ __forceinline__ int mv_xidx(int lane, int m) {
    if (TYPE == DS4_TYPE_Q8_0) return 32 * lane + m;                        /* one block per lane */
    if (TYPE == DS4_TYPE_F32)  return 4 * (lane + 32 * (m >> 2)) + (m & 3); /* float4 chunks */
    return 8 * (lane + 32 * (m >> 3)) + (m & 7);                            /* 8 halves per chunk */
}

/* Dot of the lane's Q8_0 block (in the staged slice) with its activations. */
template <int NT>
__device__ __forceinline__ void mv_dot_q8(const uint8_t *slot, int lane, const float (&xr)[NT][32],
                                          float (&acc)[NT]) {
    /* Block `lane` starts at byte 34*lane: 4-aligned for even lanes, 2 past a
     * 4-byte boundary for odd ones.  Load 9 aligned words from the boundary at
     * or before it; the scale is the low or high half of word 0, and quant
     * word i is the funnel shift of words i, i+1 by 16 (even) or 32 (odd). */
    const int odd = lane & 1;
    const uint32_t *wp = (const uint32_t *)(slot + 34 * lane - 2 * odd);
    uint32_t wd[9];
#pragma unroll
    for (int i = 0; i < 9; i++) wd[i] = wp[i];
    const float d = dsq_f16((uint16_t)(odd ? (wd[0] >> 16) : (wd[0] & 0xffffu)));
    const unsigned sh = odd ? 32u : 16u;
    float s[NT];
#pragma unroll
    for (int u = 0; u < NT; u++) s[u] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        /* bias the signed bytes to 0..255 and place each in the mantissa of
         * 2^23: the float is 2^23 + q + 128 exactly */
        const uint32_t q = __funnelshift_rc(wd[i], wd[i + 1], sh) ^ 0x80808080u;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const float f = __int_as_float((int)__byte_perm(q, 0x4B000000u, 0x7440u + b)) - 8388736.0f;
#pragma unroll
            for (int u = 0; u < NT; u++) s[u] = fmaf(f, xr[u][4 * i + b], s[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < NT; u++) acc[u] = d * s[u];
}

/* Dot of the lane's F32/F16/BF16 chunks of a slice with its activations. */
template <int TYPE, int NT>
__device__ __forceinline__ void mv_dot_vec(const uint4 *v, const float (&xr)[NT][32], float (&acc)[NT]) {
    constexpr int NV = TYPE == DS4_TYPE_F32 ? 8 : 4;
#pragma unroll
    for (int u = 0; u < NT; u++) acc[u] = 0.0f;
#pragma unroll
    for (int c = 0; c < NV; c++) {
        const uint32_t wd[4] = { v[c].x, v[c].y, v[c].z, v[c].w };
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (TYPE == DS4_TYPE_F32) {
                const float f = __uint_as_float(wd[j]);
#pragma unroll
                for (int u = 0; u < NT; u++) acc[u] = fmaf(f, xr[u][4 * c + j], acc[u]);
            } else {
                float f0, f1;
                if (TYPE == DS4_TYPE_F16) {
                    f0 = dsq_f16((uint16_t)(wd[j] & 0xffffu));
                    f1 = dsq_f16((uint16_t)(wd[j] >> 16));
                } else {
                    f0 = __uint_as_float(wd[j] << 16);
                    f1 = __uint_as_float(wd[j] & 0xffff0000u);
                }
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    acc[u] = fmaf(f0, xr[u][8 * c + 2 * j], acc[u]);
                    acc[u] = fmaf(f1, xr[u][8 * c + 2 * j + 1], acc[u]);
                }
            }
        }
    }
}

template <int TYPE, int NT, int MODE>
__global__ void __launch_bounds__(MV_THREADS, NT >= 4 ? 1 : NT >= 2 ? 2 : MV_MIN_BLOCKS) k_matvec(const mv_args a) {
    /* NOTE(pdl prologue): dense mode reads nothing another kernel writes until its grid wait
     * below -- the weights and the step block are the host's -- so its first rows' copies can
     * be in flight while the kernel before it finishes */
    if (MODE != MV_DENSE) ds4_grid_dep();   /* NOTE(pdl prologue): the MoE modes read the experts chosen */
    constexpr bool DUAL = MODE == MV_GATE_UP;
    constexpr int NMAT = DUAL ? 2 : 1;
    constexpr int NPLANE = DUAL ? 2 : NT;
    static_assert(!(DUAL && NT != 1), "gate|up mode is single-token");
    extern __shared__ __align__(16) uint8_t mv_smem[];
    __shared__ float part[NPLANE][MV_PART];   /* [plane][local row * S + slice] */

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int S = a.S, G = MV_WARPS / S;
    const int s = warp % S, g = warp / S;
    const int tile = G * a.rpg;
    const int prob = blockIdx.y, tok = blockIdx.z;
    float *xs = (float *)mv_smem;                                    /* [S][MV_XS_FLOATS] */
    uint8_t *stage = mv_smem + (size_t)S * MV_XS_FLOATS * sizeof(float);
    float *ws = (float *)(stage + mv_ring_bytes<TYPE, MODE>());      /* in_norm: [S][MV_XS_FLOATS] */

    const uint8_t *W[NMAT];            /* the block's problem (mv_problem) */
    const float *x, *tab; float *y; int rows, bx, tab_pos0; int64_t y_tok;
    mv_problem<MODE, NMAT>(a, prob, tok, W, x, y, rows, bx, y_tok, tab, tab_pos0);

    /* my rows: first + G*i, i < n_mine */
    const int first = bx * tile + g;
    const int n_mine = first < rows ? min(a.rpg, (rows - 1 - first) / G + 1) : 0;

    /* Q8_0: put the first rows in flight before anything else */
    constexpr int ST = mv_stages<MODE>::n;
    uint8_t *ring = stage + (size_t)warp * ST * NMAT * MV_Q8_SLICE;
    if (TYPE == DS4_TYPE_Q8_0) {
#pragma unroll
        for (int p = 0; p < ST - 1; p++) {     /* one commit group per row, even if empty */
            if (p < n_mine) {
                const size_t off = (size_t)(first + G * p) * a.row_bytes + (size_t)s * MV_Q8_SLICE;
#pragma unroll
                for (int mt = 0; mt < NMAT; mt++) {
                    uint8_t *dst = ring + (size_t)(p * NMAT + mt) * MV_Q8_SLICE;
                    for (int c = lane; c < MV_Q8_SLICE / 16; c += 32)
                        cp_async16(dst + 16 * c, W[mt] + off + 16 * c);
                }
            }
            cp_async_commit();
        }
    }
    if (MODE == MV_DENSE) ds4_grid_dep();   /* NOTE(pdl prologue): x, written by the kernel before */

    /* activations: coalesced loads of all S slices by the block, one token
     * at a time, then each lane takes its 32 values in 16-byte reads */
    float xr[NT][32];
    __shared__ double nred[MV_WARPS];
#pragma unroll
    for (int u = 0; u < NT; u++) {
        const float *xu = x + (int64_t)u * a.x_tok;
        double ss = 0.0;
#pragma unroll 8
        for (int e = threadIdx.x; e < S * MV_SLICE; e += MV_THREADS) {
            const float v = xu[e];
            xs[mv_xs_addr(e)] = v;
            if (a.in_norm) {
                ss += (double)(v * v);
                if (u == 0) ws[mv_xs_addr(e)] = a.in_norm[e];   /* coalesced, like x */
            }
        }
        float nsc = 1.0f;
        if (a.in_norm) {            /* the input's RMSNorm, as k_rmsnorm computes it */
            ss = warp_sum(ss);
            if (lane == 0) nred[warp] = ss;
        }
        __syncthreads();
        if (a.in_norm) {
            double tot = 0.0;
            for (int wv = 0; wv < MV_WARPS; wv++) tot += nred[wv];
            nsc = 1.0f / sqrtf((float)(tot / (double)a.K) + a.in_eps);
        }
        const float *xw = xs + s * MV_XS_FLOATS;
#pragma unroll
        for (int m = 0; m < 32; m += 4) {
            const float4 v = *(const float4 *)(xw + mv_xs_addr(mv_xidx<TYPE>(lane, m)));
            xr[u][m] = v.x; xr[u][m + 1] = v.y; xr[u][m + 2] = v.z; xr[u][m + 3] = v.w;
        }
        if (a.in_norm) {
            const float *ww = ws + s * MV_XS_FLOATS;
#pragma unroll
            for (int m = 0; m < 32; m += 4) {
                const float4 g = *(const float4 *)(ww + mv_xs_addr(mv_xidx<TYPE>(lane, m)));
                xr[u][m]     = __fmul_rn(__fmul_rn(xr[u][m], nsc), g.x);
                xr[u][m + 1] = __fmul_rn(__fmul_rn(xr[u][m + 1], nsc), g.y);
                xr[u][m + 2] = __fmul_rn(__fmul_rn(xr[u][m + 2], nsc), g.z);
                xr[u][m + 3] = __fmul_rn(__fmul_rn(xr[u][m + 3], nsc), g.w);
            }
        }
        __syncthreads();
    }

    if (TYPE == DS4_TYPE_Q8_0) {
        for (int i = 0; i < n_mine; i++) {
            const int ahead = i + ST - 1;
            if (ahead < n_mine) {
                const size_t off = (size_t)(first + G * ahead) * a.row_bytes + (size_t)s * MV_Q8_SLICE;
#pragma unroll
                for (int mt = 0; mt < NMAT; mt++) {
                    uint8_t *dst = ring + (size_t)((ahead % ST) * NMAT + mt) * MV_Q8_SLICE;
                    for (int c = lane; c < MV_Q8_SLICE / 16; c += 32)
                        cp_async16(dst + 16 * c, W[mt] + off + 16 * c);
                }
            }
            cp_async_commit();
            cp_async_wait<ST - 1>();   /* row i's group has landed (for this lane) */
            __syncwarp();              /* ... and for every lane */
            const int lr = g + G * i;
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
                float acc[NT];
                mv_dot_q8<NT>(ring + (size_t)((i % ST) * NMAT + mt) * MV_Q8_SLICE, lane, xr, acc);
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    const float r = warp_sum(acc[u]);
                    if (lane == 0) part[DUAL ? mt : u][lr * S + s] = r;
                }
            }
            __syncwarp();              /* slot (i % ST) is refilled next iteration */
        }
        cp_async_wait<0>();
    } else {
        constexpr int NV = TYPE == DS4_TYPE_F32 ? 8 : 4;
        const size_t slice_bytes = (size_t)MV_SLICE * (TYPE == DS4_TYPE_F32 ? 4 : 2);
        for (int i = 0; i < n_mine; i++) {
            const size_t off = (size_t)(first + G * i) * a.row_bytes + (size_t)s * slice_bytes;
            uint4 v[NMAT][NV];
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++)
#pragma unroll
                for (int c = 0; c < NV; c++)
                    v[mt][c] = ld_stream16(W[mt] + off + 16 * (size_t)(lane + 32 * c));
            const int lr = g + G * i;
#pragma unroll
            for (int mt = 0; mt < NMAT; mt++) {
                float acc[NT];
                mv_dot_vec<TYPE, NT>(v[mt], xr, acc);
#pragma unroll
                for (int u = 0; u < NT; u++) {
                    const float r = warp_sum(acc[u]);
                    if (lane == 0) part[DUAL ? mt : u][lr * S + s] = r;
                }
            }
        }
    }
    __syncthreads();

    mv_write_rows<DUAL, NT>(part, tile, bx * tile, rows, S, a, y, y_tok, tab, tab_pos0);
}

/* Units (rows, or 16-row tiles) per warp: enough blocks per problem for one wave of want_blocks
 * over probs problems, G warps a block; at least 1, at most max. */
static int mv_rpg(int64_t units, int G, int64_t want_blocks, int64_t probs, int max) {
    int64_t per_prob = (want_blocks + probs - 1) / probs;
    if (per_prob < 1) per_prob = 1;
    int64_t rpg = (units + G * per_prob - 1) / (G * per_prob);
    if (rpg < 1) rpg = 1;
    if (rpg > max) rpg = max;
    return (int)rpg;
}

/* Rows per warp and the grid of a fast launch.  One wave: aim for as many
 * blocks as fit on the device at once (blocks_per_sm, from the occupancy of
 * this instantiation and its shared memory), since a launch of 1.3 waves
 * takes two block times; rows per warp grow only once every resident slot
 * has a block.  Segments (matmul_multi) get whole tiles of their own. */
static dim3 mv_plan(mv_args &a, int n_prob, int n_tok_grid, int blocks_per_sm) {
    const int G = MV_WARPS / a.S;
    const int64_t want_blocks = (int64_t)blocks_per_sm * g_cuda.n_sm;
    const int64_t probs = (int64_t)n_prob * n_tok_grid;
    int64_t all_rows = a.rows;
    if (a.n_seg > 0) {
        all_rows = 0;
        for (int i = 0; i < a.n_seg; i++) all_rows += a.seg_rows[i];
    }
    a.rpg = mv_rpg(all_rows, G, want_blocks, probs, MV_RPG_MAX);
    const int tile = G * a.rpg;
    int64_t tiles = (a.rows + tile - 1) / tile;
    if (a.n_seg > 0) {
        tiles = 0;
        for (int i = 0; i < a.n_seg; i++) {
            a.seg_tile0[i] = (int)tiles;
            tiles += (a.seg_rows[i] + tile - 1) / tile;
        }
        a.seg_tile0[a.n_seg] = (int)tiles;
    }
    return dim3((unsigned)tiles, (unsigned)n_prob, (unsigned)n_tok_grid);
}

/* Resident blocks per SM of each k_matvec instantiation, by (S, norm):
 * asked once, at init (mv_setup_t, from ops_setup), never inside a step. */
template <int TYPE, int NT, int MODE> struct mv_occ { static int bps[MV_WARPS + 1][2]; };
template <int TYPE, int NT, int MODE> int mv_occ<TYPE, NT, MODE>::bps[MV_WARPS + 1][2];

/* Raise the instantiation's shared-memory limit (for the largest S, with the
 * norm buffer) and ask its occupancy for every S the fast path takes. */
template <int TYPE, int NT, int MODE>
static void mv_setup_t(void) {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_matvec<TYPE, NT, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)mv_smem_bytes<TYPE, MODE>(MV_WARPS, MODE == MV_DENSE)));
    for (int S = 1; S <= MV_WARPS; S *= 2)
        for (int norm = 0; norm < 2; norm++) {
            int n = 0;
            DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_matvec<TYPE, NT, MODE>, MV_THREADS,
                                                                         mv_smem_bytes<TYPE, MODE>(S, norm != 0)));
            mv_occ<TYPE, NT, MODE>::bps[S][norm] = n > 0 ? n : 1;
        }
}

template <int TYPE>
static void mv_setup_type(void) {
    mv_setup_t<TYPE, 1, MV_GATE_UP>();
    mv_setup_t<TYPE, 1, MV_DOWN>();
    mv_setup_t<TYPE, 1, MV_DENSE>();
    mv_setup_t<TYPE, 2, MV_DENSE>();
    mv_setup_t<TYPE, 3, MV_DENSE>();
    mv_setup_t<TYPE, 4, MV_DENSE>();
}

/* The one launcher of k_matvec (a template over its instantiations). */
template <int TYPE, int NT, int MODE>
static void launch_matvec_fast_t(mv_args a, int n_prob, int n_tok_grid) {
    const bool norm = a.in_norm != NULL;
    const size_t smem = mv_smem_bytes<TYPE, MODE>(a.S, norm);
    const int bps = mv_occ<TYPE, NT, MODE>::bps[a.S][norm];
    if (bps < 1) {
        ds4_fatal("matvec: no occupancy for S = %d (ops_setup did not run)", a.S);
    }
    const dim3 grid = mv_plan(a, n_prob, n_tok_grid, bps);
    DS4_WHATIF_SKIP_MV(MODE);
    DS4_LAUNCH(k_matvec<TYPE, NT, MODE>, grid, MV_THREADS, smem, a);
}

template <int TYPE>
static void matvec_fast_type(const mv_args &a, int n_prob, int n_tok_grid, int mode, int nt) {
    if (mode == MV_GATE_UP) launch_matvec_fast_t<TYPE, 1, MV_GATE_UP>(a, n_prob, n_tok_grid);
    else if (mode == MV_DOWN) launch_matvec_fast_t<TYPE, 1, MV_DOWN>(a, n_prob, n_tok_grid);
    else if (nt == 4) launch_matvec_fast_t<TYPE, 4, MV_DENSE>(a, n_prob, n_tok_grid);
    else if (nt == 3) launch_matvec_fast_t<TYPE, 3, MV_DENSE>(a, n_prob, n_tok_grid);
    else if (nt == 2) launch_matvec_fast_t<TYPE, 2, MV_DENSE>(a, n_prob, n_tok_grid);
    else launch_matvec_fast_t<TYPE, 1, MV_DENSE>(a, n_prob, n_tok_grid);
}

/* A dense launch over nt_dense tokens in chunks of max_chunk, the last one what is left (the
 * fast kernels keep a chunk's activations on chip, and a token's arithmetic does not depend
 * on the chunk); fn gets the chunk's arguments and its token count. */
template <typename F>
static void mv_token_chunks(const mv_args &a, int nt_dense, int max_chunk, F fn) {
    int done = 0;
    while (done < nt_dense) {
        const int chunk = nt_dense - done < max_chunk ? nt_dense - done : max_chunk;
        mv_args c = a;
        c.x = a.x + (int64_t)done * a.x_tok;
        c.y = a.y + (int64_t)done * a.y_tok;
        c.tok0 = done;
        for (int i = 0; i < a.n_seg; i++) c.seg_y[i] = a.seg_y[i] + (int64_t)done * a.seg_rows[i];
        fn(c, chunk);
        done += chunk;
    }
}

#include "ds4_cuda_matvec_q.cuh"

/* Generic fallback: one warp per row, any K (multiple of 32 for Q8_0). */
template <int TYPE>
__device__ __forceinline__ float mv_row_dot_generic(const uint8_t *row, const float *x, int K, int lane) {
    float acc = 0.0f;
    if (TYPE == DS4_TYPE_Q8_0) {
        for (int b = 0; b < K / DS4_QK8_0; b++) {
            const uint8_t *blk = row + (size_t)b * DS4_Q8_0_BLOCK_BYTES;
            const float d = dsq_f16(*(const uint16_t *)blk);
            acc = fmaf(d * (float)(int8_t)blk[2 + lane], x[b * DS4_QK8_0 + lane], acc);
        }
    } else {
        for (int k = lane; k < K; k += 32) acc = fmaf(weight_elem(TYPE, row, k), x[k], acc);
    }
    return warp_sum(acc);
}

template <int TYPE, int MODE>
__global__ void __launch_bounds__(MV_THREADS) k_matvec_generic(const mv_args a, int n_tok_loop) {
    ds4_grid_dep();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    if (row >= a.rows) return;
    const int prob = blockIdx.y, tok = blockIdx.z;
    const size_t mat = (MODE == MV_DENSE || !a.sel) ? (size_t)prob
                                                    : (size_t)a.sel[(int64_t)tok * a.k + prob];
    const uint8_t *r0 = a.w + mat * a.mat_bytes + (size_t)row * a.row_bytes;
    const float *x = a.x + (int64_t)tok * a.x_tok + (int64_t)prob * a.x_prob;
    float *y = a.y + (int64_t)tok * a.y_tok + (int64_t)prob * a.y_prob;
    if (MODE == MV_GATE_UP) {
        const uint8_t *r1 = a.w2 + mat * a.mat_bytes + (size_t)row * a.row_bytes;
        const float gv = mv_row_dot_generic<TYPE>(r0, x, a.K, lane);
        const float uv = mv_row_dot_generic<TYPE>(r1, x, a.K, lane);
        if (lane == 0) y[row] = silu_mul(gv, uv, a.clamp);
    } else {
        for (int u = 0; u < n_tok_loop; u++) {
            const float v = mv_row_dot_generic<TYPE>(r0, x + (int64_t)u * a.x_tok, a.K, lane);
            if (lane == 0) y[(int64_t)u * a.y_tok + row] = v;
        }
    }
}

template <int TYPE, int MODE>
static void launch_matvec_generic_t(const mv_args &a, dim3 grid, int n_tok_loop) {
    DS4_LAUNCH(k_matvec_generic<TYPE, MODE>, grid, MV_THREADS, 0, a, n_tok_loop);
}

template <int TYPE>
static void matvec_generic_type(const mv_args &a, dim3 grid, int mode, int n_tok_loop) {
    if (mode == MV_GATE_UP) launch_matvec_generic_t<TYPE, MV_GATE_UP>(a, grid, 1);
    else if (mode == MV_DOWN) launch_matvec_generic_t<TYPE, MV_DOWN>(a, grid, 1);
    else launch_matvec_generic_t<TYPE, MV_DENSE>(a, grid, n_tok_loop);
}

int type_supported(int type) {
    return type == DS4_TYPE_F32 || type == DS4_TYPE_F16 || type == DS4_TYPE_BF16 || type == DS4_TYPE_Q8_0 ||
           dsq_is_type(type);
}

void check_matrix_type(int type, const char *what) {
    if (!type_supported(type)) {
        ds4_fatal("%s: unsupported weight type %d", what, type);
    }
}

/* Does the fast kernel take this shape?  K a multiple of 1024 with 1, 2, 4 or
 * 8 slices; rows and matrices 16-byte aligned. */
static bool mv_fast_ok(int64_t K, size_t row_bytes, size_t mat_bytes, const void *w, const void *w2) {
    const int64_t S = K % MV_SLICE == 0 ? K / MV_SLICE : 0;
    return (S == 1 || S == 2 || S == 4 || S == 8) && (uintptr_t)w % 16 == 0 &&
           (!w2 || (uintptr_t)w2 % 16 == 0) && row_bytes % 16 == 0 && mat_bytes % 16 == 0;
}

/* Run a matvec problem set: n_prob problems (blockIdx.y) x n_tok_grid tokens
 * (blockIdx.z, MoE modes) x nt_dense tokens inside (dense mode). */
void matvec_run(int type, int mode, mv_args a, int n_prob, int n_tok_grid, int nt_dense) {
    if ((a.n_seg == 0 && a.rows <= 0) || n_prob <= 0 || n_tok_grid <= 0 || nt_dense <= 0) return;
    const bool quant = dsq_is_type(type) && mvq_fast_ok(type, mode, a.K, a.row_bytes, a.mat_bytes, a.w, a.w2);
    const bool fast = quant || (!dsq_is_type(type) && mv_fast_ok(a.K, a.row_bytes, a.mat_bytes, a.w, a.w2));
    if (a.n_seg > 0 && !fast) {
        ds4_fatal("matvec: a multi-matrix launch needs the fast kernel's shapes");
    }
    if (!fast) {
        dim3 grid((unsigned)((a.rows + MV_WARPS - 1) / MV_WARPS), (unsigned)n_prob, (unsigned)n_tok_grid);
        switch (type) {
        case DS4_TYPE_F32:  matvec_generic_type<DS4_TYPE_F32>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_F16:  matvec_generic_type<DS4_TYPE_F16>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_BF16: matvec_generic_type<DS4_TYPE_BF16>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_Q2_K: matvec_generic_type<DS4_TYPE_Q2_K>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_Q4_K: matvec_generic_type<DS4_TYPE_Q4_K>(a, grid, mode, nt_dense); break;
        case DS4_TYPE_IQ2_XXS: matvec_generic_type<DS4_TYPE_IQ2_XXS>(a, grid, mode, nt_dense); break;
        default:            matvec_generic_type<DS4_TYPE_Q8_0>(a, grid, mode, nt_dense); break;
        }
        return;
    }
    /* dense tokens in chunks of up to 4 (the activations of a chunk live in registers; a
     * call of 3, a speculative check's, is one launch); with DS4_CUDA_DECODE_GROUP=0 chunks of
     * 4, 2, 1 as before (a call of 3 streams its matrices twice).  The super-block types'
     * kernel takes two at most (three f16 parts per token fill 6 of the MMA's 8 columns) and
     * sets the slices itself (mvq_plan) */
    int max_chunk = 4;
    if (quant) {
        if (mode != MV_DENSE) nt_dense = 1;
        max_chunk = mode == MV_DENSE && mvq_shape_ok(type, mode, 2, a.K, a.row_bytes, a.mat_bytes, a.w, a.w2) ? 2 : 1;
    } else {
        a.S = a.K / MV_SLICE;
        if (sess()->lim.decode_group == 0 && nt_dense == 3) max_chunk = 2;
    }
    mv_token_chunks(a, nt_dense, max_chunk, [&](const mv_args &c, int chunk) {
        switch (type) {
        case DS4_TYPE_F32:     matvec_fast_type<DS4_TYPE_F32>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_F16:     matvec_fast_type<DS4_TYPE_F16>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_BF16:    matvec_fast_type<DS4_TYPE_BF16>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_Q2_K:    mvq_type<DS4_TYPE_Q2_K>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_Q4_K:    mvq_type<DS4_TYPE_Q4_K>(c, n_prob, n_tok_grid, mode, chunk); break;
        case DS4_TYPE_IQ2_XXS: mvq_type<DS4_TYPE_IQ2_XXS>(c, n_prob, n_tok_grid, mode, chunk); break;
        default:               matvec_fast_type<DS4_TYPE_Q8_0>(c, n_prob, n_tok_grid, mode, chunk); break;
        }
    });
}

/* Dequantize nrows rows of K elements (any type) into dst[nrows][K]. */
__global__ void k_dequant(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                          float *dst) {
    ds4_grid_dep();
    const int64_t n = nrows * K;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = idx / K, c = idx % K;
        dst[idx] = weight_elem(type, src + (size_t)r * row_bytes, c);
    }
}

static void launch_dequant(const uint8_t *src, int type, size_t row_bytes, int64_t K, int64_t nrows,
                           float *dst) {
    if (nrows <= 0 || K <= 0) return;
    if (dsq_is_type(type)) {
        launch_dequant_q(src, type, row_bytes, K, nrows, dst);
        return;
    }
    DS4_LAUNCH(k_dequant, grid_for(nrows * K), 256, 0, src, type, row_bytes, K, nrows, dst);
}

/* y[t][r] (row stride ldy) = sum_k W[row0 + r][k] x[t][k] (row stride ldx) for
 * r < nrows, t < nt, with W the matrix at byte offset mat_off of w.  Row tiles
 * are dequantized into scratch (F32 weights are used in place) and multiplied
 * by cuBLAS: C(nr x nt, ld ldy) = A^T(nr x K) B(K x nt, ld ldx). */
void gemm_rows(const ds4_weight *w, size_t mat_off, int64_t row0, int64_t nrows,
               const float *x, int64_t ldx, float *y, int64_t ldy, int nt) {
    if (nrows <= 0 || nt <= 0) return;
    const int64_t K = w->ne[0];
    const size_t rb = ds4_row_bytes(w->type, K);
    const uint8_t *base = (const uint8_t *)w->dev + mat_off + (size_t)row0 * rb;
    if (gemm_tc_rows(w->type, base, rb, K, nrows, x, ldx, y, ldy, nt)) return;   /* ds4_cuda_gemm.cu */
    const float one = 1.0f, zero = 0.0f;
    int64_t tile = w->type == DS4_TYPE_F32 ? nrows : DEQ_CAP_FLOATS / K;
    if (tile < 1) tile = 1;
    if (tile > nrows) tile = nrows;
    float *deq = w->type == DS4_TYPE_F32 ? NULL
                                        : (float *)scratch_get(&sess()->deq, (size_t)(tile * K) * sizeof(float));
    for (int64_t r0 = 0; r0 < nrows; r0 += tile) {
        const int64_t nr = nrows - r0 < tile ? nrows - r0 : tile;
        const float *A;
        if (w->type == DS4_TYPE_F32) {
            A = (const float *)(base + (size_t)r0 * rb);
        } else {
            launch_dequant(base + (size_t)r0 * rb, w->type, rb, K, nr, deq);
            A = deq;
        }
        DS4_CUBLAS(cublasSgemm(sess_blas(), CUBLAS_OP_T, CUBLAS_OP_N, (int)nr, nt, (int)K,
                               &one, A, (int)K, x, (int)ldx, &zero, y + r0, (int)ldy));
    }
}

void cuda_matmul(const ds4_weight *w, int expert, const float *x, float *y, int nt) {
    if (nt <= 0) return;
    check_matrix_type(w->type, "matmul");
    const int64_t K = w->ne[0], N = w->ne[1];
    const size_t rb = ds4_row_bytes(w->type, K);
    const size_t mat_off = (size_t)expert * (size_t)N * rb;
    if (nt <= MV_MAX_NT) {
        mv_args a;
        memset(&a, 0, sizeof a);
        a.w = (const uint8_t *)w->dev + mat_off;
        a.mat_bytes = (size_t)N * rb;
        a.row_bytes = rb;
        a.K = (int)K;
        a.rows = (int)N;
        a.x = x; a.x_tok = K;
        a.y = y; a.y_tok = N;
        matvec_run(w->type, MV_DENSE, a, 1, 1, nt);
    } else {
        gemm_rows(w, mat_off, 0, N, x, K, y, N, nt);
    }
}

static void cuda_matmul_grouped(const ds4_weight *w, int groups, const float *x, float *y, int nt) {
    if (nt <= 0 || groups <= 0) return;
    check_matrix_type(w->type, "matmul_grouped");
    const int64_t K = w->ne[0], R = w->ne[1] / groups;
    const size_t rb = ds4_row_bytes(w->type, K);
    if (nt <= MV_MAX_NT) {
        mv_args a;
        memset(&a, 0, sizeof a);
        a.w = (const uint8_t *)w->dev;
        a.mat_bytes = (size_t)R * rb;       /* group g's rows start g*R rows in */
        a.row_bytes = rb;
        a.K = (int)K;
        a.rows = (int)R;
        a.x = x; a.x_prob = K; a.x_tok = (int64_t)groups * K;
        a.y = y; a.y_prob = R; a.y_tok = (int64_t)groups * R;
        matvec_run(w->type, MV_DENSE, a, groups, 1, nt);
    } else if (gemm_tc_ok(w->type, w->dev, rb, K)) {
        /* the groups as segments of one launch, each from its own part of one split of x, as
         * many at a time as the split scratch holds (ds4_cuda_gemm.cu) */
        int per = gemm_tc_parts_fit(nt, K);
        if (per > TC_SEG_MAX) per = TC_SEG_MAX;
        if (per < 1) ds4_fatal("matmul_grouped: the split scratch holds no part of %d x %lld", nt, (long long)K);
        const int launches = (groups + per - 1) / per;
        per = (groups + launches - 1) / launches;      /* the groups spread evenly over the launches */
        for (int g0 = 0; g0 < groups; g0 += per) {
            const int ng = groups - g0 < per ? groups - g0 : per;
            const tc_split sp = gemm_tc_split(x + (int64_t)g0 * K, (int64_t)groups * K, K, nt, ng);
            tc_seg seg[TC_SEG_MAX];
            for (int i = 0; i < ng; i++)
                seg[i] = (tc_seg){ (const uint8_t *)w->dev + (size_t)(g0 + i) * R * rb, R, y + (int64_t)(g0 + i) * R,
                                   (int64_t)groups * R, i };
            gemm_tc_multi(w->type, 0, 1, rb, sp, ng, seg, NULL, 0);
        }
    } else {
        for (int g = 0; g < groups; g++)
            gemm_rows(w, 0, (int64_t)g * R, R, x + (int64_t)g * K, (int64_t)groups * K,
                      y + (int64_t)g * R, (int64_t)groups * R, nt);
    }
}

/* matmul_multi: the fast kernel takes every matrix of one type in one launch
 * (decode: the seven projections of an attention input are one launch
 * instead of seven), normalising x in each block when asked and adding the
 * ape row in the epilogue.  Whatever it cannot take (prefill, other shapes)
 * runs as the composition the contract defines, after the fast launches,
 * since that path normalises x in place. */
static void cuda_matmul_multi(int n, const ds4_weight *const *w, float *const *y, float *x, int nt,
                              const float *norm_w, float eps, const float *const *add_tab, const ds4_step *step,
                              int period) {
    if (n <= 0 || nt <= 0) return;
    if (n > DS4_MULTI_MAX) {
        ds4_fatal("matmul_multi: %d matrices above %d", n, DS4_MULTI_MAX);
    }
    const int64_t K = w[0]->ne[0];
    bool done[DS4_MULTI_MAX] = { false };
    for (int i = 0; i < n; i++) {
        check_matrix_type(w[i]->type, "matmul_multi");
        if (w[i]->ne[0] != K) {
            ds4_fatal("matmul_multi: %s has K = %lld, not %lld", w[i]->name ? w[i]->name : "?",
                      (long long)w[i]->ne[0], (long long)K);
        }
    }
    if (add_tab && period <= 0) {
        ds4_fatal("matmul_multi: table period %d", period);
    }
    if (nt <= MV_MAX_NT) {
        for (int i = 0; i < n; i++) {
            if (done[i]) continue;
            const int type = w[i]->type;
            const size_t rb = ds4_row_bytes(type, K);
            mv_args a;
            memset(&a, 0, sizeof a);
            for (int j = i; j < n; j++) {
                const size_t mb = (size_t)w[j]->ne[1] * rb;
                if (done[j] || w[j]->type != type) continue;
                if (!(dsq_is_type(type) ? mvq_fast_ok(type, MV_DENSE, K, rb, mb, w[j]->dev, NULL)
                                        : mv_fast_ok(K, rb, mb, w[j]->dev, NULL))) continue;
                a.seg_w[a.n_seg] = (const uint8_t *)w[j]->dev;
                a.seg_y[a.n_seg] = y[j];
                a.seg_rows[a.n_seg] = (int)w[j]->ne[1];
                a.seg_tab[a.n_seg] = add_tab ? add_tab[j] : NULL;
                a.n_seg++;
                done[j] = true;
            }
            if (a.n_seg == 0) continue;
            a.w = a.seg_w[0];
            a.row_bytes = rb;
            a.K = (int)K;
            a.x = x; a.x_tok = K;
            a.in_norm = norm_w; a.in_eps = eps;
            a.tab_step = step; a.tab_period = period > 0 ? period : 1;
            matvec_run(type, MV_DENSE, a, 1, 1, nt);
        }
    }
    bool normed = false, split = false, late[DS4_MULTI_MAX] = { false };
    tc_split sp;
    for (int i = 0; i < n; i++) {
        if (done[i]) continue;
        late[i] = true;
        if (norm_w && !normed) {
            launch_rmsnorm(x, norm_w, x, nt, (int)K, eps);
            normed = true;
        }
        /* a prefill batch: every matrix of w[i]'s type the tensor-core engine takes, in one
         * launch from one split of x (ds4_cuda_gemm.cu); the rest (and a decode batch's
         * matrices the fast kernel did not take) one by one */
        const int type = w[i]->type;
        const size_t rb = ds4_row_bytes(type, K);
        tc_seg seg[DS4_MULTI_MAX];
        int ns = 0;
        for (int j = i; j < n && nt > MV_MAX_NT; j++) {
            if (done[j] || w[j]->type != type || !gemm_tc_ok(type, w[j]->dev, rb, K)) continue;
            seg[ns++] = (tc_seg){ (const uint8_t *)w[j]->dev, w[j]->ne[1], y[j], w[j]->ne[1], 0 };
            done[j] = late[j] = true;
        }
        if (ns > 0) {
            if (!split) sp = gemm_tc_split(x, K, K, nt, 1);
            split = true;
            gemm_tc_multi(type, 0, 1, rb, sp, ns, seg, NULL, 0);
        } else {
            cuda_matmul(w[i], 0, x, y[i], nt);
            done[i] = true;
        }
    }
    if (add_tab)     /* the ape rows of the matrices not done in the fast kernel's epilogue */
        for (int i = 0; i < n; i++)
            if (late[i] && add_tab[i]) launch_add_cyclic(y[i], add_tab[i], step, nt, period, (int)w[i]->ne[1]);
}

/* Shared expert: gate|up mode of the fast kernel with matrix 0 (sel NULL)
 * for decode, the composition otherwise. */
static void cuda_matmul_swiglu(const ds4_weight *gate, const ds4_weight *up, const float *x, float *y, int nt,
                               float limit, float *g, float *u) {
    if (nt <= 0) return;
    check_matrix_type(gate->type, "matmul_swiglu");
    if (up->type != gate->type || up->ne[0] != gate->ne[0] || up->ne[1] != gate->ne[1]) {
        ds4_fatal("matmul_swiglu: gate and up weights differ in type or shape");
    }
    const int64_t K = gate->ne[0], F = gate->ne[1];
    if (nt <= MV_MAX_NT) {
        mv_args a;
        memset(&a, 0, sizeof a);
        a.w = (const uint8_t *)gate->dev;
        a.w2 = (const uint8_t *)up->dev;
        a.row_bytes = ds4_row_bytes(gate->type, K);
        a.mat_bytes = (size_t)F * a.row_bytes;
        a.K = (int)K;
        a.rows = (int)F;
        a.x = x; a.x_tok = K;
        a.y = y; a.y_tok = F;
        a.clamp = limit;
        matvec_run(gate->type, MV_GATE_UP, a, 1, nt, 1);
        return;
    }
    const size_t rb = ds4_row_bytes(gate->type, K);
    if (up->type == gate->type && gemm_tc_ok(gate->type, gate->dev, rb, K) && gemm_tc_ok(up->type, up->dev, rb, K)) {
        /* gate and up in one launch from one split (ds4_cuda_gemm.cu) */
        const tc_split sp = gemm_tc_split(x, K, K, nt, 1);
        const tc_seg seg[2] = { { (const uint8_t *)gate->dev, F, g, F, 0 }, { (const uint8_t *)up->dev, F, u, F, 0 } };
        gemm_tc_multi(gate->type, 0, 1, rb, sp, 2, seg, NULL, 0);
    } else {
        cuda_matmul(gate, 0, x, g, nt);
        cuda_matmul(up, 0, x, u, nt);
    }
    launch_swiglu(g, u, y, 1, (int64_t)nt * F, (int64_t)nt * F, (int64_t)nt * F, limit);
}

/* Every kernel attribute and occupancy of the matvec kernels, once at init (cuda_init). */
void matmul_setup(void) {
    mv_setup_type<DS4_TYPE_F32>();
    mv_setup_type<DS4_TYPE_F16>();
    mv_setup_type<DS4_TYPE_BF16>();
    mv_setup_type<DS4_TYPE_Q8_0>();
    mvq_setup_type<DS4_TYPE_Q2_K>();
    mvq_setup_type<DS4_TYPE_Q4_K>();
    mvq_setup_type<DS4_TYPE_IQ2_XXS>();
}

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_matmul(ds4_backend *b) {
    b->matmul = cuda_matmul;
    b->matmul_grouped = cuda_matmul_grouped;
    b->matmul_multi = cuda_matmul_multi;
    b->matmul_swiglu = cuda_matmul_swiglu;
}
