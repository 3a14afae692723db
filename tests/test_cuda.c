/*
 * test_cuda.c - the CUDA backend (src/cache/cache_cuda.cu, src/codec/codec_cuda.cu,
 * src/attn/attn_cuda.cu) against the CPU library, on fresh random inputs:
 *   - GPU encode (append) writes the same bytes as tqkv_batch_append: payload planes,
 *     fp16 scales and the q8 window ring (tq4, tq3; with and without a window);
 *   - GPU decode attention over tq4 / tq3 rows (left padding, rows of different lengths,
 *     several KV splits, the q8 window, V norms near fp16's range) matches the CPU fused
 *     kernel, rel. L2 < 6e-3 per (row, head) (fp16 query / codebook / weights against float32);
 *   - batch invariance: a row attended alone gives bit-identical output;
 *   - the dense bf16 baseline against a float64 reference on the bf16-rounded K/V
 *     (rel. L2 < 1.5e-2: bf16 query and weights);
 *   - row operations in device memory (filter, align, spec round with an append and a
 *     per-row rollback, trim, extract, merge, restore): the device state's canonical export
 *     equals the host batch's after the same operations, byte for byte;
 *   - several queries per row with masks (causal over left-padded rows, sliding window, the
 *     q8 window) against the CPU prefill engine (float32 both: rel. L2 < 1e-4).
 * Exits 77 (skipped) when the build has no CUDA or no GPU is present.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#ifdef TQKV_HAVE_CUDA
#include "cache/batch.h"
#include "cache/cache_cuda.h"
#include "cache/cache_impl.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------
static tqkv_cache_config mkcfg(tqkv_format f, int kvh, int window, uint64_t seed) {
    tqkv_cache_config c = tqkv_cache_config_default();
    c.k_format = c.v_format = f;
    c.kv_heads = kvh;
    c.head_dim = 128;
    c.window = window;
    c.window_slack = window ? 16 : 0;
    c.seed = seed;
    return c;
}

static float *dev_copy(const float *h, size_t n) {
    void *d = NULL;
    assert_int_equal(tqkv_cuda_malloc(&d, n * sizeof(float)), TQKV_OK);
    assert_int_equal(tqkv_cuda_h2d(d, h, n * sizeof(float)), TQKV_OK);
    return d;
}

/* Tokens [t0, t0+n) of x [rows, kvh, T, d] -> out [rows, kvh, n, d]. */
static void slice(const float *x, int rows, int kvh, int T, int t0, int n, float *out) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < kvh; h++)
            memcpy(out + (((size_t)r * kvh + h) * n) * 128,
                   x + (((size_t)r * kvh + h) * T + t0) * 128, (size_t)n * 128 * sizeof(float));
}

