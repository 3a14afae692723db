/*
 * attn.c - attention over the rows of a batched cache: attn_batch() and the kernel names.
 * Owns: turning (cache rows, mask, queries) into independent work items, the decode
 * engine (n_query == 1) and the prefill engine (n_query > 1) drivers, the per-thread
 * scratch, the combine of KV-split partials, query rotation / output un-rotation.
 * Must not: mutate the cache, validate public arguments beyond what keeps it memory-safe
 * (the cache wrappers do that), or let a row's result depend on anything but that row.
 *
 * Visibility: with a mask, query i of row r sees columns [lo, hi) (token t is column
 * left_pad + t; lo == hi: zeros). Without one, query i sees tokens [0, offset - nq + i + 1)
 * (nq == 1: the whole row). A windowed (tq) plane's q8 copies (ring, or the side buffer of
 * the last append) are read in the plane's rotated domain: decode (n_query == 1) reads
 * tokens t >= plane_window_start() from them; the prefill engine gives each query i its
 * own window, tokens t >= max(p_i + 1 - window, batch_q8_lo) with p_i = offset - nq + i,
 * which is what a decode step at p_i reads (see batch.h).
 *
 * Kernel sets (tq = tq2/tq3/tq4 plane; the q8 window of a tq plane is rotated q8):
 *   dense     decode every block / tile of K and V to floats in the original domain
 *             (tq and window tokens: decode in the rotated domain, then un-rotate each
 *             token), then softmax attention on the floats. f32 planes are read in place.
 *   deferred  rotate q once (K codec) when K is tq; decode tq / window tokens in the
 *             rotated domain only; accumulate V rotated when V is tq and un-rotate each
 *             output once (V codec). Non-tq planes as dense.
 *   fused     n_query == 1: like deferred, but no K/V block is ever materialised: the
 *             primitives decode each token chunk in registers (codebook lookup; the fp16
 *             scale folded once per token into the score / value weight) and use it for
 *             every q head of the GQA group. f16/q8/q4 and the q8 ring decode in registers
 *             too. tq4 and tq3 K scores use a vpshufb byte-plane lookup against a query permuted
 *             once per item (isa->prep_q / score_prep). n_query > 1: same as deferred (the prefill engine decodes a tile once and
 *             reuses it for up to ATTN_QV query vectors, which beats in-register decode).
 *
 * Engines
 *   decode  (n_query == 1): items (row, kv head, KV segment of ATTN_SEG tokens on the
 *           row's own token grid). Each item runs blocks (ATTN_BT tokens, ATTN_BT_FUSED
 *           for fused) in order: scores for all G heads of the group, online softmax,
 *           weighted V sum; while scoring it prefetches this block's V and the next
 *           block's K (the cache's 4 KiB pages defeat the hardware prefetcher). Segment
 *           partials (m, l, acc) are merged in segment order.
 *   prefill (n_query > 1): items (row, kv head, block of ATTN_QV / G queries), the same for
 *           all three sets. Query vectors are lanes: qt [dim, lanes], st [tile, lanes],
 *           ot [dim, lanes]; tiles of <= ATTN_KT tokens on the row's token grid are decoded
 *           once per item, then QK^T, masked online softmax and PV run as register-blocked
 *           outer products (no horizontal sums). Lane strips that see none of a tile are
 *           skipped; a tile a lane cannot see leaves it bit-for-bit unchanged, so a query's
 *           output depends only on its own range.
 * Batch invariance: every split point (segments, blocks, tiles, window / ring runs) is a
 * function of the row's token indices and its config, never of left padding, batch
 * size or thread count; each item is computed by one thread in a fixed order.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "attn/attn_internal.h"
#include "cache/batch.h"
#include "codec/codec.h"
#include "util/common.h"
#include "util/pool.h"

/* Prefetch distances in blocks (measured: further ahead does not help). */
#define ATTN_PF_V 0
#define ATTN_PF_K 1

// ---------------------------------------------------------------------------
// Kernel names
// ---------------------------------------------------------------------------
static const char *const KERNEL_NAMES[TQKV_KERNEL_COUNT] = {"dense", "deferred", "fused"};

