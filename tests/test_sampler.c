/*
 * test_sampler.c - token sampling: greedy, temperature, top-k, top-p, min-p, repetition
 * penalty, seeded reproducibility, and the sampled distribution against the exact one;
 * the pieces of decode-and-pick (sampler_impl.h): the penalty window's tokens, and rows
 * finished from the device pick's results (its algorithm run by pick_ref.h) giving the
 * tokens, errors and RNG draws of tqkv_sampler_sample on fresh random rows.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/sample/pick.h"
#include "model/sample/sampler_impl.h"
#include "pick_ref.h"
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

// ---------------------------------------------------------------------------
// decode-and-pick: the host finish of device results equals tqkv_sampler_sample
// ---------------------------------------------------------------------------

static void test_penalty_tokens(void **state) {
    (void)state;
    tqkv_sampler *s = make(1.0f, 5, 1, 0, 1.3f, 1, 16);
    int32_t out[16];
    assert_int_equal(sampler_penalty_bound(s), 0); /* no history: nothing to penalize */
    assert_int_equal(sampler_penalty_tokens(s, out), 0);
    assert_true(sampler_penalty(s) == 1.0f);
    const int hist[6] = {5, 3, 5, 7, 3, 9};
    for (int i = 0; i < 6; i++) assert_int_equal(tqkv_sampler_accept(s, hist[i]), TQKV_OK);
    assert_int_equal(sampler_penalty_bound(s), 6);
    assert_int_equal(sampler_penalty_tokens(s, out), 4);
    assert_int_equal(out[0], 5);
    assert_int_equal(out[1], 3);
    assert_int_equal(out[2], 7);
    assert_int_equal(out[3], 9);
    assert_true(sampler_penalty(s) == 1.3f);
    tqkv_sampler_free(s);
    tqkv_sampler_params p = tqkv_sampler_params_default();
    p.repetition_penalty = 2.0f;
    p.penalty_last_n = 3;
    assert_int_equal(tqkv_sampler_init(&s, &p, 16), TQKV_OK);
    for (int i = 0; i < 6; i++) assert_int_equal(tqkv_sampler_accept(s, hist[i]), TQKV_OK);
    assert_int_equal(sampler_penalty_bound(s), 3);
    assert_int_equal(sampler_penalty_tokens(s, out), 3); /* window 7 3 9 */
    assert_int_equal(out[0], 7);
    assert_int_equal(out[1], 3);
    assert_int_equal(out[2], 9);
    assert_int_equal(sampler_penalty_tokens(s, out), 3); /* its marks were cleared */
    tqkv_sampler_free(s);
    s = make(1.0f, 5, 1, 0, 1.0f, 1, 16); /* penalty 1: nothing, whatever the history */
    assert_int_equal(tqkv_sampler_accept(s, 4), TQKV_OK);
    assert_int_equal(sampler_penalty_tokens(s, out), 0);
    tqkv_sampler_free(s);
}

static void test_pick_kind(void **state) {
    (void)state;
    struct {
        float temp;
        int   top_k, vocab;
        sampler_pick_kind kind;
        int   k;
    } c[] = {{0, 0, 100, SAMPLER_PICK_GREEDY, 1},    {0, 50, 100, SAMPLER_PICK_GREEDY, 1},
             {0.7f, 50, 100, SAMPLER_PICK_TOP_K, 50}, {0.7f, 0, 100, SAMPLER_PICK_FULL, 0},
             {0.7f, 100, 100, SAMPLER_PICK_FULL, 0},  {0.7f, 99, 100, SAMPLER_PICK_TOP_K, 99},
             {1.0f, 1024, 5000, SAMPLER_PICK_TOP_K, 1024},
             {1.0f, 1025, 5000, SAMPLER_PICK_FULL, 0}};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        tqkv_sampler *s = make(c[i].temp, c[i].top_k, 1, 0, 1, 0, c[i].vocab);
        int k = -1;
        assert_int_equal(sampler_pick_kind_of(s, PICK_TOP_K_MAX, &k), c[i].kind);
        assert_int_equal(k, c[i].k);
        tqkv_sampler_free(s);
    }
}

/* Brute force: ids of the k best of pen [V] / T by (value desc, id asc). */
static const float *g_ord_v;
static int ord_desc(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const float x = g_ord_v[i], y = g_ord_v[j];
    if (x > y || (x == y && i < j)) return -1;
    return x < y || (x == y && i > j) ? 1 : 0;
}

