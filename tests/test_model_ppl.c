/*
 * test_model_ppl.c - a short perplexity check on shared/data/heldout-code.txt: 2 windows of
 * 512 tokens scored like tools/kvq_reference.py. f32 must be finite and sane, q8 within
 * 0.5 % of f32, tq4 within a few % (skips when ../shared or the model is absent).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "testutil.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

#define CTX 512
#define WINDOWS 2

static double window_ppl(const tqkv_model *m, const int32_t *ids, const char *kv, int window) {
    int V = tqkv_model_get_config(m)->vocab_size;
    tqkv_model_state_params p = tqkv_model_state_params_default();
    assert_int_equal(tqkv_kv_spec_parse(kv, &p.k_format, &p.v_format), TQKV_OK);
    p.window = window;
    p.threads = 2;
    p.kv_seed = test_seed() % 1000;
    tqkv_model_state *s = NULL;
    assert_int_equal(tqkv_model_state_init(&s, m, &p), TQKV_OK);
    float *lg = malloc(sizeof(float) * (size_t)CTX * V);
    double nll = 0;
    for (int w = 0; w < WINDOWS; w++) {
        const int32_t *x = ids + (size_t)w * CTX;
        assert_int_equal(tqkv_model_state_reset(s, 1), TQKV_OK);
        if (tqkv_model_prefill(m, s, x, NULL, CTX, TQKV_LOGITS_ALL, lg) != TQKV_OK)
            fail_msg("prefill: %s", tqkv_last_error());
        for (int j = 0; j < CTX; j++) {
            const float *l = lg + (size_t)j * V;
            double mx = l[0], z = 0;
            for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
            for (int v = 0; v < V; v++) z += exp(l[v] - mx);
            nll += mx + log(z) - l[x[j + 1]];
        }
    }
    free(lg);
    tqkv_model_state_free(s);
    return exp(nll / (WINDOWS * CTX));
}

static void test_short_ppl(void **state) {
    (void)state;
    char tp[1024], md[1024];
    if (!shared_path("data/heldout-code.txt", tp, sizeof tp)) skip();
    source_path("models/qwen3-code-28m", md, sizeof md);
    struct stat st;
    if (stat(md, &st) != 0) skip();
    FILE *f = fopen(tp, "rb");
    assert_non_null(f);
    size_t cap = 64 * 1024;
    char *text = malloc(cap);
    size_t len = fread(text, 1, cap, f);
    fclose(f);
    while (len > 0 && ((unsigned char)text[len - 1] & 0xC0) == 0x80) len--; /* whole UTF-8 */
    if (len > 0 && (unsigned char)text[len - 1] >= 0xC0) len--;
    tqkv_tokenizer *tok = NULL;
    assert_int_equal(tqkv_tokenizer_load(&tok, md), TQKV_OK);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tqkv_tokenizer_encode(tok, text, len, 0, &ids, &n), TQKV_OK);
    assert_true(n > WINDOWS * CTX + 1);
    tqkv_model *m = NULL;
    assert_int_equal(tqkv_model_load(&m, md, NULL), TQKV_OK);
    double f32 = window_ppl(m, ids, "f32", 0);
    double q8 = window_ppl(m, ids, "q8", 0);
    double tq4 = window_ppl(m, ids, "tq4", 0);
    double tq4w = window_ppl(m, ids, "tq4", 32);
    fprintf(stderr, "[ppl] %d x %d tokens: f32 %.4f, q8 %.4f (%+.2f%%), tq4 %.4f (%+.2f%%), "
            "tq4 window 32 %.4f (%+.2f%%)\n", WINDOWS, CTX, f32, q8, 100 * (q8 / f32 - 1), tq4,
            100 * (tq4 / f32 - 1), tq4w, 100 * (tq4w / f32 - 1));
    assert_true(isfinite(f32) && f32 > 1.5 && f32 < 30);
    assert_true(fabs(q8 / f32 - 1) < 0.005);
    assert_true(tq4 / f32 - 1 < 0.04 && tq4 / f32 - 1 > -0.02);
    assert_true(tq4w / f32 - 1 < 0.04 && tq4w / f32 - 1 > -0.02);
    tqkv_model_free(m);
    tqkv_tokenizer_free(tok);
    free(ids);
    free(text);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_short_ppl)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
