/*
 * test_moe.c - the Qwen3-MoE graph (src/model/arch/qwen3moe/) against transformers fp32
 * goldens of tiny random-weight checkpoints (tests/golden/moe/, made on the GPU machine by
 * tools/make_graph_goldens_moe.py; one tensor per expert, as the published checkpoints):
 *   - qwen3moe: 8 experts, top 2 renormalised, layer 1 dense (mlp_only_layers);
 *   - qwen3moe_s2: 6 experts, top 3 raw weights, every second layer sparse;
 * every prompt alone at every position (rel. L2 < 1e-3), the left-padded batch bitwise equal
 * to the rows alone at 1 and 3 threads (a token's routing and expert sums never depend on
 * the other tokens), prefill + per-token decode, greedy equal to generate(); the sparse
 * layers as loaded; q8 / tq4 caches near the f32 one; config refusals naming the bad field.
 * Skipped (77) when the goldens are absent.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "graph_golden.h"
#include "model/model_impl.h"
#include "model_helpers.h"
#include "testutil.h"
#include "tqkv_model.h"
#include "util/common.h"

static void test_qwen3moe_parity(void **st) {
    (void)st;
    check_parity("moe", "qwen3moe");
}
static void test_qwen3moe_decode_greedy(void **st) {
    (void)st;
    check_decode_greedy("moe", "qwen3moe");
}
static void test_qwen3moe_s2_parity(void **st) {
    (void)st;
    check_parity("moe", "qwen3moe_s2");
}
static void test_qwen3moe_s2_decode_greedy(void **st) {
    (void)st;
    check_decode_greedy("moe", "qwen3moe_s2");
}

/* The config as loaded: experts, top-k, sparse layers (decoder_sparse_step / mlp_only_layers). */
static void test_config(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "moe", "qwen3moe");
    tqkv_model *m = load_model(&g);
    const tqkv_model_config *c = tqkv_model_get_config(m);
    assert_int_equal(c->arch, TQKV_ARCH_QWEN3_MOE);
    assert_int_equal(c->n_experts, 8);
    assert_int_equal(c->n_experts_used, 2);
    assert_int_equal(c->norm_topk_prob, 1);
    assert_int_equal(c->n_moe_layers, 2);
    assert_int_equal(c->layer_moe[0], 1);
    assert_int_equal(c->layer_moe[1], 0);
    assert_int_equal(c->layer_moe[2], 1);
    tqkv_model_free(m);
    golden_free(&g);
    golden_load(&g, "moe", "qwen3moe_s2");
    m = load_model(&g);
    c = tqkv_model_get_config(m);
    for (int l = 0; l < 4; l++) assert_int_equal(c->layer_moe[l], l % 2 == 1);
    assert_int_equal(c->norm_topk_prob, 0);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Compressed KV on the MoE graph: q8 and tq4 caches against the f32 cache over every position
 * of prompt 0. Routing is discontinuous (a token whose top-k flips under the cache's error
 * takes other experts), so the bounds are looser than a dense graph's at this size
 * (test_qwen35 minicpm5, the same attention shape: tq4 7.7e-2); q8 must stay far below tq4. */
static void test_qwen3moe_kv_formats(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "moe", "qwen3moe");
    tqkv_model *m = load_model(&g);
    const int V = g.vocab, n = g.n[0];
    const tqkv_format fm[3] = {TQKV_F32, TQKV_Q8, TQKV_TQ4};
    float *out[3];
    for (int k = 0; k < 3; k++) {
        out[k] = malloc(sizeof(float) * (size_t)n * V);
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.rows = 1;
        sp.threads = 2;
        sp.k_format = sp.v_format = fm[k];
        tqkv_model_state *s = NULL;
        assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
        assert_int_equal(tqkv_model_prefill(m, s, g.ids[0], NULL, n, TQKV_LOGITS_ALL, out[k]), TQKV_OK);
        tqkv_model_state_free(s);
    }
    const double e8 = rel_l2(out[1], out[0], (size_t)n * V), e4 = rel_l2(out[2], out[0], (size_t)n * V);
    printf("qwen3moe vs the f32 cache, %d positions: q8 rel L2 %.3g, tq4 %.3g\n", n, e8, e4);
    assert_true(e8 > 0 && e8 < 0.02);
    assert_true(e4 > e8 && e4 < 0.3);
    for (int k = 0; k < 3; k++) free(out[k]);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Each bad field is refused with a message naming it. */
static void test_refusals(void **st) {
    (void)st;
    char p[1024];
    char *text = slurp(source_path("tests/golden/moe/qwen3moe/config.json", p, sizeof p), NULL);
    assert_non_null(text);
    /* (the goldens' config says num_local_experts, as transformers 5 saves it) */
    const struct { const char *key; double v; int del; } bad[] = {
        {"num_local_experts", 0, 0}, {"num_experts_per_tok", 9, 0}, {"num_local_experts", 0, 1},
        {"moe_intermediate_size", 0, 1}, {"decoder_sparse_step", 0, 0}, {"num_experts", 1.5, 0},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cJSON *j = cJSON_Parse(text);
        assert_non_null(j);
        cJSON_DeleteItemFromObject(j, bad[i].key);
        if (!bad[i].del) cJSON_AddNumberToObject(j, bad[i].key, bad[i].v);
        char *out = cJSON_PrintUnformatted(j);
        tqkv_model_config c;
        const tqkv_status rc = model_config_parse(out, strlen(out), "bad.json", &c);
        printf("refused (%d): %s\n", (int)rc, tqkv_last_error());
        assert_int_equal(rc, TQKV_ECORRUPT);
        assert_non_null(strstr(tqkv_last_error(), bad[i].key));
        free(out);
        cJSON_Delete(j);
    }
    cJSON *j = cJSON_Parse(text);
    cJSON_DeleteItemFromObject(j, "mlp_only_layers");
    cJSON *l = cJSON_CreateIntArray((const int[]){0, 7}, 2);
    cJSON_AddItemToObject(j, "mlp_only_layers", l);
    char *out = cJSON_PrintUnformatted(j);
    tqkv_model_config c;
    assert_int_equal(model_config_parse(out, strlen(out), "bad.json", &c), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "mlp_only_layers"));
    free(out);
    cJSON_Delete(j);
    free(text);
}

int main(void) {
    char p[1024];
    FILE *f = fopen(source_path("tests/golden/moe/qwen3moe/goldens.json", p, sizeof p), "rb");
    if (!f) {
        printf("SKIPPED: %s missing (tools/make_graph_goldens_moe.py makes it)\n", p);
        return 77;
    }
    fclose(f);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3moe_parity),      cmocka_unit_test(test_qwen3moe_decode_greedy),
        cmocka_unit_test(test_qwen3moe_s2_parity),   cmocka_unit_test(test_qwen3moe_s2_decode_greedy),
        cmocka_unit_test(test_config),               cmocka_unit_test(test_qwen3moe_kv_formats),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
