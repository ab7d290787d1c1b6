/* ds4_bench.c -- decode and prefill throughput of ds4 on one backend, and the
 * decode step that scripts/kernel_report.sh profiles.
 *
 *   ds4_bench --model tiny|small|flash16|flash-q2|...[@EXPERTS][/CTX]|FILE [--type q8_0] [--backend cuda|cpu]
 *             [--reps 5] [--decode 32] [--decode-after 512] [--prefill 512,4096] [--no-warmup] [--ubatch U1,... [--ubatch-prompt N]]
 *             [--copy-bw GBps] [--tc-peak TFLOPS] [--threads N]
 *             [--profile-step [--profile-prefill] [--profile-warmup 8] [--profile-timed 16]]      (CUDA builds)
 *
 * Synthetic configs are built in memory from the seed (no file), through the
 * same GGUF parser and weight upload as a file would take.  For each prefill
 * length: one warm-up, then --reps timed prefills (context reset between
 * them).  Decode: after a 512-token prefill and 4 warm-up steps, --reps runs
 * of --decode steps; tok/s is the median over runs.  Weight bytes per decoded
 * token are what one step must stream (dense weights + k of E experts); with
 * --copy-bw (device copy bandwidth, read+write, from bench/bandwidth) the
 * achieved fraction is printed.  On CUDA the kernel launches and the host
 * time spent launching them are counted over one timed run and reported per
 * token.  A prefill's line also gives its TFLOP/s (ds4_model_prefill_flops: the weights' products
 * and the attention, 2 per multiply-add) and, with --tc-peak (the device's measured tensor-core
 * peak, from bench/mma_peak), the fraction of it.
 * Output: human lines plus one `RESULT key=value ...` line per metric.
 * --reps 0 skips the throughput runs (decode and prefill) altogether.
 *
 * --profile-step (CUDA backend only) runs after the throughput runs: a
 * prefill of the FIRST --prefill length, --profile-warmup decode steps (they
 * take every one-time cost out of the way, such as lazy module loading), --profile-timed decode steps each timed with
 * the host clock (median -> `RESULT ... metric=step_wall_ms`), and then
 * exactly one more decode step (ds4_eval with n = 1) between
 * cudaProfilerStart() and cudaProfilerStop().  Under
 * `ncu --profile-from-start off` only that step's kernels are profiled;
 * without a profiler the bracket costs nothing.  The launches of that step
 * (ds4_ctx_stats) are printed as `metric=profiled_step_launches`, to check
 * the profiler's kernel count against.  It measures nothing by itself beyond
 * the host-timed steps: scripts/kernel_report.sh runs it under ncu and turns
 * the kernel times into a table.  Quick profiled run:
 *
 *   ds4_bench --model flash16 --reps 0 --prefill 512 --profile-step
 *
 * --profile-prefill makes the profiled unit a prefill instead: one untimed prefill of the
 * first --prefill length, --profile-timed more timed (median -> step_wall_ms), then one
 * bracketed (context reset before each, so every one starts at position 0).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../ds4.h"
#include "../ds4_gpu.h"
#include "bench_util.h"

#ifdef DS4_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#endif

static void fail(const char *what, const char *err) {
    fprintf(stderr, "ds4_bench: %s: %s\n", what, err);
    exit(1);
}

static void usage(FILE *f) {
    fprintf(f, "usage: ds4_bench --model tiny|small|flash16|FILE [--type T] [--backend cuda|cpu] [--reps N]\n"
               "                 [--decode N] [--decode-after P] [--prefill L1,L2,...] [--no-warmup] [--ubatch U1,... [--ubatch-prompt N]] [--copy-bw GBps] [--tc-peak TFLOPS] [--threads N]\n"
               "                 [--profile-step [--profile-prefill] [--profile-warmup N] [--profile-timed N]]\n");
}

int main(int argc, char **argv) {
    const char *model = "tiny", *type = NULL, *backend = NULL, *prefill_list = "512,4096";
    int reps = 5, n_decode = 32, threads = 0, decode_after = 512, warmup = 1;
    const char *ubatch_list = NULL;
    int ubatch_prompt = 16384;
    int profile_step = 0, profile_prefill = 0, prof_warmup = 8, prof_timed = 16;
    double copy_bw = 0.0, tc_peak = 0.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--profile-step")) { profile_step = 1; continue; }   /* the flags without a value */
        if (!strcmp(a, "--profile-prefill")) { profile_prefill = 1; continue; }
        if (!strcmp(a, "--no-warmup")) { warmup = 0; continue; }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!v) { fprintf(stderr, "ds4_bench: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--type")) type = v;
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--reps")) reps = atoi(v);
        else if (!strcmp(a, "--decode")) n_decode = atoi(v);
        else if (!strcmp(a, "--decode-after")) decode_after = atoi(v);
        else if (!strcmp(a, "--ubatch")) ubatch_list = v;
        else if (!strcmp(a, "--ubatch-prompt")) ubatch_prompt = atoi(v);
        else if (!strcmp(a, "--prefill")) prefill_list = v;
        else if (!strcmp(a, "--copy-bw")) copy_bw = atof(v);
        else if (!strcmp(a, "--tc-peak")) tc_peak = atof(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--profile-warmup")) prof_warmup = atoi(v);
        else if (!strcmp(a, "--profile-timed")) prof_timed = atoi(v);
        else { fprintf(stderr, "ds4_bench: unknown option %s\n", a); usage(stderr); return 2; }
        i++;
    }
    if (reps < 0 || n_decode < 1) { fprintf(stderr, "ds4_bench: --reps must be >= 0 and --decode >= 1\n"); return 2; }
    if (prof_warmup < 0 || prof_timed < 1) {
        fprintf(stderr, "ds4_bench: --profile-warmup must be >= 0 and --profile-timed >= 1\n");
        return 2;
    }
    if (profile_prefill && !profile_step) { fprintf(stderr, "ds4_bench: --profile-prefill goes with --profile-step\n"); return 2; }
