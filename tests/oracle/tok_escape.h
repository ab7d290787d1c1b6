/* tok_escape.h -- the corpus escapes of tests/test_tokenizer.py, decoded the same way by
 * both sides of the comparison (tests/oracle/tok_oracle.c over llama.cpp, tests/tok_driver.c
 * over ds4_tok.c): one case per line, with \\ \n \r \t and \xNN standing for the byte. */
#ifndef TOK_ESCAPE_H
#define TOK_ESCAPE_H

#include <stddef.h>

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

#endif
