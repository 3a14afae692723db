/*
 * attn_avx2_block.c - AVX2/FMA/F16C primitives that only see floats (no stored format):
 * the online-softmax block, per-token tq scales, the rotation, and the prefill tile
 * micro-kernels (QK^T, masked online softmax, PV in query-minor layout).
 * Must not: allocate, use threads, or let a result depend on anything but its own lane
 * (same fixed-order rules as attn_avx2.c).
 */
#include "attn/attn_internal.h"

#if defined(__x86_64__) || defined(__i386__)

#include "attn/attn_avx2.h"

// ---------------------------------------------------------------------------
// Online softmax block
// ---------------------------------------------------------------------------
TQKV_AVX2 void attn_avx2_softmax_block(float *sc, int ldsc, int n, int nh, const float *ks,
                                 const float *vs, float *m, float *l, float *acc, int dim,
                                 float *w, int ldw) {
    const int n8 = (n + 7) & ~7;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < nh; h++) {
        const float *s = sc + (size_t)h * ldsc;
        float *wh = w + (size_t)h * ldw;
        __m256 vmax = ninf;
        for (int t = 0; t < n8; t += 8) {
            __m256 x = _mm256_mul_ps(ld(s + t), ld(ks + t));
            if (t + 8 > n) {   // tail lanes -> -inf
                const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                    _mm256_set1_epi32(n), _mm256_add_epi32(_mm256_set1_epi32(t), lane)));
                x = _mm256_blendv_ps(ninf, x, keep);
            }
            vmax = _mm256_max_ps(vmax, x);
        }
        const float bm = hmax8(vmax);
        const float mn = m[h] > bm ? m[h] : bm;
        const __m256 vmn = _mm256_set1_ps(mn);
        const float alpha = m[h] == -INFINITY
                                ? 0.0f
                                : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[h] - mn)));
        __m256 vsum = _mm256_setzero_ps();
        for (int t = 0; t < n8; t += 8) {
            // same product as the max pass, then - mn (exact: fmsub rounds once, like sub)
            const __m256 x = _mm256_mul_ps(ld(s + t), ld(ks + t));
            __m256 p = exp8(_mm256_sub_ps(x, vmn));
            if (t + 8 > n) {
                const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                    _mm256_set1_epi32(n), _mm256_add_epi32(_mm256_set1_epi32(t), lane)));
                p = _mm256_and_ps(p, keep);
            }
            vsum = _mm256_add_ps(vsum, p);
            _mm256_storeu_ps(wh + t, vs ? _mm256_mul_ps(p, ld(vs + t)) : p);
        }
        l[h] = l[h] * alpha + hsum1(vsum);
        if (alpha != 1.0f) {
            const __m256 va = _mm256_set1_ps(alpha);
            float *ah = acc + (size_t)h * dim;
            for (int i = 0; i < dim; i += 8) _mm256_storeu_ps(ah + i, _mm256_mul_ps(ld(ah + i), va));
        }
        m[h] = mn;
    }
}

// ---------------------------------------------------------------------------
// Token scales, rotation
// ---------------------------------------------------------------------------
TQKV_AVX2 void attn_avx2_token_scales(const uint16_t *sc, int n, float mul, float *out) {
    const __m256 m = _mm256_set1_ps(mul);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(m, _mm256_cvtph_ps(_mm_loadu_si128(
                                                       (const __m128i *)(const void *)(sc + j)))));
    for (; j < n; j++) out[j] = mul * _cvtsh_ss(sc[j]);
}

/* Normalized-free Walsh-Hadamard butterflies in codec/rotation.c's order: stages 1, 2, 4
 * inside each 8-block (a + b on the low lane of each pair, a - b on the high one), then
 * stages 8 .. dim/2 across registers. Every value sees the same adds as the scalar code. */
