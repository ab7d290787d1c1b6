/* test_hooks_hold.c -- a device emitter's hold queue (ds4h_holdq, ds4_hooks.c), the part of the
 * CUDA drain that keeps a speculative check's records back, held on the CPU to what ds4_hooks.h
 * promises.
 *
 * Records are fed in control-slot order, as the drain takes them, each with the sequence number
 * the device gave it; the writer callback gathers what would reach the file.  Checked:
 *   - no window: every record written at once, as it came;
 *   - a window: the records from its first slot on are kept back (and every record after them,
 *     even past the window's end, so the order holds) until the commit, then written cut to the
 *     rows below pos_end (ds4h_cut: a record of rows all at or past pos_end is dropped, one that
 *     straddles it is cut, an attn_probs record is whole or dropped, a gap record stays), and
 *     the sequence numbers written run on without a hole;
 *   - a commit that comes before the drain sees the window's records: cut as they come;
 *   - windows with no records (a call whose records were all dropped) pass, so a long run of
 *     holds never finds the queue full;
 *   - the end with a window never closed: its records are counted as rejected, not written;
 *   - settled (the flush's test): false while closed-window records wait, true when only an
 *     open window holds some.
 * Negative control: the same feed with the cut disabled (pos_end past every row) writes every
 * row, which the checks above would refuse.
 * Then the two threads as the CUDA emitter runs them (stress): the main thread opens and closes
 * a window around each of thousands of speculative checks (1..3 drafts, a random number taken,
 * records beside them outside any window) while a drain thread takes the records in slot order,
 * in uneven batches, and runs and passes the queue when idle; the queue often full.  What
 * reaches the "file": every position of the sequence once per hook, no other, each row's
 * payload its own, numbered without a hole, and written + rejected = produced. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4_hooks.h"

static int n_pass, n_fail;

static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (ok) n_pass++; else n_fail++;
}

/* What reached the "file": descriptors, and each record's first payload word. */
typedef struct {
    ds4h_record r[256];
    uint32_t    w0[256];
    int         n;
} sink;

static void on_write(void *user, const ds4h_record *r, const void *payload) {
    sink *s = user;
    if (s->n == 256) return;
    s->r[s->n] = *r;
    s->w0[s->n] = r->nbytes >= 4 ? *(const uint32_t *)payload : 0xffffffffu;
    s->n++;
}

/* A record of hook, its first row at pos, rows rows of 4 words (word i of row k = 100 pos + k). */
static ds4h_record rec(uint64_t seq, int hook, int pos, int rows, uint32_t *pay) {
    ds4h_record r;
    memset(&r, 0, sizeof r);
    r.magic = DS4H_RECORD_MAGIC;
    r.hook = (uint32_t)hook;
    r.seq = seq;
    r.pos = (uint32_t)pos;
    r.ndim = 2;
    r.shape[0] = (uint32_t)rows; r.shape[1] = 4; r.shape[2] = r.shape[3] = 1;
    r.nbytes = (uint64_t)rows * 16;
    for (int k = 0; k < rows; k++)
        for (int i = 0; i < 4; i++) pay[4 * k + i] = (uint32_t)(100 * (pos + k) + i);
    return r;
}

static ds4h_record gap(uint64_t seq, int pos, int count) {
    ds4h_record r;
    memset(&r, 0, sizeof r);
    r.magic = DS4H_RECORD_MAGIC;
    r.seq = seq;
    r.pos = (uint32_t)pos;
    r.flags = DS4H_FLAG_GAP;
    r.ndim = 1;
    r.shape[0] = (uint32_t)count; r.shape[1] = r.shape[2] = r.shape[3] = 1;
    return r;
}

static int seq_runs_on(const sink *s) {
    uint64_t next = s->n ? s->r[0].seq : 0;
    for (int i = 0; i < s->n; i++) {
        if (s->r[i].seq != next) return 0;
        next += s->r[i].flags & DS4H_FLAG_GAP ? s->r[i].shape[0] : 1;
    }
    return 1;
}

/* One speculative step's records: a check of 4 rows at positions 10..13 (attn and logits, 4
 * rows each; attn_probs one record per row), slots from `slot`, seq from `seq`.  Returns the
 * records fed. */
