/* fuzz_cli.c -- libFuzzer target: the command-line parsers of ds4_cli.c (cli_parse for the run
 * options, synth_parse for `ds4 synth`).
 *
 * Includes ds4_cli.c (its main renamed, libFuzzer has its own) to reach the static parsers;
 * ds4.c, ds4_quant.c and ds4_tok.c are linked as they are. The input, split at NUL bytes, is the
 * argument list (a NUL ends an argument; a final NUL is optional, so "-n\0" is one argument and
 * "-p\0\0" is "-p" and ""), at most MAX_ARGS arguments, each in its own exact-size heap block
 * so that ASan sees a read past its NUL. It is parsed twice as run options, argv
 * {"ds4", args...}, and twice as synth options, argv {"ds4", "synth", args...}. Invariants:
 *   - no crash, no ASan/UBSan report, no leak (LeakSanitizer: the opts are freed with
 *     cli_opts_free / synth_opts_free whatever the result), argv left unchanged;
 *   - the result is 0, or -1 with a non-empty one-line error (no '\n');
 *   - the same argv gives the same result twice (rc, error text, every parsed value);
 *   - on 0 the values are what the harness reads from argv on its own (a flag's value is the
 *     next argument, the last occurrence wins, -h/--help ends the reading) and lie in their
 *     documented ranges: -n in [0, 2^24], -c in [1, 2^24] (or 0, unset), --threads in [1, 64]
 *     (or 0), --mtp-draft in [1, 3] (or 0), --experts in [1, 1024] (or 0), --temp in [0, 100], --top-p in [1e-6, 1], finite;
 *     --seed a non-negative decimal (no '-') whose value is the seed; the --tokens/--force
 *     lists have one id per comma-separated field, each >= 0 and equal to that field; the
 *     backend is one this build has; -p and --tokens not both, --think only with --chat,
 *     --force at least -n ids; --mtp's value is the last given; the synth config is --config
 *     with --vocab ("+vocab"), --mtp ("+mtp") or --mtp-file ("+mtpfile", not both) and
 *     --experts ("@E") folded in, nothing cut, and its --type is one ds4_parse_wtype knows.
 * Built by scripts/fuzz.sh like the others:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
 *         tests/fuzz/fuzz_cli.c ds4.c ds4_quant.c ds4_tok.c -pthread -lm
 */
#define main ds4_cli_main
#include "../../ds4_cli.c"
#undef main

#include <math.h>

#define MAX_ARGS 64

static void bad(const char *what, char **argv, int argc) {
    fprintf(stderr, "fuzz_cli: %s; argv:", what);
    for (int i = 0; i < argc; i++) {
        fprintf(stderr, " '");
        for (const unsigned char *p = (const unsigned char *)argv[i]; *p; p++)
            if (*p >= 0x20 && *p < 0x7f && *p != '\'') fputc(*p, stderr); else fprintf(stderr, "\\x%02x", *p);
        fprintf(stderr, "'");
    }
    fprintf(stderr, "\n");
    abort();
}

static void check_error(int rc, const char *err, char **argv, int argc) {
    if (rc != 0 && rc != -1) bad("parser returned neither 0 nor -1", argv, argc);
    if (rc == -1 && !err[0]) bad("rejected with an empty error", argv, argc);
    if (rc == -1 && strchr(err, '\n')) bad("the error is more than one line", argv, argc);
}

/* The harness's own reading of argv: each value-taking flag's last value (NULL when absent),
 * the value-less flags, and whether -h/--help came. Returns 0 when some argument is neither a
 * known flag nor a flag's value, which an accepted argv must not have. */
struct flag { const char *name; int slot; };   /* slot -1: no value (bare[slot] set to 1 instead) */
struct reading {
    int help, bare[8];
    const char *val[16];
    int twice;                                 /* an option (or its alias) came more than once */
};

