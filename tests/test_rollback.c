/* test_rollback -- ds4_ctx_checkpoint / ds4_ctx_rollback (ds4.h, "taking positions back") on a
 * backend: the CPU's, or with `cuda` as the argument (a CUDA build) the GPU's.
 *
 * A context that ran calls it then took back must give the logits of one that never ran them,
 * byte for byte.  Each step of the test context saves a checkpoint of w = 1..4 positions, runs w
 * junk tokens in one call, takes all of them back, then feeds the step's real token alone; the
 * reference context feeds the real tokens alone.  A prompt of 40 positions and 300 steps on tiny
 * (window 32; ratio-4 compressors, 8 state slots; ratio-128, 128) cross every ring many times at
 * every phase.  On the CPU also the calls that keep some rows (a call of the real token and junk
 * after it, rolled back to keep the real one: the speculative check's case), and the MTP block's
 * own caches (DS4_PART_MTP, the head being CPU-only).  Negative control: with
 * DS4_ROLLBACK_RESTORE=0 (positions moved back, nothing restored) the logits must differ, or the
 * test would see nothing.  Also the calls' errors, and the MTP head fed from its queue on the
 * backend (ds4_mtp_queue) against the same streams through the host. */
#define _POSIX_C_SOURCE 200809L   /* setenv */
#include "ds4.h"
#include "ds4_gpu.h"           /* ds4_backend_stats */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures, passes;

static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (ok) passes++; else failures++;
}

static void die(const char *what, const char *err) {
    fprintf(stderr, "test_rollback: %s: %s\n", what, err);
    exit(1);
}

enum { P = 40, STEPS = 300 };

static uint32_t rnd(uint32_t *s) { *s = *s * 1664525u + 1013904223u; return *s >> 8; }

/* The logits of STEPS single-token steps after the prompt, into out [STEPS][V].  mode 0: nothing
 * else; 1: before each step, w junk tokens run and taken back; 2: the step's token runs in a
 * call with w - 1 junk tokens after it, which are taken back (its row kept).  Returns 0 when the
 * context could not be made. */
static int run_steps(ds4_model *m, const ds4_backend *be, const int32_t *toks, int mode, float *out) {
    char err[512];
    const int V = ds4_model_n_vocab(m);
    ds4_ctx *c = ds4_ctx_new(m, be, P + STEPS + DS4_CHECKPOINT_MAX, P, err, sizeof err);
    if (!c) die("context", err);
    float *rows = malloc(sizeof(float) * (size_t)DS4_CHECKPOINT_MAX * V);
    if (!rows) die("buffers", "out of memory");
    if (ds4_eval(c, toks, P, NULL, 0, err, sizeof err) != 0) die("prompt", err);
    uint32_t s = 99;
    for (int i = 0; i < STEPS; i++) {
        const int pos = ds4_ctx_pos(c), w = 1 + i % DS4_CHECKPOINT_MAX;
        int32_t junk[DS4_CHECKPOINT_MAX];
        for (int k = 0; k < w; k++) junk[k] = (int32_t)(rnd(&s) % (uint32_t)V);
        float *o = out + (size_t)i * V;
        if (mode == 1) {
            if (ds4_ctx_checkpoint(c, DS4_PART_TRUNK, w, err, sizeof err) != 0) die("checkpoint", err);
            if (ds4_eval(c, junk, w, rows, 1, err, sizeof err) != 0) die("junk", err);
            if (ds4_ctx_rollback(c, DS4_PART_TRUNK, pos, err, sizeof err) != 0) die("rollback", err);
        }
        if (mode == 2) {
            junk[0] = toks[P + i];
            if (ds4_ctx_checkpoint(c, DS4_PART_TRUNK, w, err, sizeof err) != 0) die("checkpoint", err);
            if (ds4_eval(c, junk, w, rows, 1, err, sizeof err) != 0) die("call", err);
            if (ds4_ctx_rollback(c, DS4_PART_TRUNK, pos + 1, err, sizeof err) != 0) die("rollback", err);
            memcpy(o, rows, sizeof(float) * V);
        } else if (ds4_eval(c, &toks[P + i], 1, o, 0, err, sizeof err) != 0) {
            die("step", err);
        }
    }
    free(rows);
    ds4_ctx_free(c);
    return 1;
}

