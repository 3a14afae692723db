/*
 * cache_helpers.h - helpers for the cache tests (test_cache.c, test_batch.c, test_state.c):
 * configs, random token tensors, slicing a sequence, feeding caches, comparing exports.
 * Must not: hide assertions about the behaviour under test (they stay in the tests).
 */
#ifndef TQKV_CACHE_HELPERS_H
#define TQKV_CACHE_HELPERS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "util/common.h"

static inline tqkv_cache_config cfg_make(tqkv_format kf, tqkv_format vf, int heads, int dim,
                                         int window, int slack, uint64_t seed) {
    tqkv_cache_config c = tqkv_cache_config_default();
    c.k_format = kf;
    c.v_format = vf;
    c.kv_heads = heads;
    c.head_dim = dim;
    c.window = window;
    c.window_slack = slack;
    c.seed = seed;
    return c;
}

/* malloc'd [n] floats ~ N(0, 1) */
static inline float *rand_floats(test_rng *r, size_t n) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    assert_non_null(x);
    rng_fill_normal(r, x, n, 1.0f);
    return x;
}

/* A sequence of T tokens: k, v [heads, T, dim]. */
typedef struct {
    int heads, T, dim;
    float *k, *v;
} seq_t;

static inline seq_t seq_make(test_rng *r, int heads, int T, int dim) {
    seq_t s = {heads, T, dim, rand_floats(r, (size_t)heads * T * dim),
               rand_floats(r, (size_t)heads * T * dim)};
    return s;
}
static inline void seq_free(seq_t *s) {
    free(s->k);
    free(s->v);
}

/* Copy tokens [t0, t0+n) of one plane of s into out [heads, n, dim]. */
static inline void seq_slice(const seq_t *s, const float *x, int t0, int n, float *out) {
    for (int h = 0; h < s->heads; h++)
        memcpy(out + (size_t)h * n * s->dim, x + ((size_t)h * s->T + t0) * s->dim,
               (size_t)n * s->dim * sizeof(float));
}

/* Append tokens [t0, t1) of s to a single cache, in chunks of 1..max_chunk tokens. */
static inline void cache_feed(tqkv_cache *c, const seq_t *s, int t0, int t1, test_rng *r,
                              int max_chunk) {
    float *kb = malloc((size_t)s->heads * (t1 - t0 + 1) * s->dim * sizeof(float));
    float *vb = malloc((size_t)s->heads * (t1 - t0 + 1) * s->dim * sizeof(float));
    assert_non_null(kb);
    assert_non_null(vb);
    int t = t0;
    while (t < t1) {
        int n = max_chunk > 1 ? rng_int(r, 1, max_chunk) : 1;
        if (n > t1 - t) n = t1 - t;
        seq_slice(s, s->k, t, n, kb);
        seq_slice(s, s->v, t, n, vb);
        assert_int_equal(tqkv_cache_append(c, kb, vb, n), TQKV_OK);
        t += n;
    }
    free(kb);
    free(vb);
}

/* A fresh single cache fed tokens [0, n) of s. */
static inline tqkv_cache *cache_fresh(const tqkv_cache_config *cfg, const seq_t *s, int n,
                                      test_rng *r) {
    tqkv_cache *c = NULL;
    assert_int_equal(tqkv_cache_init(&c, cfg), TQKV_OK);
    cache_feed(c, s, 0, n, r, 5);
    assert_int_equal(tqkv_cache_length(c), n);
    return c;
}

typedef struct {
    uint8_t *p;
    size_t n;
} blob;

static inline blob blob_cache(const tqkv_cache *c) {
    blob b = {NULL, 0};
    assert_int_equal(tqkv_cache_export(c, &b.p, &b.n), TQKV_OK);
    return b;
}
static inline blob blob_batch(const tqkv_batch *c) {
    blob b = {NULL, 0};
    assert_int_equal(tqkv_batch_export(c, &b.p, &b.n), TQKV_OK);
    return b;
}
static inline int blob_eq(blob a, blob b) { return a.n == b.n && !memcmp(a.p, b.p, a.n); }
static inline void blob_free(blob *b) {
    free(b->p);
    b->p = NULL;
}

