/* ds4_hooks.c -- activation hooks on the host: the selection, the stream, the writer, and
 * the device emitter's sizing (the module ds4_hooks.h declares).
 *
 * The engine (ds4.c) holds one ds4h_ctx per context with DS4_HOOKS set and calls it at a
 * handful of points (ds4_hooks.h, "The engine's side"): open at context creation, start once
 * the context exists, and during each forward call emit after the op that made a tensor,
 * flush at the end of a point, join before an op overwrites a recorded tensor, publish at
 * the call's end; then call_end, stats and close.  Everything else about hooks is here:
 *
 *   Selection   the catalog's names and DS4_HOOKS's grammar ("attn,resid:40-42")
 *   Stream      DS4_HOOKS_OUT written beside its target (ds4_tmp_path) and renamed over it
 *               once the context exists, so a run that fails before leaves an earlier
 *               capture as it was; the JSON header a reader names and shapes records by
 *   Writer      with the CPU backend a record goes to the file as the op that made it
 *               returns (synchronous: nothing is ever dropped); a failed write stops the run
 *               with one line (ds4_eval returns the error), never a silent loss.  Between
 *               ds4h_hold and ds4h_commit (a speculative check) it keeps the records back and
 *               then writes only the rows the sequence keeps
 *   Emitter     with a device emitter (ds4_gpu.h hooks_open; CUDA: ds4_hooks.cu) the records
 *               of one point go to the backend as one producer (hook_put), into rings sized
 *               here from what one decode step of the selection produces
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ds4.h"
#include "ds4_gguf.h"
#include "ds4_gpu.h"
#include "ds4_hooks.h"

#define errf ds4_errf

/* ---------------------------------------------------------------------------
 * Selection
 * ------------------------------------------------------------------------- */

static const char *const ds4h_names[DS4H_N_HOOKS] = { "attn", "resid", "moe_sel", "moe_w", "moe", "logits",
                                                       "attn_probs" };

const char *ds4h_name(int hook) { return hook >= 0 && hook < DS4H_N_HOOKS ? ds4h_names[hook] : NULL; }

/* "a" or "a-b" (decimal digits only) into [lo, hi]. */
static int ds4h_parse_range(const char *s, size_t n, int *lo, int *hi) {
    if (n == 0) return -1;            /* "attn:" (fuzz_env found it: an empty range read as -1) */
    long v[2] = { -1, -1 };
    int k = 0;
    size_t i = 0;
    while (i < n && k < 2) {
        if (s[i] < '0' || s[i] > '9') return -1;
        long x = 0;
        while (i < n && s[i] >= '0' && s[i] <= '9') {
            x = x * 10 + (s[i] - '0');
            if (x >= DS4H_MAX_LAYERS) return -1;
            i++;
        }
        v[k++] = x;
        if (i < n) {
            if (s[i] != '-' || k == 2) return -1;
            i++;
            if (i == n) return -1;
        }
    }
    if (i != n) return -1;
    *lo = (int)v[0];
    *hi = k == 2 ? (int)v[1] : (int)v[0];
    return *lo <= *hi ? 0 : -1;
}

