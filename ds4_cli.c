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
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ds4.h"
#include "ds4_gpu.h"
#include "ds4_tok.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The errors of main: one line on stderr, exit status 2. */
__attribute__((format(printf, 1, 2), noreturn))
static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ds4: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(2);
}

/* The errors of the parsers: one line into err, for the caller to print; returns -1. */
__attribute__((format(printf, 3, 4)))
static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (errlen) vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
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
        "  --stats             after the run, the backend's counters over the decode steps:\n"
        "                      launches per step, device allocations, frees and waits\n"
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

/* ---- argument parsing ----
 *
 * cli_parse (the run options) and synth_parse (`ds4 synth`) turn argv into a struct and
 * nothing else: no model is opened, no file is touched, nothing is printed and nothing exits.
 * Each returns 0, or -1 with one line in err, which main prints as "ds4: <err>" before it
 * exits with status 2. The checks that need a model (token ids against the vocabulary, the
 * context size against the prompt) or the filesystem (the default model, --dump-logits) come
 * after, in main. Whatever the result, the caller releases the struct with cli_opts_free or
 * synth_opts_free. tests/fuzz/fuzz_cli.c feeds both parsers arbitrary argument vectors. */

/* An argument as an error line quotes it (ds4_show): at most SHOW_MAX bytes, "..." when cut. */
enum { SHOW_MAX = 64, SHOW_BUF = SHOW_MAX * 4 + 4 };

static const char *show(char out[SHOW_BUF], const char *s) { return ds4_show(out, SHOW_BUF, s, strlen(s), SHOW_MAX); }

static int parse_int(const char *flag, const char *s, int lo, int hi, int *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return fail(err, errlen, "%s expects an integer in [%d, %d]", flag, lo, hi);
    *out = (int)v;
    return 0;
}

/* A non-negative decimal. strtoull skips leading blanks and negates after them (" -1" would be
 * 2^64-1), so any '-' is refused. */
static int parse_u64(const char *flag, const char *s, uint64_t *out, char *err, size_t errlen) {
    char *end, sh[SHOW_BUF];
    errno = 0;
    if (strchr(s, '-')) return fail(err, errlen, "%s expects a non-negative integer, got '%s'", flag, show(sh, s));
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end) return fail(err, errlen, "%s expects a non-negative integer, got '%s'", flag, show(sh, s));
    *out = (uint64_t)v;
    return 0;
}

static int parse_float(const char *flag, const char *s, float lo, float hi, float *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return fail(err, errlen, "%s expects a number in [%g, %g]", flag, lo, hi);
    *out = v;
    return 0;
}

/* "1,2,3" -> *ids (malloc'd, *n ids, at least one), freeing the list an earlier --tokens or
 * --force left there (the last one given wins); -1 with a message on a malformed list. */
static int parse_ids(const char *flag, const char *s, int32_t **ids_out, int *n_out, char *err, size_t errlen) {
    char sh[SHOW_BUF];
    if (!*s) return fail(err, errlen, "%s expects comma-separated token ids, got ''", flag);
    int cap = 16, n = 0;
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    if (!ids) return fail(err, errlen, "%s: out of memory", flag);
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(ids);
            return fail(err, errlen, "%s expects comma-separated non-negative token ids, got '%s'", flag, show(sh, s));
        }
        if (n == cap) {
            int32_t *more = cap <= INT_MAX / 2 ? realloc(ids, sizeof(int32_t) * (size_t)cap * 2) : NULL;
            if (!more) { free(ids); return fail(err, errlen, "%s: out of memory", flag); }
            ids = more;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
        p = *end == ',' ? end + 1 : end;
        if (*end == ',' && !*p) { free(ids); return fail(err, errlen, "%s: trailing comma in '%s'", flag, show(sh, s)); }
    }
    free(*ids_out);
    *ids_out = ids;
    *n_out = n;
    return 0;
}

/* The run options. Strings point into argv; the id lists are the struct's own. */
struct cli_opts {
    int help;                                  /* -h/--help: print the usage, run nothing */
    const char *model_path, *prompt, *dump;    /* -m, -p, --dump-logits; NULL when not given */
    const char *backend;                       /* "cpu" or "cuda" (the build's default when not given) */
    int32_t *prompt_ids, *force;               /* --tokens, --force: NULL, or n >= 1 ids >= 0 */
    int n_prompt_ids, n_force;
    int n_gen, n_gen_set;                      /* -n, in [0, 2^24] (default 32, or --force's count) */
    int n_ctx;                                 /* -c/--ctx in [1, 2^24]; 0: prompt + n */
    float temp, top_p;                         /* [0, 100], [1e-6, 1] */
    uint64_t seed;
    int chat, think;
    int stats;                                 /* --stats */
    int threads;                               /* --threads in [1, 64]; 0: not given */
};

