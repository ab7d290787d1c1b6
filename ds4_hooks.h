/* ds4_hooks.h -- activation hooks: what ds4 can stream out of a forward pass, and the file
 * those records land in (stage 3 of patches/series).
 *
 * What it is.  A catalog of hook points in the forward pass (below), a selection of them
 * (DS4_HOOKS="attn,resid:40-42": names with optional layer ranges), and a framed record
 * stream (DS4_HOOKS_OUT, default ds4-hooks.ds4h) that scripts/ds4hooks.py reads with numpy
 * alone.  Each forward call emits, for every selected (hook, layer), one record holding that
 * call's rows: a fixed 64-byte descriptor -- sequence number, hook, layer, first position,
 * call index, dtype, shape, byte count -- then the payload.  The writer assigns identity
 * where the data is made; a reader never infers it from order.
 *
 * Who writes.  The CPU backend's forward pass writes each record as the op that makes it
 * returns (ds4_hooks.c, the writer: synchronous, so nothing is ever dropped).  The CUDA
 * backend produces records on the device, into rings a host thread drains (ds4_hooks.cu):
 * eagerly or inside a replayed CUDA graph, losslessly (DS4_HOOKS_POLICY=wait, the default)
 * or dropping what does not fit (drop).  A prompt's rows may come in several records
 * (pos tells where each starts); a reader joins them by (hook, layer, position).
 *
 * Names.  The module's names are ds4h_ (functions, types, variables; the CUDA emitter's
 * internals too) and DS4H_ (macros, constants).  What the library exports through ds4.h keeps
 * its ds4_ (ds4_hooks_check, ds4_ctx_hooks_stats, struct ds4_hooks_stats), the emitter's
 * kernels and backend-table entries the CUDA backend's k_ and cuda_, and the environment
 * variables their DS4_HOOKS names.
 *
 * The file (little-endian throughout):
 *   "DS4HOOKS" | u32 version (1) | u32 n = bytes of the JSON header | n bytes of JSON, padded
 *   with spaces to a multiple of 8 (model shape, the catalog, the selection, the backend)
 *   then records: a ds4h_record (64 bytes) | nbytes of payload, padded with zeros to 8.
 * Sequence numbers count every record produced, dropped ones included.  A record with
 * DS4H_FLAG_GAP set carries no payload: shape[0] records were dropped there
 * (DS4_HOOKS_POLICY=drop), the first of them with this record's seq, hook, layer, pos and
 * step; the next record's seq follows them.  With speculative decoding (ds4 --mtp-draft) a
 * check call's records hold only the rows the sequence keeps (ds4h_cut, below): a record of
 * rejected drafts' rows alone is not written and takes no sequence number, so the numbers of
 * the records written still run 0, 1, 2, ... apart from gaps.  reserved is 0 in the file.  A
 * truncated file is read up to its last whole record.
 */
