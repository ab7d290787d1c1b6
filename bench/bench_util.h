/* bench_util.h -- the clock, the median and the CUDA check the bench programs share.
 *
 * Header only (static inline), C and CUDA C++ alike, found by `#include "bench_util.h"` from
 * bench/ with no build flag.  A program that defines BENCH_NAME (its name, a string literal)
 * before including it also gets CHECK(stmt): on a CUDA error, one line naming the program, the
 * error and the statement, then exit(1).
 */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

/* Seconds on the monotonic clock. */
static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* qsort order of doubles, ascending. */
static inline int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of v[0..n) (sorts v in place). */
static inline double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#ifdef BENCH_NAME
#define CHECK(stmt) do {                                                            \
        cudaError_t e_ = (stmt);                                                    \
        if (e_ != cudaSuccess) {                                                    \
            fprintf(stderr, BENCH_NAME ": %s in `%s` at %s:%d\n", cudaGetErrorString(e_), \
                    #stmt, __FILE__, __LINE__);                                     \
            exit(1);                                                                \
        }                                                                           \
    } while (0)
#endif

#endif