static void cli_opts_free(struct cli_opts *o) {
    free(o->prompt_ids);
    free(o->force);
    o->prompt_ids = o->force = NULL;
    o->n_prompt_ids = o->n_force = 0;
}

static int cli_parse(int argc, char **argv, struct cli_opts *o, char *err, size_t errlen) {
    static const char *known[] = { "-m", "-p", "--tokens", "-n", "--temp", "--top-p", "--seed", "-c",
                                   "--ctx", "--backend", "--dump-logits", "--force", "--threads" };
    char sh[SHOW_BUF];
    memset(o, 0, sizeof *o);
    o->n_gen = 32;
    o->top_p = 1.0f;
    o->seed = 1;
    if (errlen) err[0] = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { o->help = 1; return 0; }
        if (!strcmp(a, "--chat")) { o->chat = 1; continue; }       /* the flags without a value */
        if (!strcmp(a, "--think")) { o->think = 1; continue; }
        if (!strcmp(a, "--stats")) { o->stats = 1; continue; }
        int is_known = 0;
        for (size_t q = 0; q < sizeof(known) / sizeof(known[0]); q++) if (!strcmp(a, known[q])) is_known = 1;
        if (!is_known) return fail(err, errlen, "unknown option '%s' (see ds4 --help)", show(sh, a));
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return fail(err, errlen, "option %s needs a value (see ds4 --help)", a);
        int rc = 0;
        if (!strcmp(a, "-m")) o->model_path = v;
        else if (!strcmp(a, "-p")) o->prompt = v;
        else if (!strcmp(a, "--tokens")) rc = parse_ids(a, v, &o->prompt_ids, &o->n_prompt_ids, err, errlen);
        else if (!strcmp(a, "-n")) { rc = parse_int(a, v, 0, 1 << 24, &o->n_gen, err, errlen); o->n_gen_set = 1; }
        else if (!strcmp(a, "--temp")) rc = parse_float(a, v, 0.0f, 100.0f, &o->temp, err, errlen);
        else if (!strcmp(a, "--top-p")) rc = parse_float(a, v, 1e-6f, 1.0f, &o->top_p, err, errlen);
        else if (!strcmp(a, "--seed")) rc = parse_u64(a, v, &o->seed, err, errlen);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx")) rc = parse_int(a, v, 1, 1 << 24, &o->n_ctx, err, errlen);
        else if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--dump-logits")) o->dump = v;
        else if (!strcmp(a, "--force")) rc = parse_ids(a, v, &o->force, &o->n_force, err, errlen);
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 1, 64, &o->threads, err, errlen);
        if (rc) return -1;
        i++;
    }
    if (o->prompt && o->prompt_ids) return fail(err, errlen, "give either -p or --tokens, not both");
    if (o->think && !o->chat) return fail(err, errlen, "--think goes with --chat");
    if (o->chat && o->prompt_ids) return fail(err, errlen, "--chat wraps -p TEXT; it does not take --tokens");
    if (o->force && !o->n_gen_set) o->n_gen = o->n_force;
    if (o->force && o->n_force < o->n_gen) return fail(err, errlen, "--force gives fewer ids than -n asks to generate");
#ifdef DS4_CUDA
    if (!o->backend) o->backend = "cuda";
    if (strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda"))
        return fail(err, errlen, "unknown --backend '%s' (cpu or cuda)", show(sh, o->backend));
#else
    if (!o->backend) o->backend = "cpu";
    if (!strcmp(o->backend, "cuda"))
        return fail(err, errlen, "--backend cuda: this ds4 was built without CUDA (run: make cuda CUDA_ARCH=sm_90)");
    if (strcmp(o->backend, "cpu")) return fail(err, errlen, "unknown --backend '%s' (cpu or cuda)", show(sh, o->backend));
#endif
    return 0;
}

