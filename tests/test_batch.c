/*
 * test_batch.c - the batched cache: appends, row changes (merge / filter / extract / align)
 * as byte-exact round trips, left- and right-padded prefill, spec rounds against fresh
 * caches, random operation sequences against per-row mirror caches, masks against a
 * brute-force reference, the lease, donor capture, signatures and
 * the failure contract (status + message + unchanged bytes). Attention: test_cache_attend.c.
 */
#include "cache_helpers.h"
#include "util/keep_order.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

static const tqkv_format PAIRS[][2] = {
    {TQKV_TQ4, TQKV_TQ3}, {TQKV_TQ3, TQKV_TQ3}, {TQKV_TQ4, TQKV_Q8}, {TQKV_F32, TQKV_F16},
    {TQKV_Q4, TQKV_TQ2},
};
#define N_PAIRS ((int)(sizeof PAIRS / sizeof PAIRS[0]))

static tqkv_cache_config random_cfg(test_rng *r, int pair) {
    int window = rng_int(r, 0, 1) ? 8 : 0;
    return cfg_make(PAIRS[pair][0], PAIRS[pair][1], rng_int(r, 1, 2), 32 << rng_int(r, 0, 2),
                    window, 4, rng_u64(r));
}

// ---------------------------------------------------------------------------
// Appends
// ---------------------------------------------------------------------------

static void test_append_matches_singles(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 11);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 4), T = rng_int(&r, 1, 30);
        seq_t *s = seqs_make(&r, R, cfg.kv_heads, T, cfg.head_dim);
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
        assert_int_equal(tqkv_batch_rows(b), R);
        assert_int_equal(tqkv_batch_columns(b), 0);
        int t = 0;
        while (t < T) { /* decode and window appends mixed */
            int n = rng_int(&r, 1, 6);
            if (n > T - t) n = T - t;
            assert_int_equal(batch_feed(b, s, R, t, n), TQKV_OK);
            t += n;
        }
        int off[8], pad[8];
        assert_int_equal(tqkv_batch_offsets(b, off, pad), TQKV_OK);
        for (int i = 0; i < R; i++) {
            assert_int_equal(off[i], T);
            assert_int_equal(pad[i], 0);
            tqkv_cache *c = cache_fresh(&cfg, &s[i], T, &r);
            assert_row_is(b, i, c);
            tqkv_cache_free(c);
        }
        assert_int_equal(tqkv_batch_columns(b), T);
        assert_int_equal(tqkv_batch_offsets(b, NULL, NULL), TQKV_OK);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
    /* an empty batch (make_empty_batch) accepts appends and holds nothing */
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ4, 1, 32, 0, 0, 1);
    tqkv_batch *e = NULL;
    assert_int_equal(tqkv_batch_init(&e, &cfg, 0), TQKV_OK);
    assert_int_equal(tqkv_batch_rows(e), 0);
    assert_int_equal(tqkv_batch_append(e, NULL, NULL, 3), TQKV_OK);
    assert_int_equal(tqkv_batch_columns(e), 0);
    assert_int_equal(tqkv_batch_bytes_used(e), 0);
    tqkv_batch_free(e);
}

static void test_signature(void **state) {
    (void)state;
    struct { tqkv_format k, v; const char *sig; } cases[] = {
        {TQKV_TQ4, TQKV_TQ3, "kv:batched-tq:4:3"}, {TQKV_TQ2, TQKV_TQ2, "kv:batched-tq:2:2"},
        {TQKV_F16, TQKV_F16, "kv:batched-f16:f16"}, {TQKV_TQ4, TQKV_Q8, "kv:batched-tq4:q8"},
        {TQKV_F32, TQKV_Q4, "kv:batched-f32:q4"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tqkv_cache_config cfg = cfg_make(cases[i].k, cases[i].v, 1, 32, 0, 0, 0);
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, 1), TQKV_OK);
        assert_string_equal(tqkv_batch_signature(b), cases[i].sig);
        assert_int_equal(tqkv_batch_get_config(b)->k_format, cases[i].k);
        tqkv_batch_free(b);
    }
}

// ---------------------------------------------------------------------------
// Row changes
// ---------------------------------------------------------------------------

static void test_merge_extract_roundtrip(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 12);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 5), T = 30;
        seq_t *s = seqs_make(&r, R + 2, cfg.kv_heads, T, cfg.head_dim);
        int len[8];
        for (int i = 0; i < R; i++) len[i] = rng_int(&r, 0, T);
        tqkv_cache *singles[8];
        /* items: singles, then a 2-row batch fed in lockstep */
        tqkv_batch *pair = NULL;
        assert_int_equal(tqkv_batch_init(&pair, &cfg, 2), TQKV_OK);
        int plen = rng_int(&r, 1, T);
        assert_int_equal(batch_feed(pair, s + R, 2, 0, plen), TQKV_OK);
        tqkv_cache_ref refs[9];
        memset(refs, 0, sizeof refs);
        for (int i = 0; i < R; i++) {
            singles[i] = cache_fresh(&cfg, &s[i], len[i], &r);
            refs[i].single = singles[i];
        }
        refs[R].batch = pair;
        tqkv_batch *m = NULL;
        assert_int_equal(tqkv_batch_merge(&m, refs, R + 1), TQKV_OK);
        assert_int_equal(tqkv_batch_rows(m), R + 2);
        int off[10], pad[10], mx = plen;
        for (int i = 0; i < R; i++) if (len[i] > mx) mx = len[i];
        assert_int_equal(tqkv_batch_offsets(m, off, pad), TQKV_OK);
        for (int i = 0; i < R + 2; i++) {
            int want = i < R ? len[i] : plen;
            assert_int_equal(off[i], want);
            assert_int_equal(pad[i], mx - want); /* right-aligned */
        }
        assert_int_equal(tqkv_batch_columns(m), mx);
        for (int i = 0; i < R; i++) assert_row_is(m, i, singles[i]);
        for (int i = 0; i < 2; i++) {
            tqkv_cache *c = NULL;
            assert_int_equal(tqkv_batch_extract(pair, i, &c), TQKV_OK);
            assert_row_is(m, R + i, c);
            tqkv_cache_free(c);
        }
        /* merging leaves the items as they were: a second merge gives the same bytes */
        tqkv_batch *m2 = NULL;
        assert_int_equal(tqkv_batch_merge(&m2, refs, R + 1), TQKV_OK);
        blob b1 = blob_batch(m), b2 = blob_batch(m2);
        assert_true(blob_eq(b1, b2));
        blob_free(&b2);
        /* rows keep growing identically after the merge, and the batches share nothing */
        float *k = rand_floats(&r, (size_t)(R + 2) * cfg.kv_heads * 3 * cfg.head_dim);
        float *v = rand_floats(&r, (size_t)(R + 2) * cfg.kv_heads * 3 * cfg.head_dim);
        assert_int_equal(tqkv_batch_append(m, k, v, 3), TQKV_OK);
        for (int i = 0; i < R; i++) {
            assert_int_equal(tqkv_cache_append(singles[i], k + (size_t)i * cfg.kv_heads * 3 * cfg.head_dim,
                                               v + (size_t)i * cfg.kv_heads * 3 * cfg.head_dim, 3),
                             TQKV_OK);
            assert_row_is(m, i, singles[i]);
        }
        b2 = blob_batch(m2);
        assert_true(blob_eq(b1, b2));
        blob_free(&b1);
        blob_free(&b2);
        free(k);
        free(v);
        for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
        tqkv_batch_free(m);
        tqkv_batch_free(m2);
        tqkv_batch_free(pair);
        seqs_free(s, R + 2);
    }
}

