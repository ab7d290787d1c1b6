/* quant_oracle.c -- ds4_quant_dequant against ggml's own dequantisation, bit for bit.
 *
 *   quant_oracle [--blocks N] [--quant-rows R] [--seed S] [--no-quantize]
 *
 * Links libggml-base from the npm llama.cpp release in build/oracle (see
 * fetch_llama.sh) and, for Q2_K, Q4_K, IQ2_XXS and the control type Q8_0,
 * compares ggml_get_type_traits(type)->to_float with ds4_quant_dequant with
 * memcmp on the float arrays, over blocks from three sources:
 *
 *   random  N blocks from ds4_quant_random_block (default N = 20000);
 *   bytes   N blocks of uniformly random bytes, f16 scale fields forced finite
 *           (an exponent field of 31 loses its top bit), so zero, negative and
 *           subnormal scales and every pattern of the other fields occur;
 *   ggml    the output of ggml_quantize_chunk on R rows of 4096 random floats
 *           (default R = 64, i.e. 1024 super-blocks): Gaussian values with a
 *           per-row scale from 1e-3 to 10 and a few outliers; every other row
 *           passes a random importance matrix (IQ2_XXS requires one in ggml, so
 *           all of its rows pass one).
 *
 * Plus one exhaustive line: every one of the 65536 f16 values as the scale of
 * a Q8_0 block of ones (q * d with q = 1 is d itself), which pins down the
 * f16 decode including infinities, NaNs and subnormals.
 *
 * And an "API" line: ds4_quant_row_bytes / is_kquant on edge cases, the
 * determinism of ds4_quant_random_block, and that its blocks dequantise to
 * finite values with max |x| in [0.01, 0.25] and mean |x| in [0.003, 0.1].
 *
 * One line per type: blocks compared, mismatching blocks.  Exit 0 if all
 * match, 1 on any mismatch or failed API check, 2 on a usage or setup error.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"

#include "../../ds4_quant.h"

_Static_assert((int)GGML_TYPE_Q2_K == (int)DS4_TYPE_Q2_K, "Q2_K type id");
_Static_assert((int)GGML_TYPE_Q4_K == (int)DS4_TYPE_Q4_K, "Q4_K type id");
_Static_assert((int)GGML_TYPE_IQ2_XXS == (int)DS4_TYPE_IQ2_XXS, "IQ2_XXS type id");
_Static_assert(GGML_TYPE_Q8_0 == DS4_QUANT_Q8_0, "Q8_0 type id");

#define QUANT_ROW 4096

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in (0, 1) */
static double rng_unit(uint64_t *s) { return ((double)(rng_next(s) >> 11) + 0.5) * 0x1.0p-53; }

static double rng_gauss(uint64_t *s)
{
    const double two_pi = 6.283185307179586;
    return sqrt(-2.0 * log(rng_unit(s))) * cos(two_pi * rng_unit(s));
}

/* Byte offsets of the f16 scale fields of one block. */
static int scale_offsets(int type, int off[2])
{
    switch (type) {
    case DS4_TYPE_Q2_K: off[0] = 80; off[1] = 82; return 2;
    case DS4_TYPE_Q4_K: off[0] = 0; off[1] = 2; return 2;
    default:            off[0] = 0; return 1;
    }
}

typedef struct {
    long compared, mismatched;
    double roundtrip;   /* ggml source: relative RMS error of quantise + dequantise */
} tally;