// ---------------------------------------------------------------------------
// Encode
// ---------------------------------------------------------------------------
static void test_cuda_encode_bytes(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0xC0DA);
    const tqkv_format fm[2] = {TQKV_TQ4, TQKV_TQ3};
    for (int fi = 0; fi < 2; fi++)
        for (int wi = 0; wi < 2; wi++) {
            const int R = rng_int(&r, 1, 3), H = rng_int(&r, 1, 3), T = rng_int(&r, 40, 400);
            const int W = wi ? rng_int(&r, 8, 64) : 0;
            tqkv_cache_config cfg = mkcfg(fm[fi], H, W, rng_u64(&r));
            const size_t n = (size_t)R * H * T * 128;
            float *k = malloc(n * 4), *v = malloc(n * 4), *kb = malloc(n * 4), *vb = malloc(n * 4);
            rng_fill_normal(&r, k, n, 1.0f);
            rng_fill_normal(&r, v, n, 0.5f);
            for (size_t i = 0; i < n; i += 97) k[i] *= 40.0f; /* outliers */
            tqkv_batch *b = NULL;
            cuda_kv *kv = NULL;
            assert_int_equal(tqkv_batch_init(&b, &cfg, R), TQKV_OK);
            assert_int_equal(tqkv_cuda_kv_init(&kv, &cfg, 0, R, T + 8), TQKV_OK);
            for (int t = 0, c; t < T; t += c) {
                c = rng_int(&r, 1, 150);
                if (c > T - t) c = T - t;
                slice(k, R, H, T, t, c, kb);
                slice(v, R, H, T, t, c, vb);
                assert_int_equal(tqkv_batch_append(b, kb, vb, c), TQKV_OK);
                float *dk = dev_copy(kb, (size_t)R * H * c * 128), *dv = dev_copy(vb, (size_t)R * H * c * 128);
                assert_int_equal(tqkv_cuda_kv_append(kv, dk, dv, c), TQKV_OK);
                tqkv_cuda_free(dk);
                tqkv_cuda_free(dv);
            }
            const size_t pay = b->k.codec.payload, cap = (size_t)T + 8, ring = (size_t)b->ring;
            uint8_t *kd = malloc((size_t)R * H * cap * pay), *vd = malloc((size_t)R * H * cap * pay);
            uint16_t *ks = malloc((size_t)R * H * cap * 2), *vs = malloc((size_t)R * H * cap * 2);
            int8_t *kw = malloc(R * H * ring * 128 + 1), *vw = malloc(R * H * ring * 128 + 1);
            uint16_t *kws = malloc(R * H * ring * 8 + 1), *vws = malloc(R * H * ring * 8 + 1);
            assert_int_equal(tqkv_cuda_kv_download(kv, kd, ks, vd, vs, kw, kws, vw, vws), TQKV_OK);
            long bad = 0, checked = 0;
            for (int rr = 0; rr < R; rr++)
                for (int h = 0; h < H; h++) {
                    for (int t = 0; t < T; t++) {
                        const size_t dsl = ((size_t)rr * H + h) * cap + t;
                        bad += memcmp(kd + dsl * pay, plane_data(&b->k, b, rr, h, t), pay) != 0;
                        bad += memcmp(vd + dsl * pay, plane_data(&b->v, b, rr, h, t), pay) != 0;
                        bad += ks[dsl] != *plane_scales(&b->k, b, rr, h, t);
                        bad += vs[dsl] != *plane_scales(&b->v, b, rr, h, t);
                        checked += 4;
                    }
                    for (int t = b->win_lo[rr]; ring && t < b->offset[rr]; t++) {
                        const size_t s = ((size_t)rr * H + h) * ring + (size_t)t % ring;
                        bad += memcmp(kw + s * 128, plane_win_data(&b->k, b, rr, h, t), 128) != 0;
                        bad += memcmp(vw + s * 128, plane_win_data(&b->v, b, rr, h, t), 128) != 0;
                        bad += memcmp(kws + s * 4, plane_win_scales(&b->k, b, rr, h, t), 8) != 0;
                        bad += memcmp(vws + s * 4, plane_win_scales(&b->v, b, rr, h, t), 8) != 0;
                        checked += 4;
                    }
                }
            printf("encode %s window %d: %ld of %ld vectors differ\n", tqkv_format_name(fm[fi]), W,
                   bad, checked);
            assert_true(checked > 0);
            assert_int_equal(bad, 0);
            free(kd); free(vd); free(ks); free(vs); free(kw); free(vw); free(kws); free(vws);
            free(k); free(v); free(kb); free(vb);
            tqkv_batch_free(b);
            tqkv_cuda_kv_free(kv);
        }
}

