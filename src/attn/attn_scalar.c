/*
 * attn_scalar.c - portable scalar attention primitives (the fallback every machine runs,
 * and the path TQKV_NO_SIMD=1 selects).
 * Owns: per-format token decode (tq indices unpacked by the codec, codec_unpack_bits), the
 * scalar versions of the primitives in attn_internal.h.
 * Must not: allocate, use threads, or depend on anything but the run it is given.
 */
#include <math.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "codec/codec.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Token decode
// ---------------------------------------------------------------------------
void attn_decode_token(const attn_src *s, const uint8_t *pl, const uint16_t *sc, int scaled,
                       float *out) {
    const int d = s->dim;
    switch (s->fmt) {
    case TQKV_F32:
        memcpy(out, pl, (size_t)d * sizeof(float));
        break;
    case TQKV_F16:
        for (int i = 0; i < d; i++) {
            uint16_t h;
            memcpy(&h, pl + 2 * (size_t)i, 2);
            out[i] = tqkv_f16_to_f32(h);
        }
        break;
    case TQKV_Q8:
        for (int i = 0; i < d; i++)
            out[i] = (float)(int8_t)pl[i] * tqkv_f16_to_f32(sc[i / 32]);
        break;
    case TQKV_Q4:
        for (int g = 0; g < d / 32; g++) {
            const float sg = tqkv_f16_to_f32(sc[g]);
            for (int j = 0; j < 16; j++) {
                const uint8_t byte = pl[16 * g + j];
                out[32 * g + j] = (float)((int)(byte & 15) - 8) * sg;
                out[32 * g + 16 + j] = (float)((int)(byte >> 4) - 8) * sg;
            }
        }
        break;
    case TQKV_FP8: {
        const float s256 = tqkv_f16_to_f32(sc[0]) * 256.0f;
        for (int i = 0; i < d; i++) out[i] = tqkv_f16_to_f32(codec_fp8_half(pl[i])) * s256;
        break;
    }
    case TQKV_TQ1:
    case TQKV_TQ2:
    case TQKV_TQ3:
    case TQKV_TQ4: {
        const float sv = scaled ? tqkv_f16_to_f32(sc[0]) : 1.0f;
        uint8_t idx[512]; // [d], d <= 512 (tqkv_check_dim)
        codec_unpack_bits(tqkv_format_tq_bits(s->fmt), d, pl, idx);
        for (int i = 0; i < d; i++) out[i] = scaled ? sv * s->cent[idx[i]] : s->cent[idx[i]];
        break;
    }
    default:
        memset(out, 0, (size_t)d * sizeof(float));
        break;
    }
}

static inline const uint8_t *src_pl(const attn_src *s, int t) {
    return s->data + (size_t)t * s->dstride;
}
static inline const uint16_t *src_sc(const attn_src *s, int t) {
    return s->scales ? s->scales + (size_t)t * s->sstride : NULL;
}

// ---------------------------------------------------------------------------
// Decode engine primitives
// ---------------------------------------------------------------------------
static void sc_decode(const attn_src *s, int n, float *out, const attn_pf *pf) {
    (void)pf;
    for (int t = 0; t < n; t++)
        attn_decode_token(s, src_pl(s, t), src_sc(s, t), 1, out + (size_t)t * s->dim);
}

static void sc_score(const attn_src *s, int n, const float *q, int nh, float *sc, int ldsc,
                     const attn_pf *pf) {
    (void)pf;
    const int d = s->dim;
    float u[512];   // [dim]
    for (int t = 0; t < n; t++) {
        attn_decode_token(s, src_pl(s, t), src_sc(s, t), 0, u);
        for (int h = 0; h < nh; h++) {
            const float *qh = q + (size_t)h * d;
            float acc = 0.0f;
            for (int i = 0; i < d; i++) acc += qh[i] * u[i];
            sc[(size_t)h * ldsc + t] = acc;
        }
    }
}

static void sc_accum(const attn_src *s, int n, const float *w, int ldw, int nh, float *acc,
                     const attn_pf *pf) {
    (void)pf;
    const int d = s->dim;
    float u[512];   // [dim]
    for (int t = 0; t < n; t++) {
        attn_decode_token(s, src_pl(s, t), src_sc(s, t), 0, u);
        for (int h = 0; h < nh; h++) {
            const float wt = w[(size_t)h * ldw + t];
            float *ah = acc + (size_t)h * d;
            for (int i = 0; i < d; i++) ah[i] += wt * u[i];
        }
    }
}

static void sc_softmax_block(float *sc, int ldsc, int n, int nh, const float *ks,
                             const float *vs, float *m, float *l, float *acc, int dim,
                             float *w, int ldw) {
    for (int h = 0; h < nh; h++) {
        float *s = sc + (size_t)h * ldsc;
        float bm = -INFINITY;
        for (int t = 0; t < n; t++) {
            s[t] *= ks[t];
            if (s[t] > bm) bm = s[t];
        }
        const float mn = m[h] > bm ? m[h] : bm;
        const float alpha = m[h] == -INFINITY ? 0.0f : expf(m[h] - mn);
        float sum = 0.0f;
        float *wh = w + (size_t)h * ldw;
        for (int t = 0; t < n; t++) {
            const float pt = expf(s[t] - mn);
            sum += pt;
            wh[t] = vs ? pt * vs[t] : pt;
        }
        l[h] = l[h] * alpha + sum;
        if (alpha != 1.0f) {
            float *ah = acc + (size_t)h * dim;
            for (int i = 0; i < dim; i++) ah[i] *= alpha;
        }
        m[h] = mn;
    }
}

