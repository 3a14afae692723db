/*
 * test_codec.c - tests of src/codec: Lloyd-Max tables, rotation, bit packing,
 * ggml q8_0/q4_0 rounding, fp16, TurboQuant MSE, SIMD == scalar, bad inputs.
 * Owns: nothing but test code. Must not: assert on timings.
 * Every random input comes from test_seed() (printed; replay with TQKV_TEST_SEED).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "codec/codec.h"
#include "testutil.h"
#include "util/common.h"

static const tqkv_format TQ_FORMATS[4] = {TQKV_TQ1, TQKV_TQ2, TQKV_TQ3, TQKV_TQ4};
static const int DIMS[5] = {32, 64, 128, 256, 512};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* n random unit vectors x [n, dim] (Gaussian direction). */
static void random_unit(test_rng *r, float *x, size_t n, int dim) {
    for (size_t i = 0; i < n; i++) {
        double s = 0;
        double v[512];
        for (int j = 0; j < dim; j++) {
            v[j] = rng_normal(r);
            s += v[j] * v[j];
        }
        s = sqrt(s);
        for (int j = 0; j < dim; j++) x[i * dim + j] = (float)(v[j] / s);
    }
}

static void set_simd(int on) {
    if (on) unsetenv("TQKV_NO_SIMD");
    else setenv("TQKV_NO_SIMD", "1", 1);
}

/* float64 round-to-nearest-even fp16 reference (independent of common.c). */
static uint16_t ref_f16(double v) {
    uint16_t sign = signbit(v) ? 0x8000u : 0;
    double a = fabs(v);
    if (isnan(v)) return 0x7e00u | sign;
    if (a >= 65520.0) return sign | 0x7c00u; /* 65504 + half ulp ties to even = inf */
    if (a < ldexp(1.0, -14)) {              /* subnormal (or rounds up to min normal) */
        double q = rint(a * ldexp(1.0, 24));
        return (uint16_t)(sign | (uint16_t)q);
    }
    int e;
    frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) -> a in [2^(e-1), 2^e) */
    e -= 1;
    double m = rint(a * ldexp(1.0, 10 - e)); /* in [1024, 2048] */
    if (m == 2048.0) {
        m = 1024.0;
        e++;
    }
    if (e > 15) return sign | 0x7c00u;
    return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)(m - 1024.0));
}

// ---------------------------------------------------------------------------
// Lloyd-Max codebooks
// ---------------------------------------------------------------------------

static double npdf(double x) { return isinf(x) ? 0.0 : exp(-0.5 * x * x) / sqrt(2.0 * M_PI); }
static double xpdf(double x) { return isinf(x) ? 0.0 : x * npdf(x); }
/* P(a < X <= b), accurate in both tails. */
static double nprob(double a, double b) {
    if (a >= 0) return 0.5 * (erfc(a / M_SQRT2) - erfc(b / M_SQRT2));
    if (b <= 0) return 0.5 * (erfc(-b / M_SQRT2) - erfc(-a / M_SQRT2));
    return 0.5 * (erf(b / M_SQRT2) - erf(a / M_SQRT2));
}
static double cell_lo(const double *c, int i) { return i == 0 ? -INFINITY : 0.5 * (c[i - 1] + c[i]); }
static double cell_hi(const double *c, int L, int i) {
    return i == L - 1 ? INFINITY : 0.5 * (c[i] + c[i + 1]);
}
/* E[X | cell i] for the midpoint cells of c. */
static double cell_centroid(const double *c, int L, int i) {
    double a = cell_lo(c, i), b = cell_hi(c, L, i);
    return (npdf(a) - npdf(b)) / nprob(a, b);
}
/* E[(X - Q(X))^2]: per cell (1 + c^2) P - 2 c (phi(a) - phi(b)) + a phi(a) - b phi(b). */
static double distortion(const double *c, int L) {
    double D = 0;
    for (int i = 0; i < L; i++) {
        double a = cell_lo(c, i), b = cell_hi(c, L, i);
        D += (1 + c[i] * c[i]) * nprob(a, b) - 2 * c[i] * (npdf(a) - npdf(b)) + xpdf(a) - xpdf(b);
    }
    return D;
}

static void test_lloyd_max(void **state) {
    (void)state;
    const double known[5] = {0, 0.3634, 0.1175, 0.03454, 0.009497};
    const double tol[5] = {0, 1e-4, 1e-4, 2e-5, 1e-5};
    for (int bits = 1; bits <= 4; bits++) {
        const int L = 1 << bits;
        const double *tab = codec_lloyd_max(bits);
        assert_non_null(tab);
        /* Re-derive with a Lloyd iteration from a uniform start. */
        double c[16];
        for (int i = 0; i < L; i++) c[i] = -3.0 + 6.0 * (i + 0.5) / L;
        int it;
        for (it = 0; it < 50000; it++) {
            double nc[16], delta = 0;
            for (int i = 0; i < L; i++) nc[i] = cell_centroid(c, L, i);
            for (int i = 0; i < L; i++) {
                delta = fmax(delta, fabs(nc[i] - c[i]));
                c[i] = nc[i];
            }
            if (delta < 1e-15) break;
        }
        double maxdiff = 0, maxcond = 0;
        for (int i = 0; i < L; i++) {
            maxdiff = fmax(maxdiff, fabs(c[i] - tab[i]));
            maxcond = fmax(maxcond, fabs(cell_centroid(tab, L, i) - tab[i]));
            if (i) assert_true(tab[i] > tab[i - 1]);
            assert_true(fabs(tab[i] + tab[L - 1 - i]) < 1e-15); /* symmetric */
        }
        const double D = distortion(tab, L);
        fprintf(stderr, "[lloyd] %d bits: %d iterations, max |table - derived| %.2e, "
                        "centroid condition %.2e, distortion %.9f (known %.6g)\n",
                bits, it, maxdiff, maxcond, D, known[bits]);
        assert_true(maxdiff < 1e-12); /* a wrong digit anywhere down to the 12th fails */
        assert_true(maxcond < 1e-13);
        assert_true(fabs(D - known[bits]) < tol[bits]);
    }
    assert_null(codec_lloyd_max(0));
    assert_null(codec_lloyd_max(5));

    /* codec tables: centroids / sqrt(d) and midpoint bounds */
    for (int f = 0; f < 4; f++)
        for (int k = 0; k < 5; k++) {
            struct tqkv_codec c;
            assert_int_equal(codec_setup(&c, TQ_FORMATS[f], DIMS[k], 1), TQKV_OK);
            const double *tab = codec_lloyd_max(c.bits);
            const double s = sqrt((double)DIMS[k]);
            for (int i = 0; i < (1 << c.bits); i++) {
                assert_true(fabs(c.centroids[i] * s - tab[i]) < 1e-6 * fabs(tab[i]));
                if (i + 1 < (1 << c.bits))
                    assert_true(fabs(c.bounds[i] * s - 0.5 * (tab[i] + tab[i + 1])) < 1e-6);
            }
            codec_teardown(&c);
        }
}

