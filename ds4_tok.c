/*
 * ds4_tok.c - the DeepSeek V3/V4 tokenizer (byte-level BPE), written to give exactly the ids
 * llama.cpp gives for the same GGUF vocabulary (tokenizer.ggml.model = "gpt2",
 * tokenizer.ggml.pre = "deepseek-v3" or "joyai-llm", which llama.cpp treats the same way).
 *
 * How text becomes ids
 * --------------------
 * 1. Special tokens. Every token whose type is control, user-defined or unknown is looked for
 *    in the raw bytes, longest text first (equal lengths: lower id first; llama.cpp leaves that
 *    order unspecified, which matters only if two equal-length special texts overlap). Each
 *    occurrence (leftmost, non-overlapping) is cut out as that token and the text on both
 *    sides is left for the next special token. With parse_special = 0 only user-defined tokens
 *    are cut out. This happens on bytes, before any UTF-8 decoding. The types are the GGUF's,
 *    corrected the way llama.cpp corrects them by text (llama_control_texts below: e.g. a
 *    "</s>" or "<｜fim▁hole｜>" typed normal or user-defined is treated as control).
 * 2. Decoding. Each remaining piece of text is decoded into code points the lenient way
 *    llama.cpp does it: a byte that does not start a well-formed sequence (by lead-bit pattern
 *    and continuation bytes only: overlong forms and surrogates are accepted) becomes U+FFFD
 *    and decoding resumes at the next byte. From then on the text *is* these code points: an
 *    invalid byte is tokenized as the three bytes EF BF BD of U+FFFD, not as itself.
 *    (A 4-byte form above U+10FFFF makes llama.cpp throw an uncaught exception; here its lead
 *    byte is treated as invalid instead.)
 * 3. Pre-tokenization: three regexes, each applied inside every piece the previous one left,
 *    and text between matches kept as pieces of its own:
 *      a. \p{N}{1,3}                    runs of digits cut into threes from the left
 *      b. [一-龥぀-ゟ゠-ヿ]+              runs of U+4E00..9FA5 and U+3040..30FF (CJK, kana)
 *      c. [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+ | [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
 *         | ?[\p{P}\p{S}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
 *    llama.cpp runs these with std::regex (ECMAScript: first alternative that matches wins,
 *    backtracking) on a "collapsed" copy of the text in which every non-ASCII code point is
 *    replaced by one byte standing for its class: White_Space -> \v (so \s matches it), else
 *    its general category N, L, P, M or S, else "other". ASCII stays itself, so \s there is
 *    only \t \n \v \f \r and space (the C locale). The matchers below are that regex written
 *    out by hand over the same classes; the classes come from ds4_unicode.h (Unicode 15.1, the
 *    version llama.cpp's tables follow).
 * 4. Byte-level BPE on each piece: its UTF-8 bytes are mapped to the GPT-2 byte alphabet
 *    (printable Latin-1 bytes stand for themselves, the other 68 bytes become U+0100..U+0143),
 *    one symbol per byte. Then, repeatedly, the adjacent pair with the lowest merge rank
 *    (rank = index in tokenizer.ggml.merges; ties: leftmost pair) is merged, until no adjacent
 *    pair has a rank. Each final symbol is its token; a symbol whose text is not a token
 *    (possible only when a merge produces a non-token) becomes, for each byte of its
 *    alphabet-encoded text, the token whose text is that one byte, if any (llama.cpp's rule).
 *
 * Pieces (ids -> bytes) undo step 4: each code point of a normal token's text is mapped back
 * to its byte; special tokens are their text. All pieces are computed once in ds4_tok_new.
 *
 * Tables: token text -> id and (left id, right id) -> (rank, merged id) are open-addressing
 * hash tables: building for 129280 tokens and 127741 merges takes about 70 ms (-O2).
 */
#include "ds4_msg.h"
#include "ds4_tok.h"
#include "ds4_unicode.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ds4_tok {
    int n;
    char *text;          /* all token texts back to back */
    size_t *toff;        /* n + 1 offsets into text */
    int32_t *type;       /* token types (DS4_TOKTYPE_*) */
    int32_t *th;         /* text hash: ids, -1 empty */
    uint32_t thmask;
    uint64_t *mkey;      /* merge hash: (left id + 1) << 32 | (right id + 1), 0 empty */
    int32_t *mrank;
    int32_t *mres;       /* id of the merged text, -1 if it is no token */
    uint32_t mmask;
    int32_t byte_tok[256];    /* token of the alphabet character of byte b */
    int32_t onebyte_tok[256]; /* token whose text is the single byte b */
    char *pieces;
    size_t *poff;        /* n + 1 offsets into pieces */
    int32_t *spec;       /* special tokens, longest text first */
    int nspec;
};

