/*
 * test_cache_attend.c - the attention entry points of the caches (src/cache/attend.c):
 * tqkv_cache_attend (causal mask built internally) and tqkv_batch_attend (masks from
 * make_mask) against float64 references on the decoded K/V, for every kernel, and the
 * wrappers' validation (status + message + unchanged bytes). The kernels themselves are
 * tested in test_attention.c.
 */
#include "cache_helpers.h"

#include "cache/batch.h"

/* Token t of row r, head h of plane K (isv 0) or V as query i of nq sees it: from its q8
 * copy when t >= max(offset - nq + i + 1 - window, batch_q8_lo) (per-query window, see
 * batch.h), else from the main plane. out [head_dim]. */
static void pq_token(const struct tqkv_batch *b, int r, int h, int t, int i, int nq, int isv,
                     float *out) {
    int ws = b->offset[r];
    if (b->ring > 0) {
        ws = b->offset[r] - nq + i + 1 - b->cfg.window;
        if (ws < batch_q8_lo(b, r)) ws = batch_q8_lo(b, r);
    }
    batch_decode_token(b, isv ? &b->v : &b->k, r, h, t, t >= ws, out);
}

// ---------------------------------------------------------------------------
// Single cache (causal, built internally)
// ---------------------------------------------------------------------------

static void test_cache_attend(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 9);
    const tqkv_format fmts[][2] = {{TQKV_F32, TQKV_F32}, {TQKV_TQ4, TQKV_TQ3}, {TQKV_Q8, TQKV_TQ2}};
    for (int fi = 0; fi < 3; fi++)
        for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++) {
            int H = 2, D = 64, T = rng_int(&r, 1, 30), qh = 2 * H, nq = rng_int(&r, 1, T < 6 ? T : 6);
            tqkv_cache_config cfg = cfg_make(fmts[fi][0], fmts[fi][1], H, D, fi ? 6 : 0, 3,
                                             rng_u64(&r));
            seq_t s = seq_make(&r, H, T, D);
            tqkv_cache *c = cache_fresh(&cfg, &s, T, &r);
            /* what attention must see: the decoded tokens, q8 copies for each query's own
             * newest `window` (pq_token) */
            float *K = malloc((size_t)D * 4), *V = malloc((size_t)T * D * 4);
            size_t n = (size_t)qh * nq * D;
            float *q = rand_floats(&r, n), *out = malloc(n * 4);
            double *ref = calloc(n, sizeof(double)), sc[64];
            tqkv_attn_params p = {.q_heads = qh, .scale = 0.125f, .kernel = (tqkv_kernel)kern,
                                  .threads = 2};
            assert_int_equal(tqkv_cache_attend(c, q, nq, &p, out), TQKV_OK);
            for (int j = 0; j < qh; j++)
                for (int i = 0; i < nq; i++) {
                    int h = j / 2, hi = T - nq + i + 1;
                    const float *qv = q + ((size_t)j * nq + i) * D;
                    double mx = -INFINITY, sum = 0;
                    for (int t = 0; t < hi; t++) {
                        double dot = 0;
                        pq_token(c->b, 0, h, t, i, nq, 0, K);
                        pq_token(c->b, 0, h, t, i, nq, 1, V + (size_t)t * D);
                        for (int d = 0; d < D; d++) dot += (double)qv[d] * K[d];
                        sc[t] = dot * 0.125;
                        if (sc[t] > mx) mx = sc[t];
                    }
                    for (int t = 0; t < hi; t++) sum += (sc[t] = exp(sc[t] - mx));
                    for (int t = 0; t < hi; t++)
                        for (int d = 0; d < D; d++)
                            ref[((size_t)j * nq + i) * D + d] += sc[t] / sum * V[(size_t)t * D + d];
                }
            double err = rel_l2_d(out, ref, n);
            if (err > (fi ? 2e-3 : 1e-4)) fail_msg("fmt %d kernel %d: rel err %g", fi, kern, err);
            /* bad arguments */
            blob before = blob_cache(c);
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, q, T + 1, &p, out), TQKV_ERANGE, before, blob_cache, c);
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, q, 0, &p, out), TQKV_EINVAL, before, blob_cache, c);
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, NULL, 1, &p, out), TQKV_EINVAL, before, blob_cache, c);
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, q, 1, NULL, out), TQKV_EINVAL, before, blob_cache, c);
            tqkv_attn_params bp = p;
            bp.q_heads = 3;
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, q, 1, &bp, out), TQKV_EINVAL, before, blob_cache, c);
            bp = p;
            bp.threads = 0;
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, q, 1, &bp, out), TQKV_EINVAL, before, blob_cache, c);
            bp = p;
            bp.kernel = (tqkv_kernel)-1;
            ASSERT_FAILS_UNCHANGED(tqkv_cache_attend(c, q, 1, &bp, out), TQKV_EINVAL, before, blob_cache, c);
            blob_free(&before);
            free(K);
            free(V);
            free(q);
            free(out);
            free(ref);
            seq_free(&s);
            tqkv_cache_free(c);
        }
}

