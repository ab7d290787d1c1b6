/* ds4_hooks.cu -- the CUDA hook emitter (stage 3 of patches/series): activations stream off
 * the GPU while the decode step runs, eagerly or as a replayed CUDA graph, and nothing is
 * lost unless the user asked for drops.
 *
 * What it is.  Two rings in device memory and a host thread:
 *   - the control ring: fixed 64-byte descriptors (ds4_hooks.h's ds4h_record: sequence
 *     number, hook, layer, position, step, dtype, shape, byte count; its reserved field holds
 *     the payload's ring offset while it is in the ring);
 *   - the payload ring: raw bytes, each record's payload padded to 8;
 *   - the drain thread: it copies published spans of both rings, in large device-to-host
 *     copies on its own stream, into pinned staging and writes them to the file.
 * A producer (hook_put) is a kernel issued right after the op that made the tensor, on the
 * emitter's side stream forked from the compute stream (ds4_side_fork), so a capture records
 * it like any op -- as a branch beside the step's kernels, joined back before the tensor is
 * overwritten (hooks_join).  It computes every address from the
 * device-resident 64-bit heads (struct ds4h_heads) when it runs, and reads the position and
 * the step from the step block, so one recording serves every position; attn_probs, whose
 * size grows with the position, takes its size from the step block too.  The device assigns
 * identity (sequence numbers count every record produced, dropped or not); the host never
 * infers it from order.
 *
 * Publication.  Producers do not publish.  One kernel per forward call (hooks_publish, after
 * the logits' record: inside the step's last recorded region) fences at system scope and
 * stores the control ring's fill count into pinned mapped memory with a system-scope release;
 * the drain thread reads it with acquire.  Everything before it in the stream has completed,
 * so the descriptors and payloads it covers are in device memory when the copy engine reads
 * them.  One publication per call, not per record: each would cost a system-scope fence.
 * An eager call (a prompt's chunk) also publishes on the producers' stream after a producer
 * that brings the call's unpublished payload to an eighth of the payload ring
 * (ds4h_produced): its records then drain while the prompt runs.  Published only at the end,
 * a prompt's records would fill the ring, and each full ring would stop the prompt until the
 * drain had copied it.  A recorded step's records are far below that share of a ring sized
 * for 64 steps; a recording keeps one publication per call.
 *
 * Space.  Producers check free space against the drained counters the drain thread stores
 * (release) into the same mapped memory.  Lossless by default (DS4_HOOKS_POLICY=wait).  In an
 * eager call the host makes room before it issues a producer (ds4h_room): it keeps an upper
 * bound of the payload bytes and slots reserved, and while that bound leaves no room for the
 * record it publishes what it issued and polls the drained counters (in no CUDA call that
 * waits).  So an eager producer finds its room and never waits on the device: a kernel that
 * spins until a host thread's copies land, while the main thread keeps issuing launches behind
 * it, is a cycle that CUDA does not promise to break.  A replayed
 * step's producer, which the host cannot hold back, may still wait on the device: it first
 * publishes everything before it -- otherwise a ring smaller than a step would wait on records
 * nobody may drain -- then polls the drained counters.  The host then waits at the step's end
 * in a synchronisation, not in a launch.  DS4_HOOKS_POLICY=drop never waits:
 * the record is counted as dropped (exactly), and the next record that fits is preceded by a
 * gap record (DS4H_FLAG_GAP) naming the first dropped record and how many were dropped;
 * drops at the very end get their gap record when the emitter closes.
 *
 * Speculative checks (hooks_hold .. hooks_commit, ds4 --mtp-draft).  A check call's records
 * are produced like any others; only the sequence keeps fewer rows than the call made.  The
 * main thread marks the call's span of control slots: hold publishes, waits for the stream and
 * opens a window at the publication (every slot below it was made before the hold), commit
 * does the same and closes the window there with pos_end.  The drain hands every record to
 * the hold queue (ds4h_holdq, ds4_hooks.c), which keeps each record from an open window back in
 * host memory (so the rings' space goes back as usual and a producer never waits on a commit),
 * with every record after it, and once the window is closed writes them in order, cut by
 * ds4h_cut; a record that keeps no row is not written, and every
 * sequence number after it is one less, so the file's numbers are those of the records the
 * sequence holds, as the CPU writer's are.
 *
 * Sizes.  Records whose payloads fit DS4H_ONE_BLOCK together are reserved and copied by one
 * block (one launch: every decode record but Flash's logits; the core hands over the records
 * made at one point of the step together, up to DS4H_PUT_MAX); larger ones (a prompt's
 * rows, a vocabulary's logits) are reserved by one block and copied by a grid (two
 * launches), and the core's rows are split into records of at most a quarter of the
 * payload ring so that a prompt of any length streams through a ring of any size.  Hooks off: no kernel, no allocation, no thread (the core never calls in).
 *
 * It is a translation unit of the CUDA backend like the op families (ds4_cuda_common.cuh),
 * so its launches go through the one DS4_LAUNCH, count in the session, and fail a capture
 * like every other op's.  The drain's copies are the backend's only work on a stream other
 * than ds4_current_stream(): each is marked NOTE(hook drain), which scripts/check_streams.py
 * accepts only with the emitter's own stream.
 */

#include "ds4_cuda_common.cuh"

#define DS4H_ONE_BLOCK    (128u << 10)   /* payload bytes one block reserves and copies */
#define DS4H_PUT_THREADS  1024
#define DS4H_COPY_THREADS 256
#define DS4H_POLL_NS      1000           /* a waiting producer's pause between polls */

/* Device memory, written by the producers only (one thread of one block at a time: the
 * producers are ordered by the stream). */
