/*
 * test_qwen35.c - the Qwen 3.5 hybrid graph and the MiniCPM5-shaped Llama against
 * transformers 5.17 fp32 goldens of tiny random-weight checkpoints (tests/golden/qwen35,
 * made by tools/make_graph_goldens_qwen35.py), and the row semantics of the recurrent
 * state rows: left-padded batch, batch / thread invariance (bitwise), merge / filter mid
 * generation, spec rounds with rollback, state export / restore.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "model/model_impl.h"
#include "model/state/recurrent.h"
#include "graph_golden.h"
#include "model_helpers.h"
#include "testutil.h"
#include "tqkv_model.h"
#include "util/common.h"

static void test_hybrid_parity(void **st) {
    (void)st;
    check_parity("qwen35", "hybrid");
}
static void test_hybrid_decode_greedy(void **st) {
    (void)st;
    check_decode_greedy("qwen35", "hybrid");
}
static void test_minicpm5_parity(void **st) {
    (void)st;
    check_parity("qwen35", "minicpm5");
}
static void test_minicpm5_decode_greedy(void **st) {
    (void)st;
    check_decode_greedy("qwen35", "minicpm5");
}

/* MiniCPM5 shape on a tq4 cache, where the deferred set really differs from the dense one
 * (attention on rotated K/V, one un-rotation per output): the deferred set (the graph's
 * default) equals the dense set within float rounding over the same encoded rows, prefill
 * (all positions of the left-padded batch) and decode, and stays near transformers. */
static void test_minicpm5_deferred_tq4(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "minicpm5");
    tqkv_model *m = load_model(&g);
    const int V = g.vocab, R = g.n_prompts;
    int nmax = 0, lens[4];
    for (int i = 0; i < R; i++) nmax = g.n[i] > nmax ? g.n[i] : nmax;
    int32_t *tok = calloc((size_t)R * nmax, sizeof(int32_t));
    for (int r = 0; r < R; r++) {
        lens[r] = g.n[r];
        memcpy(tok + (size_t)r * nmax + (nmax - g.n[r]), g.ids[r], sizeof(int32_t) * g.n[r]);
    }
    float *out[2];
    for (int set = 0; set < 2; set++) {
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.rows = R;
        sp.threads = 2;
        sp.k_format = sp.v_format = TQKV_TQ4;
        if (set == 1) sp.prefill_kernel = sp.decode_kernel = TQKV_KERNEL_DENSE; /* override */
        tqkv_model_state *s = NULL;
        assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
        assert_int_equal(s->p.prefill_kernel, set == 0 ? TQKV_KERNEL_DEFERRED : TQKV_KERNEL_DENSE);
        out[set] = malloc(sizeof(float) * ((size_t)R * nmax * V + (size_t)8 * R * V));
        assert_int_equal(tqkv_model_prefill(m, s, tok, lens, nmax, TQKV_LOGITS_ALL, out[set]), TQKV_OK);
        for (int k = 0; k < 8; k++) {
            int32_t t[4] = {3 + k, 5 + k, 7 + k, 0};
            assert_int_equal(tqkv_model_decode(m, s, t, out[set] + (size_t)R * nmax * V + (size_t)k * R * V),
                             TQKV_OK);
        }
        tqkv_model_state_free(s);
    }
    double dd = rel_l2(out[0], out[1], (size_t)R * nmax * V + (size_t)8 * R * V), worst = 0;
    for (int r = 0; r < R; r++) {
        double e = rel_l2(out[0] + ((size_t)r * nmax + nmax - g.n[r]) * V,
                          g.logits + (size_t)g.first[r] * V, (size_t)g.n[r] * V);
        worst = e > worst ? e : worst;
    }
    printf("minicpm5 tq4: deferred vs dense set rel L2 %.2e; deferred vs HF (f32 KV) %.2e\n", dd, worst);
    assert_true(dd < 1e-4);
    assert_true(worst < 0.1);
    free(out[0]);
    free(out[1]);
    free(tok);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Kernel sets by graph: the table's choice, and the override. */
