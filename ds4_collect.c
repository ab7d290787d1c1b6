/* ds4_collect.c -- `ds4 collect`: activation datasets from a corpus, in the layout that
 * Hugging Face `datasets` writes with save_to_disk and SAELens loads as an activation cache.
 *
 *   Corpus      plain text (one document per line) or JSONL (--jsonl: one JSON object per
 *               line, the document in its "text" field or --text-field's); empty, invalid
 *               UTF-8, oversized (--max-doc-bytes) and malformed documents are skipped and
 *               counted
 *   Packing     documents tokenized (no BOS of their own) and joined into one stream with a BOS
 *               between two documents; each window of --ctx C tokens is BOS then the stream's
 *               next C-1 tokens (a separator BOS at the window's start is its BOS, not doubled);
 *               a tail shorter than a window is dropped (SAELens's concat_and_batch_sequences
 *               with its defaults: begin_batch_token and sequence_separator_token BOS)
 *   Run         one prefill per window from position 0 (ds4_ctx_reset), logits unused, on the
 *               CPU or (--backend cuda) the GPU; the hooks of --hooks caught by a sink on the
 *               hook writer (ds4_ctx_set_hook_sink: the CPU writer inside the step, or CUDA's
 *               drain thread, waited for after each window)
 *   Dataset     DIR/data-XXXXX-of-NNNNN.arrow (Arrow IPC streams: a schema, one record batch
 *               per window, the end-of-stream marker), DIR/dataset_info.json, DIR/state.json,
 *               DIR/ds4_collect.json (the settings and the corpus's counts; a resumed run must
 *               find the same); the writer is here, flatbuffers by hand, no Arrow library;
 *               --format safetensors: one .safetensors file per shard instead
 *   Resume      a shard is written to NAME.partial and renamed when whole, so an existing shard
 *               is complete and never rewritten; a run finds them, removes a .partial and
 *               computes only the missing windows
 *
 * Two passes over the corpus: the first counts its windows (the shard count is in every
 * shard's name) and hashes its bytes, the second runs them, a writer thread writing each
 * window while the next one is computed.  Memory is bounded by one document
 * (--max-doc-bytes), two windows' activations (one computed, one written) and one window of
 * pending tokens. */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ds4.h"
#include "ds4_hooks.h"
#include "ds4_tok.h"

int cmd_collect(int argc, char **argv);   /* called by ds4_cli.c's main */
const char *default_model_path(char *buf, size_t len);   /* ds4_cli.c: the embedded default model */

enum { EXIT_FAIL = 1, EXIT_USAGE = 2 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------------------
 * A growing byte buffer: the flatbuffers and the JSON files are built in one
 * ------------------------------------------------------------------------- */

typedef struct {
    uint8_t *b;
    size_t   n, cap;
    int      oom;
} buf;

static void b_raw(buf *f, const void *p, size_t k) {
    if (f->oom) return;
    if (f->n + k > f->cap) {
        size_t c = f->cap ? f->cap : 1024;
        while (c < f->n + k) c *= 2;
        uint8_t *nb = realloc(f->b, c);
        if (!nb) { f->oom = 1; return; }
        f->b = nb;
        f->cap = c;
    }
    if (p) memcpy(f->b + f->n, p, k);
    else memset(f->b + f->n, 0, k);
    f->n += k;
}

static void b_s(buf *f, const char *s) { b_raw(f, s, strlen(s)); }

__attribute__((format(printf, 2, 3)))
static void b_printf(buf *f, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    const int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= sizeof tmp) { f->oom = 1; return; }
    b_raw(f, tmp, (size_t)k);
}

/* s as a JSON string, quotes included (bytes >= 0x80 pass as they are: the names are UTF-8 or
 * come from the command line) */
static void b_json_str(buf *f, const char *s) {
    b_s(f, "\"");
    for (; *s; s++) {
        const unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') { b_s(f, "\\"); b_raw(f, s, 1); }
        else if (c < 0x20) b_printf(f, "\\u%04x", c);
        else b_raw(f, s, 1);
    }
    b_s(f, "\"");
}

/* ---------------------------------------------------------------------------
 * Flatbuffers, written front to back
 *
 * An offset field is an unsigned distance to something later in the buffer, so a table is
 * written first with zeros in its offset fields (their positions are its "slots") and each
 * child after it, linking the slot to where the child starts.  A table's vtable goes just
 * before it (the table's first word is the signed distance back to it).  Tables start on 8
 * bytes, so every scalar is aligned to its size from the buffer's start.
 * ------------------------------------------------------------------------- */

static void fb_pad(buf *f, size_t a) {
    static const uint8_t z[8];
    if (f->n % a) b_raw(f, z, a - f->n % a);
}

static void fb_link(buf *f, size_t slot) {   /* the offset at slot points at f->n */
    if (f->oom) return;
    const uint32_t v = (uint32_t)(f->n - slot);
    memcpy(f->b + slot, &v, 4);
}

typedef struct { int id, size; uint64_t v; } fb_fld;   /* size 1, 2, 4, 8: a scalar; 0: an offset */

/* A table with fl[0:nf) (ids < 16), linked from slot; slots[id] := the position of each offset
 * field. */
static void fb_table(buf *f, size_t slot, const fb_fld *fl, int nf, size_t *slots) {
    uint16_t off[16] = {0};
    int nid = 0;
    size_t pos = 4;
    for (int i = 0; i < nf; i++) {
        const size_t sz = fl[i].size ? (size_t)fl[i].size : 4;
        pos = (pos + sz - 1) / sz * sz;
        off[fl[i].id] = (uint16_t)pos;
        pos += sz;
        if (fl[i].id + 1 > nid) nid = fl[i].id + 1;
    }
    fb_pad(f, 2);
    const size_t vt = f->n;
    const uint16_t head[2] = { (uint16_t)(4 + 2 * nid), (uint16_t)pos };
    b_raw(f, head, 4);
    b_raw(f, off, (size_t)nid * 2);
    fb_pad(f, 8);
    const size_t t = f->n;
    fb_link(f, slot);
    const int32_t back = (int32_t)(t - vt);
    b_raw(f, &back, 4);
    for (int i = 0; i < nf; i++) {
        while (!f->oom && f->n < t + off[fl[i].id]) b_raw(f, NULL, 1);
        if (fl[i].size == 0) {
            if (slots) slots[fl[i].id] = f->n;
            b_raw(f, NULL, 4);
        } else {
            b_raw(f, &fl[i].v, (size_t)fl[i].size);   /* little-endian host: the low bytes */
        }
    }
    while (!f->oom && f->n < t + pos) b_raw(f, NULL, 1);
}

static void fb_string(buf *f, size_t slot, const char *s) {
    fb_pad(f, 4);
    fb_link(f, slot);
    const uint32_t n = (uint32_t)strlen(s);
    b_raw(f, &n, 4);
    b_raw(f, s, n + 1);
}

/* A vector of n offsets linked from slot; elem[i] := the slot of element i. */
static void fb_vec_off(buf *f, size_t slot, int n, size_t *elem) {
    fb_pad(f, 4);
    fb_link(f, slot);
    const uint32_t k = (uint32_t)n;
    b_raw(f, &k, 4);
    for (int i = 0; i < n; i++) {
        elem[i] = f->n;
        b_raw(f, NULL, 4);
    }
}

/* A vector of n structs of two int64 (FieldNode, Buffer), the elements on 8 bytes. */
static void fb_vec_pairs(buf *f, size_t slot, int n, const int64_t *v) {
    fb_pad(f, 4);
    if (f->n % 8 == 0) b_raw(f, NULL, 4);
    fb_link(f, slot);
    const uint32_t k = (uint32_t)n;
    b_raw(f, &k, 4);
    b_raw(f, v, (size_t)n * 16);
}

/* ---------------------------------------------------------------------------
 * Arrow IPC (the streaming format: Schema.fbs, Message.fbs)
 * ------------------------------------------------------------------------- */

enum { AT_INT = 2, AT_FLOAT = 3, AT_LIST = 12, AT_FIXED_LIST = 16 };   /* Type union */
enum { MH_SCHEMA = 1, MH_RECORD_BATCH = 3 };                            /* MessageHeader union */
#define ARROW_V5 4                                                      /* MetadataVersion */

typedef struct afield {
    const char          *name;
    int                  type, param;   /* Int: bit width (signed); FloatingPoint: precision (1 single); FixedSizeList: size */
    const struct afield *child;
    const char          *ext_name, *ext_meta;   /* ARROW:extension:name / :metadata, NULL: none */
} afield;

