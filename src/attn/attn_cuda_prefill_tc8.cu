/*
 * attn_cuda_prefill_tc8.cu - the default masked prefill attention on tensor cores (prefill,
 * chunked prefill, speculative verify): the contract, the float32 reference kernel and the
 * dispatch are attn_cuda_prefill.cu's; the arithmetic (fp16 / bf16 tiles with a float factor
 * per token, the V factor inside the softmax, PSHIFT, the q8 window's copy tile) is
 * attn_cuda_prefill_tc.cu's, whose 4-warp kernel stays for A/B runs (TQKV_PREFILL_TC=1).
 * Owns: one CTA of 8 warps per (row, kv head, block of BQ = 128 / G query positions), so
 * each decoded tile of 64 tokens serves 128 query vectors (twice the 4-warp kernel's); at
 * d = 128 the K / V tiles are double-buffered and the next tile's compressed bytes are
 * loaded into registers before the current tile's MMAs (decoded into the other buffer after
 * them: one barrier per tile; O's rescale is skipped when no row maximum of the warp moved,
 * x 1 being exact, and without a q8 window the mask when the tile is visible to all the
 * warp's vectors); tiles that meet the q8 window, and every tile at d = 256
 * (one buffer: the shared memory of two does not fit), are loaded synchronously as in the
 * 4-warp kernel. Blocks are launched longest first (the position block is the grid's slowest
 * dimension, counted from the end): under a causal mask the last blocks read the most tiles
 * (more than 65535 blocks, over 1M positions at G = 8, run the 4-warp kernel).
 *   S [16 vectors, 64 tokens] = Q [16, D] . K^T [D, 64]    mma.m16n8k16, one warp
 *   O [16, D]               += P [16, 64] . V [64, D]      mma.m16n8k16
 * Must not: mutate the cache; let a query's output depend on anything but its own row and
 * range (tile boundaries are row-local: t0 = the block's lowest visible token + 64 k; a
 * query's tiles and their order are the 4-warp kernel's whenever both blocks have the same
 * lowest visible token).
 * Precision: the 4-warp kernel's (same operations per (vector, tile)): test_cuda's bounds.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attn/attn_cuda_prefill_tc.cuh"

namespace {

using namespace ptc;

constexpr int NW = 8;          /* warps per CTA */
constexpr int TM = 16 * NW;    /* query vectors per CTA */
constexpr int TT = 32 * NW;    /* threads */

/* Shared memory: per-token factors (K factor, log2 V factor, 1 / V factor) of each of the NB
 * main tile buffers and of the window's copy tile, the codebooks; then Q [TM][LD], NB x
 * (K, V [TK][LD]) and, with a window, K2, V2 [TK][LD] (16-bit values). The output is staged
 * through Q, K and V's space as float [TM][LD]. NB = 2 at d = 128 (double-buffered tiles,
 * register prefetch), 1 at d = 256. */
template <int D> struct Tc8Layout {
    static constexpr int LD = TC_LD<D>;
    static constexpr int NB = D == CUDA_DIM ? 2 : 1;
    static constexpr int NF = 3 * TK * (NB + 1) + 32;      /* floats before the tiles */
    static constexpr size_t bytes(bool two) {
        return (size_t)NF * 4 + (size_t)(TM + 2 * NB * TK + (two ? 2 * TK : 0)) * LD * 2;
    }
    static_assert((size_t)TM * LD * 4 <= (size_t)(TM + 2 * NB * TK) * LD * 2, "the output stage fits Q, K and V");
    static_assert(NF % 4 == 0, "the tiles start 16-byte aligned");
};
static_assert(Tc8Layout<CUDA_DIM>::bytes(true) <= 227 * 1024, "the d = 128 tiles fit an SM");
static_assert(Tc8Layout<CUDA_DIM_WIDE>::bytes(true) <= 227 * 1024, "the d = 256 tiles fit an SM");
static_assert(TK * (CUDA_DIM / 32) == TT, "d = 128: one (token, group) of K and of V per thread per tile");

// ---------------------------------------------------------------------------
// Register prefetch of one main-plane (token, 32-dim group) (d = 128)
// ---------------------------------------------------------------------------

