/* test_gguf.c -- tests of the GGUF section (reader, validator, synthetic writer).
 *
 * Includes the section's source directly, so the static helpers are testable
 * without the rest of the engine:
 *   cc -std=c11 -O1 -g -Wall -Wextra -I. tests/test_gguf.c -lm -lpthread
 * Also run under -fsanitize=address,undefined.
 *
 *   test_gguf                          run every test; last line "N passed, M failed"
 *   test_gguf --fill CONFIG TYPE THREADS
 *                                      time ds4_synth_fill (TYPE: f32 f16 bf16 q8_0) and parse it
 */
#define _POSIX_C_SOURCE 200809L
#include "../ds4.c"         /* the whole engine: its GGUF reader is static */
#include "../ds4_synth.c"   /* and the writer, whose plans build the malformed files below */

#include <time.h>

static int n_pass, n_fail;

#define CHECK(cond, ...) do { \
        if (cond) n_pass++; \
        else { \
            n_fail++; \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__); \
            printf("\n"); \
        } \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

static uint64_t rng_state = 0x1234567887654321ull;
static uint64_t rnd(void) { return synth_next(&rng_state); }

/* ---------------------------------------------------------------------- */

static uint8_t *make_synth(const char *cfg, uint64_t seed, int wtype, int threads, size_t *size) {
    *size = ds4_synth_size(cfg, wtype);
    if (!*size) return NULL;
    uint8_t *buf = malloc(*size);
    char err[256];
    if (!buf || ds4_synth_fill(cfg, seed, wtype, buf, *size, threads, err, sizeof err) != 0) {
        printf("synth %s failed: %s\n", cfg, err);
        free(buf);
        return NULL;
    }
    return buf;
}

/* Parses a private exact-size copy (so ASan sees any read past the end). */
static int parse_copy(const uint8_t *buf, size_t size, ds4_model *m, char *err, size_t errlen) {
    uint8_t *c = malloc(size ? size : 1);
    if (size) memcpy(c, buf, size);
    int rc = ds4_gguf_parse(m, c, size, err, errlen);
    free(c);
    return rc;
}

static ds4_model *scratch_model(void) {
    static ds4_model *m;
    if (!m) m = calloc(1, sizeof *m);
    return m;
}

static void expect_fail(const char *label, const uint8_t *buf, size_t size, const char *sub) {
    char err[512];
    int rc = parse_copy(buf, size, scratch_model(), err, sizeof err);
    CHECK(rc == -1 && strstr(err, sub) != NULL, "%s: rc %d, message \"%s\", wanted \"%s\"", label, rc, err, sub);
    if (rc == -1) CHECK(strchr(err, '\n') == NULL && err[0], "%s: message not one line", label);
}

static void expect_ok(const char *label, const uint8_t *buf, size_t size, ds4_model *m) {
    char err[512];
    int rc = parse_copy(buf, size, m ? m : scratch_model(), err, sizeof err);
    CHECK(rc == 0, "%s: parse failed: %s", label, err);
}

/* ---- plans: build a synthetic plan, mutate it, serialise it ---- */

static int plan_kv_index(gguf_plan *p, const char *key) {
    for (int i = 0; i < p->n_kv; i++)
        if (strcmp(p->kv[i].key, key) == 0) return i;
    printf("no key %s in plan\n", key);
    exit(2);
}

static gguf_wkv *plan_kv(gguf_plan *p, const char *key) { return &p->kv[plan_kv_index(p, key)]; }

static void plan_del_kv(gguf_plan *p, const char *key) {
    int i = plan_kv_index(p, key);
    memmove(&p->kv[i], &p->kv[i + 1], (size_t)(p->n_kv - i - 1) * sizeof p->kv[0]);
    p->n_kv--;
}

static int plan_t_index(gguf_plan *p, const char *name) {
    for (int i = 0; i < p->n_t; i++)
        if (strcmp(p->t[i].name, name) == 0) return i;
    printf("no tensor %s in plan\n", name);
    exit(2);
}

static gguf_wtensor *plan_t(gguf_plan *p, const char *name) { return &p->t[plan_t_index(p, name)]; }

static void plan_del_t(gguf_plan *p, const char *name) {
    int i = plan_t_index(p, name);
    memmove(&p->t[i], &p->t[i + 1], (size_t)(p->n_t - i - 1) * sizeof p->t[0]);
    p->n_t--;
}

static void plan_add_t(gguf_plan *p, const char *name, int n_dims, int64_t ne0, int64_t ne1, uint32_t type) {
    int64_t ne[4] = {ne0, ne1, 1, 1};
    gguf_wtensor *t = gguf_plan_tensor(p, name, n_dims, ne, type);
    t->fill = SF_BIAS;
    t->std = 0.1f;
}

static void tiny_plan(gguf_plan *p) {
    char err[256];
    if (!synth_plan_init(p, "tiny", DS4_TYPE_F32, err, sizeof err)) {
        printf("plan: %s\n", err);
        exit(2);
    }
}

/* Serialises a plan (relayout: recompute offsets first). */
static uint8_t *plan_image(gguf_plan *p, int relayout, size_t *size) {
    if (relayout) gguf_plan_layout(p);
    *size = (size_t)p->total;
    uint8_t *buf = malloc(*size);
    gguf_plan_write_header(p, buf, *size);
    gguf_plan_fill(p, 7, buf, *size, 1);
    return buf;
}

static void plan_expect_fail(const char *label, gguf_plan *p, int relayout, const char *sub) {
    size_t n;
    uint8_t *b = plan_image(p, relayout, &n);
    expect_fail(label, b, n, sub);
    free(b);
    gguf_plan_free(p);
}

static void plan_expect_ok(const char *label, gguf_plan *p, ds4_model *m) {
    size_t n;
    uint8_t *b = plan_image(p, 1, &n);
    expect_ok(label, b, n, m);
    free(b);
    gguf_plan_free(p);
}

/* ---- raw builder for GGUF-level malformations ---- */

typedef struct { uint8_t b[4096]; gguf_wout o; } raw_t;

static void raw_begin(raw_t *r, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    r->o.buf = r->b;
    r->o.cap = sizeof r->b;
    r->o.pos = 0;
    gguf_w_bytes(&r->o, "GGUF", 4);
    gguf_w_u32(&r->o, version);
    gguf_w_u64(&r->o, n_tensors);
    gguf_w_u64(&r->o, n_kv);
}

static void raw_tinfo(raw_t *r, const char *name, uint32_t n_dims, const int64_t *ne, uint32_t type, uint64_t off) {
    gguf_w_str(&r->o, name);
    gguf_w_u32(&r->o, n_dims);
    for (uint32_t i = 0; i < n_dims; i++) gguf_w_u64(&r->o, (uint64_t)ne[i]);
    gguf_w_u32(&r->o, type);
    gguf_w_u64(&r->o, off);
}

static void raw_pad(raw_t *r, size_t extra) {
    while (r->o.pos % 32) gguf_w_le(&r->o, 0, 1);
    for (size_t i = 0; i < extra; i++) gguf_w_le(&r->o, 0, 1);
}

/* ---------------------------------------------------------------------- */

static void test_conversions(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ds4_f16_to_f32((uint16_t)h);
        int nan = ((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff);
        if (nan) bad += gguf_f32_finite(f) || (ds4_f32_to_f16(f) & 0x7c00) != 0x7c00 || !(ds4_f32_to_f16(f) & 0x3ff);
        else bad += ds4_f32_to_f16(f) != h;
    }
    CHECK(bad == 0, "f16 round trip: %d mismatches", bad);
    CHECK(ds4_f16_to_f32(0x0001) == 0x1p-24f && ds4_f16_to_f32(0x03ff) == 1023 * 0x1p-24f &&
          ds4_f16_to_f32(0x0400) == 0x1p-14f && ds4_f16_to_f32(0x3c00) == 1.0f &&
          ds4_f16_to_f32(0x7bff) == 65504.0f && ds4_f16_to_f32(0xc000) == -2.0f,
          "f16 -> f32 special values");
    CHECK(ds4_f32_to_f16(65504.0f) == 0x7bff && ds4_f32_to_f16(65519.996f) == 0x7bff &&
          ds4_f32_to_f16(65520.0f) == 0x7c00 && ds4_f32_to_f16(1e10f) == 0x7c00 &&
          ds4_f32_to_f16(-INFINITY) == 0xfc00 && ds4_f32_to_f16(-0.0f) == 0x8000,
          "f32 -> f16 overflow / signs");
    CHECK(ds4_f32_to_f16(0x1p-25f) == 0 && ds4_f32_to_f16(nextafterf(0x1p-25f, 1)) == 1 &&
          ds4_f32_to_f16(1.5f * 0x1p-24f) == 2 && ds4_f32_to_f16(2.5f * 0x1p-24f) == 2 &&
          ds4_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00 && ds4_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02 &&
          ds4_f32_to_f16(0x1p-14f - 0x1p-25f) == 0x0400,
          "f32 -> f16 ties and subnormals");
    /* random floats: the result is a nearest f16, ties to even */
    bad = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t bits = (uint32_t)rnd();
        uint32_t e = 100 + (uint32_t)(rnd() % 45);        /* 2^-27 .. 2^17 */
        bits = (bits & 0x807fffffu) | (e << 23);
        float x;
        memcpy(&x, &bits, 4);
        uint16_t h = ds4_f32_to_f16(x);
        double v = ds4_f16_to_f32(h), ax = fabs((double)x);
        if ((h & 0x7c00) == 0x7c00) { bad += ax < 65520.0; continue; }
        uint16_t mag = h & 0x7fff;
        double up = ds4_f16_to_f32((uint16_t)(mag + 1));
        double dn = mag ? ds4_f16_to_f32((uint16_t)(mag - 1)) : 0.0;
        double err = fabs(fabs(v) - ax);
        if (mag + 1 < 0x7c00 && fabs(up - ax) < err) bad++;
        if (mag && fabs(dn - ax) < err) bad++;
        if ((mag + 1 < 0x7c00 && fabs(up - ax) == err && (mag & 1)) || (mag && fabs(dn - ax) == err && (mag & 1))) bad++;
        if ((x < 0) != ((h & 0x8000) != 0) && mag) bad++;
    }
    CHECK(bad == 0, "f32 -> f16 random nearest-even: %d bad", bad);

    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = ds4_bf16_to_f32((uint16_t)h);
        if ((h & 0x7f80) == 0x7f80 && (h & 0x7f)) bad += ds4_f32_to_bf16(f) != (h | 0x40);
        else bad += ds4_f32_to_bf16(f) != h;
    }
    CHECK(bad == 0, "bf16 round trip: %d mismatches", bad);
    float a, b, c;
    uint32_t ua = 0x3f808000u, ub = 0x3f818000u, uc = 0x3f808001u;
    memcpy(&a, &ua, 4); memcpy(&b, &ub, 4); memcpy(&c, &uc, 4);
    CHECK(ds4_f32_to_bf16(a) == 0x3f80 && ds4_f32_to_bf16(b) == 0x3f82 && ds4_f32_to_bf16(c) == 0x3f81 &&
          ds4_f32_to_bf16(INFINITY) == 0x7f80 && (ds4_f32_to_bf16(NAN) & 0x7fc0) == 0x7fc0,
          "f32 -> bf16 ties / specials");
}