static void kv_vec(buf *f, size_t slot, const char *const *kv, int n) {
    size_t el[4], s[2][2];
    fb_vec_off(f, slot, n, el);
    for (int i = 0; i < n; i++) {
        const fb_fld fl[] = { { 0, 0, 0 }, { 1, 0, 0 } };
        fb_table(f, el[i], fl, 2, s[i]);
    }
    for (int i = 0; i < n; i++) {
        fb_string(f, s[i][0], kv[2 * i]);
        fb_string(f, s[i][1], kv[2 * i + 1]);
    }
}

static void field_write(buf *f, size_t slot, const afield *a) {
    size_t s[16] = {0}, ch[1];
    const fb_fld fl[] = { { 0, 0, 0 }, { 1, 1, 1 }, { 2, 1, (uint64_t)a->type }, { 3, 0, 0 }, { 5, 0, 0 }, { 6, 0, 0 } };
    fb_table(f, slot, fl, a->ext_name ? 6 : 5, s);
    fb_string(f, s[0], a->name);
    size_t ts[2];
    if (a->type == AT_INT) {
        const fb_fld t[] = { { 0, 4, (uint64_t)a->param }, { 1, 1, 1 } };
        fb_table(f, s[3], t, 2, ts);
    } else if (a->type == AT_FLOAT) {
        const fb_fld t[] = { { 0, 2, (uint64_t)a->param } };
        fb_table(f, s[3], t, 1, ts);
    } else if (a->type == AT_FIXED_LIST) {
        const fb_fld t[] = { { 0, 4, (uint64_t)a->param } };
        fb_table(f, s[3], t, 1, ts);
    } else {
        fb_table(f, s[3], NULL, 0, ts);
    }
    fb_vec_off(f, s[5], a->child ? 1 : 0, ch);
    if (a->child) field_write(f, ch[0], a->child);
    if (a->ext_name) {
        const char *kv[4] = { "ARROW:extension:name", a->ext_name, "ARROW:extension:metadata", a->ext_meta };
        kv_vec(f, s[6], kv, 2);
    }
}

/* The framing of one message: continuation marker, the metadata's length (padded so the body
 * starts on 8 bytes), the flatbuffer. */
static int ipc_put(FILE *fp, const buf *meta) {
    static const uint8_t z[8];
    const size_t pad = (8 - (meta->n + 8) % 8) % 8;
    const uint32_t head[2] = { 0xFFFFFFFFu, (uint32_t)(meta->n + pad) };
    return fwrite(head, 4, 2, fp) == 2 && fwrite(meta->b, 1, meta->n, fp) == meta->n &&
           fwrite(z, 1, pad, fp) == pad ? 0 : -1;
}

/* ---------------------------------------------------------------------------
 * The dataset's columns: one Array2D per (hook, layer), then token_ids
 * ------------------------------------------------------------------------- */

typedef struct {
    int      hook, layer, width, i32;   /* i32: moe_sel's expert ids */
    char     name[64];                  /* TransformerLens-style */
    char     ext_meta[64];              /* [[C, W], "float32"] */
    uint8_t *win;                       /* this window's rows, [C][width] */
    uint32_t rows;                      /* rows the sink put there */
    int32_t *offs;                      /* the inner list's offsets, 0, W, 2W, ... C*W */
} column;

static const char *tl_name(int hook) {
    switch (hook) {
    case DS4H_ATTN:    return "hook_attn_out";
    case DS4H_RESID:   return "hook_resid_post";
    case DS4H_MOE:     return "hook_mlp_out";
    case DS4H_MOE_W:   return "mlp.hook_expert_weights";
    case DS4H_MOE_SEL: return "mlp.hook_expert_indices";
    }
    return NULL;
}

typedef struct {
    int      C;                /* --ctx */
    column  *col;
    int      ncol;
    int      map[DS4H_N_HOOKS][DS4H_MAX_LAYERS];   /* column of (hook, layer), -1: none */
    int      bad;              /* a record that does not fit its column */
    char     why[256];
} catcher;

static void on_record(void *user, const ds4h_record *r, const void *payload) {
    catcher *k = user;
    if (r->hook >= DS4H_N_HOOKS || r->layer < 0 || r->layer >= DS4H_MAX_LAYERS) return;
    const int ci = k->map[r->hook][r->layer];
    if (ci < 0) return;
    column *c = &k->col[ci];
    const uint64_t w = (uint64_t)r->shape[1] * r->shape[2], rows = r->shape[0];
    if (w != (uint64_t)c->width || r->pos + rows > (uint64_t)k->C) {
        if (!k->bad)
            snprintf(k->why, sizeof k->why, "%s: a record of %llu x %llu at position %u does not fit [%d][%d]", c->name,
                     (unsigned long long)rows, (unsigned long long)w, r->pos, k->C, c->width);
        k->bad = 1;
        return;
    }
    memcpy(c->win + (size_t)r->pos * c->width * 4, payload, (size_t)(rows * w * 4));
    c->rows += (uint32_t)rows;
}

/* The features as `datasets` writes them (Features.to_dict), in column order. */
static void features_json(buf *j, const catcher *k) {
    b_s(j, "{");
    for (int i = 0; i < k->ncol; i++) {
        b_json_str(j, k->col[i].name);
        b_printf(j, ": {\"shape\": [%d, %d], \"dtype\": \"%s\", \"_type\": \"Array2D\"}, ", k->C, k->col[i].width,
                 k->col[i].i32 ? "int32" : "float32");
    }
    b_printf(j, "\"token_ids\": {\"feature\": {\"dtype\": \"int32\", \"_type\": \"Value\"}, \"length\": %d, "
             "\"_type\": \"Sequence\"}}", k->C);
}

/* The schema message: the columns, the huggingface key with the features. */
static int write_schema(FILE *fp, const catcher *k) {
    buf j = {0}, f = {0};
    b_s(&j, "{\"info\": {\"features\": ");
    features_json(&j, k);
    b_raw(&j, "}}", 3);                       /* with the NUL */
    const int n = k->ncol + 1;
    afield *leaf = calloc((size_t)n * 3, sizeof *leaf);
    if (!leaf || j.oom) { free(leaf); free(j.b); return -1; }
    for (int i = 0; i < k->ncol; i++) {
        afield *a = &leaf[3 * i];
        a[2] = (afield){ "item", k->col[i].i32 ? AT_INT : AT_FLOAT, k->col[i].i32 ? 32 : 1, NULL, NULL, NULL };
        a[1] = (afield){ "item", AT_LIST, 0, &a[2], NULL, NULL };
        a[0] = (afield){ k->col[i].name, AT_LIST, 0, &a[1], "datasets.features.features.Array2DExtensionType",
                         k->col[i].ext_meta };
    }
    afield *t = &leaf[3 * k->ncol];
    t[1] = (afield){ "item", AT_INT, 32, NULL, NULL, NULL };
    t[0] = (afield){ "token_ids", AT_FIXED_LIST, k->C, &t[1], NULL, NULL };

    size_t root[1], ms[16], ss[16], el[DS4H_N_HOOKS * DS4H_MAX_LAYERS + 1];
    b_raw(&f, NULL, 4);
    root[0] = 0;
    const fb_fld mfl[] = { { 0, 2, ARROW_V5 }, { 1, 1, MH_SCHEMA }, { 2, 0, 0 }, { 3, 8, 0 } };
    fb_table(&f, root[0], mfl, 4, ms);
    const fb_fld sfl[] = { { 0, 2, 0 }, { 1, 0, 0 }, { 2, 0, 0 } };
    fb_table(&f, ms[2], sfl, 3, ss);
    fb_vec_off(&f, ss[1], n, el);
    for (int i = 0; i < k->ncol; i++) field_write(&f, el[i], &leaf[3 * i]);
    field_write(&f, el[k->ncol], t);
    const char *kv[2] = { "huggingface", (const char *)j.b };
    kv_vec(&f, ss[2], kv, 1);
    const int rc = f.oom ? -1 : ipc_put(fp, &f);
    free(f.b);
    free(j.b);
    free(leaf);
    return rc;
}

