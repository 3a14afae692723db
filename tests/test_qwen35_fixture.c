/*
 * test_qwen35_fixture.c - the trained Qwen 3.5 hybrid fixture (../shared/models/
 * qwen35-code-hybrid-30m) on held-out text: left-padded batch and thread counts bitwise
 * equal to each row alone, prefill in chunks within float rounding of one prefill, and a
 * short perplexity with f32 and tq4 caches. Exits 77 (skipped) without ../shared.
 * (transformers parity of the graph: test_qwen35.c; full ppl figures: bench/RESULTS.md.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static char g_model[1024], g_text[1024];

typedef struct {
    tqkv_model *m;
    int32_t    *ids;
    size_t      n_ids;
} fixture;

static void fixture_load(fixture *f) {
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    assert_int_equal(tqkv_model_load(&f->m, g_model, &lp), TQKV_OK);
    tqkv_tokenizer *tok = NULL;
    assert_int_equal(tqkv_tokenizer_load(&tok, g_model), TQKV_OK);
    FILE *fp = fopen(g_text, "rb");
    assert_non_null(fp);
    size_t cap = 48 * 1024;
    char *text = malloc(cap);
    size_t len = fread(text, 1, cap, fp);
    fclose(fp);
    while (len > 0 && ((unsigned char)text[len - 1] & 0xC0) == 0x80) len--; /* whole chars */
    if (len > 0 && (unsigned char)text[len - 1] >= 0xC0) len--;
    assert_int_equal(tqkv_tokenizer_encode(tok, text, len, 0, &f->ids, &f->n_ids), TQKV_OK);
    assert_true(f->n_ids > 4096);
    free(text);
    tqkv_tokenizer_free(tok);
}

static void fixture_free(fixture *f) {
    tqkv_model_free(f->m);
    free(f->ids);
}

static tqkv_model_state *state(const tqkv_model *m, int rows, int threads, const char *kv) {
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.rows = rows;
    sp.threads = threads;
    assert_int_equal(tqkv_kv_spec_parse(kv, &sp.k_format, &sp.v_format), TQKV_OK);
    tqkv_model_state *s = NULL;
    assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
    return s;
}

/* 3 rows from random offsets of the text, random lengths; alone (1 thread) vs the
 * left-padded batch (2 threads) for the prefill and 8 decode steps: bitwise equal. */
static void test_batch_invariance(void **st) {
    (void)st;
    fixture f;
    fixture_load(&f);
    test_rng rng;
    rng_init(&rng, test_seed());
    const int V = tqkv_model_get_config(f.m)->vocab_size, R = 3, steps = 8;
    int lens[3], nmax = 0;
    const int32_t *src[3];
    for (int r = 0; r < R; r++) {
        lens[r] = rng_int(&rng, 20, 300);
        src[r] = f.ids + rng_int(&rng, 0, (int)f.n_ids - 400);
        nmax = lens[r] > nmax ? lens[r] : nmax;
    }
    int32_t *tok = calloc((size_t)R * nmax, sizeof(int32_t));
    for (int r = 0; r < R; r++) memcpy(tok + (size_t)r * nmax + nmax - lens[r], src[r], sizeof(int32_t) * lens[r]);
    float *lb = malloc(sizeof(float) * R * V * (steps + 1)), *la = malloc(sizeof(float) * V);
    tqkv_model_state *b = state(f.m, R, 2, "tq4");
    assert_int_equal(tqkv_model_prefill(f.m, b, tok, lens, nmax, TQKV_LOGITS_LAST, lb), TQKV_OK);
    for (int k = 0; k < steps; k++) {
        int32_t t[3];
        for (int r = 0; r < R; r++) t[r] = src[r][lens[r] + k]; /* teacher forcing */
        assert_int_equal(tqkv_model_decode(f.m, b, t, lb + (size_t)(k + 1) * R * V), TQKV_OK);
    }
    for (int r = 0; r < R; r++) {
        tqkv_model_state *a = state(f.m, 1, 1, "tq4");
        assert_int_equal(tqkv_model_prefill(f.m, a, src[r], NULL, lens[r], TQKV_LOGITS_LAST, la), TQKV_OK);
        assert_memory_equal(la, lb + (size_t)r * V, sizeof(float) * V);
        for (int k = 0; k < steps; k++) {
            assert_int_equal(tqkv_model_decode(f.m, a, &src[r][lens[r] + k], la), TQKV_OK);
            assert_memory_equal(la, lb + ((size_t)(k + 1) * R + r) * V, sizeof(float) * V);
        }
        tqkv_model_state_free(a);
    }
    tqkv_model_state_free(b);
    free(tok);
    free(lb);
    free(la);
    fixture_free(&f);
}

