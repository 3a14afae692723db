/*
 * test_attention.c - attention kernels over cache rows (src/attn).
 * Owns: agreement of the dense / deferred / fused kernel sets with each other and with a
 * float64 reference on the cache's decoded K/V (every format, GQA, windows, masks, SIMD
 * and scalar), bitwise batched-vs-single equality through prefill, decode steps and a
 * speculative round, bitwise batch invariance (padding, neighbours, thread count), and a
 * few bad inputs through the cache wrappers.
 * Must not: time anything.
 */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "cache/batch.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------
static tqkv_cache_config make_cfg(tqkv_format kf, tqkv_format vf, int kvh, int dim, int window,
                                  int slack, uint64_t seed) {
    tqkv_cache_config c = tqkv_cache_config_default();
    c.k_format = kf;
    c.v_format = vf;
    c.kv_heads = kvh;
    c.head_dim = dim;
    c.window = window;
    c.window_slack = slack;
    c.seed = seed;
    return c;
}

static void set_simd(int on) { setenv("TQKV_NO_SIMD", on ? "0" : "1", 1); }

/* Random K/V [rows, kvh, n, dim]. */
static float *rand_kv(test_rng *rng, int rows, int kvh, int n, int dim) {
    size_t cnt = (size_t)rows * kvh * n * dim;
    float *x = malloc(cnt * sizeof(float));
    assert_non_null(x);
    rng_fill_normal(rng, x, cnt, 1.0f);
    return x;
}

/* Row r of a batch input [rows, kvh, n, dim], tokens [t0, n) -> [kvh, n - t0, dim]. */
static float *row_slice(const float *x, int r, int kvh, int n, int dim, int t0) {
    float *o = malloc(sizeof(float) * (size_t)kvh * (n - t0) * dim + 1);
    assert_non_null(o);
    for (int h = 0; h < kvh; h++)
        memcpy(o + (size_t)h * (n - t0) * dim, x + (((size_t)r * kvh + h) * n + t0) * dim,
               sizeof(float) * (size_t)(n - t0) * dim);
    return o;
}

/* Left-padded prefill of rows with lengths len[r]; the data is kept in *kin / *vin
 * [rows, kvh, maxlen, dim]. */
static tqkv_batch *build_prefill(test_rng *rng, const tqkv_cache_config *cfg, int rows,
                                 const int *len, float **kin, float **vin, int *maxlen) {
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, cfg, rows), TQKV_OK);
    int mx = 0;
    for (int r = 0; r < rows; r++) mx = len[r] > mx ? len[r] : mx;
    float *k = rand_kv(rng, rows, cfg->kv_heads, mx, cfg->head_dim);
    float *v = rand_kv(rng, rows, cfg->kv_heads, mx, cfg->head_dim);
    assert_int_equal(tqkv_batch_prepare_prefill(b, len), TQKV_OK);
    assert_int_equal(tqkv_batch_append(b, k, v, mx), TQKV_OK);
    assert_int_equal(tqkv_batch_finalize_prefill(b), TQKV_OK);
    if (kin) *kin = k; else free(k);
    if (vin) *vin = v; else free(v);
    if (maxlen) *maxlen = mx;
    return b;
}

/* float64 attention on the cache's decoded K/V. out: [rows, qh, nq, dim]. Query i of a row
 * (token p = offset - nq + i) reads token t of a windowed plane from its q8 copy when
 * t >= max(p + 1 - window, batch_q8_lo), else from the main plane (batch.h). */
static void ref_attend_v(const tqkv_batch *b, const tqkv_mask *m, const float *q, int nq, int qh,
                         float scale, int v_main, double *out);
static void ref_attend(const tqkv_batch *b, const tqkv_mask *m, const float *q, int nq, int qh,
                       float scale, double *out) {
    ref_attend_v(b, m, q, nq, qh, scale, 0, out);
}

/* ref_attend, but v_main != 0 reads every value from the main plane (a keys-only window's
 * rule, taken from the configuration rather than from the cache's planes). */
static void ref_attend_v(const tqkv_batch *b, const tqkv_mask *m, const float *q, int nq, int qh,
                         float scale, int v_main, double *out) {
    const tqkv_cache_config *cfg = tqkv_batch_get_config(b);
    const int rows = tqkv_batch_rows(b), kvh = cfg->kv_heads, d = cfg->head_dim;
    const int cols = tqkv_batch_columns(b), G = qh / kvh;
    // per (row, head): main [cols, d] and q8-copy [cols, d] decodes, by token
    float *k = malloc(sizeof(float) * (size_t)cols * d + 1), *v = malloc(sizeof(float) * (size_t)cols * d + 1);
    float *kw = malloc(sizeof(float) * (size_t)cols * d + 1), *vw = malloc(sizeof(float) * (size_t)cols * d + 1);
    int *off = malloc(sizeof(int) * (size_t)rows), *lp = malloc(sizeof(int) * (size_t)rows);
    double *s = malloc(sizeof(double) * (size_t)cols + 1);
    assert_true(k && v && kw && vw && off && lp && s);
    assert_int_equal(tqkv_batch_offsets(b, off, lp), TQKV_OK);
    for (int r = 0; r < rows; r++) {
        const int q8lo = batch_q8_lo(b, r);
        for (int h = 0; h < kvh; h++) {
            for (int t = 0; t < off[r]; t++) {
                batch_decode_token(b, &b->k, r, h, t, 0, k + (size_t)t * d);
                batch_decode_token(b, &b->v, r, h, t, 0, v + (size_t)t * d);
                batch_decode_token(b, &b->k, r, h, t, t >= q8lo, kw + (size_t)t * d);
                batch_decode_token(b, &b->v, r, h, t, !v_main && t >= q8lo, vw + (size_t)t * d);
            }
            for (int g = 0; g < G; g++)
                for (int i = 0; i < nq; i++) {
                    const int hq = h * G + g;
                    const size_t qi = (((size_t)r * qh + hq) * nq + i) * d;
                    int lo = 0, hi = off[r];
                    if (m) {
                        lo = m->lo[(size_t)r * nq + i] - lp[r];
                        hi = m->hi[(size_t)r * nq + i] - lp[r];
                    }
                    int ws = off[r];
                    if (b->ring > 0) {
                        ws = off[r] - nq + i + 1 - cfg->window;
                        if (ws < q8lo) ws = q8lo;
                    }
                    double *o = out + qi;
                    for (int j = 0; j < d; j++) o[j] = 0;
                    if (lo >= hi) continue;
                    double mx = -INFINITY, sum = 0;
                    for (int t = lo; t < hi; t++) {
                        const float *kt = (t >= ws ? kw : k) + (size_t)t * d;
                        double a = 0;
                        for (int j = 0; j < d; j++) a += (double)q[qi + j] * kt[j];
                        s[t - lo] = a * scale;
                        if (s[t - lo] > mx) mx = s[t - lo];
                    }
                    for (int t = lo; t < hi; t++) {
                        const double p = exp(s[t - lo] - mx);
                        sum += p;
                        const float *vt = (t >= ws ? vw : v) + (size_t)t * d;
                        for (int j = 0; j < d; j++) o[j] += p * vt[j];
                    }
                    for (int j = 0; j < d; j++) o[j] /= sum;
                }
        }
    }
    free(k);
    free(v);
    free(kw);
    free(vw);
    free(off);
    free(lp);
    free(s);
}

