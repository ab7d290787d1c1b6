/* ds4_synth.c -- writing deepseek4 GGUF files: the writer and the synthetic models.
 *
 * Tooling, not the engine: ds4.c reads models, this file makes them.  The
 * tests, the benchmarks and the embedded default model run on synthetic
 * models -- random weights with the exact deepseek4 layout -- so that nothing
 * needs a download.
 *
 *   Writer            a "plan" (keys + tensor directory) laid out and serialised
 *                     to GGUF v3; the tensor list comes from ds4_gguf.h's table,
 *                     the same one the reader validates against
 *   Synthetic models  named configurations (tiny, small, slim, flash16 and the
 *                     published files' layouts), a byte-level BPE vocabulary
 *                     learned from a built-in text (integer-only training), the
 *                     weight statistics, and the fill: a counter-based integer
 *                     PRNG over the data in parallel, so the same (config, seed,
 *                     type) gives the same bytes on every machine and with any
 *                     thread count (no libm in the generator)
 *
 * Entry points: ds4_synth_config_ok, ds4_synth_size, ds4_synth_fill (ds4_gguf.h).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "ds4_gguf.h"
#include "ds4_quant.h"
#include "ds4_tok.h"

/* ======================================================================
 * Writer: a "plan" (keys + tensor directory) serialised to GGUF.
 * ====================================================================== */

#define GGUF_PLAN_MAX_KV 64

typedef struct {
    char        key[96];
    uint32_t    type;        /* GGUF_T_* */
    uint64_t    u;           /* integer / bool value (two's complement for signed) */
    double      f;           /* f32 / f64 value */
    const char *s;           /* string value (not owned) */
    uint32_t    arr_type;    /* arrays of fixed-size elements, host layout */
    uint64_t    arr_n;
    const void *arr;
} gguf_wkv;

typedef struct {
    char     name[96];
    uint32_t n_dims;
    int64_t  ne[4];
    uint32_t type;
    uint8_t  fill;           /* SF_* */
    float    mean, std;
    int32_t  tid_e;          /* SF_TID2EID: number of experts */
    uint64_t offset;         /* relative to the data section (set by gguf_plan_layout) */
    uint64_t nbytes;
    int      seed_ti;        /* whose PRNG streams fill it: its index in the whole model's plan */
} gguf_wtensor;

typedef struct {
    ds4_hparams   hp;
    char          model_name[64];
    uint32_t      ratios[DS4_MAX_LAYERS];
    gguf_wkv      kv[GGUF_PLAN_MAX_KV];
    int           n_kv;
    gguf_wtensor *t;
    int           n_t, cap_t;
    uint32_t      alignment;
    uint64_t      header_bytes, data_start, total;
    void         *vocab;        /* synth_vocab's strings and arrays (owned), NULL without a vocabulary */
} gguf_plan;

typedef struct { uint8_t *buf; size_t cap; size_t pos; } gguf_wout;   /* buf NULL: measure only */

static void gguf_w_bytes(gguf_wout *o, const void *p, size_t n) {
    if (o->buf && n <= o->cap && o->pos <= o->cap - n) memcpy(o->buf + o->pos, p, n);
    o->pos += n;
}
static void gguf_w_le(gguf_wout *o, uint64_t v, int n) {
    uint8_t b[8];
    for (int i = 0; i < n; i++) b[i] = (uint8_t)(v >> (8 * i));
    gguf_w_bytes(o, b, (size_t)n);
}
static void gguf_w_u32(gguf_wout *o, uint32_t v) { gguf_w_le(o, v, 4); }
static void gguf_w_u64(gguf_wout *o, uint64_t v) { gguf_w_le(o, v, 8); }
static void gguf_w_f32(gguf_wout *o, float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    gguf_w_le(o, b, 4);
}
static void gguf_w_str(gguf_wout *o, const char *s) {
    size_t n = s ? strlen(s) : 0;
    gguf_w_u64(o, n);
    gguf_w_bytes(o, s, n);
}

static void gguf_w_kv(gguf_wout *o, const gguf_wkv *kv) {
    gguf_w_str(o, kv->key);
    gguf_w_u32(o, kv->type);
    switch (kv->type) {
    case GGUF_T_F32: gguf_w_f32(o, (float)kv->f); break;
    case GGUF_T_F64: { uint64_t b; memcpy(&b, &kv->f, 8); gguf_w_u64(o, b); break; }
    case GGUF_T_STRING: gguf_w_str(o, kv->s); break;
    case GGUF_T_ARRAY: {
        gguf_w_u32(o, kv->arr_type);
        gguf_w_u64(o, kv->arr_n);
        if (kv->arr_type == GGUF_T_STRING) {      /* arr: const char *const [arr_n] */
            for (uint64_t i = 0; kv->arr && i < kv->arr_n; i++) gguf_w_str(o, ((const char *const *)kv->arr)[i]);
            break;
        }
        size_t es = kv->arr_type < GGUF_T_COUNT ? gguf_type_size[kv->arr_type] : 0;
        const uint8_t *p = kv->arr;
        for (uint64_t i = 0; p && es && i < kv->arr_n; i++) {
            uint64_t v = 0;
            if (es == 1) v = p[i];
            else if (es == 2) { uint16_t x; memcpy(&x, p + i * 2, 2); v = x; }
            else if (es == 4) { uint32_t x; memcpy(&x, p + i * 4, 4); v = x; }
            else { memcpy(&v, p + i * 8, 8); }
            gguf_w_le(o, v, (int)es);
        }
        break;
    }
    default:
        if (kv->type < GGUF_T_COUNT) gguf_w_le(o, kv->u, gguf_type_size[kv->type]);
        break;
    }
}

/* Header, metadata and tensor directory (not the alignment padding). */
static void gguf_plan_write_meta(const gguf_plan *p, gguf_wout *o) {
    gguf_w_bytes(o, "GGUF", 4);
    gguf_w_u32(o, GGUF_VERSION);
    gguf_w_u64(o, (uint64_t)p->n_t);
    gguf_w_u64(o, (uint64_t)p->n_kv);
    for (int i = 0; i < p->n_kv; i++) gguf_w_kv(o, &p->kv[i]);
    for (int i = 0; i < p->n_t; i++) {
        const gguf_wtensor *t = &p->t[i];
        gguf_w_str(o, t->name);
        gguf_w_u32(o, t->n_dims);
        for (uint32_t j = 0; j < t->n_dims && j < 4; j++) gguf_w_u64(o, (uint64_t)t->ne[j]);
        gguf_w_u32(o, t->type);
        gguf_w_u64(o, t->offset);
    }
}

