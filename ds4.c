/* ds4.c -- a DeepSeek V4 inference engine in one C file.
 *
 * What it is.  ds4 loads a DeepSeek V4 ("Flash" architecture) model from a
 * GGUF file in the deepseek4 convention shared with llama.cpp, and runs it:
 * prefill of a prompt in chunks of up to DS4_UBATCH tokens, then decode one
 * token at a time, sharing one KV state.  The model is the full architecture: mHC residual streams
 * with Sinkhorn mixing, low-rank MQA attention with per-head sinks over a
 * sliding window, ratio-4 (overlapping, lightning-indexer top-k) and
 * ratio-128 compressed KV, partial RoPE with YaRN, a grouped low-rank output,
 * hash- and score-routed MoE with a shared expert and a clamped SwiGLU.
 *
 * How it is organised.  The arithmetic lives behind a narrow backend
 * contract (ds4_gpu.h): a vtable of ops on opaque backend buffers.  This file
 * holds the CPU backend, which is the specification every other backend is
 * tested against, and the forward pass, which only sequences ops and keeps
 * the host-side bookkeeping (positions, how many compressed rows exist).
 * The byte-level BPE tokenizer of gpt2 vocabularies is ds4_tok.c (models
 * without a vocabulary take byte-level ids).  The deepseek4 file convention
 * (keys, tensor table, hyperparameters) is ds4_gguf.h, shared with the writer
 * of synthetic models, ds4_synth.c, which is tooling and not the engine.
 * Activation hooks are a module (ds4_hooks.h, ds4_hooks.c): the forward pass
 * emits a record after the op that made it, and holds one pointer to the rest.
 * The CUDA backend is ds4_cuda.cu (its entry point) and one ds4_cuda_*.cu per
 * op family; the program is ds4_cli.c; the block
 * layouts of the super-block quantisations (Q2_K, Q4_K, IQ2_XXS) live in
 * ds4_quant.c.  Fused ops of the contract (hc_pre, matmul_multi, ...) are
 * defined, and computed here, as compositions of the plain ops.
 *
 * Speculative decoding (ds4 --mtp-draft, in ds4_cli.c) drafts with the model's MTP block
 * (ds4_mtp_eval) and takes back the positions of rejected drafts (ds4_ctx_checkpoint /
 * ds4_ctx_rollback), both through the backend's ops and copies, so on either backend.
 *
 * What it is not.  No multi-sequence batching, no simulation of the FP8/FP4
 * quantisation-aware rounding of the official weights: like both reference
 * implementations, ds4 computes in f32.
 *
 * Sections, in pipeline order:
 *   Model structures hyperparameters and weights of a loaded model
 *   GGUF            reading and validating deepseek4 files (ds4_gguf.h: the convention)
 *   Thread pool     the CPU backend's workers
 *   CPU backend     every op of ds4_gpu.h, plainly
 *   Models          mapping, weight enumeration and upload
 *   Contexts        KV window ring, compressed rows, compressor state, activations
 *   Forward pass    mHC, attention (compressors, indexer), MoE, head
 *   Sampling        greedy and temperature/top-p
 *   Environment     the DS4_* variables, read once
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ds4.h"
#include "ds4_hooks.h"
#include "ds4_quant.h"
#include "ds4_tok.h"
#include "ds4_gguf.h"

#define errf ds4_errf   /* this file's short name for ds4.h's one-line error */

/* ---------------------------------------------------------------------------
 * Model structures
 *
 * What the GGUF section fills and the forward pass reads: the hyperparameters
 * of the deepseek4 convention (ds4_hparams, ds4_gguf.h) and one ds4_weight per
 * tensor.  Absent optional tensors (compressor, indexer, hash/bias routing)
 * have host == NULL.
 * ------------------------------------------------------------------------- */

typedef struct ds4_layer_w {
    ds4_weight attn_norm, ffn_norm, attn_sinks;
    ds4_weight q_a, q_a_norm, q_b, kv, kv_a_norm, out_a, out_b;
    ds4_weight hc_attn_fn, hc_attn_base, hc_attn_scale;
    ds4_weight hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
    /* compressed layers */
    ds4_weight comp_kv, comp_gate, comp_ape, comp_norm;
    /* ratio-4 layers */
    ds4_weight idx_proj, idx_q_b, idx_comp_kv, idx_comp_gate, idx_comp_ape, idx_comp_norm;
    /* MoE */
    ds4_weight gate_inp, tid2eid, exp_probs_b;
    ds4_weight gate_exps, up_exps, down_exps;
    ds4_weight gate_shexp, up_shexp, down_shexp;
} ds4_layer_w;

/* The MTP block (hp.n_mtp = 1): a whole layer at block n_layer (its attention keeps a cache
 * of its own; routed, never hashed, MoE) and the nextn tensors that feed it.  The trunk's
 * forward pass never reads it; ds4_mtp_eval does.  It goes to the backend with the model. */
typedef struct ds4_mtp_w {
    ds4_weight eh_proj, enorm, hnorm;                             /* required */
    ds4_weight embed_tokens, shared_head_head, shared_head_norm;  /* optional (host NULL: the model's) */
    ds4_layer_w layer;
} ds4_mtp_w;
_Static_assert(sizeof(ds4_mtp_w) % sizeof(ds4_weight) == 0, "ds4_mtp_w is ds4_weights only (gguf_bind sums them)");

struct ds4_model {
    ds4_hparams hp;
    ds4_weight  tok_embd, output, output_norm, output_hc_fn, output_hc_base, output_hc_scale;
    ds4_layer_w layers[DS4_MAX_LAYERS];
    ds4_mtp_w   mtp;         /* hp.n_mtp = 1 */
    size_t      mtp_bytes;   /* its tensors' bytes (not in weight_bytes) */
    /* mapping */
    const uint8_t *base;     /* whole file */
    size_t         size;
    const uint8_t *mtp_base; /* the MTP block's own file (ds4_model_attach_mtp), mapped; NULL: none */
    size_t         mtp_size;
    int            owned_kind; /* 0 = mmap'ed file, 1 = malloc'ed memory image, 2 = borrowed */
    size_t         weight_bytes; /* sum of the trunk's tensor bytes (the MTP block's apart) */
    int            n_tensors;
    const ds4_backend *weights_backend; /* where the weights were uploaded */
    float         *ape_f32[2 * DS4_MAX_LAYERS];   /* F32 copies of F16 ape tables (owned) */
    int            n_ape_f32;
    ds4_tok       *tok;          /* gpt2 vocabularies: the tokenizer, built on first use (owned) */
};
typedef struct ds4_model ds4_model;

/* Layer il's weights: a trunk layer, or (il == n_layer) the MTP block's. */
static ds4_layer_w *layer_w_mut(ds4_model *m, int il) { return il < m->hp.n_layer ? &m->layers[il] : &m->mtp.layer; }
static const ds4_layer_w *layer_w(const ds4_model *m, int il) { return layer_w_mut((ds4_model *)m, il); }

/* Implemented in the GGUF section below. */

/* Parse and validate a deepseek4 GGUF image (the whole file in memory).
 * On success fills m (weights point into buf) and returns 0.  On failure
 * writes ONE line (no trailing newline) naming the key/tensor and what was
 * expected into err and returns -1.  Never crashes, never reads outside
 * [buf, buf+size). */
int ds4_gguf_parse(ds4_model *m, const uint8_t *buf, size_t size, char *err, size_t errlen);

/* ---------------------------------------------------------------------------
 * GGUF: reading and validating deepseek4 files
 *
 * This section and ds4_synth.c, the writer, are the only places that know the
 * GGUF byte format; the deepseek4 naming convention (keys and tensors, as
 * llama.cpp's loader requires them) is ds4_gguf.h.  This section has:
 *
 *  1. A reader.  ds4_gguf_parse() walks a GGUF v3 image that is already in
 *     memory with a bounds-checked cursor: every length, count and offset is
 *     checked against the bytes that are left, in 64-bit arithmetic with
 *     overflow checks, so a corrupt or hostile file produces one error line
 *     and never a read outside [buf, buf+size).  It then checks the
 *     deepseek4 convention: each required key with its type and a range that
 *     keeps the forward pass from crashing, and each tensor with its exact
 *     ggml shape and an allowed type.  On success the ds4_model's weights
 *     point straight into the image (no copy).
 *  2. The tensor table's definitions (gguf_global_specs, gguf_layer_specs and
 *     their shapes), declared in ds4_gguf.h.
 *  3. The f16/bf16 conversions shared with the CPU backend.
 *
 * Both the reader and the synthetic writer take the tensor list from the
 * same table (gguf_global_specs / gguf_layer_specs with gguf_layer_shape),
 * so the files we write are exactly the files we accept.
 *
 * Weight names: global tensors get their full GGUF name ("token_embd.weight");
 * per-layer tensors get the name without the "blk.N." prefix
 * ("attn_q_b.weight"); both are static strings, valid forever.
 */

/* ======================================================================
 * Number conversions (exact; subnormals, infinities and NaN handled).
 * ====================================================================== */

/* The float whose IEEE-754 bits are b, and back. */
static float f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

float ds4_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* subnormal: man * 2^-24; normalise so that bit 10 is the implicit one */
        uint32_t e = 113u;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
    return f32_from_bits(bits);
}

uint16_t ds4_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)                      /* NaN: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u)                     /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {                   /* normal f16 range: rebias, round to nearest even */
        uint32_t r = ax - 0x38000000u;         /* (127 - 15) << 23 */
        r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;   /* a carry may bump the exponent: correct */
        return (uint16_t)(sign | r);
    }
    if (ax <= 0x33000000u)                     /* <= 2^-25: rounds (to even) to zero */
        return (uint16_t)sign;
    /* f16 subnormal: result = value / 2^-24, rounded to nearest even */
    uint32_t e = ax >> 23;                     /* 102..112 */
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;                 /* 14..24 */
    uint32_t h = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float ds4_bf16_to_f32(uint16_t h) {
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t ds4_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)       /* NaN: truncate, force quiet */
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ======================================================================
 * GGUF constants (the rest are in ds4_gguf.h).
 * ====================================================================== */

static const char *const gguf_type_names[GGUF_T_COUNT] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"
};

static const char *gguf_tensor_type_name(uint32_t t) {
    switch (t) {
    case DS4_TYPE_F32: return "F32";
    case DS4_TYPE_F16: return "F16";
    case DS4_TYPE_BF16: return "BF16";
    case DS4_TYPE_Q8_0: return "Q8_0";
    case DS4_TYPE_Q2_K: return "Q2_K";
    case DS4_TYPE_Q4_K: return "Q4_K";
    case DS4_TYPE_IQ2_XXS: return "IQ2_XXS";
    case DS4_TYPE_I32: return "I32";
    default: return "?";
    }
}

static int gguf_tensor_type_ok(uint32_t t) {
    return t == DS4_TYPE_F32 || t == DS4_TYPE_F16 || t == DS4_TYPE_BF16 || t == DS4_TYPE_Q8_0 ||
           t == DS4_TYPE_Q2_K || t == DS4_TYPE_Q4_K || t == DS4_TYPE_IQ2_XXS || t == DS4_TYPE_I32;
}

/* The super-block types: 256 elements a block. */
static int gguf_type_is_superblock(uint32_t t) {
    return t == DS4_TYPE_Q2_K || t == DS4_TYPE_Q4_K || t == DS4_TYPE_IQ2_XXS;
}

/* Bytes of a tensor of nel elements (ne0 % 32 == 0 for Q8_0); 0 on overflow. */
uint64_t gguf_tensor_bytes(uint32_t type, uint64_t nel) {
    switch (type) {
    case DS4_TYPE_F32: case DS4_TYPE_I32:
        return nel > UINT64_MAX / 4 ? 0 : nel * 4;
    case DS4_TYPE_F16: case DS4_TYPE_BF16:
        return nel > UINT64_MAX / 2 ? 0 : nel * 2;
    case DS4_TYPE_Q8_0:
        return nel / DS4_QK8_0 > UINT64_MAX / DS4_Q8_0_BLOCK_BYTES ? 0
             : (nel / DS4_QK8_0) * DS4_Q8_0_BLOCK_BYTES;
    case DS4_TYPE_Q2_K: case DS4_TYPE_Q4_K: case DS4_TYPE_IQ2_XXS: {
        const uint64_t bb = ds4_row_bytes((int)type, DS4_QK_K);
        return nel / DS4_QK_K > UINT64_MAX / bb ? 0 : (nel / DS4_QK_K) * bb;
    }
    default:
        return 0;
    }
}

static uint16_t gguf_le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t gguf_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t gguf_le64(const uint8_t *p) {
    return (uint64_t)gguf_le32(p) | ((uint64_t)gguf_le32(p + 4) << 32);
}
/* Finiteness from the bits, so the checks survive -ffinite-math-only. */
static int gguf_f32_finite(float f) {
    return (f32_bits(f) & 0x7f800000u) != 0x7f800000u;
}
static float gguf_lef32(const uint8_t *p) {
    return f32_from_bits(gguf_le32(p));
}

/* ======================================================================
 * The tensor table of the deepseek4 convention (ds4_gguf.h; shared by the
 * reader and the synthetic writer).  Order of gguf_layer_specs = order in
 * synthetic files.
 * ====================================================================== */

const gguf_tspec gguf_global_specs[GT_COUNT] = {
    {"token_embd.weight",      offsetof(ds4_model, tok_embd),        TS_ALWAYS, TC_MAT, SF_EMBD,     0},
    {"output_hc_fn.weight",    offsetof(ds4_model, output_hc_fn),    TS_ALWAYS, TC_MAT, SF_HC_FN,    1},
    {"output_hc_base.weight",  offsetof(ds4_model, output_hc_base),  TS_ALWAYS, TC_F32, SF_HC_BASE,  0},
    {"output_hc_scale.weight", offsetof(ds4_model, output_hc_scale), TS_ALWAYS, TC_F32, SF_HC_SCALE, 0},
    {"output_norm.weight",     offsetof(ds4_model, output_norm),     TS_ALWAYS, TC_F32, SF_NORM,     0},
    {"output.weight",          offsetof(ds4_model, output),          TS_ALWAYS, TC_MAT, SF_OUTPUT,   0},
};