/* Dequantise nb blocks both ways and compare block by block. */
static void compare(int type, const uint8_t *blocks, int64_t nb, const char *src, tally *t)
{
    const int64_t be = ds4_quant_block_elems(type);
    const size_t bb = ds4_quant_block_bytes(type);
    const int64_t n = nb * be;
    float *a = malloc((size_t)n * sizeof(float));
    float *b = malloc((size_t)n * sizeof(float));
    if (!a || !b) { fprintf(stderr, "quant_oracle: out of memory\n"); exit(2); }
    /* poison both outputs differently so an unwritten element cannot pass */
    memset(a, 0x55, (size_t)n * sizeof(float));
    memset(b, 0xaa, (size_t)n * sizeof(float));
    ggml_get_type_traits((enum ggml_type)type)->to_float(blocks, a, n);
    ds4_quant_dequant(type, blocks, b, n);
    for (int64_t i = 0; i < nb; i++) {
        t->compared++;
        if (memcmp(a + i * be, b + i * be, (size_t)be * sizeof(float)) == 0) continue;
        if (t->mismatched++ < 3) {
            int64_t j = 0;
            while (memcmp(a + i * be + j, b + i * be + j, sizeof(float)) == 0) j++;
            uint32_t ua, ub;
            memcpy(&ua, a + i * be + j, 4);
            memcpy(&ub, b + i * be + j, 4);
            fprintf(stderr, "  %s %s block %lld element %lld: ggml %.9g (0x%08x) ds4 %.9g (0x%08x); bytes",
                    ds4_quant_type_name(type), src, (long long)i, (long long)j,
                    a[i * be + j], ua, b[i * be + j], ub);
            for (size_t k = 0; k < bb && k < 16; k++) fprintf(stderr, " %02x", blocks[i * bb + k]);
            fprintf(stderr, " ...\n");
        }
    }
    free(a);
    free(b);
}

static void src_random(int type, int64_t nb, uint64_t *seed, tally *t)
{
    const size_t bb = ds4_quant_block_bytes(type);
    uint8_t *blocks = malloc((size_t)nb * bb);
    if (!blocks) exit(2);
    for (int64_t i = 0; i < nb; i++) ds4_quant_random_block(type, seed, blocks + i * bb);
    compare(type, blocks, nb, "random", t);
    free(blocks);
}

static void src_bytes(int type, int64_t nb, uint64_t *seed, tally *t)
{
    const size_t bb = ds4_quant_block_bytes(type);
    uint8_t *blocks = malloc((size_t)nb * bb);
    if (!blocks) exit(2);
    for (size_t i = 0; i < (size_t)nb * bb; i++) blocks[i] = (uint8_t)rng_next(seed);
    int off[2];
    const int ns = scale_offsets(type, off);
    for (int64_t i = 0; i < nb; i++)
        for (int k = 0; k < ns; k++) {
            uint8_t *hi = blocks + i * bb + off[k] + 1;   /* sign, exponent, 2 mantissa bits */
            if ((*hi & 0x7c) == 0x7c) *hi &= (uint8_t)~0x40;
        }
    compare(type, blocks, nb, "bytes", t);
    free(blocks);
}

static void src_ggml(int type, int64_t rows, uint64_t *seed, tally *t)
{
    const size_t row_bytes = ds4_quant_row_bytes(type, QUANT_ROW);
    float *x = malloc((size_t)rows * QUANT_ROW * sizeof(float));
    float *imat = malloc(QUANT_ROW * sizeof(float));
    uint8_t *q = malloc((size_t)rows * row_bytes);
    if (!x || !imat || !q) exit(2);
    for (int64_t r = 0; r < rows; r++) {
        const double scale = pow(10.0, -3.0 + 4.0 * rng_unit(seed));
        float *xr = x + r * QUANT_ROW;
        for (int i = 0; i < QUANT_ROW; i++) {
            double v = scale * rng_gauss(seed);
            if (rng_next(seed) % 512 == 0) v *= 20.0;   /* a few outliers */
            xr[i] = (float)v;
        }
    }
    const int need_imat = ggml_quantize_requires_imatrix((enum ggml_type)type);
    for (int64_t r = 0; r < rows; r++) {
        const float *im = NULL;
        if (need_imat || (r & 1)) {
            for (int i = 0; i < QUANT_ROW; i++) imat[i] = (float)(0.01 + rng_unit(seed) * rng_unit(seed));
            im = imat;
        }
        size_t got = ggml_quantize_chunk((enum ggml_type)type, x + r * QUANT_ROW, q + r * row_bytes,
                                         0, 1, QUANT_ROW, im);
        if (got != row_bytes) {
            fprintf(stderr, "quant_oracle: ggml_quantize_chunk(%s) wrote %zu bytes, expected %zu\n",
                    ds4_quant_type_name(type), got, row_bytes);
            exit(2);
        }
    }
    compare(type, q, rows * (QUANT_ROW / ds4_quant_block_elems(type)), "ggml", t);
    /* the quantised data is real: relative RMS error of the round trip */
    float *y = malloc((size_t)rows * QUANT_ROW * sizeof(float));
    if (!y) exit(2);
    ds4_quant_dequant(type, q, y, rows * QUANT_ROW);
    double e2 = 0, x2 = 0;
    for (int64_t i = 0; i < rows * QUANT_ROW; i++) {
        const double r = (double)y[i] - (double)x[i];
        e2 += r * r;
        x2 += (double)x[i] * (double)x[i];
    }
    t->roundtrip = sqrt(e2 / x2);
    free(y);
    free(x);
    free(imat);
    free(q);
}

