/* ds4_cuda.cu -- the CUDA backend of ds4.
 *
 * What it is.  A complete implementation of the backend contract in
 * ds4_gpu.h for NVIDIA GPUs: device memory, weight upload, and every op the
 * forward pass calls, computed in f32 on weights stored exactly as the GGUF
 * file stores them (F32, F16, BF16, Q8_0; I32 for the hash-routing table;
 * the routed experts' Q2_K, Q4_K and IQ2_XXS, whose kernels live in
 * ds4_cuda_quant.cuh and ds4_cuda_matvec_q.cuh).
 * The CPU backend in ds4.c is the specification; tests/test_backend_ops.c
 * runs both side by side and states the tolerance of every op.
 *
 * Where the time goes, and how the file answers it.  Decoding a token reads
 * every active weight once, so decode speed is memory bandwidth: the
 * matrix-vector kernels (and the MoE kernels built on them) are written to
 * stream Q8_0 rows at close to the copy bandwidth of the device, with the
 * activation slice of each warp held in registers and the weight rows staged
 * through shared memory by asynchronous copies.  Prefill has many tokens per
 * weight, so it dequantizes weights to f32 and hands the products to cuBLAS
 * (f32 arithmetic, no TF32).  Everything else (norms, RoPE, mHC, attention,
 * the indexer, routing) is small next to the weights, but at decode each of
 * those kernels costs a few microseconds of latency, and a layer run op by op
 * takes about 45 of them.  So the contract has fused ops (ds4_gpu.h: hc_pre, matmul_multi,
 * head_norm_rope, matmul_swiglu, attention_step, compressor_step(s),
 * indexer_step, moe_gate),
 * each defined as a composition of plain ops, which this file runs as fewer
 * kernels at decode (~18 per layer) and as the composition where fusing does
 * not pay.  The mHC projection (24 rows of 16384 floats) is spread over
 * K instead of rows (split-K; the last block to finish, counted by an
 * integer counter, reduces the partials in a fixed order and finishes the
 * step).
 *
 * Streams and sessions (stages 0 and 1 of patches/series).  Every kernel
 * launch, memset, copy, cuBLAS call and event record goes to
 * ds4_current_stream() (ds4_stream.h); scripts/check_streams.py keeps it
 * that way.  Each context owns a session (ds4_gpu.h): a non-blocking stream,
 * which becomes the thread's current stream while the session is bound, a
 * cuBLAS handle with a fixed workspace, and every scratch buffer, sized from
 * the context's limits when it is made.  A decode step is therefore
 * replayable: no op allocates, frees or waits; the position is read from the
 * step block when a kernel runs, never passed by value, so each kernel's
 * grid is sized for the most a step of that shape can need (blocks with
 * nothing to do return at once) and a compressor's emit work runs or not on
 * the device; the launches of a step -- kernels, grids and argument bytes --
 * are the same at every position (DS4_LAUNCH_TRACE records them and
 * tests/test_gpu.py compares them).  The step's inputs go up through pinned
 * staging, its logits come down the same way, and that download is the one
 * wait of the step.  Kernel attributes and occupancies are settled at init.
 * A prompt's MoE layers still read the routing back to group tokens by
 * expert (one ordered read and wait per layer, never in a decode step).
 * Each kernel has exactly one launcher (a static host function that sizes
 * the grid), and every launch goes through DS4_LAUNCH, whose
 * ds4_launch_kernel holds the file's only `<<<>>>`.
 *
 * Graphs (stage 2).  With DS4_CUDA_GRAPHS=1 the core brackets a decode step
 * (or clusters of layers) as regions; the session records each region once
 * as a CUDA graph on its stream and replays it on every later step
 * (region_begin/region_end, in the Sessions banner): a capture is checked
 * node for node against the launches the region issued, and any failure
 * leaves that region eager for good (fail closed).
 *
 * Hooks (stage 3).  ds4_hooks.cu's emitter records activations inside the
 * same regions: producer kernels on a side stream copy them into device rings,
 * and a drain thread streams the rings to the host while the graphs replay.
 *
 * Determinism.  Same inputs give byte-identical outputs run to run: no
 * floating-point atomics, every reduction has a fixed shape (warp butterflies,
 * fixed trees, fixed-order sums of per-slice or per-expert partials), and
 * cuBLAS runs with atomics disallowed on one handle and one stream.
 *
 * Files, in pipeline order (each op family's kernels and launchers together, one
 * translation unit each, sharing ds4_cuda_common.cuh: the launch path, device helpers,
 * device and session state, and the launchers one family calls in another):
 *   ds4_cuda.cu             this entry point: the stream stack, the device (cuda_init),
 *                           counted allocations, waits and copies, weight upload, sessions
 *                           (every scratch sized), recorded regions (CUDA graphs), the table
 *   ds4_cuda_norm.cu        embedding, RMSNorm, RoPE and head_norm_rope, add and scale
 *   ds4_cuda_mhc.cu         hc_mix (Sinkhorn), hc_post, hc_pre (split-K, one launch)
 *   ds4_cuda_matmul.cu      decode matvec (multi-matrix, normed input), generic matvec,
 *                           prefill cuBLAS, matmul_multi, matmul_swiglu; the super-block
 *                           types' k_matvec_q in ds4_cuda_matvec_q.cuh, their element
 *                           decoders in ds4_cuda_quant.cuh
 *   ds4_cuda_gemm.cu        prefill products of Q8_0 and F16 weights on tensor cores
 *                           (dense and grouped by expert), exact products, f32 sums
 *   ds4_cuda_attn.cu        window + compressed rows, split-row combine (ring store and
 *                           de-rotation for attention_step), ring store, attention_probs
 *                           (ds4_cuda_probs.cuh)
 *   ds4_cuda_compressor.cu  ape bias (add_cyclic), gated pooling, compressor_step(s)
 *   ds4_cuda_indexer.cu     scores, exact top-k, indexer_step
 *   ds4_cuda_moe.cu         routing (with the router: moe_gate), SwiGLU, experts (decode
 *                           and prefill)
 *   ds4_hooks.cu            the hook emitter: device rings, producers, drain thread
 * Each family file ends with its entries in the backend table (ds4_cuda_ops_*), which
 * make_cuda_backend at the end of this file gathers with its own and the hook emitter's.
 */
