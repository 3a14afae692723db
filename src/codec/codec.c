/*
 * codec.c - encode / decode of one format at one head_dim, and the public
 * "Codec" section of tqkv.h.
 * Owns: codec_setup/teardown, per-format quantizers (f32, f16, q8 = ggml q8_0,
 * q4 = ggml q4_0, tq2/3/4 = TurboQuant, fp8 = e4m3 with a per-vector scale), scalar decode and SIMD dispatch, the public
 * byte form (payload then fp16 scales, little-endian).
 * Must not: know about caches, rows or attention; keep global mutable state.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "codec/codec_impl.h"
#include "util/common.h"

#define CODEC_MAX_DIM 512

// ---------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------

tqkv_status codec_setup(struct tqkv_codec *c, tqkv_format f, int dim, uint64_t seed) {
    if (!c) return tqkv_fail(TQKV_EINVAL, "codec_setup: NULL codec");
    if ((int)f < 0 || f >= TQKV_FORMAT_COUNT)
        return tqkv_fail(TQKV_EINVAL, "codec: invalid format id %d", (int)f);
    tqkv_status st = tqkv_check_dim(dim);
    if (st != TQKV_OK) return st;

    struct tqkv_codec t;
    memset(&t, 0, sizeof t);
    t.format = f;
    t.dim = dim;
    t.bits = tqkv_format_tq_bits(f);
    t.rotated = t.bits > 0;
    t.seed = seed;
    codec_format_layout(f, dim, &t.payload, &t.n_scales);
    if (t.bits) {
        const double *lm = codec_lloyd_max(t.bits);
        const int L = 1 << t.bits;
        const double inv = 1.0 / sqrt((double)dim);
        for (int i = 0; i < L; i++) t.centroids[i] = (float)(lm[i] * inv);
        for (int i = 0; i + 1 < L; i++) t.bounds[i] = (float)(0.5 * (lm[i] + lm[i + 1]) * inv);
        t.signs = tqkv_malloc((size_t)dim * sizeof(float)); // [dim]
        if (!t.signs) return TQKV_ENOMEM;
        codec_make_signs(seed, dim, t.signs);
    }
    *c = t;
    return TQKV_OK;
}

void codec_teardown(struct tqkv_codec *c) {
    if (!c) return;
    free(c->signs);
    c->signs = NULL;
}

// ---------------------------------------------------------------------------
// Scalar helpers
// ---------------------------------------------------------------------------

/* Round a non-negative double to fp16 with a single RNE rounding (round-to-odd
 * to float first), saturating finite values at 65504; NaN stays NaN. */
static uint16_t f64_to_f16_sat(double s) {
    if (s != s) return 0x7e00u;
    if (s >= 65504.0) return 0x7bffu;
    float t = (float)s;
    if ((double)t > s) t = nextafterf(t, 0.0f);
    if ((double)t != s) { /* sticky bit: round-to-odd keeps the later RNE exact */
        uint32_t u;
        memcpy(&u, &t, 4);
        u |= 1u;
        memcpy(&t, &u, 4);
    }
    return tqkv_f32_to_f16(t);
}

/* Index of the nearest centroid = number of bounds strictly below u. */
static inline int tq_quantize(const float *bounds, int L, float u) {
    int idx = 0;
    for (int step = L >> 1; step > 0; step >>= 1)
        if (u > bounds[idx + step - 1]) idx += step;
    return idx;
}

// ---------------------------------------------------------------------------
// Encode, one vector
// ---------------------------------------------------------------------------

/* sum of xr[i]^2 in float64, four interleaved accumulators (the AVX2 path uses the
 * same lanes in the same order). */
static double tq_norm2(const float *xr, int d) {
    double a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int i = 0; i < d; i += 4) {
        a0 += (double)xr[i] * xr[i];
        a1 += (double)xr[i + 1] * xr[i + 1];
        a2 += (double)xr[i + 2] * xr[i + 2];
        a3 += (double)xr[i + 3] * xr[i + 3];
    }
    return (a0 + a1) + (a2 + a3);
}

