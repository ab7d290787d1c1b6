/* ds4_cuda_indexer.cu -- the CUDA backend's lightning indexer: the scores of the compressed
 * rows and their exact top-k, and the fused indexer_step.
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * Indexer
 *
 * k_indexer_scores: one block per (tile of IX_RT visible rows, query).  The
 * query's Hi x di heads sit in shared memory (rows padded by one float, so
 * lanes on consecutive heads hit distinct banks) next to the row tile stored
 * transposed; a thread computes one head's dots with 4 rows, then the
 * weighted ReLU terms are summed over heads in head order, as the CPU does.
 * That serves decode and a speculative check (a few queries: the blocks split
 * the rows); a prompt's batch takes k_indexer_tiles (below), whose blocks
 * share the rows among queries and compute the same bits.
 * k_indexer_select: one block per query.  When the query sees at most k
 * rows, every one is taken and only the sort below runs.  Otherwise a radix
 * select over the scores'
 * order-preserving bit patterns (four 8-bit histogram passes) finds the k-th
 * largest score T; the rows above T and the lowest-numbered rows equal to T
 * (an ordered ballot scan) are collected, and only those k keys are sorted by
 * a bitonic network.  The key is the score's bits above the complement of the
 * row id, so descending keys = higher score first, lower row on ties.  Any
 * number of visible rows works; the first 4096 keys stay in registers across
 * the passes, the rest are reread from L2.
 * ------------------------------------------------------------------------- */

#define IX_RT        16
#define IX_THREADS   256
#define IX_QREGS     32                     /* q floats per thread loaded in one batch */
#define IX_SEL       1024                   /* max k; also the select block size */
#define IX_CACHE     4                      /* keys per select thread held in registers */

static size_t ix_smem_bytes(int Hi, int di) {
    size_t f = (size_t)Hi * (di + 1) + Hi;
    f = (f + 3) & ~(size_t)3;                      /* 16-byte align the row tile */
    f += (size_t)di * (IX_RT + 4) + (size_t)IX_RT * (Hi + 1);
    return f * sizeof(float);
}

/* indexer_step's rotation of nq staged queries of Hi heads (the rope op's arithmetic, on the
 * staged copy): element c of pair m = query tl * Hi + head h sits at q_s[m * sm + c * sc].  The
 * cosines and sines depend on the query and the pair alone, so they are made once per query
 * into cs_s ([nq][n_rot / 2][2], scratch the caller has free), not once per head; lanes take
 * consecutive pairs m.  Starts and ends with a barrier: the staging before it is complete, and
 * so are the rotated queries (cs_s may be rewritten) after it. */
template <int THREADS>
__device__ void ix_rope_staged(float *q_s, int sm, int sc, int nq, int Hi, int di, float *cs_s, const rope_args &rr,
                               int p0) {
    const int half = rr.n_rot / 2, c0 = di - rr.n_rot, nm = nq * Hi;
    for (int task = threadIdx.x; task < nq * half; task += THREADS)
        rope_cs(rr, p0 + task / half, task % half, 0, &cs_s[2 * task], &cs_s[2 * task + 1]);
    __syncthreads();
    for (int task = threadIdx.x; task < nm * half; task += THREADS) {
        const int m = task % nm, i = task / nm, e = 2 * ((m / Hi) * half + i);
        const float c = cs_s[e], s = cs_s[e + 1];
        float *x = q_s + (size_t)m * sm + (size_t)(c0 + 2 * i) * sc;
        const float x0 = x[0], x1 = x[sc];
        x[0] = rope_rot0(x0, x1, c, s);
        x[sc] = rope_rot1(x0, x1, c, s);
    }
    __syncthreads();
}