static void attend(const tqkv_batch *b, const tqkv_mask *m, const float *q, int nq, int qh,
                   float scale, tqkv_kernel kern, int threads, float *out) {
    tqkv_attn_params p = {.q_heads = qh, .scale = scale, .kernel = kern, .threads = threads};
    tqkv_status st = tqkv_batch_attend(b, m, q, nq, &p, out);
    if (st != TQKV_OK) fail_msg("batch_attend: %s", tqkv_last_error());
}

static void single_attend(const tqkv_cache *c, const float *q, int nq, int qh, float scale,
                          tqkv_kernel kern, int threads, float *out) {
    tqkv_attn_params p = {.q_heads = qh, .scale = scale, .kernel = kern, .threads = threads};
    tqkv_status st = tqkv_cache_attend(c, q, nq, &p, out);
    if (st != TQKV_OK) fail_msg("cache_attend: %s", tqkv_last_error());
}

// ---------------------------------------------------------------------------
// Agreement: fused = deferred = dense = float64 reference
// ---------------------------------------------------------------------------
typedef struct {
    tqkv_format kf, vf;
    int kvh, qh, dim;
    int window, slack;   /* cache q8 window */
    int nq, mwin;        /* queries per row, mask window */
    float scale;         /* 0: 1/sqrt(dim) */
    int maxlen;          /* row lengths drawn from [1, maxlen] */
    int longrow;         /* if > 0, row 0 has this many tokens */
    int keys_only;       /* window_keys_only: the ring holds keys only */
} agree_case;

static const agree_case AGREE[] = {
    {TQKV_F32, TQKV_F32, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_F16, TQKV_F16, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_Q8, TQKV_Q8, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_Q4, TQKV_Q4, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_TQ2, TQKV_TQ2, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_TQ3, TQKV_TQ3, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_TQ4, TQKV_TQ4, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},
    {TQKV_F32, TQKV_F32, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_F16, TQKV_F16, 2, 8, 128, 0, 0, 9, 0, 0.3f, 150, 0, 0},
    {TQKV_Q8, TQKV_Q8, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_Q4, TQKV_Q4, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_TQ2, TQKV_TQ2, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_TQ3, TQKV_TQ3, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_TQ4, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_TQ3, 2, 2, 128, 8, 8, 1, 0, 0.2f, 150, 0, 0},     /* GQA 1:1, window */
    {TQKV_TQ4, TQKV_TQ3, 2, 2, 128, 8, 8, 21, 0, 0, 150, 0, 0},
    {TQKV_Q8, TQKV_TQ4, 2, 8, 128, 8, 4, 1, 0, 0, 150, 0, 0},
    {TQKV_Q8, TQKV_TQ4, 2, 8, 128, 8, 4, 6, 12, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_Q8, 1, 2, 128, 16, 8, 1, 24, 0, 150, 0, 0},       /* mask window, nq 1 */
    {TQKV_TQ3, TQKV_TQ3, 2, 8, 128, 8, 4, 17, 16, 0.5f, 150, 0, 0},
    {TQKV_TQ2, TQKV_TQ2, 1, 4, 128, 4, 4, 1, 0, 0.5f, 150, 0, 0},
    {TQKV_TQ4, TQKV_TQ4, 1, 8, 128, 0, 0, 1, 0, 0, 100, 0, 0},        /* GQA 8:1 */
    {TQKV_TQ3, TQKV_Q4, 2, 6, 128, 8, 8, 3, 0, 0, 100, 0, 0},         /* GQA 3:1 */
    {TQKV_TQ4, TQKV_TQ2, 1, 4, 64, 8, 8, 1, 0, 0, 150, 0, 0},         /* dim 64 */
    {TQKV_Q4, TQKV_TQ3, 1, 1, 32, 4, 4, 1, 0, 0, 150, 0, 0},          /* dim 32, 1:1 */
    {TQKV_Q4, TQKV_TQ3, 1, 1, 32, 4, 4, 5, 0, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_TQ4, 1, 4, 256, 8, 8, 2, 0, 0, 80, 0, 0},         /* dim 256 */
    {TQKV_TQ4, TQKV_TQ4, 2, 8, 128, 16, 8, 1, 0, 0, 100, 4500, 0},    /* long: KV segments */
    {TQKV_F16, TQKV_Q8, 1, 4, 128, 0, 0, 1, 1000, 0, 100, 2600, 0},   /* long + mask window */
    {TQKV_TQ3, TQKV_TQ3, 1, 4, 128, 8, 8, 70, 0, 0, 100, 700, 0},     /* several tiles */
    {TQKV_FP8, TQKV_FP8, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},        /* fp8 */
    {TQKV_FP8, TQKV_FP8, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_FP8, TQKV_TQ4, 2, 8, 128, 8, 4, 6, 12, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_FP8, 1, 4, 64, 8, 8, 1, 0, 0, 150, 0, 0},
    {TQKV_TQ1, TQKV_TQ1, 2, 8, 128, 0, 0, 1, 0, 0, 200, 0, 0},        /* tq1 */
    {TQKV_TQ1, TQKV_TQ1, 2, 8, 128, 0, 0, 9, 0, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_TQ1, 1, 4, 256, 8, 8, 3, 0, 0, 80, 0, 0},
    {TQKV_TQ1, TQKV_TQ2, 2, 2, 64, 8, 4, 17, 16, 0, 150, 0, 0},
    {TQKV_TQ4, TQKV_TQ3, 2, 2, 128, 8, 8, 21, 0, 0, 150, 0, 1},    /* keys-only window */
    {TQKV_TQ2, TQKV_TQ2, 2, 8, 128, 8, 4, 1, 0, 0, 150, 0, 1},
    {TQKV_TQ3, TQKV_TQ3, 1, 4, 128, 8, 8, 70, 0, 0, 100, 700, 1},
};

