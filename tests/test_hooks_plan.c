/* test_hooks_plan.c -- the device hook emitter's ring sizes (ds4h_ring_plan, ds4_hooks.c) held
 * to what ds4_hooks.h promises, on the CPU (the emitter itself is CUDA's).
 *
 * For a model shape and a DS4_HOOKS selection the test computes, from the catalog's record
 * shapes (ds4_hooks.h: attn and moe [D], resid [h][D], moe_sel and moe_w [k], logits [V],
 * attn_probs [H][ld]), what one decode step produces (bytes, rounded to 8 per record, and
 * records) and the largest record, then checks the plan:
 *   - DS4_HOOKS_RING_MB given: exactly that many MiB, or an error naming the least that holds
 *     four largest records when it is smaller;
 *   - otherwise: 64 x the step's bytes rounded up to MiB, within 64..1024 MiB, and never below
 *     four largest records;
 *   - control slots: at least 1024, one per KiB of payload ring, and four steps' records.
 * Shapes: tiny's, flash16's, and flash16's with attn_probs over a 1M context (a 2 MB record).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"
#include "ds4_gguf.h"
#include "ds4_gpu.h"
#include "ds4_hooks.h"

static int n_pass, n_fail;
#define MiB ((uint64_t)1 << 20)

static void shape(ds4_hparams *hp, int L, int D, int hc, int k, int V, int H) {
    memset(hp, 0, sizeof *hp);
    hp->n_layer = L; hp->n_embd = D; hp->n_hc = hc; hp->n_expert_used = k; hp->n_vocab = V; hp->n_head = H;
}

/* Plans one case and checks it; want_err: the plan must fail (a given ring too small). */
static void check(const char *name, const ds4_hparams *hp, const char *spec, int probs_ld, int ring_mb, int want_err) {
    ds4h_selection sel;
    char err[256] = "";
    if (ds4h_parse(spec, &sel, err, sizeof err) != 0) { printf("FAIL %s: parse: %s\n", name, err); n_fail++; return; }
    uint64_t rec[DS4H_N_HOOKS];
    rec[DS4H_ATTN] = rec[DS4H_MOE] = (uint64_t)hp->n_embd * 4;
    rec[DS4H_RESID] = (uint64_t)hp->n_hc * hp->n_embd * 4;
    rec[DS4H_MOE_SEL] = rec[DS4H_MOE_W] = (uint64_t)hp->n_expert_used * 4;
    rec[DS4H_LOGITS] = (uint64_t)hp->n_vocab * 4;
    rec[DS4H_ATTN_PROBS] = (uint64_t)hp->n_head * (uint64_t)(probs_ld > 0 ? probs_ld : 1) * 4;
    uint64_t step = 0, recs = 0, big = 0;
    for (int h = 0; h < DS4H_N_HOOKS; h++)
        for (int l = 0; l < (h == DS4H_LOGITS ? 1 : hp->n_layer); l++)
            if (ds4h_selected(&sel, h, h == DS4H_LOGITS ? -1 : l)) {
                step += (rec[h] + 7) / 8 * 8;
                recs++;
                if (rec[h] > big) big = rec[h];
            }
    const uint64_t need = (4 * big + MiB - 1) / MiB;
    ds4_env env;
    memset(&env, 0, sizeof env);
    env.hooks_ring_mb = ring_mb;
    ds4h_emitter_cfg cfg;
    const int rc = ds4h_ring_plan(&sel, hp, probs_ld, &env, &cfg, err, sizeof err);
    char why[200] = "";
    if (want_err) {
        char at_least[48];
        snprintf(at_least, sizeof at_least, "give at least %llu", (unsigned long long)need);
        if (rc == 0) snprintf(why, sizeof why, "planned %llu MiB, wanted an error", (unsigned long long)(cfg.ring_bytes / MiB));
        else if (!strstr(err, "too small") || !strstr(err, at_least)) snprintf(why, sizeof why, "message '%s'", err);
    } else if (rc != 0) {
        snprintf(why, sizeof why, "error '%s'", err);
    } else {
        uint64_t mb = ring_mb > 0 ? (uint64_t)ring_mb : (64 * step + MiB - 1) / MiB;
        if (ring_mb <= 0) {
            if (mb < 64) mb = 64;
            if (mb > 1024) mb = 1024;
            if (mb < need) mb = need;
        }
        uint64_t slots = cfg.ring_bytes / 1024 > 1024 ? cfg.ring_bytes / 1024 : 1024;
        if (slots < 4 * recs) slots = 4 * recs;
        if (cfg.ring_bytes != mb * MiB)
            snprintf(why, sizeof why, "ring %llu bytes, want %llu MiB", (unsigned long long)cfg.ring_bytes, (unsigned long long)mb);
        else if (cfg.ring_bytes < 4 * big)
            snprintf(why, sizeof why, "ring %llu below four records of %llu", (unsigned long long)cfg.ring_bytes, (unsigned long long)big);
        else if (cfg.ring_slots != slots)
            snprintf(why, sizeof why, "slots %llu, want %llu", (unsigned long long)cfg.ring_slots, (unsigned long long)slots);
    }
    if (why[0]) { printf("FAIL %s (%s): %s\n", name, spec, why); n_fail++; return; }
    printf("ok   %s (%s): %s\n", name, spec, want_err ? err :
           (snprintf(why, sizeof why, "%llu MiB, %llu slots; step %llu bytes in %llu records, largest %llu",
                     (unsigned long long)(cfg.ring_bytes / MiB), (unsigned long long)cfg.ring_slots,
                     (unsigned long long)step, (unsigned long long)recs, (unsigned long long)big), why));
    n_pass++;
}

int main(void) {
    ds4_hparams tiny, flash;
    shape(&tiny, 6, 128, 4, 2, 512, 8);
    shape(&flash, 43, 4096, 4, 6, 129280, 64);
    const int ld_1m = 128 + (1048576 / 128 + 1) + 1;    /* window + compressed rows + sink */
    check("tiny", &tiny, "attn", 0, 0, 0);                               /* the 64 MiB floor */
    check("tiny", &tiny, "attn,resid,moe,logits", 0, 0, 0);
    check("flash16", &flash, "attn,resid,moe,logits", 0, 0, 0);          /* 64 x the step */
    check("flash16", &flash, "logits", 0, 0, 0);
    check("flash16 1M", &flash, "attn_probs", ld_1m, 0, 0);              /* the 1024 MiB ceiling */
    check("flash16 1M", &flash, "attn_probs:5", ld_1m, 8, 1);            /* given, below four records */
    check("flash16 1M", &flash, "attn_probs:5", ld_1m, 9, 0);            /* given, just enough */
    check("flash16", &flash, "attn,resid,moe,attn_probs", 10, 1, 0);     /* slots: four steps' 258 records */
    check("flash16", &flash, "moe_sel", 0, 1, 0);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
