/*
 * attn_avx2.c - AVX2/FMA/F16C format-aware attention primitives (chosen at run time by
 * attn.c) and the TQKV_AVX2 primitive table.
 * Owns: in-register decode of every stored format (tq4: two _mm256_permutevar8x32_ps
 * lookups + blend; tq3: one 8-entry lookup, its top index bit from a 256-entry table of
 * the 1-bit plane byte; tq2: one in-lane 4-entry lookup; f16/q8/q4 conversion), the fused
 * score / accumulate loops, and the fused K scores of tq4 / tq3 in byte planes (vpshufb
 * lookups against a query permuted once per item). Float-only primitives (softmax block,
 * rotation, prefill tiles) live in attn_avx2_block.c; shared helpers in attn_avx2.h.
 * Must not: allocate, use threads, or let a result depend on anything but its own lane:
 * every (head, token) dot product and every (head, dim) accumulator is one FMA chain in
 * a fixed order, so how tokens / heads are grouped into registers never changes a bit.
 */
#include "attn/attn_internal.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attn/attn_avx2.h"

// ---------------------------------------------------------------------------
// In-register decode: one "pair" = 16 values of group g (32 dims), half h (0/1).
// Chunks (8 dims each): 4-bit formats pair chunks 4g+h and 4g+2+h (low / high nibbles of
// the same 8 bytes); every other format pairs 4g+2h and 4g+2h+1. tq values are the raw
// codebook entries (no scale); the lookup tables T0/T1 come from luts().
// ---------------------------------------------------------------------------
static AI int cha(int fmt, int g, int h) {
    return (fmt == TQKV_Q4 || fmt == TQKV_TQ4) ? 4 * g + h : 4 * g + 2 * h;
}
static AI int chb(int fmt, int g, int h) {
    return (fmt == TQKV_Q4 || fmt == TQKV_TQ4) ? 4 * g + 2 + h : 4 * g + 2 * h + 1;
}

typedef struct {
    __m256 t0, t1;
} luts;

TQKV_AVX2 static AI luts luts_make(int fmt, const float *c) {
    luts L;
    if (fmt == TQKV_TQ4) {   // c[0..7], c[8..15]
        L.t0 = ld(c);
        L.t1 = ld(c + 8);
    } else if (fmt == TQKV_TQ3) {   // one 8-entry table, 3-bit index
        L.t0 = ld(c);
        L.t1 = L.t0;
    } else if (fmt == TQKV_TQ2) {   // 4-entry in-lane table (perm4) in both 128-bit halves
        L.t0 = _mm256_setr_ps(c[0], c[1], c[2], c[3], c[0], c[1], c[2], c[3]);
        L.t1 = L.t0;
    } else if (fmt == TQKV_TQ1) {   // c[0] and c[1] broadcast (a blend picks per lane)
        L.t0 = _mm256_set1_ps(c[0]);
        L.t1 = _mm256_set1_ps(c[1]);
    } else {
        L.t0 = L.t1 = _mm256_setzero_ps();
    }
    return L;
}

/* tq3 high bits: entry v, lane j = bit j of v moved to bit 2 (the index's top bit).
 * 256 x 8 lanes, read-only (8 KiB). */
#define HB_E(v) {((v) & 1) << 2, ((v) >> 1 & 1) << 2, ((v) >> 2 & 1) << 2, ((v) >> 3 & 1) << 2, \
                 ((v) >> 4 & 1) << 2, ((v) >> 5 & 1) << 2, ((v) >> 6 & 1) << 2, ((v) >> 7 & 1) << 2}
#define HB_E4(v) HB_E(v), HB_E((v) + 1), HB_E((v) + 2), HB_E((v) + 3)
#define HB_E16(v) HB_E4(v), HB_E4((v) + 4), HB_E4((v) + 8), HB_E4((v) + 12)
#define HB_E64(v) HB_E16(v), HB_E16((v) + 16), HB_E16((v) + 32), HB_E16((v) + 48)
static const int32_t TQ3_HIBITS[256][8] __attribute__((aligned(32))) = {
    HB_E64(0), HB_E64(64), HB_E64(128), HB_E64(192)};
#undef HB_E
#undef HB_E4
#undef HB_E16
#undef HB_E64

/* tq3 chunk k of a group, one lookup. Lane j of x = crumb byte j; after the shift, lane
 * bits 0..1 hold the crumb (bits above: later crumbs, cleared; for k = 3 none). Bit 2 comes
 * from TQ3_HIBITS[hk] (hk = byte k of the 1-bit plane): index = crumb | h << 2; the lookup
 * ignores higher bits. Four vector ops per 8 values (three for the first and last chunk). */
TQKV_AVX2 static AI __m256 lut8_tq3_tab(luts L, __m256i x, uint32_t hk, int k) {
    const __m256i xs = k ? _mm256_srli_epi32(x, 2 * k) : x;
    const __m256i xc = k < 3 ? _mm256_and_si256(xs, _mm256_set1_epi32(3)) : xs;
    const __m256i idx = _mm256_or_si256(
        xc, _mm256_load_si256((const __m256i *)(const void *)TQ3_HIBITS[hk & 255]));
    return perm(L.t0, idx);
}