/* idx[i] = nearest centroid of xr[i] * inv; returns ||c[idx]||^2 in float64. */
static double tq_quantize_scalar(const struct tqkv_codec *c, const float *xr, float inv,
                                 uint8_t *idx) {
    const int d = c->dim, L = 1 << c->bits;
    for (int i = 0; i < d; i++) idx[i] = (uint8_t)tq_quantize(c->bounds, L, xr[i] * inv);
    double c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    for (int i = 0; i < d; i += 4) {
        double v0 = c->centroids[idx[i]], v1 = c->centroids[idx[i + 1]];
        double v2 = c->centroids[idx[i + 2]], v3 = c->centroids[idx[i + 3]];
        c0 += v0 * v0;
        c1 += v1 * v1;
        c2 += v2 * v2;
        c3 += v3 * v3;
    }
    return (c0 + c1) + (c2 + c3);
}

/* xr: [dim] rotated vector -> payload [c->payload], scale [1]. */
static void tq_encode_one(const struct tqkv_codec *c, const float *xr, uint8_t *payload,
                          uint16_t *scale, int simd) {
    const int d = c->dim;
    uint8_t idx[CODEC_MAX_DIM] = {0}; // [dim]
    double n2, cn2;
#if TQKV_CODEC_X86
    if (simd) {
        n2 = codec_norm2_avx2(xr, d);
    } else
#endif
        n2 = tq_norm2(xr, d);
    const double n = sqrt(n2);
    const float inv = n > 0 && n <= 1e300 ? (float)(1.0 / n) : 0.0f;
#if TQKV_CODEC_X86
    if (simd) {
        cn2 = codec_tq_quantize_avx2(c, xr, inv, idx);
    } else
#endif
        cn2 = tq_quantize_scalar(c, xr, inv, idx);
    (void)simd;
    codec_pack_indices(c, idx, payload);
    if (!(n > 0)) *scale = n == 0 ? 0 : 0x7e00u;   /* zero vector -> 0; NaN -> NaN */
    else if (!(n <= 1e300)) *scale = 0x7c00u;      /* inf input -> inf */
    else *scale = f64_to_f16_sat(n / sqrt(cn2));
}

/* round(v), half away from zero (C round()), without a libm call; |v| <= 127.
 * v - trunc(v) is exact; the comparisons become setcc (no branch: real data makes
 * them coin flips). */
static inline int round_half_away(double v) {
    int r = (int)v;
    double f = v - (double)r;
    return r + (f >= 0.5) - (f <= -0.5);
}

/* ggml q8_0 on 32-value blocks. x: [dim] -> q [dim] int8, scales [dim/32]. */
static void q8_encode_one(int dim, const float *x, uint8_t *payload, uint16_t *scales) {
    for (int b = 0; b < dim / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(v[j]);
            if (a > amax) amax = a;
        }
        const float dq = amax / 127.0f;
        scales[b] = tqkv_f32_to_f16(dq);
        for (int j = 0; j < 32; j++) {
            double q = dq != 0.0f ? (double)v[j] / (double)dq : 0.0;
            if (q != q) q = 0.0; /* NaN input */
            q = q < -127.0 ? -127.0 : q > 127.0 ? 127.0 : q;
            payload[32 * b + j] = (uint8_t)(int8_t)round_half_away(q);
        }
    }
}

/* ggml q4_0 on 32-value blocks. x: [dim] -> nibbles in the 4-bit plane, scales [dim/32]. */
static void q4_encode_one(int dim, const float *x, uint8_t *payload, uint16_t *scales) {
    uint8_t q[CODEC_MAX_DIM]; // [dim]
    for (int b = 0; b < dim / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++) {
            if (amax < fabsf(v[j])) {
                amax = fabsf(v[j]);
                max = v[j];
            }
        }
        const float dq = max / -8.0f;
        scales[b] = tqkv_f32_to_f16(dq);
        for (int j = 0; j < 32; j++) {
            double t = dq != 0.0f ? (double)v[j] / (double)dq + 8.5 : 8.5;
            if (!(t >= 0.0)) t = 0.0; /* also NaN */
            if (t > 15.0) t = 15.0;
            q[32 * b + j] = (uint8_t)(int)t;
        }
    }
    codec_plane4_pack(q, dim, payload);
}

/* e4m3, round to nearest even on the float64 value (see docs/FORMATS.md "fp8"). The
 * AVX2 encoder (codec_avx2.c) runs the same steps per lane. */
