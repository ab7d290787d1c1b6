/* ds4_cuda_mhc.cu -- the CUDA backend's mHC ops: hc_mix (with Sinkhorn), hc_post, and hc_pre
 * (split-K: at decode one launch, for a prompt's batch two).
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * mHC: mixing (with Sinkhorn) and the residual update
 *
 * hc_mix: one block per (1024 channels, token).  Every block turns the
 * token's logits into the n_hc pre weights and forms the weighted sum of the
 * streams over its channels; warp 0 of the token's first block also builds
 * post and the Sinkhorn-normalised comb matrix (hc_sinkhorn_lanes, one lane
 * per matrix entry, shared with hc_pre).  The arithmetic follows the CPU op
 * step for step, but for the sums' order and the reciprocals (a few ulp).
 * hc_post: one thread per (token, channel) computes all n_hc outputs from
 * values it has already read, so the op is safe even in place.
 * ------------------------------------------------------------------------- */

#define HC_MAX 4   /* = DS4_HC_MAX: the Sinkhorn warp holds one C entry per lane */

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

#define HC_TILE 1024   /* channels per hc_mix block (4 per thread) */
#define HC_NMIX_MAX ((2 + HC_MAX) * HC_MAX)   /* mix logits per token: 24 */

/* The hardware reciprocal (MUFU.RCP, ~1 ulp, flushes denormals), with no
 * range fix-up: the Sinkhorn sums it inverts lie in [eps, h + eps]. */
__device__ __forceinline__ float rcp_approx(float v) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

/* Sum of H register values as a tree, (v0 + v1) + (v2 + v3): half the
 * dependent adds of the CPU's left-to-right chain. */
template <int H>
__device__ __forceinline__ float sum_tree(const float *v) {
    if (H == 1) return v[0];
    if (H == 2) return v[0] + v[1];
    if (H == 3) return (v[0] + v[1]) + v[2];
    return (v[0] + v[1]) + (v[2] + v[3]);
}

/* post and the Sinkhorn-normalised comb of one token by one warp (every
 * lane calls it): lane l < h*h holds C[a][b], l = a + H*b (the comb
 * layout).  A normalisation gathers its group's H entries with H
 * independent shuffles, sums them as a tree, and multiplies by one hardware
 * reciprocal issued once for all sixteen entries: the chain of forty steps
 * is shuffle latency + two adds + one MUFU, where one thread walking the
 * matrix issued sixteen multiplies, twelve adds and four reciprocals per
 * step.  m: the token's mix logits (shared memory), already scaled by rms. */
template <int H>
__device__ void hc_sinkhorn_lanes(const float *m, const float *base, float sc1, float sc2, float eps, int iters,
                                  float *post, float *comb) {
    const int l = threadIdx.x & 31, a = l % H, b = (l / H) % H;
    if (l < H) post[l] = 2.0f * sigmoid_f(m[H + l] * sc1 + base[H + l]);
    const int li = a + H * b;                       /* lanes >= H*H mirror an entry; they write nothing */
    float c = m[2 * H + li] * sc2 + base[2 * H + li];
    float g[H];
#pragma unroll
    for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, H * b + q);   /* over destinations a */
    float mx = g[0];
#pragma unroll
    for (int q = 1; q < H; q++) mx = fmaxf(mx, g[q]);
    c = expf(c - mx);
#pragma unroll
    for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, H * b + q);
    c = c * rcp_approx(sum_tree<H>(g)) + eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {                               /* "row": over destinations, for each source */
#pragma unroll
            for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, H * b + q);
            c *= rcp_approx(sum_tree<H>(g) + eps);
        }
#pragma unroll
        for (int q = 0; q < H; q++) g[q] = __shfl_sync(FULL_MASK, c, a + H * q);   /* "col": over sources */
        c *= rcp_approx(sum_tree<H>(g) + eps);
    }
    if (l < H * H) comb[l] = c;
}

/* The standalone hc_mix op.  scale has 3 entries, or 1 in head mode (only
 * scale[0] is read then). */
__global__ void k_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                         int64_t D, int h, int head, float eps, int iters,
                         float *y, float *post, float *comb) {
    ds4_grid_dep();
    __shared__ float m_s[HC_NMIX_MAX], base_s[HC_NMIX_MAX];
    __shared__ float pre_s[HC_MAX];
    const int t = blockIdx.y;
    const int n_mix = head ? h : (2 + h) * h;
    const float *m = mix + (int64_t)t * n_mix;
    for (int i = threadIdx.x; i < n_mix; i += blockDim.x) { m_s[i] = m[i]; base_s[i] = base[i]; }
    __syncthreads();
    if (threadIdx.x < h) pre_s[threadIdx.x] = sigmoid_f(m_s[threadIdx.x] * scale[0] + base_s[threadIdx.x]) + eps;
    if (!head && blockIdx.x == 0 && threadIdx.x < 32) {
        float *pt = post + (int64_t)t * h, *ct = comb + (int64_t)t * h * h;
        const float sc1 = scale[1], sc2 = scale[2];
        switch (h) {                            /* warp-uniform */
        case 1: hc_sinkhorn_lanes<1>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        case 2: hc_sinkhorn_lanes<2>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        case 3: hc_sinkhorn_lanes<3>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        default: hc_sinkhorn_lanes<4>(m_s, base_s, sc1, sc2, eps, iters, pt, ct); break;
        }
    }
    __syncthreads();
    const float *xt = x + (int64_t)t * h * D;
    float *yt = y + (int64_t)t * D;
#pragma unroll
    for (int j = 0; j < HC_TILE / 256; j++) {
        const int64_t i = (int64_t)blockIdx.x * HC_TILE + j * 256 + threadIdx.x;
        if (i < D) {
            float acc = 0.0f;
            for (int s = 0; s < h; s++) acc += pre_s[s] * xt[s * D + i];
            yt[i] = acc;
        }
    }
}