#ifndef DS4_CUDA
    if (profile_step) { fprintf(stderr, "ds4_bench: --profile-step needs a CUDA build (make cuda)\n"); return 2; }
#endif
    if (threads > 0) ds4_cpu_set_threads(threads);
    setvbuf(stdout, NULL, _IOLBF, 0);   /* partial results survive a time limit */
    const int fill_threads = threads > 0 ? threads : (int)sysconf(_SC_NPROCESSORS_ONLN);

    const ds4_backend *be = ds4_backend_cpu();
#ifdef DS4_CUDA
    if (!backend || !strcmp(backend, "cuda")) be = ds4_backend_cuda();
#endif
    if (backend && strcmp(backend, be->name) != 0) fail("backend", "not available in this build");
    if (profile_step && strcmp(be->name, "cuda") != 0) fail("--profile-step", "needs the cuda backend");

    char err[1024];
    double t0 = now_s();
    ds4_model *m;
    if (ds4_synth_config_ok(model)) {   /* a synthetic config (NAME or NAME@EXPERTS), built in memory */
        const char *ty = type ? type : (!strncmp(model, "flash16", 7) ? "q8_0" : "f32");
        int wt = ds4_parse_wtype(ty);
        if (wt < 0) fail("--type", ty);
        m = ds4_synth_open(model, 1, wt, fill_threads, err, sizeof(err));
    } else {
        m = ds4_model_open(model, err, sizeof(err));
    }
    if (!m) fail("model", err);
    const double t_synth = now_s() - t0;
    ds4_model_describe(m, stderr);

    /* prefill lengths */
    int pl[8], n_pl = 0, max_p = 512;
    for (const char *p = prefill_list; *p && n_pl < 8;) {
        pl[n_pl] = atoi(p);
        if (pl[n_pl] > max_p) max_p = pl[n_pl];
        n_pl++;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    /* the profiled step follows a prefill of the first length */
    const int prof_p = n_pl > 0 ? pl[0] : 512;
    if (profile_step && prof_p < 1) fail("--prefill", "the first length (the profiled step's prefill) must be >= 1");
    if (profile_step && reps == 0) max_p = prof_p;   /* no throughput runs: size the context for this one */
    const int V = ds4_model_n_vocab(m);
    const int tail_dec = n_decode + 4, tail_prof = prof_warmup + prof_timed + 1;
    const int n_ctx = max_p + (tail_dec > tail_prof ? tail_dec : tail_prof) + 8;
    t0 = now_s();
    ds4_ctx *c = ds4_ctx_new(m, be, n_ctx, max_p, err, sizeof(err));
    if (!c) fail("context", err);
    const double t_upload = now_s() - t0;
    printf("model %s: %.2f GB of weights, built in %.1f s, uploaded to %s in %.1f s\n", model,
           ds4_model_weight_bytes(m) / 1e9, t_synth, be->name, t_upload);

    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n_ctx);
    for (int i = 0; i < n_ctx; i++) tok[i] = (int32_t)((i * 2654435761u) % (unsigned)V);
    float *logits = malloc(sizeof(float) * (size_t)V);
    int n_v = reps > n_decode ? reps : n_decode;
    if (n_v < prof_timed) n_v = prof_timed;
    double *v = malloc(sizeof(double) * (size_t)n_v);

    if (reps > 0) {
        /* decode: after a --decode-after-token prefill (default 512, at most the longest --prefill) */
        const int P0 = max_p < decode_after ? max_p : decode_after < 1 ? 1 : decode_after;
        const size_t bytes_tok = ds4_model_decode_bytes(m);
        double launches_tok = 0, launch_s_tok = 0;
        ds4_backend_stats ds, warm;
        memset(&ds, 0, sizeof ds);
        memset(&warm, 0, sizeof warm);
        for (int r = warmup ? -1 : 0; r < reps; r++) {      /* r = -1 is the warm-up */
            ds4_ctx_reset(c);
            if (ds4_eval(c, tok, P0, logits, 0, err, sizeof(err)) != 0) fail("prefill", err);
            for (int w = 0; w < 4; w++)
                if (ds4_eval(c, tok + P0 + w, 1, logits, 0, err, sizeof(err)) != 0) fail("decode", err);
            if (r == 0) {
                ds4_ctx_stats(c, &warm, 1);      /* the prefill and warm-up steps: captures */
                ds4_ctx_stats(c, &ds, 1);
            }
            double s = now_s();
            for (int j = 0; j < n_decode; j++)
                if (ds4_eval(c, tok + P0 + 4 + j, 1, logits, 0, err, sizeof(err)) != 0) fail("decode", err);
            const double dt = now_s() - s;
            if (r == 0) {
                ds4_ctx_stats(c, &ds, 0);
                launches_tok = (double)ds.launches / n_decode;
                launch_s_tok = ds.launch_seconds / n_decode;
            }
            if (r >= 0) v[r] = n_decode / dt;
        }
        const double tps = median(v, reps);
        const double gbs = bytes_tok * tps / 1e9;
        printf("decode: median %.2f tok/s (%.3f ms/token, %d reps x %d tokens after a %d-token prefill)\n",
               tps, 1e3 / tps, reps, n_decode, P0);
        printf("decode: %.3f GB of weights per token -> %.1f GB/s", bytes_tok / 1e9, gbs);
        if (copy_bw > 0) printf(" = %.1f%% of the %.0f GB/s copy bandwidth", 100.0 * gbs / copy_bw, copy_bw);
        printf("\n");
        printf("RESULT model=%s backend=%s metric=decode_tok_s value=%.3f\n", model, be->name, tps);
        printf("RESULT model=%s backend=%s metric=decode_weight_GBps value=%.1f bytes_per_token=%zu\n",
               model, be->name, gbs, bytes_tok);
        if (copy_bw > 0)
            printf("RESULT model=%s backend=%s metric=decode_bw_fraction value=%.3f copy_bw_GBps=%.0f\n",
                   model, be->name, gbs / copy_bw, copy_bw);
        if (launches_tok > 0 || warm.captures || ds.replays || ds.fallbacks) {
            /* a replayed graph may issue no launch of its own: the counters still count */
            printf("decode: %.0f kernel launches per token, %.1f us of host time launching them per token\n",
                   launches_tok, launch_s_tok * 1e6);
            printf("RESULT model=%s backend=%s metric=launches_per_token value=%.0f host_launch_us_per_token=%.1f\n",
                   model, be->name, launches_tok, launch_s_tok * 1e6);
            /* what stage 1 of patches/series promises: no allocation and one wait per step */
            printf("decode: over %d steps %llu device allocations, %llu frees, %llu device syncs, "
                   "%llu stream syncs\n", n_decode, (unsigned long long)ds.mallocs, (unsigned long long)ds.frees,
                   (unsigned long long)ds.device_syncs, (unsigned long long)ds.stream_syncs);
            printf("RESULT model=%s backend=%s metric=decode_waits steps=%d mallocs=%llu frees=%llu device_syncs=%llu "
                   "stream_syncs=%llu\n", model, be->name, n_decode, (unsigned long long)ds.mallocs,
                   (unsigned long long)ds.frees, (unsigned long long)ds.device_syncs,
                   (unsigned long long)ds.stream_syncs);
            if (warm.captures || ds.replays || ds.fallbacks) {
                /* DS4_CUDA_GRAPHS=1 (patches/series stage 2) */
                const double per = warm.captures ? 1.0 / (double)warm.captures : 0.0;
                printf("decode: graphs: the warm-up captured %llu (%.2f ms capture + %.2f ms instantiate per graph), "
                       "%llu held with %llu nodes and %.1f MiB; the timed run: %llu captures, %llu replays, "
                       "%llu eager fallbacks; programmatic dependent launch %s\n", (unsigned long long)warm.captures, warm.capture_ms * per,
                       warm.instantiate_ms * per, (unsigned long long)ds.graphs, (unsigned long long)ds.graph_nodes,
                       (double)ds.graph_bytes / (1024.0 * 1024.0), (unsigned long long)ds.captures,
                       (unsigned long long)ds.replays, (unsigned long long)ds.fallbacks, ds.graph_pdl ? "on" : "off");
                printf("RESULT model=%s backend=%s metric=graphs warmup_captures=%llu capture_ms_per_graph=%.3f "
                       "instantiate_ms_per_graph=%.3f held=%llu nodes=%llu bytes=%llu timed_captures=%llu "
                       "timed_replays=%llu timed_fallbacks=%llu pdl=%llu\n", model, be->name,
                       (unsigned long long)warm.captures, warm.capture_ms * per, warm.instantiate_ms * per,
                       (unsigned long long)ds.graphs, (unsigned long long)ds.graph_nodes,
                       (unsigned long long)ds.graph_bytes, (unsigned long long)ds.captures,
                       (unsigned long long)ds.replays, (unsigned long long)ds.fallbacks,
                       (unsigned long long)ds.graph_pdl);
            }
        }
    }

    for (int i = 0; i < n_pl && reps > 0; i++) {
        const int P = pl[i];
        if (P > max_p || P < 1) continue;
        for (int r = warmup ? -1 : 0; r < reps; r++) {      /* r = -1 is the warm-up */
            ds4_ctx_reset(c);
            double s = now_s();
            if (ds4_eval(c, tok, P, logits, 0, err, sizeof(err)) != 0) fail("prefill", err);
            if (r >= 0) v[r] = now_s() - s;
        }
        const double med = median(v, reps);
        double fl[2];
        ds4_model_prefill_flops(m, 0, P, fl);
        const double tf = (fl[0] + fl[1]) / med / 1e12;
        printf("prefill %5d tokens: median %.4f s = %.1f tok/s (%d reps), %.3g TFLOP/s (%.3g GFLOP a token: weights "
               "%.1f%%, attention %.1f%%)", P, med, P / med, reps, tf, (fl[0] + fl[1]) / P / 1e9,
               100.0 * fl[0] / (fl[0] + fl[1]), 100.0 * fl[1] / (fl[0] + fl[1]));
        if (tc_peak > 0) printf(" = %.1f%% of %.0f TFLOP/s", 100.0 * tf / tc_peak, tc_peak);
        printf("\n");
        printf("RESULT model=%s backend=%s metric=prefill_tok_s prompt=%d value=%.2f\n", model, be->name, P, P / med);
        printf("RESULT model=%s backend=%s metric=prefill_tflops prompt=%d value=%.2f\n", model, be->name, P, tf);
    }