TQKV_AVX2 static AI __m256 fwht8(__m256 v) {
    __m256 s = _mm256_permute_ps(v, 0xB1);   // swap neighbours
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
    s = _mm256_permute_ps(v, 0x4E);          // swap pairs
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
    s = _mm256_permute2f128_ps(v, v, 1);     // swap halves
    return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
}

TQKV_AVX2 static void v_fwht(float *x, int dim) {
    for (int i = 0; i < dim; i += 8) _mm256_storeu_ps(x + i, fwht8(ld(x + i)));
    for (int h = 8; h < dim; h <<= 1)
        for (int i = 0; i < dim; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
                const __m256 a = ld(x + j), b = ld(x + j + h);
                _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
            }
}

TQKV_AVX2 void attn_avx2_rotate(const float *signs, int dim, float *x) {
    const __m256 inv = _mm256_set1_ps((float)(1.0 / sqrt((double)dim)));
    for (int i = 0; i < dim; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(ld(x + i), ld(signs + i)));
    v_fwht(x, dim);
    for (int i = 0; i < dim; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(ld(x + i), inv));
}

TQKV_AVX2 void attn_avx2_unrotate(const float *signs, int dim, float *x) {
    const __m256 inv = _mm256_set1_ps((float)(1.0 / sqrt((double)dim)));
    v_fwht(x, dim);
    for (int i = 0; i < dim; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(ld(x + i), _mm256_mul_ps(ld(signs + i), inv)));
}

// ---------------------------------------------------------------------------
// Prefill tiles (query-minor: 16 lanes = 2 registers per strip)
// ---------------------------------------------------------------------------
/* st[j, c] = sum_i k[j, i] qt[i, c] for JJ tokens x 16 lanes. */
TQKV_AVX2 static AI void qk_block(int JJ, const float *k, size_t ldk, int dim, const float *qt,
                             int mp, int c, float *st) {
    __m256 a0[4], a1[4];
#pragma GCC unroll 4
    for (int j = 0; j < JJ; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int i = 0; i < dim; i++) {
        const __m256 q0 = ld(qt + (size_t)i * mp + c), q1 = ld(qt + (size_t)i * mp + c + 8);
#pragma GCC unroll 4
        for (int j = 0; j < JJ; j++) {
            const __m256 kb = bc(k + (size_t)j * ldk + i);
            a0[j] = _mm256_fmadd_ps(kb, q0, a0[j]);
            a1[j] = _mm256_fmadd_ps(kb, q1, a1[j]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < JJ; j++) {
        _mm256_storeu_ps(st + (size_t)j * mp + c, a0[j]);
        _mm256_storeu_ps(st + (size_t)j * mp + c + 8, a1[j]);
    }
}

TQKV_AVX2 void attn_avx2_tile_qk(const float *k, size_t ldk, int n, int dim, const float *qt,
                                int mp, int l0, int l1, float *st) {
    for (int c = l0; c < l1; c += 16) {
        int j = 0;
        for (; j + 4 <= n; j += 4) qk_block(4, k + (size_t)j * ldk, ldk, dim, qt, mp, c, st + (size_t)j * mp);
        const int r = n - j;
        if (r == 3) qk_block(3, k + (size_t)j * ldk, ldk, dim, qt, mp, c, st + (size_t)j * mp);
        else if (r == 2) qk_block(2, k + (size_t)j * ldk, ldk, dim, qt, mp, c, st + (size_t)j * mp);
        else if (r == 1) qk_block(1, k + (size_t)j * ldk, ldk, dim, qt, mp, c, st + (size_t)j * mp);
    }
}

TQKV_AVX2 void attn_avx2_tile_softmax(float *st, int n, int tok0, int mp, int l0, int l1,
                                const int32_t *lo, const int32_t *hi, float *m, float *l,
                                float *ot, int dim) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int c = l0; c < l1; c += 8) {
        const __m256i vlo = _mm256_loadu_si256((const __m256i *)(const void *)(lo + c));
        const __m256i vhi = _mm256_loadu_si256((const __m256i *)(const void *)(hi + c));
        // fully visible for the whole tile?  lo <= tok0 && tok0 + n <= hi on every lane
        const __m256i out_lo = _mm256_cmpgt_epi32(vlo, _mm256_set1_epi32(tok0));
        const __m256i out_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(tok0 + n), vhi);
        const int full = _mm256_testz_si256(_mm256_or_si256(out_lo, out_hi),
                                            _mm256_set1_epi32(-1));
        __m256 vmax = ninf;
        for (int j = 0; j < n; j++) {
            float *x = st + (size_t)j * mp + c;
            __m256 v = ld(x);
            if (!full) {
                const __m256i tk = _mm256_set1_epi32(tok0 + j);
                // visible iff lo <= tk && tk < hi  <=>  !(lo > tk) && (hi > tk)
                const __m256i vis = _mm256_andnot_si256(_mm256_cmpgt_epi32(vlo, tk),
                                                        _mm256_cmpgt_epi32(vhi, tk));
                v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(vis));
                _mm256_storeu_ps(x, v);
            }
            vmax = _mm256_max_ps(vmax, v);
        }
        const __m256 mo = ld(m + c);
        const __m256 mn = _mm256_max_ps(mo, vmax);
        const __m256 ms = _mm256_blendv_ps(mn, _mm256_setzero_ps(), _mm256_cmp_ps(mn, ninf, _CMP_EQ_OQ));
        const __m256 alpha = exp8(_mm256_sub_ps(mo, ms));
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            float *x = st + (size_t)j * mp + c;
            const __m256 p = exp8(_mm256_sub_ps(ld(x), ms));
            _mm256_storeu_ps(x, p);
            sum = _mm256_add_ps(sum, p);
        }
        _mm256_storeu_ps(l + c, _mm256_fmadd_ps(ld(l + c), alpha, sum));
        _mm256_storeu_ps(m + c, mn);
        const __m256 one = _mm256_set1_ps(1.0f);
        if (_mm256_movemask_ps(_mm256_cmp_ps(alpha, one, _CMP_NEQ_UQ)) != 0) {
            for (int i = 0; i < dim; i++) {
                float *o = ot + (size_t)i * mp + c;
                _mm256_storeu_ps(o, _mm256_mul_ps(ld(o), alpha));
            }
        }
    }
}