/* The MTP head's logits of STEPS rows (token toks[i], streams h[i]), one row a call; with junk,
 * before each row w junk rows run and are taken back. */
static void run_mtp(ds4_model *m, const int32_t *toks, const float *h, int hw, int junk, float *out) {
    char err[512];
    const int V = ds4_model_n_vocab(m);
    ds4_ctx *c = ds4_ctx_new(m, ds4_backend_cpu(), STEPS + DS4_CHECKPOINT_MAX, DS4_CHECKPOINT_MAX, err, sizeof err);
    if (!c) die("context", err);
    float *rows = malloc(sizeof(float) * (size_t)DS4_CHECKPOINT_MAX * V);
    if (!rows) die("buffers", "out of memory");
    uint32_t s = 7;
    for (int i = 0; i < STEPS; i++) {
        const int pos = ds4_ctx_mtp_pos(c), w = 1 + i % DS4_CHECKPOINT_MAX;
        if (junk) {
            int32_t jt[DS4_CHECKPOINT_MAX];
            for (int k = 0; k < w; k++) jt[k] = (int32_t)(rnd(&s) % (uint32_t)V);
            if (ds4_ctx_checkpoint(c, DS4_PART_MTP, w, err, sizeof err) != 0) die("MTP checkpoint", err);
            if (ds4_mtp_eval(c, h + (size_t)((i + 5) % STEPS) * hw, jt, w, rows, 1, err, sizeof err) != 0) die("MTP junk", err);
            if (ds4_ctx_rollback(c, DS4_PART_MTP, pos, err, sizeof err) != 0) die("MTP rollback", err);
        }
        if (ds4_mtp_eval(c, h + (size_t)i * hw, &toks[i], 1, out + (size_t)i * V, 0, err, sizeof err) != 0) die("MTP", err);
    }
    free(rows);
    ds4_ctx_free(c);
}

/* The head's queue (ds4_mtp_queue, ds4_mtp_eval_queued) against ds4_mtp_eval with the same
 * streams through the host, on backend be: the prompt's rows (zeros, then the model's streams
 * of rows 0 .. P - 2), the carry (row P - 1's), then chained rows of the head's own streams; the
 * logits byte-identical.  On the CPU also the queue's refusals. */