static int read_argv(int first, int argc, char **argv, const struct flag *flags, struct reading *r) {
    memset(r, 0, sizeof *r);
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { r->help = 1; return 1; }
        const struct flag *f = flags;
        while (f->name && strcmp(f->name, a)) f++;
        if (!f->name) return 0;
        if (f->slot < 0) { r->twice |= r->bare[-1 - f->slot]; r->bare[-1 - f->slot] = 1; continue; }
        if (i + 1 >= argc) return 0;
        r->twice |= r->val[f->slot] != NULL;
        r->val[f->slot] = argv[++i];
    }
    return 1;
}

/* --seed: digits only after optional blanks and '+', never a '-'; the value is strtoull's. */
static void check_seed(const char *v, uint64_t seed, char **argv, int argc) {
    if (!v) { if (seed != 1) bad("seed changed without --seed", argv, argc); return; }
    if (strchr(v, '-')) bad("--seed accepted a value with a '-'", argv, argc);
    if (strtoull(v, NULL, 10) != seed) bad("--seed value differs from its argument", argv, argc);
}

static void check_int(const char *v, int got, int lo, int hi, int unset, const char *what, char **argv, int argc) {
    if (!v) { if (got != unset) bad(what, argv, argc); return; }
    if (got < lo || got > hi || strtoll(v, NULL, 10) != got) bad(what, argv, argc);
}

static void check_float(const char *v, float got, float lo, float hi, float unset, const char *what,
                        char **argv, int argc) {
    if (!isfinite(got) || got < lo || got > hi) bad(what, argv, argc);
    if (!v) { if (got != unset) bad(what, argv, argc); return; }
    if (strtof(v, NULL) != got) bad(what, argv, argc);
}

/* One id per comma-separated field of v, each >= 0 and equal to its field. */
static void check_ids(const char *v, const int32_t *ids, int n, const char *what, char **argv, int argc) {
    if (!v) { if (ids || n) bad(what, argv, argc); return; }
    if (!ids || n < 1) bad(what, argv, argc);
    int fields = 1;
    for (const char *p = v; *p; p++) fields += *p == ',';
    if (fields != n) bad(what, argv, argc);
    const char *p = v;
    for (int i = 0; i < n; i++) {
        char *end;
        const long long want = strtoll(p, &end, 10);
        if (ids[i] < 0 || ids[i] != want) bad(what, argv, argc);
        p = strchr(p, ',');
        if (i + 1 < n) { if (!p) bad(what, argv, argc); p++; }
    }
}

enum { R_M, R_P, R_TOKENS, R_N, R_TEMP, R_TOPP, R_SEED, R_CTX, R_BACKEND, R_DUMP, R_FORCE, R_THREADS, R_FILE, R_MTP,
       R_MTPFILE };