static void run_agree_case(const agree_case *c, uint64_t seed) {
    test_rng rng;
    rng_init(&rng, seed);
    const int rows = 3, d = c->dim;
    const float scale = c->scale > 0 ? c->scale : 1.0f / sqrtf((float)d);
    tqkv_cache_config cfg = make_cfg(c->kf, c->vf, c->kvh, d, c->window, c->slack, rng_u64(&rng));
    cfg.window_keys_only = c->keys_only;
    int len[3];
    for (int r = 0; r < rows; r++) len[r] = rng_int(&rng, 1, c->maxlen);
    if (c->longrow) len[0] = c->longrow;
    tqkv_batch *b = build_prefill(&rng, &cfg, rows, len, NULL, NULL, NULL);
    // decode steps: move the ring around
    const int steps = rng_int(&rng, 0, 20);
    for (int s = 0; s < steps; s++) {
        float *k = rand_kv(&rng, rows, c->kvh, 1, d), *v = rand_kv(&rng, rows, c->kvh, 1, d);
        assert_int_equal(tqkv_batch_append(b, k, v, 1), TQKV_OK);
        free(k);
        free(v);
    }
    float *k = rand_kv(&rng, rows, c->kvh, c->nq, d), *v = rand_kv(&rng, rows, c->kvh, c->nq, d);
    assert_int_equal(tqkv_batch_append(b, k, v, c->nq), TQKV_OK);
    free(k);
    free(v);
    tqkv_mask_lease *lease = NULL;
    const tqkv_mask *m = NULL;
    assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
    assert_int_equal(tqkv_batch_make_mask(b, lease, c->nq, c->mwin, &m), TQKV_OK);

    const size_t n = (size_t)rows * c->qh * c->nq * d;
    float *q = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n);
    float *first = malloc(sizeof(float) * n);
    double *ref = malloc(sizeof(double) * n);
    assert_true(q && out && first && ref);
    rng_fill_normal(&rng, q, n, 1.0f);
    ref_attend(b, m, q, c->nq, c->qh, scale, ref);

    double worst = 0, worst_x = 0;
    for (int simd = 1; simd >= 0; simd--) {
        set_simd(simd);
        for (int kern = TQKV_KERNEL_COUNT - 1; kern >= 0; kern--) {
            attend(b, m, q, c->nq, c->qh, scale, (tqkv_kernel)kern, 2, out);
            const double e = rel_l2_d(out, ref, n);
            if (e > worst) worst = e;
            if (e > 1e-4)
                fail_msg("%s/%s kvh %d qh %d d %d win %d nq %d mwin %d: %s %s vs float64 "
                         "rel L2 %.3g", tqkv_format_name(c->kf), tqkv_format_name(c->vf), c->kvh,
                         c->qh, d, c->window, c->nq, c->mwin, simd ? "avx2" : "scalar",
                         tqkv_kernel_name((tqkv_kernel)kern), e);
            if (simd && kern == TQKV_KERNEL_FUSED) {
                memcpy(first, out, sizeof(float) * n);
            } else {
                const double x = rel_l2(out, first, n);
                if (x > worst_x) worst_x = x;
                if (x > 1e-4)
                    fail_msg("%s/%s nq %d: %s %s vs avx2 fused rel L2 %.3g",
                             tqkv_format_name(c->kf), tqkv_format_name(c->vf), c->nq,
                             simd ? "avx2" : "scalar", tqkv_kernel_name((tqkv_kernel)kern), x);
            }
        }
    }
    set_simd(1);
    printf("  %-4s/%-4s kvh %d qh %d d %3d win %2d nq %2d mwin %4d len %4d,%4d,%4d: "
           "vs ref %.2e, vs fused %.2e\n",
           tqkv_format_name(c->kf), tqkv_format_name(c->vf), c->kvh, c->qh, d, c->window, c->nq,
           c->mwin, len[0], len[1], len[2], worst, worst_x);
    free(q);
    free(out);
    free(first);
    free(ref);
    tqkv_mask_lease_free(lease);
    tqkv_batch_free(b);
}