tqkv_status tqkv_kernel_parse(const char *name, tqkv_kernel *out) {
    if (!name || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_kernel_parse: NULL argument");
    for (int k = 0; k < TQKV_KERNEL_COUNT; k++) {
        if (!strcmp(name, KERNEL_NAMES[k])) {
            *out = (tqkv_kernel)k;
            return TQKV_OK;
        }
    }
    return tqkv_fail(TQKV_EINVAL, "unknown kernel set '%s' (expected dense, deferred or fused)",
                     name);
}

const char *tqkv_kernel_name(tqkv_kernel k) {
    if ((int)k < 0 || k >= TQKV_KERNEL_COUNT) return "unknown";
    return KERNEL_NAMES[k];
}

// ---------------------------------------------------------------------------
// Context
// ---------------------------------------------------------------------------
typedef struct {
    const struct tqkv_batch *b;
    const attn_isa *isa;
    tqkv_kernel kernel;
    int rows, kvh, qh, G, d, nq;
    float scale;
    int krot;              /* queries live in K's rotated domain */
    int vrot;              /* outputs accumulate in V's rotated domain */
    const float *qd;       /* [rows, q_heads, nq, d] queries (rotated when krot) */
    const int32_t *qlo;    /* [rows, nq] first visible token */
    const int32_t *qhi;    /* [rows, nq] end of visible tokens (== qlo: none) */
} attn_ctx;

typedef struct {
    int r, h;              /* row, kv head */
    int a, z;              /* decode: token range; prefill: query range */
} attn_item;

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

/* Run of plane pl (row r, kv head h) that holds token t; returns the run's end. *rot is
 * 1 when the run's values live in the plane's rotated domain. */
static int run_at(const attn_ctx *c, const tqkv_plane *pl, int r, int h, int t, attn_src *s,
                  int *rot) {
    const struct tqkv_batch *b = c->b;
    const int wstart = plane_window_start(pl, b, r);
    s->dim = c->d;
    s->cent = pl->codec.centroids;
    if (t < wstart) {
        s->fmt = pl->codec.format;
        s->data = plane_data(pl, b, r, h, b->left_pad[r] + t);
        s->scales = pl->codec.n_scales ? plane_scales(pl, b, r, h, b->left_pad[r] + t) : NULL;
        s->dstride = pl->codec.payload;
        s->sstride = (size_t)pl->codec.n_scales;
        *rot = pl->codec.rotated;
        return wstart;
    }
    s->fmt = TQKV_Q8;
    s->data = (const uint8_t *)plane_win_data(pl, b, r, h, t);
    s->scales = plane_win_scales(pl, b, r, h, t);
    s->dstride = (size_t)c->d;
    s->sstride = (size_t)(c->d / 32);
    *rot = 1;
    return imin(b->offset[r], t - t % b->ring + b->ring);
}

/* For the dense / deferred sets: decode a run of n tokens into tile [n, d] (original
 * domain for dense) and point s at it. f32 runs are used in place. */
static void materialise(const attn_ctx *c, const tqkv_plane *pl, attn_src *s, int rot, int n,
                        float *tile, const attn_pf *pf) {
    if (s->fmt == TQKV_F32) return;
    c->isa->decode[s->fmt](s, n, tile, pf);
    if (c->kernel == TQKV_KERNEL_DENSE && rot)
        for (int j = 0; j < n; j++) c->isa->unrotate(pl->codec.signs, c->d, tile + (size_t)j * c->d);
    s->fmt = TQKV_F32;
    s->data = (const uint8_t *)tile;
    s->scales = NULL;
    s->dstride = (size_t)c->d * sizeof(float);
    s->sstride = 0;
}

// ---------------------------------------------------------------------------
// Decode engine (n_query == 1)
// ---------------------------------------------------------------------------
static size_t decode_scratch_floats(int G, int d) {
    return (size_t)ATTN_BT_MAX * d + 2 * (size_t)G * ATTN_BT_MAX + 2 * ATTN_BT_MAX +
           (size_t)G * d;
}

/* part: [G, d] acc, then m [G], l [G]. */
static void decode_item(const attn_ctx *c, const attn_item *it, float *scratch, float *part) {
    const struct tqkv_batch *b = c->b;
    const int G = c->G, d = c->d, r = it->r, h = it->h;
    const float *q = c->qd + ((size_t)r * c->qh + (size_t)h * G) * d;   // [G, d]
    float *acc = part;                        // [G, d]
    float *m = part + (size_t)G * d;          // [G]
    float *l = m + G;                         // [G]
    const int fused = c->kernel == TQKV_KERNEL_FUSED;
    const int BT = fused ? ATTN_BT_FUSED : ATTN_BT;
    float *tile = scratch;                    // [BT, d]
    float *sc = tile + (size_t)BT * d;        // [G, BT]
    float *w = sc + (size_t)G * BT;           // [G, BT]
    float *ks = w + (size_t)G * BT;           // [BT]
    float *vs = ks + BT;                      // [BT]
    float *qp = vs + BT;                      // [G, d] q in the K main format's layout
    // fused: a format-specific query layout for the main K plane, prepared once per item
    const tqkv_format kmain = b->k.codec.format;
    const int prep = fused && c->isa->prep_q[kmain] && d >= 64;
    if (prep) c->isa->prep_q[kmain](q, G, d, qp);
    memset(acc, 0, sizeof(float) * (size_t)G * d);
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int t = it->a, e; t < it->z; t = e) {
        attn_src sk, sv;
        int rk, rv;
        e = imin(it->z, (t / BT + 1) * BT);
        e = imin(e, run_at(c, &b->k, r, h, t, &sk, &rk));
        e = imin(e, run_at(c, &b->v, r, h, t, &sv, &rv));
        const int n = e - t;
        const int run_is_main = t < plane_window_start(&b->k, b, r);
        // prefetch, spread over the scoring loop: V ATTN_PF_V blocks ahead, K ATTN_PF_K
        // blocks ahead (the run holding that token; a stale tail only wastes a prefetch)
        attn_pf pf[ATTN_NPF] = {{NULL, 0}, {NULL, 0}};
        {
            const int tv = t + ATTN_PF_V * BT, tk = t + ATTN_PF_K * BT;
            attn_src ps;
            int pr;
            if (tv < it->z) {
                run_at(c, &b->v, r, h, tv, &ps, &pr);
                pf[0].p = ps.data;
                pf[0].stride = ps.dstride;
            }
            if (tk < it->z) {
                run_at(c, &b->k, r, h, tk, &ps, &pr);
                pf[1].p = ps.data;
                pf[1].stride = ps.dstride;
            }
        }
        // scores for the group's heads
        if (!fused) materialise(c, &b->k, &sk, rk, n, tile, NULL);
        if (tqkv_format_is_tq(sk.fmt))   // one fp16 scale per tq vector: consecutive
            c->isa->token_scales(sk.scales, n, c->scale, ks);
        else
            for (int j = 0; j < n; j++) ks[j] = c->scale;
        for (int j = n; j < BT; j++) ks[j] = 1.0f;
        if (prep && sk.fmt == kmain && run_is_main)
            c->isa->score_prep[kmain](&sk, n, qp, G, sc, BT, pf);
        else
            c->isa->score[sk.fmt](&sk, n, q, G, sc, BT, pf);
        // online softmax, value weights (tq scale folded per token)
        if (!fused) materialise(c, &b->v, &sv, rv, n, tile, NULL);
        const float *vsp = NULL;
        if (tqkv_format_is_tq(sv.fmt)) {
            c->isa->token_scales(sv.scales, n, 1.0f, vs);
            for (int j = n; j < BT; j++) vs[j] = 1.0f;
            vsp = vs;
        }
        c->isa->softmax_block(sc, BT, n, G, ks, vsp, m, l, acc, d, w, BT);
        c->isa->accum[sv.fmt](&sv, n, w, BT, G, acc, NULL);
    }
}

