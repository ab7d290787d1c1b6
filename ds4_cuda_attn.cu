/* ds4_cuda_attn.cu -- the CUDA backend's attention: the window and compressed rows with the
 * split-row combine (and, for attention_step, the ring store and de-rotation fused in), the
 * ring store, the tiled attention of a prefill batch (in f32, and on tensor cores with its
 * rows split into exact f16 parts once per call), the diagnostic attention_probs
 * (ds4_cuda_probs.cuh), and the side stream that runs a decode step's compressors and indexer
 * beside the queries (side_begin).
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * Attention
 *
 * Query t at position P attends, in order, to its window rows (from this
 * batch's kv or from the ring), then to the compressed rows (all visible ones
 * for ratio 128, the indexer's picks for ratio 4), plus the head's sink in
 * the denominator.
 *
 * k_attention: one block per (head group of ATT_HB heads, row chunk, query).
 * The key/value head is shared by all heads (MQA), so a block loads each row
 * once for its ATT_HB heads.  Each of the 8 warps takes every 8th row of the
 * chunk, two rows per step so that their loads overlap, computes the ATT_HB
 * scores (lane-strided dims, butterfly sums) and keeps an online softmax
 * state (max, sum, output) per head in registers.
 * The warps' states are merged by a fixed 3-level tree through shared memory.
 * With one chunk the block applies the sink and writes the output; decode
 * (few queries) splits the rows into chunks so that enough blocks run, and
 * k_attention_combine merges the chunk partials in chunk order.
 * A block stages its heads' queries and its chunk's ratio-4 picks in shared
 * memory first, so each row costs one memory round trip.
 * Shared memory for d = 512: q 8 KiB + merge buffer 32 KiB + picks 4 KiB.
 * Decode on an H200 (64 heads x 512, 640 rows): 14.5 us + 3.9 us combine.
 * That is instruction issue (~90 instructions per head and row: q from
 * shared memory, a butterfly per score, the rescale), not memory.  A batch
 * that fills the device takes the tile kernels (below): k_attention_mma, both
 * products of a tile on tensor cores, or k_attention_tiles, in f32 with one
 * transposed reduction per 8 rows.
 * ------------------------------------------------------------------------- */

#define ATT_HB         4
#define ATT_WARPS      8
#define ATT_THREADS    (ATT_WARPS * 32)
#define ATT_MAX_CHUNKS 32
#define ATT_MAX_D      512
#define ATT_MAX_TOPK   1024    /* ratio-4 picks per query staged in shared memory */
#define ATT_STEP_SPLIT_NT 4    /* calls of up to this many queries split rows as one-token steps (attention_want) */

typedef struct {
    const float *q, *kv, *ring, *comp, *sinks;
    const int32_t *topk;
    float *out, *part_o, *part_ml;
    const ds4_step *step;   /* pos0 is read from here when the kernel runs */
    int W, H, d, ratio, k;
    int want;               /* row chunks wanted (the grid's y); a query's chunking: att_chunks */
    float scale;
    int nt;
    int derot;          /* attention_step: de-rotate the output (inverse RoPE at P) as it is written */
    rope_args rope;
    float *ring_out;    /* attention_step with split rows: k_attention_combine stores kv into the ring */
    __half *sp;         /* k_attention_mma: the rows in f16 parts, three planes of [sp_rows][d] */
    int32_t *sp_exp;    /* and each row's exponent */
    int64_t sp_rows;
} attn_args;

/* Element e of an output head row as written: v, or, with a.derot, its
 * inverse rotation at position P.  The partner of a pair sits in lane ^ 1
 * (the rotated dims start at an even offset), so every lane of the warp
 * must call this. */
__device__ __forceinline__ float att_derot(const attn_args &a, float v, int e, int P) {
    const float pv = __shfl_xor_sync(FULL_MASK, v, 1);
    const int r0 = a.d - a.rope.n_rot;
    if (!a.derot || e < r0 || e >= a.d) return v;
    const int j = e - r0;
    float c, s;
    rope_cs(a.rope, P, j >> 1, 1, &c, &s);
    return (j & 1) ? rope_rot1(pv, v, c, s) : rope_rot0(v, pv, c, s);
}

/* Row i of a query's list (window, then compressed), or NULL for a -1 pick;
 * ids_s holds the query's ratio-4 picks. */
__device__ __forceinline__ const float *att_row(const attn_args &a, int pos0, const int *ids_s, int n_win,
                                                int p_first, int i) {
    if (i < n_win) {
        const int p = p_first + i;
        return p >= pos0 ? a.kv + (int64_t)(p - pos0) * a.d : a.ring + (int64_t)(p % a.W) * a.d;
    }
    if (a.ratio == 4) {
        const int id = ids_s[i - n_win];
        return id < 0 ? NULL : a.comp + (int64_t)id * a.d;
    }
    return a.comp + (int64_t)(i - n_win) * a.d;
}

/* Online softmax step for two rows at once (scores sa, sb uniform across the
 * warp; -inf for a missing row, whose values are 0).  Branch-free, so the
 * compiler can interleave the heads' chains. */
template <int DM>
__device__ __forceinline__ void att_online2(float sa, float sb, const float (&va)[DM], const float (&vb)[DM],
                                            float &m, float &l, float (&o)[DM]) {
    const float mn = fmaxf(m, fmaxf(sa, sb));
    if (mn == -INFINITY) return;                  /* nothing seen yet and both rows missing */
    const float corr = expf(m - mn);              /* 0 when m was -inf */
    const float pa = expf(sa - mn), pb = expf(sb - mn);
    m = mn;
    l = l * corr + pa + pb;
#pragma unroll
    for (int k = 0; k < DM; k++) o[k] = fmaf(pb, vb[k], fmaf(pa, va[k], o[k] * corr));
}

/* How the rows of the query at position P are split: its row list into
 * chunks of a multiple of 16 rows (two per warp per step), at least 32, so
 * that about `want` chunks run; one chunk when the list is short or want is
 * 1.  A function of the query's position and `want` alone (not of the batch
 * it came in), computed where it runs. */
__host__ __device__ __forceinline__ void att_chunks(int P, int W, int ratio, int k, int want, int *chunks,
                                                   int *chunk_rows) {
    const int Lmax = ds4_att_rows(P, W, ratio, k);
    int c = 1, rows = Lmax > 0 ? Lmax : 1;
    if (want > 1 && Lmax > 32) {
        rows = (Lmax + want - 1) / want;
        rows = (rows + 15) / 16 * 16;
        if (rows < 32) rows = 32;
        c = (Lmax + rows - 1) / rows;
    }
    *chunks = c;
    *chunk_rows = rows;
}

