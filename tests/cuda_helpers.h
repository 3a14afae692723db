/*
 * cuda_helpers.h - helpers for the device cache tests (test_cuda.c, test_cuda_slide.c):
 * host -> device copies, the device state against the host batch's export, the CPU's fused
 * decode through a mask, the worst relative L2 over vectors.
 * Must not: hide assertions about the behaviour under test (they stay in the tests).
 */
#ifndef TQKV_TESTS_CUDA_HELPERS_H
#define TQKV_TESTS_CUDA_HELPERS_H

#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "cache/batch.h"
#include "cache/cache_cuda.h"
#include "cache/cache_impl.h"

/* A device copy of h [n] floats (tqkv_cuda_free it). */
static inline float *dev_copy(const float *h, size_t n) {
    void *d = NULL;
    assert_int_equal(tqkv_cuda_malloc(&d, n * sizeof(float)), TQKV_OK);
    assert_int_equal(tqkv_cuda_h2d(d, h, n * sizeof(float)), TQKV_OK);
    return d;
}

/* The device state's canonical export equals the host batch's, byte for byte. */
static inline void assert_same_state(const struct tqkv_batch *b, const cuda_kv *kv,
                                     const char *step) {
    uint8_t *hb = NULL, *db = NULL;
    size_t hl = 0, dl = 0;
    assert_int_equal(state_export(b, 0, &hb, &hl), TQKV_OK);
    assert_int_equal(tqkv_cuda_kv_export(kv, &db, &dl), TQKV_OK);
    if (hl != dl || memcmp(hb, db, hl))
        fail_msg("%s: device state differs from host (%zu vs %zu bytes)", step, dl, hl);
    free(hb);
    free(db);
}

/* The CPU's fused decode of b (one query per row, q [rows, qh, d]) into out. */
static inline void cpu_decode(const struct tqkv_batch *b, const float *q, int qh, float scale,
                              float *out) {
    tqkv_attn_params p = {.q_heads = qh, .scale = scale, .kernel = TQKV_KERNEL_FUSED, .threads = 2};
    tqkv_mask_lease *lease = NULL;
    const tqkv_mask *mask = NULL;
    assert_int_equal(tqkv_mask_lease_init(&lease), TQKV_OK);
    assert_int_equal(tqkv_batch_make_mask(b, lease, 1, 0, &mask), TQKV_OK);
    assert_int_equal(tqkv_batch_attend(b, mask, q, 1, &p, out), TQKV_OK);
    tqkv_mask_lease_free(lease);
}

/* Worst rel L2 over nv vectors of d (NaN sticks). */
static inline double worst_rel(const float *a, const float *b, size_t nv, int d) {
    double worst = 0;
    for (size_t i = 0; i < nv; i++) {
        const double e = rel_l2(a + i * d, b + i * d, (size_t)d);
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

#endif
