/* ds4_cuda_moe.cu -- the CUDA backend's mixture of experts: routing (with the router, moe_gate),
 * SwiGLU, and the experts at decode (matvec kernels, no host round trip) and at prefill
 * (grouped by expert: one tensor-core launch per projection over every expert, or cuBLAS on
 * dequantised slices for the types that engine does not take).  At decode the shared expert
 * runs on a second stream beside the routing and the routed experts (shared_begin).
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * MoE
 *
 * Routing: one warp per token.  probs = sqrt(softplus(logits)) in shared
 * memory; scored layers take k rounds of a warp arg-max (ties: lower expert)
 * over the biased probs, hash layers copy the token's tid2eid row; lane j
 * then holds slot j's weight, normalised by the sum taken in slot order, as
 * the CPU does.  At decode the router's matvec runs in the same launch
 * (k_moe_gate, the op moe_gate).
 *
 * Experts, decode (nt <= MOE_DECODE_MAX_NT): no host round trip.  k_matvec
 * in gate|up mode computes h = swiglu(gate x, up x) for every (token, slot)
 * into [nt][k][F], reading the expert id from sel on the device; down mode
 * computes each slot's output into [nt][k][D]; k_moe_combine adds them with
 * the routing weights in slot order.  Three launches, which stream the
 * selected experts' weights near the copy bandwidth.  The combine stays a
 * launch of its own: folded into the down launch (its last block per row
 * tile adding the slots after a fence and a counter) it slows that launch
 * by more than the launch it saves.
 * Experts, prefill: the (token, slot) pairs are grouped by expert, in token
 * order within an expert.  Dequantizing an expert costs about as much as eight
 * matvecs over it, so with fewer than MOE_GEMM_MIN_AVG tokens per used expert
 * the decode kernels run anyway.  When the tensor-core engine takes the
 * experts' types (ds4_cuda_gemm.cu) and the batch has at least
 * MOE_GEMM_MIN_AVG pairs per expert of the layer (so per used expert too),
 * the grouping is made on the device (k_moe_group: the pair tables and the
 * tile table), and each projection is one launch over every expert's tiles
 * of up to 64 pairs, its grid sized for the most tiles the batch can have:
 * no host round trip, so the host issues the prompt's layers ahead of the
 * device.  Otherwise sel is copied to the host, counted and grouped there
 * (one wait per MoE layer), and the tables go back up; the types the engine
 * does not take run each expert's three projections as cuBLAS GEMMs on its
 * dequantized slice.  Both groupings give the same tables, so the same sums.
 * k_moe_combine then reads the outputs back in (token, slot) order through the
 * pair -> row table.
 * ------------------------------------------------------------------------- */

#define MOE_GEMM_MIN_AVG   8    /* GEMMs pay once experts average this many tokens */
#define MOE_GROUP_MAX_E    256  /* k_moe_group's per-warp counts: 32 x E ints of shared memory */
#define MOE_GROUP_THREADS  1024
#define ROUTE_MAX_E        1024
#define ROUTE_MAX_K        64

/* The routing of one token by one warp (every lane calls it): l the
 * token's E logits (read through L2: k_moe_gate's other blocks wrote them),
 * probs/selp shared buffers of E floats each, tid_row the token's tid2eid
 * row (hash layers) or NULL. */