#define LW(f) offsetof(ds4_layer_w, f)
const gguf_tspec gguf_layer_specs[LT_COUNT] = {
    {"attn_norm.weight",               LW(attn_norm),     TS_ALWAYS,     TC_F32, SF_NORM,     0},
    {"attn_sinks.weight",              LW(attn_sinks),    TS_ALWAYS,     TC_F32, SF_SINK,     0},
    {"attn_q_a.weight",                LW(q_a),           TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"attn_q_a_norm.weight",           LW(q_a_norm),      TS_ALWAYS,     TC_F32, SF_NORM,     0},
    {"attn_q_b.weight",                LW(q_b),           TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"attn_kv.weight",                 LW(kv),            TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"attn_kv_a_norm.weight",          LW(kv_a_norm),     TS_ALWAYS,     TC_F32, SF_NORM,     0},
    {"attn_output_a.weight",           LW(out_a),         TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"attn_output_b.weight",           LW(out_b),         TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"hc_attn_fn.weight",              LW(hc_attn_fn),    TS_ALWAYS,     TC_MAT, SF_HC_FN,    1},
    {"hc_attn_base.weight",            LW(hc_attn_base),  TS_ALWAYS,     TC_F32, SF_HC_BASE,  0},
    {"hc_attn_scale.weight",           LW(hc_attn_scale), TS_ALWAYS,     TC_F32, SF_HC_SCALE, 0},
    {"attn_compressor_kv.weight",      LW(comp_kv),       TS_COMPRESSED, TC_MAT, SF_LINEAR,   0},
    {"attn_compressor_gate.weight",    LW(comp_gate),     TS_COMPRESSED, TC_MAT, SF_LINEAR,   0},
    {"attn_compressor_ape.weight",     LW(comp_ape),      TS_COMPRESSED, TC_APE, SF_APE,      0},
    {"attn_compressor_norm.weight",    LW(comp_norm),     TS_COMPRESSED, TC_F32, SF_NORM,     0},
    {"indexer.proj.weight",            LW(idx_proj),      TS_RATIO4,     TC_MAT, SF_LINEAR,   0},
    {"indexer.attn_q_b.weight",        LW(idx_q_b),       TS_RATIO4,     TC_MAT, SF_LINEAR,   0},
    {"indexer_compressor_kv.weight",   LW(idx_comp_kv),   TS_RATIO4,     TC_MAT, SF_LINEAR,   0},
    {"indexer_compressor_gate.weight", LW(idx_comp_gate), TS_RATIO4,     TC_MAT, SF_LINEAR,   0},
    {"indexer_compressor_ape.weight",  LW(idx_comp_ape),  TS_RATIO4,     TC_APE, SF_APE,      0},
    {"indexer_compressor_norm.weight", LW(idx_comp_norm), TS_RATIO4,     TC_F32, SF_NORM,     0},
    {"ffn_norm.weight",                LW(ffn_norm),      TS_ALWAYS,     TC_F32, SF_NORM,     0},
    {"hc_ffn_fn.weight",               LW(hc_ffn_fn),     TS_ALWAYS,     TC_MAT, SF_HC_FN,    1},
    {"hc_ffn_base.weight",             LW(hc_ffn_base),   TS_ALWAYS,     TC_F32, SF_HC_BASE,  0},
    {"hc_ffn_scale.weight",            LW(hc_ffn_scale),  TS_ALWAYS,     TC_F32, SF_HC_SCALE, 0},
    {"ffn_gate_inp.weight",            LW(gate_inp),      TS_ALWAYS,     TC_MAT, SF_LINEAR,   1},
    {"ffn_gate_tid2eid.weight",        LW(tid2eid),       TS_HASH,       TC_I32, SF_TID2EID,  0},
    {"exp_probs_b.bias",               LW(exp_probs_b),   TS_ROUTED,     TC_F32, SF_BIAS,     0},
    {"ffn_gate_exps.weight",           LW(gate_exps),     TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"ffn_up_exps.weight",             LW(up_exps),       TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"ffn_down_exps.weight",           LW(down_exps),     TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"ffn_gate_shexp.weight",          LW(gate_shexp),    TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"ffn_up_shexp.weight",            LW(up_shexp),      TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
    {"ffn_down_shexp.weight",          LW(down_shexp),    TS_ALWAYS,     TC_MAT, SF_LINEAR,   0},
};
#undef LW

#define NW(f) offsetof(ds4_mtp_w, f)
const gguf_tspec gguf_nextn_specs[NT_COUNT] = {
    {"nextn.eh_proj.weight",          NW(eh_proj),          TS_ALWAYS,   TC_MAT, SF_LINEAR, 0},
    {"nextn.enorm.weight",            NW(enorm),            TS_ALWAYS,   TC_F32, SF_NORM,   0},
    {"nextn.hnorm.weight",            NW(hnorm),            TS_ALWAYS,   TC_F32, SF_NORM,   0},
    {"nextn.embed_tokens.weight",     NW(embed_tokens),     TS_OPTIONAL, TC_MAT, SF_EMBD,   0},
    {"nextn.shared_head_head.weight", NW(shared_head_head), TS_OPTIONAL, TC_MAT, SF_OUTPUT, 0},
    {"nextn.shared_head_norm.weight", NW(shared_head_norm), TS_OPTIONAL, TC_F32, SF_NORM,   0},
};
#undef NW

int gguf_nextn_shape(int id, const ds4_hparams *hp, int64_t ne[4]) {
    const int64_t D = hp->n_embd, V = hp->n_vocab;
    ne[0] = ne[1] = ne[2] = ne[3] = 1;
    switch (id) {
    case NT_EH_PROJ:                             ne[0] = 2 * D; ne[1] = D; return 2;
    case NT_ENORM: case NT_HNORM: case NT_SHARED_HEAD_NORM: ne[0] = D; return 1;
    case NT_EMBED_TOKENS: case NT_SHARED_HEAD_HEAD: ne[0] = D; ne[1] = V; return 2;
    default: return 0;
    }
}

int gguf_layer_has(int when, const ds4_hparams *hp, int il) {
    switch (when) {
    case TS_COMPRESSED: return hp->ratio[il] != 0;
    case TS_RATIO4:     return hp->ratio[il] == 4;
    case TS_HASH:       return il < hp->n_hash_layers;
    case TS_ROUTED:     return il >= hp->n_hash_layers;
    default:            return 1;
    }
}

/* Expected ggml shape (ne0 first) of a global tensor; returns n_dims.
 * All hparams are validated to be in [1, INT32_MAX] first, so no product
 * here can overflow int64. */
int gguf_global_shape(int id, const ds4_hparams *hp, int64_t ne[4]) {
    int64_t D = hp->n_embd, V = hp->n_vocab, hc = hp->n_hc;
    ne[0] = ne[1] = ne[2] = ne[3] = 1;
    switch (id) {
    case GT_TOKEN_EMBD:   ne[0] = D; ne[1] = V; return 2;
    case GT_OUT_HC_FN:    ne[0] = hc * D; ne[1] = hc; return 2;
    case GT_OUT_HC_BASE:  ne[0] = hc; return 1;
    case GT_OUT_HC_SCALE: ne[0] = 1; return 1;
    case GT_OUTPUT_NORM:  ne[0] = D; return 1;
    case GT_OUTPUT:       ne[0] = D; ne[1] = V; return 2;
    default: return 0;
    }
}

int gguf_layer_shape(int id, const ds4_hparams *hp, int il, int64_t ne[4]) {
    int64_t D = hp->n_embd, V = hp->n_vocab, H = hp->n_head, d = hp->head_dim;
    int64_t q = hp->q_lora, g = hp->o_groups, r = hp->o_lora;
    int64_t E = hp->n_expert, k = hp->n_expert_used, f = hp->n_ff_exp;
    int64_t fs = (int64_t)hp->n_ff_exp * hp->n_expert_shared;
    int64_t hc = hp->n_hc, mix = (2 + hc) * hc;
    int64_t ratio = hp->ratio[il], c = ratio == 4 ? 2 : 1;
    int64_t Hi = hp->idx_heads, di = hp->idx_dim;
    ne[0] = ne[1] = ne[2] = ne[3] = 1;
    switch (id) {
    case LT_ATTN_NORM: case LT_FFN_NORM:        ne[0] = D; return 1;
    case LT_ATTN_SINKS:                         ne[0] = H; return 1;
    case LT_Q_A:                                ne[0] = D; ne[1] = q; return 2;
    case LT_Q_A_NORM:                           ne[0] = q; return 1;
    case LT_Q_B:                                ne[0] = q; ne[1] = H * d; return 2;
    case LT_KV:                                 ne[0] = D; ne[1] = d; return 2;
    case LT_KV_A_NORM: case LT_COMP_NORM:       ne[0] = d; return 1;
    case LT_OUT_A:                              ne[0] = H * d / g; ne[1] = g * r; return 2;
    case LT_OUT_B:                              ne[0] = g * r; ne[1] = D; return 2;
    case LT_HC_ATTN_FN: case LT_HC_FFN_FN:      ne[0] = hc * D; ne[1] = mix; return 2;
    case LT_HC_ATTN_BASE: case LT_HC_FFN_BASE:  ne[0] = mix; return 1;
    case LT_HC_ATTN_SCALE: case LT_HC_FFN_SCALE: ne[0] = 3; return 1;
    case LT_COMP_KV: case LT_COMP_GATE:         ne[0] = D; ne[1] = c * d; return 2;
    case LT_COMP_APE:                           ne[0] = c * d; ne[1] = ratio; return 2;
    case LT_IDX_PROJ:                           ne[0] = D; ne[1] = Hi; return 2;
    case LT_IDX_Q_B:                            ne[0] = q; ne[1] = Hi * di; return 2;
    case LT_IDX_COMP_KV: case LT_IDX_COMP_GATE: ne[0] = D; ne[1] = 2 * di; return 2;
    case LT_IDX_COMP_APE:                       ne[0] = 2 * di; ne[1] = 4; return 2;
    case LT_IDX_COMP_NORM:                      ne[0] = di; return 1;
    case LT_GATE_INP:                           ne[0] = D; ne[1] = E; return 2;
    case LT_TID2EID:                            ne[0] = k; ne[1] = V; return 2;
    case LT_EXP_PROBS_B:                        ne[0] = E; return 1;
    case LT_GATE_EXPS: case LT_UP_EXPS:         ne[0] = D; ne[1] = f; ne[2] = E; return 3;
    case LT_DOWN_EXPS:                          ne[0] = f; ne[1] = D; ne[2] = E; return 3;
    case LT_GATE_SHEXP: case LT_UP_SHEXP:       ne[0] = D; ne[1] = fs; return 2;
    case LT_DOWN_SHEXP:                         ne[0] = fs; ne[1] = D; return 2;
    default: return 0;
    }
}

/* ======================================================================
 * Reader: bounds-checked cursor over the image.
 * ====================================================================== */

typedef struct { const uint8_t *s; uint64_t n; } gguf_str;

typedef struct {
    gguf_str key;
    uint32_t type;
    size_t   val;        /* offset of the value in the image */
    uint32_t arr_type;   /* arrays: element type, count, offset of element 0 */
    uint64_t arr_n;
    size_t   arr_data;
} gguf_kv;

typedef struct {
    gguf_str name;
    uint32_t n_dims;
    uint32_t type;
    int64_t  ne[4];
    uint64_t offset;     /* relative to the data section */
    uint64_t nbytes;
    int      used;       /* bound to a model weight (or deliberately skipped) */
} gguf_tinfo;

typedef struct { gguf_str s; uint64_t h; int64_t idx; } gguf_slot;
typedef struct { gguf_slot *v; size_t cap, n; } gguf_set;   /* open addressing, idx -1 = empty */

typedef struct {
    const uint8_t *buf;
    size_t size, pos;
    char *err;
    size_t errlen;
    gguf_kv *kv;
    size_t n_kv, cap_kv;
    gguf_tinfo *t;
    size_t n_t, cap_t;
    gguf_set kset, tset;
    uint64_t alignment, data_start;
    int n_block;         /* block_count (includes MTP blocks when nextn_predict_layers > 0) */
} gguf_ctx;

/* Writes one line into err (newlines replaced); returns 0 so callers can `return gguf_fail(...)`. */
static int gguf_fail(gguf_ctx *g, const char *fmt, ...) {
    if (g->err && g->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(g->err, g->errlen, fmt, ap);
        va_end(ap);
        for (char *p = g->err; *p; p++)
            if (*p == '\n' || *p == '\r') *p = ' ';
    }
    return 0;
}

/* A printable, NUL-terminated copy of a (possibly hostile) name for messages. */
static const char *gguf_show(char *out, size_t outlen, gguf_str s) {
    size_t n = 0;
    uint64_t i;
    for (i = 0; i < s.n && n + 4 < outlen; i++) {
        uint8_t c = s.s[i];
        out[n++] = (c >= 32 && c < 127) ? (char)c : '?';
    }
    if (i < s.n && outlen >= 4) {
        out[n++] = '.'; out[n++] = '.'; out[n++] = '.';
    }
    out[n] = 0;
    return out;
}

static int gguf_streq(gguf_str s, const char *c) {
    size_t n = strlen(c);
    return s.n == n && memcmp(s.s, c, n) == 0;
}

static uint64_t gguf_hash(gguf_str s) {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t i = 0; i < s.n; i++) {
        h ^= s.s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static void gguf_set_free(gguf_set *S) {
    free(S->v);
    S->v = NULL;
    S->cap = S->n = 0;
}

static int64_t gguf_set_find(const gguf_set *S, gguf_str s) {
    if (!S->cap) return -1;
    uint64_t h = gguf_hash(s);
    for (size_t i = (size_t)h & (S->cap - 1);; i = (i + 1) & (S->cap - 1)) {
        const gguf_slot *e = &S->v[i];
        if (e->idx < 0) return -1;
        if (e->h == h && e->s.n == s.n && memcmp(e->s.s, s.s, s.n) == 0) return e->idx;
    }
}

static void gguf_set_put(gguf_set *S, gguf_slot e) {
    size_t i = (size_t)e.h & (S->cap - 1);
    while (S->v[i].idx >= 0) i = (i + 1) & (S->cap - 1);
    S->v[i] = e;
    S->n++;
}

/* Inserts s -> idx.  Returns -1 when inserted, the existing index for a
 * duplicate, -2 when out of memory. */
static int64_t gguf_set_add(gguf_set *S, gguf_str s, int64_t idx) {
    if ((S->n + 1) * 2 > S->cap) {
        size_t ncap = S->cap ? S->cap * 2 : 64;
        gguf_slot *nv = malloc(ncap * sizeof *nv);
        if (!nv) return -2;
        for (size_t i = 0; i < ncap; i++) nv[i].idx = -1;
        gguf_set old = *S;
        S->v = nv;
        S->cap = ncap;
        S->n = 0;
        for (size_t i = 0; i < old.cap; i++)
            if (old.v[i].idx >= 0) gguf_set_put(S, old.v[i]);
        free(old.v);
    }
    int64_t prev = gguf_set_find(S, s);
    if (prev >= 0) return prev;
    gguf_slot e = {s, gguf_hash(s), idx};
    gguf_set_put(S, e);
    return -1;
}

/* Room for entry n of an array of cap entries that doubles from `first`: the array (maybe moved,
 * *cap updated), NULL when out of memory (the old array and *cap kept). */
static void *gguf_room(void *arr, size_t *cap, size_t n, size_t elem, size_t first) {
    if (n < *cap) return arr;
    size_t nc = *cap ? *cap * 2 : first;
    void *na = realloc(arr, nc * elem);
    if (na) *cap = nc;
    return na;
}

/* Files the name of entry idx of a table (`table` in the out-of-memory line, `kind` in the
 * duplicate one, nm its printable form); 0 with the failure said. */
static int gguf_file_name(gguf_ctx *g, gguf_set *S, gguf_str name, size_t idx, const char *table,
                          const char *kind, const char *nm) {
    int64_t dup = gguf_set_add(S, name, (int64_t)idx);
    if (dup == -2) return gguf_fail(g, "out of memory reading %s", table);
    if (dup >= 0) return gguf_fail(g, "duplicate %s '%s'", kind, nm);
    return 1;
}

static int gguf_need(gguf_ctx *g, uint64_t n, const char *what) {
    if (n <= g->size - g->pos) return 1;
    return gguf_fail(g, "truncated file: %s at offset %zu runs past end of file (size %zu)",
                     what, g->pos, g->size);
}

static int gguf_rd32(gguf_ctx *g, const char *what, uint32_t *v) {
    if (!gguf_need(g, 4, what)) return 0;
    *v = gguf_le32(g->buf + g->pos);
    g->pos += 4;
    return 1;
}

static int gguf_rd64(gguf_ctx *g, const char *what, uint64_t *v) {
    if (!gguf_need(g, 8, what)) return 0;
    *v = gguf_le64(g->buf + g->pos);
    g->pos += 8;
    return 1;
}

static int gguf_rdstr(gguf_ctx *g, const char *what, gguf_str *s) {
    uint64_t n;
    if (!gguf_rd64(g, what, &n)) return 0;
    if (n > g->size - g->pos)
        return gguf_fail(g, "%s: string length %llu at offset %zu runs past end of file (size %zu)",
                         what, (unsigned long long)n, g->pos - 8, g->size);
    s->s = g->buf + g->pos;
    s->n = n;
    g->pos += (size_t)n;
    return 1;
}

/* Steps over one metadata value of the given type, checking every length. */
static int gguf_skip_value(gguf_ctx *g, uint32_t type, int depth, const char *what) {
    if (type >= GGUF_T_COUNT)
        return gguf_fail(g, "%s has unknown value type %u", what, type);
    if (type == GGUF_T_STRING) {
        gguf_str s;
        return gguf_rdstr(g, what, &s);
    }
    if (type != GGUF_T_ARRAY) {
        if (!gguf_need(g, gguf_type_size[type], what)) return 0;
        g->pos += gguf_type_size[type];
        return 1;
    }
    uint32_t et;
    uint64_t n;
    size_t at = g->pos;
    if (!gguf_rd32(g, what, &et) || !gguf_rd64(g, what, &n)) return 0;
    if (et >= GGUF_T_COUNT)
        return gguf_fail(g, "%s: array at offset %zu has unknown element type %u", what, at, et);
    if (et == GGUF_T_ARRAY && depth + 1 >= GGUF_MAX_ARRAY_DEPTH)
        return gguf_fail(g, "%s: arrays nested deeper than %d levels", what, GGUF_MAX_ARRAY_DEPTH);
    uint64_t min = et == GGUF_T_STRING ? 8 : et == GGUF_T_ARRAY ? 12 : gguf_type_size[et];
    if (n > (g->size - g->pos) / min)
        return gguf_fail(g, "%s: array of %llu %s elements at offset %zu runs past end of file (size %zu)",
                         what, (unsigned long long)n, gguf_type_names[et], at, g->size);
    if (et != GGUF_T_STRING && et != GGUF_T_ARRAY) {
        g->pos += (size_t)(n * min);
        return 1;
    }
    for (uint64_t i = 0; i < n; i++)
        if (!gguf_skip_value(g, et, depth + 1, what)) return 0;
    return 1;
}

static const gguf_kv *gguf_find_kv(const gguf_ctx *g, const char *key) {
    gguf_str s = {(const uint8_t *)key, strlen(key)};
    int64_t i = gguf_set_find(&g->kset, s);
    return i < 0 ? NULL : &g->kv[i];
}

static gguf_tinfo *gguf_find_tensor(gguf_ctx *g, const char *name) {
    gguf_str s = {(const uint8_t *)name, strlen(name)};
    int64_t i = gguf_set_find(&g->tset, s);
    return i < 0 ? NULL : &g->t[i];
}

/* Integer of a scalar integer type at p; 0 if the type is not an integer.
 * u64 values above INT64_MAX read as INT64_MAX (always out of range). */
static int gguf_int_at(const uint8_t *p, uint32_t type, int64_t *v) {
    switch (type) {
    case GGUF_T_U8:  *v = p[0]; return 1;
    case GGUF_T_I8:  *v = (int8_t)p[0]; return 1;
    case GGUF_T_U16: *v = gguf_le16(p); return 1;
    case GGUF_T_I16: *v = (int16_t)gguf_le16(p); return 1;
    case GGUF_T_U32: *v = gguf_le32(p); return 1;
    case GGUF_T_I32: *v = (int32_t)gguf_le32(p); return 1;
    case GGUF_T_U64: { uint64_t u = gguf_le64(p); *v = u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u; return 1; }
    case GGUF_T_I64: *v = (int64_t)gguf_le64(p); return 1;
    default: return 0;
    }
}

static int gguf_is_int_type(uint32_t t) {
    return t <= GGUF_T_I32 || t == GGUF_T_U64 || t == GGUF_T_I64;
}

/* The GGUF-level pass: header, metadata, tensor directory, data layout. */
static int gguf_read(gguf_ctx *g) {
    char what[192], nm[128];

    if (!g->buf) return gguf_fail(g, "no GGUF image (NULL buffer)");
    if (g->size < 4) return gguf_fail(g, "file too small for a GGUF header (%zu bytes)", g->size);
    if (memcmp(g->buf, "GGUF", 4) != 0)
        return gguf_fail(g, "bad magic: not a GGUF file (first bytes %02x %02x %02x %02x)",
                         g->buf[0], g->buf[1], g->buf[2], g->buf[3]);
    g->pos = 4;
    uint32_t version;
    uint64_t n_tensors, n_kv;
    if (!gguf_rd32(g, "header version", &version)) return 0;
    if (version != GGUF_VERSION)
        return gguf_fail(g, "unsupported GGUF version %u (expected %d)", version, GGUF_VERSION);
    if (!gguf_rd64(g, "header tensor count", &n_tensors) || !gguf_rd64(g, "header key-value count", &n_kv))
        return 0;
    size_t left = g->size - g->pos;
    if (n_kv > left / GGUF_MIN_KV_BYTES)
        return gguf_fail(g, "key-value count %llu is impossible for a file of %zu bytes",
                         (unsigned long long)n_kv, g->size);
    if (n_tensors > left / GGUF_MIN_TINFO_BYTES ||
        n_kv * GGUF_MIN_KV_BYTES + n_tensors * GGUF_MIN_TINFO_BYTES > left)
        return gguf_fail(g, "tensor count %llu is impossible for a file of %zu bytes",
                         (unsigned long long)n_tensors, g->size);

    /* ---- metadata ---- */
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_kv kv;
        memset(&kv, 0, sizeof kv);
        snprintf(what, sizeof what, "key #%llu name", (unsigned long long)i);
        if (!gguf_rdstr(g, what, &kv.key)) return 0;
        snprintf(what, sizeof what, "key '%s'", gguf_show(nm, sizeof nm, kv.key));
        if (!gguf_rd32(g, what, &kv.type)) return 0;
        kv.val = g->pos;
        if (kv.type == GGUF_T_ARRAY && g->size - g->pos >= 12) {
            kv.arr_type = gguf_le32(g->buf + g->pos);
            kv.arr_n = gguf_le64(g->buf + g->pos + 4);
            kv.arr_data = g->pos + 12;
        }
        if (!gguf_skip_value(g, kv.type, 0, what)) return 0;
        gguf_kv *nk = gguf_room(g->kv, &g->cap_kv, g->n_kv, sizeof *nk, 64);
        if (!nk) return gguf_fail(g, "out of memory reading metadata");
        g->kv = nk;
        if (!gguf_file_name(g, &g->kset, kv.key, g->n_kv, "metadata", "key", nm)) return 0;
        g->kv[g->n_kv++] = kv;
    }

    /* ---- alignment ---- */
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *akv = gguf_find_kv(g, K_ALIGNMENT);
    if (akv) {
        int64_t a;
        if (!gguf_int_at(g->buf + akv->val, akv->type, &a))
            return gguf_fail(g, "key '%s' has type %s, expected u32", K_ALIGNMENT, gguf_type_names[akv->type]);
        if (a <= 0 || a > (int64_t)UINT32_MAX || (a & (a - 1)) != 0)
            return gguf_fail(g, "key '%s' = %lld is not a power of two", K_ALIGNMENT, (long long)a);
        g->alignment = (uint64_t)a;
    }

    /* ---- tensor directory ---- */
    for (uint64_t i = 0; i < n_tensors; i++) {
        gguf_tinfo t;
        memset(&t, 0, sizeof t);
        snprintf(what, sizeof what, "tensor #%llu name", (unsigned long long)i);
        if (!gguf_rdstr(g, what, &t.name)) return 0;
        if (t.name.n == 0 || t.name.n > GGUF_MAX_NAME)
            return gguf_fail(g, "tensor #%llu has a name of %llu bytes (expected 1..%d)",
                             (unsigned long long)i, (unsigned long long)t.name.n, GGUF_MAX_NAME);
        gguf_show(nm, sizeof nm, t.name);
        snprintf(what, sizeof what, "tensor '%s' info", nm);
        if (!gguf_rd32(g, what, &t.n_dims)) return 0;
        if (t.n_dims < 1 || t.n_dims > 4)
            return gguf_fail(g, "tensor '%s' has n_dims %u (expected 1..4)", nm, t.n_dims);
        t.ne[0] = t.ne[1] = t.ne[2] = t.ne[3] = 1;
        uint64_t nel = 1;
        for (uint32_t j = 0; j < t.n_dims; j++) {
            uint64_t u;
            if (!gguf_rd64(g, what, &u)) return 0;
            int64_t v = (int64_t)u;
            if (v < 1)
                return gguf_fail(g, "tensor '%s' has invalid dimension ne[%u] = %lld", nm, j, (long long)v);
            if ((uint64_t)v > (uint64_t)INT64_MAX / nel)
                return gguf_fail(g, "tensor '%s' element count overflows (ne[%u] = %lld)", nm, j, (long long)v);
            nel *= (uint64_t)v;
            t.ne[j] = v;
        }
        if (!gguf_rd32(g, what, &t.type)) return 0;
        if (!gguf_tensor_type_ok(t.type))
            return gguf_fail(g, "tensor '%s' has unsupported type %u (ds4 reads F32, F16, BF16, Q8_0, Q2_K, "
                             "Q4_K, IQ2_XXS, I32)", nm, t.type);
        if (t.type == DS4_TYPE_Q8_0 && t.ne[0] % DS4_QK8_0 != 0)
            return gguf_fail(g, "tensor '%s' has type Q8_0 but ne[0] = %lld is not a multiple of %d",
                             nm, (long long)t.ne[0], DS4_QK8_0);
        if (gguf_type_is_superblock(t.type) && t.ne[0] % DS4_QK_K != 0)
            return gguf_fail(g, "tensor '%s' has type %s but ne[0] = %lld is not a multiple of %d", nm,
                             gguf_tensor_type_name(t.type), (long long)t.ne[0], DS4_QK_K);
        t.nbytes = gguf_tensor_bytes(t.type, nel);
        if (t.nbytes == 0 || t.nbytes > (uint64_t)SIZE_MAX)
            return gguf_fail(g, "tensor '%s' byte size overflows", nm);
        if (!gguf_rd64(g, what, &t.offset)) return 0;
        gguf_tinfo *nt = gguf_room(g->t, &g->cap_t, g->n_t, sizeof *nt, 256);
        if (!nt) return gguf_fail(g, "out of memory reading tensor infos");
        g->t = nt;
        if (!gguf_file_name(g, &g->tset, t.name, g->n_t, "tensor infos", "tensor", nm)) return 0;
        g->t[g->n_t++] = t;
    }

    /* ---- data section ---- */
    uint64_t pad = (g->alignment - (uint64_t)g->pos % g->alignment) % g->alignment;
    g->data_start = (uint64_t)g->pos + pad;
    if (g->n_t > 0 && g->data_start > g->size)
        return gguf_fail(g, "data section starts at offset %llu, past end of file (size %zu)",
                         (unsigned long long)g->data_start, g->size);
    for (size_t i = 0; i < g->n_t; i++) {
        const gguf_tinfo *t = &g->t[i];
        gguf_show(nm, sizeof nm, t->name);
        if (t->offset % g->alignment != 0)
            return gguf_fail(g, "tensor '%s' data offset %llu is not a multiple of the alignment %llu",
                             nm, (unsigned long long)t->offset, (unsigned long long)g->alignment);
        uint64_t room = g->size - g->data_start;
        if (t->offset > room || t->nbytes > room - t->offset) {
            uint64_t a = t->offset > UINT64_MAX - g->data_start ? UINT64_MAX : g->data_start + t->offset;
            uint64_t b = t->nbytes > UINT64_MAX - a ? UINT64_MAX : a + t->nbytes;
            return gguf_fail(g, "tensor '%s' data [%llu, %llu) extends past end of file (size %zu)",
                             nm, (unsigned long long)a, (unsigned long long)b, g->size);
        }
    }
    return 1;
}

/* ======================================================================
 * Reader: deepseek4 keys.
 * ====================================================================== */

enum { KEY_OPTIONAL = 0, KEY_REQUIRED = 1 };
#define GGUF_I32MAX ((int64_t)INT32_MAX)

/* Each key reader returns 1 (present, valid), 0 (absent and optional) or -1 (error written). */
static int gguf_key_missing(gguf_ctx *g, const char *key, int req, const char *tname) {
    if (!req) return 0;
    gguf_fail(g, "missing key '%s' (%s)", key, tname);
    return -1;
}

static int gguf_key_wrong_type(gguf_ctx *g, const char *key, const gguf_kv *kv, const char *expected) {
    if (kv->type == GGUF_T_ARRAY && kv->arr_type < GGUF_T_COUNT)
        gguf_fail(g, "key '%s' has type array of %s, expected %s", key, gguf_type_names[kv->arr_type], expected);
    else
        gguf_fail(g, "key '%s' has type %s, expected %s", key,
                  kv->type < GGUF_T_COUNT ? gguf_type_names[kv->type] : "?", expected);
    return -1;
}

static int gguf_range_fail(gguf_ctx *g, const char *key, int64_t v, int64_t lo, int64_t hi) {
    if (lo == hi)
        gguf_fail(g, "key '%s' = %lld, expected %lld", key, (long long)v, (long long)lo);
    else
        gguf_fail(g, "key '%s' = %lld is out of range (expected %lld..%lld)", key,
                  (long long)v, (long long)lo, (long long)hi);
    return -1;
}

/* The required key `key`, an array of strings: NULL with the failure said when missing or not one. */
static const gguf_kv *gguf_key_strings(gguf_ctx *g, const char *key) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) { gguf_key_missing(g, key, KEY_REQUIRED, "array of strings"); return NULL; }
    if (kv->type != GGUF_T_ARRAY || kv->arr_type != GGUF_T_STRING) {
        gguf_key_wrong_type(g, key, kv, "array of strings");
        return NULL;
    }
    return kv;
}

static int gguf_key_int(gguf_ctx *g, const char *key, int req, int64_t lo, int64_t hi, int64_t *out) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) return gguf_key_missing(g, key, req, "u32");
    int64_t v;
    if (!gguf_int_at(g->buf + kv->val, kv->type, &v)) return gguf_key_wrong_type(g, key, kv, "u32");
    if (v < lo || v > hi) return gguf_range_fail(g, key, v, lo, hi);
    *out = v;
    return 1;
}

static int gguf_key_f32(gguf_ctx *g, const char *key, int req, float *out) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) return gguf_key_missing(g, key, req, "f32");
    if (kv->type != GGUF_T_F32) return gguf_key_wrong_type(g, key, kv, "f32");
    float f = gguf_lef32(g->buf + kv->val);
    if (!gguf_f32_finite(f)) {
        gguf_fail(g, "key '%s' = %g is not finite", key, (double)f);
        return -1;
    }
    *out = f;
    return 1;
}

static int gguf_key_bool(gguf_ctx *g, const char *key, int req, int *out) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) return gguf_key_missing(g, key, req, "bool");
    if (kv->type != GGUF_T_BOOL) return gguf_key_wrong_type(g, key, kv, "bool");
    *out = g->buf[kv->val] != 0;
    return 1;
}

static int gguf_key_str(gguf_ctx *g, const char *key, int req, gguf_str *out) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) return gguf_key_missing(g, key, req, "string");
    if (kv->type != GGUF_T_STRING) return gguf_key_wrong_type(g, key, kv, "string");
    out->n = gguf_le64(g->buf + kv->val);
    out->s = g->buf + kv->val + 8;
    return 1;
}

/* f32 or array of f32 (>= n entries): per-layer values into out[0..n_out). */
static int gguf_key_f32_or_arr(gguf_ctx *g, const char *key, int req, int n_need, int n_out, float *out) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) return gguf_key_missing(g, key, req, "f32 or array of f32");
    if (kv->type == GGUF_T_F32) {
        float f = gguf_lef32(g->buf + kv->val);
        if (!gguf_f32_finite(f) || f < 0) {
            gguf_fail(g, "key '%s' = %g is out of range (expected a finite value >= 0)", key, (double)f);
            return -1;
        }
        for (int i = 0; i < n_out; i++) out[i] = f;
        return 1;
    }
    if (kv->type != GGUF_T_ARRAY || kv->arr_type != GGUF_T_F32)
        return gguf_key_wrong_type(g, key, kv, "f32 or array of f32");
    if (kv->arr_n < (uint64_t)n_need) {
        gguf_fail(g, "key '%s' has %llu entries, expected at least %d (block_count)", key,
                  (unsigned long long)kv->arr_n, n_need);
        return -1;
    }
    for (int i = 0; i < n_out; i++) {
        float f = gguf_lef32(g->buf + kv->arr_data + (size_t)i * 4);
        if (!gguf_f32_finite(f) || f < 0) {
            gguf_fail(g, "key '%s'[%d] = %g is out of range (expected a finite value >= 0)", key, i, (double)f);
            return -1;
        }
        out[i] = f;
    }
    return 1;
}

static int gguf_float_fail(gguf_ctx *g, const char *key, float v, const char *expected) {
    gguf_fail(g, "key '%s' = %g is out of range (expected %s)", key, (double)v, expected);
    return 0;
}

/* Reads and checks every deepseek4 key into hp.  Returns 1 / 0 (error written). */
static int gguf_hparams(gguf_ctx *g, ds4_hparams *hp) {
    gguf_str s;
    int64_t v;
    float f;
    int r;
    char shown[128];

#define GG_INT(key, lo, hi, dst) do { \
        if (gguf_key_int(g, key, KEY_REQUIRED, lo, hi, &v) < 0) return 0; \
        dst = v; \
    } while (0)
