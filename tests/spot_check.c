/* spot_check.c -- CUDA against the CPU backend on a synthetic model at full size,
 * without writing the model to disk.
 *
 *   spot_check [--model flash16] [--type q8_0] [--seed 1] [--prompt 8] [-n 8] [--tol 5e-5]
 *              [--dump-cuda FILE] [--cuda-only]
 *
 * What it is.  The flash16 spot check of scripts/gpu-check.sh: the Flash-shaped
 * model (43 layers, hidden 4096, 64 heads x 512, 16 experts, vocab 129280,
 * Q8_0) is built twice in host memory from the same seed (the same bytes
 * `ds4 synth` writes), once for each backend, because a model's weights are
 * bound to the backend of its first context.  The CPU backend (the
 * specification) prefills --prompt token ids and decodes -n greedy steps; the
 * CUDA backend prefills the same ids and is teacher-forced on the CPU's
 * tokens.  Every row's logits are compared: max |dlogit| must stay within
 * --tol (tests/test_gpu.py's GPU_TOL, 5e-5, justified there) and every row's
 * argmax must agree.  That covers every decode and prefill kernel path at the
 * real sizes, which the small test models (K < 1024) never reach.
 *
 * What it is not.  Not a benchmark, and not an oracle test: both sides are
 * ds4.  It needs about twice the model's size in host memory (52 GB for
 * flash16) and a GPU; without a GPU it prints "skipped: no GPU" and exits 0.
 * Output: one line per phase, then `spot: PASS|FAIL ...`; exit 0 on PASS.
 * --dump-cuda FILE also writes the CUDA rows' logits to FILE ((prompt + n) x vocab floats,
 * raw little-endian f32, row after row): scripts/gpu-check.sh series byte-compares them
 * across builds of the patch series.  --cuda-only skips the CPU side (no comparison, one model
 * build): the CUDA backend prefills and decodes -n greedy steps, for byte-comparing long runs
 * (DS4_CUDA_GRAPHS=1 against eager, over 300 steps) where the CPU reference would take hours.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ds4.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what, const char *err) {
    fprintf(stderr, "spot_check: %s: %s\n", what, err);
    exit(2);
}

/* Prefill `prompt`, then n steps: greedy (force == NULL) or forced on force[j].
 * Returns logits [(P + n)][V]; the fed tokens go to fed[P + n]. */
static float *run(ds4_model *m, const ds4_backend *be, const int32_t *prompt, int P, int n, const int32_t *force,
                  int32_t *fed) {
    char err[1024];
    const int V = ds4_model_n_vocab(m);
    ds4_ctx *c = ds4_ctx_new(m, be, P + n + 1, P, err, sizeof err);
    if (!c) die("context", err[0] ? err : "backend failed to start");
    float *lg = malloc(sizeof(float) * (size_t)(P + n) * V);
    if (!lg) die("memory", "logits");
    if (ds4_eval(c, prompt, P, lg, 1, err, sizeof err) != 0) die("prefill", err);
    memcpy(fed, prompt, sizeof(int32_t) * (size_t)P);
    for (int j = 0; j < n; j++) {
        const int32_t tok = force ? force[j] : ds4_argmax(lg + (size_t)(P + j - 1) * V, V);
        fed[P + j] = tok;
        if (ds4_eval(c, &tok, 1, lg + (size_t)(P + j) * V, 0, err, sizeof err) != 0) die("decode", err);
    }
    ds4_ctx_free(c);
    return lg;
}

/* P prompt ids, the first and last vocabulary rows included. */
static int32_t *make_prompt(int P, int V) {
    int32_t *p = malloc(sizeof(int32_t) * (size_t)P);
    if (!p) die("memory", "prompt");
    for (int i = 0; i < P; i++)
        p[i] = i == 0 ? 0 : i == 1 ? V - 1 : (int32_t)(((uint32_t)i * 2654435761u) % (uint32_t)V);
    return p;
}

/* --dump-cuda: rows x V floats, raw.  0, or 2 with one line. */
static int write_dump(const char *path, const float *l, int rows, int V) {
    FILE *f = fopen(path, "wb");
    const size_t nf = (size_t)rows * (size_t)V;
    if (!f || fwrite(l, sizeof(float), nf, f) != nf || fclose(f) != 0) {
        fprintf(stderr, "spot_check: cannot write %s\n", path);
        return 2;
    }
    printf("spot: CUDA logits written to %s (%zu floats)\n", path, nf);
    return 0;
}