static void test_kernels_agree(void **state) {
    (void)state;
    const uint64_t seed = test_seed();
    for (size_t i = 0; i < sizeof AGREE / sizeof AGREE[0]; i++)
        run_agree_case(&AGREE[i], seed + 7919 * i);
}

// ---------------------------------------------------------------------------
// Batched vs single: bitwise
// ---------------------------------------------------------------------------
typedef struct {
    tqkv_format kf, vf;
    int kvh, qh, window, slack;
} bs_case;

static const bs_case BS[] = {
    {TQKV_TQ4, TQKV_TQ4, 2, 8, 8, 8},
    {TQKV_TQ3, TQKV_Q8, 2, 4, 16, 8},
    {TQKV_F16, TQKV_F16, 2, 2, 0, 0},
    {TQKV_Q4, TQKV_TQ2, 1, 4, 4, 4},
    {TQKV_FP8, TQKV_TQ3, 2, 4, 8, 8},
};

/* out_b [rows, qh, nq_b, d] row r, queries [i0, i0 + nq) vs out_s [qh, nq, d]: bitwise. */
static void expect_rows_equal(const float *out_b, int r, int qh, int nq_b, int i0,
                              const float *out_s, int nq, int d, const char *what) {
    for (int h = 0; h < qh; h++)
        for (int i = 0; i < nq; i++) {
            const float *x = out_b + (((size_t)r * qh + h) * nq_b + i0 + i) * d;
            const float *y = out_s + ((size_t)h * nq + i) * d;
            if (memcmp(x, y, sizeof(float) * (size_t)d))
                fail_msg("%s: row %d head %d query %d differs (%.9g vs %.9g)", what, r, h, i,
                         x[0], y[0]);
        }
}

static void run_bs_case(const bs_case *c, uint64_t seed, int simd) {
    test_rng rng;
    rng_init(&rng, seed);
    set_simd(simd);
    const int rows = 3, d = 128, qh = c->qh, kvh = c->kvh;
    const float scale = 1.0f / sqrtf((float)d);
    tqkv_cache_config cfg = make_cfg(c->kf, c->vf, kvh, d, c->window, c->slack, rng_u64(&rng));
    int len[3], mx;
    for (int r = 0; r < rows; r++) len[r] = rng_int(&rng, 1, 90);
    float *kin, *vin;
    tqkv_batch *b = build_prefill(&rng, &cfg, rows, len, &kin, &vin, &mx);
    tqkv_cache *single[3];
    for (int r = 0; r < rows; r++) {
        assert_int_equal(tqkv_cache_init(&single[r], &cfg), TQKV_OK);
        float *ks = row_slice(kin, r, kvh, mx, d, mx - len[r]);
        float *vs = row_slice(vin, r, kvh, mx, d, mx - len[r]);
        assert_int_equal(tqkv_cache_append(single[r], ks, vs, len[r]), TQKV_OK);
        free(ks);
        free(vs);
    }
    tqkv_mask_lease *lease = NULL;
    assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
    const size_t big = (size_t)rows * qh * mx * d;
    float *q = malloc(sizeof(float) * big), *ob = malloc(sizeof(float) * big);
    float *ob2 = malloc(sizeof(float) * big), *qs = malloc(sizeof(float) * big);
    float *os = malloc(sizeof(float) * big);
    assert_true(q && ob && ob2 && qs && os);
    char what[160];

    // 1. the prefill forward itself: nq = max length, padding queries see nothing
    {
        const tqkv_mask *m = NULL;
        assert_int_equal(tqkv_batch_make_mask(b, lease, mx, 0, &m), TQKV_OK);
        rng_fill_normal(&rng, q, big, 1.0f);
        for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++) {
            attend(b, m, q, mx, qh, scale, (tqkv_kernel)kern, 1, ob);
            attend(b, m, q, mx, qh, scale, (tqkv_kernel)kern, 3, ob2);
            snprintf(what, sizeof what, "%s/%s prefill %s threads 1 vs 3",
                     tqkv_format_name(c->kf), tqkv_format_name(c->vf),
                     tqkv_kernel_name((tqkv_kernel)kern));
            assert_memory_equal(ob, ob2, sizeof(float) * big);
            for (int r = 0; r < rows; r++) {
                const int pad = mx - len[r];
                for (int h = 0; h < qh; h++) {
                    for (int i = 0; i < pad; i++)   // padding queries: zeros
                        for (int j = 0; j < d; j++)
                            assert_true(ob[(((size_t)r * qh + h) * mx + i) * d + j] == 0.0f);
                    memcpy(qs + (size_t)h * len[r] * d, q + (((size_t)r * qh + h) * mx + pad) * d,
                           sizeof(float) * (size_t)len[r] * d);
                }
                single_attend(single[r], qs, len[r], qh, scale, (tqkv_kernel)kern, 2, os);
                snprintf(what, sizeof what, "%s/%s prefill %s", tqkv_format_name(c->kf),
                         tqkv_format_name(c->vf), tqkv_kernel_name((tqkv_kernel)kern));
                expect_rows_equal(ob, r, qh, mx, pad, os, len[r], d, what);
            }
        }
    }

    // 2. decode steps, 3. a speculative round with a per-row rollback, 4. decode again
    for (int phase = 0; phase < 3; phase++) {
        const int nsteps = phase == 1 ? 1 : 3;
        for (int s = 0; s < nsteps; s++) {
            const int n = phase == 1 ? 5 : 1;
            if (phase == 1) assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
            float *k = rand_kv(&rng, rows, kvh, n, d), *v = rand_kv(&rng, rows, kvh, n, d);
            assert_int_equal(tqkv_batch_append(b, k, v, n), TQKV_OK);
            for (int r = 0; r < rows; r++) {
                float *ks = row_slice(k, r, kvh, n, d, 0), *vs = row_slice(v, r, kvh, n, d, 0);
                assert_int_equal(tqkv_cache_append(single[r], ks, vs, n), TQKV_OK);
                free(ks);
                free(vs);
            }
            free(k);
            free(v);
            const tqkv_mask *m = NULL;
            assert_int_equal(tqkv_batch_make_mask(b, lease, n, 0, &m), TQKV_OK);
            const size_t nb = (size_t)rows * qh * n * d;
            rng_fill_normal(&rng, q, nb, 1.0f);
            for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++) {
                attend(b, m, q, n, qh, scale, (tqkv_kernel)kern, 1 + (s % 3), ob);
                attend(b, m, q, n, qh, scale, (tqkv_kernel)kern, 2, ob2);
                assert_memory_equal(ob, ob2, sizeof(float) * nb);
                for (int r = 0; r < rows; r++) {
                    single_attend(single[r], q + (size_t)r * qh * n * d, n, qh, scale,
                                  (tqkv_kernel)kern, 1, os);
                    snprintf(what, sizeof what, "%s/%s phase %d step %d %s",
                             tqkv_format_name(c->kf), tqkv_format_name(c->vf), phase, s,
                             tqkv_kernel_name((tqkv_kernel)kern));
                    expect_rows_equal(ob, r, qh, n, 0, os, n, d, what);
                }
            }
            if (phase == 1) {
                int keep[3];
                for (int r = 0; r < rows; r++) keep[r] = rng_int(&rng, 0, n);
                assert_int_equal(tqkv_batch_spec_rollback(b, keep, rows), TQKV_OK);
                for (int r = 0; r < rows; r++)
                    assert_int_equal(tqkv_cache_trim(single[r], n - keep[r]), TQKV_OK);
            }
        }
    }
    set_simd(1);
    for (int r = 0; r < rows; r++) tqkv_cache_free(single[r]);
    tqkv_mask_lease_free(lease);
    tqkv_batch_free(b);
    free(kin);
    free(vin);
    free(q);
    free(ob);
    free(ob2);
    free(qs);
    free(os);
}