/* Merge the partials of (row, q head) in segment order and write the output vector. */
static void decode_combine(const attn_ctx *c, const float *parts, int nseg, int g,
                           float *out) {
    const int G = c->G, d = c->d;
    const size_t stride = (size_t)G * (d + 2);
    if (nseg == 0) {
        memset(out, 0, sizeof(float) * (size_t)d);
        return;
    }
    float mx = -INFINITY;
    for (int s = 0; s < nseg; s++) {
        const float ms = parts[s * stride + (size_t)G * d + g];
        if (ms > mx) mx = ms;
    }
    float L = 0.0f;
    for (int i = 0; i < d; i++) out[i] = 0.0f;
    for (int s = 0; s < nseg; s++) {
        const float *ps = parts + s * stride;
        const float f = expf(ps[(size_t)G * d + g] - mx);
        L += ps[(size_t)G * d + G + g] * f;
        const float *acc = ps + (size_t)g * d;
        for (int i = 0; i < d; i++) out[i] += acc[i] * f;
    }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int i = 0; i < d; i++) out[i] *= inv;
    if (c->vrot && L > 0.0f) c->isa->unrotate(c->b->v.codec.signs, d, out);
}

// ---------------------------------------------------------------------------
// Prefill engine (n_query > 1)
// ---------------------------------------------------------------------------
static int prefill_queries_per_item(int G) { return G >= ATTN_QV ? 1 : ATTN_QV / G; }
static int prefill_lanes(int G) {
    const int m = prefill_queries_per_item(G) * G;
    return (m + ATTN_LANES - 1) / ATTN_LANES * ATTN_LANES;
}
static size_t prefill_scratch_floats(int G, int d) {
    const size_t mp = (size_t)prefill_lanes(G);
    // qt, ot [d, mp]; st, st2 [KT, mp]; kt, vt, kt2 [KT, d]; lo, hi, m, l, ws [mp]; vec [d]
    return 2 * (size_t)d * mp + 2 * (size_t)ATTN_KT * mp + 3 * (size_t)ATTN_KT * d + 5 * mp + d;
}