int main(int argc, char **argv) {
    const char *model = "flash16", *type = "q8_0", *dump = NULL;
    int seed = 1, P = 8, n = 8, cuda_only = 0;
    double tol = 5e-5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--cuda-only")) { cuda_only = 1; continue; }   /* the one flag without a value */
        if (!v) { fprintf(stderr, "spot_check: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--type")) type = v;
        else if (!strcmp(a, "--seed")) seed = atoi(v);
        else if (!strcmp(a, "--prompt")) P = atoi(v);
        else if (!strcmp(a, "-n")) n = atoi(v);
        else if (!strcmp(a, "--tol")) tol = atof(v);
        else if (!strcmp(a, "--dump-cuda")) dump = v;
        else { fprintf(stderr, "spot_check: unknown option %s\n", a); return 2; }
        i++;
    }
    if (P < 1 || n < 1 || !(tol > 0)) { fprintf(stderr, "spot_check: --prompt, -n and --tol must be positive\n"); return 2; }
    const int wt = ds4_parse_wtype(type);
    if (wt < 0) die("--type", type);
    setvbuf(stdout, NULL, _IOLBF, 0);
#ifndef DS4_CUDA
    printf("skipped: no GPU (not a CUDA build)\n");
    return 0;
#else
    const ds4_backend *cuda = ds4_backend_cuda();
    if (cuda->init() != 0) { printf("skipped: no GPU\n"); return 0; }
    const int threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    char err[1024];
    double t0 = now_s();
    ds4_model *mc = NULL;
    if (cuda_only) {
        ds4_model *m1 = ds4_synth_open(model, (uint64_t)seed, wt, threads, err, sizeof err);
        if (!m1) die("model", err);
        printf("spot: %s (%s, seed %d) built in %.1f s, %.2f GB (CUDA only)\n", model, type, seed, now_s() - t0,
               ds4_model_weight_bytes(m1) / 1e9);
        const int V1 = ds4_model_n_vocab(m1);
        int32_t *pr = make_prompt(P, V1), *fed = malloc(sizeof(int32_t) * (size_t)(P + n));
        t0 = now_s();
        float *l1 = run(m1, cuda, pr, P, n, NULL, fed);
        printf("spot: CUDA prefill %d + %d greedy steps in %.1f s\n", P, n, now_s() - t0);
        const int rc = dump ? write_dump(dump, l1, P + n, V1) : 0;
        free(l1); free(pr); free(fed);
        ds4_model_close(m1);
        return rc;
    }
    mc = ds4_synth_open(model, (uint64_t)seed, wt, threads, err, sizeof err);
    if (!mc) die("model", err);
    ds4_model *mg = ds4_synth_open(model, (uint64_t)seed, wt, threads, err, sizeof err);
    if (!mg) die("model", err);
    const int V = ds4_model_n_vocab(mc);
    printf("spot: %s (%s, seed %d) built twice in %.1f s, %.2f GB each\n", model, type, seed, now_s() - t0,
           ds4_model_weight_bytes(mc) / 1e9);

    int32_t *prompt = make_prompt(P, V);
    int32_t *fed_c = malloc(sizeof(int32_t) * (size_t)(P + n)), *fed_g = malloc(sizeof(int32_t) * (size_t)(P + n));
    ds4_cpu_set_threads(threads);
    t0 = now_s();
    float *lc = run(mc, ds4_backend_cpu(), prompt, P, n, NULL, fed_c);
    printf("spot: CPU prefill %d + %d greedy steps in %.1f s\n", P, n, now_s() - t0);
    t0 = now_s();
    float *lg = run(mg, cuda, prompt, P, n, fed_c + P, fed_g);
    printf("spot: CUDA prefill %d + %d forced steps in %.1f s\n", P, n, now_s() - t0);

    if (dump && write_dump(dump, lg, P + n, V) != 0) return 2;

    double worst = 0.0;
    int worst_row = 0, argmax_bad = 0, first_bad = -1;
    for (int r = 0; r < P + n; r++) {
        const float *a = lc + (size_t)r * V, *b = lg + (size_t)r * V;
        for (int v = 0; v < V; v++) {
            const double d = fabs((double)a[v] - (double)b[v]);
            if (!(d <= worst)) { worst = d; worst_row = r; }   /* NaN counts as worst */
        }
        if (ds4_argmax(a, V) != ds4_argmax(b, V)) { argmax_bad++; if (first_bad < 0) first_bad = r; }
    }
    const int ok = worst <= tol && argmax_bad == 0;
    printf("spot: %s max |dlogit| %.3g at row %d (tol %g), argmax %s over %d rows (%d prompt + %d decode)\n",
           ok ? "PASS" : "FAIL", worst, worst_row, tol, argmax_bad ? "DIFFERS" : "identical", P + n, P, n);
    if (argmax_bad) printf("spot: argmax differs on %d rows, first row %d\n", argmax_bad, first_bad);
    free(lc); free(lg); free(prompt); free(fed_c); free(fed_g);
    ds4_model_close(mc);
    ds4_model_close(mg);
    return ok ? 0 : 1;
#endif
}