// ---------------------------------------------------------------------------
// MSE at d = 128
// ---------------------------------------------------------------------------

static void test_mse_d128(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x11);
    const int d = 128;
    const size_t N = 20000;
    /* plain norm: the Lloyd-Max distortion; norm-corrected (the stored form) is the same
     * but for tq1, whose centroids all have one magnitude: the decoded vector is
     * |x| sign(xr) / sqrt(d), so its error is 2 - 2 E|xr_i| sqrt(d) = 2 - 2 sqrt(2 / pi). */
    const double theory[4] = {2.0 - 2.0 * sqrt(2.0 / M_PI), 0.1175, 0.0345, 0.0095};
    const double theory_plain[4] = {0.3634, 0.1175, 0.0345, 0.0095};
    float *x = xmalloc(N * d * sizeof(float));
    float *y = xmalloc(N * d * sizeof(float));
    random_unit(&r, x, N, d);
    for (int f = 0; f < 4; f++) {
        tqkv_codec *c;
        assert_int_equal(tqkv_codec_init(&c, TQ_FORMATS[f], d, rng_u64(&r)), TQKV_OK);
        const size_t B = tqkv_codec_bytes(c);
        uint8_t *e = xmalloc(N * B);
        assert_int_equal(tqkv_codec_encode(c, x, N, e), TQKV_OK);
        assert_int_equal(tqkv_codec_decode(c, e, N, y), TQKV_OK);
        double mse = 0, mse_plain = 0;
        for (size_t i = 0; i < N; i++) {
            const float *xi = x + i * d;
            double n = 0, err = 0;
            for (int j = 0; j < d; j++) {
                double t = (double)xi[j] - y[i * d + j];
                err += t * t;
                n += (double)xi[j] * xi[j];
            }
            mse += err;
            /* plain norm: scale = n from the same indices */
            uint8_t idx[512];
            codec_unpack_indices(c, e + i * B, idx);
            float z[512];
            for (int j = 0; j < d; j++) z[j] = (float)sqrt(n) * c->centroids[idx[j]];
            codec_unrotate(c, z);
            double ep = 0;
            for (int j = 0; j < d; j++) {
                double t = (double)xi[j] - z[j];
                ep += t * t;
            }
            mse_plain += ep;
        }
        mse /= (double)N;
        mse_plain /= (double)N;
        fprintf(stderr, "[mse] %s d=128 N=%zu: norm-corrected %.6f, plain norm %.6f, "
                        "theory %.4f (stored %+.2f%%, plain %+.2f%%)\n",
                tqkv_format_name(TQ_FORMATS[f]), N, mse, mse_plain, theory[f],
                100 * (mse / theory[f] - 1), 100 * (mse_plain / theory_plain[f] - 1));
        assert_true(fabs(mse / theory[f] - 1) < 0.05);
        assert_true(fabs(mse_plain / theory_plain[f] - 1) < 0.10);
        free(e);
        tqkv_codec_free(c);
    }
    free(x);
    free(y);
}

/* The decoded vector has the input's norm up to fp16 rounding of the scale. */
static void test_norm_and_zero(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x22);
    for (int f = 0; f < 4; f++)
        for (int k = 0; k < 5; k++) {
            const int d = DIMS[k];
            tqkv_codec *c;
            assert_int_equal(tqkv_codec_init(&c, TQ_FORMATS[f], d, rng_u64(&r)), TQKV_OK);
            float x[512], y[512];
            uint8_t e[512];
            for (int t = 0; t < 20; t++) {
                float sd = (float)exp(rng_uniform(&r) * 8 - 4);
                rng_fill_normal(&r, x, (size_t)d, sd);
                assert_int_equal(tqkv_codec_encode(c, x, 1, e), TQKV_OK);
                assert_int_equal(tqkv_codec_decode(c, e, 1, y), TQKV_OK);
                double nx = 0, ny = 0;
                for (int j = 0; j < d; j++) {
                    nx += (double)x[j] * x[j];
                    ny += (double)y[j] * y[j];
                }
                assert_true(fabs(sqrt(ny) / sqrt(nx) - 1) < 1e-3);
            }
            memset(x, 0, sizeof x);
            assert_int_equal(tqkv_codec_encode(c, x, 1, e), TQKV_OK);
            const size_t P = c->payload;
            assert_int_equal(e[P] | e[P + 1] << 8, 0);
            assert_int_equal(tqkv_codec_decode(c, e, 1, y), TQKV_OK);
            for (int j = 0; j < d; j++) assert_true(y[j] == 0.0f);
            tqkv_codec_free(c);
        }
}

// ---------------------------------------------------------------------------
// Rotation
// ---------------------------------------------------------------------------