static void test_filter(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 13);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 2, 6), T = 25;
        seq_t *s = seqs_make(&r, R, cfg.kv_heads, T, cfg.head_dim);
        int len[8];
        for (int i = 0; i < R; i++) len[i] = rng_int(&r, 0, T);
        tqkv_cache *singles[8];
        tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r);
        /* a random ordered subset */
        int perm[8];
        for (int i = 0; i < R; i++) perm[i] = i;
        for (int i = R - 1; i > 0; i--) {
            int j = rng_int(&r, 0, i), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        int n_keep = rng_int(&r, 1, R);
        assert_int_equal(tqkv_batch_filter(b, perm, n_keep), TQKV_OK);
        assert_int_equal(tqkv_batch_rows(b), n_keep);
        int off[8], pad[8], minpad = 1 << 30, mx = 0;
        assert_int_equal(tqkv_batch_offsets(b, off, pad), TQKV_OK);
        for (int i = 0; i < n_keep; i++) {
            assert_int_equal(off[i], len[perm[i]]);
            if (pad[i] < minpad) minpad = pad[i];
            if (len[perm[i]] > mx) mx = len[perm[i]];
            assert_row_is(b, i, singles[perm[i]]);
        }
        assert_int_equal(minpad, 0); /* common left padding removed */
        for (int i = 0; i < n_keep; i++) assert_int_equal(pad[i] + off[i], mx);
        /* filter to nothing */
        assert_int_equal(tqkv_batch_filter(b, NULL, 0), TQKV_OK);
        assert_int_equal(tqkv_batch_rows(b), 0);
        for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
}

static void test_align_roundtrip(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 14);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 5), T = 20;
        seq_t *s = seqs_make(&r, R, cfg.kv_heads, T, cfg.head_dim);
        int len[8];
        for (int i = 0; i < R; i++) len[i] = rng_int(&r, 0, T);
        tqkv_cache *singles[8];
        tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r);
        int pad0[8], pad1[8], got[8];
        assert_int_equal(tqkv_batch_offsets(b, NULL, pad0), TQKV_OK);
        blob before = blob_batch(b);
        for (int i = 0; i < R; i++) pad1[i] = rng_int(&r, 0, 40);
        assert_int_equal(tqkv_batch_align(b, pad1), TQKV_OK);
        assert_int_equal(tqkv_batch_offsets(b, NULL, got), TQKV_OK);
        assert_memory_equal(got, pad1, (size_t)R * sizeof(int));
        for (int i = 0; i < R; i++) assert_row_is(b, i, singles[i]);
        assert_int_equal(tqkv_batch_align(b, pad0), TQKV_OK);
        blob after = blob_batch(b);
        assert_true(blob_eq(before, after));
        blob_free(&before);
        blob_free(&after);
        for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
}

// ---------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------