static void test_kernel_sets(void **st) {
    (void)st;
    const char *variants[2] = {"hybrid", "minicpm5"}, *want[2] = {"dense", "deferred"};
    for (int i = 0; i < 2; i++) {
        golden g;
        golden_load(&g, "qwen35", variants[i]);
        tqkv_model *m = load_model(&g);
        const char *name = NULL;
        tqkv_kernel kp, kd;
        assert_int_equal(tqkv_model_kernel_set(m, &name, &kp, &kd), TQKV_OK);
        assert_string_equal(name, want[i]);
        assert_int_equal(kp, i == 0 ? TQKV_KERNEL_DENSE : TQKV_KERNEL_DEFERRED);
        assert_int_equal(kd, i == 0 ? TQKV_KERNEL_DENSE : TQKV_KERNEL_FUSED);
        tqkv_model_state *s = new_state(m, 1, 1);
        assert_int_equal(s->p.prefill_kernel, kp);
        assert_int_equal(s->p.decode_kernel, kd);
        tqkv_model_state_free(s);
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.prefill_kernel = TQKV_KERNEL_FUSED;
        sp.decode_kernel = TQKV_KERNEL_DEFERRED;
        assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
        assert_int_equal(s->p.prefill_kernel, TQKV_KERNEL_FUSED);
        assert_int_equal(s->p.decode_kernel, TQKV_KERNEL_DEFERRED);
        tqkv_model_state_free(s);
        tqkv_model_free(m);
        golden_free(&g);
    }
}

// ---------------------------------------------------------------------------
// row semantics of the recurrent rows (hybrid)
// ---------------------------------------------------------------------------

/* Replace a state's rows by (layers, rec) holding `rows` rows (what a scheduler does). */
static void state_adopt(tqkv_model_state *s, tqkv_batch **layers, model_recurrent *rec, int rows) {
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        tqkv_batch_free(s->layers[l]);
        s->layers[l] = layers[l];
    }
    rec_free(s->rec);
    s->rec = rec;
    s->rows = rows;
    s->p.rows = rows;
    s->off = realloc(s->off, sizeof(int) * (size_t)rows);
    s->len = realloc(s->len, sizeof(int) * (size_t)rows);
}

/* Two rows generated alone vs merged into one batch mid-generation, then filtered back to
 * one row: every step's logits bitwise equal. Then export / restore mid-generation. */
