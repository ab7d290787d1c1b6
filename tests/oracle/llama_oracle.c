/*
 * llama_oracle: run llama.cpp (v0.4.0, prebuilt CPU libraries) on a GGUF model and dump
 * every logit row it produces, so ds4 can be compared against it.
 *
 *   llama_oracle -m MODEL.gguf --tokens 1,2,3 -n N_GEN -o OUT.ds4logit
 *                [--threads T] [--force 4,5,6] [--libdir DIR] [--cpu-backend NAME] [-v]
 *                [--tensors NAME,NAME --tensors-out FILE]
 *
 * --tensors: llama.cpp's eval callback (llama_context_params.cb_eval) copies every graph
 * tensor whose name is NAME-<layer> (the names deepseek4.cpp gives them: attn_out, l_last,
 * ffn_out, ...) as it is computed, to FILE: "LLTENSOR", u32 version 1, then per tensor
 * u32 name length, the name, i32 layer, i64 ne[4], u64 bytes, f32 data in ggml order (ne[0]
 * fastest; an I32 tensor such as lid_top_k: its i32 values, same layout).  One record per
 * tensor per llama_decode: the prompt's batch, then each step.
 *
 * One prefill llama_decode of the P prompt tokens (logits for every row), then N_GEN decode
 * steps of one token each. Step j feeds force[j] when --force is given (teacher forcing),
 * otherwise the argmax of the previous row (greedy).
 *
 * Numerics chosen to make llama.cpp a sharp reference: F32 K/V cache, flash attention
 * off, never more threads than online cores.
 *
 * Output: the DS4LOGIT format (little-endian), see tests/oracle/README.md and ds4logit.py:
 *   char magic[8] = "DS4LOGIT"; int32 version = 1, n_vocab, n_prompt, n_gen, n_rows, 0;
 *   int32 token[n_rows]; int32 argmax[n_rows]; float32 logits[n_rows][n_vocab].
 *
 * Backend libraries: llama.cpp finds no CPU backend unless ggml_backend_load_all_from_path()
 * is called with the directory holding libggml-cpu-*.so. That directory is, in order:
 * --libdir, $LLAMA_ORACLE_LIBDIR, the directory libllama was loaded from (via its RUNPATH,
 * i.e. build/oracle/lib when linked as in the README).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ggml-backend.h"
#include "llama.h"
#include "libllama_dir.h"

#define PROG "llama_oracle"

static int g_verbose;
static enum ggml_log_level g_last_level = GGML_LOG_LEVEL_NONE;

static void die(const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, PROG ": error: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static void usage(FILE *f) {
    fprintf(f,
        "usage: " PROG " -m MODEL.gguf --tokens ID,ID,... -n N_GEN -o OUT.ds4logit\n"
        "                    [--threads T] [--force ID,ID,...] [--libdir DIR]\n"
        "                    [--cpu-backend NAME] [-v]\n"
        "  -m, --model FILE     GGUF model (deepseek4, tokenizer.ggml.model may be no_vocab)\n"
        "  -t, --tokens LIST    prompt token ids, comma separated (P >= 1), one prefill batch\n"
        "  -n, --n-gen N        decode steps after the prompt (>= 0)\n"
        "  -o, --out FILE       DS4LOGIT dump to write\n"
        "      --threads T      CPU threads, capped at the number of online cores (default 2)\n"
        "      --force LIST     teacher forcing: decode step j feeds LIST[j] (needs >= N ids)\n"
        "      --libdir DIR     directory with libggml-cpu-*.so (default: $LLAMA_ORACLE_LIBDIR,\n"
        "                       else the directory libllama.so was loaded from)\n"
        "      --cpu-backend V  load only libggml-cpu-V.so (e.g. x64, haswell, skylakex) instead\n"
        "                       of the best variant for this CPU\n"
        "  -v, --verbose        show llama.cpp's own log\n"
        "      --tensors LIST   with --tensors-out FILE: copy the graph tensors named LIST[i]-<layer>\n"
        "                       (deepseek4.cpp's names: attn_out, l_last, ffn_out, ...) to FILE\n"
        "      --mtp H.f32      with -n 0: the dump's rows are the MTP head's logits (graph_mtp, the\n"
        "                       model's MTP block) at each prompt row: row k pairs token k with the\n"
        "                       hidden streams of position k - 1, row k - 1 of H.f32 (zeros at k = 0)\n");
}

/* --tensors: the requested base names and the output file */
static char **g_tn;
static int g_ntn;
static FILE *g_tf;
static long g_tensors_written;