/* The `ds4 synth` options: argv as main's, argv[1] being "synth". */
struct synth_opts {
    int help;
    const char *config;          /* --config, with --vocab and --experts folded in ("NAME+vocab@E") */
    const char *out;             /* -o */
    const char *type;            /* --type, or the config's default (f32; flash16: q8_0) */
    int wtype;                   /* ds4_parse_wtype(type) */
    int layout;                  /* a published files' layout (-q2, -q4): its own tensor types */
    uint64_t seed;
    int experts, vocab;          /* --experts in [1, 1024] (0: the config's), --vocab */
    int threads;                 /* --threads in [1, 64]; 0: not given */
    char *folded;                /* malloc'd: config when --vocab or --experts rewrote it */
};

static void synth_opts_free(struct synth_opts *o) {
    free(o->folded);
    o->folded = NULL;
}

static int synth_parse(int argc, char **argv, struct synth_opts *o, char *err, size_t errlen) {
    char sh[SHOW_BUF];
    memset(o, 0, sizeof *o);
    o->seed = 1;
    if (errlen) err[0] = 0;
    const char *type = NULL;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { o->help = 1; return 0; }
        if (!strcmp(a, "--vocab")) { o->vocab = 1; continue; }   /* the one flag without a value */
        if (strcmp(a, "--config") && strcmp(a, "--seed") && strcmp(a, "--type") && strcmp(a, "-o") &&
            strcmp(a, "--threads") && strcmp(a, "--experts"))
            return fail(err, errlen, "unknown synth option '%s' (see ds4 synth --help)", show(sh, a));
        if (!v) return fail(err, errlen, "option %s needs a value", a);
        int rc = 0;
        if (!strcmp(a, "--config")) o->config = v;
        else if (!strcmp(a, "--seed")) rc = parse_u64(a, v, &o->seed, err, errlen);
        else if (!strcmp(a, "--type")) type = v;
        else if (!strcmp(a, "-o")) o->out = v;
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 1, 64, &o->threads, err, errlen);
        else if (!strcmp(a, "--experts")) rc = parse_int(a, v, 1, 1024, &o->experts, err, errlen);
        if (rc) return -1;
        i++;
    }
    if (!o->config) return fail(err, errlen, "synth needs --config (tiny, small, flash16, small-q2, small-q4, flash-q2 or flash-q4)");
    if (!o->out) return fail(err, errlen, "synth needs -o FILE");
    if (o->experts || o->vocab) {          /* "NAME+vocab@E" for the synth API */
        const char *config = o->config;
        if (o->experts && strchr(config, '@')) return fail(err, errlen, "give the expert count once (--experts or NAME@E)");
        if (o->vocab && strstr(config, "+vocab")) return fail(err, errlen, "give the vocabulary once (--vocab or NAME+vocab)");
        /* all of it, whatever its length: a cut could turn a bad config into a good one */
        const char *at = strchr(config, '@');
        const size_t name = at ? (size_t)(at - config) : strlen(config);
        const size_t size = strlen(config) + sizeof "+vocab" + sizeof "@1024";
        char *buf = o->folded = malloc(size);
        if (!buf) return fail(err, errlen, "out of memory");
        memcpy(buf, config, name);
        snprintf(buf + name, size - name, "%s%s", o->vocab ? "+vocab" : "", at ? at : "");
        if (o->experts) snprintf(buf + strlen(buf), size - strlen(buf), "@%d", o->experts);
        o->config = buf;
    }
    o->layout = strstr(o->config, "-q2") || strstr(o->config, "-q4");
    if (o->layout && type)
        return fail(err, errlen, "--type does not apply to the %s layout (its tensor types are the published files')", show(sh, o->config));
    o->type = type ? type : !strncmp(o->config, "flash16", 7) ? "q8_0" : "f32";
    o->wtype = ds4_parse_wtype(o->type);
    if (o->wtype < 0) return fail(err, errlen, "unknown --type '%s' (f32, f16, bf16 or q8_0)", show(sh, o->type));
    return 0;
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
    if (id < 0) die("--chat: the vocabulary has no '%s' token", text);
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
    char sh[SHOW_BUF];
    if (!ok) { fprintf(stderr, "ds4: short write to '%s'\n", show(sh, path)); return -1; }
    return 0;
}