#include "ds4_cuda_common.cuh"

/* The process-wide counters, the device, the bound session (ds4_cuda_common.cuh). */
std::atomic<uint64_t> g_n_malloc, g_n_free, g_n_dev_sync, g_n_stream_sync;
std::atomic<uint64_t> g_n_hook_sync;
ds4_cuda_device g_cuda;
thread_local ds4_session *g_sess;

/* ds4_stream.h: the calling thread's stack of stream overrides (empty: stream 0). */
static thread_local cudaStream_t g_stream_stack[DS4_STREAM_DEPTH];
static thread_local int g_stream_depth;

extern "C" cudaStream_t ds4_current_stream(void) {
    return g_stream_depth > 0 ? g_stream_stack[g_stream_depth - 1] : (cudaStream_t)0;
}

extern "C" int ds4_stream_push(cudaStream_t s) {
    if (g_stream_depth >= DS4_STREAM_DEPTH) return -1;
    g_stream_stack[g_stream_depth++] = s;
    return 0;
}

extern "C" void ds4_stream_pop(void) {
    if (g_stream_depth > 0) g_stream_depth--;
}

/* ---------------------------------------------------------------------------
 * Backend state, sessions and lifetime
 *
 * One device (0), whose properties, kernel attributes and occupancies are
 * settled once by cuda_init.  Everything per context is a session
 * (ds4_gpu.h): a non-blocking stream, a cuBLAS handle with a fixed
 * workspace, the counters of the kernels that count their own blocks,
 * scratch buffers sized from the context's limits when the session is made
 * (session_new, in the Sessions banner, by the sizes ds4_cuda_common.cuh states),
 * pinned staging for the step's copies, and the launch counters.  A thread
 * binds a session (session_bind), which also makes its stream the thread's
 * current stream (ds4_stream.h), so every launch, copy and wait of an op goes
 * to the context's stream.  Nothing inside an op allocates, frees or waits:
 * scratch_get only checks the size it was given at session creation, and
 * the wrappers below count every allocation, free and wait the backend
 * makes (ds4_backend_stats), so a run can show there were none.
 * ------------------------------------------------------------------------- */

/* One line per launch: source line of the DS4_LAUNCH, kernel address, grid,
 * block, shared memory and every argument byte in hex.  Two steps that
 * launch the same line sequence replay the same work. */
void sess_trace_launch(int line, const void *fn, dim3 grid, dim3 block, size_t smem,
                       const unsigned char *args, size_t n_args) {
    FILE *f = g_sess->trace;
    fprintf(f, "launch L%d %p grid=%u,%u,%u block=%u,%u,%u smem=%zu args=", line, fn, grid.x, grid.y, grid.z,
            block.x, block.y, block.z, smem);
    const size_t n = n_args < 4096 ? n_args : 4096;
    for (size_t i = 0; i < n; i++) fprintf(f, "%02x", args[i]);
    fprintf(f, n < n_args ? " (+%zu bytes not shown)\n" : "\n", n_args - n);
    g_sess->trace_launches++;
}

static void sess_trace_line(const char *what, size_t bytes) {
    if (g_sess && g_sess->trace) fprintf(g_sess->trace, "%s %zu\n", what, bytes);
}

/* Size check only: every scratch was allocated when the session was made. */
void *scratch_get(scratch_t *s, size_t bytes) {
    if (bytes > s->cap) {
        ds4_fatal("%s need %zu bytes, the context was sized for %zu (ds4_limits too small)",
                  s->what, bytes, s->cap);
    }
    return s->p;
}

/* The counted allocations, frees and waits. */
cudaError_t dev_malloc(void **p, size_t bytes) {
    g_n_malloc++;
    return cudaMalloc(p, bytes);
}
void dev_free(void *p) {
    if (!p) return;
    g_n_free++;
    DS4_CUDA_CHECK(cudaFree(p));
}
cudaError_t host_alloc(void **p, size_t bytes) {
    g_n_malloc++;
    return cudaHostAlloc(p, bytes, cudaHostAllocDefault);
}
void host_free(void *p) {
    if (!p) return;
    g_n_free++;
    DS4_CUDA_CHECK(cudaFreeHost(p));
}
/* The current stream's work is done; the session's upload staging is free again. */
void stream_wait(void) {
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(step result) */
    if (g_sess) g_sess->up_used = 0;
    sess_trace_line("wait", 0);
}

/* Every kernel attribute and occupancy, settled once at init. */
static void ops_setup(void) {
    matmul_setup();
    gemm_tc_setup();
    attention_setup();
    indexer_setup();
}

__global__ void k_probe(void) { ds4_grid_dep(); }