static void test_prefill_left_padded(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 15);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 5), H = cfg.kv_heads, D = cfg.head_dim;
        int len[8], mx = 0;
        for (int i = 0; i < R; i++) {
            len[i] = rng_int(&r, 1, 24);
            if (len[i] > mx) mx = len[i];
        }
        seq_t *s = seqs_make(&r, R, H, mx, D);
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
        assert_int_equal(tqkv_batch_prepare_prefill(b, len), TQKV_OK);
        assert_int_equal(tqkv_batch_prepare_prefill(b, len), TQKV_ESTATE);
        assert_int_equal(tqkv_batch_finalize_prefill(b), TQKV_ESTATE); /* append first */
        assert_int_equal(tqkv_batch_spec_begin(b), TQKV_ESTATE);
        /* [R, H, mx, D]: row i's tokens after mx - len[i] padding tokens (NaN: never read) */
        size_t per = (size_t)H * mx * D;
        float *k = malloc(R * per * sizeof(float)), *v = malloc(R * per * sizeof(float));
        for (size_t j = 0; j < R * per; j++) k[j] = v[j] = NAN;
        for (int i = 0; i < R; i++)
            for (int h = 0; h < H; h++) {
                int pad = mx - len[i];
                memcpy(k + i * per + ((size_t)h * mx + pad) * D, s[i].k + (size_t)h * mx * D,
                       (size_t)len[i] * D * sizeof(float));
                memcpy(v + i * per + ((size_t)h * mx + pad) * D, s[i].v + (size_t)h * mx * D,
                       (size_t)len[i] * D * sizeof(float));
            }
        assert_int_equal(tqkv_batch_append(b, k, v, mx + 1), TQKV_EINVAL); /* n must be max */
        assert_int_equal(tqkv_batch_append(b, k, v, mx), TQKV_OK);
        assert_int_equal(tqkv_batch_export(b, &(uint8_t *){0}, &(size_t){0}), TQKV_ESTATE);
        assert_int_equal(tqkv_batch_finalize_prefill(b), TQKV_OK);
        assert_int_equal(tqkv_batch_finalize_prefill(b), TQKV_ESTATE);
        int off[8], pad[8];
        assert_int_equal(tqkv_batch_offsets(b, off, pad), TQKV_OK);
        for (int i = 0; i < R; i++) {
            assert_int_equal(off[i], len[i]);
            assert_int_equal(pad[i], mx - len[i]);
            /* seq i holds mx tokens; a fresh single fed its first len[i] */
            tqkv_cache *c = cache_fresh(&cfg, &s[i], len[i], &r);
            assert_row_is(b, i, c);
            tqkv_cache_free(c);
        }
        /* the prefill mask hides padding queries and padding columns */
        tqkv_mask_lease *l = NULL;
        const tqkv_mask *m = NULL;
        assert_int_equal(tqkv_mask_lease_init(&l), TQKV_OK);
        assert_int_equal(tqkv_batch_make_mask(b, l, mx, 0, &m), TQKV_OK);
        if (mx == 1) assert_null(m); /* one query, every row 1 token, no padding */
        else assert_non_null(m);
        for (int i = 0; i < R && m; i++)
            for (int q = 0; q < mx; q++) {
                int c = q, lo = m->lo[i * mx + q], hi = m->hi[i * mx + q];
                if (c < mx - len[i]) assert_int_equal(lo, hi);
                else {
                    assert_int_equal(lo, mx - len[i]);
                    assert_int_equal(hi, c + 1);
                }
            }
        tqkv_mask_lease_free(l);
        free(k);
        free(v);
        /* prepare needs empty rows */
        int one[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        blob before = blob_batch(b);
        ASSERT_FAILS_UNCHANGED(tqkv_batch_prepare_prefill(b, one), TQKV_ESTATE, before, blob_batch, b);
        blob_free(&before);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
    /* lengths must be >= 1 */
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ4, 1, 32, 0, 0, 0);
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, &cfg, 2), TQKV_OK);
    int bad[2] = {3, 0};
    assert_int_equal(tqkv_batch_prepare_prefill(b, bad), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_prepare_prefill(b, NULL), TQKV_EINVAL);
    tqkv_batch_free(b);
}

static void test_prefill_right_padded(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 16);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 5), T = rng_int(&r, 8, 24);
        seq_t *s = seqs_make(&r, R, cfg.kv_heads, T, cfg.head_dim);
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
        assert_int_equal(batch_feed(b, s, R, 0, T), TQKV_OK);
        int ends[8];
        for (int i = 0; i < R; i++) ends[i] = T - rng_int(&r, 0, cfg.window_slack);
        assert_int_equal(tqkv_batch_restore_prefill_ends(b, ends), TQKV_OK);
        for (int i = 0; i < R; i++) {
            tqkv_cache *c = cache_fresh(&cfg, &s[i], ends[i], &r);
            assert_row_is(b, i, c); /* exact: cut by <= window_slack */
            tqkv_cache_free(c);
        }
        blob before = blob_batch(b);
        ends[0] += 1;
        ASSERT_FAILS_UNCHANGED(tqkv_batch_restore_prefill_ends(b, ends), TQKV_ERANGE, before,
                               blob_batch, b);
        ends[0] = -1;
        ASSERT_FAILS_UNCHANGED(tqkv_batch_restore_prefill_ends(b, ends), TQKV_ERANGE, before,
                               blob_batch, b);
        blob_free(&before);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
}

// ---------------------------------------------------------------------------
// Spec rounds and trim
// ---------------------------------------------------------------------------

static void test_spec_rollback_equals_fresh(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 17);
    for (int p = 0; p < N_PAIRS; p++) {
        for (int mode = 0; mode < 3; mode++) { /* per-row keep, n_keep == 1, commit */
            tqkv_cache_config cfg = random_cfg(&r, p);
            int R = rng_int(&r, 1, 4), T0 = rng_int(&r, 1, 20), m = rng_int(&r, 1, 4);
            seq_t *s = seqs_make(&r, R, cfg.kv_heads, T0 + m, cfg.head_dim);
            tqkv_batch *b = NULL;
            assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
            assert_int_equal(batch_feed(b, s, R, 0, T0), TQKV_OK);
            assert_int_equal(tqkv_batch_spec_active(b), 0);
            assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
            assert_int_equal(tqkv_batch_spec_active(b), 1);
            assert_int_equal(tqkv_batch_spec_begin(b), TQKV_ESTATE);
            int t = T0;
            while (t < T0 + m) { /* drafted tokens: decode or window appends */
                int n = rng_int(&r, 1, T0 + m - t);
                assert_int_equal(batch_feed(b, s, R, t, n), TQKV_OK);
                t += n;
            }
            int keep[8], want[8];
            if (mode == 0) {
                for (int i = 0; i < R; i++) want[i] = T0 + (keep[i] = rng_int(&r, 0, m));
                assert_int_equal(tqkv_batch_spec_rollback(b, keep, R), TQKV_OK);
            } else if (mode == 1) {
                keep[0] = rng_int(&r, 0, m);
                for (int i = 0; i < R; i++) want[i] = T0 + keep[0];
                assert_int_equal(tqkv_batch_spec_rollback(b, keep, 1), TQKV_OK);
            } else {
                for (int i = 0; i < R; i++) want[i] = T0 + m;
                assert_int_equal(tqkv_batch_spec_commit(b), TQKV_OK);
            }
            assert_int_equal(tqkv_batch_spec_active(b), 0);
            assert_int_equal(tqkv_batch_spec_commit(b), TQKV_ESTATE);
            int off[8];
            assert_int_equal(tqkv_batch_offsets(b, off, NULL), TQKV_OK);
            for (int i = 0; i < R; i++) {
                assert_int_equal(off[i], want[i]);
                tqkv_cache *c = cache_fresh(&cfg, &s[i], want[i], &r);
                assert_row_is(b, i, c); /* m <= window_slack: exact */
                tqkv_cache_free(c);
            }
            tqkv_batch_free(b);
            seqs_free(s, R);
        }
    }
}

