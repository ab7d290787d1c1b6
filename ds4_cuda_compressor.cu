/* ds4_cuda_compressor.cu -- the CUDA backend's KV compressor: the ape bias (add_cyclic), the
 * gated pooling, and the fused compressor_step(s).
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * Compressor
 *
 * add_cyclic adds the learned position bias (ape) to the gate scores.
 * compress_pool: a block per emitted compressed row and 32 channels.
 * Each channel's entries (ratio of them, or 2*ratio with the overlapping
 * previous window for c == 2) come from this batch or from the state ring;
 * the row is the softmax(score)-weighted sum of the kv entries, computed in
 * two passes (max, then exp-sum and weighted sum) in entry order.
 * ------------------------------------------------------------------------- */

__global__ void k_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int64_t n) {
    ds4_grid_dep();
    const int pos0 = step->pos0;
    const int64_t total = (int64_t)nt * n;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(idx / n);
        x[idx] += table[(int64_t)((pos0 + t) % period) * n + idx % n];
    }
}

void launch_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n) {
    if (nt <= 0 || n <= 0) return;
    DS4_LAUNCH(k_add_cyclic, grid_for((int64_t)nt * n), 256, 0, x, table, step, nt, period, n);
}

static void cuda_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n) {
    launch_add_cyclic(x, table, step, nt, period, n);
}

/* Position of entry e of the block starting at s: first the previous window (c == 2), then
 * the current one; negative before the sequence's start (the entry's score is then -inf: it
 * is skipped). */
__device__ __forceinline__ int pool_pos(int s, int ratio, int c, int e) {
    const int half = c == 2 ? e / ratio : 1;
    return (half == 0 ? s - ratio : s) + e % ratio;
}

/* Entry e's element of channel ch (at p = pool_pos >= 0): from the batch x (rows of c dc
 * from position pos0) or from the state ring st (c ratio slots). */
__device__ __forceinline__ float pool_at(const float *x, const float *st, int pos0, int ratio, int c, int dc, int p,
                                         int e, int ch) {
    const int64_t width = (int64_t)c * dc;
    const int64_t col = (c == 2 && e >= ratio) ? dc + ch : ch;
    return p >= pos0 ? x[(int64_t)(p - pos0) * width + col] : st[(int64_t)(p % (c * ratio)) * width + col];
}

/* Pooled value of channel ch of the block starting at position s, by one thread (the one-token
 * step below): the same two passes in entry order as k_compress_pool. */
__device__ __forceinline__ float pool_channel(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                                              int pos0, int ratio, int c, int dc, int s, int ch) {
    const int n_e = c * ratio;
    float mx = -INFINITY;
#pragma unroll 4
    for (int e = 0; e < n_e; e++) {
        const int p = pool_pos(s, ratio, c, e);
        if (p >= 0) mx = fmaxf(mx, pool_at(sc, st_sc, pos0, ratio, c, dc, p, e, ch));
    }
    float sum = 0.0f, acc = 0.0f;
#pragma unroll 4
    for (int e = 0; e < n_e; e++) {
        const int p = pool_pos(s, ratio, c, e);
        if (p < 0) continue;
        const float w = expf(pool_at(sc, st_sc, pos0, ratio, c, dc, p, e, ch) - mx);
        sum += w;
        acc += w * pool_at(kv, st_kv, pos0, ratio, c, dc, p, e, ch);
    }
    return acc / sum;
}

/* Block (i, y): row i of those the batch closes (the grid is sized for the most nt tokens
 * can close; those past this step's count return), channels CP_CH y .. + CP_CH - 1.  Row i
 * goes to out + i*dc, or with at_w0 (compressor_step's rows) to row w0 + i of out.  The
 * block's warps stage the entries' scores and values (up to CP_E entries at once, warp w
 * taking entries w, w + CP_WARPS, ..., a lane per channel, all loads in flight together);
 * then warp 0 pools them, a lane per channel, in entry order.  A row of c ratio <= CP_E
 * entries (ratio 4 and 128) is staged once for both passes. */