__device__ void moe_route_warp(const float *l, const float *bias, const int32_t *tid_row, int E, int k,
                               int norm, float wscale, float *probs, float *selp, int32_t *sel_t, float *wts_t) {
    const int lane = threadIdx.x & 31;
    for (int e = lane; e < E; e += 32) {
        const float x = __ldcg(&l[e]);
        const float sp = x > 20.0f ? x : logf(1.0f + expf(x));
        probs[e] = sqrtf(sp);
        selp[e] = bias ? probs[e] + bias[e] : probs[e];
    }
    __syncwarp();
    /* The chosen ids live in registers: lane j keeps pick j (j < 32; pick
     * 32 + j goes to mine_hi), and lane e % 32 marks expert e in its taken
     * bits (bit e / 32; E <= 1024).  Nothing shared is written during the
     * selection, so no lane can read a pick before it is made. */
    int mine = -1, mine_hi = -1;
    uint32_t taken = 0;
    if (tid_row) {
        if (lane < k) mine = tid_row[lane];
        if (lane + 32 < k) mine_hi = tid_row[lane + 32];
    } else {
        for (int j = 0; j < k; j++) {
            float bv = 0.0f;
            int be = -1;
            for (int e = lane, bit = 0; e < E; e += 32, bit++) {
                if (taken >> bit & 1u) continue;
                if (be < 0 || selp[e] > bv) { bv = selp[e]; be = e; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
                const int oe = __shfl_xor_sync(FULL_MASK, be, o);
                if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) { bv = ov; be = oe; }
            }
            /* every lane now holds the same be */
            if (be >= 0 && lane == (be & 31)) taken |= 1u << (be >> 5);
            if (lane == (j & 31)) { if (j < 32) mine = be; else mine_hi = be; }
        }
    }
    /* weights: lane j < 32 owns slot j (and 32 + j), so the k probabilities
     * are gathered and scaled in parallel; the normalising sum is added in
     * slot order by every lane (k shuffles), as the CPU adds it */
    const float w_lo = mine >= 0 && mine < E ? probs[mine] : 0.0f;
    const float w_hi = mine_hi >= 0 && mine_hi < E ? probs[mine_hi] : 0.0f;
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += __shfl_sync(FULL_MASK, j < 32 ? w_lo : w_hi, j & 31);
    if (norm && sum < 6.103515625e-5f) sum = 6.103515625e-5f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int j = lane + 32 * h;
        if (j >= k) break;
        float wv = h ? w_hi : w_lo;
        if (norm) wv /= sum;
        if (wscale != 0.0f) wv *= wscale;
        sel_t[j] = h ? mine_hi : mine;
        wts_t[j] = wv;
    }
}

__global__ void k_moe_route(const float *logits, const float *bias, const int32_t *tid2eid, int64_t tid_ld,
                            const int32_t *tokens, int E, int k, int norm, float wscale,
                            int32_t *sel, float *wts) {
    ds4_grid_dep();
    extern __shared__ float rt_s[];
    const int t = blockIdx.x;
    moe_route_warp(logits + (int64_t)t * E, bias, tid2eid ? tid2eid + (int64_t)tokens[t] * tid_ld : NULL, E, k,
                   norm, wscale, rt_s, rt_s + E, sel + (int64_t)t * k, wts + (int64_t)t * k);
}

static void launch_moe_route(const float *logits, const float *bias, const int32_t *tid2eid, int64_t tid_ld,
                             const int32_t *tokens, int nt, int E, int k, int norm, float wscale,
                             int32_t *sel, float *wts) {
    DS4_LAUNCH(k_moe_route, nt, 32, (size_t)2 * E * sizeof(float), logits, bias, tid2eid, tid_ld, tokens,
               E, k, norm, wscale, sel, wts);
}

/* moe_gate at decode: the router's logits and the routing in one launch.
 * Block (bx, t) computes logits MG_ROWS*bx .. +MG_ROWS of token t: the 8
 * warps take K/8 each (16-byte loads, all in flight), and the warps'
 * partials are added in warp order.  Then the block counts itself done on
 * the token's counter, and the last one routes the token with its warp 0
 * (moe_route_warp).  A separate router matvec and route kernel cost two
 * launches (~4 + 6 us on an H200, 43 times per Flash token).  Before its grid wait (a
 * programmatic dependent launch's prologue) a block asks its router rows into L2.  The logits
 * differ from the matmul op's by the order of the K sum (a few ulp; the
 * tested bound is the matmul's). */