__global__ void __launch_bounds__(IX_THREADS) k_indexer_scores(const float *q, const float *w, float w_scale,
                                                               const float *rows,
                                                               const ds4_step *step, int t0, int Hi, int di, int ratio,
                                                               float *scores, int64_t ld, int do_rope, rope_args rr) {
    ds4_grid_dep();
    extern __shared__ __align__(16) float ix_s[];
    const int t = t0 + blockIdx.y;
    const int n_vis = ds4_comp_rows(step->pos0 + t, ratio);
    if ((int)blockIdx.x * IX_RT >= n_vis) return;    /* the grid is sized for the context, not the step */
    const int qld = di + 1, rld = IX_RT + 4, vld = Hi + 1;
    float *q_s = ix_s;
    float *w_s = q_s + (size_t)Hi * qld;
    float *r_s = ix_s + (((size_t)Hi * qld + Hi + 3) & ~(size_t)3);
    float *v_s = r_s + (size_t)di * rld;

    /* every load of the prologue in flight at once */
    const float *qt = q + (int64_t)t * Hi * di;
    const int nq = Hi * di;
    /* element idx = h*di + c; step IX_THREADS = hs*di + cs, carried by hand */
    const int hs = IX_THREADS / di, cs = IX_THREADS % di;
    int qh = threadIdx.x / di, qc = threadIdx.x % di;
#pragma unroll
    for (int j = 0; j < IX_QREGS; j++) {
        const int idx = threadIdx.x + j * IX_THREADS;
        if (idx < nq) q_s[qh * qld + qc] = qt[idx];
        qh += hs; qc += cs;
        if (qc >= di) { qc -= di; qh++; }
    }
    for (int idx = threadIdx.x + IX_QREGS * IX_THREADS; idx < nq; idx += IX_THREADS) {
        q_s[qh * qld + qc] = qt[idx];
        qh += hs; qc += cs;
        if (qc >= di) { qc -= di; qh++; }
    }
    for (int h = threadIdx.x; h < Hi; h += IX_THREADS) w_s[h] = __fmul_rn(w[(int64_t)t * Hi + h], w_scale);
    if (do_rope) ix_rope_staged<IX_THREADS>(q_s, qld, 1, 1, Hi, di, r_s, rr, step->pos0 + t);   /* r_s: free yet */
    /* the block's tiles of IX_RT rows: blockIdx.x, then every gridDim.x-th */
    for (int r0 = blockIdx.x * IX_RT; r0 < n_vis; r0 += gridDim.x * IX_RT) {
        if (r0 != (int)blockIdx.x * IX_RT) __syncthreads();   /* the previous tile's readers are done */
        int rr = threadIdx.x / di, rc = threadIdx.x % di;
#pragma unroll 16
        for (int idx = threadIdx.x; idx < IX_RT * di; idx += IX_THREADS) {
            r_s[rc * rld + rr] = r0 + rr < n_vis ? rows[(int64_t)(r0 + rr) * di + rc] : 0.0f;
            rr += hs; rc += cs;
            if (rc >= di) { rc -= di; rr++; }
        }
        __syncthreads();

        for (int task = threadIdx.x; task < Hi * (IX_RT / 4); task += IX_THREADS) {
            const int h = task % Hi, rq = task / Hi;
            float acc[4] = { 0, 0, 0, 0 };
            const float *qh = q_s + (size_t)h * qld;
            for (int cc = 0; cc < di; cc++) {
                const float qv = qh[cc];
                const float4 rv = *(const float4 *)(r_s + (size_t)cc * rld + 4 * rq);
                acc[0] = fmaf(qv, rv.x, acc[0]); acc[1] = fmaf(qv, rv.y, acc[1]);
                acc[2] = fmaf(qv, rv.z, acc[2]); acc[3] = fmaf(qv, rv.w, acc[3]);
            }
#pragma unroll
            for (int j = 0; j < 4; j++)
                v_s[(4 * rq + j) * vld + h] = __fmul_rn(w_s[h], acc[j] > 0.0f ? acc[j] : 0.0f);
        }
        __syncthreads();
        for (int r = threadIdx.x; r < IX_RT; r += IX_THREADS) {
            if (r0 + r >= n_vis) continue;
            float sacc = 0.0f;
            for (int h = 0; h < Hi; h++) sacc += v_s[r * vld + h];
            scores[(int64_t)blockIdx.y * ld + r0 + r] = sacc;
        }
    }
}

/* The grid covers the most rows a context can have visible (ld), at most two
 * blocks per SM; each block takes every gridDim.x-th tile of the rows its
 * query sees on this step, and the rest return at once. */
