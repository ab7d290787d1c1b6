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
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "llama.h"
#include "tok_escape.h"

static void die(const char *m) { fprintf(stderr, "tok_oracle: error: %s\n", m); exit(1); }

static void log_cb(enum ggml_log_level level, const char *text, void *ud) {
    (void) ud;
    if (level == GGML_LOG_LEVEL_ERROR || getenv("TOK_ORACLE_VERBOSE")) fputs(text, stderr);
}


static char *libllama_dir(void) {
    Dl_info info;
    if (!dladdr((void *) &llama_backend_init, &info) || !info.dli_fname) return NULL;
    char *path = realpath(info.dli_fname, NULL);
    if (!path) return NULL;
    char *slash = strrchr(path, '/');
    if (slash) *slash = '\0';
    return path;
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
        int n = llama_vocab_n_tokens(vocab);
        char buf[4096];
        for (int id = 0; id < n; id++) {
            int k = llama_token_to_piece(vocab, id, buf, sizeof buf, 0, true);
            if (k < 0) die("piece too long");
            for (int j = 0; j < k; j++) fprintf(o, "%02x", (unsigned char) buf[j]);
            fputc('\n', o);
        }
        fclose(o);
    } else if (!strcmp(cmd, "encode") && argc >= 5) {
        bool special = !(argc > 5 && !strcmp(argv[5], "--no-special"));
        FILE *in = fopen(argv[3], "rb"), *o = fopen(argv[4], "w");
        if (!in || !o) die("cannot open corpus/output");
        char *line = NULL;
        size_t lcap = 0;
        ssize_t got;
        int cap = 1024;
        llama_token *ids = malloc(sizeof(llama_token) * (size_t) cap);
        while ((got = getline(&line, &lcap, in)) >= 0) {
            size_t n = (size_t) got;
            if (n && line[n - 1] == '\n') n--;
            n = tok_unescape(line, n);
            int r = llama_tokenize(vocab, line, (int32_t) n, ids, cap, false, special);
            if (r < 0) {
                cap = -r;
                ids = realloc(ids, sizeof(llama_token) * (size_t) cap);
                r = llama_tokenize(vocab, line, (int32_t) n, ids, cap, false, special);
            }
            if (r < 0) die("llama_tokenize failed");
            for (int k = 0; k < r; k++) fprintf(o, k ? " %d" : "%d", ids[k]);
            fputc('\n', o);
        }
        fclose(o);
        fclose(in);
    } else {
        die("bad command");
    }
    llama_model_free(model);
    free(dir);
    return 0;
}