/* ---------------------------------------------------------------------------------------- */
/* small helpers                                                                             */

/* The splitmix64 finalizer: the merge table's hash, and the final mix of hash_bytes. */
static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;           /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char) s[i];
        h *= 1099511628211ull;
    }
    return hash_u64(h);
}

static uint32_t pow2_at_least(uint64_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* GPT-2 byte alphabet: byte -> code point, and back (code points 0..0x143). */
static void byte_alphabet(uint32_t b2cp[256], int16_t cp2b[0x144]) {
    int n = 0;
    for (int i = 0; i < 0x144; i++) cp2b[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
        b2cp[b] = keep ? (uint32_t) b : (uint32_t) (256 + n++);
        cp2b[b2cp[b]] = (int16_t) b;
    }
}

static int utf8_put(uint32_t cp, unsigned char *o) {
    if (cp < 0x80) { o[0] = (unsigned char) cp; return 1; }
    if (cp < 0x800) {
        o[0] = (unsigned char) (0xc0 | (cp >> 6));
        o[1] = (unsigned char) (0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char) (0xe0 | (cp >> 12));
        o[1] = (unsigned char) (0x80 | ((cp >> 6) & 0x3f));
        o[2] = (unsigned char) (0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (unsigned char) (0xf0 | (cp >> 18));
    o[1] = (unsigned char) (0x80 | ((cp >> 12) & 0x3f));
    o[2] = (unsigned char) (0x80 | ((cp >> 6) & 0x3f));
    o[3] = (unsigned char) (0x80 | (cp & 0x3f));
    return 4;
}

/* Lenient decoding (see the top comment): one code point from s[*o], U+FFFD + one byte on error. */
static uint32_t utf8_get(const unsigned char *s, size_t n, size_t *o) {
    size_t i = *o;
    unsigned b = s[i];
    uint32_t cp;
    size_t k;
    if (!(b & 0x80)) { *o = i + 1; return b; }
    if (!(b & 0x40)) goto bad;
    if (!(b & 0x20)) { k = 2; cp = b & 0x1f; }
    else if (!(b & 0x10)) { k = 3; cp = b & 0x0f; }
    else if (!(b & 0x08)) { k = 4; cp = b & 0x07; }
    else goto bad;
    if (i + k - 1 >= n) goto bad;
    for (size_t j = 1; j < k; j++) {
        if ((s[i + j] & 0xc0) != 0x80) goto bad;
        cp = (cp << 6) | (s[i + j] & 0x3f);
    }
    if (cp > 0x10ffff) goto bad;
    *o = i + k;
    return cp;
bad:
    *o = i + 1;
    return 0xfffd;
}

static int uc_class(uint32_t cp) {
    if (cp >= 0x110000) return DS4_UC_OTHER;
    int lo = 0, hi = DS4_UC_NRANGES - 1;
    while (lo < hi) {                         /* last range starting at or before cp */
        int mid = (lo + hi + 1) / 2;
        if ((ds4_uc_ranges[mid] >> 8) <= cp) lo = mid; else hi = mid - 1;
    }
    return (int) (ds4_uc_ranges[lo] & 0xff);
}

/* ---------------------------------------------------------------------------------------- */
/* lookup tables                                                                             */

int32_t ds4_tok_find_n(const ds4_tok *t, const char *s, size_t n) {
    if (!t || (!s && n)) return -1;
    uint32_t h = (uint32_t) hash_bytes(s, n) & t->thmask;
    for (;;) {
        int32_t id = t->th[h];
        if (id < 0) return -1;
        size_t len = t->toff[id + 1] - t->toff[id];
        if (len == n && memcmp(t->text + t->toff[id], s, n) == 0) return id;
        h = (h + 1) & t->thmask;
    }
}

int32_t ds4_tok_find(const ds4_tok *t, const char *text) {
    if (!text) return -1;
    return ds4_tok_find_n(t, text, strlen(text));
}

static int merge_find(const ds4_tok *t, int32_t l, int32_t r, int32_t *res) {
    uint64_t key = ((uint64_t) (uint32_t) (l + 1) << 32) | (uint32_t) (r + 1);
    uint32_t h = (uint32_t) hash_u64(key) & t->mmask;
    for (;;) {
        uint64_t k = t->mkey[h];
        if (k == 0) return -1;
        if (k == key) { *res = t->mres[h]; return t->mrank[h]; }
        h = (h + 1) & t->mmask;
    }
}

int ds4_tok_byte_symbol(int b, char out[3]) {
    uint32_t b2cp[256];
    int16_t cp2b[0x144];
    if (b < 0 || b > 255) return 0;
    byte_alphabet(b2cp, cp2b);
    unsigned char u[4];
    const int n = utf8_put(b2cp[b], u);   /* code points below 0x144: 1 or 2 bytes */
    memcpy(out, u, (size_t)n);
    out[n] = 0;
    return n;
}

int ds4_tok_n_tokens(const ds4_tok *t) { return t ? t->n : 0; }

void ds4_tok_free(ds4_tok *t) {
    if (!t) return;
    free(t->text); free(t->toff); free(t->type); free(t->th);
    free(t->mkey); free(t->mrank); free(t->mres);
    free(t->pieces); free(t->poff); free(t->spec);
    free(t);
}

static int is_special_type(int32_t ty) {
    return ty == DS4_TOKTYPE_CONTROL || ty == DS4_TOKTYPE_USER_DEFINED || ty == DS4_TOKTYPE_UNKNOWN;
}

/* Texts llama.cpp v0.4.0 turns into control tokens whatever their GGUF type (its EOG, EOT, EOM
 * and FIM detection by text in llama_vocab::impl::load). For the FIM texts llama.cpp overrides
 * only the first one of each family it meets (hash order) and only when the GGUF does not name
 * that FIM token; here all are overridden (the same whenever a vocabulary has at most one text
 * per family, as DeepSeek's has). */
static const char *const llama_control_texts[] = {
    /* end of generation */
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
    /* fill in the middle: prefix, suffix, middle, pad, repo, file separator */
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>",
    "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>",
    "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>",
    "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
};

/* llama.cpp's later per-model fixes of those types (gpt-oss, o200k "<|end|>", gemma4 "</s>"). */
static void llama_type_overrides(ds4_tok *t) {
    for (size_t i = 0; i < sizeof llama_control_texts / sizeof llama_control_texts[0]; i++) {
        int32_t id = ds4_tok_find(t, llama_control_texts[i]);
        if (id >= 0) t->type[id] = DS4_TOKTYPE_CONTROL;
    }
    static const char *const user[] = { "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>" };
    for (size_t i = 0; i < 4; i++) {
        int32_t id = ds4_tok_find(t, user[i]);
        if (id >= 0) t->type[id] = DS4_TOKTYPE_USER_DEFINED;
    }
    int has_call = ds4_tok_find(t, "<|call|>") >= 0 || ds4_tok_find(t, "<|calls|>") >= 0;
    int32_t end = ds4_tok_find(t, "<|end|>");
    if (end >= 0 && has_call && (ds4_tok_find(t, "<|return|>") >= 0 || ds4_tok_find(t, "<|flush|>") >= 0))
        t->type[end] = DS4_TOKTYPE_USER_DEFINED;
    int32_t s = ds4_tok_find(t, "</s>");
    if (s >= 0 && ds4_tok_find(t, "<|tool_response>") >= 0) t->type[s] = DS4_TOKTYPE_NORMAL;
}

typedef struct { size_t len; int32_t id; } spec_key;

static int spec_cmp(const void *a, const void *b) {     /* longest first, then lowest id */
    const spec_key *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* Piece of a normal token: code points of its text mapped back to bytes. A code point outside
 * the alphabet gives "[UNK_BYTE_0x<its utf-8 in hex><token text>]" as llama.cpp writes it. */
static size_t normal_piece(const char *s, size_t n, const int16_t cp2b[0x144], char *out) {
    size_t o = 0, i = 0;
    while (i < n) {
        uint32_t cp = utf8_get((const unsigned char *) s, n, &i);
        if (cp < 0x144 && cp2b[cp] >= 0) {
            if (out) out[o] = (char) cp2b[cp];
            o++;
        } else {
            unsigned char u[4];
            int k = utf8_put(cp, u);
            char tmp[32];
            int m = snprintf(tmp, sizeof tmp, "[UNK_BYTE_0x");
            for (int j = 0; j < k; j++) m += snprintf(tmp + m, sizeof tmp - (size_t) m, "%02x", u[j]);
            if (out) memcpy(out + o, tmp, (size_t) m);
            o += (size_t) m;
            if (out) memcpy(out + o, s, n);
            o += n;
            if (out) out[o] = ']';
            o++;
        }
    }
    return o;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

ds4_tok *ds4_tok_new(int n_tokens, const char *const *tokens, const uint32_t *token_lens,
                     const int32_t *token_types, int n_merges, const char *const *merges,
                     const uint32_t *merge_lens, const char *pre, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!pre || (strcmp(pre, "deepseek-v3") != 0 && strcmp(pre, "joyai-llm") != 0)) {
        ds4_errf(err, errlen, "unsupported tokenizer pre-tokenizer '%s' (only deepseek-v3, joyai-llm)",
                pre ? pre : "(none)");
        return NULL;
    }
    if (n_tokens <= 0 || !tokens || !token_lens || n_merges < 0 || (n_merges > 0 && (!merges || !merge_lens))) {
        ds4_errf(err, errlen, "tokenizer: bad arguments (n_tokens %d, n_merges %d)", n_tokens, n_merges);
        return NULL;
    }
    ds4_tok *t = calloc(1, sizeof *t);
    if (!t) goto oom;
    t->n = n_tokens;

    /* token texts (an empty text becomes "[EMPTY_<id>]", as in llama.cpp) */
    size_t total = 0;
    for (int i = 0; i < n_tokens; i++) total += token_lens[i] ? token_lens[i] : 24;
    t->text = malloc(total + 1);
    t->toff = malloc(sizeof(size_t) * ((size_t) n_tokens + 1));
    t->type = malloc(sizeof(int32_t) * (size_t) n_tokens);
    if (!t->text || !t->toff || !t->type) goto oom;
    size_t off = 0;
    for (int i = 0; i < n_tokens; i++) {
        t->toff[i] = off;
        if (token_lens[i]) {
            if (!tokens[i]) { ds4_errf(err, errlen, "tokenizer: token %d has no text", i); goto fail; }
            memcpy(t->text + off, tokens[i], token_lens[i]);
            off += token_lens[i];
        } else {
            off += (size_t) sprintf(t->text + off, "[EMPTY_%d]", i);
        }
        t->type[i] = token_types ? token_types[i] : DS4_TOKTYPE_NORMAL;
    }
    t->toff[n_tokens] = off;

    /* text -> id; for a duplicated text the last id wins */
    uint32_t cap = pow2_at_least((uint64_t) n_tokens * 2);
    t->thmask = cap - 1;
    t->th = malloc(sizeof(int32_t) * cap);
    if (!t->th) goto oom;
    memset(t->th, 0xff, sizeof(int32_t) * cap);
    for (int i = 0; i < n_tokens; i++) {
        const char *s = t->text + t->toff[i];
        size_t n = t->toff[i + 1] - t->toff[i];
        uint32_t h = (uint32_t) hash_bytes(s, n) & t->thmask;
        for (;;) {
            int32_t id = t->th[h];
            if (id < 0) { t->th[h] = i; break; }
            if (t->toff[id + 1] - t->toff[id] == n && memcmp(t->text + t->toff[id], s, n) == 0) {
                t->th[h] = i;
                break;
            }
            h = (h + 1) & t->thmask;
        }
    }

    llama_type_overrides(t);

    /* byte alphabet */
    uint32_t b2cp[256];
    int16_t cp2b[0x144];
    byte_alphabet(b2cp, cp2b);
    for (int b = 0; b < 256; b++) {
        unsigned char u[4];
        int k = utf8_put(b2cp[b], u);
        t->byte_tok[b] = ds4_tok_find_n(t, (const char *) u, (size_t) k);
        char c = (char) b;
        t->onebyte_tok[b] = ds4_tok_find_n(t, &c, 1);
    }

    /* merges: (left id, right id) -> (rank, merged id); the first occurrence of a pair wins */
    cap = pow2_at_least((uint64_t) (n_merges > 0 ? n_merges : 1) * 2);
    t->mmask = cap - 1;
    t->mkey = calloc(cap, sizeof(uint64_t));
    t->mrank = malloc(sizeof(int32_t) * cap);
    t->mres = malloc(sizeof(int32_t) * cap);
    if (!t->mkey || !t->mrank || !t->mres) goto oom;
    char *cat = NULL;
    size_t catcap = 0;
    for (int i = 0; i < n_merges; i++) {
        const char *m = merges[i];
        size_t n = merge_lens[i], sp = 0, nsp = 0;
        for (size_t j = 0; m && j < n; j++) if (m[j] == ' ') { nsp++; if (!sp) sp = j; }
        if (!m || nsp != 1 || sp == 0 || sp + 1 >= n) {
            ds4_errf(err, errlen, "tokenizer: merge %d '%.*s' is not two parts separated by one space",
                    i, (int) (n > 80 ? 80 : n), m ? m : "");
            free(cat);
            goto fail;
        }
        int32_t l = ds4_tok_find_n(t, m, sp), r = ds4_tok_find_n(t, m + sp + 1, n - sp - 1);
        if (l < 0 || r < 0) {
            ds4_errf(err, errlen, "tokenizer: merge %d '%.*s': %s part is not a token", i,
                    (int) (n > 80 ? 80 : n), m, l < 0 ? "left" : "right");
            free(cat);
            goto fail;
        }
        if (n - 1 > catcap) {
            catcap = 2 * (n - 1);
            char *nc = realloc(cat, catcap);
            if (!nc) { free(cat); goto oom; }
            cat = nc;
        }
        memcpy(cat, m, sp);
        memcpy(cat + sp, m + sp + 1, n - sp - 1);
        uint64_t key = ((uint64_t) (uint32_t) (l + 1) << 32) | (uint32_t) (r + 1);
        uint32_t h = (uint32_t) hash_u64(key) & t->mmask;
        for (;;) {
            if (t->mkey[h] == key) break;                  /* duplicate pair: keep the first */
            if (t->mkey[h] == 0) {
                t->mkey[h] = key;
                t->mrank[h] = i;
                t->mres[h] = ds4_tok_find_n(t, cat, n - 1);
                break;
            }
            h = (h + 1) & t->mmask;
        }
    }
    free(cat);

    /* pieces */
    size_t ptotal = 0;
    for (int i = 0; i < n_tokens; i++) {
        size_t n = t->toff[i + 1] - t->toff[i];
        int32_t ty = t->type[i];
        if (is_special_type(ty) || ty == DS4_TOKTYPE_BYTE) ptotal += n;
        else if (ty == DS4_TOKTYPE_NORMAL) ptotal += normal_piece(t->text + t->toff[i], n, cp2b, NULL);
    }
    t->pieces = malloc(ptotal + 1);
    t->poff = malloc(sizeof(size_t) * ((size_t) n_tokens + 1));
    if (!t->pieces || !t->poff) goto oom;
    off = 0;
    for (int i = 0; i < n_tokens; i++) {
        const char *s = t->text + t->toff[i];
        size_t n = t->toff[i + 1] - t->toff[i];
        int32_t ty = t->type[i];
        t->poff[i] = off;
        if (is_special_type(ty)) {
            memcpy(t->pieces + off, s, n);
            off += n;
        } else if (ty == DS4_TOKTYPE_NORMAL) {
            off += normal_piece(s, n, cp2b, t->pieces + off);
        } else if (ty == DS4_TOKTYPE_BYTE) {
            /* "<0xXX>": the byte (llama.cpp parses text[3..4] as hex) */
            int v = 0;
            for (size_t j = 3; j < 5 && j < n && hexval((unsigned char) s[j]) >= 0; j++)
                v = v * 16 + hexval((unsigned char) s[j]);
            t->pieces[off++] = (char) v;
        }
    }
    t->poff[n_tokens] = off;

    /* special tokens, longest first */
    t->spec = malloc(sizeof(int32_t) * (size_t) n_tokens);
    spec_key *keys = malloc(sizeof(spec_key) * (size_t) n_tokens);
    if (!t->spec || !keys) { free(keys); goto oom; }
    for (int i = 0; i < n_tokens; i++)
        if (is_special_type(t->type[i])) {
            keys[t->nspec].len = t->toff[i + 1] - t->toff[i];
            keys[t->nspec++].id = i;
        }
    qsort(keys, (size_t) t->nspec, sizeof(spec_key), spec_cmp);
    for (int i = 0; i < t->nspec; i++) t->spec[i] = keys[i].id;
    free(keys);
    return t;

oom:
    ds4_errf(err, errlen, "tokenizer: out of memory");
fail:
    ds4_tok_free(t);
    return NULL;
}

int ds4_tok_piece(const ds4_tok *t, int32_t id, char *buf, int cap) {
    if (!t || id < 0 || id >= t->n) return INT32_MIN;
    size_t n = t->poff[id + 1] - t->poff[id];
    if ((size_t) (cap < 0 ? 0 : cap) < n) return -(int) n;
    if (n) memcpy(buf, t->pieces + t->poff[id], n);
    return (int) n;
}

/* ---------------------------------------------------------------------------------------- */
/* encoding                                                                                  */

typedef struct {
    int32_t *v;
    size_t n, cap;
    int oom;
} ivec;

static void ivec_push(ivec *a, int32_t x) {
    if (a->oom) return;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 64;
        int32_t *nv = realloc(a->v, nc * sizeof(int32_t));
        if (!nv) { a->oom = 1; return; }
        a->v = nv;
        a->cap = nc;
    }
    a->v[a->n++] = x;
}

/* Collapsed classes (see the top comment): ASCII is itself, other code points one of these. */
enum { C_WS = 0x0b, C_OTHER = 0xd0, C_N = 0xd1, C_L = 0xd2, C_P = 0xd3, C_M = 0xd4, C_S = 0xd5 };

static uint8_t collapse(uint32_t cp) {
    if (cp < 0x80) return (uint8_t) cp;
    switch (uc_class(cp)) {
        case DS4_UC_WS: return C_WS;
        case DS4_UC_N:  return C_N;
        case DS4_UC_L:  return C_L;
        case DS4_UC_P:  return C_P;
        case DS4_UC_M:  return C_M;
        case DS4_UC_S:  return C_S;
        default:        return C_OTHER;
    }
}

static int is_alpha(uint8_t c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); }
static int is_digitN(uint8_t c) { return (c >= '0' && c <= '9') || c == C_N; }
static int is_ascii_ps(uint8_t c) { return c >= 0x21 && c <= 0x7e && !is_alpha(c) && !(c >= '0' && c <= '9'); }
static int is_L(uint8_t c) { return is_alpha(c) || c == C_L; }
static int is_PS(uint8_t c) { return is_ascii_ps(c) || c == C_P || c == C_S; }
static int is_LM(uint8_t c) { return is_L(c) || c == C_M; }
static int is_ws(uint8_t c) { return (c >= 0x09 && c <= 0x0d) || c == ' '; }
static int is_crlf(uint8_t c) { return c == '\r' || c == '\n'; }
static int is_cjk(uint32_t cp) { return (cp >= 0x4e00 && cp <= 0x9fa5) || (cp >= 0x3040 && cp <= 0x30ff); }

/* The third regex at position i of [.., e): end of the match, or 0 for no match here. */
static size_t match_word(const uint8_t *c, size_t i, size_t e) {
    uint8_t c0 = c[i];
    size_t j;
    /* [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+ */
    if (is_ascii_ps(c0) && i + 1 < e && is_alpha(c[i + 1])) {
        for (j = i + 1; j < e && is_alpha(c[j]); j++) {}
        return j;
    }
    /* [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+ */
    if (!is_crlf(c0) && !is_L(c0) && !is_PS(c0) && i + 1 < e && is_LM(c[i + 1])) {
        for (j = i + 1; j < e && is_LM(c[j]); j++) {}
        return j;
    }
    if (is_LM(c0)) {
        for (j = i; j < e && is_LM(c[j]); j++) {}
        return j;
    }
    /*  ?[\p{P}\p{S}]+[\r\n]* */
    j = i + (c0 == ' ');
    if (j < e && is_PS(c[j])) {
        while (j < e && is_PS(c[j])) j++;
        while (j < e && is_crlf(c[j])) j++;
        return j;
    }
    if (!is_ws(c0)) return 0;
    size_t m = i, last = (size_t) -1;
    for (; m < e && is_ws(c[m]); m++) if (is_crlf(c[m])) last = m;
    /* \s*[\r\n]+ : \s* backs off to the last \r or \n of the run */
    if (last != (size_t) -1) return last + 1;
    /* \s+(?!\S) : the whole run at the end, else all but its last character */
    if (m == e) return m;
    if (m - i >= 2) return m - 1;
    /* \s+ */
    return m;
}

typedef struct {
    int32_t id;          /* token of the symbol's text, -1 if none */
    uint32_t start, len; /* bytes of the word */
    int32_t prev, next;
} sym_t;

typedef struct {
    int32_t rank, left, right, lid, rid;
} cand_t;

static int cand_before(const cand_t *a, const cand_t *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(cand_t *h, size_t *n, cand_t x) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_before(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static cand_t heap_pop(cand_t *h, size_t *n) {
    cand_t top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, b = i;
        const cand_t *best = &x;
        if (l < *n && cand_before(&h[l], best)) { b = l; best = &h[l]; }
        if (r < *n && cand_before(&h[r], best)) { b = r; best = &h[r]; }
        if (b == i) break;
        h[i] = h[b];
        i = b;
    }
    if (*n) h[i] = x;
    return top;
}

static void try_pair(const ds4_tok *t, const sym_t *s, int32_t l, int32_t r, cand_t *h, size_t *nh) {
    if (l < 0 || r < 0 || s[l].id < 0 || s[r].id < 0) return;
    int32_t res;
    int rank = merge_find(t, s[l].id, s[r].id, &res);
    if (rank < 0) return;
    cand_t c = { rank, l, r, s[l].id, s[r].id };
    heap_push(h, nh, c);
}

/* BPE over the bytes of one word (scratch: sym and heap sized for n). */
static void bpe_word(const ds4_tok *t, const unsigned char *w, size_t n, sym_t *s, cand_t *h, ivec *out) {
    size_t nh = 0;
    for (size_t k = 0; k < n; k++) {
        s[k].id = t->byte_tok[w[k]];
        s[k].start = (uint32_t) k;
        s[k].len = 1;
        s[k].prev = (int32_t) k - 1;
        s[k].next = k + 1 < n ? (int32_t) k + 1 : -1;
    }
    for (size_t k = 1; k < n; k++) try_pair(t, s, (int32_t) k - 1, (int32_t) k, h, &nh);
    while (nh) {
        cand_t c = heap_pop(h, &nh);
        sym_t *L = &s[c.left], *R = &s[c.right];
        if (L->len == 0 || R->len == 0 || L->next != c.right || L->id != c.lid || R->id != c.rid) continue;
        int32_t res = -1;
        merge_find(t, L->id, R->id, &res);
        L->id = res;
        L->len += R->len;
        R->len = 0;
        L->next = R->next;
        if (R->next >= 0) s[R->next].prev = c.left;
        try_pair(t, s, L->prev, c.left, h, &nh);
        try_pair(t, s, c.left, L->next, h, &nh);
    }
    for (int32_t k = 0; k >= 0 && (size_t) k < n; k = s[k].next) {
        if (s[k].id >= 0) { ivec_push(out, s[k].id); continue; }
        /* not a token: the single bytes of its alphabet text that are tokens */
        for (uint32_t j = 0; j < s[k].len; j++) {
            unsigned char b = w[s[k].start + j];
            uint32_t cp = b;
            unsigned char u[4];
            if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae)) {
                int m = 0;
                for (int x = 0; x < b; x++)
                    if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || x >= 0xae)) m++;
                cp = 256 + (uint32_t) m;
            }
            int k2 = utf8_put(cp, u);
            for (int q = 0; q < k2; q++)
                if (t->onebyte_tok[u[q]] >= 0) ivec_push(out, t->onebyte_tok[u[q]]);
        }
    }
}