template <int DM>
__global__ void __launch_bounds__(ATT_THREADS) k_attention(const attn_args a) {
    ds4_grid_dep();
    __shared__ float q_s[ATT_HB][32 * DM];
    __shared__ float red_o[ATT_WARPS / 2][ATT_HB][32 * DM];
    __shared__ float red_m[ATT_WARPS / 2][ATT_HB], red_l[ATT_WARPS / 2][ATT_HB];
    __shared__ int ids_s[ATT_MAX_TOPK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * ATT_HB, c = blockIdx.y, t = blockIdx.z;
    const int pos0 = a.step->pos0;               /* in flight with the query loads below */
#pragma unroll
    for (int idx = threadIdx.x; idx < ATT_HB * 32 * DM; idx += ATT_THREADS) {
        const int hb = idx / (32 * DM), e = idx % (32 * DM), h = h0 + hb;
        q_s[hb][e] = (h < a.H && e < a.d) ? a.q[((int64_t)t * a.H + h) * a.d + e] : 0.0f;
    }
    int chunks, chunk_rows;
    att_chunks(pos0 + t, a.W, a.ratio, a.k, a.want, &chunks, &chunk_rows);
    if (c >= chunks) return;                     /* the grid is sized for `want` chunks */
    const int P = pos0 + t;
    const int n_win = ds4_win_rows(P, a.W);
    const int p_first = P - n_win + 1;
    const int L = ds4_att_rows(P, a.W, a.ratio, a.k);
    const int i0 = c * chunk_rows;
    const int i1 = min(L, i0 + chunk_rows);

    if (a.ratio == 4) {      /* this chunk's picks, so a row costs one round trip, not two */
        const int j0 = max(i0 - n_win, 0), j1 = max(i1 - n_win, 0);
        for (int j = j0 + threadIdx.x; j < j1; j += ATT_THREADS) ids_s[j] = a.topk[(int64_t)t * a.k + j];
    }
    __syncthreads();

    float m_r[ATT_HB], l_r[ATT_HB], o[ATT_HB][DM];
#pragma unroll
    for (int hb = 0; hb < ATT_HB; hb++) {
        m_r[hb] = -INFINITY;
        l_r[hb] = 0.0f;
#pragma unroll
        for (int m = 0; m < DM; m++) o[hb][m] = 0.0f;
    }

    /* two rows per step (i and i + 8), loaded together so their latencies overlap */
    for (int i = i0 + warp; i < i1; i += 2 * ATT_WARPS) {
        const float *ra = att_row(a, pos0, ids_s, n_win, p_first, i);
        const float *rb = i + ATT_WARPS < i1 ? att_row(a, pos0, ids_s, n_win, p_first, i + ATT_WARPS) : NULL;
        float va[DM], vb[DM];
#pragma unroll
        for (int m = 0; m < DM; m++) {
            const int e = lane + 32 * m;
            va[m] = ra && e < a.d ? ra[e] : 0.0f;
            vb[m] = rb && e < a.d ? rb[e] : 0.0f;
        }
#pragma unroll
        for (int hb = 0; hb < ATT_HB; hb++) {
            float sa = 0.0f, sb = 0.0f;
#pragma unroll
            for (int m = 0; m < DM; m++) {
                const float qv = q_s[hb][lane + 32 * m];
                sa = fmaf(qv, va[m], sa);
                sb = fmaf(qv, vb[m], sb);
            }
            sa = ra ? warp_sum(sa) * a.scale : -INFINITY;
            sb = rb ? warp_sum(sb) * a.scale : -INFINITY;
            att_online2(sa, sb, va, vb, m_r[hb], l_r[hb], o[hb]);
        }
    }

    /* merge the 8 warp states: 4+4, then 2+2, then 1+1 (fixed order) */
    for (int half = ATT_WARPS / 2; half >= 1; half >>= 1) {
        if (warp >= half && warp < 2 * half) {
            const int sl = warp - half;
#pragma unroll
            for (int hb = 0; hb < ATT_HB; hb++) {
                if (lane == 0) { red_m[sl][hb] = m_r[hb]; red_l[sl][hb] = l_r[hb]; }
#pragma unroll
                for (int m = 0; m < DM; m++) red_o[sl][hb][lane + 32 * m] = o[hb][m];
            }
        }
        __syncthreads();
        if (warp < half) {
#pragma unroll
            for (int hb = 0; hb < ATT_HB; hb++) {
                const float mb = red_m[warp][hb], lb = red_l[warp][hb];
                const float M = fmaxf(m_r[hb], mb);
                const float fa = m_r[hb] == -INFINITY ? 0.0f : expf(m_r[hb] - M);
                const float fb = mb == -INFINITY ? 0.0f : expf(mb - M);
                m_r[hb] = M;
                l_r[hb] = l_r[hb] * fa + lb * fb;
#pragma unroll
                for (int m = 0; m < DM; m++)
                    o[hb][m] = o[hb][m] * fa + red_o[warp][hb][lane + 32 * m] * fb;
            }
        }
        __syncthreads();
    }

    if (warp != 0) return;
#pragma unroll
    for (int hb = 0; hb < ATT_HB; hb++) {
        const int h = h0 + hb;
        if (h >= a.H) break;
        const int64_t oh = (int64_t)t * a.H + h;
        if (chunks == 1) {
            const float sink = a.sinks[h];
            const float M = fmaxf(m_r[hb], sink);
            const float f = m_r[hb] == -INFINITY ? 0.0f : expf(m_r[hb] - M);
            const float denom = l_r[hb] * f + expf(sink - M);
#pragma unroll
            for (int m = 0; m < DM; m++) {
                const int e = lane + 32 * m;
                const float v = att_derot(a, o[hb][m] * f / denom, e, P);
                if (e < a.d) a.out[oh * a.d + e] = v;
            }
        } else {
            const int64_t pidx = oh * a.want + c;   /* partials of a (query, head): want slots */
            if (lane == 0) { a.part_ml[2 * pidx] = m_r[hb]; a.part_ml[2 * pidx + 1] = l_r[hb]; }
#pragma unroll
            for (int m = 0; m < DM; m++) {
                const int e = lane + 32 * m;
                if (e < a.d) a.part_o[pidx * a.d + e] = o[hb][m];
            }
        }
    }
}

template <int DM>
static void launch_attention_t(const attn_args &a, dim3 grid) {
    DS4_LAUNCH(k_attention<DM>, grid, ATT_THREADS, 0, a);
}

/* One block per (head, query), one thread per dim: merge the chunk partials
 * in chunk order.  Warp 0 turns the chunk maxima and sums into weights with
 * fixed butterflies; every thread then issues all its chunk loads at once.
 * For attention_step the output is de-rotated as it is written, and the
 * head-0 blocks store the batch's kv rows into the window ring: every
 * k_attention block has finished reading the ring by then.  It is launched
 * whenever the rows may be split (want > 1); on a step whose rows fit one
 * chunk k_attention has written the output, and only the ring store is left. */
__global__ void k_attention_combine(const attn_args a) {
    ds4_grid_dep();
    __shared__ float f_s[ATT_MAX_CHUNKS];
    __shared__ float denom_s;
    const int h = blockIdx.x, t = blockIdx.y;
    const int pos0 = a.step->pos0;
    const int H = a.H, d = a.d;
    const int64_t base = ((int64_t)t * H + h) * a.want;   /* this (query, head)'s want partial slots */
    /* the chunk maxima and sums, loaded with the position (slots past this step's chunks are dropped) */
    float mc = -INFINITY, lc = 0.0f;
    if (threadIdx.x < a.want) {
        mc = a.part_ml[2 * (base + threadIdx.x)];
        lc = a.part_ml[2 * (base + threadIdx.x) + 1];
    }
    const int e = threadIdx.x;                  /* blockDim.x = d rounded up to a warp */
    float v[ATT_MAX_CHUNKS];                    /* every slot's partial row, in flight at once */
#pragma unroll
    for (int c = 0; c < ATT_MAX_CHUNKS; c++) v[c] = c < a.want && e < d ? a.part_o[(base + c) * d + e] : 0.0f;
    int chunks, chunk_rows;
    att_chunks(pos0 + t, a.W, a.ratio, a.k, a.want, &chunks, &chunk_rows);
    if (chunks == 1) {
        if (a.ring_out && h == 0 && e < d && t >= a.nt - a.W)
            a.ring_out[(int64_t)((pos0 + t) % a.W) * d + e] = a.kv[(int64_t)t * d + e];
        return;
    }
    if (threadIdx.x < 32) {
        const int c = threadIdx.x;
        if (c >= chunks) { mc = -INFINITY; lc = 0.0f; }
        const float sink = a.sinks[h];
        float M = warp_max(mc);
        M = fmaxf(M, sink);
        const float f = mc == -INFINITY ? 0.0f : expf(mc - M);
        const float denom = warp_sum(lc * f);
        if (c < chunks) f_s[c] = f;
        if (c == 0) denom_s = denom + expf(sink - M);
    }
    __syncthreads();
    const float denom = denom_s;
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < ATT_MAX_CHUNKS; c++) acc = fmaf(c < chunks ? v[c] : 0.0f, c < chunks ? f_s[c] : 0.0f, acc);
    const float o = att_derot(a, acc / denom, e, pos0 + t);
    if (e < d) a.out[((int64_t)t * H + h) * d + e] = o;
    if (a.ring_out && h == 0 && e < d && t >= a.nt - a.W)
        a.ring_out[(int64_t)((pos0 + t) % a.W) * d + e] = a.kv[(int64_t)t * d + e];
}

static void launch_attention_combine(const attn_args &a) {
    const unsigned threads = (unsigned)((a.d + 31) / 32 * 32);
    DS4_LAUNCH(k_attention_combine, dim3((unsigned)a.H, (unsigned)a.nt), threads, 0, a);
}