/* One record batch: one row, the window. */
static int write_batch(FILE *fp, const catcher *k, const int32_t *ids, uint64_t *bytes) {
    const int n = k->ncol;
    const int64_t C = k->C;
    int64_t *nodes = malloc(sizeof(int64_t) * 2 * (size_t)(3 * n + 2));
    int64_t *bufs = malloc(sizeof(int64_t) * 2 * (size_t)(6 * n + 3));
    if (!nodes || !bufs) { free(nodes); free(bufs); return -1; }
    int nn = 0, nb = 0;
    int64_t o = 0;
#define NODE(len) (nodes[2 * nn] = (len), nodes[2 * nn + 1] = 0, nn++)
#define BUF(len) (bufs[2 * nb] = o, bufs[2 * nb + 1] = (len), o += ((len) + 7) / 8 * 8, nb++)
    for (int i = 0; i < n; i++) {
        const int64_t W = k->col[i].width;
        NODE(1); NODE(C); NODE(C * W);
        BUF(0); BUF(8); BUF(0); BUF((C + 1) * 4); BUF(0); BUF(C * W * 4);
    }
    NODE(1); NODE(C);
    BUF(0); BUF(0); BUF(C * 4);
#undef NODE
#undef BUF
    buf f = {0};
    size_t ms[16], rs[16];
    b_raw(&f, NULL, 4);
    const fb_fld mfl[] = { { 0, 2, ARROW_V5 }, { 1, 1, MH_RECORD_BATCH }, { 2, 0, 0 }, { 3, 8, (uint64_t)o } };
    fb_table(&f, 0, mfl, 4, ms);
    const fb_fld rfl[] = { { 0, 8, 1 }, { 1, 0, 0 }, { 2, 0, 0 } };
    fb_table(&f, ms[2], rfl, 3, rs);
    fb_vec_pairs(&f, rs[1], nn, nodes);
    fb_vec_pairs(&f, rs[2], nb, bufs);
    free(nodes);
    free(bufs);
    int ok = !f.oom && ipc_put(fp, &f) == 0;
    *bytes += f.n + 16;
    free(f.b);
    static const uint8_t z[8];
    for (int i = 0; ok && i < n; i++) {
        const column *c = &k->col[i];
        const int32_t top[2] = { 0, (int32_t)C };
        const size_t no = (size_t)(C + 1) * 4, nv = (size_t)C * c->width * 4;
        ok = fwrite(top, 4, 2, fp) == 2 && fwrite(c->offs, 1, no, fp) == no && fwrite(z, 1, (8 - no % 8) % 8, fp) ==
             (8 - no % 8) % 8 && fwrite(c->win, 1, nv, fp) == nv && fwrite(z, 1, (8 - nv % 8) % 8, fp) == (8 - nv % 8) % 8;
    }
    const size_t nt = (size_t)C * 4;
    ok = ok && fwrite(ids, 1, nt, fp) == nt && fwrite(z, 1, (8 - nt % 8) % 8, fp) == (8 - nt % 8) % 8;
    *bytes += (uint64_t)o;
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------------------
 * --format safetensors: one file per shard, each column a tensor [rows][ctx][width] (F32, or I32
 * for moe_sel) and token_ids [rows][ctx] (I32), in column order, contiguous.  The header is known
 * when the shard opens (its rows are), so the file is sized then and each window written at its
 * row of every tensor: memory stays one window.
 * ------------------------------------------------------------------------- */

/* The header (8-byte length, then the JSON padded with spaces to 8) and the file's full size;
 * *data0 := where the tensors start. */
static int st_open(FILE *fp, const catcher *k, int64_t rows, const char *meta, uint64_t *data0) {
    buf j = {0};
    uint64_t off = 0;
    b_s(&j, "{\"__metadata__\": {\"format\": \"pt\", \"ds4_collect\": ");
    b_json_str(&j, meta);
    b_s(&j, "}");
    for (int i = 0; i <= k->ncol; i++) {
        const int64_t w = i < k->ncol ? k->col[i].width : 1;
        const uint64_t n = (uint64_t)rows * k->C * w * 4;
        b_s(&j, ", ");
        b_json_str(&j, i < k->ncol ? k->col[i].name : "token_ids");
        if (i < k->ncol)
            b_printf(&j, ": {\"dtype\": \"%s\", \"shape\": [%lld, %d, %lld], \"data_offsets\": [%llu, %llu]}",
                     k->col[i].i32 ? "I32" : "F32", (long long)rows, k->C, (long long)w, (unsigned long long)off,
                     (unsigned long long)(off + n));
        else
            b_printf(&j, ": {\"dtype\": \"I32\", \"shape\": [%lld, %d], \"data_offsets\": [%llu, %llu]}", (long long)rows,
                     k->C, (unsigned long long)off, (unsigned long long)(off + n));
        off += n;
    }
    b_s(&j, "}");
    while (j.n % 8) b_s(&j, " ");
    if (j.oom) { free(j.b); errno = ENOMEM; return -1; }
    const uint64_t hl = j.n;
    *data0 = 8 + hl;
    const int ok = fwrite(&hl, 8, 1, fp) == 1 && fwrite(j.b, 1, j.n, fp) == j.n && fflush(fp) == 0 &&
                   ftruncate(fileno(fp), (off_t)(*data0 + off)) == 0;
    free(j.b);
    return ok ? 0 : -1;
}

/* Window `row` of a shard of `rows` into every tensor. */
static int st_window(FILE *fp, const catcher *k, int64_t row, int64_t rows, uint64_t data0, const int32_t *ids,
                     uint64_t *bytes) {
    uint64_t off = data0;
    for (int i = 0; i <= k->ncol; i++) {
        const size_t n = (size_t)k->C * (i < k->ncol ? k->col[i].width : 1) * 4;
        if (fseeko(fp, (off_t)(off + (uint64_t)row * n), SEEK_SET) != 0 ||
            fwrite(i < k->ncol ? (const void *)k->col[i].win : (const void *)ids, 1, n, fp) != n)
            return -1;
        off += (uint64_t)rows * n;
        *bytes += n;
    }
    return 0;
}

/* ---------------------------------------------------------------------------
 * The corpus: documents, their checks, the packing
 * ------------------------------------------------------------------------- */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const uint8_t *s = p;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}
#define FNV0 1469598103934665603ull

static int utf8_ok(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        const uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        int k;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; min = 0x10000; }
        else return 0;
        for (int j = 1; j <= k; j++) {
            if (i + (size_t)j >= n || (s[i + j] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += (size_t)k + 1;
    }
    return 1;
}

/* JSON, enough to take one string field of an object.  Each returns the index after what it
 * read, or -1 when the text is not JSON. */
static size_t js_ws(const char *s, size_t n, size_t i) {
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n')) i++;
    return i;
}

static int hexv(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* The string at s[i] == '"', decoded into out (room for n bytes; NULL: skipped).  A lone
 * surrogate escape is written as its three bytes, which the UTF-8 check refuses. */
static long js_string(const char *s, size_t n, size_t i, char *out, size_t *olen) {
    size_t o = 0;
    i++;
    while (i < n && s[i] != '"') {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20) return -1;
        if (c != '\\') { if (out) out[o] = (char)c; o++; i++; continue; }
        if (++i >= n) return -1;
        char e = s[i++];
        uint32_t cp;
        switch (e) {
        case '"': case '\\': case '/': cp = (uint32_t)e; break;
        case 'b': cp = 8; break;
        case 'f': cp = 12; break;
        case 'n': cp = 10; break;
        case 'r': cp = 13; break;
        case 't': cp = 9; break;
        case 'u': {
            if (i + 4 > n) return -1;
            cp = 0;
            for (int q = 0; q < 4; q++) { const int h = hexv(s[i + q]); if (h < 0) return -1; cp = cp << 4 | (uint32_t)h; }
            i += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && i + 6 <= n && s[i] == '\\' && s[i + 1] == 'u') {
                uint32_t lo = 0;
                int okh = 1;
                for (int q = 0; q < 4; q++) { const int h = hexv(s[i + 2 + q]); if (h < 0) okh = 0; else lo = lo << 4 | (uint32_t)h; }
                if (okh && lo >= 0xDC00 && lo <= 0xDFFF) { cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00); i += 6; }
            }
            break;
        }
        default: return -1;
        }
        uint8_t u[4];
        int k;
        if (cp < 0x80) { u[0] = (uint8_t)cp; k = 1; }
        else if (cp < 0x800) { u[0] = (uint8_t)(0xC0 | cp >> 6); u[1] = (uint8_t)(0x80 | (cp & 0x3F)); k = 2; }
        else if (cp < 0x10000) { u[0] = (uint8_t)(0xE0 | cp >> 12); u[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)); u[2] = (uint8_t)(0x80 | (cp & 0x3F)); k = 3; }
        else { u[0] = (uint8_t)(0xF0 | cp >> 18); u[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F)); u[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)); u[3] = (uint8_t)(0x80 | (cp & 0x3F)); k = 4; }
        if (out) memcpy(out + o, u, (size_t)k);
        o += (size_t)k;
    }
    if (i >= n) return -1;
    if (olen) *olen = o;
    return (long)i + 1;
}

