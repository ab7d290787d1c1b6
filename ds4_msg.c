/* ds4_msg.c -- the one-line messages every part of ds4 writes (ds4_msg.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4_msg.h"

const char *ds4_show(char *out, size_t cap, const char *s, size_t n, size_t max) {
    size_t o = 0, i = 0;
    for (; i < n && i < max && o + 5 < cap; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f) out[o++] = (char)c;
        else o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    if (n > max && o + 4 < cap) { memcpy(out + o, "...", 3); o += 3; }
    out[o] = 0;
    return out;
}

void ds4_errf(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

void ds4_fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("ds4: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}