static void launch_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                          int nt, int D, int h, int head, float eps, int iters,
                          float *y, float *post, float *comb) {
    if (nt <= 0) return;
    if (h < 1 || h > HC_MAX) {
        ds4_fatal("hc_mix: n_hc = %d outside 1..%d", h, HC_MAX);
    }
    dim3 grid((unsigned)((D + HC_TILE - 1) / HC_TILE > 0 ? (D + HC_TILE - 1) / HC_TILE : 1), (unsigned)nt);
    DS4_LAUNCH(k_hc_mix, grid, 256, 0, mix, scale, base, x, D, h, head, eps, iters, y, post, comb);
}

static void cuda_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                        int nt, int D, int n_hc, int head, float hc_eps, int sinkhorn_iters,
                        float *y, float *post, float *comb) {
    launch_hc_mix(mix, scale, base, x, nt, D, n_hc, head, hc_eps, sinkhorn_iters, y, post, comb);
}

__global__ void k_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                          int nt, int64_t D, int h, float *x_out) {
    ds4_grid_dep();
    const int64_t n = (int64_t)nt * D;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = idx / D, i = idx % D;
        float xr[HC_MAX];
        for (int b = 0; b < h; b++) xr[b] = x_res[(t * h + b) * D + i];
        const float fv = f[t * D + i];
        for (int a = 0; a < h; a++) {
            float acc = post[t * h + a] * fv;
            for (int b = 0; b < h; b++) acc += comb[t * h * h + a + h * b] * xr[b];
            x_out[(t * h + a) * D + i] = acc;
        }
    }
}

static void launch_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                           int nt, int D, int h, float *x_out) {
    if (nt <= 0 || D <= 0) return;
    if (h < 1 || h > HC_MAX) {
        ds4_fatal("hc_post: n_hc = %d outside 1..%d", h, HC_MAX);
    }
    DS4_LAUNCH(k_hc_post, grid_for((int64_t)nt * D), 256, 0, f, x_res, post, comb, nt, D, h, x_out);
}

static void cuda_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                         int nt, int D, int n_hc, float *x_out) {
    launch_hc_post(f, x_res, post, comb, nt, D, n_hc, x_out);
}

/* hc_pre: the whole mHC pre step of a sublayer (decode: up to
 * HC_SPLIT_MAX_NT tokens) in one launch.
 *
 * The projection it contains (mix = fn . rmsnorm(x), fn {n_hc*D, n_mix}, 24
 * rows of 16384 for Flash) is the shape that starved the matvec kernels: few
 * rows, long K.  So K is spread over blocks instead of rows, and the blocks'
 * partials are reduced by the last block to finish:
 *
 *  Every block: one per (32 channels, token), 32 warps; warp (s, g) holds
 *    element (stream s, channel b*32 + lane).  It applies the previous
 *    sublayer's residual update to its elements (as k_hc_post computes it)
 *    and writes them to x, then forms the block's partial dot with each of
 *    the n_mix rows of fn (group g dots HCP_RPG of them) and its partial sum
 *    of squares (double, as the norm sums).  Warp butterflies, then the
 *    warps in stream order: a fixed shape.  The partials go to the op's flat
 *    scratch; then the block makes them visible (__threadfence) and counts
 *    itself done on the token's counter.
 *  The block that counts last (the counter reaches nb) resets the counter
 *    and finishes the token: warp r adds row r's partials in block order
 *    (lane-strided, then a butterfly), one more warp the squares; mix = rms
 *    * dot (the norm's scale applied after the dot: the same value up to
 *    rounding, ~1e-7 relative, well inside the tested bound); then pre,
 *    post and the Sinkhorn comb (warp 0, hc_sinkhorn_lanes), y = sum_s
 *    pre[s] x[s] and the sublayer's RMSNorm of y, by the other 31 warps.
 * Which block comes last depends on scheduling, but what it computes does
 * not: it reads every block's partials in block order, so the result is the
 * same bits on every run.  The counter is an integer (no float atomics).
 * A second launch for the finish cost its launch and ramp (~3 us on an
 * H200) 87 times per Flash token.  The partials live in the op's flat
 * scratch (nt * n_hc * D floats; this needs 26 per 32 channels), the
 * counters (one per token) are allocated once at init.
 * ------------------------------------------------------------------------- */

#define HCP_CH      32                  /* channels per block */
#define HCP_GROUPS  8                   /* row groups: warp (stream s, group g) dots rows of group g */
#define HCP_THREADS (HC_MAX * HCP_GROUPS * 32)
#define HCP_RPG     ((HC_NMIX_MAX + HCP_GROUPS - 1) / HCP_GROUPS)
#define HCF_CACHE   8                   /* y values per thread kept between the finish's passes */

/* fn is F32 (what ds4 synth writes) or F16 (the published Flash files). */
template <int WT>
__device__ __forceinline__ float hc_fn_elem(const void *fn, int64_t idx) {
    return WT == DS4_TYPE_F16 ? dsq_f16(((const uint16_t *)fn)[idx]) : ((const float *)fn)[idx];
}

