/* ds4_cuda_probs.cuh -- the CUDA side of the optional op attention_probs.
 *
 * What it is.  The attn_probs hook (ds4_hooks.h) reports the weight attention gives every
 * row a query attended, and the sink's share.  ds4_gpu.h states the op; the CPU backend
 * (ds4.c: cpu_attention_probs, att_task) is the specification.  For query t at
 * P = pos0 + t (pos0 read from the step block when the kernels run) and head h, the row
 * probs[(t*H + h)*ld ...] holds, column by column: the ds4_win_rows(P, W) window rows in
 * increasing position (row = p >= pos0 ? kv[p - pos0] : ring[p % W]); then, for ratio 128,
 * the compressed rows w < ds4_comp_rows(P, 128), for ratio 4 the k pick slots topk[t*k + j]
 * (0 where the pick is -1); then the sink's share.  With s_i = scale * q[t][h].row_i,
 * m = max(max_i s_i, sink[h]) and den = sum_i exp(s_i - m) + exp(sink[h] - m), row i gets
 * exp(s_i - m) / den and the sink exp(sink[h] - m) / den: ds4_att_rows(P, W, ratio, k) + 1
 * columns that sum to 1.  Columns past them are not written.  It is a diagnostic: it runs
 * only when the hook is selected, next to (not inside) attention_step, so it is written
 * to be plain and exact rather than fast.
 *
 * How.  Two kernels, the probs row itself as the scratch between them (a row list can be
 * thousands of entries long, too long to keep in shared memory or registers):
 *   k_attention_probs_scores  one block per (group of PROBS_HB heads, chunk of PROBS_ROWS
 *       columns, query).  The key/value head is shared by all heads, so a block stages its
 *       heads' queries in shared memory and each warp reads a row once for all of them:
 *       lane-strided products, one butterfly per head, and lane hb writes head hb's scaled
 *       score into the row's column (-inf for an empty ratio-4 pick, which the second kernel
 *       turns into an exact 0).
 *   k_attention_probs_norm    one block per (head, query): the maximum over the columns and
 *       the sink, then e_i = expf(s_i - m) written back in place while the block sums them,
 *       then every column multiplied by inv = 1/den and the sink's share written after them.
 *
 * Launch shape.  Nothing on the host depends on the position (the op is recorded into CUDA
 * graphs and replayed at other positions): the score grid is (ceil(H / PROBS_HB),
 * ceil((ld - 1) / PROBS_ROWS), nt) -- ld is the caller's row pitch, fixed for a context and
 * large enough for the longest row list the context can reach, which the launcher checks
 * against the session's n_ctx -- and the normalising grid is (H, nt).  A block whose columns
 * lie past its query's row list at this position returns at once.
 *
 * Numerics.  The scores are the attention op's (f32 dot products, lane partials and a
 * butterfly; DOT error against the CPU's strided sums), and expf is CUDA's accurate one
 * (no fast math: within 2 ulp).  The denominator is summed in double, as the CPU sums it:
 * the terms are the very floats then scaled, so the summation adds no error of its own in
 * either backend and the order in which the threads add cannot matter to ~1e-16 (a float
 * sum of a few thousand terms could drift by ~1e-5 relative at worst, the whole CPU-vs-GPU
 * budget).  The sink term is exp in double as well, as the CPU computes it; FP64 costs
 * nothing here: one add per column.  So a column differs from the CPU's only by its
 * score's DOT error through expf, which the test bounds with the attention op's tolerance.
 *
 * Why the result does not depend on scheduling.  Every column is written by exactly one
 * warp of the first kernel, from a dot product reduced in a fixed shape; every row of probs
 * is owned by exactly one block of the second, which reduces its maximum and sum in a fixed
 * tree (warp butterflies, then the warp partials in warp order).  No atomics, no
 * cross-block communication but the kernel boundary, so the output is byte-identical run to
 * run and the same whichever order the blocks run in.
 *
 * Part of ds4_cuda_attn.cu, included after its attention section (ATT_MAX_D is defined
 * there; DS4_LAUNCH, sess() and warp_sum come from ds4_cuda_common.cuh);
 * cuda_attention_probs is its one entry.
 */

