/*
 * test_cuda_model.c - the model forward on the GPU (tqkv_model_state_params.device = 1)
 * against the CPU forward on the bundled model (models/qwen3-code-28m, or the directory in
 * TQKV_TEST_MODEL), on fresh random token sequences:
 *  - prefill logits of every position and decode logits, GPU vs CPU, for f32 (dense bf16
 *    cache on the device), tq4 and tq3 (+ q8 window), within a stated relative L2;
 *  - batch invariance on the device: a row's prefill and decode logits alone (1 row) and
 *    inside a batch of 3 rows (at position 2, other rows with other tokens) are bitwise
 *    equal;
 *  - a padded prefill is refused with TQKV_EUNSUPPORTED and leaves the state usable.
 * Exits 77 (skipped) when the build has no CUDA, no GPU is present or the model is absent.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "testutil.h"
#include "tqkv_model.h"

#ifdef TQKV_HAVE_CUDA
#include "cache/cache_cuda.h"

static tqkv_model *g_model;
static uint64_t    g_seed;

static tqkv_model_state *new_state(int rows, tqkv_format f, int window, int device) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = p.v_format = f;
    p.window = window;
    p.threads = 4;
    p.device = device;
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, g_model, &p) != TQKV_OK)
        fail_msg("state init (device %d): %s", device, tqkv_last_error());
    return s;
}

static void random_tokens(test_rng *r, int32_t *t, size_t n, int V) {
    for (size_t i = 0; i < n; i++) t[i] = rng_int(r, 1, V - 1);
}

/* Largest rel L2 over positions of GPU vs CPU logits [n, V]; counts argmax agreement. */
static double worst_rel(const float *g, const float *c, int n, int V, int *argmax_same) {
    double w = 0;
    *argmax_same = 0;
    for (int i = 0; i < n; i++) {
        double e = rel_l2(g + (size_t)i * V, c + (size_t)i * V, (size_t)V);
        if (!(e <= w)) w = e;
        int ag = 0, ac = 0;
        for (int v = 1; v < V; v++) {
            if (g[(size_t)i * V + v] > g[(size_t)i * V + ag]) ag = v;
            if (c[(size_t)i * V + v] > c[(size_t)i * V + ac]) ac = v;
        }
        *argmax_same += ag == ac;
    }
    return w;
}

/* prefill n (all logits) + `steps` decode steps, GPU vs CPU, one row. */
static void parity(tqkv_format f, int window, double tol_prefill, double tol_decode) {
    const int V = tqkv_model_get_config(g_model)->vocab_size, n = 150, steps = 12;
    test_rng r;
    rng_init(&r, g_seed ^ (uint64_t)f * 77);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(n + steps));
    float *lg = malloc(sizeof(float) * (size_t)n * V), *lc = malloc(sizeof(float) * (size_t)n * V);
    random_tokens(&r, tok, (size_t)(n + steps), V);
    tqkv_model_state *sg = new_state(1, f, window, 1), *sc = new_state(1, f, window, 0);
    assert_int_equal(tqkv_model_prefill(g_model, sg, tok, NULL, n, TQKV_LOGITS_ALL, lg), TQKV_OK);
    assert_int_equal(tqkv_model_prefill(g_model, sc, tok, NULL, n, TQKV_LOGITS_ALL, lc), TQKV_OK);
    int same = 0;
    double wp = worst_rel(lg, lc, n, V, &same);
    printf("%s window %d: prefill %d: worst rel L2 %.3g, argmax equal %d/%d\n",
           tqkv_format_name(f), window, n, wp, same, n);
    if (!(wp < tol_prefill)) fail_msg("prefill logits GPU vs CPU: rel L2 %g >= %g", wp, tol_prefill);
    double wd = 0;
    int dsame = 0;
    for (int i = 0; i < steps; i++) {
        assert_int_equal(tqkv_model_decode(g_model, sg, tok + n + i, lg), TQKV_OK);
        assert_int_equal(tqkv_model_decode(g_model, sc, tok + n + i, lc), TQKV_OK);
        int s1 = 0;
        double e = worst_rel(lg, lc, 1, V, &s1);
        dsame += s1;
        if (!(e <= wd)) wd = e;
    }
    int off = -1;
    assert_int_equal(tqkv_model_state_offsets(sg, &off), TQKV_OK);
    assert_int_equal(off, n + steps);
    printf("%s window %d: decode %d steps: worst rel L2 %.3g, argmax equal %d/%d\n",
           tqkv_format_name(f), window, steps, wd, dsame, steps);
    if (!(wd < tol_decode)) fail_msg("decode logits GPU vs CPU: rel L2 %g >= %g", wd, tol_decode);
    tqkv_model_state_free(sg);
    tqkv_model_state_free(sc);
    free(tok); free(lg); free(lc);
}

/* Tolerances: the GPU GEMM sums in another order than the CPU's (f32, ~1e-6 relative per
 * product); f32 runs on a bf16 device cache (K/V rounded to bf16, ~4e-3 relative per value);
 * tq decode runs on fp16 tensor cores (queries, dequantized K/V and softmax weights in fp16),
 * and a key whose rounding differs by one code lands on a neighbouring centroid. */
static void test_parity_f32(void **st) { (void)st; parity(TQKV_F32, 0, 2e-2, 2e-2); }
static void test_parity_tq4(void **st) { (void)st; parity(TQKV_TQ4, 0, 3e-2, 4e-2); }
static void test_parity_tq3_window(void **st) { (void)st; parity(TQKV_TQ3, 32, 3e-2, 4e-2); }