static void mtp_queue(ds4_model *m, const ds4_backend *be, const int32_t *toks) {
    char err[512], what[160];
    const int V = ds4_model_n_vocab(m);
    int L, D, hc, k;
    ds4_model_dims(m, &L, &D, &hc, &k);
    const size_t hw = (size_t)D * hc;
    ds4_ctx *a = ds4_ctx_new(m, be, 3 * P, P, err, sizeof err), *b = ds4_ctx_new(m, be, 3 * P, P, err, sizeof err);
    if (!a || !b) die("context", err);
    float *h = calloc((size_t)(P + 1) * hw, sizeof(float)), *ref = malloc(sizeof(float) * (size_t)P * V),
          *got = malloc(sizeof(float) * (size_t)P * V);
    if (!h || !ref || !got) die("buffers", "out of memory");
    /* the prompt: a from the host (h row 0 zeros), b from the queue */
    if (ds4_eval(a, toks, P, NULL, 0, err, sizeof err) != 0 || ds4_ctx_streams(a, h + hw, P) != 0 ||
        ds4_mtp_eval(a, h, toks, P, ref, 1, err, sizeof err) != 0)
        die("head (host)", err);
    if (ds4_eval(b, toks, P, NULL, 0, err, sizeof err) != 0 || ds4_mtp_queue(b, DS4_MTP_SRC_ZERO, 0, 1, err, sizeof err) != 0 ||
        ds4_mtp_queue(b, DS4_MTP_SRC_MODEL, 0, P, err, sizeof err) != 0 ||
        ds4_mtp_eval_queued(b, toks, P, got, 1, err, sizeof err) != 0)
        die("head (queue)", err);
    snprintf(what, sizeof what, "%s: the head from its queue (%d prompt rows): logits byte-identical to the host's", be->name, P);
    check(!memcmp(ref, got, sizeof(float) * (size_t)P * V) && ds4_mtp_queued(b) == 1, what);
    /* the carry, then rows of the head's own streams, one a call (the chained drafts' case) */
    int same = 1;
    for (int i = 0; i < 6; i++) {
        const float *hr = h + (size_t)P * hw;          /* i = 0: the carry, row P - 1's streams */
        if (i > 0) {
            if (ds4_mtp_streams(a, h, 1) != 0) die("streams", "the head's");
            hr = h;
            if (ds4_mtp_queue(b, DS4_MTP_SRC_HEAD, 0, 1, err, sizeof err) != 0) die("queue", err);
        }
        if (ds4_mtp_eval(a, hr, &toks[P + i], 1, ref, 0, err, sizeof err) != 0 ||
            ds4_mtp_eval_queued(b, &toks[P + i], 1, got, 0, err, sizeof err) != 0)
            die("head", err);
        same = same && !memcmp(ref, got, sizeof(float) * (size_t)V) && ds4_mtp_queued(b) == 0;
    }
    snprintf(what, sizeof what, "%s: the head from its queue, the carry and 5 chained rows: logits byte-identical", be->name);
    check(same, what);
    const char *gr = getenv("DS4_CUDA_GRAPHS");
    if (be != ds4_backend_cpu() && gr && atoi(gr) == 1) {
        /* the six one-row calls: one recording, replayed (an eager fallback gives the same
         * bytes, so only the counters show that the region recorded) */
        ds4_backend_stats st;
        ds4_ctx_stats(b, &st, 0);
        snprintf(what, sizeof what, "%s, graphs: the one-row head calls replayed (%llu captures, %llu replays, %llu eager fallbacks)",
                 be->name, (unsigned long long)st.captures, (unsigned long long)st.replays, (unsigned long long)st.fallbacks);
        check(st.fallbacks == 0 && st.replays >= 5, what);
    }
    if (be == ds4_backend_cpu()) {
        check(ds4_mtp_queue(b, DS4_MTP_SRC_MODEL, 0, 1, err, sizeof err) == -1 && strstr(err, "which has 0"),
              "the model's streams after a head call (gone) refused");
        check(ds4_mtp_queue(b, DS4_MTP_SRC_HEAD, 1, 1, err, sizeof err) == -1, "a head row past its last call refused");
        check(ds4_mtp_queue(b, 9, 0, 1, err, sizeof err) == -1, "an unknown source refused");
        check(ds4_mtp_queue(b, DS4_MTP_SRC_ZERO, 0, P + 1, err, sizeof err) == 0 &&
              ds4_mtp_queue(b, DS4_MTP_SRC_ZERO, 0, 1, err, sizeof err) == -1 && strstr(err, "exceed"),
              "a queue past max_batch + 1 rows refused");
        check(ds4_mtp_eval_queued(b, toks, P, NULL, 0, err, sizeof err) == 0 && ds4_mtp_queued(b) == 1 &&
              ds4_mtp_eval_queued(b, toks, 2, NULL, 0, err, sizeof err) == -1 && strstr(err, "2 rows asked, 1 queued"),
              "more rows asked than queued refused");
        ds4_ctx_reset(b);
        check(ds4_mtp_queued(b) == 0, "ds4_ctx_reset empties the head's queue");
    }
    free(h); free(ref); free(got);
    ds4_ctx_free(a);
    ds4_ctx_free(b);
}