/* A spec round survives row changes (filter, align, capacity growth): spec_base moves
 * with its row, and rolling back afterwards still equals fresh caches. */
static void test_spec_survives_row_changes(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 25);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 2, 5), T0 = rng_int(&r, 1, 20), m = rng_int(&r, 1, 4);
        seq_t *s = seqs_make(&r, R, cfg.kv_heads, T0 + m, cfg.head_dim);
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
        assert_int_equal(batch_feed(b, s, R, 0, T0), TQKV_OK);
        assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
        assert_int_equal(batch_feed(b, s, R, T0, m), TQKV_OK);
        int perm[8], pads[8], keep[8];
        for (int i = 0; i < R; i++) perm[i] = R - 1 - i; /* reversed */
        int n_keep = rng_int(&r, 1, R);
        assert_int_equal(tqkv_batch_filter(b, perm, n_keep), TQKV_OK);
        for (int i = 0; i < n_keep; i++) pads[i] = rng_int(&r, 0, 40); /* forces growth */
        assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
        assert_int_equal(tqkv_batch_spec_active(b), 1);
        for (int i = 0; i < n_keep; i++) keep[i] = rng_int(&r, 0, m);
        assert_int_equal(tqkv_batch_spec_rollback(b, keep, n_keep), TQKV_OK);
        for (int i = 0; i < n_keep; i++) {
            tqkv_cache *c = cache_fresh(&cfg, &s[perm[i]], T0 + keep[i], &r);
            assert_row_is(b, i, c);
            tqkv_cache_free(c);
        }
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
}

static void test_trim_batch(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 18);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 4), T = 20, len[8], mn = T;
        seq_t *s = seqs_make(&r, R, cfg.kv_heads, T, cfg.head_dim);
        for (int i = 0; i < R; i++) {
            len[i] = rng_int(&r, 5, T);
            if (len[i] < mn) mn = len[i];
        }
        tqkv_cache *singles[8];
        tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r);
        blob before = blob_batch(b);
        ASSERT_FAILS_UNCHANGED(tqkv_batch_trim(b, mn + 1), TQKV_ERANGE, before, blob_batch, b);
        ASSERT_FAILS_UNCHANGED(tqkv_batch_trim(b, -1), TQKV_EINVAL, before, blob_batch, b);
        int n = rng_int(&r, 0, cfg.window_slack < mn ? cfg.window_slack : mn);
        assert_int_equal(tqkv_batch_trim(b, n), TQKV_OK);
        for (int i = 0; i < R; i++) {
            tqkv_cache *c = cache_fresh(&cfg, &s[i], len[i] - n, &r);
            assert_row_is(b, i, c);
            tqkv_cache_free(c);
            tqkv_cache_free(singles[i]);
        }
        blob_free(&before);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
}

/* Random sequences of batch operations mirrored on one single cache per row (rollback and
 * trim = single trim, row changes = bookkeeping, merge = a new single, export/restore of
 * both): after every step each row extracts to the bytes of its mirror, whatever the
 * window state (cuts beyond the slack included). */
