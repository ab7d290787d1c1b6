/* ds4.h -- the public API of the ds4 engine.
 *
 * ds4 runs DeepSeek V4 (Flash-architecture) models stored as deepseek4 GGUF
 * files.  The API is deliberately narrow: open a model, make a context bound
 * to a backend, feed tokens, read logits, sample.
 *
 * Return convention (everywhere in this header): 0 = success; -1 = failure,
 * with one line describing the problem written into the caller's err buffer
 * (or, where no err buffer is taken, printed to stderr).  Pointer-returning
 * calls return NULL on failure.
 */
#ifndef DS4_H
#define DS4_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ds4_gpu.h"
#include "ds4_msg.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_model ds4_model;
typedef struct ds4_ctx ds4_ctx;

/* ---- models ---- */

/* Map and validate a deepseek4 GGUF file. */
ds4_model *ds4_model_open(const char *path, char *err, size_t errlen);
/* Validate a GGUF image already in memory.  With take_ownership the model
 * frees buf (which must come from malloc or ds4_alloc_huge) when closed. */
ds4_model *ds4_model_open_memory(uint8_t *buf, size_t size, int take_ownership, char *err, size_t errlen);
void       ds4_model_close(ds4_model *m);

int    ds4_model_n_vocab(const ds4_model *m);
/* The shape of what the hooks see (ds4_hooks.h): layers, embedding width D, mHC streams, experts
 * per token. */
void   ds4_model_dims(const ds4_model *m, int *n_layer, int *n_embd, int *n_hc, int *n_expert_used);
int64_t ds4_model_n_ctx_train(const ds4_model *m);   /* deepseek4.context_length */
int    ds4_model_has_vocab(const ds4_model *m);
size_t ds4_model_weight_bytes(const ds4_model *m);
/* Bytes of weights read by one decoded token (dense tensors + the routed
 * experts actually used + one embedding row). */
size_t ds4_model_decode_bytes(const ds4_model *m);
/* The arithmetic of a prefill of n tokens from position pos0, in floating-point operations
 * (2 per multiply-add): out[0] the weights' products (every matrix per token, k of E experts,
 * the output head once), out[1] the attention (scores and weighted sums over the rows each
 * query sees, missing ratio-4 picks not counted) and the indexer's scores. */
void   ds4_model_prefill_flops(const ds4_model *m, int64_t pos0, int64_t n, double out[2]);
void   ds4_model_describe(const ds4_model *m, FILE *f);
/* The tokenizer of a model with a gpt2 (byte-level BPE) vocabulary, built on
 * first use and owned by the model (ds4_tok.h); NULL with err otherwise. */
struct ds4_tok;
struct ds4_tok *ds4_model_tokenizer(ds4_model *m, char *err, size_t errlen);
/* tokenizer.ggml.bos_token_id / eos_token_id, -1 when the file has none. */
int    ds4_model_bos(const ds4_model *m);
int    ds4_model_eos(const ds4_model *m);
/* `ds4 info`: describe, then parameters and bytes per tensor type, the device
 * memory of the weights and the weight bytes one decode step reads. */
void   ds4_model_info(const ds4_model *m, FILE *f);

/* Large page-aligned host allocation (mmap) for model images; free with ds4_free_huge. */
uint8_t *ds4_alloc_huge(size_t size);
void     ds4_free_huge(uint8_t *p, size_t size);

/* Output files that a failed run must not destroy are written beside their target and renamed
 * over it once whole: *tmp := PATH.tmp-PID (malloc'd), or NULL when PATH exists and is not a
 * regular file (a device such as /dev/null, a pipe), which is written in place.  -1 when out of
 * memory. */
int ds4_tmp_path(const char *path, char **tmp);

/* ---- synthetic models ---- */

/* Parse "f32", "f16", "bf16", "q8_0"; -1 if unknown. */
int ds4_parse_wtype(const char *s);
/* Write a synthetic deepseek4 GGUF (a config as ds4_synth_config_ok takes) to path. */
int ds4_synth_write(const char *config, uint64_t seed, int wtype, const char *path,
                    int n_threads, char *err, size_t errlen);