struct ds4h_heads {
    unsigned long long seq;        /* records produced: the next sequence number */
    unsigned long long fill;       /* control slots written (records and gap records) */
    unsigned long long pay;        /* payload bytes reserved */
    unsigned long long dropped;    /* records dropped (drop policy) */
    unsigned long long gap_n;      /* dropped since the last slot written */
    unsigned long long waits;      /* producers that waited */
    unsigned long long dfill_c;    /* the drained counters as last read from the host (slots, */
    unsigned long long dpay_c;     /* payload words): they only grow, so a stale copy is safe */
    unsigned long long cur_off;    /* the two-launch path: the reservation */
    unsigned int       cur_ok, cur_d1;
    ds4h_record        gap;        /* the first record dropped since the last slot written */
};

/* Pinned mapped memory: the publication (device -> host) and the drained counters (host ->
 * device), on separate 64-byte lines. */
struct ds4h_mapped {
    unsigned long long pub;            /* control slots published */
    unsigned long long pub_pay;        /* payload bytes reserved when they were (the host's room) */
    unsigned long long pad0[6];
    unsigned long long drained_fill;   /* slots the drain has taken */
    unsigned long long drained_pay;    /* payload bytes the drain has taken (bytes; the producers count words) */
    unsigned long long pad1[6];
};

/* A producer's arguments (by value: a recording bakes them in; nothing in them varies
 * between steps). */
struct ds4h_put_args {
    ds4h_heads         *D;
    ds4h_mapped        *H;             /* device view of the mapped block */
    ds4h_record        *ring;
    unsigned int       *pay;           /* the payload ring, as 4-byte words */
    unsigned long long  cap_slots, cap_words;
    int                 drop;
    const ds4_step     *step;
    const unsigned int *src;
    long long           s0, s1;
    unsigned int        hook, dtype, ndim, d0, d1, d2;
    int                 layer, pos_add, dyn, W, ratio, k;
};