static void errors(ds4_model *m, ds4_model *plain) {
    char err[512];
    ds4_ctx *c = ds4_ctx_new(m, ds4_backend_cpu(), 64, 8, err, sizeof err);
    if (!c) die("context", err);
    const int32_t t[5] = { 1, 2, 3, 4, 5 };
    check(ds4_ctx_rollback(c, DS4_PART_TRUNK, 0, err, sizeof err) == -1 && strstr(err, "no checkpoint"),
          "rollback without a checkpoint refused");
    check(ds4_ctx_checkpoint(c, DS4_PART_TRUNK, DS4_CHECKPOINT_MAX + 1, err, sizeof err) == -1 && strstr(err, "outside [1, 4]"),
          "a checkpoint wider than DS4_CHECKPOINT_MAX refused");
    check(ds4_ctx_checkpoint(c, DS4_PART_TRUNK, 0, err, sizeof err) == -1, "a checkpoint of 0 positions refused");
    check(ds4_ctx_checkpoint(c, 7, 1, err, sizeof err) == -1 && strstr(err, "unknown context part"), "an unknown part refused");
    if (ds4_eval(c, t, 2, NULL, 0, err, sizeof err) != 0) die("eval", err);
    check(ds4_ctx_checkpoint(c, DS4_PART_TRUNK, 2, err, sizeof err) == 0, "checkpoint at 2");
    if (ds4_eval(c, t, 3, NULL, 0, err, sizeof err) != 0) die("eval", err);
    check(ds4_ctx_rollback(c, DS4_PART_TRUNK, 3, err, sizeof err) == -1 && strstr(err, "past the checkpoint"),
          "a rollback after more positions than the checkpoint saved refused");
    check(ds4_ctx_pos(c) == 5, "a refused rollback leaves the position");
    ds4_ctx_reset(c);
    if (ds4_eval(c, t, 4, NULL, 0, err, sizeof err) != 0) die("eval", err);
    check(ds4_ctx_rollback(c, DS4_PART_TRUNK, 3, err, sizeof err) == -1 && strstr(err, "no checkpoint"),
          "ds4_ctx_reset drops the checkpoint");
    check(ds4_ctx_checkpoint(c, DS4_PART_TRUNK, 3, err, sizeof err) == 0, "checkpoint at 4");
    if (ds4_eval(c, t, 3, NULL, 0, err, sizeof err) != 0) die("eval", err);
    check(ds4_ctx_rollback(c, DS4_PART_TRUNK, 3, err, sizeof err) == -1 && strstr(err, "cannot roll back to position 3"),
          "a rollback before the checkpoint refused");
    check(ds4_ctx_rollback(c, DS4_PART_TRUNK, 6, err, sizeof err) == 0 && ds4_ctx_pos(c) == 6, "rollback to 6");
    float *h = calloc(8 * 1024, sizeof(float));
    check(h && ds4_ctx_streams(c, h, 2) == 0 && ds4_ctx_streams(c, h, 3) == -1,
          "the streams of the rows taken back are gone (2 of the call's 3 rows left)");
    check(ds4_ctx_rollback(c, DS4_PART_TRUNK, 5, err, sizeof err) == 0 && ds4_ctx_pos(c) == 5,
          "the checkpoint stays valid after a rollback");
    free(h);
    ds4_ctx_free(c);
    c = ds4_ctx_new(plain, ds4_backend_cpu(), 64, 8, err, sizeof err);
    if (!c) die("context", err);
    check(ds4_ctx_checkpoint(c, DS4_PART_MTP, 1, err, sizeof err) == -1 && strstr(err, "no MTP block"),
          "DS4_PART_MTP on a model without the block refused");
    check(ds4_mtp_queue(c, DS4_MTP_SRC_ZERO, 0, 1, err, sizeof err) == -1 && strstr(err, "no MTP block"),
          "the head's queue on a model without the block refused");
    ds4_ctx_free(c);
}