/* The group's bytes as loaded: bf16 64 bytes; else up to 32 (fp8 32, tq4 16, tq2 8, tq3 8 and
 * its 4 high-bit bytes in w[1].x), and the token's scale. */
template <int F> struct RawG {
    uint4 w[F == F_BF16 ? 4 : 2];
    uint16_t sc;
};

/* Load group g of the main-plane token at column col (load_main's reads). */
template <int D, int F>
__device__ __forceinline__ void raw_fetch(RawG<F> &r, const uint8_t *data, const uint16_t *sc, size_t pay, int bits,
                                          size_t col, int g) {
    const uint8_t *p = data + col * pay;
    if constexpr (F == F_BF16) {
#pragma unroll
        for (int c = 0; c < 4; c++) r.w[c] = reinterpret_cast<const uint4 *>(p + 64 * g)[c];
        r.sc = 0;
    } else {
        r.sc = sc[col];
        r.w[1] = make_uint4(0u, 0u, 0u, 0u);
        if (bits == CUDA_BITS_FP8) {
            r.w[0] = reinterpret_cast<const uint4 *>(p + 32 * g)[0];
            r.w[1] = reinterpret_cast<const uint4 *>(p + 32 * g)[1];
        } else if (bits == 4) {
            r.w[0] = *reinterpret_cast<const uint4 *>(p + 16 * g);
        } else {
            const uint2 w = *reinterpret_cast<const uint2 *>(p + 8 * g);
            r.w[0] = make_uint4(w.x, w.y, 0u, 0u);
            if (bits == 3) r.w[1].x = *reinterpret_cast<const uint32_t *>(p + D / 4 + 4 * g);
        }
    }
}

/* The loaded group into dst, decoded as load_main does; returns the token's factor. */
template <int D, int F>
__device__ __forceinline__ float raw_put(uint16_t *dst, const RawG<F> &r, int bits, const float *cent) {
    if constexpr (F == F_BF16) {
#pragma unroll
        for (int c = 0; c < 4; c++) reinterpret_cast<uint4 *>(dst)[c] = r.w[c];
        return 1.0f;
    } else {
        float x[32];
        if (bits == CUDA_BITS_FP8) { /* codec_fp8_half: the e4m3 value x 2^-8, exact in fp16 */
            const uint32_t b[8] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w, r.w[1].x, r.w[1].y, r.w[1].z, r.w[1].w};
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const uint32_t by = (b[j >> 2] >> (8 * (j & 3))) & 0xFFu;
                x[j] = __half2float(__ushort_as_half((uint16_t)(((by & 0x80u) << 8) | ((by & 0x7fu) << 7))));
            }
            put32<F>(dst, x);
            return __half2float(__ushort_as_half(r.sc)) * 256.0f;
        }
        if (bits == 4) {
            const uint32_t b[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
            for (int j = 0; j < 32; j++) x[j] = cent[(b[(j & 15) >> 2] >> (8 * (j & 3) + 4 * (j >> 4))) & 15];
        } else {
            const uint32_t b[2] = {r.w[0].x, r.w[0].y};
            const uint32_t hb = bits == 3 ? r.w[1].x : 0u;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                int idx = (b[(j & 7) >> 2] >> (8 * (j & 3) + 2 * (j >> 3))) & 3;
                idx |= ((hb >> (8 * (j >> 3) + (j & 7))) & 1) << 2;
                x[j] = cent[idx];
            }
        }
        put32<F>(dst, x);
        return __half2float(__ushort_as_half(r.sc));
    }
}

/* This thread's (token tt, group g) of the main-plane tile at t0: K and V of a token the
 * row holds (t < tend) into rk / rv; nothing for padding. */
template <int D, int F>
__device__ __forceinline__ void pf_fetch(RawG<F> &rk, RawG<F> &rv, const PParams<D> &P, const cuda_row &row,
                                         size_t rh, int t0, int tend, int tt, int g) {
    const int t = t0 + tt;
    if (t >= tend) return;
    const size_t col = rh * P.cap + (size_t)(row.left_pad + t);
    raw_fetch<D, F>(rk, P.kd, P.ks, P.kpay, P.kc.bits, col, g);
    raw_fetch<D, F>(rv, P.vd, P.vs, P.vpay, P.vc.bits, col, g);
}