// ---------------------------------------------------------------------------
// Attention over compressed rows
// ---------------------------------------------------------------------------
static void attend_gpu(const struct tqkv_batch *b, const float *q, int qh, float scale, float *out) {
    cuda_kv *kv = NULL;
    int cap = 1;
    for (int i = 0; i < b->rows; i++)
        if (b->left_pad[i] + b->offset[i] > cap) cap = b->left_pad[i] + b->offset[i];
    assert_int_equal(tqkv_cuda_kv_init(&kv, &b->cfg, 0, b->rows, cap), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_upload(kv, b), TQKV_OK);
    const size_t n = (size_t)b->rows * qh * 128;
    float *dq = dev_copy(q, n), *dout = NULL;
    assert_int_equal(tqkv_cuda_malloc((void **)&dout, n * 4), TQKV_OK);
    for (size_t i = 0; i < n; i++) out[i] = NAN;
    assert_int_equal(tqkv_cuda_h2d(dout, out, n * 4), TQKV_OK); /* poison */
    assert_int_equal(tqkv_cuda_kv_attend(kv, dq, qh, scale, dout), TQKV_OK);
    assert_int_equal(tqkv_cuda_sync(), TQKV_OK);
    assert_int_equal(tqkv_cuda_d2h(out, dout, n * 4), TQKV_OK);
    /* the same call on the same cache again: the work counters must have reset themselves
     * (with more items than CTAs a stale counter would skip items) */
    float *again = malloc(n * 4);
    assert_non_null(again);
    assert_int_equal(tqkv_cuda_kv_attend(kv, dq, qh, scale, dout), TQKV_OK);
    assert_int_equal(tqkv_cuda_sync(), TQKV_OK);
    assert_int_equal(tqkv_cuda_d2h(again, dout, n * 4), TQKV_OK);
    if (memcmp(again, out, n * 4)) fail_msg("a second identical attention call differs from the first");
    free(again);
    tqkv_cuda_free(dq);
    tqkv_cuda_free(dout);
    tqkv_cuda_kv_free(kv);
}