static void check_run(const struct cli_opts *o, int argc, char **argv) {
    static const struct flag flags[] = {
        { "-m", R_M }, { "-p", R_P }, { "--tokens", R_TOKENS }, { "-n", R_N }, { "--temp", R_TEMP },
        { "--top-p", R_TOPP }, { "--seed", R_SEED }, { "-c", R_CTX }, { "--ctx", R_CTX }, { "--backend", R_BACKEND },
        { "--dump-logits", R_DUMP }, { "--force", R_FORCE }, { "--threads", R_THREADS }, { "-f", R_FILE }, { "--file", R_FILE },
        { "--mtp-draft", R_MTP }, { "--mtp", R_MTPFILE }, { "--chat", -1 }, { "--think", -2 }, { "--stats", -3 }, { "-v", -4 }, { "--verbose", -4 },
        { "-i", -5 }, { "--interactive", -5 }, { "--allow-nonfinite", -6 }, { NULL, 0 } };
    struct reading r;
    if (!read_argv(1, argc, argv, flags, &r)) bad("accepted an argument that is no option", argv, argc);
    if (r.twice && !r.help) bad("accepted an option given twice", argv, argc);
    if (o->help != r.help || o->chat != r.bare[0] || o->think != r.bare[1]) bad("-h/--chat/--think not as given", argv, argc);
    if (o->verbose != r.bare[3] || o->interactive != r.bare[4] || o->allow_nonfinite != r.bare[5])
        bad("-v/-i/--allow-nonfinite not as given", argv, argc);
    if (o->stats != r.bare[2]) bad("--stats not as given", argv, argc);
    if (o->model_path != r.val[R_M] || o->prompt != r.val[R_P] || o->dump != r.val[R_DUMP] || o->prompt_file != r.val[R_FILE] ||
        o->mtp_file != r.val[R_MTPFILE])
        bad("-m/-p/--dump-logits/-f/--mtp not the last value given", argv, argc);
    check_ids(r.val[R_TOKENS], o->prompt_ids, o->n_prompt_ids, "--tokens list not as given", argv, argc);
    check_ids(r.val[R_FORCE], o->force, o->n_force, "--force list not as given", argv, argc);
    check_float(r.val[R_TEMP], o->temp, 0.0f, 100.0f, 0.0f, "--temp out of range or not as given", argv, argc);
    check_float(r.val[R_TOPP], o->top_p, 1e-6f, 1.0f, 1.0f, "--top-p out of range or not as given", argv, argc);
    check_seed(r.val[R_SEED], o->seed, argv, argc);
    check_int(r.val[R_THREADS], o->threads, 1, 64, 0, "--threads out of range or not as given", argv, argc);
    check_int(r.val[R_CTX], o->n_ctx, 1, 1 << 24, 0, "-c/--ctx out of range or not as given", argv, argc);
    check_int(r.val[R_MTP], o->mtp_draft, 1, 3, 0, "--mtp-draft out of range or not as given", argv, argc);
    if (o->n_gen < 0 || o->n_gen > (1 << 24)) bad("-n out of [0, 2^24]", argv, argc);
    if (r.val[R_N]) check_int(r.val[R_N], o->n_gen, 0, 1 << 24, 0, "-n not as given", argv, argc);
    if (o->n_gen_set != (r.val[R_N] != NULL)) bad("n_gen_set not as given", argv, argc);
    if (o->help) return;   /* the checks across options are not made for --help */
    if (!r.val[R_N] && o->n_gen != (o->force ? o->n_force : 32)) bad("-n default wrong", argv, argc);
    if ((o->prompt != NULL) + (o->prompt_ids != NULL) + (o->prompt_file != NULL) > 1) bad("accepted two prompts", argv, argc);
    if (o->think && !o->chat) bad("accepted --think without --chat", argv, argc);
    if (o->interactive && (!o->chat || o->force || o->dump)) bad("accepted -i without --chat, or with --force or a dump", argv, argc);
    if (o->chat && o->prompt_ids) bad("accepted --chat with --tokens", argv, argc);
    if (o->force && o->n_force != o->n_gen) bad("accepted --force of another length than -n", argv, argc);
    if (!o->backend || (r.val[R_BACKEND] && strcmp(o->backend, r.val[R_BACKEND]))) bad("backend not as given", argv, argc);
#ifdef DS4_CUDA
    if (strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda")) bad("unknown backend accepted", argv, argc);
#else
    if (strcmp(o->backend, "cpu")) bad("a backend other than cpu accepted in a CPU build", argv, argc);
#endif
}

enum { S_CONFIG, S_SEED, S_TYPE, S_O, S_THREADS, S_EXPERTS, S_CTX };

static void check_synth(const struct synth_opts *o, int argc, char **argv) {
    static const struct flag flags[] = {
        { "--config", S_CONFIG }, { "--seed", S_SEED }, { "--type", S_TYPE }, { "-o", S_O }, { "--threads", S_THREADS },
        { "--experts", S_EXPERTS }, { "--ctx", S_CTX }, { "--vocab", -1 }, { "--mtp", -2 }, { "--mtp-file", -3 },
        { NULL, 0 } };
    struct reading r;
    if (!read_argv(2, argc, argv, flags, &r)) bad("synth: accepted an argument that is no option", argv, argc);
    if (o->help != r.help) bad("synth: --help not as given", argv, argc);
    if (o->help) return;
    if (r.twice) bad("synth: accepted an option given twice", argv, argc);
    if (o->vocab != r.bare[0] || o->mtp != r.bare[1] || o->mtp_file != r.bare[2] || !o->out || o->out != r.val[S_O])
        bad("synth: --vocab/--mtp/--mtp-file/-o not as given", argv, argc);
    if (o->mtp && o->mtp_file) bad("synth: accepted --mtp with --mtp-file", argv, argc);
    check_seed(r.val[S_SEED], o->seed, argv, argc);
    check_int(r.val[S_THREADS], o->threads, 1, 64, 0, "synth: --threads out of range or not as given", argv, argc);
    check_int(r.val[S_EXPERTS], o->experts, 1, 1024, 0, "synth: --experts out of range or not as given", argv, argc);
    check_int(r.val[S_CTX], o->ctx, 1, 1 << 24, 0, "synth: --ctx out of range or not as given", argv, argc);
    const char *cfg = r.val[S_CONFIG];
    if (!cfg || !o->config) bad("synth: accepted without --config", argv, argc);
    if (!o->vocab && !o->mtp && !o->mtp_file && !o->experts && !o->ctx) {
        if (o->config != cfg) bad("synth: config is not --config's value", argv, argc);
    } else {
        /* --config NAME[@E][/N] with --vocab, --mtp or --mtp-file, --experts E', --ctx N':
         * NAME[+vocab][+mtp|+mtpfile][@E][@E'][/N][/N']
         * (one @ and one / at most, else rejected); NAME ends at the first @ or / */
        const char *slash = strchr(cfg, '/');
        const char *at = strchr(cfg, '@');
        if (at && slash && at > slash) at = NULL;            /* an @ after the / belongs to the /N part */
        const size_t name = at ? (size_t)(at - cfg) : slash ? (size_t)(slash - cfg) : strlen(cfg);
        char *want = malloc(strlen(cfg) + 64);
        if (!want) abort();
        memcpy(want, cfg, name);
        want[name] = 0;
        if (o->vocab) strcat(want, "+vocab");
        if (o->mtp) strcat(want, "+mtp");
        if (o->mtp_file) strcat(want, "+mtpfile");
        if (at) strncat(want, at, slash ? (size_t)(slash - at) : strlen(at));
        if (o->experts) sprintf(want + strlen(want), "@%d", o->experts);
        if (slash) strcat(want, slash);
        if (o->ctx) sprintf(want + strlen(want), "/%d", o->ctx);
        const int same = !strcmp(want, o->config);
        free(want);
        if (!same) bad("synth: config is not --config with --vocab/--experts/--ctx folded in", argv, argc);
        if (o->experts && at) bad("synth: accepted --experts with NAME@E", argv, argc);
        if (o->ctx && slash) bad("synth: accepted --ctx with NAME/N", argv, argc);
        if (o->vocab && strstr(cfg, "+vocab")) bad("synth: accepted --vocab with NAME+vocab", argv, argc);
        if ((o->mtp || o->mtp_file) && strstr(cfg, "+mtp")) bad("synth: accepted --mtp/--mtp-file with NAME+mtp", argv, argc);
    }
    (void)ds4_synth_config_ok(o->config);   /* ds4_synth_write's check, run here only for crashes */
    const int layout = strstr(o->config, "-q2") || strstr(o->config, "-q4");
    if (o->layout != layout || (layout && r.val[S_TYPE])) bad("synth: layout and --type", argv, argc);
    if (!o->type || (r.val[S_TYPE] && o->type != r.val[S_TYPE])) bad("synth: --type not as given", argv, argc);
    if (o->wtype < 0 || o->wtype != ds4_parse_wtype(o->type)) bad("synth: accepted an unknown --type", argv, argc);
}

static int same_run(const struct cli_opts *a, const struct cli_opts *b) {
    return a->help == b->help && a->model_path == b->model_path && a->prompt == b->prompt && a->dump == b->dump &&
           (a->backend == b->backend || (a->backend && b->backend && !strcmp(a->backend, b->backend))) &&
           a->n_prompt_ids == b->n_prompt_ids && a->n_force == b->n_force &&
           (!a->prompt_ids) == (!b->prompt_ids) && (!a->force) == (!b->force) &&
           (!a->prompt_ids || !memcmp(a->prompt_ids, b->prompt_ids, sizeof(int32_t) * (size_t)a->n_prompt_ids)) &&
           (!a->force || !memcmp(a->force, b->force, sizeof(int32_t) * (size_t)a->n_force)) &&
           a->n_gen == b->n_gen && a->n_gen_set == b->n_gen_set && a->n_ctx == b->n_ctx &&
           !memcmp(&a->temp, &b->temp, sizeof a->temp) && !memcmp(&a->top_p, &b->top_p, sizeof a->top_p) &&
           a->seed == b->seed && a->chat == b->chat && a->think == b->think && a->threads == b->threads &&
           a->stats == b->stats && a->mtp_draft == b->mtp_draft && a->mtp_file == b->mtp_file;
}

static int same_synth(const struct synth_opts *a, const struct synth_opts *b) {
    return a->help == b->help && a->out == b->out && a->seed == b->seed && a->experts == b->experts &&
           a->vocab == b->vocab && a->mtp == b->mtp && a->mtp_file == b->mtp_file && a->threads == b->threads &&
           a->wtype == b->wtype && a->layout == b->layout &&
           (a->config == b->config || (a->config && b->config && !strcmp(a->config, b->config))) &&
           (a->type == b->type || (a->type && b->type && !strcmp(a->type, b->type)));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *argv[MAX_ARGS + 3];
    const uint8_t *start[MAX_ARGS + 3];
    size_t len[MAX_ARGS + 3];
    int n = 0;
    argv[n] = "ds4"; start[n] = NULL; n++;
    argv[n] = "synth"; start[n] = NULL; n++;            /* skipped for the run options */
    for (size_t i = 0; i < size && n < MAX_ARGS + 2; ) {
        const uint8_t *nul = memchr(data + i, 0, size - i);
        const size_t l = nul ? (size_t)(nul - (data + i)) : size - i;
        argv[n] = malloc(l + 1);
        if (!argv[n]) abort();
        memcpy(argv[n], data + i, l);
        argv[n][l] = 0;
        start[n] = data + i;
        len[n] = l;
        n++;
        i += l + 1;
    }
    argv[n] = NULL;
    char err1[512], err2[512];

    /* run options: {"ds4", args...} */
    char **rargv = argv + 1;
    int rargc = n - 1;
    rargv[0] = "ds4";
    struct cli_opts a, b;
    const int ra = cli_parse(rargc, rargv, &a, err1, sizeof err1);
    check_error(ra, err1, rargv, rargc);
    if (ra == 0) check_run(&a, rargc, rargv);
    const int rb = cli_parse(rargc, rargv, &b, err2, sizeof err2);
    if (ra != rb || (ra != 0 && strcmp(err1, err2)) || (ra == 0 && !same_run(&a, &b)))
        bad("cli_parse gave two results for one argv", rargv, rargc);
    cli_opts_free(&a);
    cli_opts_free(&b);

    /* synth options: {"ds4", "synth", args...} */
    argv[1] = "synth";
    struct synth_opts s, t;
    const int sa = synth_parse(n, argv, &s, err1, sizeof err1);
    check_error(sa, err1, argv, n);
    if (sa == 0) check_synth(&s, n, argv);
    const int sb = synth_parse(n, argv, &t, err2, sizeof err2);
    if (sa != sb || (sa != 0 && strcmp(err1, err2)) || (sa == 0 && !same_synth(&s, &t)))
        bad("synth_parse gave two results for one argv", argv, n);
    synth_opts_free(&s);
    synth_opts_free(&t);

    for (int i = 2; i < n; i++) {
        if (memcmp(argv[i], start[i], len[i]) || argv[i][len[i]]) bad("a parser changed argv", argv, n);
        free(argv[i]);
    }
    return 0;
}
