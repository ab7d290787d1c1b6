/*
 * ds4_tok: DeepSeek V3/V4 byte-level BPE tokenizer (GGUF "gpt2" model, pre "deepseek-v3" or
 * "joyai-llm"), bit-compatible with llama.cpp's llama_tokenize(add_special = false) and
 * llama_token_to_piece(special = true). See ds4_tok.c for how it works.
 */
#ifndef DS4_TOK_H
#define DS4_TOK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* GGUF tokenizer.ggml.token_type values (same numbers as llama.cpp's llama_token_type). */
enum {
    DS4_TOKTYPE_UNDEFINED    = 0,
    DS4_TOKTYPE_NORMAL       = 1,
    DS4_TOKTYPE_UNKNOWN      = 2,
    DS4_TOKTYPE_CONTROL      = 3,
    DS4_TOKTYPE_USER_DEFINED = 4,
    DS4_TOKTYPE_UNUSED       = 5,
    DS4_TOKTYPE_BYTE         = 6,
};

typedef struct ds4_tok ds4_tok;

/*
 * Build a tokenizer. tokens[i] is token_lens[i] bytes (no NUL needed);
 * token_types may be NULL (all normal). merges[i] ("left right", merge_lens[i] bytes) has rank i.
 * pre must be "deepseek-v3" or "joyai-llm" (same behaviour). The arrays are copied.
 * On failure returns NULL and writes a one-line message to err (if err != NULL).
 */
ds4_tok *ds4_tok_new(int n_tokens, const char *const *tokens, const uint32_t *token_lens,
                     const int32_t *token_types, int n_merges, const char *const *merges,
                     const uint32_t *merge_lens, const char *pre, char *err, size_t errlen);

void ds4_tok_free(ds4_tok *t);

int ds4_tok_n_tokens(const ds4_tok *t);

/* The GPT-2 byte alphabet's symbol for byte b (0..255) as UTF-8 (1 or 2 bytes, then a NUL):
 * the text of that byte's token in a byte-level BPE vocabulary. Returns the length. */
int ds4_tok_byte_symbol(int b, char out[3]);

/*
 * Tokenize len bytes of text (any bytes; invalid UTF-8 is handled like llama.cpp does).
 * parse_special != 0: control, user-defined and unknown tokens written literally in the text
 * become those tokens; 0: only user-defined ones do (llama.cpp's rule). No BOS/EOS is added.
 * Writes at most cap ids to out and returns the number of ids of the full result, so a return
 * value > cap means out was too small (call again with a larger buffer). -1 on error (t or
 * text NULL, out of memory).
 */
int ds4_tok_encode(const ds4_tok *t, const char *text, size_t len, int parse_special,
                   int32_t *out, int cap);

/*
 * The bytes of token id (byte-level BPE alphabet decoded; control/user-defined/unknown tokens
 * as their text; unused/undefined tokens give 0 bytes), like llama_token_to_piece(special=true,
 * lstrip=0). Returns the length; -length when cap is smaller (nothing written); INT32_MIN
 * for an id out of range. No NUL is appended.
 */
int ds4_tok_piece(const ds4_tok *t, int32_t id, char *buf, int cap);

/* The id whose text is exactly text (NUL-terminated), or -1. For duplicated texts the last id
 * wins, as in llama.cpp. ds4_tok_find_n takes a length. */
int32_t ds4_tok_find(const ds4_tok *t, const char *text);
int32_t ds4_tok_find_n(const ds4_tok *t, const char *text, size_t len);

#ifdef __cplusplus
}
#endif

#endif
