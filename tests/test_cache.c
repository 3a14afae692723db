/*
 * test_cache.c - the single-sequence cache: read-back per format (exact for f32, equal to
 * the codec's own round trip otherwise, q8 window included), chunking invariance, trim and
 * the recent window's exactness within window_slack, min_reusable_offset, byte accounting,
 * and the failure contract (status + message + unchanged bytes).
 */
#include "cache_helpers.h"

// ---------------------------------------------------------------------------
// Read-back
// ---------------------------------------------------------------------------

static void test_readback_f32_exact(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 1);
    int heads = rng_int(&r, 1, 3), dim = 32 << rng_int(&r, 0, 2), T = rng_int(&r, 1, 60);
    tqkv_cache_config cfg = cfg_make(TQKV_F32, TQKV_F32, heads, dim, 0, 0, rng_u64(&r));
    seq_t s = seq_make(&r, heads, T, dim);
    tqkv_cache *c = cache_fresh(&cfg, &s, T, &r);
    float *k = malloc((size_t)heads * T * dim * sizeof(float));
    float *v = malloc((size_t)heads * T * dim * sizeof(float));
    assert_int_equal(tqkv_cache_read(c, 0, T, k, v), TQKV_OK);
    assert_memory_equal(k, s.k, (size_t)heads * T * dim * sizeof(float));
    assert_memory_equal(v, s.v, (size_t)heads * T * dim * sizeof(float));
    /* a sub-range */
    int t0 = rng_int(&r, 0, T - 1), n = rng_int(&r, 1, T - t0);
    float *ref = malloc((size_t)heads * n * dim * sizeof(float));
    assert_int_equal(tqkv_cache_read(c, t0, n, k, v), TQKV_OK);
    seq_slice(&s, s.k, t0, n, ref);
    assert_memory_equal(k, ref, (size_t)heads * n * dim * sizeof(float));
    free(ref);
    free(k);
    free(v);
    seq_free(&s);
    tqkv_cache_free(c);
}

/* Reference decode of one token x [dim] as the cache must hold it: the main format's
 * codec round trip, or (window) q8 of the rotated vector, un-rotated. Public codec API. */
static void ref_token(tqkv_format f, int dim, uint64_t seed, int from_window, const float *x,
                      float *out) {
    tqkv_codec *c = NULL, *q8 = NULL;
    assert_int_equal(tqkv_codec_init(&c, f, dim, seed), TQKV_OK);
    uint8_t buf[4096];
    if (!from_window) {
        assert_int_equal(tqkv_codec_encode(c, x, 1, buf), TQKV_OK);
        assert_int_equal(tqkv_codec_decode(c, buf, 1, out), TQKV_OK);
    } else {
        assert_int_equal(tqkv_codec_init(&q8, TQKV_Q8, dim, seed), TQKV_OK);
        float xr[512];
        memcpy(xr, x, (size_t)dim * sizeof(float));
        assert_int_equal(tqkv_codec_rotate(c, xr, 1), TQKV_OK);
        assert_int_equal(tqkv_codec_encode(q8, xr, 1, buf), TQKV_OK);
        assert_int_equal(tqkv_codec_decode(q8, buf, 1, out), TQKV_OK);
        assert_int_equal(tqkv_codec_unrotate(c, out, 1), TQKV_OK);
        tqkv_codec_free(q8);
    }
    tqkv_codec_free(c);
}

/* rel_l2 bound of one format on N(0,1) vectors (loose: the codec tests own the precise ones) */
static double format_bound(tqkv_format f) {
    switch (f) {
    case TQKV_F32: return 0.0;
    case TQKV_F16: return 1e-3;
    case TQKV_Q8: return 0.015;
    case TQKV_Q4: return 0.2;
    case TQKV_TQ4: return 0.15;
    case TQKV_TQ3: return 0.25;
    case TQKV_TQ2: return 0.45;
    default: return 0.0;
    }
}