static void test_hybrid_merge_filter_export(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    tqkv_model *m = load_model(&g);
    const int V = g.vocab, L = m->cfg.n_layers, steps = 6;
    /* reference: each prompt alone, prefill then `2 * steps` greedy decode steps */
    float *ref = malloc(sizeof(float) * 2 * (2 * steps + 1) * V), *lg = malloc(sizeof(float) * 2 * V);
    int32_t toks[2][32];
    for (int r = 0; r < 2; r++) {
        tqkv_model_state *s = new_state(m, 1, 1);
        float *o = ref + (size_t)r * (2 * steps + 1) * V;
        assert_int_equal(tqkv_model_prefill(m, s, g.ids[r + 1], NULL, g.n[r + 1], TQKV_LOGITS_LAST, o),
                         TQKV_OK);
        for (int k = 0; k < 2 * steps; k++) {
            toks[r][k] = argmax(o + (size_t)k * V, V);
            assert_int_equal(tqkv_model_decode(m, s, &toks[r][k], o + (size_t)(k + 1) * V), TQKV_OK);
        }
        tqkv_model_state_free(s);
    }
    /* alone for `steps`, then merge into one 2-row state */
    tqkv_model_state *a[2];
    for (int r = 0; r < 2; r++) {
        a[r] = new_state(m, 1, 2);
        assert_int_equal(tqkv_model_prefill(m, a[r], g.ids[r + 1], NULL, g.n[r + 1], TQKV_LOGITS_LAST, lg),
                         TQKV_OK);
        for (int k = 0; k < steps; k++) assert_int_equal(tqkv_model_decode(m, a[r], &toks[r][k], lg), TQKV_OK);
    }
    tqkv_model_state *b = new_state(m, 2, 2);
    tqkv_batch **layers = calloc((size_t)L, sizeof *layers);
    for (int l = 0; l < L; l++) {
        if (!a[0]->layers[l]) continue;
        tqkv_cache_ref items[2] = {{a[0]->layers[l], NULL}, {a[1]->layers[l], NULL}};
        assert_int_equal(tqkv_batch_merge(&layers[l], items, 2), TQKV_OK);
    }
    model_recurrent *rec = NULL, *ri[2] = {a[0]->rec, a[1]->rec};
    int rows0[2] = {0, 0};
    assert_int_equal(rec_merge(&rec, ri, rows0, 2), TQKV_OK);
    state_adopt(b, layers, rec, 2);
    free(layers);
    for (int k = steps; k < 2 * steps - 2; k++) {
        int32_t t2[2] = {toks[0][k], toks[1][k]};
        assert_int_equal(tqkv_model_decode(m, b, t2, lg), TQKV_OK);
        for (int r = 0; r < 2; r++)
            assert_memory_equal(lg + (size_t)r * V, ref + ((size_t)r * (2 * steps + 1) + k + 1) * V,
                                sizeof(float) * V);
    }
    /* filter: keep row 1 only */
    int keep[1] = {1};
    for (int l = 0; l < L; l++)
        if (b->layers[l]) assert_int_equal(tqkv_batch_filter(b->layers[l], keep, 1), TQKV_OK);
    assert_int_equal(rec_filter(b->rec, keep, 1), TQKV_OK);
    b->rows = b->p.rows = 1;
    int k = 2 * steps - 2;
    assert_int_equal(tqkv_model_decode(m, b, &toks[1][k], lg), TQKV_OK);
    assert_memory_equal(lg, ref + ((size_t)1 * (2 * steps + 1) + k + 1) * V, sizeof(float) * V);
    /* export / restore of the KV rows and the recurrent rows, then the last step */
    tqkv_model_state *c = new_state(m, 1, 1);
    tqkv_batch **rl = calloc((size_t)L, sizeof *rl);
    for (int l = 0; l < L; l++) {
        if (!b->layers[l]) continue;
        uint8_t *buf = NULL;
        size_t len = 0;
        assert_int_equal(tqkv_batch_export(b->layers[l], &buf, &len), TQKV_OK);
        assert_int_equal(tqkv_batch_restore(&rl[l], buf, len), TQKV_OK);
        free(buf);
    }
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(rec_export(b->rec, &buf, &len), TQKV_OK);
    model_recurrent *rr = NULL;
    buf[len / 2] ^= 1; /* a flipped bit is refused */
    assert_int_equal(rec_restore(&rr, &m->cfg, buf, len), TQKV_ECORRUPT);
    buf[len / 2] ^= 1;
    assert_int_equal(rec_restore(&rr, &m->cfg, buf, len), TQKV_OK);
    free(buf);
    state_adopt(c, rl, rr, 1);
    free(rl);
    k = 2 * steps - 1;
    assert_int_equal(tqkv_model_decode(m, c, &toks[1][k], lg), TQKV_OK);
    assert_memory_equal(lg, ref + ((size_t)1 * (2 * steps + 1) + k + 1) * V, sizeof(float) * V);
    /* bytes: fixed per-row state plus KV of the full layers only */
    size_t fixed = tqkv_model_state_row_fixed_bytes(c);
    size_t conv = (size_t)(2 * 2 * 32 + 4 * 48) * 3, ssm = (size_t)4 * 32 * 48;
    assert_int_equal(fixed, 2 * (conv + ssm) * sizeof(float));
    assert_true(tqkv_model_state_kv_bytes_per_token(c) == 2.0 * 2 * 2 * 64 * 4); /* f32 K+V, 2 full layers */
    for (int r = 0; r < 2; r++) tqkv_model_state_free(a[r]);
    tqkv_model_state_free(b);
    tqkv_model_state_free(c);
    free(ref);
    free(lg);
    tqkv_model_free(m);
    golden_free(&g);
}

/* recurrent.c row operations on random bytes: select / concat / merge / extract / filter
 * move each row's bytes and token count unchanged; bad indices and shapes are refused;
 * export / restore round-trips and refuses corruption and another model's shape. */