static int cuda_init(void) {
    if (g_cuda.ready) return 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        /* no driver (cudaErrorInsufficientDriver) and no device (cudaErrorNoDevice) both mean the same to a user */
        fprintf(stderr, "ds4: no CUDA GPU found (the CUDA runtime says: %s); run on a machine with an NVIDIA GPU "
                "and its driver, or use --backend cpu\n", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        (void)cudaGetLastError();
        return -1;
    }
    e = cudaSetDevice(0);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: no CUDA device available: %s\n", cudaGetErrorString(e));
        return -1;
    }
    cudaDeviceProp prop;
    DS4_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    /* A build without machine code for this GPU fails at the first launch;
     * say so here, with the fix, instead. */
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, k_probe);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: this build has no kernels for %s (sm_%d%d): rebuild with CUDA_ARCH=sm_%d%d (%s)\n",
                prop.name, prop.major, prop.minor, prop.major, prop.minor, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return -1;
    }
    g_cuda.n_sm = prop.multiProcessorCount;
    g_cuda.max_grid_yz = prop.maxGridSize[1] < prop.maxGridSize[2] ? prop.maxGridSize[1] : prop.maxGridSize[2];
    g_cuda.cc_major = prop.major;
    g_cuda.smem_optin = prop.sharedMemPerBlockOptin;
    ops_setup();
    fprintf(stderr, "ds4: CUDA device 0: %s (sm_%d%d, %d SMs, %.1f GiB)\n", prop.name,
            prop.major, prop.minor, prop.multiProcessorCount,
            (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    g_cuda.ready = 1;
    return 0;
}

/* Zero-filled, and finished before it returns: buffers are made when a
 * context is, never inside a step, and the context's stream must not race
 * the fill. */
static void *cuda_alloc(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 16;
    cudaError_t e = dev_malloc(&p, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cudaMalloc of %zu bytes failed: %s\n", bytes, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return NULL;
    }
    DS4_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ds4_current_stream()));
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(load time) */
    return p;
}

static void cuda_free(void *p) {
    dev_free(p);
}

/* Uploads are ordered on the current stream.  The step's small ones (the
 * step block, the tokens) are copied into the session's pinned staging and
 * go up asynchronously; anything that does not fit (a test's inputs, a
 * prompt larger than the staging) is copied and waited for. */
static void cuda_upload(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return;
    ds4_session *S = g_sess;
    sess_trace_line("upload", bytes);
    if (S && S->up_used + bytes <= S->up_cap) {
        unsigned char *st = S->up_stage + S->up_used;
        S->up_used += (bytes + 15) & ~(size_t)15;
        memcpy(st, src, bytes);
        DS4_CUDA_CHECK(cudaMemcpyAsync(dst, st, bytes, cudaMemcpyHostToDevice, ds4_current_stream()));
        return;
    }
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ds4_current_stream()));
    stream_wait();
}

/* The one wait of a step: after every op issued before it, the bytes come
 * down and are in dst on return.  Small results go through the session's
 * pinned staging.  A larger one (a row of logits is 517 KB on Flash) is
 * copied straight into dst: for pageable memory the driver stages it in
 * pieces and overlaps the DMA with its own copy out, where the pinned
 * staging would add a full host copy after the DMA (DOWN_STAGE_MAX). */
#define DOWN_STAGE_MAX ((size_t)64 << 10)
static void cuda_download(void *dst, const void *src, size_t bytes) {
    ds4_session *S = g_sess;
    sess_trace_line("download", bytes);
    if (S && bytes <= S->down_cap) {
        DS4_CUDA_CHECK(cudaMemcpyAsync(S->down_stage, src, bytes, cudaMemcpyDeviceToHost, ds4_current_stream()));
        stream_wait();
        memcpy(dst, S->down_stage, bytes);
        return;
    }
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ds4_current_stream()));
    stream_wait();
}

static void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return;
    DS4_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ds4_current_stream()));
    if (g_sess && g_sess->capturing) g_sess->cap_other++;    /* a recorded copy is a node */
}

/* Weights keep the file's byte layout (Q8_0 rows of 34-byte blocks included);
 * the kernels below read that layout directly. */
static int cuda_upload_weight(ds4_weight *w) {
    if (!type_supported(w->type) && w->type != DS4_TYPE_I32) {
        fprintf(stderr, "ds4: the CUDA backend has no kernels for weight type %d (tensor %s); use --backend cpu\n",
                w->type, w->name ? w->name : "?");
        return -1;
    }
    void *p = NULL;
    cudaError_t e = dev_malloc(&p, w->nbytes ? w->nbytes : 16);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cannot upload weight %s (%zu bytes): %s\n",
                w->name ? w->name : "?", w->nbytes, cudaGetErrorString(e));
        (void)cudaGetLastError();
        return -1;
    }
    /* NOTE(load time): weights go up once, before any step; the copy is
     * complete when cudaMemcpy returns only up to the driver's staging, so
     * session_new waits for the device before a context's stream runs */
    if (w->nbytes) DS4_CUDA_CHECK(cudaMemcpy(p, w->host, w->nbytes, cudaMemcpyHostToDevice));
    w->dev = p;
    return 0;
}

static void cuda_release_weight(ds4_weight *w) {
    dev_free(w->dev);
    w->dev = NULL;
}

static void cuda_synchronize(void) {
    stream_wait();
}

/* ---------------------------------------------------------------------------
 * Sessions
 *
 * session_new sizes each scratch from the context's limits with the same
 * rules the ops use to ask for it (named next to each), so an op never finds
 * its buffer short; allocates the stream, the cuBLAS handle and workspace,
 * the block counters and the pinned staging; and waits once for the device
 * (the weights' copies, the zero fills) before the stream is used.
 * ------------------------------------------------------------------------- */