/* 16-entry lookup: idx bits 0..2 pick within a half (two _mm256_permutevar8x32_ps
 * lookups), lane bit hbit of x (the nibble's bit 3) blends in the top half. */
TQKV_AVX2 static AI __m256 lut16(luts L, __m256i x, __m256i idx, int hbit) {
    return _mm256_blendv_ps(perm(L.t0, idx), perm(L.t1, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(x, 31 - hbit)));
}

/* fp8: 8 e4m3 bytes -> floats (value * 2^-8, exact via their fp16 halves, codec_fp8_half). */
TQKV_AVX2 static AI __m256 fp8x8(const uint8_t *p) {
    /* sign-extended to int16, << 7: bits 14 and 15 both hold the sign, 13..7 the rest */
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(const void *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xbf80)));
}
TQKV_AVX2 static AI __m256 fp8_scale(const uint16_t *sc) {
    return _mm256_set1_ps(_cvtsh_ss(sc[0]) * 256.0f);
}

/* tq1: the 8 values of one byte of the 1-bit plane (bit j = lane j): c[bit]. */
TQKV_AVX2 static AI __m256 tq1_chunk(luts L, uint8_t byte) {
    const __m256i bit = _mm256_and_si256(_mm256_set1_epi32(byte),
                                         _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128));
    const __m256i zero = _mm256_cmpeq_epi32(bit, _mm256_setzero_si256());
    return _mm256_blendv_ps(L.t1, L.t0, _mm256_castsi256_ps(zero));
}

TQKV_AVX2 static AI void dec_pair(int fmt, const uint8_t *pl, const uint16_t *sc, int dim, int g,
                             int h, luts L, __m256 *a, __m256 *b) {
    switch (fmt) {
    case TQKV_F32: {
        const float *f = (const float *)(const void *)pl + 32 * g + 16 * h;
        *a = ld(f);
        *b = ld(f + 8);
        break;
    }
    case TQKV_F16: {
        const uint16_t *x = (const uint16_t *)(const void *)pl + 32 * g + 16 * h;
        *a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)x));
        *b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(x + 8)));
        break;
    }
    case TQKV_Q8: {
        const __m256 s = h2f(sc[g]);
        const uint8_t *x = pl + 32 * g + 16 * h;
        *a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64((const __m128i *)(const void *)x))), s);
        *b = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64((const __m128i *)(const void *)(x + 8)))), s);
        break;
    }
    case TQKV_FP8: {
        const __m256 s = fp8_scale(sc);
        *a = _mm256_mul_ps(fp8x8(pl + 32 * g + 16 * h), s);
        *b = _mm256_mul_ps(fp8x8(pl + 32 * g + 16 * h + 8), s);
        break;
    }
    case TQKV_Q4: {
        const __m256 s = h2f(sc[g]);
        const __m256 ms = _mm256_mul_ps(s, _mm256_set1_ps(-8.0f));
        const __m256i x = ldzx8(pl + 16 * g + 8 * h);
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15))), s,
                             ms);
        *b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), s, ms);
        break;
    }
    case TQKV_TQ2: {
        const __m256i x = ldzx8(pl + 8 * g);
        if (h == 0) {
            *a = perm4(L.t0, x);
            *b = perm4(L.t0, _mm256_srli_epi32(x, 2));
        } else {
            *a = perm4(L.t0, _mm256_srli_epi32(x, 4));
            *b = perm4(L.t0, _mm256_srli_epi32(x, 6));
        }
        break;
    }
    case TQKV_TQ3: {
        const __m256i x = ldzx8(pl + 8 * g);
        const uint8_t *hp = pl + dim / 4 + 4 * g + 2 * h;   // 1-bit plane bytes 2h, 2h+1
        *a = lut8_tq3_tab(L, x, hp[0], 2 * h);
        *b = lut8_tq3_tab(L, x, hp[1], 2 * h + 1);
        break;
    }
    case TQKV_TQ4: {
        const __m256i x = ldzx8(pl + 16 * g + 8 * h);
        *a = lut16(L, x, x, 3);
        *b = lut16(L, x, _mm256_srli_epi32(x, 4), 7);
        break;
    }
    case TQKV_TQ1:   // chunks 4g+2h, 4g+2h+1 are bytes 4g+2h, 4g+2h+1 of the 1-bit plane
        *a = tq1_chunk(L, pl[4 * g + 2 * h]);
        *b = tq1_chunk(L, pl[4 * g + 2 * h + 1]);
        break;
    default:
        *a = *b = _mm256_setzero_ps();
        break;
    }
}

/* Prefetch token t of each stream in pf (see attn_pf): compact formats (a block's worth
 * is a few KiB) straight into L1, wide ones (f32/f16: tens of KiB) into L2. */