static void test_recurrent_rows(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    tqkv_model *m = load_model(&g);
    test_rng rng;
    rng_init(&rng, test_seed());
    model_recurrent *a = NULL, *b = NULL, *o = NULL;
    assert_int_equal(rec_init(&a, &m->cfg, 3), TQKV_OK);
    assert_int_equal(rec_init(&b, &m->cfg, 2), TQKV_OK);
    rng_fill_normal(&rng, a->state, 3 * a->row_floats, 1.0f);
    rng_fill_normal(&rng, b->state, 2 * b->row_floats, 1.0f);
    for (int r = 0; r < 3; r++) a->tokens[r] = rng_int(&rng, 1, 1000);
    for (int r = 0; r < 2; r++) b->tokens[r] = rng_int(&rng, 1, 1000);
    const size_t rb = a->row_floats * sizeof(float);
#define ROW(x, r) ((x)->state + (size_t)(r) * (x)->row_floats)
    int keep[3] = {2, 0, 1};
    assert_int_equal(rec_select(a, keep, 2, &o), TQKV_OK);
    assert_int_equal(o->rows, 2);
    assert_memory_equal(ROW(o, 0), ROW(a, 2), rb);
    assert_memory_equal(ROW(o, 1), ROW(a, 0), rb);
    assert_int_equal(o->tokens[0], a->tokens[2]);
    rec_free(o);
    model_recurrent *items[2] = {a, b};
    assert_int_equal(rec_concat(&o, items, 2), TQKV_OK);
    assert_int_equal(o->rows, 5);
    assert_memory_equal(ROW(o, 3), ROW(b, 0), rb);
    assert_int_equal(o->tokens[4], b->tokens[1]);
    /* filter in place, then merge rows of two objects, then extract */
    int fk[2] = {4, 1};
    assert_int_equal(rec_filter(o, fk, 2), TQKV_OK);
    assert_memory_equal(ROW(o, 0), ROW(b, 1), rb);
    assert_memory_equal(ROW(o, 1), ROW(a, 1), rb);
    model_recurrent *mi[2] = {o, a}, *mm = NULL, *ex = NULL;
    int mr[2] = {1, 2};
    assert_int_equal(rec_merge(&mm, mi, mr, 2), TQKV_OK);
    assert_memory_equal(ROW(mm, 0), ROW(a, 1), rb);
    assert_memory_equal(ROW(mm, 1), ROW(a, 2), rb);
    assert_int_equal(rec_extract(mm, 1, &ex), TQKV_OK);
    assert_memory_equal(ROW(ex, 0), ROW(a, 2), rb);
    assert_int_equal(ex->tokens[0], a->tokens[2]);
    /* refusals leave the object unchanged */
    int dup[2] = {0, 0}, oob[1] = {5};
    assert_int_equal(rec_filter(mm, dup, 2), TQKV_EINVAL);
    assert_int_equal(rec_filter(mm, oob, 1), TQKV_ERANGE);
    assert_int_equal(mm->rows, 2);
    assert_int_equal(rec_extract(mm, 2, &ex), TQKV_ERANGE);
    /* export / restore */
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(rec_export(a, &buf, &len), TQKV_OK);
    model_recurrent *rr = NULL;
    assert_int_equal(rec_restore(&rr, &m->cfg, buf, len), TQKV_OK);
    assert_int_equal(rr->rows, 3);
    assert_memory_equal(rr->state, a->state, 3 * rb);
    assert_memory_equal(rr->tokens, a->tokens, 3 * sizeof(int));
    rec_free(rr);
    rr = NULL;
    assert_int_equal(rec_restore(&rr, &m->cfg, buf, len - 1), TQKV_ECORRUPT);
    size_t at = (size_t)rng_int(&rng, 0, (int)len - 1);
    buf[at] ^= 0x10;
    assert_int_equal(rec_restore(&rr, &m->cfg, buf, len), TQKV_ECORRUPT);
    buf[at] ^= 0x10;
    tqkv_model_config other = m->cfg;
    other.lin_v_dim = 64;
    assert_int_equal(rec_restore(&rr, &other, buf, len), TQKV_ECORRUPT);
    assert_null(rr);
    free(buf);
#undef ROW
    rec_free(a);
    rec_free(b);
    rec_free(o);
    rec_free(mm);
    rec_free(ex);
    tqkv_model_free(m);
    golden_free(&g);
}