#define MG_THREADS 256
#define MG_ROWS    2
static_assert(MOE_DECODE_MAX_NT <= HC_SPLIT_MAX_NT, "a session's gate_count holds HC_SPLIT_MAX_NT counters");
template <int WT>
__global__ void __launch_bounds__(MG_THREADS) k_moe_gate(const void *gw, const float *x, int64_t K, int E,
                                                        float *logits, const float *bias,
                                                        const int32_t *tid2eid, int64_t tid_ld,
                                                        const int32_t *tokens, int k, int norm, float wscale,
                                                        unsigned *count, int32_t *sel, float *wts) {
    /* NOTE(pdl prologue): the block's router rows (the host's weights) are asked into L2 before
     * its grid wait, so they stream while the kernel before it finishes */
    extern __shared__ float mg_s[];                 /* probs, selp: [E] each */
    __shared__ float part[MG_ROWS][MG_THREADS / 32];
    __shared__ int last_s;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bx = blockIdx.x, t = blockIdx.y;
    const int64_t slice = K / (MG_THREADS / 32), k0 = (int64_t)warp * slice;
    constexpr int ES = WT == DS4_TYPE_F16 ? 2 : 4;  /* bytes an element */
#pragma unroll
    for (int r = 0; r < MG_ROWS; r++) {
        const int row = bx * MG_ROWS + r;
        if (row >= E) break;
        const uint8_t *w0 = (const uint8_t *)gw + ((int64_t)row * K + k0) * ES;
        for (int64_t o = 128 * lane; o < slice * ES; o += 32 * 128) prefetch_l2(w0 + o);
    }
    ds4_grid_dep();                                 /* NOTE(pdl prologue): x, written by the kernel before */
    const float *xt = x + (int64_t)t * K;
    float acc[MG_ROWS];
#pragma unroll
    for (int r = 0; r < MG_ROWS; r++) acc[r] = 0.0f;
#pragma unroll 4
    for (int64_t e = k0 + 4 * lane; e < k0 + slice; e += 128) {
        const float4 xv = *(const float4 *)(xt + e);
#pragma unroll
        for (int r = 0; r < MG_ROWS; r++) {
            const int row = bx * MG_ROWS + r;
            if (row >= E) break;
            float w0, w1, w2, w3;
            if (WT == DS4_TYPE_F16) {
                const uint2 h = ld_stream8((const uint8_t *)gw + ((int64_t)row * K + e) * 2);
                w0 = dsq_f16((uint16_t)(h.x & 0xffffu)); w1 = dsq_f16((uint16_t)(h.x >> 16));
                w2 = dsq_f16((uint16_t)(h.y & 0xffffu)); w3 = dsq_f16((uint16_t)(h.y >> 16));
            } else {
                const uint4 v = ld_stream16((const uint8_t *)gw + ((int64_t)row * K + e) * 4);
                w0 = __uint_as_float(v.x); w1 = __uint_as_float(v.y);
                w2 = __uint_as_float(v.z); w3 = __uint_as_float(v.w);
            }
            acc[r] = fmaf(w0, xv.x, acc[r]); acc[r] = fmaf(w1, xv.y, acc[r]);
            acc[r] = fmaf(w2, xv.z, acc[r]); acc[r] = fmaf(w3, xv.w, acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < MG_ROWS; r++) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) part[r][warp] = v;
    }
    __syncthreads();
    if (threadIdx.x < MG_ROWS && bx * MG_ROWS + (int)threadIdx.x < E) {
        float v = 0.0f;
        for (int w = 0; w < MG_THREADS / 32; w++) v += part[threadIdx.x][w];
        logits[(int64_t)t * E + bx * MG_ROWS + threadIdx.x] = v;
    }
    if (warp == 0) __threadfence();                 /* the only writer */
    __syncthreads();
    if (threadIdx.x == 0) last_s = atomicAdd(&count[t], 1u) == gridDim.x - 1u;
    __syncthreads();
    if (!last_s || warp != 0) return;
    __threadfence();
    if (lane == 0) count[t] = 0;
    moe_route_warp(logits + (int64_t)t * E, bias, tid2eid ? tid2eid + (int64_t)tokens[t] * tid_ld : NULL, E, k,
                   norm, wscale, mg_s, mg_s + E, sel + (int64_t)t * k, wts + (int64_t)t * k);
}

static void launch_moe_gate(const void *gw, int wt, const float *x, int64_t K, int E, int nt, float *logits,
                            const float *bias, const int32_t *tid2eid, int64_t tid_ld, const int32_t *tokens,
                            int k, int norm, float wscale, int32_t *sel, float *wts) {
    const dim3 grid((unsigned)((E + MG_ROWS - 1) / MG_ROWS), (unsigned)nt);
    const size_t smem = (size_t)2 * E * sizeof(float);
    if (wt == DS4_TYPE_F16)
        DS4_LAUNCH(k_moe_gate<DS4_TYPE_F16>, grid, MG_THREADS, smem, gw, x, K, E, logits, bias, tid2eid, tid_ld,
                   tokens, k, norm, wscale, sess()->gate_count,
                   sel, wts);
    else
        DS4_LAUNCH(k_moe_gate<DS4_TYPE_F32>, grid, MG_THREADS, smem, gw, x, K, E, logits, bias, tid2eid, tid_ld,
                   tokens, k, norm, wscale, sess()->gate_count,
                   sel, wts);
}