#ifdef DS4_WHATIF
/* hcp_probe (what-if builds): a timeline of k_hc_pre launches, printed by the finishing block. */
__device__ unsigned long long g_hcp_g[4];    /* globaltimer: first entry, last entry, last grid-wait pass, unused */
__device__ long long g_hcp_c[8];             /* the finishing block's clock64 stamps */
__device__ unsigned g_hcp_n;
__device__ __forceinline__ unsigned long long hcp_gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
#define HCP_STAMP(i) do { if constexpr (PROBE) g_hcp_c[i] = clock64(); } while (0)
#else
#define HCP_STAMP(i) (void)0
#endif

#define HCF_STAGE   4096                /* floats of partial dots the finish stages in shared memory */

/* v / n for a count n: a power of two (Flash's 4,096 and 16,384) scales the exponent, which is
 * exact, so it equals the division bit for bit without its long double-precision sequence. */
__device__ __forceinline__ double div_count(double v, int64_t n) {
    return (n & (n - 1)) == 0 ? ldexp(v, -(__ffsll(n) - 1)) : v / (double)n;
}

/* The finish of token t's hc_pre by a block of NTHR threads (k_hc_pre's last block: HCP_THREADS,
 * or k_hcb_finish's: HCBF_THREADS): the nb partial dots of every mix row and the nb partial sums
 * of squares (at p0 = t nb, in block order; the block's warps take these n_mix + 2 tasks in turn),
 * mix = rms * dot, pre, post and the Sinkhorn comb (warp 0), y = sum_s pre[s] x[s] and its RMSNorm
 * (the other warps, each thread keeping CACHE of its y values between the two passes). */
