/* ds4_cuda_norm.cu -- the CUDA backend's small row ops: the embedding, RMSNorm, RoPE (and the
 * fused head_norm_rope), and the elementwise add and scale.  Each is one launch sized by its
 * rows; the CPU ops in ds4.c are the specification (tests/test_backend_ops.c).
 */

#include "ds4_cuda_common.cuh"

/* ---------------------------------------------------------------------------
 * Embedding
 *
 * One block per token: dequantize the token's row of token_embd (any weight
 * type) and write it into each of the n_hc residual streams.
 * ------------------------------------------------------------------------- */

__global__ void k_embed(const uint8_t *table, int type, size_t row_bytes, int64_t D,
                        const int32_t *tokens, int n_hc, float *x) {
    ds4_grid_dep();
    const int t = blockIdx.x;
    const uint8_t *row = table + (size_t)tokens[t] * row_bytes;
    float *xt = x + (int64_t)t * n_hc * D;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
        const float v = weight_elem(type, row, i);
        for (int s = 0; s < n_hc; s++) xt[s * D + i] = v;
    }
}

static void launch_embed(const ds4_weight *w, const int32_t *tokens, int nt, int n_hc, float *x) {
    if (nt <= 0) return;
    const int64_t D = w->ne[0];
    DS4_LAUNCH(k_embed, nt, 256, 0, (const uint8_t *)w->dev, w->type,
               ds4_row_bytes(w->type, D), D, tokens, n_hc, x);
}

static void cuda_embed(const ds4_weight *w, const int32_t *tokens, int nt, int n_hc, float *x) {
    launch_embed(w, tokens, nt, n_hc, x);
}

/* ---------------------------------------------------------------------------
 * RMSNorm
 *
 * One block per row (1024 threads for wide rows, which at decode are a single
 * row and so a single block: its loads must all be in flight together).
 * Squares are summed in double (as the CPU op and ggml do) through a
 * fixed-shape block reduction; each thread keeps its first RMS_PER elements
 * in registers for the scaling pass (as float4 when everything is aligned).  All reads of x (but the tail beyond
 * RMS_PER per thread, which each thread rereads just before writing it)
 * happen before the barrier, so y == x is safe.
 * ------------------------------------------------------------------------- */

#define RMS_PER 16   /* elements per thread kept in registers between the passes */

/* VEC: rows, x, y and w are 16-byte aligned, so the cached elements move as
 * float4 (four times fewer load/store instructions: a decode row is a single
 * block, and its issue rate is the limit). */
template <int THREADS, bool VEC>
__global__ void __launch_bounds__(THREADS) k_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps,
                                                     emit_rows er) {
    ds4_grid_dep();
    __shared__ double part[THREADS / 32];
    int first;
    if ((int)blockIdx.x >= emit_span(er, gridDim.x, &first)) return;
    const float *xr = x + ((int64_t)first + blockIdx.x) * n;
    float *yr = y + ((int64_t)first + blockIdx.x) * n;
    constexpr int STEP = VEC ? 4 : 1;
    constexpr int NV = RMS_PER / STEP;
    /* element i of vector j of thread tid: (j * THREADS + tid) * STEP + i */
    float v[RMS_PER];
#pragma unroll
    for (int j = 0; j < NV; j++) {               /* all loads in flight at once */
        const int64_t e = ((int64_t)j * THREADS + threadIdx.x) * STEP;
        if (VEC) {
            const float4 q = e < n ? *(const float4 *)(xr + e) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[4 * j] = q.x; v[4 * j + 1] = q.y; v[4 * j + 2] = q.z; v[4 * j + 3] = q.w;
        } else {
            v[j] = e < n ? xr[e] : 0.0f;
        }
    }
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < RMS_PER; j++) ss += (double)(v[j] * v[j]);
    const int64_t cached = (int64_t)RMS_PER * THREADS;
    for (int64_t i = cached + threadIdx.x; i < n; i += THREADS) {
        const float u = xr[i];
        ss += (double)(u * u);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();                            /* every read of x is done: y == x is safe */
    double tot = 0.0;
    for (int i = 0; i < THREADS / 32; i++) tot += part[i];
    const float scale = 1.0f / sqrtf((float)(tot / (double)n) + eps);
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const int64_t e = ((int64_t)j * THREADS + threadIdx.x) * STEP;
        if (e >= n) continue;
        if (VEC) {
            float4 q = make_float4(v[4 * j] * scale, v[4 * j + 1] * scale, v[4 * j + 2] * scale, v[4 * j + 3] * scale);
            if (w) {
                const float4 g = *(const float4 *)(w + e);
                q.x *= g.x; q.y *= g.y; q.z *= g.z; q.w *= g.w;
            }
            *(float4 *)(yr + e) = q;
        } else {
            yr[e] = w ? v[j] * scale * w[e] : v[j] * scale;
        }
    }
    for (int64_t i = cached + threadIdx.x; i < n; i += THREADS) {
        const float u = xr[i] * scale;
        yr[i] = w ? u * w[i] : u;
    }
}

