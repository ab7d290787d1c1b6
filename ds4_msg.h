/* ds4_msg.h -- the one-line messages every part of ds4 writes.
 *
 * The error convention: a call that can fail and return says why in ONE line, written into
 * the caller's err buffer (ds4_errf), and returns -1 or NULL; a name or a string that came
 * from outside is quoted through ds4_show, so that the line stays one line whatever it
 * holds.  Deciding to exit, and with which status, is the program's (ds4_cli.c): 2 for a bad
 * flag, value or combination, 1 for a run that failed.
 *
 * The one exception: an op of a backend (ds4_gpu.h) has no way to fail and return.  Its inputs
 * and sizes are checked before the first op runs (the model when it loads, the context's
 * limits when it is made), so a failure inside one is a bug or a broken device: the op says
 * so in one line through ds4_fatal, which exits with 1, the status of a failed run. */
#ifndef DS4_MSG_H
#define DS4_MSG_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* s[0:n) as an error line quotes it: printable ASCII as it is, every other byte as \xNN,
 * at most max bytes and "..." when cut, so that the message stays one line whatever s
 * holds.  out holds cap bytes (4 * max + 4 always suffice). */
const char *ds4_show(char *out, size_t cap, const char *s, size_t n, size_t max);

/* The one-line error every call that can fail returns: fmt into err (NULL or 0 bytes:
 * nothing), truncated to errlen - 1 bytes. */
void ds4_errf(char *err, size_t errlen, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* An op's failure (see above): "ds4: " fmt on stderr, then exit status 1. */
void ds4_fatal(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif /* DS4_MSG_H */
