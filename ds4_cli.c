/* ds4_cli.c -- the `ds4` program: run a DeepSeek V4 model, or write a synthetic one.
 *
 *   ds4 [-m FILE] [-p TEXT | --tokens IDS] [-n N] [--temp T] [--top-p P] [--seed S]
 *       [-c N] [--backend cpu|cuda] [--dump-logits FILE] [--force IDS] [--threads N]
 *   ds4 synth --config tiny|small|flash16 [--seed N] [--type f32|f16|bf16|q8_0] -o FILE
 *
 * Without -m it runs the embedded default model, models/ds4-tiny.gguf beside the
 * binary (the build writes it).  Everything here is argument handling and
 * reporting; the engine is ds4.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ds4.h"
#include "ds4_tok.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "ds4: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, "\n");
    exit(2);
}

static void usage(FILE *f) {
    fprintf(f,
        "usage: ds4 [options]                 run a deepseek4 GGUF model\n"
        "       ds4 synth [options] -o FILE   write a synthetic deepseek4 GGUF\n"
        "       ds4 info FILE                 tensor types, parameters, memory and decode bytes of a GGUF\n"
        "\n"
        "run options:\n"
        "  -m FILE             model (default: models/ds4-tiny.gguf beside the binary)\n"
        "  -p TEXT             prompt text, through the model's tokenizer (BOS first); models\n"
        "                      without a vocabulary: one id per byte\n"
        "  --chat              wrap -p in the V4 chat format and stop at EOS (README)\n"
        "  --think             with --chat: thinking on (<think>), else off (</think>)\n"
        "  --tokens IDS        prompt as comma-separated token ids (instead of -p)\n"
        "  -n N                tokens to generate (default 32)\n"
        "  --temp T            sampling temperature, 0 = greedy (default 0)\n"
        "  --top-p P           nucleus sampling threshold in (0, 1] (default 1)\n"
        "  --seed S            sampling seed (default 1)\n"
        "  -c, --ctx N         context size in tokens (default: prompt + n)\n"
        "  --backend B         cpu or cuda (default: cuda in a CUDA build, else cpu)\n"
        "  --dump-logits FILE  write every row's logits in the DS4LOGIT format (README)\n"
        "  --force IDS         teacher forcing: decode step j feeds IDS[j] instead of the sample\n"
        "  --threads N         CPU threads (default: DS4_THREADS or all cores)\n"
        "  -h, --help          this text\n"
        "\n"
        "synth options:\n"
        "  --config NAME       tiny, small, flash16, or the published files' layouts small-q2,\n"
        "                      small-q4, flash-q2, flash-q4 (IQ2_XXS/Q2_K or Q4_K experts)\n"
        "  --seed N            weight seed (default 1)\n"
        "  --experts E         routed experts (default: the config's; top-k to 1024)\n"
        "  --vocab             a byte-level BPE vocabulary (default: none, raw ids)\n"
        "  --type T            matrix type f32, f16, bf16 or q8_0 (default f32; flash16: q8_0)\n"
        "  -o FILE             output path\n");
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        char range[64];
        snprintf(range, sizeof(range), "an integer in [%ld, %ld]", lo, hi);
        die("%s expects %s", flag, range);
    }
    return v;
}

static uint64_t parse_u64(const char *flag, const char *s) {
    char *end;
    errno = 0;
    if (*s == '-') die("%s expects a non-negative integer, got '%s'", flag, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) die("%s expects a non-negative integer, got '%s'", flag, s);
    return (uint64_t)v;
}

static float parse_float(const char *flag, const char *s, float lo, float hi) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        char range[64];
        snprintf(range, sizeof(range), "a number in [%g, %g]", lo, hi);
        die("%s expects %s", flag, range);
    }
    return v;
}

/* "1,2,3" -> ids; exits with a message on malformed lists. */
static int32_t *parse_ids(const char *flag, const char *s, int *n_out) {
    int cap = 16, n = 0;
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    const char *p = s;
    if (!*p) die("%s expects comma-separated token ids, got '%s'", flag, s);
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ','))
            die("%s expects comma-separated non-negative token ids, got '%s'", flag, s);
        if (n == cap) { cap *= 2; ids = realloc(ids, sizeof(int32_t) * cap); }
        ids[n++] = (int32_t)v;
        p = *end == ',' ? end + 1 : end;
        if (*end == ',' && !*p) die("%s: trailing comma in '%s'", flag, s);
    }
    *n_out = n;
    return ids;
}

