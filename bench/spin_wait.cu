/* spin_wait.cu -- can a kernel that spins until another host thread's CUDA copy lands stop a
 * process whose main thread keeps issuing launches behind it?
 *
 * The hook emitter's shape (ds4_hooks.cu), without the engine: a producer stream P, a compute
 * stream C and a drain thread with its own stream D, all non-blocking.  Each round the main
 * thread issues, on P, a kernel that asks for room (it stores the round into pinned mapped
 * memory) and spins until the drain thread answers; the drain thread sees the request, copies
 * COPY_MB MiB device-to-host on D, waits for D, and answers.  Meanwhile the main thread issues
 * LAUNCHES tiny kernels on C, with a fork (C -> P, a tiny kernel on P) and a join (P -> C)
 * every FORK of them, as the emitter's producers fork and join: C soon waits behind the
 * spinner, and the launches pile up behind it until the host blocks in one.
 *
 * Modes:
 *   copy    the drain thread answers after its copy (the emitter's drain)
 *   nocopy  the drain thread answers at once, calling no CUDA function (the control: the
 *           spinner and the launches alone)
 *   room    as copy, but the main thread waits (polling the mapped answer, outside CUDA)
 *           for the round's answer before it issues the round's launches (ds4h_room's order)
 * A watchdog ends the process after LIMIT seconds with one line naming the round, the launch
 * and where the drain thread is; exit 3.  Exit 0: every round ended, with the time they took.
 *
 * Build: nvcc -O3 -std=c++17 -arch=sm_90 bench/spin_wait.cu -o build/spin_wait -lpthread
 * Usage: spin_wait MODE [ROUNDS (20)] [LAUNCHES (4000)] [FORK (16)] [LIMIT (20)] [COPY_MB (2)]
 */
#include <cuda_runtime.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define BENCH_NAME "spin_wait"
#include "bench_util.h"

struct mapped {
    unsigned long long req;           /* device -> host: the round a spinner asks for */
    unsigned long long pad0[7];
    unsigned long long done;          /* host -> device: the last round answered */
    unsigned long long pad1[7];
};

__global__ void k_tiny(float *x) { x[threadIdx.x] += 1.0f; }

__global__ void k_spin(mapped *m, unsigned long long round) {
    if (threadIdx.x != 0) return;
    asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(&m->req), "l"(round) : "memory");
    for (;;) {
        unsigned long long v;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(&m->done) : "memory");
        if (v >= round) break;
        __nanosleep(1000);
    }
}

static mapped *g_m;                   /* host view */
static int g_mode;                    /* 0 copy, 1 nocopy, 2 room */
static volatile int g_stop, g_round, g_launch, g_drain_in_cuda;
static void *g_src, *g_dst;
static size_t g_bytes;

static void *drain_main(void *arg) {
    (void)arg;
    cudaStream_t d;
    CHECK(cudaStreamCreateWithFlags(&d, cudaStreamNonBlocking));
    unsigned long long served = 0;
    while (!g_stop) {
        const unsigned long long r = __atomic_load_n(&g_m->req, __ATOMIC_ACQUIRE);
        if (r > served) {
            if (g_mode != 1) {
                g_drain_in_cuda = 1;
                CHECK(cudaMemcpyAsync(g_dst, g_src, g_bytes, cudaMemcpyDeviceToHost, d));
                CHECK(cudaStreamSynchronize(d));
                g_drain_in_cuda = 0;
            }
            served = r;
            __atomic_store_n(&g_m->done, r, __ATOMIC_RELEASE);
            continue;
        }
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
    }
    CHECK(cudaStreamDestroy(d));
    return NULL;
}

static void on_alarm(int sig) {
    (void)sig;
    char line[200];
    const int n = snprintf(line, sizeof line,
                           "spin_wait: stopped: round %d, launch %d of the round; the drain thread %s\n", g_round,
                           g_launch, g_drain_in_cuda ? "inside its copy or its wait" : "outside CUDA");
    if (n > 0) (void)!write(2, line, (size_t)n);
    _exit(3);
}