static void test_readback_formats(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 2);
    const tqkv_format pairs[][2] = {
        {TQKV_F16, TQKV_F16}, {TQKV_Q8, TQKV_Q8}, {TQKV_Q4, TQKV_Q4},   {TQKV_TQ2, TQKV_TQ2},
        {TQKV_TQ3, TQKV_TQ3}, {TQKV_TQ4, TQKV_TQ4}, {TQKV_TQ4, TQKV_TQ3}, {TQKV_TQ4, TQKV_Q8},
        {TQKV_F16, TQKV_TQ3},
    };
    for (size_t pi = 0; pi < sizeof pairs / sizeof pairs[0]; pi++) {
        for (int win = 0; win < 2; win++) {
            int heads = rng_int(&r, 1, 2), dim = 32 << rng_int(&r, 0, 2), T = rng_int(&r, 12, 40);
            int window = win ? 8 : 0, slack = 4;
            uint64_t seed = rng_u64(&r);
            tqkv_cache_config cfg = cfg_make(pairs[pi][0], pairs[pi][1], heads, dim, window,
                                             slack, seed);
            seq_t s = seq_make(&r, heads, T, dim);
            tqkv_cache *c = cache_fresh(&cfg, &s, T, &r);
            float *k = malloc((size_t)heads * T * dim * sizeof(float));
            float *v = malloc((size_t)heads * T * dim * sizeof(float));
            assert_int_equal(tqkv_cache_read(c, 0, T, k, v), TQKV_OK);
            for (int pl = 0; pl < 2; pl++) {
                tqkv_format f = pairs[pi][pl];
                const float *got = pl ? v : k, *in = pl ? s.v : s.k;
                int has_win = window > 0 && tqkv_format_is_tq(f);
                for (int h = 0; h < heads; h++)
                    for (int t = 0; t < T; t++) {
                        size_t o = ((size_t)h * T + t) * dim;
                        int from_win = has_win && t >= T - window;
                        float ref[512];
                        ref_token(f, dim, seed, from_win, in + o, ref);
                        assert_memory_equal(got + o, ref, (size_t)dim * sizeof(float));
                        /* per token: only the q8 window is tight enough to bound (tq error
                         * per vector varies a lot at small dim; the aggregate is below) */
                        double e = rel_l2(got + o, in + o, (size_t)dim);
                        double bound = from_win ? 3 * format_bound(TQKV_Q8) : 1e9;
                        if (e > bound)
                            fail_msg("format %s window %d token %d: rel err %g > %g",
                                     tqkv_format_name(f), from_win, t, e, bound);
                    }
                /* aggregate error in float64 against the format's typical bound */
                double agg = rel_l2(got, in, (size_t)heads * T * dim);
                assert_true(agg <= format_bound(f) + 1e-12);
            }
            free(k);
            free(v);
            seq_free(&s);
            tqkv_cache_free(c);
        }
    }
}

/* The window holds q8 copies: reading with a window is closer to the input than without. */
static void test_window_improves_recent_tokens(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 3);
    int heads = 2, dim = 128, T = 48;
    seq_t s = seq_make(&r, heads, T, dim);
    tqkv_cache_config a = cfg_make(TQKV_TQ3, TQKV_TQ3, heads, dim, 16, 4, 7);
    tqkv_cache_config b = cfg_make(TQKV_TQ3, TQKV_TQ3, heads, dim, 0, 4, 7);
    tqkv_cache *ca = cache_fresh(&a, &s, T, &r), *cb = cache_fresh(&b, &s, T, &r);
    float *ka = malloc((size_t)heads * 16 * dim * 4), *va = malloc((size_t)heads * 16 * dim * 4);
    float *kb = malloc((size_t)heads * 16 * dim * 4), *vb = malloc((size_t)heads * 16 * dim * 4);
    float *ref = malloc((size_t)heads * 16 * dim * 4);
    assert_int_equal(tqkv_cache_read(ca, T - 16, 16, ka, va), TQKV_OK);
    assert_int_equal(tqkv_cache_read(cb, T - 16, 16, kb, vb), TQKV_OK);
    seq_slice(&s, s.k, T - 16, 16, ref);
    double ea = rel_l2(ka, ref, (size_t)heads * 16 * dim), eb = rel_l2(kb, ref, (size_t)heads * 16 * dim);
    assert_true(ea < 0.02);
    assert_true(eb > 0.1);
    free(ka); free(va); free(kb); free(vb); free(ref);
    tqkv_cache_free(ca);
    tqkv_cache_free(cb);
    seq_free(&s);
}

/* Feeding the same tokens in any chunking gives the same bytes. */
static void test_chunking_invariance(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 4);
    for (int it = 0; it < 6; it++) {
        tqkv_format f = (tqkv_format)rng_int(&r, 0, TQKV_FORMAT_COUNT - 1);
        int heads = rng_int(&r, 1, 3), dim = 64, T = rng_int(&r, 1, 50);
        tqkv_cache_config cfg = cfg_make(f, TQKV_TQ3, heads, dim, rng_int(&r, 0, 6), 3, rng_u64(&r));
        seq_t s = seq_make(&r, heads, T, dim);
        tqkv_cache *a = NULL, *b = NULL;
        assert_int_equal(tqkv_cache_init(&a, &cfg), TQKV_OK);
        assert_int_equal(tqkv_cache_init(&b, &cfg), TQKV_OK);
        cache_feed(a, &s, 0, T, &r, 1);
        cache_feed(b, &s, 0, T, &r, 17);
        assert_caches_same(a, b);
        tqkv_cache_free(a);
        tqkv_cache_free(b);
        seq_free(&s);
    }
}

