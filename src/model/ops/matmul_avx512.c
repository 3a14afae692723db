/*
 * matmul_avx512.c - AVX-512 kernels for packed bf16 weights (see matmul_avx512.h).
 * Owns: two register-blocked micro-kernels over (MR rows x one 8-row weight group) tiles:
 *   exact: bf16 weights widened to f32, f32 FMAs in the order of matmul.h (bitwise equal to
 *          the AVX2 and scalar kernels, twice their vector width);
 *   bf16:  activations rounded to bf16, vdpbf16ps (AVX512_BF16), f32 sums.
 * Must not: let the tile shape, M, the thread split or the CPU path choice within a mode
 * change any output bit. Each zmm accumulator holds two outputs (weight rows 2p, 2p+1 of a
 * group, 8 lanes each), so a tile only decides which outputs are computed together.
 */
#include "model/ops/matmul_avx512.h"

#include <stdint.h>
#include <stdlib.h>

#include "util/common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AINL __attribute__((always_inline)) inline
#define MB512 96 /* rows per M block: a block of x stays in L2 while the weights stream */

// ---------------------------------------------------------------------------
// the 8-lane reduction of four accumulators (8 outputs)
// ---------------------------------------------------------------------------

/* v[p] holds output 2p in lanes 0-7 and 2p+1 in lanes 8-15. Returns the 8 sums, each
 * ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) of its 8 lanes (hsum8 of matmul.c, vectorized). */
static AINL TQKV_AVX512 __m256 reduce8x8(const __m512 v[4]) {
    /* c = (a0+a4, a1+a5, a2+a6, a3+a7) per output, one output per 128-bit quarter */
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 1, 3, 1)));
    /* r = (s01.c0+c2, s01.c1+c3, s23.c0+c2, s23.c1+c3) per quarter */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 f = _mm512_add_ps(_mm512_shuffle_ps(r, r, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(r, r, _MM_SHUFFLE(3, 1, 3, 1)));
    /* quarter q lane 0: output q of s01 (v0A v0B v1A v1B); lane 1: of s23 (v2A ... v3B) */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, f));
}

static AINL TQKV_AVX512 void store8(float *y, __m256 r, const float *bias) {
    if (bias) r = _mm256_add_ps(r, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, r);
}

// ---------------------------------------------------------------------------
// exact: f32 FMAs, the order of matmul.h
// ---------------------------------------------------------------------------

/* Rows x[0..MR) (stride ldx, pair-permuted) times the 8 rows of one packed group wg
 * ([k/16][8][16]) into y[i * ldy + 0..8). MR <= 4. Per 16-block the evens of a pair
 * ((v << 16)) meet x's first 8, the odds (v & 0xffff0000) its second 8, as in matmul.c. */
static AINL TQKV_AVX512 void tile_exact(const float *x, size_t ldx, const uint16_t *wg, int K,
                                        float *y, size_t ldy, const float *bias, const int MR) {
    __m512 acc[4][4];
    #pragma GCC unroll 6
    for (int i = 0; i < MR; i++)
        #pragma GCC unroll 6
        for (int p = 0; p < 4; p++) acc[i][p] = _mm512_setzero_ps();
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < K; k += 16) {
        const uint16_t *b = wg + (size_t)k * 8;
        __m512 we[4], wo[4];
        #pragma GCC unroll 6
        for (int p = 0; p < 4; p++) {
            __m512i v = _mm512_loadu_si512((const void *)(b + 32 * p));
            we[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[p] = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
        }
        #pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            __m512 xe = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (size_t)i * ldx + k));
            __m512 xo = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (size_t)i * ldx + k + 8));
            #pragma GCC unroll 6
            for (int p = 0; p < 4; p++) {
                acc[i][p] = _mm512_fmadd_ps(xe, we[p], acc[i][p]);
                acc[i][p] = _mm512_fmadd_ps(xo, wo[p], acc[i][p]);
            }
        }
    }
    #pragma GCC unroll 6
    for (int i = 0; i < MR; i++) store8(y + (size_t)i * ldy, reduce8x8(acc[i]), bias);
}

#define DEF_EXACT(MR)                                                                             \
    static TQKV_AVX512 void tile_exact_##MR(const float *x, size_t ldx, const uint16_t *wg,     \
                                            int K, float *y, size_t ldy, const float *bias) {   \
        tile_exact(x, ldx, wg, K, y, ldy, bias, MR);                                             \
    }
DEF_EXACT(1) DEF_EXACT(2) DEF_EXACT(3) DEF_EXACT(4)