/* Split every chunk (lengths in code points) with one of the three pre-tokenizer passes. */
static int split_pass(int pass, const uint32_t *cp, const uint8_t *cl, const ivec *in, ivec *out) {
    size_t start = 0;
    out->n = 0;
    for (size_t q = 0; q < in->n; q++) {
        size_t s = start, e = start + (size_t) in->v[q], i = s, gap = s;
        start = e;
        while (i < e) {
            size_t m = 0;
            if (pass == 0) {
                if (is_digitN(cl[i])) {
                    m = i + 1;
                    while (m < e && m < i + 3 && is_digitN(cl[m])) m++;
                }
            } else if (pass == 1) {
                if (is_cjk(cp[i])) {
                    m = i + 1;
                    while (m < e && is_cjk(cp[m])) m++;
                }
            } else {
                m = match_word(cl, i, e);
            }
            if (!m) { i++; continue; }
            if (i > gap) ivec_push(out, (int32_t) (i - gap));
            ivec_push(out, (int32_t) (m - i));
            i = gap = m;
        }
        if (e > gap) ivec_push(out, (int32_t) (e - gap));
    }
    return out->oom ? -1 : 0;
}

/* Tokenize one fragment of raw text (no special tokens in it). */
static int encode_text(const ds4_tok *t, const unsigned char *s, size_t n, ivec *out) {
    if (n == 0) return 0;
    int rc = -1;
    uint32_t *cp = malloc(sizeof(uint32_t) * n);
    uint8_t *cl = malloc(n);
    unsigned char *w = malloc(4 * n);
    sym_t *sy = malloc(sizeof(sym_t) * 4 * n);
    cand_t *h = malloc(sizeof(cand_t) * 12 * n + sizeof(cand_t));
    ivec a = {0}, b = {0};
    if (!cp || !cl || !w || !sy || !h) goto done;
    size_t ncp = 0;
    for (size_t o = 0; o < n;) {
        cp[ncp] = utf8_get(s, n, &o);
        cl[ncp] = collapse(cp[ncp]);
        ncp++;
    }
    ivec_push(&a, (int32_t) ncp);
    if (split_pass(0, cp, cl, &a, &b) || split_pass(1, cp, cl, &b, &a) || split_pass(2, cp, cl, &a, &b))
        goto done;
    size_t start = 0;
    for (size_t q = 0; q < b.n; q++) {
        size_t wl = 0;
        for (size_t k = start; k < start + (size_t) b.v[q]; k++) wl += (size_t) utf8_put(cp[k], w + wl);
        start += (size_t) b.v[q];
        bpe_word(t, w, wl, sy, h, out);
    }
    rc = out->oom ? -1 : 0;
done:
    free(cp); free(cl); free(w); free(sy); free(h); free(a.v); free(b.v);
    return rc;
}