static long js_value(const char *s, size_t n, size_t i, int depth) {
    if (depth > 64 || i >= n) return -1;
    if (s[i] == '"') return js_string(s, n, i, NULL, NULL);
    if (s[i] == '{' || s[i] == '[') {
        const char close = s[i] == '{' ? '}' : ']';
        const int obj = s[i] == '{';
        i = js_ws(s, n, i + 1);
        if (i < n && s[i] == close) return (long)i + 1;
        for (;;) {
            long r;
            if (obj) {
                if (i >= n || s[i] != '"' || (r = js_string(s, n, i, NULL, NULL)) < 0) return -1;
                i = js_ws(s, n, (size_t)r);
                if (i >= n || s[i] != ':') return -1;
                i = js_ws(s, n, i + 1);
            }
            if ((r = js_value(s, n, i, depth + 1)) < 0) return -1;
            i = js_ws(s, n, (size_t)r);
            if (i < n && s[i] == ',') { i = js_ws(s, n, i + 1); continue; }
            if (i < n && s[i] == close) return (long)i + 1;
            return -1;
        }
    }
    const size_t i0 = i;
    while (i < n && (strchr("+-.eE", s[i]) || (s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z'))) i++;
    if (i == i0) return -1;
    if (s[i0] >= 'a' && s[i0] <= 'z' && !((i - i0 == 4 && (!strncmp(s + i0, "true", 4) || !strncmp(s + i0, "null", 4))) ||
                                          (i - i0 == 5 && !strncmp(s + i0, "false", 5))))
        return -1;
    return (long)i;
}

/* The string field `field` of the object on a line: decoded into out (n bytes suffice).  0; -1:
 * not a JSON object; -2: no such string field. */
static int js_field(const char *s, size_t n, const char *field, char *out, size_t *olen) {
    if (js_value(s, n, js_ws(s, n, 0), 0) < 0) return -1;
    size_t i = js_ws(s, n, 0);
    if (s[i] != '{' || js_ws(s, n, (size_t)js_value(s, n, i, 0)) != n) return -1;
    i = js_ws(s, n, i + 1);
    const size_t fl = strlen(field);
    int found = -2;
    while (i < n && s[i] == '"') {
        size_t kl;
        char *key = malloc(n);
        if (!key) return -1;
        const long r = js_string(s, n, i, key, &kl);
        const int match = r > 0 && kl == fl && !memcmp(key, field, fl);
        free(key);
        i = js_ws(s, n, (size_t)r);
        i = js_ws(s, n, i + 1);                             /* the ':' */
        if (match && s[i] == '"' && found == -2) { js_string(s, n, i, out, olen); found = 0; }
        i = js_ws(s, n, (size_t)js_value(s, n, i, 0));
        if (i < n && s[i] == ',') i = js_ws(s, n, i + 1);
    }
    return found;
}

enum { DOC_OK, DOC_EMPTY, DOC_BAD_UTF8, DOC_BIG, DOC_BAD_JSON, DOC_N };
static const char *const doc_what[DOC_N] = { "used", "empty", "invalid_utf8", "oversized", "bad_json" };

typedef struct {
    FILE       *f;
    int         jsonl;
    const char *field;
    size_t      max_bytes;
    char       *line, *text;
    size_t      cap, tcap;
    uint64_t    hash, bytes;
} corpus;

/* The next document: its class (DOC_*), its text in *t, *n bytes; -1 at the end, -2 on a read
 * error. */
static int next_doc(corpus *cp, const char **t, size_t *n) {
    errno = 0;
    const ssize_t got = getline(&cp->line, &cp->cap, cp->f);
    if (got < 0) return ferror(cp->f) ? -2 : -1;
    cp->hash = fnv(cp->hash, cp->line, (size_t)got);
    cp->bytes += (uint64_t)got;
    size_t len = (size_t)got;
    if (len && cp->line[len - 1] == '\n') len--;
    if (len && cp->line[len - 1] == '\r') len--;
    if (len > cp->max_bytes) return DOC_BIG;
    const char *s = cp->line;
    if (cp->jsonl) {
        if (js_ws(cp->line, len, 0) == len) return DOC_EMPTY;
        if (cp->tcap < len + 1) {
            char *nt = realloc(cp->text, len + 1);
            if (!nt) return -2;
            cp->text = nt;
            cp->tcap = len + 1;
        }
        if (js_field(cp->line, len, cp->field, cp->text, &len) != 0) return DOC_BAD_JSON;
        s = cp->text;
    }
    if (!len) return DOC_EMPTY;
    if (!utf8_ok((const uint8_t *)s, len)) return DOC_BAD_UTF8;
    *t = s;
    *n = len;
    return DOC_OK;
}

typedef struct {
    int32_t *q;                /* pending stream tokens q[head:n) */
    size_t   n, head, cap;
    int32_t  bos;
    int      C;
} packer;

static int pk_push(packer *p, const int32_t *ids, size_t k) {
    if (p->head > 0 && p->head == p->n) p->head = p->n = 0;
    if (p->head > p->n / 2) {
        memmove(p->q, p->q + p->head, (p->n - p->head) * 4);
        p->n -= p->head;
        p->head = 0;
    }
    const size_t need = p->n + k + 1;
    if (need > p->cap) {
        int32_t *nq = realloc(p->q, need * 2 * 4);
        if (!nq) return -1;
        p->q = nq;
        p->cap = need * 2;
    }
    if (p->n > p->head) p->q[p->n++] = p->bos;      /* the separator between two documents */
    memcpy(p->q + p->n, ids, k * 4);
    p->n += k;
    return 0;
}

static int pk_window(packer *p, int32_t *out) {
    const size_t avail = p->n - p->head;
    const size_t lead = avail > 0 && p->q[p->head] == p->bos;
    if (avail < (size_t)p->C - 1 + lead) return 0;
    out[0] = p->bos;
    memcpy(out + 1, p->q + p->head + lead, (size_t)(p->C - 1) * 4);
    p->head += (size_t)p->C - 1 + lead;
    return 1;
}

/* A document's ids into *ids (grown as needed): their count, -1 on failure. */
static int tokenize(const ds4_tok *tok, const char *t, size_t n, int32_t **ids, size_t *cap) {
    if (n > INT_MAX / 2) return -1;
    int k = ds4_tok_encode(tok, t, n, 0, *ids, (int)*cap);
    if (k > (int)*cap) {
        free(*ids);
        *cap = (size_t)k;
        *ids = malloc(*cap * 4);
        if (!*ids) { *cap = 0; return -1; }
        k = ds4_tok_encode(tok, t, n, 0, *ids, (int)*cap);
    }
    return k;
}

/* ---------------------------------------------------------------------------
 * The command
 * ------------------------------------------------------------------------- */

typedef struct {
    const char *model, *input, *out, *hooks, *ds4h, *field, *backend;
    int         ctx, jsonl, threads, stop_after, safetensors;
    int64_t     tokens, shard_rows, max_doc;
    int         help;
} copts;

static int opt_i64(const char *flag, const char *v, int64_t lo, int64_t hi, int64_t *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    const long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        ds4_errf(err, errlen, "%s expects an integer in [%lld, %lld]", flag, (long long)lo, (long long)hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int collect_parse(int argc, char **argv, copts *o, char *err, size_t errlen) {
    static const char *const names[] = { "-m", "-i", "-o", "--hooks", "--ds4h", "--text-field", "--backend", "--ctx",
                                         "--threads", "--stop-after-shards", "--tokens", "--shard-rows",
                                         "--max-doc-bytes", "--format", "--jsonl" };
    enum { NN = sizeof names / sizeof names[0] };
    int seen[NN] = {0};
    char sh[260];
    memset(o, 0, sizeof *o);
    o->ctx = 128;
    o->field = "text";
    o->max_doc = 16 << 20;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { o->help = 1; return 0; }
        int q = 0;
        while (q < NN && strcmp(a, names[q])) q++;
        if (q == NN) {
            ds4_errf(err, errlen, "unknown collect option '%s' (see ds4 collect --help)", ds4_show(sh, sizeof sh, a, strlen(a), 64));
            return -1;
        }
        if (seen[q]++) { ds4_errf(err, errlen, "%s is given twice (each option at most once)", a); return -1; }
        if (q == NN - 1) { o->jsonl = 1; continue; }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        if (!v) { ds4_errf(err, errlen, "option %s needs a value", a); return -1; }
        int64_t x = 0;
        switch (q) {
        case 0: o->model = v; break;
        case 1: o->input = v; break;
        case 2: o->out = v; break;
        case 3: o->hooks = v; break;
        case 4: o->ds4h = v; break;
        case 5: o->field = v; break;
        case 6: o->backend = v; break;
        case 7: if (opt_i64(a, v, 2, 1 << 20, &x, err, errlen)) return -1; o->ctx = (int)x; break;
        case 8: if (opt_i64(a, v, 1, 64, &x, err, errlen)) return -1; o->threads = (int)x; break;
        case 9: if (opt_i64(a, v, 1, 99999, &x, err, errlen)) return -1; o->stop_after = (int)x; break;
        case 10: if (opt_i64(a, v, 1, INT64_MAX / 2, &o->tokens, err, errlen)) return -1; break;
        case 11: if (opt_i64(a, v, 1, 1 << 30, &o->shard_rows, err, errlen)) return -1; break;
        case 12: if (opt_i64(a, v, 1, (int64_t)1 << 32, &o->max_doc, err, errlen)) return -1; break;
        case 13:
            if (!strcmp(v, "safetensors")) o->safetensors = 1;
            else if (strcmp(v, "arrow")) {
                ds4_errf(err, errlen, "unknown --format '%s' (arrow or safetensors)", ds4_show(sh, sizeof sh, v, strlen(v), 64));
                return -1;
            }
            break;
        }
    }
    if (!o->input) { ds4_errf(err, errlen, "collect needs -i CORPUS (plain text, one document per line; --jsonl: JSON lines)"); return -1; }
    if (!o->out) { ds4_errf(err, errlen, "collect needs -o DIR (the dataset directory)"); return -1; }
    if (!o->hooks) { ds4_errf(err, errlen, "collect needs --hooks SPEC (e.g. resid:20,attn:10-12)"); return -1; }
    if (seen[5] && !o->jsonl) { ds4_errf(err, errlen, "--text-field goes with --jsonl"); return -1; }
    if (o->tokens && o->tokens < o->ctx) {
        ds4_errf(err, errlen, "--tokens %lld is less than one window of --ctx %d", (long long)o->tokens, o->ctx);
        return -1;
    }
    if (o->backend && strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda")) {
        ds4_errf(err, errlen, "unknown --backend '%s' (cpu or cuda)", o->backend);
        return -1;
    }
#ifndef DS4_CUDA
    if (o->backend && !strcmp(o->backend, "cuda")) {
        ds4_errf(err, errlen, "--backend cuda: this ds4 was built without CUDA (run: make cuda CUDA_ARCH=sm_90)");
        return -1;
    }
#endif
    return 0;
}

static void collect_usage(FILE *f) {
    fprintf(f,
        "usage: ds4 collect -i CORPUS -o DIR --hooks SPEC [options]\n"
        "  activations of a corpus as a Hugging Face datasets directory (save_to_disk's layout,\n"
        "  SAELens's activation cache: one Array2D column per hook, token_ids); README, \"ds4 collect\"\n"
        "  -m FILE               model (default: models/ds4-tiny.gguf beside the binary)\n"
        "  -i CORPUS             plain text, one document per line (--jsonl: one JSON object per line)\n"
        "  -o DIR                the dataset directory (made; a run into it again resumes)\n"
        "  --hooks SPEC          the hooks, as DS4_HOOKS: attn, resid, moe, moe_sel, moe_w with layer ranges\n"
        "  --ctx N               tokens per window, BOS first (default 128)\n"
        "  --tokens N            token budget: at most N / ctx windows (default: the whole corpus)\n"
        "  --shard-rows N        windows per shard (default: as many as fit in 512 MiB)\n"
        "  --jsonl               the corpus is JSON lines; --text-field NAME (default text) holds the document\n"
        "  --max-doc-bytes N     longer lines are skipped and counted (default 16 MiB)\n"
        "  --format F            arrow (the datasets directory, default) or safetensors (one file per shard)\n"
        "  --ds4h FILE           also write the run's hook stream (.ds4h) to FILE\n"
        "  --stop-after-shards K debug: stop once K shards were written by this run (resume test)\n"
        "  --threads N           CPU threads (default: DS4_THREADS or all cores)\n"
        "  --backend cpu|cuda    the backend (default cpu)\n");
}

/* ---------------------------------------------------------------------------
 * The writer thread: a window's write overlaps the next window's prefill
 *
 * Two catchers take turns: the sink fills one (the window being computed) while the writer
 * writes the other (the window before), with that window's own token ids.  One job at a time:
 * the main thread hands a window over once the writer is done with the one before, so memory
 * holds two windows of activations.  The writer owns the open shard: it makes NAME.partial
 * at the shard's first window of this run, writes each window, and at the shard's last one
 * ends the stream, syncs, closes and renames.  A failure keeps its one-line message for the
 * main thread, which says it and stops; a shard left open is removed at the end.  Between
 * jobs (busy == 0, under mu) everything here is the main thread's to read.
 * ------------------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             busy, quit;
    /* the job */
    const catcher  *k;
    const int32_t  *ids;
    int64_t         s, row, srows;
    int             last;
    /* the settings */
    const char     *out, *ext, *meta;
    int             safetensors;
    int64_t         S, have;              /* shards whole before this run */
    char           *done;
    /* the writer's own, and what it has done */
    FILE           *sf;
    char            spath[PATH_MAX + 64], tpath[PATH_MAX + 80];
    uint64_t        data0;                /* safetensors: where the open shard's tensors start */
    int64_t         shards;               /* shards this run made whole */
    uint64_t        bytes;
    int             failed;
    char            why[PATH_MAX + 256];
} writer;

static void wr_fail(writer *wr) {
    snprintf(wr->why, sizeof wr->why, "writing %s failed: %s; the %lld whole shards stay, run again to resume",
             wr->tpath, strerror(errno ? errno : EIO), (long long)(wr->have + wr->shards));
    wr->failed = 1;
}

static void wr_job(writer *wr) {
    if (!wr->sf) {
        snprintf(wr->spath, sizeof wr->spath, "%s/data-%05lld-of-%05lld.%s", wr->out, (long long)wr->s, (long long)wr->S,
                 wr->ext);
        snprintf(wr->tpath, sizeof wr->tpath, "%s.partial", wr->spath);
        errno = 0;
        wr->sf = fopen(wr->tpath, "wb");
        if (!wr->sf || (wr->safetensors ? st_open(wr->sf, wr->k, wr->srows, wr->meta, &wr->data0)
                                        : write_schema(wr->sf, wr->k)) != 0) { wr_fail(wr); return; }
    }
    errno = 0;
    if ((wr->safetensors ? st_window(wr->sf, wr->k, wr->row, wr->srows, wr->data0, wr->ids, &wr->bytes)
                         : write_batch(wr->sf, wr->k, wr->ids, &wr->bytes)) != 0) { wr_fail(wr); return; }
    if (!wr->last) return;
    static const uint32_t eos[2] = { 0xFFFFFFFFu, 0 };
    errno = 0;
    int ok = (wr->safetensors || fwrite(eos, 4, 2, wr->sf) == 2) && fflush(wr->sf) == 0 && fsync(fileno(wr->sf)) == 0;
    if (fclose(wr->sf) != 0) ok = 0;
    wr->sf = NULL;
    if (!ok || rename(wr->tpath, wr->spath) != 0) {
        wr_fail(wr);
        unlink(wr->tpath);
        return;
    }
    wr->done[wr->s] = 1;
    wr->shards++;
}

static void *wr_main(void *arg) {
    writer *wr = arg;
    sigset_t ss;                          /* Ctrl-C and SIGTERM are the main thread's to take */
    sigemptyset(&ss);
    sigaddset(&ss, SIGINT);
    sigaddset(&ss, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &ss, NULL);
    pthread_mutex_lock(&wr->mu);
    for (;;) {
        while (!wr->busy && !wr->quit) pthread_cond_wait(&wr->cv, &wr->mu);
        if (!wr->busy) break;
        pthread_mutex_unlock(&wr->mu);
        if (!wr->failed) wr_job(wr);
        pthread_mutex_lock(&wr->mu);
        wr->busy = 0;
        pthread_cond_broadcast(&wr->cv);
    }
    pthread_mutex_unlock(&wr->mu);
    return NULL;
}

/* Until the writer is done with the window it was given. */
static void wr_wait(writer *wr) {
    pthread_mutex_lock(&wr->mu);
    while (wr->busy) pthread_cond_wait(&wr->cv, &wr->mu);
    pthread_mutex_unlock(&wr->mu);
}

static void wr_give(writer *wr, const catcher *k, const int32_t *ids, int64_t s, int64_t row, int64_t srows, int last) {
    pthread_mutex_lock(&wr->mu);
    wr->k = k;
    wr->ids = ids;
    wr->s = s;
    wr->row = row;
    wr->srows = srows;
    wr->last = last;
    wr->busy = 1;
    pthread_cond_broadcast(&wr->cv);
    pthread_mutex_unlock(&wr->mu);
}

static volatile sig_atomic_t g_stop;
static void on_signal(int sig) { g_stop = sig; signal(sig, SIG_DFL); }
static int on_chunk(void *user, int done, int total) { (void)user; (void)done; (void)total; return g_stop != 0; }

static int write_file(const char *dir, const char *name, const buf *b, char *err, size_t errlen) {
    char path[PATH_MAX], tmp[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.partial", path);
    FILE *f = fopen(tmp, "wb");
    int ok = f && !b->oom && fwrite(b->b, 1, b->n, f) == b->n;
    if (f && fclose(f) != 0) ok = 0;
    if (!ok || rename(tmp, path) != 0) {
        ds4_errf(err, errlen, "writing %s failed: %s", path, strerror(errno ? errno : EIO));
        unlink(tmp);
        return -1;
    }
    return 0;
}

static char *read_small(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *s = malloc(1 << 20);
    size_t n = s ? fread(s, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (s) s[n] = 0;
    return s;
}

int cmd_collect(int argc, char **argv) {
    char err[1024], sh[260];
    copts o;
    if (collect_parse(argc, argv, &o, err, sizeof err) != 0) { fprintf(stderr, "ds4: %s\n", err); return EXIT_USAGE; }
    if (o.help) { collect_usage(stdout); return 0; }
    if (getenv("DS4_HOOKS") || getenv("DS4_HOOKS_OUT")) {
        fprintf(stderr, "ds4: collect selects its hooks with --hooks and writes a stream with --ds4h; unset DS4_HOOKS "
                "and DS4_HOOKS_OUT\n");
        return EXIT_USAGE;
    }
    ds4h_selection sel;
    if (ds4h_parse(o.hooks, &sel, err, sizeof err) != 0) { fprintf(stderr, "ds4: --hooks: %s\n", err); return EXIT_USAGE; }
    for (int l = 0; l < DS4H_MAX_LAYERS; l++)
        if (ds4h_selected(&sel, DS4H_ATTN_PROBS, l) || ds4h_selected(&sel, DS4H_LOGITS, -1)) {
            fprintf(stderr, "ds4: --hooks: collect takes attn, resid, moe, moe_sel and moe_w (logits and attn_probs have "
                    "no [ctx][width] shape)\n");
            return EXIT_USAGE;
        }
    /* the engine takes its selection from the environment: --hooks becomes DS4_HOOKS, and the
     * stream goes to --ds4h or nowhere (a device is written in place) */
    setenv("DS4_HOOKS", o.hooks, 1);
    setenv("DS4_HOOKS_OUT", o.ds4h ? o.ds4h : "/dev/null", 1);
    ds4_env env;
    if (ds4_env_read(&env, err, sizeof err) != 0) { fprintf(stderr, "ds4: %s\n", err); return EXIT_USAGE; }
    const int threads = o.threads ? o.threads : env.threads;
    if (threads > 0) ds4_cpu_set_threads(threads);

    char defpath[PATH_MAX + 32];
    const char *mpath = o.model ? o.model : default_model_path(defpath, sizeof defpath);
    ds4_model *m = ds4_model_open(mpath, err, sizeof err);
    if (!m) { fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
    const int hrc = ds4_hooks_check(m, &env, err, sizeof err);
    if (hrc != 0) { fprintf(stderr, "ds4: %s\n", err); return hrc == -1 ? EXIT_USAGE : EXIT_FAIL; }
    ds4_tok *tok = ds4_model_has_vocab(m) ? ds4_model_tokenizer(m, err, sizeof err) : NULL;
    if (!tok) {
        fprintf(stderr, "ds4: collect needs a model with a vocabulary%s%s\n", ds4_model_has_vocab(m) ? ": " : "",
                ds4_model_has_vocab(m) ? err : " (this one has none)");
        return EXIT_USAGE;
    }
    const int bos = ds4_model_bos(m);
    if (bos < 0) { fprintf(stderr, "ds4: collect: the vocabulary has no BOS token to begin windows with\n"); return EXIT_USAGE; }
    if ((int64_t)o.ctx > ds4_model_n_ctx_train(m)) {
        fprintf(stderr, "ds4: --ctx %d is past the model's context_length %lld\n", o.ctx, (long long)ds4_model_n_ctx_train(m));
        return EXIT_USAGE;
    }

    /* the columns, by layer, then in the catalog's order */
    int n_layer, D, hc, k_used;
    ds4_model_dims(m, &n_layer, &D, &hc, &k_used);
    static catcher K;
    memset(&K, 0, sizeof K);
    memset(K.map, 0xff, sizeof K.map);
    K.C = o.ctx;
    K.col = calloc((size_t)n_layer * DS4H_N_HOOKS, sizeof *K.col);
    if (!K.col) { fprintf(stderr, "ds4: out of memory\n"); return EXIT_FAIL; }
    static const int order[] = { DS4H_ATTN, DS4H_MOE, DS4H_RESID, DS4H_MOE_W, DS4H_MOE_SEL };
    uint64_t row_bytes = (uint64_t)o.ctx * 4;
    for (int l = 0; l < n_layer; l++)
        for (int q = 0; q < 5; q++) {
            const int h = order[q];
            if (!ds4h_selected(&sel, h, l)) continue;
            column *c = &K.col[K.ncol];
            c->hook = h;
            c->layer = l;
            c->i32 = h == DS4H_MOE_SEL;
            c->width = h == DS4H_RESID ? hc * D : h == DS4H_MOE_W || h == DS4H_MOE_SEL ? k_used : D;
            snprintf(c->name, sizeof c->name, "blocks.%d.%s", l, tl_name(h));
            snprintf(c->ext_meta, sizeof c->ext_meta, "[[%d, %d], \"%s\"]", o.ctx, c->width, c->i32 ? "int32" : "float32");
            c->win = malloc((size_t)o.ctx * c->width * 4);
            c->offs = malloc((size_t)(o.ctx + 1) * 4);
            if (!c->win || !c->offs) { fprintf(stderr, "ds4: out of memory for a window's activations\n"); return EXIT_FAIL; }
            for (int r = 0; r <= o.ctx; r++) c->offs[r] = r * c->width;
            K.map[h][l] = K.ncol++;
            row_bytes += (uint64_t)o.ctx * c->width * 4;
        }
    const int64_t R = o.shard_rows ? o.shard_rows : (int64_t)((512ull << 20) / row_bytes > 0 ? (512ull << 20) / row_bytes : 1);

    /* pass 1: the windows, the counts, the corpus's hash */
    corpus cp = { .jsonl = o.jsonl, .field = o.field, .max_bytes = (size_t)o.max_doc, .hash = FNV0 };
    const int64_t max_windows = o.tokens ? o.tokens / o.ctx : INT64_MAX;
    uint64_t counts[DOC_N] = {0}, doc_tokens = 0;
    int64_t W = 0;
    packer pk = { .bos = bos, .C = o.ctx };
    int32_t *ids = NULL, *win = malloc((size_t)o.ctx * 4);
    size_t ids_cap = 0;
    if (!win) { fprintf(stderr, "ds4: out of memory\n"); return EXIT_FAIL; }
    cp.f = fopen(o.input, "rb");
    if (!cp.f) { fprintf(stderr, "ds4: cannot read the corpus '%s': %s\n", ds4_show(sh, sizeof sh, o.input, strlen(o.input), 64), strerror(errno)); return EXIT_FAIL; }
    for (;;) {
        const char *t;
        size_t n;
        const int d = next_doc(&cp, &t, &n);
        if (d == -2) { fprintf(stderr, "ds4: reading the corpus '%s' failed\n", ds4_show(sh, sizeof sh, o.input, strlen(o.input), 64)); return EXIT_FAIL; }
        if (d == -1) break;
        if (W >= max_windows) continue;     /* past the budget: only hashed */
        counts[d]++;
        if (d != DOC_OK) continue;
        const int k = tokenize(tok, t, n, &ids, &ids_cap);
        if (k < 0) { fprintf(stderr, "ds4: cannot tokenize a document (out of memory)\n"); return EXIT_FAIL; }
        doc_tokens += (uint64_t)k;
        if (pk_push(&pk, ids, (size_t)k) != 0) { fprintf(stderr, "ds4: out of memory packing\n"); return EXIT_FAIL; }
        while (W < max_windows && pk_window(&pk, win)) W++;
    }
    const uint64_t tail = pk.n - pk.head;
    if (W == 0) {
        fprintf(stderr, "ds4: collect: the corpus gives no whole window of %d tokens (%llu documents used, %llu tokens)\n",
                o.ctx, (unsigned long long)counts[DOC_OK], (unsigned long long)doc_tokens);
        return EXIT_FAIL;
    }
    const int64_t S = (W + R - 1) / R;
    if (S > 99999) { fprintf(stderr, "ds4: collect: %lld shards are too many for data-XXXXX-of-NNNNN names; give a larger --shard-rows\n", (long long)S); return EXIT_USAGE; }

    /* the settings and the counts: the dataset's identity (a resumed run must find the same) */
    uint64_t th = FNV0;
    {
        char piece[4096];
        for (int id = 0; id < ds4_tok_n_tokens(tok); id++) {
            int len = ds4_tok_piece(tok, id, piece, sizeof piece);
            if (len < 0) len = 0;
            const uint32_t l32 = (uint32_t)len;
            th = fnv(fnv(th, &l32, 4), piece, (size_t)len);
        }
    }
    struct stat mst;
    const uint64_t msize = stat(mpath, &mst) == 0 ? (uint64_t)mst.st_size : 0;
    const char *mbase = strrchr(mpath, '/') ? strrchr(mpath, '/') + 1 : mpath;
    const char *ibase = strrchr(o.input, '/') ? strrchr(o.input, '/') + 1 : o.input;
    buf meta = {0};
    b_s(&meta, "{\"tool\": \"ds4 collect\", \"model\": {\"file\": ");
    b_json_str(&meta, mbase);
    b_printf(&meta, ", \"bytes\": %llu, \"n_layer\": %d, \"n_embd\": %d, \"n_hc\": %d, \"n_expert_used\": %d, \"n_vocab\": %d}, ",
             (unsigned long long)msize, n_layer, D, hc, k_used, ds4_model_n_vocab(m));
    b_s(&meta, "\"hooks\": ");
    b_json_str(&meta, o.hooks);
    b_s(&meta, ", \"columns\": [");
    for (int i = 0; i < K.ncol; i++) {
        b_printf(&meta, "%s{\"name\": ", i ? ", " : "");
        b_json_str(&meta, K.col[i].name);
        b_printf(&meta, ", \"ds4_hook\": \"%s\", \"layer\": %d, \"width\": %d, \"dtype\": \"%s\"}", ds4h_name(K.col[i].hook),
                 K.col[i].layer, K.col[i].width, K.col[i].i32 ? "int32" : "float32");
    }
    b_printf(&meta, "], \"format\": \"%s\"", o.safetensors ? "safetensors" : "arrow");
    b_printf(&meta, ", \"context_size\": %d, \"packing\": \"bos_first_bos_separated\", \"tokenizer\": {\"model\": \"gpt2\", "
             "\"n_tokens\": %d, \"bos\": %d, \"eos\": %d, \"pieces_fnv1a64\": \"%016llx\"}, \"corpus\": {\"file\": ", o.ctx,
             ds4_tok_n_tokens(tok), bos, ds4_model_eos(m), (unsigned long long)th);
    b_json_str(&meta, ibase);
    b_printf(&meta, ", \"bytes\": %llu, \"fnv1a64\": \"%016llx\", \"format\": \"%s\", \"text_field\": ",
             (unsigned long long)cp.bytes, (unsigned long long)cp.hash, o.jsonl ? "jsonl" : "text");
    if (o.jsonl) b_json_str(&meta, o.field); else b_s(&meta, "null");
    b_printf(&meta, ", \"max_doc_bytes\": %lld}, \"documents\": {", (long long)o.max_doc);
    for (int d = 0; d < DOC_N; d++) b_printf(&meta, "%s\"%s\": %llu", d ? ", " : "", doc_what[d], (unsigned long long)counts[d]);
    b_printf(&meta, "}, \"document_tokens\": %llu, \"token_budget\": %lld, \"windows\": %lld, \"tokens\": %lld, "
             "\"tail_tokens_dropped\": %llu, \"shard_rows\": %lld, \"shards\": %lld}", (unsigned long long)doc_tokens,
             (long long)o.tokens, (long long)W, (long long)(W * o.ctx), (unsigned long long)(W < max_windows ? tail : 0),
             (long long)R, (long long)S);
    b_raw(&meta, "\n", 2);
    if (meta.oom) { fprintf(stderr, "ds4: out of memory\n"); return EXIT_FAIL; }
    meta.n--;                                 /* the NUL stays after the text */

    /* the directory: new, or a run of the same settings to resume */
    if (mkdir(o.out, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "ds4: cannot make the dataset directory '%s': %s\n", ds4_show(sh, sizeof sh, o.out, strlen(o.out), 64), strerror(errno));
        return EXIT_FAIL;
    }
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/ds4_collect.json", o.out);
    char *old = read_small(path);
    int resumed = 0;
    if (old) {
        if (strcmp(old, (const char *)meta.b) != 0) {
            fprintf(stderr, "ds4: collect: '%s' holds a dataset of other settings, model or corpus (ds4_collect.json "
                    "differs); give another -o or remove it\n", ds4_show(sh, sizeof sh, o.out, strlen(o.out), 64));
            return EXIT_USAGE;
        }
        resumed = 1;
        free(old);
    } else {
        DIR *dd = opendir(o.out);
        for (struct dirent *e; dd && (e = readdir(dd));)
            if (!strncmp(e->d_name, "data-", 5)) {
                fprintf(stderr, "ds4: collect: '%s' holds shards without ds4_collect.json; give another -o\n",
                        ds4_show(sh, sizeof sh, o.out, strlen(o.out), 64));
                return EXIT_USAGE;
            }
        if (dd) closedir(dd);
        if (write_file(o.out, "ds4_collect.json", &meta, err, sizeof err) != 0) { fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
    }
    /* a shard is whole when it exists; a .partial is what an interrupted run left */
    int64_t have = 0;
    const char *ext = o.safetensors ? "safetensors" : "arrow";
    char *done = calloc((size_t)S, 1);
    if (!done) { fprintf(stderr, "ds4: out of memory\n"); return EXIT_FAIL; }
    for (int64_t s = 0; s < S; s++) {
        struct stat st;
        snprintf(path, sizeof path, "%s/data-%05lld-of-%05lld.%s", o.out, (long long)s, (long long)S, ext);
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) { done[s] = 1; have++; }
        strcat(path, ".partial");
        unlink(path);
    }

    ds4_model_describe(m, stderr);
    fprintf(stderr, "ds4: collect: %lld windows of %d tokens (%lld tokens) in %lld shards of %lld; %d columns, "
            "%.1f MB per window%s\n", (long long)W, o.ctx, (long long)(W * o.ctx), (long long)S, (long long)R, K.ncol,
            row_bytes / 1e6, resumed ? (have ? "; resuming" : "; resuming (no whole shard yet)") : "");
    if (resumed && have)
        fprintf(stderr, "ds4: collect: %lld of %lld shards are whole and stay as they are\n", (long long)have, (long long)S);

    ds4_ctx *c = NULL;
    if (have < S) {
        const ds4_backend *be = ds4_backend_cpu();
#ifdef DS4_CUDA
        if (o.backend && !strcmp(o.backend, "cuda")) be = ds4_backend_cuda();
#endif
        c = ds4_ctx_new(m, be, o.ctx, o.ctx, err, sizeof err);
        if (!c) { if (err[0]) fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
        if (ds4_ctx_set_hook_sink(c, on_record, &K, err, sizeof err) != 0) { fprintf(stderr, "ds4: %s\n", err); return EXIT_FAIL; }
        ds4_ctx_set_progress(c, on_chunk, NULL);
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGXFSZ, SIG_IGN);                 /* past a file size limit: a write error, said as one */

    /* pass 2 */
    rewind(cp.f);
    cp.hash = FNV0;
    cp.bytes = 0;
    free(pk.q);
    memset(&pk, 0, sizeof pk);
    pk.bos = bos;
    pk.C = o.ctx;
    /* two catchers and two token windows, taking turns (the writer thread's section) */
    catcher K2 = K;
    K2.col = malloc((size_t)K.ncol * sizeof *K2.col);
    int32_t *win2 = malloc((size_t)o.ctx * 4);
    if (!K2.col || !win2) { fprintf(stderr, "ds4: out of memory\n"); return EXIT_FAIL; }
    for (int i = 0; i < K.ncol; i++) {
        K2.col[i] = K.col[i];                 /* offs is shared (read only) */
        K2.col[i].win = malloc((size_t)o.ctx * K.col[i].width * 4);
        if (!K2.col[i].win) { fprintf(stderr, "ds4: out of memory for a window's activations\n"); return EXIT_FAIL; }
    }
    catcher *kc[2] = { &K, &K2 };
    int32_t *wins[2] = { win, win2 };
    int cur = 0;
    writer wr;
    memset(&wr, 0, sizeof wr);
    wr.out = o.out;
    wr.ext = ext;
    wr.meta = (const char *)meta.b;
    wr.safetensors = o.safetensors;
    wr.S = S;
    wr.have = have;
    wr.done = done;
    pthread_t wthr;
    if (pthread_mutex_init(&wr.mu, NULL) != 0 || pthread_cond_init(&wr.cv, NULL) != 0 ||
        pthread_create(&wthr, NULL, wr_main, &wr) != 0) {
        fprintf(stderr, "ds4: collect: cannot start the writer thread\n");
        return EXIT_FAIL;
    }
    int64_t w = 0, run_windows = 0, handed = 0, stop_shards = 0, todo = 0;
    for (int64_t s = 0; s < S; s++) if (!done[s]) todo += (s == S - 1 ? W - s * R : R);
    const double t0 = now_s();
    int rc = 0, stop = 0, tty = isatty(STDERR_FILENO), shown_last = 0;
    /* the progress line, once the writer is done with a window: on a terminal after every
     * window, else after every shard */
#define PROGRESS() do {                                                                                       \
        const double el_ = now_s() - t0, rate_ = run_windows * (double)o.ctx / (el_ > 1e-9 ? el_ : 1e-9);     \
        const double eta_ = rate_ > 0 ? (todo - run_windows) * (double)o.ctx / rate_ : 0;                     \
        fprintf(stderr, "%sds4: collect: shard %lld/%lld, %lld/%lld tokens, %.1f tok/s, %.3f GB written, %.0f s left%s", \
                tty ? "\r\033[K" : "", (long long)(have + wr.shards), (long long)S, (long long)(run_windows * o.ctx), \
                (long long)(todo * o.ctx), rate_, wr.bytes / 1e9, eta_, tty ? "" : "\n");                     \
    } while (0)
    while (!stop && w < W) {
        const char *t;
        size_t n;
        const int d = next_doc(&cp, &t, &n);
        if (d == -2) { fprintf(stderr, "ds4: reading the corpus failed\n"); rc = EXIT_FAIL; break; }
        if (d == -1) break;
        if (d != DOC_OK) continue;
        const int k = tokenize(tok, t, n, &ids, &ids_cap);
        if (k < 0 || pk_push(&pk, ids, (size_t)k) != 0) { fprintf(stderr, "ds4: tokenizing failed\n"); rc = EXIT_FAIL; break; }
        while (!stop && w < W && pk_window(&pk, wins[cur])) {
            const int64_t s = w / R, row = w % R;
            const int last = row == R - 1 || w == W - 1;
            w++;
            if (done[s]) continue;
            if (g_stop) { stop = 1; break; }
            catcher *kk = kc[cur];
            for (int i = 0; i < kk->ncol; i++) kk->col[i].rows = 0;
            if (ds4_ctx_set_hook_sink(c, on_record, kk, err, sizeof err) != 0) {
                fprintf(stderr, "ds4: %s\n", err);
                rc = EXIT_FAIL;
                stop = 1;
                break;
            }
            ds4_ctx_reset(c);
            const int er = ds4_eval(c, wins[cur], o.ctx, NULL, 0, err, sizeof err);
            if (er == -2) { stop = 1; break; }
            if (er != 0) { fprintf(stderr, "ds4: %s\n", err); rc = EXIT_FAIL; stop = 1; break; }
            /* every record of the window handed to on_record: a device emitter's drain thread
             * may still be writing them when ds4_eval returns */
            ds4_hooks_stats hs;
            if (ds4_ctx_hooks_stats(c, &hs) == 0 && hs.err) {
                fprintf(stderr, "ds4: collect: the hook stream failed: %s\n", strerror(hs.err));
                rc = EXIT_FAIL;
                stop = 1;
                break;
            }
            for (int i = 0; i < kk->ncol && !kk->bad; i++)
                if (kk->col[i].rows != (uint32_t)o.ctx) {
                    snprintf(kk->why, sizeof kk->why, "%s: the window gave %u rows of %d", kk->col[i].name,
                             kk->col[i].rows, o.ctx);
                    kk->bad = 1;
                }
            if (kk->bad) { fprintf(stderr, "ds4: collect: %s\n", kk->why); rc = EXIT_FAIL; stop = 1; break; }
            wr_wait(&wr);                     /* the window before is written: its catcher is free */
            if (wr.failed) { fprintf(stderr, "ds4: collect: %s\n", wr.why); rc = EXIT_FAIL; stop = 1; break; }
            if (handed && (tty || shown_last)) PROGRESS();
            wr_give(&wr, kk, wins[cur], s, row, s == S - 1 ? W - s * R : R, last);
            run_windows++;
            handed++;
            shown_last = last;
            if (last && o.stop_after && ++stop_shards == o.stop_after) stop = 2;
            cur ^= 1;
        }
    }
    wr_wait(&wr);
    pthread_mutex_lock(&wr.mu);
    wr.quit = 1;
    pthread_cond_broadcast(&wr.cv);
    pthread_mutex_unlock(&wr.mu);
    pthread_join(wthr, NULL);
    if (wr.failed && !rc) { fprintf(stderr, "ds4: collect: %s\n", wr.why); rc = EXIT_FAIL; }
    else if (handed && !wr.failed && (tty || shown_last)) PROGRESS();
#undef PROGRESS
    const int64_t written_now = wr.shards;
    if (tty) fprintf(stderr, "\n");
    if (wr.sf) { fclose(wr.sf); unlink(wr.tpath); }
    /* the last line of a run that made every shard */
#define SAY_DONE() fprintf(stderr, "ds4: collect: %lld windows (%lld tokens) in %lld %sshards in %s; documents: %llu used, " \
                "%llu empty, %llu invalid UTF-8, %llu oversized, %llu bad JSON; %llu tail tokens dropped\n", (long long)W, \
                (long long)(W * o.ctx), (long long)S, o.safetensors ? "safetensors " : "",                          \
                ds4_show(sh, sizeof sh, o.out, strlen(o.out), 64), (unsigned long long)counts[DOC_OK],              \
                (unsigned long long)counts[DOC_EMPTY], (unsigned long long)counts[DOC_BAD_UTF8],                    \
                (unsigned long long)counts[DOC_BIG], (unsigned long long)counts[DOC_BAD_JSON],                      \
                (unsigned long long)(W < max_windows ? tail : 0))
    const int complete = have + written_now == S;
    if (!rc && g_stop) {
        fprintf(stderr, "ds4: collect: interrupted (%s): %lld of %lld shards are whole; the same command resumes\n",
                g_stop == SIGTERM ? "SIGTERM" : "Ctrl-C", (long long)(have + written_now), (long long)S);
        rc = 128 + (int)g_stop;
    } else if (!rc && !complete && stop == 2) {
        fprintf(stderr, "ds4: collect: stopped after %d shards (--stop-after-shards): %lld of %lld are whole; the same "
                "command resumes\n", o.stop_after, (long long)(have + written_now), (long long)S);
    } else if (!rc && !complete) {
        fprintf(stderr, "ds4: collect: the corpus gave %lld of its %lld windows the second time it was read (did it "
                "change?); the whole shards stay\n", (long long)w, (long long)W);
        rc = EXIT_FAIL;
    } else if (!rc && o.safetensors) {
        SAY_DONE();
    } else if (!rc) {
        /* every shard whole: the files that make the directory a dataset */
        buf st = {0}, info = {0};
        b_s(&st, "{\n  \"_data_files\": [\n");
        for (int64_t s = 0; s < S; s++)
            b_printf(&st, "    {\n      \"filename\": \"data-%05lld-of-%05lld.arrow\"\n    }%s\n", (long long)s, (long long)S,
                     s + 1 < S ? "," : "");
        b_printf(&st, "  ],\n  \"_fingerprint\": \"%016llx\",\n  \"_format_columns\": null,\n  \"_format_kwargs\": {},\n"
                 "  \"_format_type\": null,\n  \"_output_all_columns\": false,\n  \"_split\": null\n}",
                 (unsigned long long)fnv(FNV0, meta.b, meta.n));
        b_s(&info, "{\n  \"citation\": \"\",\n  \"description\": ");
        meta.b[meta.n - 1] = 0;               /* the description: the settings without the newline */
        b_json_str(&info, (const char *)meta.b);
        b_s(&info, ",\n  \"features\": ");
        features_json(&info, &K);
        b_s(&info, ",\n  \"homepage\": \"\",\n  \"license\": \"\"\n}");
        if (write_file(o.out, "dataset_info.json", &info, err, sizeof err) != 0 ||
            write_file(o.out, "state.json", &st, err, sizeof err) != 0) {
            fprintf(stderr, "ds4: collect: %s; the %lld shards are whole, run again to finish\n", err, (long long)S);
            rc = EXIT_FAIL;
        } else {
            SAY_DONE();
        }
        free(st.b);
        free(info.b);
    }
#undef SAY_DONE
    if (c) {
        ds4_hooks_stats hst;
        if (ds4_ctx_hooks_stats(c, &hst) == 0 && hst.err && !rc) rc = EXIT_FAIL;
        ds4_ctx_free(c);
    }
    fclose(cp.f);
    free(cp.line);
    free(cp.text);
    free(meta.b);
    free(done);
    free(ids);
    free(win);
    free(pk.q);
    for (int i = 0; i < K.ncol; i++) { free(K.col[i].win); free(K2.col[i].win); free(K.col[i].offs); }
    free(K.col);
    free(K2.col);
    free(win2);
    pthread_mutex_destroy(&wr.mu);
    pthread_cond_destroy(&wr.cv);
    ds4_model_close(m);
    return rc;
}