/* 1 if `ds4 synth` knows the config: tiny, small, flash16, small-q2, small-q4,
 * flash-q2, flash-q4, each optionally NAME[+vocab][@E][/N]: a vocabulary, E routed experts
 * (top-k..1024), context_length N (1..DS4_SYNTH_MAX_CTX; default the config's). */
#define DS4_SYNTH_MAX_CTX (1 << 24)
int ds4_synth_config_ok(const char *config);
/* Build the same image in memory and open it (no file). */
ds4_model *ds4_synth_open(const char *config, uint64_t seed, int wtype, int n_threads,
                          char *err, size_t errlen);

/* ---- contexts ---- */

/* A context holds the KV window ring, compressed rows, compressor state and
 * activation buffers on the backend.  n_ctx bounds the positions; max_batch
 * bounds the tokens of one ds4_eval call.  Weights are uploaded to the
 * backend on the first context (and released with the model).  If the
 * backend itself fails to start it prints its own line and err is left
 * empty. */
ds4_ctx *ds4_ctx_new(ds4_model *m, const ds4_backend *be, int n_ctx, int max_batch,
                     char *err, size_t errlen);
void     ds4_ctx_free(ds4_ctx *c);
/* The most tokens of one prefill chunk: DS4_UBATCH, or its default, bounds the batch a
 * context is made for; DS4_UBATCH_MAX keeps every grid dimension that counts tokens within
 * a GPU's 65535. */
#define DS4_UBATCH_DEFAULT 4096
#define DS4_UBATCH_MAX 65535
int      ds4_ctx_max_batch(const ds4_ctx *c);
/* Called between the chunks of a prefill with the tokens done and the call's total; a non-zero
 * return stops the call (ds4_eval returns -2). */
typedef int (*ds4_progress_fn)(void *user, int done, int total);
void     ds4_ctx_set_progress(ds4_ctx *c, ds4_progress_fn fn, void *user);
/* The backend bytes a context of n_ctx positions and batches of up to max_batch tokens
 * allocates (window ring, compressed and indexer rows, compressor state, activations),
 * computed without allocating: the plan a caller prints or checks before ds4_ctx_new.
 * ds4_ctx_bytes: what a context did allocate. */
size_t   ds4_ctx_plan_bytes(const ds4_model *m, int n_ctx, int max_batch);
size_t   ds4_ctx_bytes(const ds4_ctx *c);
int      ds4_ctx_pos(const ds4_ctx *c);   /* tokens consumed so far */
/* Start over at position 0 (the state is overwritten before it is read again). */
void     ds4_ctx_reset(ds4_ctx *c);
/* The backend's counters for this context (ds4_gpu.h: launches, device
 * allocations and waits); reset != 0 zeroes them after reading. */
struct ds4_backend_stats;
void     ds4_ctx_stats(ds4_ctx *c, struct ds4_backend_stats *st, int reset);
/* DS4_HOOKS: what the hook writer has done (ds4_gpu.h ds4_hooks_stats); with a device emitter
 * it first waits until every record produced so far is written.  -1 when hooks are off. */
struct ds4_hooks_stats;
int      ds4_ctx_hooks_stats(ds4_ctx *c, struct ds4_hooks_stats *st);
/* DS4_HOOKS: also hand every record written, its descriptor (ds4_hooks.h ds4h_record) and its
 * payload, to fn as the writer writes it (ds4 collect).  The CPU writer calls fn inside
 * ds4_eval; CUDA's drain thread calls it on its own thread, so read what fn gathered after
 * ds4_ctx_hooks_stats (which waits for every record produced so far).  Set it between calls.
 * -1 with one line when hooks are off. */
struct ds4h_record;
typedef void (*ds4_hook_sink)(void *user, const struct ds4h_record *r, const void *payload);
int      ds4_ctx_set_hook_sink(ds4_ctx *c, ds4_hook_sink fn, void *user, char *err, size_t errlen);
/* DS4_HOOKS with speculative checks (ds4 --mtp-draft): after ds4_ctx_hooks_hold the records of
 * the calls that follow are kept back; ds4_ctx_hooks_commit writes them cut to the rows at
 * positions below pos_end (the rows the sequence keeps), so a stream never holds a rejected
 * draft's row.  The CPU backend's writer, and a device emitter whose backend has hooks_hold
 * (CUDA; else hold is -1 with one line).  A hold while one is open (its call failed) first
 * closes the open one with nothing kept.  Both do nothing when hooks are off. */
