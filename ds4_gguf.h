/* ds4_gguf.h -- the deepseek4 GGUF convention, shared by the reader and the writer.
 *
 * Internal to the engine (not an API): ds4.c reads and validates deepseek4 files
 * (ds4_gguf_parse) and ds4_synth.c writes them (synthetic models).  Both take the
 * key names, the GGUF value types and the tensor list from here -- one table,
 * gguf_global_specs / gguf_layer_specs with gguf_global_shape / gguf_layer_shape --
 * so the files the writer makes are exactly the files the reader accepts.
 *
 *   ds4_hparams      the hyperparameters a file declares
 *   GGUF constants   value types, sizes, limits, the deepseek4 key names
 *   Tensor table     when a layer has a tensor, its allowed types, its synthetic
 *                    initialisation, its shape (defined in ds4.c)
 *   Synthetic models the writer's entry points (defined in ds4_synth.c)
 */
#ifndef DS4_GGUF_H
#define DS4_GGUF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ds4.h"

/* ---------------------------------------------------------------------------
 * Hyperparameters
 * ------------------------------------------------------------------------- */

#define DS4_MAX_LAYERS 128
#define DS4_HC_MAX 4

typedef struct ds4_hparams {
    int64_t n_ctx_train;        /* deepseek4.context_length */
    int     n_embd;             /* D */
    int     n_layer;
    int     n_mtp;              /* MTP blocks read (0 or 1): block n_layer, its tensors bound */
    int     n_vocab;
    int     n_head;             /* H */
    int     head_dim;           /* d = key_length = value_length */
    float   rms_eps;
    int     q_lora;             /* q_lora_rank */
    int     n_swa;              /* sliding_window */
    int     o_groups;
    int     o_lora;
    float   compress_rope_base;
    int     ratio[DS4_MAX_LAYERS];   /* compress_ratios[0..n_layer + n_mtp) : 0, 4 or 128 */
    int     idx_heads;          /* indexer.head_count */
    int     idx_dim;            /* indexer.key_length */
    int     idx_topk;           /* indexer.top_k */
    int     n_rot;              /* rope.dimension_count */
    float   rope_base;          /* rope.freq_base */
    int     rope_yarn;          /* rope.scaling.type == "yarn" */
    float   rope_factor;        /* rope.scaling.factor (1 if absent) */
    int     rope_orig_ctx;      /* rope.scaling.original_context_length */
    float   yarn_beta_fast;     /* 32 unless given */
    float   yarn_beta_slow;     /* 1 unless given */
    int     n_expert;
    int     n_expert_used;
    int     n_expert_shared;
    int     n_ff_exp;
    float   expert_weights_scale;
    int     expert_weights_norm;
    int     expert_gating_func; /* must be 4 */
    float   clamp_exp[DS4_MAX_LAYERS];     /* [0..n_layer + n_mtp) */
    float   clamp_shexp[DS4_MAX_LAYERS];
    int     n_hc;               /* hyper_connection.count (4) */
    int     sinkhorn_iters;
    float   hc_eps;
    int     n_hash_layers;      /* hash_layer_count */
    int     has_vocab;          /* 1 for tokenizer.ggml.model == "gpt2" (byte-level BPE), 0 for "no_vocab" */
    /* gpt2 vocabularies: where the arrays sit in the image (validated by the reader) */
    size_t  voc_tokens, voc_merges, voc_types;   /* offsets of element 0; voc_types 0 = absent */
    int64_t voc_n_merges;
    char    voc_pre[64];        /* tokenizer.ggml.pre */
    int     voc_bos, voc_eos;   /* -1 when absent */
} ds4_hparams;

/* ---------------------------------------------------------------------------
 * GGUF constants
 * ------------------------------------------------------------------------- */