int main(int argc, char **argv) {
    const ds4_backend *be = ds4_backend_cpu();
    ds4_cpu_set_threads(1);           /* the CPU's logits are the same for any count; one is quickest on 2 cores */
    if (argc > 1 && !strcmp(argv[1], "cuda")) {
#ifdef DS4_CUDA
        be = ds4_backend_cuda();
#else
        die("cuda", "this build has no CUDA backend");
#endif
    }
    char err[512];
    ds4_model *m = ds4_synth_open("tiny+mtp", 1, DS4_TYPE_F32, 0, err, sizeof err);
    if (!m) die("tiny+mtp", err);
    const int V = ds4_model_n_vocab(m);
    int32_t toks[P + STEPS];
    uint32_t s = 1;
    for (int i = 0; i < P + STEPS; i++) toks[i] = (int32_t)(rnd(&s) % (uint32_t)V);
    float *ref = malloc(sizeof(float) * (size_t)STEPS * V), *got = malloc(sizeof(float) * (size_t)STEPS * V);
    if (!ref || !got) die("buffers", "out of memory");
    char what[160];

    run_steps(m, be, toks, 0, ref);
    run_steps(m, be, toks, 1, got);
    snprintf(what, sizeof what, "%s: junk calls of 1..4 tokens taken back: %d steps' logits byte-identical", be->name, STEPS);
    check(!memcmp(ref, got, sizeof(float) * (size_t)STEPS * V), what);
    if (be == ds4_backend_cpu()) {
        run_steps(m, be, toks, 2, got);
        check(!memcmp(ref, got, sizeof(float) * (size_t)STEPS * V),
              "cpu: calls of the token and 0..3 junk after it, rolled back to keep the token: byte-identical");
    }
    setenv("DS4_ROLLBACK_RESTORE", "0", 1);
    run_steps(m, be, toks, 1, got);
    snprintf(what, sizeof what, "%s: DS4_ROLLBACK_RESTORE=0 (nothing restored): the logits differ", be->name);
    check(memcmp(ref, got, sizeof(float) * (size_t)STEPS * V) != 0, what);
    unsetenv("DS4_ROLLBACK_RESTORE");
    mtp_queue(m, be, toks);

    if (be == ds4_backend_cpu()) {
        int L, D, hc, k;
        ds4_model_dims(m, &L, &D, &hc, &k);
        const int hw = D * hc;
        float *h = malloc(sizeof(float) * (size_t)STEPS * hw);
        if (!h) die("buffers", "out of memory");
        for (size_t i = 0; i < (size_t)STEPS * hw; i++) h[i] = (float)((int)(rnd(&s) % 2001) - 1000) / 1000.0f;
        run_mtp(m, toks, h, hw, 0, ref);
        run_mtp(m, toks, h, hw, 1, got);
        check(!memcmp(ref, got, sizeof(float) * (size_t)STEPS * V),
              "cpu: the MTP block's junk rows taken back: its logits byte-identical");
        setenv("DS4_ROLLBACK_RESTORE", "1", 1);       /* the model's part only */
        run_mtp(m, toks, h, hw, 1, got);
        check(memcmp(ref, got, sizeof(float) * (size_t)STEPS * V) != 0,
              "cpu: DS4_ROLLBACK_RESTORE=1 (the MTP block's part not restored): its logits differ");
        unsetenv("DS4_ROLLBACK_RESTORE");
        free(h);
        ds4_model *plain = ds4_synth_open("tiny", 1, DS4_TYPE_F32, 0, err, sizeof err);
        if (!plain) die("tiny", err);
        errors(m, plain);
        ds4_model_close(plain);
    }
    free(ref);
    free(got);
    ds4_model_close(m);
    printf("%d passed, %d failed\n", passes, failures);
    return failures ? 1 : 0;
}