int      ds4_ctx_hooks_hold(ds4_ctx *c, char *err, size_t errlen);
int      ds4_ctx_hooks_commit(ds4_ctx *c, int pos_end, char *err, size_t errlen);

/* Feed n tokens at the current position: a prefill in chunks of at most the context's batch
 * (ds4_ctx_max_batch: max_batch of ds4_ctx_new capped by DS4_UBATCH) when n > 1, one decode
 * step when n == 1.  logits (host, may be NULL) receives [n][n_vocab] when all_rows, else
 * only the last row [n_vocab].  The chunks do not change the logits.  -1 with one line on
 * failure; -2 when the progress function (ds4_ctx_set_progress) asked to stop between two
 * chunks: the chunks done stay in the context (ds4_ctx_pos says how far it got). */
int ds4_eval(ds4_ctx *c, const int32_t *tokens, int n, float *logits, int all_rows,
             char *err, size_t errlen);

/* ---- taking positions back (speculative decoding) ----
 *
 * A call's rows can be taken back: ds4_ctx_checkpoint saves, before the calls, what the next n
 * positions of one part of the context can overwrite that later positions still read -- the
 * window ring's slots and the compressors' (and indexers') state slots of those positions, at
 * most DS4_CHECKPOINT_MAX rows per ring and layer, copied on the backend -- and
 * ds4_ctx_rollback(c, part, pos) puts them back for positions pos and after and makes pos the
 * part's position again.  The compressed and indexer rows of blocks those positions closed are
 * left as they are: no query before a block's last position sees its row, and the row is
 * written again when that position is reached again.  The part: DS4_PART_TRUNK (the model's
 * layers, at ds4_ctx_pos) or DS4_PART_MTP (the MTP block's own caches, at ds4_ctx_mtp_pos).  One
 * checkpoint per part, replaced by the next and dropped by ds4_ctx_reset; it stays valid across
 * rollbacks.  ds4_ctx_rollback needs pos in [the checkpoint's position, the part's position]
 * and the part's position at most n past the checkpoint's.  0, or -1 with one line. */
#define DS4_CHECKPOINT_MAX 4
enum { DS4_PART_TRUNK = 0, DS4_PART_MTP = 1 };
int ds4_ctx_checkpoint(ds4_ctx *c, int part, int n, char *err, size_t errlen);
int ds4_ctx_rollback(ds4_ctx *c, int part, int pos, char *err, size_t errlen);

/* ---- the MTP block (multi-token prediction; the model's, when ds4 info shows it) ---- */

/* Whether the model has an MTP block (deepseek4.nextn_predict_layers = 1, read whole, from its
 * file or from an MTP file). */
int ds4_model_has_mtp(const ds4_model *m);
/* ds4 --mtp FILE: the MTP block from a file of its own, the block split out of a model that has
 * it (`ds4 synth --mtp-file`): that model's keys, the block's tensors (blk.<n_layer>.*) alone.
 * Its hyperparameters must be m's, m must have no block yet and its weights must not be on a
 * backend yet.  0, or -1 with one line in err (m unchanged). */
int ds4_model_attach_mtp(ds4_model *m, const char *path, char *err, size_t errlen);
/* The trunk's final hidden streams ([n_hc][n_embd] a row: what the head reads, before it
 * mixes them) of the last rows rows of the last ds4_eval chunk, into out (host).  -1 when
 * the last call was not a ds4_eval chunk or had fewer rows (a rollback takes the rows of the
 * positions it takes back away). */
int ds4_ctx_streams(ds4_ctx *c, float *out, int rows);
/* The same for the MTP block: its output streams (what its head mixes) of the last rows rows
 * of the last ds4_mtp_eval -- the hidden state a chained draft feeds back to the head. */