static void cuda_moe_route(const float *logits, const float *bias, const ds4_weight *tid2eid,
                           const int32_t *tokens, int nt, int E, int k, int norm, float wscale,
                           int32_t *sel, float *wts) {
    if (nt <= 0) return;
    if (E < 1 || E > ROUTE_MAX_E || k < 1 || k > ROUTE_MAX_K || k > E) {
        ds4_fatal("moe_route: E = %d, k = %d outside the supported 1..%d, 1..%d",
                  E, k, ROUTE_MAX_E, ROUTE_MAX_K);
    }
    launch_moe_route(logits, bias, tid2eid ? (const int32_t *)tid2eid->dev : NULL,
                     tid2eid ? tid2eid->ne[0] : 0, tokens, nt, E, k, norm, wscale, sel, wts);
}

static void cuda_moe_gate(const ds4_weight *gate_inp, const float *x, float *logits, const float *bias,
                          const ds4_weight *tid2eid, const int32_t *tokens, int nt, int E, int k, int norm,
                          float wscale, int32_t *sel, float *wts) {
    if (nt <= 0) return;
    const int64_t K = gate_inp->ne[0];
    const bool fused = nt <= MOE_DECODE_MAX_NT && gate_inp->ne[1] == E && gate_inp->ne[2] <= 1 &&
                       (gate_inp->type == DS4_TYPE_F32 || gate_inp->type == DS4_TYPE_F16) &&
                       K % (4 * MG_THREADS) == 0 && (uintptr_t)gate_inp->dev % 16 == 0 &&
                       E >= 1 && E <= ROUTE_MAX_E && k >= 1 && k <= ROUTE_MAX_K && k <= E;
    if (!fused) {
        cuda_matmul(gate_inp, 0, x, logits, nt);
        cuda_moe_route(logits, bias, tid2eid, tokens, nt, E, k, norm, wscale, sel, wts);
        return;
    }
    launch_moe_gate(gate_inp->dev, gate_inp->type, x, K, E, nt, logits, bias,
                    tid2eid ? (const int32_t *)tid2eid->dev : NULL, tid2eid ? tid2eid->ne[0] : 0, tokens,
                    k, norm, wscale, sel, wts);
}

/* y[r][c] = swiglu(g[r][c], u[r][c]) with row strides ld_in / ld_out. */
__global__ void k_swiglu(const float *g, const float *u, float *y, int64_t rows, int64_t cols,
                         int64_t ld_in, int64_t ld_out, float limit) {
    ds4_grid_dep();
    const int64_t n = rows * cols;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = idx / cols, c = idx % cols;
        y[r * ld_out + c] = silu_mul(g[r * ld_in + c], u[r * ld_in + c], limit);
    }
}

void launch_swiglu(const float *g, const float *u, float *y, int64_t rows, int64_t cols,
                   int64_t ld_in, int64_t ld_out, float limit) {
    if (rows <= 0 || cols <= 0) return;
    DS4_LAUNCH(k_swiglu, grid_for(rows * cols), 256, 0, g, u, y, rows, cols, ld_in, ld_out, limit);
}

static void cuda_swiglu(const float *g, const float *u, float *y, int64_t n, float limit) {
    launch_swiglu(g, u, y, 1, n, n, n, limit);
}

/* A prompt's grouping on the device, in one block of 32 warps (E <= MOE_GROUP_MAX_E): the
 * pairs 0 .. n - 1 (sel, expert ids, valid: the routing's picks or tid2eid rows, which the
 * loader checks) ordered by expert and, within an expert, by pair, as the host's counting
 * sort orders them.  Warp w takes the pairs of its slice [w s, w s + s) in rounds of 32;
 * __match_any_sync finds the lanes of a round that share an expert, and a lane's rank among
 * them is the count of such lanes below it.  Pass 1 counts each expert's pairs per warp
 * (cnt[w][e]); the scan (expert-major, then warp) turns the counts into each warp's first row
 * for each expert; pass 2 places every pair at that row plus its rank: perm[row] = pair,
 * pos[pair] = row.  Then the tiles, expert e's rows in chunks of TC_BN as gemm_tc_tiles makes
 * them ({e, first row, end row, 0}, experts in order), and empty tiles ({0, 0, 0, 0}: a
 * product's block returns at once) up to max_tiles, the grid's size. */
