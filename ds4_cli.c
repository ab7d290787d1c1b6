/* ds4_cli.c -- the `ds4` program: run a DeepSeek V4 model, or write a synthetic one.
 *
 *   ds4 [-m FILE] [-p TEXT [--chat [--think] [-i]] | --tokens IDS] [-n N] [--temp T] [--top-p P]
 *       [--seed S] [-c N] [--backend cpu|cuda] [--dump-logits FILE] [--force IDS] [--threads N]
 *       [--mtp-draft D] [--mtp MTPFILE] [-v]
 *   ds4 synth --config NAME [--seed N] [--type f32|f16|bf16|q8_0] [--mtp | --mtp-file] -o FILE
 *   ds4 info FILE [--ctx N] [--mtp MTPFILE]
 *   ds4 collect -i CORPUS -o DIR --hooks SPEC   (ds4_collect.c)
 *
 * Without -m it runs the embedded default model, models/ds4-tiny.gguf beside the binary (the
 * build writes it).  Everything here is argument handling and reporting; the engine is ds4.c.
 *
 * What goes where: stdout carries the generated text and nothing else, written token by token
 * as it is sampled (UTF-8 whole: a character split across tokens waits for its last byte,
 * invalid bytes become U+FFFD, control characters their Unicode pictures).  stderr carries the
 * model line, the speed line, -v's ids and prompt, --stats, and every error.
 *
 * Exit status: 0 done; 1 a file, the model, the backend or the numbers failed; 2 a usage error
 * (a bad flag, value or combination); 130 stopped by Ctrl-C (the text so far is kept, every
 * output file is closed whole).  Output files (--dump-logits) are written beside their target
 * and renamed over it only when complete, so a failed run never destroys an earlier one. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ds4.h"
#include "ds4_gpu.h"
#include "ds4_tok.h"

int cmd_collect(int argc, char **argv);   /* `ds4 collect` (ds4_collect.c) */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { EXIT_FAIL = 1, EXIT_USAGE = 2 };   /* a stop by signal: 128 + the signal (Ctrl-C: 130) */

/* The errors of main: one line on stderr, then exit: die_usage for a bad flag, value or
 * combination (status 2), die_run for everything else -- files, the model, memory (status 1). */
__attribute__((format(printf, 2, 3), noreturn))
static void die_status(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ds4: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(status);
}
#define die_usage(...) die_status(EXIT_USAGE, __VA_ARGS__)
#define die_run(...) die_status(EXIT_FAIL, __VA_ARGS__)

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
        "usage: ds4 [options]                 run a deepseek4 GGUF model; the text goes to stdout\n"
        "       ds4 synth [options] -o FILE   write a synthetic deepseek4 GGUF\n"
        "       ds4 info FILE [--ctx N] [--mtp MTPFILE]\n"
        "                                     tensor types, parameters, memory and decode bytes of a GGUF;\n"
        "                                     with --ctx, the memory plan of a context of N positions;\n"
        "                                     with --mtp, the model with the MTP block of MTPFILE\n"
        "       ds4 collect -i CORPUS -o DIR --hooks SPEC [options]\n"
        "                                     hook activations of a corpus as a Hugging Face datasets\n"
        "                                     directory (ds4 collect --help)\n"
        "\n"
        "run options (each at most once):\n"
        "  -m FILE             model (default: models/ds4-tiny.gguf beside the binary)\n"
        "  -p TEXT             prompt text, through the model's tokenizer (BOS first); models\n"
        "                      without a vocabulary: one id per byte\n"
        "  --chat              wrap -p in the V4 chat format and stop at EOS (README)\n"
        "  --think             with --chat: thinking on (<think>), else off (</think>)\n"
        "  -i, --interactive   with --chat: a conversation, one turn per line of stdin (-p, if\n"
        "                      given, is the first); the history stays in the context\n"
        "  -f, --file FILE     prompt text from FILE (- for stdin), as -p takes it: long documents\n"
        "  --tokens IDS        prompt as comma-separated token ids (instead of -p)\n"
        "  -n N                tokens to generate (default 32; per turn with -i)\n"
        "  --temp T            sampling temperature, 0 = greedy (default 0)\n"
        "  --top-p P           nucleus sampling threshold in (0, 1] (default 1)\n"
        "  --seed S            sampling seed (default 1)\n"
        "  -c, --ctx N         context size in tokens (default: prompt + n; -i: 4096 or the model's)\n"
        "  --backend B         cpu or cuda (default: cuda in a CUDA build, else cpu)\n"
        "  --dump-logits FILE  write every row's logits in the DS4LOGIT format (README)\n"
        "  --force IDS         teacher forcing: decode step j feeds IDS[j] instead of the sample\n"
        "                      (as many ids as -n asks for; without -n, -n is their count)\n"
        "  --allow-nonfinite   go on when the logits hold NaN or Inf (default: stop, naming the row)\n"
        "  --threads N         CPU threads (default: DS4_THREADS or all cores)\n"
        "  --mtp-draft D       speculative decoding: D tokens (1..3) drafted by the model's MTP\n"
        "                      head, checked by the model in one call; greedy: the tokens are\n"
        "                      plain greedy decoding's (CPU: the logits too, byte for byte);\n"
        "                      --temp > 0: each token has plain sampling's distribution (default: off)\n"
        "  --mtp FILE          the MTP block from a file of its own, for a model without one: the\n"
        "                      block split out of a model that has it (ds4 synth --mtp-file writes\n"
        "                      one; README, \"Speculative decoding\")\n"
        "  -v, --verbose       also print the prompt, the prompt ids and the generated ids (stderr)\n"
        "  --stats             after the run, the backend's counters over the decode steps:\n"
        "                      launches per step, device allocations, frees and waits; with\n"
        "                      --mtp-draft, the drafts made and accepted\n"
        "  -h, --help          this text\n"
        "\n"
        "synth options:\n"
        "  --config NAME       tiny, small, slim, flash16, or the published files' layouts small-q2,\n"
        "                      small-q4, flash-q2, flash-q4 (IQ2_XXS/Q2_K or Q4_K experts)\n"
        "  --seed N            weight seed (default 1)\n"
        "  --experts E         routed experts (default: the config's; top-k to 1024)\n"
        "  --vocab             a byte-level BPE vocabulary (default: none, raw ids)\n"
        "  --mtp               an MTP block after the layers (llama.cpp's blk.<n_layer>.nextn.* names;\n"
        "                      ds4 reads it and decodes without it)\n"
        "  --mtp-file          the MTP block alone: the file `ds4 --mtp FILE` adds to the model the\n"
        "                      same config and seed write without --mtp (the same bytes as --mtp's)\n"
        "  --type T            matrix type f32, f16, bf16 or q8_0 (default f32; flash16: q8_0)\n"
        "  --ctx N             the context_length the file declares (default: the config's)\n"
        "  -o FILE             output path\n"
        "\n"
        "Environment: DS4_THREADS and the other DS4_* variables (CUDA graphs, hooks, tracing) are\n"
        "listed with their defaults in README.md, \"Environment variables\"; an unknown DS4_* name\n"
        "is an error.  Exit status: 0 done, 1 failed, 2 usage error, 130 interrupted (Ctrl-C).\n");
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
    const char *prompt_file;                   /* -f: the prompt text from a file ("-": stdin) */
    const char *backend;                       /* "cpu" or "cuda" (the build's default when not given) */
    int32_t *prompt_ids, *force;               /* --tokens, --force: NULL, or n >= 1 ids >= 0 */
    int n_prompt_ids, n_force;
    int n_gen, n_gen_set;                      /* -n, in [0, 2^24] (default 32, or --force's count) */
    int n_ctx;                                 /* -c/--ctx in [1, 2^24]; 0: prompt + n (-i: 4096) */
    float temp, top_p;                         /* [0, 100], [1e-6, 1] */
    uint64_t seed;
    int chat, think, interactive;              /* --chat, --think, -i */
    int verbose;                               /* -v: the prompt and the ids on stderr */
    int allow_nonfinite;                       /* --allow-nonfinite: NaN/Inf logits do not stop the run */
    int stats;                                 /* --stats */
    int threads;                               /* --threads in [1, 64]; 0: not given */
    int mtp_draft;                             /* --mtp-draft in [1, 3]; 0: off */
    const char *mtp_file;                      /* --mtp FILE: the MTP block from a file of its own */
};

static void cli_opts_free(struct cli_opts *o) {
    free(o->prompt_ids);
    free(o->force);
    o->prompt_ids = o->force = NULL;
    o->n_prompt_ids = o->n_force = 0;
}

