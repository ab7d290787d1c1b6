/*
 * tok_oracle: llama.cpp (v0.4.0, prebuilt libllama) as the reference tokenizer for ds4_tok.
 *
 *   tok_oracle VOCAB.gguf encode CORPUS OUT [--no-special]   ids of every corpus line
 *   tok_oracle VOCAB.gguf pieces OUT                          piece of every id, hex
 *
 * The model is loaded with vocab_only = true. encode calls llama_tokenize(add_special = false,
 * parse_special = true unless --no-special); pieces calls llama_token_to_piece(lstrip = 0,
 * special = true). Corpus escapes and output formats are those of tests/tok_driver.c:
 * one case per line, "\\" "\n" "\r" "\t" "\xNN" escapes; ids space separated, pieces in hex.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "llama.h"
#include "libllama_dir.h"
#include "tok_escape.h"

static void die(const char *m) { fprintf(stderr, "tok_oracle: error: %s\n", m); exit(1); }

static void log_cb(enum ggml_log_level level, const char *text, void *ud) {
    (void) ud;
    if (level == GGML_LOG_LEVEL_ERROR || getenv("TOK_ORACLE_VERBOSE")) fputs(text, stderr);
}

/* llama.cpp as tok_escape.h's tokenizer: its "-(ids needed)" becomes the count to make room for. */
static int encode(const void *vocab, const char *s, size_t n, int special, int32_t *ids, int cap) {
    int r = llama_tokenize(vocab, s, (int32_t) n, ids, cap, false, special);
    return r < 0 && r != INT32_MIN ? -r : r;
}
static int piece_of(const void *vocab, int id, char *buf, int cap) {
    return llama_token_to_piece(vocab, id, buf, cap, 0, true);
}

int main(int argc, char **argv) {
    if (argc < 4) die("usage: tok_oracle VOCAB.gguf encode CORPUS OUT [--no-special] | pieces OUT");
    llama_log_set(log_cb, NULL);
    char *dir = libllama_dir();
    if (dir) ggml_backend_load_all_from_path(dir);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) die("cannot load the model (vocab_only)");
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const char *cmd = argv[2];
    if (!strcmp(cmd, "pieces")) {
        FILE *o = fopen(argv[3], "w");
        if (!o) die("cannot write output");
        if (tok_write_pieces(o, vocab, llama_vocab_n_tokens(vocab), piece_of) != 0) die("piece too long");
        fclose(o);
    } else if (!strcmp(cmd, "encode") && argc >= 5) {
        int special = !(argc > 5 && !strcmp(argv[5], "--no-special"));
        FILE *in = fopen(argv[3], "rb"), *o = fopen(argv[4], "w");
        if (!in || !o) die("cannot open corpus/output");
        if (tok_encode_corpus(in, o, vocab, special, encode) < 0) die("llama_tokenize failed");
        fclose(o);
        fclose(in);
    } else {
        die("bad command");
    }
    llama_model_free(model);
    free(dir);
    return 0;
}