__global__ void __launch_bounds__(MOE_GROUP_THREADS) k_moe_group(const int32_t *sel, int n, int E, int32_t *perm,
                                                                 int32_t *pos, int4 *tiles, int max_tiles) {
    ds4_grid_dep();
    extern __shared__ int mgp_s[];
    constexpr int NW = MOE_GROUP_THREADS / 32;
    int *cnt = mgp_s;                               /* [NW][E] */
    int *off = mgp_s + NW * E;                      /* [E + 1]: first row of each expert */
    int *toff = off + E + 1;                        /* [E + 1]: first tile of each expert */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1u;
    for (int i = threadIdx.x; i < NW * E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    const int slice = (n + NW - 1) / NW, p0 = warp * slice, p1 = min(p0 + slice, n);
    for (int b = p0; b < p1; b += 32) {             /* pass 1: the warp's counts */
        const int i = b + lane;
        const int e = i < p1 ? sel[i] : -1 - lane;  /* lanes past the slice: a group each */
        const unsigned peers = __match_any_sync(FULL_MASK, e);
        if (e >= 0 && (peers & below) == 0) cnt[warp * E + e] += __popc(peers);
        __syncwarp();                               /* the next round's leader may be another lane */
    }
    __syncthreads();
    if (threadIdx.x < E) {                          /* each expert's count, warp prefixes */
        const int e = threadIdx.x;
        int run = 0;
        for (int w = 0; w < NW; w++) { const int c = cnt[w * E + e]; cnt[w * E + e] = run; run += c; }
        off[e + 1] = run;
        toff[e + 1] = (run + TC_BN - 1) / TC_BN;
    }
    __syncthreads();
    if (threadIdx.x == 0) {                         /* expert prefixes (E <= 256 adds) */
        off[0] = toff[0] = 0;
        for (int e = 0; e < E; e++) { off[e + 1] += off[e]; toff[e + 1] += toff[e]; }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NW * E; i += blockDim.x) cnt[i] += off[i % E];
    __syncthreads();
    for (int b = p0; b < p1; b += 32) {             /* pass 2: every pair at its row */
        const int i = b + lane;
        const int e = i < p1 ? sel[i] : -1 - lane;
        const unsigned peers = __match_any_sync(FULL_MASK, e);
        if (e >= 0) {
            const int r = cnt[warp * E + e] + __popc(peers & below);
            perm[r] = i;
            pos[i] = r;
        }
        __syncwarp();
        if (e >= 0 && (peers & below) == 0) cnt[warp * E + e] += __popc(peers);
        __syncwarp();
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x)   /* the tiles */
        for (int r = off[e], j = toff[e]; r < off[e + 1]; r += TC_BN, j++)
            tiles[j] = make_int4(e, r, min(r + TC_BN, off[e + 1]), 0);
    for (int j = toff[E] + threadIdx.x; j < max_tiles; j += blockDim.x) tiles[j] = make_int4(0, 0, 0, 0);
}

static void launch_moe_group(const int32_t *sel, int64_t n, int E, int32_t *perm, int32_t *pos, int4 *tiles,
                             int max_tiles) {
    const size_t smem = ((size_t)(MOE_GROUP_THREADS / 32) * E + 2 * ((size_t)E + 1)) * sizeof(int);
    DS4_LAUNCH(k_moe_group, 1, MOE_GROUP_THREADS, smem, sel, (int)n, E, perm, pos, tiles, max_tiles);
}

/* out[t][:] = sum_j wts[t][j] * slot_out[row(t, j)][:], j in order; row is
 * t*k + j (decode layout) or pos[t*k + j] (prefill, grouped by expert). */
__global__ void k_moe_combine(const float *slot_out, const int32_t *pos, const float *wts, int nt, int k,
                              int64_t D, const float *add, float *out) {
    ds4_grid_dep();
    const int64_t n = (int64_t)nt * D;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = idx / D, i = idx % D;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            const int64_t pr = t * k + j;
            const int64_t row = pos ? pos[pr] : pr;
            acc += wts[pr] * slot_out[row * D + i];
        }
        out[idx] = add ? __fadd_rn(acc, add[idx]) : acc;
    }
}

static void launch_moe_combine(const float *slot_out, const int32_t *pos, const float *wts, int nt, int k,
                               int64_t D, const float *add, float *out) {
    DS4_LAUNCH(k_moe_combine, grid_for((int64_t)nt * D), 256, 0, slot_out, pos, wts, nt, k, D, add, out);
}

