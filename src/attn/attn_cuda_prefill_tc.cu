/*
 * attn_cuda_prefill_tc.cu - the tensor-core form of the masked prefill attention (prefill,
 * chunked prefill, speculative verify): the contract, the float32 reference kernel and the
 * dispatch are attn_cuda_prefill.cu's.
 * Owns: one CTA of 4 warps per (row, kv head, block of BQ = 64 / G query positions); its 64
 * query vectors (G heads x BQ positions, vector m = position m / G, head m % G) against
 * tiles of 64 tokens decoded once into shared memory, fp16 (tq) or bf16 (the dense bf16
 * baseline), with a float factor per token:
 *   S [16 vectors, 64 tokens] = Q [16, D] . K^T [D, 64]    mma.m16n8k16, one warp
 *   O [16, D]               += P [16, 64] . V [64, D]      mma.m16n8k16
 * Tile values: tq tokens their codebook values (factor: the token's scale); q8 window copies
 * their values times block scale / token factor (factor: q8_tok_factor's max, so values stay
 * within 127); bf16 tokens as stored (factor 1). K's factor multiplies the scores; V's enters
 * the softmax as in the decode kernel (attn_cuda_tile.cuh: s' = s + log2 f, P = 2^(s' - m),
 * the sum adds P / f), so P's fp16 range never depends on the V scales; P is shifted up by
 * 2^15 and the sum adds P as rounded (PSHIFT).
 * The per-query q8 window (a query at p reads token t from its q8 copy when t >= c(p) =
 * max(p + 1 - W, q8lo)): the block's c span [cmin, cmax) is at most BQ - 1 tokens; tokens
 * t >= cmax are tiled from their copies, t < cmax from the main plane, and the tiles that
 * meet [cmin, cmax) get a second K / V tile of copies: their scores are computed from both
 * and each (vector, token) takes its own, the P of each source multiplies its own V.
 * Must not: mutate the cache; let a query's output depend on anything but its own row and
 * range (tile boundaries are row-local: t0 = the block's lowest visible token + 64 k).
 * Precision: the decode kernel's (fp16 query and values, float32 accumulation): test_cuda
 * bounds it like decode, 6e-3 rel. L2 (tq) / 1.5e-2 (bf16); TQKV_PREFILL_TC=0 runs the
 * float32 kernel instead.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attn/attn_cuda_prefill_tc.cuh"

namespace {

using namespace ptc;

constexpr int TM = 64;   /* query vectors per CTA (4 warps x 16) */
constexpr int TT = 128;  /* threads */

/* Shared memory: per-token factors (K factor, log2 V factor, 1 / V factor; second set for the
 * window's copy tile) and the codebooks, then Q [TM][LD], K, V [TK][LD] and, with a window,
 * K2, V2 [TK][LD] (16-bit values; LD = D + 8: rows 16 bytes apart modulo 128, so ldmatrix
 * reads 8 rows without bank conflicts). The output is staged through K and V's space as
 * float [TM][D + 8]. */
template <int D> struct TcLayout {
    static constexpr int LD = TC_LD<D>;
    static constexpr int NF = 6 * TK + 32;                 /* floats before the tiles */
    static constexpr size_t bytes(bool two) { return (size_t)NF * 4 + (size_t)(TM + (two ? 4 : 2) * TK) * LD * 2; }
    static_assert((size_t)TM * LD * 4 <= (size_t)2 * TK * LD * 2, "the output stage fits K and V");
};
static_assert(TcLayout<CUDA_DIM_WIDE>::bytes(true) <= 227 * 1024, "the d = 256 tiles fit an SM");