uint8_t codec_e4m3_from_double(double v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    const double a = fabs(v);
    if (!(a < 448.0)) return sign | 0x7e;                   /* saturate (callers pass no NaN) */
    if (a < 0x1p-6) {                                       /* subnormal grid: 2^-9 */
        const double r = (a + 0x1p43) - 0x1p43;             /* ulp(2^43) = 2^-9: RNE */
        return sign | (uint8_t)(r * 512.0);                 /* 0..8; 8 is 2^-6 = code 0x08 */
    }
    uint64_t u;
    memcpy(&u, &a, 8);
    u += ((uint64_t)1 << 48) - 1 + ((u >> 49) & 1);         /* RNE to 3 mantissa bits */
    u &= ~(((uint64_t)1 << 49) - 1);
    const int e = (int)(u >> 52) - 1023;                    /* -6..8 */
    return sign | (uint8_t)(((e + 7) << 3) | (int)((u >> 49) & 7));
}

/* fp8 scale of x [dim]: fp16(amax / 448) (binary32 quotient, RNE, saturating at 65504);
 * 0x7e00 if any NaN, 0x7c00 if any inf. Shared by the scalar and AVX2 encoders. */
static uint16_t fp8_scale(int dim, const float *x) {
    float amax = 0.0f;
    int nan = 0, inf = 0;
    for (int i = 0; i < dim; i++) {
        const float a = fabsf(x[i]);
        nan |= a != a;
        inf |= a == INFINITY;
        if (a > amax) amax = a;
    }
    if (nan) return 0x7e00u;
    if (inf) return 0x7c00u;
    const float s = amax / 448.0f;
    return s >= 65504.0f ? 0x7bffu : tqkv_f32_to_f16(s);
}

/* fp8: x [dim] -> payload [dim] e4m3 of x[i] / s (float64 quotient), scale [1]. A scale
 * of zero, NaN or inf stores zero bytes. */
static void fp8_encode_one(int dim, const float *x, uint8_t *payload, uint16_t *scale,
                           int simd) {
    const uint16_t h = fp8_scale(dim, x);
    *scale = h;
    const float s = tqkv_f16_to_f32(h);
    if (!(s > 0.0f) || s == INFINITY) {
        memset(payload, 0, (size_t)dim);
        return;
    }
#if TQKV_CODEC_X86
    if (simd) {
        codec_fp8_encode_avx2(dim, x, s, payload);
        return;
    }
#endif
    (void)simd;
    for (int i = 0; i < dim; i++) payload[i] = codec_e4m3_from_double((double)x[i] / (double)s);
}

static void f16_encode_one(int dim, const float *x, uint8_t *payload, int simd) {
#if TQKV_CODEC_X86
    if (simd) {
        codec_f16_encode_avx2(dim, x, payload);
        return;
    }
#endif
    (void)simd;
    for (int i = 0; i < dim; i++) {
        uint16_t h = tqkv_f32_to_f16(x[i]);
        payload[2 * i] = (uint8_t)h;
        payload[2 * i + 1] = (uint8_t)(h >> 8);
    }
}

/* x: [dim] in the codec's input domain (rotated when rot_in). */
static void encode_one(const struct tqkv_codec *c, const float *x, int rot_in, uint8_t *payload,
                       uint16_t *scales, int simd) {
    const int d = c->dim;
    switch (c->format) {
    case TQKV_F32: memcpy(payload, x, (size_t)d * sizeof(float)); break;
    case TQKV_F16: f16_encode_one(d, x, payload, simd); break;
    case TQKV_Q8:
#if TQKV_CODEC_X86
        if (simd) codec_q8_encode_avx2(d, x, payload, scales);
        else
#endif
            q8_encode_one(d, x, payload, scales);
        break;
    case TQKV_Q4: q4_encode_one(d, x, payload, scales); break;
    case TQKV_FP8: fp8_encode_one(d, x, payload, scales, simd); break;
    case TQKV_TQ1:
    case TQKV_TQ2:
    case TQKV_TQ3:
    case TQKV_TQ4:
        if (rot_in) {
            tq_encode_one(c, x, payload, scales, simd);
        } else {
            float xr[CODEC_MAX_DIM]; // [dim]
            memcpy(xr, x, (size_t)d * sizeof(float));
#if TQKV_CODEC_X86
            if (simd) codec_rotate_avx2(c, xr);
            else
#endif
                codec_rotate(c, xr);
            tq_encode_one(c, xr, payload, scales, simd);
        }
        break;
    default: break;
    }
}

void codec_encode(const struct tqkv_codec *c, const float *x, size_t n, uint8_t *payload,
                  uint16_t *scales) {
    const int simd = n ? tqkv_cpu_has_avx2() : 0;
    for (size_t i = 0; i < n; i++)
        encode_one(c, x + i * (size_t)c->dim, 0, payload + i * c->payload,
                   scales ? scales + i * (size_t)c->n_scales : NULL, simd);
}