/* xg[i][:] = x[perm[i] / k][:] */
__global__ void k_moe_gather(const float *x, const int32_t *perm, int k, int64_t n_pairs, int64_t D, float *xg) {
    ds4_grid_dep();
    const int64_t n = n_pairs * D;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = idx / D, c = idx % D;
        xg[idx] = x[(int64_t)(perm[i] / k) * D + c];
    }
}

static void launch_moe_gather(const float *x, const int32_t *perm, int k, int64_t n_pairs, int64_t D, float *xg) {
    DS4_LAUNCH(k_moe_gather, grid_for(n_pairs * D), 256, 0, x, perm, k, n_pairs, D, xg);
}

/* ---------------------------------------------------------------------------
 * The shared expert beside the routed experts (shared_begin, shared_end)
 *
 * At decode the shared expert's two matvecs read only the layer's normed input and write
 * buffers of their own, so they need not wait for the routing or the routed experts: issued on
 * the session's second stream after an event on the compute stream (the fork), they stream
 * their weights while the router and the routed experts stream theirs, and moe_decode makes
 * the compute stream wait for their end (the join) just before the combine that adds their
 * output.  Under a capture the two events become edges of the recorded graph, not nodes.
 * The sums are the same either way.  Batches above MOE_DECODE_MAX_NT tokens stay in order:
 * their products share the session's scratch and cuBLAS handle with the routed experts'.
 * ------------------------------------------------------------------------- */

static int cuda_shared_begin(int nt) {
    ds4_session *S = sess();
    if (!S->shx.s || nt > MOE_DECODE_MAX_NT || nt > MV_MAX_NT) return 0;
    ds4_side_fork(&S->shx);
    return 1;
}

static void cuda_shared_end(void) { ds4_side_unfork(&sess()->shx); }

/* Before the op that writes out: the compute stream waits for the shared expert's stream (a
 * no-op unless shared_end was last) and for the hook producers (out is the attn record's
 * source: ds4_gpu.h moe_experts), both already done unless they outlast the experts. */
static void out_join(void) {
    ds4_side_join(&sess()->shx);
    cuda_hooks_join();
}

static void moe_decode(const float *x, const int32_t *sel, const float *wts,
                       const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                       int nt, int k, float clamp, const float *add, float *out) {
    const int64_t D = gate->ne[0], F = gate->ne[1];
    const size_t rb_g = ds4_row_bytes(gate->type, D), rb_d = ds4_row_bytes(down->type, F);
    const int64_t pairs = (int64_t)nt * k;
    float *h = (float *)scratch_get(&sess()->moe_h, (size_t)(pairs * F) * sizeof(float));
    float *tmp = (float *)scratch_get(&sess()->moe_tmp, (size_t)(pairs * D) * sizeof(float));

    mv_args a;
    memset(&a, 0, sizeof a);
    a.w = (const uint8_t *)gate->dev;
    a.w2 = (const uint8_t *)up->dev;
    a.mat_bytes = (size_t)F * rb_g;
    a.row_bytes = rb_g;
    a.K = (int)D;
    a.rows = (int)F;
    a.x = x; a.x_prob = 0; a.x_tok = D;
    a.y = h; a.y_prob = F; a.y_tok = (int64_t)k * F;
    a.sel = sel; a.k = k; a.clamp = clamp;
    matvec_run(gate->type, MV_GATE_UP, a, k, nt, 1);

    mv_args b;
    memset(&b, 0, sizeof b);
    b.w = (const uint8_t *)down->dev;
    b.mat_bytes = (size_t)D * rb_d;
    b.row_bytes = rb_d;
    b.K = (int)F;
    b.rows = (int)D;
    b.x = h; b.x_prob = F; b.x_tok = (int64_t)k * F;
    b.y = tmp; b.y_prob = D; b.y_tok = (int64_t)k * D;
    b.sel = sel; b.k = k;
    matvec_run(down->type, MV_DOWN, b, k, nt, 1);

    out_join();                                 /* add: the shared expert's output */
    launch_moe_combine(tmp, NULL, wts, nt, k, D, add, out);
}