enum {
    GGUF_T_U8 = 0, GGUF_T_I8, GGUF_T_U16, GGUF_T_I16, GGUF_T_U32, GGUF_T_I32, GGUF_T_F32,
    GGUF_T_BOOL, GGUF_T_STRING, GGUF_T_ARRAY, GGUF_T_U64, GGUF_T_I64, GGUF_T_F64, GGUF_T_COUNT
};
static const uint8_t gguf_type_size[GGUF_T_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
#define GGUF_VERSION 3
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ARRAY_DEPTH 4     /* arrays of arrays allowed, this many levels at most */
#define GGUF_MAX_NAME 256          /* longest tensor name accepted (ggml's limit is 64) */
#define GGUF_MIN_KV_BYTES 13       /* key length 8 + key >= 0 + type 4 + value >= 1 */
#define GGUF_MIN_TINFO_BYTES 32    /* name length 8 + n_dims 4 + ne 8 + type 4 + offset 8 */

/* deepseek4 key names (llama.cpp gguf-py constants, arch "deepseek4") */
#define K_ARCH          "general.architecture"
#define K_NAME          "general.name"
#define K_ALIGNMENT     "general.alignment"
#define K_TOK_MODEL     "tokenizer.ggml.model"
#define K_TOK_TOKENS    "tokenizer.ggml.tokens"
#define K_TOK_MERGES    "tokenizer.ggml.merges"
#define K_TOK_TYPES     "tokenizer.ggml.token_type"
#define K_TOK_PRE       "tokenizer.ggml.pre"
#define K_TOK_BOS       "tokenizer.ggml.bos_token_id"
#define K_TOK_EOS       "tokenizer.ggml.eos_token_id"
#define K_CTX           "deepseek4.context_length"
#define K_EMBD          "deepseek4.embedding_length"
#define K_BLOCKS        "deepseek4.block_count"
#define K_VOCAB         "deepseek4.vocab_size"
#define K_NEXTN         "deepseek4.nextn_predict_layers"
#define K_HEADS         "deepseek4.attention.head_count"
#define K_HEADS_KV      "deepseek4.attention.head_count_kv"
#define K_KEY_LEN       "deepseek4.attention.key_length"
#define K_VAL_LEN       "deepseek4.attention.value_length"
#define K_RMS_EPS       "deepseek4.attention.layer_norm_rms_epsilon"
#define K_Q_LORA        "deepseek4.attention.q_lora_rank"
#define K_SWA           "deepseek4.attention.sliding_window"
#define K_O_GROUPS      "deepseek4.attention.output_group_count"
#define K_O_LORA        "deepseek4.attention.output_lora_rank"
#define K_COMP_BASE     "deepseek4.attention.compress_rope_freq_base"
#define K_RATIOS        "deepseek4.attention.compress_ratios"
#define K_IDX_HEADS     "deepseek4.attention.indexer.head_count"
#define K_IDX_DIM       "deepseek4.attention.indexer.key_length"
#define K_IDX_TOPK      "deepseek4.attention.indexer.top_k"
#define K_ROPE_DIM      "deepseek4.rope.dimension_count"
#define K_ROPE_BASE     "deepseek4.rope.freq_base"
#define K_ROPE_TYPE     "deepseek4.rope.scaling.type"
#define K_ROPE_FACTOR   "deepseek4.rope.scaling.factor"
#define K_ROPE_ORIG     "deepseek4.rope.scaling.original_context_length"
#define K_BETA_FAST     "deepseek4.rope.scaling.yarn_beta_fast"
#define K_BETA_SLOW     "deepseek4.rope.scaling.yarn_beta_slow"
#define K_EXPERTS       "deepseek4.expert_count"
#define K_EXPERTS_USED  "deepseek4.expert_used_count"
#define K_EXPERTS_SHARED "deepseek4.expert_shared_count"
#define K_FF_EXP        "deepseek4.expert_feed_forward_length"
#define K_EXP_SCALE     "deepseek4.expert_weights_scale"
#define K_EXP_NORM      "deepseek4.expert_weights_norm"
#define K_GATING        "deepseek4.expert_gating_func"
#define K_CLAMP_EXP     "deepseek4.swiglu_clamp_exp"
#define K_CLAMP_SHEXP   "deepseek4.swiglu_clamp_shexp"
#define K_HC_COUNT      "deepseek4.hyper_connection.count"
#define K_HC_ITERS      "deepseek4.hyper_connection.sinkhorn_iterations"
#define K_HC_EPS        "deepseek4.hyper_connection.epsilon"
#define K_HASH_LAYERS   "deepseek4.hash_layer_count"

/* Bytes of nel elements of a tensor type (DS4_TYPE_*); 0 on overflow or an unknown type. */
uint64_t gguf_tensor_bytes(uint32_t type, uint64_t nel);

/* ---------------------------------------------------------------------------
 * Tensor table (shared by the reader and the synthetic writer).  Order of
 * gguf_layer_specs = order in synthetic files.
 * ------------------------------------------------------------------------- */

enum { TS_ALWAYS, TS_COMPRESSED, TS_RATIO4, TS_HASH, TS_ROUTED,      /* when a layer has the tensor */
       TS_OPTIONAL };                                                 /* nextn: read when present */
enum { TC_MAT, TC_F32, TC_I32, TC_APE };   /* TC_APE: F32 or F16 (read as F32) */                                      /* allowed types */
enum {                                                                /* synthetic initialisation */
    SF_EMBD, SF_LINEAR, SF_OUTPUT, SF_NORM, SF_SINK, SF_HC_FN, SF_HC_BASE, SF_HC_SCALE,
    SF_APE, SF_BIAS, SF_TID2EID
};

typedef struct {
    const char *name;    /* global name, or the part after "blk.N." */
    size_t      off;     /* offsetof the ds4_weight in ds4_model / ds4_layer_w */
    uint8_t     when;    /* TS_* (layer tensors) */
    uint8_t     cls;     /* TC_* */
    uint8_t     fill;    /* SF_* */
    uint8_t     synth_f32; /* a TC_MAT tensor that synthetic models keep in F32 */
} gguf_tspec;
enum {
    GT_TOKEN_EMBD, GT_OUT_HC_FN, GT_OUT_HC_BASE, GT_OUT_HC_SCALE, GT_OUTPUT_NORM, GT_OUTPUT, GT_COUNT
};
enum {
    LT_ATTN_NORM, LT_ATTN_SINKS, LT_Q_A, LT_Q_A_NORM, LT_Q_B, LT_KV, LT_KV_A_NORM, LT_OUT_A, LT_OUT_B,
    LT_HC_ATTN_FN, LT_HC_ATTN_BASE, LT_HC_ATTN_SCALE,
    LT_COMP_KV, LT_COMP_GATE, LT_COMP_APE, LT_COMP_NORM,
    LT_IDX_PROJ, LT_IDX_Q_B, LT_IDX_COMP_KV, LT_IDX_COMP_GATE, LT_IDX_COMP_APE, LT_IDX_COMP_NORM,
    LT_FFN_NORM, LT_HC_FFN_FN, LT_HC_FFN_BASE, LT_HC_FFN_SCALE,
    LT_GATE_INP, LT_TID2EID, LT_EXP_PROBS_B,
    LT_GATE_EXPS, LT_UP_EXPS, LT_DOWN_EXPS, LT_GATE_SHEXP, LT_UP_SHEXP, LT_DOWN_SHEXP,
    LT_COUNT
};

/* The MTP block's own tensors, "blk.<n_layer>.nextn.*" (llama.cpp's names), beside a whole
 * layer's under blk.<n_layer>: eh_proj maps [enorm(embedding); hnorm(hidden)] (2D) to D, per
 * hyper-connection stream; embed_tokens, shared_head_head and shared_head_norm are optional
 * (absent: the model's token_embd, output and output_norm). */
enum { NT_EH_PROJ, NT_ENORM, NT_HNORM, NT_EMBED_TOKENS, NT_SHARED_HEAD_HEAD, NT_SHARED_HEAD_NORM, NT_COUNT };

extern const gguf_tspec gguf_global_specs[GT_COUNT];
extern const gguf_tspec gguf_layer_specs[LT_COUNT];
extern const gguf_tspec gguf_nextn_specs[NT_COUNT];

/* Whether layer il has a tensor present TS_* `when`. */
int gguf_layer_has(int when, const ds4_hparams *hp, int il);
/* The ggml shape (ne) of global tensor GT_* / layer tensor LT_* id; returns n_dims. */
int gguf_global_shape(int id, const ds4_hparams *hp, int64_t ne[4]);
int gguf_layer_shape(int id, const ds4_hparams *hp, int il, int64_t ne[4]);
int gguf_nextn_shape(int id, const ds4_hparams *hp, int64_t ne[4]);

/* A caller's string (a path, a config name) as quoted in a one-line error:
 * ds4_show of its first 200 bytes. */
static inline const char *shown(const char *s) {
    static _Thread_local char buf[2][1024];     /* two per message at most */
    static _Thread_local int k;
    k ^= 1;
    return ds4_show(buf[k], sizeof buf[k], s, strlen(s), 200);
}

/* ---------------------------------------------------------------------------
 * Synthetic models (ds4_synth.c)
 * ------------------------------------------------------------------------- */

/* Synthetic models.  Writes a complete deepseek4 GGUF image for a named
 * config ("tiny", "small", "flash16") and seed.  wtype is the type of the
 * large matrices (DS4_TYPE_F32/F16/BF16/Q8_0); norms and small tensors are F32,
 * tid2eid is I32.  Deterministic: same bytes on every machine.
 * ds4_synth_size() gives the exact image size; ds4_synth_fill() writes it into
 * a caller buffer of that size (multithreaded with n_threads), so a huge model
 * can be built straight in memory.  Return 0 / -1 with err. */
int    ds4_synth_config_ok(const char *config);
size_t ds4_synth_size(const char *config, int wtype);
int    ds4_synth_fill(const char *config, uint64_t seed, int wtype, uint8_t *buf, size_t size,
                      int n_threads, char *err, size_t errlen);

#endif