static int cli_parse(int argc, char **argv, struct cli_opts *o, char *err, size_t errlen) {
    /* every option, with its aliases; each may be given once (an alias counts as its option) */
    static const char *const opts[][2] = {
        { "-m", NULL }, { "-p", NULL }, { "--tokens", NULL }, { "-n", NULL }, { "--temp", NULL },
        { "--top-p", NULL }, { "--seed", NULL }, { "-c", "--ctx" }, { "--backend", NULL }, { "--dump-logits", NULL },
        { "--force", NULL }, { "--threads", NULL }, { "-f", "--file" }, { "--mtp-draft", NULL }, { "--mtp", NULL },
        /* the flags without a value, from here */
        { "--chat", NULL }, { "--think", NULL }, { "-i", "--interactive" }, { "-v", "--verbose" },
        { "--allow-nonfinite", NULL }, { "--stats", NULL },
    };
    enum { N_OPTS = sizeof opts / sizeof opts[0], FIRST_FLAG = 15 };
    int seen[N_OPTS] = {0};
    char sh[SHOW_BUF];
    memset(o, 0, sizeof *o);
    o->n_gen = 32;
    o->top_p = 1.0f;
    o->seed = 1;
    if (errlen) err[0] = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { o->help = 1; return 0; }
        int q = 0;
        while (q < N_OPTS && strcmp(a, opts[q][0]) && !(opts[q][1] && !strcmp(a, opts[q][1]))) q++;
        if (q == N_OPTS) return fail(err, errlen, "unknown option '%s' (see ds4 --help)", show(sh, a));
        if (seen[q]++) return fail(err, errlen, "%s is given twice (each option at most once)", opts[q][0]);
        if (q >= FIRST_FLAG) {
            if (!strcmp(a, "--chat")) o->chat = 1;
            else if (!strcmp(a, "--think")) o->think = 1;
            else if (!strcmp(a, "--allow-nonfinite")) o->allow_nonfinite = 1;
            else if (!strcmp(a, "--stats")) o->stats = 1;
            else if (q == FIRST_FLAG + 2) o->interactive = 1;
            else o->verbose = 1;
            continue;
        }
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
        else if (q == 7) rc = parse_int(a, v, 1, 1 << 24, &o->n_ctx, err, errlen);
        else if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--dump-logits")) o->dump = v;
        else if (!strcmp(a, "--force")) rc = parse_ids(a, v, &o->force, &o->n_force, err, errlen);
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 1, 64, &o->threads, err, errlen);
        else if (q == 12) o->prompt_file = v;
        else if (!strcmp(a, "--mtp-draft")) rc = parse_int(a, v, 1, 3, &o->mtp_draft, err, errlen);
        else if (!strcmp(a, "--mtp")) o->mtp_file = v;
        if (rc) return -1;
        i++;
    }
    if ((o->prompt != NULL) + (o->prompt_ids != NULL) + (o->prompt_file != NULL) > 1)
        return fail(err, errlen, "give one of -p, -f or --tokens");
    if (o->think && !o->chat) return fail(err, errlen, "--think goes with --chat");
    if (o->interactive && !o->chat) return fail(err, errlen, "-i goes with --chat (a conversation in the V4 chat format)");
    if (o->chat && o->prompt_ids) return fail(err, errlen, "--chat wraps -p TEXT; it does not take --tokens");
    if (o->interactive && o->prompt_file && !strcmp(o->prompt_file, "-"))
        return fail(err, errlen, "-i reads its turns from stdin; -f - would read the same");
    if (o->interactive && (o->force || o->dump))
        return fail(err, errlen, "-i takes neither --force nor --dump-logits (their rows need a fixed prompt)");
    if (o->force && !o->n_gen_set) o->n_gen = o->n_force;
    if (o->force && o->n_force != o->n_gen)
        return fail(err, errlen, "--force gives %d ids but -n asks for %d tokens (give as many ids as tokens)",
                    o->n_force, o->n_gen);
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
    int experts, vocab, mtp;     /* --experts in [1, 1024] (0: the config's), --vocab, --mtp */
    int mtp_file;                /* --mtp-file: the MTP block alone (ds4 --mtp FILE reads it) */
    int ctx;                     /* --ctx: context_length in [1, 2^24] (0: the config's) */
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
    int seed_set = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { o->help = 1; return 0; }
        if (!strcmp(a, "--vocab") || !strcmp(a, "--mtp") || !strcmp(a, "--mtp-file")) {   /* no value */
            int *f = !strcmp(a, "--vocab") ? &o->vocab : !strcmp(a, "--mtp") ? &o->mtp : &o->mtp_file;
            if ((*f)++) return fail(err, errlen, "%s is given twice (each option at most once)", a);
            continue;
        }
        if (strcmp(a, "--config") && strcmp(a, "--seed") && strcmp(a, "--type") && strcmp(a, "-o") &&
            strcmp(a, "--threads") && strcmp(a, "--experts") && strcmp(a, "--ctx"))
            return fail(err, errlen, "unknown synth option '%s' (see ds4 synth --help)", show(sh, a));
        if (!v) return fail(err, errlen, "option %s needs a value", a);
        int rc = 0;
        if ((!strcmp(a, "--config") && o->config) || (!strcmp(a, "--seed") && seed_set) || (!strcmp(a, "--type") && type) ||
            (!strcmp(a, "-o") && o->out) || (!strcmp(a, "--threads") && o->threads) || (!strcmp(a, "--experts") && o->experts) ||
            (!strcmp(a, "--ctx") && o->ctx))
            return fail(err, errlen, "%s is given twice (each option at most once)", a);
        if (!strcmp(a, "--seed")) seed_set = 1;
        if (!strcmp(a, "--config")) o->config = v;
        else if (!strcmp(a, "--seed")) rc = parse_u64(a, v, &o->seed, err, errlen);
        else if (!strcmp(a, "--type")) type = v;
        else if (!strcmp(a, "-o")) o->out = v;
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 1, 64, &o->threads, err, errlen);
        else if (!strcmp(a, "--experts")) rc = parse_int(a, v, 1, 1024, &o->experts, err, errlen);
        else if (!strcmp(a, "--ctx")) rc = parse_int(a, v, 1, DS4_SYNTH_MAX_CTX, &o->ctx, err, errlen);
        if (rc) return -1;
        i++;
    }
    if (!o->config) return fail(err, errlen, "synth needs --config (tiny, small, slim, flash16, small-q2, small-q4, flash-q2 or flash-q4)");
    if (!o->out) return fail(err, errlen, "synth needs -o FILE");
    if (o->mtp && o->mtp_file)
        return fail(err, errlen, "--mtp and --mtp-file exclude each other (a model with its MTP block, or the block alone)");
    if (o->experts || o->vocab || o->mtp || o->mtp_file || o->ctx) {   /* "NAME+vocab+mtp@E/N" for the synth API */
        const char *config = o->config;
        if (o->ctx && strchr(config, '/')) return fail(err, errlen, "give the context length once (--ctx or NAME/N)");
        if (o->experts && strchr(config, '@')) return fail(err, errlen, "give the expert count once (--experts or NAME@E)");
        if (o->vocab && strstr(config, "+vocab")) return fail(err, errlen, "give the vocabulary once (--vocab or NAME+vocab)");
        if ((o->mtp || o->mtp_file) && strstr(config, "+mtp"))
            return fail(err, errlen, "give the MTP block once (--mtp, --mtp-file, NAME+mtp or NAME+mtpfile)");
        /* all of it, whatever its length: a cut could turn a bad config into a good one.
         * NAME, then +vocab, then the config's @E or --experts, then its /N or --ctx */
        const size_t name = strcspn(config, "@/"), at_len = strcspn(config + name, "/");
        const size_t size = strlen(config) + sizeof "+vocab" + sizeof "+mtpfile" + sizeof "@1024" + sizeof "/16777216";
        char *buf = o->folded = malloc(size);
        if (!buf) return fail(err, errlen, "out of memory");
        snprintf(buf, size, "%.*s%s%s%.*s", (int)name, config, o->vocab ? "+vocab" : "",
                 o->mtp ? "+mtp" : o->mtp_file ? "+mtpfile" : "",
                 (int)at_len, config + name);
        if (o->experts) snprintf(buf + strlen(buf), size - strlen(buf), "@%d", o->experts);
        snprintf(buf + strlen(buf), size - strlen(buf), "%s", config + name + at_len);
        if (o->ctx) snprintf(buf + strlen(buf), size - strlen(buf), "/%d", o->ctx);
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

/* ---- the text on stdout ----
 *
 * Tokens arrive as byte pieces that may split a UTF-8 character, and a random-weight or
 * damaged model can emit any bytes.  The writer passes well-formed UTF-8 through, holds an
 * incomplete sequence until its last byte, writes U+FFFD for each maximal ill-formed
 * subsequence (Unicode's "substitution of maximal subparts"), and writes the C0 control
 * characters other than tab and newline, and DEL, as their Unicode control pictures
 * (U+2400 + c, U+2421), so that the text is valid UTF-8 a terminal shows as it is. */
typedef struct {
    FILE *f;
    unsigned char seq[4];
    int n, need;                 /* bytes held, bytes the held character needs */
    int err;                     /* errno of the first failed write, 0: none */
    int at_line_start;           /* the last byte written was a newline (or nothing was written) */
} textout;

static void tx_put(textout *t, const void *p, size_t n) {
    if (!n || t->err) return;
    if (fwrite(p, 1, n, t->f) != n) t->err = errno ? errno : EIO;
    t->at_line_start = ((const char *)p)[n - 1] == '\n';
}

static void tx_cp(textout *t, uint32_t cp) {   /* one code point < 0x10000 */
    unsigned char b[3];
    if (cp < 0x800) { b[0] = (unsigned char)(0xc0 | cp >> 6); b[1] = (unsigned char)(0x80 | (cp & 0x3f)); tx_put(t, b, 2); return; }
    b[0] = (unsigned char)(0xe0 | cp >> 12); b[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    b[2] = (unsigned char)(0x80 | (cp & 0x3f));
    tx_put(t, b, 3);
}

/* the range the second byte of a sequence led by lead must fall in */
static int tx_second_ok(unsigned char lead, unsigned char b) {
    if (lead == 0xe0) return b >= 0xa0 && b <= 0xbf;
    if (lead == 0xed) return b >= 0x80 && b <= 0x9f;
    if (lead == 0xf0) return b >= 0x90 && b <= 0xbf;
    if (lead == 0xf4) return b >= 0x80 && b <= 0x8f;
    return b >= 0x80 && b <= 0xbf;
}

static void tx_byte(textout *t, unsigned char b) {
    if (t->n) {
        if (t->n == 1 ? tx_second_ok(t->seq[0], b) : (b & 0xc0) == 0x80) {
            t->seq[t->n++] = b;
            if (t->n == t->need) { tx_put(t, t->seq, (size_t)t->n); t->n = 0; }
            return;
        }
        t->n = 0;
        tx_cp(t, 0xfffd);                        /* the held prefix; b starts afresh */
    }
    if (b < 0x80) {
        if ((b < 0x20 && b != '\n' && b != '\t') || b == 0x7f) tx_cp(t, b == 0x7f ? 0x2421 : 0x2400 + b);
        else tx_put(t, &b, 1);
    } else if (b >= 0xc2 && b <= 0xf4) {
        t->seq[0] = b;
        t->n = 1;
        t->need = b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4;
    } else {
        tx_cp(t, 0xfffd);                        /* a continuation byte alone, C0, C1, F5..FF */
    }
}

/* the end of the text: a character still incomplete is ill-formed */
static void tx_finish(textout *t) {
    if (t->n) { t->n = 0; tx_cp(t, 0xfffd); }
}

/* fflush, so the token is on its way; -1 once any write has failed */
static int tx_sync(textout *t) {
    if (!t->err && fflush(t->f) != 0) t->err = errno ? errno : EIO;
    return t->err ? -1 : 0;
}

/* A token's bytes: its piece for models with a vocabulary; the byte itself for byte-level ids
 * of models without one (ids past 255 as <id>). */
static void tx_token(textout *t, const ds4_model *m, const ds4_tok *tok, int32_t id) {
    char buf[512];
    int n = -1;
    if (tok) n = ds4_tok_piece(tok, id, buf, (int)sizeof buf);
    else if (!ds4_model_has_vocab(m) && id >= 0 && id < 256) { buf[0] = (char)id; n = 1; }
    if (n < 0) n = snprintf(buf, sizeof buf, "<%d>", id);
    for (int i = 0; i < n; i++) tx_byte(t, (unsigned char)buf[i]);
}

/* A special token of the vocabulary by its text, or a one-line error. */
static int32_t special_id(const ds4_tok *tok, const char *text) {
    const int32_t id = ds4_tok_find(tok, text);
    if (id < 0) die_run("--chat: the vocabulary has no '%s' token", text);
    return id;
}

/* ---- output files ----
 *
 * An output file is written beside its target (ds4_tmp_path: PATH.tmp-PID) and renamed over it
 * once whole, so a run that fails, early or late, leaves whatever was at PATH before untouched.
 * A target that exists and is not a regular file (/dev/null, /dev/full, a pipe) is written in
 * place: there is nothing to protect and nothing can be renamed over it. */
typedef struct {
    char *path, *tmp;            /* tmp NULL: written in place */
    FILE *f;
} outfile;

static int outfile_open(outfile *o, const char *path, char *err, size_t errlen) {
    char sh[SHOW_BUF];
    struct stat st;
    memset(o, 0, sizeof *o);
    o->path = strdup(path);
    if (!o->path) return fail(err, errlen, "out of memory");
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return fail(err, errlen, "cannot write '%s': it is a directory", show(sh, path));
    if (ds4_tmp_path(path, &o->tmp) != 0) return fail(err, errlen, "out of memory");
    if (!o->tmp) {
        o->f = fopen(path, "wb");
    } else {
        const int fd = open(o->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
        o->f = fd >= 0 ? fdopen(fd, "wb") : NULL;
        if (fd >= 0 && !o->f) close(fd);
    }
    if (!o->f) {
        const int e = errno;
        if (o->tmp) unlink(o->tmp);
        return fail(err, errlen, "cannot write '%s': %s", show(sh, path), strerror(e));
    }
    return 0;
}

/* close and put in place; -1 with the error printed */
static int outfile_commit(outfile *o) {
    char sh[SHOW_BUF];
    int ok = !ferror(o->f);
    if (fclose(o->f) != 0) ok = 0;
    o->f = NULL;
    if (ok && o->tmp && rename(o->tmp, o->path) != 0) {
        fprintf(stderr, "ds4: cannot put '%s' in place: %s\n", show(sh, o->path), strerror(errno));
        unlink(o->tmp);
        return -1;
    }
    if (!ok) {
        fprintf(stderr, "ds4: writing '%s' failed: %s\n", show(sh, o->path), strerror(errno ? errno : EIO));
        if (o->tmp) unlink(o->tmp);
        return -1;
    }
    return 0;
}

/* close and remove what was written; the target stays as it was */
static void outfile_abort(outfile *o) {
    if (o->f) fclose(o->f);
    if (o->tmp) unlink(o->tmp);
    o->f = NULL;
}

static void outfile_free(outfile *o) {
    free(o->path);
    free(o->tmp);
    o->path = o->tmp = NULL;
}

static int write_dump(outfile *o, int n_vocab, int P, int G, const int32_t *tok, const float *logits) {
    const int rows = P + G;
    int32_t hdr[6] = { 1, n_vocab, P, G, rows, 0 };
    int32_t *am = malloc(sizeof(int32_t) * (rows ? rows : 1));
    if (!am) { outfile_abort(o); fprintf(stderr, "ds4: out of memory writing the dump\n"); return -1; }
    for (int i = 0; i < rows; i++) am[i] = ds4_argmax(logits + (size_t)i * n_vocab, n_vocab);
    FILE *f = o->f;
    const int ok = fwrite("DS4LOGIT", 1, 8, f) == 8 && fwrite(hdr, 4, 6, f) == 6 &&
                   fwrite(tok, 4, rows, f) == (size_t)rows && fwrite(am, 4, rows, f) == (size_t)rows &&
                   fwrite(logits, 4, (size_t)rows * n_vocab, f) == (size_t)rows * n_vocab;
    free(am);
    if (!ok) {
        char sh[SHOW_BUF];
        fprintf(stderr, "ds4: writing '%s' failed: %s\n", show(sh, o->path), strerror(errno ? errno : EIO));
        outfile_abort(o);
        return -1;
    }
    return outfile_commit(o);
}

/* ---- Ctrl-C ----
 * The first SIGINT (or SIGTERM) asks the run to stop after the step or prompt chunk in flight
 * (the text so far, the dump and the stats are kept; exit 128 + the signal); a second one ends
 * the process as the signal does by default. */
static volatile sig_atomic_t g_interrupted;   /* the signal that asked to stop (SIGINT, SIGTERM), 0: none */

static void on_sigint(int sig) {
    g_interrupted = sig;
    signal(sig, SIG_DFL);
}

/* ---- the progress meters: one line on stderr when stderr is a terminal, for the prompt once
 * it has taken 2 s, for the generation when the text goes elsewhere (a file, a pipe) ---- */
typedef struct {
    int on;
    double t0, last, delay;
    int shown;
} meter;

static void meter_show(meter *mt, const char *what, long done, long total) {
    if (!mt->on) return;
    const double t = now_s();
    if ((t - mt->last < 0.25 && done < total) || t - mt->t0 < mt->delay) return;
    mt->last = t;
    const double rate = done / (t - mt->t0 > 1e-9 ? t - mt->t0 : 1e-9);
    const double eta = rate > 0 ? (total - done) / rate : 0;
    fprintf(stderr, "\r\033[Kds4: %s %ld/%ld tokens, %.1f tok/s, %.0f s left", what, done, total, rate, eta);
    mt->shown = 1;
}

static void meter_clear(meter *mt) {
    if (mt->shown) fprintf(stderr, "\r\033[K");
    mt->shown = 0;
}

/* index of the first non-finite value of l[0:n), or -1 */
static int first_nonfinite(const float *l, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &l[i], 4);
        if ((u & 0x7f800000u) == 0x7f800000u) return i;
    }
    return -1;
}

/* The logits rows [0, rows) of one call checked; -1 with one line naming the first bad row. */
static int check_rows(const float *l, int rows, int V, int pos0, const char *what) {
    for (int r = 0; r < rows; r++) {
        const int i = first_nonfinite(l + (size_t)r * V, V);
        if (i < 0) continue;
        fprintf(stderr, "ds4: non-finite logits in %s: row %d (position %d), vocab id %d is %s; the weights or the "
                "backend produced NaN/Inf (--allow-nonfinite goes on)\n", what, r, pos0 + r, i,
                l[(size_t)r * V + i] != l[(size_t)r * V + i] ? "NaN" : "Inf");
        return -1;
    }
    return 0;
}

static int cmd_synth(int argc, char **argv, int threads) {
    struct synth_opts o;
    char err[512];
    if (synth_parse(argc, argv, &o, err, sizeof err) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        synth_opts_free(&o);
        return EXIT_USAGE;
    }
    if (o.help) { usage(stdout); synth_opts_free(&o); return 0; }
    if (o.threads) threads = o.threads;
    double t0 = now_s();
    int rc = 0;
    if (ds4_synth_write(o.config, o.seed, o.wtype, o.out, threads, err, sizeof(err)) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        rc = ds4_synth_config_ok(o.config) ? EXIT_FAIL : EXIT_USAGE;   /* a config it does not know: usage */
    } else {
        fprintf(stderr, "ds4: wrote %s (config %s, seed %llu, %s) in %.2f s\n", o.out, o.config,
                (unsigned long long)o.seed, o.layout ? "the published files' tensor types" : o.type, now_s() - t0);
    }
    synth_opts_free(&o);
    return rc;
}

/* The embedded default model, models/ds4-tiny.gguf beside the binary (also ds4 collect's). */
const char *default_model_path(char *buf, size_t len) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return "models/ds4-tiny.gguf";
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (slash) *slash = 0;
    snprintf(buf, len, "%s/models/ds4-tiny.gguf", exe);
    return buf;
}