int ds4h_parse(const char *spec, ds4h_selection *sel, char *err, size_t errlen) {
    char sh[160], sh2[80];
    memset(sel, 0, sizeof *sel);
    sel->max_layer = -1;
    if (!*spec) return (errf(err, errlen, "empty (give hooks: attn, resid, moe, moe_sel, moe_w, logits, attn_probs)"), -1);
    const char *p = spec;
    for (;;) {
        const char *end = strchr(p, ',');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        const char *colon = memchr(p, ':', n);
        const size_t nl = colon ? (size_t)(colon - p) : n;
        if (nl == 0) return (errf(err, errlen, "an empty hook name (items are NAME or NAME:A-B, comma-separated)"), -1);
        int hooks[3], nh = 0;
        if (nl == 3 && !strncmp(p, "moe", 3)) {
            hooks[0] = DS4H_MOE_SEL; hooks[1] = DS4H_MOE_W; hooks[2] = DS4H_MOE; nh = 3;
        } else {
            for (int h = 0; h < DS4H_N_HOOKS; h++)
                if (strlen(ds4h_names[h]) == nl && !strncmp(p, ds4h_names[h], nl)) hooks[nh++] = h;
        }
        if (!nh)
            return (errf(err, errlen, "unknown hook '%s' (attn, resid, moe, moe_sel, moe_w, logits, attn_probs)",
                              ds4_show(sh, sizeof sh, p, nl, 32)), -1);
        int lo = 0, hi = DS4H_MAX_LAYERS - 1;
        if (colon) {
            if (hooks[0] == DS4H_LOGITS) return (errf(err, errlen, "logits has no layers: give it without a range"), -1);
            if (ds4h_parse_range(colon + 1, n - nl - 1, &lo, &hi) != 0)
                return (errf(err, errlen, "bad layer range '%s' for %s (A or A-B, A <= B < %d)",
                                  ds4_show(sh, sizeof sh, colon + 1, n - nl - 1, 32),
                                  ds4_show(sh2, sizeof sh2, p, nl, 16), DS4H_MAX_LAYERS), -1);
            if (hi > sel->max_layer) sel->max_layer = hi;
        }
        for (int j = 0; j < nh; j++) {
            if (!colon) sel->all_layers[hooks[j]] = 1;
            else for (int l = lo; l <= hi; l++) sel->layers[hooks[j]][l / 64] |= (uint64_t)1 << (l % 64);
        }
        sel->any = 1;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

int ds4h_selected(const ds4h_selection *sel, int hook, int layer) {
    if (!sel || hook < 0 || hook >= DS4H_N_HOOKS) return 0;
    if (sel->all_layers[hook]) return 1;
    if (layer < 0 || layer >= DS4H_MAX_LAYERS) return 0;
    return (int)(sel->layers[hook][layer / 64] >> (layer % 64) & 1);
}

/* DS4_HOOKS parsed into sel and checked against the model's n_layer layers. */
static int ds4h_env_selection(int n_layer, const ds4_env *env, ds4h_selection *sel, char *err, size_t errlen) {
    char e2[256];
    if (ds4h_parse(env->hooks, sel, e2, sizeof e2) != 0) { errf(err, errlen, "DS4_HOOKS: %s", e2); return -1; }
    if (sel->max_layer >= n_layer) {
        errf(err, errlen, "DS4_HOOKS: layer %d is past the model's %d layers (0..%d)", sel->max_layer, n_layer,
             n_layer - 1);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------
 * Stream
 *
 * The stream is written beside its target (ds4_tmp_path) and renamed over PATH once the
 * context exists (ds4h_start), so a run that fails before it starts -- a bad selection, a
 * prompt too long, no GPU -- leaves an earlier capture at PATH as it was.
 * ------------------------------------------------------------------------- */

struct ds4h_ctx {
    const ds4_backend *be;
    void              *sess;          /* the context's session (the device emitter lives on it) */
    int                n_swa;         /* attn_probs: a query's columns (ds4_att_rows) */
    ds4h_selection     sel;
    FILE              *f;             /* DS4_HOOKS_OUT */
    char              *path;
    char              *tmp;           /* where the stream is written until ds4h_start; NULL: at path */
    uint64_t           seq;           /* records written (the CPU's writer) */
    uint64_t           bytes;         /* their payload bytes */
    int                dev;           /* the backend's emitter writes the records */
    ds4h_put           q[DS4H_PUT_MAX];      /* records made at one point of the step, not yet put */
    int                nq;
    int                err;           /* errno of a failed write (0: none) */
    int                pos;           /* the forward call in flight: its first position, */
    uint32_t           call;          /* its index, */
    const ds4_step    *step;          /* and its step block (backend memory) */
    float             *probs;         /* attn_probs: [B][H][probs_ld] (backend memory) */
    int                probs_ld, n_head;
    size_t             probs_bytes;
    float             *ptmp;          /* one token's [H][n+1], packed for its record */
    void             (*sink)(void *user, const ds4h_record *r, const void *payload);   /* ds4h_set_sink */
    void              *sink_user;
    int                hold;          /* ds4h_hold .. ds4h_commit: the CPU writer keeps records back */
    uint8_t           *held;          /* their descriptors and payloads, back to back, each padded to 8 */
    size_t             held_n, held_cap;
    uint64_t           rejected;      /* held records that kept no row (not written) */
};

int ds4h_check(int n_layer, const ds4_env *env, char *err, size_t errlen) {
    if (!env->hooks) return 0;
    ds4h_selection sel;
    if (ds4h_env_selection(n_layer, env, &sel, err, errlen) != 0) return -1;
    struct stat st;
    if (stat(env->hooks_out, &st) == 0 && S_ISDIR(st.st_mode)) {
        errf(err, errlen, "DS4_HOOKS_OUT: cannot write %s: it is a directory", shown(env->hooks_out));
        return -2;
    }
    /* try what ds4h_open will do, leaving nothing behind and PATH untouched */
    char *tmp;
    if (ds4_tmp_path(env->hooks_out, &tmp) != 0) { errf(err, errlen, "out of memory"); return -2; }
    const int fd = tmp ? open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666)
                       : open(env->hooks_out, O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        errf(err, errlen, "DS4_HOOKS_OUT: cannot write %s: %s", shown(env->hooks_out), strerror(errno));
        free(tmp);
        return -2;
    }
    close(fd);
    if (tmp) unlink(tmp);
    free(tmp);
    return 0;
}

/* The header: what a reader needs to name and shape the records. */
static int ds4h_write_header(ds4h_ctx *h, const ds4h_host *host, const ds4_env *env, char *err, size_t errlen) {
    const ds4_hparams *hp = host->hp;
    char js[4096];
    int n = snprintf(js, sizeof js,
                     "{\"format\": \"ds4h\", \"version\": %d, \"backend\": \"%s\", \"policy\": \"%s\", "
                     "\"model\": {\"n_layer\": %d, \"n_embd\": %d, \"n_hc\": %d, \"n_expert_used\": %d, "
                     "\"n_vocab\": %d}, \"catalog\": [", DS4H_VERSION, h->be->name, env->hooks_drop ? "drop" : "wait",
                     hp->n_layer, hp->n_embd, hp->n_hc, hp->n_expert_used, hp->n_vocab);
    for (int k = 0; k < DS4H_N_HOOKS; k++)
        n += snprintf(js + n, sizeof js - (size_t)n, "%s{\"id\": %d, \"name\": \"%s\", \"dtype\": \"%s\", "
                      "\"per_layer\": %s}", k ? ", " : "", k, ds4h_name(k), k == DS4H_MOE_SEL ? "i32" : "f32",
                      k == DS4H_LOGITS ? "false" : "true");
    n += snprintf(js + n, sizeof js - (size_t)n, "], \"selection\": {");
    for (int k = 0, first = 1; k < DS4H_N_HOOKS; k++) {
        const int per = k != DS4H_LOGITS;
        int any = 0;
        for (int l = 0; l < (per ? hp->n_layer : 1); l++) any |= ds4h_selected(&h->sel, k, per ? l : -1);
        if (!any) continue;
        n += snprintf(js + n, sizeof js - (size_t)n, "%s\"%s\": [", first ? "" : ", ", ds4h_name(k));
        first = 0;
        for (int l = 0, c = 0; per && l < hp->n_layer; l++)
            if (ds4h_selected(&h->sel, k, l)) n += snprintf(js + n, sizeof js - (size_t)n, "%s%d", c++ ? ", " : "", l);
        n += snprintf(js + n, sizeof js - (size_t)n, "]");
    }
    n += snprintf(js + n, sizeof js - (size_t)n, "}}");
    if (n <= 0 || (size_t)n >= sizeof js - 8) { errf(err, errlen, "DS4_HOOKS: the header does not fit"); return -1; }
    while (n % 8) js[n++] = ' ';
    const uint32_t ver = DS4H_VERSION, len = (uint32_t)n;
    if (fwrite("DS4HOOKS", 1, 8, h->f) != 8 || fwrite(&ver, 4, 1, h->f) != 1 || fwrite(&len, 4, 1, h->f) != 1 ||
        fwrite(js, 1, (size_t)n, h->f) != (size_t)n) {
        errf(err, errlen, "DS4_HOOKS_OUT: writing %s failed: %s", h->path, strerror(errno));
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------
 * Emitter: the device rings' sizes
 *
 * Sized from what one decode step of this selection produces, so the drain may fall many
 * steps behind before a producer waits, and at least four times the largest record a
 * producer cannot split (a row, one token's attn_probs), so that one always fits once the
 * drain catches up.
 * ------------------------------------------------------------------------- */

int ds4h_ring_plan(const ds4h_selection *sel, const struct ds4_hparams *hp, int probs_ld, const struct ds4_env *env,
                   struct ds4h_emitter_cfg *cfg, char *err, size_t errlen) {
    uint64_t step_bytes = 0, step_recs = 0, big = 0;
    const uint64_t D = (uint64_t)hp->n_embd, k = (uint64_t)hp->n_expert_used;
    for (int hk = 0; hk < DS4H_N_HOOKS; hk++) {
        const uint64_t b = hk == DS4H_ATTN || hk == DS4H_MOE ? D * 4 : hk == DS4H_RESID ? (uint64_t)hp->n_hc * D * 4
                         : hk == DS4H_MOE_SEL || hk == DS4H_MOE_W ? k * 4 : hk == DS4H_LOGITS ? (uint64_t)hp->n_vocab * 4
                         : (uint64_t)hp->n_head * (uint64_t)(probs_ld > 0 ? probs_ld : 1) * 4;
        for (int l = 0; l < (hk == DS4H_LOGITS ? 1 : hp->n_layer); l++) {
            if (!ds4h_selected(sel, hk, hk == DS4H_LOGITS ? -1 : l)) continue;
            step_bytes += (b + 7) & ~(uint64_t)7;
            step_recs++;
            if (b > big) big = b;
        }
    }
    const uint64_t MiB = (uint64_t)1 << 20, need = (4 * big + MiB - 1) / MiB;
    uint64_t mb;
    if (env->hooks_ring_mb > 0) {
        mb = (uint64_t)env->hooks_ring_mb;
        if (mb < need) {
            errf(err, errlen, "DS4_HOOKS_RING_MB=%d is too small for this selection: the ring must hold four of "
                 "its largest record (%llu bytes), give at least %llu", env->hooks_ring_mb, (unsigned long long)big,
                 (unsigned long long)need);
            return -1;
        }
    } else {
        mb = (64 * step_bytes + MiB - 1) / MiB;
        if (mb < 64) mb = 64;
        if (mb > 1024) mb = 1024;
        if (mb < need) mb = need;
    }
    memset(cfg, 0, sizeof *cfg);
    cfg->drop = env->hooks_drop;
    cfg->ring_bytes = mb * MiB;
    cfg->ring_slots = cfg->ring_bytes / 1024 > 1024 ? cfg->ring_bytes / 1024 : 1024;
    if (cfg->ring_slots < 4 * step_recs) cfg->ring_slots = 4 * step_recs;
    cfg->throttle_us = (uint32_t)env->hooks_throttle_us;
    return 0;
}

/* ---------------------------------------------------------------------------
 * The engine's side
 * ------------------------------------------------------------------------- */

int ds4h_open(ds4h_ctx **out, const ds4h_host *host, const ds4_env *env, char *err, size_t errlen) {
    *out = NULL;
    const ds4_hparams *hp = host->hp;
    const ds4_backend *be = host->be;
    if (strcmp(be->name, "cpu") != 0 && !be->hooks_open) {
        errf(err, errlen, "DS4_HOOKS: the %s backend has no hook emitter", be->name);
        return -1;
    }
    ds4h_ctx *h = calloc(1, sizeof *h);
    if (!h) { errf(err, errlen, "out of memory"); return -1; }
    *out = h;                                 /* ds4h_close undoes whatever is done below */
    h->be = be;
    h->sess = host->sess;
    h->n_swa = hp->n_swa;
    h->n_head = hp->n_head;
    if (ds4h_env_selection(hp->n_layer, env, &h->sel, err, errlen) != 0) return -1;
    int probs = 0;
    for (int l = 0; l < hp->n_layer; l++) probs |= ds4h_selected(&h->sel, DS4H_ATTN_PROBS, l);
    if (probs) {
        if (!be->attention_probs) {
            errf(err, errlen, "DS4_HOOKS: attn_probs: the %s backend cannot report attention weights", be->name);
            return -1;
        }
        const int k = hp->idx_topk > 0 ? hp->idx_topk : 0, n128 = host->n_ctx / 128 + 1;
        h->probs_ld = hp->n_swa + (k > n128 ? k : n128) + 1;
        h->probs_bytes = (size_t)host->max_batch * hp->n_head * h->probs_ld * 4;
        h->probs = be->alloc(h->probs_bytes);
        h->ptmp = malloc((size_t)hp->n_head * h->probs_ld * 4);
        if (!h->probs || !h->ptmp) { errf(err, errlen, "DS4_HOOKS: attn_probs: out of memory"); return -1; }
    }
    h->path = strdup(env->hooks_out);
    if (!h->path || ds4_tmp_path(h->path, &h->tmp) != 0) { errf(err, errlen, "out of memory"); return -1; }
    h->f = fopen(h->tmp ? h->tmp : h->path, "wb");
    if (!h->f) {
        errf(err, errlen, "DS4_HOOKS_OUT: cannot write %s: %s", env->hooks_out, strerror(errno));
        return -1;
    }
    setvbuf(h->f, NULL, _IOFBF, (size_t)1 << 22);   /* records arrive in many small writes */
    if (ds4h_write_header(h, host, env, err, errlen) != 0) return -1;
    if (!be->hooks_open) return 0;           /* the CPU: ds4h_emit writes each record itself */

    ds4h_emitter_cfg cfg;
    if (ds4h_ring_plan(&h->sel, hp, h->probs_ld, env, &cfg, err, errlen) != 0) return -1;
    cfg.f = h->f;
    cfg.path = h->path;
    if (fflush(h->f) != 0) {                 /* the header goes out before any record */
        errf(err, errlen, "DS4_HOOKS_OUT: writing %s failed: %s", h->path, strerror(errno));
        return -1;
    }
    void *prev = be->session_bind(h->sess);
    const int rc = be->hooks_open(&cfg, err, errlen);
    be->session_bind(prev);
    if (rc != 0) return -1;
    h->dev = 1;
    return 0;
}

size_t ds4h_device_bytes(const ds4h_ctx *h) { return h ? h->probs_bytes : 0; }

int ds4h_start(ds4h_ctx *h, char *err, size_t errlen) {
    if (!h || !h->tmp) return 0;
    if (rename(h->tmp, h->path) != 0) {
        errf(err, errlen, "DS4_HOOKS_OUT: cannot put %s in place: %s", shown(h->path), strerror(errno));
        return -1;
    }
    free(h->tmp);
    h->tmp = NULL;
    return 0;
}

void ds4h_call_begin(ds4h_ctx *h, int pos, uint32_t call, const ds4_step *step) {
    if (!h) return;
    h->pos = pos;
    h->call = call;
    h->step = step;
}

int ds4h_call_end(ds4h_ctx *h, char *err, size_t errlen) {
    if (!h) return 0;
    if (h->f && !h->dev && !h->err && fflush(h->f) != 0) h->err = errno ? errno : EIO;
    if (h->err) {
        errf(err, errlen, "DS4_HOOKS_OUT: writing %s failed: %s", h->path, strerror(h->err));
        return -1;
    }
    return 0;
}

/* The device emitter: the records queued at this point of the step, in one producer. */
void ds4h_flush(ds4h_ctx *h) {
    if (!h) return;
    if (h->nq) h->be->hook_put(h->q, h->nq);
    h->nq = 0;
}

void ds4h_join(ds4h_ctx *h) {
    if (h && h->dev) h->be->hooks_join();
}

void ds4h_publish(ds4h_ctx *h) {
    if (h && h->dev) h->be->hooks_publish();
}

/* The CPU writer: record r (its seq assigned here) and its payload to the stream and the sink. */
static void ds4h_write(ds4h_ctx *h, ds4h_record *r, const void *data) {
    static const uint8_t zeros[8];
    r->seq = h->seq;
    const size_t pad = (size_t)((8 - r->nbytes % 8) % 8);
    if (fwrite(r, sizeof *r, 1, h->f) != 1 || fwrite(data, 1, (size_t)r->nbytes, h->f) != r->nbytes ||
        (pad && fwrite(zeros, 1, pad, h->f) != pad)) {
        h->err = errno ? errno : EIO;
        return;
    }
    h->seq++;
    h->bytes += r->nbytes;
    if (h->sink) h->sink(h->sink_user, r, data);
}

/* Held: r and its payload appended to the held records. */
static void ds4h_keep(ds4h_ctx *h, const ds4h_record *r, const void *data) {
    const size_t need = h->held_n + sizeof *r + (size_t)((r->nbytes + 7) / 8 * 8);
    if (need > h->held_cap) {
        size_t cap = h->held_cap ? h->held_cap : 1 << 20;
        while (cap < need) cap *= 2;
        uint8_t *p = realloc(h->held, cap);
        if (!p) { h->err = ENOMEM; return; }
        h->held = p;
        h->held_cap = cap;
    }
    memcpy(h->held + h->held_n, r, sizeof *r);
    memcpy(h->held + h->held_n + sizeof *r, data, (size_t)r->nbytes);
    h->held_n = need;
}

int ds4h_hold(ds4h_ctx *h, char *err, size_t errlen) {
    if (!h) return 0;
    /* a hold never committed (its call failed): none of its rows is the sequence's; closed with
     * nothing kept, its records counted as rejected, so that the device's window does not stay
     * open (keeping every later record back) */
    if (h->hold && ds4h_commit(h, INT_MIN, err, errlen) != 0) return -1;
    if (h->dev) {
        if (!h->be->hooks_hold) {
            errf(err, errlen, "DS4_HOOKS: the %s backend's hook emitter cannot hold a call's records back", h->be->name);
            return -1;
        }
        void *prev = h->be->session_bind(h->sess);
        h->be->hooks_hold();
        h->be->session_bind(prev);
        h->hold = 1;
        return 0;
    }
    h->hold = 1;
    h->held_n = 0;
    return 0;
}

int ds4h_commit(ds4h_ctx *h, int pos_end, char *err, size_t errlen) {
    if (!h || !h->hold) return 0;
    h->hold = 0;
    if (h->dev) {               /* the drain cuts and writes them (a failed write: at ds4h_stats) */
        void *prev = h->be->session_bind(h->sess);
        h->be->hooks_commit(pos_end);
        h->be->session_bind(prev);
        return 0;
    }
    for (size_t off = 0; off < h->held_n && !h->err;) {
        ds4h_record r;
        memcpy(&r, h->held + off, sizeof r);
        const uint8_t *data = h->held + off + sizeof r;
        off += sizeof r + (size_t)((r.nbytes + 7) / 8 * 8);
        if (ds4h_cut(&r, pos_end)) ds4h_write(h, &r, data);
        else h->rejected++;                                   /* rows the sequence does not keep */
    }
    h->held_n = 0;
    if (h->err) {
        errf(err, errlen, "DS4_HOOKS_OUT: writing %s failed: %s", h->path, strerror(h->err));
        return -1;
    }
    return 0;
}

void ds4h_emit(ds4h_ctx *h, int hook, int layer, const void *data, int dtype, int ndim, uint32_t d0, uint32_t d1,
               uint32_t d2, int pos_add) {
    if (!h || !h->f || h->err || !ds4h_selected(&h->sel, hook, layer)) return;
    if (h->dev) {              /* queued: ds4h_flush puts the point's records in one producer */
        if (h->nq == DS4H_PUT_MAX) ds4h_flush(h);
        const ds4h_put p = { hook, layer, dtype, ndim, d0, d1, d2, data, (int64_t)d1 * d2, (int64_t)d2,
                             pos_add, 0, 0, 0, 0, h->step };
        h->q[h->nq++] = p;
        return;
    }
    ds4h_record r;
    memset(&r, 0, sizeof r);
    r.magic = DS4H_RECORD_MAGIC;
    r.hook = (uint32_t)hook;
    r.layer = layer;
    r.pos = (uint32_t)(h->pos + pos_add);
    r.step = h->call;
    r.dtype = (uint8_t)dtype;
    r.ndim = (uint8_t)ndim;
    r.shape[0] = d0; r.shape[1] = d1; r.shape[2] = d2; r.shape[3] = 1;
    r.nbytes = (uint64_t)d0 * d1 * d2 * 4;
    if (h->hold) ds4h_keep(h, &r, data);
    else ds4h_write(h, &r, data);
}

int ds4h_set_sink(ds4h_ctx *h, void (*fn)(void *user, const ds4h_record *r, const void *payload), void *user,
                  char *err, size_t errlen) {
    if (!h) { errf(err, errlen, "no hooks are selected (DS4_HOOKS)"); return -1; }
    if (h->dev) {                 /* the device emitter's drain thread calls it */
        if (!h->be->hooks_sink) {
            errf(err, errlen, "the %s backend's hook emitter has no sink", h->be->name);
            return -1;
        }
        void *prev = h->be->session_bind(h->sess);
        h->be->hooks_sink(fn, user);
        h->be->session_bind(prev);
        return 0;
    }
    h->sink = fn;
    h->sink_user = user;
    return 0;
}

float *ds4h_probs(ds4h_ctx *h, int layer, int *ld) {
    if (!h || !h->probs || !ds4h_selected(&h->sel, DS4H_ATTN_PROBS, layer)) return NULL;
    *ld = h->probs_ld;
    return h->probs;
}

void ds4h_emit_probs(ds4h_ctx *h, int layer, int nt, int ratio, int k) {
    if (!h || !h->probs) return;
    const int H = h->n_head;
    for (int t = 0; t < nt; t++) {
        if (h->dev) {              /* the producer packs [H][cols], cols read from the step block */
            const ds4h_put p = { DS4H_ATTN_PROBS, layer, DS4H_F32, 2, (uint32_t)H, 0, 1,
                                 h->probs + (size_t)t * H * h->probs_ld, h->probs_ld, 1, t,
                                 1, h->n_swa, ratio, k, h->step };
            h->be->hook_put(&p, 1);
            continue;
        }
        const int P = h->pos + t, cols = ds4_att_rows(P, h->n_swa, ratio, k) + 1;
        for (int hh = 0; hh < H; hh++)
            memcpy(h->ptmp + (size_t)hh * cols, h->probs + ((size_t)t * H + hh) * h->probs_ld, (size_t)cols * 4);
        ds4h_emit(h, DS4H_ATTN_PROBS, layer, h->ptmp, DS4H_F32, 2, (uint32_t)H, (uint32_t)cols, 1, t);
    }
}

int ds4h_stats(ds4h_ctx *h, ds4_hooks_stats *st) {
    memset(st, 0, sizeof *st);
    if (!h) return -1;
    if (h->dev) {
        void *prev = h->be->session_bind(h->sess);
        h->be->hooks_stats(st, 1);
        h->be->session_bind(prev);
        return 0;
    }
    st->produced = st->written = h->seq;
    st->rejected = h->rejected;
    st->payload_bytes = h->bytes;
    st->err = h->err;
    return 0;
}

void ds4h_close(ds4h_ctx *h) {
    if (!h) return;
    if (h->f && fclose(h->f) != 0 && !h->err)
        fprintf(stderr, "ds4: DS4_HOOKS_OUT: closing %s failed: %s\n", h->path, strerror(errno));
    if (h->tmp) unlink(h->tmp);               /* the context never started: PATH stays as it was */
    free(h->tmp);
    free(h->path);
    free(h->ptmp);
    free(h->held);                            /* a call held and never committed: rows not kept */
    if (h->probs) h->be->free(h->probs);
    free(h);
}

/* ---------------------------------------------------------------------------
 * A device emitter's speculative checks (ds4_hooks.h ds4h_holdq)
 * ------------------------------------------------------------------------- */

typedef struct {
    uint64_t from, to;
    int      pos_end, closed;
} ds4h_window;

struct ds4h_holdq {
    pthread_mutex_t mu;               /* guards win, head, n, blocked */
    ds4h_window     win[DS4H_WINDOWS];
    int             head, n;
    int             blocked;          /* the first record kept back is in an open window */
    uint8_t        *kb;               /* records kept back: [slot (8 bytes)][descriptor][payload padded to 8] */
    size_t          kb_n, kb_cap;
    uint64_t        kb_recs;          /* records in kb (the drain writes it, others read it atomically) */
    uint64_t        rejected;         /* records that kept no row (the same) */
    void          (*write)(void *user, const ds4h_record *r, const void *payload);
    void           *user;
};

ds4h_holdq *ds4h_holdq_new(void (*write)(void *user, const ds4h_record *r, const void *payload), void *user) {
    ds4h_holdq *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    if (pthread_mutex_init(&q->mu, NULL) != 0) { free(q); return NULL; }
    q->write = write;
    q->user = user;
    return q;
}

void ds4h_holdq_free(ds4h_holdq *q) {
    if (!q) return;
    pthread_mutex_destroy(&q->mu);
    free(q->kb);
    free(q);
}

int ds4h_holdq_open(ds4h_holdq *q, uint64_t from) {
    pthread_mutex_lock(&q->mu);
    const int full = q->n == DS4H_WINDOWS;
    if (!full) {
        ds4h_window *w = &q->win[(q->head + q->n) % DS4H_WINDOWS];
        w->from = from;
        w->to = 0;
        w->pos_end = 0;
        w->closed = 0;
        q->n++;
    }
    pthread_mutex_unlock(&q->mu);
    return full ? -1 : 0;
}

void ds4h_holdq_close(ds4h_holdq *q, uint64_t to, int pos_end) {
    pthread_mutex_lock(&q->mu);
    if (q->n > 0) {
        ds4h_window *w = &q->win[(q->head + q->n - 1) % DS4H_WINDOWS];
        if (!w->closed) {
            w->to = to;
            w->pos_end = pos_end;
            w->closed = 1;
            q->blocked = 0;
        }
    }
    pthread_mutex_unlock(&q->mu);
}

/* The closed windows that end at or below slot go (mu held; every slot below it written). */
static void holdq_retire(ds4h_holdq *q, uint64_t slot) {
    while (q->n > 0 && q->win[q->head].closed && slot >= q->win[q->head].to) {
        q->head = (q->head + 1) % DS4H_WINDOWS;
        q->n--;
    }
}

/* Slot's window (every slot below it written): 0 none, 1 closed (*pos_end its cut), 2 open. */
static int holdq_window_at(ds4h_holdq *q, uint64_t slot, int *pos_end) {
    pthread_mutex_lock(&q->mu);
    holdq_retire(q, slot);
    int st = 0;
    if (q->n > 0 && slot >= q->win[q->head].from) {
        st = q->win[q->head].closed ? 1 : 2;
        *pos_end = q->win[q->head].pos_end;
    }
    if (st == 2) q->blocked = 1;
    pthread_mutex_unlock(&q->mu);
    return st;
}

/* r through write() as its window says: whole, or cut to the rows kept, or not at all. */
static void holdq_write(ds4h_holdq *q, const ds4h_record *r, const void *payload, int st, int pos_end) {
    ds4h_record w = *r;
    if (st == 1 && !ds4h_cut(&w, pos_end)) {
        __atomic_store_n(&q->rejected, q->rejected + 1, __ATOMIC_RELEASE);
        return;
    }
    w.seq -= q->rejected;
    q->write(q->user, &w, payload);
}

int ds4h_holdq_take(ds4h_holdq *q, uint64_t slot, const ds4h_record *r, const void *payload) {
    int pos_end = 0;
    if (q->kb_recs == 0) {
        const int st = holdq_window_at(q, slot, &pos_end);
        if (st != 2) {
            holdq_write(q, r, payload, st, pos_end);
            return 0;
        }
    }
    const size_t pay = (size_t)((r->nbytes + 7) / 8 * 8), need = q->kb_n + sizeof slot + sizeof *r + pay;
    if (need > q->kb_cap) {
        size_t cap = q->kb_cap ? q->kb_cap : (size_t)1 << 20;
        while (cap < need) cap *= 2;
        uint8_t *p = realloc(q->kb, cap);
        if (!p) return -1;
        q->kb = p;
        q->kb_cap = cap;
    }
    uint8_t *d = q->kb + q->kb_n;
    memcpy(d, &slot, sizeof slot);
    memcpy(d + sizeof slot, r, sizeof *r);
    if (r->nbytes) memcpy(d + sizeof slot + sizeof *r, payload, (size_t)r->nbytes);
    memset(d + sizeof slot + sizeof *r + r->nbytes, 0, pay - (size_t)r->nbytes);
    q->kb_n = need;
    __atomic_store_n(&q->kb_recs, q->kb_recs + 1, __ATOMIC_RELEASE);
    return 0;
}

void ds4h_holdq_run(ds4h_holdq *q) {
    size_t off = 0;
    uint64_t done = 0;
    while (off < q->kb_n) {
        uint64_t slot;
        ds4h_record r;
        memcpy(&slot, q->kb + off, sizeof slot);
        memcpy(&r, q->kb + off + sizeof slot, sizeof r);
        int pos_end = 0;
        const int st = holdq_window_at(q, slot, &pos_end);
        if (st == 2) break;
        holdq_write(q, &r, q->kb + off + sizeof slot + sizeof r, st, pos_end);
        off += sizeof slot + sizeof r + (size_t)((r.nbytes + 7) / 8 * 8);
        done++;
    }
    if (off) {
        memmove(q->kb, q->kb + off, q->kb_n - off);
        q->kb_n -= off;
        __atomic_store_n(&q->kb_recs, q->kb_recs - done, __ATOMIC_RELEASE);
    }
}

void ds4h_holdq_pass(ds4h_holdq *q, uint64_t fill) {
    if (q->kb_recs) return;
    pthread_mutex_lock(&q->mu);
    holdq_retire(q, fill);
    pthread_mutex_unlock(&q->mu);
}

void ds4h_holdq_end(ds4h_holdq *q) {
    ds4h_holdq_run(q);
    __atomic_store_n(&q->rejected, q->rejected + q->kb_recs, __ATOMIC_RELEASE);
    __atomic_store_n(&q->kb_recs, (uint64_t)0, __ATOMIC_RELEASE);
    q->kb_n = 0;
}

int ds4h_holdq_settled(ds4h_holdq *q) {
    if (__atomic_load_n(&q->kb_recs, __ATOMIC_ACQUIRE) == 0) return 1;
    pthread_mutex_lock(&q->mu);
    const int b = q->blocked;
    pthread_mutex_unlock(&q->mu);
    return b;
}

uint64_t ds4h_holdq_rejected(ds4h_holdq *q) { return __atomic_load_n(&q->rejected, __ATOMIC_ACQUIRE); }
uint64_t ds4h_holdq_kept(ds4h_holdq *q) { return __atomic_load_n(&q->kb_recs, __ATOMIC_ACQUIRE); }
