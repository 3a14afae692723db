/*
 * test_matmul.c - the model's batch-invariant matmul: accuracy against a float64 reference,
 * SIMD == scalar bit for bit, and invariance to M, row position, and thread count; the
 * AVX-512 kernels (exact: the same bits as AVX2 and scalar; bf16 activations: accuracy and
 * invariance), skipped on CPUs without them.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/ops/matmul.h"
#include "model/ops/ops.h"
#include "testutil.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// fixtures
// ---------------------------------------------------------------------------

/* Random weights [n, k] of type t; returns storage (free it). */
static void *make_weight(test_rng *r, mm_type t, int n, int k, mm_weight *w) {
    size_t cnt = (size_t)n * k;
    void *buf = malloc(cnt * (t == MM_F32 ? 4 : 2));
    for (size_t i = 0; i < cnt; i++) {
        float v = (float)(rng_normal(r) * 0.05);
        if (t == MM_F32) ((float *)buf)[i] = v;
        else if (t == MM_F16) ((uint16_t *)buf)[i] = tqkv_f32_to_f16(v);
        else ((uint16_t *)buf)[i] = tqkv_f32_to_bf16(v);
    }
    w->data = buf;
    w->type = t;
    w->n = n;
    w->k = k;
    w->f32 = NULL;
    w->packed = 0;
    w->f32p = NULL;
    w->bf16_act = 0;
    return buf;
}

static void ref_matmul(const float *x, int m, const mm_weight *w, const float *bias, double *y) {
    for (int i = 0; i < m; i++)
        for (int n = 0; n < w->n; n++) {
            double s = bias ? bias[n] : 0;
            for (int k = 0; k < w->k; k++) s += (double)x[(size_t)i * w->k + k] * mm_weight_at(w, n, k);
            y[(size_t)i * w->n + n] = s;
        }
}

// ---------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------

static void test_accuracy_and_scalar_twin(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    const int shapes[][3] = {{1, 37, 64}, {3, 50, 72}, {7, 29, 135}, {2, 64, 512}, {5, 17, 8}, {9, 40, 1}};
    for (int t = 0; t < 3; t++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
            mm_weight w;
            void *wb = make_weight(&r, (mm_type)t, n, k, &w);
            float *x = malloc(sizeof(float) * m * k), *bias = malloc(sizeof(float) * n);
            rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
            rng_fill_normal(&r, bias, (size_t)n, 0.1f);
            float *y = malloc(sizeof(float) * m * n), *ys = malloc(sizeof(float) * m * n);
            double *yr = malloc(sizeof(double) * m * n);
            mm_matmul(x, m, &w, s % 2 ? bias : NULL, y, 2, NULL);
            mm_matmul_scalar(x, m, &w, s % 2 ? bias : NULL, ys, 1);
            ref_matmul(x, m, &w, s % 2 ? bias : NULL, yr);
            assert_true(rel_l2_d(y, yr, (size_t)m * n) < 1e-5);
            assert_memory_equal(y, ys, sizeof(float) * m * n);
            free(wb); free(x); free(bias); free(y); free(ys); free(yr);
        }
}

/* Row i of a product is the same bits for any M, any position in the batch, any threads. */
static void test_batch_invariance(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 1);
    for (int t = 0; t < 3; t++) {
        int n = 77, k = 200, m = 23;
        mm_weight w;
        void *wb = make_weight(&r, (mm_type)t, n, k, &w);
        float *x = malloc(sizeof(float) * m * k);
        rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
        float *full = malloc(sizeof(float) * m * n), *part = malloc(sizeof(float) * m * n);
        mm_matmul(x, m, &w, NULL, full, 2, NULL);
        for (int i = 0; i < m; i++) { /* alone */
            mm_matmul(x + (size_t)i * k, 1, &w, NULL, part, 1 + i % 2, NULL);
            assert_memory_equal(part, full + (size_t)i * n, sizeof(float) * n);
        }
        for (int m0 = 0; m0 < m; m0 += 3) { /* sub-batches of every size at every offset */
            int mm = 1 + (m0 * 7) % 9;
            if (m0 + mm > m) mm = m - m0;
            for (int th = 1; th <= 3; th++) {
                mm_matmul(x + (size_t)m0 * k, mm, &w, NULL, part, th, NULL);
                assert_memory_equal(part, full + (size_t)m0 * n, sizeof(float) * n * mm);
            }
        }
        free(wb); free(x); free(full); free(part);
    }
}