static void sc_token_scales(const uint16_t *sc, int n, float mul, float *out) {
    for (int j = 0; j < n; j++) out[j] = mul * tqkv_f16_to_f32(sc[j]);
}

/* Same operations in the same order as codec/rotation.c (scalar reference there). */
static void sc_fwht(float *x, int dim) {
    for (int i = 0; i < dim; i += 8) {
        float *v = x + i;
        for (int h = 1; h < 8; h <<= 1)
            for (int j = 0; j < 8; j += 2 * h)
                for (int k = j; k < j + h; k++) {
                    const float a = v[k], b = v[k + h];
                    v[k] = a + b;
                    v[k + h] = a - b;
                }
    }
    for (int h = 8; h < dim; h <<= 1)
        for (int i = 0; i < dim; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

static float inv_sqrt_dim(int dim) { return (float)(1.0 / sqrt((double)dim)); }

static void sc_rotate(const float *signs, int dim, float *x) {
    const float inv = inv_sqrt_dim(dim);
    for (int i = 0; i < dim; i++) x[i] *= signs[i];
    sc_fwht(x, dim);
    for (int i = 0; i < dim; i++) x[i] *= inv;
}

static void sc_unrotate(const float *signs, int dim, float *x) {
    const float inv = inv_sqrt_dim(dim);
    sc_fwht(x, dim);
    for (int i = 0; i < dim; i++) x[i] *= signs[i] * inv;
}

// ---------------------------------------------------------------------------
// Prefill tile primitives
// ---------------------------------------------------------------------------
static void sc_tile_qk(const float *k, size_t ldk, int n, int dim, const float *qt, int mp,
                       int l0, int l1, float *st) {
    for (int j = 0; j < n; j++) {
        float *row = st + (size_t)j * mp;
        for (int c = l0; c < l1; c++) row[c] = 0.0f;
        for (int i = 0; i < dim; i++) {
            const float kv = k[(size_t)j * ldk + i];
            const float *qi = qt + (size_t)i * mp;
            for (int c = l0; c < l1; c++) row[c] += kv * qi[c];
        }
    }
}

static void sc_tile_softmax(float *st, int n, int tok0, int mp, int l0, int l1,
                            const int32_t *lo, const int32_t *hi, float *m, float *l, float *ot,
                            int dim) {
    for (int c = l0; c < l1; c++) {
        float mx = -INFINITY;
        for (int j = 0; j < n; j++) {
            float *x = st + (size_t)j * mp + c;
            const int tok = tok0 + j;
            if (tok < lo[c] || tok >= hi[c]) *x = -INFINITY;
            if (*x > mx) mx = *x;
        }
        const float mn = m[c] > mx ? m[c] : mx;
        const float ms = mn == -INFINITY ? 0.0f : mn;
        const float alpha = expf(m[c] - ms);
        float sum = 0.0f;
        for (int j = 0; j < n; j++) {
            float *x = st + (size_t)j * mp + c;
            *x = expf(*x - ms);
            sum += *x;
        }
        l[c] = l[c] * alpha + sum;
        m[c] = mn;
        if (alpha != 1.0f)
            for (int i = 0; i < dim; i++) ot[(size_t)i * mp + c] *= alpha;
    }
}

static void sc_tile_pv(const float *v, size_t ldv, int n, int dim, const float *pt, int mp,
                       int l0, int l1, float *ot) {
    for (int i = 0; i < dim; i++) {
        float *oi = ot + (size_t)i * mp;
        for (int j = 0; j < n; j++) {
            const float vv = v[(size_t)j * ldv + i];
            const float *pj = pt + (size_t)j * mp;
            for (int c = l0; c < l1; c++) oi[c] += vv * pj[c];
        }
    }
}

// ---------------------------------------------------------------------------
// Table
// ---------------------------------------------------------------------------
static const attn_isa SCALAR = {
    .name = "scalar",
    .decode = {sc_decode, sc_decode, sc_decode, sc_decode, sc_decode, sc_decode, sc_decode,
               sc_decode, sc_decode},
    .score = {sc_score, sc_score, sc_score, sc_score, sc_score, sc_score, sc_score, sc_score,
              sc_score},
    .accum = {sc_accum, sc_accum, sc_accum, sc_accum, sc_accum, sc_accum, sc_accum, sc_accum,
              sc_accum},
    .token_scales = sc_token_scales,
    .rotate = sc_rotate,
    .unrotate = sc_unrotate,
    .softmax_block = sc_softmax_block,
    .tile_qk = sc_tile_qk,
    .tile_softmax = sc_tile_softmax,
    .tile_pv = sc_tile_pv,
};

const attn_isa *attn_isa_scalar(void) { return &SCALAR; }