/* rows: the rows to normalise, or with er.step the most a step can emit
 * (the row offset w0*n keeps the float4 alignment of x and y when n % 4 == 0). */
void launch_rmsnorm_rows(const float *x, const float *w, float *y, int rows, int n, float eps, emit_rows er) {
    if (rows <= 0 || n <= 0) return;
    const bool vec = n % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)w % 16 == 0;
    if (n >= 4096) {
        if (vec) DS4_LAUNCH(k_rmsnorm<1024, true>, rows, 1024, 0, x, w, y, n, eps, er);
        else DS4_LAUNCH(k_rmsnorm<1024, false>, rows, 1024, 0, x, w, y, n, eps, er);
    } else {
        if (vec) DS4_LAUNCH(k_rmsnorm<256, true>, rows, 256, 0, x, w, y, n, eps, er);
        else DS4_LAUNCH(k_rmsnorm<256, false>, rows, 256, 0, x, w, y, n, eps, er);
    }
}

void launch_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps) {
    launch_rmsnorm_rows(x, w, y, rows, n, eps, no_emit());
}

void cuda_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps) {
    launch_rmsnorm(x, w, y, rows, n, eps);
}

/* ---------------------------------------------------------------------------
 * RoPE
 *
 * One thread per (token, head, pair).  The angle is built exactly as the CPU
 * op builds it: te starts at (float)p and is multiplied by theta_scale once
 * per pair (so pair i repeats the i multiplications), and the YaRN blend uses
 * explicitly rounded products so the compiler cannot fuse them into an FMA
 * the CPU does not do.  theta_scale itself comes from the host's powf.
 * ------------------------------------------------------------------------- */

/* Rotation of rows at positions pos0 + t*pos_step (pos0 from the step block),
 * or, for emitted compressor rows (er.step), of row w0 + t at position
 * (w0 + t)*ratio. */
__global__ void k_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, emit_rows er,
                       rope_args r, int inverse) {
    ds4_grid_dep();
    const int half = r.n_rot / 2;
    int first;
    const int rows = emit_span(er, nt, &first);
    const int p0 = er.step ? first * er.ratio : step->pos0;
    const int64_t n = (int64_t)(rows < nt ? rows : nt) * nh * half;
    x += (int64_t)first * nh * dh;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const int64_t th = idx / half;          /* t * nh + head */
        const int t = (int)(th / nh);
        rope_pair(x + th * dh + (dh - r.n_rot) + 2 * i, r, p0 + t * pos_step, i, inverse);
    }
}

void launch_rope_rows(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, emit_rows er,
                      const ds4_rope *rp, int inverse) {
    if (nt <= 0 || nh <= 0 || rp->n_rot <= 0) return;
    const rope_args r = rope_args_of(rp);
    const int64_t n = (int64_t)nt * nh * (rp->n_rot / 2);
    DS4_LAUNCH(k_rope, grid_for(n), 256, 0, x, nt, nh, dh, step, pos_step, er, r, inverse);
}

void launch_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                 int inverse) {
    launch_rope_rows(x, nt, nh, dh, step, pos_step, no_emit(), rp, inverse);
}

static void cuda_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                      int inverse) {
    launch_rope(x, nt, nh, dh, step, pos_step, rp, inverse);
}

/* head_norm_rope: one block per (token, head) row: the row's RMSNorm (squares
 * in double, a fixed-shape reduction) and then RoPE of its last n_rot dims,
 * with the row held in shared memory between the two.  The rows of the
 * second tensor (a layer's key/value row beside its queries) follow in the
 * same grid: one launch instead of two (a launch of this size costs ~3.5 us
 * on an H200, 43 times per Flash token). */
#define HNR_THREADS 128
#define HNR_MAX_DH  4096