static uint64_t gguf_align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Assigns tensor offsets in order; returns the total image size (0 on overflow). */
static uint64_t gguf_plan_layout(gguf_plan *p) {
    gguf_wout o = {NULL, 0, 0};
    uint64_t a = p->alignment ? p->alignment : GGUF_DEFAULT_ALIGNMENT;
    gguf_plan_write_meta(p, &o);
    p->header_bytes = o.pos;
    p->data_start = gguf_align_up(o.pos, a);
    uint64_t off = 0;
    for (int i = 0; i < p->n_t; i++) {
        gguf_wtensor *t = &p->t[i];
        uint64_t nel = 1;
        for (uint32_t j = 0; j < t->n_dims && j < 4; j++) {
            if (t->ne[j] < 1 || (uint64_t)t->ne[j] > (uint64_t)INT64_MAX / nel) return p->total = 0;
            nel *= (uint64_t)t->ne[j];
        }
        t->nbytes = gguf_tensor_bytes(t->type, nel);
        off = gguf_align_up(off, a);
        t->offset = off;
        if (t->nbytes > (uint64_t)1 << 56) return p->total = 0;
        off += t->nbytes;
    }
    p->total = p->data_start + gguf_align_up(off, a);
    return p->total;
}

static void gguf_plan_free(gguf_plan *p) {
    free(p->t);
    p->t = NULL;
    p->n_t = p->cap_t = 0;
    free(p->vocab);
    p->vocab = NULL;
}

static gguf_wkv *gguf_plan_kv(gguf_plan *p, const char *key, uint32_t type) {
    if (p->n_kv >= GGUF_PLAN_MAX_KV) return NULL;
    gguf_wkv *kv = &p->kv[p->n_kv++];
    memset(kv, 0, sizeof *kv);
    snprintf(kv->key, sizeof kv->key, "%s", key);
    kv->type = type;
    return kv;
}
static void gguf_plan_kv_u32(gguf_plan *p, const char *key, uint32_t v) {
    gguf_wkv *kv = gguf_plan_kv(p, key, GGUF_T_U32);
    if (kv) kv->u = v;
}
static void gguf_plan_kv_f32(gguf_plan *p, const char *key, float v) {
    gguf_wkv *kv = gguf_plan_kv(p, key, GGUF_T_F32);
    if (kv) kv->f = v;
}
static void gguf_plan_kv_bool(gguf_plan *p, const char *key, int v) {
    gguf_wkv *kv = gguf_plan_kv(p, key, GGUF_T_BOOL);
    if (kv) kv->u = v != 0;
}
static void gguf_plan_kv_str(gguf_plan *p, const char *key, const char *s) {
    gguf_wkv *kv = gguf_plan_kv(p, key, GGUF_T_STRING);
    if (kv) kv->s = s;
}
static void gguf_plan_kv_arr(gguf_plan *p, const char *key, uint32_t arr_type, uint64_t n, const void *data) {
    gguf_wkv *kv = gguf_plan_kv(p, key, GGUF_T_ARRAY);
    if (kv) {
        kv->arr_type = arr_type;
        kv->arr_n = n;
        kv->arr = data;
    }
}

