/*
 * attn_internal.h - private interface between the attention drivers (attn.c) and the
 * per-ISA primitives (attn_scalar.c, attn_avx2.c).
 * Owns: the token-run descriptor, the primitive tables, the tiling constants that fix
 * every reduction order (batch invariance depends on them).
 * Must not: be included outside src/attn and its tests; know about masks or rows.
 *
 * Vocabulary
 *   source run  a contiguous range of tokens of one (row, kv head) stored in one format
 *               at a fixed stride: the main plane, or one wrap-free stretch of the q8 ring.
 *   u_t         token t's vector as the primitives see it: for tq runs the codebook values
 *               c[idx] WITHOUT the per-token fp16 scale (the caller folds it in), for every
 *               other run the fully decoded value (q8/q4 block scales applied).
 *   block       a step of the decode engine (<= ATTN_BT tokens, never crossing a multiple
 *               of ATTN_BT nor a run boundary): one online-softmax update.
 *   tile        the same for the prefill engine with ATTN_KT.
 */
#ifndef TQKV_ATTN_INTERNAL_H
#define TQKV_ATTN_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

// ---------------------------------------------------------------------------
// Constants (changing any of them changes results bit-wise; they must not depend on
// the batch, the thread count or a row's padding)
// ---------------------------------------------------------------------------
#define ATTN_BT   32    /* decode engine, dense / deferred: tokens per online-softmax block */
#ifndef ATTN_BT_FUSED
#define ATTN_BT_FUSED 128 /* decode engine, fused: no tile to keep in L1, so a longer block */
#endif
#define ATTN_BT_MAX (ATTN_BT > ATTN_BT_FUSED ? ATTN_BT : ATTN_BT_FUSED)
#define ATTN_SEG  2048  /* decode engine: KV split of long rows (multiple of both blocks) */
#define ATTN_KT   64    /* prefill engine: tokens per tile */
#define ATTN_QV   128   /* prefill engine: query vectors per item (heads x queries) */
#define ATTN_LANES 16   /* prefill engine: lane strips are multiples of this */

// ---------------------------------------------------------------------------
// Source run
// ---------------------------------------------------------------------------
typedef struct {
    tqkv_format     fmt;      /* TQKV_F32 for decoded float tiles; TQKV_Q8 for the ring */
    int             dim;
    const uint8_t  *data;     /* payload of the run's first token */
    const uint16_t *scales;   /* scales of the run's first token (NULL: f32 / f16) */
    size_t          dstride;  /* payload bytes per token */
    size_t          sstride;  /* fp16 scales per token */
    const float    *cent;     /* tq: centroids [16] */
} attn_src;

/* Software prefetch of other token streams while a primitive walks its own n tokens:
 * for token t it touches bytes [p + t * stride, p + t * stride + stride) of each entry
 * with p != NULL (the V run of the block, the K run of the next block). The cache's
 * 4 KiB pages defeat the hardware stream prefetcher; this hides DRAM latency. */
typedef struct {
    const uint8_t *p;
    size_t stride;
} attn_pf;
#define ATTN_NPF 2

/* decode: out [n, dim] = fully decoded tokens (tq: scale * c[idx], stored domain). */
typedef void (*attn_decode_fn)(const attn_src *s, int n, float *out, const attn_pf *pf);
/* score: sc[h * ldsc + t] = sum_i q[h * dim + i] * u_t[i]   for h < nh, t < n. */
typedef void (*attn_score_fn)(const attn_src *s, int n, const float *q, int nh, float *sc,
                              int ldsc, const attn_pf *pf);
/* accum: acc[h * dim + i] += sum_t w[h * ldw + t] * u_t[i], tokens in order. */
typedef void (*attn_accum_fn)(const attn_src *s, int n, const float *w, int ldw, int nh,
                              float *acc, const attn_pf *pf);

typedef struct {
    const char    *name;
    attn_decode_fn decode[TQKV_FORMAT_COUNT];
    attn_score_fn  score[TQKV_FORMAT_COUNT];
    attn_accum_fn  accum[TQKV_FORMAT_COUNT];
    /* One online-softmax block for nh heads: sc [nh, ldsc] raw scores (entries n..ldsc
     * rounded up to 8 are scratch); ks [n] per-token score factors, vs [n] per-token value
     * factors (NULL = 1). Updates m, l [nh], rescales acc [nh, dim], writes the value
     * weights w [nh, ldw] = p * vs. */
    /* Optional per-format score on a prepared query layout (NULL: none): prep_q writes
     * q [nh, dim] into that layout once per item, score_prep then scores like score. */
    void (*prep_q[TQKV_FORMAT_COUNT])(const float *q, int nh, int dim, float *out);
    attn_score_fn score_prep[TQKV_FORMAT_COUNT];
    /* out[j] = mul * fp16 sc[j] for j < n (consecutive per-token tq scales). */
    void (*token_scales)(const uint16_t *sc, int n, float mul, float *out);
    /* Randomized Hadamard rotation of one vector in place, as codec_rotate /
     * codec_unrotate (same butterflies, same order): signs [dim] +-1. */
    void (*rotate)(const float *signs, int dim, float *x);
    void (*unrotate)(const float *signs, int dim, float *x);
    void (*softmax_block)(float *sc, int ldsc, int n, int nh, const float *ks,
                          const float *vs, float *m, float *l, float *acc, int dim, float *w,
                          int ldw);
    /* Prefill tile primitives on lanes [l0, l1) (multiples of ATTN_LANES) of mp:
     *   qk:      st [n, mp]  = k [n, ldk] . qt [dim, mp]
     *   softmax: masks st by lo <= tok0 + j < hi, updates m, l [mp], rescales
     *            ot [dim, mp], turns st into probabilities
     *   pv:      ot [dim, mp] += v [n, ldv]^T . st [n, mp] */
    void (*tile_qk)(const float *k, size_t ldk, int n, int dim, const float *qt, int mp, int l0,
                    int l1, float *st);
    void (*tile_softmax)(float *st, int n, int tok0, int mp, int l0, int l1, const int32_t *lo,
                         const int32_t *hi, float *m, float *l, float *ot, int dim);
    void (*tile_pv)(const float *v, size_t ldv, int n, int dim, const float *pt, int mp, int l0,
                    int l1, float *ot);
} attn_isa;

const attn_isa *attn_isa_scalar(void);
/* NULL when the build has no AVX2 code (non-x86). Does not check the CPU. */
const attn_isa *attn_isa_avx2(void);
/* The AVX2 table with the prefill tiles' AVX-512 twins (attn_avx512_block.c: the same bits);
 * NULL on non-x86 builds. Does not check the CPU (tqkv_cpu_has_avx512()). */
const attn_isa *attn_isa_avx512(void);
void attn_avx512_tile_qk(const float *k, size_t ldk, int n, int dim, const float *qt, int mp,
                         int l0, int l1, float *st);
void attn_avx512_tile_pv(const float *v, size_t ldv, int n, int dim, const float *pt, int mp,
                         int l0, int l1, float *ot);

/* Lossless scalar decode of one token (u_t semantics when scaled == 0; the full value
 * when scaled != 0). Shared by the scalar primitives and the tests. */
void attn_decode_token(const attn_src *s, const uint8_t *pl, const uint16_t *sc, int scaled,
                       float *out);

#endif
