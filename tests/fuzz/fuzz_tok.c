/* fuzz_tok.c -- libFuzzer target: the byte-level BPE tokenizer (ds4_tok.c).
 *
 * The tokenizer is built once per process from models/ds4-tiny.gguf (written by `make`;
 * DS4_FUZZ_MODEL overrides the path) with ds4_model_open + ds4_model_tokenizer. Per input:
 *   ids = ds4_tok_encode(text, parse_special = 0 and 1); every id in [0, n_tokens);
 *   the pieces of the ids (ds4_tok_piece) concatenate back to the input, for valid UTF-8 input,
 *   with parse_special 0 and 1 (control tokens' pieces are their text);
 *   the encoding is deterministic (same ids twice), and the cap protocol holds (return > cap
 *   when the buffer is too small);
 *   ds4_tok_find_n on the input never crashes and, when it finds an id, that id's piece is the input.
 * Built like fuzz_gguf.c (scripts/fuzz.sh).
 */
#define _POSIX_C_SOURCE 200809L
#include "ds4.h"
#include "ds4_tok.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ds4_model *model;   /* open for the whole process (it owns the tokenizer) */
static ds4_tok *tok;
static int n_tokens;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *path = getenv("DS4_FUZZ_MODEL");
    if (!path) path = "models/ds4-tiny.gguf";
    char err[512];
    ds4_model *m = model = ds4_model_open(path, err, sizeof err);
    if (!m) { fprintf(stderr, "fuzz_tok: %s (run make first, or set DS4_FUZZ_MODEL)\n", err); exit(2); }
    tok = ds4_model_tokenizer(m, err, sizeof err);
    if (!tok) { fprintf(stderr, "fuzz_tok: %s: no tokenizer: %s\n", path, err); exit(2); }
    n_tokens = ds4_tok_n_tokens(tok);
    return 0;
}

/* Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF). */
static int utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        int len; uint32_t cp;
        if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
        else return 0;
        if (i + (size_t)len > n) return 0;
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return 0;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += (size_t)len;
    }
    return 1;
}

static void fail(const char *msg, int special, size_t size) {
    fprintf(stderr, "fuzz_tok: %s (parse_special=%d, input %zu bytes)\n", msg, special, size);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    int valid = utf8_valid(data, size);
    /* invalid UTF-8 bytes become U+FFFD (3 bytes, as llama.cpp does): up to 3 ids a byte */
    int cap = 3 * (int)size + 8;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
    int32_t *ids2 = malloc(sizeof(int32_t) * (size_t)cap);
    char *out = malloc(size + 64);
    char piece[4096];
    if (!ids || !ids2 || !out) { free(ids); free(ids2); free(out); return 0; }
    for (int special = 0; special <= 1; special++) {
        int n = ds4_tok_encode(tok, text, size, special, ids, cap);
        if (n < 0) fail("encode returned -1", special, size);
        if (n > cap) fail("more ids than 3 * input bytes + 8", special, size);
        if (size > 0 && n == 0) fail("non-empty input gave no ids", special, size);
        int n2 = ds4_tok_encode(tok, text, size, special, ids2, cap);
        if (n2 != n || memcmp(ids, ids2, sizeof(int32_t) * (size_t)n) != 0) fail("encode not deterministic", special, size);
        if (n > 1) {   /* too small a buffer: the full count comes back */
            int n3 = ds4_tok_encode(tok, text, size, special, ids2, n - 1);
            if (n3 != n) fail("cap protocol: return value is not the full count", special, size);
        }
        size_t pos = 0;
        int same = 1;
        for (int i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= n_tokens) fail("id out of range", special, size);
            int k = ds4_tok_piece(tok, ids[i], piece, (int)sizeof piece);
            if (k < 0) fail("piece of a valid id failed", special, size);
            if (pos + (size_t)k > size) { same = 0; break; }
            memcpy(out + pos, piece, (size_t)k);
            pos += (size_t)k;
        }
        if (valid && (!same || pos != size || memcmp(out, data, size) != 0))
            fail("pieces do not concatenate back to the (valid UTF-8) input", special, size);
    }
    if (ds4_tok_piece(tok, -1, piece, 16) != INT32_MIN || ds4_tok_piece(tok, n_tokens, piece, 16) != INT32_MIN)
        fail("piece of an out-of-range id is not INT32_MIN", 0, size);
    int32_t id = ds4_tok_find_n(tok, text, size);
    if (id >= n_tokens || id < -1) fail("find_n returned an id out of range", 0, size);
    free(ids); free(ids2); free(out);
    return 0;
}