/* ---- recorded regions: CUDA graphs (stage 2 of patches/series) ----
 *
 * region_begin(key) replays the key's graph on the session's stream, or
 * starts a capture of the ops the core then issues (cudaStreamBeginCapture,
 * thread-local mode); region_end(key) ends it, checks it and instantiates
 * and launches the graph (a capture records the work, it does not run it).
 * With graphs on, the session's stream is a blocking one, so that a stray
 * operation on the legacy stream during a capture fails loudly instead of
 * running once outside the graph.  A capture counts as good only when no
 * launch failed, capture and instantiation succeeded, and the graph holds
 * exactly one node per launch the region issued (cudaGraphGetNodes: a
 * launch missing from the graph would be missing from every replay).  Any
 * failure -- or DS4_CUDA_GRAPH_FAIL's injected one -- clears the error, keeps
 * the key as dead (it runs eagerly from then on; the first failure prints one
 * line) and answers DS4_REGION_REISSUE: the region's ops were recorded, not
 * run, so the core issues them again.  The cache holds at most graph_cache
 * keys, the least recently used evicted first. */
struct region {
    uint64_t        key;
    cudaGraphExec_t exec;       /* NULL: the key is dead (its recording failed) */
    uint64_t        nodes, bytes, last_use;
};

static void region_drop(ds4_session *S, int i) {
    struct region *r = &S->reg[i];
    if (r->exec) {
        DS4_CUDA_CHECK(cudaGraphExecDestroy(r->exec));
        S->gs.graphs--;
        S->gs.graph_nodes -= r->nodes;
        S->gs.graph_bytes -= r->bytes;
    }
    S->reg[i] = S->reg[--S->n_reg];
}

static struct region *region_find(ds4_session *S, uint64_t key) {
    for (int i = 0; i < S->n_reg; i++)
        if (S->reg[i].key == key) return &S->reg[i];
    return NULL;
}

/* A new entry for key (the least recently used one makes room when the cache is full). */
static struct region *region_add(ds4_session *S, uint64_t key) {
    if (S->n_reg >= S->lim.graph_cache) {
        int lru = 0;
        for (int i = 1; i < S->n_reg; i++)
            if (S->reg[i].last_use < S->reg[lru].last_use) lru = i;
        region_drop(S, lru);
    }
    struct region *r = &S->reg[S->n_reg++];
    memset(r, 0, sizeof *r);
    r->key = key;
    r->last_use = ++S->reg_clock;
    return r;
}

static void region_dead(ds4_session *S, uint64_t key, const char *what, const char *why) {
    struct region *r = region_find(S, key);
    if (!r) r = region_add(S, key);
    if (r->exec) {
        DS4_CUDA_CHECK(cudaGraphExecDestroy(r->exec));
        S->gs.graphs--;
        S->gs.graph_nodes -= r->nodes;
        S->gs.graph_bytes -= r->bytes;
        r->exec = NULL;
    }
    static std::atomic<int> said;
    if (said++ == 0)
        fprintf(stderr, "ds4: CUDA graph %s of region %llx failed (%s): it runs eagerly from now on "
                "(fallbacks are counted in --stats)\n", what, (unsigned long long)key, why);
    S->gs.fallbacks++;
}

static int cuda_region_begin(uint64_t key) {
    ds4_session *S = g_sess;
    if (!S || !S->lim.graphs) return DS4_REGION_ISSUE;
    if (S->capturing) {
        ds4_fatal("region_begin(%llx) inside the recording of %llx", (unsigned long long)key,
                  (unsigned long long)S->cap_key);
    }
    struct region *r = region_find(S, key);
    if (r) {
        r->last_use = ++S->reg_clock;
        if (!r->exec) {
            S->gs.fallbacks++;
            return DS4_REGION_ISSUE;
        }
        const cudaError_t e = cudaGraphLaunch(r->exec, ds4_current_stream());
        if (e == cudaSuccess) {
            S->gs.replays++;
            sess_trace_line("replay", (size_t)r->nodes);
            return DS4_REGION_REPLAYED;
        }
        (void)cudaGetLastError();
        region_dead(S, key, "launch", cudaGetErrorName(e));
        return DS4_REGION_ISSUE;
    }
    const cudaError_t e = cudaStreamBeginCapture(ds4_current_stream(), cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        region_dead(S, key, "capture", cudaGetErrorName(e));
        return DS4_REGION_ISSUE;
    }
    S->capturing = true;
    S->cap_key = key;
    S->cap_launches0 = S->launches;
    S->cap_other = 0;
    S->cap_err = cudaSuccess;
    S->cap_t0 = ds4_now();
    return DS4_REGION_ISSUE;
}