/* Main-plane run of pl holding token t (ends at the row's offset). */
static void main_run(const attn_ctx *c, const tqkv_plane *pl, int r, int h, int t, attn_src *s,
                     int *rot) {
    const struct tqkv_batch *b = c->b;
    s->dim = c->d;
    s->cent = pl->codec.centroids;
    s->fmt = pl->codec.format;
    s->data = plane_data(pl, b, r, h, b->left_pad[r] + t);
    s->scales = pl->codec.n_scales ? plane_scales(pl, b, r, h, b->left_pad[r] + t) : NULL;
    s->dstride = pl->codec.payload;
    s->sstride = (size_t)pl->codec.n_scales;
    *rot = pl->codec.rotated;
}

/* q8-copy run of pl holding token t (batch_q8_lo <= t); returns the run's end. */
static int q8_run(const attn_ctx *c, const tqkv_plane *pl, int r, int h, int t, attn_src *s) {
    const int8_t *d;
    const uint16_t *sc;
    const int e = plane_q8_at(pl, c->b, r, h, t, &d, &sc);
    s->dim = c->d;
    s->cent = pl->codec.centroids;
    s->fmt = TQKV_Q8;
    s->data = (const uint8_t *)d;
    s->scales = sc;
    s->dstride = (size_t)c->d;
    s->sstride = (size_t)(c->d / 32);
    return e;
}

/* Per-query window, one plane, tile [t, t + n): which source each (token, lane) reads.
 * 0: main plane only; 1: q8 copies only; 2: both (token t + j, lane cl reads the copy iff
 * t + j >= ws[cl]). */
static int pw_mode(const tqkv_plane *pl, int t, int e, int q8lo, int wsmin, int wsmax) {
    if (!pl->has_window || e <= q8lo || e <= wsmin) return 0;
    return t >= wsmax ? 1 : 2;
}

/* Prefill tile with a per-query window (c->b has a ring): scores then PV for lanes
 * [l0, l1), each plane read from its main run, its q8 run or both (pw_mode). */
static void prefill_tile_pw(const attn_ctx *c, int r, int h, int t, int n, int q8lo,
                            int wsmin, int wsmax, const int32_t *ws, int l0, int l1, int mp,
                            const int32_t *lo, const int32_t *hi, float *qt, float *st,
                            float *st2, float *kt, float *kt2, float *vt, float *m, float *l,
                            float *ot) {
    const struct tqkv_batch *b = c->b;
    const attn_isa *isa = c->isa;
    const int d = c->d, e = t + n;
    attn_src sm, sw;
    int rm;
    // ---- scores
    const int km = pw_mode(&b->k, t, e, q8lo, wsmin, wsmax);
    if (km != 1) {
        main_run(c, &b->k, r, h, t, &sm, &rm);
        materialise(c, &b->k, &sm, rm, n, kt, NULL);
        isa->tile_qk((const float *)(const void *)sm.data, sm.dstride / sizeof(float), n, d, qt,
                     mp, l0, l1, st);
    }
    if (km != 0) {
        q8_run(c, &b->k, r, h, t, &sw);
        materialise(c, &b->k, &sw, 1, n, kt2, NULL);
        isa->tile_qk((const float *)(const void *)sw.data, sw.dstride / sizeof(float), n, d, qt,
                     mp, l0, l1, km == 1 ? st : st2);
    }
    if (km == 2)
        for (int j = 0; j < n; j++)
            for (int cl = l0; cl < l1; cl++)
                if (t + j >= ws[cl]) st[(size_t)j * mp + cl] = st2[(size_t)j * mp + cl];
    isa->tile_softmax(st, n, t, mp, l0, l1, lo, hi, m, l, ot, d);
    // ---- values: probabilities split between the main and the q8 source
    const int vm = pw_mode(&b->v, t, e, q8lo, wsmin, wsmax);
    if (vm == 2)
        for (int j = 0; j < n; j++)
            for (int cl = l0; cl < l1; cl++) {
                float *p = st + (size_t)j * mp + cl, *p2 = st2 + (size_t)j * mp + cl;
                if (t + j >= ws[cl]) {
                    *p2 = *p;
                    *p = 0.0f;
                } else {
                    *p2 = 0.0f;
                }
            }
    if (vm != 1) {
        main_run(c, &b->v, r, h, t, &sm, &rm);
        materialise(c, &b->v, &sm, rm, n, vt, NULL);
        isa->tile_pv((const float *)(const void *)sm.data, sm.dstride / sizeof(float), n, d, st,
                     mp, l0, l1, ot);
    }
    if (vm != 0) {
        q8_run(c, &b->v, r, h, t, &sw);
        materialise(c, &b->v, &sw, 1, n, kt2, NULL);
        isa->tile_pv((const float *)(const void *)sw.data, sw.dstride / sizeof(float), n, d,
                     vm == 1 ? st : st2, mp, l0, l1, ot);
    }
}