static int feed_check(ds4h_holdq *q, uint64_t slot, uint64_t seq) {
    uint32_t pay[64];
    ds4h_record r = rec(seq, DS4H_ATTN, 10, 4, pay);
    int n = 0;
    ds4h_holdq_take(q, slot + n, &r, pay); n++;
    for (int k = 0; k < 4; k++) {
        r = rec(seq + n, DS4H_ATTN_PROBS, 10 + k, 1, pay);
        ds4h_holdq_take(q, slot + n, &r, pay); n++;
    }
    r = rec(seq + n, DS4H_LOGITS, 10, 4, pay);
    ds4h_holdq_take(q, slot + n, &r, pay); n++;
    return n;
}

/* ---- the two threads ---- */
#define ST_STEPS 20000
#define ST_SLOTS (ST_STEPS * 10)
#define ST_POS   (ST_STEPS * 4 + 8)
typedef struct {
    ds4h_record *ring;                 /* [ST_SLOTS] the "device ring", slot order */
    uint32_t    *pay;                  /* [ST_SLOTS][16] */
    uint64_t     pub;                  /* slots published (atomic) */
    int          done;                 /* the main thread has published its last slot (atomic) */
    ds4h_holdq  *q;
    /* the drain side's view of what it wrote */
    uint8_t      cover[4][ST_POS];     /* [attn, probs, logits, resid][pos] times written */
    uint64_t     next_seq, written;
    int          bad_payload, bad_seq;
    unsigned     rng;
} stress;

static unsigned st_rand(unsigned *r) { *r = *r * 1103515245u + 12345u; return *r >> 8; }

static int st_hook_index(uint32_t hook) {
    return hook == DS4H_ATTN ? 0 : hook == DS4H_ATTN_PROBS ? 1 : hook == DS4H_LOGITS ? 2 : 3;
}

static void st_write(void *user, const ds4h_record *r, const void *payload) {
    stress *t = user;
    const uint32_t *p = payload;
    if (r->seq != t->next_seq) t->bad_seq++;
    t->next_seq = r->seq + 1;
    t->written++;
    for (uint32_t k = 0; k < r->shape[0]; k++) {
        const uint32_t pos = r->pos + k;
        if (pos < ST_POS) t->cover[st_hook_index(r->hook)][pos]++;
        for (int i = 0; i < 4; i++)
            if (p[4 * k + i] != 100 * pos + (uint32_t)i) t->bad_payload++;
    }
}

static void *st_drain(void *arg) {
    stress *t = arg;
    uint64_t taken = 0;
    for (;;) {
        const uint64_t pub = __atomic_load_n(&t->pub, __ATOMIC_ACQUIRE);
        const int done = __atomic_load_n(&t->done, __ATOMIC_ACQUIRE);
        uint64_t batch = 1 + st_rand(&t->rng) % 37;       /* an uneven batch, then idle */
        while (taken < pub && batch--) {
            if (ds4h_holdq_take(t->q, taken, &t->ring[taken], t->pay + 16 * taken) != 0) t->bad_payload++;
            taken++;
        }
        if (taken == pub) {
            ds4h_holdq_run(t->q);
            ds4h_holdq_pass(t->q, taken);
            if (done) break;
            sched_yield();
        }
    }
    ds4h_holdq_end(t->q);
    return NULL;
}

/* the main thread's record at slot pub, hook, rows from pos; seq = the slot (every record takes
 * one, as on the device) */
static void st_put(stress *t, int hook, int pos, int rows) {
    const uint64_t slot = t->pub;
    t->ring[slot] = rec(slot, hook, pos, rows, t->pay + 16 * slot);
    __atomic_store_n(&t->pub, slot + 1, __ATOMIC_RELEASE);
}