static int cuda_region_end(uint64_t key) {
    ds4_session *S = g_sess;
    if (!S || !S->lim.graphs || !S->capturing) return 0;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(ds4_current_stream(), &g);
    S->capturing = false;
    const double t1 = ds4_now();
    const uint64_t launched = S->launches - S->cap_launches0 + (uint64_t)S->cap_other;   /* and the copies */
    char why[160] = "";
    S->n_captures_tried++;
    size_t n_nodes = 0;
    if (key != S->cap_key)
        snprintf(why, sizeof why, "region_end(%llx) ends the recording of %llx", (unsigned long long)key,
                 (unsigned long long)S->cap_key);
    else if (S->cap_err != cudaSuccess)
        snprintf(why, sizeof why, "a launch failed: %s", cudaGetErrorName(S->cap_err));
    else if (e != cudaSuccess || !g)
        snprintf(why, sizeof why, "%s", cudaGetErrorName(e));
    else if (S->lim.graph_fail == S->n_captures_tried)
        snprintf(why, sizeof why, "injected by DS4_CUDA_GRAPH_FAIL=%d", S->lim.graph_fail);
    else if ((e = cudaGraphGetNodes(g, NULL, &n_nodes)) != cudaSuccess)
        snprintf(why, sizeof why, "%s", cudaGetErrorName(e));
    else if ((uint64_t)n_nodes != launched)
        snprintf(why, sizeof why, "the graph has %zu nodes for %llu launches", n_nodes, (unsigned long long)launched);
    cudaGraphExec_t exec = NULL;
    size_t bytes = 0;
    if (!why[0]) {
        size_t f0 = 0, f1 = 0, total = 0;
        DS4_CUDA_CHECK(cudaMemGetInfo(&f0, &total));
#if CUDART_VERSION >= 12000
        e = cudaGraphInstantiate(&exec, g, 0);
#else
        e = cudaGraphInstantiate(&exec, g, NULL, NULL, 0);   /* CUDA 11's signature */
#endif
        DS4_CUDA_CHECK(cudaMemGetInfo(&f1, &total));
        bytes = f0 > f1 ? f0 - f1 : 0;
        if (e != cudaSuccess) {
            snprintf(why, sizeof why, "instantiate: %s", cudaGetErrorName(e));
            exec = NULL;
        }
    }
    const double t2 = ds4_now();
    if (g) DS4_CUDA_CHECK(cudaGraphDestroy(g));
    if (!why[0] && (e = cudaGraphLaunch(exec, ds4_current_stream())) != cudaSuccess)
        snprintf(why, sizeof why, "launch: %s", cudaGetErrorName(e));
    if (why[0]) {
        (void)cudaGetLastError();
        if (exec) DS4_CUDA_CHECK(cudaGraphExecDestroy(exec));
        region_dead(S, key, "recording", why);
        return DS4_REGION_REISSUE;
    }
    struct region *r = region_add(S, key);
    r->exec = exec;
    r->nodes = n_nodes;
    r->bytes = bytes;
    S->gs.captures++;
    S->gs.graphs++;
    S->gs.graph_nodes += n_nodes;
    S->gs.graph_bytes += bytes;
    S->gs.capture_ms += (t1 - S->cap_t0) * 1e3;
    S->gs.instantiate_ms += (t2 - t1) * 1e3;
    sess_trace_line("capture", n_nodes);
    return 0;
}

/* ---- side streams (ds4_side, ds4_cuda_common.cuh) ---- */

cudaError_t ds4_side_open(ds4_side *d, const char *who) {
    memset(d, 0, sizeof *d);
    d->who = who;
    cudaError_t e = cudaStreamCreateWithFlags(&d->s, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d->fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d->join, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        ds4_side_close(d);
    }
    return e;
}

void ds4_side_close(ds4_side *d) {
    if (d->fork) DS4_CUDA_CHECK(cudaEventDestroy(d->fork));
    if (d->join) DS4_CUDA_CHECK(cudaEventDestroy(d->join));
    if (d->s) DS4_CUDA_CHECK(cudaStreamDestroy(d->s));
    d->fork = d->join = NULL;
    d->s = NULL;
}

static void side_event(const ds4_side *d, cudaError_t e, const char *what, int line) {
    if (e != cudaSuccess && !(g_sess && g_sess->capturing)) {
        ds4_fatal("CUDA error %s (%s) in %s's %s at %s:%d", cudaGetErrorName(e), cudaGetErrorString(e), d->who, what,
                  __FILE__, line);
    }
    launch_check(e, __FILE__, line);
}

void ds4_side_fork(ds4_side *d) {
    side_event(d, cudaEventRecord(d->fork, ds4_current_stream()), "fork", __LINE__);
    if (ds4_stream_push(d->s) != 0) {
        ds4_fatal("%s cannot push its stream (ds4_stream.h: %d overrides deep)", d->who, DS4_STREAM_DEPTH);
    }
    side_event(d, cudaStreamWaitEvent(ds4_current_stream(), d->fork, 0), "fork", __LINE__);
}

void ds4_side_unfork(ds4_side *d) {
    side_event(d, cudaEventRecord(d->join, ds4_current_stream()), "join", __LINE__);
    ds4_stream_pop();
    d->pending = true;
}

void ds4_side_join(ds4_side *d) {
    if (!d->pending) return;
    side_event(d, cudaStreamWaitEvent(ds4_current_stream(), d->join, 0), "join", __LINE__);
    d->pending = false;
}

static void cuda_session_reset(void *s) {
    ds4_session *S = (ds4_session *)s;
    while (S->n_reg > 0) region_drop(S, S->n_reg - 1);
}