static void spec_begin(tqkv_model_state *s) {
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) assert_int_equal(tqkv_batch_spec_begin(s->layers[l]), TQKV_OK);
    assert_int_equal(rec_spec_begin(s->rec), TQKV_OK);
}

static void spec_rollback(tqkv_model_state *s, const int *keep, int n_keep) {
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) assert_int_equal(tqkv_batch_spec_rollback(s->layers[l], keep, n_keep), TQKV_OK);
    assert_int_equal(rec_spec_rollback(s->rec, keep, n_keep), TQKV_OK);
}

/* Spec rounds with a per-row keep: a 2-row batch drafts 4 random tokens per row, keeps
 * keep[r] of them (random, 0..4), then decodes one token. Compared with a state that never
 * drafted (each row alone, fed only its kept tokens by decode steps):
 *   drafts fed by decode steps    -> logits bitwise equal (the snapshots restore exactly);
 *   drafts fed by one extend of 4 -> within 1e-5 relative L2 (the kept tokens' attention ran
 *                                    in the prefill engine instead of the decode engine). */
static void test_hybrid_spec_rollback(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    tqkv_model *m = load_model(&g);
    test_rng rng;
    rng_init(&rng, test_seed());
    const int V = g.vocab, R = 2, n = 23;
    int32_t tok[2 * 23];
    for (int r = 0; r < R; r++) memcpy(tok + r * n, g.ids[r + 1], sizeof(int32_t) * n);
    float *lg = malloc(sizeof(float) * R * 4 * V), *lr = malloc(sizeof(float) * R * V);
    for (int round = 0; round < 4; round++) {
        int by_extend = round % 2;
        int32_t draft[2][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) draft[r][i] = rng_int(&rng, 1, V - 1);
        int keep[2] = {rng_int(&rng, 0, 4), rng_int(&rng, 0, 4)};
        tqkv_model_state *s = new_state(m, R, 2);
        assert_int_equal(tqkv_model_prefill(m, s, tok, NULL, n, TQKV_LOGITS_NONE, NULL), TQKV_OK);
        spec_begin(s);
        if (by_extend) {
            int32_t e4[8];
            for (int r = 0; r < R; r++) memcpy(e4 + r * 4, draft[r], sizeof(int32_t) * 4);
            assert_int_equal(tqkv_model_extend(m, s, e4, 4, TQKV_LOGITS_ALL, lg), TQKV_OK);
        } else {
            for (int i = 0; i < 4; i++) {
                int32_t t2[2] = {draft[0][i], draft[1][i]};
                assert_int_equal(tqkv_model_decode(m, s, t2, lg), TQKV_OK);
            }
        }
        spec_rollback(s, keep, 2);
        int offs[2];
        assert_int_equal(tqkv_model_state_offsets(s, offs), TQKV_OK);
        int32_t next[2] = {7, 9};
        assert_int_equal(tqkv_model_decode(m, s, next, lg), TQKV_OK);
        for (int r = 0; r < R; r++) {
            assert_int_equal(offs[r], n + keep[r]);
            tqkv_model_state *a = new_state(m, 1, 1);
            assert_int_equal(tqkv_model_prefill(m, a, tok + r * n, NULL, n, TQKV_LOGITS_NONE, NULL), TQKV_OK);
            for (int i = 0; i < keep[r]; i++)
                assert_int_equal(tqkv_model_decode(m, a, &draft[r][i], lr), TQKV_OK);
            assert_int_equal(tqkv_model_decode(m, a, &next[r], lr), TQKV_OK);
            if (by_extend) {
                double e = rel_l2(lg + (size_t)r * V, lr, (size_t)V);
                printf("spec round (extend of 4), row %d keep %d: rel L2 vs never drafted %.2e\n",
                       r, keep[r], e);
                assert_true(e < 1e-5);
            } else {
                assert_memory_equal(lg + (size_t)r * V, lr, sizeof(float) * V);
            }
            tqkv_model_state_free(a);
        }
        tqkv_model_state_free(s);
    }
    free(lg);
    free(lr);
    tqkv_model_free(m);
    golden_free(&g);
}

/* A KV-only trim leaves the recurrent rows ahead of the KV rows: the forward refuses it
 * (and changes nothing); a reset makes the state usable again. */