/* ---------------------------------------------------------------------------
 * Attention of a prefill batch, tiled (DS4_CUDA_PREFILL_ATTN)
 *
 * When a batch's (query, head group) blocks fill the device on their own
 * (want == 1), k_attention_tiles serves it instead of k_attention: the same row
 * list per query, the same online softmax and sink, with the work per row cut
 * by sharing it across heads.
 *
 * One block per (query, group of ATT_TH = 32 heads): 8 warps of ATT_HB = 4
 * heads.  The block first drops the query's missing ratio-4 picks (-1) from
 * its list, keeping the order, so the rows it scores all exist (a prompt's
 * early positions have few visible compressed rows for k picks).  The rows
 * stream through shared memory in tiles of ATT_TR = 16, double-buffered with
 * cp.async, so a row is read from memory once per 32 heads.  A lane
 * owns 4 NJ dims, e = 128 j + 4 lane + c (NJ = d / 128 rounded up; float4
 * loads), and keeps its 4 heads' queries and outputs in registers.
 * Per group of 8 rows, a lane forms 32 partial scores (4 heads x 8 rows) over
 * its dims; one transposed butterfly (warp_xsum32: 31 shuffles) leaves lane j
 * the whole score of head j / 8 and row j % 8.  The online softmax advances
 * once per group: the group's maximum and sum over the head's 8 lanes, one
 * rescale of the outputs, then each row's weight is shuffled to every lane and
 * multiplied into the row's values.
 * Per (head, row) that is about 40 lane instructions (32 of them FMAs), where
 * k_attention spends about 90.  The arithmetic differs from k_attention's only
 * in the order of the sums (f32 throughout); tests/test_backend_ops.c holds
 * both to the CPU op within TOL_CHAIN.
 * Shared memory for d = 512: two tiles 64 KiB, picks 4 KiB; one block per SM.
 * ------------------------------------------------------------------------- */

#define ATT_TH 32      /* heads per block: ATT_THREADS / 32 warps x ATT_HB */
#define ATT_TR 16      /* rows per shared-memory tile: two groups of 8 */

static size_t attention_tiles_smem(int d) {
    return (size_t)2 * ATT_TR * d * sizeof(float) + (size_t)ATT_MAX_TOPK * sizeof(int);
}

/* Elements e .. e + 3 of an output head row as written: with a.derot their
 * inverse rotation at position P (the rotated dims start at an even offset,
 * so a pair never straddles a float4). */