TQKV_AVX2 static AI void pf_token(const attn_pf *pf, int t) {
    if (!pf) return;
    for (int k = 0; k < ATTN_NPF; k++) {
        if (!pf[k].p) continue;
        const char *p = (const char *)pf[k].p + (size_t)t * pf[k].stride;
        if (pf[k].stride <= PF_L1_MAX_STRIDE) {
            for (size_t o = 0; o < pf[k].stride; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
        } else {
            for (size_t o = 0; o < pf[k].stride; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
        }
    }
}

/* Same prefetches as pf_token when every stream is NULL or at most one line per token
 * (ok != 0): one prefetcht0 per stream and token, no loops or tests in the token loop. */
typedef struct {
    const char *p[ATTN_NPF];
    size_t s[ATTN_NPF];
    int ok;
} pf_fast;
static const char PF_DUMMY[64] __attribute__((aligned(64)));
static AI pf_fast pf_fast_make(const attn_pf *pf) {
    pf_fast F;
    F.ok = 1;
    for (int k = 0; k < ATTN_NPF; k++) {
        F.p[k] = pf && pf[k].p ? (const char *)pf[k].p : PF_DUMMY;
        F.s[k] = pf && pf[k].p ? pf[k].stride : 0;
        if (F.s[k] > 64) F.ok = 0;
    }
    return F;
}
TQKV_AVX2 static AI void pf_fast_token(const pf_fast *F, const attn_pf *pf, int t) {
    if (F->ok) {
        for (int k = 0; k < ATTN_NPF; k++) _mm_prefetch(F->p[k] + (size_t)t * F->s[k], _MM_HINT_T0);
    } else {
        pf_token(pf, t);
    }
}

/* One chunk c (natural dims 8c .. 8c+7) of a token, same values as dec_pair. */
TQKV_AVX2 static AI __m256 dec_chunk(int fmt, const uint8_t *pl, const uint16_t *sc, int dim, int c,
                               luts L) {
    const int g = c >> 2, k = c & 3;
    switch (fmt) {
    case TQKV_F32:
        return ld((const float *)(const void *)pl + 8 * c);
    case TQKV_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128(
            (const __m128i *)(const void *)((const uint16_t *)(const void *)pl + 8 * c)));
    case TQKV_Q8:
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64((const __m128i *)(const void *)(pl + 8 * c)))),
                             h2f(sc[g]));
    case TQKV_FP8:
        return _mm256_mul_ps(fp8x8(pl + 8 * c), fp8_scale(sc));
    case TQKV_Q4: {
        const __m256 s = h2f(sc[g]);
        const __m256i x = ldzx8(pl + 16 * g + 8 * (k & 1));
        const __m256i v =
            k < 2 ? _mm256_and_si256(x, _mm256_set1_epi32(15)) : _mm256_srli_epi32(x, 4);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, _mm256_mul_ps(s, _mm256_set1_ps(-8.0f)));
    }
    case TQKV_TQ2: {
        const __m256i x = ldzx8(pl + 8 * g);
        return perm4(L.t0, k ? _mm256_srli_epi32(x, 2 * k) : x);
    }
    case TQKV_TQ3:
        return lut8_tq3_tab(L, ldzx8(pl + 8 * g), pl[dim / 4 + 4 * g + k], k);
    case TQKV_TQ4: {
        const __m256i x = ldzx8(pl + 16 * g + 8 * (k & 1));
        return k < 2 ? lut16(L, x, x, 3) : lut16(L, x, _mm256_srli_epi32(x, 4), 7);
    }
    case TQKV_TQ1:   // chunk c is byte c of the 1-bit plane
        return tq1_chunk(L, pl[c]);
    default:
        return _mm256_setzero_ps();
    }
}

static AI int is_tq(int fmt) {
    return fmt == TQKV_TQ1 || fmt == TQKV_TQ2 || fmt == TQKV_TQ3 || fmt == TQKV_TQ4;
}

// ---------------------------------------------------------------------------
// decode: n tokens -> floats [n, dim]
// ---------------------------------------------------------------------------
TQKV_AVX2 static AI void decode_gen(int fmt, const attn_src *s, int n, float *out,
                               const attn_pf *pf) {
    const int dim = s->dim, ng = dim / 32;
    const luts L = luts_make(fmt, s->cent);
    for (int t = 0; t < n; t++) {
        const uint8_t *pl = s->data + (size_t)t * s->dstride;
        const uint16_t *sc = s->scales ? s->scales + (size_t)t * s->sstride : NULL;
        float *o = out + (size_t)t * dim;
        pf_token(pf, t);
        const __m256 sv = is_tq(fmt) ? h2f(sc[0]) : _mm256_set1_ps(1.0f);
        for (int g = 0; g < ng; g++) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256 a, b;
                dec_pair(fmt, pl, sc, dim, g, h, L, &a, &b);
                if (is_tq(fmt)) {
                    a = _mm256_mul_ps(a, sv);
                    b = _mm256_mul_ps(b, sv);
                }
                _mm256_storeu_ps(o + 8 * cha(fmt, g, h), a);
                _mm256_storeu_ps(o + 8 * chb(fmt, g, h), b);
            }
        }
    }
}

/* Pointers to tokens t..t+TS-1 of one step (a tail past n repeats the last valid token, whose
 * scores are computed and dropped), prefetching each. */