static void test_hybrid_kv_trim_refused(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    tqkv_model *m = load_model(&g);
    tqkv_model_state *s = new_state(m, 1, 1);
    float *lg = malloc(sizeof(float) * g.vocab);
    assert_int_equal(tqkv_model_prefill(m, s, g.ids[1], NULL, g.n[1], TQKV_LOGITS_LAST, lg), TQKV_OK);
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (s->layers[l]) assert_int_equal(tqkv_batch_trim(s->layers[l], 1), TQKV_OK);
    assert_int_equal(tqkv_model_decode(m, s, &g.ids[1][0], lg), TQKV_ESTATE);
    assert_non_null(strstr(tqkv_last_error(), "cannot be trimmed"));
    assert_int_equal(tqkv_model_state_reset(s, 1), TQKV_OK);
    assert_int_equal(tqkv_model_prefill(m, s, g.ids[1], NULL, g.n[1], TQKV_LOGITS_LAST, lg), TQKV_OK);
    assert_null(tqkv_model_state_layer(s, 0)); /* layer 0 is linear: no KV rows */
    assert_non_null(tqkv_model_state_layer(s, 1));
    tqkv_model_state_free(s);
    free(lg);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Clear refusals: the dense graph with experts (the MoE graph is its own architecture,
 * test_moe), a multimodal wrapper without text_config. */
static void test_refusals(void **st) {
    (void)st;
    tqkv_model_config c;
    const char *moe = "{\"architectures\":[\"Qwen3_5ForCausalLM\"],\"model_type\":\"qwen3_5_text\","
                      "\"vocab_size\":256,\"hidden_size\":64,\"intermediate_size\":128,"
                      "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"head_dim\":64,"
                      "\"num_experts\":8}";
    assert_int_equal(model_config_parse(moe, strlen(moe), "moe.json", &c), TQKV_EUNSUPPORTED);
    assert_non_null(strstr(tqkv_last_error(), "Qwen3_5MoeForCausalLM"));
    const char *mm = "{\"model_type\":\"qwen3_5\"}";
    assert_int_equal(model_config_parse(mm, strlen(mm), "mm.json", &c), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "text_config"));
    /* a rotary factor far outside (0, 1] is refused before any cast (the config fuzzer
     * found 1.4e29 cast to int: undefined behaviour) */
    char p[1024];
    char *text = slurp(source_path("tests/golden/qwen35/hybrid/config.json", p, sizeof p), NULL);
    assert_non_null(text);
    const double bad[] = {1.4e29, -1e30, 0, 1.5};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cJSON *j = cJSON_Parse(text), *rp = cJSON_GetObjectItem(j, "rope_parameters");
        assert_non_null(j);
        cJSON *host = cJSON_IsObject(rp) ? rp : j;
        cJSON_DeleteItemFromObject(host, "partial_rotary_factor");
        cJSON_AddNumberToObject(host, "partial_rotary_factor", bad[i]);
        char *out = cJSON_PrintUnformatted(j);
        assert_int_equal(model_config_parse(out, strlen(out), "bad.json", &c), TQKV_ECORRUPT);
        assert_non_null(strstr(tqkv_last_error(), "partial_rotary_factor"));
        free(out);
        cJSON_Delete(j);
    }
    free(text);
}

/* Copy a safetensors file renaming "model.X" tensors to "model.language_model.X". */
static void wrap_safetensors(const char *src, const char *dst) {
    size_t len = 0;
    char *b = slurp(src, &len);
    assert_non_null(b);
    uint64_t hl;
    memcpy(&hl, b, 8);
    cJSON *h = cJSON_ParseWithLength(b + 8, (size_t)hl), *e, *o = cJSON_CreateObject();
    assert_non_null(h);
    cJSON_ArrayForEach(e, h) {
        char name[512];
        if (!strncmp(e->string, "model.", 6))
            snprintf(name, sizeof name, "model.language_model.%s", e->string + 6);
        else
            snprintf(name, sizeof name, "%s", e->string);
        cJSON_AddItemToObject(o, name, cJSON_Duplicate(e, 1));
    }
    char *txt = cJSON_PrintUnformatted(o);
    size_t n = strlen(txt), pad = (8 - n % 8) % 8;
    uint64_t nl = n + pad;
    FILE *f = fopen(dst, "wb");
    assert_non_null(f);
    fwrite(&nl, 8, 1, f);
    fwrite(txt, 1, n, f);
    for (size_t i = 0; i < pad; i++) fputc(' ', f);
    fwrite(b + 8 + hl, 1, len - 8 - hl, f);
    fclose(f);
    free(txt);
    cJSON_Delete(h);
    cJSON_Delete(o);
    free(b);
}