static void session_release(ds4_session *S) {
    if (!S) return;
    ds4h_emitter_close(S);  /* the hook emitter drains first: its producers ran on the stream */
    while (S->n_reg > 0) region_drop(S, S->n_reg - 1);
    free(S->reg);
    if (S->stream) {
        g_n_stream_sync++;
        DS4_CUDA_CHECK(cudaStreamSynchronize(S->stream));   /* NOTE(load time): a context ends */
    }
    scratch_t *all[] = { &S->deq, &S->tc_x, &S->moe_h, &S->moe_tmp, &S->moe_xg, &S->moe_gu, &S->moe_idx, &S->att_part,
                         &S->att_split, &S->ix_scores };
    for (scratch_t *x : all) dev_free(x->p);
    dev_free(S->hc_count);
    dev_free(S->gate_count);
    dev_free(S->blas_ws);
    host_free(S->host_idx);
    host_free(S->up_stage);
    host_free(S->down_stage);
    if (S->blas) DS4_CUBLAS_CHECK(cublasDestroy(S->blas));
    ds4_side_close(&S->shx);
    ds4_side_close(&S->axs);
    if (S->stream) DS4_CUDA_CHECK(cudaStreamDestroy(S->stream));
    if (S->trace) fclose(S->trace);
    if (g_sess == S) g_sess = NULL;
    free(S);
}

static bool session_scratch(scratch_t *x, const char *what, size_t bytes) {
    x->what = what;
    if (bytes == 0) return true;
    const cudaError_t e = dev_malloc(&x->p, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cannot allocate the context's %s (%zu bytes): %s\n", what, bytes, cudaGetErrorString(e));
        (void)cudaGetLastError();
        x->p = NULL;
        return false;
    }
    x->cap = bytes;
    /* zeroed once (session_new waits for it): kernels may read slots a step did not write
     * (k_attention_combine loads every partial slot before it knows how many are used) */
    DS4_CUDA_CHECK(cudaMemsetAsync(x->p, 0, bytes, ds4_current_stream()));
    return true;
}

static bool session_pinned(void **p, const char *what, size_t bytes) {
    const cudaError_t e = host_alloc(p, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "ds4: cannot allocate the context's %s (%zu bytes of pinned memory): %s\n", what, bytes,
                cudaGetErrorString(e));
        (void)cudaGetLastError();
        *p = NULL;
        return false;
    }
    return true;
}

