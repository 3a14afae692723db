/*
 * test_cuda_slide.c - sliding-window layers on the device cache (src/cache/cache_cuda_slide.cu)
 * against batch_slide.c, on fresh random inputs, head_dim 128 and 256, tq4 and tq3 with the
 * q8 window (its ring wrapped):
 *   - tqkv_cuda_kv_drop_oldest: the device export equals tqkv_batch_drop_oldest's byte for
 *     byte, a drop that leaves every row's padding past keep compacts (in place on the device:
 *     the common padding gone) on both, and a second drop is still equal;
 *   - window views: decode attention over tqkv_cuda_kv_window_view(kv, W, 0) equals the
 *     same attention after a real drop to W tokens, bit for bit, and the CPU's fused decode
 *     of the dropped batch within the kernel's bound; a view `back` tokens back equals a
 *     trimmed-then-dropped copy within float rounding (printed: bitwise or not);
 *   - misuse: a drop inside a spec round, an unreserved scratch, back past a row's length:
 *     refused with a message, nothing changed.
 * Exits 77 (skipped) when the build has no CUDA or no GPU is present.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#ifdef TQKV_HAVE_CUDA
#include "cuda_helpers.h"

/* Decode attention of kv (q: DEVICE [rows, qh, d]) into host out [n]. */
static void gpu_decode(cuda_kv *kv, const float *dq, int qh, float *dout, float *out, size_t n) {
    assert_int_equal(tqkv_cuda_kv_attend(kv, dq, qh, 0.088f, dout), TQKV_OK);
    assert_int_equal(tqkv_cuda_sync(), TQKV_OK);
    assert_int_equal(tqkv_cuda_d2h(out, dout, n * 4), TQKV_OK);
}

/* One case: D head dim, format f; tol: the decode kernel's bound against the CPU (the fp16
 * tensor-core kernels, as test_cuda; d 256 with TQKV_WIDE_TC=0: the float32 one). */