static void prefill_item(const attn_ctx *c, const attn_item *it, float *scratch, float *out) {
    const struct tqkv_batch *b = c->b;
    const attn_isa *isa = c->isa;
    const int G = c->G, d = c->d, r = it->r, h = it->h, i0 = it->a, nqb = it->z - it->a;
    const int M = nqb * G, mp = (M + ATTN_LANES - 1) / ATTN_LANES * ATTN_LANES;
    float *qt = scratch;                         // [d, mp]
    float *ot = qt + (size_t)d * mp;             // [d, mp]
    float *st = ot + (size_t)d * mp;             // [ATTN_KT, mp]
    float *st2 = st + (size_t)ATTN_KT * mp;      // [ATTN_KT, mp] (per-query window)
    float *kt = st2 + (size_t)ATTN_KT * mp;      // [ATTN_KT, d]
    float *vt = kt + (size_t)ATTN_KT * d;        // [ATTN_KT, d]
    float *kt2 = vt + (size_t)ATTN_KT * d;       // [ATTN_KT, d] (per-query window)
    int32_t *lo = (int32_t *)(kt2 + (size_t)ATTN_KT * d);  // [mp]
    int32_t *hi = lo + mp;                       // [mp]
    int32_t *ws = hi + mp;                       // [mp] first token read from q8 copies
    float *m = (float *)(ws + mp);               // [mp]
    float *l = m + mp;                           // [mp]
    float *vec = l + mp;                         // [d]
    // per-query window: a ring on K or V (tq plane with window > 0)
    const int pw = b->ring > 0 && (b->k.has_window || b->v.has_window);
    const int q8lo = pw ? batch_q8_lo(b, r) : 0;
    int wsmin = INT32_MAX, wsmax = 0;

    // lanes: c = (i - i0) * G + g
    int tmin = INT32_MAX, tmax = 0;
    for (int cl = 0; cl < mp; cl++) {
        m[cl] = -INFINITY;
        l[cl] = 0.0f;
        if (cl >= M) {
            lo[cl] = hi[cl] = 0;
            for (int k = 0; k < d; k++) qt[(size_t)k * mp + cl] = 0.0f;
            continue;
        }
        const int i = i0 + cl / G, g = cl % G;
        const float *q = c->qd + (((size_t)r * c->qh + (size_t)h * G + g) * c->nq + i) * d;
        for (int k = 0; k < d; k++) qt[(size_t)k * mp + cl] = q[k] * c->scale;
        lo[cl] = c->qlo[(size_t)r * c->nq + i];
        hi[cl] = c->qhi[(size_t)r * c->nq + i];
        ws[cl] = imax(b->offset[r] - c->nq + i + 1 - b->cfg.window, q8lo);
        if (lo[cl] >= hi[cl]) {
            lo[cl] = hi[cl] = 0;
        } else {
            tmin = imin(tmin, lo[cl]);
            tmax = imax(tmax, hi[cl]);
            wsmin = imin(wsmin, ws[cl]);
            wsmax = imax(wsmax, ws[cl]);
        }
    }
    for (int cl = M; cl < mp; cl++) ws[cl] = INT32_MAX;
    memset(ot, 0, sizeof(float) * (size_t)d * mp);

    for (int t = tmin, e; t < tmax; t = e) {
        attn_src sk, sv;
        int rk = 0, rv = 0;
        e = imin(tmax, (t / ATTN_KT + 1) * ATTN_KT);
        if (pw) {   // tiles never cross q8lo nor the end of a q8 run
            const tqkv_plane *wp = b->k.has_window ? &b->k : &b->v;
            if (t < q8lo) e = imin(e, q8lo);
            else e = imin(e, q8_run(c, wp, r, h, t, &sk));
        } else {
            e = imin(e, run_at(c, &b->k, r, h, t, &sk, &rk));
            e = imin(e, run_at(c, &b->v, r, h, t, &sv, &rv));
        }
        const int n = e - t;
        // lanes that see any token of [t, e)
        int ga = -1, gz = -1;
        for (int cl = 0; cl < M; cl++) {
            if (lo[cl] < hi[cl] && lo[cl] < e && hi[cl] > t) {
                if (ga < 0) ga = cl;
                gz = cl;
            }
        }
        if (ga < 0) continue;
        const int l0 = ga / ATTN_LANES * ATTN_LANES;
        const int l1 = gz / ATTN_LANES * ATTN_LANES + ATTN_LANES;
        if (pw) {
            prefill_tile_pw(c, r, h, t, n, q8lo, wsmin, wsmax, ws, l0, l1, mp, lo, hi, qt, st,
                            st2, kt, kt2, vt, m, l, ot);
            continue;
        }
        materialise(c, &b->k, &sk, rk, n, kt, NULL);
        isa->tile_qk((const float *)(const void *)sk.data, sk.dstride / sizeof(float), n, d, qt,
                     mp, l0, l1, st);
        isa->tile_softmax(st, n, t, mp, l0, l1, lo, hi, m, l, ot, d);
        materialise(c, &b->v, &sv, rv, n, vt, NULL);
        isa->tile_pv((const float *)(const void *)sv.data, sv.dstride / sizeof(float), n, d, st,
                     mp, l0, l1, ot);
    }

    for (int cl = 0; cl < M; cl++) {
        const int i = i0 + cl / G, g = cl % G;
        float *o = out + (((size_t)r * c->qh + (size_t)h * G + g) * c->nq + i) * d;
        if (!(l[cl] > 0.0f)) {
            memset(o, 0, sizeof(float) * (size_t)d);
            continue;
        }
        const float inv = 1.0f / l[cl];
        for (int k = 0; k < d; k++) vec[k] = ot[(size_t)k * mp + cl] * inv;
        if (c->vrot) c->isa->unrotate(b->v.codec.signs, d, vec);
        memcpy(o, vec, sizeof(float) * (size_t)d);
    }
}

