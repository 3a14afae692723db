/*
 * test_gemma4.c - the Gemma 4 text graph against transformers 5.17 fp32 goldens of tiny
 * random-weight checkpoints (tests/golden/gemma4/<variant>, made by
 * tools/make_graph_goldens_gemma4.py): logits of a left-padded batch within 1e-3 relative
 * L2 (f32 cache), identical greedy continuations; batch invariance (alone vs padded batch,
 * 1 vs 2 threads, bitwise); bounded sliding layers (dropping old tokens changes no bit,
 * 8192 generated tokens keep the sliding caches at window + slack); trim and spec rollback
 * exact.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model/model_impl.h"
#include "model_helpers.h"
#include "testutil.h"
#include "tqkv_model.h"

// ---------------------------------------------------------------------------
// goldens
// ---------------------------------------------------------------------------

#define NP 3
#define NG 12

typedef struct {
    char       dir[1024];
    int        vocab;
    int        len[NP];
    int32_t    ids[NP][64];
    int        off[NP];
    int        greedy[NP][NG];
    float     *logits; /* [rows, vocab] */
    tqkv_model *m;
} g4gold;

static void gold_load(const char *variant, g4gold *g) {
    memset(g, 0, sizeof *g);
    char rel[256], p[1200];
    snprintf(rel, sizeof rel, "tests/golden/gemma4/%s", variant);
    snprintf(g->dir, sizeof g->dir, "%s", source_path(rel, p, sizeof p));
    snprintf(p, sizeof p, "%s/golden.json", g->dir);
    char *text = slurp(p, NULL);
    assert_non_null(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    g->vocab = cJSON_GetObjectItem(root, "vocab")->valueint;
    const cJSON *e;
    int i = 0;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(root, "prompts")) {
        const cJSON *v;
        cJSON_ArrayForEach(v, e) g->ids[i][g->len[i]++] = v->valueint;
        i++;
    }
    assert_int_equal(i, NP);
    i = 0;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(root, "logits_offset")) g->off[i++] = e->valueint;
    i = 0;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(root, "greedy")) {
        int k = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, e) if (k < NG) g->greedy[i][k++] = v->valueint;
        i++;
    }
    cJSON_Delete(root);
    size_t bl;
    snprintf(p, sizeof p, "%s/logits.bin", g->dir);
    g->logits = (float *)slurp(p, &bl);
    assert_non_null(g->logits);
    size_t rows = 0;
    for (int k = 0; k < NP; k++) rows += (size_t)g->len[k];
    assert_int_equal(bl, rows * g->vocab * sizeof(float));
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    if (tqkv_model_load(&g->m, g->dir, &lp) != TQKV_OK) fail_msg("load %s: %s", g->dir, tqkv_last_error());
    assert_int_equal(tqkv_model_get_config(g->m)->arch, TQKV_ARCH_GEMMA4);
}

static void gold_free(g4gold *g) {
    free(g->logits);
    tqkv_model_free(g->m);
}

static tqkv_model_state *new_state(const tqkv_model *m, int rows, int threads, int slack,
                                   tqkv_format f) {
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.rows = rows;
    sp.threads = threads;
    sp.window_slack = slack;
    sp.k_format = sp.v_format = f;
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, m, &sp) != TQKV_OK) fail_msg("state: %s", tqkv_last_error());
    return s;
}