static gguf_wtensor *gguf_plan_tensor(gguf_plan *p, const char *name, int n_dims, const int64_t ne[4], uint32_t type) {
    if (p->n_t == p->cap_t) {
        int nc = p->cap_t ? p->cap_t * 2 : 256;
        gguf_wtensor *nt = realloc(p->t, (size_t)nc * sizeof *nt);
        if (!nt) return NULL;
        p->t = nt;
        p->cap_t = nc;
    }
    gguf_wtensor *t = &p->t[p->n_t++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = (uint32_t)n_dims;
    for (int j = 0; j < 4; j++) t->ne[j] = ne[j];
    t->type = type;
    return t;
}

/* ======================================================================
 * Synthetic models.
 * ====================================================================== */

typedef struct {
    const char *name;
    int n_vocab, n_embd, n_layer, n_hash, n_head, head_dim, n_rot, q_lora, o_groups, o_lora, n_swa;
    int idx_heads, idx_dim, idx_topk, n_expert, n_used, n_shared, n_ff, n_ctx;
    float yarn_factor;
    int yarn_orig;
    int layout;    /* 0: every matrix of the --type; 2, 4: the published Flash files' per-tensor
                    * types with IQ2_XXS/Q2_K (2) or Q4_K (4) routed experts (synth_layout_type) */
    int vocab;     /* "+vocab": a byte-level BPE vocabulary (synth_vocab) instead of no_vocab */
    int mtp;       /* "+mtp" (1): an MTP block after the layers (block n_layer, llama.cpp's names);
                    * "+mtpfile" (2): that block alone, as `ds4 --mtp FILE` reads it (the keys of
                    * the model with the block, its tensors only, the same bytes as there) */
} synth_config;

/* compress_ratios of every config: 0, 0, then 4, 128, 4, 128, ...; an MTP block's is 0 (a
 * window-attention layer: the only kind llama.cpp's MTP graph computes) */
static const synth_config synth_configs[] = {
    /* name      vocab   D    L  hash H   d    rot  q    g  r     swa  Hi  di   topk E   k  S  f     ctx    yarn  orig layout vocab mtp */
    {"tiny",     512,    128, 6, 2,   8,  64,  16,  64,  2, 32,   32,  32, 64,  8,   8,  2, 1, 64,   4096,  4.0f, 256, 0, 0, 0},
    {"small",    1024,   256, 8, 3,   16, 128, 32,  128, 4, 64,   64,  32, 64,  16,  16, 4, 1, 128,  8192,  8.0f, 1024, 0, 0, 0},
    /* tiny narrowed for 1M-position checks: 4 layers (one ratio-4, one ratio-128), 2 heads and one
     * indexer head of 32, so the CPU backend's quadratic indexer and ratio-128 attention take minutes */
    {"slim",     512,    128, 4, 2,   2,  64,  16,  64,  2, 32,   32,  1,  32,  8,   8,  2, 1, 64,   4096,  4.0f, 256, 0, 0, 0},
    {"flash16",  129280, 4096, 43, 3, 64, 512, 64,  1024, 8, 1024, 128, 64, 128, 512, 16, 6, 1, 2048, 65536, 16.0f, 65536, 0, 0, 0},
    /* the real files' layouts; the small ones widen the experts to one 256-element super-block */
    {"small-q2", 1024,   256, 8, 3,   16, 128, 32,  128, 4, 64,   64,  32, 64,  16,  16, 4, 1, 256,  8192,  8.0f, 1024, 2, 0, 0},
    {"small-q4", 1024,   256, 8, 3,   16, 128, 32,  128, 4, 64,   64,  32, 64,  16,  16, 4, 1, 256,  8192,  8.0f, 1024, 4, 0, 0},
    {"flash-q2", 129280, 4096, 43, 3, 64, 512, 64,  1024, 8, 1024, 128, 64, 128, 512, 16, 6, 1, 2048, 65536, 16.0f, 65536, 2, 0, 0},
    {"flash-q4", 129280, 4096, 43, 3, 64, 512, 64,  1024, 8, 1024, 128, 64, 128, 512, 16, 6, 1, 2048, 65536, 16.0f, 65536, 4, 0, 0},
};

/* ---- a synthetic byte-level BPE vocabulary ----
 *
 * For "+vocab" configs (the embedded default model): BOS, EOS, the 256 byte
 * symbols of the GPT-2 byte alphabet, the V4 chat markers (<｜User｜>,
 * <｜Assistant｜>: control; <think>, </think>: user-defined), then the tokens
 * of BPE merges learned from synth_vocab_text until n_vocab tokens (the same
 * layout tests/oracle/add_vocab.py writes with gguf-py).  Training splits the
 * text at spaces (a space starts a word) and takes the most frequent adjacent
 * pair each round, ties to the lower ids: integers only, so every machine
 * writes the same bytes.  The model's weights are random: only the prompt and
 * the detokenized text are meaningful, which is what the vocabulary is for. */
static const char synth_vocab_text[] =
    "Once upon a time there was a little town by the sea. The people of the town went to the sea "
    "every morning, and every evening they came back with fish and stories. One day a girl found a "
    "small boat on the sand. She asked her mother if she could take it to the water, and her mother "
    "said that she could, if she came back before the sun went down. The girl took the boat and the "
    "sea was calm and the sky was blue. She saw birds and fish and a long line of white clouds. When "
    "the sun was low she turned the boat and went home, and she told everyone what she had seen. "
    "The model reads the text, the tokens and the numbers 0 1 2 3 4 5 6 7 8 9 10 100 2026. "
    "int main(void) { return 0; } for (int i = 0; i < n; i++) x[i] = y[i] + 1; "
    "Il était une fois une petite ville au bord de la mer. Es war einmal eine kleine Stadt am Meer. "
    "Érase una vez un pueblo junto al mar. 從前有一個海邊的小鎮。 むかしむかし、海のそばに小さな町がありました。";

#define SYNTH_VOCAB_BASE 262    /* BOS, EOS, 256 bytes, 4 chat markers */

static int synth_u64_cmp(const void *x, const void *y) {
    const uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

typedef struct {
    const char **tokens;   /* [n_vocab] NUL-terminated */
    int32_t     *types;    /* [n_vocab] */
    const char **merges;   /* [n_merges] "left right" */
    int          n_merges;
} synth_vocab_t;

/* Builds the vocabulary into one allocation (returned; the caller frees it). */
static void *synth_vocab(int n_vocab, synth_vocab_t *v) {
    const int n_text = (int)sizeof synth_vocab_text - 1;
    const int n_merge_max = n_vocab - SYNTH_VOCAB_BASE;
    if (n_merge_max < 0) return NULL;
    /* strings: every token is at most 2 bytes per text byte */
    const size_t str_cap = (size_t)n_vocab * 64 + (size_t)n_merge_max * 130 + 4096;
    const size_t bytes = sizeof(char *) * (size_t)(n_vocab + n_merge_max + 1) + sizeof(int32_t) * (size_t)n_vocab +
                         str_cap + sizeof(int) * (size_t)n_text * 2 + sizeof(int) * (size_t)n_vocab;
    uint8_t *mem = calloc(1, bytes);
    if (!mem) return NULL;
    v->tokens = (const char **)mem;
    v->merges = v->tokens + n_vocab;
    v->types = (int32_t *)(v->merges + n_merge_max + 1);
    char *str = (char *)(v->types + n_vocab), *sp = str;
    int *seq = (int *)(str + str_cap), *word = seq + n_text;   /* symbol ids; word start flags */
    int *tlen = word + n_text;                                   /* token byte lengths */
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)n_text);  /* adjacent pairs (a << 32 | b) */
    if (!keys) { free(mem); return NULL; }
    int nt = 0;
#define TOK(s_, t_) do { size_t l_ = strlen(s_); memcpy(sp, s_, l_ + 1); v->tokens[nt] = sp; tlen[nt] = (int)l_; \
                         v->types[nt++] = (t_); sp += l_ + 1; } while (0)
    TOK("<｜begin▁of▁sentence｜>", 3);
    TOK("<｜end▁of▁sentence｜>", 3);
    for (int b = 0; b < 256; b++) {
        char sym[3];
        ds4_tok_byte_symbol(b, sym);       /* ds4_tok.c: the one definition of the alphabet */
        TOK(sym, 1);
    }
    TOK("<｜User｜>", 3);
    TOK("<｜Assistant｜>", 3);
    TOK("<think>", 4);
    TOK("</think>", 4);
#undef TOK
    for (int i = 0; i < n_text; i++) {
        seq[i] = 2 + (uint8_t)synth_vocab_text[i];
        word[i] = i == 0 || synth_vocab_text[i] == ' ';
    }
    int len = n_text;
    v->n_merges = 0;
    while (nt < n_vocab) {
        /* the most frequent adjacent pair inside a word (ties: lower ids): sort
         * the pair keys, then the longest run of one key */
        int np = 0;
        for (int i = 0; i + 1 < len; i++)
            if (!word[i + 1]) keys[np++] = (uint64_t)seq[i] << 32 | (uint32_t)seq[i + 1];
        qsort(keys, (size_t)np, sizeof keys[0], synth_u64_cmp);
        int best_a = -1, best_b = -1, best_n = 0;
        for (int i = 0; i < np;) {
            int j = i;
            while (j < np && keys[j] == keys[i]) j++;
            if (j - i > best_n) { best_n = j - i; best_a = (int)(keys[i] >> 32); best_b = (int)(uint32_t)keys[i]; }
            i = j;
        }
        if (best_n < 2) break;
        /* the merged token and the merge "left right" */
        const int id = nt;
        v->tokens[id] = sp;
        memcpy(sp, v->tokens[best_a], (size_t)tlen[best_a]);
        memcpy(sp + tlen[best_a], v->tokens[best_b], (size_t)tlen[best_b] + 1);
        tlen[id] = tlen[best_a] + tlen[best_b];
        sp += tlen[id] + 1;
        v->types[id] = 1;
        nt++;
        v->merges[v->n_merges++] = sp;
        memcpy(sp, v->tokens[best_a], (size_t)tlen[best_a]);
        sp[tlen[best_a]] = ' ';
        memcpy(sp + tlen[best_a] + 1, v->tokens[best_b], (size_t)tlen[best_b] + 1);
        sp += tlen[best_a] + tlen[best_b] + 2;
        int o = 0;
        for (int i = 0; i < len; i++) {
            if (i + 1 < len && !word[i + 1] && seq[i] == best_a && seq[i + 1] == best_b) {
                word[o] = word[i];
                seq[o++] = id;
                i++;
            } else {
                word[o] = word[i];
                seq[o++] = seq[i];
            }
        }
        len = o;
    }
    free(keys);
    while (nt < n_vocab) {          /* a text too short for the size: unused filler tokens */
        v->tokens[nt] = sp;
        sp += snprintf(sp, 24, "<unused%d>", nt) + 1;
        v->types[nt++] = 5;
    }
    return mem;
}