static void launch_indexer_scores(const float *q, const float *w, float w_scale, const float *rows,
                                  const ds4_step *step, int t0, int n_q, int Hi, int di, int ratio, int64_t ld,
                                  float *scores, const ds4_rope *rp) {
    const size_t smem = ix_smem_bytes(Hi, di);
    if (smem > g_cuda.smem_optin) {
        ds4_fatal("indexer: %d heads x %d dims need %zu bytes of shared memory (device max %zu)",
                  Hi, di, smem, g_cuda.smem_optin);
    }
    int64_t tiles = (ld + IX_RT - 1) / IX_RT;
    if (tiles > 2 * (int64_t)g_cuda.n_sm) tiles = 2 * (int64_t)g_cuda.n_sm;
    dim3 grid((unsigned)(tiles > 0 ? tiles : 1), (unsigned)n_q);
    rope_args r;
    memset(&r, 0, sizeof r);
    if (rp) r = rope_args_of(rp);
    DS4_LAUNCH(k_indexer_scores, grid, IX_THREADS, smem, q, w, w_scale, rows, step, t0, Hi, di, ratio,
               scores, ld, rp ? 1 : 0, r);
}

/* k_indexer_tiles: the scores of a batch of queries (a prompt's), the same
 * bits as k_indexer_scores.  k_indexer_scores stages one query (Hi x di
 * floats, 32 KiB for Flash) per block of IX_RT rows, so a prompt of n queries
 * reads its queries n_vis / IX_RT times over, and a thread's four dots share
 * nothing with its neighbours'.  Here the scores of a query tile are one
 * register-tiled product: a block holds IXT_M = 128 (query, head) pairs, i.e.
 * IXT_M / Hi consecutive queries with every head, staged once (transposed,
 * [di][IXT_M], rotated in place for indexer_step), and walks the row tiles
 * of IXT_R = 64 rows its queries see: blockIdx.y, then every gridDim.y-th.
 * Thread (ty, tx) keeps 4 pairs x 8 rows of dots in registers (pairs 4 ty ..,
 * rows 4 tx .. and 32 + 4 tx ..): per element of the head, three 16-byte
 * shared loads (one 64-byte broadcast, two 128-byte rows) for 32 FMAs.
 * Each dot is the same FMA chain as k_indexer_scores' (c = 0 .. di-1 from
 * 0), the weighted ReLU the same product, and the sum over heads the same
 * left-to-right chain (one thread per (query, row), from the tile's terms in
 * shared memory, where the row tile was), so the scores are the same bits
 * and the selections the same rows, whichever kernel a batch takes.
 * Shared memory for Hi = 64, di = 128: queries 64 KiB + rows or terms
 * 33 KiB, two blocks per SM.  Shapes: Hi divides IXT_M, di a multiple of 4
 * up to 128, the buffers 16-byte aligned (ix_tiles_take). */
#define IXT_M       128                    /* (query, head) pairs per block */
#define IXT_R       64                     /* rows per tile */
#define IXT_THREADS 256                    /* 32 x 8: 4 pairs x 8 rows each */
#define IXT_MAX_DI  128
#define IXT_MIN_NQ  8                      /* batches from this many queries take the tiles */

static size_t ixt_smem_bytes(int Hi, int di) {
    /* after the queries and their weights, one region for the rotation's table, then each row
     * tile, then the tile's terms */
    const size_t cs = (size_t)(IXT_M / Hi) * di, rows = (size_t)di * IXT_R, terms = (size_t)(IXT_M / Hi) * IXT_R * (Hi + 1);
    const size_t u = cs > rows ? cs : rows;
    return ((size_t)di * IXT_M + IXT_M + (u > terms ? u : terms)) * sizeof(float);
}