__device__ __forceinline__ float4 att_derot4(const attn_args &a, float4 v, int e, int P) {
    if (!a.derot) return v;
    const int r0 = a.d - a.rope.n_rot;
    float x[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
    for (int c = 0; c < 4; c += 2)
        if (e + c >= r0) rope_pair(x + c, a.rope, P, (e + c - r0) >> 1, 1);
    return make_float4(x[0], x[1], x[2], x[3]);
}

/* A lane's dims of a row (zeros past d, or for no row): e = 128 j + 4 lane + c. */
template <int NJ>
__device__ __forceinline__ void att_lane_dims(const float *row, int d, int lane, float4 (&v)[NJ]) {
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        const int e = 128 * j + 4 * lane;
        v[j] = row && e < d ? *(const float4 *)(row + e) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

/* Tile tt of a query's rows into buffer buf (rows past L are zeros).  One
 * cp.async group. */
__device__ __forceinline__ void att_load_tile(const attn_args &a, float *tiles, const int *ids_s, int tt,
                                              int buf, int L, int n_win, int p_first, int pos0) {
    const int d = a.d, cpr = d / 4;                            /* 16-byte pieces per row */
    float *dst = tiles + (size_t)buf * ATT_TR * d;
    for (int c = threadIdx.x; c < ATT_TR * cpr; c += ATT_THREADS) {
        const int r = c / cpr, col = c - r * cpr, i = tt * ATT_TR + r;
        const float *src = i < L ? att_row(a, pos0, ids_s, n_win, p_first, i) : NULL;
        if (src) cp_async16(dst + r * d + 4 * col, src + 4 * col);
        else *(float4 *)(dst + r * d + 4 * col) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cp_async_commit();
}

/* The rows of query t (at P, with n_win window rows) that exist: its ratio-4 picks with
 * id >= 0, compacted into ids_s in list order, so every row n_win .. L - 1 exists and a
 * missing pick (there are k - P/4 of them at positions below 4k) costs nothing.  Returns L.
 * Every thread of the block (NTHR threads) calls it; cnt_s holds NTHR / 32 ints. */
template <int NTHR = ATT_THREADS>
__device__ __forceinline__ int att_compact_picks(const attn_args &a, int t, int P, int n_win, int *ids_s,
                                                 int *cnt_s) {
    if (a.ratio != 4) return ds4_att_rows(P, a.W, a.ratio, a.k);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n = 0;
    for (int j0 = 0; j0 < a.k; j0 += NTHR) {
        const int j = j0 + threadIdx.x;
        const int id = j < a.k ? a.topk[(int64_t)t * a.k + j] : -1;
        const unsigned m = __ballot_sync(FULL_MASK, id >= 0);
        if (lane == 0) cnt_s[warp] = __popc(m);
        __syncthreads();
        int off = n, tot = n;
#pragma unroll
        for (int w = 0; w < NTHR / 32; w++) {
            off += w < warp ? cnt_s[w] : 0;
            tot += cnt_s[w];
        }
        if (id >= 0) ids_s[off + __popc(m & ((1u << lane) - 1u))] = id;
        __syncthreads();                                       /* cnt_s is rewritten next round */
        n = tot;
    }
    return n_win + n;
}

template <int NJ>
__global__ void __launch_bounds__(ATT_THREADS, 1) k_attention_tiles(const attn_args a) {
    ds4_grid_dep();
    extern __shared__ __align__(16) float att_sm[];
    const int d = a.d;
    float *tiles = att_sm;                                     /* [2][ATT_TR][d] */
    int *ids_s = (int *)(att_sm + 2 * ATT_TR * d);             /* the query's ratio-4 picks */
    __shared__ int cnt_s[ATT_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x, h0 = blockIdx.y * ATT_TH + warp * ATT_HB;
    const int pos0 = a.step->pos0;
    const int P = pos0 + t;
    const int n_win = ds4_win_rows(P, a.W);
    const int p_first = P - n_win + 1;
    const int L = att_compact_picks(a, t, P, n_win, ids_s, cnt_s);

    float4 q[ATT_HB][NJ], o[ATT_HB][NJ];
#pragma unroll
    for (int hb = 0; hb < ATT_HB; hb++) {
        att_lane_dims<NJ>(h0 + hb < a.H ? a.q + ((int64_t)t * a.H + h0 + hb) * d : NULL, d, lane, q[hb]);
#pragma unroll
        for (int j = 0; j < NJ; j++) o[hb][j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }

    float m_own = -INFINITY, l_own = 0.0f;                    /* of head lane / 8 of the warp's 4 */
    const int T = (L + ATT_TR - 1) / ATT_TR;
    att_load_tile(a, tiles, ids_s, 0, 0, L, n_win, p_first, pos0);
    for (int tt = 0; tt < T; tt++) {
        const int buf = tt & 1;
        if (tt + 1 < T) {
            att_load_tile(a, tiles, ids_s, tt + 1, buf ^ 1, L, n_win, p_first, pos0);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const float *tb = tiles + (size_t)buf * ATT_TR * d;
#pragma unroll
        for (int g = 0; g < ATT_TR / 8; g++) {
            if (tt * ATT_TR + g * 8 >= L) break;               /* the same for the whole block */
            float s[32];
#pragma unroll
            for (int r = 0; r < 8; r++) {
                float4 kr[NJ];
                att_lane_dims<NJ>(tb + (g * 8 + r) * d, d, lane, kr);
#pragma unroll
                for (int hb = 0; hb < ATT_HB; hb++) {
                    float acc = 0.0f;
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        acc = fmaf(q[hb][j].x, kr[j].x, acc);
                        acc = fmaf(q[hb][j].y, kr[j].y, acc);
                        acc = fmaf(q[hb][j].z, kr[j].z, acc);
                        acc = fmaf(q[hb][j].w, kr[j].w, acc);
                    }
                    s[hb * 8 + r] = acc;
                }
            }
            /* lane j: head j / 8, row j % 8 of this group */
            const float sum = warp_xsum32(s, lane);
            const float sv = tt * ATT_TR + g * 8 + (lane & 7) < L ? sum * a.scale : -INFINITY;
            float mx = sv;
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
            const float mn = fmaxf(m_own, mx);
            const float p = mn == -INFINITY ? 0.0f : expf(sv - mn);
            const float corr = m_own == -INFINITY ? 0.0f : expf(m_own - mn);
            float ps = p;
            ps += __shfl_xor_sync(FULL_MASK, ps, 1);
            ps += __shfl_xor_sync(FULL_MASK, ps, 2);
            ps += __shfl_xor_sync(FULL_MASK, ps, 4);
            l_own = l_own * corr + ps;
            m_own = mn;
#pragma unroll
            for (int hb = 0; hb < ATT_HB; hb++) {
                const float c = __shfl_sync(FULL_MASK, corr, 8 * hb);
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    o[hb][j].x *= c; o[hb][j].y *= c; o[hb][j].z *= c; o[hb][j].w *= c;
                }
            }
#pragma unroll
            for (int r = 0; r < 8; r++) {
                float4 v[NJ];
                att_lane_dims<NJ>(tb + (g * 8 + r) * d, d, lane, v);
#pragma unroll
                for (int hb = 0; hb < ATT_HB; hb++) {
                    const float w = __shfl_sync(FULL_MASK, p, 8 * hb + r);
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        o[hb][j].x = fmaf(w, v[j].x, o[hb][j].x);
                        o[hb][j].y = fmaf(w, v[j].y, o[hb][j].y);
                        o[hb][j].z = fmaf(w, v[j].z, o[hb][j].z);
                        o[hb][j].w = fmaf(w, v[j].w, o[hb][j].w);
                    }
                }
            }
        }
        __syncthreads();                                       /* buf is refilled two tiles on */
    }

#pragma unroll
    for (int hb = 0; hb < ATT_HB; hb++) {
        const float m_h = __shfl_sync(FULL_MASK, m_own, 8 * hb), l_h = __shfl_sync(FULL_MASK, l_own, 8 * hb);
        const int h = h0 + hb;
        if (h >= a.H) break;
        const float sink = a.sinks[h];
        const float M = fmaxf(m_h, sink);
        const float f = m_h == -INFINITY ? 0.0f : expf(m_h - M);
        const float denom = l_h * f + expf(sink - M);
        float *orow = a.out + ((int64_t)t * a.H + h) * d;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int e = 128 * j + 4 * lane;
            if (e >= d) continue;
            const float4 v = make_float4(o[hb][j].x * f / denom, o[hb][j].y * f / denom,
                                         o[hb][j].z * f / denom, o[hb][j].w * f / denom);
            *(float4 *)(orow + e) = att_derot4(a, v, e, P);
        }
    }
}

template <int NJ>
static void launch_attention_tiles_t(const attn_args &a) {
    const dim3 grid((unsigned)a.nt, (unsigned)((a.H + ATT_TH - 1) / ATT_TH));
    DS4_LAUNCH(k_attention_tiles<NJ>, grid, ATT_THREADS, attention_tiles_smem(a.d), a);
}

/* ---------------------------------------------------------------------------
 * Attention of a prefill batch on tensor cores (DS4_CUDA_PREFILL_ATTN=2, the default)
 *
 * Blocks like k_attention_tiles' (one per query and group of heads: 16 on two planes, 32 on
 * three; the query's existing rows in tiles of ATM_TR = 16), with both products of a tile as
 * MMAs: a query's heads share every kv row (MQA), so its scores S = Q K^T (16 or 32 heads x 16
 * rows x d) and its output O += P V (heads x d x 16 rows) are small matrix products.
 *
 * Numerics: the GEMM engine's exact parts (ds4_cuda_gemm.cu), on both operands.
 *   - Each query head row and each kv row is scaled by its own power of two 2^a so that its
 *     largest element lies in [2^14, 2^15), and split into three f16 parts hi + mid + lo
 *     (att_split_row; the same split as k_tc_split: 33 significant bits for f32's 24).
 *   - A score is six MMAs per k step, hi.hi, hi.mid, mid.hi, hi.lo, lo.hi and mid.mid (the
 *     dropped terms are below 2^-33 of the largest products), in three accumulators (hi.hi;
 *     the 2^-11 terms; the 2^-22 terms) over a warp's slice of the dims, summed small to
 *     large in f32.  Every product is exact; the tensor core's sums truncate, chained over
 *     one warp's slice only (at most d / 64 k steps).  The warps that share a (head, row) hold a
 *     slice of the dims; their partials are added in f32 in a fixed order, and the scale
 *     2^-(a_q + a_k) comes off exactly.
 *   - By default (DS4_CUDA_PREFILL_PLANES=2) the parts are hi + mid alone (k_att_rows_split
 *     writes two planes, a tile copies two): a score is three MMAs per k step (hi.hi; hi.mid and
 *     mid.hi), each element within 2^-22 of itself; P V below is three MMAs too.
 *   - The softmax weights p (in [0, 1]) become f = p 2^(B - a_k + 14) <= 2^14, B the
 *     smallest a_k seen so far (the largest row), and f is split in three parts too, so
 *     f.(2^a_k v) = 2^(B + 14) p v for every row; O is kept in units of 2^(B + 14) and
 *     rescaled exactly (with the softmax's correction) when B falls.  Each tile's P V starts
 *     from zero accumulators (six MMAs, three with two planes, smallest terms first) and goes
 *     into the running O with one f32 FMA, so the truncation never chains across tiles.
 * The result is f32-accurate in an order of its own: test_backend_ops holds it, like the two
 * other attention kernels, to TOL_CHAIN of the CPU op (on rows of one scale and on rows
 * whose magnitudes differ by 2^16).
 *
 * The rows are split once per call, not once per (query, tile): k_att_rows_split writes the
 * three parts and the exponent of every row a query of the batch may read (the batch's kv
 * rows, the window ring, the compressed rows visible to the batch) into the session's
 * scratch (att_split; rows = nt + W + the compressed rows the context can hold).  A block
 * then copies a tile's parts with cp.async into one of two buffers, the next tile's while
 * the MMAs of this one run.  A block has MI head tiles of 16 (atm_mi: one on two planes, two
 * on three) and 8 warps per head tile where d is a multiple of 128 (4 otherwise: a warp's dims
 * must be whole k16 steps), 126 registers a thread at d = 512.  Warp w takes heads 16 (w % MI)
 * .. + 15 and the dim slice w / MI: in S it sums its slice of the dims for 16 heads x 16 rows
 * (ldmatrix for both operands); in O += P V its 16 heads x its slice of the output dims, with
 * P's fragments taken from the reduced S in registers (the m16n8k16 C layout of two n tiles
 * is the A layout of one k16 step) and V's by ldmatrix.trans from the same parts.  S is
 * reduced once per head tile: its warps share out its 8 values a lane (of 16 heads x 16 rows),
 * each sums its values over the slices in slice order and scales them, and all read the result
 * back (two named barriers of the tile's warps).  The online softmax runs on the reduced S,
 * the same in the warps of a head tile.
 *   Shared memory holds the planes the session uses.  At d = 512, on two planes: query parts
 * 33 KiB, two tiles of row parts 65 KiB, score partials 8 KiB, picks 4 KiB, so two blocks (16
 * warps) share an SM and one's barriers overlap the other's MMAs; on three: 98 + 98 + 16 + 4
 * KiB, one block of 16 warps an SM.  Rows are padded by 8 halves, so the 8 row addresses of an
 * ldmatrix fall in distinct bank groups.  d must be a multiple of 64, the card must give a
 * block that much shared memory (two planes: sm_80's 163 KiB holds every d <= 512, sm_86/89's
 * 99 KiB d <= 448; three: d <= 320 and d <= 192), and the session the split (a context of
 * n_ctx positions holds n_ctx / 4 compressed rows: 3 KiB each at d = 512, 0.8 GB at 1M);
 * otherwise k_attention_tiles serves the batch.
 * ------------------------------------------------------------------------- */

#define ATM_TR  16     /* rows per tile */
#define ATM_PAD 8      /* halves of padding per staged row */
#define ATM_STATIC_SMEM 512   /* bytes: an upper bound of the kernel's static shared arrays */

/* Head tiles (of 16) of a k_attention_mma block on PL planes: one on two planes (16 heads, two
 * blocks an SM), two on three (32 heads, one block an SM). */
__host__ __device__ constexpr int atm_mi(int PL) { return PL == 2 ? 1 : 2; }

/* Warps of a k_attention_mma block for d = 64 KS on PL planes: per head tile, 8 (dims in
 * eighths) where d is a multiple of 128, else 4 (quarters). */
__host__ __device__ constexpr int atm_warps(int KS, int PL) { return (KS % 2 == 0 ? 8 : 4) * atm_mi(PL); }

static size_t attention_mma_smem(int d, int PL) {
    const size_t ld = (size_t)(d + ATM_PAD);
    return (size_t)PL * 16 * atm_mi(PL) * ld * sizeof(__half)        /* query parts */
         + 2 * (size_t)PL * ATM_TR * ld * sizeof(__half)             /* two tiles of row parts */
         + (size_t)atm_warps(d / 64, PL) * 8 * 32 * sizeof(float)    /* score partials */
         + (size_t)ATT_MAX_TOPK * sizeof(int);                       /* picks */
}

/* Rows of the split a call reads: its nt kv rows, the W ring slots, and the compressed rows
 * the context can hold (ratio 4 or 128), in that order. */
static int64_t attention_split_rows(int nt, int W, int ratio) {
    return (int64_t)nt + W + (ratio > 0 ? (int64_t)sess()->lim.n_ctx / ratio + 1 : 0);
}

/* Bytes of a split of `rows` rows of d: three f16 planes and an int exponent per row. */
static size_t attention_split_bytes(int64_t rows, int d) {
    return (size_t)rows * ((size_t)3 * d * sizeof(__half) + sizeof(int32_t));
}

/* The session's split scratch for a context of lim (ds4_cuda.cu sizes it): the largest call,
 * max_batch queries at the largest window and ratio 4; 0 where the kernel never runs. */
size_t attention_split_scratch(const ds4_limits *lim) {
    const int d = lim->head_dim;
    if (lim->prefill_attn != 2 || d <= 0 || d % 64 != 0 || d > ATT_MAX_D || lim->max_batch <= ATT_STEP_SPLIT_NT)
        return 0;
    const int W = lim->n_swa > 0 ? lim->n_swa : 0;
    return attention_split_bytes((int64_t)lim->max_batch + W + (int64_t)lim->n_ctx / 4 + 1, d);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __half *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const __half *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}

/* 2^e as a float, 0 below the normal range (e <= 127). */
__device__ __forceinline__ float att_pow2(int e) {
    return e < -126 ? 0.0f : __int_as_float((127 + e) << 23);
}

/* Row x of d = 64 KS floats (NULL: zeros) scaled by 2^a, its largest |element| then in
 * [2^14, 2^15), into PL f16 planes dst, dst + plane (, dst + 2 plane); returns a (0 for a
 * zero or non-finite row, whose NaN and Inf then reach the sums as they are).  The whole
 * warp calls it; a lane takes the pairs 64 j + 2 lane. */
template <int KS, int PL>
__device__ __forceinline__ int att_split_row(const float *x, __half *dst, int64_t plane, int lane) {
    float2 v[KS];
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < KS; j++) {
        v[j] = x ? *(const float2 *)(x + 64 * j + 2 * lane) : make_float2(0.0f, 0.0f);
        m = fmaxf(m, fmaxf(fabsf(v[j].x), fabsf(v[j].y)));
    }
    const int a = tc_part_exp(warp_max(m));
    const float s = __int_as_float((127 + a) << 23);
#pragma unroll
    for (int j = 0; j < KS; j++) {
        __half h0, m0, l0, h1, m1, l1;
        tc_split3(v[j].x * s, h0, m0, l0);                 /* exact: a power of two */
        tc_split3(v[j].y * s, h1, m1, l1);
        const int e = 64 * j + 2 * lane;
        *(__half2 *)(dst + e) = __halves2half2(h0, h1);
        *(__half2 *)(dst + plane + e) = __halves2half2(m0, m1);
        if (PL == 3) *(__half2 *)(dst + 2 * plane + e) = __halves2half2(l0, l1);
    }
    return a;
}

/* Every row a call may read, split (one warp per row of the list kv | ring | compressed; the
 * compressed rows past those visible to the batch are skipped). */
template <int KS, int PL>
__global__ void __launch_bounds__(ATT_THREADS) k_att_rows_split(const attn_args a) {
    ds4_grid_dep();
    constexpr int D = 64 * KS;
    const int lane = threadIdx.x & 31;
    const int64_t i = (int64_t)blockIdx.x * ATT_WARPS + (threadIdx.x >> 5);
    if (i >= a.sp_rows) return;
    const float *x;
    if (i < a.nt) x = a.kv + i * D;
    else if (i < (int64_t)a.nt + a.W) x = a.ring ? a.ring + (i - a.nt) * D : NULL;
    else {
        const int64_t c = i - a.nt - a.W;
        if (c >= ds4_comp_rows(a.step->pos0 + a.nt - 1, a.ratio)) return;
        x = a.comp + c * D;
    }
    const int e = att_split_row<KS, PL>(x, a.sp + i * D, a.sp_rows * D, lane);
    if (lane == 0) a.sp_exp[i] = e;
}

/* Row i of a query's list as a row of the split (att_row's order). */
__device__ __forceinline__ int64_t att_split_index(const attn_args &a, int pos0, const int *ids_s, int n_win,
                                                  int p_first, int i) {
    if (i < n_win) {
        const int p = p_first + i;
        return p >= pos0 ? (int64_t)(p - pos0) : (int64_t)a.nt + p % a.W;
    }
    return (int64_t)a.nt + a.W + (a.ratio == 4 ? ids_s[i - n_win] : i - n_win);
}

/* Tile tt of a query's rows (its parts and exponents) into buffer kb, ke; rows past L are
 * zeros with an exponent that makes their weights 0.  NTHR / 16 threads per row; one cp.async
 * group. */
template <int D, int NTHR, int PL>
__device__ __forceinline__ void atm_load_tile(const attn_args &a, __half *kb, int *ke, const int *ids_s, int tt,
                                              int L, int n_win, int p_first, int pos0) {
    constexpr int LD = D + ATM_PAD, PIECES = D / 8;          /* 16-byte pieces per row and part */
    constexpr int TPR = NTHR / ATM_TR;                       /* threads per row */
    const int r = threadIdx.x / TPR, sub = threadIdx.x % TPR, i = tt * ATM_TR + r;
    __half *dst = kb + r * LD;
    if (i < L) {
        const int64_t si = att_split_index(a, pos0, ids_s, n_win, p_first, i);
        const __half *src = a.sp + si * D;
#pragma unroll
        for (int p = 0; p < PL; p++)
#pragma unroll
            for (int c = sub; c < PIECES; c += TPR)
                cp_async16(dst + p * ATM_TR * LD + 8 * c, src + p * a.sp_rows * D + 8 * c);
        if (sub == 0) cp_async4(ke + r, a.sp_exp + si);
    } else {
#pragma unroll
        for (int p = 0; p < PL; p++)
#pragma unroll
            for (int c = sub; c < PIECES; c += TPR) *(uint4 *)(dst + p * ATM_TR * LD + 8 * c) = make_uint4(0, 0, 0, 0);
        if (sub == 0) ke[r] = 1000;
    }
    cp_async_commit();
}

/* The NG warps of head group mi (warps mi, mi + 2, ...) wait for one another: named barrier
 * 1 + mi, so the two groups of a block go on without each other. */
__device__ __forceinline__ void atm_group_sync(int mi, int NG) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + mi), "r"(NG * 32) : "memory");
}