/* The type a layout gives a tensor (the published Flash files, as upstream's
 * loader requires them): token_embd F16; output, the attention projections
 * and the shared expert Q8_0; the mHC fn projections, the compressors and
 * their ape, the indexer's q_b and proj and ffn_gate_inp F16; routed experts
 * IQ2_XXS gate/up + Q2_K down (layout 2) or Q4_K (layout 4); F32 and I32
 * tensors as always. */
static uint32_t synth_layout_type(const gguf_tspec *sp, int layout) {
    if (sp->cls == TC_I32) return DS4_TYPE_I32;
    if (sp->cls == TC_F32) return DS4_TYPE_F32;
    const gguf_tspec *G = gguf_global_specs, *Lw = gguf_layer_specs;
    if (sp == &Lw[LT_GATE_EXPS] || sp == &Lw[LT_UP_EXPS]) return layout == 2 ? DS4_TYPE_IQ2_XXS : DS4_TYPE_Q4_K;
    if (sp == &Lw[LT_DOWN_EXPS]) return layout == 2 ? DS4_TYPE_Q2_K : DS4_TYPE_Q4_K;
    if (sp == &G[GT_OUTPUT] || sp == &Lw[LT_Q_A] || sp == &Lw[LT_Q_B] || sp == &Lw[LT_KV] || sp == &Lw[LT_OUT_A] ||
        sp == &Lw[LT_OUT_B] || sp == &Lw[LT_GATE_SHEXP] || sp == &Lw[LT_UP_SHEXP] || sp == &Lw[LT_DOWN_SHEXP])
        return DS4_TYPE_Q8_0;
    return DS4_TYPE_F16;   /* token_embd, hc fn, compressors and ape, indexer q_b/proj, gate_inp */
}

/* A config by name, optionally with a vocabulary and a routed-expert count:
 * "tiny+vocab", "flash-q2@256" (E from top-k to 1024; the real Flash has 256).
 * Fills *out; 0 if unknown. */
/* NAME[+vocab][@E][/N]: a config, its vocabulary, E routed experts, context_length N (the
 * positions the file declares; the YaRN original context stays the config's, so the
 * arithmetic at any position is the same). */
static int synth_find(const char *config, synth_config *out) {
    if (!config) return 0;
    const char *slash = strchr(config, '/');
    long ctx = 0;
    if (slash) {
        char *end;
        errno = 0;
        ctx = strtol(slash + 1, &end, 10);
        if (errno || end == slash + 1 || *end || slash[1] < '0' || slash[1] > '9' || ctx < 1 || ctx > DS4_SYNTH_MAX_CTX)
            return 0;
    }
    const size_t len = slash ? (size_t)(slash - config) : strlen(config);
    char head[128];
    if (len >= sizeof head) return 0;
    memcpy(head, config, len);
    head[len] = 0;
    /* NAME, then +vocab and +mtp or +mtpfile (each at most once, either order), then @E */
    const size_t n = strcspn(head, "+@");
    const char *q = head + n;
    int vocab = 0, mtp = 0;
    while (*q == '+') {
        if (!strncmp(q, "+vocab", 6) && !vocab) { vocab = 1; q += 6; }
        else if (!strncmp(q, "+mtpfile", 8) && !mtp) { mtp = 2; q += 8; }
        else if (!strncmp(q, "+mtp", 4) && !mtp) { mtp = 1; q += 4; }
        else return 0;
    }
    if (*q && *q != '@') return 0;
    const char *at = *q == '@' ? q : NULL;
    for (size_t i = 0; i < sizeof synth_configs / sizeof synth_configs[0]; i++) {
        if (strlen(synth_configs[i].name) != n || strncmp(head, synth_configs[i].name, n) != 0) continue;
        *out = synth_configs[i];
        out->vocab = vocab;
        out->mtp = mtp;
        if (at) {
            char *end;
            errno = 0;
            const long e = strtol(at + 1, &end, 10);
            if (errno || end == at + 1 || *end || e < out->n_used || e > 1024) return 0;
            out->n_expert = (int)e;
        }
        if (ctx) out->n_ctx = (int)ctx;
        return 1;
    }
    return 0;
}

/* Synthetic weight statistics -- THE place to tune them.  Every element is
 * mean + std * u, with u uniform on [-sqrt(3), sqrt(3)) (unit variance);
 * ne0 is the tensor's fan-in. */
static void synth_stats(int fill, int64_t ne0, const ds4_hparams *hp, float *mean, float *std) {
    double m = 0.0, s = 0.0;
    switch (fill) {
    case SF_EMBD:     s = 1.0; break;                            /* token_embd */
    case SF_LINEAR:   s = 1.0 / sqrt((double)ne0); break;        /* every matmul weight (incl. router, experts) */
    case SF_OUTPUT:   s = 1.0 / sqrt((double)hp->n_embd); break; /* output head */
    case SF_NORM:     m = 1.0; s = 0.1; break;                   /* RMSNorm weights, compressor norms */
    case SF_SINK:     s = 1.0; break;                            /* attention sink logits */
    case SF_HC_FN:    s = 0.1 / sqrt((double)ne0); break;        /* mHC mix projections */
    case SF_HC_BASE:  s = 0.5; break;                            /* mHC biases */
    case SF_HC_SCALE: m = 1.0; s = 0.1; break;                   /* mHC scales (positive) */
    case SF_APE:      s = 0.5; break;                            /* compressor position bias */
    case SF_BIAS:     s = 0.1; break;                            /* exp_probs_b routing bias */
    default: break;                                              /* SF_TID2EID: integers */
    }
    *mean = (float)m;
    *std = (float)s;
}