#define CP_CH    32
#define CP_WARPS 8
#define CP_E     128
__global__ void __launch_bounds__(CP_WARPS * 32) k_compress_pool(const float *kv, const float *sc, const float *st_kv,
                                                                 const float *st_sc, const ds4_step *step, int nt,
                                                                 int ratio, int c, int dc, int at_w0, float *out) {
    ds4_grid_dep();
    __shared__ float s_sc[CP_E][CP_CH], s_kv[CP_E][CP_CH];
    const int pos0 = step->pos0;
    const int i = blockIdx.x;
    if (i >= ds4_emit_count(pos0, nt, ratio)) return;
    const int w0 = ds4_emit_first(pos0, ratio);
    const int s = (w0 + i) * ratio;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ch = blockIdx.y * CP_CH + lane;
    const bool on = ch < dc;
    const int n_e = c * ratio;
    const bool once = n_e <= CP_E;
    float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
    for (int pass = 0; pass < 2; pass++) {
        for (int e0 = 0; e0 < n_e; e0 += CP_E) {
            const int ne = n_e - e0 < CP_E ? n_e - e0 : CP_E;
            if (pass == 0 || !once) {
                __syncthreads();                        /* the previous chunk's reads are done */
                for (int e = warp; e < ne; e += CP_WARPS) {
                    const int p = pool_pos(s, ratio, c, e0 + e);
                    if (!on || p < 0) continue;
                    s_sc[e][lane] = pool_at(sc, st_sc, pos0, ratio, c, dc, p, e0 + e, ch);
                    if (pass == 1 || once) s_kv[e][lane] = pool_at(kv, st_kv, pos0, ratio, c, dc, p, e0 + e, ch);
                }
                __syncthreads();
            }
            if (warp != 0 || !on) continue;
            for (int e = 0; e < ne; e++) {
                if (pool_pos(s, ratio, c, e0 + e) < 0) continue;
                if (pass == 0) {
                    mx = fmaxf(mx, s_sc[e][lane]);
                } else {
                    const float w = expf(s_sc[e][lane] - mx);
                    sum += w;
                    acc += w * s_kv[e][lane];
                }
            }
        }
    }
    if (warp == 0 && on) out[((int64_t)(at_w0 ? w0 : 0) + i) * dc + ch] = acc / sum;
}

static void launch_compress_pool(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                                 const ds4_step *step, int nt, int ratio, int c, int dc, int at_w0, float *out) {
    if (nt <= 0 || ratio <= 0 || dc <= 0) return;
    const dim3 grid((unsigned)emit_rows_max(nt, ratio), (unsigned)((dc + CP_CH - 1) / CP_CH));
    DS4_LAUNCH(k_compress_pool, grid, CP_WARPS * 32, 0, kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, at_w0, out);
}

static void cuda_compress_pool(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                               const ds4_step *step, int nt, int ratio, int c, int dc, float *out) {
    launch_compress_pool(kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, 0, out);
}

/* compressor_step for one token: one block does the whole step.  When the
 * token closes a block (emit, decided from the step block when the kernel
 * runs: the launch is the same on every step) it pools the row into shared memory, applies
 * its RMSNorm (squares in double, fixed reduction) and RoPE at the row's
 * position, and writes it; after a barrier it stores the token's kv and
 * gate rows into the state rings (the slot it overwrites, position
 * pos0 - c*ratio, is older than any entry the pool reads).  Batches run the
 * composition. */
#define CST_THREADS 512
#define CST_MAX_DC  4096
#define CST_PRE     2      /* state-row floats per thread loaded up front (widths up to 1024) */

/* The compressors of one launch: block b steps cs[b] (compressor_steps: a
 * ratio-4 layer's kv compressor and its indexer's run side by side). */
typedef struct {
    ds4_compressor cs[DS4_MULTI_MAX];
} cst_set;

__global__ void __launch_bounds__(CST_THREADS) k_compressor_step(const cst_set set, const ds4_step *step, float eps,
                                                                rope_args r) {
    ds4_grid_dep();
    extern __shared__ float cst_row[];
    __shared__ double red[CST_THREADS / 32];
    const int pos0 = step->pos0;
    const ds4_compressor &cp = set.cs[blockIdx.x];
    const float *kv = cp.kv, *sc = cp.sc, *norm_w = cp.norm_w;
    float *st_kv = cp.st_kv, *st_sc = cp.st_sc, *rows = cp.rows;
    const int ratio = cp.ratio, c = cp.c, dc = cp.dc;
    const int width = c * dc;
    /* the token's rows for the state store, loaded with the position (most
     * steps emit nothing and only store them) */
    float kv_r[CST_PRE], sc_r[CST_PRE];
#pragma unroll
    for (int j = 0; j < CST_PRE; j++) {
        const int i = threadIdx.x + j * CST_THREADS;
        kv_r[j] = i < width ? kv[i] : 0.0f;
        sc_r[j] = i < width ? sc[i] : 0.0f;
    }
    const int w0 = ds4_emit_first(pos0, ratio);
    if (ds4_emit_count(pos0, 1, ratio) > 0) {
        double ss = 0.0;
        for (int ch = threadIdx.x; ch < dc; ch += CST_THREADS) {
            const float v = pool_channel(kv, sc, st_kv, st_sc, pos0, ratio, c, dc, w0 * ratio, ch);
            cst_row[ch] = v;
            ss += (double)(v * v);
        }
        block_norm_rope<CST_THREADS>(cst_row, dc, norm_w, eps, ss, red, r, w0 * ratio);
        for (int ch = threadIdx.x; ch < dc; ch += CST_THREADS) rows[(int64_t)w0 * dc + ch] = cst_row[ch];
    }
    __syncthreads();
    const int slot = pos0 % (c * ratio);
#pragma unroll
    for (int j = 0; j < CST_PRE; j++) {
        const int i = threadIdx.x + j * CST_THREADS;
        if (i < width) {
            st_kv[(int64_t)slot * width + i] = kv_r[j];
            st_sc[(int64_t)slot * width + i] = sc_r[j];
        }
    }
    for (int i = threadIdx.x + CST_PRE * CST_THREADS; i < width; i += CST_THREADS) {
        st_kv[(int64_t)slot * width + i] = kv[i];
        st_sc[(int64_t)slot * width + i] = sc[i];
    }
}