static int tensor_wanted(const char *name, int *layer) {
    const char *dash = strrchr(name, '-');
    if (!dash || !dash[1]) return 0;
    char *end;
    const long il = strtol(dash + 1, &end, 10);
    if (*end) return 0;
    for (int i = 0; i < g_ntn; i++)
        if (strlen(g_tn[i]) == (size_t)(dash - name) && !strncmp(g_tn[i], name, (size_t)(dash - name))) {
            *layer = (int) il;
            return 1;
        }
    return 0;
}

static bool tensor_cb(struct ggml_tensor *t, bool ask, void *ud) {
    (void) ud;
    int layer;
    if (!tensor_wanted(ggml_get_name(t), &layer)) return !ask;
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_I32)
        die("--tensors: %s is not F32 or I32 (type %d)", ggml_get_name(t), (int) t->type);
    const size_t n = (size_t) ggml_nelements(t);
    float *buf = malloc(n * sizeof(float));
    char *raw = malloc(ggml_nbytes(t));
    if (!buf || !raw) die("out of memory for tensor %s", ggml_get_name(t));
    ggml_backend_tensor_get(t, raw, 0, ggml_nbytes(t));
    /* gather in ggml order through the strides (views need not be contiguous) */
    size_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++)
                    memcpy(&buf[k++], raw + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3], 4);
    const char *name = ggml_get_name(t);
    const uint32_t nl = (uint32_t) strlen(name);
    const int32_t il = layer;
    const uint64_t bytes = n * sizeof(float);
    if (fwrite(&nl, 4, 1, g_tf) != 1 || fwrite(name, 1, nl, g_tf) != nl || fwrite(&il, 4, 1, g_tf) != 1 ||
        fwrite(t->ne, 8, 4, g_tf) != 4 || fwrite(&bytes, 8, 1, g_tf) != 1 || fwrite(buf, 4, n, g_tf) != n)
        die("--tensors-out: write failed: %s", strerror(errno));
    g_tensors_written++;
    free(buf);
    free(raw);
    return true;
}

static void log_cb(enum ggml_log_level level, const char *text, void *ud) {
    (void) ud;
    if (level != GGML_LOG_LEVEL_CONT) g_last_level = level;
    if (g_verbose || g_last_level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Parse "1,2,3" into a malloc'd int32 array. */
static int32_t *parse_ids(const char *s, int *n_out, const char *what) {
    int cap = 16, n = 0;
    int32_t *v = malloc(sizeof(*v) * cap);
    if (!v) die("out of memory");
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) die("%s: bad token id list '%s'", what, s);
        if (n == cap) {
            cap *= 2;
            v = realloc(v, sizeof(*v) * cap);
            if (!v) die("out of memory");
        }
        v[n++] = (int32_t) x;
        while (*end == ' ') end++;
        if (*end == '\0') break;
        if (*end != ',') die("%s: bad token id list '%s'", what, s);
        p = end + 1;
    }
    *n_out = n;
    return v;
}

static long parse_long(const char *s, const char *what, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (end == s || *end || errno || x < lo || x > hi) die("%s: bad value '%s'", what, s);
    return x;
}

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int32_t argmax_row(const float *row, int n) {
    int32_t best = 0;
    float bv = row[0];
    for (int i = 1; i < n; i++) {
        if (row[i] > bv || (bv != bv && row[i] == row[i])) { bv = row[i]; best = i; }
    }
    return best;
}

/* Row i of a batch: token t at position pos, sequence 0, its logits wanted. */
static void batch_row(struct llama_batch *b, int i, int32_t t, int pos) {
    b->token[i] = t;
    b->pos[i] = pos;
    b->n_seq_id[i] = 1;
    b->seq_id[i][0] = 0;
    b->logits[i] = 1;
}