/* The fetched (token tt, group g) into tiles sk / sv and its factors into f (zeros, factors 0
 * and 1, for padding: tile_load's plain-tile result). */
template <int D, int F>
__device__ __forceinline__ void pf_store(const RawG<F> &rk, const RawG<F> &rv, const PParams<D> &P, bool have,
                                         const float *ck, const float *cv, uint16_t *sk, uint16_t *sv, float *f,
                                         int tt, int g) {
    constexpr int LD = TC_LD<D>;
    uint16_t *dk = sk + tt * LD + 32 * g, *dv = sv + tt * LD + 32 * g;
    float kf = 0.0f, vf = 1.0f;
    if (have) {
        kf = raw_put<D, F>(dk, rk, P.kc.bits, ck);
        vf = raw_put<D, F>(dv, rv, P.vc.bits, cv);
    } else {
        const float z[32] = {};
        put32<F>(dk, z);
        put32<F>(dv, z);
    }
    if (g == 0) put_factors(f, f + TK, f + 2 * TK, tt, kf, vf);
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

/* This warp's vectors' state: visible [lo, hi), the window's c (t >= c: the copy), for the
 * thread's fragment rows lane / 4 and + 8. */
struct Vec2 {
    int lo[2], hi[2], c[2];
};


/* Queries of the block: vector m = (position m / G, head m % G) -> sq [TM][LD], one warp per
 * vector: rotated by K's codec (tq) and scaled by qmul (the 4-warp kernel's). */
template <int D, int F>
__device__ __forceinline__ void queries_load(const PParams<D> &P, int r, int h, int q0, int bq, uint16_t *sq) {
    constexpr int LD = TC_LD<D>, E = D / 32;
    const int lane = threadIdx.x & 31, G = P.G;
    for (int m = threadIdx.x >> 5; m < TM; m += NW) {
        const int i = m / G, gg = m % G;
        float x[E] = {};
        if (m < bq * G && q0 + i < P.nq) {   /* warp-uniform */
            cw_load_rotate<E>(P.q + (((size_t)r * P.qh + (size_t)h * G + gg) * P.nq + q0 + i) * D, P.kc, P.krot,
                              lane, x);
#pragma unroll
            for (int c = 0; c < E; c++) x[c] *= P.qmul;
        }
#pragma unroll
        for (int c = 0; c < E; c += 2)
            *reinterpret_cast<uint32_t *>(sq + m * LD + E * lane + c) = pack2<F>(x[c], x[c + 1]);
    }
}

/* The staged output so [TM][LD] (normalized, V domain) un-rotated into P.out. */
template <int D>
__device__ __forceinline__ void output_store(const PParams<D> &P, int r, int h, int q0, int bq, const float *so) {
    constexpr int LD = TC_LD<D>, E = D / 32;
    const int lane = threadIdx.x & 31, G = P.G;
    for (int m = threadIdx.x >> 5; m < bq * G; m += NW) {
        const int i = m / G, gg = m % G;
        if (q0 + i >= P.nq) break;
        float x[E];
#pragma unroll
        for (int c = 0; c < E; c++) x[c] = so[m * LD + E * lane + c];
        if (P.vrot) {
            float sg[E];
#pragma unroll
            for (int c = 0; c < E; c++) sg[c] = P.vc.signs[E * lane + c];
            cw_unrotate_n<E>(x, sg, P.vc.inv, lane);
        }
        float *op = P.out + (((size_t)r * P.qh + (size_t)h * G + gg) * P.nq + q0 + i) * D + E * lane;
#pragma unroll
        for (int c = 0; c < E; c++) op[c] = x[c];
    }
}

/* Grid (kv heads, rows, position blocks): block z holds positions from (nblk - 1 - z) BQ.
 * WIN: P.window > 0 (without it no tile has a copy tile: the per-token source selects of
 * the softmax compile away). */
template <int D, int F, bool WIN>
__global__ void __launch_bounds__(TT, 1) prefill_tc8_kernel(const PParams<D> P) {
    using L = Tc8Layout<D>;
    constexpr int LD = L::LD, NB = L::NB, NG = D / 32;
    /* the dense bf16 tiles' factors are 1 (K), log2 1 = 0 and 1 (V) for every token the
     * mask lets through: no factor arithmetic (x 1 and + 0 are exact) */
    constexpr bool FAC = F != F_BF16;
    extern __shared__ __align__(16) float smf[];
    float *fm = smf, *f2 = smf + 3 * TK * NB, *ck = f2 + 3 * TK, *cv = ck + 16;
    uint16_t *sq = reinterpret_cast<uint16_t *>(smf + L::NF);
    uint16_t *sb = sq + TM * LD;                          /* buffer b: K at sb + 2 b TK LD, V after */
    uint16_t *sk2 = sb + 2 * NB * TK * LD, *sv2 = sk2 + TK * LD;
    const int h = blockIdx.x, r = blockIdx.y, G = P.G, bq = TM / G;
    const int q0 = (int)(gridDim.z - 1 - blockIdx.z) * bq;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const cuda_row row = P.rows[r];
    const size_t rh = (size_t)r * P.kvh + h;
    int tlo, thi;
    Win wn;
    block_range<D>(P, row, r, q0, bq, tlo, thi, wn);
    if (threadIdx.x < 16) {
        ck[threadIdx.x] = P.kc.cent[threadIdx.x];
        cv[threadIdx.x] = P.vc.cent[threadIdx.x];
    }
    queries_load<D, F>(P, r, h, q0, bq, sq);
    Vec2 vv;
    const int q8lo = wn.xon ? wn.xlo : row.win_lo;
    int flo = -(1 << 30), fhi = 1 << 30;   /* [the largest lo, the smallest hi) of valid vectors */
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int m = 16 * w + (lane >> 2) + 8 * u, i = m / G;
        const bool ok = m < bq * G && q0 + i < P.nq;
        vv.lo[u] = ok ? (P.lo ? P.lo[(size_t)r * P.nq + q0 + i] : 0) : 0;
        vv.hi[u] = ok ? (P.lo ? P.hi[(size_t)r * P.nq + q0 + i] : row.ntok) : 0;
        vv.c[u] = wn.on && ok ? max(row.ntok - P.nq + q0 + i + 1 - P.window, q8lo) : 1 << 30;
        if (ok) { flo = max(flo, vv.lo[u]); fhi = min(fhi, vv.hi[u]); }
    }
    /* the warp's lowest visible token: the least lo of both of the thread's non-empty vectors
     * (not row lane / 4's alone: at G = 8 rows 0-7 are one position, 8-15 the next, and a
     * lower lo on the second must not be dropped) */
    const int wlo = __reduce_min_sync(0xffffffffu, min(vv.lo[0] < vv.hi[0] ? vv.lo[0] : 1 << 30,
                                                       vv.lo[1] < vv.hi[1] ? vv.lo[1] : 1 << 30));
    const int whi = __reduce_max_sync(0xffffffffu, max(vv.hi[0], vv.hi[1]));
    /* a tile inside [wflo, wfhi) is visible to every valid vector of the warp (invalid ones
     * are never stored): no mask */
    const int wflo = WIN ? 0 : __reduce_max_sync(0xffffffffu, flo), wfhi = WIN ? 0 : __reduce_min_sync(0xffffffffu, fhi);
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float mx[2] = {M_START, M_START}, l[2] = {0.0f, 0.0f};
    const int tend = min(thi, row.ntok);
    const int nt = thi > tlo ? (thi - tlo + TK - 1) / TK : 0;
    const int ptt = threadIdx.x / NG, pg = threadIdx.x % NG;   /* the prefetched item (NB 2) */
    RawG<F> rk, rv;
    // ---- per tile: a tile not prefetched is loaded synchronously between barriers (the
    // first; those with q8 copies; every tile at d = 256); then the next tile's bytes into
    // registers when it is plain (no q8 copy: NB 2 only), the MMAs, the prefetched bytes
    // decoded into the other buffer, a barrier
    bool ready = false;   /* tile k is in buffer k % NB */
    for (int k = 0; k < nt; k++) {
        const int t0 = tlo + k * TK, t1 = t0 + TK, b = NB == 2 ? k & 1 : 0;
        const bool two = WIN && wn.on && t0 < wn.cmax && t0 + TK > wn.cmin;   /* block-uniform */
        uint16_t *sk = sb + 2 * b * TK * LD;
        if (!ready) {
            __syncthreads();   /* the previous tiles are used (and sq, ck, cv written) */
            tile_load<D, F, TT>(P, row, rh, t0, tend, wn, ck, cv, sk, sk + TK * LD, fm + 3 * TK * b,
                                two ? sk2 : nullptr, sv2, f2);
            __syncthreads();
        }
        const bool pf = NB == 2 && k + 1 < nt && (!WIN || !wn.on || t1 + TK <= wn.cmin);
        if (pf) pf_fetch<D, F>(rk, rv, P, row, rh, t1, tend, ptt, pg);
        if (t0 < whi && t0 + TK > wlo) {   /* warp-uniform: a vector of the warp sees the tile */
            const uint16_t *sv = sk + TK * LD;
            const float *f1 = fm + 3 * TK * b;
            const int (&vlo)[2] = vv.lo, (&vhi)[2] = vv.hi, (&vc)[2] = vv.c;
            // ---- scores (the copy tile's where a vector reads it), V factors, mask, row maxima --
            float s[8][4];
            tile_scores<D, F>(s, sq + 16 * w * LD, sk, lane);
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (FAC) s[j][e] *= f1[8 * j + 2 * (lane & 3) + (e & 1)];
            if (two) tile_scores2<D, F>(s, sq + 16 * w * LD, sk2, f2, t0, vc, wn.cmax, lane);
            float tmax[2] = {M_START, M_START};
            if (!WIN && t0 >= wflo && t0 + TK <= wfhi) {   /* warp-uniform: all visible */
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        if (FAC) s[j][e] += f1[TK + 8 * j + 2 * (lane & 3) + (e & 1)];
                        tmax[e >> 1] = fmaxf(tmax[e >> 1], s[j][e]);
                    }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int u = e >> 1, tt = 8 * j + 2 * (lane & 3) + (e & 1), t = t0 + tt;
                        const bool b2 = two && t >= vc[u] && t < wn.cmax, vis = t >= vlo[u] && t < vhi[u];
                        s[j][e] = vis ? (FAC ? s[j][e] + (b2 ? f2 : f1)[TK + tt] : s[j][e]) : -INFINITY;
                        tmax[u] = fmaxf(tmax[u], s[j][e]);
                    }
            }
            float al[2];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                tmax[u] = fmaxf(tmax[u], __shfl_xor_sync(0xffffffffu, tmax[u], 1));
                tmax[u] = fmaxf(tmax[u], __shfl_xor_sync(0xffffffffu, tmax[u], 2));
                const float mn = fmaxf(mx[u], tmax[u]);
                al[u] = ex2(mx[u] - mn);
                mx[u] = mn;
                l[u] *= al[u];
            }
            if (__any_sync(0xffffffffu, al[0] != 1.0f || al[1] != 1.0f)) {   /* o x 1 = o: skipped */
#pragma unroll
                for (int n = 0; n < D / 8; n++) {
                    o[n][0] *= al[0]; o[n][1] *= al[0];
                    o[n][2] *= al[1]; o[n][3] *= al[1];
                }
            }
            // ---- P = 2^(s' - m + PSHIFT) as the mma will read it; l += P / f; O += P V, each
            // source's P against its V tile

            bool any2 = false;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int u = e >> 1, tt = 8 * j + 2 * (lane & 3) + (e & 1), t = t0 + tt;
                    const bool b2 = two && t >= vc[u] && t < wn.cmax;
                    s[j][e] = round16<F>(ex2(s[j][e] - mx[u] + PSHIFT));
                    l[u] += FAC ? s[j][e] * (b2 ? f2 : f1)[2 * TK + tt] : s[j][e];
                    any2 |= b2;
                }
            any2 = __any_sync(0xffffffffu, any2);
