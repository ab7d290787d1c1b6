/* mtp_dump -- the MTP head's logits at every row of a prompt, as a DS4LOGIT dump, and the
 * trunk's final hidden streams of every row (f32, [P][n_hc * n_embd]).  tests/test_mtp.py feeds
 * those streams to llama_oracle --mtp (llama.cpp's MTP graph) and compares the two dumps: the
 * head on the same inputs.  With `cuda` last (a CUDA build: make build/cuda-ARCH/mtp_dump) the
 * trunk and the head run on the GPU; tests/test_mtp_cuda.py holds that dump to the CPU's.
 *
 *   mtp_dump MODEL.gguf ID,ID,... OUT.ds4logit STREAMS.f32 [cuda] [--mtp FILE]
 *
 * --mtp FILE: the MTP block from a file of its own (ds4_model_attach_mtp), as `ds4 --mtp FILE`
 * reads it; tests/test_mtp_spec.py holds that head's dump to the same model's with the block in
 * its file.
 *
 * The prompt goes through the trunk in one batch; row k of the MTP head then pairs the trunk's
 * final streams of position k - 1 (zeros at k = 0) with the prompt's token k, as llama.cpp's
 * MTP driver (common/speculative.cpp) feeds its MTP context, and predicts token k + 1. */
#include "ds4.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *what, const char *why) {
    fprintf(stderr, "mtp_dump: %s: %s\n", what, why);
    exit(1);
}

int main(int argc, char **argv) {
    const char *mtp_file = NULL;
    if (argc >= 7 && !strcmp(argv[argc - 2], "--mtp")) {
        mtp_file = argv[argc - 1];
        argc -= 2;
    }
    if (argc != 5 && !(argc == 6 && !strcmp(argv[5], "cuda"))) {
        fprintf(stderr, "usage: mtp_dump MODEL.gguf ID,ID,... OUT.ds4logit STREAMS.f32 [cuda] [--mtp FILE]\n");
        return 2;
    }
    const ds4_backend *be = ds4_backend_cpu();
    if (argc == 6) {
#ifdef DS4_CUDA
        be = ds4_backend_cuda();
#else
        die("cuda", "this build has no CUDA backend");
#endif
    }
    char err[512];
    int P = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (strlen(argv[2]) + 1));
    if (!ids) die("prompt", "out of memory");
    for (char *s = argv[2], *end; *s; s = *end ? end + 1 : end) {
        ids[P++] = (int32_t)strtol(s, &end, 10);
        if (end == s || (*end && *end != ',')) die("prompt", "expected comma-separated ids");
    }
    ds4_model *m = ds4_model_open(argv[1], err, sizeof err);
    if (!m) die(argv[1], err);
    if (mtp_file && ds4_model_attach_mtp(m, mtp_file, err, sizeof err) != 0) die(mtp_file, err);
    if (!ds4_model_has_mtp(m)) die(argv[1], "the model has no MTP block");
    ds4_ctx *c = ds4_ctx_new(m, be, P + 1, P, err, sizeof err);
    if (!c) die("context", err);
    int L, D, hc, k;
    ds4_model_dims(m, &L, &D, &hc, &k);
    const int V = ds4_model_n_vocab(m);
    const size_t w = (size_t)hc * D;
    float *h = calloc((size_t)P * w, sizeof(float)), *in = calloc((size_t)P * w, sizeof(float));
    float *logits = malloc(sizeof(float) * (size_t)P * V);
    int32_t *amax = malloc(sizeof(int32_t) * (size_t)P);
    if (!h || !in || !logits || !amax) die("buffers", "out of memory");
    if (ds4_eval(c, ids, P, NULL, 0, err, sizeof err) != 0) die("trunk", err);
    if (ds4_ctx_streams(c, h, P) != 0) die("trunk", "no streams for the prompt's rows");
    memcpy(in + w, h, sizeof(float) * (size_t)(P - 1) * w);      /* row k: position k - 1's */
    if (ds4_mtp_eval(c, in, ids, P, logits, 1, err, sizeof err) != 0) die("MTP", err);
    for (int r = 0; r < P; r++) {
        int best = 0;
        for (int v = 1; v < V; v++) if (logits[(size_t)r * V + v] > logits[(size_t)r * V + best]) best = v;
        amax[r] = best;
    }
    FILE *f = fopen(argv[3], "wb");
    if (!f) die(argv[3], "cannot open for writing");
    const int32_t head[6] = { 1, V, P, 0, P, 0 };
    int ok = fwrite("DS4LOGIT", 1, 8, f) == 8 && fwrite(head, 4, 6, f) == 6 &&
             fwrite(ids, 4, (size_t)P, f) == (size_t)P && fwrite(amax, 4, (size_t)P, f) == (size_t)P &&
             fwrite(logits, 4, (size_t)P * V, f) == (size_t)P * V;
    if (fclose(f) != 0 || !ok) die(argv[3], "write failed");
    FILE *sf = fopen(argv[4], "wb");
    if (!sf) die(argv[4], "cannot open for writing");
    ok = fwrite(h, sizeof(float) * w, (size_t)P, sf) == (size_t)P;
    if (fclose(sf) != 0 || !ok) die(argv[4], "write failed");
    ds4_ctx_free(c);
    ds4_model_close(m);
    free(ids); free(h); free(in); free(logits); free(amax);
    return 0;
}
