/*
 * test_sampler_openai.c - OpenAI's sampling parameters in the sampler: frequency_penalty,
 * presence_penalty (over the tokens accepted after tqkv_sampler_mark_prompt_end) and
 * logit_bias, against a float64 reference written here:
 *   l'[t] = l[t] - f * c[t] - p * (c[t] > 0) + bias[t]     (c: count among generated)
 * greedy picks on fresh random rows equal the reference argmax; sampled draws follow
 * the reference softmax; rows with these parameters are picked from the whole row
 * (sampler_pick_kind_of: FULL, the device path brings them to the host sampler); bad
 * parameters are refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/sample/sampler_impl.h"
#include "testutil.h"
#include "tqkv_model.h"

typedef struct {
    float   f, p;
    int32_t bias_ids[8];
    float   bias_vals[8];
    int     n_bias;
    int32_t prompt[16];
    int     n_prompt;
    int32_t gen[40];
    int     n_gen;
} pcase;

static void make_case(test_rng *r, pcase *c, int V) {
    memset(c, 0, sizeof *c);
    c->f = (float)(rng_uniform(r) * 4 - 2);
    c->p = (float)(rng_uniform(r) * 4 - 2);
    c->n_bias = rng_int(r, 0, 8);
    for (int i = 0; i < c->n_bias; i++) {
        int id, dup;
        do { /* distinct ids */
            id = rng_int(r, 0, V - 1);
            dup = 0;
            for (int k = 0; k < i; k++) dup |= c->bias_ids[k] == id;
        } while (dup);
        c->bias_ids[i] = id;
        c->bias_vals[i] = (float)(rng_uniform(r) * 10 - 5);
    }
    c->n_prompt = rng_int(r, 0, 16);
    for (int i = 0; i < c->n_prompt; i++) c->prompt[i] = rng_int(r, 0, V - 1);
    c->n_gen = rng_int(r, 0, 40);
    /* few distinct tokens, so counts above 1 are common */
    for (int i = 0; i < c->n_gen; i++) c->gen[i] = rng_int(r, 0, V / 4);
}

/* The reference: penalized logits in float64. */
static void reference(const pcase *c, const float *l, int V, double *out) {
    int *cnt = calloc((size_t)V, sizeof(int));
    for (int i = 0; i < c->n_gen; i++) cnt[c->gen[i]]++;
    for (int t = 0; t < V; t++) out[t] = (double)l[t] - (double)c->f * cnt[t] - (cnt[t] > 0 ? (double)c->p : 0.0);
    for (int i = 0; i < c->n_bias; i++) out[c->bias_ids[i]] += c->bias_vals[i];
    free(cnt);
}

static tqkv_sampler *make(const pcase *c, float temp, uint64_t seed, int V) {
    tqkv_sampler_params p = tqkv_sampler_params_default();
    p.temperature = temp;
    p.seed = seed;
    p.frequency_penalty = c->f;
    p.presence_penalty = c->p;
    p.bias_ids = c->bias_ids;
    p.bias_vals = c->bias_vals;
    p.n_bias = c->n_bias;
    tqkv_sampler *s = NULL;
    assert_int_equal(tqkv_sampler_init(&s, &p, V), TQKV_OK);
    for (int i = 0; i < c->n_prompt; i++) assert_int_equal(tqkv_sampler_accept(s, c->prompt[i]), TQKV_OK);
    tqkv_sampler_mark_prompt_end(s);
    for (int i = 0; i < c->n_gen; i++) assert_int_equal(tqkv_sampler_accept(s, c->gen[i]), TQKV_OK);
    return s;
}

static void test_greedy_matches_reference(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    const int V = 96;
    float l[96], tmp[96];
    double ref[96];
    int checked = 0, changed = 0;
    for (int it = 0; it < 3000; it++) {
        pcase c;
        make_case(&r, &c, V);
        rng_fill_normal(&r, l, (size_t)V, 2.0f);
        reference(&c, l, V, ref);
        int best = 0;
        for (int t = 1; t < V; t++)
            if (ref[t] > ref[best]) best = t;
        /* skip near ties (float rounding may decide them either way) */
        int tie = 0;
        for (int t = 0; t < V; t++) tie |= t != best && fabs(ref[t] - ref[best]) < 1e-4;
        if (tie) continue;
        int raw_best = 0;
        for (int t = 1; t < V; t++)
            if (l[t] > l[raw_best]) raw_best = t;
        changed += raw_best != best;
        tqkv_sampler *s = make(&c, 0.0f, 1, V);
        assert_true(tqkv_sampler_needs_history(s) == (c.f != 0 || c.p != 0));
        int k = 0;
        assert_int_equal(sampler_pick_kind_of(s, 1024, &k), SAMPLER_PICK_FULL);
        memcpy(tmp, l, sizeof tmp);
        int t = -1;
        assert_int_equal(tqkv_sampler_sample(s, tmp, &t), TQKV_OK);
        if (t != best) fprintf(stderr, "case %d: f %g p %g: got %d want %d\n", it, c.f, c.p, t, best);
        assert_int_equal(t, best);
        /* the sampler's penalized row equals the reference within float rounding */
        for (int v = 0; v < V; v++) assert_true(fabs((double)tmp[v] - ref[v]) < 1e-4 * (1 + fabs(ref[v])));
        /* a second pick on the same history gives the same (the scratch counts reset) */
        memcpy(tmp, l, sizeof tmp);
        assert_int_equal(tqkv_sampler_sample(s, tmp, &t), TQKV_OK);
        assert_int_equal(t, best);
        tqkv_sampler_free(s);
        checked++;
    }
    fprintf(stderr, "checked %d rows, %d with a different argmax than the raw logits\n", checked, changed);
    assert_true(checked > 2500);
    assert_true(changed > 300); /* the parameters mattered */
}