typedef struct {
    size_t off, len;     /* raw text bytes, or */
    int32_t id;          /* a special token (>= 0); -1 for raw text */
} frag_t;

int ds4_tok_encode(const ds4_tok *t, const char *text, size_t len, int parse_special,
                   int32_t *out, int cap) {
    if (!t || (!text && len)) return -1;
    ivec res = {0};
    int rc = -1;
    size_t nf = 0, fcap = 16;
    frag_t *f = malloc(sizeof(frag_t) * fcap), *g = NULL;
    if (!f) return -1;
    if (len) f[nf++] = (frag_t) { 0, len, -1 };

    for (int si = 0; si < t->nspec && nf; si++) {
        int32_t id = t->spec[si];
        int32_t ty = t->type[id];
        if (!parse_special && ty != DS4_TOKTYPE_USER_DEFINED) continue;
        const char *tx = t->text + t->toff[id];
        size_t tl = t->toff[id + 1] - t->toff[id];
        /* quick reject: is it anywhere in a raw fragment? */
        int any = 0;
        for (size_t q = 0; q < nf && !any; q++) {
            if (f[q].id >= 0 || f[q].len < tl) continue;
            const char *p = text + f[q].off, *end = p + f[q].len - tl;
            while (p <= end) {
                const char *hit = memchr(p, tx[0], (size_t) (end - p) + 1);
                if (!hit) break;
                if (memcmp(hit, tx, tl) == 0) { any = 1; break; }
                p = hit + 1;
            }
        }
        if (!any) continue;
        size_t gcap = nf * 2 + 16, ng = 0;
        g = malloc(sizeof(frag_t) * gcap);
        if (!g) goto done;
        for (size_t q = 0; q < nf; q++) {
            if (f[q].id >= 0 || f[q].len < tl) {
                if (ng == gcap) { gcap *= 2; frag_t *x = realloc(g, sizeof(frag_t) * gcap); if (!x) goto done; g = x; }
                g[ng++] = f[q];
                continue;
            }
            size_t pos = f[q].off, end = f[q].off + f[q].len;
            while (pos < end) {
                size_t hit = end;
                for (size_t k = pos; k + tl <= end; k++) {
                    const char *p = memchr(text + k, tx[0], end - tl + 1 - k);
                    if (!p) break;
                    k = (size_t) (p - text);
                    if (memcmp(p, tx, tl) == 0) { hit = k; break; }
                }
                if (ng + 2 >= gcap) { gcap *= 2; frag_t *x = realloc(g, sizeof(frag_t) * gcap); if (!x) goto done; g = x; }
                if (hit == end) { g[ng++] = (frag_t) { pos, end - pos, -1 }; break; }
                if (hit > pos) g[ng++] = (frag_t) { pos, hit - pos, -1 };
                g[ng++] = (frag_t) { 0, 0, id };
                pos = hit + tl;
            }
        }
        free(f);
        f = g;
        g = NULL;
        nf = ng;
    }

    for (size_t q = 0; q < nf; q++) {
        if (f[q].id >= 0) ivec_push(&res, f[q].id);
        else if (encode_text(t, (const unsigned char *) text + f[q].off, f[q].len, &res)) goto done;
    }
    if (res.oom || res.n > (size_t) INT_MAX) goto done;
    for (size_t i = 0; i < res.n && (int) i < cap; i++) out[i] = res.v[i];
    rc = (int) res.n;
done:
    free(f); free(g); free(res.v);
    return rc;
}