template <int H, int NTHR = HCP_THREADS, int CACHE = HCF_CACHE, bool PROBE = false>
__device__ void hcp_finish(const float *scale, const float *base, const float *norm_w, int64_t D, int head,
                           float rms_eps, float hc_eps, int iters, const double *ss_part, const float *dot_part,
                           int nb, int t, const float *x, float *y, float *post, float *comb) {
    __shared__ float m_s[HC_NMIX_MAX], base_s[HC_NMIX_MAX];
    __shared__ double ss_s, red2[NTHR / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_mix = head ? H : (2 + H) * H;
    const int64_t p0 = (int64_t)t * nb;
    const float sc0 = scale[0];
    float sc1 = 0.0f, sc2 = 0.0f;
    if (threadIdx.x == 0 && !head) { sc1 = scale[1]; sc2 = scale[2]; }
    /* The nb x n_mix partial dots, staged in shared memory first when they fit: a block-wide
     * coalesced read, where a warp reading its row's partials from L2 (a stride of n_mix
     * floats a lane) fetched every sector n_mix / 8 times over.  Rows padded to n_mix + 1
     * floats (no bank conflicts).  The sums' order is the same either way. */
    __shared__ float part_s[HCF_STAGE];
    const int np = nb * n_mix, ps = n_mix + 1;
    const bool staged = nb * ps <= HCF_STAGE;
    if (staged) {
        constexpr int PER = (HCF_STAGE + NTHR - 1) / NTHR;
        float v[PER];
#pragma unroll
        for (int k = 0; k < PER; k++) {            /* every load in flight before the stores */
            const int q = k * NTHR + threadIdx.x;
            v[k] = q < np ? __ldcg(&dot_part[p0 * n_mix + q]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const int q = k * NTHR + threadIdx.x;
            if (q < np) part_s[(q / n_mix) * ps + q % n_mix] = v[k];
        }
        __syncthreads();
    }
    /* task r < n_mix: mix row r's partials; HC_NMIX_MAX: the squares'; HC_NMIX_MAX + 1: base */
    auto task = [&](int r) {
        if (r < n_mix) {
            float acc = 0.0f;
            if (staged)
                for (int bb = lane; bb < nb; bb += 32) acc += part_s[bb * ps + r];
            else
                for (int bb = lane; bb < nb; bb += 32) acc += __ldcg(&dot_part[(p0 + bb) * n_mix + r]);
            acc = warp_sum(acc);
            if (lane == 0) m_s[r] = acc;
        } else if (r == HC_NMIX_MAX) {
            double acc = 0.0;
            for (int bb = lane; bb < nb; bb += 32) acc += __ldcg(&ss_part[p0 + bb]);
            acc = warp_sum(acc);
            if (lane == 0) ss_s = acc;
        } else if (r == HC_NMIX_MAX + 1) {
            for (int q = lane; q < n_mix; q += 32) base_s[q] = base[q];
        }
    };
    if (threadIdx.x == 0) HCP_STAMP(1);
    if constexpr (NTHR / 32 >= HC_NMIX_MAX + 2) task(warp);   /* a warp each */
    else
        for (int r = warp; r < HC_NMIX_MAX + 2; r += NTHR / 32) task(r);
    __syncthreads();
    if (threadIdx.x == 0) HCP_STAMP(2);
    /* mix = rms * dot, and pre, computed the same way by every thread */
    const float rs = 1.0f / sqrtf((float)div_count(ss_s, (int64_t)H * D) + rms_eps);
    float pre[H];
#pragma unroll
    for (int s = 0; s < H; s++) pre[s] = sigmoid_f((m_s[s] * rs) * sc0 + base_s[s]) + hc_eps;

    const float *xt = x + (int64_t)t * H * D;
    float *yt = y + (int64_t)t * D;
    constexpr int YT = NTHR - 32;                 /* the threads of warps 1.. */
    const int yi = threadIdx.x - 32;
    float yc[CACHE], nw[CACHE];
    double ss = 0.0;
    if (warp == 0) {
        if (!head) {
            /* mix = rms * dot for the post and comb logits (entries >= H: the
             * other warps read only the pre logits, entries < H) */
            for (int r = H + lane; r < (2 + H) * H; r += 32) m_s[r] *= rs;
            __syncwarp();
            hc_sinkhorn_lanes<H>(m_s, base_s, __shfl_sync(FULL_MASK, sc1, 0), __shfl_sync(FULL_MASK, sc2, 0),
                                 hc_eps, iters, post + (int64_t)t * H, comb + (int64_t)t * H * H);
        }
        if (lane == 0) HCP_STAMP(3);
    } else {
#pragma unroll
        for (int j = 0; j < CACHE; j++) {
            const int64_t e = (int64_t)j * YT + yi;
            float acc = 0.0f;
            nw[j] = 1.0f;
            if (e < D) {
                if (norm_w) nw[j] = norm_w[e];
#pragma unroll
                for (int s = 0; s < H; s++) acc += pre[s] * __ldcg(&xt[s * D + e]);
            }
            yc[j] = acc;
            ss += (double)(acc * acc);
        }
        for (int64_t e = (int64_t)CACHE * YT + yi; e < D; e += YT) {
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < H; s++) acc += pre[s] * __ldcg(&xt[s * D + e]);
            ss += (double)(acc * acc);
        }
    }
    /* Warp 0 is done once post and comb are written: the y warps meet at a barrier of their
     * own (named barrier 1), so the norm's sum and the y writes run beside the Sinkhorn chain,
     * not after it.  tot leaves out warp 0's term, which was +0.0 (the same bits). */
    if (warp == 0) return;
    ss = warp_sum(ss);
    if (lane == 0) red2[warp] = ss;
    if (threadIdx.x == 32) HCP_STAMP(4);
    asm volatile("bar.sync 1, %0;" ::"r"(NTHR - 32) : "memory");
    if (threadIdx.x == 32) HCP_STAMP(5);
    double tot = 0.0;
    for (int wv = 1; wv < NTHR / 32; wv++) tot += red2[wv];
    const float sc = 1.0f / sqrtf((float)div_count(tot, D) + rms_eps);
#pragma unroll
    for (int j = 0; j < CACHE; j++) {
        const int64_t e = (int64_t)j * YT + yi;
        if (e < D) yt[e] = norm_w ? yc[j] * sc * nw[j] : yc[j] * sc;
    }
    if (threadIdx.x == 32) HCP_STAMP(6);
    for (int64_t e = (int64_t)CACHE * YT + yi; e < D; e += YT) {
        float acc = 0.0f;
#pragma unroll
        for (int s = 0; s < H; s++) acc += pre[s] * __ldcg(&xt[s * D + e]);
        yt[e] = norm_w ? acc * sc * norm_w[e] : acc * sc;
    }
}

/* The one hc_pre kernel (see the banner).  H is the stream count as a
 * template argument, so every input of the residual update (post, f, the H
 * comb entries and the H residual streams) is loaded in one round, before
 * any arithmetic: a runtime loop over the streams issued its loads one FMA
 * at a time, a memory latency each (6.1 us per call on an H200).  In the
 * finish, warp 0 runs post and Sinkhorn (a serial chain of ~40
 * normalisations) while warps 1..31 form y, its norm and its writes (they
 * meet at a barrier without warp 0), so the block takes the longer of the
 * two chains, not their sum; the partial dots are staged in shared memory
 * by one coalesced read; the scales are read before the
 * first barrier and the norm weights with the y pass's loads, so no global
 * load waits behind a barrier.  What other blocks wrote (x, the partials)
 * is read through L2 (__ldcg).  The fn loads come before the grid wait (a programmatic
 * dependent launch's prologue, ds4_grid_dep): nothing the step writes is read before it. */
template <int H, int WT>
__global__ void __launch_bounds__(HCP_THREADS) k_hc_pre(const float *f, const float *x_res, float *x, const void *fn,
                                                       const float *scale, const float *base, const float *norm_w,
                                                       int64_t D, int head, float rms_eps, float hc_eps, int iters,
                                                       double *ss_part, float *dot_part, unsigned *count,
                                                       float *y, float *post, float *comb) {
    /* NOTE(pdl prologue): the block's fn weights (the host's) are loaded before its grid wait,
     * so their memory latency passes while the kernel before it finishes */
    __shared__ float red[H][HC_NMIX_MAX];
    __shared__ double red_ss[H];
    __shared__ int last_s;
#ifdef DS4_WHATIF
    const int wf = iters >> 16;                   /* what-if parts (launch_hc_pre_t): timing only */
    iters = wf & 1 ? 0 : iters & 0xffff;
#else
    constexpr int wf = 0;
#endif
#ifdef DS4_WHATIF
    long long c_entry = 0;
    if ((wf & 8) && threadIdx.x == 0) {
        c_entry = clock64();
        const unsigned long long gt = hcp_gtime();
        atomicMin(&g_hcp_g[0], gt);
        atomicMax(&g_hcp_g[1], gt);
    }
#endif
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sw = warp % HC_MAX, g = warp / HC_MAX;
    const int b = blockIdx.x, t = blockIdx.y, nb = gridDim.x;
    const int n_mix = head ? H : (2 + H) * H;
    const int64_t i = (int64_t)b * HCP_CH + lane;
    const bool act = sw < H && i < D;
    const int64_t K = (int64_t)H * D;
    const int r0 = g * HCP_RPG;

    /* ---- every block: residual update, partial dots and squares ---- */
    float w[HCP_RPG];
#pragma unroll
    for (int j = 0; j < HCP_RPG; j++)             /* every load in flight before the math */
        w[j] = act && r0 + j < n_mix ? hc_fn_elem<WT>(fn, (int64_t)(r0 + j) * K + (int64_t)sw * D + i) : 0.0f;
    ds4_grid_dep();                               /* NOTE(pdl prologue): f, x, post, comb: the kernels' before */
#ifdef DS4_WHATIF
    if ((wf & 8) && threadIdx.x == 0) atomicMax(&g_hcp_g[2], hcp_gtime());
#endif
    float v = 0.0f;
    if (act) {
        float *xe = x + ((int64_t)t * H + sw) * D + i;
        if (f) {
            const float *xr = x_res + (int64_t)t * H * D;
            const float pv = post[(int64_t)t * H + sw], fv = f[(int64_t)t * D + i];
            float cb[H], xv[H];
#pragma unroll
            for (int bb = 0; bb < H; bb++) {
                cb[bb] = comb[(int64_t)t * H * H + sw + H * bb];
                xv[bb] = xr[bb * D + i];
            }
            float acc = pv * fv;                  /* k_hc_post's order */
#pragma unroll
            for (int bb = 0; bb < H; bb++) acc += cb[bb] * xv[bb];
            if (g == 0) *xe = acc;
            v = acc;
        } else {
            v = *xe;
        }
    }
    if (sw < H) {
#pragma unroll
        for (int j = 0; j < HCP_RPG; j++) {
            if (r0 + j < n_mix) {                 /* warp-uniform: the butterflies interleave */
                const float p = warp_sum(w[j] * v);
                if (lane == 0) red[sw][r0 + j] = p;
            }
        }
        if (g == 0) {
            double ss = (double)(v * v);
            ss = warp_sum(ss);
            if (lane == 0) red_ss[sw] = ss;
        }
    }
    __syncthreads();
    const int64_t p0 = (int64_t)t * nb;
    if (threadIdx.x < n_mix) {
        float acc = 0.0f;
#pragma unroll
        for (int s = 0; s < H; s++) acc += red[s][threadIdx.x];
        dot_part[(p0 + b) * n_mix + threadIdx.x] = acc;
    } else if (threadIdx.x == HC_NMIX_MAX) {
        double acc = 0.0;
#pragma unroll
        for (int s = 0; s < H; s++) acc += red_ss[s];
        ss_part[p0 + b] = acc;
    }
    /* every read of post and comb above is done before this block counts
     * itself, so the last block may overwrite them.  Only the warps that
     * wrote global memory (x by group 0, the partials by warp 0) fence: a
     * fence in all 32 warps was 15% of the kernel's stall samples. */
    if (g == 0 && !(wf & 4)) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_s = atomicAdd(&count[t], 1u) == (unsigned)nb - 1u;
    __syncthreads();
    if (!last_s) return;
#ifdef DS4_WHATIF
    const long long c_last = clock64();
#endif
    __threadfence();
    if (threadIdx.x == 0) count[t] = 0;           /* ready for the next launch */
    if (wf & 2) return;
#ifdef DS4_WHATIF
    unsigned long long g_count = 0;
    if ((wf & 8) && threadIdx.x == 0) { g_count = hcp_gtime(); g_hcp_c[0] = clock64(); }
    if (wf & 8)
        hcp_finish<H, HCP_THREADS, HCF_CACHE, true>(scale, base, norm_w, D, head, rms_eps, hc_eps, iters, ss_part,
                                                    dot_part, nb, t, x, y, post, comb);
    else
#endif
    hcp_finish<H>(scale, base, norm_w, D, head, rms_eps, hc_eps, iters, ss_part, dot_part, nb, t, x, y, post, comb);
#ifdef DS4_WHATIF
    __syncthreads();
    if ((wf & 8) && threadIdx.x == 0) {
        const unsigned long long g_end = hcp_gtime();
        const unsigned n = atomicAdd(&g_hcp_n, 1u);
        if (n >= 3000 && n < 3006) {
            const long long *c = g_hcp_c;
            printf("hcp_probe %u: ns from the first block's entry: last entry %llu, last grid-wait pass %llu, "
                   "last count %llu, end %llu; the finisher's cycles: entry to count %lld, fence %lld; from the finish's start: "
                   "partials %lld, sinkhorn done %lld, y pass done %lld, join %lld, y written %lld\n", n,
                   g_hcp_g[1] - g_hcp_g[0], g_hcp_g[2] - g_hcp_g[0], g_count - g_hcp_g[0], g_end - g_hcp_g[0],
                   c_last - c_entry, c[0] - c_last, c[2] - c[0], c[3] - c[0], c[4] - c[0], c[5] - c[0], c[6] - c[0]);
        }
        g_hcp_g[0] = ~0ull; g_hcp_g[1] = 0; g_hcp_g[2] = 0;
    }
#endif
}

/* ---------------------------------------------------------------------------
 * hc_pre of a batch (more than HC_SPLIT_MAX_NT tokens): two launches
 *
 * k_hcb_dots: block (chunk c of HCB_CH = 128 channels, HCB_TOK = 16 tokens), a warp per two
 *   tokens (w and w + 8 of the block's).
 *   Before its grid wait (a programmatic dependent launch's prologue: weights only) the block
 *   stages the chunk's fn columns (every mix row, every stream, its 128 channels) in shared
 *   memory, once for its 16 tokens, where k_hc_pre's blocks each read theirs for one token.
 *   Each warp then applies each of its tokens' residual update to the chunk (lane l: channels
 *   l + 32 e, e < 4, of every stream; k_hc_post's order), writes x, and forms each token's
 *   n_mix partial dots over the chunk's H x 128 elements (a lane's 4 H products in stream
 *   order, then one transposed butterfly, warp_xsum32: lane r holds row r's) and its partial
 *   sum of squares (double).  The partials go to the op's flat scratch at [t][chunk].  A weight
 *   read from shared memory serves both tokens: the dots read shared memory at one 4-byte
 *   wavefront per FMA pair, the kernel's bound with one token a warp (a chunk's 48 KiB of fn
 *   per token), and each token's sums are the one-token order, so the two-token warp changes
 *   no bit.
 * k_hcb_finish: a block per token runs hcp_finish over the chunks' partials, in chunk order,
 *   with HCBF_THREADS = 256 threads (k_hc_pre's finish has 1024), so that three tokens' blocks
 *   share an SM and their memory round trips overlap; a thread keeps its 19 y values in
 *   registers between the two passes.  The sum of squares is the same double sum in another
 *   grouping (the float scale it gives is the same but for a tie in the last bit of the double).
 * The arithmetic is k_hc_pre's with other partial sums (128 channels a chunk, not 32); like it,
 * mix = rms * dot (the norm's scale after the dot).  An fn of another type takes the CPU op's
 * composition (hc_post, rmsnorm, the matmul op, hc_mix, rmsnorm).
 * ------------------------------------------------------------------------- */

#define HCB_CH      128                 /* channels a chunk: 4 a lane */
#define HCB_TOK     16                  /* tokens a block */
#define HCB_TPW     2                   /* tokens a warp: w + 8 j */
#define HCB_THREADS (HCB_TOK / HCB_TPW * 32)
#define HCBF_THREADS 256                /* k_hcb_finish: three tokens' blocks an SM, not one */
#define HCBF_CACHE   19                 /* its y values a thread keeps: D <= 19 x 224 = 4256 read once */

/* A token's inputs to its residual update of the chunk (the lane's channels c0 + lane + 32 e):
 * loaded for both of a warp's tokens before either is updated, since the update's stores to x
 * may alias them as far as the compiler knows. */
template <int H>
struct hcb_in {
    float pv[H], cb[H][H], fv[4], xv[H][4];
};

/* f: the branch output (NULL: x is already updated, and v is read from it). */
template <int H>
__device__ __forceinline__ void hcb_load(const float *f, const float *x_res, const float *x, const float *post,
                                         const float *comb, int64_t D, int64_t t, int64_t c0, int lane, hcb_in<H> &in) {
    if (f) {
        const float *xr = x_res + t * H * D, *ft = f + t * D;
#pragma unroll
        for (int s = 0; s < H; s++) {
            in.pv[s] = post[t * H + s];
#pragma unroll
            for (int bb = 0; bb < H; bb++) in.cb[s][bb] = comb[t * H * H + s + H * bb];
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int64_t i = c0 + lane + 32 * e;
            in.fv[e] = i < D ? ft[i] : 0.0f;
#pragma unroll
            for (int bb = 0; bb < H; bb++) in.xv[bb][e] = i < D ? xr[bb * D + i] : 0.0f;
        }
    } else {
        const float *xt = x + t * H * D;
#pragma unroll
        for (int s = 0; s < H; s++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t i = c0 + lane + 32 * e;
                in.xv[s][e] = i < D ? xt[s * D + i] : 0.0f;
            }
    }
}

/* The token's updated chunk v (k_hc_post's order), written to x when `store` (and f). */
template <int H>
__device__ __forceinline__ void hcb_update(const float *f, float *x, int64_t D, int64_t t, int64_t c0, int lane,
                                           bool store, const hcb_in<H> &in, float (&v)[H][4]) {
    float *xt = x + t * H * D;
#pragma unroll
    for (int s = 0; s < H; s++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (!f) {
                v[s][e] = in.xv[s][e];
                continue;
            }
            float acc = in.pv[s] * in.fv[e];
#pragma unroll
            for (int bb = 0; bb < H; bb++) acc += in.cb[s][bb] * in.xv[bb][e];
            v[s][e] = acc;
            const int64_t i = c0 + lane + 32 * e;
            if (store && i < D) xt[s * D + i] = acc;
        }
}

/* A token's partial dots (lane r < n_mix: row r's) and sum of squares into the scratch. */
template <int H>
__device__ __forceinline__ void hcb_store(float (&d)[32], const float (&v)[H][4], int64_t p, int n_mix, int lane,
                                          double *ss_part, float *dot_part) {
    const float dot = warp_xsum32(d, lane);
    double ss = 0.0;
#pragma unroll
    for (int s = 0; s < H; s++)
#pragma unroll
        for (int e = 0; e < 4; e++) ss += (double)(v[s][e] * v[s][e]);
    ss = warp_sum(ss);
    if (lane < n_mix) dot_part[p * n_mix + lane] = dot;
    if (lane == 0) ss_part[p] = ss;
}

template <int H, int WT>
__global__ void __launch_bounds__(HCB_THREADS, 2) k_hcb_dots(const float *f, const float *x_res, float *x,
                                                             const void *fn, const float *post, const float *comb,
                                                             int64_t D, int nt, int n_mix, double *ss_part,
                                                             float *dot_part) {
    /* NOTE(pdl prologue): the chunk's fn columns (the host's weights) are staged before the
     * grid wait */
    __shared__ float w_s[HC_NMIX_MAX * H * HCB_CH];   /* [row][stream][channel] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nb = gridDim.x;
    const int64_t c0 = (int64_t)blockIdx.x * HCB_CH, K = (int64_t)H * D;
    constexpr int NQ = HC_NMIX_MAX * H * HCB_CH, NL = (NQ + HCB_THREADS - 1) / HCB_THREADS;
    float wl[NL];
#pragma unroll
    for (int j = 0; j < NL; j++) {                /* every load in flight, then the stores */
        const int q = threadIdx.x + j * HCB_THREADS;
        const int r = q / (H * HCB_CH), s = q / HCB_CH % H, c = q % HCB_CH;
        wl[j] = q < NQ && r < n_mix && c0 + c < D ? hc_fn_elem<WT>(fn, (int64_t)r * K + (int64_t)s * D + c0 + c)
                                                   : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < NL; j++)
        if (threadIdx.x + j * HCB_THREADS < NQ) w_s[threadIdx.x + j * HCB_THREADS] = wl[j];
    ds4_grid_dep();                               /* NOTE(pdl prologue): f, x, post, comb: the kernels' before */
    __syncthreads();
    const int t0 = blockIdx.y * HCB_TOK + warp, t1 = t0 + HCB_TOK / HCB_TPW;
    if (t0 >= nt) return;                         /* no barrier follows */
    const bool two = t1 < nt;                     /* else the second token's loads repeat t0's, nothing stored */
    float v0[H][4], v1[H][4];
    {
        hcb_in<H> in0, in1;
        hcb_load<H>(f, x_res, x, post, comb, D, t0, c0, lane, in0);
        hcb_load<H>(f, x_res, x, post, comb, D, two ? t1 : t0, c0, lane, in1);
        hcb_update<H>(f, x, D, t0, c0, lane, true, in0, v0);
        hcb_update<H>(f, x, D, t1, c0, lane, two, in1, v1);
    }
    float d0[32], d1[32];
#pragma unroll
    for (int r = 0; r < 32; r++) {
        float a0 = 0.0f, a1 = 0.0f;
        if (r < n_mix) {
#pragma unroll
            for (int s = 0; s < H; s++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float w = w_s[(r * H + s) * HCB_CH + lane + 32 * e];
                    a0 += w * v0[s][e];
                    a1 += w * v1[s][e];
                }
        }
        d0[r] = a0;
        d1[r] = a1;
    }
    hcb_store<H>(d0, v0, (int64_t)t0 * nb + blockIdx.x, n_mix, lane, ss_part, dot_part);
    if (two) hcb_store<H>(d1, v1, (int64_t)t1 * nb + blockIdx.x, n_mix, lane, ss_part, dot_part);
}