#define GG_F32(key, dst) do { \
        if (gguf_key_f32(g, key, KEY_REQUIRED, &f) < 0) return 0; \
        dst = f; \
    } while (0)

    memset(hp, 0, sizeof *hp);

    if (gguf_key_str(g, K_ARCH, KEY_REQUIRED, &s) < 0) return 0;
    if (!gguf_streq(s, "deepseek4"))
        return gguf_fail(g, "key '%s' is '%s', expected 'deepseek4'", K_ARCH, gguf_show(shown, sizeof shown, s));

    GG_INT(K_CTX, 1, INT64_MAX, hp->n_ctx_train);
    GG_INT(K_EMBD, 1, GGUF_I32MAX, hp->n_embd);

    int64_t n_block, nextn = 0;
    GG_INT(K_BLOCKS, 1, 1 << 16, n_block);
    if (gguf_key_int(g, K_NEXTN, KEY_OPTIONAL, 0, n_block - 1, &nextn) < 0) return 0;
    if (nextn > 0) {
        /* as llama.cpp: the MTP blocks only count when their tensors are present; then every
         * tensor of the block must be (gguf_bind) */
        char probe[96];
        snprintf(probe, sizeof probe, "blk.%lld.nextn.eh_proj.weight", (long long)(n_block - nextn));
        if (!gguf_find_tensor(g, probe)) nextn = 0;
        if (nextn > 1)
            return gguf_fail(g, "key '%s' = %lld: ds4 reads one MTP block", K_NEXTN, (long long)nextn);
    }
    if (nextn && n_block > DS4_MAX_LAYERS)
        return gguf_fail(g, "key '%s' = %lld exceeds the ds4 limit of %d layers with the MTP block", K_BLOCKS,
                         (long long)n_block, DS4_MAX_LAYERS);
    if (n_block - nextn > DS4_MAX_LAYERS)
        return gguf_fail(g, "key '%s' = %lld exceeds the ds4 limit of %d layers", K_BLOCKS,
                         (long long)(n_block - nextn), DS4_MAX_LAYERS);
    g->n_block = (int)n_block;
    hp->n_layer = (int)(n_block - nextn);
    hp->n_mtp = (int)nextn;
    const int L = hp->n_layer, LM = L + hp->n_mtp;   /* LM: the layers with the MTP block's */

    r = gguf_key_int(g, K_VOCAB, KEY_OPTIONAL, 1, GGUF_I32MAX, &v);
    if (r < 0) return 0;
    if (r > 0) {
        hp->n_vocab = (int)v;
    } else {
        /* no vocab_size key: take it from token_embd {n_embd, n_vocab} */
        const gguf_tinfo *te = gguf_find_tensor(g, "token_embd.weight");
        if (!te || te->n_dims < 2 || te->ne[1] > GGUF_I32MAX)
            return gguf_fail(g, "missing key '%s' (u32) and no token_embd.weight to take it from", K_VOCAB);
        hp->n_vocab = (int)te->ne[1];
    }

    /* ---- attention ---- */
    GG_INT(K_HEADS, 1, GGUF_I32MAX, hp->n_head);
    if (gguf_key_int(g, K_HEADS_KV, KEY_OPTIONAL, 1, 1, &v) < 0) return 0;
    GG_INT(K_KEY_LEN, 2, GGUF_I32MAX, hp->head_dim);
    if (hp->head_dim % 2 != 0)
        return gguf_fail(g, "key '%s' = %d must be even", K_KEY_LEN, hp->head_dim);
    if (gguf_key_int(g, K_VAL_LEN, KEY_OPTIONAL, hp->head_dim, hp->head_dim, &v) < 0) return 0;
    GG_F32(K_RMS_EPS, hp->rms_eps);
    if (!(hp->rms_eps > 0)) return gguf_float_fail(g, K_RMS_EPS, hp->rms_eps, "> 0");
    GG_INT(K_Q_LORA, 1, GGUF_I32MAX, hp->q_lora);
    GG_INT(K_SWA, 1, GGUF_I32MAX, hp->n_swa);
    GG_INT(K_O_GROUPS, 1, GGUF_I32MAX, hp->o_groups);
    if (hp->n_head % hp->o_groups != 0)
        return gguf_fail(g, "key '%s' = %d does not divide %s = %d", K_O_GROUPS, hp->o_groups, K_HEADS, hp->n_head);
    GG_INT(K_O_LORA, 1, GGUF_I32MAX, hp->o_lora);
    GG_F32(K_COMP_BASE, hp->compress_rope_base);
    if (!(hp->compress_rope_base > 0)) return gguf_float_fail(g, K_COMP_BASE, hp->compress_rope_base, "> 0");

    /* compress_ratios: integer array, >= block_count entries, each 0, 4 or 128 */
    {
        const gguf_kv *kv = gguf_find_kv(g, K_RATIOS);
        if (!kv) return gguf_key_missing(g, K_RATIOS, KEY_REQUIRED, "array of u32"), 0;
        if (kv->type != GGUF_T_ARRAY || !gguf_is_int_type(kv->arr_type))
            return gguf_key_wrong_type(g, K_RATIOS, kv, "array of u32"), 0;
        if (kv->arr_n < (uint64_t)n_block)
            return gguf_fail(g, "key '%s' has %llu entries, expected at least %lld (block_count)",
                             K_RATIOS, (unsigned long long)kv->arr_n, (long long)n_block);
        size_t es = gguf_type_size[kv->arr_type];
        for (int64_t i = 0; i < n_block; i++) {
            gguf_int_at(g->buf + kv->arr_data + (size_t)i * es, kv->arr_type, &v);
            if (v != 0 && v != 4 && v != 128)
                return gguf_fail(g, "key '%s'[%lld] = %lld (expected 0, 4 or 128)", K_RATIOS,
                                 (long long)i, (long long)v);
            if (i < LM) hp->ratio[i] = (int)v;
        }
    }
    int any4 = 0;
    for (int i = 0; i < LM; i++) any4 |= hp->ratio[i] == 4;

    GG_INT(K_IDX_HEADS, any4 ? 1 : 0, GGUF_I32MAX, hp->idx_heads);
    GG_INT(K_IDX_DIM, any4 ? 2 : 0, GGUF_I32MAX, hp->idx_dim);
    GG_INT(K_IDX_TOPK, any4 ? 1 : 0, GGUF_I32MAX, hp->idx_topk);

    /* ---- RoPE ---- */
    GG_INT(K_ROPE_DIM, 2, GGUF_I32MAX, hp->n_rot);
    if (hp->n_rot % 2 != 0) return gguf_fail(g, "key '%s' = %d must be even", K_ROPE_DIM, hp->n_rot);
    if (hp->n_rot > hp->head_dim)
        return gguf_fail(g, "key '%s' = %d exceeds %s = %d", K_ROPE_DIM, hp->n_rot, K_KEY_LEN, hp->head_dim);
    if (any4) {
        if (hp->idx_dim % 2 != 0) return gguf_fail(g, "key '%s' = %d must be even", K_IDX_DIM, hp->idx_dim);
        if (hp->n_rot > hp->idx_dim)
            return gguf_fail(g, "key '%s' = %d exceeds %s = %d", K_ROPE_DIM, hp->n_rot, K_IDX_DIM, hp->idx_dim);
    }
    hp->rope_base = 10000.0f;
    if ((r = gguf_key_f32(g, K_ROPE_BASE, KEY_OPTIONAL, &f)) < 0) return 0;
    if (r > 0) {
        if (!(f > 0)) return gguf_float_fail(g, K_ROPE_BASE, f, "> 0");
        hp->rope_base = f;
    }
    hp->rope_yarn = 0;
    if ((r = gguf_key_str(g, K_ROPE_TYPE, KEY_OPTIONAL, &s)) < 0) return 0;
    if (r > 0) {
        if (gguf_streq(s, "yarn")) hp->rope_yarn = 1;
        else if (!gguf_streq(s, "none"))
            return gguf_fail(g, "key '%s' is '%s', expected 'yarn' or 'none'", K_ROPE_TYPE,
                             gguf_show(shown, sizeof shown, s));
    }
    hp->rope_factor = 1.0f;
    if ((r = gguf_key_f32(g, K_ROPE_FACTOR, KEY_OPTIONAL, &f)) < 0) return 0;
    if (r > 0 && f != 0.0f) {              /* 0 means "not set", as in llama.cpp */
        if (!(f > 0)) return gguf_float_fail(g, K_ROPE_FACTOR, f, "> 0");
        hp->rope_factor = f;
    }
    hp->rope_orig_ctx = hp->n_ctx_train > GGUF_I32MAX ? INT32_MAX : (int)hp->n_ctx_train;
    if ((r = gguf_key_int(g, K_ROPE_ORIG, KEY_OPTIONAL, 1, GGUF_I32MAX, &v)) < 0) return 0;
    if (r > 0) hp->rope_orig_ctx = (int)v;
    hp->yarn_beta_fast = 32.0f;
    hp->yarn_beta_slow = 1.0f;
    if ((r = gguf_key_f32(g, K_BETA_FAST, KEY_OPTIONAL, &f)) < 0) return 0;
    if (r > 0) hp->yarn_beta_fast = f;
    if ((r = gguf_key_f32(g, K_BETA_SLOW, KEY_OPTIONAL, &f)) < 0) return 0;
    if (r > 0) hp->yarn_beta_slow = f;

    /* ---- MoE ---- */
    GG_INT(K_EXPERTS, 1, GGUF_I32MAX, hp->n_expert);
    if (gguf_key_int(g, K_EXPERTS_USED, KEY_REQUIRED, 1, GGUF_I32MAX, &v) < 0) return 0;
    if (v > hp->n_expert)
        return gguf_fail(g, "key '%s' = %lld exceeds %s = %d", K_EXPERTS_USED, (long long)v, K_EXPERTS, hp->n_expert);
    hp->n_expert_used = (int)v;
    GG_INT(K_EXPERTS_SHARED, 1, GGUF_I32MAX, hp->n_expert_shared);
    {
        /* expert_feed_forward_length: integer, or per-layer integer array with one value */
        const gguf_kv *kv = gguf_find_kv(g, K_FF_EXP);
        if (!kv) return gguf_key_missing(g, K_FF_EXP, KEY_REQUIRED, "u32"), 0;
        if (kv->type == GGUF_T_ARRAY) {
            if (!gguf_is_int_type(kv->arr_type))
                return gguf_key_wrong_type(g, K_FF_EXP, kv, "u32"), 0;
            if (kv->arr_n < (uint64_t)L)
                return gguf_fail(g, "key '%s' has %llu entries, expected at least %d (block_count)",
                                 K_FF_EXP, (unsigned long long)kv->arr_n, L);
            size_t es = gguf_type_size[kv->arr_type];
            int64_t v0 = 0;
            for (int i = 0; i < L; i++) {
                gguf_int_at(g->buf + kv->arr_data + (size_t)i * es, kv->arr_type, &v);
                if (i == 0) v0 = v;
                if (v != v0)
                    return gguf_fail(g, "key '%s' differs between layers (%lld at layer 0, %lld at layer %d); "
                                     "ds4 needs one expert width", K_FF_EXP, (long long)v0, (long long)v, i);
            }
            v = v0;
            if (v < 1 || v > GGUF_I32MAX) return gguf_range_fail(g, K_FF_EXP, v, 1, GGUF_I32MAX), 0;
        } else if (gguf_key_int(g, K_FF_EXP, KEY_REQUIRED, 1, GGUF_I32MAX, &v) < 0) {
            return 0;
        }
        hp->n_ff_exp = (int)v;
    }
    GG_F32(K_EXP_SCALE, hp->expert_weights_scale);
    if (gguf_key_bool(g, K_EXP_NORM, KEY_REQUIRED, &hp->expert_weights_norm) < 0) return 0;
    GG_INT(K_GATING, 4, 4, hp->expert_gating_func);
    if (gguf_key_f32_or_arr(g, K_CLAMP_EXP, KEY_REQUIRED, (int)n_block, LM, hp->clamp_exp) < 0) return 0;
    if ((r = gguf_key_f32_or_arr(g, K_CLAMP_SHEXP, KEY_OPTIONAL, (int)n_block, LM, hp->clamp_shexp)) < 0) return 0;
    if (r == 0) memcpy(hp->clamp_shexp, hp->clamp_exp, sizeof hp->clamp_shexp);

    /* ---- hyper-connections, hash routing ---- */
    GG_INT(K_HC_COUNT, DS4_HC_MAX, DS4_HC_MAX, hp->n_hc);
    GG_INT(K_HC_ITERS, 1, 1000000, hp->sinkhorn_iters);
    GG_F32(K_HC_EPS, hp->hc_eps);
    if (!(hp->hc_eps >= 0)) return gguf_float_fail(g, K_HC_EPS, hp->hc_eps, ">= 0");
    GG_INT(K_HASH_LAYERS, 0, L, hp->n_hash_layers);

    /* ---- tokenizer: none (no_vocab) or byte-level BPE (gpt2) ---- */
    hp->has_vocab = 0;
    hp->voc_bos = hp->voc_eos = -1;
    if ((r = gguf_key_str(g, K_TOK_MODEL, KEY_OPTIONAL, &s)) < 0) return 0;
    if (r > 0 && !gguf_streq(s, "no_vocab")) {
        char shown[80];
        if (!gguf_streq(s, "gpt2"))
            return gguf_fail(g, "key '%s' = '%s' is not supported (ds4 reads 'gpt2' byte-level BPE or 'no_vocab')",
                             K_TOK_MODEL, gguf_show(shown, sizeof shown, s));
        const gguf_kv *ky = gguf_find_kv(g, K_TOK_TYPES);
        const gguf_kv *kt = gguf_key_strings(g, K_TOK_TOKENS);
        if (!kt) return 0;
        if (kt->arr_n != (uint64_t)hp->n_vocab)
            return gguf_fail(g, "key '%s' has %llu tokens, expected %d (the vocabulary size)", K_TOK_TOKENS,
                             (unsigned long long)kt->arr_n, hp->n_vocab);
        const gguf_kv *km = gguf_key_strings(g, K_TOK_MERGES);
        if (!km) return 0;
        if (km->arr_n > (uint64_t)INT32_MAX)
            return gguf_fail(g, "key '%s' has %llu merges", K_TOK_MERGES, (unsigned long long)km->arr_n);
        if (ky) {
            if (ky->type != GGUF_T_ARRAY || ky->arr_type != GGUF_T_I32) {
                gguf_key_wrong_type(g, K_TOK_TYPES, ky, "array of i32");
                return 0;
            }
            if (ky->arr_n != (uint64_t)hp->n_vocab)
                return gguf_fail(g, "key '%s' has %llu entries, expected %d", K_TOK_TYPES,
                                 (unsigned long long)ky->arr_n, hp->n_vocab);
            hp->voc_types = ky->arr_data;
        }
        gguf_str pre;
        if (gguf_key_str(g, K_TOK_PRE, KEY_REQUIRED, &pre) < 0) return 0;
        if (pre.n >= sizeof hp->voc_pre)
            return gguf_fail(g, "key '%s' is %llu bytes long", K_TOK_PRE, (unsigned long long)pre.n);
        memcpy(hp->voc_pre, pre.s, pre.n);
        hp->voc_pre[pre.n] = 0;
        int64_t v;
        if ((r = gguf_key_int(g, K_TOK_BOS, KEY_OPTIONAL, 0, hp->n_vocab - 1, &v)) < 0) return 0;
        if (r > 0) hp->voc_bos = (int)v;
        if ((r = gguf_key_int(g, K_TOK_EOS, KEY_OPTIONAL, 0, hp->n_vocab - 1, &v)) < 0) return 0;
        if (r > 0) hp->voc_eos = (int)v;
        hp->voc_tokens = kt->arr_data;
        hp->voc_merges = km->arr_data;
        hp->voc_n_merges = (int64_t)km->arr_n;
        hp->has_vocab = 1;
    }

#undef GG_INT
#undef GG_F32
    return 1;
}

/* ======================================================================
 * Reader: deepseek4 tensors.
 * ====================================================================== */

static void gguf_fmt_shape(char *out, size_t n, int n_dims, const int64_t *ne) {
    size_t p = 0;
    p += (size_t)snprintf(out + p, n - p, "{");
    for (int i = 0; i < n_dims && p < n; i++)
        p += (size_t)snprintf(out + p, n - p, "%s%lld", i ? ", " : "", (long long)ne[i]);
    if (p < n) snprintf(out + p, n - p, "}");
}

/* Finds, checks and binds one tensor of the convention. */
static int gguf_bind_one(gguf_ctx *g, const char *name, const char *wname, const gguf_tspec *sp,
                         int n_dims, const int64_t ne[4], ds4_weight *w) {
    gguf_tinfo *t = gguf_find_tensor(g, name);
    if (!t) return gguf_fail(g, "missing tensor '%s'", name);
    if (t->ne[0] != ne[0] || t->ne[1] != ne[1] || t->ne[2] != ne[2] || t->ne[3] != ne[3]) {
        char a[96], b[96];
        gguf_fmt_shape(a, sizeof a, (int)t->n_dims, t->ne);
        gguf_fmt_shape(b, sizeof b, n_dims, ne);
        return gguf_fail(g, "tensor '%s' has shape %s, expected %s", name, a, b);
    }
    int ok;
    const char *expected;
    switch (sp->cls) {
    case TC_MAT:
        ok = t->type == DS4_TYPE_F32 || t->type == DS4_TYPE_F16 || t->type == DS4_TYPE_BF16 ||
             t->type == DS4_TYPE_Q8_0 || gguf_type_is_superblock(t->type);
        expected = "F32, F16, BF16, Q8_0, Q2_K, Q4_K or IQ2_XXS";
        break;
    case TC_I32:
        ok = t->type == DS4_TYPE_I32;
        expected = "I32";
        break;
    case TC_APE:   /* the published Flash files store the ape tables as F16 */
        ok = t->type == DS4_TYPE_F32 || t->type == DS4_TYPE_F16;
        expected = "F32 or F16";
        break;
    default:
        ok = t->type == DS4_TYPE_F32;
        expected = "F32";
        break;
    }
    if (!ok)
        return gguf_fail(g, "tensor '%s' has type %s, expected %s", name, gguf_tensor_type_name(t->type), expected);
    t->used = 1;
    w->name = wname;
    w->type = (int)t->type;
    w->n_dims = n_dims;
    w->ne[0] = ne[0];
    w->ne[1] = ne[1];
    w->ne[2] = ne[2];
    w->nbytes = (size_t)t->nbytes;
    w->host = g->buf + g->data_start + t->offset;
    w->dev = NULL;
    return 1;
}

/* Parses "blk.N." at the start of a name; returns N or -1. */
static int64_t gguf_block_index(gguf_str s, uint64_t *after) {
    if (s.n < 6 || memcmp(s.s, "blk.", 4) != 0) return -1;
    uint64_t i = 4;
    int64_t n = 0;
    while (i < s.n && s.s[i] >= '0' && s.s[i] <= '9' && i < 14) n = n * 10 + (s.s[i++] - '0');
    if (i == 4 || i >= s.n || s.s[i] != '.') return -1;
    *after = i + 1;
    return n;
}

/* Block il's tensors: a trunk layer, or (il == n_layer) the MTP block's layer and its nextn
 * tensors. */
static int gguf_bind_layer(gguf_ctx *g, ds4_model *m, int il) {
    const ds4_hparams *hp = &m->hp;
    char name[128];
    int64_t ne[4];
    ds4_layer_w *lw = il < hp->n_layer ? &m->layers[il] : &m->mtp.layer;
    for (int id = 0; id < LT_COUNT; id++) {
        const gguf_tspec *sp = &gguf_layer_specs[id];
        if (!gguf_layer_has(sp->when, hp, il)) continue;
        snprintf(name, sizeof name, "blk.%d.%s", il, sp->name);
        int nd = gguf_layer_shape(id, hp, il, ne);
        ds4_weight *w = (ds4_weight *)((char *)lw + sp->off);
        if (!gguf_bind_one(g, name, sp->name, sp, nd, ne, w)) return 0;
    }
    for (int id = 0; il == hp->n_layer && id < NT_COUNT; id++) {
        const gguf_tspec *sp = &gguf_nextn_specs[id];
        snprintf(name, sizeof name, "blk.%d.%s", il, sp->name);
        if (sp->when == TS_OPTIONAL && !gguf_find_tensor(g, name)) continue;
        int nd = gguf_nextn_shape(id, hp, ne);
        if (!gguf_bind_one(g, name, sp->name, sp, nd, ne, (ds4_weight *)((char *)&m->mtp + sp->off))) return 0;
    }
    /* hash routing table: every id must name an expert */
    const ds4_weight *tw = &lw->tid2eid;
    if (tw->host) {
        const uint8_t *p = tw->host;
        int64_t k = tw->ne[0], rows = tw->ne[1];
        for (int64_t row = 0; row < rows; row++)
            for (int64_t j = 0; j < k; j++) {
                int32_t e = (int32_t)gguf_le32(p + (size_t)(row * k + j) * 4);
                if (e < 0 || e >= hp->n_expert)
                    return gguf_fail(g, "tensor 'blk.%d.ffn_gate_tid2eid.weight' row %lld has expert id %d "
                                     "(expected 0..%d)", il, (long long)row, e, hp->n_expert - 1);
            }
    }
    return 1;
}

/* The MTP block's bytes (not in weight_bytes). */
static size_t model_mtp_bytes(const ds4_model *m) {
    size_t n = 0;
    const ds4_weight *w = &m->mtp.eh_proj;   /* ds4_mtp_w is ds4_weights only */
    for (size_t i = 0; m->hp.n_mtp && i < sizeof m->mtp / sizeof *w; i++) n += w[i].nbytes;
    return n;
}

static int gguf_bind(gguf_ctx *g, ds4_model *m) {
    const ds4_hparams *hp = &m->hp;
    char name[128];
    int64_t ne[4];

    for (int id = 0; id < GT_COUNT; id++) {
        const gguf_tspec *sp = &gguf_global_specs[id];
        int nd = gguf_global_shape(id, hp, ne);
        if (!gguf_bind_one(g, sp->name, sp->name, sp, nd, ne, (ds4_weight *)((char *)m + sp->off))) return 0;
    }
    /* the trunk's layers, then the MTP block's (block n_layer: a layer and its nextn tensors) */
    for (int il = 0; il < hp->n_layer + hp->n_mtp; il++)
        if (!gguf_bind_layer(g, m, il)) return 0;

    /* anything else is an error, except MTP blocks and the vision routing bias */
    for (size_t i = 0; i < g->n_t; i++) {
        gguf_tinfo *t = &g->t[i];
        if (t->used) continue;
        uint64_t after = 0;
        int64_t blk = gguf_block_index(t->name, &after);
        if (blk >= 0) {
            gguf_str rest = {t->name.s + after, t->name.n - after};
            int mtp_block = blk >= hp->n_layer && blk < g->n_block;           /* nextn_predict_layers */
            int nextn = blk >= hp->n_layer && rest.n >= 6 && memcmp(rest.s, "nextn.", 6) == 0;
            int vl = blk < hp->n_layer && gguf_streq(rest, "exp_probs_b_vl.bias");
            if (mtp_block || nextn || vl) continue;
        }
        return gguf_fail(g, "unexpected tensor '%s'", gguf_show(name, sizeof name, t->name));
    }

    m->weight_bytes = 0;
    m->n_tensors = 0;
    for (size_t i = 0; i < g->n_t; i++)
        if (g->t[i].used) {
            m->weight_bytes += (size_t)g->t[i].nbytes;
            m->n_tensors++;
        }
    m->mtp_bytes = model_mtp_bytes(m);
    m->weight_bytes -= m->mtp_bytes;
    return 1;
}

/* The reader's tables (what gguf_read allocated). */
static void gguf_ctx_free(gguf_ctx *g) {
    free(g->kv);
    free(g->t);
    gguf_set_free(&g->kset);
    gguf_set_free(&g->tset);
}

int ds4_gguf_parse(ds4_model *m, const uint8_t *buf, size_t size, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    gguf_ctx g;
    memset(&g, 0, sizeof g);
    g.buf = buf;
    g.size = size;
    g.err = err;
    g.errlen = errlen;

    ds4_model *tm = calloc(1, sizeof *tm);
    int ok = 0;
    if (!m) gguf_fail(&g, "no model to fill (NULL)");
    else if (!tm) gguf_fail(&g, "out of memory");
    else ok = gguf_read(&g) && gguf_hparams(&g, &tm->hp) && gguf_bind(&g, tm);
    if (ok) {
        int owned = m->owned_kind;
        *m = *tm;
        m->owned_kind = owned;
        m->base = buf;
        m->size = size;
    }
    free(tm);
    gguf_ctx_free(&g);
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------------------
 * Thread pool
 *
 * The CPU backend splits every op into independent items (matrix rows,
 * (token, head) pairs, tokens) and hands contiguous ranges of items to a
 * fixed set of worker threads.  Each item's arithmetic does not depend on how
 * the items were split, so results are identical for any thread count.
 * ------------------------------------------------------------------------- */

typedef void (*ds4_task_fn)(void *arg, int64_t i0, int64_t i1);

#define DS4_MAX_THREADS 64

static struct {
    int             n;            /* threads including the caller */
    int             started;
    pthread_t       th[DS4_MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t  cv_work, cv_done;
    uint64_t        gen;
    int             pending;
    ds4_task_fn     fn;
    void           *arg;
    int64_t         n_items;
} g_pool = { .n = 0, .mu = PTHREAD_MUTEX_INITIALIZER,
             .cv_work = PTHREAD_COND_INITIALIZER, .cv_done = PTHREAD_COND_INITIALIZER };

static void pool_range(int idx, int n, int64_t n_items, int64_t *i0, int64_t *i1) {
    *i0 = n_items * idx / n;
    *i1 = n_items * (idx + 1) / n;
}

static void *pool_worker(void *p) {
    int idx = (int)(intptr_t)p;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&g_pool.mu);
        while (g_pool.gen == seen) pthread_cond_wait(&g_pool.cv_work, &g_pool.mu);
        seen = g_pool.gen;
        ds4_task_fn fn = g_pool.fn;
        void *arg = g_pool.arg;
        int64_t n_items = g_pool.n_items;
        int n = g_pool.n;
        pthread_mutex_unlock(&g_pool.mu);

        int64_t i0, i1;
        pool_range(idx, n, n_items, &i0, &i1);
        if (i1 > i0) fn(arg, i0, i1);

        pthread_mutex_lock(&g_pool.mu);
        if (--g_pool.pending == 0) pthread_cond_signal(&g_pool.cv_done);
        pthread_mutex_unlock(&g_pool.mu);
    }
    return NULL;
}

static int g_cpu_threads_wanted = 0;

void ds4_cpu_set_threads(int n) { g_cpu_threads_wanted = n; }

static void pool_start(void) {
    if (g_pool.started) return;
    int n = g_cpu_threads_wanted;
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    if (n > DS4_MAX_THREADS) n = DS4_MAX_THREADS;
    g_pool.n = n;
    for (int i = 1; i < n; i++) {
        if (pthread_create(&g_pool.th[i], NULL, pool_worker, (void *)(intptr_t)i) != 0) {
            g_pool.n = i;   /* run with the threads we got */
            break;
        }
    }
    g_pool.started = 1;
}

/* Run fn over [0, n_items) split across the pool; small jobs run inline. */
static void parallel_for(int64_t n_items, int64_t min_per_thread, ds4_task_fn fn, void *arg) {
    if (n_items <= 0) return;
    pool_start();
    if (g_pool.n <= 1 || n_items < 2 * min_per_thread) { fn(arg, 0, n_items); return; }
    pthread_mutex_lock(&g_pool.mu);
    g_pool.fn = fn;
    g_pool.arg = arg;
    g_pool.n_items = n_items;
    g_pool.pending = g_pool.n - 1;
    g_pool.gen++;
    pthread_cond_broadcast(&g_pool.cv_work);
    pthread_mutex_unlock(&g_pool.mu);

    int64_t i0, i1;
    pool_range(0, g_pool.n, n_items, &i0, &i1);
    if (i1 > i0) fn(arg, i0, i1);

    pthread_mutex_lock(&g_pool.mu);
    while (g_pool.pending > 0) pthread_cond_wait(&g_pool.cv_done, &g_pool.mu);
    pthread_mutex_unlock(&g_pool.mu);
}

/* ---------------------------------------------------------------------------
 * CPU backend: the specification
 *
 * Plain f32 loops.  Every op here is the definition the CUDA backend is
 * tested against (tests/test_backend_ops.c).  Dot products use eight float
 * partial sums (vectorisable without fast-math, and well within the 1e-5
 * agreement the references show); norms accumulate squares in double as
 * ggml does.
 * ------------------------------------------------------------------------- */

static float dot_f32(const float *a, const float *b, int64_t n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += a[i + j] * b[i + j];
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* Dequantize row `row` (counting across experts) of weight w into out[ne0]. */
static void dequant_row(const ds4_weight *w, int64_t row, float *out) {
    const int64_t K = w->ne[0];
    const uint8_t *p = (const uint8_t *)w->dev + (size_t)row * ds4_row_bytes(w->type, K);
    switch (w->type) {
    case DS4_TYPE_F32: memcpy(out, p, (size_t)K * 4); break;
    case DS4_TYPE_F16: {
        const uint16_t *h = (const uint16_t *)p;
        for (int64_t i = 0; i < K; i++) out[i] = ds4_f16_to_f32(h[i]);
    } break;
    case DS4_TYPE_BF16: {
        const uint16_t *h = (const uint16_t *)p;
        for (int64_t i = 0; i < K; i++) out[i] = ds4_bf16_to_f32(h[i]);
    } break;
    case DS4_TYPE_Q8_0: {
        for (int64_t b = 0; b < K / DS4_QK8_0; b++) {
            const uint8_t *blk = p + b * DS4_Q8_0_BLOCK_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = ds4_f16_to_f32(dh);
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < DS4_QK8_0; j++) out[b * DS4_QK8_0 + j] = d * (float)q[j];
        }
    } break;
    case DS4_TYPE_Q2_K: case DS4_TYPE_Q4_K: case DS4_TYPE_IQ2_XXS:
        ds4_quant_dequant(w->type, p, out, K);   /* ds4_quant.c: the block layouts */
        break;
    default: memset(out, 0, (size_t)K * 4); break;
    }
}

static void *cpu_alloc(size_t bytes) {
    void *p = NULL;
    if (bytes == 0) bytes = 64;
    if (posix_memalign(&p, 64, (bytes + 63) & ~(size_t)63) != 0) {
        fprintf(stderr, "ds4: out of host memory allocating %zu bytes\n", bytes);
        return NULL;
    }
    memset(p, 0, bytes);
    return p;
}
static void cpu_free(void *p) { free(p); }
static void cpu_memcpy(void *dst, const void *src, size_t bytes) { memmove(dst, src, bytes); }
static int  cpu_init(void) { pool_start(); return 0; }
static int  cpu_upload_weight(ds4_weight *w) { w->dev = (void *)w->host; return 0; }
static void cpu_release_weight(ds4_weight *w) { w->dev = NULL; }
static void cpu_synchronize(void) {}
/* A "Key: N kB" line of a /proc file, in bytes; 0 when absent. */
static size_t proc_kb(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    const size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl) && sscanf(line + kl, " %llu kB", &kb) == 1) break;
    fclose(f);
    return (size_t)kb * 1024;
}

/* What the process can still take: the kernel's MemAvailable, and under an address-space limit
 * (ulimit -v) what is left of it; (size_t)-1 when neither is known. */
static size_t cpu_mem_available(void) {
    size_t avail = proc_kb("/proc/meminfo", "MemAvailable:");
    if (!avail) avail = (size_t)-1;
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        const size_t used = proc_kb("/proc/self/status", "VmSize:");
        const size_t left = rl.rlim_cur > used ? (size_t)(rl.rlim_cur - used) : 0;
        if (left < avail) avail = left;
    }
    return avail;
}
/* The CPU runs every type the reader accepts. */
static int  cpu_supports_type(int t) { return t >= 0 && gguf_tensor_type_ok((uint32_t)t); }
/* The CPU backend keeps no per-context state: a session is a token. */
static char g_cpu_session;
static void *cpu_session_new(const ds4_limits *lim) { (void)lim; return &g_cpu_session; }
static void  cpu_session_free(void *s) { (void)s; }
static void *cpu_session_bind(void *s) { (void)s; return NULL; }
static void  cpu_session_stats(void *s, ds4_backend_stats *st, int reset) {
    (void)s; (void)reset;
    memset(st, 0, sizeof *st);
}
/* Nothing is recorded on the CPU: every region is issued. */
static int   cpu_region_begin(uint64_t key) { (void)key; return DS4_REGION_ISSUE; }
static int   cpu_region_end(uint64_t key) { (void)key; return 0; }
static void  cpu_session_reset(void *s) { (void)s; }