static void launch_compressor_step(const cst_set &set, int n, int max_dc, const ds4_step *step, float eps,
                                   const ds4_rope *rp) {
    DS4_LAUNCH(k_compressor_step, n, CST_THREADS, (size_t)max_dc * sizeof(float), set, step, eps, rope_args_of(rp));
}

/* Batches: the composition, each launch over the most rows the batch can
 * emit, the emitted ones (and their destination, row w0 on) found from the
 * step block when the kernels run. */
static void cuda_compressor_step(const float *kv, const float *sc, float *st_kv, float *st_sc,
                                 const ds4_step *step, int nt, int ratio, int c, int dc, const float *norm_w,
                                 float eps, const ds4_rope *rp, float *rows) {
    if (nt <= 0 || ratio <= 0 || dc <= 0) return;
    if (nt == 1 && dc <= CST_MAX_DC && rp->n_rot <= dc) {
        cst_set set;
        memset(&set, 0, sizeof set);
        set.cs[0] = (ds4_compressor){ kv, sc, st_kv, st_sc, ratio, c, dc, norm_w, rows };
        launch_compressor_step(set, 1, dc, step, eps, rp);
        return;
    }
    const emit_rows er = { step, ratio, nt };
    const int max_rows = emit_rows_max(nt, ratio);
    launch_compress_pool(kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, 1, rows);
    launch_rmsnorm_rows(rows, norm_w, rows, max_rows, dc, eps, er);
    launch_rope_rows(rows, max_rows, 1, dc, step, ratio, er, rp, 0);
    launch_ring_store(st_kv, kv, c * ratio, c * dc, step, nt);
    launch_ring_store(st_sc, sc, c * ratio, c * dc, step, nt);
}

/* A step's compressors: at decode, every one the one-token kernel takes in
 * one launch (a block each); otherwise each as compressor_step. */
static void cuda_compressor_steps(int n, const ds4_compressor *cs, const ds4_step *step, int nt, float eps,
                                  const ds4_rope *rp) {
    if (n <= 0 || nt <= 0) return;
    if (n > DS4_MULTI_MAX) {
        ds4_fatal("compressor_steps: %d compressors above %d", n, DS4_MULTI_MAX);
    }
    bool one_launch = nt == 1;
    int max_dc = 0;
    for (int i = 0; i < n; i++) {
        if (cs[i].ratio <= 0 || cs[i].dc <= 0 || cs[i].dc > CST_MAX_DC || rp->n_rot > cs[i].dc) one_launch = false;
        if (cs[i].dc > max_dc) max_dc = cs[i].dc;
    }
    if (!one_launch) {
        for (int i = 0; i < n; i++)
            cuda_compressor_step(cs[i].kv, cs[i].sc, cs[i].st_kv, cs[i].st_sc, step, nt, cs[i].ratio, cs[i].c,
                                 cs[i].dc, cs[i].norm_w, eps, rp, cs[i].rows);
        return;
    }
    cst_set set;
    memset(&set, 0, sizeof set);
    for (int i = 0; i < n; i++) set.cs[i] = cs[i];
    launch_compressor_step(set, n, max_dc, step, eps, rp);
}

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_compressor(ds4_backend *b) {
    b->add_cyclic = cuda_add_cyclic;
    b->compress_pool = cuda_compress_pool;
    b->compressor_step = cuda_compressor_step;
    b->compressor_steps = cuda_compressor_steps;
}