template <int H>
__global__ void __launch_bounds__(HCBF_THREADS, 3) k_hcb_finish(const float *scale, const float *base, const float *norm_w,
                                                           int64_t D, int head, float rms_eps, float hc_eps, int iters,
                                                           const double *ss_part, const float *dot_part, int nb,
                                                           const float *x, float *y, float *post, float *comb) {
    ds4_grid_dep();
    hcp_finish<H, HCBF_THREADS, HCBF_CACHE>(scale, base, norm_w, D, head, rms_eps, hc_eps, iters, ss_part, dot_part,
                                            nb, blockIdx.x, x, y, post, comb);
}

/* The batch's two launches (H streams, fn of type wt). */
template <int H>
static void launch_hc_pre_batch_t(const float *f, const float *x_res, float *x, const void *fn, int wt,
                                  const float *scale, const float *base, const float *norm_w, int nt, int64_t D,
                                  int head, float rms_eps, float hc_eps, int iters, double *ss_part,
                                  float *dot_part, float *y, float *post, float *comb) {
    const int n_mix = head ? H : (2 + H) * H;
    const int nb = (int)((D + HCB_CH - 1) / HCB_CH);
    const dim3 grid((unsigned)nb, (unsigned)((nt + HCB_TOK - 1) / HCB_TOK));
    if (wt == DS4_TYPE_F16)
        DS4_LAUNCH(k_hcb_dots<H, DS4_TYPE_F16>, grid, HCB_THREADS, 0, f, x_res, x, fn, post, comb, D, nt, n_mix,
                   ss_part, dot_part);
    else
        DS4_LAUNCH(k_hcb_dots<H, DS4_TYPE_F32>, grid, HCB_THREADS, 0, f, x_res, x, fn, post, comb, D, nt, n_mix,
                   ss_part, dot_part);
    DS4_LAUNCH(k_hcb_finish<H>, (unsigned)nt, HCBF_THREADS, 0, scale, base, norm_w, D, head, rms_eps, hc_eps, iters,
               ss_part, dot_part, nb, x, y, post, comb);
}