/* -- embed -- */
typedef struct { const ds4_weight *w; const int32_t *tok; int n_hc; float *x; } embed_args;
static void embed_task(void *a_, int64_t i0, int64_t i1) {
    embed_args *a = a_;
    const int64_t D = a->w->ne[0];
    for (int64_t t = i0; t < i1; t++) {
        float *x = a->x + t * a->n_hc * D;
        dequant_row(a->w, a->tok[t], x);
        for (int s = 1; s < a->n_hc; s++) memcpy(x + s * D, x, (size_t)D * 4);
    }
}
static void cpu_embed(const ds4_weight *w, const int32_t *tok, int nt, int n_hc, float *x) {
    embed_args a = { w, tok, n_hc, x };
    parallel_for(nt, 4, embed_task, &a);
}

/* -- rmsnorm -- */
typedef struct { const float *x, *w; float *y; int n; float eps; } rms_args;
static void rms_task(void *a_, int64_t i0, int64_t i1) {
    rms_args *a = a_;
    for (int64_t r = i0; r < i1; r++) {
        const float *x = a->x + r * a->n;
        float *y = a->y + r * a->n;
        double ss = 0.0;
        for (int i = 0; i < a->n; i++) ss += (double)(x[i] * x[i]);
        const float scale = 1.0f / sqrtf((float)(ss / a->n) + a->eps);
        if (a->w) for (int i = 0; i < a->n; i++) y[i] = x[i] * scale * a->w[i];
        else      for (int i = 0; i < a->n; i++) y[i] = x[i] * scale;
    }
}
static void cpu_rmsnorm(const float *x, const float *w, float *y, int rows, int n, float eps) {
    rms_args a = { x, w, y, n, eps };
    parallel_for(rows, 16, rms_task, &a);
}

/* -- matmul -- */
typedef struct { const ds4_weight *w; int64_t row0; const float *x; float *y; int nt;
                 int64_t N, K; int groups; int64_t R; } mm_args;
static void mm_task(void *a_, int64_t i0, int64_t i1) {
    mm_args *a = a_;
    float *row = NULL;
    if (a->w->type != DS4_TYPE_F32) row = malloc((size_t)a->K * 4);
    for (int64_t n = i0; n < i1; n++) {
        const float *wr;
        if (row) { dequant_row(a->w, a->row0 + n, row); wr = row; }
        else wr = (const float *)a->w->dev + (size_t)(a->row0 + n) * a->K;
        /* grouped projections read the slice of x that belongs to row n's group */
        const int64_t xoff = a->groups > 1 ? (n / a->R) * a->K : 0;
        const int64_t xstride = a->groups > 1 ? a->groups * a->K : a->K;
        for (int t = 0; t < a->nt; t++)
            a->y[(size_t)t * a->N + n] = dot_f32(wr, a->x + (size_t)t * xstride + xoff, a->K);
    }
    free(row);
}
static void cpu_matmul(const ds4_weight *w, int expert, const float *x, float *y, int nt) {
    mm_args a = { w, (int64_t)expert * w->ne[1], x, y, nt, w->ne[1], w->ne[0], 1, 0 };
    parallel_for(a.N, 8, mm_task, &a);
}
static void cpu_matmul_grouped(const ds4_weight *w, int groups, const float *x, float *y, int nt) {
    mm_args a = { w, 0, x, y, nt, w->ne[1], w->ne[0], groups, w->ne[1] / groups };
    parallel_for(a.N, 8, mm_task, &a);
}

/* -- mHC -- */
static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

typedef struct { const float *mix, *scale, *base, *x; int D, h, head; float eps; int iters;
                 float *y, *post, *comb; int n_mix; } hc_args;
static void hc_mix_task(void *a_, int64_t i0, int64_t i1) {
    hc_args *a = a_;
    const int h = a->h;
    for (int64_t t = i0; t < i1; t++) {
        const float *m = a->mix + t * a->n_mix;
        float pre[DS4_HC_MAX];
        for (int s = 0; s < h; s++) pre[s] = sigmoidf_(m[s] * a->scale[0] + a->base[s]) + a->eps;
        float *y = a->y + t * a->D;
        const float *x = a->x + t * h * a->D;
        for (int i = 0; i < a->D; i++) {
            float acc = 0.0f;
            for (int s = 0; s < h; s++) acc += pre[s] * x[s * a->D + i];
            y[i] = acc;
        }
        if (a->head) continue;
        for (int s = 0; s < h; s++)
            a->post[t * h + s] = 2.0f * sigmoidf_(m[h + s] * a->scale[1] + a->base[h + s]);
        float C[DS4_HC_MAX][DS4_HC_MAX];   /* C[a][b]: a destination, b source */
        for (int b = 0; b < h; b++) {
            float mx = -INFINITY;
            for (int d = 0; d < h; d++) {
                C[d][b] = m[2 * h + d + h * b] * a->scale[2] + a->base[2 * h + d + h * b];
                if (C[d][b] > mx) mx = C[d][b];
            }
            float sum = 0.0f;
            for (int d = 0; d < h; d++) { C[d][b] = expf(C[d][b] - mx); sum += C[d][b]; }
            for (int d = 0; d < h; d++) C[d][b] = C[d][b] / sum + a->eps;
        }
        for (int it = 0; it < a->iters; it++) {
            if (it > 0) {            /* row: normalise over destinations for each source */
                for (int b = 0; b < h; b++) {
                    float s = 0.0f;
                    for (int d = 0; d < h; d++) s += C[d][b];
                    s += a->eps;
                    for (int d = 0; d < h; d++) C[d][b] /= s;
                }
            }
            for (int d = 0; d < h; d++) {   /* col: normalise over sources for each destination */
                float s = 0.0f;
                for (int b = 0; b < h; b++) s += C[d][b];
                s += a->eps;
                for (int b = 0; b < h; b++) C[d][b] /= s;
            }
        }
        for (int d = 0; d < h; d++)
            for (int b = 0; b < h; b++) a->comb[t * h * h + d + h * b] = C[d][b];
    }
}
static void cpu_hc_mix(const float *mix, const float *scale, const float *base, const float *x,
                       int nt, int D, int n_hc, int head, float hc_eps, int iters,
                       float *y, float *post, float *comb) {
    hc_args a = { mix, scale, base, x, D, n_hc, head, hc_eps, iters, y, post, comb,
                  head ? n_hc : (2 + n_hc) * n_hc };
    parallel_for(nt, 4, hc_mix_task, &a);
}

typedef struct { const float *f, *xr, *post, *comb; int D, h; float *xo; } hcp_args;
static void hc_post_task(void *a_, int64_t i0, int64_t i1) {
    hcp_args *a = a_;
    const int h = a->h;
    for (int64_t t = i0; t < i1; t++) {
        const float *f = a->f + t * a->D, *xr = a->xr + t * h * a->D;
        const float *post = a->post + t * h, *comb = a->comb + t * h * h;
        float *xo = a->xo + t * h * a->D;
        for (int d = 0; d < h; d++)
            for (int i = 0; i < a->D; i++) {
                float acc = post[d] * f[i];
                for (int b = 0; b < h; b++) acc += comb[d + h * b] * xr[b * a->D + i];
                xo[d * a->D + i] = acc;
            }
    }
}
static void cpu_hc_post(const float *f, const float *x_res, const float *post, const float *comb,
                        int nt, int D, int n_hc, float *x_out) {
    hcp_args a = { f, x_res, post, comb, D, n_hc, x_out };
    parallel_for(nt, 4, hc_post_task, &a);
}

/* -- RoPE -- */
static void rope_cos_sin(const ds4_rope *rp, int p, float *cs /* [n_rot] cos,sin pairs */) {
    const float theta_scale = powf(rp->freq_base, -2.0f / (float)rp->n_rot);
    float theta = (float)p;
    for (int i = 0; i < rp->n_rot / 2; i++) {
        const float te = theta;
        const float ti = rp->freq_scale * te;
        float th = ti;
        if (rp->ext_factor != 0.0f) {
            const float y = ((float)i - rp->corr_lo) / fmaxf(0.001f, rp->corr_hi - rp->corr_lo);
            const float ramp = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * rp->ext_factor;
            th = ti * (1.0f - ramp) + te * ramp;
        }
        cs[2 * i] = cosf(th);
        cs[2 * i + 1] = sinf(th);
        theta *= theta_scale;
    }
}
typedef struct { float *x; int nh, dh, pos0, step, inv; const ds4_rope *rp; } rope_args;
static void rope_task(void *a_, int64_t i0, int64_t i1) {
    rope_args *a = a_;
    float cs[1024];
    const int off = a->dh - a->rp->n_rot;
    for (int64_t t = i0; t < i1; t++) {
        rope_cos_sin(a->rp, a->pos0 + (int)t * a->step, cs);
        for (int hh = 0; hh < a->nh; hh++) {
            float *v = a->x + (t * a->nh + hh) * a->dh + off;
            for (int i = 0; i < a->rp->n_rot / 2; i++) {
                const float c = cs[2 * i], s = a->inv ? -cs[2 * i + 1] : cs[2 * i + 1];
                const float x0 = v[2 * i], x1 = v[2 * i + 1];
                v[2 * i] = x0 * c - x1 * s;
                v[2 * i + 1] = x0 * s + x1 * c;
            }
        }
    }
}
static void cpu_rope_at(float *x, int nt, int nh, int dh, int pos0, int pos_step, const ds4_rope *rp, int inverse) {
    rope_args a = { x, nh, dh, pos0, pos_step, inverse, rp };
    parallel_for(nt, 4, rope_task, &a);
}

/* -- attention -- */
typedef struct { const float *q, *kv, *ring; int W, pos0, nt, H, d; const float *comp; int ratio;
                 const int32_t *topk; int k; const float *sinks; float scale; float *out; int cap;
                 float *probs; int ld; } att_args;   /* probs: attention_probs instead of out */
static void att_task(void *a_, int64_t i0, int64_t i1) {
    att_args *a = a_;
    float *s = malloc((size_t)a->cap * sizeof(float));
    const float **rows = malloc((size_t)a->cap * sizeof(*rows));
    for (int64_t it = i0; it < i1; it++) {
        const int t = (int)(it / a->H), hh = (int)(it % a->H);
        const int P = a->pos0 + t;
        const float *q = a->q + ((size_t)t * a->H + hh) * a->d;
        int n = 0;
        for (int p = P - a->W + 1 < 0 ? 0 : P - a->W + 1; p <= P; p++)
            rows[n++] = p >= a->pos0 ? a->kv + (size_t)(p - a->pos0) * a->d
                                     : a->ring + (size_t)(p % a->W) * a->d;
        if (a->ratio == 128) {
            for (int w = 0; w < (P + 1) / 128; w++) rows[n++] = a->comp + (size_t)w * a->d;
        } else if (a->ratio == 4) {
            for (int j = 0; j < a->k; j++) {
                const int32_t w = a->topk[(size_t)t * a->k + j];
                if (w >= 0) rows[n++] = a->comp + (size_t)w * a->d;
            }
        }
        float m = a->sinks[hh];
        for (int i = 0; i < n; i++) {
            s[i] = a->scale * dot_f32(q, rows[i], a->d);
            if (s[i] > m) m = s[i];
        }
        const double sink_e = exp((double)(a->sinks[hh] - m));
        double sum = sink_e;
        for (int i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
        const float inv = (float)(1.0 / sum);
        if (a->probs) {
            /* the weights w = s[i] * inv the rows get below, in the contract's columns */
            float *pr = a->probs + ((size_t)t * a->H + hh) * a->ld;
            const int n_win = ds4_win_rows(P, a->W);
            int col = 0, i = 0;
            for (; i < n_win; i++) pr[col++] = s[i] * inv;
            if (a->ratio == 128) {
                for (; i < n; i++) pr[col++] = s[i] * inv;
            } else if (a->ratio == 4) {
                for (int j = 0; j < a->k; j++) pr[col++] = a->topk[(size_t)t * a->k + j] >= 0 ? s[i++] * inv : 0.0f;
            }
            pr[col] = (float)sink_e * inv;
            continue;
        }
        float *o = a->out + ((size_t)t * a->H + hh) * a->d;
        for (int c = 0; c < a->d; c++) o[c] = 0.0f;
        for (int i = 0; i < n; i++) {
            const float w = s[i] * inv;
            for (int c = 0; c < a->d; c++) o[c] += w * rows[i][c];
        }
    }
    free(s);
    free(rows);
}
static void cpu_attention_at(const float *q, const float *kv, const float *ring, int W,
                          int pos0, int nt, int H, int d,
                          const float *comp, int ratio, const int32_t *topk, int k,
                          const float *sinks, float scale, float *out) {
    int cap = W + k + 1;
    if (ratio == 128) cap += (pos0 + nt) / 128;
    att_args a = { q, kv, ring, W, pos0, nt, H, d, comp, ratio, topk, k, sinks, scale, out, cap, NULL, 0 };
    parallel_for((int64_t)nt * H, 4, att_task, &a);
}

static void cpu_attention_probs(const float *q, const float *kv, const float *ring, int W, const ds4_step *step,
                                int nt, int H, int d, const float *comp, int ratio, const int32_t *topk, int k,
                                const float *sinks, float scale, float *probs, int ld) {
    const int pos0 = step->pos0;
    int cap = W + k + 1;
    if (ratio == 128) cap += (pos0 + nt) / 128;
    att_args a = { q, kv, ring, W, pos0, nt, H, d, comp, ratio, topk, k, sinks, scale, NULL, cap, probs, ld };
    parallel_for((int64_t)nt * H, 4, att_task, &a);
}

static void cpu_ring_store_at(float *ring, const float *rows, int slots, int width, int pos0, int nt) {
    for (int t = nt - slots < 0 ? 0 : nt - slots; t < nt; t++)
        memcpy(ring + (size_t)((pos0 + t) % slots) * width, rows + (size_t)t * width, (size_t)width * 4);
}

static void cpu_add_cyclic_at(float *x, const float *table, int pos0, int nt, int period, int n) {
    for (int t = 0; t < nt; t++) {
        const float *r = table + (size_t)((pos0 + t) % period) * n;
        float *xr = x + (size_t)t * n;
        for (int i = 0; i < n; i++) xr[i] += r[i];
    }
}

/* -- compressor pooling -- */
typedef struct { const float *kv, *sc, *skv, *ssc; int pos0, nt, ratio, c, dc, w0; float *out; } cp_args;
static void cp_task(void *a_, int64_t i0, int64_t i1) {
    cp_args *a = a_;
    const int width = a->c * a->dc, slots = a->c * a->ratio;
    for (int64_t i = i0; i < i1; i++) {
        const int s = (a->w0 + (int)i) * a->ratio;
        float *o = a->out + (size_t)i * a->dc;
        for (int ch = 0; ch < a->dc; ch++) {
            float ev[2 * 128], kvv[2 * 128];
            int n = 0;
            for (int half = (a->c == 2 ? 0 : 1); half < 2; half++) {
                const int start = half == 0 ? s - a->ratio : s;
                const int col = (a->c == 2 && half == 1) ? a->dc + ch : ch;
                for (int j = 0; j < a->ratio; j++) {
                    const int p = start + j;
                    if (p < 0) { ev[n] = -INFINITY; kvv[n] = 0.0f; n++; continue; }
                    const float *rk = p >= a->pos0 ? a->kv + (size_t)(p - a->pos0) * width
                                                   : a->skv + (size_t)(p % slots) * width;
                    const float *rs = p >= a->pos0 ? a->sc + (size_t)(p - a->pos0) * width
                                                   : a->ssc + (size_t)(p % slots) * width;
                    ev[n] = rs[col];
                    kvv[n] = rk[col];
                    n++;
                }
            }
            float mx = -INFINITY;
            for (int e = 0; e < n; e++) if (ev[e] > mx) mx = ev[e];
            float sum = 0.0f, acc = 0.0f;
            for (int e = 0; e < n; e++) {
                const float w = expf(ev[e] - mx);
                sum += w;
                acc += w * kvv[e];
            }
            o[ch] = acc / sum;
        }
    }
}
static void cpu_compress_pool_at(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                                 int pos0, int nt, int ratio, int c, int dc, float *out) {
    cp_args a = { kv, sc, st_kv, st_sc, pos0, nt, ratio, c, dc, ds4_emit_first(pos0, ratio), out };
    parallel_for(ds4_emit_count(pos0, nt, ratio), 1, cp_task, &a);
}

/* The ops as the contract has them: the position comes from the step block
 * (host memory on this backend). */
static void cpu_rope(float *x, int nt, int nh, int dh, const ds4_step *step, int pos_step, const ds4_rope *rp,
                     int inverse) {
    cpu_rope_at(x, nt, nh, dh, step->pos0, pos_step, rp, inverse);
}
static void cpu_attention(const float *q, const float *kv, const float *ring, int W,
                          const ds4_step *step, int nt, int H, int d,
                          const float *comp, int ratio, const int32_t *topk, int k,
                          const float *sinks, float scale, float *out) {
    cpu_attention_at(q, kv, ring, W, step->pos0, nt, H, d, comp, ratio, topk, k, sinks, scale, out);
}
static void cpu_ring_store(float *ring, const float *rows, int slots, int width, const ds4_step *step, int nt) {
    cpu_ring_store_at(ring, rows, slots, width, step->pos0, nt);
}
static void cpu_add_cyclic(float *x, const float *table, const ds4_step *step, int nt, int period, int n) {
    cpu_add_cyclic_at(x, table, step->pos0, nt, period, n);
}
static void cpu_compress_pool(const float *kv, const float *sc, const float *st_kv, const float *st_sc,
                              const ds4_step *step, int nt, int ratio, int c, int dc, float *out) {
    cpu_compress_pool_at(kv, sc, st_kv, st_sc, step->pos0, nt, ratio, c, dc, out);
}

/* -- lightning indexer --
 * Each query's top k visible rows by score, best first, ties to the lower row:
 * the order scored_cmp defines, which is total on finite scores, so the picks
 * are exactly the first k of the fully sorted list.  They are kept in place as
 * the rows stream past (an insertion into k sorted slots when a row beats the
 * worst kept one): about one comparison per row instead of a sort of up to
 * n_ctx/4 rows at every position.  A thread walks its queries tile by tile of
 * IX_CPU_TILE rows, so a tile is read from memory once for all of them; each
 * (query, row) score is the same arithmetic in any order. */
#define IX_CPU_TILE 512
typedef struct { float s; int32_t i; } scored;
static int scored_cmp(const scored *a, const scored *b) {
    if (a->s > b->s) return -1;
    if (a->s < b->s) return 1;
    return a->i < b->i ? -1 : a->i > b->i;
}
typedef struct { const float *q, *w; float ws; const float *rows; int pos0, Hi, di, ratio, k; int32_t *out; } ix_args;
static void ix_task(void *a_, int64_t i0, int64_t i1) {
    ix_args *a = a_;
    const int k = a->k, nq = (int)(i1 - i0), Hi = a->Hi, di = a->di;
    const float ws = a->ws;
    scored *best = malloc(((size_t)nq * (size_t)(k > 0 ? k : 1)) * sizeof(scored));
    int *kept = calloc((size_t)nq, sizeof(int));
    if (!best || !kept) ds4_fatal("out of memory (indexer)");
    const int n_max = ds4_comp_rows(a->pos0 + (int)i1 - 1, a->ratio);   /* the last query sees the most */
    for (int r0 = 0; r0 < n_max && k > 0; r0 += IX_CPU_TILE) {
        for (int64_t t = i0; t < i1; t++) {
            const int n_vis = ds4_comp_rows(a->pos0 + (int)t, a->ratio);
            const int r1 = n_vis < r0 + IX_CPU_TILE ? n_vis : r0 + IX_CPU_TILE;
            scored *bt = best + (size_t)(t - i0) * k;
            int *kt = &kept[t - i0];
            const float *qt = a->q + (size_t)t * Hi * di, *wt = a->w + (size_t)t * Hi;
            for (int r = r0; r < r1; r++) {
                const float *row = a->rows + (size_t)r * di;
                float acc = 0.0f;
                for (int h = 0; h < Hi; h++) {
                    const float qk = dot_f32(qt + (size_t)h * di, row, di);
                    acc += wt[h] * ws * (qk > 0.0f ? qk : 0.0f);   /* the weight scaled as scale() would */
                }
                /* rows come in increasing order, so a row that only ties the worst kept one loses */
                if (*kt == k && !(acc > bt[k - 1].s)) continue;
                const scored x = { acc, r };
                int j = *kt < k ? (*kt)++ : k - 1;             /* the free slot, or the worst one's */
                for (; j > 0 && scored_cmp(&x, &bt[j - 1]) < 0; j--) bt[j] = bt[j - 1];
                bt[j] = x;
            }
        }
    }
    for (int64_t t = i0; t < i1; t++)
        for (int j = 0; j < k; j++) a->out[(size_t)t * k + j] = j < kept[t - i0] ? best[(size_t)(t - i0) * k + j].i : -1;
    free(best);
    free(kept);
}
static void cpu_indexer_topk(const float *q, const float *w, float w_scale, const float *rows,
                             const ds4_step *step, int nt, int Hi, int di, int ratio, int k, int32_t *out) {
    ix_args a = { q, w, w_scale, rows, step->pos0, Hi, di, ratio, k, out };
    parallel_for(nt, 1, ix_task, &a);
}

/* -- MoE -- */
static void cpu_add(const float *x, const float *b, float *y, int64_t n);
static float softplusf_(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

static void cpu_moe_route(const float *logits, const float *bias, const ds4_weight *tid2eid,
                          const int32_t *tokens, int nt, int E, int k, int norm, float wscale,
                          int32_t *sel, float *wts) {
    float probs[1024], selp[1024];
    for (int t = 0; t < nt; t++) {
        const float *l = logits + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            probs[e] = sqrtf(softplusf_(l[e]));
            selp[e] = bias ? probs[e] + bias[e] : probs[e];
        }
        int32_t *st = sel + (size_t)t * k;
        if (tid2eid) {
            const int32_t *row = (const int32_t *)tid2eid->dev + (size_t)tokens[t] * tid2eid->ne[0];
            for (int j = 0; j < k; j++) st[j] = row[j];
        } else {
            for (int j = 0; j < k; j++) {
                int best = -1;
                for (int e = 0; e < E; e++) {
                    int taken = 0;
                    for (int q = 0; q < j; q++) if (st[q] == e) taken = 1;
                    if (taken) continue;
                    if (best < 0 || selp[e] > selp[best]) best = e;
                }
                st[j] = best;
            }
        }
        float *wt = wts + (size_t)t * k;
        float sum = 0.0f;
        for (int j = 0; j < k; j++) { wt[j] = probs[st[j]]; sum += wt[j]; }
        if (norm) {
            if (sum < 6.103515625e-5f) sum = 6.103515625e-5f;
            for (int j = 0; j < k; j++) wt[j] /= sum;
        }
        if (wscale != 0.0f)
            for (int j = 0; j < k; j++) wt[j] *= wscale;
    }
}

static void swiglu_range(const float *g, const float *u, float *y, int64_t i0, int64_t i1, float L) {
    for (int64_t i = i0; i < i1; i++) {
        float gg = g[i], uu = u[i];
        if (L > 1e-6f) {
            gg = fminf(gg, L);
            uu = fminf(fmaxf(uu, -L), L);
        }
        y[i] = gg / (1.0f + expf(-gg)) * uu;
    }
}
typedef struct { const float *g, *u; float *y; float L; } sw_args;
static void sw_task(void *a_, int64_t i0, int64_t i1) {
    sw_args *a = a_;
    swiglu_range(a->g, a->u, a->y, i0, i1, a->L);
}
static void cpu_swiglu(const float *g, const float *u, float *y, int64_t n, float limit) {
    sw_args a = { g, u, y, limit };
    parallel_for(n, 4096, sw_task, &a);
}

typedef struct { const float *x; const int32_t *sel; const float *wts; const ds4_weight *g, *u, *d;
                 int k; float L; float *out; } moe_args;
static void moe_task(void *a_, int64_t i0, int64_t i1) {
    moe_args *a = a_;
    const int64_t D = a->g->ne[0], F = a->g->ne[1];
    float *g = malloc((size_t)F * 4), *u = malloc((size_t)F * 4), *o = malloc((size_t)D * 4);
    for (int64_t t = i0; t < i1; t++) {
        float *out = a->out + t * D;
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        for (int j = 0; j < a->k; j++) {
            const int e = a->sel[t * a->k + j];
            const float w = a->wts[t * a->k + j];
            mm_args ga = { a->g, (int64_t)e * F, a->x + t * D, g, 1, F, D, 1, 0 };
            mm_task(&ga, 0, F);
            mm_args ua = { a->u, (int64_t)e * F, a->x + t * D, u, 1, F, D, 1, 0 };
            mm_task(&ua, 0, F);
            swiglu_range(g, u, g, 0, F, a->L);
            mm_args da = { a->d, (int64_t)e * D, g, o, 1, D, F, 1, 0 };
            mm_task(&da, 0, D);
            for (int64_t i = 0; i < D; i++) out[i] += w * o[i];
        }
    }
    free(g); free(u); free(o);
}
static void cpu_moe_experts(const float *x, const int32_t *sel, const float *wts,
                            const ds4_weight *gate, const ds4_weight *up, const ds4_weight *down,
                            int nt, int k, float clamp, const float *add, float *out) {
    const int64_t Dm = gate->ne[0];
    if (nt == 1) {
        /* one token: parallelise inside each projection instead of over tokens;
         * every element is computed by the same dot product either way */
        const int64_t D = gate->ne[0], F = gate->ne[1];
        float *g = malloc((size_t)F * 4), *u = malloc((size_t)F * 4), *o = malloc((size_t)D * 4);
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            cpu_matmul(gate, sel[j], x, g, 1);
            cpu_matmul(up, sel[j], x, u, 1);
            swiglu_range(g, u, g, 0, F, clamp);
            cpu_matmul(down, sel[j], g, o, 1);
            for (int64_t i = 0; i < D; i++) out[i] += wts[j] * o[i];
        }
        free(g); free(u); free(o);
    } else {
        moe_args a = { x, sel, wts, gate, up, down, k, clamp, out };
        parallel_for(nt, 1, moe_task, &a);
    }
    if (add) cpu_add(out, add, out, (int64_t)nt * Dm);
}