void codec_encode_rotated(const struct tqkv_codec *c, const float *xr, size_t n,
                          uint8_t *payload, uint16_t *scales) {
    const int simd = n ? tqkv_cpu_has_avx2() : 0;
    for (size_t i = 0; i < n; i++)
        encode_one(c, xr + i * (size_t)c->dim, 1, payload + i * c->payload,
                   scales ? scales + i * (size_t)c->n_scales : NULL, simd);
}

// ---------------------------------------------------------------------------
// Decode, one vector (scalar reference; codec_avx2.c must match it bitwise)
// ---------------------------------------------------------------------------

static void decode_one_scalar(const struct tqkv_codec *c, const uint8_t *payload,
                              const uint16_t *scales, float *x) {
    const int d = c->dim;
    switch (c->format) {
    case TQKV_F32: memcpy(x, payload, (size_t)d * sizeof(float)); break;
    case TQKV_F16:
        for (int i = 0; i < d; i++)
            x[i] = tqkv_f16_to_f32((uint16_t)(payload[2 * i] | payload[2 * i + 1] << 8));
        break;
    case TQKV_Q8:
        for (int b = 0; b < d / 32; b++) {
            const float s = tqkv_f16_to_f32(scales[b]);
            for (int j = 0; j < 32; j++)
                x[32 * b + j] = (float)(int8_t)payload[32 * b + j] * s;
        }
        break;
    case TQKV_Q4: {
        uint8_t q[CODEC_MAX_DIM]; // [dim]
        codec_plane4_unpack(payload, d, q);
        for (int b = 0; b < d / 32; b++) {
            const float s = tqkv_f16_to_f32(scales[b]);
            for (int j = 0; j < 32; j++) x[32 * b + j] = (float)((int)q[32 * b + j] - 8) * s;
        }
        break;
    }
    case TQKV_FP8: {
        const float s256 = tqkv_f16_to_f32(scales[0]) * 256.0f;
        for (int i = 0; i < d; i++) x[i] = tqkv_f16_to_f32(codec_fp8_half(payload[i])) * s256;
        break;
    }
    case TQKV_TQ1:
    case TQKV_TQ2:
    case TQKV_TQ3:
    case TQKV_TQ4: {
        uint8_t idx[CODEC_MAX_DIM]; // [dim]
        codec_unpack_indices(c, payload, idx);
        const float s = tqkv_f16_to_f32(scales[0]);
        for (int i = 0; i < d; i++) x[i] = s * c->centroids[idx[i]];
        break;
    }
    default: break;
    }
}

/* Decode one vector; unrot: apply R^T (tq). simd: use the AVX2 path. */
static void decode_one(const struct tqkv_codec *c, const uint8_t *payload,
                       const uint16_t *scales, float *x, int simd, int unrot) {
#if TQKV_CODEC_X86
    if (simd && c->format != TQKV_F32) {
        codec_decode_one_avx2(c, payload, scales, x);
        if (unrot && c->rotated) codec_unrotate_avx2(c, x);
        return;
    }
#else
    (void)simd;
#endif
    decode_one_scalar(c, payload, scales, x);
    if (unrot && c->rotated) codec_unrotate(c, x);
}

static void decode_n(const struct tqkv_codec *c, const uint8_t *payload, const uint16_t *scales,
                     size_t n, float *x, int unrot) {
    const int simd = n ? tqkv_cpu_has_avx2() : 0;
    for (size_t i = 0; i < n; i++)
        decode_one(c, payload + i * c->payload,
                   scales ? scales + i * (size_t)c->n_scales : NULL, x + i * (size_t)c->dim,
                   simd, unrot);
}

void codec_decode(const struct tqkv_codec *c, const uint8_t *payload, const uint16_t *scales,
                  size_t n, float *x) {
    decode_n(c, payload, scales, n, x, 1);
}

void codec_decode_rotated(const struct tqkv_codec *c, const uint8_t *payload,
                          const uint16_t *scales, size_t n, float *x) {
    decode_n(c, payload, scales, n, x, 0);
}

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------

tqkv_status tqkv_codec_init(tqkv_codec **out, tqkv_format f, int dim, uint64_t seed) {
    if (!out) return tqkv_fail(TQKV_EINVAL, "tqkv_codec_init: NULL out");
    struct tqkv_codec *c = tqkv_calloc(1, sizeof *c);
    if (!c) return TQKV_ENOMEM;
    tqkv_status st = codec_setup(c, f, dim, seed);
    if (st != TQKV_OK) {
        free(c);
        return st;
    }
    *out = c;
    return TQKV_OK;
}