int ds4_mtp_streams(ds4_ctx *c, float *out, int rows);
/* The MTP head, on the context's backend (the CPU's is its specification): n rows at the block's own
 * positions p = ds4_ctx_mtp_pos(c) .. p + n - 1, consecutive from 0 after ds4_ctx_reset.  Row
 * i pairs the trunk's final streams of position p + i - 1 (h[i], [n_hc][n_embd]; zeros for
 * position 0) with the token at position p + i (tokens[i]), as llama.cpp's MTP context does;
 * logits (host, may be NULL: the head's projection is skipped) receives [n][n_vocab] when
 * all_rows, else only the last row; row i is the block's prediction for the token at position
 * p + i + 1.  The block's attention keeps its own window, compressed rows and indexer rows.
 * -1 with one line on failure (no block, a block of another compress ratio, n outside
 * [1, max_batch], the context full). */
int ds4_mtp_eval(ds4_ctx *c, const float *h, const int32_t *tokens, int n, float *logits, int all_rows,
                 char *err, size_t errlen);
int ds4_ctx_mtp_pos(const ds4_ctx *c);
/* The head's input streams kept on the backend (speculative decoding, without the streams
 * through the host): a queue of rows, each [n_hc][n_embd].  ds4_mtp_queue appends n rows:
 * DS4_MTP_SRC_MODEL rows row0 .. row0 + n - 1 of the last ds4_eval chunk's final streams (those
 * ds4_ctx_streams reads), DS4_MTP_SRC_HEAD those of the last ds4_mtp_eval's output streams
 * (ds4_mtp_streams'), DS4_MTP_SRC_ZERO zeros (row0 unused: the streams before position 0).
 * ds4_mtp_eval_queued is ds4_mtp_eval with the queue's first n rows as h; the rows after them
 * stay queued, first (with DS4_CUDA_GRAPHS=1 a call of up to 4 rows replays a recording of its
 * width).  ds4_ctx_reset empties the queue.  -1 with one line: no block, rows the source does
 * not have, more than max_batch + 1 rows queued, or more rows asked than queued. */
enum { DS4_MTP_SRC_MODEL = 0, DS4_MTP_SRC_HEAD = 1, DS4_MTP_SRC_ZERO = 2 };
int ds4_mtp_queue(ds4_ctx *c, int src, int row0, int n, char *err, size_t errlen);
int ds4_mtp_queued(const ds4_ctx *c);
int ds4_mtp_eval_queued(ds4_ctx *c, const int32_t *tokens, int n, float *logits, int all_rows,
                        char *err, size_t errlen);

/* ---- sampling ---- */

typedef struct ds4_sampler {
    float    temp;    /* 0 = greedy */
    float    top_p;   /* 1 = off */
    uint64_t state;   /* RNG state, from the seed */
} ds4_sampler;

void ds4_sampler_init(ds4_sampler *s, float temp, float top_p, uint64_t seed);
int  ds4_argmax(const float *logits, int n);   /* first maximum */
/* Deterministic for a given state; scratch must hold n floats + n ints. */
int  ds4_sample(ds4_sampler *s, const float *logits, int n, void *scratch);
/* The distribution ds4_sample draws from when temp > 0, into p[0:n): softmax(logits / temp),
 * 0 outside the top-p nucleus, the nucleus renormalised.  scratch as ds4_sample's. */
void ds4_sampler_probs(const ds4_sampler *s, const float *logits, int n, float *p, void *scratch);
/* A uniform number in [0, 1) from the sampler's generator (the one ds4_sample advances). */
double ds4_sampler_uniform(ds4_sampler *s);

/* ---- messages ---- */

/* ds4_show and ds4_errf: ds4_msg.h (included above). */

/* ---- environment ---- */

/* Validate every DS4_* environment variable once at start-up: unknown names
 * and malformed values are errors.  Fills the config read by the engine. */