__device__ __forceinline__ unsigned long long ds4h_load_acquire(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ds4h_store_release(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

/* Rows of record a (attn_probs: the rows its query saw at this step's position + the sink). */
__device__ __forceinline__ unsigned int ds4h_rows(const ds4h_put_args &a) {
    return a.dyn ? (unsigned int)ds4_att_rows(a.step->pos0 + a.pos_add, a.W, a.ratio, a.k) + 1u : a.d1;
}

/* Publish every slot written so far (their data was written by kernels that completed before
 * this one, or by this thread before this call). */
__device__ __forceinline__ void ds4h_publish_now(const ds4h_put_args &a) {
    __threadfence_system();
    a.H->pub_pay = a.D->pay * 4ull;          /* ordered before pub by the release */
    ds4h_store_release(&a.H->pub, a.D->fill);
}

/* The reservation of n records (one launch's), by one thread: their descriptors (and a
 * pending gap's) into the control ring, their payloads' places in the payload ring -- all
 * or none, so a launch never publishes a record of its own whose payload it has not yet
 * copied.  Space is checked against the device's copy of the drained counters first; the
 * host's (across PCIe) are read only when that copy shows too little.  false: dropped. */
__device__ bool ds4h_reserve(const ds4h_put_args *a, int n, unsigned long long *off_words, unsigned int *d1_out) {
    ds4h_heads *D = a[0].D;
    ds4h_record r[DS4H_PUT_MAX];
    unsigned long long need[DS4H_PUT_MAX], total = 0;
    for (int i = 0; i < n; i++) {
        const int pos = a[i].step->pos0 + a[i].pos_add;
        const unsigned int d1 = ds4h_rows(a[i]);
        const unsigned long long words = (unsigned long long)a[i].d0 * d1 * a[i].d2;
        need[i] = (words + 1ull) & ~1ull;                               /* padded to 8 bytes */
        total += need[i];
        d1_out[i] = d1;
        memset(&r[i], 0, sizeof r[i]);
        r[i].magic = DS4H_RECORD_MAGIC;
        r[i].hook = a[i].hook;
        r[i].seq = D->seq++;
        r[i].layer = a[i].layer;
        r[i].pos = (uint32_t)pos;
        r[i].step = (uint32_t)a[i].step->call;
        r[i].dtype = (uint8_t)a[i].dtype;
        r[i].ndim = (uint8_t)a[i].ndim;
        r[i].shape[0] = a[i].d0; r[i].shape[1] = d1; r[i].shape[2] = a[i].d2; r[i].shape[3] = 1;
        r[i].nbytes = words * 4ull;
    }
    const unsigned long long slots = (unsigned long long)n + (D->gap_n ? 1ull : 0ull);
    unsigned long long dfill = D->dfill_c, dpay = D->dpay_c;
    bool waited = false;
    while (!(D->fill + slots - dfill <= a[0].cap_slots && D->pay + total - dpay <= a[0].cap_words)) {
        dfill = ds4h_load_acquire(&a[0].H->drained_fill);
        dpay = ds4h_load_acquire(&a[0].H->drained_pay) / 4ull;         /* bytes -> words */
        D->dfill_c = dfill;
        D->dpay_c = dpay;
        if (D->fill + slots - dfill <= a[0].cap_slots && D->pay + total - dpay <= a[0].cap_words) break;
        if (a[0].drop) {
            for (int i = 0; i < n; i++) {
                if (D->gap_n == 0) D->gap = r[i];
                D->gap_n++;
                D->dropped++;
            }
            return false;
        }
        if (!waited) {
            waited = true;
            D->waits++;
            ds4h_publish_now(a[0]);
        }
        __nanosleep(DS4H_POLL_NS);
    }
    if (D->gap_n) {
        ds4h_record g = D->gap;
        g.flags = DS4H_FLAG_GAP;
        g.ndim = 1;
        g.shape[0] = (uint32_t)D->gap_n; g.shape[1] = g.shape[2] = g.shape[3] = 1;
        g.nbytes = 0;
        g.reserved = D->pay * 4ull;
        a[0].ring[D->fill % a[0].cap_slots] = g;
        D->fill++;
        D->gap_n = 0;
    }
    for (int i = 0; i < n; i++) {
        r[i].reserved = D->pay * 4ull;
        a[0].ring[D->fill % a[0].cap_slots] = r[i];
        D->fill++;
        off_words[i] = D->pay;
        D->pay += need[i];
    }
    return true;
}

/* The copy.  A producer's records are small next to the step's weights, so its copy is
 * latency-bound rather than bandwidth-bound: each thread issues DS4H_UNROLL loads before it
 * stores any of them (DS4H_UNROLL x threads elements in flight per round, one memory latency
 * each), the ring position wraps by one comparison (a record is never larger than the ring),
 * and k_hook_put's threads load their first round of the largest record while thread 0
 * reserves.  (What a producer costs the step: bench/RESULTS.md.) */
#define DS4H_UNROLL 8

/* Where element e of the record is in its source (rows d0 of d1 x d2, strides s0, s1). */
__device__ __forceinline__ unsigned long long ds4h_src_index(const ds4h_put_args &a, unsigned int d1,
                                                             unsigned long long e) {
    const unsigned long long inner = (unsigned long long)d1 * a.d2;
    if (a.s0 == (long long)inner && a.s1 == (long long)a.d2) return e;
    const unsigned long long i0 = e / inner, rem = e % inner;
    return i0 * (unsigned long long)a.s0 + (rem / a.d2) * (unsigned long long)a.s1 + rem % a.d2;
}

/* One round: elements e, e + es, ... (DS4H_UNROLL of them, those below n) into v. */
__device__ __forceinline__ void ds4h_load_round(const ds4h_put_args &a, unsigned int d1, unsigned long long n,
                                                unsigned long long e, unsigned long long es, unsigned int *v) {
#pragma unroll
    for (int j = 0; j < DS4H_UNROLL; j++) {
        const unsigned long long ej = e + (unsigned long long)j * es;
        v[j] = ej < n ? __ldcg(a.src + ds4h_src_index(a, d1, ej)) : 0u;
    }
}

/* ... and into the payload ring, the record starting at ring word o (< cap_words). */
__device__ __forceinline__ void ds4h_store_round(const ds4h_put_args &a, unsigned long long o, unsigned long long n,
                                                 unsigned long long e, unsigned long long es, const unsigned int *v) {
#pragma unroll
    for (int j = 0; j < DS4H_UNROLL; j++) {
        const unsigned long long ej = e + (unsigned long long)j * es;
        if (ej < n) {
            unsigned long long w = o + ej;
            if (w >= a.cap_words) w -= a.cap_words;
            a.pay[w] = v[j];
        }
    }
}

/* Elements [e0, n) step es of the record into the payload ring at word offset off; the first
 * round already loaded into pre when pre is not NULL. */
__device__ __forceinline__ void ds4h_copy(const ds4h_put_args &a, unsigned long long off, unsigned int d1,
                                          unsigned long long e0, unsigned long long es, const unsigned int *pre) {
    const unsigned long long n = (unsigned long long)a.d0 * d1 * a.d2;
    const unsigned long long o = off % a.cap_words, round = (unsigned long long)DS4H_UNROLL * es;
    unsigned int v[DS4H_UNROLL];
    unsigned long long e = e0;
    if (pre) {
        ds4h_store_round(a, o, n, e, es, pre);
        e += round;
    }
    for (; e < n; e += round) {
        ds4h_load_round(a, d1, n, e, es, v);
        ds4h_store_round(a, o, n, e, es, v);
    }
}

/* A launch's records (ds4_gpu.h hook_put: up to DS4H_PUT_MAX, made at the same point of the step);
 * big: the largest, whose first round is loaded during the reservation. */
struct ds4h_put_batch {
    int         n, big;
    ds4h_put_args a[DS4H_PUT_MAX];
};

/* One block: reserve them all, then copy each (together at most DS4H_ONE_BLOCK bytes). */
__global__ void __launch_bounds__(DS4H_PUT_THREADS) k_hook_put(ds4h_put_batch b) {
    ds4_grid_dep();
    __shared__ unsigned long long off_s[DS4H_PUT_MAX];
    __shared__ unsigned int d1_s[DS4H_PUT_MAX], ok_s;
    unsigned int pre[DS4H_UNROLL];
    const unsigned int d1b = ds4h_rows(b.a[b.big]);
    ds4h_load_round(b.a[b.big], d1b, (unsigned long long)b.a[b.big].d0 * d1b * b.a[b.big].d2, threadIdx.x,
                    blockDim.x, pre);
    if (threadIdx.x == 0) ok_s = ds4h_reserve(b.a, b.n, off_s, d1_s) ? 1u : 0u;
    __syncthreads();
    if (!ok_s) return;
    for (int i = 0; i < b.n; i++)
        ds4h_copy(b.a[i], off_s[i], d1_s[i], threadIdx.x, blockDim.x, i == b.big ? pre : NULL);
}

/* The two-launch path: one thread reserves ... */
__global__ void k_hook_reserve(ds4h_put_args a) {
    ds4_grid_dep();
    if (threadIdx.x != 0) return;
    unsigned long long off = 0;
    unsigned int d1 = 0;
    a.D->cur_ok = ds4h_reserve(&a, 1, &off, &d1) ? 1u : 0u;
    a.D->cur_off = off;
    a.D->cur_d1 = d1;
}

/* ... and a grid copies. */
__global__ void __launch_bounds__(DS4H_COPY_THREADS) k_hook_copy(ds4h_put_args a) {
    ds4_grid_dep();
    if (!a.D->cur_ok) return;
    ds4h_copy(a, a.D->cur_off, a.D->cur_d1, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x,
              (unsigned long long)gridDim.x * blockDim.x, NULL);
}

__global__ void k_hook_publish(ds4h_heads *D, ds4h_mapped *H) {
    ds4_grid_dep();
    if (threadIdx.x != 0) return;
    __threadfence_system();
    H->pub_pay = D->pay * 4ull;              /* ordered before pub by the release */
    ds4h_store_release(&H->pub, D->fill);
}

/* ---- the host side ---- */

struct ds4h_emitter {
    ds4h_heads         *D;
    ds4h_mapped        *Hh, *Hd;       /* the mapped block: host and device views */
    ds4h_record        *ring;
    unsigned char      *pay;
    unsigned long long  cap_slots, cap_bytes;
    int                 drop;
    unsigned int        throttle_us;
    FILE               *f;
    char               *path;
    int                 device;
    cudaStream_t        drain;         /* the drain's own non-blocking stream */
    ds4_side            side;          /* the producers' stream, forked from the compute stream */
    ds4h_record        *st_desc;       /* pinned staging */
    unsigned char      *st_pay;
    pthread_t           thr;
    bool                thr_started;
    int                 stop;          /* set (release) once the last publication is visible */
    /* the drain's counters (it writes them; others read them with __atomic loads) */
    unsigned long long  written, gaps, gap_dropped, bytes, batches, copy_ns, lost_io;
    int                 err;
    /* cuda_hooks_sink: stored between steps (user, then fn with release), read by the drain */
    void              (*sink)(void *user, const ds4h_record *r, const void *payload);
    void               *sink_user;
    ds4h_holdq         *hq;            /* speculative checks: records kept back (ds4_hooks.h) */
    unsigned long long  unpub;         /* payload bytes issued since the last publication (host) */
    bool                unpub_any;     /* records issued since the last publication (host) */
    bool                room_known;    /* the room's bounds below hold (found exact, wait policy) */
    unsigned long long  room_graphs;   /* the session's graph launches when they were found exact */
    unsigned long long  room_pay;      /* upper bounds of the payload bytes and slots reserved by */
    unsigned long long  room_fill;     /* every producer issued so far (ds4h_room) */
    unsigned long long  room_waits;    /* records the host held back for room */
};

static unsigned long long ds4h_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* Copy n bytes of a device ring (cap bytes) from ring offset off into dst, wrapping. */
static void ds4h_ring_copy(ds4h_emitter *E, void *dst, const unsigned char *ring, unsigned long long cap,
                           unsigned long long off, unsigned long long n) {
    const unsigned long long o = off % cap, first = n < cap - o ? n : cap - o;
    if (first)   /* NOTE(hook drain) */
        DS4_CUDA_CHECK(cudaMemcpyAsync(dst, ring + o, first, cudaMemcpyDeviceToHost, E->drain));
    if (n > first)   /* NOTE(hook drain) */
        DS4_CUDA_CHECK(cudaMemcpyAsync((unsigned char *)dst + first, ring, n - first, cudaMemcpyDeviceToHost, E->drain));
}

static void ds4h_drain_wait(ds4h_emitter *E) {
    g_n_hook_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(E->drain));   /* NOTE(hook drain): the drain thread's own copies */
}

/* Write one descriptor (its ring offset zeroed: the file holds no ring state) and payload. */
static void ds4h_write_record(ds4h_emitter *E, const ds4h_record *r, const unsigned char *payload) {
    if (E->err) {
        E->lost_io++;
        return;
    }
    static const unsigned char zeros[8] = { 0 };
    ds4h_record w = *r;
    w.reserved = 0;
    const size_t pad = (size_t)((8 - w.nbytes % 8) % 8);
    if (fwrite(&w, sizeof w, 1, E->f) != 1 || (w.nbytes && fwrite(payload, 1, (size_t)w.nbytes, E->f) != w.nbytes) ||
        (pad && fwrite(zeros, 1, pad, E->f) != pad)) {
        __atomic_store_n(&E->err, errno ? errno : EIO, __ATOMIC_RELEASE);
        E->lost_io++;
        return;
    }
    if (w.flags & DS4H_FLAG_GAP) {
        __atomic_fetch_add(&E->gaps, 1ull, __ATOMIC_RELAXED);
        __atomic_fetch_add(&E->gap_dropped, (unsigned long long)w.shape[0], __ATOMIC_RELAXED);
    } else {
        __atomic_fetch_add(&E->written, 1ull, __ATOMIC_RELAXED);
        __atomic_fetch_add(&E->bytes, (unsigned long long)w.nbytes, __ATOMIC_RELAXED);
    }
    void (*sink)(void *, const ds4h_record *, const void *) = __atomic_load_n(&E->sink, __ATOMIC_ACQUIRE);
    if (sink) sink(E->sink_user, &w, payload);
}

/* The hold queue's writer (ds4h_holdq: a record, its seq renumbered, as the file has it). */
static void ds4h_write_cb(void *user, const ds4h_record *r, const void *payload) {
    ds4h_write_record((ds4h_emitter *)user, r, (const unsigned char *)payload);
}

/* The drain thread: take each published span, copy it down, write it, hand the space back. */
static void *ds4h_drain_main(void *arg) {
    ds4h_emitter *E = (ds4h_emitter *)arg;
    DS4_CUDA_CHECK(cudaSetDevice(E->device));
    unsigned long long fill = 0, payd = 0;
    for (;;) {
        const unsigned long long pub = __atomic_load_n(&E->Hh->pub, __ATOMIC_ACQUIRE);
        if (pub == fill) {
            ds4h_holdq_run(E->hq);              /* a commit may have closed their window */
            ds4h_holdq_pass(E->hq, fill);
            if (__atomic_load_n(&E->stop, __ATOMIC_ACQUIRE) && __atomic_load_n(&E->Hh->pub, __ATOMIC_ACQUIRE) == fill)
                break;
            struct timespec ts = { 0, 20000 };   /* 20 us */
            nanosleep(&ts, NULL);
            continue;
        }
        const unsigned long long n = pub - fill;
        ds4h_ring_copy(E, E->st_desc, (const unsigned char *)E->ring, E->cap_slots * sizeof(ds4h_record),
                       fill * sizeof(ds4h_record), n * sizeof(ds4h_record));
        ds4h_drain_wait(E);
        unsigned long long end = payd;
        for (unsigned long long i = 0; i < n; i++) {
            const ds4h_record *r = &E->st_desc[i];
            const unsigned long long e = r->reserved + ((r->nbytes + 7ull) & ~7ull);
            if (e > end) end = e;
        }
        if (end > payd) {
            const unsigned long long t0 = ds4h_now_ns();
            ds4h_ring_copy(E, E->st_pay, E->pay, E->cap_bytes, payd, end - payd);
            ds4h_drain_wait(E);
            __atomic_fetch_add(&E->copy_ns, ds4h_now_ns() - t0, __ATOMIC_RELAXED);
        }
        for (unsigned long long i = 0; i < n; i++) {
            const ds4h_record *r = &E->st_desc[i];
            if (ds4h_holdq_take(E->hq, fill + i, r, E->st_pay + (r->reserved - payd)) != 0) {
                __atomic_store_n(&E->err, ENOMEM, __ATOMIC_RELEASE);   /* the stream names the failure */
                E->lost_io++;
            }
        }
        ds4h_holdq_run(E->hq);
        __atomic_fetch_add(&E->batches, 1ull, __ATOMIC_RELAXED);
        if (E->throttle_us) {
            struct timespec ts = { (time_t)(E->throttle_us / 1000000u), (long)(E->throttle_us % 1000000u) * 1000L };
            nanosleep(&ts, NULL);
        }
        fill = pub;
        payd = end;
        __atomic_store_n(&E->Hh->drained_pay, payd, __ATOMIC_RELEASE);
        __atomic_store_n(&E->Hh->drained_fill, fill, __ATOMIC_RELEASE);
    }
    ds4h_holdq_end(E->hq);                      /* a window never closed keeps its rows */
    return NULL;
}

/* A publication on the current stream, behind what it issued there. */
static void ds4h_publish_here(ds4h_emitter *E) {
    DS4_LAUNCH(k_hook_publish, 1, 32, 0, E->D, E->Hd);
    E->unpub = 0;
    E->unpub_any = false;
}

/* The side stream (ds4_side, ds4_cuda_common.cuh).  A producer only reads tensors the step
 * has made; nothing in the step reads what it writes.  So it need not sit on the step's
 * critical path: cuda_hook_put forks the side stream from the compute stream and issues the
 * producers there, and the join -- which the core asks for (hooks_join) before an op
 * overwrites a tensor a pending record was made from, and which publication and the end of
 * every recorded region imply -- makes the compute stream wait for them.  Under a capture a
 * producer is a branch beside the kernels that run while it copies.  The producers stay
 * ordered among themselves (one stream), so sequence numbers and the stream's bytes are what
 * they were on the compute stream. */
static void ds4h_launch_publish(ds4h_emitter *E) {
    ds4_side_join(&E->side);    /* every producer before the publication */
    ds4h_publish_here(E);
}

/* A producer of `bytes` has been issued on the producers' stream (forked): in an eager call,
 * once the payload issued since the last publication reaches an eighth of the ring, publish
 * it there, behind the producers that wrote it (the stream orders them), so that the drain
 * copies it while the call goes on.  Not while recording: a step's records are a small share
 * of the ring, and the graph keeps one publication per call. */
static void ds4h_produced(ds4h_emitter *E, unsigned long long bytes) {
    E->unpub += bytes;
    E->unpub_any = true;
    if (sess()->capturing || E->unpub < E->cap_bytes / 8) return;
    ds4h_publish_here(E);
}

/* The host's wait for the producers' stream (the current one: the caller has forked) to run
 * everything issued, a publication last; then the mapped block holds the device's counters:
 * every slot and payload byte reserved so far.  Polled, so that the host is never inside a
 * CUDA call that waits on the device while the drain thread needs one. */
static void ds4h_room_exact(ds4h_emitter *E) {
    ds4h_publish_here(E);
    g_n_stream_sync++;
    for (;;) {
        const cudaError_t e = cudaStreamQuery(ds4_current_stream());   /* NOTE(hook room) */
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) DS4_CUDA_CHECK(e);
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
    }
    E->room_fill = __atomic_load_n(&E->Hh->pub, __ATOMIC_ACQUIRE);
    E->room_pay = __atomic_load_n(&E->Hh->pub_pay, __ATOMIC_RELAXED);
    E->room_known = true;
    E->room_graphs = sess()->gs.captures + sess()->gs.replays;
}