/* All 65536 f16 values as Q8_0 scales of blocks of ones. */
static void src_f16(tally *t)
{
    const int64_t nb = 65536;
    uint8_t *blocks = malloc((size_t)nb * DS4_QUANT_Q8_0_BLOCK_BYTES);
    if (!blocks) exit(2);
    for (int64_t h = 0; h < nb; h++) {
        uint8_t *p = blocks + h * DS4_QUANT_Q8_0_BLOCK_BYTES;
        p[0] = (uint8_t)h;
        p[1] = (uint8_t)(h >> 8);
        memset(p + 2, 1, 32);
    }
    compare(DS4_QUANT_Q8_0, blocks, nb, "f16", t);
    free(blocks);
}

/* Edge cases of the small API and the promises of ds4_quant_random_block. */
static int check_api(void)
{
    int fail = 0;
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "  API check failed: %s\n", #c); fail++; } } while (0)
    CHECK(ds4_quant_row_bytes(DS4_TYPE_Q2_K, 256) == 84);
    CHECK(ds4_quant_row_bytes(DS4_TYPE_Q4_K, 512) == 288);
    CHECK(ds4_quant_row_bytes(DS4_TYPE_IQ2_XXS, 4096) == 16 * 66);
    CHECK(ds4_quant_row_bytes(DS4_QUANT_Q8_0, 64) == 68);
    CHECK(ds4_quant_row_bytes(DS4_TYPE_Q2_K, 128) == 0);
    CHECK(ds4_quant_row_bytes(DS4_TYPE_Q4_K, 257) == 0);
    CHECK(ds4_quant_row_bytes(DS4_TYPE_IQ2_XXS, 0) == 0);
    CHECK(ds4_quant_row_bytes(DS4_TYPE_IQ2_XXS, -256) == 0);
    CHECK(ds4_quant_row_bytes(0, 256) == 0);
    CHECK(ds4_quant_row_bytes(11, 256) == 0);
    CHECK(ds4_quant_is_kquant(DS4_TYPE_Q2_K) && ds4_quant_is_kquant(DS4_TYPE_Q4_K) &&
          ds4_quant_is_kquant(DS4_TYPE_IQ2_XXS));
    CHECK(!ds4_quant_is_kquant(DS4_QUANT_Q8_0) && !ds4_quant_is_kquant(0) && !ds4_quant_is_kquant(1));
    static const int types[] = { DS4_TYPE_Q2_K, DS4_TYPE_Q4_K, DS4_TYPE_IQ2_XXS, DS4_QUANT_Q8_0 };
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const int type = types[k];
        const int64_t be = ds4_quant_block_elems(type);
        const size_t bb = ds4_quant_block_bytes(type);
        uint8_t b1[256], b2[256];
        float y[256];
        uint64_t s1 = 42, s2 = 42;
        double mx = 0, sum = 0;
        long cnt = 0;
        int finite = 1, same = 1;
        for (int i = 0; i < 1000; i++) {
            ds4_quant_random_block(type, &s1, b1);
            ds4_quant_random_block(type, &s2, b2);
            same &= memcmp(b1, b2, bb) == 0;
            ds4_quant_dequant(type, b1, y, be);
            for (int64_t j = 0; j < be; j++) {
                finite &= isfinite(y[j]) != 0;
                mx = fmax(mx, fabs(y[j]));
                sum += fabs(y[j]);
                cnt++;
            }
        }
        const double mean = sum / (double)cnt;
        if (!same || !finite || mx < 0.01 || mx > 0.25 || mean < 0.003 || mean > 0.1) {
            fprintf(stderr, "  API check failed: %s random blocks: deterministic %d finite %d max|x| %.4g mean|x| %.4g\n",
                    ds4_quant_type_name(type), same, finite, mx, mean);
            fail++;
        } else {
            printf("API      %-7s random blocks: max|x| %.4f mean|x| %.4f\n", ds4_quant_type_name(type), mx, mean);
        }
    }
