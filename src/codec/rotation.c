/*
 * rotation.c - randomized Hadamard rotation R = H D / sqrt(d).
 * Owns: sign flips from (seed, dim) via splitmix64, the normalized fast
 * Walsh-Hadamard transform (O(d log d)), codec_rotate / codec_unrotate.
 * Must not: quantize, allocate, or keep state (signs live in the codec).
 *
 * Every path multiplies in the same order so scalar and AVX2 agree bitwise:
 *   rotate:   x[i] *= signs[i] (exact); butterflies; x[i] *= inv
 *   unrotate: butterflies; x[i] *= signs[i] * inv  (signs[i] * inv is exact)
 * A codec without rotation (rotated == 0: f32/f16/q8/q4) has R = identity.
 */
#include <math.h>

#include "codec/codec_impl.h"

// ---------------------------------------------------------------------------
// Signs
// ---------------------------------------------------------------------------

static uint64_t splitmix64_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* State starts at seed ^ (dim * 0xD1B54A32D192ED03); word w = the (w+1)-th
 * splitmix64 output; coordinate 64w + j gets -1 when bit j of word w is set. */
void codec_make_signs(uint64_t seed, int dim, float *signs) {
    // signs: [dim]
    uint64_t s = seed ^ ((uint64_t)dim * 0xD1B54A32D192ED03ull);
    uint64_t w = 0;
    for (int i = 0; i < dim; i++) {
        if ((i & 63) == 0) w = splitmix64_next(&s);
        signs[i] = ((w >> (i & 63)) & 1) ? -1.0f : 1.0f;
    }
}

// ---------------------------------------------------------------------------
// Walsh-Hadamard
// ---------------------------------------------------------------------------

float codec_inv_sqrt_dim(int dim) { return (float)(1.0 / sqrt((double)dim)); }

/* Stage h pairs (j, j+h): x[j] = a + b, x[j+h] = a - b. dim >= 8. */
void codec_fwht_raw(float *x, int dim) {
    // x: [dim]
    for (int i = 0; i < dim; i += 8) { /* h = 1, 2, 4 inside blocks of 8 */
        float *v = x + i;
        for (int h = 1; h < 8; h <<= 1)
            for (int j = 0; j < 8; j += 2 * h)
                for (int k = j; k < j + h; k++) {
                    float a = v[k], b = v[k + h];
                    v[k] = a + b;
                    v[k + h] = a - b;
                }
    }
    for (int h = 8; h < dim; h <<= 1)
        for (int i = 0; i < dim; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
                float *p = x + j, *q = x + j + h;
                for (int k = 0; k < 8; k++) { /* fixed trip count: vectorizes */
                    float a = p[k], b = q[k];
                    p[k] = a + b;
                    q[k] = a - b;
                }
            }
}

void codec_fwht(float *x, int dim) {
    codec_fwht_raw(x, dim);
    const float inv = codec_inv_sqrt_dim(dim);
    for (int i = 0; i < dim; i++) x[i] *= inv;
}

// ---------------------------------------------------------------------------
// Rotation
// ---------------------------------------------------------------------------

void codec_rotate(const struct tqkv_codec *c, float *x) {
    if (!c->rotated || !c->signs) return;
    for (int i = 0; i < c->dim; i++) x[i] *= c->signs[i];
    codec_fwht(x, c->dim); /* butterflies, then x[i] *= inv */
}

void codec_unrotate(const struct tqkv_codec *c, float *x) {
    if (!c->rotated || !c->signs) return;
    const int d = c->dim;
    const float inv = codec_inv_sqrt_dim(d);
    codec_fwht_raw(x, d);
    for (int i = 0; i < d; i++) x[i] *= c->signs[i] * inv;
}