/* Room for an eager producer of `bytes` of payload (at most, padded to 8) and `slots` control
 * slots, made before it is issued on the producers' stream (the current one).  The bounds
 * count every reservation issued since they were last found exact: at the first eager record
 * after a graph has run (a recording's or a replay's records are not counted on the host), and
 * whenever the drain has taken everything published (an attn_probs record is counted at its
 * largest, so the bound drifts above the device's count).  While they leave no room, the host publishes what it issued
 * and polls the drained counters; the device, which only runs producers that had room when
 * they were issued, never waits on the host, so the drain always catches up.  Not while
 * recording (a replay's producers wait on the device, the host at the step's end) nor under
 * DS4_HOOKS_POLICY=drop (a producer drops instead of waiting). */
static void ds4h_room(ds4h_emitter *E, unsigned long long bytes, unsigned long long slots) {
    const ds4_session *S = sess();
    if (S->capturing || E->drop) return;
    if (!E->room_known || E->room_graphs != S->gs.captures + S->gs.replays) ds4h_room_exact(E);
    bool held = false;
    for (;;) {
        const unsigned long long df = __atomic_load_n(&E->Hh->drained_fill, __ATOMIC_ACQUIRE);
        const unsigned long long dp = __atomic_load_n(&E->Hh->drained_pay, __ATOMIC_ACQUIRE);
        if (E->room_pay + bytes - dp <= E->cap_bytes && E->room_fill + slots - df <= E->cap_slots) break;
        if (!held) {
            held = true;
            E->room_waits++;
        }
        if (E->unpub_any) ds4h_publish_here(E);   /* the drain may take only what is published */
        if (df == __atomic_load_n(&E->Hh->pub, __ATOMIC_ACQUIRE) &&
            cudaStreamQuery(ds4_current_stream()) == cudaSuccess) {   /* NOTE(hook room): a poll */
            ds4h_room_exact(E);  /* everything issued is published; once drained, the bounds are exact */
            if (__atomic_load_n(&E->Hh->drained_fill, __ATOMIC_ACQUIRE) == E->room_fill) continue;
        }
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
    }
    E->room_pay += bytes;
    E->room_fill += slots;
}