// ---------------------------------------------------------------------------
// Trim and the recent window
// ---------------------------------------------------------------------------

/* A cache fed T tokens of s then cut by `cut`; trimmed further to every L, it must export
 * the bytes of a fresh cache fed L tokens exactly when L >= its min_reusable_offset (or
 * L == 0). Returns that offset. */
static int check_reusable(const tqkv_cache_config *cfg, const seq_t *s, int T, int cut,
                          test_rng *r) {
    tqkv_cache *base = cache_fresh(cfg, s, T, r);
    assert_int_equal(tqkv_cache_trim(base, cut), TQKV_OK);
    int mro = tqkv_cache_min_reusable_offset(base);
    tqkv_cache_free(base);
    for (int L = 0; L <= T - cut; L++) {
        tqkv_cache *c = cache_fresh(cfg, s, T, r);
        assert_int_equal(tqkv_cache_trim(c, cut), TQKV_OK);
        assert_int_equal(tqkv_cache_trim(c, T - cut - L), TQKV_OK);
        tqkv_cache *f = cache_fresh(cfg, s, L, r);
        blob x = blob_cache(c), y = blob_cache(f);
        if (blob_eq(x, y) != (L >= mro || L == 0))
            fail_msg("cut %d, L %d: exports %s, min_reusable_offset %d", cut, L,
                     blob_eq(x, y) ? "equal" : "differ", mro);
        blob_free(&x);
        blob_free(&y);
        tqkv_cache_free(c);
        tqkv_cache_free(f);
    }
    return mro;
}

static void test_window_trim_within_slack(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 5);
    const tqkv_format pairs[][2] = {{TQKV_TQ3, TQKV_TQ3}, {TQKV_TQ4, TQKV_TQ4},
                                    {TQKV_TQ4, TQKV_TQ3}, {TQKV_TQ2, TQKV_TQ4},
                                    {TQKV_TQ4, TQKV_Q8},  {TQKV_F16, TQKV_TQ3},
                                    {TQKV_Q4, TQKV_F32}};
    const int window = 8, slack = 4;
    for (size_t pi = 0; pi < sizeof pairs / sizeof pairs[0]; pi++) {
        int heads = rng_int(&r, 1, 2), dim = 64, T = rng_int(&r, 14, 40);
        tqkv_cache_config cfg = cfg_make(pairs[pi][0], pairs[pi][1], heads, dim, window, slack,
                                         rng_u64(&r));
        seq_t s = seq_make(&r, heads, T, dim);
        for (int cut = 0; cut <= slack; cut++) {
            tqkv_cache *c = cache_fresh(&cfg, &s, T, &r);
            assert_int_equal(tqkv_cache_trim(c, cut), TQKV_OK);
            assert_int_equal(tqkv_cache_length(c), T - cut);
            tqkv_cache *f = cache_fresh(&cfg, &s, T - cut, &r);
            assert_caches_same(c, f);
            /* and they stay identical when fed the same new tokens again */
            cache_feed(c, &s, T - cut, T, &r, 3);
            cache_feed(f, &s, T - cut, T, &r, 2);
            assert_caches_same(c, f);
            tqkv_cache_free(c);
            tqkv_cache_free(f);
        }
        /* beyond the slack: exact iff the target length >= min_reusable_offset */
        int windowed = tqkv_format_is_tq(pairs[pi][0]) || tqkv_format_is_tq(pairs[pi][1]);
        int mro = check_reusable(&cfg, &s, T, 0, &r);
        if (!windowed) assert_int_equal(mro, 0);
        else assert_int_equal(mro, T - slack); /* win_lo = T - ring, + window */
        /* a cache already cut deeper than its slack: no non-empty prefix (not even all of
         * it) reads like a fresh cache, and the threshold says so by exceeding the length */
        int deep = rng_int(&r, slack + 1, T - 1);
        mro = check_reusable(&cfg, &s, T, deep, &r);
        if (!windowed) assert_int_equal(mro, 0);
        else assert_true(mro > T - deep);
        /* nothing left the ring yet (length <= window + slack): any prefix is reusable */
        tqkv_cache *small = cache_fresh(&cfg, &s, rng_int(&r, 0, window + slack), &r);
        assert_int_equal(tqkv_cache_min_reusable_offset(small), 0);
        tqkv_cache_free(small);
        seq_free(&s);
    }
}