typedef struct ds4_env {
    int threads;      /* DS4_THREADS: CPU threads, 0 = all online cores */
    int cuda_graphs;  /* DS4_CUDA_GRAPHS: 1 = record each decode step as CUDA graphs and replay
                         them (patches/series stage 2) */
    const char *launch_trace;   /* DS4_LAUNCH_TRACE: file the CUDA backend writes every launch to
                                   (a debug trace; NULL = none) */
    int graph_layers;           /* DS4_CUDA_GRAPH_LAYERS: layers per recorded region, 0 = the whole step */
    int graph_cache;            /* DS4_CUDA_GRAPH_CACHE: recordings kept per context (default 64) */
    int graph_pdl;              /* DS4_CUDA_GRAPH_PDL: recorded kernels overlap their predecessor's drain (default 1) */
    int eager_pdl;              /* DS4_CUDA_EAGER_PDL: kernels launched outside a recording (a prompt's
                                   chunks, eager steps) overlap their predecessor's drain too (default 1) */
    int graph_fail;             /* DS4_CUDA_GRAPH_FAIL: debug, the Nth capture fails (0 = none) */
    const char *hooks;          /* DS4_HOOKS: the hook selection (ds4_hooks.h), NULL = none */
    const char *hooks_out;      /* DS4_HOOKS_OUT: the record stream's file (default ds4-hooks.ds4h) */
    int hooks_drop;             /* DS4_HOOKS_POLICY: 0 = wait (lossless, the default), 1 = drop */
    int hooks_ring_mb;          /* DS4_HOOKS_RING_MB: the CUDA emitter's payload ring, 0 = sized from the
                                   model and the selection */
    int hooks_throttle_us;      /* DS4_HOOKS_THROTTLE_US: debug, the drain pauses after each batch */
    int ubatch;                 /* DS4_UBATCH: the most tokens of one prefill chunk (DS4_UBATCH_DEFAULT) */
    int prefill_tc;             /* DS4_CUDA_PREFILL_TC: prefill products of Q8_0, F16, IQ2_XXS, Q2_K and Q4_K
                                   weights on tensor cores, 4 = with wgmma where the build and card have
                                   it (sm_90), the activations' and the Q8_0 weights' stage copies by
                                   the tensor memory accelerator (default); 3 = the activations'
                                   alone; 2 = as 3 with every thread's cp.async
                                   copies (both else as 1); 1 = mma.sync; 0 = dequantise
                                   + cuBLAS */
    int prefill_attn;           /* DS4_CUDA_PREFILL_ATTN: a prefill batch's attention in row tiles shared by
                                   32 heads, 2 = on tensor cores (default), 1 = in f32 on the CUDA cores;
                                   0 = the per-query kernel decode uses */
    int prefill_planes;         /* DS4_CUDA_PREFILL_PLANES: f16 parts of each activation in the prefill's
                                   tensor-core products (DS4_CUDA_PREFILL_TC 1 to 4) and attention
                                   (DS4_CUDA_PREFILL_ATTN 2), 2 = hi + mid (default), 3 = hi + mid + lo */
    int decode_group;           /* DS4_CUDA_DECODE_GROUP: 1 = a call of up to 4 tokens (a speculative check)
                                   streams each dense matrix once, in one launch (default); 0 = chunks of
                                   4, 2, 1 (a call of 3 streams them twice) */
    int shared_stream;          /* DS4_CUDA_SHARED_STREAM: 1 = at decode the MoE's shared expert runs on a
                                   second stream beside the routing and the routed experts, and the
                                   attention's compressors and indexer on a third beside the queries
                                   (default); 0 = in order on one stream */
    int rollback_restore;       /* DS4_ROLLBACK_RESTORE: debug, the parts whose saved slots ds4_ctx_rollback
                                   restores: bit 1 << DS4_PART_* (default 3, both); a part without its bit
                                   only moves its position back (the tests show what breaks) */
    float mtp_force_p;          /* DS4_MTP_FORCE=P:FILE: debug, each draft of --mtp-draft is FILE's reference */
    const char *mtp_force_file; /*   token with probability P, else a token that differs (NULL = off) */
} ds4_env;
int ds4_env_read(ds4_env *env, char *err, size_t errlen);
/* DS4_HOOKS against a model, before a context is made: its layer ranges fit the model and
 * DS4_HOOKS_OUT can be written (ds4_ctx_new checks the same); it writes nothing and leaves an
 * existing DS4_HOOKS_OUT untouched.  0; -1 (the selection: a usage error) or -2 (the file)
 * with one line. */
int ds4_hooks_check(const ds4_model *m, const ds4_env *env, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* DS4_H */