static void test_rotation(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x33);
    for (int k = 0; k < 5; k++) {
        const int d = DIMS[k];
        const uint64_t seed = rng_u64(&r);
        tqkv_codec *c, *c2, *c3;
        assert_int_equal(tqkv_codec_init(&c, TQKV_TQ4, d, seed), TQKV_OK);
        assert_int_equal(tqkv_codec_init(&c2, TQKV_TQ2, d, seed), TQKV_OK);
        assert_int_equal(tqkv_codec_init(&c3, TQKV_TQ4, d, seed + 1), TQKV_OK);
        /* signs depend only on (seed, dim) */
        assert_memory_equal(c->signs, c2->signs, (size_t)d * sizeof(float));
        int differ = 0, neg = 0;
        for (int i = 0; i < d; i++) {
            assert_true(c->signs[i] == 1.0f || c->signs[i] == -1.0f);
            differ += c->signs[i] != c3->signs[i];
            neg += c->signs[i] < 0;
        }
        assert_true(differ > 0);
        assert_true(neg > 0 && neg < d);

        float x[512], y[512], z[512];
        for (int simd = 0; simd <= 1; simd++) {
            set_simd(simd);
            for (int t = 0; t < 8; t++) {
                rng_fill_normal(&r, x, (size_t)d, 1.0f);
                memcpy(y, x, sizeof(float) * d);
                assert_int_equal(tqkv_codec_rotate(c, y, 1), TQKV_OK);
                /* dense float64: y = H D x / sqrt(d), H[i][j] = (-1)^popcount(i & j) */
                double ref[512], nx = 0, ny = 0;
                for (int i = 0; i < d; i++) {
                    double s = 0;
                    for (int j = 0; j < d; j++)
                        s += (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) *
                             c->signs[j] * x[j];
                    ref[i] = s / sqrt((double)d);
                    nx += (double)x[i] * x[i];
                    ny += (double)y[i] * y[i];
                }
                assert_true(rel_l2_d(y, ref, (size_t)d) < 1e-6);
                assert_true(fabs(sqrt(ny / nx) - 1) < 1e-6);
                /* internal single-vector path: bitwise the same */
                memcpy(z, x, sizeof(float) * d);
                codec_rotate(c, z);
                assert_memory_equal(z, y, sizeof(float) * d);
                /* R^T R = I */
                assert_int_equal(tqkv_codec_unrotate(c, y, 1), TQKV_OK);
                assert_true(rel_l2(y, x, (size_t)d) < 1e-6);
                memcpy(z, x, sizeof(float) * d);
                codec_fwht(z, d);
                codec_fwht(z, d);
                assert_true(rel_l2(z, x, (size_t)d) < 1e-6);
                /* different seed, different rotation */
                memcpy(z, x, sizeof(float) * d);
                assert_int_equal(tqkv_codec_rotate(c3, z, 1), TQKV_OK);
                memcpy(y, x, sizeof(float) * d);
                assert_int_equal(tqkv_codec_rotate(c, y, 1), TQKV_OK);
                assert_true(rel_l2(z, y, (size_t)d) > 1e-3);
            }
        }
        set_simd(1);
        tqkv_codec_free(c);
        tqkv_codec_free(c2);
        tqkv_codec_free(c3);
    }
}

// ---------------------------------------------------------------------------
// Bit packing
// ---------------------------------------------------------------------------

static void test_pack_roundtrip(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x44);
    for (int f = 0; f < 4; f++)
        for (int k = 0; k < 5; k++) {
            struct tqkv_codec c;
            const int d = DIMS[k];
            assert_int_equal(codec_setup(&c, TQ_FORMATS[f], d, 7), TQKV_OK);
            assert_int_equal((int)c.payload, c.bits * d / 8);
            for (int t = 0; t < 20; t++) {
                uint8_t idx[512], back[512], buf[512 + 16];
                for (int i = 0; i < d; i++) idx[i] = (uint8_t)rng_int(&r, 0, (1 << c.bits) - 1);
                memset(buf, 0xA5, sizeof buf);
                codec_pack_indices(&c, idx, buf);
                for (size_t i = c.payload; i < c.payload + 16; i++) assert_int_equal(buf[i], 0xA5);
                codec_unpack_indices(&c, buf, back);
                assert_memory_equal(idx, back, (size_t)d);
            }
            codec_teardown(&c);
        }
}

static void test_pack_layout(void **state) {
    (void)state;
    struct tqkv_codec c;
    uint8_t p[64], idx[512], want[512];
    float x[512];
    uint16_t sc = tqkv_f32_to_f16(2.0f);

    /* tq4, d = 64: group 1 byte j: low = elem 32 + j, high = elem 48 + j */
    assert_int_equal(codec_setup(&c, TQKV_TQ4, 64, 3), TQKV_OK);
    memset(p, 0, sizeof p);
    memset(want, 0, sizeof want);
    for (int j = 0; j < 16; j++) {
        p[16 + j] = (uint8_t)(j | (15 - j) << 4);
        want[32 + j] = (uint8_t)j;
        want[48 + j] = (uint8_t)(15 - j);
    }
    p[0] = 0x5A; /* elem 0 = 10, elem 16 = 5 */
    want[0] = 10;
    want[16] = 5;
    codec_unpack_indices(&c, p, idx);
    assert_memory_equal(idx, want, 64);
    for (int simd = 0; simd <= 1; simd++) {
        set_simd(simd);
        codec_decode_rotated(&c, p, &sc, 1, x);
        for (int i = 0; i < 64; i++) assert_true(x[i] == 2.0f * c.centroids[want[i]]);
    }
    codec_teardown(&c);

    /* tq2, d = 32: byte j bits [2k, 2k+2) = elem 8k + j */
    assert_int_equal(codec_setup(&c, TQKV_TQ2, 32, 3), TQKV_OK);
    memset(p, 0, sizeof p);
    memset(want, 0, sizeof want);
    p[0] = 0xE4; /* elems 0, 8, 16, 24 = 0, 1, 2, 3 */
    p[5] = 0x1B; /* elems 5, 13, 21, 29 = 3, 2, 1, 0 */
    want[8] = 1; want[16] = 2; want[24] = 3;
    want[5] = 3; want[13] = 2; want[21] = 1;
    codec_unpack_indices(&c, p, idx);
    assert_memory_equal(idx, want, 32);
    for (int simd = 0; simd <= 1; simd++) {
        set_simd(simd);
        codec_decode_rotated(&c, p, &sc, 1, x);
        for (int i = 0; i < 32; i++) assert_true(x[i] == 2.0f * c.centroids[want[i]]);
    }
    codec_teardown(&c);

    /* tq3, d = 64: 2-bit plane (16 bytes) then 1-bit plane (8 bytes) */
    assert_int_equal(codec_setup(&c, TQKV_TQ3, 64, 3), TQKV_OK);
    memset(p, 0, sizeof p);
    memset(want, 0, sizeof want);
    p[8 + 3] = 0x80;    /* group 1, j = 3, k = 3: elem 59 low bits = 2 */
    p[16 + 4 + 0] = 0x01; /* group 1 LE uint32 bit 0: elem 32 high bit */
    p[16 + 4 + 3] = 0x80; /* bit 31: elem 63 */
    p[16 + 0 + 1] = 0x02; /* group 0 bit 9: elem 9 */
    p[2] = 0x03;          /* group 0, j = 2, k = 0: elem 2 low bits = 3 */
    want[59] = 2; want[32] = 4; want[63] = 4; want[9] = 4; want[2] = 3;
    codec_unpack_indices(&c, p, idx);
    assert_memory_equal(idx, want, 64);
    for (int simd = 0; simd <= 1; simd++) {
        set_simd(simd);
        codec_decode_rotated(&c, p, &sc, 1, x);
        for (int i = 0; i < 64; i++) assert_true(x[i] == 2.0f * c.centroids[want[i]]);
    }
    uint8_t q[64];
    codec_pack_indices(&c, want, q);
    assert_memory_equal(q, p, c.payload);
    codec_teardown(&c);

    /* tq1, d = 64: one 1-bit plane, bit i of the LE uint32 at 4g = elem 32g + i */
    assert_int_equal(codec_setup(&c, TQKV_TQ1, 64, 3), TQKV_OK);
    assert_int_equal((int)c.payload, 8);
    memset(p, 0, sizeof p);
    memset(want, 0, sizeof want);
    p[0] = 0x01;  /* elem 0 */
    p[1] = 0x80;  /* bit 15: elem 15 */
    p[4] = 0x06;  /* group 1 bits 1, 2: elems 33, 34 */
    p[7] = 0x80;  /* group 1 bit 31: elem 63 */
    want[0] = want[15] = want[33] = want[34] = want[63] = 1;
    codec_unpack_indices(&c, p, idx);
    assert_memory_equal(idx, want, 64);
    for (int simd = 0; simd <= 1; simd++) {
        set_simd(simd);
        codec_decode_rotated(&c, p, &sc, 1, x);
        for (int i = 0; i < 64; i++) assert_true(x[i] == 2.0f * c.centroids[want[i]]);
    }
    codec_pack_indices(&c, want, q);
    assert_memory_equal(q, p, c.payload);
    /* the two centroids are -+ sqrt(2 / pi) / sqrt(d) */
    assert_true(fabs(c.centroids[1] * 8.0 - sqrt(2.0 / M_PI)) < 1e-6);
    assert_true(c.centroids[0] == -c.centroids[1]);
    codec_teardown(&c);
    set_simd(1);
}

