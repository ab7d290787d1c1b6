/*
 * tok_driver: run ds4_tok on a GGUF vocabulary (the test twin of tests/oracle/tok_oracle.c).
 *
 *   tok_driver VOCAB.gguf encode CORPUS OUT [--no-special]   ids of every corpus line
 *   tok_driver VOCAB.gguf pieces OUT                          piece of every id, hex
 *   tok_driver VOCAB.gguf bench [REPEAT]                      tokenizer build time (ms)
 *   tok_driver VOCAB.gguf selftest                            API edge cases (prints "ok")
 *
 * GGUF: only the key/value section is read (tokenizer.ggml.tokens, .merges, .token_type,
 * .pre), sequentially, so multi-GB model files work too.
 *
 * Corpus: one case per line; the line's bytes are the case, except these escapes:
 * "\\" backslash, "\n" LF, "\r" CR, "\t" TAB, "\xNN" the byte NN (two hex digits).
 * Output of encode: one line per case, ids separated by spaces (empty line: no ids).
 * Output of pieces: one line per id, the piece's bytes in lowercase hex.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../ds4_tok.h"
#include "oracle/tok_escape.h"

static void die(const char *m) { fprintf(stderr, "tok_driver: error: %s\n", m); exit(1); }

typedef struct {
    char **s;
    uint32_t *len;
    uint64_t n;
} strarr;

static FILE *g_f;

static void rd(void *p, size_t n) { if (fread(p, 1, n, g_f) != n) die("short read in GGUF"); }
static uint64_t rd_u64(void) { uint64_t v; rd(&v, 8); return v; }
static uint32_t rd_u32(void) { uint32_t v; rd(&v, 4); return v; }

static char *rd_str(uint32_t *len) {
    uint64_t n = rd_u64();
    if (n > (1u << 30)) die("string too long");
    char *s = malloc(n + 1);
    if (!s) die("out of memory");
    rd(s, n);
    s[n] = 0;
    if (len) *len = (uint32_t) n;
    return s;
}

static size_t type_size(uint32_t t) {
    switch (t) {
        case 0: case 1: case 7: return 1;
        case 2: case 3: return 2;
        case 4: case 5: case 6: return 4;
        case 10: case 11: case 12: return 8;
        default: return 0;
    }
}

static void skip_val(uint32_t t) {
    if (t == 8) { free(rd_str(NULL)); return; }
    if (t == 9) {
        uint32_t et = rd_u32();
        uint64_t n = rd_u64();
        for (uint64_t i = 0; i < n; i++) skip_val(et);
        return;
    }
    size_t k = type_size(t);
    if (!k) die("bad GGUF value type");
    char b[8];
    rd(b, k);
}

typedef struct {
    strarr tokens, merges;
    int32_t *types;
    uint64_t ntypes;
    char *pre;
} vocab;

static void load_vocab(const char *path, vocab *v) {
    memset(v, 0, sizeof *v);
    g_f = fopen(path, "rb");
    if (!g_f) die("cannot open GGUF");
    char magic[4];
    rd(magic, 4);
    if (memcmp(magic, "GGUF", 4)) die("not a GGUF file");
    uint32_t ver = rd_u32();
    if (ver < 2) die("GGUF version < 2");
    rd_u64();
    uint64_t nkv = rd_u64();
    for (uint64_t i = 0; i < nkv; i++) {
        char *key = rd_str(NULL);
        uint32_t t = rd_u32();
        strarr *sa = !strcmp(key, "tokenizer.ggml.tokens") ? &v->tokens
                   : !strcmp(key, "tokenizer.ggml.merges") ? &v->merges : NULL;
        if (sa && t == 9) {
            uint32_t et = rd_u32();
            if (et != 8) die("tokens/merges not a string array");
            sa->n = rd_u64();
            sa->s = malloc(sizeof(char *) * sa->n);
            sa->len = malloc(sizeof(uint32_t) * sa->n);
            if (!sa->s || !sa->len) die("out of memory");
            for (uint64_t j = 0; j < sa->n; j++) sa->s[j] = rd_str(&sa->len[j]);
        } else if (!strcmp(key, "tokenizer.ggml.token_type") && t == 9) {
            uint32_t et = rd_u32();
            v->ntypes = rd_u64();
            v->types = malloc(sizeof(int32_t) * v->ntypes);
            if (!v->types) die("out of memory");
            for (uint64_t j = 0; j < v->ntypes; j++) {
                if (et == 5 || et == 4) { int32_t x; rd(&x, 4); v->types[j] = x; }
                else die("token_type not int32");
            }
        } else if (!strcmp(key, "tokenizer.ggml.pre") && t == 8) {
            v->pre = rd_str(NULL);
        } else {
            skip_val(t);
        }
        free(key);
    }
    fclose(g_f);
    if (!v->tokens.n) die("no tokenizer.ggml.tokens");
    if (v->types && v->ntypes != v->tokens.n) die("token_type count != token count");
}

static void free_vocab(vocab *v) {
    for (uint64_t i = 0; i < v->tokens.n; i++) free(v->tokens.s[i]);
    for (uint64_t i = 0; i < v->merges.n; i++) free(v->merges.s[i]);
    free(v->tokens.s); free(v->tokens.len); free(v->merges.s); free(v->merges.len);
    free(v->types); free(v->pre);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ds4_tok as tok_escape.h's tokenizer; g_encode_ms sums the time spent encoding. */