/* ---- a run ---- */

/* What the generation loop needs, for a single prompt and for each turn of -i. */
typedef struct {
    ds4_ctx *c;
    const ds4_model *m;
    const ds4_tok *tok;
    int V, eos, allow_nonfinite;
    ds4_sampler smp;
    void *scratch;               /* the sampler's: V floats + V ints */
    textout tx;
    meter mt, pmt;               /* the generation's, the prompt's */
    int32_t *gen;                /* the generated ids of the current call */
    int n_done;                  /* how many */
    int stopped;                 /* why the loop ended early: 0 no, 1 Ctrl-C, 2 failure */
    struct spec *sp;             /* --mtp-draft: the speculative decoder; NULL: off */
} run;

/* Between the prompt's chunks (ds4_ctx_set_progress): the meter, and Ctrl-C stops the prompt. */
static int on_chunk(void *user, int done, int total) {
    run *r = user;
    meter_show(&r->pmt, "prompt", done, total);
    return g_interrupted != 0;
}

/* ---- speculative decoding with the MTP head (--mtp-draft D) ----
 *
 * Each step drafts D tokens with the model's MTP head and checks them with the model in one
 * call of D + 1 rows: the token already chosen, then the drafts.  Row i's logits are those a
 * plain step would have after the same tokens, so the model's choice after row i is the token
 * plain greedy decoding takes there.  The drafts are taken while each equals the choice before
 * it; the first that does not is replaced by that choice (the next step's token), and the
 * positions of the drafts not taken are rolled back (ds4_ctx_rollback), so the next step sees
 * the context plain decoding would.  On the CPU a call of n rows gives each row the bytes of n
 * one-token calls (tests/test_chunks.py), so the tokens and the logits kept are plain greedy
 * decoding's, byte for byte (tests/test_mtp_spec.py).  With --temp > 0 the check is speculative
 * sampling's (spec_accept): each emitted token has plain sampling's distribution.
 *
 * The head follows the model as llama.cpp's MTP driver has it: its row at position k pairs the
 * token at k with the model's final streams at k - 1 (zeros at 0) and predicts the token at
 * k + 1.  Those rows are the head's history, in its own caches: one for every position the
 * model keeps, the prompt's included.  A step's first draft comes from such a row (the token
 * just chosen, the streams before it).  Draft i + 1 comes from a row that pairs draft i with
 * the head's own output streams of the row before (llama.cpp chains them so); those rows are
 * rolled back once the drafts are made (DS4_PART_MTP).  The rows of the drafts the model
 * accepted, paired with its streams, wait in a queue and go with the next step's first row in
 * one call.  The streams stay on the backend: the context's head queue (ds4_mtp_queue) holds
 * those rows, then the model's streams before its next position (the carry: zeros at 0), and
 * the decoder keeps the queued rows' tokens; a call takes the first rows, the carry stays.
 *
 * DS4_MTP_FORCE=P:FILE (a measurement knob for random-weight models, whose head is almost never
 * right): draft k of the step at generated token j becomes FILE's id j + 1 + k with
 * probability P (a generator seeded by --seed), else a token that differs from it; the head
 * still runs. */