// ---------------------------------------------------------------------------
// Entry: checks, context, per-query token ranges, work items, one parallel region
// ---------------------------------------------------------------------------

static tqkv_status attn_check(const struct tqkv_batch *b, const tqkv_mask *mask, const float *q,
                              int nq, const tqkv_attn_params *p, const float *out) {
    if (!b || !q || !p || !out) return tqkv_fail(TQKV_EINVAL, "attn_batch: NULL argument");
    const int kvh = b->cfg.kv_heads, d = b->cfg.head_dim;
    if (kvh < 1 || p->q_heads < 1 || p->q_heads % kvh)
        return tqkv_fail(TQKV_EINVAL, "attention: q_heads %d is not a positive multiple of "
                                      "kv_heads %d", p->q_heads, kvh);
    if (nq < 1) return tqkv_fail(TQKV_EINVAL, "attention: n_query %d < 1", nq);
    if (tqkv_check_dim(d) != TQKV_OK) return tqkv_fail(TQKV_EINVAL, "attention: bad head_dim %d", d);
    if ((int)p->kernel < 0 || p->kernel >= TQKV_KERNEL_COUNT)
        return tqkv_fail(TQKV_EINVAL, "attention: unknown kernel set %d", (int)p->kernel);
    if (mask && (mask->rows != b->rows || mask->n_query != nq || !mask->lo || !mask->hi))
        return tqkv_fail(TQKV_EINVAL, "attention: mask is for %d rows x %d queries, call has "
                                      "%d x %d", mask->rows, mask->n_query, b->rows, nq);
    return TQKV_OK;
}

static void attn_ctx_init(attn_ctx *c, const struct tqkv_batch *b, int nq, const tqkv_attn_params *p) {
    memset(c, 0, sizeof *c);
    c->b = b;
    c->isa = (tqkv_cpu_has_avx2() && attn_isa_avx2()) ? attn_isa_avx2() : attn_isa_scalar();
    if (c->isa == attn_isa_avx2() && tqkv_cpu_has_avx512()) c->isa = attn_isa_avx512();
    c->kernel = p->kernel;
    c->rows = b->rows;
    c->kvh = b->cfg.kv_heads;
    c->qh = p->q_heads;
    c->G = p->q_heads / c->kvh;
    c->d = b->cfg.head_dim;
    c->nq = nq;
    c->scale = p->scale;
    c->krot = c->kernel != TQKV_KERNEL_DENSE && b->k.codec.rotated;
    c->vrot = c->kernel != TQKV_KERNEL_DENSE && b->v.codec.rotated;
}

/* Visible tokens [qlo, qhi) of each (row, query), in the row's token numbering: the mask's
 * columns less the row's padding, or (no mask) causal over the last nq tokens. */
static void attn_ranges(const struct tqkv_batch *b, const tqkv_mask *mask, int nq, int32_t *qlo,
                        int32_t *qhi) {
    for (int r = 0; r < b->rows; r++) {
        const int lp = b->left_pad[r], off = b->offset[r];
        for (int i = 0; i < nq; i++) {
            long lo, hi;
            if (mask) {
                lo = (long)mask->lo[(size_t)r * nq + i] - lp;
                hi = (long)mask->hi[(size_t)r * nq + i] - lp;
            } else {
                lo = 0;
                hi = (long)off - nq + 1 + i;
            }
            lo = lo < 0 ? 0 : lo > off ? off : lo;
            hi = hi < 0 ? 0 : hi > off ? off : hi;
            if (hi < lo) hi = lo;
            qlo[(size_t)r * nq + i] = (int32_t)lo;
            qhi[(size_t)r * nq + i] = (int32_t)hi;
        }
    }
}

/* The work of one call: decode (nq == 1) items are (row, head, ATTN_SEG segment) with their
 * partial results combined per row; prefill items are (row, head, block of queries). */
