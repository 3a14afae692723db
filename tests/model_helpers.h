/*
 * model_helpers.h - helpers for the model graph tests (test_model.c, test_gemma4.c,
 * test_qwen35.c, test_cuda_model.c): reading a golden file whole, greedy argmax of a logits
 * vector, twin samplers for the decode-and-pick tests.
 * Must not: hide assertions about the behaviour under test (they stay in the tests).
 */
#ifndef TQKV_MODEL_HELPERS_H
#define TQKV_MODEL_HELPERS_H

#include <stdio.h>
#include <stdlib.h>

#include "testutil.h"
#include "tqkv_model.h"

/* malloc'd contents of path with a terminating 0 (length in *len); NULL if unreadable. */
static inline char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        fclose(f);
        return NULL;
    }
    fclose(f);
    b[n] = 0;
    if (len) *len = (size_t)n;
    return b;
}

/* Index of the largest of x [n] (first one on ties). */
static inline int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Two samplers per row with the same parameters and a fresh seed each (sp[r].seed is set),
 * both fed the row's N prompt tokens: a [R] for the call under test, b [R] for the
 * reference. Returns TQKV_OK or the first failure. */
static inline tqkv_status sampler_twins(tqkv_sampler **a, tqkv_sampler **b, tqkv_sampler_params *sp, int R,
                                        int V, const int32_t *prompt, int N, test_rng *rng) {
    for (int r = 0; r < R; r++) {
        sp[r].seed = rng_u64(rng);
        tqkv_status st = tqkv_sampler_init(&a[r], &sp[r], V);
        if (!st) st = tqkv_sampler_init(&b[r], &sp[r], V);
        for (int j = 0; j < N && !st; j++) {
            st = tqkv_sampler_accept(a[r], prompt[r * N + j]);
            if (!st) st = tqkv_sampler_accept(b[r], prompt[r * N + j]);
        }
        if (st) return st;
    }
    return TQKV_OK;
}

#endif