TQKV_AVX2 static AI void step_tokens(const attn_src *s, int t, int n, int TS, const attn_pf *pf,
                                const uint8_t **pt, const uint16_t **st) {
    for (int tt = 0; tt < TS; tt++) {
        const int u = t + tt < n ? t + tt : n - 1;
        pt[tt] = s->data + (size_t)u * s->dstride;
        st[tt] = s->scales ? s->scales + (size_t)u * s->sstride : NULL;
        pf_token(pf, u);
    }
}

// ---------------------------------------------------------------------------
// score: HB heads x TS tokens per step (HB * TS <= 8 accumulators), the token's pairs
// decoded once and used for every head of the group.
// ---------------------------------------------------------------------------
TQKV_AVX2 static AI void score_pair_gen(int fmt, int HB, const attn_src *s, int n, const float *q,
                              float *sc, int ldsc, const attn_pf *pf) {
    const int dim = s->dim, ng = dim / 32;
    // TS tokens x HB heads x 2 chains (the pair's a and b halves) <= 8 accumulators
    const int TS = 8 / (2 * HB) > 0 ? 8 / (2 * HB) : 1;
    const luts L = luts_make(fmt, s->cent);
    for (int t = 0; t < n; t += TS) {
        const uint8_t *pt[8];   // [TS] payload of each token of the step
        const uint16_t *st[8];  // [TS] its scales (NULL for f32/f16)
        step_tokens(s, t, n, TS, pf, pt, st);
        __m256 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
        for (int g = 0; g < ng; g++) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int ca = 8 * cha(fmt, g, h), cb = 8 * chb(fmt, g, h);
                __m256 a[8], b[8];
#pragma GCC unroll 8
                for (int tt = 0; tt < TS; tt++) dec_pair(fmt, pt[tt], st[tt], dim, g, h, L, &a[tt], &b[tt]);
#pragma GCC unroll 4
                for (int hh = 0; hh < HB; hh++) {
                    const float *qh = q + (size_t)hh * dim;
                    __m256 qa = ld(qh + ca), qb = ld(qh + cb);
                    if (TS > 1) {
                        KEEP(qa);
                        KEEP(qb);
                    }
#pragma GCC unroll 8
                    for (int tt = 0; tt < TS; tt++) {
                        const int i = 2 * (tt * HB + hh);
                        acc[i] = _mm256_fmadd_ps(a[tt], qa, acc[i]);
                        acc[i + 1] = _mm256_fmadd_ps(b[tt], qb, acc[i + 1]);
                    }
                }
            }
        }
        const __m256 z = _mm256_setzero_ps();
        __m256 sm[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) sm[i] = i < TS * HB ? _mm256_add_ps(acc[2 * i], acc[2 * i + 1]) : z;
        float r[8];
        if (TS * HB <= 4)
            _mm_storeu_ps(r, hsum4(sm[0], sm[1], sm[2], sm[3]));
        else
            _mm256_storeu_ps(r, hsum8(sm[0], sm[1], sm[2], sm[3], sm[4], sm[5], sm[6], sm[7]));
        for (int tt = 0; tt < TS && t + tt < n; tt++)
            for (int hh = 0; hh < HB; hh++) sc[(size_t)hh * ldsc + t + tt] = r[tt * HB + hh];
    }
}

/* Chunk strategy: TS tokens x HB heads accumulators; each token chunk decoded once, each
 * q chunk loaded once per step (KEEP) and used by all TS tokens. */
TQKV_AVX2 static AI void score_chunk_gen(int fmt, int HB, const attn_src *s, int n, const float *q,
                                    float *sc, int ldsc, const attn_pf *pf) {
    const int dim = s->dim, nc = dim / 8;
    const int TS = HB == 1 ? 8 : HB == 2 ? 4 : HB <= 4 ? 2 : 1;
    const luts L = luts_make(fmt, s->cent);
    for (int t = 0; t < n; t += TS) {
        const uint8_t *pt[8];   // [TS] payload of each token of the step
        const uint16_t *st[8];  // [TS] its scales (NULL for f32/f16)
        step_tokens(s, t, n, TS, pf, pt, st);
        __m256 acc[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int c = 0; c < nc; c += 4) {
#pragma GCC unroll 4
            for (int cc = 0; cc < 4; cc++) {
                __m256 kv[8];
#pragma GCC unroll 8
                for (int tt = 0; tt < TS; tt++) kv[tt] = dec_chunk(fmt, pt[tt], st[tt], dim, c + cc, L);
#pragma GCC unroll 8
                for (int hh = 0; hh < HB; hh++) {
                    __m256 qc = ld(q + (size_t)hh * dim + 8 * (c + cc));
                    if (TS > 1) KEEP(qc);
#pragma GCC unroll 8
                    for (int tt = 0; tt < TS; tt++)
                        acc[tt * HB + hh] = _mm256_fmadd_ps(kv[tt], qc, acc[tt * HB + hh]);
                }
            }
        }
        float r[8];
        _mm256_storeu_ps(r, hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6],
                                  acc[7]));
        for (int tt = 0; tt < TS && t + tt < n; tt++)
            for (int hh = 0; hh < HB; hh++) sc[(size_t)hh * ldsc + t + tt] = r[tt * HB + hh];
    }
}