void mm512_range_exact(const float *xp, int m, const mm_weight *w, const float *bias, float *y,
                       size_t ldy, int n0, int n1) {
    typedef void (*fn)(const float *, size_t, const uint16_t *, int, float *, size_t, const float *);
    static const fn tiles[5] = {NULL, tile_exact_1, tile_exact_2, tile_exact_3, tile_exact_4};
    const int K = w->k;
    const uint16_t *wb = w->data;
    for (int mb = 0; mb < m; mb += MB512) {
        int me = mb + MB512 < m ? mb + MB512 : m;
        for (int n = n0; n < n1; n += 8) {
            const uint16_t *wg = wb + (size_t)n * K; /* group n / 8 starts at n * K */
            for (int i = mb; i < me; i += 4) {
                int mr = me - i < 4 ? me - i : 4;
                tiles[mr](xp + (size_t)i * K, (size_t)K, wg, K, y + (size_t)i * ldy + n, ldy,
                          bias ? bias + n : NULL);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// bf16 activations: vdpbf16ps
// ---------------------------------------------------------------------------

/* Rows xb[0..MR) (bf16, stride ldx) times one packed group: lane l of output 2p / 2p+1
 * takes pair l of each 16-block. MR <= 6 (24 accumulators, 4 weight vectors, 1 x).
 * pf: NULL, or the next group, fetched into L1 a k-step at a time while this one computes
 * (with few rows the hardware prefetcher alone leaves the cores waiting on DRAM). */
static AINL TQKV_AVX512_BF16 void tile_bf16(const uint16_t *xb, size_t ldx, const uint16_t *wg,
                                            int K, float *y, size_t ldy, const float *bias,
                                            const uint16_t *pf, const int MR) {
    __m512 acc[6][4];
    #pragma GCC unroll 6
    for (int i = 0; i < MR; i++)
        #pragma GCC unroll 6
        for (int p = 0; p < 4; p++) acc[i][p] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const uint16_t *b = wg + (size_t)k * 8;
        if (pf)
            for (int p = 0; p < 4; p++) _mm_prefetch((const char *)(pf + (size_t)k * 8 + 32 * p), _MM_HINT_T0);
        __m512bh v[4];
        #pragma GCC unroll 6
        for (int p = 0; p < 4; p++) v[p] = (__m512bh)_mm512_loadu_si512((const void *)(b + 32 * p));
        #pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            __m512bh xv = (__m512bh)_mm512_broadcast_i32x8(
                _mm256_loadu_si256((const __m256i *)(xb + (size_t)i * ldx + k)));
            #pragma GCC unroll 6
            for (int p = 0; p < 4; p++) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], xv, v[p]);
        }
    }
    #pragma GCC unroll 6
    for (int i = 0; i < MR; i++) store8(y + (size_t)i * ldy, reduce8x8(acc[i]), bias);
}

#define DEF_BF16(MR)                                                                              \
    static TQKV_AVX512_BF16 void tile_bf16_##MR(const uint16_t *xb, size_t ldx,                 \
                                                const uint16_t *wg, int K, float *y, size_t ldy, \
                                                const float *bias, const uint16_t *pf) {        \
        tile_bf16(xb, ldx, wg, K, y, ldy, bias, pf, MR);                                         \
    }
DEF_BF16(1) DEF_BF16(2) DEF_BF16(3) DEF_BF16(4) DEF_BF16(5) DEF_BF16(6)

/* x: the bf16 copy of the activations ([m, K] uint16), typed as mm_range_fn wants. */
static void range_bf16(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                       size_t ldy, int n0, int n1) {
    const uint16_t *xb = (const uint16_t *)x;
    typedef void (*fn)(const uint16_t *, size_t, const uint16_t *, int, float *, size_t,
                       const float *, const uint16_t *);
    static const fn tiles[7] = {NULL, tile_bf16_1, tile_bf16_2, tile_bf16_3,
                                tile_bf16_4, tile_bf16_5, tile_bf16_6};
    const int K = w->k;
    const uint16_t *wb = w->data;
    for (int mb = 0; mb < m; mb += MB512) {
        int me = mb + MB512 < m ? mb + MB512 : m;
        for (int n = n0; n < n1; n += 8) {
            const uint16_t *wg = wb + (size_t)n * K;
            const uint16_t *next = n + 8 < n1 ? wg + (size_t)8 * K : NULL;
            for (int i = mb; i < me; i += 6) {
                int mr = me - i < 6 ? me - i : 6;
                tiles[mr](xb + (size_t)i * K, (size_t)K, wg, K, y + (size_t)i * ldy + n, ldy,
                          bias ? bias + n : NULL, i == mb ? next : NULL);
            }
        }
    }
}

/* xb [m, K] = x rounded to bf16, nearest even (K % 16 == 0). */
static TQKV_AVX512_BF16 void to_bf16(const float *x, size_t cnt, uint16_t *xb) {
    for (size_t i = 0; i < cnt; i += 16)
        _mm256_storeu_si256((__m256i *)(xb + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

int mm512_matmul_bf16(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                      size_t ldy, int threads, float *scratch) {
    const int K = w->k;
    uint16_t *xb = scratch ? (uint16_t *)scratch : malloc(sizeof(uint16_t) * (size_t)m * K);
    if (!xb) return 0;
    to_bf16(x, (size_t)m * K, xb);
    mm_run_split(range_bf16, (const float *)xb, m, w, bias, y, ldy, threads, 8);
    if ((float *)xb != scratch) free(xb);
    return 1;
}

#else /* not x86: never called (the cpu checks fail) */

void mm512_range_exact(const float *xp, int m, const mm_weight *w, const float *bias, float *y,
                       size_t ldy, int n0, int n1) {
    (void)xp; (void)m; (void)w; (void)bias; (void)y; (void)ldy; (void)n0; (void)n1;
}
int mm512_matmul_bf16(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                      size_t ldy, int threads, float *scratch) {
    (void)x; (void)m; (void)w; (void)bias; (void)y; (void)ldy; (void)threads; (void)scratch;
    return 0;
}
#endif
