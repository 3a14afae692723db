/*
 * test_sampler.c - token sampling: greedy, temperature, top-k, top-p, min-p, repetition
 * penalty, seeded reproducibility, and the sampled distribution against the exact one.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tqkv_model.h"

static tqkv_sampler *make(float temp, int top_k, float top_p, float min_p, float rep, uint64_t seed,
                          int vocab) {
    tqkv_sampler_params p = tqkv_sampler_params_default();
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repetition_penalty = rep;
    p.seed = seed;
    tqkv_sampler *s = NULL;
    assert_int_equal(tqkv_sampler_init(&s, &p, vocab), TQKV_OK);
    return s;
}

static int draw(tqkv_sampler *s, const float *logits, int vocab) {
    float *tmp = malloc(sizeof(float) * vocab);
    memcpy(tmp, logits, sizeof(float) * vocab);
    int t = -1;
    assert_int_equal(tqkv_sampler_sample(s, tmp, &t), TQKV_OK);
    free(tmp);
    assert_true(t >= 0 && t < vocab);
    return t;
}

static void test_greedy_and_filters(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    enum { V = 300 };
    float lg[V];
    rng_fill_normal(&r, lg, V, 2.0f);
    int best = 0;
    for (int i = 1; i < V; i++)
        if (lg[i] > lg[best]) best = i;
    tqkv_sampler *s = make(0, 0, 1, 0, 1, 1, V);
    assert_int_equal(draw(s, lg, V), best);
    tqkv_sampler_free(s);
    /* filters that leave one candidate act like greedy at any temperature */
    s = make(1.5f, 1, 1, 0, 1, test_seed(), V);
    for (int i = 0; i < 20; i++) assert_int_equal(draw(s, lg, V), best);
    tqkv_sampler_free(s);
    s = make(1.5f, 0, 1e-6f, 0, 1, test_seed(), V);
    for (int i = 0; i < 20; i++) assert_int_equal(draw(s, lg, V), best);
    tqkv_sampler_free(s);
    s = make(1.5f, 0, 1, 1.0f, 1, test_seed(), V);
    for (int i = 0; i < 20; i++) assert_int_equal(draw(s, lg, V), best);
    tqkv_sampler_free(s);
    /* ties: lowest id */
    float tie[4] = {1, 3, 3, 2};
    s = make(0, 0, 1, 0, 1, 0, 4);
    assert_int_equal(draw(s, tie, 4), 1);
    tqkv_sampler_free(s);
}

static void test_repetition_penalty(void **state) {
    (void)state;
    float lg[4] = {2.0f, 1.9f, -0.5f, -0.6f};
    tqkv_sampler *s = make(0, 0, 1, 0, 2.0f, 0, 4);
    assert_int_equal(draw(s, lg, 4), 0);
    assert_int_equal(tqkv_sampler_accept(s, 0), TQKV_OK);
    assert_int_equal(tqkv_sampler_accept(s, 0), TQKV_OK); /* counted once */
    assert_int_equal(draw(s, lg, 4), 1);                  /* 2.0 / 2 = 1.0 < 1.9 */
    float neg[4] = {-1.0f, -1.5f, -3.0f, -4.0f};
    tqkv_sampler_reset(s, 0);
    assert_int_equal(tqkv_sampler_accept(s, 0), TQKV_OK);
    assert_int_equal(draw(s, neg, 4), 1); /* -1 * 2 = -2 < -1.5 */
    assert_int_equal(tqkv_sampler_accept(s, 99), TQKV_ERANGE);
    tqkv_sampler_free(s);
}

static void test_reproducible(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 1);
    enum { V = 1000, N = 200 };
    float *lg = malloc(sizeof(float) * V);
    rng_fill_normal(&r, lg, V, 1.5f);
    int a[N], b[N], c[N];
    tqkv_sampler *s1 = make(0.8f, 40, 0.95f, 0.02f, 1.1f, 1234, V);
    tqkv_sampler *s2 = make(0.8f, 40, 0.95f, 0.02f, 1.1f, 1234, V);
    tqkv_sampler *s3 = make(0.8f, 40, 0.95f, 0.02f, 1.1f, 999, V);
    for (int i = 0; i < N; i++) {
        a[i] = draw(s1, lg, V);
        b[i] = draw(s2, lg, V);
        c[i] = draw(s3, lg, V);
        tqkv_sampler_accept(s1, a[i]);
        tqkv_sampler_accept(s2, b[i]);
        tqkv_sampler_accept(s3, c[i]);
    }
    assert_memory_equal(a, b, sizeof a);
    assert_true(memcmp(a, c, sizeof a) != 0);
    tqkv_sampler_free(s1);
    tqkv_sampler_free(s2);
    tqkv_sampler_free(s3);
    free(lg);
}