static void test_trim_then_read(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 6);
    int heads = 2, dim = 32, T = 30;
    tqkv_cache_config cfg = cfg_make(TQKV_F32, TQKV_F32, heads, dim, 0, 0, 1);
    seq_t s = seq_make(&r, heads, T, dim);
    tqkv_cache *c = cache_fresh(&cfg, &s, T, &r);
    int n = rng_int(&r, 0, T);
    assert_int_equal(tqkv_cache_trim(c, n), TQKV_OK);
    assert_int_equal(tqkv_cache_length(c), T - n);
    /* the trimmed tail is gone: appending a new token puts it at T - n */
    float *k = rand_floats(&r, (size_t)heads * dim), *v = rand_floats(&r, (size_t)heads * dim);
    assert_int_equal(tqkv_cache_append(c, k, v, 1), TQKV_OK);
    float *rk = malloc((size_t)heads * dim * 4), *rv = malloc((size_t)heads * dim * 4);
    assert_int_equal(tqkv_cache_read(c, T - n, 1, rk, rv), TQKV_OK);
    assert_memory_equal(rk, k, (size_t)heads * dim * 4);
    assert_memory_equal(rv, v, (size_t)heads * dim * 4);
    free(k); free(v); free(rk); free(rv);
    seq_free(&s);
    tqkv_cache_free(c);
}

// ---------------------------------------------------------------------------
// Accounting
// ---------------------------------------------------------------------------

static void test_bytes(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 7);
    for (int it = 0; it < 8; it++) {
        tqkv_format kf = (tqkv_format)rng_int(&r, 0, TQKV_FORMAT_COUNT - 1);
        tqkv_format vf = (tqkv_format)rng_int(&r, 0, TQKV_FORMAT_COUNT - 1);
        int heads = rng_int(&r, 1, 4), dim = 32 << rng_int(&r, 0, 4);
        int window = rng_int(&r, 0, 1) * rng_int(&r, 1, 10), slack = rng_int(&r, 0, 5);
        tqkv_cache_config cfg = cfg_make(kf, vf, heads, dim, window, slack, 3);
        const int ko = rng_int(&r, 0, 1); /* keys-only window: no V ring */
        cfg.window_keys_only = ko;
        tqkv_cache *c = NULL;
        assert_int_equal(tqkv_cache_init(&c, &cfg), TQKV_OK);
        double main = (double)heads * (double)(tqkv_format_bytes(kf, dim) + tqkv_format_bytes(vf, dim));
        assert_true(tqkv_cache_bytes_per_token(c) == main);
        int nwin = (window > 0) * (tqkv_format_is_tq(kf) + !ko * tqkv_format_is_tq(vf));
        int ring = nwin > 0 ? window + slack : 0;
        size_t q8 = tqkv_format_bytes(TQKV_Q8, dim);
        for (int tokens = 0; tokens < 40; tokens += 7) {
            size_t want = (size_t)tokens * (size_t)main +
                          (size_t)(tokens < ring ? tokens : ring) * heads * q8 * nwin;
            assert_int_equal(tqkv_cache_projected_bytes(c, tokens), want);
        }
        /* the batch's bytes_used agrees with the projection for a fresh row */
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, 2), TQKV_OK);
        int T = rng_int(&r, 1, 30);
        float *k = rand_floats(&r, (size_t)2 * heads * T * dim), *v = rand_floats(&r, (size_t)2 * heads * T * dim);
        assert_int_equal(tqkv_batch_append(b, k, v, T), TQKV_OK);
        assert_int_equal(tqkv_batch_bytes_used(b), 2 * tqkv_cache_projected_bytes(c, T));
        assert_true(tqkv_batch_bytes_per_token(b) == main);
        free(k);
        free(v);
        tqkv_batch_free(b);
        tqkv_cache_free(c);
    }
}

static void test_config_default(void **state) {
    (void)state;
    tqkv_cache_config c = tqkv_cache_config_default();
    assert_int_equal(c.kv_heads, 1);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.k_format, TQKV_TQ4);
    assert_int_equal(c.v_format, TQKV_TQ4);
    assert_int_equal(c.window, 0);
    assert_int_equal(c.window_slack, 32);
    assert_int_equal(c.window_keys_only, 0);
    for (int i = 0; i < 7; i++) assert_int_equal(c.reserved[i], 0);
    tqkv_cache *cc = NULL;
    assert_int_equal(tqkv_cache_init(&cc, &c), TQKV_OK);
    assert_int_equal(tqkv_cache_length(cc), 0);
    assert_int_equal(tqkv_cache_get_config(cc)->head_dim, 128);
    tqkv_cache_free(cc);
}