static void check_hparams_equal(const ds4_hparams *a, const ds4_hparams *b) {
    int bad = 0;
#define F(x) if (a->x != b->x) { bad++; printf("  hparam %s: %g vs %g\n", #x, (double)a->x, (double)b->x); }
    F(n_ctx_train) F(n_embd) F(n_layer) F(n_vocab) F(n_head) F(head_dim) F(rms_eps) F(q_lora) F(n_swa)
    F(o_groups) F(o_lora) F(compress_rope_base) F(idx_heads) F(idx_dim) F(idx_topk) F(n_rot) F(rope_base)
    F(rope_yarn) F(rope_factor) F(rope_orig_ctx) F(yarn_beta_fast) F(yarn_beta_slow) F(n_expert)
    F(n_expert_used) F(n_expert_shared) F(n_ff_exp) F(expert_weights_scale) F(expert_weights_norm)
    F(expert_gating_func) F(n_hc) F(sinkhorn_iters) F(hc_eps) F(n_hash_layers) F(has_vocab)
    for (int i = 0; i < a->n_layer && i < DS4_MAX_LAYERS; i++) { F(ratio[i]) F(clamp_exp[i]) F(clamp_shexp[i]) }
#undef F
    CHECK(bad == 0, "parsed hparams equal the synth config (%d differ)", bad);
}

static void test_tiny_valid(void) {
    size_t n;
    uint8_t *img = make_synth("tiny", 1, DS4_TYPE_F32, 2, &n);
    CHECK(img != NULL, "tiny synth");
    if (!img) return;
    ds4_model *m = calloc(1, sizeof *m);
    m->owned_kind = 2;
    char err[512];
    int rc = ds4_gguf_parse(m, img, n, err, sizeof err);
    CHECK(rc == 0, "tiny parses: %s", err);
    if (rc == 0) {
        gguf_plan p;
        tiny_plan(&p);
        check_hparams_equal(&m->hp, &p.hp);
        CHECK(m->n_tensors == p.n_t, "n_tensors %d vs %d", m->n_tensors, p.n_t);
        uint64_t wb = 0;
        for (int i = 0; i < p.n_t; i++) wb += p.t[i].nbytes;
        CHECK(m->weight_bytes == wb, "weight_bytes %zu vs %llu", m->weight_bytes, (unsigned long long)wb);
        gguf_plan_free(&p);

        const ds4_hparams *hp = &m->hp;
        CHECK(hp->n_layer == 6 && hp->n_embd == 128 && hp->n_vocab == 512 && hp->head_dim == 64 &&
              hp->ratio[0] == 0 && hp->ratio[1] == 0 && hp->ratio[2] == 4 && hp->ratio[3] == 128 &&
              hp->ratio[5] == 128 && hp->n_hash_layers == 2 && hp->has_vocab == 0 && hp->rope_yarn == 1 &&
              hp->rope_factor == 4.0f && hp->rope_orig_ctx == 256 && hp->clamp_shexp[3] == 10.0f,
              "tiny hparams");
        CHECK(m->owned_kind == 2 && m->base == img && m->size == n, "model mapping fields");
        CHECK(m->tok_embd.ne[0] == 128 && m->tok_embd.ne[1] == 512 && m->tok_embd.n_dims == 2 &&
              m->tok_embd.type == DS4_TYPE_F32 && m->tok_embd.nbytes == 128 * 512 * 4 &&
              strcmp(m->tok_embd.name, "token_embd.weight") == 0 && m->tok_embd.dev == NULL,
              "token_embd weight");
        const ds4_layer_w *l3 = &m->layers[3], *l2 = &m->layers[2], *l0 = &m->layers[0];
        CHECK(l3->q_b.ne[0] == 64 && l3->q_b.ne[1] == 512 && strcmp(l3->q_b.name, "attn_q_b.weight") == 0,
              "blk.3.attn_q_b shape");
        CHECK(l3->comp_ape.ne[0] == 64 && l3->comp_ape.ne[1] == 128 && l3->idx_proj.host == NULL,
              "blk.3 (ratio 128) compressor, no indexer");
        CHECK(l2->comp_ape.ne[0] == 128 && l2->comp_ape.ne[1] == 4 && l2->idx_q_b.ne[1] == 32 * 64 &&
              l2->idx_comp_kv.ne[1] == 128 && l2->idx_comp_ape.ne[0] == 128 && l2->idx_comp_ape.ne[1] == 4,
              "blk.2 (ratio 4) compressor and indexer");
        CHECK(l0->comp_kv.host == NULL && l0->tid2eid.host && l0->tid2eid.type == DS4_TYPE_I32 &&
              l0->tid2eid.ne[0] == 2 && l0->tid2eid.ne[1] == 512 && l0->exp_probs_b.host == NULL &&
              l2->tid2eid.host == NULL && l2->exp_probs_b.host && l2->exp_probs_b.ne[0] == 8,
              "hash / routed layers");
        CHECK(l0->gate_exps.n_dims == 3 && l0->gate_exps.ne[0] == 128 && l0->gate_exps.ne[1] == 64 &&
              l0->gate_exps.ne[2] == 8 && l0->down_exps.ne[0] == 64 && l0->down_exps.ne[1] == 128 &&
              l0->out_a.ne[0] == 256 && l0->out_a.ne[1] == 64 && l0->out_b.ne[0] == 64 &&
              l0->hc_attn_fn.ne[0] == 512 && l0->hc_attn_fn.ne[1] == 24 && m->output_hc_fn.ne[1] == 4 &&
              m->output_hc_scale.ne[0] == 1 && m->output_hc_scale.n_dims == 1,
              "expert / output / mHC shapes");
        /* every bound weight lies inside the image and is 32-byte aligned relative to it */
        int bad = 0;
        for (int il = 0; il < hp->n_layer; il++)
            for (int id = 0; id < LT_COUNT; id++) {
                const ds4_weight *w = (const ds4_weight *)((const char *)&m->layers[il] + gguf_layer_specs[id].off);
                int has = gguf_layer_has(gguf_layer_specs[id].when, hp, il);
                if (has != (w->host != NULL)) bad++;
                if (w->host && ((const uint8_t *)w->host < img || (const uint8_t *)w->host + w->nbytes > img + n ||
                                ((const uint8_t *)w->host - img) % 32 != 0)) bad++;
            }
        CHECK(bad == 0, "layer weights present exactly when expected and inside the image (%d bad)", bad);
        /* the data statistics roughly as configured */
        const float *ln = m->layers[1].attn_norm.host;
        float lo = 9, hi = -9;
        for (int i = 0; i < 128; i++) { if (ln[i] < lo) lo = ln[i]; if (ln[i] > hi) hi = ln[i]; }
        CHECK(lo > 0.82f && hi < 1.18f && hi - lo > 0.2f, "norm weights 1 + 0.1u (range %g..%g)", lo, hi);
        const float *e = m->tok_embd.host;
        double s2 = 0;
        for (int i = 0; i < 128 * 512; i++) s2 += (double)e[i] * e[i];
        CHECK(fabs(s2 / (128 * 512) - 1.0) < 0.03, "token_embd variance %g", s2 / (128 * 512));
        const int32_t *tid = m->layers[1].tid2eid.host;
        bad = 0;
        int hist[8] = {0};
        for (int r = 0; r < 512; r++) {
            if (tid[2 * r] == tid[2 * r + 1]) bad++;
            hist[tid[2 * r]]++;
            hist[tid[2 * r + 1]]++;
        }
        for (int i = 0; i < 8; i++) bad += hist[i] < 64;
        CHECK(bad == 0, "tid2eid rows distinct and spread over experts");
    }
    free(m);
    free(img);
}