/* Publish everything produced so far and let the stream finish (a host wait, between steps):
 * the publication then covers every record made before the call. */
static unsigned long long ds4h_publish_wait(ds4h_emitter *E) {
    ds4h_launch_publish(E);
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(step result): between steps */
    return __atomic_load_n(&E->Hh->pub, __ATOMIC_ACQUIRE);
}

/* Wait (host) until every record produced so far is written (or kept back by an open window):
 * publish, let the stream finish, then watch the drained counter reach the publication. */
static void ds4h_emitter_flush(ds4_session *S) {
    ds4h_emitter *E = S->hk;
    const unsigned long long pub = ds4h_publish_wait(E);
    while (__atomic_load_n(&E->Hh->drained_fill, __ATOMIC_ACQUIRE) != pub || !ds4h_holdq_settled(E->hq)) {
        struct timespec ts = { 0, 50000 };
        nanosleep(&ts, NULL);
    }
}

static void ds4h_emitter_free(ds4h_emitter *E) {
    if (!E) return;
    dev_free(E->D);
    dev_free(E->ring);
    dev_free(E->pay);
    host_free(E->Hh);
    host_free(E->st_desc);
    host_free(E->st_pay);
    if (E->drain) DS4_CUDA_CHECK(cudaStreamDestroy(E->drain));
    ds4_side_close(&E->side);
    ds4h_holdq_free(E->hq);
    free(E->path);
    free(E);
}