/* x, y -> their three parts packed as f16x2 (low half: x, the lower column). */
__device__ __forceinline__ void att_split3x2(float x, float y, uint32_t &hi, uint32_t &mid, uint32_t &lo) {
    __half hx, mx, lx, hy, my, ly;
    tc_split3(x, hx, mx, lx);
    tc_split3(y, hy, my, ly);
    __half2 h = __halves2half2(hx, hy), m = __halves2half2(mx, my), l = __halves2half2(lx, ly);
    hi = *(uint32_t *)&h;
    mid = *(uint32_t *)&m;
    lo = *(uint32_t *)&l;
}

template <int KS, int PL>
__global__ void __launch_bounds__(atm_warps(KS, PL) * 32, 3 - atm_mi(PL)) k_attention_mma(const attn_args a) {
    ds4_grid_dep();
    constexpr int MI = atm_mi(PL), HB = 16 * MI;                              /* head tiles, heads of the block */
    constexpr int NW = atm_warps(KS, PL), NTHR = NW * 32, NG = NW / MI;       /* NG warps share a head tile */
    constexpr int D = 64 * KS, LD = D + ATM_PAD, DQ = D / NG, NT = DQ / 8;   /* NT: a warp's n8 tiles of O */
    constexpr int TILE = PL * ATM_TR * LD;                                    /* halves of one tile buffer */
    extern __shared__ __align__(16) float att_sm[];
    __half *qp = (__half *)att_sm;                                   /* [PL][HB][LD] */
    __half *kp = qp + PL * HB * LD;                                  /* [2][PL][ATM_TR][LD] */
    float *xs = (float *)(kp + 2 * TILE);                            /* [NW][8][32] */
    int *ids_s = (int *)(xs + NW * 8 * 32);                          /* the query's picks */
    __shared__ float qinv_s[HB];
    __shared__ int kexp_s[2][ATM_TR];
    __shared__ int cnt_s[NTHR / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int mi = warp % MI, dq = warp / MI;                        /* heads 16 mi .., dims DQ dq .. */
    static_assert(DQ % 16 == 0 && (MI == 1 || MI == 2), "a warp's dims are whole k16 steps; one or two m16 head tiles");
    static_assert(8 % NG == 0, "a head group's warps share out a lane's 8 values of S evenly");
    const int t = blockIdx.x, hb0 = blockIdx.y * HB;
    const int pos0 = a.step->pos0, P = pos0 + t;
    const int n_win = ds4_win_rows(P, a.W), p_first = P - n_win + 1;
    const int L = att_compact_picks<NTHR>(a, t, P, n_win, ids_s, cnt_s);
    const int T = (L + ATM_TR - 1) / ATM_TR;

    static_assert(PL == 2 || PL == 3, "k_attention_mma: two or three planes");
    atm_load_tile<D, NTHR, PL>(a, kp, kexp_s[0], ids_s, 0, L, n_win, p_first, pos0);   /* in flight with the split */
#pragma unroll 1
    for (int i = 0; i < HB / NW; i++) {
        const int hl = warp * (HB / NW) + i, h = hb0 + hl;
        const int e = att_split_row<KS, PL>(h < a.H ? a.q + ((int64_t)t * a.H + h) * D : NULL, qp + hl * LD,
                                        HB * LD, lane);
        if (lane == 0) qinv_s[hl] = __int_as_float((127 - e) << 23);
    }

    /* ldmatrix row addresses: Q as A (heads x dims), the rows as B of S (rows x dims) and,
     * transposed, as B of O (rows x dims read as dims x rows); tile buffer offsets added */
    const __half *qa = qp + (mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dq * DQ + (lane >> 4) * 8;
    const int kb_off = ((lane & 7) + (lane >> 4) * 8) * LD + dq * DQ + ((lane >> 3) & 1) * 8;
    const int vb_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * LD + dq * DQ + (lane >> 4) * 8;

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_run[2] = { -INFINITY, -INFINITY }, l_run[2] = { 0.0f, 0.0f };   /* heads g, g + 8 */
    int B_run = 0;

#pragma unroll 1
    for (int tt = 0; tt < T; tt++) {
        const int buf = tt & 1;
        cp_async_wait<0>();
        __syncthreads();                 /* tile tt is in buf; every warp is done with buf ^ 1 */
        if (tt + 1 < T)
            atm_load_tile<D, NTHR, PL>(a, kp + (buf ^ 1) * TILE, kexp_s[buf ^ 1], ids_s, tt + 1, L, n_win, p_first, pos0);
        const __half *kt = kp + buf * TILE;
        const int *ke = kexp_s[buf];
        const int nv = min(ATM_TR, L - tt * ATM_TR);     /* rows of this tile that exist */

        /* S: this warp's slice of the dims, 16 heads x 16 rows; the passes in three accumulators
         * (hi.hi; the 2^-11 terms; the 2^-22 terms) */
        float acc[3][2][4];
#pragma unroll
        for (int u = 0; u < 3; u++)
#pragma unroll
            for (int n = 0; n < 2; n++) acc[u][n][0] = acc[u][n][1] = acc[u][n][2] = acc[u][n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < DQ / 16; ks++) {
            uint32_t A[PL][4], B[PL][4];
#pragma unroll
            for (int p = 0; p < PL; p++) {
                ldsm_x4(A[p], qa + p * HB * LD + ks * 16);
                ldsm_x4(B[p], kt + kb_off + p * ATM_TR * LD + ks * 16);
            }
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const uint2 bh = make_uint2(B[0][2 * n], B[0][2 * n + 1]);
                const uint2 bm = make_uint2(B[1][2 * n], B[1][2 * n + 1]);
                mma_f16_16816(acc[0][n], A[0][0], A[0][1], A[0][2], A[0][3], bh);
                mma_f16_16816(acc[1][n], A[0][0], A[0][1], A[0][2], A[0][3], bm);
                mma_f16_16816(acc[1][n], A[1][0], A[1][1], A[1][2], A[1][3], bh);
                if (PL == 3) {
                    const uint2 bl = make_uint2(B[PL - 1][2 * n], B[PL - 1][2 * n + 1]);
                    mma_f16_16816(acc[2][n], A[0][0], A[0][1], A[0][2], A[0][3], bl);
                    mma_f16_16816(acc[2][n], A[PL - 1][0], A[PL - 1][1], A[PL - 1][2], A[PL - 1][3], bh);
                    mma_f16_16816(acc[2][n], A[1][0], A[1][1], A[1][2], A[1][3], bm);
                }
            }
        }
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const int n = c >> 2, j = c & 3;
            xs[(warp * 8 + c) * 32 + lane] = (acc[2][n][j] + acc[1][n][j]) + acc[0][n][j];
        }
        atm_group_sync(mi, NG);          /* the head group's partials are in xs */

        /* value c: head g + 8 ((c >> 1) & 1), row 8 (c >> 2) + 2 tq + (c & 1).  Warp dq of the
         * group sums the values c = dq (mod NG) over the slices, scales them and leaves them in
         * slice 0's place, which only it reads; then every warp of the group takes all 8. */
#pragma unroll
        for (int c0 = 0; c0 < 8; c0 += NG) {
            const int c = c0 + dq;
            float s = xs[(mi * 8 + c) * 32 + lane];
#pragma unroll
            for (int q = 1; q < NG; q++) s += xs[((mi + MI * q) * 8 + c) * 32 + lane];   /* dims in order */
            const int r = 8 * (c >> 2) + 2 * tq + (c & 1);
            const int hl = mi * 16 + g + 8 * ((c >> 1) & 1);
            /* exact until * scale (powers of two) */
            xs[(mi * 8 + c) * 32 + lane] =
                r < nv ? s * qinv_s[hl] * __int_as_float((127 - ke[r]) << 23) * a.scale : -INFINITY;
        }
        atm_group_sync(mi, NG);
        float sv[8];
#pragma unroll
        for (int c = 0; c < 8; c++) sv[c] = xs[(mi * 8 + c) * 32 + lane];
        const int Bt = __reduce_min_sync(FULL_MASK, (lane & 15) < nv ? ke[lane & 15] : INT_MAX);
        const int Bn = tt == 0 ? Bt : min(B_run, Bt);
        float fo[2];
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float mx = fmaxf(fmaxf(sv[2 * hh], sv[2 * hh + 1]), fmaxf(sv[4 + 2 * hh], sv[5 + 2 * hh]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            const float mn = fmaxf(m_run[hh], mx);
            const float corr = m_run[hh] == -INFINITY ? 0.0f : expf(m_run[hh] - mn);
            float ps = 0.0f;
#pragma unroll
            for (int c = 0; c < 8; c++) {
                if (((c >> 1) & 1) != hh) continue;
                sv[c] = mn == -INFINITY ? 0.0f : expf(sv[c] - mn);
                ps += sv[c];
            }
            ps += __shfl_xor_sync(FULL_MASK, ps, 1);
            ps += __shfl_xor_sync(FULL_MASK, ps, 2);
            l_run[hh] = l_run[hh] * corr + ps;
            m_run[hh] = mn;
            fo[hh] = corr * att_pow2(Bn - B_run);        /* corr is 0 on the first tile */
        }
        B_run = Bn;
        /* f = p 2^(B - a_k + 14) in three parts: A of one k16 step (rows 0..15) */
        uint32_t F[3][4];
#pragma unroll
        for (int c = 0; c < 8; c += 2) {
            const int r = 8 * (c >> 2) + 2 * tq;
            const float f0 = sv[c] * att_pow2(Bn - ke[r] + 14), f1 = sv[c + 1] * att_pow2(Bn - ke[r + 1] + 14);
            att_split3x2(f0, f1, F[0][c >> 1], F[1][c >> 1], F[2][c >> 1]);   /* PL = 2: lo unused */
        }

        /* O += P V: 16 heads x this warp's DQ dims, two n8 tiles per ldmatrix */
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t V[PL][4];
#pragma unroll
            for (int p = 0; p < PL; p++) ldsm_x4_trans(V[p], kt + vb_off + p * ATM_TR * LD + np * 16);
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const uint2 vh = make_uint2(V[0][2 * k], V[0][2 * k + 1]);
                const uint2 vm = make_uint2(V[1][2 * k], V[1][2 * k + 1]);
                float c4[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
                if (PL == 3) {
                    const uint2 vl = make_uint2(V[PL - 1][2 * k], V[PL - 1][2 * k + 1]);
                    mma_f16_16816(c4, F[1][0], F[1][1], F[1][2], F[1][3], vm);
                    mma_f16_16816(c4, F[2][0], F[2][1], F[2][2], F[2][3], vh);
                    mma_f16_16816(c4, F[0][0], F[0][1], F[0][2], F[0][3], vl);
                }
                mma_f16_16816(c4, F[1][0], F[1][1], F[1][2], F[1][3], vh);
                mma_f16_16816(c4, F[0][0], F[0][1], F[0][2], F[0][3], vm);
                mma_f16_16816(c4, F[0][0], F[0][1], F[0][2], F[0][3], vh);
                float *on = o[2 * np + k];
                on[0] = fmaf(on[0], fo[0], c4[0]);
                on[1] = fmaf(on[1], fo[0], c4[1]);
                on[2] = fmaf(on[2], fo[1], c4[2]);
                on[3] = fmaf(on[3], fo[1], c4[3]);
            }
        }
    }

    /* the sink, the units 2^(B + 14), and with a.derot the inverse rotation at P */
    const int r0 = a.d - a.rope.n_rot;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int h = hb0 + mi * 16 + g + 8 * hh;
        if (h >= a.H) continue;
        const float sink = a.sinks[h];
        const float M = fmaxf(m_run[hh], sink);
        const float f = m_run[hh] == -INFINITY ? 0.0f : expf(m_run[hh] - M);
        const float denom = l_run[hh] * f + expf(sink - M);
        float *orow = a.out + ((int64_t)t * a.H + h) * D;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int e = dq * DQ + 8 * n + 2 * tq;
            float x[2] = { ldexpf(o[n][2 * hh], -B_run - 14) * f / denom,
                           ldexpf(o[n][2 * hh + 1], -B_run - 14) * f / denom };
            if (a.derot && e >= r0) rope_pair(x, a.rope, P, (e - r0) >> 1, 1);
            *(float2 *)(orow + e) = make_float2(x[0], x[1]);
        }
    }
}