/* The text part of a Qwen3_5ForConditionalGeneration checkpoint: text_config + weights under
 * model.language_model.*: same logits, bitwise, as the plain text checkpoint. */
static void test_multimodal_wrapper(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    char tmpl[] = "/tmp/tqkv_qwen35_wrapXXXXXX", p[1200], q[1200];
    assert_non_null(mkdtemp(tmpl));
    snprintf(p, sizeof p, "%s/model.safetensors", g.dir);
    snprintf(q, sizeof q, "%s/model.safetensors", tmpl);
    wrap_safetensors(p, q);
    snprintf(p, sizeof p, "%s/config.json", g.dir);
    char *ctext = slurp(p, NULL);
    cJSON *tc = cJSON_Parse(ctext), *root = cJSON_CreateObject();
    free(ctext);
    cJSON *arch = cJSON_CreateArray();
    cJSON_AddItemToArray(arch, cJSON_CreateString("Qwen3_5ForConditionalGeneration"));
    cJSON_AddItemToObject(root, "architectures", arch);
    cJSON_AddStringToObject(root, "model_type", "qwen3_5");
    cJSON_DeleteItemFromObject(tc, "tie_word_embeddings"); /* inherited from the top level */
    cJSON_AddItemToObject(root, "text_config", tc);
    cJSON_AddTrueToObject(root, "tie_word_embeddings");
    cJSON_AddItemToObject(root, "vision_config", cJSON_CreateObject());
    char *out = cJSON_Print(root);
    snprintf(q, sizeof q, "%s/config.json", tmpl);
    FILE *f = fopen(q, "wb");
    fputs(out, f);
    fclose(f);
    free(out);
    cJSON_Delete(root);
    tqkv_model *m = load_model(&g), *w = NULL;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    tqkv_status rc = tqkv_model_load(&w, tmpl, &lp);
    if (rc != TQKV_OK) fprintf(stderr, "wrapped: %s\n", tqkv_last_error());
    assert_int_equal(rc, TQKV_OK);
    assert_string_equal(tqkv_model_get_config(w)->arch_name, "Qwen3_5ForConditionalGeneration");
    const int V = g.vocab;
    float *a = malloc(sizeof(float) * V * g.n[0]), *b = malloc(sizeof(float) * V * g.n[0]);
    tqkv_model_state *sa = new_state(m, 1, 1), *sb = new_state(w, 1, 1);
    assert_int_equal(tqkv_model_prefill(m, sa, g.ids[0], NULL, g.n[0], TQKV_LOGITS_ALL, a), TQKV_OK);
    assert_int_equal(tqkv_model_prefill(w, sb, g.ids[0], NULL, g.n[0], TQKV_LOGITS_ALL, b), TQKV_OK);
    assert_memory_equal(a, b, sizeof(float) * V * g.n[0]);
    tqkv_model_state_free(sa);
    tqkv_model_state_free(sb);
    tqkv_model_free(m);
    tqkv_model_free(w);
    unlink(q);
    snprintf(q, sizeof q, "%s/model.safetensors", tmpl);
    unlink(q);
    rmdir(tmpl);
    free(a);
    free(b);
    golden_free(&g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hybrid_parity),
        cmocka_unit_test(test_hybrid_decode_greedy),
        cmocka_unit_test(test_minicpm5_parity),
        cmocka_unit_test(test_minicpm5_decode_greedy),
        cmocka_unit_test(test_minicpm5_deferred_tq4),
        cmocka_unit_test(test_kernel_sets),
        cmocka_unit_test(test_hybrid_merge_filter_export),
        cmocka_unit_test(test_hybrid_spec_rollback),
        cmocka_unit_test(test_recurrent_rows),
        cmocka_unit_test(test_hybrid_kv_trim_refused),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_multimodal_wrapper),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