#pragma unroll
            for (int kt = 0; kt < 4; kt++) {
                uint32_t a[4], a2[4];
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int j = 2 * kt + (c >> 1), e0 = 2 * (c & 1), u = c & 1;
                    const int t = t0 + 8 * j + 2 * (lane & 3);
                    const bool b0 = two && t >= vc[u] && t < wn.cmax, b1 = two && t + 1 >= vc[u] && t + 1 < wn.cmax;
                    a[c] = pack2<F>(b0 ? 0.0f : s[j][e0], b1 ? 0.0f : s[j][e0 + 1]);
                    a2[c] = pack2<F>(b0 ? s[j][e0] : 0.0f, b1 ? s[j][e0 + 1] : 0.0f);
                }
                tile_pv<D, F>(o, a, sv, kt, lane);
                if (any2) tile_pv<D, F>(o, a2, sv2, kt, lane);
            }
        }
        if (pf) {   /* the other buffer was last read before the previous barrier */
            uint16_t *nk = sb + 2 * (b ^ 1) * TK * LD;
            pf_store<D, F>(rk, rv, P, t1 + ptt < tend, ck, cv, nk, nk + TK * LD, fm + 3 * TK * (b ^ 1), ptt, pg);
            __syncthreads();
        }
        ready = pf;
    }
    // ---- normalize, stage [TM][LD] float through Q, K and V's space, un-rotate, store ------