void tqkv_codec_free(tqkv_codec *c) {
    if (!c) return;
    codec_teardown(c);
    free(c);
}

size_t tqkv_codec_bytes(const tqkv_codec *c) {
    return c ? c->payload + 2 * (size_t)c->n_scales : 0;
}

/* Common argument checks of the bulk public calls. */
static tqkv_status check_bulk(const char *fn, const tqkv_codec *c, const void *a, const void *b,
                              size_t n) {
    if (!c) return tqkv_fail(TQKV_EINVAL, "%s: NULL codec", fn);
    if (n && (!a || !b)) return tqkv_fail(TQKV_EINVAL, "%s: NULL buffer with n = %zu", fn, n);
    int ok = 1;
    tqkv_mul(n, tqkv_codec_bytes(c), &ok);
    tqkv_mul(n, (size_t)c->dim * sizeof(float), &ok);
    if (!ok) return tqkv_fail(TQKV_ERANGE, "%s: n = %zu vectors overflows size_t", fn, n);
    return TQKV_OK;
}

tqkv_status tqkv_codec_encode(const tqkv_codec *c, const float *x, size_t n, uint8_t *out) {
    tqkv_status st = check_bulk("tqkv_codec_encode", c, x, out, n);
    if (st != TQKV_OK) return st;
    const size_t bytes = tqkv_codec_bytes(c);
    const int simd = n ? tqkv_cpu_has_avx2() : 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t sc[CODEC_MAX_DIM / 32]; // [n_scales]
        uint8_t *o = out + i * bytes;
        encode_one(c, x + i * (size_t)c->dim, 0, o, sc, simd);
        for (int k = 0; k < c->n_scales; k++) {
            o[c->payload + 2 * (size_t)k] = (uint8_t)sc[k];
            o[c->payload + 2 * (size_t)k + 1] = (uint8_t)(sc[k] >> 8);
        }
    }
    return TQKV_OK;
}

tqkv_status tqkv_codec_decode(const tqkv_codec *c, const uint8_t *in, size_t n, float *x) {
    tqkv_status st = check_bulk("tqkv_codec_decode", c, in, x, n);
    if (st != TQKV_OK) return st;
    const size_t bytes = tqkv_codec_bytes(c);
    const int simd = tqkv_cpu_has_avx2();
    for (size_t i = 0; i < n; i++) {
        uint16_t sc[CODEC_MAX_DIM / 32]; // [n_scales]
        const uint8_t *p = in + i * bytes;
        for (int k = 0; k < c->n_scales; k++)
            sc[k] = (uint16_t)(p[c->payload + 2 * (size_t)k] |
                               p[c->payload + 2 * (size_t)k + 1] << 8);
        decode_one(c, p, sc, x + i * (size_t)c->dim, simd, 1);
    }
    return TQKV_OK;
}

static void rotate_n(const struct tqkv_codec *c, float *x, size_t n, int inverse) {
    const int simd = tqkv_cpu_has_avx2();
    for (size_t i = 0; i < n; i++) {
        float *v = x + i * (size_t)c->dim;
#if TQKV_CODEC_X86
        if (simd) {
            if (inverse) codec_unrotate_avx2(c, v);
            else codec_rotate_avx2(c, v);
            continue;
        }
#else
        (void)simd;
#endif
        if (inverse) codec_unrotate(c, v);
        else codec_rotate(c, v);
    }
}

void codec_rotate_n(const struct tqkv_codec *c, float *x, size_t n) { rotate_n(c, x, n, 0); }

static tqkv_status rotate_bulk(const char *fn, const tqkv_codec *c, float *x, size_t n,
                               int inverse) {
    tqkv_status st = check_bulk(fn, c, x, x, n);
    if (st != TQKV_OK) return st;
    if (!c->rotated)
        return tqkv_fail(TQKV_EINVAL, "%s: format %s has no rotation (tq formats only)", fn,
                         tqkv_format_name(c->format));
    rotate_n(c, x, n, inverse);
    return TQKV_OK;
}

tqkv_status tqkv_codec_rotate(const tqkv_codec *c, float *x, size_t n) {
    return rotate_bulk("tqkv_codec_rotate", c, x, n, 0);
}

tqkv_status tqkv_codec_unrotate(const tqkv_codec *c, float *x, size_t n) {
    return rotate_bulk("tqkv_codec_unrotate", c, x, n, 1);
}