/* Empirical frequencies of n draws vs the exact probabilities p (chi-square, 6 sigma). */
static void check_freq(tqkv_sampler *s, const float *lg, int V, const double *p, int n) {
    int *cnt = calloc((size_t)V, sizeof(int));
    for (int i = 0; i < n; i++) cnt[draw(s, lg, V)]++;
    double chi = 0;
    int dof = -1;
    for (int v = 0; v < V; v++) {
        if (p[v] == 0) {
            assert_int_equal(cnt[v], 0);
            continue;
        }
        double e = p[v] * n;
        chi += (cnt[v] - e) * (cnt[v] - e) / e;
        dof++;
    }
    assert_true(dof >= 1);
    assert_true(chi < dof + 6 * sqrt(2.0 * dof) + 10);
    free(cnt);
}

static void test_distribution(void **state) {
    (void)state;
    enum { V = 6, N = 40000 };
    float lg[V] = {1.0f, 0.5f, 0.0f, -0.3f, -1.0f, 0.2f};
    double p[V], z = 0;
    /* temperature 0.7, no filters */
    for (int v = 0; v < V; v++) z += (p[v] = exp(lg[v] / 0.7));
    for (int v = 0; v < V; v++) p[v] /= z;
    tqkv_sampler *s = make(0.7f, 0, 1, 0, 1, test_seed(), V);
    check_freq(s, lg, V, p, N);
    tqkv_sampler_free(s);
    /* top-k 3 at temperature 1: renormalized over ids 0, 1, 5 */
    z = exp(1.0) + exp(0.5) + exp(0.2);
    double pk[V] = {exp(1.0) / z, exp(0.5) / z, 0, 0, 0, exp(0.2) / z};
    s = make(1.0f, 3, 1, 0, 1, test_seed() + 7, V);
    check_freq(s, lg, V, pk, N);
    tqkv_sampler_free(s);
    /* top-p: probabilities 0.5 0.3 0.15 0.05 -> top_p 0.7 keeps the first two (5:3) */
    float lp[4] = {(float)log(0.5), (float)log(0.3), (float)log(0.15), (float)log(0.05)};
    double pp[4] = {0.625, 0.375, 0, 0};
    s = make(1.0f, 0, 0.7f, 0, 1, test_seed() + 8, 4);
    check_freq(s, lp, 4, pp, N);
    tqkv_sampler_free(s);
    /* min-p 0.25: keeps p >= 0.125 -> 0.5, 0.3, 0.15 */
    double pm[4] = {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0};
    s = make(1.0f, 0, 1, 0.25f, 1, test_seed() + 9, 4);
    check_freq(s, lp, 4, pm, N);
    tqkv_sampler_free(s);
}

static void test_bad_params(void **state) {
    (void)state;
    tqkv_sampler_params p = tqkv_sampler_params_default();
    tqkv_sampler *s = NULL;
    p.temperature = -1;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL);
    p = tqkv_sampler_params_default();
    p.top_p = 0;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL);
    p = tqkv_sampler_params_default();
    p.repetition_penalty = 0;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL);
    p = tqkv_sampler_params_default();
    assert_int_equal(tqkv_sampler_init(&s, &p, 0), TQKV_EINVAL);
    assert_null(s);
}

/* NaN / inf logits: sampling refuses (every filter path), greedy still answers in range. */
static void test_non_finite(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 11);
    enum { V = 64 };
    float lg[V];
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    const float cfg[4][3] = {{1.0f, 1.0f, 0.0f}, {1.0f, 0.9f, 0.0f}, {1.0f, 1.0f, 0.1f},
                             {1.0f, 0.9f, 0.1f}}; /* temperature, top_p, min_p */
    for (int b = 0; b < 3; b++)
        for (int c = 0; c < 4; c++) {
            rng_fill_normal(&r, lg, V, 1.0f);
            if (b == 2) { /* all -inf: no finite candidate at all */
                for (int i = 0; i < V; i++) lg[i] = bad[b];
            } else {
                lg[rng_int(&r, 0, V - 1)] = bad[b];
            }
            tqkv_sampler *s = make(cfg[c][0], 0, cfg[c][1], cfg[c][2], 1, test_seed(), V);
            int t = -1;
            assert_int_equal(tqkv_sampler_sample(s, lg, &t), TQKV_EINVAL);
            assert_int_equal(t, -1);
            tqkv_sampler_free(s);
        }
    rng_fill_normal(&r, lg, V, 1.0f);
    lg[3] = NAN;
    tqkv_sampler *s = make(0, 0, 1, 0, 1, 0, V);
    int t = -1;
    assert_int_equal(tqkv_sampler_sample(s, lg, &t), TQKV_OK);
    assert_true(t >= 0 && t < V);
    tqkv_sampler_free(s);
    tqkv_sampler_reset(NULL, 0); /* no-op */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_and_filters), cmocka_unit_test(test_repetition_penalty),
        cmocka_unit_test(test_reproducible),       cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_bad_params),        cmocka_unit_test(test_non_finite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