static void test_random_ops_mirror_singles(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 26);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int H = cfg.kv_heads, D = cfg.head_dim, R = rng_int(&r, 1, 4);
        tqkv_cache *mir[8] = {0};
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
        for (int i = 0; i < R; i++) assert_int_equal(tqkv_cache_init(&mir[i], &cfg), TQKV_OK);
        int spec = 0, spec_base[8];
        for (int step = 0; step < 60; step++) {
            int op = rng_int(&r, 0, 7), off[8];
            assert_int_equal(tqkv_batch_offsets(b, off, NULL), TQKV_OK);
            int mn = 1 << 30;
            for (int i = 0; i < R; i++) mn = off[i] < mn ? off[i] : mn;
            if (op <= 1) { /* append n tokens to every row */
                int n = rng_int(&r, 1, 6);
                size_t per = (size_t)H * n * D;
                float *k = rand_floats(&r, (size_t)R * per), *v = rand_floats(&r, (size_t)R * per);
                assert_int_equal(tqkv_batch_append(b, k, v, n), TQKV_OK);
                for (int i = 0; i < R; i++)
                    assert_int_equal(tqkv_cache_append(mir[i], k + i * per, v + i * per, n), TQKV_OK);
                free(k);
                free(v);
            } else if (op == 2 && !spec) { /* trim, often beyond the slack */
                int n = rng_int(&r, 0, mn);
                assert_int_equal(tqkv_batch_trim(b, n), TQKV_OK);
                for (int i = 0; i < R; i++) assert_int_equal(tqkv_cache_trim(mir[i], n), TQKV_OK);
            } else if (op == 3) { /* spec round: begin, or end with a per-row rollback */
                if (!spec) {
                    assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
                    memcpy(spec_base, off, sizeof off);
                } else {
                    int keep[8];
                    for (int i = 0; i < R; i++) {
                        keep[i] = rng_int(&r, 0, off[i] - spec_base[i]);
                        int cut = off[i] - spec_base[i] - keep[i];
                        assert_int_equal(tqkv_cache_trim(mir[i], cut), TQKV_OK);
                    }
                    assert_int_equal(tqkv_batch_spec_rollback(b, keep, R), TQKV_OK);
                }
                spec = !spec;
            } else if (op == 4) { /* filter: a random ordered subset (the round survives) */
                int perm[8], nb[8], used[8] = {0}, n_keep = rng_int(&r, 1, R);
                tqkv_cache *nm[8];
                for (int i = 0; i < R; i++) perm[i] = i;
                for (int i = R - 1; i > 0; i--) {
                    int j = rng_int(&r, 0, i), t = perm[i];
                    perm[i] = perm[j];
                    perm[j] = t;
                }
                const int order = rng_int(&r, 0, 2);
                if (order == 1) /* in order: the in-place compaction */
                    for (int i = 1; i < n_keep; i++)
                        for (int j = i; j > 0 && perm[j - 1] > perm[j]; j--) {
                            int t = perm[j];
                            perm[j] = perm[j - 1];
                            perm[j - 1] = t;
                        }
                if (order == 2) { /* holes filled from the tail: in place, few rows moved */
                    unsigned char kept[8] = {0};
                    for (int i = 0; i < n_keep; i++) kept[perm[i]] = 1;
                    assert_int_equal(keep_fill_tail(kept, R, perm), n_keep);
                    assert_true(keep_in_place(perm, n_keep, R) != 0); /* taken in place */
                }
                assert_int_equal(tqkv_batch_filter(b, perm, n_keep), TQKV_OK);
                for (int i = 0; i < n_keep; i++) {
                    nm[i] = mir[perm[i]];
                    nb[i] = spec_base[perm[i]];
                    used[perm[i]] = 1;
                }
                for (int i = 0; i < R; i++)
                    if (!used[i]) tqkv_cache_free(mir[i]);
                R = n_keep;
                memcpy(mir, nm, (size_t)R * sizeof *mir);
                memcpy(spec_base, nb, (size_t)R * sizeof *spec_base);
            } else if (op == 5) { /* align to random pads */
                int pads[8];
                for (int i = 0; i < R; i++) pads[i] = rng_int(&r, 0, 6);
                assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
            } else if (op == 6 && !spec && R < 8) { /* merge in a new single */
                tqkv_cache *c = NULL;
                assert_int_equal(tqkv_cache_init(&c, &cfg), TQKV_OK);
                int n = rng_int(&r, 0, 20);
                if (n) {
                    float *k = rand_floats(&r, (size_t)H * n * D), *v = rand_floats(&r, (size_t)H * n * D);
                    assert_int_equal(tqkv_cache_append(c, k, v, n), TQKV_OK);
                    free(k);
                    free(v);
                }
                tqkv_cache_ref refs[2] = {{.batch = b}, {.single = c}};
                if (rng_int(&r, 0, 1)) { /* in place */
                    assert_int_equal(tqkv_batch_append_rows(b, refs + 1, 1), TQKV_OK);
                } else {
                    tqkv_batch *m = NULL;
                    assert_int_equal(tqkv_batch_merge(&m, refs, 2), TQKV_OK);
                    tqkv_batch_free(b);
                    b = m;
                }
                mir[R++] = c;
            } else if (op == 7 && !spec) { /* export -> restore, the mirrors too */
                blob x = blob_batch(b);
                tqkv_batch *b2 = NULL;
                assert_int_equal(tqkv_batch_restore(&b2, x.p, x.n), TQKV_OK);
                blob_free(&x);
                tqkv_batch_free(b);
                b = b2;
                for (int i = 0; i < R; i++) {
                    blob y = blob_cache(mir[i]);
                    tqkv_cache *c = NULL;
                    assert_int_equal(tqkv_cache_restore(&c, y.p, y.n), TQKV_OK);
                    blob_free(&y);
                    tqkv_cache_free(mir[i]);
                    mir[i] = c;
                }
            }
            assert_int_equal(tqkv_batch_rows(b), R);
            for (int i = 0; i < R; i++) assert_row_is(b, i, mir[i]);
        }
        for (int i = 0; i < R; i++) tqkv_cache_free(mir[i]);
        tqkv_batch_free(b);
    }
}

/* The in-place orders a filter accepts (util/keep_order.h): 1 increasing, 2 holes filled from
 * the tail, 0 anything else (a move would read a row already overwritten, or run concurrently
 * with another reading its destination) and indices out of range. */
static void test_keep_in_place(void **state) {
    (void)state;
    const struct { int n, rows, keep[4], want; } c[] = {
        {0, 0, {0}, 1},          {3, 3, {0, 1, 2}, 1},    {2, 3, {1, 2}, 1},
        {3, 4, {0, 3, 2}, 2},    {2, 4, {3, 1}, 2},       {2, 5, {3, 4}, 1},
        {2, 5, {4, 3}, 0},       {2, 3, {2, 0}, 0},       {2, 3, {0, 0}, 0},
        {2, 4, {3, 2}, 0},       {2, 3, {0, 3}, 0},       {1, 3, {-1}, 0},
        {3, 6, {5, 1, 4}, 0},    {3, 6, {4, 1, 5}, 2},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
        if (keep_in_place(c[i].keep, c[i].n, c[i].rows) != c[i].want)
            fail_msg("case %zu: keep_in_place = %d, want %d", i,
                     keep_in_place(c[i].keep, c[i].n, c[i].rows), c[i].want);
}

/* Rows joining in place: the held rows keep their bytes, the storage keeps its room after
 * an in-order filter (a server's rows come and go without new allocations), and refused
 * appends change nothing. */
static void test_append_rows_inplace(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 27);
    tqkv_cache_config cfg = random_cfg(&r, 0);
    const int H = cfg.kv_heads, D = cfg.head_dim;
    tqkv_batch *b = NULL;
    tqkv_cache *c[6] = {0};
    assert_int_equal(tqkv_batch_init(&b, &cfg, 0), TQKV_OK);
    for (int i = 0; i < 6; i++) {
        const int n = 3 + 5 * i;
        float *k = rand_floats(&r, (size_t)H * n * D), *v = rand_floats(&r, (size_t)H * n * D);
        assert_int_equal(tqkv_cache_init(&c[i], &cfg), TQKV_OK);
        assert_int_equal(tqkv_cache_append(c[i], k, v, n), TQKV_OK);
        free(k);
        free(v);
    }
    tqkv_cache_ref refs[6];
    for (int i = 0; i < 6; i++) refs[i] = (tqkv_cache_ref){.single = c[i]};
    assert_int_equal(tqkv_batch_append_rows(b, refs, 4), TQKV_OK); /* into an empty batch */
    for (int i = 0; i < 4; i++) assert_row_is(b, i, c[i]);
    const int keep[2] = {1, 3};
    assert_int_equal(tqkv_batch_filter(b, keep, 2), TQKV_OK);
    const size_t room = tqkv_batch_bytes_allocated(b);
    /* two rows join where two left, shorter than the longest held: no new storage */
    tqkv_cache_ref two[2] = {refs[0], refs[2]};
    assert_int_equal(tqkv_batch_append_rows(b, two, 2), TQKV_OK);
    assert_int_equal(tqkv_batch_bytes_allocated(b), room);
    const int want[4] = {1, 3, 0, 2};
    for (int i = 0; i < 4; i++) assert_row_is(b, i, c[want[i]]);
    /* refusals leave every row as it was */
    blob before = blob_batch(b);
    tqkv_cache_ref self = {.batch = b}, both = {.batch = b, .single = c[0]};
    assert_int_equal(tqkv_batch_append_rows(b, &self, 1), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_append_rows(b, &both, 1), TQKV_EINVAL);
    tqkv_cache_config other = cfg;
    other.seed ^= 1;
    tqkv_cache *o = NULL;
    assert_int_equal(tqkv_cache_init(&o, &other), TQKV_OK);
    tqkv_cache_ref oref = {.single = o};
    assert_int_equal(tqkv_batch_append_rows(b, &oref, 1), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "seed"));
    assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
    assert_int_equal(tqkv_batch_append_rows(b, refs + 5, 1), TQKV_ESTATE);
    assert_int_equal(tqkv_batch_spec_commit(b), TQKV_OK);
    blob after = blob_batch(b);
    assert_int_equal(after.n, before.n);
    assert_memory_equal(after.p, before.p, before.n);
    blob_free(&before);
    blob_free(&after);
    /* a row longer than every held one starts at column 0 and grows the columns */
    assert_int_equal(tqkv_batch_append_rows(b, refs + 5, 1), TQKV_OK);
    assert_row_is(b, 4, c[5]);
    for (int i = 0; i < 4; i++) assert_row_is(b, i, c[want[i]]);
    tqkv_cache_free(o);
    for (int i = 0; i < 6; i++) tqkv_cache_free(c[i]);
    tqkv_batch_free(b);
}