/* The scalar fallback chosen by TQKV_NO_SIMD gives the same bits. */
static void test_no_simd_env(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 2);
    int m = 6, n = 40, k = 96;
    mm_weight w;
    void *wb = make_weight(&r, MM_BF16, n, k, &w);
    float *x = malloc(sizeof(float) * m * k), *a = malloc(sizeof(float) * m * n),
          *b = malloc(sizeof(float) * m * n);
    rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
    mm_matmul(x, m, &w, NULL, a, 2, NULL);
    setenv("TQKV_NO_SIMD", "1", 1);
    mm_matmul(x, m, &w, NULL, b, 2, NULL);
    unsetenv("TQKV_NO_SIMD");
    assert_memory_equal(a, b, sizeof(float) * m * n);
    free(wb); free(x); free(a); free(b);
}

/* The packed bf16 layout gives the same bits as the row layout, SIMD and scalar. */
static void test_packed_layout(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 4);
    const int shapes[][3] = {{1, 64, 512}, {2, 24, 48}, {3, 16, 32}, {7, 40, 160}, {13, 8, 16}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        mm_weight w;
        void *wb = make_weight(&r, MM_BF16, n, k, &w);
        assert_true(mm_can_pack(&w));
        uint16_t *pk = malloc(sizeof(uint16_t) * (size_t)n * k);
        mm_pack(&w, pk, 2);
        mm_weight wp = w;
        wp.data = pk;
        wp.packed = 1;
        assert_false(mm_can_pack(&wp));
        for (int i = 0; i < n; i += 7)
            for (int j = 0; j < k; j += 5) assert_true(mm_weight_at(&wp, i, j) == mm_weight_at(&w, i, j));
        float *x = malloc(sizeof(float) * m * k), *a = malloc(sizeof(float) * m * n),
              *b = malloc(sizeof(float) * m * n), *c = malloc(sizeof(float) * m * n),
              *row = malloc(sizeof(float) * k);
        rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
        mm_matmul(x, m, &w, NULL, a, 2, NULL);
        mm_matmul(x, m, &wp, NULL, b, 1 + (int)s % 2, NULL);
        mm_matmul_scalar(x, m, &wp, NULL, c, 1);
        assert_memory_equal(a, b, sizeof(float) * m * n);
        assert_memory_equal(a, c, sizeof(float) * m * n);
        for (int i = 0; i < m; i++) { /* rows alone */
            mm_matmul(x + (size_t)i * k, 1, &wp, NULL, b, 2, NULL);
            assert_memory_equal(a + (size_t)i * n, b, sizeof(float) * n);
        }
        /* the f32 pair-permuted copy: same bits for products of many rows */
        float *f32p = malloc(sizeof(float) * (size_t)n * k);
        assert_true(mm_can_f32p(&w));
        mm_make_f32p(&w, f32p, 2);
        mm_weight wf = wp;
        wf.f32p = f32p;
        int mm = m + MM_F32P_MIN_ROWS;
        float *xx = malloc(sizeof(float) * mm * k), *ya = malloc(sizeof(float) * mm * n),
              *yb = malloc(sizeof(float) * mm * n);
        rng_fill_normal(&r, xx, (size_t)mm * k, 1.0f);
        mm_matmul(xx, mm, &wp, NULL, ya, 2, NULL);
        mm_matmul(xx, mm, &wf, NULL, yb, 1 + (int)s % 2, NULL);
        assert_memory_equal(ya, yb, sizeof(float) * mm * n);
        mm_matmul(xx, 1, &wf, NULL, yb, 1, NULL);
        assert_memory_equal(ya, yb, sizeof(float) * n);
        free(f32p); free(xx); free(ya); free(yb);
        mm_weight_row(&wp, n - 1, row);
        for (int j = 0; j < k; j++) assert_true(row[j] == mm_weight_at(&w, n - 1, j));
        free(wb); free(pk); free(x); free(a); free(b); free(c); free(row);
    }
}

/* A packed bf16 weight [n, k] (n % 8 == 0, k % 16 == 0): *w gets it; returns both buffers
 * to free (row-major source in *src). */
static uint16_t *make_packed(test_rng *r, int n, int k, mm_weight *w, void **src) {
    *src = make_weight(r, MM_BF16, n, k, w);
    uint16_t *pk = malloc(sizeof(uint16_t) * (size_t)n * k);
    mm_pack(w, pk, 1);
    w->data = pk;
    w->packed = 1;
    return pk;
}