#pragma unroll
    for (int u = 0; u < 2; u++) {
        l[u] += __shfl_xor_sync(0xffffffffu, l[u], 1);
        l[u] += __shfl_xor_sync(0xffffffffu, l[u], 2);
        l[u] = l[u] > 0.0f ? 1.0f / l[u] : 0.0f;
    }
    __syncthreads();
    float *so = reinterpret_cast<float *>(sq);
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int m = 16 * w + (lane >> 2) + 8 * u;
            *reinterpret_cast<float2 *>(so + m * LD + 8 * n + 2 * (lane & 3)) =
                make_float2(o[n][2 * u] * l[u], o[n][2 * u + 1] * l[u]);
        }
    __syncthreads();
    output_store<D>(P, r, h, q0, bq, so);
}

template <int D, int F, bool WIN> cudaError_t tc8_attr() {
    return cudaFuncSetAttribute(prefill_tc8_kernel<D, F, WIN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)Tc8Layout<D>::bytes(true));
}

} // namespace

tqkv_status prefill_tc8_setup(void) {
    cudaError_t e = tc8_attr<CUDA_DIM, F_TQ4, false>();
    if (e == cudaSuccess) e = tc8_attr<CUDA_DIM, F_TQ4, true>();
    if (e == cudaSuccess) e = tc8_attr<CUDA_DIM, F_BF16, false>();
    if (e == cudaSuccess) e = tc8_attr<CUDA_DIM_WIDE, F_TQ4, false>();
    if (e == cudaSuccess) e = tc8_attr<CUDA_DIM_WIDE, F_TQ4, true>();
    if (e == cudaSuccess) e = tc8_attr<CUDA_DIM_WIDE, F_BF16, false>();
    return cuda_check(e, "8-warp tensor-core prefill shared memory");
}