/* Strategy per format (measured on Zen 4: see docs in attn.c). */
TQKV_AVX2 static AI void score_gen(int fmt, int HB, const attn_src *s, int n, const float *q,
                              float *sc, int ldsc, const attn_pf *pf) {
    if (SCORE_PAIR(fmt)) score_pair_gen(fmt, HB, s, n, q, sc, ldsc, pf);
    else score_chunk_gen(fmt, HB, s, n, q, sc, ldsc, pf);
}

// ---------------------------------------------------------------------------
// accum: HB heads x CP pairs of accumulators held in registers while the block's tokens
// stream through in order; each token's pair is decoded once for all HB heads.
// ---------------------------------------------------------------------------
TQKV_AVX2 static AI void accum_step(int fmt, int HB, int CP, const attn_src *s, int n,
                               const float *w, int ldw, float *acc, int g0, int hs, luts L,
                               const attn_pf *pf) {
    const int dim = s->dim;
    __m256 A[8], B[8];   // [cp * HB + hh]
#pragma GCC unroll 4
    for (int cp = 0; cp < CP; cp++) {
        const int g = g0 + (CP == 1 ? 0 : cp >> 1), h = CP == 1 ? hs : (cp & 1);
#pragma GCC unroll 4
        for (int hh = 0; hh < HB; hh++) {
            A[cp * HB + hh] = ld(acc + (size_t)hh * dim + 8 * cha(fmt, g, h));
            B[cp * HB + hh] = ld(acc + (size_t)hh * dim + 8 * chb(fmt, g, h));
        }
    }
    const uint8_t *pl = s->data;   // token t's payload (bumped: no multiply per token)
    for (int t = 0; t < n; t++, pl += s->dstride) {
        const uint16_t *sc = s->scales ? s->scales + (size_t)t * s->sstride : NULL;
        pf_token(pf, t);
#pragma GCC unroll 4
        for (int cp = 0; cp < CP; cp++) {
            const int g = g0 + (CP == 1 ? 0 : cp >> 1), h = CP == 1 ? hs : (cp & 1);
            __m256 a, b;
            dec_pair(fmt, pl, sc, dim, g, h, L, &a, &b);
#pragma GCC unroll 4
            for (int hh = 0; hh < HB; hh++) {
                const __m256 wt = bc(w + (size_t)hh * ldw + t);
                A[cp * HB + hh] = _mm256_fmadd_ps(wt, a, A[cp * HB + hh]);
                B[cp * HB + hh] = _mm256_fmadd_ps(wt, b, B[cp * HB + hh]);
            }
        }
    }
#pragma GCC unroll 4
    for (int cp = 0; cp < CP; cp++) {
        const int g = g0 + (CP == 1 ? 0 : cp >> 1), h = CP == 1 ? hs : (cp & 1);
#pragma GCC unroll 4
        for (int hh = 0; hh < HB; hh++) {
            _mm256_storeu_ps(acc + (size_t)hh * dim + 8 * cha(fmt, g, h), A[cp * HB + hh]);
            _mm256_storeu_ps(acc + (size_t)hh * dim + 8 * chb(fmt, g, h), B[cp * HB + hh]);
        }
    }
}

TQKV_AVX2 static AI void accum_gen(int fmt, int HB, int CP, const attn_src *s, int n,
                              const float *w, int ldw, float *acc, const attn_pf *pf) {
    const int ng = s->dim / 32;
    const int GS = CP >= 2 ? CP / 2 : 1;   // groups per step
    const luts L = luts_make(fmt, s->cent);
    for (int g0 = 0; g0 < ng; g0 += GS) {
        // the prefetch stream is spread over the first pass only
        const attn_pf *p1 = g0 == 0 ? pf : NULL;
        if (CP == 1) {
            accum_step(fmt, HB, CP, s, n, w, ldw, acc, g0, 0, L, p1);
            accum_step(fmt, HB, CP, s, n, w, ldw, acc, g0, 1, L, NULL);
        } else {
            accum_step(fmt, HB, CP, s, n, w, ldw, acc, g0, 0, L, p1);
        }
    }
}