// ---------------------------------------------------------------------------
// Batched cache (the wrapper's validation, and that a valid call computes masked
// attention over the rows)
// ---------------------------------------------------------------------------

/* float64 reference on b's decoded K/V (per-query window, pq_token) with the mask's
 * ranges (columns; token = column - left_pad). */
static void attend_ref(const struct tqkv_batch *b, int R, int H, int D, int cols,
                       const tqkv_mask *m, const int *pad, const int *off, const float *q,
                       int nq, int qh, float scale, double *out) {
    int G = qh / H;
    double *sc = malloc((size_t)(cols ? cols : 1) * sizeof(double));
    float *K = malloc(sizeof(float) * (size_t)D), *V = malloc(sizeof(float) * (size_t)(cols ? cols : 1) * D);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < qh; j++)
            for (int i = 0; i < nq; i++) {
                int h = j / G, lo, hi;
                if (m) {
                    lo = m->lo[r * nq + i];
                    hi = m->hi[r * nq + i];
                } else {
                    lo = pad[r];
                    hi = pad[r] + off[r] - nq + i + 1;
                }
                const float *qv = q + (((size_t)r * qh + j) * nq + i) * D;
                double *o = out + (((size_t)r * qh + j) * nq + i) * D;
                for (int d = 0; d < D; d++) o[d] = 0;
                if (hi <= lo) continue;
                double mx = -INFINITY, sum = 0;
                for (int c = lo; c < hi; c++) {
                    const float *kv = K;
                    pq_token(b, r, h, c - b->left_pad[r], i, nq, 0, K);
                    pq_token(b, r, h, c - b->left_pad[r], i, nq, 1, V + (size_t)c * D);
                    double dot = 0;
                    for (int d = 0; d < D; d++) dot += (double)qv[d] * kv[d];
                    sc[c] = dot * scale;
                    if (sc[c] > mx) mx = sc[c];
                }
                for (int c = lo; c < hi; c++) sum += (sc[c] = exp(sc[c] - mx));
                for (int c = lo; c < hi; c++) {
                    const float *vv = V + (size_t)c * D;
                    for (int d = 0; d < D; d++) o[d] += sc[c] / sum * vv[d];
                }
            }
    free(sc);
    free(K);
    free(V);
}

static void test_batch_attend_reference(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 23);
    const tqkv_format fmts[][2] = {{TQKV_F32, TQKV_F32}, {TQKV_TQ4, TQKV_TQ3}, {TQKV_Q8, TQKV_TQ4}};
    for (int fi = 0; fi < 3; fi++)
        for (int kern = 0; kern < TQKV_KERNEL_COUNT; kern++) {
            tqkv_cache_config cfg = cfg_make(fmts[fi][0], fmts[fi][1], 2, 64, rng_int(&r, 0, 1) * 6, 3,
                                             rng_u64(&r));
            int R = rng_int(&r, 1, 4), T = 24, H = 2, D = 64, len[8], pads[8], mnend = 1 << 30;
            seq_t *s = seqs_make(&r, R, H, T, D);
            for (int i = 0; i < R; i++) len[i] = rng_int(&r, 1, T);
            tqkv_cache *singles[8];
            tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r);
            for (int i = 0; i < R; i++) pads[i] = rng_int(&r, 0, 3);
            assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
            for (int i = 0; i < R; i++)
                if (pads[i] + len[i] < mnend) mnend = pads[i] + len[i];
            int nq = rng_int(&r, 1, mnend < 5 ? mnend : 5), window = rng_int(&r, 0, 1) * 5;
            int qh = 4, cols = tqkv_batch_columns(b);
            tqkv_mask_lease *l = NULL;
            const tqkv_mask *m = NULL;
            assert_int_equal(tqkv_mask_lease_init(&l), TQKV_OK);
            assert_int_equal(tqkv_batch_make_mask(b, l, nq, window, &m), TQKV_OK);
            size_t nout = (size_t)R * qh * nq * D;
            float *q = rand_floats(&r, nout), *out = malloc(nout * 4);
            double *ref = malloc(nout * sizeof(double));
            tqkv_attn_params p = {.q_heads = qh, .scale = 0.125f, .kernel = (tqkv_kernel)kern,
                                  .threads = rng_int(&r, 1, 3)};
            assert_int_equal(tqkv_batch_attend(b, m, q, nq, &p, out), TQKV_OK);
            attend_ref(b, R, H, D, cols, m, pads, len, q, nq, qh, 0.125f, ref);
            double err = rel_l2_d(out, ref, nout);
            if (err > 2e-3) fail_msg("fmt %d kernel %d: rel err %g", fi, kern, err);
            free(q); free(out); free(ref);
            tqkv_mask_lease_free(l);
            for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
            tqkv_batch_free(b);
            seqs_free(s, R);
        }
}