#undef CHECK
    return fail;
}

static void usage(void)
{
    fprintf(stderr, "usage: quant_oracle [--blocks N] [--quant-rows R] [--seed S] [--no-quantize]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    long long nblocks = 20000, qrows = 64;
    unsigned long long seed0 = 1;
    int quantize = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--blocks") && i + 1 < argc) nblocks = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--quant-rows") && i + 1 < argc) qrows = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed0 = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--no-quantize")) quantize = 0;
        else usage();
    }
    if (nblocks < 1 || qrows < 0) usage();

    static const int types[] = { DS4_TYPE_Q2_K, DS4_TYPE_Q4_K, DS4_TYPE_IQ2_XXS, DS4_QUANT_Q8_0 };
    int bad = 0;
    const int api_fail = check_api();
    printf("API      checks failed: %d\n", api_fail);
    if (api_fail) bad = 1;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const int type = types[k];
        const struct ggml_type_traits *tr = ggml_get_type_traits((enum ggml_type)type);
        if (!tr->to_float || tr->blck_size != ds4_quant_block_elems(type) ||
            tr->type_size != ds4_quant_block_bytes(type)) {
            fprintf(stderr, "quant_oracle: ggml's %s is %lld elements / %zu bytes, ds4's %lld / %zu\n",
                    tr->type_name, (long long)tr->blck_size, tr->type_size,
                    (long long)ds4_quant_block_elems(type), ds4_quant_block_bytes(type));
            return 2;
        }
        uint64_t seed = seed0 * 0x100000001b3ull + (uint64_t)type;
        tally t = { 0, 0, 0 }, tr_ = { 0, 0, 0 }, tb = { 0, 0, 0 }, tg = { 0, 0, 0 };
        src_random(type, nblocks, &seed, &tr_);
        src_bytes(type, nblocks, &seed, &tb);
        if (quantize && qrows > 0) src_ggml(type, qrows, &seed, &tg);
        t.compared = tr_.compared + tb.compared + tg.compared;
        t.mismatched = tr_.mismatched + tb.mismatched + tg.mismatched;
        printf("%-8s %zu B/%lld: blocks compared %ld (random %ld, bytes %ld, ggml-quantized %ld), mismatches %ld\n",
               ds4_quant_type_name(type), ds4_quant_block_bytes(type), (long long)ds4_quant_block_elems(type),
               t.compared, tr_.compared, tb.compared, tg.compared, t.mismatched);
        if (tg.compared)
            printf("         ggml-quantized round trip: relative RMS error %.4f\n", tg.roundtrip);
        if (t.mismatched) bad = 1;
    }
    tally tf = { 0, 0, 0 };
    src_f16(&tf);
    printf("F16      all 65536 values as Q8_0 scales: blocks compared %ld, mismatches %ld\n",
           tf.compared, tf.mismatched);
    if (tf.mismatched) bad = 1;
    ggml_quantize_free();
    printf("%s\n", bad ? "FAIL" : "OK: bit-exact");
    return bad;
}