static inline void assert_caches_same(const tqkv_cache *a, const tqkv_cache *b) {
    blob x = blob_cache(a), y = blob_cache(b);
    if (!blob_eq(x, y)) fprintf(stderr, "exports differ: %zu vs %zu bytes\n", x.n, y.n);
    assert_true(blob_eq(x, y));
    blob_free(&x);
    blob_free(&y);
}

// ---- batches

/* Append tokens [t0, t0+n) of seqs[r] to row r of b (k, v: [rows, heads, n, dim]). */
static inline tqkv_status batch_feed(tqkv_batch *b, const seq_t *seqs, int R, int t0, int n) {
    int heads = seqs[0].heads, dim = seqs[0].dim;
    size_t per = (size_t)heads * n * dim;
    size_t rows = (size_t)(R > 0 ? R : 1);
    float *k = malloc(rows * per * sizeof(float)), *v = malloc(rows * per * sizeof(float));
    assert_non_null(k);
    assert_non_null(v);
    for (int r = 0; r < R; r++) {
        seq_slice(&seqs[r], seqs[r].k, t0, n, k + r * per);
        seq_slice(&seqs[r], seqs[r].v, t0, n, v + r * per);
    }
    tqkv_status st = tqkv_batch_append(b, k, v, n);
    free(k);
    free(v);
    return st;
}

static inline seq_t *seqs_make(test_rng *r, int R, int heads, int T, int dim) {
    seq_t *s = calloc((size_t)(R > 0 ? R : 1), sizeof *s);
    for (int i = 0; i < R; i++) s[i] = seq_make(r, heads, T, dim);
    return s;
}
static inline void seqs_free(seq_t *s, int R) {
    for (int i = 0; i < R; i++) seq_free(&s[i]);
    free(s);
}

/* Row `row` of b, extracted, has the bytes of `want`. */
static inline void assert_row_is(const tqkv_batch *b, int row, const tqkv_cache *want) {
    tqkv_cache *c = NULL;
    assert_int_equal(tqkv_batch_extract(b, row, &c), TQKV_OK);
    assert_caches_same(c, want);
    tqkv_cache_free(c);
}

/* Batch merged from singles fed seqs[i][0, len[i]). singles[] is filled (caller frees). */
static inline tqkv_batch *merge_singles(const tqkv_cache_config *cfg, const seq_t *seqs,
                                        const int *len, int R, tqkv_cache **singles,
                                        test_rng *r) {
    tqkv_cache_ref *refs = calloc((size_t)(R > 0 ? R : 1), sizeof *refs);
    for (int i = 0; i < R; i++) {
        singles[i] = cache_fresh(cfg, &seqs[i], len[i], r);
        refs[i].single = singles[i];
    }
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_merge(&b, refs, R), TQKV_OK);
    free(refs);
    return b;
}

/* The failure contract: status, a message, and an unchanged export. */
#define ASSERT_FAILS_UNCHANGED(call, want, before_blob, export_fn, obj)                           \
    do {                                                                                         \
        tqkv_clear_error();                                                                      \
        tqkv_status st_ = (call);                                                                \
        if (st_ != (want))                                                                       \
            fprintf(stderr, "%s: got %s (%s), want %s\n", #call, tqkv_status_name(st_),          \
                    tqkv_last_error(), tqkv_status_name(want));                                  \
        assert_int_equal(st_, (want));                                                           \
        assert_true(tqkv_last_error()[0] != 0);                                                  \
        blob after_ = export_fn(obj);                                                            \
        assert_true(blob_eq((before_blob), after_));                                             \
        blob_free(&after_);                                                                      \
    } while (0)

#endif