// ---------------------------------------------------------------------------
// Instantiation: one function per format; heads are processed in passes of <= 4
// ---------------------------------------------------------------------------
#define ATTN_FMT_FUNCS(NAME, FMT)                                                            \
    TQKV_AVX2 static void dec_##NAME(const attn_src *s, int n, float *out, const attn_pf *pf) {   \
        decode_gen(FMT, s, n, out, pf);                                                      \
    }                                                                                        \
    TQKV_AVX2 static void score_##NAME(const attn_src *s, int n, const float *q, int nh,          \
                                  float *sc, int ldsc, const attn_pf *pf) {                  \
        for (int h0 = 0; h0 < nh;) {                                                         \
            const int left = nh - h0;                                                        \
            const int hb = left >= 4 ? 4 : left;                                             \
            const float *qh = q + (size_t)h0 * s->dim;                                       \
            float *sh = sc + (size_t)h0 * ldsc;                                              \
            const attn_pf *p1 = h0 == 0 ? pf : NULL;                                         \
            if (hb == 4) score_gen(FMT, 4, s, n, qh, sh, ldsc, p1);                          \
            else if (hb == 3) score_gen(FMT, 3, s, n, qh, sh, ldsc, p1);                     \
            else if (hb == 2) score_gen(FMT, 2, s, n, qh, sh, ldsc, p1);                     \
            else score_gen(FMT, 1, s, n, qh, sh, ldsc, p1);                                  \
            h0 += hb;                                                                        \
        }                                                                                    \
    }                                                                                        \
    TQKV_AVX2 static void accum_##NAME(const attn_src *s, int n, const float *w, int ldw, int nh,  \
                                  float *acc, const attn_pf *pf) {                           \
        for (int h0 = 0; h0 < nh;) {                                                         \
            const int left = nh - h0;                                                        \
            const int hb = left >= 4 ? 4 : left;                                             \
            const float *wh = w + (size_t)h0 * ldw;                                          \
            float *ah = acc + (size_t)h0 * s->dim;                                           \
            const attn_pf *p1 = h0 == 0 ? pf : NULL;                                         \
            if (hb == 4) accum_gen(FMT, 4, 1, s, n, wh, ldw, ah, p1);                        \
            else if (hb == 3) accum_gen(FMT, 3, 1, s, n, wh, ldw, ah, p1);                   \
            else if (hb == 2) accum_gen(FMT, 2, 2, s, n, wh, ldw, ah, p1);                   \
            else if (s->dim >= 64) accum_gen(FMT, 1, 4, s, n, wh, ldw, ah, p1);              \
            else accum_gen(FMT, 1, 2, s, n, wh, ldw, ah, p1);                                \
            h0 += hb;                                                                        \
        }                                                                                    \
    }

ATTN_FMT_FUNCS(f32, TQKV_F32)
ATTN_FMT_FUNCS(f16, TQKV_F16)
ATTN_FMT_FUNCS(q8, TQKV_Q8)
ATTN_FMT_FUNCS(q4, TQKV_Q4)
ATTN_FMT_FUNCS(tq2, TQKV_TQ2)
ATTN_FMT_FUNCS(tq3, TQKV_TQ3)
ATTN_FMT_FUNCS(tq4, TQKV_TQ4)
ATTN_FMT_FUNCS(fp8, TQKV_FP8)
ATTN_FMT_FUNCS(tq1, TQKV_TQ1)

// ---------------------------------------------------------------------------
// tq4 scores in byte planes: the 16 centroids' 4 bytes as four 16-entry vpshufb tables;
// 32 nibble indices -> 4 lookups + 8 unpacks -> 32 floats in "plane order" (fewer vector
// ops than 2 x vpermps + blend per 8 values). Used for K only, against a query permuted
// into plane order once per item (prep); V keeps natural order.
// Plane order, per 64 dims (two groups g0 = 2 * hf, g0 + 1): vector v = 8 hf + 4 s + m
// (s: low / high nibbles, m = 0..3) holds dims 32 g0 + 16 s + 4 m + (0..3) in lanes 0..3
// and 32 (g0 + 1) + 16 s + 4 m + (0..3) in lanes 4..7.
// ---------------------------------------------------------------------------
typedef struct {
    __m256i b0, b1, b2, b3;
} bplanes;

TQKV_AVX2 static AI bplanes bplanes_make(const float *c) {
    uint8_t t[4][32];
    for (int k = 0; k < 16; k++) {
        uint32_t u;
        memcpy(&u, c + k, 4);
        for (int j = 0; j < 4; j++) t[j][k] = t[j][k + 16] = (uint8_t)(u >> (8 * j));
    }
    bplanes P;
    P.b0 = _mm256_loadu_si256((const __m256i *)(const void *)t[0]);
    P.b1 = _mm256_loadu_si256((const __m256i *)(const void *)t[1]);
    P.b2 = _mm256_loadu_si256((const __m256i *)(const void *)t[2]);
    P.b3 = _mm256_loadu_si256((const __m256i *)(const void *)t[3]);
    return P;
}

/* tq3: the 8-entry codebook, repeated for index bit 3 (never set). */
TQKV_AVX2 static AI bplanes bplanes_make8(const float *c) {
    float c16[16];
    memcpy(c16, c, 8 * sizeof(float));
    memcpy(c16 + 8, c, 8 * sizeof(float));
    return bplanes_make(c16);
}

/* 32 nibble indices (bytes) -> f[0..3] (plane order, see above). */
TQKV_AVX2 static AI void bp_decode(bplanes P, __m256i idx, __m256 *f) {
    const __m256i y0 = _mm256_shuffle_epi8(P.b0, idx), y1 = _mm256_shuffle_epi8(P.b1, idx);
    const __m256i y2 = _mm256_shuffle_epi8(P.b2, idx), y3 = _mm256_shuffle_epi8(P.b3, idx);
    const __m256i u0 = _mm256_unpacklo_epi8(y0, y1), u1 = _mm256_unpackhi_epi8(y0, y1);
    const __m256i v0 = _mm256_unpacklo_epi8(y2, y3), v1 = _mm256_unpackhi_epi8(y2, y3);
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(u0, v0));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(u0, v0));
    f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(u1, v1));
    f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(u1, v1));
}

