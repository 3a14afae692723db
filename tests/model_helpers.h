/*
 * model_helpers.h - helpers for the model graph tests (test_model.c, test_gemma4.c,
 * test_qwen35.c): reading a golden file whole, greedy argmax of a logits vector.
 * Must not: hide assertions about the behaviour under test (they stay in the tests).
 */
#ifndef TQKV_MODEL_HELPERS_H
#define TQKV_MODEL_HELPERS_H

#include <stdio.h>
#include <stdlib.h>

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

#endif