/* A token as text: its UTF-8 piece for models with a vocabulary (control
 * bytes other than newline and tab escaped), else the byte-level id. */
static void print_token(const ds4_model *m, const ds4_tok *tok, int32_t id) {
    if (tok) {
        char buf[256];
        const int n = ds4_tok_piece(tok, id, buf, (int)sizeof buf);
        if (n < 0) { printf("<%d>", id); return; }
        for (int i = 0; i < n; i++) {
            const unsigned char ch = (unsigned char)buf[i];
            if (ch < 32 && ch != '\n' && ch != '\t') printf("\\x%02x", ch);
            else putchar(ch);
        }
    } else if (!ds4_model_has_vocab(m) && id < 256) {
        if ((id >= 32 && id < 127) || id == '\n') putchar(id);
        else printf("\\x%02x", id);
    } else {
        printf("<%d>", id);
    }
}

/* A special token of the vocabulary by its text, or a one-line error. */
static int32_t special_id(const ds4_tok *tok, const char *text) {
    const int32_t id = ds4_tok_find(tok, text);
    if (id < 0) die("--chat: the vocabulary has no '%s' token%s", text, "");
    return id;
}

static int write_dump(FILE *f, const char *path, int n_vocab, int P, int G, const int32_t *tok,
                      const float *logits) {
    const int rows = P + G;
    int32_t hdr[6] = { 1, n_vocab, P, G, rows, 0 };
    int32_t *am = malloc(sizeof(int32_t) * (rows ? rows : 1));
    for (int i = 0; i < rows; i++) am[i] = ds4_argmax(logits + (size_t)i * n_vocab, n_vocab);
    int ok = fwrite("DS4LOGIT", 1, 8, f) == 8 && fwrite(hdr, 4, 6, f) == 6 &&
             fwrite(tok, 4, rows, f) == (size_t)rows && fwrite(am, 4, rows, f) == (size_t)rows &&
             fwrite(logits, 4, (size_t)rows * n_vocab, f) == (size_t)rows * n_vocab;
    free(am);
    if (fclose(f) != 0) ok = 0;
    if (!ok) { fprintf(stderr, "ds4: short write to '%s'\n", path); return -1; }
    return 0;
}

static int cmd_synth(int argc, char **argv, int threads) {
    const char *config = NULL, *out = NULL, *type = NULL;
    uint64_t seed = 1;
    int experts = 0, vocab = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--vocab")) { vocab = 1; continue; }   /* the one flag without a value */
        if (strcmp(a, "--config") && strcmp(a, "--seed") && strcmp(a, "--type") && strcmp(a, "-o") &&
            strcmp(a, "--threads") && strcmp(a, "--experts"))
            die("unknown synth option '%s'%s (see ds4 synth --help)", a, "");
        if (!v) die("option %s needs a value%s", a, "");
        if (!strcmp(a, "--config")) config = v;
        else if (!strcmp(a, "--seed")) seed = parse_u64(a, v);
        else if (!strcmp(a, "--type")) type = v;
        else if (!strcmp(a, "-o")) out = v;
        else if (!strcmp(a, "--threads")) threads = (int)parse_long(a, v, 1, 64);
        else if (!strcmp(a, "--experts")) experts = (int)parse_long(a, v, 1, 1024);
        else die("unknown synth option '%s'%s (see ds4 synth --help)", a, "");
        i++;
    }
    if (!config) die("synth needs --config (tiny, small, flash16, small-q2, small-q4, flash-q2 or flash-q4)%s%s", "", "");
    if (!out) die("synth needs -o FILE%s%s", "", "");
    char cfgbuf[96];
    if (experts || vocab) {          /* "NAME+vocab@E" for the synth API */
        if (experts && strchr(config, '@')) die("give the expert count once (--experts or NAME@E)%s%s", "", "");
        if (vocab && strstr(config, "+vocab")) die("give the vocabulary once (--vocab or NAME+vocab)%s%s", "", "");
        const char *at = strchr(config, '@');
        const int n = at ? (int)(at - config) : (int)strlen(config);
        snprintf(cfgbuf, sizeof cfgbuf, "%.*s%s%s", n > 60 ? 60 : n, config, vocab ? "+vocab" : "", at ? at : "");
        if (experts) snprintf(cfgbuf + strlen(cfgbuf), sizeof cfgbuf - strlen(cfgbuf), "@%d", experts);
        config = cfgbuf;
    }
    const int layout = strstr(config, "-q2") || strstr(config, "-q4");
    if (layout && type) die("--type does not apply to the %s layout (its tensor types are the published files')%s", config, "");
    if (!type) type = !strncmp(config, "flash16", 7) ? "q8_0" : "f32";
    int wtype = ds4_parse_wtype(type);
    if (wtype < 0) die("unknown --type '%s' (f32, f16, bf16 or q8_0)%s", type, "");
    char err[512];
    double t0 = now_s();
    if (ds4_synth_write(config, seed, wtype, out, threads, err, sizeof(err)) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        return 1;
    }
    fprintf(stderr, "ds4: wrote %s (config %s, seed %llu, %s) in %.2f s\n", out, config,
            (unsigned long long)seed, layout ? "the published files' tensor types" : type, now_s() - t0);
    return 0;
}