static void test_batched_vs_single(void **state) {
    (void)state;
    const uint64_t seed = test_seed();
    for (size_t i = 0; i < sizeof BS / sizeof BS[0]; i++) run_bs_case(&BS[i], seed + 31 * i, 1);
    run_bs_case(&BS[0], seed + 1000, 0);   // scalar path too
}

// ---------------------------------------------------------------------------
// Batch invariance: a row beside others of other lengths / padding, any thread count
// ---------------------------------------------------------------------------
static void run_invariance(uint64_t seed, int simd, tqkv_format kf, tqkv_format vf, int window) {
    test_rng rng;
    rng_init(&rng, seed);
    set_simd(simd);
    const int d = 128, kvh = 2, qh = 8;
    const float scale = 0.11f;
    tqkv_cache_config cfg = make_cfg(kf, vf, kvh, d, window, 8, rng_u64(&rng));
    // row X (the one we watch) of length lx; batch A = [X, Y] (X longest: no padding),
    // batch B = [Z, W, X] (Z much longer: X padded), same data for X.
    const int lx = rng_int(&rng, 40, 300), ly = rng_int(&rng, 1, lx);
    const int lz = lx + rng_int(&rng, 50, 2500), lw = rng_int(&rng, 1, 400);
    const int la[2] = {lx, ly}, lb[3] = {lz, lw, lx};
    float *ka, *va, *kb, *vb;
    int ma, mb;
    tqkv_batch *A = build_prefill(&rng, &cfg, 2, la, &ka, &va, &ma);
    tqkv_batch *B = NULL;
    assert_int_equal(tqkv_batch_init(&B, &cfg, 3), TQKV_OK);
    mb = lz > lw ? lz : lw;   // the prefill append carries the longest row
    kb = rand_kv(&rng, 3, kvh, mb, d);
    vb = rand_kv(&rng, 3, kvh, mb, d);
    for (int h = 0; h < kvh; h++) {   // X's tokens into row 2 of B, right-aligned
        memcpy(kb + ((size_t)(2 * kvh + h) * mb + (mb - lx)) * d, ka + ((size_t)h * ma) * d,
               sizeof(float) * (size_t)lx * d);
        memcpy(vb + ((size_t)(2 * kvh + h) * mb + (mb - lx)) * d, va + ((size_t)h * ma) * d,
               sizeof(float) * (size_t)lx * d);
    }
    assert_int_equal(tqkv_batch_prepare_prefill(B, lb), TQKV_OK);
    if (tqkv_batch_append(B, kb, vb, mb) != TQKV_OK) fail_msg("append: %s", tqkv_last_error());
    assert_int_equal(tqkv_batch_finalize_prefill(B), TQKV_OK);

    tqkv_mask_lease *la_ = NULL, *lb_ = NULL;
    assert_int_equal(tqkv_mask_lease_init(&la_), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_init(&lb_), TQKV_OK);
    const int NQ[3] = {1, 1, 13};
    for (int step = 0; step < 3; step++) {
        const int n = NQ[step];
        float *k2 = rand_kv(&rng, 3, kvh, n, d), *v2 = rand_kv(&rng, 3, kvh, n, d);
        // A gets X's new tokens in row 0, B in row 2
        float *k1 = malloc(sizeof(float) * 2 * kvh * n * d), *v1 = malloc(sizeof(float) * 2 * kvh * n * d);
        assert_true(k1 && v1);
        memcpy(k1, k2 + (size_t)2 * kvh * n * d, sizeof(float) * kvh * n * d);
        memcpy(v1, v2 + (size_t)2 * kvh * n * d, sizeof(float) * kvh * n * d);
        memcpy(k1 + (size_t)kvh * n * d, k2, sizeof(float) * kvh * n * d);
        memcpy(v1 + (size_t)kvh * n * d, v2, sizeof(float) * kvh * n * d);
        assert_int_equal(tqkv_batch_append(A, k1, v1, n), TQKV_OK);
        assert_int_equal(tqkv_batch_append(B, k2, v2, n), TQKV_OK);
        free(k1);
        free(v1);
        free(k2);
        free(v2);
        const int mwin = step == 2 ? 37 : 0;
        const tqkv_mask *mA = NULL, *mB = NULL;
        assert_int_equal(tqkv_batch_make_mask(A, la_, n, mwin, &mA), TQKV_OK);
        assert_int_equal(tqkv_batch_make_mask(B, lb_, n, mwin, &mB), TQKV_OK);
        const size_t per = (size_t)qh * n * d;
        float *qa = malloc(sizeof(float) * 2 * per), *qb = malloc(sizeof(float) * 3 * per);
        float *oa = malloc(sizeof(float) * 2 * per), *obb = malloc(sizeof(float) * 3 * per);
        assert_true(qa && qb && oa && obb);
        rng_fill_normal(&rng, qb, 3 * per, 1.0f);
        memcpy(qa, qb + 2 * per, sizeof(float) * per);
        memcpy(qa + per, qb, sizeof(float) * per);
        for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++) {
            attend(A, mA, qa, n, qh, scale, (tqkv_kernel)kern, 1, oa);
            for (int th = 1; th <= 3; th++) {
                attend(B, mB, qb, n, qh, scale, (tqkv_kernel)kern, th, obb);
                if (memcmp(oa, obb + 2 * per, sizeof(float) * per))
                    fail_msg("%s/%s %s step %d (nq %d): row alone-ish vs padded beside longer "
                             "rows, threads %d: outputs differ", tqkv_format_name(kf),
                             tqkv_format_name(vf), tqkv_kernel_name((tqkv_kernel)kern), step, n,
                             th);
            }
        }
        free(qa);
        free(qb);
        free(oa);
        free(obb);
    }
    set_simd(1);
    tqkv_mask_lease_free(la_);
    tqkv_mask_lease_free(lb_);
    tqkv_batch_free(A);
    tqkv_batch_free(B);
    free(ka);
    free(va);
    free(kb);
    free(vb);
}