#ifndef DS4_HOOKS_H
#define DS4_HOOKS_H

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The catalog.  Shapes per forward call of nt tokens (D = embedding width, h = mHC streams,
 * k = experts per token, V = vocabulary):
 *   attn    [nt][D]      f32  per layer: the attention sub-block's output, the vector mHC's post
 *                              step adds back into the streams (ds4.c fwd_attention's out)
 *   resid   [nt][h][D]   f32  per layer: the h residual streams once the layer's MoE output has
 *                              been added back (the input of the next layer's mHC pre step)
 *   moe_sel [nt][k]      i32  per layer: the experts chosen for each token, in slot order
 *   moe_w   [nt][k]      f32  per layer: their routing weights
 *   moe     [nt][D]      f32  per layer: the MoE sub-block's output (routed + shared experts)
 *   logits  [rows][V]    f32  no layer: the logits the call computed (its last row, or every
 *                              row when all were asked for)
 *   attn_probs [H][n+1]  f32  per layer and per token (one record each, its position in pos):
 *                              the weight each head gave each of the n rows the query attended
 *                              -- its window rows, then the compressed rows (ratio 128) or the
 *                              k pick slots (ratio 4; 0 for an empty pick) -- and, last, the
 *                              sink's share (ds4_gpu.h attention_probs).  Its size grows with
 *                              the position.
 * "moe" in a selection stands for moe_sel, moe_w and moe together. */
enum {
    DS4H_ATTN = 0,
    DS4H_RESID,
    DS4H_MOE_SEL,
    DS4H_MOE_W,
    DS4H_MOE,
    DS4H_LOGITS,
    DS4H_ATTN_PROBS,
    DS4H_N_HOOKS
};

enum { DS4H_F32 = 0, DS4H_I32 = 1 };
#define DS4H_FLAG_GAP 1u
#define DS4H_MAX_LAYERS 1024
#define DS4H_VERSION 1
#define DS4H_RECORD_MAGIC 0x52483444u   /* "D4HR" */

/* One record's descriptor, as written (64 bytes). */
typedef struct ds4h_record {
    uint32_t magic;       /* DS4H_RECORD_MAGIC */
    uint32_t hook;        /* DS4H_* */
    uint64_t seq;         /* 0, 1, 2, ... in the order the writer assigned them */
    int32_t  layer;       /* -1 for hooks without one (logits) */
    uint32_t pos;         /* position of the first row */
    uint32_t step;        /* forward call index (0: the first call of the context) */
    uint8_t  dtype;       /* DS4H_F32 / DS4H_I32 */
    uint8_t  ndim;
    uint16_t flags;       /* DS4H_FLAG_GAP */
    uint32_t shape[4];    /* shape[0] = rows (tokens), but attn_probs: one token, [H][n+1]; unused dims 1 */
    uint64_t nbytes;      /* payload bytes (0 for a gap) */
    uint64_t reserved;
} ds4h_record;

/* A speculative check's record cut to the rows the sequence keeps, those at positions below
 * pos_end (ds4h_commit; the CUDA emitter's drain does the same): 0 when it keeps none (the
 * record is not written), else 1 with shape[0] and nbytes cut to the rows kept.  An
 * attn_probs record is one token's, kept whole or not at all; a gap record (no rows, only
 * a count of records dropped) is kept as it is. */
static inline int ds4h_cut(ds4h_record *r, int64_t pos_end) {
    if (r->flags & DS4H_FLAG_GAP) return 1;
    if ((int64_t)r->pos >= pos_end) return 0;
    if (r->hook != DS4H_ATTN_PROBS && r->shape[0] > 0) {
        const int64_t keep = pos_end - (int64_t)r->pos;
        if (keep < (int64_t)r->shape[0]) {
            r->nbytes = r->nbytes / r->shape[0] * (uint64_t)keep;
            r->shape[0] = (uint32_t)keep;
        }
    }
    return 1;
}

/* Name of a hook ("attn", ...), NULL past the catalog. */
const char *ds4h_name(int hook);

/* A selection: for each hook, which layers (bit l of layers[hook]). */
typedef struct ds4h_selection {
    int      any;                                   /* anything selected */
    uint64_t layers[DS4H_N_HOOKS][DS4H_MAX_LAYERS / 64];
    int      all_layers[DS4H_N_HOOKS];              /* no range given: every layer */
    int      max_layer;                             /* the highest layer a range named (-1: none) */
} ds4h_selection;

/* Parse DS4_HOOKS's value ("attn", "attn:0-7,resid:40-42", "moe:3", "logits").  Returns 0,
 * or -1 with one line in err naming the problem (unknown name, bad or reversed range, a
 * range on logits). */
int ds4h_parse(const char *spec, ds4h_selection *sel, char *err, size_t errlen);

/* Is (hook, layer) selected?  layer < 0 for logits. */
int ds4h_selected(const ds4h_selection *sel, int hook, int layer);

/* ---------------------------------------------------------------------------
 * The engine's side (ds4_hooks.c): what ds4.c calls, in this order.
 *
 *   ds4h_check       DS4_HOOKS against a model of n_layer layers, before a context: the
 *                    selection fits and DS4_HOOKS_OUT can be written; writes nothing.  0; -1
 *                    (the selection) or -2 (the file) with one line.
 *   ds4h_open        at context creation: the selection checked, the attn_probs buffer
 *                    allocated (backend memory, ds4h_device_bytes), the stream opened beside
 *                    its target and its header written; with a device emitter (ds4_gpu.h
 *                    hooks_open) the rings sized and opened on the context's session.  On
 *                    failure *out may still hold a partial state for ds4h_close.
 *   ds4h_start       once the context exists: the stream takes its target's place.
 *   per forward call ds4h_call_begin (its position, index and step block), then at each point
 *                    ds4h_emit (a tensor the op before made, rows d0 of d1 x d2, its first row
 *                    at the call's position + pos_add) and ds4h_flush (the point's records
 *                    to one producer); ds4h_probs/ds4h_emit_probs for attn_probs; ds4h_join
 *                    before an op overwrites a recorded tensor; ds4h_publish at the call's
 *                    end; then ds4h_call_end (the CPU writer's flush; a failed write: -1 with
 *                    one line).
 *   ds4h_stats, ds4h_close (after the backend's session is freed: its emitter writes last).
 * Every call on a ds4h_ctx takes NULL (hooks off) and does nothing (ds4h_stats: -1).
 * ------------------------------------------------------------------------- */
struct ds4_backend;
struct ds4_env;
struct ds4_hparams;
struct ds4_step;
struct ds4_hooks_stats;
typedef struct ds4h_ctx ds4h_ctx;
typedef struct ds4h_host {
    const struct ds4_backend *be;
    void                     *sess;          /* the context's backend session */
    const struct ds4_hparams *hp;
    int                       n_ctx, max_batch;
} ds4h_host;

int    ds4h_check(int n_layer, const struct ds4_env *env, char *err, size_t errlen);
int    ds4h_open(ds4h_ctx **out, const ds4h_host *host, const struct ds4_env *env, char *err, size_t errlen);
size_t ds4h_device_bytes(const ds4h_ctx *h);
int    ds4h_start(ds4h_ctx *h, char *err, size_t errlen);
void   ds4h_call_begin(ds4h_ctx *h, int pos, uint32_t call, const struct ds4_step *step);
void   ds4h_emit(ds4h_ctx *h, int hook, int layer, const void *data, int dtype, int ndim, uint32_t d0, uint32_t d1,
                 uint32_t d2, int pos_add);
void   ds4h_flush(ds4h_ctx *h);
float *ds4h_probs(ds4h_ctx *h, int layer, int *ld);   /* the buffer when layer's attn_probs is selected */
void   ds4h_emit_probs(ds4h_ctx *h, int layer, int nt, int ratio, int k);
void   ds4h_join(ds4h_ctx *h);
void   ds4h_publish(ds4h_ctx *h);
int    ds4h_call_end(ds4h_ctx *h, char *err, size_t errlen);
/* Speculative checks: after ds4h_hold the records are kept back, without sequence numbers;
 * ds4h_commit(pos_end) writes them, in the order made, each cut to its rows at positions
 * below pos_end (ds4h_cut), then writes as before.  So the stream holds the rows of the
 * sequence and no others.  The CPU writer keeps them itself; a device emitter's drain does
 * (ds4_gpu.h hooks_hold / hooks_commit), its records being produced on the device.  hold:
 * -1 with one line for a device emitter without them. */
int    ds4h_hold(ds4h_ctx *h, char *err, size_t errlen);
int    ds4h_commit(ds4h_ctx *h, int pos_end, char *err, size_t errlen);
int    ds4h_stats(ds4h_ctx *h, struct ds4_hooks_stats *st);
void   ds4h_close(ds4h_ctx *h);
/* A sink beside the stream (ds4 collect): the writer also hands each record it writes,
 * descriptor and payload, to fn, in the order written.  The CPU writer calls it inside the
 * step; a device emitter on its drain thread (ds4_gpu.h hooks_sink), so the caller reads what
 * fn gathered after ds4h_stats, which waits for every record produced so far.  -1 with one
 * line when the context has no hooks or its backend's emitter has no sink. */
int    ds4h_set_sink(ds4h_ctx *h, void (*fn)(void *user, const ds4h_record *r, const void *payload), void *user,
                     char *err, size_t errlen);

/* A device emitter's speculative checks (its drain thread; CUDA: ds4_hooks.cu), apart so that
 * a test can hold it to its promises (tests/test_hooks_hold.c).  The main thread marks a check
 * call's control slots: ds4h_holdq_open(from) at the publication before the call (-1 while
 * DS4H_WINDOWS windows are still open or not yet passed: wait for the drain and try again),
 * ds4h_holdq_close(to, pos_end) at the publication after it.  The drain hands every record it
 * takes, in slot order, to ds4h_holdq_take (copied: the payload may be reused once it returns;
 * -1 when it cannot be kept, out of memory), which writes it through write() at once or keeps
 * it back while it or a record before it is in an open window; ds4h_holdq_run writes the
 * records kept back whose window has closed, ds4h_holdq_pass(fill) retires the windows below
 * fill when nothing is kept (call both when idle), ds4h_holdq_end writes what it can and counts
 * the rest (a window never closed) as rejected.  A record in a closed window is cut by ds4h_cut:
 * one that keeps no row is not written and counts as rejected, and every record written has its
 * seq less the records rejected before it, so the file is numbered as the CPU writer numbers
 * it.  settled: nothing is kept back but what an open window holds (the flush's test).  The
 * calls are thread-safe as described (open, close, settled, rejected from any thread; the rest
 * from the drain). */
#define DS4H_WINDOWS 16
typedef struct ds4h_holdq ds4h_holdq;
ds4h_holdq *ds4h_holdq_new(void (*write)(void *user, const ds4h_record *r, const void *payload), void *user);
void        ds4h_holdq_free(ds4h_holdq *q);
int         ds4h_holdq_open(ds4h_holdq *q, uint64_t from);
void        ds4h_holdq_close(ds4h_holdq *q, uint64_t to, int pos_end);
int         ds4h_holdq_take(ds4h_holdq *q, uint64_t slot, const ds4h_record *r, const void *payload);
void        ds4h_holdq_run(ds4h_holdq *q);
void        ds4h_holdq_pass(ds4h_holdq *q, uint64_t fill);
void        ds4h_holdq_end(ds4h_holdq *q);
int         ds4h_holdq_settled(ds4h_holdq *q);
uint64_t    ds4h_holdq_rejected(ds4h_holdq *q);
uint64_t    ds4h_holdq_kept(ds4h_holdq *q);

/* The device emitter's rings for a selection (ds4h_open's policy, apart so that a test can
 * hold it to its promises): the payload ring DS4_HOOKS_RING_MB MiB when given (-1 with one
 * line when that cannot hold four of the selection's largest record), else 64 x what one
 * decode step produces, within 64..1024 MiB, and never below four largest records; the
 * control ring at least 1024 slots, one per KiB of payload ring, and four steps' records.
 * probs_ld: attn_probs's row (ds4h_open's), 0 without it.  Fills cfg's sizes, drop and
 * throttle (not f or path). */
struct ds4h_emitter_cfg;
int    ds4h_ring_plan(const ds4h_selection *sel, const struct ds4_hparams *hp, int probs_ld,
                      const struct ds4_env *env, struct ds4h_emitter_cfg *cfg, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* DS4_HOOKS_H */