#define PROBS_HB           8      /* heads per scoring block (one shared key/value head: each row read once) */
#define PROBS_WARPS        8
#define PROBS_THREADS      (PROBS_WARPS * 32)
#define PROBS_ROWS         64     /* columns (rows attended) per scoring block */
#define PROBS_NORM_THREADS 256

typedef struct {
    const float *q, *kv, *ring, *comp, *sinks;
    const int32_t *topk;
    const ds4_step *step;   /* pos0 is read from here when the kernels run */
    float *probs;
    int W, nt, H, d, ratio, k, ld;
    float scale;
} probs_args;

/* Row i of query t's list (window, then compressed), or NULL for an empty ratio-4 pick. */
__device__ __forceinline__ const float *probs_row(const probs_args &a, int t, int pos0, int n_win, int p_first,
                                                  int i) {
    if (i < n_win) {
        const int p = p_first + i;
        return p >= pos0 ? a.kv + (int64_t)(p - pos0) * a.d : a.ring + (int64_t)(p % a.W) * a.d;
    }
    const int j = i - n_win;
    if (a.ratio == 4) {
        const int32_t id = a.topk[(int64_t)t * a.k + j];
        return id < 0 ? NULL : a.comp + (int64_t)id * a.d;
    }
    return a.comp + (int64_t)j * a.d;
}

__global__ void __launch_bounds__(PROBS_THREADS) k_attention_probs_scores(const probs_args a) {
    ds4_grid_dep();
    __shared__ float q_s[PROBS_HB][ATT_MAX_D];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * PROBS_HB, t = blockIdx.z;
    const int i0 = blockIdx.y * PROBS_ROWS;
    const int pos0 = a.step->pos0;
    const int P = pos0 + t;
    /* the columns of this position's rows (never the sink's, never past the pitch) */
    const int L = min(ds4_att_rows(P, a.W, a.ratio, a.k), a.ld - 1);
    if (i0 >= L) return;                          /* uniform over the block, before any barrier */
    for (int idx = threadIdx.x; idx < PROBS_HB * a.d; idx += PROBS_THREADS) {
        const int hb = idx / a.d, e = idx % a.d, h = h0 + hb;
        q_s[hb][e] = h < a.H ? a.q[((int64_t)t * a.H + h) * a.d + e] : 0.0f;
    }
    __syncthreads();
    const int n_win = ds4_win_rows(P, a.W);
    const int p_first = P - n_win + 1;
    const int i1 = min(L, i0 + PROBS_ROWS);
    const int nh = min(PROBS_HB, a.H - h0);
    for (int i = i0 + warp; i < i1; i += PROBS_WARPS) {
        const float *row = probs_row(a, t, pos0, n_win, p_first, i);   /* the same for the whole warp */
        float acc[PROBS_HB];
#pragma unroll
        for (int hb = 0; hb < PROBS_HB; hb++) acc[hb] = 0.0f;
        if (row) {
            for (int e = lane; e < a.d; e += 32) {
                const float v = row[e];
#pragma unroll
                for (int hb = 0; hb < PROBS_HB; hb++) acc[hb] = fmaf(q_s[hb][e], v, acc[hb]);
            }
        }
        float mine = 0.0f;                        /* lane hb keeps head hb's dot product */
#pragma unroll
        for (int hb = 0; hb < PROBS_HB; hb++) {
            const float s = warp_sum(acc[hb]);
            if (lane == hb) mine = s;
        }
        if (lane < nh)
            a.probs[((int64_t)t * a.H + h0 + lane) * a.ld + i] = row ? mine * a.scale : -INFINITY;
    }
}

static void launch_attention_probs_scores(const probs_args &a) {
    const unsigned hgroups = (unsigned)((a.H + PROBS_HB - 1) / PROBS_HB);
    const unsigned chunks = (unsigned)((a.ld - 1 + PROBS_ROWS - 1) / PROBS_ROWS);
    DS4_LAUNCH(k_attention_probs_scores, dim3(hgroups, chunks, (unsigned)a.nt), PROBS_THREADS, 0, a);
}