/* ot[i, c] += sum_j v[j, i] pt[j, c] for 4 dims x 16 lanes. */
TQKV_AVX2 void attn_avx2_tile_pv(const float *v, size_t ldv, int n, int dim, const float *pt,
                                int mp, int l0, int l1, float *ot) {
    for (int c = l0; c < l1; c += 16) {
        for (int i = 0; i < dim; i += 4) {
            __m256 a0[4], a1[4];
#pragma GCC unroll 4
            for (int ii = 0; ii < 4; ii++) {
                a0[ii] = ld(ot + (size_t)(i + ii) * mp + c);
                a1[ii] = ld(ot + (size_t)(i + ii) * mp + c + 8);
            }
            for (int j = 0; j < n; j++) {
                const __m256 p0 = ld(pt + (size_t)j * mp + c), p1 = ld(pt + (size_t)j * mp + c + 8);
                const float *vj = v + (size_t)j * ldv + i;
#pragma GCC unroll 4
                for (int ii = 0; ii < 4; ii++) {
                    const __m256 vb = bc(vj + ii);
                    a0[ii] = _mm256_fmadd_ps(vb, p0, a0[ii]);
                    a1[ii] = _mm256_fmadd_ps(vb, p1, a1[ii]);
                }
            }
#pragma GCC unroll 4
            for (int ii = 0; ii < 4; ii++) {
                _mm256_storeu_ps(ot + (size_t)(i + ii) * mp + c, a0[ii]);
                _mm256_storeu_ps(ot + (size_t)(i + ii) * mp + c + 8, a1[ii]);
            }
        }
    }
}

#else

typedef int attn_avx2_block_unused;   /* ISO C: no empty translation unit */

#endif