static void synth_hparams(const synth_config *c, ds4_hparams *hp) {
    memset(hp, 0, sizeof *hp);
    hp->n_ctx_train = c->n_ctx;
    hp->n_embd = c->n_embd;
    hp->n_layer = c->n_layer;
    hp->n_mtp = c->mtp ? 1 : 0;
    hp->n_vocab = c->n_vocab;
    hp->n_head = c->n_head;
    hp->head_dim = c->head_dim;
    hp->rms_eps = 1e-6f;
    hp->q_lora = c->q_lora;
    hp->n_swa = c->n_swa;
    hp->o_groups = c->o_groups;
    hp->o_lora = c->o_lora;
    hp->compress_rope_base = 160000.0f;
    for (int i = 0; i < c->n_layer; i++) hp->ratio[i] = i < 2 ? 0 : (i % 2 == 0 ? 4 : 128);
    hp->idx_heads = c->idx_heads;
    hp->idx_dim = c->idx_dim;
    hp->idx_topk = c->idx_topk;
    hp->n_rot = c->n_rot;
    hp->rope_base = 10000.0f;
    hp->rope_yarn = 1;
    hp->rope_factor = c->yarn_factor;
    hp->rope_orig_ctx = c->yarn_orig;
    hp->yarn_beta_fast = 32.0f;
    hp->yarn_beta_slow = 1.0f;
    hp->n_expert = c->n_expert;
    hp->n_expert_used = c->n_used;
    hp->n_expert_shared = c->n_shared;
    hp->n_ff_exp = c->n_ff;
    hp->expert_weights_scale = 1.5f;
    hp->expert_weights_norm = 1;
    hp->expert_gating_func = 4;
    for (int i = 0; i < c->n_layer + hp->n_mtp; i++) hp->clamp_exp[i] = hp->clamp_shexp[i] = 10.0f;
    hp->n_hc = 4;
    hp->sinkhorn_iters = 20;
    hp->hc_eps = 1e-6f;
    hp->n_hash_layers = c->n_hash;
    hp->has_vocab = 0;
}

static int synth_add_tensor(gguf_plan *p, const char *name, const gguf_tspec *sp, int n_dims,
                            const int64_t ne[4], int wtype, int layout) {
    uint32_t type = layout ? synth_layout_type(sp, layout)
                  : sp->cls == TC_I32 ? DS4_TYPE_I32
                  : sp->cls == TC_F32 || sp->cls == TC_APE || sp->synth_f32 ? DS4_TYPE_F32 : (uint32_t)wtype;
    gguf_wtensor *t = gguf_plan_tensor(p, name, n_dims, ne, type);
    if (!t) return 0;
    t->seed_ti = (int)(t - p->t);
    t->fill = sp->fill;
    t->tid_e = p->hp.n_expert;
    synth_stats(sp->fill, ne[0], &p->hp, &t->mean, &t->std);
    return 1;
}

/* Layer il's tensors (gguf_layer_specs order). */
static int synth_add_layer(gguf_plan *p, int il, int wtype, int layout) {
    char name[128];
    int64_t ne[4];
    int ok = 1;
    for (int id = 0; id < LT_COUNT; id++) {
        const gguf_tspec *sp = &gguf_layer_specs[id];
        if (!gguf_layer_has(sp->when, &p->hp, il)) continue;
        snprintf(name, sizeof name, "blk.%d.%s", il, sp->name);
        const int nd = gguf_layer_shape(id, &p->hp, il, ne);
        ok &= synth_add_tensor(p, name, sp, nd, ne, wtype, layout);
    }
    return ok;
}