static void cuda_moe_experts(const float *x, const int32_t *sel, const float *wts,
                             const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                             int nt, int k, float clamp, const float *add, float *out) {
    if (nt <= 0 || k <= 0) {
        out_join();
        return;
    }
    check_matrix_type(gate->type, "moe_experts gate");
    check_matrix_type(down->type, "moe_experts down");
    if (up->type != gate->type) {
        ds4_fatal("moe_experts: gate and up weights must share a type");
    }
    if (nt <= MOE_DECODE_MAX_NT) {
        moe_decode(x, sel, wts, gate, up, down, nt, k, clamp, add, out);
        return;
    }
    out_join();                                 /* (shared_begin declines such batches) */
    const int64_t D = gate->ne[0], F = gate->ne[1], E = gate->ne[2];
    const int64_t pairs = (int64_t)nt * k;

    ds4_session *S = sess();
    const size_t rb_g = ds4_row_bytes(gate->type, D), rb_u = ds4_row_bytes(up->type, D);
    const size_t rb_d = ds4_row_bytes(down->type, F);
    const bool tc = gemm_tc_ok(gate->type, gate->dev, rb_g, D) && gemm_tc_ok(up->type, up->dev, rb_u, D) &&
                    gemm_tc_ok(down->type, down->dev, rb_d, F);
    /* the device tables: perm | pos | (the host's offsets) | the tensor-core engine's tiles,
     * at a 16-byte multiple from perm */
    const size_t tiles_at = (size_t)(2 * pairs + E + 1 + 3) & ~(size_t)3;
    int32_t *dperm, *dpos;
    int n_tiles = 0;
    if (tc && E <= MOE_GROUP_MAX_E && pairs >= (int64_t)MOE_GEMM_MIN_AVG * E) {
        /* grouped on the device: the grid covers the most tiles the pairs can make */
        n_tiles = (int)gemm_tc_max_tiles(pairs, E);
        dperm = (int32_t *)scratch_get(&S->moe_idx, (tiles_at + 4 * (size_t)n_tiles) * sizeof(int32_t));
        dpos = dperm + pairs;
        launch_moe_group(sel, pairs, (int)E, dperm, dpos, (int4 *)(dperm + tiles_at), n_tiles);
    } else {
        /* host tables (the session's pinned buffer): sel | perm (pairs grouped by expert) |
         * pos (pair -> row) | expert offsets | tiles */
        if ((size_t)(3 * pairs + E + 1) > S->host_idx_cap) {
            ds4_fatal("moe_experts: %lld (token, expert) pairs of %lld experts above the context's %zu entries",
                      (long long)pairs, (long long)E, S->host_idx_cap);
        }
        int32_t *hs = S->host_idx;
        int32_t *hperm = hs + pairs, *hpos = hs + 2 * pairs, *off = hs + 3 * pairs;
        /* NOTE(prefill): a prompt's routing is grouped by expert on the host when the device
         * does not group it: one ordered read and one wait per MoE layer of such a batch above
         * MOE_DECODE_MAX_NT tokens (never in a decode step) */
        DS4_CUDA_CHECK(cudaMemcpyAsync(hs, sel, (size_t)pairs * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                       ds4_current_stream()));
        stream_wait();
        for (int64_t e = 0; e <= E; e++) off[e] = 0;
        for (int64_t i = 0; i < pairs; i++) {
            if (hs[i] < 0 || hs[i] >= E) {
                ds4_fatal("moe_experts: expert id %d outside 0..%lld", hs[i], (long long)E - 1);
            }
            off[hs[i] + 1]++;
        }
        int64_t used = 0;
        for (int64_t e = 0; e < E; e++) { used += off[e + 1] > 0; off[e + 1] += off[e]; }
        if (pairs < (int64_t)MOE_GEMM_MIN_AVG * used) {
            /* too few tokens per expert for dequantization to pay */
            moe_decode(x, sel, wts, gate, up, down, nt, k, clamp, add, out);
            return;
        }
        for (int64_t i = 0; i < pairs; i++) {      /* stable: token order within an expert */
            const int32_t e = hs[i];
            const int32_t r = off[e]++;
            hperm[r] = (int32_t)i;
            hpos[i] = r;
        }
        for (int64_t e = E; e > 0; e--) off[e] = off[e - 1];   /* restore starts */
        off[0] = 0;
        if (tc) n_tiles = gemm_tc_tiles(off, (int)E, hperm + tiles_at);
        dperm = (int32_t *)scratch_get(&S->moe_idx, (tiles_at + 4 * (size_t)n_tiles) * sizeof(int32_t));
        dpos = dperm + pairs;
        /* the grouping goes back ordered on the stream; the pinned tables are not
         * written again before the next layer's wait, after this copy */
        DS4_CUDA_CHECK(cudaMemcpyAsync(dperm, hperm, (tc ? tiles_at + 4 * (size_t)n_tiles : (size_t)(2 * pairs)) *
                                       sizeof(int32_t), cudaMemcpyHostToDevice, ds4_current_stream()));
    }

    float *gu = (float *)scratch_get(&sess()->moe_gu, (size_t)(pairs * 2 * F) * sizeof(float));
    float *tmp = (float *)scratch_get(&sess()->moe_tmp, (size_t)(pairs * D) * sizeof(float));
    if (tc) {
        /* grouped launches over every expert's tiles (ds4_cuda_gemm.cu): gate and up in one
         * (two, if their types differ), then down.  The split of the gate|up input reads each
         * pair's token row itself (no gathered copy), the down projection's computes swiglu
         * itself (no h): the values the copies would have held */
        const int4 *dtiles = (const int4 *)(dperm + tiles_at);
        const tc_src gx = { x, NULL, D, dperm, k, 0.0f };
        const tc_split sx = gemm_tc_split_from(gx, D, pairs);
        const tc_seg gs[2] = { { (const uint8_t *)gate->dev, F, gu, 2 * F, 0 }, { (const uint8_t *)up->dev, F, gu + F, 2 * F, 0 } };
        if (gate->type == up->type) {
            gemm_tc_multi(gate->type, (size_t)F * rb_g, (int)E, rb_g, sx, 2, gs, dtiles, n_tiles);
        } else {
            gemm_tc_multi(gate->type, (size_t)F * rb_g, (int)E, rb_g, sx, 1, &gs[0], dtiles, n_tiles);
            gemm_tc_multi(up->type, (size_t)F * rb_u, (int)E, rb_u, sx, 1, &gs[1], dtiles, n_tiles);
        }
        const tc_src hx = { gu, gu + F, 2 * F, NULL, 1, clamp };
        const tc_split sh = gemm_tc_split_from(hx, F, pairs);
        const tc_seg ds = { (const uint8_t *)down->dev, D, tmp, D, 0 };
        gemm_tc_multi(down->type, (size_t)D * rb_d, (int)E, rb_d, sh, 1, &ds, dtiles, n_tiles);
        launch_moe_combine(tmp, dpos, wts, nt, k, D, add, out);
        return;
    }

    const int32_t *off = S->host_idx + 3 * pairs;     /* (types the engine does not take: grouped on the host) */
    float *xg = (float *)scratch_get(&sess()->moe_xg, (size_t)(pairs * D) * sizeof(float));
    float *h = (float *)scratch_get(&sess()->moe_h, (size_t)(pairs * F) * sizeof(float));
    launch_moe_gather(x, dperm, k, pairs, D, xg);
    const size_t gbytes = (size_t)F * rb_g, ubytes = (size_t)F * rb_u, dbytes = (size_t)D * rb_d;
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = off[e], cnt = off[e + 1] - off[e];
        if (cnt == 0) continue;
        gemm_rows(gate, (size_t)e * gbytes, 0, F, xg + r0 * D, D, gu + r0 * 2 * F, 2 * F, (int)cnt);
        gemm_rows(up, (size_t)e * ubytes, 0, F, xg + r0 * D, D, gu + r0 * 2 * F + F, 2 * F, (int)cnt);
    }
    launch_swiglu(gu, gu + F, h, pairs, F, 2 * F, F, clamp);
    for (int64_t e = 0; e < E; e++) {
        const int64_t r0 = off[e], cnt = off[e + 1] - off[e];
        if (cnt == 0) continue;
        gemm_rows(down, (size_t)e * dbytes, 0, D, h + r0 * F, F, tmp + r0 * D, D, (int)cnt);
    }
    launch_moe_combine(tmp, dpos, wts, nt, k, D, add, out);
}

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_moe(ds4_backend *b) {
    b->moe_route = cuda_moe_route;
    b->moe_gate = cuda_moe_gate;
    b->moe_experts = cuda_moe_experts;
    b->shared_begin = cuda_shared_begin;
    b->shared_end = cuda_shared_end;
    b->swiglu = cuda_swiglu;
}