template <int D, int F>
__global__ void __launch_bounds__(TT, 1) prefill_tc_kernel(const PParams<D> P) {
    using L = TcLayout<D>;
    constexpr int LD = L::LD;
    extern __shared__ __align__(16) float smf[];
    float *f1 = smf, *f2 = smf + 3 * TK, *ck = smf + 6 * TK, *cv = ck + 16;
    uint16_t *sq = reinterpret_cast<uint16_t *>(smf + L::NF);
    uint16_t *sk = sq + TM * LD, *sv = sk + TK * LD, *sk2 = sv + TK * LD, *sv2 = sk2 + TK * LD;
    const int r = blockIdx.z, h = blockIdx.y, G = P.G, bq = TM / G, q0 = blockIdx.x * bq;
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
    // ---- queries: vector m = (position m / G, head m % G) -> sq [TM][LD], one warp per
    // vector: rotated by K's codec (tq) and scaled as attn_cuda_prefill.cu's pqprep_kernel
    constexpr int E = D / 32;
    for (int m = w; m < TM; m += TT / 32) {
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
    // ---- this thread's two vectors (fragment rows lane / 4 and + 8) ------------------------
    int vlo[2], vhi[2], vc[2];   /* visible [lo, hi); the window's c (t >= c: the copy) */
    const int q8lo = wn.xon ? wn.xlo : row.win_lo;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const int m = 16 * w + (lane >> 2) + 8 * u, i = m / G;
        const bool ok = m < bq * G && q0 + i < P.nq;
        vlo[u] = ok ? (P.lo ? P.lo[(size_t)r * P.nq + q0 + i] : 0) : 0;
        vhi[u] = ok ? (P.lo ? P.hi[(size_t)r * P.nq + q0 + i] : row.ntok) : 0;
        vc[u] = wn.on && ok ? max(row.ntok - P.nq + q0 + i + 1 - P.window, q8lo) : 1 << 30;
    }
    /* the warp's lowest visible token: the least lo of both non-empty vectors of the thread */
    const int wlo = __reduce_min_sync(0xffffffffu, min(vlo[0] < vhi[0] ? vlo[0] : 1 << 30,
                                                       vlo[1] < vhi[1] ? vlo[1] : 1 << 30));
    const int whi = __reduce_max_sync(0xffffffffu, max(vhi[0], vhi[1]));
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float mx[2] = {M_START, M_START}, l[2] = {0.0f, 0.0f};
    const int tend = min(thi, row.ntok);
    for (int t0 = tlo; t0 < thi; t0 += TK) {
        const bool two = wn.on && t0 < wn.cmax && t0 + TK > wn.cmin;   /* block-uniform */
        __syncthreads();   /* the previous tile is used (and sq written) */
        tile_load<D, F, TT>(P, row, rh, t0, tend, wn, ck, cv, sk, sv, f1, two ? sk2 : nullptr, sv2, f2);
        __syncthreads();
        if (t0 >= whi || t0 + TK <= wlo) continue;   /* warp-uniform */
        // ---- scores (the copy tile's where a vector reads it), V factors, mask, row maxima --
        float s[8][4];
        tile_scores<D, F>(s, sq + 16 * w * LD, sk, lane);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] *= f1[8 * j + 2 * (lane & 3) + (e & 1)];
        if (two) tile_scores2<D, F>(s, sq + 16 * w * LD, sk2, f2, t0, vc, wn.cmax, lane);
        float tmax[2] = {M_START, M_START};
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int u = e >> 1, tt = 8 * j + 2 * (lane & 3) + (e & 1), t = t0 + tt;
                const bool b2 = two && t >= vc[u] && t < wn.cmax, vis = t >= vlo[u] && t < vhi[u];
                s[j][e] = vis ? s[j][e] + (b2 ? f2 : f1)[TK + tt] : -INFINITY;
                tmax[u] = fmaxf(tmax[u], s[j][e]);
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
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= al[0]; o[n][1] *= al[0];
            o[n][2] *= al[1]; o[n][3] *= al[1];
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
                l[u] += s[j][e] * (b2 ? f2 : f1)[2 * TK + tt];
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
    // ---- normalize, stage [TM][LD] float through K / V's space, un-rotate, store ----------
#pragma unroll
    for (int u = 0; u < 2; u++) {
        l[u] += __shfl_xor_sync(0xffffffffu, l[u], 1);
        l[u] += __shfl_xor_sync(0xffffffffu, l[u], 2);
        l[u] = l[u] > 0.0f ? 1.0f / l[u] : 0.0f;
    }
    __syncthreads();
    float *so = reinterpret_cast<float *>(sk);
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int m = 16 * w + (lane >> 2) + 8 * u;
            *reinterpret_cast<float2 *>(so + m * LD + 8 * n + 2 * (lane & 3)) =
                make_float2(o[n][2 * u] * l[u], o[n][2 * u + 1] * l[u]);
        }
    __syncthreads();
    for (int m = w; m < bq * G; m += TT / 32) {
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

template <int D, int F> cudaError_t tc_attr() {
    return cudaFuncSetAttribute(prefill_tc_kernel<D, F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)TcLayout<D>::bytes(true));
}

} // namespace

tqkv_status prefill_tc_setup(void) {
    cudaError_t e = tc_attr<CUDA_DIM, F_TQ4>();
    if (e == cudaSuccess) e = tc_attr<CUDA_DIM, F_BF16>();
    if (e == cudaSuccess) e = tc_attr<CUDA_DIM_WIDE, F_TQ4>();
    if (e == cudaSuccess) e = tc_attr<CUDA_DIM_WIDE, F_BF16>();
    return cuda_check(e, "tensor-core prefill shared memory");
}

template <int D> tqkv_status prefill_tc_launch(const PParams<D> &P, int bf16, cudaStream_t stream) {
    const int bq = TM / P.G;
    const dim3 grid((unsigned)((P.nq + bq - 1) / bq), (unsigned)P.kvh, (unsigned)P.nrows);
    const size_t sm = TcLayout<D>::bytes(P.window > 0);
    if (bf16) prefill_tc_kernel<D, F_BF16><<<grid, TT, sm, stream>>>(P);
    else prefill_tc_kernel<D, F_TQ4><<<grid, TT, sm, stream>>>(P);
    return cuda_check(cudaGetLastError(), "tensor-core prefill kernel launch");
}

template tqkv_status prefill_tc_launch<CUDA_DIM>(const PParams<CUDA_DIM> &, int, cudaStream_t);
template tqkv_status prefill_tc_launch<CUDA_DIM_WIDE>(const PParams<CUDA_DIM_WIDE> &, int, cudaStream_t);