/* Builds the full plan of a synthetic config (keys, tensors, layout). */
static int synth_plan_init(gguf_plan *p, const char *config, int wtype, char *err, size_t errlen) {
    memset(p, 0, sizeof *p);
    synth_config cfg;
    const synth_config *c = synth_find(config, &cfg) ? &cfg : NULL;
    if (!c) {
        if (err && errlen) snprintf(err, errlen, "unknown synth config '%s' (expected tiny, small, slim, flash16, small-q2, small-q4, flash-q2 or flash-q4, optionally @EXPERTS)",
                                    config ? shown(config) : "(null)");
        return 0;
    }
    if (wtype != DS4_TYPE_F32 && wtype != DS4_TYPE_F16 && wtype != DS4_TYPE_BF16 && wtype != DS4_TYPE_Q8_0) {
        if (err && errlen) snprintf(err, errlen, "unsupported synth weight type %d (expected F32, F16, BF16 or Q8_0)", wtype);
        return 0;
    }
    ds4_hparams *hp = &p->hp;
    synth_hparams(c, hp);
    snprintf(p->model_name, sizeof p->model_name, "ds4-synth-%s", c->name);
    const int n_block = hp->n_layer + hp->n_mtp;
    for (int i = 0; i < n_block; i++) p->ratios[i] = (uint32_t)hp->ratio[i];
    p->alignment = GGUF_DEFAULT_ALIGNMENT;

    gguf_plan_kv_str(p, K_ARCH, "deepseek4");
    gguf_plan_kv_str(p, K_NAME, p->model_name);
    gguf_plan_kv_u32(p, K_ALIGNMENT, p->alignment);
    gguf_plan_kv_u32(p, K_CTX, (uint32_t)hp->n_ctx_train);
    gguf_plan_kv_u32(p, K_EMBD, (uint32_t)hp->n_embd);
    gguf_plan_kv_u32(p, K_BLOCKS, (uint32_t)n_block);
    if (hp->n_mtp) gguf_plan_kv_u32(p, K_NEXTN, (uint32_t)hp->n_mtp);
    gguf_plan_kv_u32(p, K_VOCAB, (uint32_t)hp->n_vocab);
    gguf_plan_kv_u32(p, K_HEADS, (uint32_t)hp->n_head);
    gguf_plan_kv_u32(p, K_HEADS_KV, 1);
    gguf_plan_kv_u32(p, K_KEY_LEN, (uint32_t)hp->head_dim);
    gguf_plan_kv_u32(p, K_VAL_LEN, (uint32_t)hp->head_dim);
    gguf_plan_kv_f32(p, K_RMS_EPS, hp->rms_eps);
    gguf_plan_kv_u32(p, K_Q_LORA, (uint32_t)hp->q_lora);
    gguf_plan_kv_u32(p, K_SWA, (uint32_t)hp->n_swa);
    gguf_plan_kv_u32(p, K_O_GROUPS, (uint32_t)hp->o_groups);
    gguf_plan_kv_u32(p, K_O_LORA, (uint32_t)hp->o_lora);
    gguf_plan_kv_f32(p, K_COMP_BASE, hp->compress_rope_base);
    gguf_plan_kv_arr(p, K_RATIOS, GGUF_T_U32, (uint64_t)n_block, p->ratios);
    gguf_plan_kv_u32(p, K_IDX_HEADS, (uint32_t)hp->idx_heads);
    gguf_plan_kv_u32(p, K_IDX_DIM, (uint32_t)hp->idx_dim);
    gguf_plan_kv_u32(p, K_IDX_TOPK, (uint32_t)hp->idx_topk);
    gguf_plan_kv_u32(p, K_ROPE_DIM, (uint32_t)hp->n_rot);
    gguf_plan_kv_f32(p, K_ROPE_BASE, hp->rope_base);
    gguf_plan_kv_str(p, K_ROPE_TYPE, "yarn");
    gguf_plan_kv_f32(p, K_ROPE_FACTOR, hp->rope_factor);
    gguf_plan_kv_u32(p, K_ROPE_ORIG, (uint32_t)hp->rope_orig_ctx);
    gguf_plan_kv_u32(p, K_EXPERTS, (uint32_t)hp->n_expert);
    gguf_plan_kv_u32(p, K_EXPERTS_USED, (uint32_t)hp->n_expert_used);
    gguf_plan_kv_u32(p, K_EXPERTS_SHARED, (uint32_t)hp->n_expert_shared);
    gguf_plan_kv_u32(p, K_FF_EXP, (uint32_t)hp->n_ff_exp);
    gguf_plan_kv_f32(p, K_EXP_SCALE, hp->expert_weights_scale);
    gguf_plan_kv_bool(p, K_EXP_NORM, hp->expert_weights_norm);
    gguf_plan_kv_u32(p, K_GATING, (uint32_t)hp->expert_gating_func);
    gguf_plan_kv_f32(p, K_CLAMP_EXP, hp->clamp_exp[0]);
    gguf_plan_kv_f32(p, K_CLAMP_SHEXP, hp->clamp_shexp[0]);
    gguf_plan_kv_u32(p, K_HC_COUNT, (uint32_t)hp->n_hc);
    gguf_plan_kv_u32(p, K_HC_ITERS, (uint32_t)hp->sinkhorn_iters);
    gguf_plan_kv_f32(p, K_HC_EPS, hp->hc_eps);
    gguf_plan_kv_u32(p, K_HASH_LAYERS, (uint32_t)hp->n_hash_layers);
    if (c->vocab) {
        synth_vocab_t v;
        p->vocab = synth_vocab(hp->n_vocab, &v);
        if (!p->vocab) {
            if (err && errlen) snprintf(err, errlen, "synth config '%s': no room for a vocabulary of %d tokens",
                                        c->name, hp->n_vocab);
            gguf_plan_free(p);
            return 0;
        }
        gguf_plan_kv_str(p, K_TOK_MODEL, "gpt2");
        gguf_plan_kv_str(p, K_TOK_PRE, "deepseek-v3");
        gguf_plan_kv_arr(p, K_TOK_TOKENS, GGUF_T_STRING, (uint64_t)hp->n_vocab, v.tokens);
        gguf_plan_kv_arr(p, K_TOK_TYPES, GGUF_T_I32, (uint64_t)hp->n_vocab, v.types);
        gguf_plan_kv_arr(p, K_TOK_MERGES, GGUF_T_STRING, (uint64_t)v.n_merges, v.merges);
        gguf_plan_kv_u32(p, K_TOK_BOS, 0);
        gguf_plan_kv_u32(p, K_TOK_EOS, 1);
    } else {
        gguf_plan_kv_str(p, K_TOK_MODEL, "no_vocab");
    }

    char name[128];
    int64_t ne[4];
    int nd, ok = 1;
    /* order: token_embd, blk.0 .. blk.L-1, output_hc_*, output_norm, output, then the MTP block
     * (its layer, then eh_proj, enorm, hnorm and shared_head_norm: the optional embed_tokens and
     * shared_head_head are left out, so it shares the model's, as the published V4 files do).
     * A tensor's values come from its index, so the trunk's are the same with or without it. */
    nd = gguf_global_shape(GT_TOKEN_EMBD, hp, ne);
    ok &= synth_add_tensor(p, gguf_global_specs[GT_TOKEN_EMBD].name, &gguf_global_specs[GT_TOKEN_EMBD], nd, ne, wtype, c->layout);
    for (int il = 0; il < hp->n_layer; il++) ok &= synth_add_layer(p, il, wtype, c->layout);
    for (int id = GT_TOKEN_EMBD + 1; id < GT_COUNT; id++) {
        nd = gguf_global_shape(id, hp, ne);
        ok &= synth_add_tensor(p, gguf_global_specs[id].name, &gguf_global_specs[id], nd, ne, wtype, c->layout);
    }
    const int first_mtp = p->n_t;
    if (hp->n_mtp) {
        ok &= synth_add_layer(p, hp->n_layer, wtype, c->layout);
        for (int id = 0; id < NT_COUNT; id++) {
            if (id == NT_EMBED_TOKENS || id == NT_SHARED_HEAD_HEAD) continue;
            snprintf(name, sizeof name, "blk.%d.%s", hp->n_layer, gguf_nextn_specs[id].name);
            nd = gguf_nextn_shape(id, hp, ne);
            ok &= synth_add_tensor(p, name, &gguf_nextn_specs[id], nd, ne, wtype, c->layout);
        }
    }
    if (ok && c->mtp == 2) {
        /* the MTP block alone: its tensors keep their streams (seed_ti), so their bytes are the
         * whole model's */
        memmove(p->t, p->t + first_mtp, (size_t)(p->n_t - first_mtp) * sizeof *p->t);
        p->n_t -= first_mtp;
    }
    if (!ok || !gguf_plan_layout(p)) {
        if (err && errlen) snprintf(err, errlen, "out of memory building synth config '%s'", c->name);
        gguf_plan_free(p);
        return 0;
    }
    return 1;
}

/* Writes header, metadata, tensor directory and zero padding up to the data section. */
static void gguf_plan_write_header(const gguf_plan *p, uint8_t *buf, size_t size) {
    gguf_wout o = {buf, size, 0};
    gguf_plan_write_meta(p, &o);
    if (o.pos < size) memset(buf + o.pos, 0, (size_t)((p->data_start < size ? p->data_start : size) - o.pos));
}

/* ---- deterministic data ---- */

#define SYNTH_CHUNK ((uint64_t)1 << 16)   /* elements per PRNG stream (multiple of 32) */
#define SYNTH_TID_ROWS ((uint64_t)4096)   /* tid2eid rows per PRNG stream */