static void test_determinism(void) {
    size_t n1, n2, n3, n4;
    uint8_t *a = make_synth("tiny", 5, DS4_TYPE_Q8_0, 1, &n1);
    uint8_t *b = make_synth("tiny", 5, DS4_TYPE_Q8_0, 3, &n2);
    uint8_t *c = make_synth("tiny", 6, DS4_TYPE_Q8_0, 2, &n3);
    CHECK(a && b && c && n1 == n2 && n1 == n3, "tiny q8_0 builds");
    if (a && b && c) {
        CHECK(memcmp(a, b, n1) == 0, "same seed, different thread counts: identical bytes");
        size_t diff = 0;
        for (size_t i = 0; i < n1; i++) diff += a[i] != c[i];
        CHECK(diff > n1 / 2, "different seeds differ (%zu of %zu bytes)", diff, n1);
    }
    free(a); free(b); free(c);
    a = make_synth("small", 9, DS4_TYPE_F32, 2, &n1);
    b = make_synth("small", 9, DS4_TYPE_F32, 5, &n4);
    CHECK(a && b && n1 == n4 && memcmp(a, b, n1) == 0, "small f32: identical with 2 and 5 threads");
    if (a) {
        expect_ok("small f32 parses", a, n1, NULL);
        /* a fixed fingerprint: any change to the generator or the layout shows here */
        printf("  fingerprint small/f32/seed 9: %016llx (%zu bytes)\n", (unsigned long long)fnv(a, n1), n1);
        /* Golden values: the synthetic bytes must be the same on every machine and compiler.
         * Update these (deliberately) when the generator, the layout or synth_stats() changes. */
        CHECK(fnv(a, n1) == 0x8b1d8a4177e9b840ull, "golden fingerprint small/f32/seed 9");
    }
    free(a); free(b);
    a = make_synth("tiny", 1, DS4_TYPE_F32, 2, &n1);
    if (a) printf("  fingerprint tiny/f32/seed 1: %016llx (%zu bytes)\n", (unsigned long long)fnv(a, n1), n1);
    CHECK(a && fnv(a, n1) == 0x8b147a0b1dc16726ull, "golden fingerprint tiny/f32/seed 1");
    free(a);
    a = make_synth("tiny", 1, DS4_TYPE_Q8_0, 2, &n1);
    if (a) printf("  fingerprint tiny/q8_0/seed 1: %016llx (%zu bytes)\n", (unsigned long long)fnv(a, n1), n1);
    CHECK(a && fnv(a, n1) == 0xd190e9c9191cb340ull, "golden fingerprint tiny/q8_0/seed 1");
    free(a);
    a = make_synth("tiny", 1, DS4_TYPE_BF16, 1, &n1);
    CHECK(a && fnv(a, n1) == 0xa359a2067c30df98ull, "golden fingerprint tiny/bf16/seed 1: %016llx", a ? (unsigned long long)fnv(a, n1) : 0ull);
    free(a);
}

static void test_types(void) {
    size_t nf;
    uint8_t *f = make_synth("tiny", 3, DS4_TYPE_F32, 2, &nf);
    gguf_plan pf;
    tiny_plan(&pf);
    const int types[3] = {DS4_TYPE_F16, DS4_TYPE_BF16, DS4_TYPE_Q8_0};
    for (int k = 0; k < 3; k++) {
        int wt = types[k];
        size_t n;
        uint8_t *img = make_synth("tiny", 3, wt, 2, &n);
        ds4_model *m = calloc(1, sizeof *m);
        char err[512], lab[64];
        snprintf(lab, sizeof lab, "tiny %s", gguf_tensor_type_name((uint32_t)wt));
        int rc = ds4_gguf_parse(m, img, n, err, sizeof err);
        CHECK(rc == 0, "%s parses: %s", lab, err);
        if (rc == 0) {
            CHECK(m->tok_embd.type == wt && m->layers[2].idx_q_b.type == wt && m->layers[0].down_exps.type == wt &&
                  m->layers[0].attn_norm.type == DS4_TYPE_F32 && m->layers[0].hc_attn_fn.type == DS4_TYPE_F32 &&
                  m->layers[0].gate_inp.type == DS4_TYPE_F32 && m->output_hc_fn.type == DS4_TYPE_F32,
                  "%s tensor types", lab);
            gguf_plan pq;
            synth_plan_init(&pq, "tiny", wt, err, sizeof err);
            long bad = 0, checked = 0;
            double maxrel = 0;
            for (int i = 0; i < pq.n_t; i++) {
                const gguf_wtensor *tq = &pq.t[i], *tf = &pf.t[i];
                const uint8_t *q = img + pq.data_start + tq->offset;
                const uint8_t *x = f + pf.data_start + tf->offset;
                uint64_t nel = synth_nel(tf);
                if (tq->type == DS4_TYPE_F32 || tq->type == DS4_TYPE_I32) {
                    bad += memcmp(q, x, (size_t)tf->nbytes) != 0;
                    continue;
                }
                for (uint64_t e = 0; e < nel; e++) {
                    float v = gguf_lef32(x + e * 4);
                    checked++;
                    if (tq->type == DS4_TYPE_F16) bad += gguf_le16(q + e * 2) != ds4_f32_to_f16(v);
                    else if (tq->type == DS4_TYPE_BF16) bad += gguf_le16(q + e * 2) != ds4_f32_to_bf16(v);
                    else {
                        const uint8_t *blk = q + (e / 32) * 34;
                        float d = ds4_f16_to_f32(gguf_le16(blk));
                        float deq = d * (float)(int8_t)blk[2 + e % 32];
                        if (fabsf(deq - v) > 0.5001f * d + 1e-12f) bad++;
                        if (fabsf(v) > 0) {
                            double rel = fabs((double)deq - v) / fabs((double)v);
                            if (fabsf(v) > 0.5f * 127 * d && rel > maxrel) maxrel = rel;
                        }
                    }
                }
            }
            CHECK(bad == 0 && checked > 100000, "%s values match the f32 variant (%ld bad of %ld)", lab, bad, checked);
            if (wt == DS4_TYPE_Q8_0) CHECK(maxrel < 0.01, "q8_0 relative error on large values %g", maxrel);
            gguf_plan_free(&pq);
        }
        free(m);
        free(img);
    }
    gguf_plan_free(&pf);
    free(f);
}

static void test_sizes_and_api(void) {
    char err[256];
    CHECK(ds4_synth_config_ok("tiny") && ds4_synth_config_ok("small") && ds4_synth_config_ok("flash16") &&
          !ds4_synth_config_ok("huge") && !ds4_synth_config_ok(NULL), "config names");
    CHECK(ds4_synth_size("huge", DS4_TYPE_F32) == 0 && ds4_synth_size("tiny", 2) == 0 &&
          ds4_synth_size("tiny", DS4_TYPE_I32) == 0, "size of bad config / type is 0");
    double t0 = now_s();
    size_t fq = ds4_synth_size("flash16", DS4_TYPE_Q8_0);
    double t1 = now_s();
    size_t ff = ds4_synth_size("flash16", DS4_TYPE_F32);
    printf("  flash16 q8_0 image %zu bytes (%.2f GB), f32 %.2f GB; ds4_synth_size took %.3f ms\n",
           fq, fq / 1e9, ff / 1e9, (t1 - t0) * 1e3);
    CHECK(fq > 23e9 && fq < 27e9, "flash16 q8_0 size ~25 GB (%zu)", fq);
    uint8_t small[64];
    CHECK(ds4_synth_fill("tiny", 1, DS4_TYPE_F32, small, sizeof small, 1, err, sizeof err) == -1 &&
          strstr(err, "needs a buffer of"), "fill with a wrong size: %s", err);
    CHECK(ds4_synth_fill("nope", 1, DS4_TYPE_F32, small, sizeof small, 1, err, sizeof err) == -1 &&
          strstr(err, "unknown synth config 'nope'"), "fill unknown config: %s", err);
    CHECK(ds4_synth_fill("tiny", 1, 3, small, sizeof small, 1, err, sizeof err) == -1 &&
          strstr(err, "unsupported synth weight type 3"), "fill bad type: %s", err);

    size_t n = ds4_synth_size("small", DS4_TYPE_F32);
    uint8_t *buf = malloc(n);
    t0 = now_s();
    int rc = ds4_synth_fill("small", 1, DS4_TYPE_F32, buf, n, 2, err, sizeof err);
    t1 = now_s();
    CHECK(rc == 0, "small fill: %s", err);
    printf("  small f32 (%.1f MB) filled with 2 threads in %.1f ms\n", n / 1e6, (t1 - t0) * 1e3);
    free(buf);
    n = ds4_synth_size("small", DS4_TYPE_Q8_0);
    buf = malloc(n);
    t0 = now_s();
    rc = ds4_synth_fill("small", 1, DS4_TYPE_Q8_0, buf, n, 2, err, sizeof err);
    t1 = now_s();
    CHECK(rc == 0, "small q8_0 fill: %s", err);
    printf("  small q8_0 (%.1f MB) filled with 2 threads in %.1f ms\n", n / 1e6, (t1 - t0) * 1e3);
    expect_ok("small q8_0 parses", buf, n, NULL);
    free(buf);
}

/* ---- GGUF-level malformations (hand-built files) ---- */

