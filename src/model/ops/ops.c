/*
 * ops.c - per-vector kernels of the forward pass (see ops.h).
 * Owns: RMSNorm, RoPE tables and rotation, SwiGLU with a vectorized exp whose scalar twin
 * gives the same bits.
 * Must not: let one vector's result depend on another vector or on the SIMD choice.
 */
#include "model/ops/ops.h"

#include <math.h>
#include <string.h>

#include "util/common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OPS_X86 1
#endif

// ---------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------

void ops_rmsnorm(const float *x, const float *w, float eps, int n, float *out) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)x[i] * x[i];
        s1 += (double)x[i + 1] * x[i + 1];
        s2 += (double)x[i + 2] * x[i + 2];
        s3 += (double)x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double)x[i] * x[i];
    double ms = ((s0 + s1) + (s2 + s3)) / n;
    float r = (float)(1.0 / sqrt(ms + (double)eps));
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

// ---------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------

void ops_rope_freqs(const tqkv_model_config *c, float *inv_freq) {
    int d = c->head_dim, half = d / 2;
    for (int i = 0; i < half; i++) {
        float base = (float)c->rope_theta;
        float e = (float)(2 * i) / (float)d;
        float f = 1.0f / (float)pow((double)base, (double)e);
        if (c->rope_type == TQKV_ROPE_LINEAR) {
            f = (float)(f / c->rope_factor);
        } else if (c->rope_type == TQKV_ROPE_LLAMA3) {
            double factor = c->rope_factor, lo = c->rope_low_freq_factor,
                   hi = c->rope_high_freq_factor, old = c->rope_original_max_pos;
            double low_wl = old / lo, high_wl = old / hi;
            double wl = 2 * M_PI / f;
            double g = wl > low_wl ? f / factor : f;
            if (!(wl < high_wl) && !(wl > low_wl)) {
                double smooth = (old / wl - lo) / (hi - lo);
                g = (1 - smooth) * g / factor + smooth * g;
            }
            f = (float)g;
        }
        inv_freq[i] = f;
    }
}

void ops_rope_table(int pos, const float *inv_freq, int half, float *cos_t, float *sin_t) {
    for (int i = 0; i < half; i++) {
        float a = (float)pos * inv_freq[i];
        cos_t[i] = (float)cos((double)a);
        sin_t[i] = (float)sin((double)a);
    }
}

void ops_rope_apply(float *x, int n_heads, int head_dim, const float *cos_t, const float *sin_t) {
    int h = head_dim / 2;
    for (int hd = 0; hd < n_heads; hd++) {
        float *v = x + (size_t)hd * head_dim;
        for (int i = 0; i < h; i++) {
            float a = v[i], b = v[i + h];
            v[i] = a * cos_t[i] - b * sin_t[i];
            v[i + h] = b * cos_t[i] + a * sin_t[i];
        }
    }
}

// ---------------------------------------------------------------------------
// exp (Cephes-style, fma Horner; scalar and AVX2 perform the same operations)
// ---------------------------------------------------------------------------

#define EXP_HI 88.0f
#define EXP_LO -87.3365447504f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500E-4f
#define P1 1.3981999507E-3f
#define P2 8.3334519073E-3f
#define P3 4.1665795894E-2f
#define P4 1.6666665459E-1f
#define P5 5.0000001201E-1f

static float exp_scalar(float x) {
    x = x > EXP_HI ? EXP_HI : x;
    x = x < EXP_LO ? EXP_LO : x;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = P0;
    p = fmaf(p, r, P1);
    p = fmaf(p, r, P2);
    p = fmaf(p, r, P3);
    p = fmaf(p, r, P4);
    p = fmaf(p, r, P5);
    float z = r * r;
    float y = fmaf(p, z, r) + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return y * s;
}

#ifdef OPS_X86
static inline TQKV_AVX2 __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 nn = _mm256_sub_ps(_mm256_setzero_ps(), n);
    __m256 r = _mm256_fmadd_ps(nn, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(nn, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
    __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static TQKV_AVX2 void exp_avx2_n(const float *x, int n, float *out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp_avx2(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) out[i] = exp_scalar(x[i]);
}

static TQKV_AVX2 void swiglu_avx2(const float *g, const float *u, int n, float *h) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp_avx2(_mm256_sub_ps(zero, gv));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) h[i] = g[i] / (1.0f + exp_scalar(0.0f - g[i])) * u[i];
}
#endif

void ops_exp(const float *x, int n, float *out) {
#ifdef OPS_X86
    if (tqkv_cpu_has_avx2()) {
        exp_avx2_n(x, n, out);
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = exp_scalar(x[i]);
}

void ops_swiglu(const float *g, const float *u, int n, float *h) {
#ifdef OPS_X86
    if (tqkv_cpu_has_avx2()) {
        swiglu_avx2(g, u, n, h);
        return;
    }
#endif
    for (int i = 0; i < n; i++) h[i] = g[i] / (1.0f + exp_scalar(0.0f - g[i])) * u[i];
}