static int cmd_synth(int argc, char **argv, int threads) {
    struct synth_opts o;
    char err[512];
    if (synth_parse(argc, argv, &o, err, sizeof err) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        synth_opts_free(&o);
        return 2;
    }
    if (o.help) { usage(stdout); synth_opts_free(&o); return 0; }
    if (o.threads) threads = o.threads;
    double t0 = now_s();
    int rc = 0;
    if (ds4_synth_write(o.config, o.seed, o.wtype, o.out, threads, err, sizeof(err)) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        rc = 1;
    } else {
        fprintf(stderr, "ds4: wrote %s (config %s, seed %llu, %s) in %.2f s\n", o.out, o.config,
                (unsigned long long)o.seed, o.layout ? "the published files' tensor types" : o.type, now_s() - t0);
    }
    synth_opts_free(&o);
    return rc;
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
        if (argc != 3) die("usage: ds4 info FILE");
        ds4_model *m = ds4_model_open(argv[2], err, sizeof(err));
        if (!m) { fprintf(stderr, "ds4: %s: %s\n", argv[2], err); return 1; }
        ds4_model_info(m, stdout);
        ds4_model_close(m);
        return 0;
    }

    struct cli_opts o;
    if (cli_parse(argc, argv, &o, err, sizeof err) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        cli_opts_free(&o);
        return 2;
    }
    if (o.help) { usage(stdout); cli_opts_free(&o); return 0; }
    const char *model_path = o.model_path, *prompt = o.prompt, *dump = o.dump;
    int32_t *prompt_ids = o.prompt_ids, *force = o.force;
    const int n_prompt_ids = o.n_prompt_ids, n_force = o.n_force, chat = o.chat, think = o.think;
    int n_gen = o.n_gen, n_ctx = o.n_ctx;
    if (o.threads) threads = o.threads;
    if (threads > 0) ds4_cpu_set_threads(threads);

    const ds4_backend *be = ds4_backend_cpu();
#ifdef DS4_CUDA
    if (!strcmp(o.backend, "cuda")) be = ds4_backend_cuda();