static void test_cuda_attend_tq(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0xA77E);
    const tqkv_format fm[2] = {TQKV_TQ4, TQKV_TQ3};
    for (int fi = 0; fi < 2; fi++)
        for (int wi = 0; wi < 6; wi++) {
            /* wi 2: more (row, head, split) items than twice the persistent grid's groups
             * (3 per SM: 792 on 132 SMs; here about 1300-2400), so groups claim items from the
             * counter after their first two; splits of 512-768 tokens give each warp 4-6
             * staged tiles per item, more than its 3 stages, so stages are refilled within
             * an item as well as across items */
            const int many = wi == 2;
            /* wi 3, 4, 5: V norms near 17000, 0.01 and 1e-4 (tq V scales near the top of fp16's
             * range and far below 1; at 1e-4 the q8 window's block scales are fp16
             * subnormals): the kernel's fp16 softmax weights must not overflow or turn
             * subnormal with the V scale (attn_cuda.cu folds its log2 into the score; the
             * weights reach 2^4 against a running max up to 4 stale). Rows long enough for
             * stages refilled within an item. */
            const float vmul = wi == 3 ? 1500.0f : wi == 4 ? 1e-3f : wi == 5 ? 1e-5f : 1.0f;
            const int R = many ? rng_int(&r, 10, 12) : rng_int(&r, 2, 4), H = many ? 8 : 2;
            const int G = rng_int(&r, 0, 1) ? 4 : 8, qh = H * G;
            const int W = wi == 1 || wi >= 3 || (many && rng_int(&r, 0, 1)) ? rng_int(&r, 16, 200) : 0;
            tqkv_cache_config cfg = mkcfg(fm[fi], H, W, rng_u64(&r));
            tqkv_cache *rows[12] = {0};
            tqkv_cache_ref refs[12];
            int lens[12];
            for (int i = 0; i < R; i++) {
                lens[i] = i == 0 ? rng_int(&r, 1, 40) : many ? rng_int(&r, 9000, 20000)
                          : wi >= 3 ? rng_int(&r, 9000, 12000) : rng_int(&r, 200, 3000);
                assert_int_equal(tqkv_cache_init(&rows[i], &cfg), TQKV_OK);
                const size_t n = (size_t)H * lens[i] * 128;
                float *k = malloc(n * 4), *v = malloc(n * 4);
                rng_fill_normal(&r, k, n, 1.0f);
                rng_fill_normal(&r, v, n, vmul);
                for (int h = 0; h < H; h++) /* a few tokens that dominate the softmax, every head */
                    for (int t = 0; t < lens[i]; t++)
                        if (rng_int(&r, 0, 200) == 0)
                            for (int d = 0; d < 128; d++) k[((size_t)h * lens[i] + t) * 128 + d] *= 3.0f;
                for (int h = 0; h < H; h++) /* and a few all-zero values (V scale 0: weight in the sum only) */
                    for (int t = 0; t < lens[i]; t++)
                        if (rng_int(&r, 0, 300) == 0) memset(v + ((size_t)h * lens[i] + t) * 128, 0, 128 * sizeof(float));
                if (i == 0 && W > 0 && lens[0] >= 2) /* and in row 0's q8 window: an all-zero K, an all-zero V */
                    for (int h = 0; h < H; h++) {
                        memset(k + ((size_t)h * lens[0] + lens[0] - 1) * 128, 0, 128 * sizeof(float));
                        memset(v + ((size_t)h * lens[0] + lens[0] - 2) * 128, 0, 128 * sizeof(float));
                    }
                if (wi >= 3) /* scores that keep rising: many tiles whose max lies a little
                              * above the running max, where stale weights exceed 1 */
                    for (int h = 0; h < H; h++)
                        for (int t = 0; t < lens[i]; t++)
                            for (int d = 0; d < 128; d++)
                                k[((size_t)h * lens[i] + t) * 128 + d] *= 0.5f + 1.5f * t / lens[i];
                /* k, v are [H, T, d]: append in chunks via a [H, c, d] buffer */
                float *kb = malloc(n * 4), *vb = malloc(n * 4);
                for (int t = 0, c; t < lens[i]; t += c) {
                    c = rng_int(&r, 1, 700);
                    if (c > lens[i] - t) c = lens[i] - t;
                    slice(k, 1, H, lens[i], t, c, kb);
                    slice(v, 1, H, lens[i], t, c, vb);
                    assert_int_equal(tqkv_cache_append(rows[i], kb, vb, c), TQKV_OK);
                }
                free(k); free(v); free(kb); free(vb);
                refs[i].batch = NULL;
                refs[i].single = rows[i];
            }
            tqkv_batch *b = NULL;
            assert_int_equal(tqkv_batch_merge(&b, refs, R), TQKV_OK);
            const size_t n = (size_t)R * qh * 128;
            float *q = malloc(n * 4), *cpu = malloc(n * 4), *gpu = malloc(n * 4), *one = malloc(n * 4);
            rng_fill_normal(&r, q, n, 1.0f);
            const float scale = 1.0f / sqrtf(128.0f);
            tqkv_attn_params p = {.q_heads = qh, .scale = scale, .kernel = TQKV_KERNEL_FUSED, .threads = 2};
            tqkv_mask_lease *lease = NULL;
            const tqkv_mask *mask = NULL;
            assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
            assert_int_equal(tqkv_batch_make_mask(b, lease, 1, 0, &mask), TQKV_OK);
            assert_int_equal(tqkv_batch_attend(b, mask, q, 1, &p, cpu), TQKV_OK);
            tqkv_mask_lease_free(lease);
            attend_gpu(b, q, qh, scale, gpu);
            double worst = 0;
            for (int i = 0; i < R * qh; i++) {
                const double e = rel_l2(gpu + (size_t)i * 128, cpu + (size_t)i * 128, 128);
                if (!(e <= worst)) worst = e; /* NaN sticks */
            }
            printf("attend %s G %d window %d rows %d (lens %d..)%s: worst rel L2 vs CPU %.3g\n",
                   tqkv_format_name(fm[fi]), G, W, R, lens[0],
                   wi == 3 ? " |v| ~ 17000" : wi == 4 ? " |v| ~ 0.01" : wi == 5 ? " |v| ~ 1e-4" : "",
                   worst);
            /* fp16 queries and codebook values put errors of ~2^-11 |s| on the scores; with
             * every head's softmax held by a few tokens and rising scores, the worst (row,
             * head) reached 4.3e-3 in a sweep of 16 seeds (sixth session, run 7b; the fifth
             * session's kernel gave the same or larger errors on the same inputs: run 2), so
             * the bound is 6e-3. Folding the V scale into fp16 weights, the previous kernel's way, gives
             * 1.6e-2 to 1.9e-2 at V norms near 1e-4. */
            if (!(worst < 6e-3)) fail_msg("GPU attention differs from the CPU: %g", worst);
            /* batch invariance: each row alone (its own single cache) */
            for (int i = 0; i < R; i++) {
                attend_gpu(rows[i]->b, q + (size_t)i * qh * 128, qh, scale, one);
                if (memcmp(one, gpu + (size_t)i * qh * 128, (size_t)qh * 128 * 4))
                    fail_msg("row %d alone differs from row %d in a batch of %d", i, i, R);
            }
            free(q); free(cpu); free(gpu); free(one);
            tqkv_batch_free(b);
            for (int i = 0; i < R; i++) tqkv_cache_free(rows[i]);
        }
}

