/*
 * graph_golden.h - transformers goldens of tiny random-weight checkpoints
 * (tests/golden/<graph>/<variant>/{config.json, model.safetensors, goldens.json, logits.bin},
 * made by tools/make_graph_goldens_*.py) and the parity checks every graph test runs on them:
 * every prompt alone at every position, the left-padded batch bitwise equal to the rows
 * alone (1 and 3 threads), prefill + per-token decode, and greedy against generate().
 * Must not: hide assertions about a graph's own behaviour (its test keeps those).
 */
#ifndef TQKV_GRAPH_GOLDEN_H
#define TQKV_GRAPH_GOLDEN_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model_helpers.h"
#include "testutil.h"
#include "tqkv_model.h"
#include "util/common.h"

typedef struct {
    char     dir[1024];
    int      vocab, n_prompts;
    int      n[4], first[4];
    int32_t *ids[4];
    int      greedy[64], n_greedy;
    float   *logits; /* [n_vectors, vocab] */
} golden;

static inline void golden_load(golden *g, const char *graph, const char *variant) {
    char rel[256], p[1100];
    memset(g, 0, sizeof *g);
    snprintf(rel, sizeof rel, "tests/golden/%s/%s", graph, variant);
    source_path(rel, g->dir, sizeof g->dir);
    snprintf(p, sizeof p, "%s/goldens.json", g->dir);
    char *text = slurp(p, NULL);
    assert_non_null(text);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    g->vocab = cJSON_GetObjectItem(root, "vocab")->valueint;
    int nv = cJSON_GetObjectItem(root, "n_vectors")->valueint;
    const cJSON *pr = cJSON_GetObjectItem(root, "prompts"), *e;
    cJSON_ArrayForEach(e, pr) {
        int i = g->n_prompts++;
        g->n[i] = cJSON_GetObjectItem(e, "n")->valueint;
        g->first[i] = cJSON_GetObjectItem(e, "logits_index_first")->valueint;
        g->ids[i] = malloc(sizeof(int32_t) * (size_t)g->n[i]);
        int k = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItem(e, "ids")) g->ids[i][k++] = t->valueint;
        assert_int_equal(k, g->n[i]);
    }
    const cJSON *t;
    cJSON_ArrayForEach(t, cJSON_GetObjectItem(root, "greedy")) g->greedy[g->n_greedy++] = t->valueint;
    cJSON_Delete(root);
    snprintf(p, sizeof p, "%s/logits.bin", g->dir);
    size_t len = 0;
    g->logits = (float *)slurp(p, &len);
    assert_non_null(g->logits);
    assert_int_equal(len, sizeof(float) * (size_t)nv * (size_t)g->vocab);
}

static inline void golden_free(golden *g) {
    for (int i = 0; i < g->n_prompts; i++) free(g->ids[i]);
    free(g->logits);
}

static inline tqkv_model *load_model(const golden *g) {
    tqkv_model *m = NULL;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    tqkv_status rc = tqkv_model_load(&m, g->dir, &lp);
    if (rc != TQKV_OK) fprintf(stderr, "load: %s\n", tqkv_last_error());
    assert_int_equal(rc, TQKV_OK);
    return m;
}

static inline tqkv_model_state *new_state(const tqkv_model *m, int rows, int threads) {
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.rows = rows;
    sp.threads = threads;
    tqkv_model_state *s = NULL;
    assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
    return s;
}