static void stress_run(void) {
    stress *t = calloc(1, sizeof *t);
    t->ring = calloc(ST_SLOTS, sizeof *t->ring);
    t->pay = calloc((size_t)ST_SLOTS * 16, sizeof *t->pay);
    t->q = ds4h_holdq_new(st_write, t);
    t->rng = 12345;
    unsigned rng = 777;
    pthread_t th;
    pthread_create(&th, NULL, st_drain, t);
    int pos = 0, full = 0;
    for (int step = 0; step < ST_STEPS; step++) {
        const int D = 1 + (int)(st_rand(&rng) % 3), a = (int)(st_rand(&rng) % (unsigned)(D + 1));
        while (ds4h_holdq_open(t->q, t->pub) != 0) { full++; sched_yield(); }
        st_put(t, DS4H_ATTN, pos, D + 1);
        for (int k = 0; k <= D; k++) st_put(t, DS4H_ATTN_PROBS, pos + k, 1);
        st_put(t, DS4H_LOGITS, pos, D + 1);
        if (st_rand(&rng) % 4 == 0) (void)ds4h_holdq_settled(t->q);
        ds4h_holdq_close(t->q, t->pub, pos + a + 1);
        pos += a + 1;
        if (st_rand(&rng) % 3 == 0) st_put(t, DS4H_RESID, pos - 1, 1);   /* beside, no window */
    }
    const uint64_t produced = t->pub;
    __atomic_store_n(&t->done, 1, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    int cover_ok = 1;
    for (int h = 0; h < 3; h++)
        for (int p = 0; p < ST_POS; p++) cover_ok = cover_ok && t->cover[h][p] == (p < pos);
    for (int p = 0; p < ST_POS; p++) cover_ok = cover_ok && t->cover[3][p] <= 1;
    char what[300];
    snprintf(what, sizeof what,
             "two threads, %d checks (the queue full %d times): every position below %d once per hook, none past it, "
             "payloads their rows', numbered without a hole (%llu written + %llu rejected = %llu produced)",
             ST_STEPS, full, pos, (unsigned long long)t->written, (unsigned long long)ds4h_holdq_rejected(t->q),
             (unsigned long long)produced);
    check(cover_ok && !t->bad_payload && !t->bad_seq && t->written + ds4h_holdq_rejected(t->q) == produced &&
              ds4h_holdq_kept(t->q) == 0,
          what);
    ds4h_holdq_free(t->q);
    free(t->ring); free(t->pay); free(t);
}

int main(void) {
    uint32_t pay[64];
    char what[200];

    /* no window */
    {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        for (int i = 0; i < 5; i++) {
            ds4h_record r = rec((uint64_t)i, DS4H_RESID, i, 1, pay);
            ds4h_holdq_take(q, (uint64_t)i, &r, pay);
        }
        check(s.n == 5 && seq_runs_on(&s) && s.r[4].pos == 4 && ds4h_holdq_settled(q) && ds4h_holdq_rejected(q) == 0,
              "no window: every record written at once, in order");
        ds4h_holdq_free(q);
    }

    /* a window: records 0..2 before it, a check at slots 3..8 (positions 10..13), 2 rows kept */
    for (int late = 0; late < 2; late++) {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        for (int i = 0; i < 3; i++) {
            ds4h_record r = rec((uint64_t)i, DS4H_RESID, 7 + i, 1, pay);
            ds4h_holdq_take(q, (uint64_t)i, &r, pay);
        }
        check(ds4h_holdq_open(q, 3) == 0, "a window opens");
        if (!late) ds4h_holdq_close(q, 9, 12);            /* the commit before the drain sees them */
        const int n = feed_check(q, 3, 3);
        ds4h_record r = rec(9, DS4H_RESID, 12, 1, pay);   /* the next call's, past the window */
        ds4h_holdq_take(q, 9, &r, pay);
        if (late) {
            check(s.n == 3 && ds4h_holdq_kept(q) == (uint64_t)n + 1 && ds4h_holdq_settled(q),
                  "an open window keeps its records back, and the one after them; settled (only an open window holds)");
            ds4h_holdq_close(q, 9, 12);
            check(!ds4h_holdq_settled(q), "closed, the records kept back are not settled until the drain runs");
            ds4h_holdq_run(q);
        }
        /* written: 3 before, attn cut to 2 rows, probs of 10 and 11, logits cut to 2, the next */
        int ok = s.n == 3 + 1 + 2 + 1 + 1 && ds4h_holdq_kept(q) == 0 && ds4h_holdq_settled(q);
        ok = ok && s.r[3].hook == DS4H_ATTN && s.r[3].shape[0] == 2 && s.r[3].nbytes == 32 && s.w0[3] == 1000;
        ok = ok && s.r[4].hook == DS4H_ATTN_PROBS && s.r[4].pos == 10 && s.r[5].pos == 11 && s.r[5].shape[0] == 1;
        ok = ok && s.r[6].hook == DS4H_LOGITS && s.r[6].shape[0] == 2 && s.r[7].hook == DS4H_RESID && s.r[7].pos == 12;
        ok = ok && seq_runs_on(&s) && s.r[7].seq == 7 && ds4h_holdq_rejected(q) == 2;
        snprintf(what, sizeof what, "commit %s the records: cut to the rows below pos_end, the rejected rows' records "
                 "dropped, numbered without a hole", late ? "after" : "before");
        check(ok, what);
        ds4h_holdq_free(q);
    }

    /* negative control: pos_end past every row keeps every record whole */
    {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        ds4h_holdq_open(q, 0);
        const int n = feed_check(q, 0, 0);
        ds4h_holdq_close(q, (uint64_t)n, 1000);
        ds4h_holdq_run(q);
        check(s.n == n && s.r[0].shape[0] == 4 && ds4h_holdq_rejected(q) == 0,
              "negative control: a commit past every row writes every record whole");
        ds4h_holdq_free(q);
    }

    /* a gap record inside the window stays, numbered on */
    {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        ds4h_holdq_open(q, 0);
        ds4h_record r = rec(0, DS4H_ATTN_PROBS, 13, 1, pay);   /* a rejected row's record: dropped */
        ds4h_holdq_take(q, 0, &r, pay);
        r = gap(1, 12, 3);                                     /* records 1..3 dropped by the policy */
        ds4h_holdq_take(q, 1, &r, pay);
        r = rec(4, DS4H_ATTN, 11, 2, pay);
        ds4h_holdq_take(q, 2, &r, pay);
        ds4h_holdq_close(q, 3, 12);
        ds4h_holdq_run(q);
        check(s.n == 2 && (s.r[0].flags & DS4H_FLAG_GAP) && s.r[0].seq == 0 && s.r[0].shape[0] == 3 &&
                  s.r[1].seq == 3 && s.r[1].shape[0] == 1 && seq_runs_on(&s),
              "a gap record in a window stays, and the numbers run on around it");
        ds4h_holdq_free(q);
    }

    /* many windows with no records (every record dropped) pass; the queue never stays full */
    {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        int ok = 1;
        for (int i = 0; i < 3 * DS4H_WINDOWS; i++) {
            ok = ok && ds4h_holdq_open(q, 5) == 0;
            ds4h_holdq_close(q, 5, 3);
            ds4h_holdq_pass(q, 5);
        }
        int full = 0;
        for (int i = 0; i < DS4H_WINDOWS + 1; i++) full = ds4h_holdq_open(q, 5) != 0;
        check(ok && full, "empty windows pass the drain's fill; DS4H_WINDOWS open ones fill the queue");
        ds4h_holdq_free(q);
    }

    /* the end with a window never closed */
    {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        ds4h_holdq_open(q, 0);
        const int n = feed_check(q, 0, 0);
        ds4h_holdq_end(q);
        check(s.n == 0 && ds4h_holdq_rejected(q) == (uint64_t)n && ds4h_holdq_kept(q) == 0,
              "the end with a window never closed: its records counted as rejected, none written");
        ds4h_holdq_free(q);
    }

    /* two steps back to back, the second window opened before the drain ran the first */
    {
        sink s = { .n = 0 };
        ds4h_holdq *q = ds4h_holdq_new(on_write, &s);
        ds4h_holdq_open(q, 0);
        const int n = feed_check(q, 0, 0);
        ds4h_holdq_close(q, (uint64_t)n, 11);
        ds4h_holdq_open(q, (uint64_t)n);
        const int n2 = feed_check(q, (uint64_t)n, (uint64_t)n);
        ds4h_holdq_run(q);
        const int first = s.n;
        ds4h_holdq_close(q, (uint64_t)(n + n2), 14);
        ds4h_holdq_run(q);
        check(first == 3 && s.n == 3 + n2 && seq_runs_on(&s) && ds4h_holdq_rejected(q) == (uint64_t)(n - 3),
              "two windows back to back: the first written when closed, the second held until its commit");
        ds4h_holdq_free(q);
    }

    stress_run();

    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