// ---------------------------------------------------------------------------
// Failures: status, message, unchanged bytes
// ---------------------------------------------------------------------------

static void test_bad_config(void **state) {
    (void)state;
    tqkv_cache_config base = cfg_make(TQKV_TQ4, TQKV_TQ3, 2, 64, 8, 4, 1);
    tqkv_cache_config bad[9];
    for (int i = 0; i < 9; i++) bad[i] = base;
    bad[0].kv_heads = 0;
    bad[1].head_dim = 48;
    bad[2].head_dim = 1024;
    bad[3].k_format = TQKV_FORMAT_COUNT;
    bad[4].v_format = (tqkv_format)-1;
    bad[5].window = -1;
    bad[6].window_slack = -3;
    bad[7].reserved[3] = 1;
    bad[8].window_keys_only = 2; /* 0 or 1 */
    for (int i = 0; i < 9; i++) {
        tqkv_cache *c = (tqkv_cache *)0x1;
        tqkv_batch *b = (tqkv_batch *)0x1;
        tqkv_clear_error();
        assert_int_equal(tqkv_cache_init(&c, &bad[i]), TQKV_EINVAL);
        assert_true(tqkv_last_error()[0] != 0);
        assert_ptr_equal(c, (tqkv_cache *)0x1);
        assert_int_equal(tqkv_batch_init(&b, &bad[i], 2), TQKV_EINVAL);
        assert_ptr_equal(b, (tqkv_batch *)0x1);
    }
    tqkv_cache *c = NULL;
    assert_int_equal(tqkv_cache_init(&c, NULL), TQKV_EINVAL);
    assert_int_equal(tqkv_cache_init(NULL, &base), TQKV_EINVAL);
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, &base, -1), TQKV_EINVAL);
}

static void test_single_bad_inputs(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 8);
    int heads = 2, dim = 64, T = 20;
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ3, heads, dim, 8, 4, 5);
    seq_t s = seq_make(&r, heads, T, dim);
    tqkv_cache *c = cache_fresh(&cfg, &s, T, &r);
    blob before = blob_cache(c);
    float *k = rand_floats(&r, (size_t)heads * 4 * dim), *v = rand_floats(&r, (size_t)heads * 4 * dim);
    float out[2 * 64 * 4];
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(c, k, v, 0), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(c, k, v, -3), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(c, NULL, v, 1), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(c, k, NULL, 1), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(NULL, k, v, 1), TQKV_EINVAL, before, blob_cache, c);
    /* non-finite input anywhere in the append is rejected, nothing is stored */
    int at = rng_int(&r, 0, heads * 4 * dim - 1);
    float keep = v[at];
    v[at] = NAN;
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(c, k, v, 4), TQKV_EINVAL, before, blob_cache, c);
    v[at] = keep;
    k[at] = -INFINITY;
    ASSERT_FAILS_UNCHANGED(tqkv_cache_append(c, k, v, 4), TQKV_EINVAL, before, blob_cache, c);
    k[at] = keep;
    ASSERT_FAILS_UNCHANGED(tqkv_cache_read(c, T - 1, 2, out, out), TQKV_ERANGE, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_read(c, -1, 1, out, out), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_read(c, 0, -1, out, out), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_read(c, 0, 1, NULL, out), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_trim(c, T + 1), TQKV_ERANGE, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_trim(c, -1), TQKV_EINVAL, before, blob_cache, c);
    ASSERT_FAILS_UNCHANGED(tqkv_cache_export(c, NULL, NULL), TQKV_EINVAL, before, blob_cache, c);
    /* a successful call still works afterwards */
    assert_int_equal(tqkv_cache_append(c, k, v, 4), TQKV_OK);
    assert_int_equal(tqkv_cache_length(c), T + 4);
    blob_free(&before);
    free(k);
    free(v);
    seq_free(&s);
    tqkv_cache_free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_readback_f32_exact),
        cmocka_unit_test(test_readback_formats),
        cmocka_unit_test(test_window_improves_recent_tokens),
        cmocka_unit_test(test_chunking_invariance),
        cmocka_unit_test(test_window_trim_within_slack),
        cmocka_unit_test(test_trim_then_read),
        cmocka_unit_test(test_bytes),
        cmocka_unit_test(test_config_default),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_single_bad_inputs),
    };
    test_seed();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