// ---------------------------------------------------------------------------
// q8 / q4 against float64 ggml reference rounding
// ---------------------------------------------------------------------------

/* ggml q8_0 / q4_0 of one vector in float64 -> public byte form. */
static void ref_q8(const float *x, int d, uint8_t *out) {
    for (int b = 0; b < d / 32; b++) {
        double amax = 0;
        for (int j = 0; j < 32; j++) amax = fmax(amax, fabs((double)x[32 * b + j]));
        float dq = (float)(amax / 127.0); /* = float division amax / 127 */
        for (int j = 0; j < 32; j++) {
            double q = dq != 0 ? round((double)x[32 * b + j] / dq) : 0;
            out[32 * b + j] = (uint8_t)(int8_t)q;
        }
        uint16_t h = ref_f16(dq);
        out[d + 2 * b] = (uint8_t)h;
        out[d + 2 * b + 1] = (uint8_t)(h >> 8);
    }
}

static void ref_q4(const float *x, int d, uint8_t *out) {
    memset(out, 0, (size_t)d / 2);
    for (int b = 0; b < d / 32; b++) {
        double amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (amax < fabs((double)x[32 * b + j])) {
                amax = fabs((double)x[32 * b + j]);
                max = x[32 * b + j];
            }
        float dq = (float)(max / -8.0);
        for (int j = 0; j < 32; j++) {
            int q = dq != 0 ? (int)floor((double)x[32 * b + j] / dq + 8.5) : 8;
            if (q > 15) q = 15;
            /* 4-bit plane: byte 16b + (j % 16), low nibble for j < 16 */
            out[16 * b + (j & 15)] |= (uint8_t)(q << (j < 16 ? 0 : 4));
        }
        uint16_t h = ref_f16(dq);
        out[d / 2 + 2 * b] = (uint8_t)h;
        out[d / 2 + 2 * b + 1] = (uint8_t)(h >> 8);
    }
}

/* q8's AVX2 encoder against the scalar one, byte for byte, on the inputs the float64
 * reference cannot take or rarely draws: NaN, +-inf, -0, exact half steps of the scale,
 * quotients past +-127 after the scale's float rounding, an all-zero block. */
static void test_q8_simd_special(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x98);
    tqkv_codec *c;
    assert_int_equal(tqkv_codec_init(&c, TQKV_Q8, 128, 0), TQKV_OK);
    const size_t B = tqkv_codec_bytes(c);
    float x[128];
    uint8_t e[2][256];
    for (int t = 0; t < 400; t++) {
        rng_fill_normal(&r, x, 128, (float)exp(rng_uniform(&r) * 8 - 4));
        for (int j = 0; j < 128; j++) {
            const int k = rng_int(&r, 0, 15);
            if (k == 0) x[j] = (float)rng_int(&r, -254, 254) * 0.5f; /* half steps (scale 1) */
            if (k == 1) x[j] = -0.0f;
        }
        x[rng_int(&r, 0, 31)] = 127.0f; /* block 0's scale exactly 1: ties above are real */
        if (t % 5 == 1) x[rng_int(&r, 32, 63)] = NAN;
        if (t % 5 == 2) x[rng_int(&r, 64, 95)] = t % 2 ? INFINITY : -INFINITY;
        if (t % 5 == 3) memset(x + 96, 0, 32 * sizeof(float));
        if (t % 5 == 4) x[rng_int(&r, 96, 127)] = nextafterf(x[100], INFINITY) * 1e30f;
        for (int simd = 0; simd <= 1; simd++) {
            set_simd(simd);
            assert_int_equal(tqkv_codec_encode(c, x, 1, e[simd]), TQKV_OK);
        }
        assert_memory_equal(e[0], e[1], B);
    }
    set_simd(1);
    tqkv_codec_free(c);
}