__global__ void __launch_bounds__(IXT_THREADS, 2) k_indexer_tiles(const float *q, const float *w, float w_scale,
                                                                  const float *rows, const ds4_step *step, int t0,
                                                                  int n_q, int Hi, int di, int ratio, float *scores,
                                                                  int64_t ld, int do_rope, rope_args rr) {
    ds4_grid_dep();
    extern __shared__ __align__(16) float ixt_s[];
    float *q_s = ixt_s;                            /* [di][IXT_M]: pair m = query tl * Hi + head h */
    float *w_s = q_s + (size_t)di * IXT_M;         /* [IXT_M] */
    float *r_s = w_s + IXT_M;                      /* [di][IXT_R], then the terms [TQ][IXT_R][Hi + 1] */
    const int TQ = IXT_M / Hi;
    const int tq0 = blockIdx.x * TQ;               /* the block's first query, from t0 */
    const int nq = n_q - tq0 < TQ ? n_q - tq0 : TQ;
    const int pos0 = step->pos0;
    const int n_vis = ds4_comp_rows(pos0 + t0 + tq0 + nq - 1, ratio);   /* the block's last query sees most */
    if ((int)blockIdx.y * IXT_R >= n_vis) return;

    const int d4 = di / 4;
    const float *qb = q + (int64_t)(t0 + tq0) * Hi * di;
    for (int i = threadIdx.x; i < IXT_M * d4; i += IXT_THREADS) {
        const int m = i % IXT_M, c = 4 * (i / IXT_M);
        const float4 v = m / Hi < nq ? *(const float4 *)(qb + (int64_t)m * di + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        q_s[(c + 0) * IXT_M + m] = v.x; q_s[(c + 1) * IXT_M + m] = v.y;
        q_s[(c + 2) * IXT_M + m] = v.z; q_s[(c + 3) * IXT_M + m] = v.w;
    }
    for (int m = threadIdx.x; m < IXT_M; m += IXT_THREADS)
        w_s[m] = m / Hi < nq ? __fmul_rn(w[(int64_t)(t0 + tq0) * Hi + m], w_scale) : 0.0f;
    if (do_rope) ix_rope_staged<IXT_THREADS>(q_s, 1, IXT_M, nq, Hi, di, r_s, rr, pos0 + t0 + tq0);  /* r_s: free yet */

    const int ty = threadIdx.x / 8, tx = threadIdx.x % 8;
    const int vld = Hi + 1;
    for (int r0 = blockIdx.y * IXT_R; r0 < n_vis; r0 += gridDim.y * IXT_R) {
        __syncthreads();                           /* q_s and w_s written; the last tile's terms read */
        for (int i = threadIdx.x; i < IXT_R * d4; i += IXT_THREADS) {
            const int r = i % IXT_R, c = 4 * (i / IXT_R);
            const float4 v = r0 + r < n_vis ? *(const float4 *)(rows + (int64_t)(r0 + r) * di + c)
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
            r_s[(c + 0) * IXT_R + r] = v.x; r_s[(c + 1) * IXT_R + r] = v.y;
            r_s[(c + 2) * IXT_R + r] = v.z; r_s[(c + 3) * IXT_R + r] = v.w;
        }
        __syncthreads();
        float acc[4][8];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
#pragma unroll 4
        for (int c = 0; c < di; c++) {
            const float4 qv = *(const float4 *)(q_s + c * IXT_M + 4 * ty);
            const float4 ra = *(const float4 *)(r_s + c * IXT_R + 4 * tx);
            const float4 rb = *(const float4 *)(r_s + c * IXT_R + 32 + 4 * tx);
            const float qa[4] = { qv.x, qv.y, qv.z, qv.w };
            const float rv[8] = { ra.x, ra.y, ra.z, ra.w, rb.x, rb.y, rb.z, rb.w };
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(qa[i], rv[j], acc[i][j]);
        }
        __syncthreads();                           /* every read of the row tile done: the terms go there */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int m = 4 * ty + i, tl = m / Hi, h = m % Hi;
            const float wv = w_s[m];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int r = (j < 4 ? 4 * tx : 32 + 4 * tx) + (j & 3);
                r_s[(tl * IXT_R + r) * vld + h] = __fmul_rn(wv, acc[i][j] > 0.0f ? acc[i][j] : 0.0f);
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < TQ * IXT_R; i += IXT_THREADS) {
            const int tl = i / IXT_R, r = i % IXT_R;
            if (tl >= nq || r0 + r >= ds4_comp_rows(pos0 + t0 + tq0 + tl, ratio)) continue;
            const float *v = r_s + (size_t)(tl * IXT_R + r) * vld;
            float sacc = 0.0f;
            for (int h = 0; h < Hi; h++) sacc += v[h];
            scores[(int64_t)(tq0 + tl) * ld + r0 + r] = sacc;
        }
    }
}

/* The tiles serve a batch of at least IXT_MIN_NQ queries (decode and a
 * speculative check keep k_indexer_scores, whose blocks split the rows of one
 * query) when the shapes fit. */