/* The split of the call's rows into the session's scratch, then the attention. */
template <int KS>
static void launch_attention_mma_t(const attn_args &a0) {
    attn_args a = a0;
    a.sp_rows = attention_split_rows(a.nt, a.W, a.ratio);
    uint8_t *base = (uint8_t *)scratch_get(&sess()->att_split, attention_split_bytes(a.sp_rows, a.d));
    a.sp = (__half *)base;
    a.sp_exp = (int32_t *)(base + (size_t)3 * a.sp_rows * a.d * sizeof(__half));
    ds4_session *S = sess();
    S->n_att_mma++;
    if (S->lim.prefill_planes == 2) {
        S->n_att_mma_pl2++;
        const dim3 grid((unsigned)a.nt, (unsigned)((a.H + 16 * atm_mi(2) - 1) / (16 * atm_mi(2))));
        DS4_LAUNCH((k_att_rows_split<KS, 2>), dim3((unsigned)((a.sp_rows + ATT_WARPS - 1) / ATT_WARPS)), ATT_THREADS, 0, a);
        DS4_LAUNCH((k_attention_mma<KS, 2>), grid, atm_warps(KS, 2) * 32, attention_mma_smem(a.d, 2), a);
    } else {
        const dim3 grid((unsigned)a.nt, (unsigned)((a.H + 16 * atm_mi(3) - 1) / (16 * atm_mi(3))));
        DS4_LAUNCH((k_att_rows_split<KS, 3>), dim3((unsigned)((a.sp_rows + ATT_WARPS - 1) / ATT_WARPS)), ATT_THREADS, 0, a);
        DS4_LAUNCH((k_attention_mma<KS, 3>), grid, atm_warps(KS, 3) * 32, attention_mma_smem(a.d, 3), a);
    }
}