// ---------------------------------------------------------------------------
// Several queries per row with masks (prefill / sliding window), float32 on the GPU
// ---------------------------------------------------------------------------
static void test_cuda_prefill(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x9F11);
    for (int it = 0; it < 4; it++) {
        const int H = 2, G = it & 1 ? 4 : 8, qh = H * G, R = 3, W = it >= 2 ? 40 : 0;
        tqkv_cache_config cfg = mkcfg(it & 1 ? TQKV_TQ3 : TQKV_TQ4, H, W, rng_u64(&r));
        tqkv_cache *rows[3];
        tqkv_cache_ref refs[3];
        int minlen = 1 << 30;
        for (int i = 0; i < R; i++) {
            const int T = rng_int(&r, 12, 400);
            if (T < minlen) minlen = T;
            const size_t n = (size_t)H * T * 128;
            float *k = malloc(n * 4), *v = malloc(n * 4);
            rng_fill_normal(&r, k, n, 1.0f);
            rng_fill_normal(&r, v, n, 1.0f);
            assert_int_equal(tqkv_cache_init(&rows[i], &cfg), TQKV_OK);
            assert_int_equal(tqkv_cache_append(rows[i], k, v, T), TQKV_OK);
            refs[i].batch = NULL;
            refs[i].single = rows[i];
            free(k);
            free(v);
        }
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_merge(&b, refs, R), TQKV_OK);
        const int nq = rng_int(&r, 2, minlen < 11 ? minlen : 11), swa = it == 3 ? rng_int(&r, 1, 60) : 0;
        tqkv_mask_lease *lease = NULL;
        const tqkv_mask *mask = NULL;
        assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
        assert_int_equal(tqkv_batch_make_mask(b, lease, nq, swa, &mask), TQKV_OK);
        assert_non_null(mask);
        const size_t n = (size_t)R * qh * nq * 128;
        float *q = malloc(n * 4), *cpu = malloc(n * 4), *gpu = malloc(n * 4), *dout = NULL;
        rng_fill_normal(&r, q, n, 1.0f);
        tqkv_attn_params p = {.q_heads = qh, .scale = 0.09f, .kernel = TQKV_KERNEL_DEFERRED, .threads = 2};
        assert_int_equal(tqkv_batch_attend(b, mask, q, nq, &p, cpu), TQKV_OK);
        cuda_kv *kv = NULL;
        assert_int_equal(tqkv_cuda_kv_init(&kv, &cfg, 0, R, b->cap), TQKV_OK);
        assert_int_equal(tqkv_cuda_kv_upload(kv, b), TQKV_OK);
        float *dq = dev_copy(q, n);
        for (size_t i = 0; i < n; i++) gpu[i] = NAN;
        dout = dev_copy(gpu, n); /* poisoned */
        assert_int_equal(tqkv_cuda_kv_attend_masked(kv, dq, nq, qh, 0.09f, mask->lo, mask->hi, dout), TQKV_OK);
        assert_int_equal(tqkv_cuda_d2h(gpu, dout, n * 4), TQKV_OK);
        const double e = rel_l2(gpu, cpu, n);
        printf("prefill %s G %d window %d swa %d nq %d: rel L2 vs CPU %.3g\n", tqkv_format_name(cfg.k_format),
               G, W, swa, nq, e);
        if (!(e < 1e-4)) fail_msg("masked GPU attention differs from the CPU: %g", e);
        free(q); free(cpu); free(gpu);
        tqkv_cuda_free(dq); tqkv_cuda_free(dout);
        tqkv_cuda_kv_free(kv);
        tqkv_mask_lease_free(lease);
        tqkv_batch_free(b);
        for (int i = 0; i < R; i++) tqkv_cache_free(rows[i]);
    }
}