static void test_batch_invariance(void **state) {
    (void)state;
    const uint64_t seed = test_seed();
    run_invariance(seed, 1, TQKV_TQ4, TQKV_TQ4, 8);
    run_invariance(seed + 1, 1, TQKV_TQ3, TQKV_F16, 16);
    run_invariance(seed + 2, 1, TQKV_F32, TQKV_Q4, 0);
    run_invariance(seed + 3, 0, TQKV_TQ2, TQKV_TQ3, 8);
}

// ---------------------------------------------------------------------------
// Names and bad inputs
// ---------------------------------------------------------------------------
// ---------------------------------------------------------------------------
// Per-query window: a prefill (or chunked prefill) attends like token-by-token decoding
// ---------------------------------------------------------------------------
/* One row, n tokens fed in chunks of `chunk` (1 = decoding), each chunk attended with all of
 * its queries; out [n, qh, d] per query token. */
static void feed_chunks(const tqkv_cache_config *cfg, const float *k, const float *v,
                        const float *q, int n, int qh, int chunk, tqkv_kernel kern, float *out) {
    const int kvh = cfg->kv_heads, d = cfg->head_dim;
    tqkv_batch *b = NULL;
    tqkv_mask_lease *lease = NULL;
    assert_int_equal(tqkv_batch_init(&b, cfg, 1), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
    for (int a = 0; a < n; a += chunk) {
        const int c = n - a < chunk ? n - a : chunk;
        float *kc = malloc(sizeof(float) * (size_t)kvh * c * d), *vc = malloc(sizeof(float) * (size_t)kvh * c * d);
        float *qc = malloc(sizeof(float) * (size_t)qh * c * d), *oc = malloc(sizeof(float) * (size_t)qh * c * d);
        assert_true(kc && vc && qc && oc);
        for (int h = 0; h < kvh; h++)   // k, v: [kvh, n, d] -> [kvh, c, d]
            for (int i = 0; i < c; i++) {
                memcpy(kc + ((size_t)h * c + i) * d, k + ((size_t)h * n + a + i) * d, sizeof(float) * d);
                memcpy(vc + ((size_t)h * c + i) * d, v + ((size_t)h * n + a + i) * d, sizeof(float) * d);
            }
        for (int h = 0; h < qh; h++)    // q: [qh, n, d] -> [qh, c, d]
            memcpy(qc + (size_t)h * c * d, q + ((size_t)h * n + a) * d, sizeof(float) * (size_t)c * d);
        assert_int_equal(tqkv_batch_append(b, kc, vc, c), TQKV_OK);
        const tqkv_mask *m = NULL;
        assert_int_equal(tqkv_batch_make_mask(b, lease, c, 0, &m), TQKV_OK);
        attend(b, m, qc, c, qh, 1.0f / sqrtf((float)d), kern, 2, oc);
        for (int h = 0; h < qh; h++)
            for (int i = 0; i < c; i++)
                memcpy(out + ((size_t)(a + i) * qh + h) * d, oc + ((size_t)h * c + i) * d, sizeof(float) * d);
        free(kc);
        free(vc);
        free(qc);
        free(oc);
    }
    tqkv_mask_lease_free(lease);
    tqkv_batch_free(b);
}

static void test_prefill_window(void **state) {
    (void)state;
    test_rng rng;
    rng_init(&rng, test_seed() ^ 0x3d);
    const struct {
        tqkv_format kf, vf;
        int window, slack, n;
    } cases[] = {{TQKV_TQ4, TQKV_TQ3, 8, 4, 150}, {TQKV_TQ3, TQKV_Q8, 32, 32, 300},
                 {TQKV_FP8, TQKV_TQ2, 20, 0, 90}, {TQKV_TQ3, TQKV_TQ3, 70, 8, 200}};
    const int chunks[] = {0, 7, 33, 37, 64};   // 0: the whole prefill at once
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int kvh = 2, qh = 4, d = 128, n = cases[ci].n;
        tqkv_cache_config cfg = make_cfg(cases[ci].kf, cases[ci].vf, kvh, d, cases[ci].window,
                                         cases[ci].slack, rng_u64(&rng));
        float *k = rand_kv(&rng, 1, kvh, n, d), *v = rand_kv(&rng, 1, kvh, n, d);
        float *q = rand_kv(&rng, 1, qh, n, d);
        for (size_t i = 0; i < (size_t)qh * n * d; i++) q[i] *= 3.0f;   // peaky softmax
        const size_t no = (size_t)n * qh * d;
        float *dec = malloc(sizeof(float) * no), *pre = malloc(sizeof(float) * no);
        assert_true(dec && pre);
        feed_chunks(&cfg, k, v, q, n, qh, 1, TQKV_KERNEL_FUSED, dec);
        for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++)
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                feed_chunks(&cfg, k, v, q, n, qh, chunks[c] ? chunks[c] : n, (tqkv_kernel)kern, pre);
                double worst = 0;
                for (size_t i = 0; i < no; i++) worst = fmax(worst, fabs((double)pre[i] - dec[i]));
                fprintf(stderr, "  %s/%s window %d slack %d n %d chunk %d %s: max |prefill - "
                        "decode| %.2e\n", tqkv_format_name(cfg.k_format),
                        tqkv_format_name(cfg.v_format), cfg.window, cfg.window_slack, n,
                        chunks[c] ? chunks[c] : n, tqkv_kernel_name((tqkv_kernel)kern), worst);
                /* float reordering only; reading a query's window from the main plane
                 * instead would differ by the tq error (~1e-2) */
                assert_true(worst < 2e-5);
            }
        free(k);
        free(v);
        free(q);
        free(dec);
        free(pre);
    }
}