static bool ix_tiles_take(const float *q, const float *rows, int n_q, int Hi, int di) {
    return n_q >= IXT_MIN_NQ && Hi >= 1 && Hi <= IXT_M && IXT_M % Hi == 0 && di % 4 == 0 && di <= IXT_MAX_DI &&
           ((uintptr_t)q & 15) == 0 && ((uintptr_t)rows & 15) == 0 && ixt_smem_bytes(Hi, di) <= g_cuda.smem_optin;
}

/* Query tiles x row-tile strides: enough blocks for four per SM, no more
 * strides than the widest row list has tiles. */
static void launch_indexer_tiles(const float *q, const float *w, float w_scale, const float *rows,
                                 const ds4_step *step, int t0, int n_q, int Hi, int di, int ratio, int64_t ld,
                                 float *scores, const ds4_rope *rp) {
    const int64_t gx = (n_q + IXT_M / Hi - 1) / (IXT_M / Hi), row_tiles = (ld + IXT_R - 1) / IXT_R;
    int64_t gy = (4 * (int64_t)g_cuda.n_sm + gx - 1) / gx;
    if (gy > row_tiles) gy = row_tiles;
    if (gy < 1) gy = 1;
    rope_args r;
    memset(&r, 0, sizeof r);
    if (rp) r = rope_args_of(rp);
    DS4_LAUNCH(k_indexer_tiles, dim3((unsigned)gx, (unsigned)gy), IXT_THREADS, ixt_smem_bytes(Hi, di), q, w,
               w_scale, rows, step, t0, n_q, Hi, di, ratio, scores, ld, rp ? 1 : 0, r);
}