/* The tile kernels take the batch when every row they copy is whole 16-byte pieces (d a
 * multiple of 4, the buffers 16-byte aligned) and the switch (ds4_limits.prefill_attn, 1 or
 * 2) says so, for a batch whose blocks fill the device (one per SM resides; a smaller batch,
 * decode among them, is better served by k_attention's split rows), or for any batch with
 * prefill_attn_all (tests/test_backend_ops.c).  k_attention_mma serves it with 2 where d is a
 * multiple of 64 and the card gives a block the shared memory; k_attention_tiles otherwise. */
static bool attention_tiles_take(const attn_args &a) {
    const uintptr_t al = (uintptr_t)a.q | (uintptr_t)a.kv | (uintptr_t)a.ring | (uintptr_t)a.comp | (uintptr_t)a.out;
    if (a.d % 4 != 0 || a.d > ATT_MAX_D || (al & 15) != 0) return false;
    const ds4_limits &lim = sess()->lim;
    const int64_t blocks = (int64_t)a.nt * ((a.H + ATT_TH - 1) / ATT_TH);
    return lim.prefill_attn >= 1 && (lim.prefill_attn_all || blocks >= g_cuda.n_sm);
}

static bool attention_mma_take(const attn_args &a) {
    const int pl = sess()->lim.prefill_planes == 2 ? 2 : 3;
    return sess()->lim.prefill_attn == 2 && a.d % 64 == 0 && attention_mma_smem(a.d, pl) + ATM_STATIC_SMEM <= g_cuda.smem_optin &&
           attention_split_bytes(attention_split_rows(a.nt, a.W, a.ratio), a.d) <= sess()->att_split.cap;
}

static void launch_attention_tiles(const attn_args &a) {
    if (attention_mma_take(a)) {
        switch (a.d / 64) {
        case 1:  launch_attention_mma_t<1>(a); break;
        case 2:  launch_attention_mma_t<2>(a); break;
        case 3:  launch_attention_mma_t<3>(a); break;
        case 4:  launch_attention_mma_t<4>(a); break;
        case 5:  launch_attention_mma_t<5>(a); break;
        case 6:  launch_attention_mma_t<6>(a); break;
        case 7:  launch_attention_mma_t<7>(a); break;
        default: launch_attention_mma_t<8>(a); break;
        }
        return;
    }
    switch ((a.d + 127) / 128) {
    case 1:  launch_attention_tiles_t<1>(a); break;
    case 2:  launch_attention_tiles_t<2>(a); break;
    case 3:  launch_attention_tiles_t<3>(a); break;
    default: launch_attention_tiles_t<4>(a); break;
    }
}

/* k_attention_mma<KS> may take the shared memory of d = 64 KS where the card has it
 * (attention_mma_take asks the same question per launch). */
template <int KS>
static void attention_mma_setup(void) {
    const size_t s3 = attention_mma_smem(64 * KS, 3), s2 = attention_mma_smem(64 * KS, 2);
    if (s3 + ATM_STATIC_SMEM <= g_cuda.smem_optin)
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_mma<KS, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s3));
    if (s2 + ATM_STATIC_SMEM <= g_cuda.smem_optin) {
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_mma<KS, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s2));
        /* two blocks an SM: the driver keeps the largest shared-memory carveout */
        DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_mma<KS, 2>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
    }
}

/* Resident k_attention blocks per SM (registers and shared memory decide): asked at init. */
void attention_setup(void) {
    int n = 0;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<2>, ATT_THREADS, 0));
    g_cuda.att_bps[2] = n > 0 ? n : 1;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<4>, ATT_THREADS, 0));
    g_cuda.att_bps[4] = n > 0 ? n : 1;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<8>, ATT_THREADS, 0));
    g_cuda.att_bps[8] = n > 0 ? n : 1;
    DS4_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k_attention<16>, ATT_THREADS, 0));
    g_cuda.att_bps[16] = n > 0 ? n : 1;
    const int tsm = (int)attention_tiles_smem(ATT_MAX_D);
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_tiles<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, tsm));
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_tiles<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, tsm));
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_tiles<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, tsm));
    DS4_CUDA_CHECK(cudaFuncSetAttribute(k_attention_tiles<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, tsm));
    attention_mma_setup<1>();
    attention_mma_setup<2>();
    attention_mma_setup<3>();
    attention_mma_setup<4>();
    attention_mma_setup<5>();
    attention_mma_setup<6>();
    attention_mma_setup<7>();
    attention_mma_setup<8>();
}

static int attention_dm(int d) { return d <= 64 ? 2 : d <= 128 ? 4 : d <= 256 ? 8 : 16; }