/* Sampler a picks from row with tqkv_sampler_sample; its twin b through the device path's
 * pieces (pick_ref_row, then sampler_finish_greedy / _top_k, or the full row). The
 * statuses, messages and tokens must be equal; returns the token (-1 on an error). */
static int compare_pick(tqkv_sampler *a, tqkv_sampler *b, const float *row, int V, int *n_topk) {
    float *x = malloc(sizeof(float) * (size_t)V), *y = malloc(sizeof(float) * (size_t)V);
    memcpy(x, row, sizeof(float) * (size_t)V);
    memcpy(y, row, sizeof(float) * (size_t)V);
    int ta = -1, tb = -1, k = 0;
    const tqkv_status sa = tqkv_sampler_sample(a, x, &ta);
    char msg_a[256];
    snprintf(msg_a, sizeof msg_a, "%s", tqkv_last_error());
    const sampler_pick_kind kind = sampler_pick_kind_of(b, PICK_TOP_K_MAX, &k);
    tqkv_status sb;
    if (kind == SAMPLER_PICK_FULL) {
        sb = tqkv_sampler_sample(b, y, &tb);
    } else {
        pick_row p = {kind == SAMPLER_PICK_GREEDY ? PICK_GREEDY : PICK_TOP_K, k, 0, 0,
                      kind == SAMPLER_PICK_TOP_K ? sampler_temperature(b) : 1.0f, 1.0f};
        int32_t *pen = malloc(sizeof(int32_t) * (size_t)(sampler_penalty_bound(b) + 1));
        p.pen_n = sampler_penalty_tokens(b, pen);
        p.penalty = sampler_penalty(b);
        const int stride = k;
        int32_t *rec = malloc(sizeof(int32_t) * PICK_REC_WORDS(stride));
        pick_ref_row(y, V, &p, pen, stride, rec);
        float *vals = (float *)(rec + 2 + stride);
        if (kind == SAMPLER_PICK_GREEDY) {
            sb = sampler_finish_greedy(rec[1] ? rec[2] : -1, vals[0], &tb);
        } else {
            const unsigned f = (unsigned)rec[0];
            const int finite = !(f & (PICK_F_NAN | PICK_F_POS_INF)) && (f & PICK_F_ABOVE_NEG_INF);
            if (finite) { /* the candidates are exactly the brute-force top k, in order */
                assert_int_equal(rec[1], k);
                float *v = malloc(sizeof(float) * (size_t)V);
                int32_t *ord = malloc(sizeof(int32_t) * (size_t)V);
                for (int i = 0; i < V; i++) v[i] = y[i] / p.temp, ord[i] = i;
                g_ord_v = v;
                qsort(ord, (size_t)V, sizeof(int32_t), ord_desc);
                for (int i = 0; i < k; i++)
                    if (rec[2 + i] != ord[i])
                        fail_msg("top-%d of %d: candidate %d is id %d, brute force %d", k, V, i,
                                 rec[2 + i], ord[i]);
                free(v);
                free(ord);
                (*n_topk)++;
            }
            /* the finish takes the candidates in any order: reversed */
            int32_t *ids = rec + 2;
            for (int i = 0; finite && i < k / 2; i++) {
                const int32_t ti = ids[i];
                const float tv = vals[i];
                ids[i] = ids[k - 1 - i], vals[i] = vals[k - 1 - i];
                ids[k - 1 - i] = ti, vals[k - 1 - i] = tv;
            }
            sb = sampler_finish_top_k(b, vals, ids, k, finite, &tb);
        }
        free(pen);
        free(rec);
    }
    if (sa != sb || (sa == TQKV_OK && ta != tb) || (sa != TQKV_OK && strcmp(msg_a, tqkv_last_error())))
        fail_msg("vocab %d kind %d: sampler %d (token %d, '%s'), device path %d (token %d, '%s')",
                 V, (int)kind, sa, ta, sa ? msg_a : "", sb, tb, sb ? tqkv_last_error() : "");
    free(x);
    free(y);
    return sa == TQKV_OK ? ta : -1;
}

/* Many fresh rows and parameter sets: greedy, top-k (ties, signed zeros, -inf, k up to the
 * limit), penalties with and without a window, top-p, min-p, NaN / +inf / overflow / all
 * -inf errors. Each sampler pair draws several rows in turn and takes the picked tokens
 * into its history, so an extra or missing RNG draw would show in later picks. */