int cuda_hooks_open(const ds4h_emitter_cfg *cfg, char *err, size_t errlen) {
    ds4_session *S = sess();
    if (S->hk) { snprintf(err, errlen, "DS4_HOOKS: the context's emitter is open already"); return -1; }
    if (cfg->ring_bytes < 64 || cfg->ring_bytes % 8 || cfg->ring_slots < 2) {
        snprintf(err, errlen, "DS4_HOOKS: rings of %llu bytes and %llu slots are too small",
                 (unsigned long long)cfg->ring_bytes, (unsigned long long)cfg->ring_slots);
        return -1;
    }
    ds4h_emitter *E = (ds4h_emitter *)calloc(1, sizeof *E);
    if (!E) { snprintf(err, errlen, "DS4_HOOKS: out of host memory"); return -1; }
    E->cap_slots = cfg->ring_slots;
    E->cap_bytes = cfg->ring_bytes;
    E->drop = cfg->drop;
    E->throttle_us = cfg->throttle_us;
    E->f = cfg->f;
    E->path = strdup(cfg->path ? cfg->path : "");
    DS4_CUDA_CHECK(cudaGetDevice(&E->device));
    bool ok = E->path != NULL;
    ok = ok && dev_malloc((void **)&E->D, sizeof(ds4h_heads)) == cudaSuccess;
    ok = ok && dev_malloc((void **)&E->ring, E->cap_slots * sizeof(ds4h_record)) == cudaSuccess;
    ok = ok && dev_malloc((void **)&E->pay, E->cap_bytes) == cudaSuccess;
    if (ok) {
        g_n_malloc++;
        ok = cudaHostAlloc((void **)&E->Hh, sizeof(ds4h_mapped), cudaHostAllocMapped) == cudaSuccess;
        if (!ok) E->Hh = NULL;
    }
    ok = ok && cudaHostGetDevicePointer((void **)&E->Hd, E->Hh, 0) == cudaSuccess;
    ok = ok && host_alloc((void **)&E->st_desc, E->cap_slots * sizeof(ds4h_record)) == cudaSuccess;
    ok = ok && host_alloc((void **)&E->st_pay, E->cap_bytes) == cudaSuccess;
    ok = ok && cudaStreamCreateWithFlags(&E->drain, cudaStreamNonBlocking) == cudaSuccess;
    if (!ok) {
        snprintf(err, errlen, "DS4_HOOKS: cannot allocate the hook rings (%llu + %llu bytes of device memory, "
                 "as much pinned): %s", (unsigned long long)E->cap_bytes,
                 (unsigned long long)(E->cap_slots * sizeof(ds4h_record)), cudaGetErrorString(cudaGetLastError()));
        ds4h_emitter_free(E);
        return -1;
    }
    const cudaError_t se = ds4_side_open(&E->side, "the hook emitter");
    if (se != cudaSuccess || !(E->hq = ds4h_holdq_new(ds4h_write_cb, E))) {
        snprintf(err, errlen, "DS4_HOOKS: %s", se != cudaSuccess ? "cannot create the producers' stream and events"
                                                                 : "out of host memory for the hold queue");
        if (se != cudaSuccess) snprintf(err + strlen(err), errlen - strlen(err), ": %s", cudaGetErrorString(se));
        ds4h_emitter_free(E);
        return -1;
    }
    memset(E->Hh, 0, sizeof(ds4h_mapped));
    DS4_CUDA_CHECK(cudaMemsetAsync(E->D, 0, sizeof(ds4h_heads), ds4_current_stream()));
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(load time): the heads are zero */
    if (pthread_create(&E->thr, NULL, ds4h_drain_main, E) != 0) {
        snprintf(err, errlen, "DS4_HOOKS: cannot start the drain thread: %s", strerror(errno));
        ds4h_emitter_free(E);
        return -1;
    }
    E->thr_started = true;
    S->hk = E;
    return 0;
}