static uint64_t synth_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t synth_next(uint64_t *s) {
    *s += 0x9e3779b97f4a7c15ull;
    return synth_mix(*s);
}

/* Start state of the stream of one (seed, tensor, chunk). */
static uint64_t synth_stream(uint64_t seed, uint64_t tensor, uint64_t chunk) {
    uint64_t s = synth_mix(seed ^ 0x6473345f73796e74ull);
    s = synth_mix(s + (tensor + 1) * 0x9e3779b97f4a7c15ull);
    s = synth_mix(s ^ ((chunk + 1) * 0xd1b54a32d192ed03ull));
    return s;
}

/* n consecutive values of a stream, written so that the compiler can
 * vectorise it.  Exactly reproducible: k is a 24-bit integer and step a float
 * (24-bit mantissa), so k*step is exact in double; then one rounding for
 * + mean (the same with or without FMA contraction) and one for the cast. */
static void synth_values(uint64_t *s, float step, float mean, float *out, int n) {
    uint64_t st = *s;
    for (int i = 0; i < n; i++) {
        uint64_t z = synth_mix(st + (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ull);
        int32_t k = (int32_t)(z >> 40) - (1 << 23);
        out[i] = (float)((double)k * (double)step + (double)mean);
    }
    *s = st + (uint64_t)n * 0x9e3779b97f4a7c15ull;
}

static void synth_put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static void synth_put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8);
}

/* One Q8_0 block: d = amax/127 stored as f16; q = round-half-away(x / d) with
 * d read back from f16, clamped to [-127, 127]; d == 0 gives q = 0. */
static void synth_q8_0_block(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int i = 0; i < DS4_QK8_0; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    uint16_t dh = ds4_f32_to_f16(amax / 127.0f);
    float d = ds4_f16_to_f32(dh);
    synth_put16(out, dh);
    if (d == 0.0f) {
        memset(out + 2, 0, DS4_QK8_0);
        return;
    }
    int8_t q8[DS4_QK8_0];
    for (int i = 0; i < DS4_QK8_0; i++) {      /* branch-free and exact: vectorises */
        float v = x[i] / d;
        float a = fabsf(v);                     /* |v| <= ~127.1 */
        int q = (int)a;                         /* truncation */
        q += (a - (float)q) >= 0.5f;            /* the fraction is exact: half away from zero */
        q = q > 127 ? 127 : q;
        q = v < 0.0f ? -q : q;
        q8[i] = (int8_t)q;
    }
    memcpy(out + 2, q8, DS4_QK8_0);
}

/* The synthetic bytes rely on IEEE float semantics (exact division, no
 * reciprocal or reassociation tricks).  A build with -ffast-math would write
 * different Q8_0 bytes; this recomputes a few known results and refuses to
 * fill if they differ.  (The inputs pass through volatile so the compiler
 * cannot fold them at build time.) */
static int synth_selfcheck(void) {
    static const uint32_t xbits[2] = {0x3fe43400u, 0xbfab9a00u};  /* 127*d and a value whose x/d is exactly -95.5 */
    static const uint32_t vbits[4] = {0x3f58c0f2u, 0x3f9387a3u, 0x3f82ededu, 0x3f5efd12u};
    volatile uint32_t vb[2] = {xbits[0], xbits[1]};
    volatile float vstd = 0.1f, vmean = 1.0f;
    float x[DS4_QK8_0];
    memset(x, 0, sizeof x);
    uint32_t b0 = vb[0], b1 = vb[1];
    memcpy(&x[0], &b0, 4);
    memcpy(&x[1], &b1, 4);
    uint8_t out[DS4_Q8_0_BLOCK_BYTES];
    synth_q8_0_block(x, out);
    if (out[0] != 0x30 || out[1] != 0x23 || out[2] != 127 || (int8_t)out[3] != -96) return 0;
    uint64_t s = synth_stream(1, 0, 0);
    float step = vstd * 1.7320508f;
    step *= 0x1p-23f;
    float v[4];
    synth_values(&s, step, vmean, v, 4);
    for (int i = 0; i < 4; i++) {
        uint32_t bits;
        memcpy(&bits, &v[i], 4);
        if (bits != vbits[i]) return 0;
    }
    return 1;
}

static uint64_t synth_nel(const gguf_wtensor *t) {
    uint64_t n = 1;
    for (uint32_t j = 0; j < t->n_dims && j < 4; j++) n *= (uint64_t)t->ne[j];
    return n;
}

static uint64_t synth_chunks(const gguf_wtensor *t) {
    if (t->fill == SF_TID2EID) {
        uint64_t rows = synth_nel(t) / (uint64_t)t->ne[0];
        return (rows + SYNTH_TID_ROWS - 1) / SYNTH_TID_ROWS;
    }
    return (synth_nel(t) + SYNTH_CHUNK - 1) / SYNTH_CHUNK;
}