#ifdef DS4_CUDA
    if (profile_step && profile_prefill) {
        /* a warm-up prefill, host-timed prefills, then one prefill under the profiler */
        for (int j = -1; j < prof_timed; j++) {
            ds4_ctx_reset(c);
            const double s = now_s();
            if (ds4_eval(c, tok, prof_p, logits, 0, err, sizeof(err)) != 0) fail("prefill", err);
            if (j >= 0) v[j] = (now_s() - s) * 1e3;
        }
        double lo = v[0], hi = v[0];
        for (int j = 1; j < prof_timed; j++) { if (v[j] < lo) lo = v[j]; if (v[j] > hi) hi = v[j]; }
        const double pf_ms = median(v, prof_timed);
        printf("profile: prefill of %d tokens: median %.3f ms = %.1f tok/s (min %.3f, max %.3f, %d prefills, "
               "host clock)\n", prof_p, pf_ms, prof_p / (pf_ms * 1e-3), lo, hi, prof_timed);
        printf("RESULT model=%s backend=%s metric=step_wall_ms value=%.3f prefill=%d warmup=0 steps=%d "
               "min=%.3f max=%.3f unit=prefill\n", model, be->name, pf_ms, prof_p, prof_timed, lo, hi);
        ds4_backend_stats ps;
        ds4_ctx_reset(c);
        ds4_ctx_stats(c, &ps, 1);
        cudaError_t pe = cudaProfilerStart();
        if (pe != cudaSuccess) fprintf(stderr, "ds4_bench: cudaProfilerStart: %s\n", cudaGetErrorString(pe));
        const double s = now_s();
        if (ds4_eval(c, tok, prof_p, logits, 0, err, sizeof(err)) != 0) fail("prefill", err);   /* synchronizes */
        const double prof_ms = (now_s() - s) * 1e3;
        pe = cudaProfilerStop();
        if (pe != cudaSuccess) fprintf(stderr, "ds4_bench: cudaProfilerStop: %s\n", cudaGetErrorString(pe));
        ds4_ctx_stats(c, &ps, 0);
        printf("profile: the bracketed prefill made %llu kernel launches (incl. cuBLAS calls), %.1f us of host "
               "time launching them; it took %.3f ms (much longer under a profiler)\n",
               (unsigned long long)ps.launches, ps.launch_seconds * 1e6, prof_ms);
        printf("RESULT model=%s backend=%s metric=profiled_step_launches value=%llu host_launch_us=%.1f pos=0 "
               "step_ms=%.3f\n", model, be->name, (unsigned long long)ps.launches, ps.launch_seconds * 1e6, prof_ms);
    } else if (profile_step) {
        /* prefill, warm-up steps, host-timed steps, then one step under the profiler */
        ds4_ctx_reset(c);
        if (ds4_eval(c, tok, prof_p, logits, 0, err, sizeof(err)) != 0) fail("prefill", err);
        int pos = prof_p;
        for (int w = 0; w < prof_warmup; w++, pos++)
            if (ds4_eval(c, tok + pos, 1, logits, 0, err, sizeof(err)) != 0) fail("decode", err);
        for (int j = 0; j < prof_timed; j++, pos++) {
            const double s = now_s();
            if (ds4_eval(c, tok + pos, 1, logits, 0, err, sizeof(err)) != 0) fail("decode", err);
            v[j] = (now_s() - s) * 1e3;
        }
        double lo = v[0], hi = v[0];
        for (int j = 1; j < prof_timed; j++) { if (v[j] < lo) lo = v[j]; if (v[j] > hi) hi = v[j]; }
        const double step_ms = median(v, prof_timed);
        printf("profile: decode step after a %d-token prefill and %d warm-up steps: median %.3f ms "
               "(min %.3f, max %.3f, %d steps, host clock)\n", prof_p, prof_warmup, step_ms, lo, hi, prof_timed);
        printf("RESULT model=%s backend=%s metric=step_wall_ms value=%.3f prefill=%d warmup=%d steps=%d "
               "min=%.3f max=%.3f\n", model, be->name, step_ms, prof_p, prof_warmup, prof_timed, lo, hi);

        ds4_backend_stats ps;
        ds4_ctx_stats(c, &ps, 1);
        cudaError_t pe = cudaProfilerStart();
        if (pe != cudaSuccess) fprintf(stderr, "ds4_bench: cudaProfilerStart: %s\n", cudaGetErrorString(pe));
        const double s = now_s();
        if (ds4_eval(c, tok + pos, 1, logits, 0, err, sizeof(err)) != 0) fail("decode", err);   /* synchronizes */
        const double prof_ms = (now_s() - s) * 1e3;
        pe = cudaProfilerStop();
        if (pe != cudaSuccess) fprintf(stderr, "ds4_bench: cudaProfilerStop: %s\n", cudaGetErrorString(pe));
        ds4_ctx_stats(c, &ps, 0);
        const uint64_t n_launch = ps.launches;
        const double launch_s = ps.launch_seconds;
        printf("profile: the bracketed step (position %d) made %llu kernel launches (incl. cuBLAS calls), "
               "%.1f us of host time launching them; it took %.3f ms (much longer under a profiler)\n",
               pos, (unsigned long long)n_launch, launch_s * 1e6, prof_ms);
        printf("RESULT model=%s backend=%s metric=profiled_step_launches value=%llu host_launch_us=%.1f pos=%d "
               "step_ms=%.3f\n", model, be->name, (unsigned long long)n_launch, launch_s * 1e6, pos, prof_ms);
    }