static double g_encode_ms;
static int timed_encode(const void *t, const char *s, size_t n, int special, int32_t *ids, int cap) {
    double t0 = now_ms();
    int r = ds4_tok_encode(t, s, n, special, ids, cap);
    g_encode_ms += now_ms() - t0;
    return r;
}
static int piece_of(const void *t, int id, char *buf, int cap) { return ds4_tok_piece(t, id, buf, cap); }

static ds4_tok *build(const vocab *v, double *ms) {
    char err[256];
    double t0 = now_ms();
    ds4_tok *t = ds4_tok_new((int) v->tokens.n, (const char *const *) v->tokens.s, v->tokens.len, v->types,
                             (int) v->merges.n, (const char *const *) v->merges.s, v->merges.len,
                             v->pre ? v->pre : "", err, sizeof err);
    if (ms) *ms = now_ms() - t0;
    if (!t) { fprintf(stderr, "tok_driver: %s\n", err); exit(2); }
    return t;
}


int main(int argc, char **argv) {
    if (argc < 3) die("usage: tok_driver VOCAB.gguf encode CORPUS OUT [--no-special] | pieces OUT | bench [N]");
    vocab v;
    load_vocab(argv[1], &v);
    const char *cmd = argv[2];
    if (!strcmp(cmd, "bench")) {
        int rep = argc > 3 ? atoi(argv[3]) : 3;
        double best = 1e30;
        for (int r = 0; r < rep; r++) {
            double ms;
            ds4_tok *t = build(&v, &ms);
            if (ms < best) best = ms;
            ds4_tok_free(t);
        }
        printf("tokens %llu merges %llu build_ms %.2f\n", (unsigned long long) v.tokens.n,
               (unsigned long long) v.merges.n, best);
        free_vocab(&v);
        return 0;
    }
    ds4_tok *t = build(&v, NULL);
    if (!strcmp(cmd, "selftest")) {
        int32_t ids[64];
        char buf[64];
        const char *bos = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "selftest failed: %s\n", #c); return 1; } } while (0)
        CHECK(ds4_tok_find(t, bos) == 0);
        CHECK(ds4_tok_find(t, "no such token text") == -1);
        CHECK(ds4_tok_find_n(t, "ab", 1) == ds4_tok_find(t, "a"));
        CHECK(ds4_tok_piece(t, -1, buf, sizeof buf) == INT32_MIN);
        CHECK(ds4_tok_piece(t, ds4_tok_n_tokens(t), buf, sizeof buf) == INT32_MIN);
        CHECK(ds4_tok_piece(t, 0, buf, 3) == -(int) strlen(bos));
        CHECK(ds4_tok_piece(t, 0, buf, sizeof buf) == (int) strlen(bos) && !memcmp(buf, bos, strlen(bos)));
        CHECK(ds4_tok_encode(t, NULL, 0, 1, ids, 64) == 0);
        CHECK(ds4_tok_encode(t, NULL, 5, 1, ids, 64) == -1);
        CHECK(ds4_tok_encode(NULL, "a", 1, 1, ids, 64) == -1);
        const char *txt = "Hello world, hello tokenizer 12345";
        int n = ds4_tok_encode(t, txt, strlen(txt), 1, ids, 64);
        CHECK(n > 3 && n <= 64);
        int32_t few[2] = { -7, -7 };
        CHECK(ds4_tok_encode(t, txt, strlen(txt), 1, few, 1) == n && few[0] == ids[0] && few[1] == -7);
        CHECK(ds4_tok_encode(t, txt, strlen(txt), 1, NULL, 0) == n);
        CHECK(ds4_tok_encode(t, bos, strlen(bos), 1, ids, 64) == 1 && ids[0] == 0);
        CHECK(ds4_tok_encode(t, bos, strlen(bos), 0, ids, 64) > 1);
        char err[128] = "";
        const char *tk[2] = { "a", "b" };
        uint32_t tl[2] = { 1, 1 };
        const char *mg[1] = { "a b" };
        uint32_t ml[1] = { 3 };
        CHECK(!ds4_tok_new(2, tk, tl, NULL, 1, mg, ml, "gpt2", err, sizeof err) && strstr(err, "'gpt2'"));
        CHECK(!ds4_tok_new(2, tk, tl, NULL, 1, mg, ml, NULL, err, sizeof err));
        ds4_tok *small = ds4_tok_new(2, tk, tl, NULL, 1, mg, ml, "joyai-llm", err, sizeof err);
        CHECK(small && ds4_tok_encode(small, "ab", 2, 1, ids, 64) == 2);  /* "ab" is no token */
        ds4_tok_free(small);
        ds4_tok_free(NULL);
        printf("ok\n");
    } else if (!strcmp(cmd, "pieces") && argc >= 4) {
        FILE *o = fopen(argv[3], "w");
        if (!o) die("cannot write output");
        if (tok_write_pieces(o, t, ds4_tok_n_tokens(t), piece_of) != 0) die("piece too long");
        fclose(o);
    } else if (!strcmp(cmd, "encode") && argc >= 5) {
        int special = !(argc > 5 && !strcmp(argv[5], "--no-special"));
        FILE *in = fopen(argv[3], "rb"), *o = fopen(argv[4], "w");
        if (!in || !o) die("cannot open corpus/output");
        long lines = tok_encode_corpus(in, o, t, special, timed_encode);
        if (lines < 0) die("encode failed");
        fclose(o);
        fclose(in);
        fprintf(stderr, "tok_driver: %ld lines, encode %.1f ms\n", lines, g_encode_ms);
    } else {
        die("bad command");
    }
    ds4_tok_free(t);
    free_vocab(&v);
    return 0;
}