/* q [nh, dim] natural -> out [nh, dim] plane order (dim a multiple of 64). */
TQKV_AVX2 static void prep_q_tq4(const float *q, int nh, int dim, float *out) {
    for (int h = 0; h < nh; h++) {
        const float *qh = q + (size_t)h * dim;
        float *o = out + (size_t)h * dim;
        for (int hf = 0; hf < dim / 64; hf++)
            for (int s = 0; s < 2; s++)
                for (int m = 0; m < 4; m++) {
                    const int v = 8 * hf + 4 * s + m, d0 = 64 * hf + 16 * s + 4 * m;
                    memcpy(o + 8 * v, qh + d0, 4 * sizeof(float));
                    memcpy(o + 8 * v + 4, qh + d0 + 32, 4 * sizeof(float));
                }
    }
}

/* tq4 scores of HB <= 4 heads in byte planes (q in plane order), one token per step,
 * 2 chains per head (even / odd vectors). */
TQKV_AVX2 static AI void score_bp_gen(int HB, int DIM, const attn_src *s, int n, const float *q,
                                 float *sc, int ldsc, const attn_pf *pf) {
    const int dim = DIM ? DIM : s->dim;   // DIM: compile-time head dim (0: run time)
    const pf_fast F = pf_fast_make(pf);
    const bplanes P = bplanes_make(s->cent);
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int t = 0; t < n; t++) {
        const uint8_t *pl = s->data + (size_t)t * s->dstride;
        pf_fast_token(&F, pf, t);
        __m256 acc[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int hf = 0; hf < dim / 64; hf++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(pl + 32 * hf));
#pragma GCC unroll 2
            for (int sn = 0; sn < 2; sn++) {
                const __m256i idx = sn ? _mm256_and_si256(_mm256_srli_epi16(x, 4), m4)
                                       : _mm256_and_si256(x, m4);
                __m256 f[4];
                bp_decode(P, idx, f);
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) {
                    const int v = 8 * hf + 4 * sn + m;
#pragma GCC unroll 4
                    for (int hh = 0; hh < HB; hh++) {
                        const int i = 2 * hh + (m & 1);
                        acc[i] = _mm256_fmadd_ps(f[m], ld(q + (size_t)hh * dim + 8 * v), acc[i]);
                    }
                }
            }
        }
        __m256 sm[4];
#pragma GCC unroll 4
        for (int hh = 0; hh < 4; hh++)
            sm[hh] = hh < HB ? _mm256_add_ps(acc[2 * hh], acc[2 * hh + 1]) : _mm256_setzero_ps();
        float r[4];
        _mm_storeu_ps(r, hsum4(sm[0], sm[1], sm[2], sm[3]));
        for (int hh = 0; hh < HB; hh++) sc[(size_t)hh * ldsc + t] = r[hh];
    }
}

#define ATTN_BP_SCORE(NAME, GEN)                                                             \
    TQKV_AVX2 static void NAME(const attn_src *s, int n, const float *q, int nh, float *sc,        \
                          int ldsc, const attn_pf *pf) {                                      \
        for (int h0 = 0; h0 < nh;) {                                                          \
            const int hb = nh - h0 >= 4 ? 4 : nh - h0;                                        \
            const float *qh = q + (size_t)h0 * s->dim;                                        \
            float *sh = sc + (size_t)h0 * ldsc;                                               \
            const attn_pf *p1 = h0 == 0 ? pf : NULL;                                          \
            if (hb == 4 && s->dim == 128) GEN(4, 128, s, n, qh, sh, ldsc, p1);                \
            else if (hb == 4) GEN(4, 0, s, n, qh, sh, ldsc, p1);                              \
            else if (hb == 3) GEN(3, 0, s, n, qh, sh, ldsc, p1);                              \
            else if (hb == 2) GEN(2, 0, s, n, qh, sh, ldsc, p1);                              \
            else GEN(1, 0, s, n, qh, sh, ldsc, p1);                                           \
            h0 += hb;                                                                         \
        }                                                                                     \
    }
ATTN_BP_SCORE(score_tq4_bp, score_bp_gen)

// ---------------------------------------------------------------------------
// tq3 scores in byte planes: per group the 32 3-bit indices are assembled as bytes
// (low2 | hi << 2) with vector ops only, then looked up like tq4 (bp_decode on the
// 8-entry codebook). Bytes come out in natural order, so bp_decode yields, for group g,
// vector 4g + m = dims 32g + 4m + (0..3) in lanes 0..3, 32g + 16 + 4m + (0..3) in 4..7.
// ---------------------------------------------------------------------------
/* q [nh, dim] natural -> out [nh, dim] tq3 plane order (dim a multiple of 32). */
TQKV_AVX2 static void prep_q_tq3(const float *q, int nh, int dim, float *out) {
    for (int h = 0; h < nh; h++) {
        const float *qh = q + (size_t)h * dim;
        float *o = out + (size_t)h * dim;
        for (int g = 0; g < dim / 32; g++)
            for (int m = 0; m < 4; m++) {
                memcpy(o + 32 * g + 8 * m, qh + 32 * g + 4 * m, 4 * sizeof(float));
                memcpy(o + 32 * g + 8 * m + 4, qh + 32 * g + 16 + 4 * m, 4 * sizeof(float));
            }
    }
}

