/*
 * attn_avx2.h - private to src/attn/attn_avx2*.c: shared TQKV_AVX2 helpers (loads, horizontal
 * sums, vector exp) and the float-only primitives defined in attn_avx2_block.c.
 * Owns: nothing stateful; every helper is static inline.
 * Must not: be included outside src/attn, or on a non-x86 build (callers guard it).
 */
#ifndef TQKV_ATTN_AVX2_H
#define TQKV_ATTN_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "util/common.h" /* TQKV_AVX2 */

#define AI   __attribute__((always_inline)) inline

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
TQKV_AVX2 static AI __m256 ld(const float *p) { return _mm256_loadu_ps(p); }
TQKV_AVX2 static AI __m256 bc(const float *p) { return _mm256_broadcast_ss(p); }
TQKV_AVX2 static AI __m256 h2f(uint16_t h) { return _mm256_set1_ps(_cvtsh_ss(h)); }
TQKV_AVX2 static AI __m256i ldzx8(const uint8_t *p) {   // 8 bytes -> 8 uint32 lanes
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p));
}
TQKV_AVX2 static AI __m256 perm(__m256 t, __m256i i) { return _mm256_permutevar8x32_ps(t, i); }
/* 4-entry lookup (bits 1..0 of each lane; the table repeated in both 128-bit halves):
 * the in-lane vpermilps, a little cheaper than vpermps here. */
TQKV_AVX2 static AI __m256 perm4(__m256 t, __m256i i) { return _mm256_permutevar_ps(t, i); }
/* Keep v in a register: stops GCC from folding a shared load back into every FMA as a
 * memory operand (256-bit loads, 2 per cycle, are the decode kernels' tightest port). */
#define KEEP(v) __asm__("" : "+x"(v))
/* Prefetch hint threshold: token strides up to this many bytes go to L1 (a block of a
 * compact format is a few KiB), wider ones to L2. */
#define PF_L1_MAX_STRIDE 160
/* Score strategy per format (measured on Zen 4): f32/f16 and tq3 decode one chunk at a time
 * for two tokens sharing each q load; the others decode pairs, one token per step. */
#define SCORE_PAIR(fmt) ((fmt) >= TQKV_Q8 && (fmt) != TQKV_TQ3)

/* r[i] = sum of a[i]'s 8 lanes, tree ((0+1)+(2+3))+((4+5)+(6+7)) for every i. */
TQKV_AVX2 static AI __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                            __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* r[i] = sum of a_i's 8 lanes for i < 4 (xmm), same tree as hsum8. */
TQKV_AVX2 static AI __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

TQKV_AVX2 static AI float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

TQKV_AVX2 static AI float hsum1(__m256 v) {   // fixed order
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

/* exp(x) for x <= 0 (every caller subtracts a running max), ~1 ulp on [-87.3, 0];
 * exactly 0 below (and for -inf); exp(0) == 1 exactly. */
TQKV_AVX2 static AI __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 zero = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero, y);
}

// ---------------------------------------------------------------------------
// Float-only primitives (attn_avx2_block.c), as in attn_isa
// ---------------------------------------------------------------------------
TQKV_AVX2 void attn_avx2_softmax_block(float *sc, int ldsc, int n, int nh, const float *ks,
                                 const float *vs, float *m, float *l, float *acc, int dim,
                                 float *w, int ldw);
TQKV_AVX2 void attn_avx2_token_scales(const uint16_t *sc, int n, float mul, float *out);
TQKV_AVX2 void attn_avx2_rotate(const float *signs, int dim, float *x);
TQKV_AVX2 void attn_avx2_unrotate(const float *signs, int dim, float *x);
TQKV_AVX2 void attn_avx2_tile_qk(const float *k, size_t ldk, int n, int dim, const float *qt,
                                int mp, int l0, int l1, float *st);
TQKV_AVX2 void attn_avx2_tile_softmax(float *st, int n, int tok0, int mp, int l0, int l1,
                                const int32_t *lo, const int32_t *hi, float *m, float *l,
                                float *ot, int dim);
TQKV_AVX2 void attn_avx2_tile_pv(const float *v, size_t ldv, int n, int dim, const float *pt,
                                int mp, int l0, int l1, float *ot);

#endif