static void *cuda_session_new(const ds4_limits *lim) {
    if (!g_cuda.ready && cuda_init() != 0) return NULL;
    if (lim->max_batch < 1 || lim->n_ctx < 1) {
        fprintf(stderr, "ds4: a CUDA session needs a batch and a context of at least 1 (got %d, %d)\n",
                lim->max_batch, lim->n_ctx);
        return NULL;
    }
    /* The launch bounds, checked once for the largest chunk and context.  The token count of a
     * call rides in grid.y or grid.z of the hc, matvec, attention, indexer, gate and attn_probs
     * launches, and attn_probs's column chunks in grid.y; every other dimension is a
     * grid-stride loop, a capped grid.x, or a fixed count. */
    {
        const int64_t yz = g_cuda.max_grid_yz;
        const int64_t probs_chunks = attention_probs_chunks(lim);
        if (lim->max_batch > yz || probs_chunks > yz) {
            fprintf(stderr, "ds4: a batch of %d tokens on a context of %d positions exceeds this GPU's grid limit "
                    "%lld in y and z (give a smaller DS4_UBATCH or -c)\n", lim->max_batch, lim->n_ctx, (long long)yz);
            return NULL;
        }
    }
    ds4_session *S = (ds4_session *)calloc(1, sizeof *S);
    if (!S) {
        fprintf(stderr, "ds4: out of host memory\n");
        return NULL;
    }
    S->lim = *lim;
    S->pdl = lim->graphs && lim->graph_pdl && g_cuda.cc_major >= 9;
    S->eager_pdl = lim->eager_pdl && g_cuda.cc_major >= 9;
    const int64_t B = lim->max_batch, k = lim->n_expert_used > 0 ? lim->n_expert_used : 0;
    const int64_t D = lim->n_embd, F = lim->n_ff_exp, E = lim->n_expert;
    bool ok = true;
    const char *trace = getenv("DS4_LAUNCH_TRACE");
    if (trace && *trace) {
        S->trace = fopen(trace, "w");
        if (!S->trace) {
            fprintf(stderr, "ds4: DS4_LAUNCH_TRACE: cannot write %s: %s\n", trace, strerror(errno));
            free(S);
            return NULL;
        }
    }
    /* a blocking stream when graphs are on (a stray legacy-stream operation then fails a
     * capture loudly: the Sessions banner), a non-blocking one otherwise */
    DS4_CUDA_CHECK(cudaStreamCreateWithFlags(&S->stream, lim->graphs ? cudaStreamDefault : cudaStreamNonBlocking));
    if (lim->graphs) {
        S->reg = (struct region *)calloc((size_t)(lim->graph_cache > 0 ? lim->graph_cache : 1), sizeof *S->reg);
        if (!S->reg) {
            fprintf(stderr, "ds4: out of host memory\n");
            DS4_CUDA_CHECK(cudaStreamDestroy(S->stream));
            free(S);
            return NULL;
        }
        if (S->lim.graph_cache < 1) S->lim.graph_cache = 1;
    }
    /* the shared expert's stream and its fork and join events (shared_begin), and the
     * attention's compressors' and indexer's (side_begin) */
    if (lim->shared_stream && (ds4_side_open(&S->shx, "the shared expert") != cudaSuccess ||
                               ds4_side_open(&S->axs, "the attention's compressors and indexer") != cudaSuccess)) {
        fprintf(stderr, "ds4: cannot create the decode step's second streams (DS4_CUDA_SHARED_STREAM=0 runs without them)\n");
        (void)cudaGetLastError();
        session_release(S);
        return NULL;
    }
    DS4_CUBLAS_CHECK(cublasCreate(&S->blas));
    /* f32 products stay f32: default math never uses TF32 for Sgemm. */
    DS4_CUBLAS_CHECK(cublasSetMathMode(S->blas, CUBLAS_DEFAULT_MATH));
    DS4_CUBLAS_CHECK(cublasSetAtomicsMode(S->blas, CUBLAS_ATOMICS_NOT_ALLOWED));
    DS4_CUBLAS_CHECK(cublasSetPointerMode(S->blas, CUBLAS_POINTER_MODE_HOST));
    DS4_CUBLAS_CHECK(cublasSetStream(S->blas, S->stream));
    /* cuBLAS's recommended workspace (32 MiB on Hopper and later, 4 MiB before),
     * given up front so that no call allocates one */
    const size_t ws = g_cuda.cc_major >= 9 ? ((size_t)32 << 20) : ((size_t)4 << 20);
    if (dev_malloc(&S->blas_ws, ws) != cudaSuccess) {
        fprintf(stderr, "ds4: cannot allocate the context's cuBLAS workspace (%zu bytes)\n", ws);
        (void)cudaGetLastError();
        S->blas_ws = NULL;
        session_release(S);
        return NULL;
    }
    DS4_CUBLAS_CHECK(cublasSetWorkspace(S->blas, S->blas_ws, ws));
    /* the counters hc_pre and k_moe_gate leave at zero */
    ok = ok && dev_malloc((void **)&S->hc_count, HC_SPLIT_MAX_NT * sizeof(unsigned)) == cudaSuccess;
    ok = ok && dev_malloc((void **)&S->gate_count, HC_SPLIT_MAX_NT * sizeof(unsigned)) == cudaSuccess;
    if (!ok) {
        fprintf(stderr, "ds4: cannot allocate the context's block counters\n");
        (void)cudaGetLastError();
        session_release(S);
        return NULL;
    }
    DS4_CUDA_CHECK(cudaMemsetAsync(S->hc_count, 0, HC_SPLIT_MAX_NT * sizeof(unsigned), ds4_current_stream()));
    DS4_CUDA_CHECK(cudaMemsetAsync(S->gate_count, 0, HC_SPLIT_MAX_NT * sizeof(unsigned), ds4_current_stream()));
    /* attention partials: attention_run asks nt*H*want*(d+2) floats, at most attention_part_floats */
    ok = ok && session_scratch(&S->att_part, "attention partials",
                               lim->head_dim > 0 ? attention_part_floats(lim->head_dim) * sizeof(float) : 0);
    /* the rows of a prefill call in f16 parts (k_attention_mma) */
    ok = ok && session_scratch(&S->att_split, "attention split rows", attention_split_scratch(lim));
    /* indexer scores: cuda_indexer_topk asks ix_chunk rows of ix_ld */
    if (lim->idx_topk > 0) {
        S->ix_ld = (int64_t)lim->n_ctx / IX_MIN_RATIO + 1;
        S->ix_chunk = IX_SCORE_CAP / S->ix_ld;
        if (S->ix_chunk < 1) S->ix_chunk = 1;
        if (S->ix_chunk > B) S->ix_chunk = B;
        ok = ok && session_scratch(&S->ix_scores, "indexer scores",
                                   (size_t)(S->ix_chunk * S->ix_ld) * sizeof(float));
    }
    /* MoE: moe_decode asks [pairs][F] and [pairs][D] (pairs = nt*k), the prefill path
     * also the gathered inputs [pairs][D], gate|up [pairs][2F] and the tables */
    if (k > 0 && D > 0 && F > 0) {
        const int64_t pairs = B * k;
        ok = ok && session_scratch(&S->moe_h, "MoE activations", (size_t)(pairs * F) * sizeof(float));
        ok = ok && session_scratch(&S->moe_tmp, "MoE expert outputs", (size_t)(pairs * D) * sizeof(float));
        if (B > MOE_DECODE_MAX_NT) {
            ok = ok && session_scratch(&S->moe_xg, "MoE gathered inputs", (size_t)(pairs * D) * sizeof(float));
            ok = ok && session_scratch(&S->moe_gu, "MoE gate|up products", (size_t)(pairs * 2 * F) * sizeof(float));
            /* and the tensor-core engine's tiles (int4, 16-byte aligned after them) */
            const size_t tiles = 4 * (size_t)gemm_tc_max_tiles(pairs, E) + 4;
            ok = ok && session_scratch(&S->moe_idx, "MoE pair tables", (2 * pairs + E + 1 + tiles) * sizeof(int32_t));
            S->host_idx_cap = (size_t)(3 * pairs + E + 1) + tiles;
            ok = ok && session_pinned((void **)&S->host_idx, "MoE host tables", S->host_idx_cap * sizeof(int32_t));
        }
    }
    /* dequantised rows for cuBLAS (gemm_rows: tiles of at most DEQ_CAP_FLOATS, whole rows) */
    const int64_t R = lim->max_rows > B ? lim->max_rows : B;   /* a matmul's rows */
    if (R > MV_MAX_NT) {
        int64_t deq = lim->max_matrix < DEQ_CAP_FLOATS ? lim->max_matrix : DEQ_CAP_FLOATS;
        if (deq < lim->max_k) deq = lim->max_k;
        ok = ok && session_scratch(&S->deq, "dequantised weight rows", (size_t)deq * sizeof(float));
        /* the split activations: a batch of any product, or every (token, expert) pair of the MoE */
        size_t tcb = gemm_tc_scratch_bytes(R, lim->max_k);
        if (k > 0 && D > 0 && F > 0) {
            const size_t m = gemm_tc_scratch_bytes(B * k, D > F ? D : F);
            if (m > tcb) tcb = m;
        }
        if (lim->prefill_tc) ok = ok && session_scratch(&S->tc_x, "split activations", tcb);
    }
    /* staging: the step block and tokens up, small results down */
    S->up_cap = 64 * 1024 + (size_t)B * sizeof(int32_t);
    ok = ok && session_pinned((void **)&S->up_stage, "upload staging", S->up_cap);
    S->down_cap = DOWN_STAGE_MAX;
    ok = ok && session_pinned((void **)&S->down_stage, "download staging", S->down_cap);
    if (!ok) {
        session_release(S);
        return NULL;
    }
    g_n_dev_sync++;
    DS4_CUDA_CHECK(cudaDeviceSynchronize());   /* NOTE(load time): weights and fills are in place */
    return S;
}