/* Row i of x . w^T for rows [m0, m0 + mm) computed alone equals the full product's rows,
 * bit for bit, for every thread count 1..3; also the row alone and with y rows ldy apart. */
static void check_invariance(const float *x, int m, const mm_weight *w, const float *bias,
                             const float *full) {
    int n = w->n, k = w->k;
    float *part = malloc(sizeof(float) * (size_t)m * (n + 3));
    for (int i = 0; i < m; i++) {
        mm_matmul(x + (size_t)i * k, 1, w, bias, part, 1 + i % 2, NULL);
        assert_memory_equal(part, full + (size_t)i * n, sizeof(float) * n);
    }
    for (int m0 = 0; m0 < m; m0 += 5) {
        int mm = 1 + (m0 * 7) % 13;
        if (m0 + mm > m) mm = m - m0;
        for (int th = 1; th <= 3; th++) {
            mm_matmul(x + (size_t)m0 * k, mm, w, bias, part, th, NULL);
            assert_memory_equal(part, full + (size_t)m0 * n, sizeof(float) * n * mm);
        }
        mm_matmul_ld(x + (size_t)m0 * k, mm, w, bias, part, (size_t)n + 3, 2, NULL);
        for (int i = 0; i < mm; i++)
            assert_memory_equal(part + (size_t)i * (n + 3), full + (size_t)(m0 + i) * n,
                                sizeof(float) * n);
    }
    free(part);
}

/* The AVX-512 exact kernels: the AVX2 kernels' and the scalar twin's bits, for every M
 * (tile remainders, more than one 96-row block) and thread count. */
static void test_avx512_exact(void **state) {
    (void)state;
    if (!tqkv_cpu_has_avx512()) {
        print_message("no AVX-512 on this CPU: nothing to compare\n");
        skip();
    }
    test_rng r;
    rng_init(&r, test_seed() + 6);
    const int shapes[][3] = {{1, 64, 512}, {5, 24, 48}, {13, 40, 160}, {100, 16, 1408}, {7, 8, 16}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        mm_weight w;
        void *src;
        uint16_t *pk = make_packed(&r, n, k, &w, &src);
        float *x = malloc(sizeof(float) * m * k), *bias = malloc(sizeof(float) * n),
              *a = malloc(sizeof(float) * m * n), *b = malloc(sizeof(float) * m * n),
              *c = malloc(sizeof(float) * m * n);
        rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
        rng_fill_normal(&r, bias, (size_t)n, 0.1f);
        const float *bs = s % 2 ? bias : NULL;
        mm_matmul(x, m, &w, bs, a, 2, NULL);
        setenv("TQKV_NO_AVX512", "1", 1);
        mm_matmul(x, m, &w, bs, b, 2, NULL);
        unsetenv("TQKV_NO_AVX512");
        mm_matmul_scalar(x, m, &w, bs, c, 1);
        assert_memory_equal(a, b, sizeof(float) * m * n);
        assert_memory_equal(a, c, sizeof(float) * m * n);
        check_invariance(x, m, &w, bs, a);
        free(src); free(pk); free(x); free(bias); free(a); free(b); free(c);
    }
}

/* bf16 activations (vdpbf16ps): within f32 rounding of the float64 product of the
 * bf16-rounded x; batch, tile and thread invariant bit for bit; without AVX-512 (or with
 * TQKV_NO_AVX512=1) the flag is ignored: the exact bits. */