/* Order-preserving bits of a score (-0 counts as +0, so equal scores tie). */
__device__ __forceinline__ uint32_t ix_ukey(float s) {
    const uint32_t u = __float_as_uint(s + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Compare-exchange of bitonic stage (size, i <-> j): the value position i keeps. */
__device__ __forceinline__ uint64_t ix_cmpx(uint64_t mine, uint64_t other, int i, int j, int size) {
    const bool desc = (i & size) == 0;       /* this run sorts descending */
    const bool keep_max = desc == (i < j);
    return keep_max ? (mine > other ? mine : other) : (mine < other ? mine : other);
}

/* Sort keys[0, sz) descending, sz a power of two <= IX_SEL, one position per
 * thread.  Strides below 32 pair lanes of one warp (shuffles); the others go
 * through shared memory (write, barrier, read partner, barrier). */
__device__ void ix_bitonic(uint64_t *keys, int sz) {
    const int i = threadIdx.x;
    uint64_t kr = i < sz ? keys[i] : 0ull;
    for (int size = 2; size <= sz; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            if (stride >= 32) {
                __syncthreads();                  /* previous readers of keys are done */
                if (i < sz) keys[i] = kr;
                __syncthreads();
                if (i < sz) kr = ix_cmpx(kr, keys[i ^ stride], i, i ^ stride, size);
            } else if (i - (i & 31) < sz) {       /* warps wholly past sz sit out */
                const uint64_t other = __shfl_xor_sync(FULL_MASK, kr, stride);
                if (i < sz) kr = ix_cmpx(kr, other, i, i ^ stride, size);
            }
        }
    }
    __syncthreads();
    if (i < sz) keys[i] = kr;
    __syncthreads();
}

__global__ void __launch_bounds__(IX_SEL) k_indexer_select(const float *scores, int64_t ld, const ds4_step *step,
                                                           int t0, int ratio, int k, int32_t *out) {
    ds4_grid_dep();
    __shared__ uint32_t hist[256];
    __shared__ uint64_t sel[IX_SEL];
    __shared__ uint32_t wsum[IX_SEL / 32];
    __shared__ uint32_t s_prefix, s_remaining, n_sel;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = t0 + blockIdx.x;
    const float *sc = scores + (int64_t)blockIdx.x * ld;
    /* the first IX_CACHE*IX_SEL scores of the row, in flight with the position
     * (entries past this step's visible rows are dropped below) */
    float sv[IX_CACHE];
#pragma unroll
    for (int c = 0; c < IX_CACHE; c++) {
        const int i = c * IX_SEL + tid;
        sv[c] = i < ld ? sc[i] : 0.0f;
    }
    const int n = ds4_comp_rows(step->pos0 + t, ratio);
    const int kk = k < n ? k : n;
    if (kk > 0 && kk == n) {
        /* every visible row is taken (n <= k <= IX_SEL: one per thread): no
         * selection, only the order */
        if (tid < n) sel[tid] = ((uint64_t)ix_ukey(sv[0]) << 32) | (uint64_t)(0xffffffffu - (uint32_t)tid);
    } else if (kk > 0) {
        /* radix select: T = the kk-th largest key; `remaining` of the keys
         * equal to T belong to the top kk */
        uint32_t uk[IX_CACHE];                      /* the first IX_CACHE*IX_SEL keys, read once */
#pragma unroll
        for (int c = 0; c < IX_CACHE; c++) {
            const int i = c * IX_SEL + tid;
            uk[c] = i < n ? ix_ukey(sv[c]) : 0u;
        }
        uint32_t prefix = 0, mask = 0, remaining = (uint32_t)kk;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += IX_SEL) hist[b] = 0;
            __syncthreads();
            /* scores share their top bits, so many lanes hit one bin: one
             * atomic per distinct bin per warp */
#define IX_COUNT(valid_, u_) do {                                                          \
                const uint32_t uu_ = (u_);                                                 \
                const uint32_t bin_ = (valid_) && (uu_ & mask) == prefix ? (uu_ >> shift) & 255u : 256u; \
                const uint32_t same_ = __match_any_sync(FULL_MASK, bin_);                  \
                if (bin_ < 256u && lane == __ffs(same_) - 1) atomicAdd(&hist[bin_], (uint32_t)__popc(same_)); \
            } while (0)
#pragma unroll
            for (int c = 0; c < IX_CACHE; c++)
                if (c * IX_SEL < n) IX_COUNT(c * IX_SEL + tid < n, uk[c]);
            for (int base = IX_CACHE * IX_SEL; base < n; base += IX_SEL)
                IX_COUNT(base + tid < n, base + tid < n ? ix_ukey(sc[base + tid]) : 0u);
#undef IX_COUNT
            __syncthreads();
            if (warp == 0) {
                /* lane l owns bins 255-8l .. 248-8l, scanned from the top */
                uint32_t c[8], tot = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) { c[j] = hist[255 - 8 * lane - j]; tot += c[j]; }
                uint32_t incl = tot;
                for (int o = 1; o < 32; o <<= 1) {
                    const uint32_t v = __shfl_up_sync(FULL_MASK, incl, o);
                    if (lane >= o) incl += v;
                }
                uint32_t above = incl - tot;
                if (above < remaining && remaining <= incl) {
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        if (above + c[j] >= remaining) {
                            s_prefix = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
                            s_remaining = remaining - above;
                            break;
                        }
                        above += c[j];
                    }
                }
            }
            __syncthreads();
            prefix = s_prefix;
            remaining = s_remaining;
            mask |= 255u << shift;
        }
        /* collect: every key above T, and the first `remaining` keys equal to
         * T in row order (ballot ranks + per-warp counts, chunk by chunk) */
        if (tid == 0) n_sel = 0;
        uint32_t eq_before = 0;
        for (int base = 0, c = 0; base < n; base += IX_SEL, c++) {
            const int i = base + tid;
            uint32_t u = 0u;
#pragma unroll
            for (int cc = 0; cc < IX_CACHE; cc++) if (cc == c) u = uk[cc];
            if (c >= IX_CACHE && i < n) u = ix_ukey(sc[i]);
            const bool gt = i < n && u > prefix, eq = i < n && u == prefix;
            const uint32_t bal = __ballot_sync(FULL_MASK, eq);
            if (lane == 0) wsum[warp] = __popc(bal);
            __syncthreads();
            uint32_t rank = eq_before + __popc(bal & ((1u << lane) - 1u)), chunk_eq = 0;
            for (int wv = 0; wv < IX_SEL / 32; wv++) {
                if (wv < warp) rank += wsum[wv];
                chunk_eq += wsum[wv];
            }
            const bool take = gt || (eq && rank < remaining);
            const uint32_t tb = __ballot_sync(FULL_MASK, take);
            uint32_t at = 0;
            if (lane == 0 && tb) at = atomicAdd(&n_sel, (uint32_t)__popc(tb));
            at = __shfl_sync(FULL_MASK, at, 0) + __popc(tb & ((1u << lane) - 1u));
            if (take) sel[at] = ((uint64_t)u << 32) | (uint64_t)(0xffffffffu - (uint32_t)i);
            eq_before += chunk_eq;
            __syncthreads();
        }
        /* n_sel == kk; the insertion order above does not matter: keys are unique */
    }
    if (kk > 0) {
        int sz = 1;
        while (sz < kk) sz <<= 1;
        if (tid >= kk && tid < sz) sel[tid] = 0ull;
        __syncthreads();
        ix_bitonic(sel, sz);
    }
    for (int j = tid; j < k; j += IX_SEL)
        out[(int64_t)t * k + j] = j < kk ? (int32_t)(0xffffffffu - (uint32_t)sel[j]) : -1;
}