typedef struct { const float *a, *b; float *y; float s; } ew_args;
static void add_task(void *a_, int64_t i0, int64_t i1) {
    ew_args *a = a_;
    for (int64_t i = i0; i < i1; i++) a->y[i] = a->a[i] + a->b[i];
}
static void cpu_add(const float *x, const float *b, float *y, int64_t n) {
    ew_args a = { x, b, y, 0 };
    parallel_for(n, 8192, add_task, &a);
}
static void scale_task(void *a_, int64_t i0, int64_t i1) {
    ew_args *a = a_;
    for (int64_t i = i0; i < i1; i++) a->y[i] *= a->s;
}
static void cpu_scale(float *x, float s, int64_t n) {
    ew_args a = { NULL, NULL, x, s };
    parallel_for(n, 8192, scale_task, &a);
}
static void cpu_pair_rows(const float *a, const float *b, float *y, int rows, int rep, int64_t n) {
    for (int r = 0; r < rows; r++) {
        memcpy(y + (size_t)r * 2 * n, a + (size_t)(r / rep) * n, (size_t)n * sizeof(float));
        memcpy(y + (size_t)r * 2 * n + n, b + (size_t)r * n, (size_t)n * sizeof(float));
    }
}

/* -- fused ops: the compositions ds4_gpu.h defines them as -- */
static void cpu_hc_pre(const float *f, const float *x_res, float *x,
                       const ds4_weight *fn, const float *scale, const float *base, const float *norm_w,
                       int nt, int D, int n_hc, int head, float rms_eps, float hc_eps, int iters,
                       float *flat, float *mix, float *y, float *post, float *comb) {
    if (f) cpu_hc_post(f, x_res, post, comb, nt, D, n_hc, x);
    cpu_rmsnorm(x, NULL, flat, nt, n_hc * D, rms_eps);
    cpu_matmul(fn, 0, flat, mix, nt);
    cpu_hc_mix(mix, scale, base, x, nt, D, n_hc, head, hc_eps, iters, y, post, comb);
    cpu_rmsnorm(y, norm_w, y, nt, D, rms_eps);
}

static void cpu_matmul_multi(int n, const ds4_weight *const *w, float *const *y, float *x, int nt,
                             const float *norm_w, float eps, const float *const *add_tab, const ds4_step *step,
                             int period) {
    if (norm_w) cpu_rmsnorm(x, norm_w, x, nt, (int)w[0]->ne[0], eps);
    for (int i = 0; i < n; i++) {
        cpu_matmul(w[i], 0, x, y[i], nt);
        if (add_tab && add_tab[i]) cpu_add_cyclic(y[i], add_tab[i], step, nt, period, (int)w[i]->ne[1]);
    }
}

static void cpu_head_norm_rope(float *x, const float *w, int nt, int nh, float *x2, const float *w2, int nh2,
                               int dh, float eps, const ds4_step *step, const ds4_rope *rp) {
    cpu_rmsnorm(x, w, x, nt * nh, dh, eps);
    cpu_rope(x, nt, nh, dh, step, 1, rp, 0);
    if (nh2 > 0) {
        cpu_rmsnorm(x2, w2, x2, nt * nh2, dh, eps);
        cpu_rope(x2, nt, nh2, dh, step, 1, rp, 0);
    }
}

static void cpu_attention_step(const float *q, const float *kv, float *ring, int W, const ds4_step *step, int nt,
                               int H, int d, const float *comp, int ratio, const int32_t *topk, int k,
                               const float *sinks, float scale, const ds4_rope *rp, float *out) {
    cpu_attention(q, kv, ring, W, step, nt, H, d, comp, ratio, topk, k, sinks, scale, out);
    cpu_ring_store(ring, kv, W, d, step, nt);
    cpu_rope(out, nt, H, d, step, 1, rp, 1);
}

static void cpu_compressor_step(const float *kv, const float *sc, float *st_kv, float *st_sc,
                                const ds4_step *step, int nt, int ratio, int c, int dc, const float *norm_w,
                                float eps, const ds4_rope *rp, float *rows) {
    const int pos0 = step->pos0;
    const int w0 = ds4_emit_first(pos0, ratio), n_emit = ds4_emit_count(pos0, nt, ratio);
    if (n_emit > 0) {
        float *out = rows + (size_t)w0 * dc;
        cpu_compress_pool(kv, sc, st_kv, st_sc, step, nt, ratio, c, dc, out);
        cpu_rmsnorm(out, norm_w, out, n_emit, dc, eps);
        cpu_rope_at(out, n_emit, 1, dc, w0 * ratio, ratio, rp, 0);
    }
    cpu_ring_store(st_kv, kv, c * ratio, c * dc, step, nt);
    cpu_ring_store(st_sc, sc, c * ratio, c * dc, step, nt);
}

static void cpu_compressor_steps(int n, const ds4_compressor *cs, const ds4_step *step, int nt, float eps,
                                 const ds4_rope *rp) {
    for (int i = 0; i < n; i++)
        cpu_compressor_step(cs[i].kv, cs[i].sc, cs[i].st_kv, cs[i].st_sc, step, nt, cs[i].ratio, cs[i].c, cs[i].dc,
                            cs[i].norm_w, eps, rp, cs[i].rows);
}

static void cpu_indexer_step(float *q, const float *w, float w_scale, const float *rows, const ds4_step *step,
                             int nt, int Hi, int di, int ratio, int k, const ds4_rope *rp, int32_t *out) {
    cpu_rope(q, nt, Hi, di, step, 1, rp, 0);
    cpu_indexer_topk(q, w, w_scale, rows, step, nt, Hi, di, ratio, k, out);
}

static void cpu_moe_gate(const ds4_weight *gate_inp, const float *x, float *logits, const float *bias,
                         const ds4_weight *tid2eid, const int32_t *tokens, int nt, int E, int k, int norm,
                         float wscale, int32_t *sel, float *wts) {
    cpu_matmul(gate_inp, 0, x, logits, nt);
    cpu_moe_route(logits, bias, tid2eid, tokens, nt, E, k, norm, wscale, sel, wts);
}

static void cpu_matmul_swiglu(const ds4_weight *gate, const ds4_weight *up, const float *x, float *y, int nt,
                              float limit, float *g, float *u) {
    cpu_matmul(gate, 0, x, g, nt);
    cpu_matmul(up, 0, x, u, nt);
    cpu_swiglu(g, u, y, (int64_t)nt * gate->ne[1], limit);
}

static const ds4_backend g_cpu_backend = {
    .name = "cpu",
    .init = cpu_init, .alloc = cpu_alloc, .free = cpu_free,
    .upload = cpu_memcpy, .download = cpu_memcpy, .copy = cpu_memcpy,
    .upload_weight = cpu_upload_weight, .release_weight = cpu_release_weight,
    .synchronize = cpu_synchronize, .supports_type = cpu_supports_type, .mem_available = cpu_mem_available,
    .session_new = cpu_session_new, .session_free = cpu_session_free, .session_bind = cpu_session_bind,
    .session_stats = cpu_session_stats, .region_begin = cpu_region_begin, .region_end = cpu_region_end,
    .session_reset = cpu_session_reset,
    .embed = cpu_embed, .rmsnorm = cpu_rmsnorm, .matmul = cpu_matmul,
    .matmul_grouped = cpu_matmul_grouped, .hc_mix = cpu_hc_mix, .hc_post = cpu_hc_post,
    .rope = cpu_rope, .attention = cpu_attention, .ring_store = cpu_ring_store,
    .add_cyclic = cpu_add_cyclic, .compress_pool = cpu_compress_pool,
    .indexer_topk = cpu_indexer_topk, .moe_route = cpu_moe_route,
    .moe_experts = cpu_moe_experts, .swiglu = cpu_swiglu, .add = cpu_add, .scale = cpu_scale, .pair_rows = cpu_pair_rows,
    .hc_pre = cpu_hc_pre, .matmul_multi = cpu_matmul_multi, .head_norm_rope = cpu_head_norm_rope,
    .matmul_swiglu = cpu_matmul_swiglu, .attention_step = cpu_attention_step,
    .compressor_step = cpu_compressor_step, .moe_gate = cpu_moe_gate,
    .compressor_steps = cpu_compressor_steps, .indexer_step = cpu_indexer_step,
    .attention_probs = cpu_attention_probs,
};

const ds4_backend *ds4_backend_cpu(void) { return &g_cpu_backend; }

/* ---------------------------------------------------------------------------
 * Models: mapping a file, enumerating weights, uploading them
 * ------------------------------------------------------------------------- */

uint8_t *ds4_alloc_huge(size_t size) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (uint8_t *)p;
}
void ds4_free_huge(uint8_t *p, size_t size) { if (p) munmap(p, size); }

int ds4_tmp_path(const char *path, char **tmp) {
    struct stat st;
    *tmp = NULL;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) return 0;   /* a device or a pipe: in place */
    const size_t n = strlen(path) + 32;
    if (!(*tmp = malloc(n))) return -1;
    snprintf(*tmp, n, "%s.tmp-%ld", path, (long)getpid());
    return 0;
}

/* The ops take ape tables as F32 (ds4_gpu.h); an F16 table becomes an F32
 * copy the model owns (exact: every f16 is an f32). */
static int model_ape_to_f32(ds4_model *m, ds4_weight *w) {
    if (!w->host || w->type != DS4_TYPE_F16) return 0;
    const size_t n = (size_t)(w->ne[0] * w->ne[1] * w->ne[2]);
    float *f = malloc(n * sizeof(float));
    if (!f) return -1;
    const uint8_t *h = w->host;
    for (size_t i = 0; i < n; i++) f[i] = ds4_f16_to_f32((uint16_t)(h[2 * i] | (h[2 * i + 1] << 8)));
    m->ape_f32[m->n_ape_f32++] = f;
    w->host = f;
    w->type = DS4_TYPE_F32;
    w->nbytes = n * sizeof(float);
    return 0;
}

static int model_scan_finite(ds4_model *m, int which, char *err, size_t errlen);

static ds4_model *model_finish_open(ds4_model *m, const uint8_t *buf, size_t size, int kind,
                                    char *err, size_t errlen) {
    if (ds4_gguf_parse(m, buf, size, err, errlen) != 0) {
        free(m);
        return NULL;
    }
    m->base = buf;
    m->size = size;
    m->owned_kind = kind;
    if (model_scan_finite(m, 1, err, errlen) != 0) {
        m->owned_kind = 2;   /* the caller still owns buf */
        ds4_model_close(m);
        return NULL;
    }
    for (int il = 0; il < m->hp.n_layer + m->hp.n_mtp; il++)
        if (model_ape_to_f32(m, &layer_w_mut(m, il)->comp_ape) != 0 || model_ape_to_f32(m, &layer_w_mut(m, il)->idx_comp_ape) != 0) {
            errf(err, errlen, "out of memory converting the ape tables");
            m->owned_kind = 2;   /* the caller still owns buf */
            ds4_model_close(m);
            return NULL;
        }
    return m;
}

/* path mapped read-only into *p, *size: 0, or -1 with a line naming it as `what` (a model, an
 * MTP file). */
static int map_file(const char *path, const char *what, void **p, size_t *size, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) { errf(err, errlen, "cannot open %s '%s': %s", what, shown(path), strerror(errno)); return -1; }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        errf(err, errlen, "%s '%s' is not a regular file", what, shown(path));
        close(fd);
        return -1;
    }
    *size = (size_t)st.st_size;
    if (*size == 0) { errf(err, errlen, "%s '%s' is empty (0 bytes)", what, shown(path)); close(fd); return -1; }
    *p = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (*p == MAP_FAILED) { errf(err, errlen, "cannot map %s '%s': %s", what, shown(path), strerror(errno)); return -1; }
    return 0;
}

ds4_model *ds4_model_open(const char *path, char *err, size_t errlen) {
    void *p;
    size_t size;
    if (map_file(path, "model", &p, &size, err, errlen) != 0) return NULL;
    ds4_model *m = calloc(1, sizeof(*m));
    if (!m) { munmap(p, size); errf(err, errlen, "out of memory"); return NULL; }
    char e2[512];
    ds4_model *r = model_finish_open(m, p, size, 0, e2, sizeof(e2));
    if (!r) { munmap(p, size); errf(err, errlen, "%s: %s", path, e2); }
    return r;
}

ds4_model *ds4_model_open_memory(uint8_t *buf, size_t size, int take_ownership, char *err, size_t errlen) {
    ds4_model *m = calloc(1, sizeof(*m));
    if (!m) { errf(err, errlen, "out of memory"); return NULL; }
    return model_finish_open(m, buf, size, take_ownership ? 1 : 2, err, errlen);
}

/* ds4 --mtp FILE: the MTP block from a file of its own.  Such a file is the block split out of
 * a model that has it (`ds4 synth --mtp-file` writes one): a GGUF v3 deepseek4 file with that
 * model's keys (block_count = n_layer + 1, nextn_predict_layers = 1) and the block's tensors
 * alone, blk.<n_layer>.* under llama.cpp's names.  Every hyperparameter must be the model's
 * (mtp_hparams_match names the first key that is not); the block's own entries (its compress
 * ratio and clamps) come from the file.  Its tensors are bound, checked and scanned as a
 * model's are and stay mapped with it.  Before the model's weights go to a backend. */
static int mtp_hparams_match(const ds4_hparams *a, const ds4_hparams *b, const char **key) {
#define MH(f, k) do { if (a->f != b->f) { *key = k; return 0; } } while (0)
    MH(n_layer, K_BLOCKS); MH(n_ctx_train, K_CTX); MH(n_embd, K_EMBD); MH(n_vocab, K_VOCAB);
    MH(n_head, K_HEADS); MH(head_dim, K_KEY_LEN); MH(rms_eps, K_RMS_EPS); MH(q_lora, K_Q_LORA);
    MH(n_swa, K_SWA); MH(o_groups, K_O_GROUPS); MH(o_lora, K_O_LORA); MH(compress_rope_base, K_COMP_BASE);
    MH(idx_heads, K_IDX_HEADS); MH(idx_dim, K_IDX_DIM); MH(idx_topk, K_IDX_TOPK); MH(n_rot, K_ROPE_DIM);
    MH(rope_base, K_ROPE_BASE); MH(rope_yarn, K_ROPE_TYPE); MH(rope_factor, K_ROPE_FACTOR);
    MH(rope_orig_ctx, K_ROPE_ORIG); MH(yarn_beta_fast, K_BETA_FAST); MH(yarn_beta_slow, K_BETA_SLOW);
    MH(n_expert, K_EXPERTS); MH(n_expert_used, K_EXPERTS_USED); MH(n_expert_shared, K_EXPERTS_SHARED);
    MH(n_ff_exp, K_FF_EXP); MH(expert_weights_scale, K_EXP_SCALE); MH(expert_weights_norm, K_EXP_NORM);
    MH(expert_gating_func, K_GATING); MH(n_hc, K_HC_COUNT); MH(sinkhorn_iters, K_HC_ITERS);
    MH(hc_eps, K_HC_EPS); MH(n_hash_layers, K_HASH_LAYERS);
    for (int il = 0; il < a->n_layer; il++) {
        MH(ratio[il], K_RATIOS); MH(clamp_exp[il], K_CLAMP_EXP); MH(clamp_shexp[il], K_CLAMP_SHEXP);
    }
#undef MH
    return 1;
}

int ds4_model_attach_mtp(ds4_model *m, const char *path, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (m->hp.n_mtp) {
        errf(err, errlen, "the model has an MTP block already (blk.%d); --mtp FILE is for a model without one",
             m->hp.n_layer);
        return -1;
    }
    if (m->weights_backend) {
        errf(err, errlen, "an MTP file is read before the model's weights go to a backend");
        return -1;
    }
    void *p;
    size_t size;
    if (map_file(path, "MTP file", &p, &size, err, errlen) != 0) return -1;
    ds4_model *tm = calloc(1, sizeof *tm);   /* the block is bound here first: m changes only on success */
    char e2[512];
    e2[0] = 0;
    gguf_ctx g;
    memset(&g, 0, sizeof g);
    g.buf = p;
    g.size = size;
    g.err = e2;
    g.errlen = sizeof e2;
    const char *key = NULL;
    int ok = tm ? gguf_read(&g) && gguf_hparams(&g, &tm->hp) : gguf_fail(&g, "out of memory");
    const int L = ok ? tm->hp.n_layer : 0;
    if (ok && tm->hp.n_mtp != 1)
        ok = gguf_fail(&g, "it holds no MTP block (key '%s' and tensor 'blk.%d.nextn.eh_proj.weight')", K_NEXTN, L);
    if (ok && !mtp_hparams_match(&m->hp, &tm->hp, &key))
        ok = gguf_fail(&g, "key '%s' is not the model's: the block belongs to another model", key);
    if (ok) ok = gguf_bind_layer(&g, tm, L);
    for (size_t i = 0; ok && i < g.n_t; i++) {
        if (g.t[i].used) continue;
        char name[128];
        ok = gguf_fail(&g, "unexpected tensor '%s' (an MTP file holds blk.%d's tensors only)",
                       gguf_show(name, sizeof name, g.t[i].name), L);
    }
    gguf_ctx_free(&g);
    if (ok) {
        m->mtp = tm->mtp;
        m->hp.n_mtp = 1;
        m->hp.ratio[L] = tm->hp.ratio[L];
        m->hp.clamp_exp[L] = tm->hp.clamp_exp[L];
        m->hp.clamp_shexp[L] = tm->hp.clamp_shexp[L];
        m->mtp_bytes = model_mtp_bytes(m);
        const int n_ape = m->n_ape_f32;
        if (model_scan_finite(m, 2, e2, sizeof e2) != 0) ok = 0;
        else if (model_ape_to_f32(m, &m->mtp.layer.comp_ape) != 0 || model_ape_to_f32(m, &m->mtp.layer.idx_comp_ape) != 0) {
            snprintf(e2, sizeof e2, "out of memory converting the ape tables");
            ok = 0;
        }
        if (!ok) {                                /* m as it was */
            while (m->n_ape_f32 > n_ape) free(m->ape_f32[--m->n_ape_f32]);
            memset(&m->mtp, 0, sizeof m->mtp);
            m->hp.n_mtp = 0;
            m->mtp_bytes = 0;
        }
    }
    free(tm);
    if (!ok) {
        munmap(p, size);
        errf(err, errlen, "MTP file %s: %s", shown(path), e2);
        return -1;
    }
    m->mtp_base = p;
    m->mtp_size = size;
    return 0;
}

/* Every weight of the model, in file order of importance; NULL-host entries are absent tensors:
 * the weights of the trunk (mtp 0), then the MTP block's (mtp 1), or the MTP block's alone
 * (mtp 2). */
static int model_weights(ds4_model *m, ds4_weight **out, int cap, int mtp) {
    int n = 0;
#define W_(w) do { if ((w).host && n < cap) out[n++] = &(w); } while (0)
    if (mtp != 2) {
        W_(m->tok_embd); W_(m->output); W_(m->output_norm);
        W_(m->output_hc_fn); W_(m->output_hc_base); W_(m->output_hc_scale);
    }
    if (mtp && m->hp.n_mtp) {
        W_(m->mtp.eh_proj); W_(m->mtp.enorm); W_(m->mtp.hnorm);
        W_(m->mtp.embed_tokens); W_(m->mtp.shared_head_head); W_(m->mtp.shared_head_norm);
    }
    for (int il = mtp == 2 ? m->hp.n_layer : 0; il < m->hp.n_layer + (mtp ? m->hp.n_mtp : 0); il++) {
        ds4_layer_w *L = il < m->hp.n_layer ? &m->layers[il] : &m->mtp.layer;
        W_(L->attn_norm); W_(L->ffn_norm); W_(L->attn_sinks);
        W_(L->q_a); W_(L->q_a_norm); W_(L->q_b); W_(L->kv); W_(L->kv_a_norm); W_(L->out_a); W_(L->out_b);
        W_(L->hc_attn_fn); W_(L->hc_attn_base); W_(L->hc_attn_scale);
        W_(L->hc_ffn_fn); W_(L->hc_ffn_base); W_(L->hc_ffn_scale);
        W_(L->comp_kv); W_(L->comp_gate); W_(L->comp_ape); W_(L->comp_norm);
        W_(L->idx_proj); W_(L->idx_q_b); W_(L->idx_comp_kv); W_(L->idx_comp_gate);
        W_(L->idx_comp_ape); W_(L->idx_comp_norm);
        W_(L->gate_inp); W_(L->tid2eid); W_(L->exp_probs_b);
        W_(L->gate_exps); W_(L->up_exps); W_(L->down_exps);
        W_(L->gate_shexp); W_(L->up_shexp); W_(L->down_shexp);
    }
#undef W_
    return n;
}

#define DS4_MAX_WEIGHTS (16 + DS4_MAX_LAYERS * 40)

/* The load-time scan: every stored float of the file that is a number in its own right (F32,
 * F16 and BF16 values; the f16 scales of Q8_0, Q2_K, Q4_K and IQ2_XXS blocks) must be finite.
 * A NaN or Inf there (a damaged download, a bad quantizer) would otherwise surface as NaN
 * logits many steps later.  The quantized payloads (integers and grid indices) cannot hold a
 * non-finite value.  The scan reads every byte of the float tensors and one 16-bit scale per
 * block of the quantized ones, on the thread pool (its cost: bench/RESULTS.md). */
typedef struct { const uint8_t *p; int type; size_t unit; int64_t first; } scan_arg;

static int scan_bad(const uint8_t *u, int type) {
    switch (type) {
    case DS4_TYPE_F32: return (gguf_le32(u) & 0x7f800000u) == 0x7f800000u;
    case DS4_TYPE_F16: case DS4_TYPE_Q8_0: case DS4_TYPE_IQ2_XXS: return (gguf_le16(u) & 0x7c00) == 0x7c00;
    case DS4_TYPE_BF16: return (gguf_le16(u) & 0x7f80) == 0x7f80;
    case DS4_TYPE_Q4_K: return (gguf_le16(u) & 0x7c00) == 0x7c00 || (gguf_le16(u + 2) & 0x7c00) == 0x7c00;
    case DS4_TYPE_Q2_K: return (gguf_le16(u + 80) & 0x7c00) == 0x7c00 || (gguf_le16(u + 82) & 0x7c00) == 0x7c00;
    default: return 0;
    }
}

static void scan_task(void *a_, int64_t i0, int64_t i1) {
    scan_arg *a = a_;
    for (int64_t i = i0; i < i1; i++) {
        if (!scan_bad(a->p + (size_t)i * a->unit, a->type)) continue;
        int64_t cur = __atomic_load_n(&a->first, __ATOMIC_RELAXED);
        while ((cur < 0 || i < cur) && !__atomic_compare_exchange_n(&a->first, &cur, i, 0, __ATOMIC_RELAXED,
                                                                     __ATOMIC_RELAXED)) {}
        return;                                  /* the first of this range; a lower one is another range's */
    }
}

/* which: model_weights' mtp (1: every weight, 2: the MTP block's) */
static int model_scan_finite(ds4_model *m, int which, char *err, size_t errlen) {
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    if (!ws) { errf(err, errlen, "out of memory"); return -1; }
    const int n = model_weights(m, ws, DS4_MAX_WEIGHTS, which);
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const ds4_weight *w = ws[i];
        size_t unit, per;                         /* bytes and elements per scanned unit */
        switch (w->type) {
        case DS4_TYPE_F32: unit = 4; per = 1; break;
        case DS4_TYPE_F16: case DS4_TYPE_BF16: unit = 2; per = 1; break;
        case DS4_TYPE_Q8_0: unit = DS4_Q8_0_BLOCK_BYTES; per = DS4_QK8_0; break;
        case DS4_TYPE_Q2_K: unit = DS4_Q2_K_BLOCK_BYTES; per = DS4_QK_K; break;
        case DS4_TYPE_Q4_K: unit = DS4_Q4_K_BLOCK_BYTES; per = DS4_QK_K; break;
        case DS4_TYPE_IQ2_XXS: unit = DS4_IQ2_XXS_BLOCK_BYTES; per = DS4_QK_K; break;
        default: continue;                        /* I32: integers */
        }
        scan_arg a = { w->host, w->type, unit, -1 };
        parallel_for((int64_t)(w->nbytes / unit), 1 << 16, scan_task, &a);
        if (a.first < 0) continue;
        const int64_t el = a.first * (int64_t)per, row = el / w->ne[0];
        errf(err, errlen, "tensor %s holds a NaN or Inf %s (element %lld: row %lld, column %lld); the file is damaged",
             w->name ? w->name : "?", per > 1 ? "block scale" : "value", (long long)el, (long long)row,
             (long long)(el - row * w->ne[0]));
        rc = -1;
    }
    free(ws);
    return rc;
}

static void model_release_weights(ds4_model *m) {
    if (!m->weights_backend) return;
    const ds4_backend *be = m->weights_backend;
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    int n = ws ? model_weights(m, ws, DS4_MAX_WEIGHTS, 1) : 0;
    for (int i = 0; i < n; i++) if (ws[i]->dev) be->release_weight(ws[i]);
    free(ws);
    m->weights_backend = NULL;
}

static int model_upload_weights(ds4_model *m, const ds4_backend *be, char *err, size_t errlen) {
    if (m->weights_backend == be) return 0;
    if (m->weights_backend) {
        errf(err, errlen, "model weights already live on backend '%s'; one backend per model",
             m->weights_backend->name);
        return -1;
    }
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    if (!ws) { errf(err, errlen, "out of memory"); return -1; }
    int n = model_weights(m, ws, DS4_MAX_WEIGHTS, 1);
    m->weights_backend = be;
    for (int i = 0; i < n; i++) {
        if (be->upload_weight(ws[i]) != 0) {
            /* the backend has printed its one line, naming the weight (ds4_gpu.h) */
            if (err && errlen) err[0] = 0;
            free(ws);
            model_release_weights(m);
            return -1;
        }
    }
    free(ws);
    return 0;
}

void ds4_model_close(ds4_model *m) {
    if (!m) return;
    model_release_weights(m);
    ds4_tok_free(m->tok);
    for (int i = 0; i < m->n_ape_f32; i++) free(m->ape_f32[i]);
    if (m->owned_kind == 0) munmap((void *)m->base, m->size);
    else if (m->owned_kind == 1) ds4_free_huge((uint8_t *)m->base, m->size);
    if (m->mtp_base) munmap((void *)m->mtp_base, m->mtp_size);
    free(m);
}

void   ds4_model_dims(const ds4_model *m, int *n_layer, int *n_embd, int *n_hc, int *n_expert_used) {
    *n_layer = m->hp.n_layer;
    *n_embd = m->hp.n_embd;
    *n_hc = m->hp.n_hc;
    *n_expert_used = m->hp.n_expert_used;
}
int    ds4_model_n_vocab(const ds4_model *m) { return m->hp.n_vocab; }
int64_t ds4_model_n_ctx_train(const ds4_model *m) { return m->hp.n_ctx_train; }
int    ds4_model_has_vocab(const ds4_model *m) { return m->hp.has_vocab; }
size_t ds4_model_weight_bytes(const ds4_model *m) { return m->weight_bytes; }

/* The tokenizer of a gpt2 vocabulary, built on first use from the arrays the
 * reader validated (every string lies inside the image). */