#endif
    if (env.hooks && (env.hooks_ring_mb || env.hooks_throttle_us) && !strcmp(be->name, "cpu"))
        fprintf(stderr, "ds4: DS4_HOOKS_RING_MB, DS4_HOOKS_THROTTLE_US: the cpu backend writes each record as its op "
                "returns; it has no rings and no drain to size or slow\n");
    if (env.launch_trace && !strcmp(be->name, "cpu"))
        fprintf(stderr, "ds4: DS4_LAUNCH_TRACE: the cpu backend launches no kernels; nothing is traced\n");
    if (env.cuda_graphs && !strcmp(be->name, "cpu"))
        fprintf(stderr, "ds4: DS4_CUDA_GRAPHS=1: the cpu backend records no graphs; every step runs eagerly\n");
    else if (env.cuda_graphs)
        fprintf(stderr, "ds4: DS4_CUDA_GRAPHS=1: decode steps are recorded as CUDA graphs (%s) and replayed; "
                "the prompt runs eagerly\n", env.graph_layers ? "clusters of DS4_CUDA_GRAPH_LAYERS layers" : "one per step");

    char defpath[PATH_MAX + 32], sh[SHOW_BUF];
    if (!model_path) {
        model_path = default_model_path(defpath, sizeof(defpath));
        if (access(model_path, R_OK) != 0)
            die("no -m given and the embedded default model %s is missing (run: make)", show(sh, model_path));
    }
    double t0 = now_s();
    ds4_model *m = ds4_model_open(model_path, err, sizeof(err));
    if (!m) { fprintf(stderr, "ds4: %s\n", err); return 1; }
    if (ds4_hooks_check(m, &env, err, sizeof err) != 0) { fprintf(stderr, "ds4: %s\n", err); return 2; }
    const int V = ds4_model_n_vocab(m);

    /* prompt ids: --tokens as given; -p through the model's tokenizer (BOS first
     * when the vocabulary has one), or one byte-level id per byte without one.
     * --chat: BOS <｜User｜> prompt <｜Assistant｜> then </think> (thinking off)
     * or <think> (--think); generation stops at EOS. */
    int P = 0;
    int32_t *ids;
    ds4_tok *tok = ds4_model_has_vocab(m) ? ds4_model_tokenizer(m, err, sizeof(err)) : NULL;
    if (ds4_model_has_vocab(m) && !tok) { fprintf(stderr, "ds4: %s\n", err); return 1; }
    if (chat && !tok) die("--chat needs a model with a vocabulary (this one has none)");
    if (prompt_ids) {
        P = n_prompt_ids;
        ids = prompt_ids;
    } else if (tok) {
        if (!prompt) prompt = "Once upon a time";
        const size_t len = strlen(prompt);
        const int n = ds4_tok_encode(tok, prompt, len, 0, NULL, 0);
        if (n < 0) die("cannot tokenize the prompt");
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
        if (V < 256) die("-p feeds byte-level ids, but this model's vocabulary has fewer than 256 ids: pass --tokens");
        P = (int)strlen(prompt);
        ids = malloc(sizeof(int32_t) * (P ? P : 1));
        for (int i = 0; i < P; i++) ids[i] = (unsigned char)prompt[i];
    }
    const int eos = chat ? ds4_model_eos(m) : -1;
    if (P == 0) die("the prompt is empty: give -p TEXT or --tokens IDS");
    for (int i = 0; i < P + n_force; i++) {
        const int32_t id = i < P ? ids[i] : force[i - P];
        if (id >= V)
            die("%s token id %d is out of range (the vocabulary has %d ids)", i < P ? "prompt" : "--force", id, V);
    }
    if (n_ctx == 0) n_ctx = P + n_gen;
    if (P + n_gen > n_ctx) die("%d prompt + %d generated tokens exceed --ctx %d", P, n_gen, n_ctx);

    FILE *dumpf = NULL;
    if (dump && !(dumpf = fopen(dump, "wb"))) die("cannot write '%s': %s", show(sh, dump), strerror(errno));
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
    if (!logits || !last || !fed || !scratch) die("out of host memory for logits");
    memcpy(fed, ids, sizeof(int32_t) * P);

    ds4_sampler smp;
    ds4_sampler_init(&smp, o.temp, o.top_p, o.seed);

    double tp0 = now_s();
    if (ds4_eval(c, ids, P, dump ? logits : last, dump ? 1 : 0, err, sizeof(err)) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        return 1;
    }
    const double t_prefill = now_s() - tp0;
    ds4_backend_stats bst;
    ds4_ctx_stats(c, &bst, 1);                  /* --stats counts the decode steps only */
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

    if (o.stats) {
        ds4_ctx_stats(c, &bst, 0);
        const double ns = n_gen > 0 ? (double)n_gen : 1.0;
        printf("stats: decode %d steps on %s: %.1f launches per step (%.1f us of host time), "
               "%llu device allocations, %llu frees, %llu device syncs, %llu stream syncs\n",
               n_gen, be->name, (double)bst.launches / ns, bst.launch_seconds * 1e6 / ns,
               (unsigned long long)bst.mallocs, (unsigned long long)bst.frees,
               (unsigned long long)bst.device_syncs, (unsigned long long)bst.stream_syncs);
        if (env.cuda_graphs)
            printf("stats: graphs: %llu captures (%.1f ms capture, %.1f ms instantiate), %llu replays, "
                   "%llu eager fallbacks; %llu held, %llu nodes, %.1f MiB; programmatic dependent launch %s\n",
                   (unsigned long long)bst.captures, bst.capture_ms, bst.instantiate_ms,
                   (unsigned long long)bst.replays, (unsigned long long)bst.fallbacks, (unsigned long long)bst.graphs,
                   (unsigned long long)bst.graph_nodes, (double)bst.graph_bytes / (1024.0 * 1024.0),
                   bst.graph_pdl ? "on" : "off");
    }
    int rc = 0;
    ds4_hooks_stats hst;
    if (ds4_ctx_hooks_stats(c, &hst) == 0) {      /* DS4_HOOKS: every record written by now */
        if (o.stats)
            printf("stats: hooks: %llu records produced, %llu written (%.1f MB), %llu dropped in %llu gaps, "
                   "%llu producer waits, %llu drain batches (%.1f GB/s copying)\n",
                   (unsigned long long)hst.produced, (unsigned long long)hst.written, hst.payload_bytes / 1e6,
                   (unsigned long long)hst.dropped, (unsigned long long)hst.gaps, (unsigned long long)hst.waits,
                   (unsigned long long)hst.batches,
                   hst.copy_seconds > 0 ? hst.payload_bytes / hst.copy_seconds / 1e9 : 0.0);
        if (hst.err) rc = 1;                      /* the line naming it comes when the context closes */
    }

    if (dumpf && write_dump(dumpf, dump, V, P, n_gen, fed, logits) != 0) rc = 1;
    free(gen); free(scratch); free(fed); free(last); free(logits);
    if (ids != prompt_ids) free(ids);
    cli_opts_free(&o);
    ds4_ctx_free(c);
    ds4_model_close(m);
    return rc;
}