static void write_i32(FILE *f, int32_t v) {
    if (fwrite(&v, 4, 1, f) != 1) die("write failed");
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *out_path = NULL, *libdir = NULL, *cpu_backend = NULL;
    const char *tokens_arg = NULL, *force_arg = NULL, *tensors_arg = NULL, *tensors_out = NULL;
    long n_gen = -1;
    long threads = 2;
    const char *mtp_h = NULL;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
#define NEED_ARG() do { if (i + 1 >= argc) die("option %s needs an argument", a); } while (0)
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        else if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) g_verbose = 1;
        else if (!strcmp(a, "-m") || !strcmp(a, "--model")) { NEED_ARG(); model_path = argv[++i]; }
        else if (!strcmp(a, "-o") || !strcmp(a, "--out")) { NEED_ARG(); out_path = argv[++i]; }
        else if (!strcmp(a, "-t") || !strcmp(a, "--tokens")) { NEED_ARG(); tokens_arg = argv[++i]; }
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-gen")) { NEED_ARG(); n_gen = parse_long(argv[++i], "-n", 0, 1L << 24); }
        else if (!strcmp(a, "--threads")) { NEED_ARG(); threads = parse_long(argv[++i], "--threads", 1, 4096); }
        else if (!strcmp(a, "--force")) { NEED_ARG(); force_arg = argv[++i]; }
        else if (!strcmp(a, "--libdir")) { NEED_ARG(); libdir = argv[++i]; }
        else if (!strcmp(a, "--cpu-backend")) { NEED_ARG(); cpu_backend = argv[++i]; }
        else if (!strcmp(a, "--tensors")) { NEED_ARG(); tensors_arg = argv[++i]; }
        else if (!strcmp(a, "--tensors-out")) { NEED_ARG(); tensors_out = argv[++i]; }
        else if (!strcmp(a, "--mtp")) { NEED_ARG(); mtp_h = argv[++i]; }
        else { usage(stderr); die("unknown argument '%s'", a); }