ds4_tok *ds4_model_tokenizer(ds4_model *m, char *err, size_t errlen) {
    const ds4_hparams *hp = &m->hp;
    if (m->tok) return m->tok;
    if (!hp->has_vocab) { errf(err, errlen, "the model has no vocabulary (tokenizer.ggml.model = no_vocab)"); return NULL; }
    const int n = hp->n_vocab;
    const int64_t nm = hp->voc_n_merges;
    const char **tp = malloc(sizeof(char *) * (size_t)n), **mp = malloc(sizeof(char *) * (size_t)(nm ? nm : 1));
    uint32_t *tl = malloc(sizeof(uint32_t) * (size_t)n), *ml = malloc(sizeof(uint32_t) * (size_t)(nm ? nm : 1));
    int32_t *ty = hp->voc_types ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (!tp || !mp || !tl || !ml || (hp->voc_types && !ty)) {
        errf(err, errlen, "out of memory building the tokenizer");
    } else {
        size_t at = hp->voc_tokens;
        for (int i = 0; i < n; i++) {
            const uint64_t len = gguf_le64(m->base + at);
            tp[i] = (const char *)m->base + at + 8;
            tl[i] = (uint32_t)(len > UINT32_MAX ? UINT32_MAX : len);
            at += 8 + (size_t)len;
        }
        at = hp->voc_merges;
        for (int64_t i = 0; i < nm; i++) {
            const uint64_t len = gguf_le64(m->base + at);
            mp[i] = (const char *)m->base + at + 8;
            ml[i] = (uint32_t)(len > UINT32_MAX ? UINT32_MAX : len);
            at += 8 + (size_t)len;
        }
        for (int i = 0; ty && i < n; i++) ty[i] = (int32_t)gguf_le32(m->base + hp->voc_types + (size_t)i * 4);
        m->tok = ds4_tok_new(n, tp, tl, ty, (int)nm, mp, ml, hp->voc_pre, err, errlen);
    }
    free(tp); free(mp); free(tl); free(ml); free(ty);
    return m->tok;
}

int ds4_model_bos(const ds4_model *m) { return m->hp.voc_bos; }
int ds4_model_eos(const ds4_model *m) { return m->hp.voc_eos; }

/* `ds4 info`: the tensor-type layout, parameters and bytes per type, the
 * device memory the weights need, and the bytes one decode step reads. */
void ds4_model_info(const ds4_model *m, FILE *f) {
    ds4_model_describe(m, f);
    enum { NT = 32 };
    uint64_t par[NT] = {0}, byt[NT] = {0}, cnt[NT] = {0};
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    if (!ws) return;
    const int n = model_weights((ds4_model *)m, ws, DS4_MAX_WEIGHTS, 1);
    for (int i = 0; i < n; i++) {
        const int t = ws[i]->type >= 0 && ws[i]->type < NT ? ws[i]->type : NT - 1;
        par[t] += (uint64_t)(ws[i]->ne[0] * ws[i]->ne[1] * ws[i]->ne[2]);
        byt[t] += ws[i]->nbytes;
        cnt[t]++;
    }
    free(ws);
    /* the backends of this build, each asked which types it takes */
    const ds4_backend *bes[2] = { ds4_backend_cpu(), NULL };
#ifdef DS4_CUDA
    bes[1] = ds4_backend_cuda();
#endif
    fprintf(f, "%-8s %8s %16s %12s  %s\n", "type", "tensors", "parameters", "GB", "backends");
    uint64_t tp = 0, tb = 0;
    for (int t = 0; t < NT; t++) {
        if (!cnt[t]) continue;
        char names[64] = "";
        for (int b = 0; b < 2; b++)
            if (bes[b] && bes[b]->supports_type(t))
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", names[0] ? ", " : "", bes[b]->name);
        fprintf(f, "%-8s %8llu %16llu %12.3f  %s\n", gguf_tensor_type_name((uint32_t)t), (unsigned long long)cnt[t],
                (unsigned long long)par[t], byt[t] / 1e9, names[0] ? names : "none in this build");
        tp += par[t];
        tb += byt[t];
    }
    fprintf(f, "%-8s %8d %16llu %12.3f\n", "total", n, (unsigned long long)tp, tb / 1e9);
    fprintf(f, "device memory for the weights: %.2f GB (plus the context: KV ring, compressed rows, activations)\n",
            tb / 1e9);
    fprintf(f, "weights read per decoded token: %.3f GB (dense weights, %d of %d experts per layer, one embedding row)\n",
            ds4_model_decode_bytes(m) / 1e9, m->hp.n_expert_used, m->hp.n_expert);
    fprintf(f, "tokenizer: %s\n", m->hp.has_vocab ? "vocabulary present" : "none (no_vocab: token ids are raw)");
#ifndef DS4_CUDA
    fprintf(f, "this build has the cpu backend only (make cuda CUDA_ARCH=... adds cuda)\n");
#endif
}

size_t ds4_model_decode_bytes(const ds4_model *m) {
    /* what one decode step must stream: every dense weight once, one row of
     * the embedding and of tid2eid, and k of E routed experts per layer */
    size_t total = 0;
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    if (!ws) return 0;
    int n = model_weights((ds4_model *)m, ws, DS4_MAX_WEIGHTS, 0);
    for (int i = 0; i < n; i++) {
        const ds4_weight *w = ws[i];
        if (w == &m->tok_embd) { total += ds4_row_bytes(w->type, w->ne[0]); continue; }
        int expert = 0, tid = 0;
        for (int il = 0; il < m->hp.n_layer; il++) {
            const ds4_layer_w *L = &m->layers[il];
            if (w == &L->gate_exps || w == &L->up_exps || w == &L->down_exps) expert = 1;
            if (w == &L->tid2eid) tid = 1;
        }
        if (tid) total += ds4_row_bytes(w->type, w->ne[0]);
        else if (expert) total += w->nbytes / (size_t)m->hp.n_expert * (size_t)m->hp.n_expert_used;
        else total += w->nbytes;
    }
    free(ws);
    return total;
}

void ds4_model_prefill_flops(const ds4_model *m, int64_t pos0, int64_t n, double out[2]) {
    const ds4_hparams *h = &m->hp;
    out[0] = out[1] = 0.0;
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    if (!ws) return;
    const int nw = model_weights((ds4_model *)m, ws, DS4_MAX_WEIGHTS, 0);
    double per_token = 0.0;           /* multiply-adds of one token through the weights */
    for (int i = 0; i < nw; i++) {
        const ds4_weight *w = ws[i];
        if (w->ne[1] <= 1 || w == &m->tok_embd || w == &m->output || w == &m->output_hc_fn) continue;
        double e = (double)w->ne[0] * (double)w->ne[1] * (double)(w->ne[2] > 0 ? w->ne[2] : 1);
        int table = 0, expert = 0;
        for (int il = 0; il < h->n_layer; il++) {
            const ds4_layer_w *L = &m->layers[il];
            if (w == &L->tid2eid || w == &L->comp_ape || w == &L->idx_comp_ape) table = 1;
            if (w == &L->gate_exps || w == &L->up_exps || w == &L->down_exps) expert = 1;
        }
        if (table) continue;
        if (expert) e = e / h->n_expert * h->n_expert_used;
        per_token += e;
    }
    free(ws);
    out[0] = 2.0 * (per_token * (double)n + (double)h->n_embd * h->n_vocab);
    for (int il = 0; il < h->n_layer; il++) {
        const int r = h->ratio[il];
        for (int64_t t = 0; t < n; t++) {
            const int P = (int)(pos0 + t);
            int64_t rows = ds4_win_rows(P, h->n_swa);
            if (r == 128) rows += ds4_comp_rows(P, 128);
            if (r == 4) {
                const int vis = ds4_comp_rows(P, 4);
                rows += vis < h->idx_topk ? vis : h->idx_topk;
                out[1] += 2.0 * h->idx_heads * h->idx_dim * vis;
            }
            out[1] += 4.0 * h->n_head * h->head_dim * (double)rows;
        }
    }
}

static const char *type_name(int t) {
    switch (t) {
    case DS4_TYPE_F32: return "f32"; case DS4_TYPE_F16: return "f16";
    case DS4_TYPE_BF16: return "bf16"; case DS4_TYPE_Q8_0: return "q8_0";
    case DS4_TYPE_Q2_K: return "q2_k"; case DS4_TYPE_Q4_K: return "q4_k";
    case DS4_TYPE_IQ2_XXS: return "iq2_xxs";
    case DS4_TYPE_I32: return "i32"; default: return "?";
    }
}

void ds4_model_describe(const ds4_model *m, FILE *f) {
    const ds4_hparams *h = &m->hp;
    int n4 = 0, n128 = 0;
    for (int i = 0; i < h->n_layer; i++) { n4 += h->ratio[i] == 4; n128 += h->ratio[i] == 128; }
    fprintf(f, "ds4: model: %d layers (%d ratio-4, %d ratio-128), hidden %d, vocab %d, %d heads x %d, "
               "window %d, %d experts top-%d, %s matrices, %.2f GB\n",
            h->n_layer, n4, n128, h->n_embd, h->n_vocab, h->n_head, h->head_dim, h->n_swa,
            h->n_expert, h->n_expert_used, type_name(m->layers[0].q_b.type), m->weight_bytes / 1e9);
    if (h->n_mtp)
        fprintf(f, "ds4: model: an MTP block (blk.%d, ratio %d, %s), %.2f GB; --mtp-draft speculates with it\n",
                h->n_layer, h->ratio[h->n_layer], type_name(m->mtp.eh_proj.type), m->mtp_bytes / 1e9);
}

int ds4_parse_wtype(const char *s) {
    if (!strcmp(s, "f32")) return DS4_TYPE_F32;
    if (!strcmp(s, "f16")) return DS4_TYPE_F16;
    if (!strcmp(s, "bf16")) return DS4_TYPE_BF16;
    if (!strcmp(s, "q8_0")) return DS4_TYPE_Q8_0;
    return -1;
}

/* The image of a synthetic model (config checked, *size bytes allocated and filled): NULL with err set. */
static uint8_t *synth_image(const char *config, uint64_t seed, int wtype, int n_threads, size_t *size,
                            char *err, size_t errlen) {
    if (!ds4_synth_config_ok(config)) {
        if (config && strchr(config, '@'))
            errf(err, errlen, "synthetic config '%s': unknown name or an expert count outside [top-k, 1024], or a "
                 "context length (/N) outside [1, %d]", shown(config), DS4_SYNTH_MAX_CTX);
        else
            errf(err, errlen, "unknown synthetic config '%s' (known: tiny, small, slim, flash16, small-q2, small-q4, flash-q2, flash-q4; NAME@E sets the expert count, NAME/N the context length)", shown(config));
        return NULL;
    }
    *size = ds4_synth_size(config, wtype);
    uint8_t *buf = ds4_alloc_huge(*size);
    if (!buf) { errf(err, errlen, "cannot allocate %zu bytes for the model image", *size); return NULL; }
    if (ds4_synth_fill(config, seed, wtype, buf, *size, n_threads, err, errlen) != 0) {
        ds4_free_huge(buf, *size);
        return NULL;
    }
    return buf;
}

