/*
 * attn_avx512_block.c - AVX-512 twins of the prefill tile micro-kernels of attn_avx2_block.c
 * (QK^T and PV in query-minor layout), used through attn_isa_avx512() on CPUs with AVX-512.
 * Owns: attn_avx512_tile_qk, attn_avx512_tile_pv.
 * Must not: change any lane's arithmetic: every lane runs the AVX2 kernel's FMA sequence
 * (same operands, same order), a zmm simply holds 16 lanes instead of two ymm of 8, so
 * the results are the AVX2 (and scalar) kernels' bits. No allocation, no threads.
 */
#include "attn/attn_internal.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include "util/common.h"

#define AI5 __attribute__((always_inline)) inline

/* st[j, c..c+16*S) = sum_i k[j, i] qt[i, c..] for JJ tokens, S strips of 16 lanes. */
TQKV_AVX512 static AI5 void qk_block512(const int JJ, const int S, const float *k, size_t ldk,
                                        int dim, const float *qt, int mp, int c, float *st) {
    __m512 a[8][2];
#pragma GCC unroll 8
    for (int j = 0; j < JJ; j++)
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) a[j][s] = _mm512_setzero_ps();
    for (int i = 0; i < dim; i++) {
        __m512 q[2];
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) q[s] = _mm512_loadu_ps(qt + (size_t)i * mp + c + 16 * s);
#pragma GCC unroll 8
        for (int j = 0; j < JJ; j++) {
            const __m512 kb = _mm512_set1_ps(k[(size_t)j * ldk + i]);
#pragma GCC unroll 2
            for (int s = 0; s < S; s++) a[j][s] = _mm512_fmadd_ps(kb, q[s], a[j][s]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < JJ; j++)
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) _mm512_storeu_ps(st + (size_t)j * mp + c + 16 * s, a[j][s]);
}

#define QK_BLOCKS(S, JMAX)                                                                        \
    do {                                                                                          \
        int j = 0;                                                                                \
        for (; j + JMAX <= n; j += JMAX)                                                          \
            qk_block512(JMAX, S, k + (size_t)j * ldk, ldk, dim, qt, mp, c, st + (size_t)j * mp);  \
        for (; j < n; j++)                                                                        \
            qk_block512(1, S, k + (size_t)j * ldk, ldk, dim, qt, mp, c, st + (size_t)j * mp);     \
    } while (0)

TQKV_AVX512 void attn_avx512_tile_qk(const float *k, size_t ldk, int n, int dim, const float *qt,
                                     int mp, int l0, int l1, float *st) {
    int c = l0;
    for (; c + 32 <= l1; c += 32) QK_BLOCKS(2, 6);
    for (; c < l1; c += 16) QK_BLOCKS(1, 8);
}

/* ot[i..i+DD, c..c+16*S) += sum_j v[j, i..] pt[j, c..], accumulators loaded from ot. */
TQKV_AVX512 static AI5 void pv_block512(const int DD, const int S, const float *v, size_t ldv,
                                        int n, const float *pt, int mp, int c, int i,
                                        float *ot) {
    __m512 a[8][2];
#pragma GCC unroll 8
    for (int ii = 0; ii < DD; ii++)
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) a[ii][s] = _mm512_loadu_ps(ot + (size_t)(i + ii) * mp + c + 16 * s);
    for (int j = 0; j < n; j++) {
        __m512 p[2];
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) p[s] = _mm512_loadu_ps(pt + (size_t)j * mp + c + 16 * s);
        const float *vj = v + (size_t)j * ldv + i;
#pragma GCC unroll 8
        for (int ii = 0; ii < DD; ii++) {
            const __m512 vb = _mm512_set1_ps(vj[ii]);
#pragma GCC unroll 2
            for (int s = 0; s < S; s++) a[ii][s] = _mm512_fmadd_ps(vb, p[s], a[ii][s]);
        }
    }
#pragma GCC unroll 8
    for (int ii = 0; ii < DD; ii++)
#pragma GCC unroll 2
        for (int s = 0; s < S; s++) _mm512_storeu_ps(ot + (size_t)(i + ii) * mp + c + 16 * s, a[ii][s]);
}

/* dim % 4 == 0 (as the AVX2 kernel assumes). */
TQKV_AVX512 void attn_avx512_tile_pv(const float *v, size_t ldv, int n, int dim, const float *pt,
                                     int mp, int l0, int l1, float *ot) {
    int c = l0;
    for (; c + 32 <= l1; c += 32) {
        int i = 0;
        for (; i + 8 <= dim; i += 8) pv_block512(8, 2, v, ldv, n, pt, mp, c, i, ot);
        for (; i < dim; i += 4) pv_block512(4, 2, v, ldv, n, pt, mp, c, i, ot);
    }
    for (; c < l1; c += 16) {
        int i = 0;
        for (; i + 8 <= dim; i += 8) pv_block512(8, 1, v, ldv, n, pt, mp, c, i, ot);
        for (; i < dim; i += 4) pv_block512(4, 1, v, ldv, n, pt, mp, c, i, ot);
    }
}

#else

typedef int attn_avx512_block_unused; /* ISO C: no empty translation unit */

#endif