static void test_q8_q4_reference(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x55);
    for (int fi = 0; fi < 2; fi++) {
        const tqkv_format f = fi ? TQKV_Q4 : TQKV_Q8;
        for (int k = 0; k < 5; k++) {
            const int d = DIMS[k];
            tqkv_codec *c;
            assert_int_equal(tqkv_codec_init(&c, f, d, 0), TQKV_OK);
            const size_t B = tqkv_codec_bytes(c);
            assert_int_equal(B, fi ? (size_t)d / 2 + (size_t)d / 16 : (size_t)d + (size_t)d / 16);
            float x[512], y[512];
            uint8_t e[1024], ref[1024];
            for (int t = 0; t < 200; t++) {
                float sd = (float)exp(rng_uniform(&r) * 16 - 8);
                rng_fill_normal(&r, x, (size_t)d, sd);
                if (t % 10 == 1) memset(x, 0, 32 * sizeof(float)); /* zero block */
                if (t % 10 == 2) /* ties: values on exact half steps of the scale */
                    for (int j = 0; j < 32; j++) x[j] = (float)(rng_int(&r, -254, 254)) * 0.5f;
                if (t % 10 == 3) /* equal |max| of both signs: the first one wins */
                    x[3] = -(x[7] = 100.0f);
                if (fi) ref_q4(x, d, ref);
                else ref_q8(x, d, ref);
                for (int simd = 0; simd <= 1; simd++) { /* q8: the AVX2 encoder too */
                    set_simd(simd);
                    assert_int_equal(tqkv_codec_encode(c, x, 1, e), TQKV_OK);
                    assert_memory_equal(e, ref, B);
                }
                assert_int_equal(tqkv_codec_decode(c, e, 1, y), TQKV_OK);
                for (int b = 0; b < d / 32; b++) {
                    const size_t so = c->payload + 2 * (size_t)b;
                    double ds = tqkv_f16_to_f32((uint16_t)(e[so] | e[so + 1] << 8));
                    double amax = 0, max = 0;
                    for (int j = 0; j < 32; j++)
                        if (amax < fabs((double)x[32 * b + j])) {
                            amax = fabs((double)x[32 * b + j]);
                            max = x[32 * b + j];
                        }
                    /* exact scale dq; error = rounding step part + |q| * fp16 error of dq.
                     * q8: half a step, |q| <= 127; q4: one step (q clamps at 15), |q-8| <= 8 */
                    double dq = fi ? (float)(max / -8.0) : (float)(amax / 127.0);
                    double bound = fi ? fabs(dq) * 1.0 + 8.0 * fabs(dq - ds)
                                      : fabs(dq) * 0.5 + 127.0 * fabs(dq - ds);
                    bound = bound * (1 + 1e-6) + 1e-38;
                    assert_true(fabs(dq - ds) <= fmax(fabs(dq) / 2048.0, ldexp(1.0, -25)));
                    for (int j = 0; j < 32; j++)
                        assert_true(fabs((double)x[32 * b + j] - y[32 * b + j]) <= bound);
                }
            }
            tqkv_codec_free(c);
        }
    }
}

// ---------------------------------------------------------------------------
// fp8 (e4m3, per-vector fp16 scale) against a float64 reference
// ---------------------------------------------------------------------------

/* Value of e4m3 code b from the OCP definition (bias 7; e = 0 subnormal); NaN for 0x7f/0xff. */
static double ref_e4m3_value(int b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const double sign = b & 0x80 ? -1.0 : 1.0;
    if (e == 15 && m == 7) return NAN;
    return sign * (e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6));
}

/* Nearest finite code to v by search over all 254 finite codes; ties to the even code
 * (even mantissa); beyond 448 saturates; the sign of v is kept (zero too). */
static uint8_t ref_e4m3(double v) {
    const double a = fabs(v);
    int best = 0;
    double berr = INFINITY;
    for (int b = 0; b < 0x7f; b++) {
        const double err = fabs(ref_e4m3_value(b) - a);
        if (err < berr || (err == berr && !(b & 1))) {
            berr = err;
            best = b;
        }
    }
    return (uint8_t)(best | (signbit(v) ? 0x80 : 0));
}

/* Public byte form of fp8 in float64: scale fp16(binary32 amax / 448), e4m3(x / scale). */
static void ref_fp8(const float *x, int d, uint8_t *out) {
    double amax = 0;
    for (int i = 0; i < d; i++) amax = fmax(amax, fabs((double)x[i]));
    const float sq = (float)(amax / 448.0); /* = binary32 division (double rounding is safe) */
    const uint16_t h = sq >= 65504.0f ? 0x7bff : ref_f16(sq);
    const double s = tqkv_f16_to_f32(h);
    for (int i = 0; i < d; i++) out[i] = s > 0 ? ref_e4m3((double)x[i] / s) : 0;
    out[d] = (uint8_t)h;
    out[d + 1] = (uint8_t)(h >> 8);
}

static void test_fp8_codes(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0xf8);
    /* every code decodes to its OCP value (scale 1.0); NaN codes read as +-480 */
    tqkv_codec *c;
    assert_int_equal(tqkv_codec_init(&c, TQKV_FP8, 32, 0), TQKV_OK);
    for (int simd = 0; simd <= 1; simd++) {
        set_simd(simd);
        for (int b = 0; b < 256; b++) {
            uint8_t e[34];
            memset(e, b, 32);
            e[32] = 0x00;
            e[33] = 0x3c; /* scale 1.0 */
            float y[32];
            assert_int_equal(tqkv_codec_decode(c, e, 1, y), TQKV_OK);
            const double want = (b & 0x7f) == 0x7f ? (b & 0x80 ? -480.0 : 480.0) : ref_e4m3_value(b);
            for (int i = 0; i < 32; i++) assert_true((double)y[i] == want);
            assert_true(!!signbit(y[0]) == !!(b & 0x80));
        }
    }
    /* rounding: every code, every midpoint between neighbours (ties), a step either side,
     * random values over 2^-14 .. 2^10, zero, saturation */
    for (int b = 0; b < 0x7f; b++) {
        const double v = ref_e4m3_value(b);
        assert_int_equal(codec_e4m3_from_double(v), b);
        assert_int_equal(codec_e4m3_from_double(-v), b | 0x80);
        if (b + 1 < 0x7f) {
            const double mid = 0.5 * (v + ref_e4m3_value(b + 1));
            assert_int_equal(codec_e4m3_from_double(mid), ref_e4m3(mid));
            assert_int_equal(codec_e4m3_from_double(mid), b & 1 ? b + 1 : b);
            assert_int_equal(codec_e4m3_from_double(nextafter(mid, 0)), b);
            assert_int_equal(codec_e4m3_from_double(nextafter(mid, 1e9)), b + 1);
            assert_int_equal(codec_e4m3_from_double(-mid), ref_e4m3(-mid));
        }
    }
    for (int t = 0; t < 20000; t++) {
        const double v = (rng_u64(&r) & 1 ? -1 : 1) * ldexp(1.0 + rng_uniform(&r), rng_int(&r, -14, 10));
        assert_int_equal(codec_e4m3_from_double(v), ref_e4m3(v));
    }
    assert_int_equal(codec_e4m3_from_double(0.0), 0x00);
    assert_int_equal(codec_e4m3_from_double(-0.0), 0x80);
    assert_int_equal(codec_e4m3_from_double(448.0), 0x7e);
    assert_int_equal(codec_e4m3_from_double(463.99), 0x7e);
    assert_int_equal(codec_e4m3_from_double(464.0), 0x7e); /* tie 448 / 480: saturates */
    assert_int_equal(codec_e4m3_from_double(-1e300), 0xfe);
    assert_int_equal(codec_e4m3_from_double(ldexp(1.0, -10)), 0x00); /* half of 2^-9: even */
    assert_int_equal(codec_e4m3_from_double(ldexp(3.0, -10)), 0x02);  /* 1.5 * 2^-9 -> 2 */
    tqkv_codec_free(c);
    set_simd(1);
}