// ---------------------------------------------------------------------------
// Masks
// ---------------------------------------------------------------------------

/* Brute force: query i of row r at column q = end - nq + i; column c visible iff the query
 * is a real token (q >= pad), c is a token (c >= pad), causal (c <= q) and, with a window,
 * c > q - window. */
static int visible(int pad, int end, int nq, int i, int window, int c) {
    int q = end - nq + i;
    if (q < pad || c < pad || c > q) return 0;
    if (window > 0 && c <= q - window) return 0;
    return 1;
}

static void test_masks_bruteforce(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 19);
    tqkv_mask_lease *l = NULL;
    assert_int_equal(tqkv_mask_lease_init(&l), TQKV_OK);
    for (int it = 0; it < 30; it++) {
        tqkv_cache_config cfg = cfg_make(TQKV_F16, TQKV_F16, 1, 32, 0, 0, 0);
        int R = rng_int(&r, 1, 5), T = 16, len[8], pads[8], mnend = 1 << 30;
        seq_t *s = seqs_make(&r, R, 1, T, 32);
        for (int i = 0; i < R; i++) len[i] = rng_int(&r, 1, T);
        tqkv_cache *singles[8];
        tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r);
        for (int i = 0; i < R; i++) pads[i] = rng_int(&r, 0, 6);
        assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
        for (int i = 0; i < R; i++)
            if (pads[i] + len[i] < mnend) mnend = pads[i] + len[i];
        int nq = rng_int(&r, 1, mnend), window = rng_int(&r, 0, 1) * rng_int(&r, 1, 8);
        int cols = tqkv_batch_columns(b);
        const tqkv_mask *m = NULL;
        assert_int_equal(tqkv_batch_make_mask(b, l, nq, window, &m), TQKV_OK);
        int need_mask = !(nq == 1 && window == 0);
        for (int i = 0; i < R; i++) need_mask |= pads[i] != 0 || len[i] != len[0];
        if (!need_mask) {
            assert_null(m);
        } else {
            assert_non_null(m);
            assert_int_equal(m->rows, R);
            assert_int_equal(m->n_query, nq);
            assert_int_equal(m->window, window);
            float *dense = malloc((size_t)R * nq * cols * sizeof(float));
            assert_int_equal(tqkv_mask_to_dense(m, cols, dense), TQKV_OK);
            for (int i = 0; i < R; i++)
                for (int q = 0; q < nq; q++)
                    for (int c = 0; c < cols; c++) {
                        int vis = visible(pads[i], pads[i] + len[i], nq, q, window, c);
                        float d = dense[((size_t)i * nq + q) * cols + c];
                        assert_true(vis ? d == 0.0f : (isinf(d) && d < 0));
                    }
            /* to_dense refuses too few columns when a range reaches the last one */
            assert_int_equal(tqkv_mask_to_dense(m, cols - 1, dense), TQKV_ERANGE);
            free(dense);
        }
        for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
    tqkv_mask_lease_free(l);
}