typedef struct {
    attn_item *items;   /* [nitems] */
    size_t nitems;
    int *nseg, *seg0;   /* [rows] decode segments of each row, its first segment */
    size_t *base;       /* [rows] decode: index of the row's first item */
    float *parts;       /* [nitems, G, d + 2] decode partials */
    size_t part_stride;
} attn_work;

static void attn_work_free(attn_work *w) {
    free(w->items);
    free(w->nseg);
    free(w->seg0);
    free(w->base);
    free(w->parts);
}

static tqkv_status attn_work_init(attn_work *w, const attn_ctx *c) {
    memset(w, 0, sizeof *w);
    const int rows = c->rows, kvh = c->kvh, nq = c->nq;
    if (nq == 1) {
        w->nseg = tqkv_malloc(sizeof(int) * (size_t)rows);
        w->seg0 = tqkv_malloc(sizeof(int) * (size_t)rows);
        w->base = tqkv_malloc(sizeof(size_t) * (size_t)rows);
        if (!w->nseg || !w->seg0 || !w->base) goto nomem;
        for (int r = 0; r < rows; r++) {
            const int lo = c->qlo[r], hi = c->qhi[r];
            w->seg0[r] = lo / ATTN_SEG;
            w->nseg[r] = hi > lo ? (hi - 1) / ATTN_SEG - lo / ATTN_SEG + 1 : 0;
            w->base[r] = w->nitems; /* items of row r start here */
            w->nitems += (size_t)w->nseg[r] * kvh;
        }
        w->part_stride = (size_t)c->G * (c->d + 2);
        w->parts = tqkv_malloc(sizeof(float) * w->part_stride * (w->nitems ? w->nitems : 1));
        if (!w->parts) goto nomem;
    } else {
        const int qpi = prefill_queries_per_item(c->G);
        w->nitems = (size_t)rows * kvh * (size_t)((nq + qpi - 1) / qpi);
    }
    w->items = tqkv_malloc(sizeof(attn_item) * (w->nitems ? w->nitems : 1));
    if (!w->items) goto nomem;
    size_t n = 0;
    const int qpi = nq == 1 ? 1 : prefill_queries_per_item(c->G);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < kvh; h++) {
            const int parts = nq == 1 ? w->nseg[r] : (nq + qpi - 1) / qpi;
            for (int s = 0; s < parts; s++) {
                attn_item *it = &w->items[n++];
                it->r = r;
                it->h = h;
                if (nq == 1) {
                    it->a = imax(c->qlo[r], (w->seg0[r] + s) * ATTN_SEG);
                    it->z = imin(c->qhi[r], (w->seg0[r] + s + 1) * ATTN_SEG);
                } else {
                    it->a = s * qpi;
                    it->z = imin(nq, s * qpi + qpi);
                }
            }
        }
    return TQKV_OK;
nomem:
    attn_work_free(w);
    return tqkv_fail(TQKV_ENOMEM, "attention: out of memory for scratch");
}

/* The three loops of attn_run as pool loops (util/pool.h): item i, thread slot. */
typedef struct {
    const attn_ctx *c;
    const attn_work *w;
    const float *q;
    float *qd, *scratch, *out;
    size_t scratch_pad;
} attn_job;

static void job_query(void *arg, size_t v, int slot) {
    (void)slot;
    const attn_job *j = arg;
    const int d = j->c->d;
    float *dst = j->qd + v * d; /* c->qd */
    memcpy(dst, j->q + v * d, sizeof(float) * (size_t)d);
    if (j->c->krot) j->c->isa->rotate(j->c->b->k.codec.signs, d, dst);
}

static void job_item(void *arg, size_t i, int slot) {
    const attn_job *j = arg;
    float *scr = j->scratch + j->scratch_pad * (size_t)slot;
    if (j->c->nq == 1)
        decode_item(j->c, &j->w->items[i], scr, j->w->parts + i * j->w->part_stride);
    else
        prefill_item(j->c, &j->w->items[i], scr, j->out);
}

static void job_combine(void *arg, size_t v, int slot) {
    (void)slot;
    const attn_job *j = arg;
    const attn_ctx *c = j->c;
    const int r = (int)(v / c->qh), qhd = (int)(v % c->qh);
    const int h = qhd / c->G, g = qhd % c->G;
    const float *pr = j->w->parts + (j->w->base[r] + (size_t)h * j->w->nseg[r]) * j->w->part_stride;
    decode_combine(c, pr, j->w->nseg[r], g, j->out + v * c->d);
}

/* Queries into the K domain (qd, which c->qd reads), the items, then (decode) the combine:
 * three pool loops of nt threads. */