#endif

    ds4_hooks_stats hs;
    if (ds4_ctx_hooks_stats(c, &hs) == 0) {
        /* DS4_HOOKS (patches/series stage 3): what the emitter moved during the whole run */
        printf("hooks: %llu records produced, %llu written, %llu dropped, %llu producer waits, %.3f GB of payload "
               "in %llu drain batches, %.1f GB/s while copying\n", (unsigned long long)hs.produced,
               (unsigned long long)hs.written, (unsigned long long)hs.dropped, (unsigned long long)hs.waits,
               hs.payload_bytes / 1e9, (unsigned long long)hs.batches,
               hs.copy_seconds > 0 ? hs.payload_bytes / hs.copy_seconds / 1e9 : 0.0);
        printf("RESULT model=%s backend=%s metric=hooks produced=%llu written=%llu dropped=%llu waits=%llu "
               "payload_bytes=%llu batches=%llu copy_GBps=%.2f\n", model, be->name, (unsigned long long)hs.produced,
               (unsigned long long)hs.written, (unsigned long long)hs.dropped, (unsigned long long)hs.waits,
               (unsigned long long)hs.payload_bytes, (unsigned long long)hs.batches,
               hs.copy_seconds > 0 ? hs.payload_bytes / hs.copy_seconds / 1e9 : 0.0);
    }
    /* --ubatch U1,U2,...: a --ubatch-prompt-token prefill (default 16384) in chunks of each U
     * (DS4_UBATCH, read when a context is made: one context per U, the weights uploaded once) */
    const int up = ubatch_prompt < 1 ? 1 : ubatch_prompt > n_ctx ? n_ctx : ubatch_prompt;
    for (const char *p = ubatch_list; p && *p && reps > 0;) {
        const int ub = atoi(p);
        p = strchr(p, ',');
        p = p ? p + 1 : NULL;
        if (ub < 1) continue;
        char num[32];
        snprintf(num, sizeof num, "%d", ub);
        setenv("DS4_UBATCH", num, 1);
        ds4_ctx *cu = ds4_ctx_new(m, be, up + 8, up, err, sizeof(err));
        if (!cu) fail("context (--ubatch)", err);
        for (int r = warmup ? -1 : 0; r < reps; r++) {
            ds4_ctx_reset(cu);
            double s = now_s();
            if (ds4_eval(cu, tok, up, logits, 0, err, sizeof(err)) != 0) fail("prefill (--ubatch)", err);
            if (r >= 0) v[r] = now_s() - s;
        }
        const double med = median(v, reps);
        printf("prefill %5d tokens in chunks of %d: median %.4f s = %.1f tok/s (%d reps)\n", up, ub, med, up / med, reps);
        printf("RESULT model=%s backend=%s metric=prefill_tok_s prompt=%d ubatch=%d value=%.2f\n", model, be->name,
               up, ub, up / med);
        ds4_ctx_free(cu);
    }
    free(v); free(logits); free(tok);
#ifdef DS4_CUDA
    if (!strcmp(be->name, "cuda")) {
        /* a context allocates everything when it is made: what is in use now is the peak */
        size_t free_b = 0, total = 0;
        if (cudaMemGetInfo(&free_b, &total) == cudaSuccess) {
            printf("device memory in use: %.2f GB of %.2f GB (weights %.2f GB)\n", (total - free_b) / 1e9, total / 1e9,
                   ds4_model_weight_bytes(m) / 1e9);
            printf("RESULT model=%s backend=%s metric=device_memory used_GB=%.3f total_GB=%.3f batch=%d n_ctx=%d\n",
                   model, be->name, (total - free_b) / 1e9, total / 1e9, ds4_ctx_max_batch(c), n_ctx);
        }
    }
#endif
    ds4_ctx_free(c);
    ds4_model_close(m);
    return 0;
}