static void test_mask_lease(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 20);
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ4, 1, 32, 0, 0, 0);
    int R = 3, T = 12;
    seq_t *s = seqs_make(&r, R, 1, T + 2, 32);
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
    assert_int_equal(batch_feed(b, s, R, 0, T), TQKV_OK);
    tqkv_mask_lease *l = NULL;
    assert_int_equal(tqkv_mask_lease_init(&l), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_builds(l), 0);
    const tqkv_mask *m = (const tqkv_mask *)0x1;
    /* aligned, unpadded, one query, no window: no mask */
    assert_int_equal(tqkv_batch_make_mask(b, l, 1, 0, &m), TQKV_OK);
    assert_null(m);
    assert_int_equal(tqkv_mask_lease_builds(l), 0);
    /* a window, or several queries, need one */
    assert_int_equal(tqkv_batch_make_mask(b, l, 1, 4, &m), TQKV_OK);
    assert_non_null(m);
    assert_int_equal(tqkv_mask_lease_builds(l), 1);
    for (int layer = 0; layer < 8; layer++) { /* every layer of one forward: same key */
        const tqkv_mask *m2 = NULL;
        assert_int_equal(tqkv_batch_make_mask(b, l, 1, 4, &m2), TQKV_OK);
        assert_ptr_equal(m2, m);
    }
    assert_int_equal(tqkv_mask_lease_builds(l), 1);
    assert_int_equal(tqkv_batch_make_mask(b, l, 3, 4, &m), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_builds(l), 2);
    assert_int_equal(tqkv_batch_make_mask(b, l, 3, 0, &m), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_builds(l), 3);
    assert_int_equal(tqkv_batch_make_mask(b, l, 3, 0, &m), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_builds(l), 3);
    /* the key includes offsets: an append changes it */
    assert_int_equal(batch_feed(b, s, R, T, 1), TQKV_OK);
    assert_int_equal(tqkv_batch_make_mask(b, l, 3, 0, &m), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_builds(l), 4);
    assert_int_equal(m->hi[2], T + 1);
    /* ... and pads */
    int pads[3] = {0, 1, 0};
    assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
    assert_int_equal(tqkv_batch_make_mask(b, l, 3, 0, &m), TQKV_OK);
    assert_int_equal(tqkv_mask_lease_builds(l), 5);
    assert_int_equal(tqkv_batch_make_mask(b, l, 1, 0, &m), TQKV_OK); /* padded: mask */
    assert_non_null(m);
    /* bad arguments */
    tqkv_clear_error();
    assert_int_equal(tqkv_batch_make_mask(b, l, 0, 0, &m), TQKV_EINVAL);
    assert_true(tqkv_last_error()[0] != 0);
    assert_int_equal(tqkv_batch_make_mask(b, l, T + 2, 0, &m), TQKV_ERANGE);
    assert_int_equal(tqkv_batch_make_mask(b, l, 1, -1, &m), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_make_mask(b, NULL, 1, 0, &m), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_make_mask(NULL, l, 1, 0, &m), TQKV_EINVAL);
    assert_int_equal(tqkv_mask_to_dense(NULL, 4, NULL), TQKV_EINVAL);
    tqkv_mask_lease_free(l);
    tqkv_batch_free(b);
    seqs_free(s, R);
}

// ---------------------------------------------------------------------------
// Donor capture
// ---------------------------------------------------------------------------

static void test_capture_equals_read(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 21);
    for (int p = 0; p < N_PAIRS; p++) {
        tqkv_cache_config cfg = random_cfg(&r, p);
        int R = rng_int(&r, 1, 4), T = 20, H = cfg.kv_heads, D = cfg.head_dim, len[8], pads[8];
        seq_t *s = seqs_make(&r, R, H, T, D);
        for (int i = 0; i < R; i++) len[i] = rng_int(&r, 0, T);
        tqkv_cache *singles[8];
        tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r);
        for (int i = 0; i < R; i++) pads[i] = rng_int(&r, 0, 5);
        assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
        int cols = tqkv_batch_columns(b);
        size_t n = (size_t)R * H * cols * D; // [rows, kv_heads, cols, head_dim]
        float *k = malloc((n ? n : 1) * 4), *v = malloc((n ? n : 1) * 4);
        for (size_t j = 0; j < n; j++) k[j] = v[j] = 12345.0f; /* must be overwritten */
        int off[8], lp[8];
        assert_int_equal(tqkv_batch_capture(b, k, v, off, lp), TQKV_OK);
        float *rk = malloc((size_t)H * T * D * 4 + 4), *rv = malloc((size_t)H * T * D * 4 + 4);
        for (int i = 0; i < R; i++) {
            assert_int_equal(off[i], len[i]);
            assert_int_equal(lp[i], pads[i]);
            tqkv_cache *c = NULL;
            assert_int_equal(tqkv_batch_extract(b, i, &c), TQKV_OK);
            assert_int_equal(tqkv_cache_read(c, 0, len[i], rk, rv), TQKV_OK);
            for (int h = 0; h < H; h++)
                for (int col = 0; col < cols; col++) {
                    const float *ck = k + (((size_t)i * H + h) * cols + col) * D;
                    const float *cv = v + (((size_t)i * H + h) * cols + col) * D;
                    int t = col - pads[i];
                    if (t < 0 || t >= len[i]) {
                        for (int d = 0; d < D; d++) assert_true(ck[d] == 0.0f && cv[d] == 0.0f);
                    } else {
                        assert_memory_equal(ck, rk + ((size_t)h * len[i] + t) * D, (size_t)D * 4);
                        assert_memory_equal(cv, rv + ((size_t)h * len[i] + t) * D, (size_t)D * 4);
                    }
                }
            tqkv_cache_free(c);
        }
        free(rk);
        free(rv);
        free(k);
        free(v);
        for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
        tqkv_batch_free(b);
        seqs_free(s, R);
    }
}

// ---------------------------------------------------------------------------
// Failures: status, message, unchanged bytes
// ---------------------------------------------------------------------------