static void test_names_and_bad_inputs(void **state) {
    (void)state;
    for (int k = 0; k < TQKV_KERNEL_COUNT; k++) {
        tqkv_kernel x;
        assert_int_equal(tqkv_kernel_parse(tqkv_kernel_name((tqkv_kernel)k), &x), TQKV_OK);
        assert_int_equal(x, k);
    }
    tqkv_kernel x = TQKV_KERNEL_DENSE;
    assert_int_equal(tqkv_kernel_parse("fast", &x), TQKV_EINVAL);
    assert_true(strstr(tqkv_last_error(), "fast") != NULL);
    assert_int_equal(tqkv_kernel_parse(NULL, &x), TQKV_EINVAL);
    assert_string_equal(tqkv_kernel_name((tqkv_kernel)99), "unknown");

    tqkv_cache_config cfg = make_cfg(TQKV_TQ4, TQKV_TQ4, 2, 64, 0, 0, 1);
    tqkv_cache *c = NULL;
    assert_int_equal(tqkv_cache_init(&c, &cfg), TQKV_OK);
    test_rng rng;
    rng_init(&rng, test_seed());
    float *k = rand_kv(&rng, 1, 2, 4, 64), *v = rand_kv(&rng, 1, 2, 4, 64);
    assert_int_equal(tqkv_cache_append(c, k, v, 4), TQKV_OK);
    float q[3 * 64], out[3 * 64];
    rng_fill_normal(&rng, q, 3 * 64, 1.0f);
    tqkv_attn_params p = {.q_heads = 3, .scale = 0.125f, .kernel = TQKV_KERNEL_FUSED, .threads = 1};
    assert_int_equal(tqkv_cache_attend(c, q, 1, &p, out), TQKV_EINVAL);   // 3 % 2 != 0
    p.q_heads = 2;
    p.threads = 0;
    assert_int_equal(tqkv_cache_attend(c, q, 1, &p, out), TQKV_EINVAL);
    p.threads = 1;
    p.kernel = (tqkv_kernel)7;
    assert_int_equal(tqkv_cache_attend(c, q, 1, &p, out), TQKV_EINVAL);
    p.kernel = TQKV_KERNEL_DEFERRED;
    assert_int_equal(tqkv_cache_attend(c, q, 1, &p, out), TQKV_OK);
    free(k);
    free(v);
    tqkv_cache_free(c);
}

/* The prefill tiles' AVX-512 twins give the AVX2 kernels' bits on every lane: token counts
 * across the block sizes, lane ranges of 16 and 32 strips at offsets, dims with a 4 tail. */