#undef NEED_ARG
    }
    if (!model_path) die("missing -m MODEL.gguf (see --help)");
    if (!tokens_arg) die("missing --tokens ID,ID,... (see --help)");
    if (n_gen < 0) die("missing -n N_GEN (see --help)");
    if (!out_path) die("missing -o OUT.ds4logit (see --help)");
    if (mtp_h && n_gen != 0) die("--mtp dumps the prompt's rows: give -n 0");

    {
        const uint32_t one = 1;
        if (*(const uint8_t *) &one != 1) die("big-endian host: DS4LOGIT writer assumes little-endian");
    }

    int n_prompt = 0, n_force = 0;
    int32_t *prompt = parse_ids(tokens_arg, &n_prompt, "--tokens");
    int32_t *force = force_arg ? parse_ids(force_arg, &n_force, "--force") : NULL;
    if (force && n_force < n_gen) die("--force gives %d ids but -n asks for %ld steps", n_force, n_gen);
    const int n_rows = n_prompt + (int) n_gen;

    long n_cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (n_cores < 1) n_cores = 1;
    if (threads > n_cores) threads = n_cores;

    llama_log_set(log_cb, NULL);

    /* --- backends --- */
    char *auto_dir = NULL;
    if (!libdir) libdir = getenv("LLAMA_ORACLE_LIBDIR");
    if (!libdir || !*libdir) libdir = auto_dir = libllama_dir();
    if (!libdir) die("cannot tell where libllama is; pass --libdir DIR");
    if (!is_dir(libdir)) die("--libdir '%s' is not a directory", libdir);
    if (cpu_backend) {
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/libggml-cpu-%s.so", libdir, cpu_backend);
        if (access(path, R_OK) != 0) die("no CPU backend %s", path);
        if (!ggml_backend_load(path)) die("cannot load CPU backend %s", path);
    } else {
        ggml_backend_load_all_from_path(libdir);
    }
    if (ggml_backend_dev_count() == 0) die("no ggml backend found in '%s' (expected libggml-cpu-*.so there)", libdir);
    if (g_verbose) {
        for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            fprintf(stderr, PROG ": device %zu: %s (%s)\n", i, ggml_backend_dev_name(d), ggml_backend_dev_description(d));
        }
    }
    llama_backend_init();

    /* --- model --- */
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mtp = mtp_h != NULL;
    double t0 = now_ms();
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) die("llama.cpp failed to load '%s' (rerun with -v for its log)", model_path);
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    if (n_vocab <= 0) die("model reports n_vocab = %d", n_vocab);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] >= n_vocab) die("--tokens: id %d out of range [0,%d)", prompt[i], n_vocab);
    for (int i = 0; i < n_gen; i++)
        if (force && force[i] >= n_vocab) die("--force: id %d out of range [0,%d)", force[i], n_vocab);
    double t_load = now_ms() - t0;

    /* --- context --- */
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n_rows + 1;
    cp.n_batch = (uint32_t) n_prompt;
    cp.n_ubatch = (uint32_t) n_prompt;
    cp.n_seq_max = 1;
    cp.n_threads = (int32_t) threads;
    cp.n_threads_batch = (int32_t) threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.no_perf = true;
    if (!tensors_arg != !tensors_out) die("--tensors and --tensors-out go together");
    if (tensors_arg) {
        char *list = strdup(tensors_arg);
        for (char *tokp = strtok(list, ","); tokp; tokp = strtok(NULL, ",")) {
            g_tn = realloc(g_tn, sizeof(char *) * (size_t)(g_ntn + 1));
            g_tn[g_ntn++] = tokp;
        }
        if (!g_ntn) die("--tensors: no names");
        g_tf = fopen(tensors_out, "wb");
        if (!g_tf) die("cannot open '%s' for writing: %s", tensors_out, strerror(errno));
        const uint32_t ver = 1;
        if (fwrite("LLTENSOR", 1, 8, g_tf) != 8 || fwrite(&ver, 4, 1, g_tf) != 1) die("write failed");
        cp.cb_eval = tensor_cb;
        cp.cb_eval_user_data = NULL;
    }
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("llama.cpp failed to create a context (rerun with -v for its log)");
    if (mtp_h && llama_model_n_layer_nextn(model) != 1)
        die("--mtp: the model has %d MTP blocks, expected 1", llama_model_n_layer_nextn(model));
    if (llama_n_batch(ctx) < (uint32_t) n_prompt || llama_n_ubatch(ctx) < (uint32_t) n_prompt)
        die("context batch %u/%u smaller than the prompt (%d)", llama_n_batch(ctx), llama_n_ubatch(ctx), n_prompt);

    /* --- run --- */
    float *logits = malloc(sizeof(float) * (size_t) n_rows * (size_t) n_vocab);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t) n_rows);
    int32_t *amax = malloc(sizeof(int32_t) * (size_t) n_rows);
    if (!logits || !tok || !amax) die("out of memory for %d x %d logits", n_rows, n_vocab);

    struct llama_batch batch = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        batch_row(&batch, i, prompt[i], i);
        tok[i] = prompt[i];
    }
    batch.n_tokens = n_prompt;

    t0 = now_ms();
    int rc = llama_decode(ctx, batch);
    if (rc != 0) die("prefill llama_decode failed (%d)", rc);
    for (int i = 0; i < n_prompt; i++) {
        const float *row = llama_get_logits_ith(ctx, i);
        if (!row) die("no logits for prompt row %d", i);
        memcpy(logits + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
        amax[i] = argmax_row(row, n_vocab);
    }
    double t_prefill = now_ms() - t0;

    if (mtp_h) {
        /* the MTP head (graph_mtp) on every prompt row, fed as common/speculative.cpp's MTP
         * driver feeds it: row k is token k at position k with the trunk's final hidden
         * streams of position k - 1 (zeros at k = 0), here row k - 1 of the file (f32,
         * [P][hc * n_embd], e.g. tests/mtp_dump's); its logits replace the prompt row's */
        const int we = llama_model_n_embd_out(model);
        float *h = malloc(sizeof(float) * (size_t) n_prompt * (size_t) we);
        if (!h) die("out of memory");
        FILE *hf = fopen(mtp_h, "rb");
        if (!hf) die("cannot open '%s': %s", mtp_h, strerror(errno));
        if (fread(h, sizeof(float) * (size_t) we, (size_t) n_prompt, hf) != (size_t) n_prompt || fgetc(hf) != EOF)
            die("--mtp: '%s' does not hold %d rows of %d floats", mtp_h, n_prompt, we);
        fclose(hf);
        struct llama_context_params dp = cp;
        dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
        dp.cb_eval = NULL;
        struct llama_context *dctx = llama_init_from_model(model, dp);
        if (!dctx) die("--mtp: llama.cpp failed to create the MTP context (rerun with -v)");
        struct llama_batch mb = llama_batch_init(n_prompt, we, 1);
        mb.token = malloc(sizeof(llama_token) * (size_t) n_prompt);
        if (!mb.token) die("out of memory");
        for (int i = 0; i < n_prompt; i++) {
            batch_row(&mb, i, prompt[i], i);
            if (i == 0) memset(mb.embd, 0, sizeof(float) * (size_t) we);
            else memcpy(mb.embd + (size_t) i * we, h + (size_t) (i - 1) * we, sizeof(float) * (size_t) we);
        }
        mb.n_tokens = n_prompt;
        if ((rc = llama_decode(dctx, mb)) != 0) die("--mtp: llama_decode of the MTP context failed (%d)", rc);
        for (int i = 0; i < n_prompt; i++) {
            const float *row = llama_get_logits_ith(dctx, i);
            if (!row) die("--mtp: no logits for row %d", i);
            memcpy(logits + (size_t) i * n_vocab, row, sizeof(float) * n_vocab);
            amax[i] = argmax_row(row, n_vocab);
        }
        free(mb.token);
        mb.token = NULL;
        llama_batch_free(mb);
        llama_free(dctx);
        free(h);
    }

    t0 = now_ms();
    for (int j = 0; j < n_gen; j++) {
        const int r = n_prompt + j;
        const int32_t t = force ? force[j] : amax[r - 1];
        batch_row(&batch, 0, t, r);
        batch.n_tokens = 1;
        rc = llama_decode(ctx, batch);
        if (rc != 0) die("decode step %d llama_decode failed (%d)", j, rc);
        const float *row = llama_get_logits_ith(ctx, 0);
        if (!row) die("no logits for decode step %d", j);
        tok[r] = t;
        memcpy(logits + (size_t) r * n_vocab, row, sizeof(float) * n_vocab);
        amax[r] = argmax_row(row, n_vocab);
    }
    double t_decode = now_ms() - t0;

    /* --- stats + dump --- */
    size_t n_bad = 0;
    double sum = 0, sum2 = 0;
    const size_t n_all = (size_t) n_rows * n_vocab;
    for (size_t i = 0; i < n_all; i++) {
        const float x = logits[i];
        if (!isfinite(x)) { n_bad++; continue; }
        sum += x; sum2 += (double) x * x;
    }
    const double n_ok = (double) (n_all - n_bad);
    const double mean = n_ok > 0 ? sum / n_ok : 0.0;
    const double var = n_ok > 0 ? sum2 / n_ok - mean * mean : 0.0;
    int n_distinct = 0;
    {
        char *seen = calloc((size_t) n_vocab, 1);
        if (!seen) die("out of memory");
        for (int i = 0; i < n_rows; i++) if (!seen[amax[i]]) { seen[amax[i]] = 1; n_distinct++; }
        free(seen);
    }

    FILE *f = fopen(out_path, "wb");
    if (!f) die("cannot open '%s' for writing: %s", out_path, strerror(errno));
    if (fwrite("DS4LOGIT", 1, 8, f) != 8) die("write failed");
    write_i32(f, 1);
    write_i32(f, n_vocab);
    write_i32(f, n_prompt);
    write_i32(f, (int32_t) n_gen);
    write_i32(f, n_rows);
    write_i32(f, 0);
    if (fwrite(tok, 4, (size_t) n_rows, f) != (size_t) n_rows) die("write failed");
    if (fwrite(amax, 4, (size_t) n_rows, f) != (size_t) n_rows) die("write failed");
    if (fwrite(logits, sizeof(float), n_all, f) != n_all) die("write failed");
    if (fclose(f) != 0) die("closing '%s' failed: %s", out_path, strerror(errno));

    fprintf(stderr,
        PROG ": %s: P=%d G=%ld vocab=%d threads=%ld %s | load %.0f ms, prefill %.1f ms, "
        "decode %.1f ms (%.2f ms/tok) | logits mean %.3f std %.3f, %d distinct argmax\n",
        out_path, n_prompt, n_gen, n_vocab, threads, force ? "forced" : "greedy",
        t_load, t_prefill, t_decode, n_gen ? t_decode / n_gen : 0.0, mean, sqrt(var > 0 ? var : 0),
        n_distinct);
    if (n_bad) fprintf(stderr, PROG ": warning: %zu non-finite logits\n", n_bad);
    if (g_tf) {
        if (fclose(g_tf) != 0) die("closing '%s' failed: %s", tensors_out, strerror(errno));
        fprintf(stderr, PROG ": %s: %ld tensors\n", tensors_out, g_tensors_written);
    }

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(logits); free(tok); free(amax); free(prompt); free(force); free(auto_dir);
    return 0;
}