static void test_finish_equals_sample(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 21);
    const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.6f};
    const int topks[] = {1, 2, 5, 40, 256, 1024, 0};
    const float topps[] = {1.0f, 0.9f, 0.5f}, minps[] = {0.0f, 0.05f, 0.3f};
    const float reps[] = {1.0f, 1.3f, 0.7f};
    int n_rows = 0, n_topk = 0, n_err = 0;
    float *row = malloc(sizeof(float) * 3000);
    for (int c = 0; c < 300; c++) {
        const int V = rng_int(&r, 2, c % 10 == 0 ? 3000 : 1200);
        tqkv_sampler_params p = tqkv_sampler_params_default();
        p.temperature = temps[rng_int(&r, 0, 4)];
        p.top_k = topks[rng_int(&r, 0, 6)];
        if (p.top_k >= V) p.top_k = rng_int(&r, 1, V - 1);
        p.top_p = topps[rng_int(&r, 0, 2)];
        p.min_p = minps[rng_int(&r, 0, 2)];
        p.repetition_penalty = reps[rng_int(&r, 0, 2)];
        p.penalty_last_n = rng_int(&r, 0, 1) ? 0 : 8;
        p.seed = rng_u64(&r);
        tqkv_sampler *a = NULL, *b = NULL;
        assert_int_equal(tqkv_sampler_init(&a, &p, V), TQKV_OK);
        assert_int_equal(tqkv_sampler_init(&b, &p, V), TQKV_OK);
        for (int h = rng_int(&r, 0, 20); h > 0; h--) {
            const int t = rng_int(&r, 0, V - 1);
            assert_int_equal(tqkv_sampler_accept(a, t), TQKV_OK);
            assert_int_equal(tqkv_sampler_accept(b, t), TQKV_OK);
        }
        for (int d = 0; d < 4; d++) {
            pick_ref_gen_row(&r, row, V, rng_int(&r, 0, 5));
            const int t = compare_pick(a, b, row, V, &n_topk);
            n_rows++;
            if (t < 0) {
                n_err++;
                continue;
            }
            assert_int_equal(tqkv_sampler_accept(a, t), TQKV_OK);
            assert_int_equal(tqkv_sampler_accept(b, t), TQKV_OK);
        }
        tqkv_sampler_free(a);
        tqkv_sampler_free(b);
    }
    /* a NULL sampler's greedy: sampler_argmax against the device path's argmax */
    for (int c = 0; c < 200; c++) {
        const int V = rng_int(&r, 1, 2500);
        pick_ref_gen_row(&r, row, V, rng_int(&r, 0, 5));
        int ta = -1, tb = -1;
        const tqkv_status sa = sampler_argmax(row, V, &ta);
        pick_row p = {PICK_GREEDY, 1, 0, 0, 1.0f, 1.0f};
        int32_t rec[PICK_REC_WORDS(1)];
        pick_ref_row(row, V, &p, NULL, 1, rec);
        float v;
        memcpy(&v, &rec[3], 4);
        assert_int_equal(sampler_finish_greedy(rec[1] ? rec[2] : -1, v, &tb), sa);
        if (sa == TQKV_OK) assert_int_equal(ta, tb);
    }
    printf("decode-and-pick finish == tqkv_sampler_sample on %d rows (%d top-k candidate sets "
           "checked, %d errors alike)\n", n_rows, n_topk, n_err);
    assert_true(n_topk > 100 && n_err > 10);
    free(row);
}

/* Exact ties and signed zeros decide the candidates' order: the order of ids is id asc
 * among equal values, and -0.0 ties with +0.0. */