__global__ void __launch_bounds__(PROBS_NORM_THREADS) k_attention_probs_norm(const probs_args a) {
    ds4_grid_dep();
    __shared__ float red_m[PROBS_NORM_THREADS / 32];
    __shared__ double red_s[PROBS_NORM_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h = blockIdx.x, t = blockIdx.y;
    const int P = a.step->pos0 + t;
    const int L = ds4_att_rows(P, a.W, a.ratio, a.k);
    if (L + 1 > a.ld) return;                     /* cannot happen once the launcher's check passed */
    float *pr = a.probs + ((int64_t)t * a.H + h) * a.ld;
    const float sink = a.sinks[h];

    /* m = max(max_i s_i, sink) */
    float m = -INFINITY;
    for (int i = threadIdx.x; i < L; i += PROBS_NORM_THREADS) m = fmaxf(m, pr[i]);
    m = warp_max(m);
    if (lane == 0) red_m[warp] = m;
    __syncthreads();
    m = sink;
#pragma unroll
    for (int w = 0; w < PROBS_NORM_THREADS / 32; w++) m = fmaxf(m, red_m[w]);

    /* e_i = expf(s_i - m), in place (an empty pick's -inf gives 0), summed in double */
    double sum = 0.0;
    for (int i = threadIdx.x; i < L; i += PROBS_NORM_THREADS) {
        const float e = expf(pr[i] - m);
        pr[i] = e;
        sum += (double)e;
    }
    sum = warp_sum(sum);
    if (lane == 0) red_s[warp] = sum;
    __syncthreads();
    const double sink_e = exp((double)(sink - m));
    double den = sink_e;                          /* the CPU starts its sum from the sink's term */
#pragma unroll
    for (int w = 0; w < PROBS_NORM_THREADS / 32; w++) den += red_s[w];
    const float inv = (float)(1.0 / den);

    /* each thread scales the columns it wrote above (its own writes: no barrier needed) */
    for (int i = threadIdx.x; i < L; i += PROBS_NORM_THREADS) pr[i] *= inv;
    if (threadIdx.x == 0) pr[L] = (float)sink_e * inv;
}

static void launch_attention_probs_norm(const probs_args &a) {
    DS4_LAUNCH(k_attention_probs_norm, dim3((unsigned)a.H, (unsigned)a.nt), PROBS_NORM_THREADS, 0, a);
}

static void cuda_attention_probs(const float *q, const float *kv, const float *ring, int W, const ds4_step *step,
                                 int nt, int H, int d, const float *comp, int ratio, const int32_t *topk, int k,
                                 const float *sinks, float scale, float *probs, int ld) {
    if (nt <= 0 || H <= 0) return;
    if (d < 1 || d > ATT_MAX_D) {
        ds4_fatal("attention_probs: head dim %d outside 1..%d", d, ATT_MAX_D);
    }
    /* the pitch must hold the longest row list any position of the context reaches (the
     * position itself is known only on the device) */
    const ds4_limits *lim = &sess()->lim;
    const int P_max = lim->n_ctx > 0 ? lim->n_ctx - 1 : 0;
    const int need = ds4_att_rows(P_max, W, ratio, ratio == 4 ? k : 0) + 1;
    if (W < 1 || ld < need) {
        ds4_fatal("attention_probs: row pitch %d below the %d columns a context of %d positions "
                  "needs (window %d, ratio %d, k %d)", ld, need, lim->n_ctx, W, ratio, k);
    }
    probs_args a;
    memset(&a, 0, sizeof a);   /* every byte the launch trace records is defined */
    a.q = q; a.kv = kv; a.ring = ring; a.comp = comp; a.sinks = sinks; a.topk = topk; a.step = step;
    a.probs = probs;
    a.W = W; a.nt = nt; a.H = H; a.d = d; a.ratio = ratio; a.k = ratio == 4 ? k : 0; a.ld = ld;
    a.scale = scale;
    launch_attention_probs_scores(a);
    launch_attention_probs_norm(a);
}