// ---------------------------------------------------------------------------
// Row operations in device memory: the same operations on a host batch and on its device
// copy must leave the same state (canonical exports compared byte for byte)
// ---------------------------------------------------------------------------
static void assert_same_state(const struct tqkv_batch *b, const cuda_kv *kv, const char *step) {
    uint8_t *hb = NULL, *db = NULL;
    size_t hl = 0, dl = 0;
    assert_int_equal(state_export(b, 0, &hb, &hl), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_export(kv, &db, &dl), TQKV_OK);
    if (hl != dl || memcmp(hb, db, hl)) fail_msg("%s: device state differs from host (%zu vs %zu bytes)", step, dl, hl);
    free(hb);
    free(db);
}

static void test_cuda_rows(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x50775);
    const int H = 2, W = 24, n_in = 3;
    tqkv_cache_config cfg = mkcfg(rng_int(&r, 0, 1) ? TQKV_TQ4 : TQKV_TQ3, H, W, rng_u64(&r));
    cfg.window_slack = 8;
    tqkv_cache *rows[3];
    tqkv_cache_ref refs[3];
    for (int i = 0; i < n_in; i++) {
        const int T = rng_int(&r, 20, 300);
        const size_t n = (size_t)H * T * 128;
        float *k = malloc(n * 4), *v = malloc(n * 4);
        rng_fill_normal(&r, k, n, 1.0f);
        rng_fill_normal(&r, v, n, 1.0f);
        assert_int_equal(tqkv_cache_init(&rows[i], &cfg), TQKV_OK);
        assert_int_equal(tqkv_cache_append(rows[i], k, v, T), TQKV_OK);
        refs[i].batch = NULL;
        refs[i].single = rows[i];
        free(k);
        free(v);
    }
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_merge(&b, refs, n_in), TQKV_OK);
    cuda_kv *kv = NULL;
    assert_int_equal(tqkv_cuda_kv_init(&kv, &cfg, 0, b->rows, b->cap), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_upload(kv, b), TQKV_OK);
    assert_same_state(b, kv, "upload");
    const int keep[2] = {2, 0};
    assert_int_equal(tqkv_batch_filter(b, keep, 2), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_filter(kv, keep, 2), TQKV_OK);
    assert_same_state(b, kv, "filter");
    const int pads[2] = {rng_int(&r, 0, 9), rng_int(&r, 0, 9)};
    assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_align(kv, pads), TQKV_OK);
    assert_same_state(b, kv, "align");
    /* a spec round: append 6 tokens, keep a different number per row */
    assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_spec_begin(kv), TQKV_OK);
    const size_t na = (size_t)2 * H * 6 * 128;
    float *ka = malloc(na * 4), *va = malloc(na * 4);
    rng_fill_normal(&r, ka, na, 1.0f);
    rng_fill_normal(&r, va, na, 1.0f);
    assert_int_equal(tqkv_batch_append(b, ka, va, 6), TQKV_OK);
    float *dk = dev_copy(ka, na), *dv = dev_copy(va, na);
    assert_int_equal(tqkv_cuda_kv_append(kv, dk, dv, 6), TQKV_OK);
    const int kp[2] = {rng_int(&r, 0, 6), rng_int(&r, 0, 6)};
    assert_int_equal(tqkv_batch_spec_rollback(b, kp, 2), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_spec_rollback(kv, kp, 2), TQKV_OK);
    assert_same_state(b, kv, "spec rollback");
    assert_int_equal(tqkv_batch_trim(b, 1), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_trim(kv, 1), TQKV_OK);
    assert_same_state(b, kv, "trim");
    /* extract row 1, merge it in front of the batch */
    tqkv_cache *one = NULL;
    cuda_kv *kone = NULL, *km = NULL;
    assert_int_equal(tqkv_batch_extract(b, 1, &one), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_extract(kv, 1, &kone), TQKV_OK);
    assert_same_state(one->b, kone, "extract");
    tqkv_cache_ref mr[2] = {{NULL, one}, {b, NULL}};
    tqkv_batch *bm = NULL;
    assert_int_equal(tqkv_batch_merge(&bm, mr, 2), TQKV_OK);
    cuda_kv *items[2] = {kone, kv};
    assert_int_equal(tqkv_cuda_kv_merge(&km, items, 2), TQKV_OK);
    assert_same_state(bm, km, "merge");
    /* restore from the host's export */
    uint8_t *buf = NULL;
    size_t len = 0;
    cuda_kv *kr = NULL;
    assert_int_equal(tqkv_batch_export(bm, &buf, &len), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_restore(&kr, buf, len), TQKV_OK);
    assert_same_state(bm, kr, "restore");
    /* attention over the result still matches the CPU */
    const int qh = 2 * H;
    const size_t nq = (size_t)bm->rows * qh * 128;
    float *q = malloc(nq * 4), *cpu = malloc(nq * 4), *gpu = malloc(nq * 4), *dout = NULL;
    rng_fill_normal(&r, q, nq, 1.0f);
    float *dq = dev_copy(q, nq);
    assert_int_equal(tqkv_cuda_malloc((void **)&dout, nq * 4), TQKV_OK);
    tqkv_mask_lease *lease = NULL;
    const tqkv_mask *mask = NULL;
    assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
    assert_int_equal(tqkv_batch_make_mask(bm, lease, 1, 0, &mask), TQKV_OK);
    tqkv_attn_params p = {.q_heads = qh, .scale = 0.088f, .kernel = TQKV_KERNEL_FUSED, .threads = 2};
    assert_int_equal(tqkv_batch_attend(bm, mask, q, 1, &p, cpu), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_attend(kr, dq, qh, 0.088f, dout), TQKV_OK);
    assert_int_equal(tqkv_cuda_sync(), TQKV_OK);
    assert_int_equal(tqkv_cuda_d2h(gpu, dout, nq * 4), TQKV_OK);
    const double e = rel_l2(gpu, cpu, nq);
    printf("rows: %s, filter/align/spec/trim/extract/merge/restore identical; attention rel L2 %.3g\n",
           tqkv_format_name(cfg.k_format), e);
    if (!(e < 4e-3)) fail_msg("attention after row operations differs: %g", e);
    tqkv_mask_lease_free(lease);
    free(q); free(cpu); free(gpu); free(buf); free(ka); free(va);
    tqkv_cuda_free(dq); tqkv_cuda_free(dout); tqkv_cuda_free(dk); tqkv_cuda_free(dv);
    tqkv_cuda_kv_free(kr); tqkv_cuda_kv_free(km); tqkv_cuda_kv_free(kone); tqkv_cuda_kv_free(kv);
    tqkv_cache_free(one);
    tqkv_batch_free(bm);
    tqkv_batch_free(b);
    for (int i = 0; i < n_in; i++) tqkv_cache_free(rows[i]);
}