/* Every prompt alone, every position; then the left-padded batch of all prompts. */
static inline void check_parity(const char *graph, const char *variant) {
    golden g;
    golden_load(&g, graph, variant);
    tqkv_model *m = load_model(&g);
    const int V = g.vocab;
    int nmax = 0;
    for (int i = 0; i < g.n_prompts; i++) nmax = g.n[i] > nmax ? g.n[i] : nmax;
    float *alone = malloc(sizeof(float) * (size_t)g.n_prompts * nmax * V);
    for (int i = 0; i < g.n_prompts; i++) {
        tqkv_model_state *s = new_state(m, 1, 2);
        float *lg = alone + (size_t)i * nmax * V;
        assert_int_equal(tqkv_model_prefill(m, s, g.ids[i], NULL, g.n[i], TQKV_LOGITS_ALL, lg),
                         TQKV_OK);
        double e = rel_l2(lg, g.logits + (size_t)g.first[i] * V, (size_t)g.n[i] * V);
        printf("%s prompt %d (%d tokens) alone: rel L2 %.2e\n", variant, i, g.n[i], e);
        assert_true(e < 1e-3);
        tqkv_model_state_free(s);
    }
    /* left-padded batch: each row's real positions equal the row alone, bitwise */
    int R = g.n_prompts;
    int32_t *tok = calloc((size_t)R * nmax, sizeof(int32_t));
    int lens[4];
    for (int r = 0; r < R; r++) {
        lens[r] = g.n[r];
        memcpy(tok + (size_t)r * nmax + (nmax - g.n[r]), g.ids[r], sizeof(int32_t) * g.n[r]);
    }
    for (int threads = 1; threads <= 3; threads += 2) {
        tqkv_model_state *s = new_state(m, R, threads);
        float *lb = malloc(sizeof(float) * (size_t)R * nmax * V);
        assert_int_equal(tqkv_model_prefill(m, s, tok, lens, nmax, TQKV_LOGITS_ALL, lb), TQKV_OK);
        for (int r = 0; r < R; r++) {
            const float *row = lb + ((size_t)r * nmax + (nmax - g.n[r])) * V;
            assert_memory_equal(row, alone + (size_t)r * nmax * V, sizeof(float) * g.n[r] * V);
        }
        free(lb);
        tqkv_model_state_free(s);
    }
    free(tok);
    free(alone);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Prefill 40 tokens of prompt 0, then decode the rest one token at a time (the decode
 * path of every layer) against HF's no-cache logits; then greedy vs HF generate(). */
static inline void check_decode_greedy(const char *graph, const char *variant) {
    golden g;
    golden_load(&g, graph, variant);
    tqkv_model *m = load_model(&g);
    const int V = g.vocab, n0 = 40;
    float *lg = malloc(sizeof(float) * (size_t)V * 64);
    tqkv_model_state *s = new_state(m, 1, 2);
    assert_int_equal(tqkv_model_prefill(m, s, g.ids[0], NULL, n0, TQKV_LOGITS_LAST, lg), TQKV_OK);
    double worst = rel_l2(lg, g.logits + (size_t)(g.first[0] + n0 - 1) * V, (size_t)V);
    for (int j = n0; j < g.n[0]; j++) {
        assert_int_equal(tqkv_model_decode(m, s, &g.ids[0][j], lg), TQKV_OK);
        double e = rel_l2(lg, g.logits + (size_t)(g.first[0] + j) * V, (size_t)V);
        worst = e > worst ? e : worst;
    }
    printf("%s decode steps %d..%d: worst rel L2 %.2e\n", variant, n0, g.n[0] - 1, worst);
    assert_true(worst < 1e-3);
    /* greedy continuation of prompt 0 */
    assert_int_equal(tqkv_model_state_reset(s, 1), TQKV_OK);
    assert_int_equal(tqkv_model_prefill(m, s, g.ids[0], NULL, g.n[0], TQKV_LOGITS_LAST, lg), TQKV_OK);
    for (int k = 0; k < g.n_greedy; k++) {
        int best = 0;
        for (int v = 1; v < V; v++) best = lg[v] > lg[best] ? v : best;
        assert_int_equal(best, g.greedy[k]);
        int32_t t = best;
        assert_int_equal(tqkv_model_decode(m, s, &t, lg), TQKV_OK);
    }
    printf("%s greedy: %d tokens identical\n", variant, g.n_greedy);
    tqkv_model_state_free(s);
    free(lg);
    tqkv_model_free(m);
    golden_free(&g);
}

#endif