static void attn_run(const attn_ctx *c, const attn_work *w, const float *q, float *qd,
                     float *scratch, size_t scratch_pad, int nt, float *out) {
    attn_job j = {c, w, q, qd, scratch, out, scratch_pad};
    pool_for(nt, (size_t)c->rows * c->qh * c->nq, job_query, &j);
    pool_for(nt, w->nitems, job_item, &j);
    if (c->nq == 1) pool_for(nt, (size_t)c->rows * c->qh, job_combine, &j);
}

// ---------------------------------------------------------------------------
// per-thread buffers kept between calls
// ---------------------------------------------------------------------------

/* Each call used to allocate its query copy and scratch afresh. Above glibc's mmap
 * threshold (256 KiB in `tqkv serve`) that is a new mapping per layer and call, so every
 * prefill chunk paid page faults and zeroing for them (~11% of a serving process's time at
 * 16 streams). Buffers up to ATTN_KEEP_BYTES now stay with the calling thread (freed when
 * it exits); larger ones are still allocated per call, so no thread keeps more. */
#define ATTN_KEEP_BYTES (8u << 20)
enum { BUF_QLO, BUF_QD, BUF_SCRATCH, BUF_N };
typedef struct {
    void *p;
    size_t cap;
} attn_keep;
static __thread attn_keep tl_keep[BUF_N];
static pthread_key_t tl_key;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;

static void keep_free(void *unused) {
    (void)unused;
    for (int i = 0; i < BUF_N; i++) {
        free(tl_keep[i].p);
        tl_keep[i].p = NULL;
        tl_keep[i].cap = 0;
    }
}
static void keep_key(void) { pthread_key_create(&tl_key, keep_free); }

/* A 64-byte aligned buffer of `bytes` for slot i: the thread's kept one when it fits in
 * ATTN_KEEP_BYTES, else a fresh one; NULL without memory. Give it back with keep_put. */
static void *keep_get(int i, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes == 0) bytes = 64;
    if (bytes > ATTN_KEEP_BYTES) return aligned_alloc(64, bytes);
    attn_keep *k = &tl_keep[i];
    if (k->cap >= bytes) return k->p;
    void *p = aligned_alloc(64, bytes);
    if (!p) return NULL;
    pthread_once(&tl_once, keep_key);
    pthread_setspecific(tl_key, tl_keep); /* any non-NULL value: the destructor runs */
    free(k->p);
    k->p = p;
    k->cap = bytes;
    return p;
}

static void keep_put(int i, void *p) {
    if (p != tl_keep[i].p) free(p);
}

tqkv_status attn_batch(const struct tqkv_batch *b, const tqkv_mask *mask, const float *q,
                       int n_query, const tqkv_attn_params *p, float *out) {
    tqkv_status st = attn_check(b, mask, q, n_query, p, out);
    if (st != TQKV_OK) return st;
    if (b->rows == 0) return TQKV_OK;
    attn_ctx c;
    attn_ctx_init(&c, b, n_query, p);
    const int nt = p->threads > 0 ? p->threads : 1;
    int ok = 1;
    const size_t nvec = tqkv_mul(tqkv_mul((size_t)c.rows, (size_t)c.qh, &ok), (size_t)c.nq, &ok);
    const size_t qfloats = tqkv_mul(nvec, (size_t)c.d, &ok);
    const size_t nrq = tqkv_mul((size_t)c.rows, (size_t)c.nq, &ok);
    if (!ok) return tqkv_fail(TQKV_EINVAL, "attention: shape too large");
    int32_t *qlo = keep_get(BUF_QLO, sizeof(int32_t) * nrq * 2);   // [rows, nq] lo then hi
    float *qd = keep_get(BUF_QD, sizeof(float) * qfloats);         // [rows, q_heads, nq, d]
    const size_t scratch_per = c.nq == 1 ? decode_scratch_floats(c.G, c.d) : prefill_scratch_floats(c.G, c.d);
    const size_t scratch_pad = (scratch_per + 15) & ~(size_t)15;   // 64-byte multiples
    float *scratch = keep_get(BUF_SCRATCH, sizeof(float) * scratch_pad * (size_t)nt);
    attn_work w;
    memset(&w, 0, sizeof w);
    if (!qlo || !qd || !scratch) st = tqkv_fail(TQKV_ENOMEM, "attention: out of memory for scratch");
    if (st == TQKV_OK) {
        attn_ranges(b, mask, c.nq, qlo, qlo + nrq);
        c.qlo = qlo;
        c.qhi = qlo + nrq;
        c.qd = qd;
        st = attn_work_init(&w, &c);
    }
    if (st == TQKV_OK) {
        memset(scratch, 0, sizeof(float) * scratch_pad * (size_t)nt);
        attn_run(&c, &w, q, qd, scratch, scratch_pad, nt, out);
    }
    attn_work_free(&w);
    keep_put(BUF_SCRATCH, scratch);
    keep_put(BUF_QD, qd);
    keep_put(BUF_QLO, qlo);
    return st;
}