static void test_fp8_reference(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0xf9);
    double se = 0, sx = 0;
    for (int k = 0; k < 5; k++) {
        const int d = DIMS[k];
        tqkv_codec *c;
        assert_int_equal(tqkv_codec_init(&c, TQKV_FP8, d, 0), TQKV_OK);
        assert_int_equal(tqkv_codec_bytes(c), (size_t)d + 2);
        float x[512], y[512];
        uint8_t e[1024], ref[1024];
        for (int t = 0; t < 300; t++) {
            const float sd = (float)exp(rng_uniform(&r) * 24 - 12);
            rng_fill_normal(&r, x, (size_t)d, sd);
            if (t % 10 == 1) memset(x, 0, (size_t)d * sizeof(float)); /* zero vector */
            if (t % 10 == 2) x[rng_int(&r, 0, d - 1)] *= 1000.0f;      /* outlier: subnormals */
            if (t % 10 == 3) x[0] = 3e7f;                              /* scale saturates */
            for (int simd = 0; simd <= 1; simd++) {
                set_simd(simd);
                assert_int_equal(tqkv_codec_encode(c, x, 1, e), TQKV_OK);
                ref_fp8(x, d, ref);
                assert_memory_equal(e, ref, (size_t)d + 2);
                assert_int_equal(tqkv_codec_decode(c, e, 1, y), TQKV_OK);
            }
            /* round trip: half an e4m3 step (relative 2^-4 normal, 2^-10 s subnormal),
             * or the clip at 448 s (scale rounding / saturation) */
            const double s = tqkv_f16_to_f32((uint16_t)(e[d] | e[d + 1] << 8));
            for (int i = 0; i < d; i++) {
                const double xi = x[i], err = fabs(xi - (double)y[i]);
                const double bound = fmax(fmax(fabs(xi) * 0x1p-4, s * 0x1p-10), fabs(xi) - 448.0 * s);
                assert_true(err <= bound * (1 + 1e-6));
                if (t % 10 > 3 && d == 128) {
                    se += err * err;
                    sx += xi * xi;
                }
            }
        }
        tqkv_codec_free(c);
    }
    set_simd(1);
    /* Gaussian vectors, d = 128: relative MSE of e4m3 with an amax scale */
    fprintf(stderr, "[fp8] relative MSE at d=128: %.3e\n", se / sx);
    assert_true(se / sx < 1e-3);
}

// ---------------------------------------------------------------------------
// fp16
// ---------------------------------------------------------------------------

static void test_f16(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x66);
    /* every half round-trips; NaN stays NaN */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = tqkv_f16_to_f32((uint16_t)h);
        uint16_t back = tqkv_f32_to_f16(f);
        int is_nan = ((h >> 10) & 31) == 31 && (h & 0x3ff);
        if (is_nan) {
            assert_true(isnan(f));
            assert_true(((back >> 10) & 31) == 31 && (back & 0x3ff));
        } else {
            assert_int_equal(back, h);
            assert_int_equal(ref_f16(f), h);
        }
    }
    /* random floats vs the float64 RNE reference, via the f16 codec too */
    tqkv_codec *c;
    assert_int_equal(tqkv_codec_init(&c, TQKV_F16, 32, 0), TQKV_OK);
    float x[32], y[32];
    uint8_t e[64];
    for (int t = 0; t < 20000; t++) {
        for (int j = 0; j < 32; j++) {
            uint32_t u;
            switch (rng_int(&r, 0, 4)) {
            case 0: u = (uint32_t)rng_u64(&r); break;                     /* any bits */
            case 1: x[j] = (float)(rng_normal(&r) * ldexp(1.0, -20)); continue; /* subnormal */
            case 2: x[j] = (float)(rng_normal(&r) * 70000.0); continue;  /* near overflow */
            case 3: /* exact ties between two halves */
                x[j] = (float)ldexp((double)(2 * rng_int(&r, 1024, 2047) + 1),
                                    rng_int(&r, -26, 4));
                continue;
            default: x[j] = (float)rng_normal(&r); continue;
            }
            memcpy(&x[j], &u, 4);
        }
        set_simd(t & 1); /* both encode paths */
        assert_int_equal(tqkv_codec_encode(c, x, 1, e), TQKV_OK);
        for (int j = 0; j < 32; j++) {
            uint16_t h = (uint16_t)(e[2 * j] | e[2 * j + 1] << 8);
            assert_int_equal(h, tqkv_f32_to_f16(x[j]));
            if (isnan(x[j])) {
                assert_true(((h >> 10) & 31) == 31 && (h & 0x3ff));
            } else {
                assert_int_equal(h, ref_f16(x[j]));
            }
        }
        for (int simd = 0; simd <= 1; simd++) {
            set_simd(simd);
            assert_int_equal(tqkv_codec_decode(c, e, 1, y), TQKV_OK);
            for (int j = 0; j < 32; j++) {
                uint16_t h = (uint16_t)(e[2 * j] | e[2 * j + 1] << 8);
                float want = tqkv_f16_to_f32(h);
                assert_memory_equal(&y[j], &want, 4);
            }
        }
    }
    set_simd(1);
    /* specials */
    assert_int_equal(tqkv_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(tqkv_f32_to_f16(-INFINITY), 0xfc00);
    assert_int_equal(tqkv_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(tqkv_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(tqkv_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);          /* tie -> even 0 */
    assert_int_equal(tqkv_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);
    tqkv_codec_free(c);
}

// ---------------------------------------------------------------------------
// encode_rotated == encode; SIMD == scalar
// ---------------------------------------------------------------------------

static void test_encode_rotated(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x77);
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++)
        for (int k = 0; k < 5; k++) {
            const int d = DIMS[k];
            const size_t n = 16;
            struct tqkv_codec c;
            assert_int_equal(codec_setup(&c, (tqkv_format)f, d, rng_u64(&r)), TQKV_OK);
            float *x = xmalloc(n * d * sizeof(float)), *xr = xmalloc(n * d * sizeof(float));
            uint8_t *p1 = xmalloc(n * c.payload), *p2 = xmalloc(n * c.payload);
            uint16_t s1[16 * 16], s2[16 * 16];
            rng_fill_normal(&r, x, n * d, (float)exp(rng_uniform(&r) * 6 - 3));
            memcpy(xr, x, n * d * sizeof(float));
            for (size_t i = 0; i < n; i++) codec_rotate(&c, xr + i * d);
            codec_encode(&c, x, n, p1, s1);
            codec_encode_rotated(&c, xr, n, p2, s2);
            assert_memory_equal(p1, p2, n * c.payload);
            if (c.n_scales) assert_memory_equal(s1, s2, n * (size_t)c.n_scales * 2);
            /* public byte form = payload then LE scales */
            tqkv_codec *pc;
            assert_int_equal(tqkv_codec_init(&pc, (tqkv_format)f, d, c.seed), TQKV_OK);
            const size_t B = tqkv_codec_bytes(pc);
            assert_int_equal(B, c.payload + 2 * (size_t)c.n_scales);
            assert_int_equal(B, tqkv_format_bytes((tqkv_format)f, d));
            uint8_t *e = xmalloc(n * B);
            assert_int_equal(tqkv_codec_encode(pc, x, n, e), TQKV_OK);
            for (size_t i = 0; i < n; i++) {
                assert_memory_equal(e + i * B, p1 + i * c.payload, c.payload);
                for (int s = 0; s < c.n_scales; s++) {
                    uint16_t v = s1[i * c.n_scales + s];
                    assert_int_equal(e[i * B + c.payload + 2 * s], v & 0xff);
                    assert_int_equal(e[i * B + c.payload + 2 * s + 1], v >> 8);
                }
            }
            free(e);
            tqkv_codec_free(pc);
            free(x);
            free(xr);
            free(p1);
            free(p2);
            codec_teardown(&c);
        }
}