int main(int argc, char **argv) {
    static const char *modes[] = { "copy", "nocopy", "room" };
    if (argc < 2) {
        fprintf(stderr, "usage: spin_wait copy|nocopy|room [ROUNDS] [LAUNCHES] [FORK] [LIMIT] [COPY_MB]\n");
        return 2;
    }
    g_mode = -1;
    for (int i = 0; i < 3; i++)
        if (!strcmp(argv[1], modes[i])) g_mode = i;
    const int rounds = argc > 2 ? atoi(argv[2]) : 20, launches = argc > 3 ? atoi(argv[3]) : 4000;
    const int fork = argc > 4 ? atoi(argv[4]) : 16, limit = argc > 5 ? atoi(argv[5]) : 20;
    const int copy_mb = argc > 6 ? atoi(argv[6]) : 2;
    if (g_mode < 0 || rounds < 1 || launches < 1 || fork < 1 || limit < 1 || copy_mb < 1) {
        fprintf(stderr, "spin_wait: bad arguments (MODE copy|nocopy|room, then positive counts)\n");
        return 2;
    }
    g_bytes = (size_t)copy_mb << 20;
    CHECK(cudaHostAlloc((void **)&g_m, sizeof(mapped), cudaHostAllocMapped));
    memset(g_m, 0, sizeof(mapped));
    mapped *md;
    CHECK(cudaHostGetDevicePointer((void **)&md, g_m, 0));
    CHECK(cudaMalloc(&g_src, g_bytes));
    CHECK(cudaHostAlloc(&g_dst, g_bytes, cudaHostAllocDefault));
    float *x;
    CHECK(cudaMalloc((void **)&x, 2 * 32 * sizeof(float)));
    CHECK(cudaMemset(x, 0, 2 * 32 * sizeof(float)));
    cudaStream_t c, p;
    CHECK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&p, cudaStreamNonBlocking));
    cudaEvent_t evf, evj;
    CHECK(cudaEventCreateWithFlags(&evf, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&evj, cudaEventDisableTiming));
    pthread_t thr;
    if (pthread_create(&thr, NULL, drain_main, NULL) != 0) {
        fprintf(stderr, "spin_wait: cannot start the drain thread\n");
        return 1;
    }
    signal(SIGALRM, on_alarm);
    alarm((unsigned)limit);
    const double t0 = now_s();
    for (int r = 1; r <= rounds; r++) {
        g_round = r;
        g_launch = 0;
        k_spin<<<1, 32, 0, p>>>(md, (unsigned long long)r);
        CHECK(cudaGetLastError());
        if (g_mode == 2) {            /* the room's order: the answer before the launches behind it */
            while (__atomic_load_n(&g_m->done, __ATOMIC_ACQUIRE) < (unsigned long long)r) {
                (void)cudaStreamQuery(p);
                struct timespec ts = { 0, 20000 };
                nanosleep(&ts, NULL);
            }
        }
        for (int j = 0; j < launches; j++) {
            g_launch = j;
            k_tiny<<<1, 32, 0, c>>>(x);
            if (j % fork == 0) {      /* a producer: fork C -> P, a kernel on P, join P -> C */
                CHECK(cudaEventRecord(evf, c));
                CHECK(cudaStreamWaitEvent(p, evf, 0));
                k_tiny<<<1, 32, 0, p>>>(x + 32);
                CHECK(cudaEventRecord(evj, p));
                CHECK(cudaStreamWaitEvent(c, evj, 0));
            }
        }
        CHECK(cudaGetLastError());
    }
    CHECK(cudaStreamSynchronize(c));
    CHECK(cudaStreamSynchronize(p));
    alarm(0);
    const double dt = now_s() - t0;
    g_stop = 1;
    pthread_join(thr, NULL);
    printf("spin_wait %s: %d rounds of %d launches (a fork every %d), %d MiB copies: ended in %.3f s\n",
           modes[g_mode], rounds, launches, fork, copy_mb, dt);
    return 0;
}