typedef struct spec {
    int D, V;                    /* drafts per step, vocabulary */
    int32_t *tq;                 /* [D + 1] the tokens of the head queue's first nq rows (the row
                                    after them is the carry) */
    int nq;
    int hrows;                   /* rows of the head's last call */
    float *mlog;                 /* [V] the head's logits of its last row */
    float *vlog;                 /* [D + 1][V] the check call's logits, when no dump holds them */
    int sampling;                /* --temp > 0 (and no --force): speculative sampling */
    float *q;                    /* [D][V] sampling: the distributions the drafts were drawn from */
    float *p;                    /* [V] sampling: the model's distribution of one row, then its residue */
    float force_p;               /* DS4_MTP_FORCE */
    int32_t *ref;
    int n_ref;
    uint64_t rng;
    long base;                   /* tokens generated by earlier calls (-i turns): ref's index */
    int32_t *first;              /* [-n] per generated token j of a call, the head's own choice of the
                                    step's first draft when j is a step's first draft, else -1 (-v) */
    long steps, drafted, accepted;
    double t_draft, t_check;     /* seconds in the head's calls (drafting) and in the checks */
} spec;

static uint64_t spec_rand(uint64_t *s) {         /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The id that inverse-CDF sampling with u in [0, 1) picks from the distribution p[0:n) (ids in
 * order; the last id of non-zero mass when rounding leaves u past the sum). */
static int32_t spec_draw(const float *p, int n, double u) {
    double c = 0.0;
    int last = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] <= 0.0f) continue;
        c += p[i];
        last = i;
        if (u < c) return i;
    }
    return last;
}

/* The draft for generated token idx, from the head's choice tok (DS4_MTP_FORCE: FILE's id, or
 * one that differs from it). */
static int32_t spec_pick(spec *s, int32_t tok, long idx) {
    if (!s->ref) return tok;
    const double u = (double)(spec_rand(&s->rng) >> 11) * (1.0 / 9007199254740992.0);
    if (idx >= s->n_ref) return tok;
    const int32_t want = s->ref[idx];
    if (u < s->force_p) return want;
    return tok != want ? tok : (want + 1) % s->V;
}

/* Draft k (from 0) of a step, for generated token idx, from the head's logits in s->mlog:
 * sampling, drawn from the head's distribution with the run's sampler (kept in s->q for the
 * check); else the head's choice, through DS4_MTP_FORCE. */
static int32_t spec_choose(run *r, spec *s, int k, long idx) {
    if (!s->sampling) return spec_pick(s, ds4_argmax(s->mlog, s->V), idx);
    float *q = s->q + (size_t)k * s->V;
    ds4_sampler_probs(&r->smp, s->mlog, s->V, q, r->scratch);
    return spec_draw(q, s->V, ds4_sampler_uniform(&r->smp));
}

/* The queued head rows, if any, through the head: its logits of the last row into s->mlog
 * when want_logits.  0, or -1 with the line printed. */
static int spec_flush(run *r, spec *s, int want_logits) {
    char err[1024];
    if (!s->nq) return 0;
    if (ds4_mtp_eval_queued(r->c, s->tq, s->nq, want_logits ? s->mlog : NULL, 0, err, sizeof err) != 0) {
        fprintf(stderr, "ds4: the MTP head: %s\n", err);
        return -1;
    }
    s->hrows = s->nq;
    s->nq = 0;
    return 0;
}

/* The carry becomes the head's row of token tok (the next row queued is the next carry). */
static void spec_queue(spec *s, int32_t tok) { s->tq[s->nq++] = tok; }

/* n drafts for generated tokens j + 1 .. j + n into out: the queue (its last row the token just
 * chosen) gives the first, each further one the head's row of the one before, paired with the
 * head's own streams; those rows are then taken back.  0, or -1 with the line printed. */
static int spec_draft(run *r, spec *s, int n, long j, int32_t *out) {
    char err[1024];
    ds4_ctx *c = r->c;
    if (spec_flush(r, s, 1) != 0) return -1;
    s->first[j + 1] = ds4_argmax(s->mlog, s->V);
    out[0] = spec_choose(r, s, 0, s->base + j + 1);
    if (n == 1) return 0;
    const int mpos = ds4_ctx_mtp_pos(c);
    if (ds4_ctx_checkpoint(c, DS4_PART_MTP, n - 1, err, sizeof err) != 0) goto fail;
    for (int k = 1; k < n; k++) {
        if (ds4_mtp_queue(c, DS4_MTP_SRC_HEAD, s->hrows - 1, 1, err, sizeof err) != 0 ||
            ds4_mtp_eval_queued(c, &out[k - 1], 1, s->mlog, 0, err, sizeof err) != 0)
            goto fail;
        s->hrows = 1;
        out[k] = spec_choose(r, s, k, s->base + j + 1 + k);
    }
    if (ds4_ctx_rollback(c, DS4_PART_MTP, mpos, err, sizeof err) != 0) goto fail;
    return 0;
fail:
    fprintf(stderr, "ds4: the MTP head: %s\n", err);
    return -1;
}

/* DS4_MTP_FORCE's FILE: token ids below V, commas or blanks between them, into *ref (malloc'd);
 * a failure ends the program. */