static void test_finish_ties(void **state) {
    (void)state;
    enum { V = 10 };
    const float row[V] = {0.0f, -0.0f, 1.0f, 1.0f, -0.0f, 0.5f, 1.0f, 0.0f, -1.0f, 0.5f};
    for (int k = 1; k < V; k++) {
        pick_row p = {PICK_TOP_K, k, 0, 0, 0.7f, 1.0f};
        int32_t rec[PICK_REC_WORDS(V)];
        float y[V];
        memcpy(y, row, sizeof y);
        pick_ref_row(y, V, &p, NULL, V, rec);
        const int32_t want[V - 1] = {2, 3, 6, 5, 9, 0, 1, 4, 7};
        for (int i = 0; i < k; i++) assert_int_equal(rec[2 + i], want[i]);
        /* and the finish equals the sampler over several draws of one seed */
        tqkv_sampler *a = make(0.7f, k, 0.95f, 0.0f, 1, 77, V), *b = make(0.7f, k, 0.95f, 0.0f, 1, 77, V);
        for (int d = 0; d < 50; d++) {
            int n_topk = 0;
            compare_pick(a, b, row, V, &n_topk);
        }
        tqkv_sampler_free(a);
        tqkv_sampler_free(b);
    }
    /* two logits that differ but tie after the temperature (l / T rounds them to one
     * float): the CPU orders them by id, so the selection must key on l / T, not l */
    const float T = 3.0f;
    float lo = 1.6f, hi = 0.0f; /* l / 3 in [0.5, 1): a coarser grid than l's steps / 3 */
    for (int i = 0; i < 1000; i++, lo = nextafterf(lo, 2.0f))
        if (nextafterf(lo, 2.0f) / T == lo / T) {
            hi = nextafterf(lo, 2.0f);
            break;
        }
    assert_true(hi > lo);
    const float tie[4] = {-1.0f, lo, hi, 0.5f}; /* by l: 2 before 1; by l / T: 1 before 2 */
    pick_row p1 = {PICK_TOP_K, 1, 0, 0, T, 1.0f};
    int32_t rec1[PICK_REC_WORDS(1)];
    float y1[4];
    memcpy(y1, tie, sizeof y1);
    pick_ref_row(y1, 4, &p1, NULL, 1, rec1);
    assert_int_equal(rec1[2], 1);
    tqkv_sampler *a = make(T, 1, 1, 0, 1, 3, 4), *b = make(T, 1, 1, 0, 1, 3, 4);
    int n_topk = 0;
    assert_int_equal(compare_pick(a, b, tie, 4, &n_topk), 1);
    tqkv_sampler_free(a);
    tqkv_sampler_free(b);
    /* greedy: lowest id among the equal best, -0.0 == +0.0 */
    const float z[4] = {-0.0f, 0.0f, -1.0f, NAN};
    int t = -1;
    assert_int_equal(sampler_argmax(z, 4, &t), TQKV_OK);
    assert_int_equal(t, 0);
    assert_int_equal(sampler_finish_greedy(-1, 0.0f, &t), TQKV_EINVAL);
    assert_int_equal(sampler_finish_greedy(3, -INFINITY, &t), TQKV_EINVAL);
}

/* Bad candidate lists are refused and leave the sampler as it was (its penalty marks
 * cleared, no RNG draw). */
static void test_finish_refused(void **state) {
    (void)state;
    enum { V = 50 };
    tqkv_sampler *a = make(0.9f, 3, 1, 0, 1.5f, 5, V), *b = make(0.9f, 3, 1, 0, 1.5f, 5, V);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(tqkv_sampler_accept(a, i * 3), TQKV_OK);
        assert_int_equal(tqkv_sampler_accept(b, i * 3), TQKV_OK);
    }
    const float val[3] = {1.0f, 0.5f, 0.2f};
    const int32_t dup[3] = {4, 7, 4}, out[3] = {4, 7, V}, ok[3] = {4, 7, 9};
    int t = -1;
    assert_int_equal(sampler_finish_top_k(b, val, dup, 3, 1, &t), TQKV_EINVAL);
    assert_int_equal(sampler_finish_top_k(b, val, out, 3, 1, &t), TQKV_EINVAL);
    assert_int_equal(sampler_finish_top_k(b, val, ok, 2, 1, &t), TQKV_EINVAL); /* n != top_k */
    assert_int_equal(sampler_finish_top_k(b, NULL, ok, 3, 1, &t), TQKV_EINVAL);
    assert_int_equal(t, -1);
    tqkv_sampler *g = make(0, 0, 1, 0, 1, 0, V); /* greedy: not a top-k sampler */
    assert_int_equal(sampler_finish_top_k(g, val, ok, 3, 1, &t), TQKV_EINVAL);
    tqkv_sampler_free(g);
    test_rng r;
    rng_init(&r, test_seed() + 23);
    float row[V];
    int n_topk = 0;
    for (int d = 0; d < 20; d++) {
        rng_fill_normal(&r, row, V, 1.0f);
        compare_pick(a, b, row, V, &n_topk);
    }
    assert_int_equal(n_topk, 20);
    tqkv_sampler_free(a);
    tqkv_sampler_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_and_filters), cmocka_unit_test(test_repetition_penalty),
        cmocka_unit_test(test_reproducible),       cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_bad_params),        cmocka_unit_test(test_non_finite),
        cmocka_unit_test(test_penalty_tokens),    cmocka_unit_test(test_pick_kind),
        cmocka_unit_test(test_finish_equals_sample), cmocka_unit_test(test_finish_ties),
        cmocka_unit_test(test_finish_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
