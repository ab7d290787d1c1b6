/* tok_escape.h -- the corpus and output formats of tests/test_tokenizer.py, read and written
 * the same way by both sides of the comparison (tests/oracle/tok_oracle.c over llama.cpp,
 * tests/tok_driver.c over ds4_tok.c): one case per line, with \\ \n \r \t and \xNN standing
 * for the byte; ids space separated, one line per case; pieces in hex, one line per id.
 * Each side passes its tokenizer in as a function. getline: the includer defines
 * _POSIX_C_SOURCE 200809L or _GNU_SOURCE. */
#ifndef TOK_ESCAPE_H
#define TOK_ESCAPE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

static int tok_hexv(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decode the escapes of s[0, n) in place; returns the new length. */
static size_t tok_unescape(char *s, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\\' && i + 1 < n) {
            char c = s[i + 1];
            if (c == '\\') { s[o++] = '\\'; i++; continue; }
            if (c == 'n') { s[o++] = '\n'; i++; continue; }
            if (c == 'r') { s[o++] = '\r'; i++; continue; }
            if (c == 't') { s[o++] = '\t'; i++; continue; }
            if (c == 'x' && i + 3 < n && tok_hexv(s[i + 2]) >= 0 && tok_hexv(s[i + 3]) >= 0) {
                s[o++] = (char)(tok_hexv(s[i + 2]) * 16 + tok_hexv(s[i + 3]));
                i += 3;
                continue;
            }
        }
        s[o++] = s[i];
    }
    return o;
}

/* A side's piece of id into buf[0, cap): its length, negative when it does not fit. */
typedef int (*tok_piece_fn)(const void *tok, int id, char *buf, int cap);

/* A side's ids of s[0, n) into ids[0, cap): their count (more than cap: call again with that
 * much room), negative on failure. */
typedef int (*tok_encode_fn)(const void *tok, const char *s, size_t n, int special, int32_t *ids, int cap);

/* The piece of every id below n_ids, one hex line each; -1 when one is longer than 4096 bytes. */
static int tok_write_pieces(FILE *o, const void *tok, int n_ids, tok_piece_fn piece) {
    char buf[4096];
    for (int id = 0; id < n_ids; id++) {
        int k = piece(tok, id, buf, (int) sizeof buf);
        if (k < 0) return -1;
        for (int j = 0; j < k; j++) fprintf(o, "%02x", (unsigned char) buf[j]);
        fputc('\n', o);
    }
    return 0;
}

/* The ids of every corpus line of in, one line each to o; the number of lines, -1 when an
 * encode fails. */
static long tok_encode_corpus(FILE *in, FILE *o, const void *tok, int special, tok_encode_fn encode) {
    char *line = NULL;
    size_t lcap = 0;
    ssize_t got;
    int cap = 1024;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t) cap);
    long lines = 0;
    while ((got = getline(&line, &lcap, in)) >= 0) {
        size_t n = (size_t) got;
        if (n && line[n - 1] == '\n') n--;
        n = tok_unescape(line, n);
        int r = encode(tok, line, n, special, ids, cap);
        if (r > cap) {
            cap = r;
            ids = realloc(ids, sizeof(int32_t) * (size_t) cap);
            r = encode(tok, line, n, special, ids, cap);
        }
        if (r < 0 || r > cap) { lines = -1; break; }
        for (int k = 0; k < r; k++) fprintf(o, k ? " %d" : "%d", ids[k]);
        fputc('\n', o);
        lines++;
    }
    free(line);
    free(ids);
    return lines;
}

#endif