static void test_batch_attend_bad_inputs(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 24);
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ4, 2, 32, 0, 0, 2);
    int R = 2, T = 6, len[2] = {6, 4};
    seq_t *s = seqs_make(&r, R, 2, T, 32);
    tqkv_cache *singles[2];
    tqkv_batch *b = merge_singles(&cfg, s, len, R, singles, &r); /* row 1 padded by 2 */
    blob before = blob_batch(b);
    float *q = rand_floats(&r, (size_t)R * 4 * 3 * 32), *out = malloc((size_t)R * 4 * 3 * 32 * 4);
    tqkv_attn_params p = {.q_heads = 4, .scale = 0.2f, .kernel = TQKV_KERNEL_DENSE, .threads = 1};
    tqkv_mask_lease *l = NULL;
    const tqkv_mask *m = NULL;
    assert_int_equal(tqkv_mask_lease_init(&l), TQKV_OK);
    assert_int_equal(tqkv_batch_make_mask(b, l, 1, 0, &m), TQKV_OK);
    assert_non_null(m);
    assert_int_equal(tqkv_batch_attend(b, m, q, 1, &p, out), TQKV_OK);
#define BAD(call, want) ASSERT_FAILS_UNCHANGED(call, want, before, blob_batch, b)
    BAD(tqkv_batch_attend(NULL, m, q, 1, &p, out), TQKV_EINVAL);
    BAD(tqkv_batch_attend(b, m, NULL, 1, &p, out), TQKV_EINVAL);
    BAD(tqkv_batch_attend(b, m, q, 1, &p, NULL), TQKV_EINVAL);
    BAD(tqkv_batch_attend(b, m, q, 1, NULL, out), TQKV_EINVAL);
    BAD(tqkv_batch_attend(b, m, q, 0, &p, out), TQKV_EINVAL);
    BAD(tqkv_batch_attend(b, NULL, q, 1, &p, out), TQKV_EINVAL); /* padded rows need a mask */
    BAD(tqkv_batch_attend(b, m, q, 2, &p, out), TQKV_EINVAL);    /* mask is for 1 query */
    tqkv_attn_params bp = p;
    bp.q_heads = 3;
    BAD(tqkv_batch_attend(b, m, q, 1, &bp, out), TQKV_EINVAL);
    bp.q_heads = 0;
    BAD(tqkv_batch_attend(b, m, q, 1, &bp, out), TQKV_EINVAL);
    bp = p;
    bp.threads = 0;
    BAD(tqkv_batch_attend(b, m, q, 1, &bp, out), TQKV_EINVAL);
    bp = p;
    bp.kernel = TQKV_KERNEL_COUNT;
    BAD(tqkv_batch_attend(b, m, q, 1, &bp, out), TQKV_EINVAL);
    bp = p;
    bp.scale = NAN;
    BAD(tqkv_batch_attend(b, m, q, 1, &bp, out), TQKV_EINVAL);
    /* a mask of another shape or reaching outside the rows' tokens */
    int32_t lo[2] = {0, 1}, hi[2] = {6, 6}; /* row 1's tokens are columns [2, 6) */
    tqkv_mask wrong = {.rows = 2, .n_query = 1, .window = 0, .lo = lo, .hi = hi};
    BAD(tqkv_batch_attend(b, &wrong, q, 1, &p, out), TQKV_ERANGE);
    wrong.rows = 1;
    BAD(tqkv_batch_attend(b, &wrong, q, 1, &p, out), TQKV_EINVAL);
    wrong.rows = 2;
    wrong.lo = NULL;
    BAD(tqkv_batch_attend(b, &wrong, q, 1, &p, out), TQKV_EINVAL);
    BAD(tqkv_batch_attend(b, m, q, 7, &p, out), TQKV_ERANGE);     /* more queries than columns */
#undef BAD
    blob_free(&before);
    tqkv_mask_lease_free(l);
    free(q);
    free(out);
    for (int i = 0; i < R; i++) tqkv_cache_free(singles[i]);
    tqkv_batch_free(b);
    seqs_free(s, R);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_attend),
        cmocka_unit_test(test_batch_attend_reference),
        cmocka_unit_test(test_batch_attend_bad_inputs),
    };
    test_seed();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