static void test_batch_bad_inputs(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 22);
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ3, 2, 64, 8, 4, 9);
    int R = 3, T = 10;
    seq_t *s = seqs_make(&r, R, 2, T + 4, 64);
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
    assert_int_equal(batch_feed(b, s, R, 0, T), TQKV_OK);
    blob before = blob_batch(b);
    float *k = rand_floats(&r, (size_t)R * 2 * 2 * 64), *v = rand_floats(&r, (size_t)R * 2 * 2 * 64);
    tqkv_cache *c = NULL;
    /* shapes */
    ASSERT_FAILS_UNCHANGED(tqkv_batch_append(b, k, v, 0), TQKV_EINVAL, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_append(b, k, v, -1), TQKV_EINVAL, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_append(b, NULL, v, 1), TQKV_EINVAL, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_append(b, k, NULL, 1), TQKV_EINVAL, before, blob_batch, b);
    k[R * 2 * 2 * 64 - 1] = NAN; /* last value of the last row */
    ASSERT_FAILS_UNCHANGED(tqkv_batch_append(b, k, v, 2), TQKV_EINVAL, before, blob_batch, b);
    k[R * 2 * 2 * 64 - 1] = 0.5f;
    /* row index */
    ASSERT_FAILS_UNCHANGED(tqkv_batch_extract(b, R, &c), TQKV_ERANGE, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_extract(b, -1, &c), TQKV_ERANGE, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_extract(b, 0, NULL), TQKV_EINVAL, before, blob_batch, b);
    int keep_bad[3] = {0, 3, 1}, keep_dup[3] = {1, 1, 0};
    ASSERT_FAILS_UNCHANGED(tqkv_batch_filter(b, keep_bad, 3), TQKV_ERANGE, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_filter(b, keep_dup, 3), TQKV_EINVAL, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_filter(b, keep_dup, -1), TQKV_EINVAL, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_filter(b, NULL, 2), TQKV_EINVAL, before, blob_batch, b);
    int pads_bad[3] = {0, -1, 2};
    ASSERT_FAILS_UNCHANGED(tqkv_batch_align(b, pads_bad), TQKV_EINVAL, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_align(b, NULL), TQKV_EINVAL, before, blob_batch, b);
    /* trim beyond the length */
    ASSERT_FAILS_UNCHANGED(tqkv_batch_trim(b, T + 1), TQKV_ERANGE, before, blob_batch, b);
    /* spec: rollback without begin; keep larger than appended */
    int keep1[3] = {1, 0, 0};
    ASSERT_FAILS_UNCHANGED(tqkv_batch_spec_rollback(b, keep1, 3), TQKV_ESTATE, before, blob_batch, b);
    ASSERT_FAILS_UNCHANGED(tqkv_batch_spec_commit(b), TQKV_ESTATE, before, blob_batch, b);
    assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
    assert_int_equal(batch_feed(b, s, R, T, 2), TQKV_OK);
    int keep_big[3] = {1, 3, 0}, keep_neg[3] = {0, -1, 0};
    assert_int_equal(tqkv_batch_spec_rollback(b, keep_big, 3), TQKV_ERANGE);
    assert_true(tqkv_last_error()[0] != 0);
    assert_int_equal(tqkv_batch_spec_rollback(b, keep_neg, 3), TQKV_ERANGE);
    assert_int_equal(tqkv_batch_spec_rollback(b, keep_big, 2), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_spec_rollback(b, NULL, 1), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_spec_active(b), 1); /* failures kept the round */
    assert_int_equal(tqkv_batch_trim(b, 1), TQKV_ESTATE);
    uint8_t *tmp = NULL;
    size_t tmp_n = 0;
    assert_int_equal(tqkv_batch_export(b, &tmp, &tmp_n), TQKV_ESTATE);
    int zero = 0;
    assert_int_equal(tqkv_batch_spec_rollback(b, &zero, 1), TQKV_OK);
    blob again = blob_batch(b);
    assert_true(blob_eq(before, again)); /* rolled back to the start: same bytes */
    blob_free(&again);
    /* merging different formats, dims, heads, seed, window, slack */
    tqkv_cache_config other[6];
    for (int i = 0; i < 6; i++) other[i] = cfg;
    other[0].v_format = TQKV_TQ4;
    other[1].head_dim = 128;
    other[2].kv_heads = 1;
    other[3].seed = 10;
    other[4].window = 4;
    other[5].window_slack = 5;
    const char *names[6] = {"V format", "head_dim", "kv_heads", "seed", "window", "window_slack"};
    for (int i = 0; i < 6; i++) {
        tqkv_cache *o = NULL;
        assert_int_equal(tqkv_cache_init(&o, &other[i]), TQKV_OK);
        tqkv_cache_ref refs[2] = {{.batch = b}, {.single = o}};
        tqkv_batch *m = (tqkv_batch *)0x1;
        tqkv_clear_error();
        assert_int_equal(tqkv_batch_merge(&m, refs, 2), TQKV_EINVAL);
        assert_non_null(strstr(tqkv_last_error(), names[i]));
        assert_ptr_equal(m, (tqkv_batch *)0x1);
        tqkv_cache_free(o);
    }
    tqkv_cache_ref bad_ref[1] = {{.batch = b, .single = NULL}};
    tqkv_batch *m = NULL;
    assert_int_equal(tqkv_batch_merge(&m, bad_ref, 0), TQKV_EINVAL);
    bad_ref[0].batch = NULL;
    assert_int_equal(tqkv_batch_merge(&m, bad_ref, 1), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
    bad_ref[0].batch = b;
    assert_int_equal(tqkv_batch_merge(&m, bad_ref, 1), TQKV_ESTATE);
    assert_int_equal(tqkv_batch_spec_commit(b), TQKV_OK);
    blob after = blob_batch(b);
    assert_true(blob_eq(before, after));
    blob_free(&after);
    blob_free(&before);
    free(k);
    free(v);
    tqkv_batch_free(b);
    seqs_free(s, R);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_append_matches_singles),
        cmocka_unit_test(test_signature),
        cmocka_unit_test(test_merge_extract_roundtrip),
        cmocka_unit_test(test_filter),
        cmocka_unit_test(test_align_roundtrip),
        cmocka_unit_test(test_prefill_left_padded),
        cmocka_unit_test(test_prefill_right_padded),
        cmocka_unit_test(test_spec_rollback_equals_fresh),
        cmocka_unit_test(test_spec_survives_row_changes),
        cmocka_unit_test(test_trim_batch),
        cmocka_unit_test(test_random_ops_mirror_singles),
        cmocka_unit_test(test_append_rows_inplace),
        cmocka_unit_test(test_keep_in_place),
        cmocka_unit_test(test_masks_bruteforce),
        cmocka_unit_test(test_mask_lease),
        cmocka_unit_test(test_capture_equals_read),
        cmocka_unit_test(test_batch_bad_inputs),
    };
    test_seed();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