#define OK(x)                                                                                     \
    do {                                                                                          \
        if ((x) != TQKV_OK) fail_msg("%s: %s", #x, tqkv_last_error());                            \
    } while (0)

/* Left-padded prefill of the three prompts: logits [NP, n, V]. */
static float *batch_prefill(g4gold *g, tqkv_model_state *s, int *n_out) {
    int n = 0;
    for (int i = 0; i < NP; i++)
        if (g->len[i] > n) n = g->len[i];
    int32_t *tok = calloc((size_t)NP * n, sizeof(int32_t));
    for (int i = 0; i < NP; i++)
        memcpy(tok + (size_t)i * n + (n - g->len[i]), g->ids[i], sizeof(int32_t) * g->len[i]);
    float *lg = malloc(sizeof(float) * (size_t)NP * n * g->vocab);
    OK(tqkv_model_prefill(g->m, s, tok, g->len, n, TQKV_LOGITS_ALL, lg));
    free(tok);
    *n_out = n;
    return lg;
}

// ---------------------------------------------------------------------------
// parity, batch invariance, greedy
// ---------------------------------------------------------------------------

static void test_parity(void **state) {
    const char *variant = *state;
    g4gold g;
    gold_load(variant, &g);
    const int V = g.vocab;
    int n;
    tqkv_model_state *s = new_state(g.m, NP, 1, 32, TQKV_F32);
    float *lg = batch_prefill(&g, s, &n);
    for (int i = 0; i < NP; i++) {
        const float *mine = lg + ((size_t)i * n + (n - g.len[i])) * V;
        double e = rel_l2(mine, g.logits + (size_t)g.off[i] * V, (size_t)g.len[i] * V);
        printf("# %s prompt %d (%d tokens): rel L2 vs transformers %.2e\n", variant, i, g.len[i], e);
        assert_true(e < 1e-3);
        /* alone: bitwise the batch row */
        tqkv_model_state *a = new_state(g.m, 1, 1, 32, TQKV_F32);
        float *la = malloc(sizeof(float) * (size_t)g.len[i] * V);
        OK(tqkv_model_prefill(g.m, a, g.ids[i], NULL, g.len[i], TQKV_LOGITS_ALL, la));
        assert_memory_equal(la, mine, sizeof(float) * (size_t)g.len[i] * V);
        free(la);
        tqkv_model_state_free(a);
    }
    /* threads: bitwise */
    tqkv_model_state *s2 = new_state(g.m, NP, 2, 32, TQKV_F32);
    int n2;
    float *lg2 = batch_prefill(&g, s2, &n2);
    assert_memory_equal(lg, lg2, sizeof(float) * (size_t)NP * n * V);
    free(lg2);

    /* greedy, batched, with and without dropping old sliding tokens (slack 32 / 1) */
    for (int pass = 0; pass < 2; pass++) {
        tqkv_model_state *b = pass ? new_state(g.m, NP, 2, 1, TQKV_F32) : s;
        if (pass) {
            int nn;
            free(batch_prefill(&g, b, &nn));
        }
        int32_t cur[NP];
        for (int i = 0; i < NP; i++) cur[i] = argmax(lg + ((size_t)i * n + n - 1) * V, V);
        float *step = malloc(sizeof(float) * NP * V);
        for (int k = 0; k < NG; k++) {
            for (int i = 0; i < NP; i++)
                if (cur[i] != g.greedy[i][k])
                    fail_msg("%s pass %d prompt %d step %d: token %d, transformers %d", variant,
                             pass, i, k, cur[i], g.greedy[i][k]);
            OK(tqkv_model_decode(g.m, b, cur, step));
            for (int i = 0; i < NP; i++) cur[i] = argmax(step + (size_t)i * V, V);
        }
        free(step);
        if (pass) tqkv_model_state_free(b);
    }
    free(lg);
    tqkv_model_state_free(s);
    tqkv_model_state_free(s2);
    gold_free(&g);
}

// ---------------------------------------------------------------------------
// bounded sliding layers, trim, spec rounds
// ---------------------------------------------------------------------------

static int own_layers(tqkv_model_state *s, const tqkv_model *m, tqkv_batch **out) {
    int k = 0;
    for (int l = 0; l < tqkv_model_get_config(m)->n_layers; l++) {
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (b) out[k++] = b;
    }
    return k;
}

/* 8192 decoded tokens: a state whose sliding layers keep window + 4 tokens matches one that
 * keeps everything (not bitwise: the attention kernels' block grid follows the token index
 * of the tokens held), and its sliding caches stay bounded. */
static void test_long_bounded(void **state) {
    (void)state;
    g4gold g;
    gold_load("base", &g);
    const int V = g.vocab, steps = 8192, slack = 4, window = 8;
    /* RoPE has no position table: this test runs the bounded sliding caches far past the
     * fixture's max_position_embeddings (1024), which the forward otherwise refuses */
    ((tqkv_model_config *)tqkv_model_get_config(g.m))->max_position_embeddings = 2 * steps;
    tqkv_model_state *a = new_state(g.m, 1, 1, slack, TQKV_F32);
    tqkv_model_state *ref = new_state(g.m, 1, 1, 16384, TQKV_F32);
    float *la = malloc(sizeof(float) * V), *lr = malloc(sizeof(float) * V);
    OK(tqkv_model_prefill(g.m, a, g.ids[0], NULL, g.len[0], TQKV_LOGITS_LAST, la));
    OK(tqkv_model_prefill(g.m, ref, g.ids[0], NULL, g.len[0], TQKV_LOGITS_LAST, lr));
    assert_memory_equal(la, lr, sizeof(float) * V);
    test_rng rng;
    rng_init(&rng, test_seed());
    tqkv_batch *bl[64];
    int nb = own_layers(a, g.m, bl);
    size_t max_sliding = 0;
    double max_err = 0;
    for (int k = 0; k < steps; k++) {
        int32_t t = rng_int(&rng, 2, V - 1);
        OK(tqkv_model_decode(g.m, a, &t, la));
        OK(tqkv_model_decode(g.m, ref, &t, lr));
        double e = rel_l2(la, lr, V);
        if (e > max_err) max_err = e;
        if (e > 1e-5) fail_msg("step %d: rel L2 %.2e from the unbounded state", k, e);
        for (int i = 0; i < nb; i++) {
            int off;
            OK(tqkv_batch_offsets(bl[i], &off, NULL));
            if (off <= window + slack) { /* sliding layer */
                size_t u = tqkv_batch_bytes_used(bl[i]);
                if (u > max_sliding) max_sliding = u;
                assert_true(tqkv_batch_columns(bl[i]) <= 2 * (window + slack) + 2);
            }
        }
    }
    int pos;
    OK(tqkv_model_state_offsets(a, &pos));
    assert_int_equal(pos, g.len[0] + steps);
    int sliding = 0, full = 0;
    for (int i = 0; i < nb; i++) {
        int off;
        OK(tqkv_batch_offsets(bl[i], &off, NULL));
        if (off == window + slack) sliding++;
        if (off == pos) full++;
    }
    assert_int_equal(sliding + full, nb);
    assert_true(sliding >= 1 && full >= 1);
    printf("# %d tokens: sliding layers hold %d tokens (%zu bytes max), full layers %d; "
           "max rel L2 vs unbounded %.2e\n", pos, window + slack, max_sliding, pos, max_err);
    free(la);
    free(lr);
    tqkv_model_state_free(a);
    tqkv_model_state_free(ref);
    gold_free(&g);
}

/* Decode, trim 3 on every layer with a cache, decode the same 3 tokens: same bits. */
static void test_trim_exact(void **state) {
    (void)state;
    g4gold g;
    gold_load("base", &g);
    const int V = g.vocab;
    tqkv_model_state *s = new_state(g.m, 2, 1, 4, TQKV_F32);
    int32_t tok[2 * 22];
    int lens[2] = {g.len[0], g.len[1]};
    int n = g.len[0];
    memset(tok, 0, sizeof tok);
    memcpy(tok, g.ids[0], sizeof(int32_t) * n);
    memcpy(tok + n + (n - g.len[1]), g.ids[1], sizeof(int32_t) * g.len[1]);
    OK(tqkv_model_prefill(g.m, s, tok, lens, n, TQKV_LOGITS_NONE, NULL));
    test_rng rng;
    rng_init(&rng, test_seed());
    int32_t seq[40][2];
    float *lg = malloc(sizeof(float) * 40 * 2 * V), *l2 = malloc(sizeof(float) * 2 * V);
    for (int k = 0; k < 40; k++) {
        seq[k][0] = rng_int(&rng, 2, V - 1);
        seq[k][1] = rng_int(&rng, 2, V - 1);
        OK(tqkv_model_decode(g.m, s, seq[k], lg + (size_t)k * 2 * V));
    }
    tqkv_batch *bl[64];
    int nb = own_layers(s, g.m, bl);
    for (int i = 0; i < nb; i++) OK(tqkv_batch_trim(bl[i], 3));
    for (int k = 37; k < 40; k++) {
        OK(tqkv_model_decode(g.m, s, seq[k], l2));
        assert_memory_equal(l2, lg + (size_t)k * 2 * V, sizeof(float) * 2 * V);
    }
    free(lg);
    free(l2);
    tqkv_model_state_free(s);
    gold_free(&g);
}

/* A spec round whose drafts are all rejected leaves the state as if never drafted; one
 * that keeps 2 continues like a state that appended those 2 without a round. */
static void test_spec_rollback(void **state) {
    (void)state;
    g4gold g;
    gold_load("keqv_cap", &g);
    const int V = g.vocab;
    test_rng rng;
    rng_init(&rng, test_seed());
    int32_t seq[24];
    for (int k = 0; k < 24; k++) seq[k] = rng_int(&rng, 2, V - 1);
    float *ref = malloc(sizeof(float) * 24 * V), *lg = malloc(sizeof(float) * 4 * V);
    /* reference: prefill + 24 decodes (slack 2: sliding layers drop as they go) */
    tqkv_model_state *a = new_state(g.m, 1, 1, 2, TQKV_F32);
    OK(tqkv_model_prefill(g.m, a, g.ids[0], NULL, g.len[0], TQKV_LOGITS_NONE, NULL));
    for (int k = 0; k < 24; k++) OK(tqkv_model_decode(g.m, a, &seq[k], ref + (size_t)k * V));
    tqkv_model_state *b = new_state(g.m, 1, 1, 2, TQKV_F32);
    OK(tqkv_model_prefill(g.m, b, g.ids[0], NULL, g.len[0], TQKV_LOGITS_NONE, NULL));
    tqkv_batch *bl[64];
    int nb = own_layers(b, g.m, bl);
    for (int k = 0; k < 24; k++) {
        if (k % 3 == 0) { /* a rejected round of 2 drafts */
            for (int i = 0; i < nb; i++) OK(tqkv_batch_spec_begin(bl[i]));
            int32_t d[2] = {rng_int(&rng, 2, V - 1), rng_int(&rng, 2, V - 1)};
            OK(tqkv_model_extend(g.m, b, d, 2, TQKV_LOGITS_ALL, lg));
            int keep = 0;
            for (int i = 0; i < nb; i++) OK(tqkv_batch_spec_rollback(bl[i], &keep, 1));
        }
        OK(tqkv_model_decode(g.m, b, &seq[k], lg));
        if (memcmp(lg, ref + (size_t)k * V, sizeof(float) * V))
            fail_msg("step %d: logits after a rejected round differ from never drafting", k);
    }
    /* accepted: extend [x, y, z] in a round keeping 2 vs extend [x, y] with no round */
    tqkv_model_state *c = new_state(g.m, 1, 1, 2, TQKV_F32);
    tqkv_model_state *d = new_state(g.m, 1, 1, 2, TQKV_F32);
    OK(tqkv_model_prefill(g.m, c, g.ids[1], NULL, g.len[1], TQKV_LOGITS_NONE, NULL));
    OK(tqkv_model_prefill(g.m, d, g.ids[1], NULL, g.len[1], TQKV_LOGITS_NONE, NULL));
    int nc = own_layers(c, g.m, bl);
    for (int i = 0; i < nc; i++) OK(tqkv_batch_spec_begin(bl[i]));
    int32_t x[3] = {seq[0], seq[1], seq[2]};
    OK(tqkv_model_extend(g.m, c, x, 3, TQKV_LOGITS_ALL, lg));
    int keep = 2;
    for (int i = 0; i < nc; i++) OK(tqkv_batch_spec_rollback(bl[i], &keep, 1));
    OK(tqkv_model_extend(g.m, d, x, 2, TQKV_LOGITS_ALL, ref));
    assert_true(rel_l2(lg, ref, 2 * (size_t)V) < 1e-5);
    for (int k = 3; k < 20; k++) {
        OK(tqkv_model_decode(g.m, c, &seq[k], lg));
        OK(tqkv_model_decode(g.m, d, &seq[k], ref));
        double e = rel_l2(lg, ref, V);
        if (e > 1e-5) fail_msg("step %d: accepted round vs plain extend rel L2 %.2e", k, e);
    }
    int oc, od;
    OK(tqkv_model_state_offsets(c, &oc));
    OK(tqkv_model_state_offsets(d, &od));
    assert_int_equal(oc, od);
    free(ref);
    free(lg);
    tqkv_model_state_free(a);
    tqkv_model_state_free(b);
    tqkv_model_state_free(c);
    tqkv_model_state_free(d);
    gold_free(&g);
}

/* tq4 cache: KV-shared layers read their donor's compressed rows; logits stay close. */
static void test_tq4_close(void **state) {
    (void)state;
    g4gold g;
    gold_load("base", &g);
    int n;
    tqkv_model_state *s = new_state(g.m, NP, 1, 32, TQKV_TQ4);
    float *lg = batch_prefill(&g, s, &n);
    for (int i = 0; i < NP; i++) {
        const float *mine = lg + ((size_t)i * n + (n - g.len[i])) * g.vocab;
        double e = rel_l2(mine, g.logits + (size_t)g.off[i] * g.vocab, (size_t)g.len[i] * g.vocab);
        printf("# tq4 prompt %d: rel L2 vs transformers f32 %.3f\n", i, e);
        assert_true(e > 0 && e < 0.5);
    }
    /* shared layers have no cache of their own */
    const tqkv_model_config *c = tqkv_model_get_config(g.m);
    assert_null(tqkv_model_state_layer(s, c->n_layers - 1));
    assert_non_null(tqkv_model_state_layer(s, 0));
    free(lg);
    tqkv_model_state_free(s);
    gold_free(&g);
}


// ---------------------------------------------------------------------------
// tqkv_batch_drop_oldest at the cache level (tq4 + q8 ring: the ring is re-indexed)
// ---------------------------------------------------------------------------

/* Rows' newest `keep` tokens of a (tokens held) vs b: decoded values bitwise equal. */
static void same_tail(const tqkv_batch *a, const tqkv_batch *b) {
    const tqkv_cache_config *c = tqkv_batch_get_config(a);
    int R = tqkv_batch_rows(a), ca = tqkv_batch_columns(a), cb = tqkv_batch_columns(b);
    size_t H = (size_t)c->kv_heads, d = (size_t)c->head_dim;
    float *ka = calloc((size_t)R * H * ca * d, 4), *va = calloc((size_t)R * H * ca * d, 4);
    float *kb = calloc((size_t)R * H * cb * d, 4), *vb = calloc((size_t)R * H * cb * d, 4);
    int oa[8], pa[8], ob[8], pb[8];
    OK(tqkv_batch_capture(a, ka, va, oa, pa));
    OK(tqkv_batch_capture(b, kb, vb, ob, pb));
    for (int r = 0; r < R; r++) {
        assert_true(ob[r] <= oa[r]);
        for (size_t h = 0; h < H; h++) {
            size_t ia = ((r * H + h) * ca + (size_t)(pa[r] + oa[r] - ob[r])) * d;
            size_t ib = ((r * H + h) * cb + (size_t)pb[r]) * d;
            assert_memory_equal(ka + ia, kb + ib, sizeof(float) * ob[r] * d);
            assert_memory_equal(va + ia, vb + ib, sizeof(float) * ob[r] * d);
        }
    }
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

static void test_drop_oldest_rows(void **state) {
    (void)state;
    test_rng rng;
    rng_init(&rng, test_seed());
    tqkv_cache_config cc = tqkv_cache_config_default();
    cc.kv_heads = 2;
    cc.head_dim = 64;
    cc.k_format = cc.v_format = TQKV_TQ4;
    cc.window = 5;
    cc.window_slack = 3;
    const int R = 2, keep = 7, lens[2] = {13, 4};
    tqkv_batch *a, *b;
    OK(tqkv_batch_init(&a, &cc, R));
    OK(tqkv_batch_init(&b, &cc, R));
    size_t per = (size_t)R * 2 * 64;
    float *k = malloc(sizeof(float) * per * 13), *v = malloc(sizeof(float) * per * 13);
    rng_fill_normal(&rng, k, per * 13, 1.0f);
    rng_fill_normal(&rng, v, per * 13, 1.0f);
    OK(tqkv_batch_prepare_prefill(a, lens));
    OK(tqkv_batch_append(a, k, v, 13));
    OK(tqkv_batch_finalize_prefill(a));
    OK(tqkv_batch_prepare_prefill(b, lens));
    OK(tqkv_batch_append(b, k, v, 13));
    OK(tqkv_batch_finalize_prefill(b));
    OK(tqkv_batch_drop_oldest(b, keep));
    same_tail(a, b);
    for (int step = 0; step < 40; step++) {
        int n = 1 + step % 3;
        rng_fill_normal(&rng, k, per * n, 1.0f);
        rng_fill_normal(&rng, v, per * n, 1.0f);
        OK(tqkv_batch_append(a, k, v, n));
        OK(tqkv_batch_append(b, k, v, n));
        same_tail(a, b);
        OK(tqkv_batch_drop_oldest(b, keep));
        same_tail(a, b);
        int ob[2];
        OK(tqkv_batch_offsets(b, ob, NULL));
        assert_true(ob[0] <= keep && ob[1] <= keep);
        assert_true(tqkv_batch_columns(b) <= 2 * keep + 3);
    }
    /* a spec round refuses dropping; rows survive export/restore and merge */
    OK(tqkv_batch_spec_begin(b));
    assert_int_equal(tqkv_batch_drop_oldest(b, keep), TQKV_ESTATE);
    OK(tqkv_batch_spec_commit(b));
    uint8_t *buf;
    size_t len;
    OK(tqkv_batch_export(b, &buf, &len));
    tqkv_batch *c;
    OK(tqkv_batch_restore(&c, buf, len));
    free(buf);
    same_tail(b, c);
    same_tail(a, c);
    tqkv_cache_ref items[2] = {{b, NULL}, {a, NULL}};
    tqkv_batch *m;
    OK(tqkv_batch_merge(&m, items, 2));
    int keep_rows[2] = {0, 1};
    OK(tqkv_batch_filter(m, keep_rows, 2)); /* rows 0..1 of the merge = b's rows */
    same_tail(a, m);
    tqkv_batch_free(m);
    tqkv_batch_free(c);
    tqkv_batch_free(a);
    tqkv_batch_free(b);
    free(k);
    free(v);
}

// ---------------------------------------------------------------------------
// config: what the graph does not run is refused with a clear status
// ---------------------------------------------------------------------------

static tqkv_status parse_edited(const char *text, const char *from, const char *to) {
    const char *at = strstr(text, from);
    assert_non_null(at);
    size_t n = strlen(text) + strlen(to) + 1;
    char *buf = malloc(n);
    size_t pre = (size_t)(at - text);
    memcpy(buf, text, pre);
    strcpy(buf + pre, to);
    strcat(buf, at + strlen(from));
    tqkv_model_config c;
    tqkv_status rc = model_config_parse(buf, strlen(buf), "config.json", &c);
    if (rc == TQKV_OK) assert_int_equal(c.arch, TQKV_ARCH_GEMMA4);
    free(buf);
    return rc;
}

static void test_config_refusals(void **state) {
    (void)state;
    char p[1200];
    char *text = slurp(source_path("tests/golden/gemma4/keqv_cap/config.json", p, sizeof p), NULL);
    assert_non_null(text);
    assert_int_equal(parse_edited(text, "\"vocab_size\"", "\"vocab_size\""), TQKV_OK);
    /* the MoE block needs its sizes (test_moe runs it) */
    assert_int_equal(parse_edited(text, "\"enable_moe_block\": false", "\"enable_moe_block\": true"),
                     TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "num_experts"));
    assert_int_equal(parse_edited(text, "\"gelu_pytorch_tanh\"", "\"silu\""), TQKV_EUNSUPPORTED);
    assert_int_equal(parse_edited(text, "\"num_kv_shared_layers\": 2", "\"num_kv_shared_layers\": 6"),
                     TQKV_ECORRUPT);
    assert_int_equal(parse_edited(text, "\"head_dim\": 64", "\"head_dim\": 48"), TQKV_EUNSUPPORTED);
    assert_int_equal(parse_edited(text, "\"proportional\"", "\"yarn\""), TQKV_EUNSUPPORTED);
    assert_int_equal(parse_edited(text, "\"use_double_wide_mlp\": false", "\"use_double_wide_mlp\": true"),
                     TQKV_EUNSUPPORTED);
    /* a shared layer with no earlier layer of its type to read */
    assert_int_equal(parse_edited(text, "\"sliding_attention\",\n    \"sliding_attention\",",
                                  "\"full_attention\",\n    \"full_attention\","),
                     TQKV_ECORRUPT);
    free(text);
}

int main(void) {
    test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(test_parity, "base"),
        cmocka_unit_test_prestate(test_parity, "keqv_cap"),
        cmocka_unit_test_prestate(test_parity, "plain"),
        cmocka_unit_test(test_config_refusals),
        cmocka_unit_test(test_tq4_close),
        cmocka_unit_test(test_drop_oldest_rows),
        cmocka_unit_test(test_trim_exact),
        cmocka_unit_test(test_spec_rollback),
        cmocka_unit_test(test_long_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