static const char *default_model_path(char *buf, size_t len) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return "models/ds4-tiny.gguf";
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (slash) *slash = 0;
    snprintf(buf, len, "%s/models/ds4-tiny.gguf", exe);
    return buf;
}

int main(int argc, char **argv) {
    char err[1024];
    ds4_env env;
    if (ds4_env_read(&env, err, sizeof(err)) != 0) { fprintf(stderr, "ds4: %s\n", err); return 2; }
    int threads = env.threads;

    if (argc >= 2 && !strcmp(argv[1], "synth")) return cmd_synth(argc, argv, threads);
    if (argc >= 2 && !strcmp(argv[1], "info")) {
        /* a file ds4 cannot run fails the validator, whose one line names what is wrong */
        if (argc != 3) die("usage: ds4 info FILE%s%s", "", "");
        ds4_model *m = ds4_model_open(argv[2], err, sizeof(err));
        if (!m) { fprintf(stderr, "ds4: %s: %s\n", argv[2], err); return 1; }
        ds4_model_info(m, stdout);
        ds4_model_close(m);
        return 0;
    }

    const char *model_path = NULL, *prompt = NULL, *dump = NULL, *backend = NULL;
    int32_t *prompt_ids = NULL, *force = NULL;
    int n_prompt_ids = 0, n_force = 0, n_gen = 32, n_gen_set = 0, n_ctx = 0;
    float temp = 0.0f, top_p = 1.0f;
    uint64_t seed = 1;
    int chat = 0, think = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--chat")) { chat = 1; continue; }       /* the flags without a value */
        if (!strcmp(a, "--think")) { think = 1; continue; }
        static const char *known[] = { "-m", "-p", "--tokens", "-n", "--temp", "--top-p", "--seed", "-c",
                                       "--ctx", "--backend", "--dump-logits", "--force", "--threads" };
        int is_known = 0;
        for (size_t q = 0; q < sizeof(known) / sizeof(known[0]); q++) if (!strcmp(a, known[q])) is_known = 1;
        if (!is_known) die("unknown option '%s'%s (see ds4 --help)", a, "");
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) die("option %s needs a value (see ds4 --help)%s", a, "");
        if (!strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "-p")) prompt = v;
        else if (!strcmp(a, "--tokens")) prompt_ids = parse_ids(a, v, &n_prompt_ids);
        else if (!strcmp(a, "-n")) { n_gen = (int)parse_long(a, v, 0, 1 << 24); n_gen_set = 1; }
        else if (!strcmp(a, "--temp")) temp = parse_float(a, v, 0.0f, 100.0f);
        else if (!strcmp(a, "--top-p")) top_p = parse_float(a, v, 1e-6f, 1.0f);
        else if (!strcmp(a, "--seed")) seed = parse_u64(a, v);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx")) n_ctx = (int)parse_long(a, v, 1, 1 << 24);
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--dump-logits")) dump = v;
        else if (!strcmp(a, "--force")) force = parse_ids(a, v, &n_force);
        else if (!strcmp(a, "--threads")) threads = (int)parse_long(a, v, 1, 64);
        else die("unknown option '%s'%s (see ds4 --help)", a, "");
        i++;
    }
    if (prompt && prompt_ids) die("give either -p or --tokens, not both%s%s", "", "");
    if (think && !chat) die("--think goes with --chat%s%s", "", "");
    if (chat && prompt_ids) die("--chat wraps -p TEXT; it does not take --tokens%s%s", "", "");
    if (force && !n_gen_set) n_gen = n_force;
    if (force && n_force < n_gen) die("--force gives fewer ids than -n asks to generate%s%s", "", "");
    if (threads > 0) ds4_cpu_set_threads(threads);

    const ds4_backend *be = NULL;