static void test_raw(void) {
    raw_t r;
    int64_t ne[4];

    uint8_t three[3] = {'G', 'G', 'U'};
    expect_fail("3-byte file", three, 3, "too small");
    expect_fail("empty file", three, 0, "too small");

    raw_begin(&r, 2, 0, 0);
    expect_fail("version 2", r.b, r.o.pos, "unsupported GGUF version 2 (expected 3)");
    raw_begin(&r, 3, 0, 0);
    r.b[0] = 'X';
    expect_fail("bad magic", r.b, r.o.pos, "bad magic");

    raw_begin(&r, 3, (uint64_t)1 << 40, 0);
    expect_fail("absurd tensor count", r.b, r.o.pos, "tensor count");
    raw_begin(&r, 3, 0, (uint64_t)1 << 40);
    expect_fail("absurd kv count", r.b, r.o.pos, "key-value count");
    raw_begin(&r, 3, UINT64_MAX, 0);
    expect_fail("negative tensor count", r.b, r.o.pos, "tensor count");
    raw_begin(&r, 3, 0, 1);
    gguf_w_u64(&r.o, 5);
    expect_fail("kv count 1, truncated", r.b, r.o.pos, "impossible");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, GGUF_T_STRING);
    gguf_w_u64(&r.o, (uint64_t)1 << 62);
    raw_pad(&r, 64);
    expect_fail("absurd string length", r.b, r.o.pos, "string length");

    raw_begin(&r, 3, 0, 1);
    gguf_w_u64(&r.o, UINT64_MAX);
    raw_pad(&r, 64);
    expect_fail("absurd key name length", r.b, r.o.pos, "string length");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, GGUF_T_ARRAY);
    gguf_w_u32(&r.o, GGUF_T_U32);
    gguf_w_u64(&r.o, (uint64_t)1 << 61);
    raw_pad(&r, 64);
    expect_fail("absurd array length", r.b, r.o.pos, "array of");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, GGUF_T_ARRAY);
    gguf_w_u32(&r.o, GGUF_T_STRING);
    gguf_w_u64(&r.o, UINT64_MAX / 2);
    raw_pad(&r, 64);
    expect_fail("absurd string array length", r.b, r.o.pos, "array of");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, 13);
    gguf_w_u64(&r.o, 0);
    expect_fail("unknown kv type", r.b, r.o.pos, "unknown value type 13");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, GGUF_T_ARRAY);
    gguf_w_u32(&r.o, 99);
    gguf_w_u64(&r.o, 1);
    gguf_w_u64(&r.o, 0);
    expect_fail("unknown array element type", r.b, r.o.pos, "unknown element type 99");

    /* well-formed exotic metadata (nested arrays of strings, every scalar type) is skipped */
    raw_begin(&r, 3, 0, 3);
    gguf_w_str(&r.o, "x.nested");
    gguf_w_u32(&r.o, GGUF_T_ARRAY);
    gguf_w_u32(&r.o, GGUF_T_ARRAY);       /* level 1 */
    gguf_w_u64(&r.o, 2);
    for (int i = 0; i < 2; i++) {
        gguf_w_u32(&r.o, GGUF_T_ARRAY);   /* level 2 */
        gguf_w_u64(&r.o, 1);
        gguf_w_u32(&r.o, GGUF_T_STRING);  /* level 3 */
        gguf_w_u64(&r.o, 2);
        gguf_w_str(&r.o, "hello");
        gguf_w_str(&r.o, "");
    }
    gguf_w_str(&r.o, "x.empty");
    gguf_w_u32(&r.o, GGUF_T_ARRAY);
    gguf_w_u32(&r.o, GGUF_T_F64);
    gguf_w_u64(&r.o, 0);
    gguf_w_str(&r.o, "x.f64");
    gguf_w_u32(&r.o, GGUF_T_F64);
    gguf_w_u64(&r.o, 0);
    expect_fail("nested arrays parse, then no architecture", r.b, r.o.pos, "missing key 'general.architecture' (string)");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "x.deep");
    for (int i = 0; i < 5; i++) {
        gguf_w_u32(&r.o, GGUF_T_ARRAY);
        if (i) gguf_w_u64(&r.o, 1);
    }
    gguf_w_u32(&r.o, GGUF_T_U8);
    gguf_w_u64(&r.o, 1);
    gguf_w_le(&r.o, 0, 1);
    raw_pad(&r, 32);
    expect_fail("arrays nested too deep", r.b, r.o.pos, "nested deeper");

    raw_begin(&r, 3, 0, 2);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, GGUF_T_U8);
    gguf_w_le(&r.o, 1, 1);
    gguf_w_str(&r.o, "a");
    gguf_w_u32(&r.o, GGUF_T_U8);
    gguf_w_le(&r.o, 1, 1);
    expect_fail("duplicate key", r.b, r.o.pos, "duplicate key 'a'");

    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "general.alignment");
    gguf_w_u32(&r.o, GGUF_T_U32);
    gguf_w_u32(&r.o, 24);
    expect_fail("alignment 24", r.b, r.o.pos, "key 'general.alignment' = 24 is not a power of two");
    raw_begin(&r, 3, 0, 1);
    gguf_w_str(&r.o, "general.alignment");
    gguf_w_u32(&r.o, GGUF_T_STRING);
    gguf_w_str(&r.o, "32");
    expect_fail("alignment string", r.b, r.o.pos, "key 'general.alignment' has type string, expected u32");

    /* tensor directory */
    ne[0] = 4; ne[1] = 1;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 0, ne, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("n_dims 0", r.b, r.o.pos, "tensor 't' has n_dims 0 (expected 1..4)");
    raw_begin(&r, 3, 1, 0);
    int64_t ne5[5] = {1, 1, 1, 1, 1};
    raw_tinfo(&r, "t", 5, ne5, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("n_dims 5", r.b, r.o.pos, "tensor 't' has n_dims 5 (expected 1..4)");
    ne[0] = (int64_t)1 << 40; ne[1] = (int64_t)1 << 40;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 2, ne, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("ne product overflows", r.b, r.o.pos, "element count overflows");
    ne[0] = (int64_t)1 << 62; ne[1] = 1;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 2, ne, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("byte size overflows", r.b, r.o.pos, "byte size overflows");
    ne[0] = 4; ne[1] = -3;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 2, ne, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("negative ne", r.b, r.o.pos, "invalid dimension ne[1] = -3");
    ne[1] = 0;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 2, ne, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("zero ne", r.b, r.o.pos, "invalid dimension ne[1] = 0");
    ne[0] = 32; ne[1] = 1;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 1, ne, 2, 0);
    raw_pad(&r, 64);
    expect_fail("unknown tensor type", r.b, r.o.pos,
                "tensor 't' has unsupported type 2 (ds4 reads F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS, I32)");
    ne[0] = 33;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_Q8_0, 0);
    raw_pad(&r, 64);
    expect_fail("q8_0 ne0 not multiple of 32", r.b, r.o.pos, "not a multiple of 32");
    {   /* the super-block types take rows of whole 256-element blocks */
        const int sbt[3] = { DS4_TYPE_Q2_K, DS4_TYPE_Q4_K, DS4_TYPE_IQ2_XXS };
        const char *sbn[3] = { "tensor 't' has type Q2_K but ne[0] = 288 is not a multiple of 256",
                               "tensor 't' has type Q4_K but ne[0] = 288 is not a multiple of 256",
                               "tensor 't' has type IQ2_XXS but ne[0] = 288 is not a multiple of 256" };
        for (int i = 0; i < 3; i++) {
            ne[0] = 288;
            raw_begin(&r, 3, 1, 0);
            raw_tinfo(&r, "t", 1, ne, (uint32_t)sbt[i], 0);
            raw_pad(&r, 64);
            expect_fail("super-block ne0 not multiple of 256", r.b, r.o.pos, sbn[i]);
        }
    }
    ne[0] = 4;
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "", 1, ne, DS4_TYPE_F32, 0);
    raw_pad(&r, 64);
    expect_fail("empty tensor name", r.b, r.o.pos, "name of 0 bytes");
    raw_begin(&r, 3, 2, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_F32, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_F32, 32);
    raw_pad(&r, 64);
    expect_fail("duplicate tensor (raw)", r.b, r.o.pos, "duplicate tensor 't'");
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_F32, 4);
    raw_pad(&r, 64);
    expect_fail("misaligned offset", r.b, r.o.pos, "tensor 't' data offset 4 is not a multiple of the alignment 32");
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_F32, 0);
    size_t hdr = r.o.pos;
    raw_pad(&r, 8);                 /* 8 of the 16 data bytes */
    char want[160];
    size_t ds = (hdr + 31) / 32 * 32;
    snprintf(want, sizeof want, "tensor 't' data [%zu, %zu) extends past end of file (size %zu)", ds, ds + 16, r.o.pos);
    expect_fail("data past end", r.b, r.o.pos, want);
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_F32, UINT64_MAX - 31);
    raw_pad(&r, 64);
    expect_fail("offset near 2^64", r.b, r.o.pos, "extends past end of file");
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "t", 1, ne, DS4_TYPE_F32, 0);
    expect_fail("data section past end", r.b, r.o.pos, "past end of file");
    raw_begin(&r, 3, 1, 0);
    raw_tinfo(&r, "a_long_tensor_name_to_pass_the_count_check", 1, ne, DS4_TYPE_F32, 0);
    r.o.pos -= 18;      /* cut inside ne[0] */
    expect_fail("truncated tensor info", r.b, r.o.pos,
                "truncated file: tensor 'a_long_tensor_name_to_pass_the_count_check' info at offset");
}

/* ---- convention-level malformations (mutated synthetic plans) ---- */