/* Indices of group g as 32 bytes (natural order): crumbs from the 2-bit plane (qword k
 * shifted by 2k), the top bit from the 1-bit plane (byte i/8 replicated, bit i%8 tested). */
TQKV_AVX2 static AI __m256i tq3_idx(const uint8_t *pl, int dim, int g, __m256i sh, __m256i rep,
                              __m256i bit, __m256i m3, __m256i m4) {
    int64_t lo;
    int32_t hi;
    memcpy(&lo, pl + 8 * g, 8);
    memcpy(&hi, pl + dim / 4 + 4 * g, 4);
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(lo), sh), m3);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(hi), rep), bit);
    return _mm256_or_si256(c, _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), m4));
}

TQKV_AVX2 static AI void score_bp3_gen(int HB, int DIM, const attn_src *s, int n, const float *q,
                                  float *sc, int ldsc, const attn_pf *pf) {
    const int dim = DIM ? DIM : s->dim;   // DIM: compile-time head dim (0: run time)
    const pf_fast F = pf_fast_make(pf);
    const bplanes P = bplanes_make8(s->cent);
    const __m256i sh = _mm256_setr_epi64x(0, 2, 4, 6);
    const __m256i rep = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    for (int t = 0; t < n; t++) {
        const uint8_t *pl = s->data + (size_t)t * s->dstride;
        pf_fast_token(&F, pf, t);
        __m256 acc[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int g = 0; g < dim / 32; g++) {
            __m256 f[4];
            bp_decode(P, tq3_idx(pl, dim, g, sh, rep, bit, m3, m4), f);
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) {
#pragma GCC unroll 4
                for (int hh = 0; hh < HB; hh++) {
                    const int i = 2 * hh + (m & 1);
                    acc[i] = _mm256_fmadd_ps(f[m], ld(q + (size_t)hh * dim + 32 * g + 8 * m),
                                             acc[i]);
                }
            }
        }
        __m256 sm[4];
#pragma GCC unroll 4
        for (int hh = 0; hh < 4; hh++)
            sm[hh] = hh < HB ? _mm256_add_ps(acc[2 * hh], acc[2 * hh + 1]) : _mm256_setzero_ps();
        float r[4];
        _mm_storeu_ps(r, hsum4(sm[0], sm[1], sm[2], sm[3]));
        for (int hh = 0; hh < HB; hh++) sc[(size_t)hh * ldsc + t] = r[hh];
    }
}
ATTN_BP_SCORE(score_tq3_bp, score_bp3_gen)

// ---------------------------------------------------------------------------
// Table
// ---------------------------------------------------------------------------
/* Every member but the name and the prefill tiles: the AVX2 table and its AVX-512 twin
 * share them (one list, so a format added to one is in both). */
#define AVX2_ISA_COMMON                                                                        \
    .decode = {dec_f32, dec_f16, dec_q8, dec_q4, dec_tq2, dec_tq3, dec_tq4, dec_fp8, dec_tq1}, \
    .score = {score_f32, score_f16, score_q8, score_q4, score_tq2, score_tq3, score_tq4,        \
              score_fp8, score_tq1},                                                            \
    .accum = {accum_f32, accum_f16, accum_q8, accum_q4, accum_tq2, accum_tq3, accum_tq4,       \
              accum_fp8, accum_tq1},                                                            \
    .prep_q = {[TQKV_TQ3] = prep_q_tq3, [TQKV_TQ4] = prep_q_tq4},                              \
    .score_prep = {[TQKV_TQ3] = score_tq3_bp, [TQKV_TQ4] = score_tq4_bp},                      \
    .token_scales = attn_avx2_token_scales, .rotate = attn_avx2_rotate,                        \
    .unrotate = attn_avx2_unrotate, .softmax_block = attn_avx2_softmax_block,                  \
    .tile_softmax = attn_avx2_tile_softmax

static const attn_isa AVX2_ISA = {
    .name = "avx2",
    AVX2_ISA_COMMON,
    .tile_qk = attn_avx2_tile_qk,
    .tile_pv = attn_avx2_tile_pv,
};

const attn_isa *attn_isa_avx2(void) { return &AVX2_ISA; }

/* The same with the prefill tiles on AVX-512 (same bits per lane). */
static const attn_isa AVX512_ISA = {
    .name = "avx512",
    AVX2_ISA_COMMON,
    .tile_qk = attn_avx512_tile_qk,
    .tile_pv = attn_avx512_tile_pv,
};

const attn_isa *attn_isa_avx512(void) { return &AVX512_ISA; }

#else

const attn_isa *attn_isa_avx2(void) { return NULL; }
const attn_isa *attn_isa_avx512(void) { return NULL; }

#endif