static ds4h_put_args ds4h_args(const ds4h_emitter *E, const ds4h_put *p) {
    ds4h_put_args a;
    memset(&a, 0, sizeof a);
    a.D = E->D; a.H = E->Hd; a.ring = E->ring; a.pay = (unsigned int *)E->pay;
    a.cap_slots = E->cap_slots; a.cap_words = E->cap_bytes / 4; a.drop = E->drop;
    a.step = p->step;
    a.src = (const unsigned int *)p->src;
    a.s0 = p->s0; a.s1 = p->s1;
    a.hook = (unsigned int)p->hook; a.dtype = (unsigned int)p->dtype; a.ndim = (unsigned int)p->ndim;
    a.d0 = p->d0; a.d1 = p->d1; a.d2 = p->d2;
    a.layer = p->layer;
    a.pos_add = p->pos_add;
    a.dyn = p->dyn; a.W = p->W; a.ratio = p->ratio; a.k = p->k;
    return a;
}

static void ds4h_launch_put(ds4h_put_batch *b) {
    DS4_LAUNCH(k_hook_put, 1, DS4H_PUT_THREADS, 0, *b);
}

/* One record: rows of at most a quarter of the ring per record, so any prompt streams
 * through; one block up to DS4H_ONE_BLOCK bytes, a reservation and a grid above. */
static void ds4h_put_one(ds4h_emitter *E, const ds4h_put *p) {
    ds4h_put_batch b;
    memset(&b, 0, sizeof b);
    b.n = 1;
    b.a[0] = ds4h_args(E, p);
    if (p->dyn) {               /* attn_probs: one token's [H][rows + 1]; hooks_open sized the ring for it */
        const unsigned long long most = ((unsigned long long)p->d0 * (unsigned long long)p->s0 * 4ull + 7ull) & ~7ull;
        ds4h_room(E, most, 1);
        ds4h_launch_put(&b);
        ds4h_produced(E, most);
        return;
    }
    ds4h_put_args &a = b.a[0];
    const unsigned long long row = (unsigned long long)p->d1 * p->d2 * 4ull;
    unsigned long long per = row ? (E->cap_bytes / 4) / row : p->d0;
    if (per < 1) per = 1;
    for (unsigned long long r0 = 0; r0 < p->d0; r0 += per) {
        const unsigned long long rows = p->d0 - r0 < per ? p->d0 - r0 : per;
        a.src = (const unsigned int *)p->src + r0 * (unsigned long long)p->s0;
        a.d0 = (unsigned int)rows;
        a.pos_add = p->pos_add + (int)r0;
        const unsigned long long bytes = rows * row;
        ds4h_room(E, (bytes + 7ull) & ~7ull, 1);
        if (bytes <= DS4H_ONE_BLOCK) {
            ds4h_launch_put(&b);
        } else {
            const unsigned long long words = bytes / 4;
            unsigned long long blocks = (words + DS4H_COPY_THREADS * 4 - 1) / (DS4H_COPY_THREADS * 4);
            if (blocks > 4u * (unsigned)g_cuda.n_sm) blocks = 4u * (unsigned)g_cuda.n_sm;
            DS4_LAUNCH(k_hook_reserve, 1, 32, 0, a);
            DS4_LAUNCH(k_hook_copy, (unsigned)blocks, DS4H_COPY_THREADS, 0, a);
        }
        ds4h_produced(E, bytes);
    }
}

/* n records made at the same point of the step: one launch when they are small together (a
 * decode step's), so a step pays one node for them; otherwise one at a time. */
void cuda_hook_put(const ds4h_put *p, int n) {
    ds4_session *S = sess();
    ds4h_emitter *E = S->hk;
    if (!E) {
        ds4_fatal("hook_put with no emitter open (ds4_gpu.h hooks_open)");
    }
    unsigned long long total = 0;
    bool small = n >= 1 && n <= DS4H_PUT_MAX;
    for (int i = 0; i < n && small; i++) {
        const unsigned long long b = (unsigned long long)p[i].d0 * p[i].d1 * p[i].d2 * 4ull;
        total += (b + 7ull) & ~7ull;
        small = !p[i].dyn;
    }
    ds4_side_fork(&E->side);
    if (n == 1 || !small || total > DS4H_ONE_BLOCK || total > E->cap_bytes / 4) {
        for (int i = 0; i < n; i++) ds4h_put_one(E, &p[i]);
    } else {
        ds4h_put_batch b;
        memset(&b, 0, sizeof b);
        b.n = n;
        for (int i = 0; i < n; i++) {
            b.a[i] = ds4h_args(E, &p[i]);
            if ((uint64_t)p[i].d0 * p[i].d1 * p[i].d2 > (uint64_t)p[b.big].d0 * p[b.big].d1 * p[b.big].d2) b.big = i;
        }
        ds4h_room(E, total, (unsigned long long)n);
        ds4h_launch_put(&b);
        ds4h_produced(E, total);
    }
    ds4_side_unfork(&E->side);
}