/* Row alone vs the same row at position 2 of a 3-row batch: bitwise equal logits. */
static void invariance(tqkv_format f, int window) {
    const int V = tqkv_model_get_config(g_model)->vocab_size, n = 37, steps = 6, R = 3;
    test_rng r;
    rng_init(&r, g_seed ^ 0x5eed ^ (uint64_t)f);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)R * (n + steps));
    random_tokens(&r, tok, (size_t)R * (n + steps), V);
    /* row 2 of the batch is the single row: tokens [2][0..n+steps) */
    const int32_t *mine = tok + (size_t)2 * (n + steps);
    int32_t *pb = malloc(sizeof(int32_t) * (size_t)R * n), stepb[3];
    for (int q = 0; q < R; q++) memcpy(pb + (size_t)q * n, tok + (size_t)q * (n + steps), sizeof(int32_t) * n);
    float *l1 = malloc(sizeof(float) * (size_t)n * V), *lb = malloc(sizeof(float) * (size_t)R * n * V);
    tqkv_model_state *s1 = new_state(1, f, window, 1), *sb = new_state(R, f, window, 1);
    assert_int_equal(tqkv_model_prefill(g_model, s1, mine, NULL, n, TQKV_LOGITS_ALL, l1), TQKV_OK);
    assert_int_equal(tqkv_model_prefill(g_model, sb, pb, NULL, n, TQKV_LOGITS_ALL, lb), TQKV_OK);
    if (memcmp(l1, lb + (size_t)2 * n * V, sizeof(float) * (size_t)n * V))
        fail_msg("%s: prefill logits of a row alone differ from the row in a batch of 3",
                 tqkv_format_name(f));
    for (int i = 0; i < steps; i++) {
        for (int q = 0; q < R; q++) stepb[q] = tok[(size_t)q * (n + steps) + n + i];
        assert_int_equal(tqkv_model_decode(g_model, s1, mine + n + i, l1), TQKV_OK);
        assert_int_equal(tqkv_model_decode(g_model, sb, stepb, lb), TQKV_OK);
        if (memcmp(l1, lb + (size_t)2 * V, sizeof(float) * (size_t)V))
            fail_msg("%s: decode step %d logits of a row alone differ from the row in a batch",
                     tqkv_format_name(f), i);
    }
    /* a sanity check that the comparison can fail: row 0's logits differ from row 2's */
    assert_true(memcmp(lb, lb + (size_t)2 * V, sizeof(float) * (size_t)V) != 0);
    printf("%s window %d: row alone == row 2 of 3, bitwise (prefill %d, decode %d)\n",
           tqkv_format_name(f), window, n, steps);
    tqkv_model_state_free(s1);
    tqkv_model_state_free(sb);
    free(tok); free(pb); free(l1); free(lb);
}

static void test_invariance_f32(void **st) { (void)st; invariance(TQKV_F32, 0); }
static void test_invariance_tq4(void **st) { (void)st; invariance(TQKV_TQ4, 0); }
static void test_invariance_tq3_window(void **st) { (void)st; invariance(TQKV_TQ3, 16); }

static void test_padded_refused(void **st) {
    (void)st;
    const int V = tqkv_model_get_config(g_model)->vocab_size;
    tqkv_model_state *s = new_state(2, TQKV_TQ4, 0, 1);
    int32_t tok[2 * 8];
    for (int i = 0; i < 16; i++) tok[i] = 1 + i;
    int lengths[2] = {8, 5}, off[2] = {-1, -1};
    float *lg = malloc(sizeof(float) * 2 * (size_t)V);
    assert_int_equal(tqkv_model_prefill(g_model, s, tok, lengths, 8, TQKV_LOGITS_LAST, lg),
                     TQKV_EUNSUPPORTED);
    assert_int_equal(tqkv_model_state_offsets(s, off), TQKV_OK);
    assert_int_equal(off[0], 0);
    assert_int_equal(tqkv_model_prefill(g_model, s, tok, NULL, 8, TQKV_LOGITS_LAST, lg), TQKV_OK);
    assert_int_equal(tqkv_model_state_offsets(s, off), TQKV_OK);
    assert_int_equal(off[1], 8);
    assert_null(tqkv_model_state_layer(s, 0));
    free(lg);
    tqkv_model_state_free(s);
}

int main(void) {
    if (!tqkv_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    char d[1024];
    const char *env = getenv("TQKV_TEST_MODEL");
    if (env) snprintf(d, sizeof d, "%s", env);
    else source_path("models/qwen3-code-28m", d, sizeof d);
    struct stat sb;
    if (stat(d, &sb) != 0) {
        printf("SKIPPED: no model at %s\n", d);
        return 77;
    }
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.threads = 4;
    if (tqkv_model_load(&g_model, d, &lp) != TQKV_OK) {
        fprintf(stderr, "load failed: %s\n", tqkv_last_error());
        return 1;
    }
    g_seed = test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity_f32),
        cmocka_unit_test(test_parity_tq4),
        cmocka_unit_test(test_parity_tq3_window),
        cmocka_unit_test(test_invariance_f32),
        cmocka_unit_test(test_invariance_tq4),
        cmocka_unit_test(test_invariance_tq3_window),
        cmocka_unit_test(test_padded_refused),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tqkv_model_free(g_model);
    return rc;
}
#else
int main(void) {
    printf("SKIPPED: built without CUDA\n");
    return 77;
}
#endif