int ds4_synth_write(const char *config, uint64_t seed, int wtype, const char *path,
                    int n_threads, char *err, size_t errlen) {
    size_t size;
    uint8_t *buf = synth_image(config, seed, wtype, n_threads, &size, err, errlen);
    if (!buf) return -1;
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) { errf(err, errlen, "cannot write '%s': %s", tmp, strerror(errno)); ds4_free_huge(buf, size); return -1; }
    size_t done = 0;
    while (done < size) {
        size_t n = fwrite(buf + done, 1, size - done > (64u << 20) ? (64u << 20) : size - done, f);
        if (n == 0) break;
        done += n;
    }
    int ok = done == size && fclose(f) == 0;
    if (!ok && done != size) fclose(f);
    ds4_free_huge(buf, size);
    if (!ok || rename(tmp, path) != 0) {
        errf(err, errlen, "cannot write '%s': %s", shown(path), strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

ds4_model *ds4_synth_open(const char *config, uint64_t seed, int wtype, int n_threads,
                          char *err, size_t errlen) {
    size_t size;
    uint8_t *buf = synth_image(config, seed, wtype, n_threads, &size, err, errlen);
    if (!buf) return NULL;
    ds4_model *m = ds4_model_open_memory(buf, size, 1, err, errlen);
    if (!m) ds4_free_huge(buf, size);
    return m;
}

/* ---------------------------------------------------------------------------
 * Contexts: KV window ring, compressed rows, compressor state, activations
 *
 * Per layer (d = head_dim, W = sliding window, r = ratio, c = 2 for ratio 4):
 *   ring     [W][d]            window rows; position p at slot p % W
 *   comp     [n_ctx/r + 1][d]  compressed rows, row w covers positions [w*r, w*r + r)
 *   st_kv/sc [c*r][c*d]        compressor inputs of the last c*r positions
 *   irows    [n_ctx/4 + 1][di] indexer compressed rows (ratio 4)
 *   ist_kv/sc[8][2*di]         indexer compressor state (ratio 4)
 *   ck       [K][rings' widths] a checkpoint's saved slots, K = DS4_CHECKPOINT_MAX rows of each
 *                              ring above (ring, st_kv, st_sc, ist_kv, ist_sc; ctx_rings)
 * ------------------------------------------------------------------------- */

typedef struct ds4_layer_state {
    float *ring;
    float *comp, *st_kv, *st_sc;
    float *irows, *ist_kv, *ist_sc;
    float *ck;
} ds4_layer_state;

/* A ring of a layer's state: the row of position p sits at slot p % slots. */
typedef struct { float *buf; int slots, width; } ctx_ring;

/* Layer il's position-indexed rings (buffers NULL before they are allocated): the window, and
 * the compressors' state.  Returns how many (at most 5). */
static int ctx_rings(const ds4_hparams *hp, const ds4_layer_state *S, int il, ctx_ring out[5]) {
    const int r = hp->ratio[il], d = hp->head_dim, di = hp->idx_dim;
    int n = 0;
    out[n++] = (ctx_ring){ S->ring, hp->n_swa, d };
    if (r) {
        const int cc = r == 4 ? 2 : 1;
        out[n++] = (ctx_ring){ S->st_kv, cc * r, cc * d };
        out[n++] = (ctx_ring){ S->st_sc, cc * r, cc * d };
    }
    if (r == 4) {
        out[n++] = (ctx_ring){ S->ist_kv, 8, 2 * di };
        out[n++] = (ctx_ring){ S->ist_sc, 8, 2 * di };
    }
    return n;
}

/* The floats of layer il's checkpoint rows (ck). */
static size_t ctx_ck_floats(const ds4_hparams *hp, int il) {
    const ds4_layer_state none = { 0 };
    ctx_ring rg[5];
    const int n = ctx_rings(hp, &none, il, rg);
    size_t w = 0;
    for (int i = 0; i < n; i++) w += (size_t)rg[i].width;
    return (size_t)DS4_CHECKPOINT_MAX * w;
}

struct ds4_ctx {
    ds4_model         *m;
    const ds4_backend *be;
    int                n_ctx, max_batch, pos;
    ds4_rope           rope_window;   /* ratio-0 layers: plain RoPE */
    ds4_rope           rope_comp;     /* compressed layers, compressor rows, indexer: YaRN */
    ds4_layer_state    L[DS4_MAX_LAYERS];
    void              *sess;      /* the backend's session: stream, scratch, counters */
    int                graphs;    /* record decode steps as regions (DS4_CUDA_GRAPHS) */
    int                graph_layers;  /* layers per region, 0 = the whole step (DS4_CUDA_GRAPH_LAYERS) */
    uint32_t           generation;    /* bumped by ds4_ctx_reset: part of every region key */
    ds4h_ctx          *hk;        /* DS4_HOOKS: the hooks module (ds4_hooks.c); NULL: hooks off */
    uint32_t           hcalls;    /* forward calls made */
    ds4_step          *step;      /* the step block (backend memory), written before each call */
    void              *step_host; /* its host image: the block, then the batch's tokens */
    /* activations, all [B][...] with B = max_batch */
    int32_t *tok;                 /* [B], right after the step block: one upload writes both */
    float   *x, *x2;              /* [B][hc][D] residual streams */
    float   *flat;                /* [B][hc*D] */
    float   *mix;                 /* [B][(2+hc)*hc] */
    float   *post, *comb;         /* [B][hc], [B][hc*hc] */
    float   *h;                   /* [B][D] sublayer input */
    float   *qr;                  /* [B][q_lora] */
    float   *q, *o;               /* [B][H*d] */
    float   *kv;                  /* [B][d] */
    float   *oa;                  /* [B][G*R] */
    float   *f;                   /* [B][D] sublayer output */
    float   *ckv, *csc;           /* [B][2*d] compressor rows */
    float   *ikv, *isc;           /* [B][2*di] indexer compressor rows */
    float   *iq;                  /* [B][Hi*di] */
    float   *iw;                  /* [B][Hi] */
    int32_t *topk;                /* [B][top_k] */
    float   *rlog;                /* [B][E] */
    int32_t *sel;                 /* [B][k] */
    float   *wts;                 /* [B][k] */
    float   *sg, *su;             /* [B][F*n_shared] */
    float   *sd;                  /* [B][D] */
    float   *logits;              /* [B][V] */
    void    *allocs[64 + 8 * DS4_MAX_LAYERS];
    int      n_allocs;
    size_t   bytes;               /* what the allocations took */
    ds4_progress_fn progress;     /* called between prefill chunks (ds4_ctx_set_progress) */
    void    *progress_user;
    int      last_rows;           /* rows of the last forward call (ds4_ctx_streams) */
    int      mtp_pos;             /* the MTP block's next position (ds4_mtp_eval) */
    int      mtp_rows;            /* rows of the last call when it was ds4_mtp_eval (ds4_mtp_streams) */
    struct { int pos, n; } ckp[2];  /* the checkpoint of each part (DS4_PART_*): position, width; n 0 = none */
    int      restore;             /* DS4_ROLLBACK_RESTORE: bit 1 << part, that part's slots are restored */
    float   *mtp_cat;             /* its eh_proj input [B][hc][2D] (a model with the block) */
    float   *mtp_q;               /* the head's queued input streams (ds4_mtp_queue): B + 1 rows of
                                     [hc][D], then a row of zeros (DS4_MTP_SRC_ZERO's source): B + 2 */
    int      mtp_nq;              /* rows queued */
};

/* DS4_HOOKS against the model (ds4.h); the hooks module checks it (ds4_hooks.c). */
int ds4_hooks_check(const ds4_model *m, const ds4_env *env, char *err, size_t errlen) {
    return ds4h_check(m->hp.n_layer, env, err, errlen);
}

int ds4_ctx_hooks_stats(ds4_ctx *c, ds4_hooks_stats *st) { return ds4h_stats(c->hk, st); }
int ds4_ctx_set_hook_sink(ds4_ctx *c, ds4_hook_sink fn, void *user, char *err, size_t errlen) {
    return ds4h_set_sink(c->hk, fn, user, err, errlen);
}
int ds4_ctx_hooks_hold(ds4_ctx *c, char *err, size_t errlen) { return ds4h_hold(c->hk, err, errlen); }
int ds4_ctx_hooks_commit(ds4_ctx *c, int pos_end, char *err, size_t errlen) {
    return ds4h_commit(c->hk, pos_end, err, errlen);
}

static void *ctx_alloc(ds4_ctx *c, size_t bytes, int *fail) {
    if (*fail) return NULL;
    void *p = c->be->alloc(bytes);
    if (!p) { *fail = 1; return NULL; }
    c->allocs[c->n_allocs++] = p;
    c->bytes += bytes;
    return p;
}

/* What ds4_ctx_new allocates, computed before it allocates: the buffers that scale with the
 * context (window ring, compressed and indexer rows, compressor state) and with the batch
 * (activations).  tests/test_kernels.c holds it to the allocations for small and large sizes. */
size_t ds4_ctx_plan_bytes(const ds4_model *m, int n_ctx, int max_batch) {
    const ds4_hparams *hp = &m->hp;
    if (max_batch <= 0) max_batch = 1;
    if (max_batch > n_ctx) max_batch = n_ctx;
    const size_t B = (size_t)max_batch, D = hp->n_embd, hc = hp->n_hc, d = hp->head_dim;
    const size_t di = hp->idx_dim, Hi = hp->idx_heads;
    const size_t F = (size_t)hp->n_ff_exp * (hp->n_expert_shared > 0 ? hp->n_expert_shared : 1);
    const size_t topk = hp->idx_topk > 0 ? hp->idx_topk : 1;
    size_t kv = 0;
    for (int il = 0; il < hp->n_layer + hp->n_mtp; il++) {      /* the MTP block's caches too */
        const size_t r = (size_t)hp->ratio[il], cc = r == 4 ? 2 : 1;
        kv += (size_t)hp->n_swa * d * 4;
        if (r) kv += ((size_t)n_ctx / r + 1) * d * 4 + 2 * cc * r * cc * d * 4;
        if (r == 4) kv += ((size_t)n_ctx / 4 + 1) * di * 4 + 2 * 8 * 2 * di * 4;
        kv += ctx_ck_floats(hp, il) * 4;
    }
    const size_t per_token = 4 * (1 + 3 * hc * D + (2 + hc) * hc + hc + hc * hc + D + hp->q_lora +
                                  2 * (size_t)hp->n_head * d + d + (size_t)hp->o_groups * hp->o_lora + D +
                                  4 * d + 4 * (di ? di : 1) + (Hi * di != 0 ? Hi * di : 1) + (Hi ? Hi : 1) + topk +
                                  hp->n_expert + 2 * (size_t)hp->n_expert_used + 2 * F + D + hp->n_vocab +
                                  (hp->n_mtp ? 3 * hc * D : 0));   /* the MTP head's eh_proj input, its queue */
    return kv + B * per_token + (hp->n_mtp ? 2 * (size_t)hc * D * 4 : 0);   /* the queue's two more rows */
}

size_t ds4_ctx_bytes(const ds4_ctx *c) { return c->bytes; }

/* YaRN correction range, computed as ggml does (float arithmetic). */
static float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return n_dims * logf((float)n_ctx_orig / (n_rot * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

static void ctx_init_rope(ds4_ctx *c) {
    const ds4_hparams *h = &c->m->hp;
    c->rope_window = (ds4_rope){ h->n_rot, h->rope_base, 1.0f, 0.0f, 0.0f, 0.0f };
    ds4_rope r = { h->n_rot, h->compress_rope_base, 1.0f, 0.0f, 0.0f, 0.0f };
    if (h->rope_yarn) {
        r.freq_scale = 1.0f / h->rope_factor;
        r.ext_factor = 1.0f;
        const int octx = h->rope_orig_ctx > 0 ? h->rope_orig_ctx : (int)h->n_ctx_train;
        /* llama.cpp fixes beta_fast = 32, beta_slow = 1 for this architecture */
        const float lo = floorf(yarn_corr_dim(h->n_rot, octx, 32.0f, h->compress_rope_base));
        const float hi = ceilf(yarn_corr_dim(h->n_rot, octx, 1.0f, h->compress_rope_base));
        r.corr_lo = fmaxf(0.0f, lo);
        r.corr_hi = fminf((float)(h->n_rot - 1), hi);
    } else if (h->rope_factor > 0.0f && h->rope_factor != 1.0f) {
        r.freq_scale = 1.0f / h->rope_factor;   /* linear scaling */
    }
    c->rope_comp = r;
}

/* The bytes the weights take on a backend: the CPU reads them where the file is mapped. */
static size_t model_backend_weight_bytes(const ds4_model *m, const ds4_backend *be) {
    return strcmp(be->name, "cpu") == 0 ? 0 : m->weight_bytes + m->mtp_bytes;   /* the MTP block goes up too */
}

ds4_ctx *ds4_ctx_new(ds4_model *m, const ds4_backend *be, int n_ctx, int max_batch,
                     char *err, size_t errlen) {
    const ds4_hparams *hp = &m->hp;
    if (n_ctx <= 0) { errf(err, errlen, "context size must be positive (got %d)", n_ctx); return NULL; }
    if ((int64_t)n_ctx > hp->n_ctx_train) {
        errf(err, errlen, "a context of %d positions is past the model's context_length %lld", n_ctx,
             (long long)hp->n_ctx_train);
        return NULL;
    }
    if (hp->n_rot > 1024 || hp->n_expert > 1024) {
        errf(err, errlen, "model exceeds ds4's limits (rope dims %d and experts %d must be <= 1024)",
             hp->n_rot, hp->n_expert);
        return NULL;
    }
    ds4_env env;
    if (ds4_env_read(&env, err, errlen) != 0) return NULL;
    /* the batch is a prefill chunk: at most DS4_UBATCH tokens, whatever the caller asks */
    if (max_batch <= 0) max_batch = 1;
    if (max_batch > env.ubatch) max_batch = env.ubatch;
    if (max_batch > n_ctx) max_batch = n_ctx;
    if (be->init() != 0) {
        /* the backend has printed its one line (ds4_gpu.h's convention); add nothing */
        if (err && errlen) err[0] = 0;
        return NULL;
    }
    /* the memory plan, checked before anything is allocated: the weights (when they are not on
     * this backend yet) and the context's buffers against what the backend has free */
    if (be->mem_available) {
        const size_t w = m->weights_backend == be ? 0 : model_backend_weight_bytes(m, be);
        const size_t cb = ds4_ctx_plan_bytes(m, n_ctx, max_batch), avail = be->mem_available();
        if (w + cb > avail) {
            errf(err, errlen, "a context of %d positions (batches of %d) needs %.2f GB on %s (weights %.2f GB, "
                 "context %.2f GB) and %.2f GB are available; give a smaller -c or DS4_UBATCH", n_ctx, max_batch, (w + cb) / 1e9,
                 be->name, w / 1e9, cb / 1e9, avail / 1e9);
            return NULL;
        }
    }
    if (model_upload_weights(m, be, err, errlen) != 0) return NULL;

    ds4_ctx *c = calloc(1, sizeof(*c));
    if (!c) { errf(err, errlen, "out of memory"); return NULL; }
    c->m = m; c->be = be; c->n_ctx = n_ctx; c->max_batch = max_batch;
    c->graphs = env.cuda_graphs;
    c->graph_layers = env.graph_layers;
    c->restore = env.rollback_restore;
    ctx_init_rope(c);

    const size_t B = (size_t)max_batch, D = hp->n_embd, hc = hp->n_hc, d = hp->head_dim;
    const size_t di = hp->idx_dim, Hi = hp->idx_heads, E = hp->n_expert, k = hp->n_expert_used;
    const size_t F = (size_t)hp->n_ff_exp * (hp->n_expert_shared > 0 ? hp->n_expert_shared : 1);
    const size_t topk = hp->idx_topk > 0 ? hp->idx_topk : 1;
    int fail = 0;
    for (int il = 0; il < hp->n_layer + hp->n_mtp; il++) {    /* the MTP block's attention has its own */
        ds4_layer_state *S = &c->L[il];
        const int r = hp->ratio[il];
        S->ring = ctx_alloc(c, (size_t)hp->n_swa * d * 4, &fail);
        if (r) {
            const size_t cc = r == 4 ? 2 : 1;
            S->comp = ctx_alloc(c, ((size_t)n_ctx / r + 1) * d * 4, &fail);
            S->st_kv = ctx_alloc(c, cc * r * cc * d * 4, &fail);
            S->st_sc = ctx_alloc(c, cc * r * cc * d * 4, &fail);
        }
        if (r == 4) {
            S->irows = ctx_alloc(c, ((size_t)n_ctx / 4 + 1) * di * 4, &fail);
            S->ist_kv = ctx_alloc(c, 8 * 2 * di * 4, &fail);
            S->ist_sc = ctx_alloc(c, 8 * 2 * di * 4, &fail);
        }
    }
    {   /* every layer's checkpoint rows in one allocation */
        size_t ck = 0;
        for (int il = 0; il < hp->n_layer + hp->n_mtp; il++) ck += ctx_ck_floats(hp, il);
        float *base = ctx_alloc(c, ck * 4, &fail);
        for (int il = 0; base && il < hp->n_layer + hp->n_mtp; il++) {
            c->L[il].ck = base;
            base += ctx_ck_floats(hp, il);
        }
    }
    c->step = ctx_alloc(c, sizeof(ds4_step) + B * 4, &fail);
    c->tok  = c->step ? (int32_t *)(c->step + 1) : NULL;
    c->step_host = malloc(sizeof(ds4_step) + B * 4);
    if (!c->step_host) fail = 1;
    c->x    = ctx_alloc(c, B * hc * D * 4, &fail);
    c->x2   = ctx_alloc(c, B * hc * D * 4, &fail);
    c->flat = ctx_alloc(c, B * hc * D * 4, &fail);
    c->mix  = ctx_alloc(c, B * (2 + hc) * hc * 4, &fail);
    c->post = ctx_alloc(c, B * hc * 4, &fail);
    c->comb = ctx_alloc(c, B * hc * hc * 4, &fail);
    c->h    = ctx_alloc(c, B * D * 4, &fail);
    c->qr   = ctx_alloc(c, B * hp->q_lora * 4, &fail);
    c->q    = ctx_alloc(c, B * hp->n_head * d * 4, &fail);
    c->o    = ctx_alloc(c, B * hp->n_head * d * 4, &fail);
    c->kv   = ctx_alloc(c, B * d * 4, &fail);
    c->oa   = ctx_alloc(c, B * (size_t)hp->o_groups * hp->o_lora * 4, &fail);
    c->f    = ctx_alloc(c, B * D * 4, &fail);
    c->ckv  = ctx_alloc(c, B * 2 * d * 4, &fail);
    c->csc  = ctx_alloc(c, B * 2 * d * 4, &fail);
    c->ikv  = ctx_alloc(c, B * 2 * (di ? di : 1) * 4, &fail);
    c->isc  = ctx_alloc(c, B * 2 * (di ? di : 1) * 4, &fail);
    c->iq   = ctx_alloc(c, B * ((Hi * di) != 0 ? Hi * di : 1) * 4, &fail);
    c->iw   = ctx_alloc(c, B * (Hi ? Hi : 1) * 4, &fail);
    c->topk = ctx_alloc(c, B * topk * 4, &fail);
    c->rlog = ctx_alloc(c, B * E * 4, &fail);
    c->sel  = ctx_alloc(c, B * k * 4, &fail);
    c->wts  = ctx_alloc(c, B * k * 4, &fail);
    c->sg   = ctx_alloc(c, B * F * 4, &fail);
    c->su   = ctx_alloc(c, B * F * 4, &fail);
    c->sd   = ctx_alloc(c, B * D * 4, &fail);
    c->logits = ctx_alloc(c, B * (size_t)hp->n_vocab * 4, &fail);
    if (hp->n_mtp) {
        c->mtp_cat = ctx_alloc(c, B * hc * 2 * D * 4, &fail);
        c->mtp_q = ctx_alloc(c, (B + 2) * hc * D * 4, &fail);   /* zero-filled: the last row stays so */
    }
    if (fail) {
        errf(err, errlen, "cannot allocate context buffers on backend '%s' (n_ctx %d, batch %d)",
             be->name, n_ctx, max_batch);
        ds4_ctx_free(c);
        return NULL;
    }
    /* everything the backend's ops will need, sized now: nothing is allocated
     * once the context exists */
    ds4_limits lim;
    memset(&lim, 0, sizeof lim);
    lim.max_batch = max_batch;
    lim.max_rows = hp->n_mtp ? max_batch * hp->n_hc : max_batch;   /* ds4_mtp_eval's eh_proj */
    lim.n_ctx = n_ctx;
    lim.n_embd = hp->n_embd;
    lim.n_head = hp->n_head;
    lim.head_dim = hp->head_dim;
    lim.idx_topk = hp->idx_topk;
    lim.n_swa = hp->n_swa;
    lim.n_expert = hp->n_expert;
    lim.n_expert_used = hp->n_expert_used;
    lim.n_ff_exp = hp->n_ff_exp;
    lim.n_vocab = hp->n_vocab;
    lim.graphs = env.cuda_graphs;
    lim.graph_cache = env.graph_cache;
    lim.graph_fail = env.graph_fail;
    lim.graph_pdl = env.graph_pdl;
    lim.eager_pdl = env.eager_pdl;
    lim.prefill_tc = env.prefill_tc;
    lim.prefill_attn = env.prefill_attn;
    lim.prefill_planes = env.prefill_planes;
    lim.decode_group = env.decode_group;
    lim.shared_stream = env.shared_stream;
    ds4_weight **ws = malloc(sizeof(*ws) * DS4_MAX_WEIGHTS);
    if (!ws) { errf(err, errlen, "out of memory"); ds4_ctx_free(c); return NULL; }
    const int nw = model_weights(m, ws, DS4_MAX_WEIGHTS, 1);
    for (int i = 0; i < nw; i++) {
        if (ws[i]->ne[0] > lim.max_k) lim.max_k = ws[i]->ne[0];
        if (ws[i]->ne[0] * ws[i]->ne[1] > lim.max_matrix) lim.max_matrix = ws[i]->ne[0] * ws[i]->ne[1];
    }
    free(ws);
    c->sess = be->session_new(&lim);
    if (!c->sess) {
        /* the backend has printed its one line */
        if (err && errlen) err[0] = 0;
        ds4_ctx_free(c);
        return NULL;
    }
    if (env.hooks) {
        const ds4h_host host = { be, c->sess, hp, c->n_ctx, c->max_batch };
        const int rc = ds4h_open(&c->hk, &host, &env, err, errlen);
        c->bytes += ds4h_device_bytes(c->hk);
        if (rc != 0) {
            ds4_ctx_free(c);
            return NULL;
        }
    }
    /* the context exists: the hook stream takes its target's place (ds4_tmp_path) */
    if (ds4h_start(c->hk, err, errlen) != 0) {
        ds4_ctx_free(c);
        return NULL;
    }
    return c;
}

void ds4_ctx_free(ds4_ctx *c) {
    if (!c) return;
    if (c->sess) c->be->session_free(c->sess);
    free(c->step_host);
    ds4h_close(c->hk);                          /* after the session: its emitter writes to the stream */
    for (int i = 0; i < c->n_allocs; i++) c->be->free(c->allocs[i]);
    free(c);
}

void ds4_ctx_stats(ds4_ctx *c, ds4_backend_stats *st, int reset) {
    c->be->session_stats(c->sess, st, reset);
}

int ds4_ctx_pos(const ds4_ctx *c) { return c->pos; }
/* The recordings of the old context go with it: they would replay correctly
 * (they bake no position), but keying on the generation keeps the promise
 * simple: nothing recorded before a reset runs after it. */
void ds4_ctx_reset(ds4_ctx *c) {
    c->pos = 0;
    c->mtp_pos = 0;
    c->last_rows = 0;
    c->mtp_rows = 0;
    c->mtp_nq = 0;
    c->ckp[0].n = c->ckp[1].n = 0;
    c->generation++;
    c->be->session_reset(c->sess);
}

/* Checkpoints (ds4.h, "taking positions back").  A part's layers, and its position. */
static int ck_part(ds4_ctx *c, int part, int *l0, int *l1, int **pos, char *err, size_t errlen) {
    const ds4_hparams *hp = &c->m->hp;
    if (part == DS4_PART_TRUNK) { *l0 = 0; *l1 = hp->n_layer; *pos = &c->pos; return 0; }
    if (part == DS4_PART_MTP && hp->n_mtp) { *l0 = hp->n_layer; *l1 = hp->n_layer + hp->n_mtp; *pos = &c->mtp_pos; return 0; }
    if (part == DS4_PART_MTP) errf(err, errlen, "the model has no MTP block");
    else errf(err, errlen, "unknown context part %d", part);
    return -1;
}

/* Rows i0 .. i1-1 of a checkpoint taken at position p0 (saved row i: position p0 + i) between
 * a ring and its saved rows: to_ring 0 saves them, 1 puts them back.  At most two copies (the
 * slots wrap once: a checkpoint is no wider than the ring). */
static void ck_copy(const ds4_backend *be, const ctx_ring *rg, float *saved, int p0, int i0, int i1, int to_ring) {
    while (i0 < i1) {
        const int slot = (p0 + i0) % rg->slots;
        const int k = i1 - i0 < rg->slots - slot ? i1 - i0 : rg->slots - slot;
        float *ring = rg->buf + (size_t)slot * rg->width, *sv = saved + (size_t)i0 * rg->width;
        const size_t bytes = (size_t)k * rg->width * 4;
        if (to_ring) be->copy(ring, sv, bytes);
        else be->copy(sv, ring, bytes);
        i0 += k;
    }
}

/* The same for every ring of layers [l0, l1), each ring's rows at its place in the layer's ck. */
static void ck_layers(ds4_ctx *c, int l0, int l1, int p0, int i0, int i1, int to_ring) {
    void *prev = c->be->session_bind(c->sess);
    for (int il = l0; il < l1; il++) {
        ctx_ring rg[5];
        const int nr = ctx_rings(&c->m->hp, &c->L[il], il, rg);
        float *saved = c->L[il].ck;
        for (int k = 0; k < nr; k++) {
            ck_copy(c->be, &rg[k], saved, p0, i0, i1, to_ring);
            saved += (size_t)DS4_CHECKPOINT_MAX * rg[k].width;
        }
    }
    c->be->session_bind(prev);
}

int ds4_ctx_checkpoint(ds4_ctx *c, int part, int n, char *err, size_t errlen) {
    int l0, l1, *pos;
    if (ck_part(c, part, &l0, &l1, &pos, err, errlen) != 0) return -1;
    if (n < 1 || n > DS4_CHECKPOINT_MAX) {
        errf(err, errlen, "a checkpoint of %d positions is outside [1, %d]", n, DS4_CHECKPOINT_MAX);
        return -1;
    }
    for (int il = l0; il < l1; il++) {
        ctx_ring rg[5];
        const int nr = ctx_rings(&c->m->hp, &c->L[il], il, rg);
        for (int k = 0; k < nr; k++)
            if (n > rg[k].slots) {
                errf(err, errlen, "a checkpoint of %d positions is wider than a ring of layer %d (%d slots)", n, il,
                     rg[k].slots);
                return -1;
            }
    }
    ck_layers(c, l0, l1, *pos, 0, n, 0);
    c->ckp[part].pos = *pos;
    c->ckp[part].n = n;
    return 0;
}

int ds4_ctx_rollback(ds4_ctx *c, int part, int to, char *err, size_t errlen) {
    int l0, l1, *pos;
    if (ck_part(c, part, &l0, &l1, &pos, err, errlen) != 0) return -1;
    const int p0 = c->ckp[part].pos, n = c->ckp[part].n, cur = *pos;
    if (!n) { errf(err, errlen, "no checkpoint to roll back to"); return -1; }
    if (cur > p0 + n) {
        errf(err, errlen, "position %d is past the checkpoint's %d positions from %d", cur, n, p0);
        return -1;
    }
    if (to < p0 || to > cur) {
        errf(err, errlen, "cannot roll back to position %d (the checkpoint is at %d, the position is %d)", to, p0, cur);
        return -1;
    }
    if (c->restore & (1 << part)) ck_layers(c, l0, l1, p0, to - p0, cur - p0, 1);
    *pos = to;
    int *rows = part == DS4_PART_TRUNK ? &c->last_rows : &c->mtp_rows;
    *rows = *rows > cur - to ? *rows - (cur - to) : 0;
    return 0;
}

/* ---------------------------------------------------------------------------
 * Forward pass
 *
 * One call processes nt tokens at positions pos0 .. pos0+nt-1 through every
 * layer, in the order of the architecture doc:
 *   mHC pre (attention site) -> RMSNorm -> attention (q/kv, compressors,
 *   indexer, sinks softmax, de-rotation, grouped output) -> mHC post ->
 *   mHC pre (FFN site) -> RMSNorm -> MoE (routing, experts, shared expert) ->
 *   mHC post; then the mHC head, RMSNorm and the output projection.
 * ------------------------------------------------------------------------- */

static void fwd_attention(ds4_ctx *c, int il, const float *hn, int nt, float *out) {
    const ds4_backend *be = c->be;
    const ds4_hparams *hp = &c->m->hp;
    const ds4_layer_w *L = layer_w(c->m, il);
    ds4_layer_state *S = &c->L[il];
    const int H = hp->n_head, d = hp->head_dim, ratio = hp->ratio[il];
    const int Hi = hp->idx_heads, di = hp->idx_dim;
    const ds4_rope *rp = ratio ? &c->rope_comp : &c->rope_window;

    /* every projection of the normed input hn in one call: the q latent, the
     * shared key/value row, and the compressors' kv and gate rows (+ ape) */
    const ds4_weight *pw[DS4_MULTI_MAX];
    float *py[DS4_MULTI_MAX];
    const float *pt[DS4_MULTI_MAX];
    int n = 0;
#define PROJ(w_, y_, t_) do { pw[n] = (w_); py[n] = (y_); pt[n] = (t_); n++; } while (0)
    PROJ(&L->q_a, c->qr, NULL);
    PROJ(&L->kv, c->kv, NULL);
    if (ratio) {
        PROJ(&L->comp_kv, c->ckv, NULL);
        PROJ(&L->comp_gate, c->csc, L->comp_ape.dev);
    }
    if (ratio == 4) {
        PROJ(&L->idx_comp_kv, c->ikv, NULL);
        PROJ(&L->idx_comp_gate, c->isc, L->idx_comp_ape.dev);
        PROJ(&L->idx_proj, c->iw, NULL);
    }
    be->matmul_multi(n, pw, py, (float *)hn, nt, NULL, 0.0f, pt, c->step, ratio ? ratio : 1);

    /* compressors: pool finished blocks into rows (normalised, rotated), then
     * remember the batch's kv and gate rows in their state rings.  They read only the call
     * above, so where the backend takes them beside the queries (side_begin) they are issued
     * now; else after the queries' norm, as below */
    const int k = ratio == 4 ? hp->idx_topk : 0;
    ds4_compressor cs[2];
    int ncs = 0;
    if (ratio) {
        cs[ncs++] = (ds4_compressor){ c->ckv, c->csc, S->st_kv, S->st_sc, ratio, ratio == 4 ? 2 : 1, d,
                                      L->comp_norm.dev, S->comp };
    }
    if (ratio == 4) {
        cs[ncs++] = (ds4_compressor){ c->ikv, c->isc, S->ist_kv, S->ist_sc, 4, 2, di, L->idx_comp_norm.dev,
                                      S->irows };
    }
    const int side = ncs && be->side_begin && be->side_begin(nt);
    if (side) {
        be->compressor_steps(ncs, cs, c->step, nt, hp->rms_eps, &c->rope_comp);
        be->side_end();
    }

    /* queries (and the indexer's) from the normed latent; one unweighted norm per head */
    n = 0;
    PROJ(&L->q_b, c->q, NULL);
    if (ratio == 4) PROJ(&L->idx_q_b, c->iq, NULL);
#undef PROJ
    be->matmul_multi(n, pw, py, c->qr, nt, L->q_a_norm.dev, hp->rms_eps, NULL, c->step, 1);
    /* the indexer's queries are rotated as its rows were, then score the rows: beside the
     * queries' norm where the compressors ran beside their projection */
    const float ix_scale = 1.0f / sqrtf((float)di * (float)Hi);
    const int ix_side = side && ratio == 4 && be->side_begin(nt);
    if (ix_side) {
        be->indexer_step(c->iq, c->iw, ix_scale, S->irows, c->step, nt, Hi, di, 4, k, &c->rope_comp, c->topk);
        be->side_end();
    }
    be->head_norm_rope(c->q, NULL, nt, H, c->kv, L->kv_a_norm.dev, 1, d, hp->rms_eps, c->step, rp);
    if (ncs && !side) be->compressor_steps(ncs, cs, c->step, nt, hp->rms_eps, &c->rope_comp);
    if (ratio == 4 && !ix_side)
        be->indexer_step(c->iq, c->iw, ix_scale, S->irows, c->step, nt, Hi, di, 4, k, &c->rope_comp, c->topk);
    if (side) be->side_join();

    /* the attn_probs hook: attention's weights, from the inputs attention_step is given
     * (before it stores this batch into the ring); one record per token, n+1 columns */
    int probs_ld;
    float *probs = ds4h_probs(c->hk, il, &probs_ld);
    if (probs) {
        be->attention_probs(c->q, c->kv, S->ring, hp->n_swa, c->step, nt, H, d, S->comp, ratio,
                            ratio == 4 ? c->topk : NULL, k, L->attn_sinks.dev, 1.0f / sqrtf((float)d), probs,
                            probs_ld);
        ds4h_emit_probs(c->hk, il, nt, ratio, k);
    }

    /* attention, the window ring update, and the query-position rotation
     * undone; then the grouped low-rank output */
    be->attention_step(c->q, c->kv, S->ring, hp->n_swa, c->step, nt, H, d, S->comp, ratio,
                       ratio == 4 ? c->topk : NULL, k, L->attn_sinks.dev, 1.0f / sqrtf((float)d), rp, c->o);
    be->matmul_grouped(&L->out_a, hp->o_groups, c->o, c->oa, nt);
    ds4h_join(c->hk);              /* out is c->f: the previous layer's records were made from it */
    be->matmul(&L->out_b, 0, c->oa, out, nt);
}

/* The MoE's shared expert of layer il: c->sd = down(swiglu(gate hn, up hn)). */
static void fwd_shared(ds4_ctx *c, const ds4_layer_w *L, int il, const float *hn, int nt) {
    c->be->matmul_swiglu(&L->gate_shexp, &L->up_shexp, hn, c->sg, nt, c->m->hp.clamp_shexp[il], c->sg, c->su);
    c->be->matmul(&L->down_shexp, 0, c->sg, c->sd, nt);
}

static void fwd_moe(ds4_ctx *c, int il, const float *hn, int nt, float *out) {
    const ds4_backend *be = c->be;
    const ds4_hparams *hp = &c->m->hp;
    const ds4_layer_w *L = layer_w(c->m, il);
    const int hash = il < hp->n_hash_layers;
    /* the shared expert (the routed experts' op adds it at the end): beside the routing and the
     * routed experts where the backend takes it (shared_begin), else after the routing */
    const float *shared = hp->n_expert_shared > 0 ? c->sd : NULL;
    const int side = shared && be->shared_begin && be->shared_begin(nt);
    if (side) {
        fwd_shared(c, L, il, hn, nt);
        be->shared_end();
    }
    be->moe_gate(&L->gate_inp, hn, c->rlog, hash ? NULL : L->exp_probs_b.dev, hash ? &L->tid2eid : NULL, c->tok,
                 nt, hp->n_expert, hp->n_expert_used, hp->expert_weights_norm,
                 hp->expert_weights_scale, c->sel, c->wts);
    if (shared && !side) fwd_shared(c, L, il, hn, nt);
    be->moe_experts(hn, c->sel, c->wts, &L->gate_exps, &L->up_exps, &L->down_exps,
                    nt, hp->n_expert_used, hp->clamp_exp[il], shared, out);
}

/* Hooks in the forward pass (ds4_hooks.h, "The engine's side").  A record is emitted after
 * the op that makes its tensor.  A device emitter's producers may run beside the ops issued
 * after them (ds4_gpu.h hooks_join), so before an op overwrites a tensor a record was made
 * from, and at the end of a span of layers, the step joins them (ds4h_join).  The
 * overwrites: attention's output projection writes c->f (the MoE output and the experts and
 * resid records of the layer before were made from c->f, c->sel, c->wts and c->x, which
 * nothing in attention before it writes); the MoE writes c->sel, c->wts and c->f (the attn
 * record was made from c->f, attn_probs from the module's buffer, which the next layer's
 * attention rewrites after that): c->f only in moe_experts' last op, which joins the
 * producers itself (ds4_gpu.h), so the attn record's producer runs beside the whole MoE;
 * the publication joins by itself.  That producer is issued after the MoE's hc_pre (which
 * reads c->f and writes no record's source), not between it and the output projection: a
 * fork there stands between the two launches, and hc_pre's launch would no longer overlap
 * the projection's end (programmatic launch).
 *
 * A layer's records after its MoE: the experts chosen (c->sel, c->wts), the MoE output
 * (c->f) and the streams once that output is added back (c->x).  They are emitted after the
 * next hc_pre (the next layer's, or the head's), which makes c->x and leaves the others as
 * they were, so one producer carries all four -- in the order the CPU writes them. */
static void hooks_layer_end(ds4_ctx *c, int il, int nt) {
    const ds4_hparams *hp = &c->m->hp;
    const uint32_t k = (uint32_t)hp->n_expert_used, D = (uint32_t)hp->n_embd;
    ds4h_emit(c->hk, DS4H_MOE_SEL, il, c->sel, DS4H_I32, 2, (uint32_t)nt, k, 1, 0);
    ds4h_emit(c->hk, DS4H_MOE_W, il, c->wts, DS4H_F32, 2, (uint32_t)nt, k, 1, 0);
    ds4h_emit(c->hk, DS4H_MOE, il, c->f, DS4H_F32, 2, (uint32_t)nt, D, 1, 0);
    ds4h_emit(c->hk, DS4H_RESID, il, c->x, DS4H_F32, 3, (uint32_t)nt, (uint32_t)hp->n_hc, D, 0);
    ds4h_flush(c->hk);
}

/* Each sublayer starts with hc_pre, which first applies the residual update
 * of the sublayer before it (its output f, with the post/comb of its own mHC
 * step): x --attention--> x2 --MoE--> x, and the head folds in the last one.
 * fwd_span runs layers [l0, l1), with the embedding when l0 == 0 and the head
 * when l1 is the last layer: the whole step, or one region of it. */
/* Layer il (a trunk layer, or the MTP block at il == n_layer) on the streams in c->x: its two
 * sublayers, each after an mHC pre step; f_prev is the output of the sublayer before it, whose
 * update the first step applies (NULL: the streams come as they are). */
static void fwd_layer(ds4_ctx *c, int il, const float *f_prev, int nt) {
    const ds4_backend *be = c->be;
    const ds4_hparams *hp = &c->m->hp;
    const ds4_layer_w *L = layer_w(c->m, il);
    const int D = hp->n_embd, hc = hp->n_hc, it = hp->sinkhorn_iters;
    const float eps = hp->rms_eps, heps = hp->hc_eps;
    be->hc_pre(f_prev, c->x2, c->x, &L->hc_attn_fn, L->hc_attn_scale.dev, L->hc_attn_base.dev, L->attn_norm.dev,
               nt, D, hc, 0, eps, heps, it, c->flat, c->mix, c->h, c->post, c->comb);
    if (f_prev) hooks_layer_end(c, il - 1, nt);
    fwd_attention(c, il, c->h, nt, c->f);
    ds4h_emit(c->hk, DS4H_ATTN, il, c->f, DS4H_F32, 2, (uint32_t)nt, (uint32_t)D, 1, 0);
    be->hc_pre(c->f, c->x, c->x2, &L->hc_ffn_fn, L->hc_ffn_scale.dev, L->hc_ffn_base.dev, L->ffn_norm.dev,
               nt, D, hc, 0, eps, heps, it, c->flat, c->mix, c->h, c->post, c->comb);
    ds4h_flush(c->hk);             /* after hc_pre (above) */
    fwd_moe(c, il, c->h, nt, c->f);    /* its last op joins before it rewrites c->f */
}

/* The head's mHC step: the last sublayer's update (the final streams into c->x), the streams
 * collapsed, then RMSNorm with norm: c->h [nt][D]. */
static void fwd_head_norm(ds4_ctx *c, const ds4_weight *norm, int nt) {
    const ds4_model *m = c->m;
    const ds4_hparams *hp = &m->hp;
    c->be->hc_pre(c->f, c->x2, c->x, &m->output_hc_fn, m->output_hc_scale.dev, m->output_hc_base.dev, norm->dev,
                  nt, hp->n_embd, hp->n_hc, 1, hp->rms_eps, hp->hc_eps, hp->sinkhorn_iters,
                  c->flat, c->mix, c->h, c->post, c->comb);
}

static void fwd_span(ds4_ctx *c, int l0, int l1, int nt, int all_rows) {
    const ds4_backend *be = c->be;
    const ds4_model *m = c->m;
    const ds4_hparams *hp = &m->hp;
    const int D = hp->n_embd;

    if (l0 == 0) be->embed(&m->tok_embd, c->tok, nt, hp->n_hc, c->x);
    for (int il = l0; il < l1; il++) fwd_layer(c, il, il > 0 ? c->f : NULL, nt);
    if (l1 < hp->n_layer) {
        ds4h_join(c->hk);          /* a recorded region ends joined */
        return;
    }
    /* head: the last update, collapse the streams, normalise, project to the vocabulary */
    fwd_head_norm(c, &m->output_norm, nt);
    hooks_layer_end(c, hp->n_layer - 1, nt);
    if (all_rows) be->matmul(&m->output, 0, c->h, c->logits, nt);
    else be->matmul(&m->output, 0, c->h + (size_t)(nt - 1) * D, c->logits, 1);
    const int rows = all_rows ? nt : 1;
    ds4h_emit(c->hk, DS4H_LOGITS, -1, c->logits, DS4H_F32, 2, (uint32_t)rows, (uint32_t)hp->n_vocab, 1, nt - rows);
    ds4h_flush(c->hk);
    /* the call's records become visible to the device emitter's drain in one publication */
    ds4h_publish(c->hk);
}

/* With DS4_CUDA_GRAPHS=1 a decode step (one token, the last row's logits) and a
 * check of speculative drafts (2 .. DS4_GRAPH_MAX_ROWS tokens, every row's
 * logits; with hooks too, whose producers read the position from the step block
 * and are shaped by the token count alone) run as recorded regions
 * (ds4_gpu.h region_begin/end): the whole step, or clusters of
 * DS4_CUDA_GRAPH_LAYERS layers.  A region's key names everything its ops bake
 * in: its layers, the token count, whether every row's logits are made, and
 * the context generation (the buffers are the context's own, the position is
 * in the step block; the ops of a call of up to 8 tokens choose their kernels
 * from its shape alone).  So each width is one recording, replayed from then
 * on.  Other batches (a prompt's chunks) run eagerly. */
#define DS4_GRAPH_MAX_ROWS 4
static int fwd_recorded(const ds4_ctx *c, int nt, int all_rows) {
    if (!c->graphs) return 0;
    if (nt == 1) return !all_rows;
    return nt <= DS4_GRAPH_MAX_ROWS && all_rows;
}

static void fwd_batch(ds4_ctx *c, int nt, int all_rows) {
    const ds4_backend *be = c->be;
    const int L = c->m->hp.n_layer;
    if (!fwd_recorded(c, nt, all_rows)) {
        fwd_span(c, 0, L, nt, all_rows);
        return;
    }
    const int per = c->graph_layers > 0 && c->graph_layers < L ? c->graph_layers : L;
    for (int l0 = 0; l0 < L; l0 += per) {
        const int l1 = l0 + per < L ? l0 + per : L;
        const uint64_t key = (uint64_t)l0 | (uint64_t)l1 << 12 | (uint64_t)nt << 24 | (uint64_t)all_rows << 30 |
                             (uint64_t)c->generation << 32;
        if (be->region_begin(key) == DS4_REGION_REPLAYED) continue;
        fwd_span(c, l0, l1, nt, all_rows);
        if (be->region_end(key) == DS4_REGION_REISSUE) fwd_span(c, l0, l1, nt, all_rows);
    }
}

/* The step block of a call of n tokens at pos, then the tokens, up as one small ordered copy. */
static void step_upload(ds4_ctx *c, int pos, const int32_t *tokens, int n) {
    const ds4_step st = { pos, n, (int32_t)c->hcalls, 0 };
    memcpy(c->step_host, &st, sizeof st);
    memcpy((ds4_step *)c->step_host + 1, tokens, (size_t)n * 4);
    c->be->upload(c->step, c->step_host, sizeof st + (size_t)n * 4);
}

/* One forward call of n <= max_batch tokens at c->pos (ds4_eval has checked them and the room). */
static int eval_chunk(ds4_ctx *c, const int32_t *tokens, int n, float *logits, int all_rows,
                      char *err, size_t errlen) {
    const ds4_hparams *hp = &c->m->hp;
    /* The step's inputs go up as one small ordered copy (the position in the
     * step block, then the tokens); the ops read them when they run.  The
     * host waits once, for the logits (or, without them, for the step to end). */
    const ds4_backend *be = c->be;
    void *prev = be->session_bind(c->sess);
    step_upload(c, c->pos, tokens, n);
    ds4h_call_begin(c->hk, c->pos, c->hcalls, c->step);
    fwd_batch(c, n, all_rows);
    if (logits) be->download(logits, c->logits, (size_t)(all_rows ? n : 1) * hp->n_vocab * 4);
    else be->synchronize();
    be->session_bind(prev);
    c->pos += n;
    c->hcalls++;
    c->last_rows = n;
    c->mtp_rows = 0;
    if (ds4h_call_end(c->hk, err, errlen) != 0) return -1;
    return 0;
}

/* Chunked prefill: n tokens go through in chunks of at most max_batch (DS4_UBATCH), each a
 * forward call at the position the one before left; every state (window ring, compressed and
 * indexer rows, compressor state, hook sequence) carries across, so the logits do not depend
 * on the chunk size (the CPU's are byte-identical for any; tests/test_chunks.py). */
int ds4_eval(ds4_ctx *c, const int32_t *tokens, int n, float *logits, int all_rows,
             char *err, size_t errlen) {
    const ds4_hparams *hp = &c->m->hp;
    if (n <= 0) { errf(err, errlen, "no tokens to evaluate"); return -1; }
    if (c->pos + n > c->n_ctx) {
        errf(err, errlen, "context full: position %d + %d tokens exceeds --ctx %d", c->pos, n, c->n_ctx);
        return -1;
    }
    for (int i = 0; i < n; i++)                  /* every chunk's tokens, before the first runs */
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab) {
            errf(err, errlen, "token id %d out of range [0, %d)", tokens[i], hp->n_vocab);
            return -1;
        }
    for (int i = 0; i < n; i += c->max_batch) {
        const int nb = n - i < c->max_batch ? n - i : c->max_batch;
        const int last = i + nb == n;
        /* all rows: each chunk's rows in place; the last row only: the last chunk's */
        float *out = !logits ? NULL : all_rows ? logits + (size_t)i * hp->n_vocab : last ? logits : NULL;
        if (eval_chunk(c, tokens + i, nb, out, all_rows, err, errlen) != 0) return -1;
        if (!last && c->progress && c->progress(c->progress_user, i + nb, n) != 0) {
            errf(err, errlen, "interrupted after %d of %d prompt tokens", i + nb, n);
            return -2;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------
 * The MTP head (the model's MTP block; llama.cpp's graph_mtp of deepseek4 is the reference)
 *
 * Row i: the token's embedding (nextn.embed_tokens, else the model's) through enorm, and each
 * of the trunk's hc final streams through hnorm; per stream, eh_proj of [enorm(e); hnorm(h_s)]
 * (2D -> D) makes the block's input streams.  Then the block is a layer as any other (mHC
 * pre, attention over its own caches at the rows' positions, mHC post, mHC pre, routed MoE
 * with the shared expert), and the model's mHC head with nextn.shared_head_norm (else
 * output_norm) and nextn.shared_head_head (else output) gives the logits.  Every op goes
 * through the backend: the concatenation is the backend's ordered copies, so the head runs
 * where the model does (eagerly: its rows are uploaded from the host each call).
 * ------------------------------------------------------------------------- */

int ds4_model_has_mtp(const ds4_model *m) { return m->hp.n_mtp > 0; }
int ds4_ctx_mtp_pos(const ds4_ctx *c) { return c->mtp_pos; }

/* The last rows rows of the first have rows of c->x. */
static int ctx_x_rows(ds4_ctx *c, float *out, int rows, int have) {
    const ds4_hparams *hp = &c->m->hp;
    if (rows < 0 || rows > have) return -1;
    const size_t w = (size_t)hp->n_hc * hp->n_embd;
    void *prev = c->be->session_bind(c->sess);
    c->be->download(out, c->x + (size_t)(have - rows) * w, (size_t)rows * w * 4);
    c->be->session_bind(prev);
    return 0;
}

int ds4_ctx_streams(ds4_ctx *c, float *out, int rows) { return ctx_x_rows(c, out, rows, c->last_rows); }
int ds4_mtp_streams(ds4_ctx *c, float *out, int rows) { return ctx_x_rows(c, out, rows, c->mtp_rows); }

/* The head of n rows whose trunk streams are at hdev on the backend ([n][hc][D]; the host
 * entry uploads them to c->x2 first).  With DS4_CUDA_GRAPHS=1 a call of up to
 * DS4_GRAPH_MAX_ROWS rows from the queue (c->mtp_q) runs as a recorded region keyed by its
 * width, whether it makes logits (and of every row), and the context's generation: like a
 * check call's, its ops read the position and tokens from the step block and choose their
 * kernels from the width alone. */
static void mtp_eval_dev(ds4_ctx *c, const float *hdev, const int32_t *tokens, int n, float *logits, int all_rows) {
    const ds4_model *m = c->m;
    const ds4_hparams *hp = &m->hp;
    const ds4_backend *be = c->be;
    const int D = hp->n_embd, hc = hp->n_hc, il = hp->n_layer;
    const ds4_mtp_w *M = &m->mtp;
    ds4h_ctx *hk = c->hk;                        /* the block's ops emit no hook records */
    c->hk = NULL;
    step_upload(c, c->mtp_pos, tokens, n);
    const int head = logits != NULL, rows = all_rows ? n : 1;
    const int rec = c->graphs && hdev == c->mtp_q && n <= DS4_GRAPH_MAX_ROWS;
    const uint64_t key = (uint64_t)1 << 31 | (uint64_t)head << 28 | (uint64_t)n << 24 | (uint64_t)(all_rows != 0) << 30 |
                         (uint64_t)c->generation << 32;
    for (int pass = 0; pass < 2; pass++) {
        if (rec && pass == 0 && be->region_begin(key) == DS4_REGION_REPLAYED) break;
        /* the input streams: enorm(e) beside each hnorm(h_s), then eh_proj */
        be->embed(M->embed_tokens.host ? &M->embed_tokens : &m->tok_embd, c->tok, n, 1, c->f);
        be->rmsnorm(c->f, M->enorm.dev, c->f, n, D, hp->rms_eps);
        be->rmsnorm(hdev, M->hnorm.dev, c->x2, n * hc, D, hp->rms_eps);
        be->pair_rows(c->f, c->x2, c->mtp_cat, n * hc, hc, D);
        be->matmul(&M->eh_proj, 0, c->mtp_cat, c->x, n * hc);
        /* the block as a layer (its input streams need no update first), the model's mHC head, the
         * block's head norm and projection */
        fwd_layer(c, il, NULL, n);
        fwd_head_norm(c, M->shared_head_norm.host ? &M->shared_head_norm : &m->output_norm, n);
        if (head) {
            const ds4_weight *hw = M->shared_head_head.host ? &M->shared_head_head : &m->output;
            be->matmul(hw, 0, c->h + (size_t)(n - rows) * D, c->logits, rows);
        }
        if (!rec || pass == 1 || be->region_end(key) != DS4_REGION_REISSUE) break;
    }
    if (head) be->download(logits, c->logits, (size_t)rows * hp->n_vocab * 4);
    else be->synchronize();
    c->hk = hk;
    c->mtp_pos += n;
    c->last_rows = 0;                            /* c->x now holds the block's streams */
    c->mtp_rows = n;
}

/* What every head call checks first. */
static int mtp_eval_check(ds4_ctx *c, const int32_t *tokens, int n, char *err, size_t errlen) {
    const ds4_hparams *hp = &c->m->hp;
    if (!hp->n_mtp) { errf(err, errlen, "the model has no MTP block"); return -1; }
    if (n < 1 || n > c->max_batch) { errf(err, errlen, "MTP rows %d outside [1, %d]", n, c->max_batch); return -1; }
    if (c->mtp_pos + n > c->n_ctx) {
        errf(err, errlen, "MTP context full: position %d + %d rows exceeds --ctx %d", c->mtp_pos, n, c->n_ctx);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab) {
            errf(err, errlen, "token id %d out of range [0, %d)", tokens[i], hp->n_vocab);
            return -1;
        }
    if (hp->ratio[hp->n_layer] != 0) {   /* llama.cpp's graph_mtp attends over a window whatever the ratio */
        errf(err, errlen, "the MTP block has compress ratio %d: its head is specified for a window-attention block (ratio 0)",
             hp->ratio[hp->n_layer]);
        return -1;
    }
    return 0;
}

int ds4_mtp_eval(ds4_ctx *c, const float *h, const int32_t *tokens, int n, float *logits, int all_rows,
                 char *err, size_t errlen) {
    if (mtp_eval_check(c, tokens, n, err, errlen) != 0) return -1;
    const ds4_hparams *hp = &c->m->hp;
    void *prev = c->be->session_bind(c->sess);
    c->be->upload(c->x2, h, (size_t)n * hp->n_hc * hp->n_embd * 4);
    mtp_eval_dev(c, c->x2, tokens, n, logits, all_rows);
    c->be->session_bind(prev);
    return 0;
}

int ds4_mtp_queue(ds4_ctx *c, int src, int row0, int n, char *err, size_t errlen) {
    const ds4_hparams *hp = &c->m->hp;
    if (!hp->n_mtp) { errf(err, errlen, "the model has no MTP block"); return -1; }
    const size_t hw = (size_t)hp->n_hc * hp->n_embd;
    const int have = src == DS4_MTP_SRC_MODEL ? c->last_rows : src == DS4_MTP_SRC_HEAD ? c->mtp_rows : n;
    if ((src != DS4_MTP_SRC_MODEL && src != DS4_MTP_SRC_HEAD && src != DS4_MTP_SRC_ZERO) || n < 1 || row0 < 0 ||
        (src != DS4_MTP_SRC_ZERO && row0 + n > have)) {
        errf(err, errlen, "MTP queue: rows %d..%d of source %d, which has %d", row0, row0 + n - 1, src, have);
        return -1;
    }
    if (c->mtp_nq + n > c->max_batch + 1) {
        errf(err, errlen, "MTP queue: %d rows queued, %d more exceed %d", c->mtp_nq, n, c->max_batch + 1);
        return -1;
    }
    void *prev = c->be->session_bind(c->sess);
    float *dst = c->mtp_q + (size_t)c->mtp_nq * hw;
    if (src == DS4_MTP_SRC_ZERO)
        for (int i = 0; i < n; i++) c->be->copy(dst + (size_t)i * hw, c->mtp_q + (size_t)(c->max_batch + 1) * hw, hw * 4);
    else
        c->be->copy(dst, c->x + (size_t)row0 * hw, (size_t)n * hw * 4);
    c->be->session_bind(prev);
    c->mtp_nq += n;
    return 0;
}

int ds4_mtp_queued(const ds4_ctx *c) { return c->mtp_nq; }

int ds4_mtp_eval_queued(ds4_ctx *c, const int32_t *tokens, int n, float *logits, int all_rows,
                        char *err, size_t errlen) {
    if (mtp_eval_check(c, tokens, n, err, errlen) != 0) return -1;
    if (n > c->mtp_nq) { errf(err, errlen, "MTP queue: %d rows asked, %d queued", n, c->mtp_nq); return -1; }
    const ds4_hparams *hp = &c->m->hp;
    const size_t hw = (size_t)hp->n_hc * hp->n_embd;
    void *prev = c->be->session_bind(c->sess);
    mtp_eval_dev(c, c->mtp_q, tokens, n, logits, all_rows);
    /* the rows after them go first, in order (row i from row n + i: each read before it is written) */
    for (int i = 0; i < c->mtp_nq - n; i++)
        c->be->copy(c->mtp_q + (size_t)i * hw, c->mtp_q + (size_t)(n + i) * hw, hw * 4);
    c->be->session_bind(prev);
    c->mtp_nq -= n;
    return 0;
}

void ds4_ctx_set_progress(ds4_ctx *c, ds4_progress_fn fn, void *user) {
    c->progress = fn;
    c->progress_user = user;
}

int ds4_ctx_max_batch(const ds4_ctx *c) { return c->max_batch; }

/* ---------------------------------------------------------------------------
 * Sampling
 * ------------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {          /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void ds4_sampler_init(ds4_sampler *s, float temp, float top_p, uint64_t seed) {
    s->temp = temp; s->top_p = top_p; s->state = seed;
}

int ds4_argmax(const float *l, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (l[i] > l[best]) best = i;
    return best;
}

static const float *g_sort_p;
static int prob_desc(const void *a, const void *b) {
    const int i = *(const int *)a, j = *(const int *)b;
    if (g_sort_p[i] > g_sort_p[j]) return -1;
    if (g_sort_p[i] < g_sort_p[j]) return 1;
    return i - j;
}

/* The softmax of l / temp into p, idx sorted by it (descending, ties by index); the size of the
 * top-p nucleus, and its mass into *tot. */
static int sample_nucleus(const ds4_sampler *s, const float *l, int n, float *p, int *idx, double *tot) {
    float mx = l[ds4_argmax(l, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) { p[i] = expf((l[i] - mx) / s->temp); sum += p[i]; idx[i] = i; }
    for (int i = 0; i < n; i++) p[i] = (float)(p[i] / sum);
    g_sort_p = p;
    qsort(idx, (size_t)n, sizeof(int), prob_desc);
    int keep = n;
    if (s->top_p > 0.0f && s->top_p < 1.0f) {
        double c = 0.0;
        for (int i = 0; i < n; i++) { c += p[idx[i]]; if (c >= s->top_p) { keep = i + 1; break; } }
    }
    double t = 0.0;
    for (int i = 0; i < keep; i++) t += p[idx[i]];
    *tot = t;
    return keep;
}

double ds4_sampler_uniform(ds4_sampler *s) { return (double)(rng_next(&s->state) >> 11) * (1.0 / 9007199254740992.0); }

void ds4_sampler_probs(const ds4_sampler *s, const float *l, int n, float *out, void *scratch) {
    float *p = scratch;
    int *idx = (int *)(p + n);
    double tot;
    const int keep = sample_nucleus(s, l, n, p, idx, &tot);
    for (int i = 0; i < n; i++) out[i] = 0.0f;
    for (int i = 0; i < keep; i++) out[idx[i]] = (float)(p[idx[i]] / tot);
}

int ds4_sample(ds4_sampler *s, const float *l, int n, void *scratch) {
    if (s->temp <= 0.0f) return ds4_argmax(l, n);
    float *p = scratch;
    int *idx = (int *)(p + n);
    double tot;
    const int keep = sample_nucleus(s, l, n, p, idx, &tot);
    const double r = ds4_sampler_uniform(s) * tot;
    double c = 0.0;
    for (int i = 0; i < keep; i++) { c += p[idx[i]]; if (r < c) return idx[i]; }
    return idx[keep - 1];
}

/* ---------------------------------------------------------------------------
 * Environment: every DS4_* variable is read once, here
 * ------------------------------------------------------------------------- */

extern char **environ;

/* A DS4_* variable that is one of two words: 1 for a, 2 for b, 0 unset, -1 (err set) otherwise. */
static int env_choice(const char *name, const char *a, const char *b, char *err, size_t errlen) {
    const char *v = getenv(name);
    if (!v) return 0;
    if (!strcmp(v, a)) return 1;
    if (!strcmp(v, b)) return 2;
    char shown[256];
    errf(err, errlen, "%s='%s' is not %s or %s", name, ds4_show(shown, sizeof shown, v, strlen(v), 48), a, b);
    return -1;
}

/* A DS4_* variable naming a file to write `what` to: *out when set, -1 (err set) when empty. */
static int env_file(const char *name, const char *what, const char **out, char *err, size_t errlen) {
    const char *v = getenv(name);
    if (!v) return 0;
    if (!*v) {
        errf(err, errlen, "%s is empty (give the file to write %s to)", name, what);
        return -1;
    }
    *out = v;
    return 0;
}

/* Up to 48 bytes of s (n bytes) for an error line: control and non-ASCII bytes
 * as \xNN, so the message stays one line whatever the environment holds. */
int ds4_env_read(ds4_env *env, char *err, size_t errlen) {
    static const char *known[] = { "DS4_THREADS", "DS4_CUDA_GRAPHS", "DS4_LAUNCH_TRACE", "DS4_CUDA_GRAPH_LAYERS",
                                   "DS4_CUDA_GRAPH_CACHE", "DS4_CUDA_GRAPH_FAIL", "DS4_CUDA_GRAPH_PDL", "DS4_HOOKS", "DS4_HOOKS_OUT",
                                   "DS4_HOOKS_POLICY", "DS4_HOOKS_RING_MB", "DS4_HOOKS_THROTTLE_US", "DS4_UBATCH",
                                   "DS4_CUDA_PREFILL_TC", "DS4_CUDA_PREFILL_ATTN", "DS4_CUDA_DECODE_GROUP", "DS4_ROLLBACK_RESTORE",
                                   "DS4_MTP_FORCE", "DS4_CUDA_SHARED_STREAM", "DS4_CUDA_PREFILL_PLANES", "DS4_CUDA_EAGER_PDL" };
    char shown[256];
    memset(env, 0, sizeof(*env));
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, "DS4_", 4) != 0) continue;
        const char *eq = strchr(*e, '=');
        size_t nl = eq ? (size_t)(eq - *e) : strlen(*e);
        int ok = 0;
        for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
            if (strlen(known[i]) == nl && !strncmp(known[i], *e, nl)) ok = 1;
        if (!ok) {
            errf(err, errlen, "unknown environment variable %s (ds4 reads: DS4_THREADS, DS4_CUDA_GRAPHS, DS4_CUDA_GRAPH_LAYERS, "
                 "DS4_CUDA_GRAPH_CACHE, DS4_CUDA_GRAPH_FAIL, DS4_CUDA_GRAPH_PDL, DS4_CUDA_EAGER_PDL, DS4_LAUNCH_TRACE, "
                 "DS4_HOOKS, DS4_HOOKS_OUT, "
                 "DS4_HOOKS_POLICY, DS4_HOOKS_RING_MB, DS4_HOOKS_THROTTLE_US, DS4_UBATCH, DS4_CUDA_PREFILL_TC, "
                 "DS4_CUDA_PREFILL_ATTN, DS4_CUDA_PREFILL_PLANES, DS4_CUDA_DECODE_GROUP, DS4_CUDA_SHARED_STREAM, "
                 "DS4_ROLLBACK_RESTORE, DS4_MTP_FORCE; "
                 "see README)",
                 ds4_show(shown, sizeof shown, *e, nl, 48));
            return -1;
        }
    }
    const char *t = getenv("DS4_THREADS");
    if (t) {
        char *end;
        errno = 0;
        long v = strtol(t, &end, 10);
        if (errno || end == t || *end || v < 0 || v > DS4_MAX_THREADS) {
            errf(err, errlen, "DS4_THREADS='%s' is not an integer in [0, %d] (0 = all cores)",
                 ds4_show(shown, sizeof shown, t, strlen(t), 48), DS4_MAX_THREADS);
            return -1;
        }
        env->threads = (int)v;
    }
    const int cg = env_choice("DS4_CUDA_GRAPHS", "0", "1", err, errlen);
    if (cg < 0) return -1;
    if (cg) env->cuda_graphs = cg == 2;
    env->graph_cache = 64;
    env->graph_pdl = 1;
    env->eager_pdl = 1;
    env->prefill_tc = 4;
    env->prefill_attn = 2;
    env->prefill_planes = 2;
    env->decode_group = 1;
    env->shared_stream = 1;
    env->rollback_restore = 3;
    env->ubatch = DS4_UBATCH_DEFAULT;
    static const struct { const char *name; long lo, hi; const char *what; } ints[] = {
        { "DS4_CUDA_GRAPH_LAYERS", 0, 1024, "layers per recorded region, 0 = the whole step" },
        { "DS4_CUDA_GRAPH_CACHE", 1, 4096, "recordings kept per context" },
        { "DS4_CUDA_GRAPH_FAIL", 0, 1000000, "the capture to fail, 0 = none" },
        { "DS4_CUDA_GRAPH_PDL", 0, 1, "1 = recorded kernels launch as programmatic dependents" },
        { "DS4_HOOKS_RING_MB", 0, 65536, "MiB of the hook payload ring, 0 = sized from the model and the selection" },
        { "DS4_HOOKS_THROTTLE_US", 0, 1000000, "debug: microseconds the hook drain pauses after each batch" },
        { "DS4_UBATCH", 1, DS4_UBATCH_MAX, "the most tokens of one prefill chunk" },
        { "DS4_CUDA_PREFILL_TC", 0, 4, "prefill products of Q8_0, F16, IQ2_XXS, Q2_K and Q4_K weights on tensor cores: 4 = wgmma on sm_90 with the activations' and the Q8_0 weights' stage copies by the tensor memory accelerator, 3 = the activations' alone, 2 = wgmma with cp.async copies, 1 = mma.sync, 0 = cuBLAS" },
        { "DS4_CUDA_PREFILL_ATTN", 0, 2, "a prefill batch's attention in row tiles shared by 32 heads: 2 = on tensor cores, 1 = f32, 0 = per query" },
        { "DS4_CUDA_DECODE_GROUP", 0, 1, "1 = a call of up to 4 tokens streams each dense matrix once, in one launch" },
        { "DS4_CUDA_SHARED_STREAM", 0, 1, "1 = at decode the shared expert, the compressors and the indexer run on side streams" },
        { "DS4_CUDA_PREFILL_PLANES", 2, 3, "f16 parts of each activation in the prefill's tensor-core products (DS4_CUDA_PREFILL_TC 1 to 4) and attention (DS4_CUDA_PREFILL_ATTN 2): 2 = hi + mid, 3 = hi + mid + lo" },
        { "DS4_CUDA_EAGER_PDL", 0, 1, "1 = kernels launched outside a recording are programmatic dependents too" },
        { "DS4_ROLLBACK_RESTORE", 0, 3, "debug: the parts a rollback restores, bit 0 the model's layers, bit 1 the MTP block's" },
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        const char *v = getenv(ints[i].name);
        if (!v) continue;
        char *end;
        errno = 0;
        const long x = strtol(v, &end, 10);
        if (errno || end == v || *end || v[0] < '0' || v[0] > '9' || x < ints[i].lo || x > ints[i].hi) {
            errf(err, errlen, "%s='%s' is not an integer in [%ld, %ld] (%s)", ints[i].name,
                 ds4_show(shown, sizeof shown, v, strlen(v), 48), ints[i].lo, ints[i].hi, ints[i].what);
            return -1;
        }
        if (i == 0) env->graph_layers = (int)x;
        else if (i == 1) env->graph_cache = (int)x;
        else if (i == 2) env->graph_fail = (int)x;
        else if (i == 3) env->graph_pdl = (int)x;
        else if (i == 4) env->hooks_ring_mb = (int)x;
        else if (i == 5) env->hooks_throttle_us = (int)x;
        else if (i == 6) env->ubatch = (int)x;
        else if (i == 7) env->prefill_tc = (int)x;
        else if (i == 8) env->prefill_attn = (int)x;
        else if (i == 9) env->decode_group = (int)x;
        else if (i == 10) env->shared_stream = (int)x;
        else if (i == 11) env->prefill_planes = (int)x;
        else if (i == 12) env->eager_pdl = (int)x;
        else env->rollback_restore = (int)x;
    }
    const char *mf = getenv("DS4_MTP_FORCE");
    if (mf) {   /* P:FILE, P a decimal in [0, 1] */
        const char *colon = strchr(mf, ':');
        char num[32], *end;
        const size_t pl = colon ? (size_t)(colon - mf) : 0;
        float pv = -1.0f;
        if (colon && pl > 0 && pl < sizeof num && mf[0] >= '0' && mf[0] <= '9') {
            memcpy(num, mf, pl);
            num[pl] = 0;
            errno = 0;
            pv = strtof(num, &end);
            if (errno || *end) pv = -1.0f;
        }
        if (!(pv >= 0.0f && pv <= 1.0f) || !colon[1]) {
            errf(err, errlen, "DS4_MTP_FORCE='%s' is not P:FILE (P in [0, 1], FILE the reference token ids)",
                 ds4_show(shown, sizeof shown, mf, strlen(mf), 48));
            return -1;
        }
        env->mtp_force_p = pv;
        env->mtp_force_file = colon + 1;
    }
    const char *hk = getenv("DS4_HOOKS");
    if (hk) {
        ds4h_selection sel;
        char e2[256];
        if (ds4h_parse(hk, &sel, e2, sizeof e2) != 0) {
            errf(err, errlen, "DS4_HOOKS='%s': %s", ds4_show(shown, sizeof shown, hk, strlen(hk), 48), e2);
            return -1;
        }
        env->hooks = hk;
    }
    env->hooks_out = "ds4-hooks.ds4h";
    if (env_file("DS4_HOOKS_OUT", "the hook records", &env->hooks_out, err, errlen) != 0) return -1;
    const int hp_ = env_choice("DS4_HOOKS_POLICY", "wait", "drop", err, errlen);
    if (hp_ < 0) return -1;
    if (hp_) env->hooks_drop = hp_ == 2;
    return env_file("DS4_LAUNCH_TRACE", "the launch trace", &env->launch_trace, err, errlen);
}