static void launch_hc_pre_batch(const float *f, const float *x_res, float *x, const void *fn, int wt,
                                const float *scale, const float *base, const float *norm_w, int nt, int64_t D, int h,
                                int head, float rms_eps, float hc_eps, int iters, double *ss_part, float *dot_part,
                                float *y, float *post, float *comb) {
    switch (h) {
    case 1: launch_hc_pre_batch_t<1>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, ss_part, dot_part, y, post, comb); break;
    case 2: launch_hc_pre_batch_t<2>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, ss_part, dot_part, y, post, comb); break;
    case 3: launch_hc_pre_batch_t<3>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, ss_part, dot_part, y, post, comb); break;
    default: launch_hc_pre_batch_t<4>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, ss_part, dot_part, y, post, comb); break;
    }
}

template <int H>
static void launch_hc_pre_t(const float *f, const float *x_res, float *x, const void *fn, int wt,
                            const float *scale, const float *base, const float *norm_w, int nt, int64_t D,
                            int head, float rms_eps, float hc_eps, int iters, int nb,
                            double *ss_part, float *dot_part, float *y, float *post, float *comb) {
    const dim3 grid((unsigned)nb, (unsigned)nt);
#ifdef DS4_WHATIF
    /* What-if parts of k_hc_pre (WHATIF_SKIP, timing only): hcp_sinkhorn drops the Sinkhorn
     * iterations, hcp_finish the last block's finish, hcp_fence the blocks' fence before they
     * count themselves; passed in iters' high bits. */
    iters |= (ds4_whatif_skip("hcp_sinkhorn") ? 1 << 16 : 0) | (ds4_whatif_skip("hcp_finish") ? 2 << 16 : 0) |
             (ds4_whatif_skip("hcp_fence") ? 4 << 16 : 0) | (ds4_whatif_skip("hcp_probe") ? 8 << 16 : 0);
#endif
    if (wt == DS4_TYPE_F16)
        DS4_LAUNCH(k_hc_pre<H, DS4_TYPE_F16>, grid, HCP_THREADS, 0, f, x_res, x, fn, scale, base, norm_w, D, head,
                   rms_eps, hc_eps, iters, ss_part, dot_part,
                   sess()->hc_count, y, post, comb);
    else
        DS4_LAUNCH(k_hc_pre<H, DS4_TYPE_F32>, grid, HCP_THREADS, 0, f, x_res, x, fn, scale, base, norm_w, D, head,
                   rms_eps, hc_eps, iters, ss_part, dot_part,
                   sess()->hc_count, y, post, comb);
}