__global__ void __launch_bounds__(HNR_THREADS) k_head_norm_rope(float *x, const float *w, int nh, float *x2,
                                                               const float *w2, int nh2, int nt, int dh,
                                                               float eps, const ds4_step *step, rope_args r) {
    ds4_grid_dep();
    extern __shared__ float row_s[];
    __shared__ double red[HNR_THREADS / 32];
    const int pos0 = step->pos0;    /* read first: its latency hides behind the row's loads */
    /* blocks [0, nt*nh): rows of x; the next nt*nh2: rows of x2 */
    int64_t row = blockIdx.x;
    int t;
    if (row >= (int64_t)nt * nh) {
        row -= (int64_t)nt * nh;
        t = (int)(row / nh2);
        x = x2;
        w = w2;
    } else {
        t = (int)(row / nh);
    }
    float *xr = x + row * dh;
    double ss = 0.0;
    for (int i = threadIdx.x; i < dh; i += HNR_THREADS) {
        const float v = xr[i];
        row_s[i] = v;
        ss += (double)(v * v);
    }
    block_norm_rope<HNR_THREADS>(row_s, dh, w, eps, ss, red, r, pos0 + t);
    for (int i = threadIdx.x; i < dh; i += HNR_THREADS) xr[i] = row_s[i];
}

static void launch_head_norm_rope(float *x, const float *w, int nt, int nh, float *x2, const float *w2, int nh2,
                                  int dh, float eps, const ds4_step *step, const ds4_rope *rp) {
    if (nh2 < 0 || !x2) nh2 = 0;
    if (nt <= 0 || nh < 0 || nh + nh2 <= 0 || dh <= 0) return;
    if (dh > HNR_MAX_DH || rp->n_rot > dh) {
        ds4_fatal("head_norm_rope: head width %d (rope %d) outside 1..%d", dh, rp->n_rot, HNR_MAX_DH);
    }
    DS4_LAUNCH(k_head_norm_rope, (unsigned)((int64_t)nt * (nh + nh2)), HNR_THREADS, (size_t)dh * sizeof(float),
               x, w, nh, x2, w2, nh2, nt, dh, eps, step, rope_args_of(rp));
}

static void cuda_head_norm_rope(float *x, const float *w, int nt, int nh, float *x2, const float *w2, int nh2,
                                int dh, float eps, const ds4_step *step, const ds4_rope *rp) {
    launch_head_norm_rope(x, w, nt, nh, x2, w2, nh2, dh, eps, step, rp);
}

/* ---------------------------------------------------------------------------
 * Elementwise
 * ------------------------------------------------------------------------- */

__global__ void k_add(const float *a, const float *b, float *y, int64_t n) {
    ds4_grid_dep();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

static void launch_add(const float *a, const float *b, float *y, int64_t n) {
    if (n <= 0) return;
    DS4_LAUNCH(k_add, grid_for(n), 256, 0, a, b, y, n);
}

static void cuda_add(const float *a, const float *b, float *y, int64_t n) {
    launch_add(a, b, y, n);
}

__global__ void k_scale(float *x, float s, int64_t n) {
    ds4_grid_dep();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= s;
}

static void launch_scale(float *x, float s, int64_t n) {
    if (n <= 0) return;
    DS4_LAUNCH(k_scale, grid_for(n), 256, 0, x, s, n);
}

static void cuda_scale(float *x, float s, int64_t n) {
    launch_scale(x, s, n);
}

/* y[r] = a[r / rep], b[r]: a block per row of y, its 2 n elements (ds4_gpu.h pair_rows). */
__global__ void k_pair_rows(const float *a, const float *b, float *y, int rep, int64_t n) {
    ds4_grid_dep();
    const int r = blockIdx.x;
    const float *ar = a + (int64_t)(r / rep) * n, *br = b + (int64_t)r * n;
    float *yr = y + (int64_t)r * 2 * n;
    for (int64_t i = threadIdx.x; i < 2 * n; i += blockDim.x) yr[i] = i < n ? ar[i] : br[i - n];
}

static void launch_pair_rows(const float *a, const float *b, float *y, int rows, int rep, int64_t n) {
    if (rows <= 0 || n <= 0) return;
    if (rep < 1) ds4_fatal("pair_rows: rep %d below 1", rep);
    DS4_LAUNCH(k_pair_rows, (unsigned)rows, 256, 0, a, b, y, rep, n);
}

static void cuda_pair_rows(const float *a, const float *b, float *y, int rows, int rep, int64_t n) {
    launch_pair_rows(a, b, y, rows, rep, n);
}

/* Its entries in the backend table (ds4_cuda.cu). */
void ds4_cuda_ops_norm(ds4_backend *b) {
    b->embed = cuda_embed;
    b->rmsnorm = cuda_rmsnorm;
    b->rope = cuda_rope;
    b->head_norm_rope = cuda_head_norm_rope;
    b->add = cuda_add;
    b->scale = cuda_scale;
    b->pair_rows = cuda_pair_rows;
}