void cuda_hooks_join(void) {
    ds4_session *S = sess();
    if (S->hk) ds4_side_join(&S->hk->side);
}

void cuda_hooks_publish(void) {
    ds4_session *S = sess();
    if (S->hk) ds4h_launch_publish(S->hk);
}

void cuda_hooks_sink(void (*fn)(void *user, const ds4h_record *r, const void *payload), void *user) {
    ds4_session *S = sess();
    ds4h_emitter *E = S->hk;
    if (!E) return;
    ds4h_emitter_flush(S);              /* the records in flight go to the sink they were made under */
    __atomic_store_n(&E->sink, (void (*)(void *, const ds4h_record *, const void *))NULL, __ATOMIC_RELEASE);
    E->sink_user = user;
    __atomic_store_n(&E->sink, fn, __ATOMIC_RELEASE);
}

void cuda_hooks_stats(ds4_hooks_stats *st, int flush) {
    ds4_session *S = sess();
    memset(st, 0, sizeof *st);
    ds4h_emitter *E = S->hk;
    if (!E) return;
    if (flush) ds4h_emitter_flush(S);
    ds4h_heads d;
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(step result): counters, between steps */
    DS4_CUDA_CHECK(cudaMemcpy(&d, E->D, sizeof d, cudaMemcpyDeviceToHost));   /* NOTE(step result): the same */
    st->rejected = ds4h_holdq_rejected(E->hq);
    st->produced = d.seq - st->rejected;
    st->dropped = d.dropped;
    st->waits = d.waits + E->room_waits;   /* on the device (a replay's producers) and on the host */
    st->written = __atomic_load_n(&E->written, __ATOMIC_RELAXED);
    st->gaps = __atomic_load_n(&E->gaps, __ATOMIC_RELAXED);
    st->payload_bytes = __atomic_load_n(&E->bytes, __ATOMIC_RELAXED);
    st->batches = __atomic_load_n(&E->batches, __ATOMIC_RELAXED);
    st->copy_seconds = (double)__atomic_load_n(&E->copy_ns, __ATOMIC_RELAXED) * 1e-9;
    st->drain_syncs = g_n_hook_sync;
    st->err = __atomic_load_n(&E->err, __ATOMIC_ACQUIRE);
}

/* A speculative check begins: a window opens at the publication of everything before it
 * (waiting, should DS4H_WINDOWS be open or not yet passed, for the drain to pass one). */
void cuda_hooks_hold(void) {
    ds4_session *S = sess();
    ds4h_emitter *E = S->hk;
    if (!E) return;
    const unsigned long long from = ds4h_publish_wait(E);
    while (ds4h_holdq_open(E->hq, from) != 0) {
        struct timespec ts = { 0, 50000 };
        nanosleep(&ts, NULL);
    }
}

/* The check's rows below pos_end are the sequence's: its window closes at the publication of
 * everything the check made. */
void cuda_hooks_commit(int pos_end) {
    ds4_session *S = sess();
    ds4h_emitter *E = S->hk;
    if (!E) return;
    ds4h_holdq_close(E->hq, ds4h_publish_wait(E), pos_end);
}

/* The emitter's end (session_free): the last publication, the drain to its end, a gap record
 * for drops after the last record written, one line about drops or a failed write. */
void ds4h_emitter_close(ds4_session *S) {
    ds4h_emitter *E = S->hk;
    if (!E) return;
    void *prev = cuda_session_bind(S);
    ds4h_launch_publish(E);
    g_n_stream_sync++;
    DS4_CUDA_CHECK(cudaStreamSynchronize(ds4_current_stream()));   /* NOTE(load time): a context ends */
    __atomic_store_n(&E->stop, 1, __ATOMIC_RELEASE);
    if (E->thr_started) pthread_join(E->thr, NULL);
    ds4h_heads d;
    DS4_CUDA_CHECK(cudaMemcpy(&d, E->D, sizeof d, cudaMemcpyDeviceToHost));   /* NOTE(load time): the same */
    if (d.gap_n) {
        ds4h_record g = d.gap;
        g.flags = DS4H_FLAG_GAP;
        g.ndim = 1;
        g.shape[0] = (uint32_t)d.gap_n; g.shape[1] = g.shape[2] = g.shape[3] = 1;
        g.nbytes = 0;
        g.seq -= ds4h_holdq_rejected(E->hq);       /* numbered as the records written before it */
        ds4h_write_record(E, &g, NULL);
    }
    if (d.dropped)
        fprintf(stderr, "ds4: DS4_HOOKS_POLICY=drop: %llu of %llu records dropped; %s marks each run of them with a "
                "gap record\n", d.dropped, d.seq - ds4h_holdq_rejected(E->hq), E->path);
    if (E->err)
        fprintf(stderr, "ds4: DS4_HOOKS_OUT: writing %s failed: %s (%llu records not written)\n", E->path,
                strerror(E->err), E->lost_io);
    S->hk = NULL;
    ds4h_emitter_free(E);
    cuda_session_bind(prev);
}