static void test_bf16_act(void **state) {
    (void)state;
    if (!tqkv_cpu_has_avx512_bf16()) {
        print_message("no AVX512_BF16 on this CPU: bf16_act is ignored there\n");
        skip();
    }
    test_rng r;
    rng_init(&r, test_seed() + 7);
    const int shapes[][3] = {{1, 64, 512}, {6, 24, 48}, {13, 40, 160}, {100, 16, 1408},
                             {7, 8, 16}, {200, 32, 64}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        mm_weight w;
        void *src;
        uint16_t *pk = make_packed(&r, n, k, &w, &src);
        float *x = malloc(sizeof(float) * m * k), *xr = malloc(sizeof(float) * m * k),
              *bias = malloc(sizeof(float) * n), *a = malloc(sizeof(float) * m * n),
              *e = malloc(sizeof(float) * m * n), *b = malloc(sizeof(float) * m * n);
        double *yr = malloc(sizeof(double) * m * n), *yx = malloc(sizeof(double) * m * n);
        rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
        rng_fill_normal(&r, bias, (size_t)n, 0.1f);
        for (size_t i = 0; i < (size_t)m * k; i++) xr[i] = tqkv_bf16_to_f32(tqkv_f32_to_bf16(x[i]));
        const float *bs = s % 2 ? bias : NULL;
        mm_matmul(x, m, &w, bs, e, 2, NULL); /* exact */
        w.bf16_act = 1;
        mm_matmul(x, m, &w, bs, a, 2, NULL);
        ref_matmul(xr, m, &w, bs, yr);
        ref_matmul(x, m, &w, bs, yx);
        assert_true(rel_l2_d(a, yr, (size_t)m * n) < 1e-5);  /* f32 sums of exact products */
        assert_true(rel_l2_d(a, yx, (size_t)m * n) < 1e-2);  /* bf16 rounding of x: ~2^-9 */
        assert_true(rel_l2_d(a, yx, (size_t)m * n) > 1e-7);  /* and it did run in bf16 */
        check_invariance(x, m, &w, bs, a);
        setenv("TQKV_NO_AVX512", "1", 1);
        mm_matmul(x, m, &w, bs, b, 2, NULL);
        unsetenv("TQKV_NO_AVX512");
        assert_memory_equal(b, e, sizeof(float) * m * n);
        /* x already bf16-rounded: the same bits (the rounding is idempotent) */
        mm_matmul(xr, m, &w, bs, b, 1, NULL);
        assert_memory_equal(a, b, sizeof(float) * m * n);
        free(src); free(pk); free(x); free(xr); free(bias); free(a); free(e); free(b);
        free(yr); free(yx);
    }
}

static void test_blas_path(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 3);
    int m = 9, n = 33, k = 64;
    mm_weight w;
    void *wb = make_weight(&r, MM_F32, n, k, &w);
    w.f32 = wb;
    float *x = malloc(sizeof(float) * m * k), *y = malloc(sizeof(float) * m * n);
    double *yr = malloc(sizeof(double) * m * n);
    rng_fill_normal(&r, x, (size_t)m * k, 1.0f);
    mm_matmul_blas(x, m, &w, NULL, y, (size_t)n, 1);
    ref_matmul(x, m, &w, NULL, yr);
    assert_true(rel_l2_d(y, yr, (size_t)m * n) < 1e-5);
    free(wb); free(x); free(y); free(yr);
}

/* exp / SwiGLU: SIMD and scalar give the same bits; exp within 2e-7 relative of libm. */
static void test_ops_exp_swiglu(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() + 5);
    enum { N = 1003 };
    float *x = malloc(sizeof(float) * N), *u = malloc(sizeof(float) * N), *a = malloc(sizeof(float) * N),
          *b = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) x[i] = (float)(rng_uniform(&r) * 170.0 - 86.0);
    rng_fill_normal(&r, u, N, 2.0f);
    ops_exp(x, N, a);
    for (int i = 0; i < N; i++) assert_true(fabs(a[i] / exp((double)x[i]) - 1) < 2e-7);
    setenv("TQKV_NO_SIMD", "1", 1);
    ops_exp(x, N, b);
    unsetenv("TQKV_NO_SIMD");
    assert_memory_equal(a, b, sizeof(float) * N);
    for (int i = 0; i < N; i++) x[i] = (float)(rng_normal(&r) * 6);
    ops_swiglu(x, u, N, a);
    setenv("TQKV_NO_SIMD", "1", 1);
    ops_swiglu(x, u, N, b);
    unsetenv("TQKV_NO_SIMD");
    assert_memory_equal(a, b, sizeof(float) * N);
    for (int i = 0; i < N; i++) {
        double ref = x[i] / (1 + exp(-(double)x[i])) * u[i];
        assert_true(fabs(a[i] - ref) <= 1e-6 * fabs(ref) + 1e-30);
    }
    free(x); free(u); free(a); free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accuracy_and_scalar_twin),
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_no_simd_env),
        cmocka_unit_test(test_packed_layout),
        cmocka_unit_test(test_avx512_exact),
        cmocka_unit_test(test_bf16_act),
        cmocka_unit_test(test_blas_path),
        cmocka_unit_test(test_ops_exp_swiglu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