static void launch_indexer_select(const float *scores, int64_t ld, const ds4_step *step, int t0, int n_q, int ratio,
                                  int k, int32_t *out) {
    DS4_LAUNCH(k_indexer_select, n_q, IX_SEL, 0, scores, ld, step, t0, ratio, k, out);
}

/* Scores go to the session's buffer: rows of ld = the most rows the context
 * can have visible, for ix_chunk queries at a time (both fixed when the
 * session was made, so the launches do not depend on the position). */
static void indexer_run(const float *q, const float *w, float w_scale, const float *rows,
                        const ds4_step *step, int nt, int Hi, int di, int ratio, int k, const ds4_rope *rp,
                        int32_t *out) {
    if (nt <= 0 || k <= 0) return;
    if (rp && (rp->n_rot < 0 || rp->n_rot > di || rp->n_rot % 2)) {
        ds4_fatal("indexer: rope of %d dims on heads of %d", rp->n_rot, di);
    }
    if (k > IX_SEL) {
        ds4_fatal("indexer: top-k %d above %d", k, IX_SEL);
    }
    ds4_session *S = sess();
    if (ratio < IX_MIN_RATIO) {
        ds4_fatal("indexer: ratio %d below %d (the score rows are sized for it)", ratio, IX_MIN_RATIO);
    }
    if (nt > S->lim.max_batch) {
        ds4_fatal("indexer: %d queries above the context's batch %d", nt, S->lim.max_batch);
    }
    const int64_t chunk = S->ix_chunk;
    float *scores = (float *)scratch_get(&S->ix_scores, (size_t)(chunk * S->ix_ld) * sizeof(float));
    for (int t0 = 0; t0 < nt; t0 += (int)chunk) {
        const int n_q = nt - t0 < chunk ? nt - t0 : (int)chunk;
        if (ix_tiles_take(q, rows, n_q, Hi, di))
            launch_indexer_tiles(q, w, w_scale, rows, step, t0, n_q, Hi, di, ratio, S->ix_ld, scores, rp);
        else
            launch_indexer_scores(q, w, w_scale, rows, step, t0, n_q, Hi, di, ratio, S->ix_ld, scores, rp);
        launch_indexer_select(scores, S->ix_ld, step, t0, n_q, ratio, k, out);
    }
}

static void cuda_indexer_topk(const float *q, const float *w, float w_scale, const float *rows,
                              const ds4_step *step, int nt, int Hi, int di, int ratio, int k, int32_t *out) {
    indexer_run(q, w, w_scale, rows, step, nt, Hi, di, ratio, k, NULL, out);
}

/* indexer_step: the rope op is folded into the scores kernel, which rotates
 * its staged copy of the query (q itself is left as it was) -- one launch
 * less per ratio-4 layer. */
static void cuda_indexer_step(float *q, const float *w, float w_scale, const float *rows, const ds4_step *step,
                              int nt, int Hi, int di, int ratio, int k, const ds4_rope *rp, int32_t *out) {
    indexer_run(q, w, w_scale, rows, step, nt, Hi, di, ratio, k, rp && rp->n_rot > 0 ? rp : NULL, out);
}

/* The scores kernels have only dynamic shared memory: allow all of it (once, at init). */
void indexer_setup(void) {
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_indexer_scores, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)g_cuda.smem_optin));
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_indexer_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)g_cuda.smem_optin));
}

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_indexer(ds4_backend *b) {
    b->indexer_topk = cuda_indexer_topk;
    b->indexer_step = cuda_indexer_step;
}