/* Row chunks a launch of nt queries of H heads asks for: decode has few
 * (query, head group) blocks, so its rows are split until the launch fills
 * one wave of resident blocks (at most ATT_MAX_CHUNKS); 1 when the blocks
 * fill the device already.  A shape, not a position.  A call of up to
 * ATT_STEP_SPLIT_NT queries splits each query's rows as a one-token call
 * does (the chunks decide the order of the softmax sums): a speculative
 * check's rows then get the bytes of one-token steps (ds4 --mtp-draft).
 * Its launch is up to ATT_STEP_SPLIT_NT waves; the partials' scratch is
 * sized for them (attention_part_floats). */
static int attention_want(int nt, int H, int d) {
    if (nt <= ATT_STEP_SPLIT_NT) nt = 1;
    const int64_t hgroups = (H + ATT_HB - 1) / ATT_HB;
    const int64_t base_blocks = hgroups * nt;
    const int64_t wave = (int64_t)g_cuda.att_bps[attention_dm(d)] * g_cuda.n_sm;
    if (base_blocks >= wave) return 1;
    int64_t want = wave / base_blocks;
    if (want > ATT_MAX_CHUNKS) want = ATT_MAX_CHUNKS;
    return (int)want;
}

/* Partial rows (one per query, head and chunk) of the largest split: nt*H*want
 * <= H*wave/hgroups <= ATT_HB*wave above ATT_STEP_SPLIT_NT queries, and
 * ATT_STEP_SPLIT_NT times that at or below, whatever H. */
size_t attention_part_floats(int d) {
    int64_t wave = 0;
    for (int dm = 2; dm <= 16; dm *= 2)
        if ((int64_t)g_cuda.att_bps[dm] * g_cuda.n_sm > wave) wave = (int64_t)g_cuda.att_bps[dm] * g_cuda.n_sm;
    return (size_t)(ATT_STEP_SPLIT_NT * ATT_HB * wave) * (size_t)(d + 2);
}

/* attention, and for attention_step (ring_out != NULL) the ring update and
 * the de-rotation by rp, fused into the output writes where the shapes allow. */
static void attention_run(const float *q, const float *kv, const float *ring, int W,
                          const ds4_step *step, int nt, int H, int d,
                          const float *comp, int ratio, const int32_t *topk, int k,
                          const float *sinks, float scale, float *out, float *ring_out, const ds4_rope *rp) {
    if (nt <= 0 || H <= 0) return;
    if (d < 1 || d > ATT_MAX_D) {
        ds4_fatal("attention: head dim %d outside 1..%d", d, ATT_MAX_D);
    }
    if (ratio == 4 && k > ATT_MAX_TOPK) {
        ds4_fatal("attention: %d top-k rows above %d", k, ATT_MAX_TOPK);
    }
    attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q; a.kv = kv; a.ring = ring; a.comp = comp; a.sinks = sinks; a.topk = topk; a.out = out;
    a.W = W; a.step = step; a.H = H; a.d = d; a.ratio = ratio; a.k = k; a.scale = scale; a.nt = nt;
    /* fused de-rotation needs the rotated dims to start at an even offset (pairs in lanes 2i, 2i+1) */
    const bool derot_fused = rp && rp->n_rot > 0 && rp->n_rot <= d && (d - rp->n_rot) % 2 == 0;
    if (derot_fused) { a.derot = 1; a.rope = rope_args_of(rp); }
    const int hgroups = (H + ATT_HB - 1) / ATT_HB;
    const int DM = attention_dm(d);
    /* The launches depend on the shape only: k_attention_tiles for a batch it
     * takes; otherwise k_attention over `want` row chunks (the blocks of chunks
     * a step does not use return at once), and the combine whenever a step may
     * split its rows. */
    const bool tiles = attention_tiles_take(a);
    a.want = tiles ? 1 : attention_want(nt, H, d);
    if (a.want > 1) {
        const int64_t np = (int64_t)nt * H * a.want;
        float *p = (float *)scratch_get(&sess()->att_part, (size_t)np * (d + 2) * sizeof(float));
        a.part_o = p;
        a.part_ml = p + np * d;
    }
    dim3 grid((unsigned)hgroups, (unsigned)a.want, (unsigned)nt);
    if (tiles) {
        launch_attention_tiles(a);
    } else {
        switch (DM) {
        case 2:  launch_attention_t<2>(a, grid); break;
        case 4:  launch_attention_t<4>(a, grid); break;
        case 8:  launch_attention_t<8>(a, grid); break;
        default: launch_attention_t<16>(a, grid); break;
        }
    }
    if (a.want > 1) {
        a.ring_out = ring_out;
        launch_attention_combine(a);
    } else if (ring_out) {
        launch_ring_store(ring_out, kv, W, d, step, nt);
    }
    if (rp && !derot_fused) launch_rope(out, nt, H, d, step, 1, rp, 1);
}

static void cuda_attention(const float *q, const float *kv, const float *ring, int W,
                           const ds4_step *step, int nt, int H, int d,
                           const float *comp, int ratio, const int32_t *topk, int k,
                           const float *sinks, float scale, float *out) {
    attention_run(q, kv, ring, W, step, nt, H, d, comp, ratio, topk, k, sinks, scale, out, NULL, NULL);
}

#include "ds4_cuda_probs.cuh"

static void cuda_attention_step(const float *q, const float *kv, float *ring, int W,
                                const ds4_step *step, int nt, int H, int d,
                                const float *comp, int ratio, const int32_t *topk, int k,
                                const float *sinks, float scale, const ds4_rope *rp, float *out) {
    attention_run(q, kv, ring, W, step, nt, H, d, comp, ratio, topk, k, sinks, scale, out, ring, rp);
}

/* Window ring update: the last min(nt, slots) rows of the batch. */
__global__ void k_ring_store(float *ring, const float *rows, int slots, int64_t width, const ds4_step *step,
                             int t_first, int n_rows) {
    ds4_grid_dep();
    const int pos0 = step->pos0;
    const int64_t n = (int64_t)n_rows * width;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int t = t_first + (int)(idx / width);
        const int64_t col = idx % width;
        ring[(int64_t)((pos0 + t) % slots) * width + col] = rows[(int64_t)t * width + col];
    }
}

void launch_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt) {
    const int t_first = nt - slots > 0 ? nt - slots : 0;
    const int n_rows = nt - t_first;
    if (n_rows <= 0 || width <= 0) return;
    DS4_LAUNCH(k_ring_store, grid_for((int64_t)n_rows * width), 256, 0, ring, rows, slots, width, step,
               t_first, n_rows);
}

static void cuda_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt) {
    launch_ring_store(ring, rows, slots, width, step, nt);
}

/* Column chunks of attn_probs's scoring grid (its grid.y) for the longest row list of a
 * context of lim: the window, then the larger of the ratio-128 rows and the top-k picks. */
int64_t attention_probs_chunks(const ds4_limits *lim) {
    const int64_t n128 = (int64_t)lim->n_ctx / 128 + 1, k = lim->idx_topk > 0 ? lim->idx_topk : 0;
    return ((int64_t)lim->n_swa + (k > n128 ? k : n128) + PROBS_ROWS - 1) / PROBS_ROWS;
}

/* ---------------------------------------------------------------------------
 * The compressors and the indexer beside the query projection (side_begin, side_end, side_join)
 *
 * At decode a ratio layer's compressors read only the first projection call's rows (their
 * kv and gate rows) and write their own state and rows; the indexer reads those rows, its
 * weights row from the first call and its queries from the second.  So the compressors need
 * not wait for the queries' projection, nor the indexer for the queries' norm and rotation:
 * the engine issues the compressors in a first span on the session's attention stream
 * (forked after the first projection call), the indexer in a second (forked after the
 * second call, so after the compressors too: a stream runs in order), and joins before the
 * attention, which reads all of it.  Under a capture the events become edges of the graph.
 * The same kernels on the same inputs: the sums are the same.  Batches above MV_MAX_NT tokens
 * stay in order (the prefill's indexer and products share nothing, but their launches fill
 * the device on their own).
 * ------------------------------------------------------------------------- */

static int cuda_side_begin(int nt) {
    ds4_session *S = sess();
    if (!S->axs.s || nt > MV_MAX_NT) return 0;
    ds4_side_fork(&S->axs);
    return 1;
}

static void cuda_side_end(void) { ds4_side_unfork(&sess()->axs); }

static void cuda_side_join(void) { ds4_side_join(&sess()->axs); }

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_attn(ds4_backend *b) {
    b->side_begin = cuda_side_begin;
    b->side_end = cuda_side_end;
    b->side_join = cuda_side_join;
    b->attention = cuda_attention;
    b->attention_probs = cuda_attention_probs;
    b->ring_store = cuda_ring_store;
    b->attention_step = cuda_attention_step;
}
