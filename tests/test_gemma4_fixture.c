/*
 * test_gemma4_fixture.c - the trained Gemma 4 fixture (../shared/models/gemma4-code-30m):
 * with a tq4 cache and prompts longer than the 512-token window, a row's logits are
 * bitwise identical alone and in a left-padded batch, at 1 and 2 threads, through prefill
 * and decode; sliding layers hold at most window + slack tokens, full layers all of them.
 * Skipped (exit 77) when ../shared is absent. (Perplexity parity: `tqkv ppl`, bench/RESULTS.md.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tqkv_model.h"

#define OK(x)                                                                                     \
    do {                                                                                          \
        if ((x) != TQKV_OK) fail_msg("%s: %s", #x, tqkv_last_error());                            \
    } while (0)

static tqkv_model *g_model;

static tqkv_model_state *new_state(int rows, int threads) {
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.rows = rows;
    sp.threads = threads;
    sp.k_format = sp.v_format = TQKV_TQ4;
    tqkv_model_state *s = NULL;
    OK(tqkv_model_state_init(&s, g_model, &sp));
    return s;
}

#define STEPS 3

/* logits: [rows, STEPS + 1, V] (prefill's last token, then each decode) */
static void run(tqkv_model_state *s, const int32_t *tok, const int *lens, int n,
                const int32_t *next, float *logits) {
    const int R = tqkv_model_state_rows(s), V = tqkv_model_get_config(g_model)->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)R * V);
    OK(tqkv_model_prefill(g_model, s, tok, lens, n, TQKV_LOGITS_LAST, lg));
    for (int r = 0; r < R; r++)
        memcpy(logits + (size_t)r * (STEPS + 1) * V, lg + (size_t)r * V, sizeof(float) * V);
    for (int k = 0; k < STEPS; k++) {
        int32_t t[8];
        for (int r = 0; r < R; r++) t[r] = next[r * STEPS + k];
        OK(tqkv_model_decode(g_model, s, t, lg));
        for (int r = 0; r < R; r++)
            memcpy(logits + ((size_t)r * (STEPS + 1) + k + 1) * V, lg + (size_t)r * V,
                   sizeof(float) * V);
    }
    free(lg);
}

static void test_invariance_tq4(void **state) {
    (void)state;
    const int V = tqkv_model_get_config(g_model)->vocab_size, L = tqkv_model_get_config(g_model)->n_layers;
    test_rng rng;
    rng_init(&rng, test_seed());
    const int n = 700, lens[2] = {700, 300};
    int32_t *tok = calloc((size_t)2 * n, sizeof(int32_t)), next[2 * STEPS];
    for (int r = 0; r < 2; r++)
        for (int j = n - lens[r]; j < n; j++) tok[(size_t)r * n + j] = rng_int(&rng, 3, V - 1);
    for (int i = 0; i < 2 * STEPS; i++) next[i] = rng_int(&rng, 3, V - 1);
    size_t per = (size_t)(STEPS + 1) * V;
    float *batch = malloc(sizeof(float) * 2 * per), *b2 = malloc(sizeof(float) * 2 * per),
          *alone = malloc(sizeof(float) * per);
    tqkv_model_state *s = new_state(2, 1);
    run(s, tok, lens, n, next, batch);
    /* memory: sliding layers bounded, full layers hold every token */
    int pos[2];
    OK(tqkv_model_state_offsets(s, pos));
    assert_int_equal(pos[0], 700 + STEPS);
    assert_int_equal(pos[1], 300 + STEPS);
    int bounded = 0;
    for (int l = 0; l < L; l++) {
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (!b) continue;
        int off[2];
        OK(tqkv_batch_offsets(b, off, NULL));
        if (off[0] != pos[0]) {
            assert_true(off[0] <= 512 + 32);
            bounded++;
        }
        assert_true(off[1] == pos[1]);
    }
    assert_true(bounded >= 1);
    tqkv_model_state *s2 = new_state(2, 2);
    run(s2, tok, lens, n, next, b2);
    assert_memory_equal(batch, b2, sizeof(float) * 2 * per);
    for (int r = 0; r < 2; r++) {
        tqkv_model_state *a = new_state(1, 2);
        run(a, tok + (size_t)r * n + (n - lens[r]), NULL, lens[r], next + r * STEPS, alone);
        assert_memory_equal(alone, batch + (size_t)r * per, sizeof(float) * per);
        tqkv_model_state_free(a);
    }
    tqkv_model_state_free(s);
    tqkv_model_state_free(s2);
    free(tok);
    free(batch);
    free(b2);
    free(alone);
}

int main(void) {
    char p[1024];
    const char *dir = shared_path("models/gemma4-code-30m", p, sizeof p);
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    if (!dir || tqkv_model_load(&g_model, dir, &lp) != TQKV_OK) {
        printf("SKIPPED: %s absent\n", dir ? dir : "../shared");
        return 77;
    }
    test_seed();
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_invariance_tq4)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tqkv_model_free(g_model);
    return rc;
}