// ---------------------------------------------------------------------------
// bf16 baseline
// ---------------------------------------------------------------------------
static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static void test_cuda_attend_bf16(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0xBF16);
    const int R = 3, H = 2, G = 4, qh = H * G, T = rng_int(&r, 300, 2500);
    tqkv_cache_config cfg = mkcfg(TQKV_TQ4, H, 0, 1);
    cuda_kv *kv = NULL;
    assert_int_equal(tqkv_cuda_kv_init(&kv, &cfg, 1, R, T), TQKV_OK);
    const size_t n = (size_t)R * H * T * 128, nq = (size_t)R * qh * 128;
    float *k = malloc(n * 4), *v = malloc(n * 4), *q = malloc(nq * 4), *out = malloc(nq * 4);
    rng_fill_normal(&r, k, n, 1.0f);
    rng_fill_normal(&r, v, n, 1.0f);
    rng_fill_normal(&r, q, nq, 1.0f);
    float *dk = dev_copy(k, n), *dv = dev_copy(v, n), *dq = dev_copy(q, nq), *dout = NULL;
    assert_int_equal(tqkv_cuda_kv_append(kv, dk, dv, T), TQKV_OK);
    assert_int_equal(tqkv_cuda_malloc((void **)&dout, nq * 4), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_attend(kv, dq, qh, 0.08838834764831845f, dout), TQKV_OK);
    assert_int_equal(tqkv_cuda_sync(), TQKV_OK);
    assert_int_equal(tqkv_cuda_d2h(out, dout, nq * 4), TQKV_OK);
    double *ref = calloc(128, sizeof(double)), *sc = malloc((size_t)T * sizeof(double)), worst = 0;
    for (int rr = 0; rr < R; rr++)
        for (int j = 0; j < qh; j++) {
            const int h = j / G;
            const float *qv = q + ((size_t)rr * qh + j) * 128;
            const float *K = k + ((size_t)rr * H + h) * T * 128, *V = v + ((size_t)rr * H + h) * T * 128;
            double mx = -INFINITY, sum = 0;
            for (int t = 0; t < T; t++) {
                double dot = 0;
                for (int d = 0; d < 128; d++) dot += (double)qv[d] * bf16_round(K[(size_t)t * 128 + d]);
                sc[t] = dot * 0.08838834764831845;
                if (sc[t] > mx) mx = sc[t];
            }
            memset(ref, 0, 128 * sizeof(double));
            for (int t = 0; t < T; t++) sum += (sc[t] = exp(sc[t] - mx));
            for (int t = 0; t < T; t++)
                for (int d = 0; d < 128; d++) ref[d] += sc[t] / sum * bf16_round(V[(size_t)t * 128 + d]);
            const double e = rel_l2_d(out + ((size_t)rr * qh + j) * 128, ref, 128);
            if (!(e <= worst)) worst = e;
        }
    printf("bf16 baseline T %d: worst rel L2 vs float64 %.3g\n", T, worst);
    if (!(worst < 1.5e-2)) fail_msg("bf16 baseline differs from the float64 reference: %g", worst);
    free(ref); free(sc); free(k); free(v); free(q); free(out);
    tqkv_cuda_free(dk); tqkv_cuda_free(dv); tqkv_cuda_free(dq); tqkv_cuda_free(dout);
    tqkv_cuda_kv_free(kv);
}

int main(void) {
    if (!tqkv_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_encode_bytes),
        cmocka_unit_test(test_cuda_attend_tq),
        cmocka_unit_test(test_cuda_attend_bf16),
        cmocka_unit_test(test_cuda_rows),
        cmocka_unit_test(test_cuda_prefill),
    };
    test_seed();
    const char *only = getenv("TQKV_TEST_FILTER"); /* e.g. test_cuda_attend_tq, for seed sweeps */
    if (only) cmocka_set_test_filter(only);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#else
int main(void) {
    printf("SKIPPED: built without CUDA\n");
    return 77;
}
#endif
