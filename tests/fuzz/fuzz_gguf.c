/* fuzz_gguf.c -- libFuzzer target: the GGUF reader and validator, from memory.
 *
 * Includes ds4.c (as tests/test_gguf.c does) to reach model_weights() and the ds4_model struct.
 * Per input: copy into an exact-size heap buffer (so ASan sees any read past the end), then
 * ds4_model_open_memory(buf, size, take_ownership=0). Invariants:
 *   rejected: err is non-empty and is one line (no '\n');
 *   accepted: every weight's [host, host+nbytes) lies inside [buf, buf+size), and the
 *             tokenizer (gpt2 vocabularies) builds or fails with one error line.
 *
 * -DDS4_FUZZ_PAD (binary fuzz_gguf_pad): the input is the start of the image and the harness
 * zero-pads it to PAD_BYTES (4 MiB, enough for `ds4 synth --config tiny --vocab --type q8_0`),
 * so a fuzzed header/kv/tensor-info section with in-range data offsets reaches the deepseek4
 * validator (keys, shapes, types) and is often accepted; the raw target mostly stops at
 * "tensor data extends past end of file". The padded image is an exact-size heap block too.
 * Built by scripts/fuzz.sh:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
 *         tests/fuzz/fuzz_gguf.c ds4_quant.c ds4_tok.c -pthread -lm
 */
#define _POSIX_C_SOURCE 200809L
#ifdef DS4_FUZZ_SRC
#include DS4_FUZZ_SRC      /* scripts/fuzz.sh --planted: a modified copy of ds4.c */
#else
#include "../../ds4.c"
#endif

static void check_one_line(const char *what, const char *err) {
    if (err[0] == 0) { fprintf(stderr, "fuzz_gguf: %s: empty error message\n", what); abort(); }
    if (strchr(err, '\n')) { fprintf(stderr, "fuzz_gguf: %s: error has a newline: %s\n", what, err); abort(); }
}

#define PAD_BYTES ((size_t)4 << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
#ifdef DS4_FUZZ_PAD
    static uint8_t *pad;
    if (!pad && !(pad = calloc(1, PAD_BYTES))) return 0;
    if (size > PAD_BYTES) return 0;
    uint8_t *buf = pad;
    memcpy(buf, data, size);
    size_t in_size = size;
    size = PAD_BYTES;
#else
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
#endif
    char err[512];
    err[0] = 0;
    ds4_model *m = ds4_model_open_memory(buf, size, 0, err, sizeof err);
    if (!m) {
        check_one_line("rejected input", err);
        goto done;
    }
    static ds4_weight *ws[DS4_MAX_WEIGHTS];
    int n = model_weights(m, ws, DS4_MAX_WEIGHTS, 1);   /* the MTP block's too */
    const uint8_t *lo = buf, *hi = buf + size;
    for (int i = 0; i < n; i++) {
        const uint8_t *h = ws[i]->host;
        if (h < lo || h > hi || ws[i]->nbytes > (size_t)(hi - h)) {
            fprintf(stderr, "fuzz_gguf: accepted model's tensor %s [%p,+%zu) outside the buffer [%p,+%zu)\n",
                    ws[i]->name ? ws[i]->name : "?", (const void *)h, ws[i]->nbytes, (const void *)lo, size);
            abort();
        }
    }
    if (m->hp.has_vocab) {
        err[0] = 0;
        if (!ds4_model_tokenizer(m, err, sizeof err)) check_one_line("tokenizer of an accepted model", err);
    }
    ds4_model_close(m);
done:
#ifdef DS4_FUZZ_PAD
    memset(buf, 0, in_size);
#else
    free(buf);
#endif
    return 0;
}