static void slide_case(int D, tqkv_format f, double tol, uint64_t mix) {
    test_rng r;
    rng_init(&r, test_seed() ^ mix);
    enum { H = 2, R = 3 };
    const int qh = 2 * H;
    tqkv_cache_config cfg = tqkv_cache_config_default();
    cfg.k_format = cfg.v_format = f;
    cfg.kv_heads = H;
    cfg.head_dim = D;
    cfg.window = 16; /* the q8 recent window */
    cfg.window_slack = 8;
    cfg.seed = rng_u64(&r);
    /* rows of unequal lengths, each longer than the ring (wrapped) */
    tqkv_cache *rows[R];
    tqkv_cache_ref refs[R];
    int len[R];
    for (int i = 0; i < R; i++) {
        len[i] = rng_int(&r, 60, 420);
        const size_t n = (size_t)H * len[i] * D;
        float *k = malloc(n * 4), *v = malloc(n * 4);
        rng_fill_normal(&r, k, n, 1.0f);
        rng_fill_normal(&r, v, n, 1.0f);
        assert_int_equal(tqkv_cache_init(&rows[i], &cfg), TQKV_OK);
        assert_int_equal(tqkv_cache_append(rows[i], k, v, len[i]), TQKV_OK);
        refs[i].batch = NULL;
        refs[i].single = rows[i];
        free(k);
        free(v);
    }
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_merge(&b, refs, R), TQKV_OK);
    cuda_kv *kv = NULL;
    assert_int_equal(tqkv_cuda_kv_init(&kv, &cfg, 0, b->rows, b->cap), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_upload(kv, b), TQKV_OK);
    assert_same_state(b, kv, "upload");
    cuda_kv_slide *s = NULL;
    assert_int_equal(tqkv_cuda_slide_init(&s), TQKV_OK);
    cuda_kv *view = NULL;
    /* misuse: an unreserved scratch */
    assert_int_equal(tqkv_cuda_kv_window_view(kv, s, 32, 0, &view), TQKV_EINVAL);
    assert_int_equal(tqkv_cuda_kv_drop_oldest(kv, s, 32), TQKV_EINVAL);
    int moved = 0;
    assert_int_equal(tqkv_cuda_slide_reserve(s, kv, &moved), TQKV_OK);
    assert_int_equal(moved, 1);
    assert_int_equal(tqkv_cuda_slide_reserve(s, kv, &moved), TQKV_OK);
    assert_int_equal(moved, 0);
    int shortest = len[0];
    for (int i = 1; i < R; i++) shortest = len[i] < shortest ? len[i] : shortest;
    /* misuse: back past a row's length */
    assert_int_equal(tqkv_cuda_kv_window_view(kv, s, 32, shortest + 1, &view), TQKV_ERANGE);
    assert_same_state(b, kv, "refused view");

    const size_t nq = (size_t)R * qh * D;
    float *q = malloc(nq * 4), *viewed = malloc(nq * 4), *dropped = malloc(nq * 4),
          *cpu = malloc(nq * 4), *back_v = malloc(nq * 4), *back_ref = malloc(nq * 4), *dout = NULL;
    rng_fill_normal(&r, q, nq, 1.0f);
    float *dq = dev_copy(q, nq);
    assert_int_equal(tqkv_cuda_malloc((void **)&dout, nq * 4), TQKV_OK);

    /* a view `back` tokens back against a copy trimmed by back, then dropped to W */
    const int W = rng_int(&r, 20, shortest - 4), back = rng_int(&r, 1, 4);
    assert_int_equal(tqkv_cuda_kv_window_view(kv, s, W, back, &view), TQKV_OK);
    gpu_decode(view, dq, qh, dout, back_v, nq);
    {
        const int all[R] = {0, 1, 2};
        cuda_kv *c = NULL;
        cuda_kv_slide *s2 = NULL;
        assert_int_equal(tqkv_cuda_kv_select(kv, all, R, &c), TQKV_OK);
        assert_int_equal(tqkv_cuda_kv_trim(c, back), TQKV_OK);
        assert_int_equal(tqkv_cuda_slide_init(&s2), TQKV_OK);
        assert_int_equal(tqkv_cuda_slide_reserve(s2, c, NULL), TQKV_OK);
        assert_int_equal(tqkv_cuda_kv_drop_oldest(c, s2, W), TQKV_OK);
        gpu_decode(c, dq, qh, dout, back_ref, nq);
        tqkv_cuda_slide_free(s2);
        tqkv_cuda_kv_free(c);
    }
    const double eb = worst_rel(back_v, back_ref, (size_t)R * qh, D);
    const int back_bitwise = !memcmp(back_v, back_ref, nq * 4);
    if (!(eb < 1e-6)) fail_msg("view %d back vs trimmed + dropped copy: %g", back, eb);

    /* a view of the newest W against a real drop to W: bitwise, and near the CPU's */
    assert_int_equal(tqkv_cuda_kv_window_view(kv, s, W, 0, &view), TQKV_OK);
    gpu_decode(view, dq, qh, dout, viewed, nq);
    assert_same_state(b, kv, "after views"); /* a view changes nothing */
    assert_int_equal(tqkv_batch_drop_oldest(b, W), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_drop_oldest(kv, s, W), TQKV_OK);
    assert_same_state(b, kv, "drop");
    gpu_decode(kv, dq, qh, dout, dropped, nq);
    if (memcmp(viewed, dropped, nq * 4)) fail_msg("window view != attention after the drop");
    cpu_decode(b, q, qh, 0.088f, cpu);
    const double e = worst_rel(dropped, cpu, (size_t)R * qh, D);
    if (!(e < tol)) fail_msg("attention after the drop vs CPU: %g (bound %g)", e, tol);

    /* misuse: a drop inside a spec round */
    assert_int_equal(tqkv_cuda_kv_spec_begin(kv), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_drop_oldest(kv, s, 4), TQKV_ESTATE);
    assert_int_equal(tqkv_cuda_kv_spec_commit(kv), TQKV_OK);
    assert_same_state(b, kv, "refused drop");

    /* append past the bound, drop again: every row's padding passes keep, so both compact */
    const int na = 5, keep = W / 2;
    const size_t n = (size_t)R * H * na * D;
    float *ka = malloc(n * 4), *va = malloc(n * 4);
    rng_fill_normal(&r, ka, n, 1.0f);
    rng_fill_normal(&r, va, n, 1.0f);
    float *dk = dev_copy(ka, n), *dv = dev_copy(va, n);
    assert_int_equal(tqkv_batch_append(b, ka, va, na), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_append(kv, dk, dv, na), TQKV_OK);
    assert_same_state(b, kv, "append after the drop");
    assert_int_equal(tqkv_batch_drop_oldest(b, keep), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_drop_oldest(kv, s, keep), TQKV_OK);
    assert_same_state(b, kv, "second drop");
    /* compacted (in place: the kept rows shifted left) when the common padding is gone */
    int min_pad = -1;
    for (int i = 0; i < R; i++)
        if (min_pad < 0 || tqkv_cuda_kv_left_pads(kv)[i] < min_pad) min_pad = tqkv_cuda_kv_left_pads(kv)[i];
    if (min_pad != 0) fail_msg("a drop leaving every row's padding >= keep did not compact (pad %d)", min_pad);

    printf("slide d %d %s: lens %d %d %d, W %d: view == drop bitwise, vs CPU %.3g; view %d back "
           "vs trimmed + dropped %.3g (%s); drops and compaction byte-equal to the CPU's\n",
           D, tqkv_format_name(f), len[0], len[1], len[2], W, e, back, eb,
           back_bitwise ? "bitwise" : "not bitwise");
    free(q);
    free(viewed);
    free(dropped);
    free(cpu);
    free(back_v);
    free(back_ref);
    free(ka);
    free(va);
    tqkv_cuda_free(dq);
    tqkv_cuda_free(dout);
    tqkv_cuda_free(dk);
    tqkv_cuda_free(dv);
    tqkv_cuda_slide_free(s);
    tqkv_cuda_kv_free(kv);
    tqkv_batch_free(b);
    for (int i = 0; i < R; i++) tqkv_cache_free(rows[i]);
}

static void test_cuda_slide_d128(void **state) {
    (void)state;
    slide_case(128, TQKV_TQ4, 6e-3, 0x511de4);
    slide_case(128, TQKV_TQ3, 6e-3, 0x511de3);
}

/* d 256: the tensor-core kernel's bound (test_cuda.c d256_tol: d = 128's, 6e-3, for the same
 * fp16 roundings), 1e-4 when TQKV_WIDE_TC=0 selects the float32 kernel */
static void test_cuda_slide_d256(void **state) {
    (void)state;
    const double tol = tqkv_cuda_wide_tc() > 0 ? 6e-3 : 1e-4;
    slide_case(256, TQKV_TQ4, tol, 0x5256e4);
    slide_case(256, TQKV_TQ3, tol, 0x5256e3);
}

int main(void) {
    if (!tqkv_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_slide_d128),
        cmocka_unit_test(test_cuda_slide_d256),
    };
    test_seed();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
#else
int main(void) {
    printf("SKIPPED: built without CUDA\n");
    return 77;
}
#endif