static void test_convention(void) {
    gguf_plan p;
    ds4_model *m = calloc(1, sizeof *m);

    tiny_plan(&p);
    plan_del_kv(&p, K_Q_LORA);
    plan_expect_fail("missing q_lora", &p, 1, "missing key 'deepseek4.attention.q_lora_rank' (u32)");

    tiny_plan(&p);
    plan_kv(&p, K_Q_LORA)->type = GGUF_T_STRING;
    plan_kv(&p, K_Q_LORA)->s = "64";
    plan_expect_fail("q_lora as string", &p, 1, "key 'deepseek4.attention.q_lora_rank' has type string, expected u32");

    tiny_plan(&p);
    plan_kv(&p, K_Q_LORA)->type = GGUF_T_I32;
    plan_kv(&p, K_Q_LORA)->u = (uint64_t)(int64_t)-64;
    plan_expect_fail("q_lora negative", &p, 1, "key 'deepseek4.attention.q_lora_rank' = -64 is out of range");

    static const uint32_t int_types[] = {GGUF_T_U8, GGUF_T_I16, GGUF_T_I32, GGUF_T_U64, GGUF_T_I64};
    for (int i = 0; i < 5; i++) {
        tiny_plan(&p);
        plan_kv(&p, K_Q_LORA)->type = int_types[i];
        plan_kv(&p, K_HEADS_KV)->type = int_types[i];
        plan_expect_ok("q_lora / head_count_kv as another integer type", &p, m);
        CHECK(m->hp.q_lora == 64, "q_lora read from integer type %u", int_types[i]);
    }

    tiny_plan(&p);
    plan_kv(&p, K_EXP_SCALE)->type = GGUF_T_U32;
    plan_expect_fail("expert_weights_scale as u32", &p, 1, "key 'deepseek4.expert_weights_scale' has type u32, expected f32");
    tiny_plan(&p);
    plan_kv(&p, K_EXP_SCALE)->type = GGUF_T_F64;
    plan_expect_fail("expert_weights_scale as f64", &p, 1, "has type f64, expected f32");
    tiny_plan(&p);
    plan_kv(&p, K_EXP_NORM)->type = GGUF_T_U32;
    plan_expect_fail("expert_weights_norm as u32", &p, 1, "key 'deepseek4.expert_weights_norm' has type u32, expected bool");
    tiny_plan(&p);
    plan_kv(&p, K_RMS_EPS)->f = NAN;
    plan_expect_fail("rms eps NaN", &p, 1, "is not finite");
    tiny_plan(&p);
    plan_kv(&p, K_RMS_EPS)->f = 0;
    plan_expect_fail("rms eps 0", &p, 1, "key 'deepseek4.attention.layer_norm_rms_epsilon' = 0 is out of range (expected > 0)");

    /* architecture */
    tiny_plan(&p);
    plan_kv(&p, K_ARCH)->s = "llama";
    plan_expect_fail("wrong architecture", &p, 1, "key 'general.architecture' is 'llama', expected 'deepseek4'");
    tiny_plan(&p);
    plan_del_kv(&p, K_ARCH);
    plan_expect_fail("missing architecture", &p, 1, "missing key 'general.architecture' (string)");

    /* range checks */
    struct { const char *key; uint64_t v; const char *msg; } rc[] = {
        {K_HEADS_KV, 2, "key 'deepseek4.attention.head_count_kv' = 2, expected 1"},
        {K_GATING, 3, "key 'deepseek4.expert_gating_func' = 3, expected 4"},
        {K_HC_COUNT, 2, "key 'deepseek4.hyper_connection.count' = 2, expected 4"},
        {K_ROPE_DIM, 15, "key 'deepseek4.rope.dimension_count' = 15 must be even"},
        {K_ROPE_DIM, 0, "key 'deepseek4.rope.dimension_count' = 0 is out of range"},
        {K_ROPE_DIM, 66, "key 'deepseek4.rope.dimension_count' = 66 exceeds deepseek4.attention.key_length = 64"},
        {K_EXPERTS_USED, 9, "key 'deepseek4.expert_used_count' = 9 exceeds deepseek4.expert_count = 8"},
        {K_EXPERTS_USED, 0, "key 'deepseek4.expert_used_count' = 0 is out of range"},
        {K_O_GROUPS, 3, "key 'deepseek4.attention.output_group_count' = 3 does not divide deepseek4.attention.head_count = 8"},
        {K_BLOCKS, 200, "key 'deepseek4.block_count' = 200 exceeds the ds4 limit of 128 layers"},
        {K_BLOCKS, 0, "key 'deepseek4.block_count' = 0 is out of range"},
        {K_HC_ITERS, 0, "key 'deepseek4.hyper_connection.sinkhorn_iterations' = 0 is out of range"},
        {K_HASH_LAYERS, 7, "key 'deepseek4.hash_layer_count' = 7 is out of range (expected 0..6)"},
        {K_IDX_TOPK, 0, "key 'deepseek4.attention.indexer.top_k' = 0 is out of range (expected 1.."},
        {K_IDX_HEADS, 0, "key 'deepseek4.attention.indexer.head_count' = 0 is out of range"},
        {K_SWA, 0, "key 'deepseek4.attention.sliding_window' = 0 is out of range"},
        {K_KEY_LEN, 63, "key 'deepseek4.attention.key_length' = 63 must be even"},
        {K_VAL_LEN, 32, "key 'deepseek4.attention.value_length' = 32, expected 64"},
        {K_EMBD, 0, "key 'deepseek4.embedding_length' = 0 is out of range"},
        {K_VOCAB, 0, "key 'deepseek4.vocab_size' = 0 is out of range"},
        {K_EXPERTS_SHARED, 0, "key 'deepseek4.expert_shared_count' = 0 is out of range"},
        {K_FF_EXP, 0, "key 'deepseek4.expert_feed_forward_length' = 0 is out of range"},
        {K_CTX, 0, "key 'deepseek4.context_length' = 0 is out of range"},
        {K_EMBD, 256, "tensor 'token_embd.weight' has shape {128, 512}, expected {256, 512}"},
        {K_VOCAB, 500, "tensor 'token_embd.weight' has shape {128, 512}, expected {128, 500}"},
    };
    for (size_t i = 0; i < sizeof rc / sizeof rc[0]; i++) {
        tiny_plan(&p);
        plan_kv(&p, rc[i].key)->u = rc[i].v;
        plan_expect_fail(rc[i].key, &p, 1, rc[i].msg);
    }
    tiny_plan(&p);
    plan_kv(&p, K_ROPE_TYPE)->s = "linear";
    plan_expect_fail("rope scaling linear", &p, 1, "key 'deepseek4.rope.scaling.type' is 'linear', expected 'yarn' or 'none'");

    /* compress_ratios */
    tiny_plan(&p);
    p.ratios[3] = 64;
    plan_expect_fail("ratio 64", &p, 1, "key 'deepseek4.attention.compress_ratios'[3] = 64 (expected 0, 4 or 128)");
    tiny_plan(&p);
    plan_kv(&p, K_RATIOS)->arr_n = 4;
    plan_expect_fail("ratios too short", &p, 1,
                     "key 'deepseek4.attention.compress_ratios' has 4 entries, expected at least 6 (block_count)");
    tiny_plan(&p);
    plan_kv(&p, K_RATIOS)->arr_type = GGUF_T_F32;
    plan_expect_fail("ratios as f32 array", &p, 1,
                     "key 'deepseek4.attention.compress_ratios' has type array of f32, expected array of u32");
    tiny_plan(&p);
    plan_kv(&p, K_RATIOS)->type = GGUF_T_U32;
    plan_expect_fail("ratios as scalar", &p, 1,
                     "key 'deepseek4.attention.compress_ratios' has type u32, expected array of u32");
    tiny_plan(&p);
    plan_del_kv(&p, K_RATIOS);
    plan_expect_fail("ratios missing", &p, 1, "missing key 'deepseek4.attention.compress_ratios' (array of u32)");
    tiny_plan(&p);
    plan_kv(&p, K_RATIOS)->arr_type = GGUF_T_I32;
    plan_kv(&p, K_RATIOS)->arr_n = 8;   /* longer than block_count is fine (p.ratios[6..7] == 0) */
    plan_expect_ok("ratios as longer i32 array", &p, m);
    CHECK(m->hp.ratio[4] == 4 && m->hp.ratio[5] == 128, "ratios read from i32 array");
    {   /* no ratio-4 layer: indexer keys may be 0 and indexer tensors are not expected */
        tiny_plan(&p);
        p.ratios[2] = p.ratios[4] = 128;
        p.hp.ratio[2] = p.hp.ratio[4] = 128;
        plan_kv(&p, K_IDX_TOPK)->u = 0;
        for (int il = 2; il <= 4; il += 2) {
            char nm[96];
            for (int id = LT_IDX_PROJ; id <= LT_IDX_COMP_NORM; id++) {
                snprintf(nm, sizeof nm, "blk.%d.%s", il, gguf_layer_specs[id].name);
                plan_del_t(&p, nm);
            }
            snprintf(nm, sizeof nm, "blk.%d.attn_compressor_kv.weight", il);
            plan_t(&p, nm)->ne[1] = 64;
            snprintf(nm, sizeof nm, "blk.%d.attn_compressor_gate.weight", il);
            plan_t(&p, nm)->ne[1] = 64;
            snprintf(nm, sizeof nm, "blk.%d.attn_compressor_ape.weight", il);
            plan_t(&p, nm)->ne[0] = 64;
            plan_t(&p, nm)->ne[1] = 128;
        }
        plan_expect_ok("only ratio-128 layers, top_k 0", &p, m);
        CHECK(m->hp.idx_topk == 0 && m->hp.ratio[2] == 128 && m->layers[2].idx_proj.host == NULL,
              "no-indexer model");
    }

    /* optional keys and their defaults */
    tiny_plan(&p);
    plan_del_kv(&p, K_CLAMP_SHEXP);
    plan_del_kv(&p, K_ROPE_TYPE);
    plan_del_kv(&p, K_ROPE_FACTOR);
    plan_del_kv(&p, K_ROPE_ORIG);
    plan_del_kv(&p, K_ROPE_BASE);
    plan_del_kv(&p, K_VOCAB);
    plan_del_kv(&p, K_HEADS_KV);
    plan_del_kv(&p, K_VAL_LEN);
    plan_del_kv(&p, K_TOK_MODEL);
    plan_del_kv(&p, K_ALIGNMENT);
    plan_expect_ok("optional keys absent", &p, m);
    CHECK(m->hp.rope_yarn == 0 && m->hp.rope_factor == 1.0f && m->hp.rope_orig_ctx == 4096 &&
          m->hp.rope_base == 10000.0f && m->hp.n_vocab == 512 && m->hp.clamp_shexp[2] == 10.0f &&
          m->hp.has_vocab == 0 && m->hp.yarn_beta_fast == 32.0f && m->hp.yarn_beta_slow == 1.0f,
          "defaults of optional keys");

    static float clamps[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    tiny_plan(&p);
    gguf_wkv *kv = plan_kv(&p, K_CLAMP_EXP);
    kv->type = GGUF_T_ARRAY; kv->arr_type = GGUF_T_F32; kv->arr_n = 6; kv->arr = clamps;
    plan_del_kv(&p, K_CLAMP_SHEXP);
    gguf_plan_kv_f32(&p, K_BETA_FAST, 16.0f);
    gguf_plan_kv_f32(&p, K_BETA_SLOW, 2.0f);
    plan_kv(&p, K_ROPE_TYPE)->s = "none";
    plan_expect_ok("per-layer clamps, yarn betas", &p, m);
    CHECK(m->hp.clamp_exp[0] == 1 && m->hp.clamp_exp[5] == 6 && m->hp.clamp_shexp[5] == 6 &&
          m->hp.yarn_beta_fast == 16.0f && m->hp.yarn_beta_slow == 2.0f && m->hp.rope_yarn == 0,
          "per-layer clamp values and optional rope keys");

    /* byte-level BPE vocabularies (tokenizer.ggml.model = gpt2); each case
     * builds the plan afresh (plan_expect_* free it) */
    for (int stage = 0; stage <= 7; stage++) {
        static const char *toks[512], *merges[3] = { "a b", "ab c", "d e" };
        static char names[512][8];
        static int32_t types[512];
        for (int i = 0; i < 512; i++) { snprintf(names[i], sizeof names[i], "t%d", i); toks[i] = names[i]; types[i] = 1; }
        tiny_plan(&p);
        plan_kv(&p, K_TOK_MODEL)->s = stage == 7 ? "llama" : "gpt2";
        if (stage >= 1) gguf_plan_kv_arr(&p, K_TOK_TOKENS, GGUF_T_STRING, stage == 1 ? 511 : 512, toks);
        if (stage >= 3) gguf_plan_kv_arr(&p, K_TOK_MERGES, GGUF_T_STRING, 3, merges);
        if (stage >= 4) {
            gguf_plan_kv_str(&p, K_TOK_PRE, "deepseek-v3");
            gguf_plan_kv_arr(&p, K_TOK_TYPES, stage == 6 ? GGUF_T_U8 : GGUF_T_I32, 512, types);
            gguf_plan_kv_u32(&p, K_TOK_BOS, 0);
            gguf_plan_kv_u32(&p, K_TOK_EOS, stage == 4 ? 512 : 1);
        }
        switch (stage) {
        case 0: plan_expect_fail("gpt2 without tokens", &p, 1, "missing key 'tokenizer.ggml.tokens'"); break;
        case 1: plan_expect_fail("gpt2 token count", &p, 1, "has 511 tokens, expected 512"); break;
        case 2: plan_expect_fail("gpt2 without merges", &p, 1, "missing key 'tokenizer.ggml.merges'"); break;
        case 3: plan_expect_fail("gpt2 without pre", &p, 1, "missing key 'tokenizer.ggml.pre'"); break;
        case 4: plan_expect_fail("gpt2 eos out of range", &p, 1, "tokenizer.ggml.eos_token_id"); break;
        case 5:
            plan_expect_ok("gpt2 vocabulary", &p, m);
            CHECK(m->hp.has_vocab == 1 && m->hp.voc_n_merges == 3 && m->hp.voc_bos == 0 && m->hp.voc_eos == 1 &&
                  !strcmp(m->hp.voc_pre, "deepseek-v3") && m->hp.voc_types != 0, "gpt2 vocabulary keys");
            break;
        case 6: plan_expect_fail("token_type not i32", &p, 1, "tokenizer.ggml.token_type"); break;
        default: plan_expect_fail("unknown tokenizer model", &p, 1, "'llama' is not supported"); break;
        }
    }
    tiny_plan(&p);
    kv = plan_kv(&p, K_CLAMP_SHEXP);
    kv->type = GGUF_T_ARRAY; kv->arr_type = GGUF_T_F32; kv->arr_n = 5; kv->arr = clamps;
    plan_expect_fail("clamp array too short", &p, 1,
                     "key 'deepseek4.swiglu_clamp_shexp' has 5 entries, expected at least 6 (block_count)");
    tiny_plan(&p);
    plan_kv(&p, K_CLAMP_EXP)->type = GGUF_T_U32;
    plan_expect_fail("clamp as u32", &p, 1, "key 'deepseek4.swiglu_clamp_exp' has type u32, expected f32 or array of f32");
    tiny_plan(&p);
    plan_del_kv(&p, K_CLAMP_EXP);
    plan_expect_fail("clamp missing", &p, 1, "missing key 'deepseek4.swiglu_clamp_exp' (f32 or array of f32)");

    static uint32_t ffs[6] = {64, 64, 64, 64, 64, 64};
    tiny_plan(&p);
    kv = plan_kv(&p, K_FF_EXP);
    kv->type = GGUF_T_ARRAY; kv->arr_type = GGUF_T_U32; kv->arr_n = 6; kv->arr = ffs;
    plan_expect_ok("expert width as a per-layer array", &p, m);
    CHECK(m->hp.n_ff_exp == 64, "expert width from array");
    static uint32_t ffs2[6] = {64, 64, 64, 32, 64, 64};
    tiny_plan(&p);
    kv = plan_kv(&p, K_FF_EXP);
    kv->type = GGUF_T_ARRAY; kv->arr_type = GGUF_T_U32; kv->arr_n = 6; kv->arr = ffs2;
    plan_expect_fail("expert width differs per layer", &p, 1, "differs between layers");

    tiny_plan(&p);
    gguf_plan_kv_u32(&p, K_Q_LORA, 64);
    plan_expect_fail("duplicate key (plan)", &p, 1, "duplicate key 'deepseek4.attention.q_lora_rank'");

    /* tensors */
    tiny_plan(&p);
    plan_t(&p, "blk.3.attn_q_b.weight")->ne[1] = 256;
    plan_expect_fail("q_b shape", &p, 1, "tensor 'blk.3.attn_q_b.weight' has shape {64, 256}, expected {64, 512}");
    tiny_plan(&p);
    plan_t(&p, "blk.1.ffn_down_exps.weight")->n_dims = 2;
    plan_expect_fail("exps lost a dim", &p, 1,
                     "tensor 'blk.1.ffn_down_exps.weight' has shape {64, 128}, expected {64, 128, 8}");
    tiny_plan(&p);
    plan_t(&p, "blk.0.attn_norm.weight")->n_dims = 2;      /* {128, 1}: same tensor */
    plan_expect_ok("trailing 1 dimension", &p, m);
    CHECK(m->layers[0].attn_norm.n_dims == 1 && m->layers[0].attn_norm.ne[0] == 128, "n_dims normalised");
    tiny_plan(&p);
    plan_t(&p, "blk.0.attn_norm.weight")->type = DS4_TYPE_F16;
    plan_expect_fail("norm as F16", &p, 1, "tensor 'blk.0.attn_norm.weight' has type F16, expected F32");
    tiny_plan(&p);
    plan_t(&p, "blk.1.ffn_gate_tid2eid.weight")->type = DS4_TYPE_F32;
    plan_expect_fail("tid2eid as F32", &p, 1, "tensor 'blk.1.ffn_gate_tid2eid.weight' has type F32, expected I32");
    tiny_plan(&p);
    plan_t(&p, "token_embd.weight")->type = DS4_TYPE_I32;
    plan_expect_fail("token_embd as I32", &p, 1,
                     "tensor 'token_embd.weight' has type I32, expected F32, F16, BF16, Q8_0, Q2_K, Q4_K or IQ2_XXS");
    tiny_plan(&p);
    plan_t(&p, "blk.4.hc_ffn_fn.weight")->type = DS4_TYPE_Q8_0;
    plan_t(&p, "blk.4.ffn_gate_inp.weight")->type = DS4_TYPE_BF16;
    plan_t(&p, "output_hc_fn.weight")->type = DS4_TYPE_F16;
    plan_expect_ok("mHC / router matrices quantised", &p, m);

    tiny_plan(&p);
    plan_del_t(&p, "blk.2.indexer.proj.weight");
    plan_expect_fail("missing indexer.proj", &p, 1, "missing tensor 'blk.2.indexer.proj.weight'");
    tiny_plan(&p);
    plan_del_t(&p, "output.weight");
    plan_expect_fail("missing output", &p, 1, "missing tensor 'output.weight'");
    tiny_plan(&p);
    plan_del_t(&p, "blk.5.exp_probs_b.bias");
    plan_expect_fail("missing exp_probs_b", &p, 1, "missing tensor 'blk.5.exp_probs_b.bias'");
    tiny_plan(&p);
    plan_add_t(&p, "blk.0.bogus.weight", 1, 4, 1, DS4_TYPE_F32);
    plan_expect_fail("unexpected tensor", &p, 1, "unexpected tensor 'blk.0.bogus.weight'");
    tiny_plan(&p);
    plan_add_t(&p, "blk.6.attn_norm.weight", 1, 128, 1, DS4_TYPE_F32);
    plan_expect_fail("tensor of a 7th block", &p, 1, "unexpected tensor 'blk.6.attn_norm.weight'");
    tiny_plan(&p);
    plan_add_t(&p, "blk.1.indexer.proj.weight", 2, 128, 32, DS4_TYPE_F32);
    plan_expect_fail("indexer on a window-only layer", &p, 1, "unexpected tensor 'blk.1.indexer.proj.weight'");
    tiny_plan(&p);
    int base_tensors = p.n_t;
    plan_add_t(&p, "blk.6.nextn.eh_proj.weight", 2, 256, 128, DS4_TYPE_F32);
    plan_add_t(&p, "blk.6.nextn.enorm.weight", 1, 128, 1, DS4_TYPE_F32);
    plan_add_t(&p, "blk.3.exp_probs_b_vl.bias", 1, 8, 1, DS4_TYPE_F32);
    plan_expect_ok("MTP nextn tensors and vision bias ignored", &p, m);
    CHECK(m->n_tensors == base_tensors, "ignored tensors not counted (n_tensors %d, expected %d)", m->n_tensors, base_tensors);
    {   /* nextn_predict_layers: block 6 is an MTP block; present, it is read whole */
        tiny_plan(&p);
        plan_kv(&p, K_BLOCKS)->u = 7;
        plan_kv(&p, K_RATIOS)->arr_n = 7;   /* p.ratios[6] == 0 */
        gguf_plan_kv_u32(&p, K_NEXTN, 1);
        plan_add_t(&p, "blk.6.nextn.eh_proj.weight", 2, 256, 128, DS4_TYPE_F32);
        plan_add_t(&p, "blk.6.attn_norm.weight", 1, 128, 1, DS4_TYPE_F32);
        plan_expect_fail("an MTP block without its layer", &p, 1, "missing tensor 'blk.6.attn_sinks.weight'");
        tiny_plan(&p);
        plan_kv(&p, K_BLOCKS)->u = 7;
        plan_kv(&p, K_RATIOS)->arr_n = 7;
        gguf_plan_kv_u32(&p, K_NEXTN, 1);     /* declared but the MTP tensors are absent: block 6 is a layer */
        plan_expect_fail("nextn declared, no MTP tensors", &p, 1, "missing tensor 'blk.6.attn_norm.weight'");

        /* tiny+mtp (ds4 synth --mtp): the trunk as tiny's, the block bound, the optional
         * tensors absent; then each way of breaking the block, refused by name */
        size_t tiny_bytes;
        tiny_plan(&p);
        plan_expect_ok("tiny (for its weight bytes)", &p, m);
        tiny_bytes = m->weight_bytes;
        char err[256];
        if (!synth_plan_init(&p, "tiny+mtp", DS4_TYPE_F32, err, sizeof err)) { printf("plan: %s\n", err); exit(2); }
        plan_expect_ok("tiny+mtp", &p, m);   /* frees the plan */
        CHECK(m->hp.n_layer == 6 && m->hp.n_mtp == 1, "tiny+mtp: n_layer %d, n_mtp %d", m->hp.n_layer, m->hp.n_mtp);
        CHECK(m->hp.ratio[6] == 0, "tiny+mtp: the MTP block's ratio %d, expected 0", m->hp.ratio[6]);
        CHECK(m->mtp.eh_proj.host && m->mtp.eh_proj.ne[0] == 256 && m->mtp.eh_proj.ne[1] == 128,
              "tiny+mtp: eh_proj not bound as {256, 128}");
        CHECK(m->mtp.layer.q_b.host && m->mtp.layer.exp_probs_b.host && !m->mtp.layer.tid2eid.host &&
              !m->mtp.layer.comp_kv.host, "tiny+mtp: the block's layer is not a routed window layer");
        CHECK(m->mtp.shared_head_norm.host && !m->mtp.embed_tokens.host && !m->mtp.shared_head_head.host,
              "tiny+mtp: the optional nextn tensors");
        CHECK(m->weight_bytes == tiny_bytes && m->mtp_bytes > 0, "tiny+mtp: weight bytes %zu (tiny %zu), MTP %zu",
              m->weight_bytes, tiny_bytes, m->mtp_bytes);
        const char *gone[] = { "blk.6.nextn.hnorm.weight", "blk.6.nextn.eh_proj.weight", "blk.6.ffn_down_exps.weight",
                               "blk.6.attn_sinks.weight" };
        for (int i = 0; i < 4; i++) {
            synth_plan_init(&p, "tiny+mtp", DS4_TYPE_F32, NULL, 0);
            plan_del_t(&p, gone[i]);
            /* without eh_proj the block is not an MTP block (llama.cpp's probe): block 6 is then a
             * seventh layer, and its nextn tensors are not a layer's */
            char want[128];
            if (i == 1) snprintf(want, sizeof want, "unexpected tensor 'blk.6.nextn.enorm.weight'");
            else snprintf(want, sizeof want, "missing tensor '%s'", gone[i]);
            plan_expect_fail(gone[i], &p, 1, want);
        }
        synth_plan_init(&p, "tiny+mtp", DS4_TYPE_F32, NULL, 0);
        gguf_plan_tensor(&p, "blk.6.nextn.shared_head_head.weight", 2, (const int64_t[4]){ 128, 100, 1, 1 }, DS4_TYPE_F32);
        plan_expect_fail("an optional nextn tensor of the wrong shape", &p, 1,
                         "tensor 'blk.6.nextn.shared_head_head.weight' has shape");
        synth_plan_init(&p, "tiny+mtp", DS4_TYPE_F32, NULL, 0);
        plan_kv(&p, K_NEXTN)->u = 2;
        plan_kv(&p, K_BLOCKS)->u = 8;
        plan_kv(&p, K_RATIOS)->arr_n = 8;
        plan_expect_fail("two MTP blocks", &p, 1, "'deepseek4.nextn_predict_layers' = 2: ds4 reads one MTP block");
    }

    tiny_plan(&p);
    gguf_plan_layout(&p);
    strcpy(p.t[5].name, p.t[4].name);
    plan_expect_fail("duplicate tensor name", &p, 1, "duplicate tensor 'blk.0.attn_q_a_norm.weight'");

    tiny_plan(&p);
    gguf_plan_layout(&p);
    p.t[p.n_t - 1].offset += (uint64_t)1 << 20;
    plan_expect_fail("offset past end", &p, 0, "tensor 'output.weight' data [");
    tiny_plan(&p);
    gguf_plan_layout(&p);
    p.t[7].offset += 4;
    plan_expect_fail("misaligned offset (plan)", &p, 0, "is not a multiple of the alignment 32");
    tiny_plan(&p);
    gguf_plan_layout(&p);
    p.t[7].offset = p.t[6].offset;   /* overlapping tensor data is legal GGUF */
    {
        size_t n;
        uint8_t *img = plan_image(&p, 0, &n);
        expect_ok("overlapping tensor data", img, n, NULL);
        free(img);
        gguf_plan_free(&p);
    }

    /* tid2eid values */
    for (int k = 0; k < 2; k++) {
        tiny_plan(&p);
        size_t n;
        uint8_t *img = plan_image(&p, 1, &n);
        const gguf_wtensor *t = plan_t(&p, "blk.1.ffn_gate_tid2eid.weight");
        synth_put32(img + p.data_start + t->offset + (7 * 2 + 1) * 4, k ? (uint32_t)-1 : 8u);
        expect_fail("tid2eid out of range", img, n,
                    k ? "tensor 'blk.1.ffn_gate_tid2eid.weight' row 7 has expert id -1 (expected 0..7)"
                      : "tensor 'blk.1.ffn_gate_tid2eid.weight' row 7 has expert id 8 (expected 0..7)");
        free(img);
        gguf_plan_free(&p);
    }
    free(m);
}

/* ---- truncations and fuzzing ---- */

static int msg_is_eof(const char *e) {
    return strstr(e, "past end of file") || strstr(e, "impossible") || strstr(e, "too small");
}

static void test_truncation(void) {
    size_t n;
    uint8_t *img = make_synth("tiny", 2, DS4_TYPE_Q8_0, 2, &n);
    gguf_plan p;
    synth_plan_init(&p, "tiny", DS4_TYPE_Q8_0, NULL, 0);
    char err[512];
    long bad = 0, tried = 0;
    for (size_t cut = 0; cut < n; cut += cut < p.data_start + 64 ? 1 : 1 + (size_t)(rnd() % 4096)) {
        tried++;
        int rc = parse_copy(img, cut, scratch_model(), err, sizeof err);
        if (rc == 0 || !msg_is_eof(err)) {
            if (bad++ < 5) printf("  cut at %zu: rc %d \"%s\"\n", cut, rc, err);
        }
    }
    for (size_t cut = n - 40; cut < n; cut++) {
        tried++;
        int rc = parse_copy(img, cut, scratch_model(), err, sizeof err);
        if (rc == 0 || !strstr(err, "extends past end of file")) {
            if (bad++ < 5) printf("  cut at %zu: rc %d \"%s\"\n", cut, rc, err);
        }
    }
    CHECK(bad == 0, "every truncation (%ld cut points, header %llu bytes) fails with an end-of-file message",
          tried, (unsigned long long)p.data_start);
    gguf_plan_free(&p);
    free(img);
}

static void test_fuzz(void) {
    size_t n;
    uint8_t *img = make_synth("tiny", 4, DS4_TYPE_Q8_0, 2, &n);
    uint8_t *work = malloc(n);          /* exact size: ASan catches any over-read */
    memcpy(work, img, n);
    gguf_plan p;
    synth_plan_init(&p, "tiny", DS4_TYPE_Q8_0, NULL, 0);
    size_t hdr = (size_t)p.data_start;
    char err[512];
    int ok = 0, fail = 0, badmsg = 0;

    /* 2000 single-byte corruptions (mostly in the header, where they matter) */
    for (int i = 0; i < 2000; i++) {
        size_t at = (rnd() % 4) ? (size_t)(rnd() % hdr) : (size_t)(rnd() % n);
        uint8_t old = work[at];
        work[at] = (uint8_t)rnd();
        int rc = ds4_gguf_parse(scratch_model(), work, n, err, sizeof err);
        if (rc == 0) ok++;
        else { fail++; badmsg += !err[0] || strchr(err, '\n') != NULL; }
        work[at] = old;
    }
    /* 1000 corruptions of an 8-byte field with boundary values */
    static const uint64_t vals[] = {0, 1, 2, 3, 31, 32, 33, 0x7f, 0xff, 0xffff, 0xffffffffull, 0x100000000ull,
                                    (uint64_t)1 << 62, (uint64_t)INT64_MAX, (uint64_t)INT64_MIN, UINT64_MAX,
                                    UINT64_MAX - 31};
    for (int i = 0; i < 1000; i++) {
        size_t at = (size_t)(rnd() % (hdr - 8));
        uint8_t old[8];
        memcpy(old, work + at, 8);
        uint64_t v = vals[rnd() % (sizeof vals / sizeof vals[0])];
        int w = (rnd() & 1) ? 8 : 4;
        for (int k = 0; k < w; k++) work[at + k] = (uint8_t)(v >> (8 * k));
        int rc = ds4_gguf_parse(scratch_model(), work, n, err, sizeof err);
        if (rc == 0) ok++;
        else { fail++; badmsg += !err[0] || strchr(err, '\n') != NULL; }
        memcpy(work + at, old, 8);
    }
    /* 1000 multi-byte header corruptions */
    for (int i = 0; i < 1000; i++) {
        int k = 1 + (int)(rnd() % 8);
        size_t at[8];
        uint8_t old[8];
        for (int j = 0; j < k; j++) {
            at[j] = (size_t)(rnd() % hdr);
            old[j] = work[at[j]];
            work[at[j]] = (uint8_t)rnd();
        }
        int rc = ds4_gguf_parse(scratch_model(), work, n, err, sizeof err);
        if (rc == 0) ok++;
        else { fail++; badmsg += !err[0] || strchr(err, '\n') != NULL; }
        for (int j = k - 1; j >= 0; j--) work[at[j]] = old[j];
    }
    /* 1000 random truncations, each in an exact-size copy */
    for (int i = 0; i < 1000; i++) {
        size_t cut = (rnd() % 2) ? (size_t)(rnd() % (hdr + 64)) : (size_t)(rnd() % n);
        int rc = parse_copy(work, cut, scratch_model(), err, sizeof err);
        if (rc == 0) ok++;
        else { fail++; badmsg += !err[0] || strchr(err, '\n') != NULL; }
    }
    CHECK(memcmp(work, img, n) == 0, "fuzz restored the image");
    CHECK(badmsg == 0, "fuzz: every failure has a one-line message (%d bad)", badmsg);
    printf("  fuzz: %d parses succeeded, %d failed cleanly, no crash\n", ok, fail);
    CHECK(ok + fail == 5000, "fuzz ran");
    gguf_plan_free(&p);
    free(work);
    free(img);
}

/* ---------------------------------------------------------------------- */

static int bench_fill(const char *cfg, const char *tname, int threads) {
    int wt = strcmp(tname, "f16") == 0 ? DS4_TYPE_F16 : strcmp(tname, "bf16") == 0 ? DS4_TYPE_BF16
           : strcmp(tname, "q8_0") == 0 ? DS4_TYPE_Q8_0 : DS4_TYPE_F32;
    double t0 = now_s();
    size_t n = ds4_synth_size(cfg, wt);
    double t1 = now_s();
    if (!n) { printf("bad config\n"); return 1; }
    uint8_t *buf = malloc(n);
    if (!buf) { printf("cannot allocate %zu bytes\n", n); return 1; }
    char err[512];
    double t2 = now_s();
    int rc = ds4_synth_fill(cfg, 1, wt, buf, n, threads, err, sizeof err);
    double t3 = now_s();
    ds4_model *m = calloc(1, sizeof *m);
    int prc = rc == 0 ? ds4_gguf_parse(m, buf, n, err, sizeof err) : -1;
    double t4 = now_s();
    printf("%s/%s: %zu bytes; size %.3f ms, fill (%d threads) %.2f s, parse %.3f ms, rc %d/%d %s\n", cfg, tname, n,
           (t1 - t0) * 1e3, threads, t3 - t2, (t4 - t3) * 1e3, rc, prc, rc || prc ? err : "");
    if (prc == 0) printf("fingerprint of the first 64 MB: %016llx\n",
                         (unsigned long long)fnv(buf, n < ((size_t)64 << 20) ? n : ((size_t)64 << 20)));
    free(m);
    free(buf);
    return rc || prc;
}

/* ds4_model_prefill_flops against the arithmetic written out from the hyperparameters: the
 * weights' multiply-adds per token (every matrix of the convention, k of E experts; tables,
 * vectors and the head excluded, the head counted once), and the attention's rows at two
 * positions. */
static void test_prefill_flops(void) {
    static const char *cfgs[] = { "tiny", "small-q2" };
    for (int ci = 0; ci < 2; ci++) {
        size_t n;
        uint8_t *img = make_synth(cfgs[ci], 1, DS4_TYPE_F32, 2, &n);
        CHECK(img != NULL, "%s synth", cfgs[ci]);
        if (!img) continue;
        ds4_model *m = calloc(1, sizeof *m);
        m->owned_kind = 2;
        char err[512];
        if (ds4_gguf_parse(m, img, n, err, sizeof err) != 0) { CHECK(0, "%s parses: %s", cfgs[ci], err); free(img); free(m); continue; }
        const ds4_hparams *h = &m->hp;
        const double D = h->n_embd, H = h->n_head, d = h->head_dim, q = h->q_lora, hc = h->n_hc;
        const double Hi = h->idx_heads, di = h->idx_dim, E = h->n_expert, k = h->n_expert_used, F = h->n_ff_exp;
        double per = 0.0;
        for (int il = 0; il < h->n_layer; il++) {
            per += D * q + q * H * d + D * d + H * d * h->o_lora + h->o_groups * (double)h->o_lora * D;
            per += 2.0 * (hc * D) * ((2.0 + hc) * hc);
            if (h->ratio[il]) per += 2.0 * D * (h->ratio[il] == 4 ? 2.0 : 1.0) * d;
            if (h->ratio[il] == 4) per += D * Hi + q * Hi * di + 2.0 * D * 2.0 * di;
            per += D * E + k * 3.0 * D * F + 3.0 * D * F * h->n_expert_shared;
        }
        double a1[2], a2[2], b[2];
        ds4_model_prefill_flops(m, 0, 1, a1);
        ds4_model_prefill_flops(m, 0, 2, a2);
        const double got = (a2[0] - a1[0]) / 2.0;
        CHECK(fabs(got - per) <= 1e-9 * per, "%s: %.0f multiply-adds a token through the weights, expected %.0f",
              cfgs[ci], got, per);
        CHECK(fabs(a1[0] - 2.0 * (per + D * h->n_vocab)) <= 1e-9 * a1[0], "%s: one token with the head", cfgs[ci]);
        CHECK(a1[1] == 4.0 * H * d * h->n_layer, "%s: position 0 sees one row per layer", cfgs[ci]);
        /* position 1000: the window, 1001/128 rows of ratio 128, min(k, 1001/4) picks of ratio 4 and
         * the indexer's scores over 1001/4 rows */
        ds4_model_prefill_flops(m, 1000, 1, b);
        double att = 0.0;
        for (int il = 0; il < h->n_layer; il++) {
            double rows = h->n_swa < 1001 ? h->n_swa : 1001;
            if (h->ratio[il] == 128) rows += 1001 / 128;
            if (h->ratio[il] == 4) { rows += h->idx_topk < 1001 / 4 ? h->idx_topk : 1001 / 4; att += 2.0 * Hi * di * (1001 / 4); }
            att += 4.0 * H * d * rows;
        }
        CHECK(b[1] == att, "%s: attention at position 1000 %.0f, expected %.0f", cfgs[ci], b[1], att);
        free(img);
        free(m);
    }
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "--fill") == 0) return bench_fill(argv[2], argv[3], atoi(argv[4]));
    setvbuf(stdout, NULL, _IONBF, 0);
    test_conversions();
    test_tiny_valid();
    test_prefill_flops();
    test_determinism();
    test_types();
    test_sizes_and_api();
    test_raw();
    test_convention();
    test_truncation();
    test_fuzz();
    free(scratch_model());
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail != 0;
}