static void synth_fill_chunk(const gguf_plan *p, int ti, uint64_t chunk, uint64_t seed, uint8_t *buf) {
    const gguf_wtensor *t = &p->t[ti];
    uint8_t *dst = buf + p->data_start + t->offset;
    uint64_t s = synth_stream(seed, (uint64_t)t->seed_ti, chunk);

    if (t->fill == SF_TID2EID) {
        /* each row: ne0 distinct expert ids in [0, E) (rejection sampling) */
        int64_t k = t->ne[0];
        uint64_t E = t->tid_e > 0 ? (uint64_t)t->tid_e : 1;
        uint64_t rows = synth_nel(t) / (uint64_t)k;
        uint64_t r0 = chunk * SYNTH_TID_ROWS, r1 = r0 + SYNTH_TID_ROWS < rows ? r0 + SYNTH_TID_ROWS : rows;
        int32_t ids[64];
        for (uint64_t row = r0; row < r1; row++) {
            for (int64_t j = 0; j < k; j++) {
                uint32_t id;
                if ((uint64_t)k > E || k > 64) {
                    id = (uint32_t)((row + (uint64_t)j) % E);
                } else {
                    int dup;
                    do {
                        id = (uint32_t)(((synth_next(&s) >> 32) * E) >> 32);
                        dup = 0;
                        for (int64_t q = 0; q < j; q++) dup |= ids[q] == (int32_t)id;
                    } while (dup);
                    ids[j] = (int32_t)id;
                }
                synth_put32(dst + (row * (uint64_t)k + (uint64_t)j) * 4, id);
            }
        }
        return;
    }

    uint64_t nel = synth_nel(t);
    uint64_t e0 = chunk * SYNTH_CHUNK, e1 = e0 + SYNTH_CHUNK < nel ? e0 + SYNTH_CHUNK : nel;
    float step = t->std * 1.7320508f;   /* sqrt(3): unit-variance uniform */
    step *= 0x1p-23f;
    float x[256];
    switch (t->type) {
    case DS4_TYPE_F32: case DS4_TYPE_F16: case DS4_TYPE_BF16:
        for (uint64_t e = e0; e < e1; e += 256) {
            int n = e1 - e < 256 ? (int)(e1 - e) : 256;
            synth_values(&s, step, t->mean, x, n);
            for (int i = 0; i < n; i++) {
                uint32_t b;
                if (t->type == DS4_TYPE_F32) {
                    memcpy(&b, &x[i], 4);
                    synth_put32(dst + (e + (uint64_t)i) * 4, b);
                } else {
                    b = t->type == DS4_TYPE_F16 ? ds4_f32_to_f16(x[i]) : ds4_f32_to_bf16(x[i]);
                    synth_put16(dst + (e + (uint64_t)i) * 2, (uint16_t)b);
                }
            }
        }
        break;
    case DS4_TYPE_Q8_0:
        for (uint64_t e = e0; e + DS4_QK8_0 <= e1; e += DS4_QK8_0) {
            synth_values(&s, step, t->mean, x, DS4_QK8_0);
            synth_q8_0_block(x, dst + (e / DS4_QK8_0) * DS4_Q8_0_BLOCK_BYTES);
        }
        break;
    case DS4_TYPE_Q2_K: case DS4_TYPE_Q4_K: case DS4_TYPE_IQ2_XXS: {
        /* random valid super-blocks (ds4_quant.c says what valid means per type);
         * SYNTH_CHUNK is a multiple of 256, so chunks hold whole blocks */
        const size_t bb = ds4_row_bytes((int)t->type, DS4_QK_K);
        for (uint64_t e = e0; e + DS4_QK_K <= e1; e += DS4_QK_K)
            ds4_quant_random_block((int)t->type, &s, dst + (e / DS4_QK_K) * bb);
        break;
    }
    default:   /* I32 without a fill rule: zeros */
        memset(dst + e0 * 4, 0, (size_t)(e1 - e0) * 4);
        break;
    }
}

typedef struct {
    const gguf_plan *p;
    uint8_t *buf;
    uint64_t seed;
    const uint64_t *first;   /* first[i] = first work item of tensor i; first[n_t] = total */
    uint64_t n_items;
    atomic_uint_fast64_t next;
} synth_job;

static void *synth_worker(void *arg) {
    synth_job *j = arg;
    for (;;) {
        uint64_t it = atomic_fetch_add(&j->next, 1);
        if (it >= j->n_items) break;
        int lo = 0, hi = j->p->n_t;          /* largest lo with first[lo] <= it */
        while (hi - lo > 1) {
            int mid = lo + (hi - lo) / 2;
            if (j->first[mid] <= it) lo = mid;
            else hi = mid;
        }
        synth_fill_chunk(j->p, lo, it - j->first[lo], j->seed, j->buf);
    }
    return NULL;
}

/* Fills every tensor that lies inside buf, and zeroes all padding. */
static int gguf_plan_fill(const gguf_plan *p, uint64_t seed, uint8_t *buf, size_t size, int n_threads) {
    if (p->data_start > size) return 0;
    uint64_t room = size - p->data_start;
    int monotone = 1;
    uint64_t end = 0;
    for (int i = 0; i < p->n_t; i++) {
        if (p->t[i].offset < end) monotone = 0;
        end = p->t[i].offset + p->t[i].nbytes;
    }
    if (monotone) {
        uint64_t at = 0;
        for (int i = 0; i < p->n_t; i++) {
            const gguf_wtensor *t = &p->t[i];
            uint64_t a = t->offset < room ? t->offset : room;
            if (a > at) memset(buf + p->data_start + at, 0, (size_t)(a - at));
            uint64_t b = t->offset + t->nbytes;
            if (b > at) at = b < room ? b : room;
        }
        if (at < room) memset(buf + p->data_start + at, 0, (size_t)(room - at));
    } else {
        memset(buf + p->data_start, 0, (size_t)room);
    }

    uint64_t *first = malloc(((size_t)p->n_t + 1) * sizeof *first);
    if (!first) return 0;
    uint64_t n = 0;
    for (int i = 0; i < p->n_t; i++) {
        const gguf_wtensor *t = &p->t[i];
        first[i] = n;
        if (t->offset <= room && t->nbytes <= room - t->offset) n += synth_chunks(t);
    }
    first[p->n_t] = n;

    synth_job job;
    job.p = p;
    job.buf = buf;
    job.seed = seed;
    job.first = first;
    job.n_items = n;
    atomic_init(&job.next, 0);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 256) n_threads = 256;
    pthread_t th[256];
    int started = 0;
    for (int i = 1; i < n_threads; i++) {
        if (pthread_create(&th[started], NULL, synth_worker, &job) != 0) break;
        started++;
    }
    synth_worker(&job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    free(first);
    return 1;
}

int ds4_synth_config_ok(const char *config) {
    synth_config c;
    return synth_find(config, &c);
}

size_t ds4_synth_size(const char *config, int wtype) {
    gguf_plan p;
    if (!synth_plan_init(&p, config, wtype, NULL, 0)) return 0;
    uint64_t total = p.total;
    gguf_plan_free(&p);
    return total > (uint64_t)SIZE_MAX ? 0 : (size_t)total;
}

int ds4_synth_fill(const char *config, uint64_t seed, int wtype, uint8_t *buf, size_t size,
                   int n_threads, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!synth_selfcheck()) {
        if (err && errlen)
            snprintf(err, errlen, "synth self-check failed: this build does not follow IEEE float semantics "
                                  "(-ffast-math?), so synthetic bytes would differ from other builds");
        return -1;
    }
    gguf_plan p;
    if (!synth_plan_init(&p, config, wtype, err, errlen)) return -1;
    int rc = 0;
    if (!buf || size != p.total) {
        if (err && errlen)
            snprintf(err, errlen, "synth config '%s' needs a buffer of %llu bytes, got %zu%s", shown(config),
                     (unsigned long long)p.total, size, buf ? "" : " (NULL)");
        rc = -1;
    } else {
        gguf_plan_write_header(&p, buf, size);
        if (!gguf_plan_fill(&p, seed, buf, size, n_threads)) {
            if (err && errlen) snprintf(err, errlen, "out of memory filling synth config '%s'", shown(config));
            rc = -1;
        }
    }
    gguf_plan_free(&p);
    return rc;
}