#ifdef DS4_CUDA
    if (!backend) backend = "cuda";
#else
    if (!backend) backend = "cpu";
#endif
    if (!strcmp(backend, "cpu")) be = ds4_backend_cpu();
#ifdef DS4_CUDA
    else if (!strcmp(backend, "cuda")) be = ds4_backend_cuda();
#else
    else if (!strcmp(backend, "cuda")) die("--backend cuda: this ds4 was built without CUDA (run: make cuda CUDA_ARCH=sm_90)%s%s", "", "");
#endif
    else die("unknown --backend '%s' (cpu or cuda)%s", backend, "");

    char defpath[PATH_MAX + 32];
    if (!model_path) {
        model_path = default_model_path(defpath, sizeof(defpath));
        if (access(model_path, R_OK) != 0)
            die("no -m given and the embedded default model %s is missing (run: make)%s", model_path, "");
    }
    double t0 = now_s();
    ds4_model *m = ds4_model_open(model_path, err, sizeof(err));
    if (!m) { fprintf(stderr, "ds4: %s\n", err); return 1; }
    const int V = ds4_model_n_vocab(m);

    /* prompt ids: --tokens as given; -p through the model's tokenizer (BOS first
     * when the vocabulary has one), or one byte-level id per byte without one.
     * --chat: BOS <｜User｜> prompt <｜Assistant｜> then </think> (thinking off)
     * or <think> (--think); generation stops at EOS. */
    int P = 0;
    int32_t *ids;
    ds4_tok *tok = ds4_model_has_vocab(m) ? ds4_model_tokenizer(m, err, sizeof(err)) : NULL;
    if (ds4_model_has_vocab(m) && !tok) { fprintf(stderr, "ds4: %s\n", err); return 1; }
    if (chat && !tok) die("--chat needs a model with a vocabulary (this one has none)%s%s", "", "");
    if (prompt_ids) {
        P = n_prompt_ids;
        ids = prompt_ids;
    } else if (tok) {
        if (!prompt) prompt = "Once upon a time";
        const size_t len = strlen(prompt);
        const int n = ds4_tok_encode(tok, prompt, len, 0, NULL, 0);
        if (n < 0) die("cannot tokenize the prompt%s%s", "", "");
        ids = malloc(sizeof(int32_t) * (size_t)(n + 4));
        const int bos = ds4_model_bos(m);
        if (bos >= 0) ids[P++] = bos;
        if (chat) ids[P++] = special_id(tok, "<｜User｜>");
        P += ds4_tok_encode(tok, prompt, len, 0, ids + P, n);
        if (chat) {
            ids[P++] = special_id(tok, "<｜Assistant｜>");
            ids[P++] = special_id(tok, think ? "<think>" : "</think>");
        }
    } else {
        if (!prompt) prompt = "Once upon a time";
        if (V < 256) die("-p feeds byte-level ids, but this model's vocabulary has fewer than 256 ids: pass --tokens%s%s", "", "");
        P = (int)strlen(prompt);
        ids = malloc(sizeof(int32_t) * (P ? P : 1));
        for (int i = 0; i < P; i++) ids[i] = (unsigned char)prompt[i];
    }
    const int eos = chat ? ds4_model_eos(m) : -1;
    if (P == 0) die("the prompt is empty: give -p TEXT or --tokens IDS%s%s", "", "");
    for (int i = 0; i < P + n_force; i++) {
        const int32_t id = i < P ? ids[i] : force[i - P];
        if (id >= V) {
            char msg[96];
            snprintf(msg, sizeof(msg), "token id %d is out of range (the vocabulary has %d ids)", id, V);
            die("%s %s", i < P ? "prompt" : "--force", msg);
        }
    }
    if (n_ctx == 0) n_ctx = P + n_gen;
    if (P + n_gen > n_ctx) {
        char msg[96];
        snprintf(msg, sizeof(msg), "%d prompt + %d generated tokens exceed --ctx %d", P, n_gen, n_ctx);
        die("%s%s", msg, "");
    }

    FILE *dumpf = NULL;
    if (dump && !(dumpf = fopen(dump, "wb"))) {
        char msg[64];
        snprintf(msg, sizeof(msg), "%s", strerror(errno));
        die("cannot write '%s': %s", dump, msg);
    }
    ds4_model_describe(m, stderr);
    if (!prompt_ids && !tok)
        fprintf(stderr, "ds4: model has no vocabulary: prompt text is fed as byte-level ids (one id per byte)\n");

    ds4_ctx *c = ds4_ctx_new(m, be, n_ctx, P, err, sizeof(err));
    if (!c) {
        if (err[0]) fprintf(stderr, "ds4: %s\n", err);   /* empty: the backend already said why */
        ds4_model_close(m);
        return 1;
    }
    const double t_load = now_s() - t0;

    const int rows = P + n_gen;
    float *logits = dump ? malloc(sizeof(float) * (size_t)rows * V) : malloc(sizeof(float) * (size_t)P * V);
    float *last = malloc(sizeof(float) * V);
    int32_t *fed = malloc(sizeof(int32_t) * rows);
    void *scratch = malloc((sizeof(float) + sizeof(int)) * (size_t)V);
    if (!logits || !last || !fed || !scratch) die("out of host memory for %s%s", "logits", "");
    memcpy(fed, ids, sizeof(int32_t) * P);

    ds4_sampler smp;
    ds4_sampler_init(&smp, temp, top_p, seed);

    double tp0 = now_s();
    if (ds4_eval(c, ids, P, dump ? logits : last, dump ? 1 : 0, err, sizeof(err)) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        return 1;
    }
    const double t_prefill = now_s() - tp0;
    const float *prev = dump ? logits + (size_t)(P - 1) * V : last;

    printf("prompt ids:");
    for (int i = 0; i < P; i++) printf(" %d", ids[i]);
    printf("\n");
    fflush(stdout);

    int32_t *gen = malloc(sizeof(int32_t) * (n_gen ? n_gen : 1));
    double td0 = now_s();
    for (int j = 0; j < n_gen; j++) {
        const int32_t next = force ? force[j] : ds4_sample(&smp, prev, V, scratch);
        if (next == eos) { n_gen = j; break; }   /* --chat: the answer is complete */
        gen[j] = next;
        fed[P + j] = next;
        float *out = dump ? logits + (size_t)(P + j) * V : last;
        if (ds4_eval(c, &next, 1, out, 0, err, sizeof(err)) != 0) {
            fprintf(stderr, "ds4: %s\n", err);
            return 1;
        }
        prev = out;
    }
    const double t_decode = now_s() - td0;

    printf("generated ids:");
    for (int j = 0; j < n_gen; j++) printf(" %d", gen[j]);
    printf("\ntext: ");
    if (prompt && !prompt_ids) for (int i = 0; i < P; i++) print_token(m, tok, ids[i]);
    printf("[");
    for (int j = 0; j < n_gen; j++) print_token(m, tok, gen[j]);
    printf("]\n");
    printf("speed: load %.2f s, prefill %d tokens in %.3f s (%.1f tok/s), decode %d tokens in %.3f s (%.2f tok/s), backend %s\n",
           t_load, P, t_prefill, P / (t_prefill > 0 ? t_prefill : 1e-9), n_gen, t_decode,
           n_gen / (t_decode > 0 ? t_decode : 1e-9), be->name);

    int rc = 0;
    if (dumpf && write_dump(dumpf, dump, V, P, n_gen, fed, logits) != 0) rc = 1;
    free(gen); free(scratch); free(fed); free(last); free(logits);
    if (ids != prompt_ids) free(ids);
    free(prompt_ids); free(force);
    ds4_ctx_free(c);
    ds4_model_close(m);
    return rc;
}