static void cuda_session_free(void *s) {
    session_release((ds4_session *)s);
}

/* The session's stream becomes the thread's current stream while it is bound. */
void *cuda_session_bind(void *s) {
    ds4_session *prev = g_sess;
    if (prev) ds4_stream_pop();
    g_sess = (ds4_session *)s;
    if (g_sess && ds4_stream_push(g_sess->stream) != 0) {
        ds4_fatal("session_bind: the thread's stream overrides are %d deep already", DS4_STREAM_DEPTH);
    }
    return prev;
}

static void cuda_session_stats(void *s, ds4_backend_stats *st, int reset) {
    ds4_session *S = (ds4_session *)s;
    memset(st, 0, sizeof *st);
    st->launches = S->launches;
    st->launch_seconds = S->launch_seconds;
    st->mallocs = g_n_malloc;
    st->frees = g_n_free;
    st->device_syncs = g_n_dev_sync;
    st->stream_syncs = g_n_stream_sync;
    st->captures = S->gs.captures;
    st->replays = S->gs.replays;
    st->fallbacks = S->gs.fallbacks;
    st->graphs = S->gs.graphs;
    st->graph_nodes = S->gs.graph_nodes;
    st->graph_bytes = S->gs.graph_bytes;
    st->capture_ms = S->gs.capture_ms;
    st->instantiate_ms = S->gs.instantiate_ms;
    st->graph_pdl = S->pdl;
    st->tc_wgmma = S->n_tc_wgmma;
    st->tc_tma = S->n_tc_tma;
    st->tc_tma_a = S->n_tc_tma_a;
    st->tc_pl2 = S->n_tc_pl2;
    st->att_mma = S->n_att_mma;
    st->att_mma_pl2 = S->n_att_mma_pl2;
    if (reset) {
        S->n_tc_wgmma = S->n_tc_tma = S->n_tc_tma_a = 0;
        S->n_tc_pl2 = S->n_att_mma = S->n_att_mma_pl2 = 0;
        S->gs.captures = S->gs.replays = S->gs.fallbacks = 0;
        S->gs.capture_ms = S->gs.instantiate_ms = 0.0;
        S->launches = 0;
        S->launch_seconds = 0.0;
        g_n_malloc = 0;
        g_n_free = 0;
        g_n_dev_sync = 0;
        g_n_stream_sync = 0;
    }
}

/* ---------------------------------------------------------------------------
 * The backend table
 * ------------------------------------------------------------------------- */

/* Device memory free now (cudaMemGetInfo): ds4_ctx_new's plan is checked against it. */
static size_t cuda_mem_available(void) {
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) { (void)cudaGetLastError(); return (size_t)-1; }
    return free_b;
}

/* What upload_weight and the ops take: the matrix types, and I32 (tid2eid, read by moe_route). */
static int cuda_supports_type(int type) { return type_supported(type) || type == DS4_TYPE_I32; }

static ds4_backend make_cuda_backend(void) {
    ds4_backend b;
    memset(&b, 0, sizeof b);
    b.name = "cuda";
    b.init = cuda_init;
    b.alloc = cuda_alloc;
    b.free = cuda_free;
    b.upload = cuda_upload;
    b.download = cuda_download;
    b.copy = cuda_copy;
    b.upload_weight = cuda_upload_weight;
    b.release_weight = cuda_release_weight;
    b.synchronize = cuda_synchronize;
    b.supports_type = cuda_supports_type;
    b.mem_available = cuda_mem_available;
    b.session_new = cuda_session_new;
    b.session_free = cuda_session_free;
    b.session_bind = cuda_session_bind;
    b.session_stats = cuda_session_stats;
    b.region_begin = cuda_region_begin;
    b.region_end = cuda_region_end;
    b.session_reset = cuda_session_reset;
    ds4_cuda_ops_norm(&b);
    ds4_cuda_ops_mhc(&b);
    ds4_cuda_ops_matmul(&b);
    ds4_cuda_ops_attn(&b);
    ds4_cuda_ops_compressor(&b);
    ds4_cuda_ops_indexer(&b);
    ds4_cuda_ops_moe(&b);
    b.hooks_open = cuda_hooks_open;
    b.hooks_sink = cuda_hooks_sink;
    b.hook_put = cuda_hook_put;
    b.hooks_publish = cuda_hooks_publish;
    b.hooks_join = cuda_hooks_join;
    b.hooks_stats = cuda_hooks_stats;
    b.hooks_hold = cuda_hooks_hold;
    b.hooks_commit = cuda_hooks_commit;
    return b;
}

static const ds4_backend g_cuda_backend = make_cuda_backend();

extern "C" const ds4_backend *ds4_backend_cuda(void) { return &g_cuda_backend; }