/* Prompt tokens before the mark are not penalized; without the mark all history is. */
static void test_prompt_not_counted(void **state) {
    (void)state;
    const int V = 8;
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 1.0f};
    pcase c;
    memset(&c, 0, sizeof c);
    c.f = 2.0f;
    c.prompt[0] = 7;
    c.n_prompt = 1;
    tqkv_sampler *s = make(&c, 0.0f, 1, V);
    float tmp[8];
    memcpy(tmp, l, sizeof tmp);
    int t = -1;
    assert_int_equal(tqkv_sampler_sample(s, tmp, &t), TQKV_OK);
    assert_int_equal(t, 7); /* the prompt's 7 is not penalized */
    assert_int_equal(tqkv_sampler_accept(s, 7), TQKV_OK);
    memcpy(tmp, l, sizeof tmp);
    assert_int_equal(tqkv_sampler_sample(s, tmp, &t), TQKV_OK);
    assert_int_equal(t, 0); /* generated once: 1 - 2 < 0 */
    assert_true(tmp[7] == -1.0f);
    tqkv_sampler_free(s);
}

/* Sampled draws (temperature 0.8) follow the reference softmax of the penalized row. */
static void test_sampled_distribution(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    const int V = 6, N = 40000;
    for (int rep = 0; rep < 4; rep++) {
        pcase c;
        memset(&c, 0, sizeof c);
        c.f = (float)(rng_uniform(&r) * 2 - 1);
        c.p = (float)(rng_uniform(&r) * 2 - 1);
        c.n_gen = 6;
        for (int i = 0; i < c.n_gen; i++) c.gen[i] = rng_int(&r, 0, 2);
        c.n_bias = 1;
        c.bias_ids[0] = rng_int(&r, 0, V - 1);
        c.bias_vals[0] = (float)(rng_uniform(&r) * 2 - 1);
        float l[6];
        rng_fill_normal(&r, l, (size_t)V, 1.0f);
        double ref[6], prob[6], z = 0;
        reference(&c, l, V, ref);
        for (int t = 0; t < V; t++) z += prob[t] = exp(ref[t] / 0.8);
        for (int t = 0; t < V; t++) prob[t] /= z;
        tqkv_sampler *s = make(&c, 0.8f, rng_u64(&r), V);
        int hits[6] = {0};
        float tmp[6];
        for (int i = 0; i < N; i++) {
            memcpy(tmp, l, sizeof tmp);
            int t = -1;
            assert_int_equal(tqkv_sampler_sample(s, tmp, &t), TQKV_OK);
            hits[t]++;
        }
        for (int t = 0; t < V; t++) {
            double sd = sqrt(prob[t] * (1 - prob[t]) / N);
            double got = (double)hits[t] / N;
            if (fabs(got - prob[t]) > 5 * sd + 1e-4)
                fail_msg("token %d: frequency %g, reference probability %g (5 sd = %g)", t, got, prob[t], 5 * sd);
        }
        tqkv_sampler_free(s);
    }
}

static void test_bad_params(void **state) {
    (void)state;
    tqkv_sampler *s = NULL;
    tqkv_sampler_params p = tqkv_sampler_params_default();
    int32_t ids[2] = {3, 3};
    float vals[2] = {1, 2};
    p.bias_ids = ids;
    p.bias_vals = vals;
    p.n_bias = 2;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL); /* repeated id */
    ids[1] = 10;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL); /* outside the vocab */
    ids[1] = 4;
    vals[1] = NAN;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL);
    p.n_bias = 0;
    p.frequency_penalty = INFINITY;
    assert_int_equal(tqkv_sampler_init(&s, &p, 10), TQKV_EINVAL);
    assert_null(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_matches_reference),
        cmocka_unit_test(test_prompt_not_counted),
        cmocka_unit_test(test_sampled_distribution),
        cmocka_unit_test(test_bad_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