static void test_simd_equal(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x88);
    set_simd(1);
    if (!tqkv_cpu_has_avx2()) fprintf(stderr, "[simd] no AVX2 here: both paths are scalar\n");
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++)
        for (int k = 0; k < 5; k++) {
            const int d = DIMS[k];
            const size_t n = 64;
            struct tqkv_codec c;
            assert_int_equal(codec_setup(&c, (tqkv_format)f, d, rng_u64(&r)), TQKV_OK);
            float *x = xmalloc(n * d * sizeof(float));
            float *a = xmalloc(n * d * sizeof(float)), *b = xmalloc(n * d * sizeof(float));
            uint8_t *p = xmalloc(n * c.payload);
            uint16_t *s = xmalloc(n * 16 * sizeof(uint16_t));
            rng_fill_normal(&r, x, n * d, (float)exp(rng_uniform(&r) * 6 - 3));
            if (f == TQKV_F16) /* specials through the F16C path */
                for (int j = 0; j < 8; j++) {
                    uint32_t u = j & 1 ? 0x7f800001u + (uint32_t)rng_int(&r, 0, 1 << 20)
                                       : 0xff812345u; /* NaNs with payloads */
                    memcpy(&x[rng_int(&r, 0, (int)(n * d) - 1)], &u, 4);
                }
            x[0] = 1e-41f;  /* float subnormal */
            x[1] = 70000.0f; /* overflows fp16 */
            { /* encode: SIMD == scalar bytes (tq rotation, norms, quantizer; f16 F16C) */
                uint8_t *p2 = xmalloc(n * c.payload);
                uint16_t *s2 = xmalloc(n * 16 * sizeof(uint16_t));
                memset(s, 0, n * 16 * sizeof(uint16_t));
                memset(s2, 0, n * 16 * sizeof(uint16_t));
                set_simd(0);
                codec_encode(&c, x, n, p2, s2);
                set_simd(1);
                codec_encode(&c, x, n, p, s);
                assert_memory_equal(p, p2, n * c.payload);
                assert_memory_equal(s, s2, n * 16 * sizeof(uint16_t));
                free(p2);
                free(s2);
            }
            if (f != TQKV_F32 && f != TQKV_F16) /* arbitrary bytes decode too */
                for (size_t i = 0; i < n * c.payload / 2; i++) p[i] = (uint8_t)rng_u64(&r);
            for (int rot = 0; rot <= 1; rot++) {
                set_simd(1);
                if (rot) codec_decode_rotated(&c, p, s, n, a);
                else codec_decode(&c, p, s, n, a);
                set_simd(0);
                if (rot) codec_decode_rotated(&c, p, s, n, b);
                else codec_decode(&c, p, s, n, b);
                assert_memory_equal(a, b, n * d * sizeof(float));
            }
            if (c.rotated) { /* bulk public rotate / unrotate */
                tqkv_codec *pc;
                assert_int_equal(tqkv_codec_init(&pc, (tqkv_format)f, d, c.seed), TQKV_OK);
                memcpy(a, x, n * d * sizeof(float));
                memcpy(b, x, n * d * sizeof(float));
                set_simd(1);
                assert_int_equal(tqkv_codec_rotate(pc, a, n), TQKV_OK);
                set_simd(0);
                assert_int_equal(tqkv_codec_rotate(pc, b, n), TQKV_OK);
                assert_memory_equal(a, b, n * d * sizeof(float));
                set_simd(1);
                assert_int_equal(tqkv_codec_unrotate(pc, a, n), TQKV_OK);
                set_simd(0);
                assert_int_equal(tqkv_codec_unrotate(pc, b, n), TQKV_OK);
                assert_memory_equal(a, b, n * d * sizeof(float));
                tqkv_codec_free(pc);
            }
            set_simd(1);
            free(x);
            free(a);
            free(b);
            free(p);
            free(s);
            codec_teardown(&c);
        }
}

// ---------------------------------------------------------------------------
// Formats and bad inputs
// ---------------------------------------------------------------------------