static void test_avx512_tiles_bitwise(void **state) {
    (void)state;
    if (!tqkv_cpu_has_avx512() || !attn_isa_avx512()) {
        print_message("no AVX-512 on this CPU: nothing to compare\n");
        skip();
    }
    const attn_isa *a2 = attn_isa_avx2(), *a5 = attn_isa_avx512();
    test_rng rng;
    rng_init(&rng, test_seed() + 11);
    const int dims[] = {64, 128, 132}, ns[] = {1, 5, 7, 8, 13, 64}, lanes[][2] = {{0, 16}, {16, 64}, {0, 48}, {32, 96}};
    const int mp = 96;
    for (size_t di = 0; di < 3; di++)
        for (size_t ni = 0; ni < 6; ni++)
            for (size_t li = 0; li < 4; li++) {
                int dim = dims[di], n = ns[ni], l0 = lanes[li][0], l1 = lanes[li][1];
                size_t ldk = (size_t)dim + 4;
                float *k = malloc(sizeof(float) * n * ldk), *qt = malloc(sizeof(float) * dim * mp);
                float *s2 = malloc(sizeof(float) * n * mp), *s5 = malloc(sizeof(float) * n * mp);
                float *o2 = malloc(sizeof(float) * dim * mp), *o5 = malloc(sizeof(float) * dim * mp);
                rng_fill_normal(&rng, k, (size_t)n * ldk, 1.0f);
                rng_fill_normal(&rng, qt, (size_t)dim * mp, 1.0f);
                rng_fill_normal(&rng, o2, (size_t)dim * mp, 1.0f);
                memcpy(o5, o2, sizeof(float) * dim * mp);
                memset(s2, 0, sizeof(float) * n * mp);
                memset(s5, 0, sizeof(float) * n * mp);
                a2->tile_qk(k, ldk, n, dim, qt, mp, l0, l1, s2);
                a5->tile_qk(k, ldk, n, dim, qt, mp, l0, l1, s5);
                assert_memory_equal(s2, s5, sizeof(float) * n * mp);
                a2->tile_pv(k, ldk, n, dim, s2, mp, l0, l1, o2); /* k as v, scores as p */
                a5->tile_pv(k, ldk, n, dim, s5, mp, l0, l1, o5);
                assert_memory_equal(o2, o5, sizeof(float) * dim * mp);
                free(k); free(qt); free(s2); free(s5); free(o2); free(o5);
            }
}

/* A keys-only window: two caches fed the same tokens, one with a K and V window (B), one
 * with the keys' window only (A). A reads the keys' q8 copies and every value from its tq
 * plane: A's output is the float64 reference over B's bytes with V from the main plane, and
 * differs from B's (whose newest values come from their q8 copies); A holds one ring. */
static void test_keys_only_window(void **state) {
    (void)state;
    const int rows = 2, kvh = 2, qh = 4, d = 128, W = 16;
    const int len[2] = {90, 40};
    for (int nq = 1; nq <= 9; nq += 8) {
        test_rng ra, rb;
        const uint64_t seed = test_seed() + 31 * (uint64_t)nq;
        rng_init(&ra, seed);
        rng_init(&rb, seed);
        tqkv_cache_config ca = make_cfg(TQKV_TQ4, TQKV_TQ2, kvh, d, W, 4, 77), cb = ca;
        ca.window_keys_only = 1;
        tqkv_batch *a = build_prefill(&ra, &ca, rows, len, NULL, NULL, NULL);
        tqkv_batch *b = build_prefill(&rb, &cb, rows, len, NULL, NULL, NULL);
        assert_true(a->k.has_window && !a->v.has_window && b->k.has_window && b->v.has_window);
        float *k = rand_kv(&ra, rows, kvh, nq, d), *v = rand_kv(&ra, rows, kvh, nq, d);
        assert_int_equal(tqkv_batch_append(a, k, v, nq), TQKV_OK);
        assert_int_equal(tqkv_batch_append(b, k, v, nq), TQKV_OK);
        const size_t n = (size_t)rows * qh * nq * d, q8 = tqkv_format_bytes(TQKV_Q8, d);
        assert_int_equal(tqkv_batch_projected_bytes(b, 100) - tqkv_batch_projected_bytes(a, 100),
                         (size_t)kvh * q8 * (size_t)(W + 4)); /* one ring (V's) less */
        float *q = malloc(sizeof(float) * n), *oa = malloc(sizeof(float) * n);
        float *ob = malloc(sizeof(float) * n);
        double *ref = malloc(sizeof(double) * n);
        assert_true(q && oa && ob && ref);
        rng_fill_normal(&ra, q, n, 1.0f);
        tqkv_mask_lease *lease = NULL;
        const tqkv_mask *m = NULL; /* the rows are left-padded: a mask (the same for a and b) */
        assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
        assert_int_equal(tqkv_batch_make_mask(a, lease, nq, 0, &m), TQKV_OK);
        ref_attend_v(b, m, q, nq, qh, 0.1f, 1, ref);
        for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++) {
            attend(a, m, q, nq, qh, 0.1f, (tqkv_kernel)kern, 2, oa);
            attend(b, m, q, nq, qh, 0.1f, (tqkv_kernel)kern, 2, ob);
            const double ea = rel_l2_d(oa, ref, n), eab = rel_l2(oa, ob, n);
            printf("  keys-only nq %d %s: vs reference %.2e, vs K and V window %.2e\n", nq,
                   tqkv_kernel_name((tqkv_kernel)kern), ea, eab);
            assert_true(ea < 1e-4);
            assert_true(eab > 1e-3);
        }
        free(k); free(v); free(q); free(oa); free(ob); free(ref);
        tqkv_mask_lease_free(lease);
        tqkv_batch_free(a);
        tqkv_batch_free(b);
    }
}

/* Every kernel table has a decode, score and accumulate kernel for every format (a format
 * added to one table and not to another crashed on AVX-512 CPUs only). */
static void test_isa_tables_complete(void **state) {
    (void)state;
    const attn_isa *isas[] = {attn_isa_scalar(), attn_isa_avx2(), attn_isa_avx512()};
    for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
        if (!isas[i]) continue; /* not built for this target */
        for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
            if (!isas[i]->decode[f] || !isas[i]->score[f] || !isas[i]->accum[f])
                fail_msg("%s: format %s has no kernel", isas[i]->name,
                         tqkv_format_name((tqkv_format)f));
        }
        assert_non_null(isas[i]->tile_qk);
        assert_non_null(isas[i]->tile_pv);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_isa_tables_complete),
        cmocka_unit_test(test_avx512_tiles_bitwise),
        cmocka_unit_test(test_names_and_bad_inputs),
        cmocka_unit_test(test_kernels_agree),
        cmocka_unit_test(test_batched_vs_single),
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_prefill_window),
        cmocka_unit_test(test_keys_only_window),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