template <int D> tqkv_status prefill_tc8_launch(const PParams<D> &P, int bf16, cudaStream_t stream) {
    const int bq = TM / P.G, nblk = (P.nq + bq - 1) / bq;
    /* past grid.z (blocks on grid.x there); a dense bf16 cache has no ring, so no q8 window */
    if (nblk > 65535 || (bf16 && P.window > 0)) return prefill_tc_launch<D>(P, bf16, stream);
    const dim3 grid((unsigned)P.kvh, (unsigned)P.nrows, (unsigned)nblk);
    const size_t sm = Tc8Layout<D>::bytes(P.window > 0);
    if (bf16) prefill_tc8_kernel<D, F_BF16, false><<<grid, TT, sm, stream>>>(P);
    else if (P.window > 0) prefill_tc8_kernel<D, F_TQ4, true><<<grid, TT, sm, stream>>>(P);
    else prefill_tc8_kernel<D, F_TQ4, false><<<grid, TT, sm, stream>>>(P);
    return cuda_check(cudaGetLastError(), "8-warp tensor-core prefill kernel launch");
}

template tqkv_status prefill_tc8_launch<CUDA_DIM>(const PParams<CUDA_DIM> &, int, cudaStream_t);
template tqkv_status prefill_tc8_launch<CUDA_DIM_WIDE>(const PParams<CUDA_DIM_WIDE> &, int, cudaStream_t);