static void test_formats(void **state) {
    (void)state;
    const size_t at128[TQKV_FORMAT_COUNT] = {512, 256, 136, 72, 34, 50, 66, 130, 18};
    const char *names[TQKV_FORMAT_COUNT] = {"f32", "f16", "q8",  "q4", "tq2",
                                            "tq3", "tq4", "fp8", "tq1"};
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
        assert_int_equal(tqkv_format_bytes((tqkv_format)f, 128), at128[f]);
        assert_string_equal(tqkv_format_name((tqkv_format)f), names[f]);
        tqkv_format g;
        assert_int_equal(tqkv_format_parse(names[f], &g), TQKV_OK);
        assert_int_equal(g, f);
        for (int k = 0; k < 5; k++) {
            const int d = DIMS[k];
            double bpv = tqkv_format_bits_per_value((tqkv_format)f, d);
            assert_true(fabs(bpv - 8.0 * (double)tqkv_format_bytes((tqkv_format)f, d) / d) < 1e-12);
        }
        const int tq = (f >= TQKV_TQ2 && f <= TQKV_TQ4) || f == TQKV_TQ1;
        assert_int_equal(tqkv_format_is_tq((tqkv_format)f), tq);
        assert_int_equal(tqkv_format_tq_bits((tqkv_format)f),
                         f == TQKV_TQ1 ? 1 : tq ? f - TQKV_TQ2 + 2 : 0);
    }
    assert_true(fabs(tqkv_format_bits_per_value(TQKV_TQ4, 128) - 4.125) < 1e-12);
    assert_true(fabs(tqkv_format_bits_per_value(TQKV_Q4, 64) - 4.5) < 1e-12);
    assert_true(fabs(tqkv_format_bits_per_value(TQKV_Q8, 512) - 8.5) < 1e-12);
    assert_true(fabs(tqkv_format_bits_per_value(TQKV_FP8, 128) - 8.125) < 1e-12);
    assert_true(fabs(tqkv_format_bits_per_value(TQKV_TQ1, 128) - 1.125) < 1e-12);
    assert_true(fabs(tqkv_format_bits_per_value(TQKV_TQ1, 256) - 1.0625) < 1e-12);
    tqkv_format k, v;
    assert_int_equal(tqkv_kv_spec_parse("tq4/tq3", &k, &v), TQKV_OK);
    assert_int_equal(k, TQKV_TQ4);
    assert_int_equal(v, TQKV_TQ3);
    assert_int_equal(tqkv_kv_spec_parse("f16", &k, &v), TQKV_OK);
    assert_int_equal(k, TQKV_F16);
    assert_int_equal(v, TQKV_F16);
    assert_int_equal(tqkv_kv_spec_parse("q8_0/q4", &k, &v), TQKV_OK);
    assert_int_equal(k, TQKV_Q8);
    assert_int_equal(v, TQKV_Q4);
}

#define EXPECT_FAIL(call, code)                                                                    \
    do {                                                                                           \
        tqkv_clear_error();                                                                        \
        assert_int_equal((call), (code));                                                          \
        assert_true(tqkv_last_error()[0] != 0);                                                    \
    } while (0)

static void test_bad_inputs(void **state) {
    (void)state;
    const int bad_dims[] = {0, 16, 33, 1024, -128, 48, 96};
    tqkv_codec *c = NULL;
    for (size_t i = 0; i < sizeof bad_dims / sizeof bad_dims[0]; i++) {
        EXPECT_FAIL(tqkv_check_dim(bad_dims[i]), TQKV_EINVAL);
        EXPECT_FAIL(tqkv_codec_init(&c, TQKV_TQ4, bad_dims[i], 0), TQKV_EINVAL);
        assert_null(c);
        assert_int_equal(tqkv_format_bytes(TQKV_TQ4, bad_dims[i]), 0);
    }
    EXPECT_FAIL(tqkv_codec_init(&c, TQKV_FORMAT_COUNT, 128, 0), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_init(&c, (tqkv_format)-1, 128, 0), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_init(NULL, TQKV_TQ4, 128, 0), TQKV_EINVAL);
    assert_int_equal(tqkv_format_bytes(TQKV_FORMAT_COUNT, 128), 0);
    assert_string_equal(tqkv_format_name(TQKV_FORMAT_COUNT), "unknown");

    tqkv_format f = TQKV_F32, k = TQKV_F32, v = TQKV_F32;
    const char *bad_names[] = {"tq5", "", "q16", "tq4 ", "TQ", "f64", "tq4/"};
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        EXPECT_FAIL(tqkv_format_parse(bad_names[i], &f), TQKV_EINVAL);
        assert_int_equal(f, TQKV_F32);
    }
    EXPECT_FAIL(tqkv_format_parse(NULL, &f), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_format_parse("tq4", NULL), TQKV_EINVAL);
    const char *bad_specs[] = {"tq4/", "/tq4", "tq4/tq3/tq2", "bogus", "tq4/bogus", "", "/"};
    for (size_t i = 0; i < sizeof bad_specs / sizeof bad_specs[0]; i++) {
        EXPECT_FAIL(tqkv_kv_spec_parse(bad_specs[i], &k, &v), TQKV_EINVAL);
        assert_int_equal(k, TQKV_F32); /* outputs unchanged on failure */
        assert_int_equal(v, TQKV_F32);
    }
    EXPECT_FAIL(tqkv_kv_spec_parse(NULL, &k, &v), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_kv_spec_parse("tq4", NULL, &v), TQKV_EINVAL);

    assert_int_equal(tqkv_codec_init(&c, TQKV_TQ4, 128, 0), TQKV_OK);
    float x[128] = {0};
    uint8_t e[66];
    EXPECT_FAIL(tqkv_codec_encode(NULL, x, 1, e), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_encode(c, NULL, 1, e), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_encode(c, x, 1, NULL), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_decode(NULL, e, 1, x), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_decode(c, NULL, 1, x), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_decode(c, e, 1, NULL), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_rotate(NULL, x, 1), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_rotate(c, NULL, 1), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_unrotate(c, NULL, 1), TQKV_EINVAL);
    EXPECT_FAIL(tqkv_codec_encode(c, x, SIZE_MAX / 8, e), TQKV_ERANGE);
    assert_int_equal(tqkv_codec_encode(c, NULL, 0, NULL), TQKV_OK); /* n = 0 is a no-op */
    assert_int_equal(tqkv_codec_bytes(NULL), 0);
    tqkv_codec_free(c);
    tqkv_codec_free(NULL);

    assert_int_equal(tqkv_codec_init(&c, TQKV_F16, 128, 0), TQKV_OK);
    EXPECT_FAIL(tqkv_codec_rotate(c, x, 1), TQKV_EINVAL); /* no rotation in f16 */
    tqkv_codec_free(c);
}

int main(void) {
    test_seed();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_formats),
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_lloyd_max),
        cmocka_unit_test(test_rotation),
        cmocka_unit_test(test_pack_roundtrip),
        cmocka_unit_test(test_pack_layout),
        cmocka_unit_test(test_q8_q4_reference),
        cmocka_unit_test(test_q8_simd_special),
        cmocka_unit_test(test_fp8_codes),
        cmocka_unit_test(test_fp8_reference),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_encode_rotated),
        cmocka_unit_test(test_simd_equal),
        cmocka_unit_test(test_norm_and_zero),
        cmocka_unit_test(test_mse_d128),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