static int32_t *spec_read_ref(const char *path, int V, int *n_ref) {
    char sh[SHOW_BUF];
    FILE *f = fopen(path, "rb");
    if (!f) die_run("DS4_MTP_FORCE: cannot read '%s': %s", show(sh, path), strerror(errno));
    int32_t *ref = NULL;
    int cap = 0, n = 0;
    for (int ch = fgetc(f); ch != EOF;) {
        if (ch == ',' || ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') { ch = fgetc(f); continue; }
        if (ch < '0' || ch > '9') {
            char b[8];
            snprintf(b, sizeof b, ch >= 0x20 && ch < 0x7f ? "%c" : "\\x%02x", ch);
            die_usage("DS4_MTP_FORCE: '%s' holds '%s', not token ids", show(sh, path), b);
        }
        long v = 0;
        for (; ch >= '0' && ch <= '9'; ch = fgetc(f))
            if ((v = v * 10 + (ch - '0')) >= V)
                die_usage("DS4_MTP_FORCE: '%s' holds an id past the vocabulary (%d ids)", show(sh, path), V);
        if (n == cap) {
            cap = cap ? 2 * cap : 1024;
            ref = realloc(ref, sizeof(int32_t) * (size_t)cap);
            if (!ref) die_run("out of host memory for DS4_MTP_FORCE");
        }
        ref[n++] = (int32_t)v;
    }
    if (ferror(f)) die_run("DS4_MTP_FORCE: reading '%s' failed", show(sh, path));
    fclose(f);
    if (!n) die_usage("DS4_MTP_FORCE: '%s' holds no token ids", show(sh, path));
    *n_ref = n;
    return ref;
}

/* The decoder of --mtp-draft D for run r (its context made), with DS4_MTP_FORCE's reference ids
 * (ref, NULL: none; the decoder frees them); out of memory ends the program. */
static void spec_init(spec *s, run *r, int D, int n_gen, int sampling, float force_p, int32_t *ref, int n_ref,
                      uint64_t seed) {
    s->D = D;
    s->V = r->V;
    char err[1024];
    if (ds4_mtp_queue(r->c, DS4_MTP_SRC_ZERO, 0, 1, err, sizeof err) != 0)   /* the carry at position 0 */
        die_run("the MTP head: %s", err);
    s->tq = malloc((size_t)(D + 1) * sizeof(int32_t));
    s->mlog = malloc((size_t)s->V * sizeof(float));
    s->vlog = malloc((size_t)(D + 1) * s->V * sizeof(float));
    s->first = malloc((size_t)(n_gen + 1) * sizeof(int32_t));
    s->sampling = sampling;
    s->q = malloc((size_t)D * s->V * sizeof(float));
    s->p = malloc((size_t)s->V * sizeof(float));
    if (!s->tq || !s->mlog || !s->vlog || !s->first || !s->q || !s->p)
        die_run("out of host memory for --mtp-draft");
    s->force_p = force_p;
    s->ref = ref;
    s->n_ref = n_ref;
    s->rng = seed;
}

static void spec_free(spec *s) {
    free(s->tq); free(s->mlog); free(s->vlog); free(s->ref);
    free(s->first); free(s->q); free(s->p);
}

/* prefill's work with the head: ids[0:n) through the model in chunks of its batch, each
 * chunk's rows then through the head (paired with the streams before them: the carry, then the
 * chunk's own; its last row's streams stay queued as the next carry). */
static int spec_feed(run *r, const int32_t *ids, int n, float *rows_out, float *last) {
    char err[1024];
    spec *s = r->sp;
    ds4_ctx *c = r->c;
    const int mb = ds4_ctx_max_batch(c), pos0 = ds4_ctx_pos(c);
    if (spec_flush(r, s, 0) != 0) return -1;
    r->pmt.t0 = now_s();
    r->pmt.last = 0;
    for (int i = 0, nb; i < n; i += nb) {
        nb = n - i < mb ? n - i : mb;
        if (ds4_eval(c, ids + i, nb, rows_out ? rows_out + (size_t)i * r->V : last, rows_out != NULL, err, sizeof err) != 0 ||
            ds4_mtp_queue(c, DS4_MTP_SRC_MODEL, 0, nb, err, sizeof err) != 0 ||
            ds4_mtp_eval_queued(c, ids + i, nb, NULL, 0, err, sizeof err) != 0) {
            meter_clear(&r->pmt);
            fprintf(stderr, "ds4: %s\n", err);
            return -1;
        }
        s->hrows = nb;
        meter_show(&r->pmt, "prompt", i + nb, n);
        if (i + nb < n && g_interrupted) { meter_clear(&r->pmt); return -3; }
    }
    meter_clear(&r->pmt);
    const float *chk = rows_out ? rows_out : last;
    const int nchk = rows_out ? n : 1, at = rows_out ? pos0 : pos0 + n - 1;
    if (!r->allow_nonfinite && check_rows(chk, nchk, r->V, at, "the prompt") != 0) return -2;
    if (rows_out) memcpy(last, rows_out + (size_t)(n - 1) * r->V, sizeof(float) * r->V);
    return 0;
}

/* Speculative sampling's check of nd drafts (batch[1..nd], drawn from s->q) against the model's
 * rows out[0..nd]: draft i + 1 is taken with probability min(1, p_i(x) / q_i(x)), p_i the
 * distribution ds4_sample draws from after row i; the first one refused is replaced by a draw
 * from the residue max(0, p_i - q_i), renormalised, and when every draft is taken the next token
 * is drawn from p_nd.  Each emitted token then has the distribution plain sampling gives it
 * (the tokens differ from plain sampling's with the same seed: the generator is drawn more
 * often).  An EOS taken ends the drafts taken before it, as plain decoding stops there.
 * *taken: the drafts taken; returns the next token. */
static int32_t spec_accept(run *r, spec *s, const float *out, const int32_t *batch, int nd, int *taken) {
    const int V = s->V;
    int a = 0;
    int32_t next;
    for (;;) {
        ds4_sampler_probs(&r->smp, out + (size_t)a * V, V, s->p, r->scratch);
        if (a == nd) { next = spec_draw(s->p, V, ds4_sampler_uniform(&r->smp)); break; }
        const float *q = s->q + (size_t)a * V;
        const int32_t x = batch[a + 1];
        if (ds4_sampler_uniform(&r->smp) * q[x] < s->p[x]) {
            if (x == r->eos) { next = x; break; }
            a++;
            continue;
        }
        double sum = 0.0;
        for (int i = 0; i < V; i++) {
            s->p[i] = s->p[i] > q[i] ? s->p[i] - q[i] : 0.0f;
            sum += s->p[i];
        }
        if (sum > 0.0)
            for (int i = 0; i < V; i++) s->p[i] = (float)(s->p[i] / sum);
        else   /* p below q nowhere: only rounding refused the draft; p itself */
            ds4_sampler_probs(&r->smp, out + (size_t)a * V, V, s->p, r->scratch);
        next = spec_draw(s->p, V, ds4_sampler_uniform(&r->smp));
        break;
    }
    *taken = a;
    return next;
}

/* generate's work with the head (its contract, greedy or --force): one step is the token
 * chosen, up to D drafts, one call of the model over them, the drafts it accepts. */
static void spec_generate(run *r, int n, const int32_t *force, const float *prev, float *rows, float *last) {
    char err[1024];
    spec *s = r->sp;
    ds4_ctx *c = r->c;
    const int V = r->V;
    int32_t batch[DS4_CHECKPOINT_MAX], choice[DS4_CHECKPOINT_MAX];
    r->n_done = 0;
    r->stopped = 0;
    for (int j = 0; j <= n; j++) s->first[j] = -1;
    int32_t next = n <= 0 ? 0 : force ? force[0] : ds4_sample(&r->smp, prev, V, r->scratch);
    for (int j = 0; j < n;) {
        if (g_interrupted) { r->stopped = 1; return; }
        if (next == r->eos) return;
        r->gen[j] = next;
        tx_token(&r->tx, r->m, r->tok, next);
        if (tx_sync(&r->tx) != 0) { r->stopped = 2; return; }
        const int nd = s->D < n - j - 1 ? s->D : n - j - 1;   /* drafts: no further than -n */
        const int pos = ds4_ctx_pos(c);
        batch[0] = next;
        spec_queue(s, next);
        const double t0 = now_s();
        if (nd > 0 && spec_draft(r, s, nd, j, batch + 1) != 0) { r->stopped = 2; return; }
        const double t1 = now_s();
        float *out = rows ? rows + (size_t)j * V : s->vlog;
        if ((nd > 0 && ds4_ctx_checkpoint(c, DS4_PART_TRUNK, nd + 1, err, sizeof err) != 0) ||
            ds4_ctx_hooks_hold(c, err, sizeof err) != 0 || ds4_eval(c, batch, nd + 1, out, 1, err, sizeof err) != 0) {
            fprintf(stderr, "ds4: %s\n", err);
            r->stopped = 2;
            return;
        }
        s->t_draft += t1 - t0;
        s->t_check += now_s() - t1;
        /* the drafts taken: while each is the model's choice after the row before it (EOS never:
         * plain decoding stops there, so it becomes the next step's token) */
        int a = 0;
        if (s->sampling) {
            choice[0] = spec_accept(r, s, out, batch, nd, &a);
        } else {
            for (;; a++) {
                choice[a] = force ? (j + a + 1 < n ? force[j + a + 1] : 0) : ds4_argmax(out + (size_t)a * V, V);
                if (a == nd || batch[a + 1] != choice[a] || choice[a] == r->eos) break;
            }
        }
        /* the hook records of the rows kept (DS4_HOOKS: held since the check began) */
        if (ds4_ctx_hooks_commit(c, pos + a + 1, err, sizeof err) != 0) {
            fprintf(stderr, "ds4: %s\n", err);
            r->stopped = 2;
            return;
        }
        /* the rows kept are plain decoding's steps j .. j + a: each checked as a step is */
        for (int i = 0; i <= a; i++) {
            if (i > 0) {
                r->gen[j + i] = batch[i];
                tx_token(&r->tx, r->m, r->tok, batch[i]);
            }
            r->n_done = j + i + 1;
            char what[64];
            snprintf(what, sizeof what, "decode step %d", j + i);
            if (!r->allow_nonfinite && check_rows(out + (size_t)i * V, 1, V, pos + i, what) != 0) { r->stopped = 2; return; }
        }
        if (tx_sync(&r->tx) != 0) { r->stopped = 2; return; }
        if (a < nd && ds4_ctx_rollback(c, DS4_PART_TRUNK, pos + a + 1, err, sizeof err) != 0) {
            fprintf(stderr, "ds4: %s\n", err);
            r->stopped = 2;
            return;
        }
        /* the head's rows of the drafts taken wait for the next step's first draft, paired with
         * the check's streams before each; its row a's streams are the next carry */
        if (ds4_mtp_queue(c, DS4_MTP_SRC_MODEL, 0, a + 1, err, sizeof err) != 0) {
            fprintf(stderr, "ds4: the MTP head: %s\n", err);
            r->stopped = 2;
            return;
        }
        for (int i = 1; i <= a; i++) spec_queue(s, batch[i]);
        if (!rows) memcpy(last, out + (size_t)a * V, sizeof(float) * V);
        s->steps++;
        s->drafted += nd;
        s->accepted += a;
        j += a + 1;
        meter_show(&r->mt, "generated", j, n);
        next = choice[s->sampling ? 0 : a];
    }
}

/* Feed ids[0:n) (ds4_eval chunks it); the logits of the last row into last (all rows into
 * rows_out when given).  -1 when a call failed, -2 when the logits are not finite, -3 when
 * Ctrl-C stopped it, with the line printed (-3: by the caller). */
static int prefill(run *r, const int32_t *ids, int n, float *rows_out, float *last) {
    char err[1024];
    if (r->sp) return spec_feed(r, ids, n, rows_out, last);
    const int pos0 = ds4_ctx_pos(r->c);
    r->pmt.t0 = now_s();
    r->pmt.last = 0;
    const int rc = ds4_eval(r->c, ids, n, rows_out ? rows_out : last, rows_out ? 1 : 0, err, sizeof err);
    meter_clear(&r->pmt);
    if (rc == -2) return -3;
    if (rc != 0) { fprintf(stderr, "ds4: %s\n", err); return -1; }
    /* without all rows only the last one is known */
    const float *chk = rows_out ? rows_out : last;
    const int nchk = rows_out ? n : 1, at = rows_out ? pos0 : pos0 + n - 1;
    if (!r->allow_nonfinite && check_rows(chk, nchk, r->V, at, "the prompt") != 0) return -2;
    if (rows_out) memcpy(last, rows_out + (size_t)(n - 1) * r->V, sizeof(float) * r->V);
    return 0;
}

/* Sample and feed up to n tokens after the logits in prev; every step's logits into rows (when
 * given, [n][V]) or into last.  Stops at EOS (not fed, not printed), at Ctrl-C, at a failure. */
static void generate(run *r, int n, const int32_t *force, const float *prev, float *rows, float *last) {
    char err[1024];
    if (r->sp) {
        spec_generate(r, n, force, prev, rows, last);
        r->sp->base += r->n_done;
        return;
    }
    r->n_done = 0;
    r->stopped = 0;
    for (int j = 0; j < n; j++) {
        if (g_interrupted) { r->stopped = 1; return; }
        const int32_t next = force ? force[j] : ds4_sample(&r->smp, prev, r->V, r->scratch);
        if (next == r->eos) return;
        r->gen[j] = next;
        tx_token(&r->tx, r->m, r->tok, next);
        if (tx_sync(&r->tx) != 0) { r->stopped = 2; return; }
        float *out = rows ? rows + (size_t)j * r->V : last;
        const int pos = ds4_ctx_pos(r->c);
        if (ds4_eval(r->c, &next, 1, out, 0, err, sizeof err) != 0) {
            fprintf(stderr, "ds4: %s\n", err);
            r->stopped = 2;
            return;
        }
        r->n_done = j + 1;
        if (!r->allow_nonfinite) {
            char what[64];
            snprintf(what, sizeof what, "decode step %d", j);
            if (check_rows(out, 1, r->V, pos, what) != 0) { r->stopped = 2; return; }
        }
        meter_show(&r->mt, "generated", j + 1, n);
        prev = out;
    }
}

static void print_ids(const char *what, const int32_t *ids, int n) {
    fprintf(stderr, "%s:", what);
    for (int i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

/* The prompt on stderr (-v): its ids turned back into text through the same writer as the
 * output (so BOS and the chat tokens show as their text). */
static void print_prompt(const ds4_model *m, const ds4_tok *tok, const int32_t *ids, int n) {
    textout t = { .f = stderr };
    tx_put(&t, "prompt: ", 8);
    for (int i = 0; i < n; i++) tx_token(&t, m, tok, ids[i]);
    tx_finish(&t);
    tx_put(&t, "\n", 1);
}

/* -p TEXT as ids: BOS (when the vocabulary has one), then for --chat <｜User｜> TEXT <｜Assistant｜>
 * and </think> (thinking off) or <think> (--think); turns after the first of -i start without
 * BOS.  Models without a vocabulary: one byte-level id per byte.  malloc'd; *n its length. */
static int32_t *prompt_ids_of(const ds4_model *m, ds4_tok *tok, const char *prompt, int chat, int think, int bos_first,
                             int *n_out) {
    const size_t len = strlen(prompt);
    int32_t *ids;
    int P = 0;
    if (tok) {
        const int n = ds4_tok_encode(tok, prompt, len, 0, NULL, 0);
        if (n < 0) die_run("cannot tokenize the prompt");
        ids = malloc(sizeof(int32_t) * (size_t)(n + 4));
        if (!ids) die_run("out of host memory for the prompt");
        const int bos = ds4_model_bos(m);
        if (bos >= 0 && bos_first) ids[P++] = bos;
        if (chat) ids[P++] = special_id(tok, "<｜User｜>");
        P += ds4_tok_encode(tok, prompt, len, 0, ids + P, n);
        if (chat) {
            ids[P++] = special_id(tok, "<｜Assistant｜>");
            ids[P++] = special_id(tok, think ? "<think>" : "</think>");
        }
    } else {
        if (ds4_model_n_vocab(m) < 256)
            die_usage("-p feeds byte-level ids, but this model's vocabulary has fewer than 256 ids: pass --tokens");
        if (len > INT_MAX / 2) die_usage("the prompt is too long");
        ids = malloc(sizeof(int32_t) * (len ? len : 1));
        if (!ids) die_run("out of host memory for the prompt");
        for (size_t i = 0; i < len; i++) ids[P++] = (unsigned char)prompt[i];
    }
    *n_out = P;
    return ids;
}

/* The model at path, with the MTP block of mtp_file when it is given (--mtp): NULL with a line. */
static ds4_model *open_model(const char *path, const char *mtp_file, char *err, size_t errlen) {
    ds4_model *m = ds4_model_open(path, err, errlen);
    if (m && mtp_file && ds4_model_attach_mtp(m, mtp_file, err, errlen) != 0) {
        ds4_model_close(m);
        return NULL;
    }
    return m;
}

int main(int argc, char **argv) {
    char err[1024];
    ds4_env env;
    if (ds4_env_read(&env, err, sizeof(err)) != 0) { fprintf(stderr, "ds4: %s\n", err); return EXIT_USAGE; }
    int threads = env.threads;

    if (argc >= 2 && !strcmp(argv[1], "synth")) return cmd_synth(argc, argv, threads);
    if (argc >= 2 && !strcmp(argv[1], "collect")) return cmd_collect(argc, argv);   /* ds4_collect.c */
    if (argc >= 2 && !strcmp(argv[1], "info")) {
        /* a file ds4 cannot run fails the validator, whose one line names the file and what is wrong */
        const char *file = NULL, *mtp_file = NULL;
        int plan_ctx = 0;
        for (int i = 2; i < argc; i++) {
            if (!strcmp(argv[i], "--ctx") && i + 1 < argc && !plan_ctx) {
                if (parse_int("--ctx", argv[++i], 1, 1 << 24, &plan_ctx, err, sizeof err) != 0) die_usage("%s", err);
            } else if (!strcmp(argv[i], "--mtp") && i + 1 < argc && !mtp_file) {
                mtp_file = argv[++i];
            } else if (argv[i][0] != '-' && !file) {
                file = argv[i];
            } else {
                die_usage("usage: ds4 info FILE [--ctx N] [--mtp MTPFILE]");
            }
        }
        if (!file) die_usage("usage: ds4 info FILE [--ctx N] [--mtp MTPFILE]");
        if (threads > 0) ds4_cpu_set_threads(threads);
        ds4_model *m = open_model(file, mtp_file, err, sizeof err);
        if (!m) { fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
        ds4_model_info(m, stdout);
        if (plan_ctx) {
            /* the plan ds4_ctx_new checks before it allocates: a prompt of N goes in chunks of
             * DS4_UBATCH, so the batch is the smaller of the two */
            const int64_t train = ds4_model_n_ctx_train(m);
            const int b = plan_ctx < env.ubatch ? plan_ctx : env.ubatch;
            const size_t cb = ds4_ctx_plan_bytes(m, plan_ctx, b), w = ds4_model_weight_bytes(m);
            printf("context of %d positions (model context_length %lld%s), prefill chunks of %d tokens:\n", plan_ctx,
                   (long long)train, plan_ctx > train ? ": PAST IT, ds4 refuses this -c" : "", b);
            printf("  context buffers (window, compressed and indexer rows, compressor state, activations): %.3f GB\n",
                   cb / 1e9);
            printf("  on a GPU: %.3f GB of weights + %.3f GB = %.3f GB, plus the backend's scratch "
                   "(README: DS4_CUDA_PREFILL_ATTN's split rows grow with the context)\n", w / 1e9, cb / 1e9,
                   (w + cb) / 1e9);
            printf("  on the CPU: %.3f GB beside the mapped file\n", cb / 1e9);
        }
        ds4_model_close(m);
        if (fflush(stdout) != 0 || ferror(stdout)) {
            fprintf(stderr, "ds4: writing to stdout failed: %s\n", strerror(errno ? errno : EIO));
            return EXIT_FAIL;
        }
        return 0;
    }

    struct cli_opts o;
    if (cli_parse(argc, argv, &o, err, sizeof err) != 0) {
        fprintf(stderr, "ds4: %s\n", err);
        cli_opts_free(&o);
        return EXIT_USAGE;
    }
    if (o.help) { usage(stdout); cli_opts_free(&o); return fflush(stdout) == 0 ? 0 : EXIT_FAIL; }
    const char *model_path = o.model_path, *prompt = o.prompt;
    int32_t *force = o.force;
    int n_gen = o.n_gen, n_ctx = o.n_ctx;
    if (o.threads) threads = o.threads;
    if (threads > 0) ds4_cpu_set_threads(threads);
    signal(SIGPIPE, SIG_IGN);                    /* a closed stdout is a write error, said as one */

    const ds4_backend *be = ds4_backend_cpu();
#ifdef DS4_CUDA
    if (!strcmp(o.backend, "cuda")) be = ds4_backend_cuda();
#endif
    if (env.hooks && (env.hooks_ring_mb || env.hooks_throttle_us) && !strcmp(be->name, "cpu"))
        fprintf(stderr, "ds4: DS4_HOOKS_RING_MB, DS4_HOOKS_THROTTLE_US: the cpu backend writes each record as its op "
                "returns; it has no rings and no drain to size or slow\n");
    if (env.launch_trace && !strcmp(be->name, "cpu"))
        fprintf(stderr, "ds4: DS4_LAUNCH_TRACE: the cpu backend launches no kernels; nothing is traced\n");
    if (o.mtp_draft && env.hooks && be->hooks_open && !be->hooks_hold)
        die_usage("--mtp-draft with DS4_HOOKS: the %s backend's hook emitter cannot hold back the rows of rejected "
                  "drafts", be->name);
    if (env.mtp_force_file && !o.mtp_draft) die_usage("DS4_MTP_FORCE goes with --mtp-draft");
    if (env.mtp_force_file && o.temp > 0.0f)
        die_usage("DS4_MTP_FORCE goes with greedy decoding (its FILE holds greedy ids; give --temp 0)");
    if (env.cuda_graphs && !strcmp(be->name, "cpu"))
        fprintf(stderr, "ds4: DS4_CUDA_GRAPHS=1: the cpu backend records no graphs; every step runs eagerly\n");
    else if (env.cuda_graphs)
        fprintf(stderr, "ds4: DS4_CUDA_GRAPHS=1: decode steps are recorded as CUDA graphs (%s) and replayed; "
                "the prompt runs eagerly\n", env.graph_layers ? "clusters of DS4_CUDA_GRAPH_LAYERS layers" : "one per step");

    char defpath[PATH_MAX + 32], sh[SHOW_BUF];
    if (!model_path) {
        model_path = default_model_path(defpath, sizeof(defpath));
        if (access(model_path, R_OK) != 0)
            die_run("no -m given and the embedded default model %s is missing (run: make)", show(sh, model_path));
    }
    double t0 = now_s();
    ds4_model *m = open_model(model_path, o.mtp_file, err, sizeof err);
    if (!m) { fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
    /* DS4_HOOKS against the model: a bad selection is a usage error, a file that cannot be written a failure */
    const int hrc = ds4_hooks_check(m, &env, err, sizeof err);
    if (hrc != 0) { fprintf(stderr, "ds4: %s\n", err); return hrc == -1 ? EXIT_USAGE : EXIT_FAIL; }
    const int V = ds4_model_n_vocab(m);

    ds4_tok *tok = ds4_model_has_vocab(m) ? ds4_model_tokenizer(m, err, sizeof(err)) : NULL;
    if (ds4_model_has_vocab(m) && !tok) { fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
    if (o.chat && !tok) die_usage("--chat needs a model with a vocabulary (this one has none)");
    if (o.mtp_draft && !ds4_model_has_mtp(m))
        die_usage("--mtp-draft needs a model with an MTP block (ds4 info shows it; this one has none)");
    int n_force_ref = 0;
    int32_t *force_ref = env.mtp_force_file && o.mtp_draft ? spec_read_ref(env.mtp_force_file, V, &n_force_ref) : NULL;

    /* -f: the file's bytes are the prompt text (a NUL in it ends the text: say so rather than cut) */
    char *file_text = NULL;
    if (o.prompt_file) {
        FILE *pf = strcmp(o.prompt_file, "-") ? fopen(o.prompt_file, "rb") : stdin;
        if (!pf) die_run("cannot read the prompt file '%s': %s", show(sh, o.prompt_file), strerror(errno));
        size_t cap = 1 << 16, len = 0;
        file_text = malloc(cap);
        for (size_t got; file_text && (got = fread(file_text + len, 1, cap - len - 1, pf)) > 0;) {
            len += got;
            if (len + 1 == cap) { char *more = realloc(file_text, cap * 2); if (!more) { free(file_text); file_text = NULL; } else { file_text = more; cap *= 2; } }
        }
        if (!file_text) die_run("out of host memory for the prompt file");
        const int rerr = ferror(pf);
        if (pf != stdin) fclose(pf);
        if (rerr) die_run("reading the prompt file '%s' failed", show(sh, o.prompt_file));
        file_text[len] = 0;
        if (strlen(file_text) != len) die_usage("the prompt file '%s' holds a NUL byte", show(sh, o.prompt_file));
        prompt = file_text;
    }

    /* the prompt's ids (-i: the first turn's, when -p gives one) */
    int P = 0;
    int32_t *ids = NULL;
    if (o.prompt_ids) {
        P = o.n_prompt_ids;
        ids = o.prompt_ids;
    } else if (!o.interactive || prompt) {
        if (!prompt) prompt = "Once upon a time";
        ids = prompt_ids_of(m, tok, prompt, o.chat, o.think, 1, &P);
        if (P == 0) die_usage("the prompt is empty: give -p TEXT or --tokens IDS");
    }
    for (int i = 0; i < P + o.n_force; i++) {
        const int32_t id = i < P ? ids[i] : force[i - P];
        if (id >= V)
            die_usage("%s token id %d is out of range (the vocabulary has %d ids)", i < P ? "prompt" : "--force", id, V);
    }
    const int64_t train = ds4_model_n_ctx_train(m);
    if (n_ctx > train) die_usage("-c %d is past the model's context_length %lld", n_ctx, (long long)train);
    if (n_ctx == 0) {
        n_ctx = o.interactive ? (train < 4096 ? (int)train : 4096) : P + n_gen;
        if (!o.interactive && (int64_t)P + n_gen > train)
            die_usage("%d prompt + %d generated tokens are past the model's context_length %lld", P, n_gen, (long long)train);
    }
    if (P + n_gen > n_ctx && !o.interactive) die_usage("%d prompt + %d generated tokens exceed --ctx %d", P, n_gen, n_ctx);
    if (P > n_ctx) die_usage("the first turn's %d tokens exceed --ctx %d", P, n_ctx);
    if (o.mtp_draft && env.ubatch < o.mtp_draft + 1 && env.ubatch < n_ctx)   /* a context's batch: both bound it */
        die_usage("--mtp-draft %d checks %d tokens in one call: DS4_UBATCH=%d is too small", o.mtp_draft,
                  o.mtp_draft + 1, env.ubatch);

    outfile dump;
    memset(&dump, 0, sizeof dump);
    if (o.dump && outfile_open(&dump, o.dump, err, sizeof err) != 0) die_run("%s", err);
    ds4_model_describe(m, stderr);
    if (!o.prompt_ids && !tok)
        fprintf(stderr, "ds4: model has no vocabulary: prompt text is fed as byte-level ids (one id per byte)\n");

    /* the prompt goes in chunks of at most DS4_UBATCH tokens (ds4_ctx_new caps the batch) */
    int max_batch = o.interactive ? n_ctx : (P > 0 ? P : 1);
    if (max_batch > env.ubatch) max_batch = env.ubatch;
    if (max_batch < o.mtp_draft + 1) max_batch = o.mtp_draft + 1;   /* the drafts' check is one call */
    const size_t plan = ds4_ctx_plan_bytes(m, n_ctx, max_batch);
    if (plan >= ((size_t)1 << 30) || o.verbose)
        fprintf(stderr, "ds4: context of %d positions, batches of %d: %.2f GB on %s (window, compressed and indexer "
                "rows, activations)\n", n_ctx, max_batch, plan / 1e9, be->name);

    ds4_ctx *c = ds4_ctx_new(m, be, n_ctx, max_batch, err, sizeof(err));
    if (!c) {
        if (err[0]) fprintf(stderr, "ds4: %s\n", err);   /* empty: the backend already said why */
        if (o.dump) { outfile_abort(&dump); outfile_free(&dump); }
        ds4_model_close(m);
        return EXIT_FAIL;
    }
    const double t_load = now_s() - t0;

    run r;
    memset(&r, 0, sizeof r);
    r.c = c; r.m = m; r.tok = tok; r.V = V; r.allow_nonfinite = o.allow_nonfinite;
    r.eos = o.chat ? ds4_model_eos(m) : -1;
    r.tx.f = stdout;
    r.tx.at_line_start = 1;
    r.mt.on = isatty(STDERR_FILENO) && !isatty(STDOUT_FILENO);
    r.pmt.on = isatty(STDERR_FILENO);
    r.pmt.delay = 2.0;
    ds4_ctx_set_progress(c, on_chunk, &r);
    ds4_sampler_init(&r.smp, o.temp, o.top_p, o.seed);
    spec sp;
    memset(&sp, 0, sizeof sp);
    if (o.mtp_draft) {
        spec_init(&sp, &r, o.mtp_draft, n_gen, o.temp > 0.0f && !o.force, env.mtp_force_p, force_ref, n_force_ref, o.seed);
        r.sp = &sp;
    }
    const int rows = P + n_gen;
    float *logits = o.dump ? malloc(sizeof(float) * (size_t)rows * V) : NULL;
    float *last = malloc(sizeof(float) * V);
    int32_t *fed = malloc(sizeof(int32_t) * (rows ? rows : 1));
    r.scratch = malloc((sizeof(float) + sizeof(int)) * (size_t)V);
    r.gen = malloc(sizeof(int32_t) * (n_gen ? n_gen : 1));
    if ((o.dump && !logits) || !last || !fed || !r.scratch || !r.gen) die_run("out of host memory for the logits");
    if (P) memcpy(fed, ids, sizeof(int32_t) * P);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;                   /* no SA_RESTART: a read of stdin (-i) returns */
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);               /* kill, timeout: the same clean stop */

    int rc = 0;
    double t_prefill = 0, t_decode = 0;
    long n_prefilled = 0, n_decoded = 0;
    ds4_backend_stats bst;
    if (!o.interactive) {
        const double tp0 = now_s();
        const int prc = prefill(&r, ids, P, logits, last);
        if (prc != 0) r.stopped = prc == -3 ? 1 : 2;
        t_prefill = now_s() - tp0;
        n_prefilled = prc == -1 || prc == -3 ? 0 : P;   /* a failed or stopped prompt left no whole rows */
        ds4_ctx_stats(c, &bst, 1);                /* --stats counts the decode steps only */
        if (o.verbose) { print_prompt(m, tok, ids, P); print_ids("prompt ids", ids, P); }
        const double td0 = now_s();
        if (!r.stopped) generate(&r, n_gen, force, last, logits ? logits + (size_t)P * V : NULL, last);
        t_decode = now_s() - td0;
        n_decoded = r.n_done;
        meter_clear(&r.mt);
        memcpy(fed + P, r.gen, sizeof(int32_t) * (size_t)r.n_done);
        if (o.verbose) print_ids("generated ids", r.gen, r.n_done);
        if (o.verbose && r.sp) print_ids("mtp first drafts", sp.first, r.n_done);
    } else {
        /* -i: one turn per line of stdin; the history stays in the context, each answer closed
         * by EOS as the chat format has it */
        char *line = NULL;
        size_t cap = 0;
        const int eos = ds4_model_eos(m);
        if (eos < 0) die_run("-i: the vocabulary has no EOS token to end a turn with");
        for (int turn = 0; !r.stopped && !g_interrupted; turn++) {
            int nt = 0;
            int32_t *tids = NULL;
            if (turn == 0 && ids) { tids = ids; nt = P; }
            else {
                if (isatty(STDIN_FILENO)) fprintf(stderr, "> ");
                errno = 0;
                const ssize_t got = getline(&line, &cap, stdin);
                if (got < 0) { if (errno == EINTR) r.stopped = 1; break; }
                if (got > 0 && line[got - 1] == '\n') line[got - 1] = 0;
                if (!line[0]) { turn--; continue; }
                tids = prompt_ids_of(m, tok, line, 1, o.think, ds4_ctx_pos(c) == 0, &nt);
            }
            const int left = n_ctx - ds4_ctx_pos(c);
            if (nt + 1 > left) {
                fprintf(stderr, "ds4: the context is full: this turn needs %d positions, %d are left of -c %d\n",
                        nt + 1, left, n_ctx);
                rc = EXIT_FAIL;
                if (tids != ids) free(tids);
                break;
            }
            double tq = now_s();
            const int prc = prefill(&r, tids, nt, NULL, last);
            if (prc != 0) r.stopped = prc == -3 ? 1 : 2;
            t_prefill += now_s() - tq;
            n_prefilled += nt;
            if (o.verbose) { print_prompt(m, tok, tids, nt); print_ids("prompt ids", tids, nt); }
            if (tids != ids) free(tids);
            if (r.stopped) break;
            /* the answer, leaving one position for the EOS that closes it */
            const int room = n_ctx - ds4_ctx_pos(c) - 1;
            tq = now_s();
            generate(&r, n_gen < room ? n_gen : room, NULL, last, NULL, last);
            t_decode += now_s() - tq;
            n_decoded += r.n_done;
            if (o.verbose) print_ids("generated ids", r.gen, r.n_done);
            if (o.verbose && r.sp) print_ids("mtp first drafts", sp.first, r.n_done);
            if (r.stopped) break;
            if (r.sp) {                           /* the head follows the model: through prefill */
                if (spec_feed(&r, &eos, 1, NULL, last) == -1) r.stopped = 2;
            } else if (ds4_eval(c, &eos, 1, last, 0, err, sizeof err) != 0) {
                fprintf(stderr, "ds4: %s\n", err);
                r.stopped = 2;
            }
            tx_put(&r.tx, "\n", 1);
            if (tx_sync(&r.tx) != 0) r.stopped = 2;
        }
        free(line);
    }
    if (g_interrupted && !r.stopped) r.stopped = 1;

    /* the end of the text: a newline after it, so the shell's prompt starts a line */
    tx_finish(&r.tx);
    if (!r.tx.at_line_start) tx_put(&r.tx, "\n", 1);
    if (tx_sync(&r.tx) != 0) {
        fprintf(stderr, "ds4: writing the text to stdout failed: %s\n", strerror(r.tx.err));
        rc = EXIT_FAIL;
    } else if (r.stopped == 2) {
        rc = EXIT_FAIL;
    }
    if (r.stopped == 1) {
        fprintf(stderr, "ds4: interrupted (%s): %ld tokens generated; the output files are closed whole\n",
                g_interrupted == SIGTERM ? "SIGTERM" : "Ctrl-C", n_decoded);
        rc = 128 + (g_interrupted ? (int)g_interrupted : SIGINT);
    }
    fprintf(stderr, "speed: load %.2f s, prefill %ld tokens in %.3f s (%.1f tok/s), decode %ld tokens in %.3f s "
            "(%.2f tok/s), backend %s\n", t_load, n_prefilled, t_prefill,
            n_prefilled / (t_prefill > 0 ? t_prefill : 1e-9), n_decoded, t_decode,
            n_decoded / (t_decode > 0 ? t_decode : 1e-9), be->name);

    if (o.stats) {                               /* -i: over the whole conversation */
        ds4_ctx_stats(c, &bst, 0);
        const double ns = n_decoded > 0 ? (double)n_decoded : 1.0;
        fprintf(stderr, "stats: decode %ld steps on %s: %.1f launches per step (%.1f us of host time), "
                "%llu device allocations, %llu frees, %llu device syncs, %llu stream syncs\n",
                n_decoded, be->name, (double)bst.launches / ns, bst.launch_seconds * 1e6 / ns,
                (unsigned long long)bst.mallocs, (unsigned long long)bst.frees,
                (unsigned long long)bst.device_syncs, (unsigned long long)bst.stream_syncs);
        if (env.cuda_graphs)
            fprintf(stderr, "stats: graphs: %llu captures (%.1f ms capture, %.1f ms instantiate), %llu replays, "
                    "%llu eager fallbacks; %llu held, %llu nodes, %.1f MiB; programmatic dependent launch %s\n",
                    (unsigned long long)bst.captures, bst.capture_ms, bst.instantiate_ms,
                    (unsigned long long)bst.replays, (unsigned long long)bst.fallbacks, (unsigned long long)bst.graphs,
                    (unsigned long long)bst.graph_nodes, (double)bst.graph_bytes / (1024.0 * 1024.0),
                    bst.graph_pdl ? "on" : "off");
    }
    if (o.stats && r.sp)
        fprintf(stderr, "stats: mtp: --mtp-draft %d%s: %ld steps, %ld drafted, %ld accepted (%.1f%%), %.2f tokens per step; "
                "a step %.3f ms drafting, %.3f ms checking\n",
                sp.D, sp.ref ? " (DS4_MTP_FORCE)" : "", sp.steps, sp.drafted, sp.accepted,
                sp.drafted ? 100.0 * sp.accepted / sp.drafted : 0.0, sp.steps ? (double)n_decoded / sp.steps : 0.0,
                sp.steps ? 1e3 * sp.t_draft / sp.steps : 0.0, sp.steps ? 1e3 * sp.t_check / sp.steps : 0.0);
    ds4_hooks_stats hst;
    if (ds4_ctx_hooks_stats(c, &hst) == 0) {      /* DS4_HOOKS: every record written by now */
        if (o.stats)
            fprintf(stderr, "stats: hooks: %llu records produced, %llu written (%.1f MB), %llu dropped in %llu gaps, "
                    "%llu producer waits, %llu drain batches (%.1f GB/s copying, %llu drain waits)\n",
                    (unsigned long long)hst.produced, (unsigned long long)hst.written, hst.payload_bytes / 1e6,
                    (unsigned long long)hst.dropped, (unsigned long long)hst.gaps, (unsigned long long)hst.waits,
                    (unsigned long long)hst.batches,
                    hst.copy_seconds > 0 ? hst.payload_bytes / hst.copy_seconds / 1e9 : 0.0,
                    (unsigned long long)hst.drain_syncs);
        if (o.stats && hst.rejected)
            fprintf(stderr, "stats: hooks: %llu records of rejected drafts alone not written (--mtp-draft)\n",
                    (unsigned long long)hst.rejected);
        if (hst.err) rc = EXIT_FAIL;              /* the line naming it comes when the context closes */
        else {
            char hp[4 * 1024 + 8];
            fprintf(stderr, "ds4: hooks: %llu records (%.1f MB) written to %s%s\n", (unsigned long long)hst.written,
                    hst.payload_bytes / 1e6, ds4_show(hp, sizeof hp, env.hooks_out, strlen(env.hooks_out), 1024),
                    hst.dropped ? ", some dropped (above)" : "");
        }
    }

    /* the dump holds every row computed, also after a failure or Ctrl-C: P prompt rows (when
     * the prompt went through) and the decode steps done */
    if (o.dump) {
        if (n_prefilled == P && write_dump(&dump, V, P, r.n_done, fed, logits) != 0) rc = EXIT_FAIL;
        else if (n_prefilled != P) outfile_abort(&dump);
        outfile_free(&dump);
    }
    if (r.sp) spec_free(r.sp);
    free(r.gen); free(r.scratch); free(fed); free(last); free(logits);
    if (ids != o.prompt_ids) free(ids);
    free(file_text);
    cli_opts_free(&o);
    ds4_ctx_free(c);
    ds4_model_close(m);
    return rc;
}