/* The one launcher of k_hc_pre (a template over H and the fn type). */
static void launch_hc_pre(const float *f, const float *x_res, float *x, const void *fn, int wt,
                          const float *scale, const float *base, const float *norm_w, int nt, int64_t D, int h,
                          int head, float rms_eps, float hc_eps, int iters, int nb,
                          double *ss_part, float *dot_part, float *y, float *post, float *comb) {
    switch (h) {
    case 1: launch_hc_pre_t<1>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    case 2: launch_hc_pre_t<2>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    case 3: launch_hc_pre_t<3>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    default: launch_hc_pre_t<4>(f, x_res, x, fn, wt, scale, base, norm_w, nt, D, head, rms_eps, hc_eps, iters, nb, ss_part, dot_part, y, post, comb); break;
    }
}

static void cuda_hc_pre(const float *f, const float *x_res, float *x,
                        const ds4_weight *fn, const float *scale, const float *base, const float *norm_w,
                        int nt, int D, int n_hc, int head, float rms_eps, float hc_eps, int iters,
                        float *flat, float *mix, float *y, float *post, float *comb) {
    if (nt <= 0 || D <= 0) return;
    const int h = n_hc, n_mix = head ? h : (2 + h) * h;
    if (h < 1 || h > HC_MAX) {
        ds4_fatal("hc_pre: n_hc = %d outside 1..%d", h, HC_MAX);
    }
    if (fn->ne[0] != (int64_t)h * D || fn->ne[1] != n_mix) {
        ds4_fatal("hc_pre: %s must be {%d, %d}", fn->name ? fn->name : "fn", h * D, n_mix);
    }
    /* the partials go to flat (nt*h*D floats): the squares (doubles) first, then the dots */
    const bool fn_ok = fn->type == DS4_TYPE_F32 || fn->type == DS4_TYPE_F16;
    const int nb = (int)((D + HCP_CH - 1) / HCP_CH), nbb = (int)((D + HCB_CH - 1) / HCB_CH);
    if (fn_ok && nt <= HC_SPLIT_MAX_NT && (int64_t)nb * (n_mix + 2) <= (int64_t)h * D) {
        double *ss_part = (double *)flat;
        float *dot_part = flat + 2 * (int64_t)nt * nb;
        launch_hc_pre(f, x_res, x, fn->dev, fn->type, scale, base, norm_w, nt, D, h, head, rms_eps, hc_eps, iters, nb,
                      ss_part, dot_part, y, post, comb);
        return;
    }
    if (fn_ok && (int64_t)nbb * (n_mix + 2) <= (int64_t)h * D) {
        double *ss_part = (double *)flat;
        float *dot_part = flat + 2 * (int64_t)nt * nbb;
        launch_hc_pre_batch(f, x_res, x, fn->dev, fn->type, scale, base, norm_w, nt, D, h, head, rms_eps, hc_eps,
                            iters, ss_part, dot_part, y, post, comb);
        return;
    }
    /* the CPU op's composition: the projection through the matmul op (any weight type) */
    if (f) launch_hc_post(f, x_res, post, comb, nt, D, h, x);
    cuda_rmsnorm(x, NULL, flat, nt, h * D, rms_eps);
    cuda_matmul(fn, 0, flat, mix, nt);
    launch_hc_mix(mix, scale, base, x, nt, D, h, head, hc_eps, iters, y, post, comb);
    cuda_rmsnorm(y, norm_w, y, nt, D, rms_eps);
}

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_mhc(ds4_backend *b) {
    b->hc_mix = cuda_hc_mix;
    b->hc_post = cuda_hc_post;
    b->hc_pre = cuda_hc_pre;
}