/* 512 tokens: one prefill vs prefill 100 + extends of 137 + decode steps (f32 cache). */
static void test_chunked_prefill(void **st) {
    (void)st;
    fixture f;
    fixture_load(&f);
    const int V = tqkv_model_get_config(f.m)->vocab_size, n = 512;
    float *whole = malloc(sizeof(float) * (size_t)n * V), *part = malloc(sizeof(float) * (size_t)n * V);
    tqkv_model_state *s = state(f.m, 1, 2, "f32");
    assert_int_equal(tqkv_model_prefill(f.m, s, f.ids, NULL, n, TQKV_LOGITS_ALL, whole), TQKV_OK);
    assert_int_equal(tqkv_model_state_reset(s, 1), TQKV_OK);
    assert_int_equal(tqkv_model_prefill(f.m, s, f.ids, NULL, 100, TQKV_LOGITS_ALL, part), TQKV_OK);
    int at = 100;
    while (at + 137 <= n - 4) {
        assert_int_equal(tqkv_model_extend(f.m, s, f.ids + at, 137, TQKV_LOGITS_ALL, part + (size_t)at * V), TQKV_OK);
        at += 137;
    }
    for (; at < n; at++) assert_int_equal(tqkv_model_decode(f.m, s, f.ids + at, part + (size_t)at * V), TQKV_OK);
    double e = rel_l2(part, whole, (size_t)n * V);
    printf("chunked vs whole prefill, 512 tokens: rel L2 %.2e\n", e);
    assert_true(e < 1e-4);
    tqkv_model_state_free(s);
    free(whole);
    free(part);
    fixture_free(&f);
}

/* Two windows of 1024: f32 and tq4 perplexity, sane and close. */
static void test_short_ppl(void **st) {
    (void)st;
    fixture f;
    fixture_load(&f);
    const int V = tqkv_model_get_config(f.m)->vocab_size, ctx = 1024, W = 2;
    float *lg = malloc(sizeof(float) * (size_t)ctx * V);
    double ppl[2];
    const char *kv[2] = {"f32", "tq4"};
    for (int k = 0; k < 2; k++) {
        tqkv_model_state *s = state(f.m, 1, 2, kv[k]);
        double nll = 0;
        for (int w = 0; w < W; w++) {
            assert_int_equal(tqkv_model_state_reset(s, 1), TQKV_OK);
            const int32_t *x = f.ids + (size_t)w * ctx;
            assert_int_equal(tqkv_model_prefill(f.m, s, x, NULL, ctx, TQKV_LOGITS_ALL, lg), TQKV_OK);
            for (int j = 0; j < ctx; j++) {
                const float *l = lg + (size_t)j * V;
                float mx = l[0];
                for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
                double z = 0;
                for (int v = 0; v < V; v++) z += exp((double)(l[v] - mx));
                nll += mx + log(z) - l[x[j + 1]];
            }
        }
        ppl[k] = exp(nll / (W * ctx));
        tqkv_model_state_free(s);
    }
    printf("[ppl] 2 x 1024 tokens: f32 %.4f, tq4 %.4f (%+.2f%%)\n", ppl[0], ppl[1],
           100 * (ppl[1] / ppl[0] - 1));
    assert_true(ppl[0] > 2 && ppl[0] < 20);
    assert_true(fabs(ppl[1] / ppl[0] - 1) < 0.02);
    free(lg);
    fixture_free(&f);
}

int main(void) {
    if (!shared_path("models/qwen35-code-hybrid-30m/config.json", g_model, sizeof g_model) ||
        !shared_path("data/heldout-code.txt", g_text, sizeof g_text)) {
        fprintf(stderr, "test_qwen35_fixture: ../shared absent: skipped\n");
        return 77;
    }
    FILE *fp = fopen(g_model, "rb");
    if (!fp) {
        fprintf(stderr, "test_qwen35_fixture: %s absent: skipped\n", g_model);
        return 77;
    }
    fclose(fp);
    *strrchr(g_model, '/') = 0;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_short_ppl),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
