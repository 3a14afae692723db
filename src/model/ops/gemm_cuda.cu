/*
 * gemm_cuda.cu - the GPU forward's batch-invariant tensor-core GEMM (see gemm_cuda.h for
 * the contract and the reduction order).
 * Owns: the activation kernel (f32 -> bf16 parts [parts, T, K]), the tiled mma kernel
 * (cp.async pipeline, swizzled shared memory, ldmatrix) and its grouped launch (row groups
 * of one split, each with its own matrix: the experts of an MoE layer; the same tile code),
 * its tile shapes and their pick; the warpgroup (wgmma) tiles are in gemm_wgmma.cuh.
 * Must not: split K, fold partials, or let a tile shape change one output's arithmetic.
 *
 * Shapes. A CTA is WM x WN warps; a warp covers MT weight tiles of 16 rows (the mma's M)
 * and NT token tiles of 8 (the mma's N), so a CTA covers BM = 16 MT WM weight rows and
 * BN = 8 NT WN tokens. K is staged 64 at a time (BK): per stage W [BM rows][64 k] and each
 * activation part [BN rows][64 k], 128 bytes a row, the 16-byte chunk c of row r stored
 * at chunk c ^ (r & 7) (ldmatrix reads eight rows of one chunk without bank conflicts).
 * Every output adds its k16 steps in ascending order (hi, then lo), whatever the shape.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "util/cuda_device.h"
#include "util/env_switch.h"
#include "model/ops/gemm_cuda.h"
#include "model/ops/ops_cuda.cuh"

// ---------------------------------------------------------------------------
// activations: x f32 [T, ldx] -> xb bf16 [parts, T, K]
// ---------------------------------------------------------------------------

/* One thread per 8 values: hi = bf16(x) (nearest even), lo = bf16(x - hi) when parts = 2. */
__global__ void gemm_split_kernel(const float *__restrict__ x, size_t ldx, int T, int K, int parts,
                                  uint4 *__restrict__ xb) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, kc = (size_t)K / 8;
    if (i >= (size_t)T * kc) return;
    const size_t t = i / kc, k = (i % kc) * 8;
    const float4 a = *reinterpret_cast<const float4 *>(x + t * ldx + k);
    const float4 c = *reinterpret_cast<const float4 *>(x + t * ldx + k + 4);
    const float v[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint16_t h0 = cuda_split_hi(v[2 * j]), h1 = cuda_split_hi(v[2 * j + 1]);
        hi[j] = (uint32_t)h0 | ((uint32_t)h1 << 16);
        lo[j] = (uint32_t)cuda_split_lo(v[2 * j], h0) | ((uint32_t)cuda_split_lo(v[2 * j + 1], h1) << 16);
    }
    xb[i] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    if (parts == 2) xb[(size_t)T * kc + i] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

// ---------------------------------------------------------------------------
// PTX helpers
// ---------------------------------------------------------------------------

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x2(uint32_t &r0, uint32_t &r1, uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
/* d += A[16 x 16] . B[16 x 8], bf16 in, f32 accumulate: the reduction order's one step */
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* byte offset of 16-byte chunk c of row r in a 128-byte-row tile */
__device__ __forceinline__ uint32_t swz(int r, int c) { return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4)); }

// ---------------------------------------------------------------------------
// the kernel
// ---------------------------------------------------------------------------

template <int WM, int WN, int MT, int NT, int P, int ST> struct Tile {
    static constexpr int THREADS = 32 * WM * WN, BM = 16 * MT * WM, BN = 8 * NT * WN;
    static constexpr int WBYTES = BM * 128, XBYTES = BN * 128, STAGE = WBYTES + P * XBYTES;
    static constexpr int SMEM = ST * STAGE;
    static constexpr int WCP = BM * 8 / THREADS, XCP = BN * 8 / THREADS; /* copies per thread */
    static_assert(WCP * THREADS == BM * 8 && XCP * THREADS == BN * 8 && ST >= 2, "copy split");
    static_assert(NT == 1 || NT % 2 == 0, "token tiles load in pairs");
};

/* The matrix row that a tile's row n reads: n, or with il (the gated epilogue, gemm_epi) and
 * N = 2 I rows of gate then up, gate row 8 b + j at n = 16 b + j and up row I + 8 b + j at
 * n = 16 b + 8 + j (j < 8): the mma puts rows n and n + 8 in the same thread. */
__device__ __forceinline__ int gemm_wrow(int n, int N, int il) {
    return il ? ((n & 8) ? N / 2 : 0) + ((n >> 4) << 3) + (n & 7) : n;
}

/* One stage: W rows n0 .. n0 + BM (gemm_load_w; il: in gemm_wrow's order) and the tokens'
 * parts t0 .. t0 + BN (gemm_load_x) at k 64 kt .. 64 kt + 63 into slot `st` (zeros past N,
 * T or K). Part p of token t is at xb + (p TS + t) K (TS: the split's row count; a grouped
 * GEMM's xb starts at its group's first row). */
template <class C>
__device__ __forceinline__ void gemm_load_w(uint32_t st, const uint16_t *__restrict__ w, int N, int K,
                                            int n0, int kt, int il = 0) {
    const int kc = K / 8;
#pragma unroll
    for (int h = 0; h < C::WCP; h++) {
        const int q = threadIdx.x + C::THREADS * h, r = q >> 3, c = q & 7, n = n0 + r, kq = kt * 8 + c;
        const bool ok = n < N && kq < kc;
        const size_t wr = (size_t)gemm_wrow(n, N, il);
        cp_async16(st + swz(r, c), ok ? (const void *)(w + wr * K + 8 * kq) : (const void *)w,
                   ok ? 16u : 0u);
    }
}
template <class C, int P>
__device__ __forceinline__ void gemm_load_x(uint32_t st, const uint16_t *__restrict__ xb, int T,
                                            int TS, int K, int t0, int kt) {
    const int kc = K / 8;
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int h = 0; h < C::XCP; h++) {
            const int q = threadIdx.x + C::THREADS * h, r = q >> 3, c = q & 7, t = t0 + r, kq = kt * 8 + c;
            const bool ok = t < T && kq < kc;
            const uint16_t *src = xb + ((size_t)p * TS + t) * K + 8 * kq;
            cp_async16(st + C::WBYTES + p * C::XBYTES + swz(r, c), ok ? (const void *)src : (const void *)xb,
                       ok ? 16u : 0u);
        }
}
template <class C, int P>
__device__ __forceinline__ void gemm_load(uint32_t st, const uint16_t *__restrict__ w, int N,
                                          const uint16_t *__restrict__ xb, int T, int TS, int K,
                                          int n0, int t0, int kt, int il = 0) {
    gemm_load_w<C>(st, w, N, K, n0, kt, il);
    gemm_load_x<C, P>(st, xb, T, TS, K, t0, kt);
}

/* The prologue's ST - 1 stages: first their weight tiles, which no kernel writes, then the
 * grid dependency wait (PDL: a programmatic launch starts while the kernel before, the one
 * that wrote xb, still runs; the wait returns once it completed and its writes are visible;
 * a no-op for a plain launch), then the activations. Commit group 0 holds all the
 * prologue's weights and stage 0's activations, group s stage s's: stage s has landed once
 * groups 0 .. s have. Nothing is read from or written to global memory but W before the
 * wait; the same bytes land in the same slots. */
template <class C, int P, int ST>
__device__ __forceinline__ void gemm_prologue(uint32_t sbase, const uint16_t *__restrict__ w, int N,
                                              const uint16_t *__restrict__ xb, int T, int TS, int K,
                                              int n0, int t0, int nk, int il = 0) {
#pragma unroll
    for (int s = 0; s < ST - 1; s++)
        if (s < nk) gemm_load_w<C>(sbase + s * C::STAGE, w, N, K, n0, s, il);
    cuda_pdl_wait();
    cuda_pdl_trigger(); /* a programmatic kernel after this one may launch (and wait) */
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < nk) gemm_load_x<C, P>(sbase + s * C::STAGE, xb, T, TS, K, t0, s);
        cp_async_commit();
    }
}

/* One stage's four k16 steps into acc: per step the warp's MT weight fragments, each
 * part's NT token fragments, then per output the hi mma and (P = 2) the lo mma. */
template <class C, int MT, int NT, int P>
__device__ __forceinline__ void gemm_stage(float (&acc)[MT][NT][4], uint32_t st, int wrow, int wtok,
                                           int lane) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        uint32_t a[MT][4], b[P][NT][2];
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const int r = wrow + 16 * m + (lane & 15);
            ldsm_x4(a[m], st + swz(r, 2 * kk + (lane >> 4)));
        }
#pragma unroll
        for (int p = 0; p < P; p++) {
            const uint32_t xs = st + C::WBYTES + p * C::XBYTES;
            if (NT == 1) {
                const int r = wtok + (lane & 7);
                ldsm_x2(b[p][0][0], b[p][0][1], xs + swz(r, 2 * kk + ((lane >> 3) & 1)));
            } else {
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    const int r = wtok + 8 * j + (lane & 7) + ((lane >> 4) << 3);
                    uint32_t v[4];
                    ldsm_x4(v, xs + swz(r, 2 * kk + ((lane >> 3) & 1)));
                    b[p][j][0] = v[0]; b[p][j][1] = v[1];
                    b[p][j + 1][0] = v[2]; b[p][j + 1][1] = v[3];
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int p = 0; p < P; p++) mma16816(acc[m][j], a[m], b[p][j][0], b[p][j][1]);
    }
}

/* The cp.async pipeline over K's stages: the prologue, then per stage kt: wait until it has
 * landed, queue stage kt + ST - 1 into the slot stage kt - 1 left, and run `stage` (the
 * tile's mma steps) on slot kt % ST. Every tile shape streams K through this one loop. */
template <class C, int P, int ST, class F>
__device__ __forceinline__ void gemm_mainloop(uint32_t sbase, const uint16_t *__restrict__ w, int N,
                                              const uint16_t *__restrict__ xb, int T, int TS, int K,
                                              int n0, int t0, int nk, int il, F &&stage) {
    gemm_prologue<C, P, ST>(sbase, w, N, xb, T, TS, K, n0, t0, nk, il);
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<ST - 2>(); /* stage kt has landed (this thread's copies) */
        __syncthreads();         /* ... everyone's, and stage kt - 1's slot is free */
        const int nx = kt + ST - 1;
        if (nx < nk) gemm_load<C, P>(sbase + (nx % ST) * C::STAGE, w, N, xb, T, TS, K, n0, t0, nx, il);
        cp_async_commit();
        stage(sbase + (kt % ST) * C::STAGE);
    }
    cp_async_wait<0>();
}

/* A tile's epilogue: y[t * ldy + n] = acc (+ bias[n]) (act 0), or the gated activation of
 * the row pairs that gemm_wrow's order puts in one thread: h[t * ldh + i] = act(gate_i) up_i
 * (ops_cuda.cuh's mc_silu_mul / mc_gelu_mul, as the activation kernels compute it) and, with
 * hf, h's GEMM split [parts, TS, N / 2] at row hrow0 + t. */
struct gemm_epi {
    int act;          /* 0, TQKV_GEMM_ACT_SILU or TQKV_GEMM_ACT_GELU */
    float *h;         /* the tile's row 0 (the group's first) */
    size_t ldh;
    uint16_t *hf;     /* or NULL */
    size_t hTK;       /* TS N / 2: the split's part stride */
    int hrow0, parts;
};

/* The gated epilogue of one thread's accumulators (gemm_epi, act != 0). */
template <int MT, int NT>
__device__ __forceinline__ void gemm_store_act(const float (&acc)[MT][NT][4], const gemm_epi &ep,
                                               int T, int N, int t0, int n0, int wrow, int wtok,
                                               int lane) {
    const int g = lane >> 2, c = lane & 3, I = N / 2;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int nb = n0 + wrow + 16 * m, i = (nb >> 1) + g;
                const int t = t0 + wtok + 8 * j + 2 * c + q;
                if (nb >= N || t >= T) continue;
                const float gv = acc[m][j][q], uv = acc[m][j][q + 2];
                const float o = ep.act == TQKV_GEMM_ACT_SILU ? mc_silu_mul(gv, uv) : mc_gelu_mul(gv, uv);
                ep.h[(size_t)t * ep.ldh + i] = o;
                if (ep.hf) mc_split_store(ep.hf, ep.hTK, (size_t)(ep.hrow0 + t) * I + i, o, ep.parts);
            }
}

/* One CTA's tile: weight rows n0 .. n0 + BM, tokens t0 .. t0 + BN of T (parts TS rows apart),
 * then the epilogue ep (gemm_epi: y (+ bias) when act is 0). */
template <int WM, int WN, int MT, int NT, int P, int ST>
__device__ __forceinline__ void gemm_tile(const uint16_t *__restrict__ xb, int T, int TS, int K,
                                          const uint16_t *__restrict__ w, int N,
                                          const float *__restrict__ bias, float *__restrict__ y,
                                          size_t ldy, int t0, int n0, const gemm_epi &ep) {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(sm);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrow = (warp % WM) * 16 * MT, wtok = (warp / WM) * 8 * NT, nk = (K + 63) / 64;
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
    gemm_mainloop<C, P, ST>(sbase, w, N, xb, T, TS, K, n0, t0, nk, ep.act != 0, [&](uint32_t st) {
        gemm_stage<C, MT, NT, P>(acc, st, wrow, wtok, lane);
    });
    if (ep.act) {
        gemm_store_act<MT, NT>(acc, ep, T, N, t0, n0, wrow, wtok, lane);
        return;
    }
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int n = n0 + wrow + 16 * m + g + (q >> 1) * 8;
                const int t = t0 + wtok + 8 * j + 2 * c + (q & 1);
                if (n < N && t < T) y[(size_t)t * ldy + n] = bias ? acc[m][j][q] + bias[n] : acc[m][j][q];
            }
}

/* grid (ceil(T / BN), ceil(N / BM)), block THREADS, dynamic shared memory SMEM. */
template <int WM, int WN, int MT, int NT, int P, int ST>
__global__ void __launch_bounds__(32 * WM * WN)
gemm_kernel(const uint16_t *__restrict__ xb, int T, int K, const uint16_t *__restrict__ w, int N,
            const float *__restrict__ bias, float *__restrict__ y, size_t ldy) {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    gemm_tile<WM, WN, MT, NT, P, ST>(xb, T, T, K, w, N, bias, y, ldy, blockIdx.x * C::BN,
                                     blockIdx.y * C::BM, gemm_epi{});
}

/* Grouped: grid (ceil(max rows / BN), ceil(N / BM), G); CTA z computes group z = {row0,
 * rows, matrix, -}: y rows row0 .. row0 + rows from the split's same rows (TS rows per part)
 * and matrix w + matrix wstride (ep.act: the gated epilogue into h's rows row0 ..). A CTA
 * past its group's rows returns at once (whole block). */
template <int WM, int WN, int MT, int NT, int P, int ST>
__global__ void __launch_bounds__(32 * WM * WN)
gemm_grouped_kernel(const uint16_t *__restrict__ xb, int TS, int K, const uint16_t *__restrict__ w,
                    size_t wstride, int N, float *__restrict__ y, size_t ldy,
                    const int4 *__restrict__ groups, gemm_epi ep) {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    cuda_pdl_wait(); /* programmatic (pdl): the routing that wrote the groups has completed */
    const int4 gr = groups[blockIdx.z];
    const int t0 = blockIdx.x * C::BN;
    if (t0 >= gr.y) return;
    if (ep.act) {
        ep.h += (size_t)gr.x * ep.ldh;
        ep.hrow0 = gr.x;
    }
    gemm_tile<WM, WN, MT, NT, P, ST>(xb + (size_t)gr.x * K, gr.y, TS, K, w + (size_t)gr.z * wstride,
                                     N, nullptr, y + (size_t)gr.x * ldy, ldy, t0, blockIdx.y * C::BM,
                                     ep);
}

#include "model/ops/gemm_wgmma.cuh"
#include "model/ops/gemm_tma.cuh"

// ---------------------------------------------------------------------------
// host: the tile shapes and their pick
// ---------------------------------------------------------------------------

/* s<8 NT>: decode, 32 weight rows x up to 64 tokens, deep pipelines (the weights stream);
 * m: 64 x 64, four warps; l: prefill, 128 x 128, eight warps of 64 x 32; xl: long prefill,
 * 128 x 256, eight warps of 64 x 64 (half the shared-memory reads per mma; one activation
 * part only: two would leave room for two stages). */
#define GEMM_SHAPES(X, P)                                                                          \
    X(SH_S8, 2, 1, 1, 1, P, 8) X(SH_S16, 2, 1, 1, 2, P, 8) X(SH_S32, 2, 1, 1, 4, P, 8)             \
    X(SH_S64, 2, 1, 1, 8, P, (P == 1 ? 6 : 4)) X(SH_M, 2, 2, 2, 4, P, 4) X(SH_L, 2, 4, 4, 4, P, 4)  \
    X(SH_S8N, 1, 1, 1, 1, P, 16) X(SH_S32W, 2, 2, 1, 2, P, 8)                                    \
    X(SH_S64W, 2, 2, 1, 4, P, (P == 1 ? 6 : 4))
#define GEMM_SHAPES_P1(X) X(SH_XL, 2, 4, 4, 8, 1, 4)
/* wl / wxl: the warpgroup (wgmma) tiles of gemm_wgmma.cuh, 128 weight rows x 128 / 256 tokens:
 * (id, BN, parts, stages). Built for sm_90a only (TQKV_CUDA_SM90A); forced by name, and
 * picked where measured faster (shape_pick). */
#define GEMM_WG_SHAPES(X) X(SH_WL, 128, 1, 6) X(SH_WL, 128, 2, 4) X(SH_WXL, 256, 1, 4)
/* tl / txl: wl / wxl's arithmetic on warp-specialised TMA tiles (gemm_tma.cuh), the same
 * (id, BN, parts, stages, + CTAs per cluster); sm_90a only. Picked in place of wl / wxl
 * unless TQKV_GEMM_TMA=0. cxl: txl in clusters of two sharing the activation tile
 * (multicast); picked for wxl with TQKV_GEMM_TMA=2 (opt-in: 2x cuBLAS's time, session 13). */
#define GEMM_TMA_SHAPES(X) X(SH_TL, 128, 1, 6, 1) X(SH_TL, 128, 2, 4, 1) X(SH_TXL, 256, 1, 4, 1) X(SH_CXL, 256, 1, 4, 2)
/* s8t: s8n's arithmetic (16 weight rows a CTA, one consumer warp) fed by the copy engine
 * (gemm_tma.cuh's STile): (id, consumer warps, parts, stages); sm_90a only, the one-token pick
 * for narrow matrices (shape_pick);
 * s8n where a map can't be made, in the grouped launch and in other builds (the same bits). */
#define GEMM_ST_SHAPES(X) X(SH_S8T, 1, 1, 16) X(SH_S8T, 1, 2, 16)

/* s8n: one token, 16 weight rows a CTA (one warp) with 16 stages in flight: twice the CTAs of
 * s8 where N / 32 CTAs leave SMs with one CTA of 28 KB in flight. (A 32-row 16-stage shape
 * was measured beside it and dropped: bench/RESULTS.md "GPU, session 8".)
 * s32w / s64w: s32 / s64's CTA (32 weight rows x 32 / 64 tokens) on four warps of 16 x 16 / 32
 * instead of two of 32 x 16 / 32: each SM sub-partition gets a warp where N / 32 CTAs leave one
 * CTA an SM (Llama-8B's 4096-row matrices at T 33 .. 64: s64 took 1.49x cuBLAS's time). */
enum { SH_S8, SH_S16, SH_S32, SH_S64, SH_M, SH_L, SH_XL, SH_S8N, SH_S32W, SH_S64W,
       SH_S8T, SH_WL, SH_WXL, SH_TL, SH_TXL, SH_CXL, SH_N };
static const char *const g_shape_name[SH_N] = {"s8",  "s16", "s32",  "s64",  "m",   "l",
                                               "xl",  "s8n", "s32w", "s64w", "s8t", "wl",
                                               "wxl", "tl",  "txl",  "cxl"};

static pthread_once_t g_once = PTHREAD_ONCE_INIT; /* TQKV_GEMM_TILE */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_done, g_bad; /* bit d: device d's tiles set up / refused (cuda_device.h) */
static int g_sms = 132, g_force = -1;
/* TQKV_GEMM_TMA: 0 wl / wxl, 1 (default) tl / txl, 2 tl / cxl; cxl's clusters resident at once
 * (0: none, cxl runs as txl). Read by the sm_90a tiles only. */
[[maybe_unused]] static int g_tma = 1, g_cxl_clusters;
static unsigned long g_tma_runs, g_cxl_runs; /* TMA tile launches, clustered ones (tests) */

template <int BN, int P, int ST> static bool wg_shape_setup() {
    return cudaFuncSetAttribute(gemm_wg_kernel<BN, P, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                WTile<BN, P, ST>::SMEM) == cudaSuccess;
}

#ifdef TQKV_CUDA_SM90A
static cudaLaunchAttribute cluster_attr(int cl) {
    cudaLaunchAttribute at = {};
    at.id = cudaLaunchAttributeClusterDimension;
    at.val.clusterDim.x = (unsigned)cl;
    at.val.clusterDim.y = at.val.clusterDim.z = 1;
    return at;
}

template <int NW, int P, int ST> static bool st_shape_setup() {
    return cudaFuncSetAttribute(gemm_st_kernel<NW, P, ST>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                STile<NW, P, ST>::SMEM) == cudaSuccess;
}

/* The kernel's shared memory; for clusters, how many fit at once (g_cxl_clusters: the
 * persistent grid; a grid of more would leave clusters waiting for a whole other's run). */
template <int BN, int P, int ST, int CL> static bool tma_shape_setup() {
    using C = TTile<BN, P, ST, CL>;
    if (cudaFuncSetAttribute(gemm_tma_kernel<BN, P, ST, CL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             C::SMEM) != cudaSuccess)
        return false;
    if (CL == 1) return true;
    cudaLaunchAttribute at = cluster_attr(CL);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(CL * g_sms));
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM;
    cfg.attrs = &at;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, gemm_tma_kernel<BN, P, ST, CL>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
    }
    g_cxl_clusters = n;
    return true;
}

/* cuTensorMapEncodeTiled (the driver's, through the runtime: no libcuda link) */
typedef CUresult (*tmap_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                   const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                   CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                   CUtensorMapFloatOOBfill);
static tmap_encode_fn g_encode; /* set once under g_mu (gemm_device_ready); NULL: no TMA tiles */

static tmap_encode_fn tmap_encoder(void) {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess || q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return (tmap_encode_fn)fn;
}

/* A bf16 map over `planes` planes of [rows][K] at base (planes rows K apart), rank 2 or 3,
 * box 64 k x box_rows (x 1 plane), 128-byte swizzle, zero fill past the edges. 0 when the
 * encoder is missing or refuses (base not 16-byte aligned, say). K % 8 == 0 (gemm_check):
 * the row stride is a multiple of 16 bytes. */
static bool tmap_make(CUtensorMap *m, const uint16_t *base, int K, int rows, int planes, int box_rows, int rank) {
    if (!g_encode || ((uintptr_t)base & 15u)) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)K, (cuuint64_t)rows, (cuuint64_t)planes};
    const cuuint64_t strides[2] = {(cuuint64_t)K * 2u, (cuuint64_t)K * 2u * (cuuint64_t)rows};
    const cuuint32_t box[3] = {64u, (cuuint32_t)box_rows, 1u}, step[3] = {1u, 1u, 1u};
    return g_encode(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)base, dims, strides, box, step,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
#endif

template <int WM, int WN, int MT, int NT, int P, int ST> static bool shape_setup() {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    return cudaFuncSetAttribute(gemm_kernel<WM, WN, MT, NT, P, ST>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM) == cudaSuccess &&
           cudaFuncSetAttribute(gemm_grouped_kernel<WM, WN, MT, NT, P, ST>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM) == cudaSuccess;
}

/* Once per process: TQKV_GEMM_TILE (a shape name: every T takes it, for benchmarks; the bits
 * are the same) and TQKV_GEMM_TMA (default 1: tl / txl for wl / wxl; 0: the pick keeps wl /
 * wxl; 2: cxl for wxl; same bits). */
static void gemm_init(void) {
    const char *e = getenv("TQKV_GEMM_TILE"), *t = getenv("TQKV_GEMM_TMA");
    for (int i = 0; e && i < SH_N; i++)
        if (!strcmp(e, g_shape_name[i])) g_force = i;
    /* on by default since session 14 (test_gemm_tma / _cxl passed on an H100 once the GEMM
     * refused unaligned W; the session-13 fault was that test step's, not the tiles');
     * TQKV_GEMM_TMA=0 keeps wl / wxl (same bits) */
    g_tma = !t ? 1 : !strcmp(t, "0") ? 0 : !strcmp(t, "2") ? 2 : 1;
}

/* Once per device, before its first launch: the kernels' shared memory and the SM count
 * (kernel attributes belong to the device current when they are set). 1: usable. */
static int gemm_device_ready(void) {
    pthread_once(&g_once, gemm_init);
    const unsigned bit = cuda_device_bit();
    if (__atomic_load_n(&g_done, __ATOMIC_ACQUIRE) & bit) return !(__atomic_load_n(&g_bad, __ATOMIC_ACQUIRE) & bit);
    pthread_mutex_lock(&g_mu);
    if (!(g_done & bit)) {
        int dev = 0, sms = 0;
        if (cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0)
            g_sms = sms; /* the tensor-parallel ranks' GPUs are one model */
        bool ok = true;
#define X(id, wm, wn, mt, nt, p, st) ok = ok && shape_setup<wm, wn, mt, nt, p, st>();
        GEMM_SHAPES(X, 1)
        GEMM_SHAPES(X, 2)
        GEMM_SHAPES_P1(X)
#undef X
        /* the grouped 8-stage s8n (g_grouped_st8): all of the SM's shared memory for its nine
         * CTAs (a preference: no failure to report) */
        (void)cudaFuncSetAttribute(gemm_grouped_kernel<1, 1, 1, 1, 1, 8>,
                                   cudaFuncAttributePreferredSharedMemoryCarveout, 100);
        (void)cudaFuncSetAttribute(gemm_grouped_kernel<1, 1, 1, 1, 2, 8>,
                                   cudaFuncAttributePreferredSharedMemoryCarveout, 100);
#ifdef TQKV_CUDA_SM90A
#define X(id, bn, p, st) ok = ok && wg_shape_setup<bn, p, st>();
        GEMM_WG_SHAPES(X)
#undef X
#define X(id, bn, p, st, cl) ok = ok && tma_shape_setup<bn, p, st, cl>();
        GEMM_TMA_SHAPES(X)
#undef X
#define X(id, nw, p, st) ok = ok && st_shape_setup<nw, p, st>();
        GEMM_ST_SHAPES(X)
#undef X
        if (!g_encode) g_encode = tmap_encoder();
#endif
        if (!ok) {
            (void)cudaGetLastError();
            __atomic_fetch_or(&g_bad, bit, __ATOMIC_RELEASE);
        }
        __atomic_fetch_or(&g_done, bit, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_mu);
    return !(__atomic_load_n(&g_bad, __ATOMIC_ACQUIRE) & bit);
}

/* The mma.sync shape for T > GEMM_CUDA_SMALL_T tokens: xl where its 256-token tiles still
 * about fill the GPU (H200: 1.2-1.3x l's speed at T >= 512 when they do, slower when they
 * leave SMs idle; bench/RESULTS.md "GPU, session 4"), l where its tiles fill it, else m. */
static int pick_mma(int T, int N, int parts) {
    if (parts == 1 && 10L * ((T + 255) / 256) * ((N + 127) / 128) >= 7L * g_sms) return SH_XL;
    if ((long)((T + 127) / 128) * ((N + 127) / 128) >= g_sms) return SH_L; /* fills the GPU */
    return SH_M;
}

/* The warpgroup shape for T > GEMM_CUDA_SMALL_T tokens (sm_90a). Measured on an H100 at the
 * Llama-8B matrices, T 96 .. 4096 (bench/RESULTS.md "GPU, session 10"): m where wl's CTAs
 * would fill less than half the SMs (bf16 activations: its 64 x 64 tiles keep more SMs
 * busy); else whichever of wl / wxl needs fewer waves of CTAs, a wave of wxl costing 1.77
 * of wl's (its tiles are twice the work at 0.886 of the time per output). With hi + lo
 * activations wl everywhere (m at best ties it there). */
[[maybe_unused]] static int pick_wg(int T, int N, int parts) {
    const long sms = g_sms, cl = (long)((T + 127) / 128) * ((N + 127) / 128);
    const long cx = (long)((T + 255) / 256) * ((N + 127) / 128);
    if (parts != 1) return SH_WL;
    if (2 * cl < sms) return SH_M;
    return 177 * ((cx + sms - 1) / sms) < 100 * ((cl + sms - 1) / sms) ? SH_WXL : SH_WL;
}

/* T 33 .. 64: four warps a CTA (s64 / s32's two left SM sub-partitions idle where few CTAs
 * share an SM). s32w (two CTAs along T, each weight row read twice, the second from L2) where
 * s64w's ceil(N / 32) CTAs would fill the SMs less than four times, else s64w. Measured on an
 * H100 at the Llama-8B matrices, T 48 and 64, parts 1 (bench/RESULTS.md "Session 16"): 4096 x
 * 14336 0.0996 (s64) -> 0.0812 ms (s32w), 4096 x 4096 0.0389 -> 0.0307, 6144 x 4096 0.0418 ->
 * 0.0357, 28672 x 4096 0.1281 -> 0.1216 (s64w; s32w 0.1300). */
static int pick_s64(int N) { return (long)((N + 31) / 32) >= 4L * g_sms ? SH_S64W : SH_S32W; }

/* The shape for T tokens, N outputs and `parts` (xl, wxl have one part: l, wl serve two);
 * `wg`: the warpgroup tiles may be picked (not for the grouped launch, which has none). */
static int shape_pick(int T, int N, int parts, int wg) {
    int sh;
    if (g_force >= 0) sh = g_force;
    /* one token: s8n (16 rows a CTA, 16 stages; 1.05x s8's tokens/s, H100, Llama-8B decode
     * at 1 row, bench/RESULTS.md "GPU, session 8"), or s8t (s8n fed by the copy engine, the
     * same bits; s8n where no map can be made, in the grouped launch and without sm_90a)
     * where its N / 16 CTAs leave an SM one or none: on an H100 in one run (session 18)
     * 2048x4096 took 0.0247 ms under s8t against 0.0285 under s8n, while 4096-row and wider
     * matrices tied or lost up to 2% (4096x14336 0.0643 against 0.0629); the one-row
     * Qwen3-30B-A3B step (o projection 2048 x 4096) +1.8%, Llama-8B's unchanged. T 2..8 keep
     * s8. */
    else if (T <= GEMM_CUDA_SMALL_T)
        sh = T == 1 ? ((N + 15) / 16 <= g_sms ? SH_S8T : SH_S8N)
             : T <= 8 ? SH_S8 : T <= 16 ? SH_S16 : T <= 32 ? SH_S32 : pick_s64(N);
#ifdef TQKV_CUDA_SM90A
    else if (wg) {
        sh = pick_wg(T, N, parts);
        if (g_tma) sh = sh == SH_WL ? SH_TL : sh == SH_WXL ? (g_tma == 2 ? SH_CXL : SH_TXL) : sh; /* same bits */
    }
#endif
    else sh = pick_mma(T, N, parts);
#ifndef TQKV_CUDA_SM90A
    wg = 0; /* no warpgroup tiles in this build */
#endif
    if (!wg) /* no warpgroup or copy-engine tile: the same bits from the cp.async ones */
        sh = sh == SH_WL || sh == SH_TL                     ? SH_L
             : sh == SH_WXL || sh == SH_TXL || sh == SH_CXL ? SH_XL
             : sh == SH_S8T                                 ? SH_S8N
                                                            : sh;
    if (parts != 1) /* one part only */
        sh = sh == SH_XL ? SH_L : sh == SH_WXL ? SH_WL : sh == SH_TXL || sh == SH_CXL ? SH_TL : sh;
    return sh;
}

/* One GEMM kernel's launch on C's tile sizes over T tokens and N weight rows; pdl: a
 * programmatic launch (util/cuda_pdl.cuh: a plain one when the runtime refuses it). */
template <class C, class... A>
static void launch_tile(void (*kern)(A...), cudaStream_t s, int T, int N, int pdl, A... args) {
    const dim3 grid((unsigned)((T + C::BN - 1) / C::BN), (unsigned)((N + C::BM - 1) / C::BM));
    cuda_pdl_launch(pdl, kern, grid, dim3(C::THREADS), C::SMEM, s, args...);
}

template <int WM, int WN, int MT, int NT, int P, int ST>
static void launch(cudaStream_t s, const uint16_t *xb, int T, int K, const uint16_t *w, int N,
                   const float *bias, float *y, size_t ldy, int pdl) {
    launch_tile<Tile<WM, WN, MT, NT, P, ST>>(gemm_kernel<WM, WN, MT, NT, P, ST>, s, T, N, pdl, xb,
                                             T, K, w, N, bias, y, ldy);
}

/* The warpgroup tiles' launch, as launch(). */
template <int BN, int P, int ST>
static void launch_wg(cudaStream_t s, const uint16_t *xb, int T, int K, const uint16_t *w, int N,
                      const float *bias, float *y, size_t ldy, int pdl) {
    launch_tile<WTile<BN, P, ST>>(gemm_wg_kernel<BN, P, ST>, s, T, N, pdl, xb, T, K, w, N, bias, y,
                                  ldy);
}

#ifdef TQKV_CUDA_SM90A
/* The TMA tiles' launch, as launch(): the weight and activation maps built per call (host
 * work only; captured into a graph as kernel parameters), a persistent grid of CL x
 * min(units, resident CTAs or clusters). false (nothing launched) when a map can't be made,
 * cxl's weight tiles are odd in number or no cluster fits: the caller falls back (txl, then
 * wl / wxl), the same bits. A refused launch is left to gemm_launched to report. */
template <int BN, int P, int ST, int CL>
static bool launch_tma(cudaStream_t s, const uint16_t *xb, int T, int K, const uint16_t *w, int N,
                       const float *bias, float *y, size_t ldy, int pdl) {
    using C = TTile<BN, P, ST, CL>;
    const long nn = (N + 127) / 128, units = (long)((T + BN - 1) / BN) * nn / CL;
    const long slots = CL == 1 ? g_sms : g_cxl_clusters;
    CUtensorMap wm, xm;
    if ((CL > 1 && (nn % CL || slots < 1)) || !tmap_make(&wm, w, K, N, 1, 128, 2) ||
        !tmap_make(&xm, xb, K, T, P, C::XROWS, 3))
        return false;
    cudaLaunchAttribute at[2];
    const dim3 grid((unsigned)(CL * (units < slots ? units : slots)));
    cudaLaunchConfig_t cfg = cuda_pdl_config(grid, dim3(C::THREADS), C::SMEM, s, &at[1]); /* at[1]: PDL */
    at[0] = cluster_attr(CL);
    cfg.attrs = CL > 1 ? at : at + 1;
    cfg.numAttrs = (CL > 1) + (pdl != 0);
    cudaError_t e = cudaLaunchKernelEx(&cfg, gemm_tma_kernel<BN, P, ST, CL>, wm, xm, T, K, N, bias, y, ldy);
    if (e != cudaSuccess && pdl) { /* again without PDL (the cluster attribute, if any, is first) */
        (void)cudaGetLastError();
        cfg.numAttrs--;
        e = cudaLaunchKernelEx(&cfg, gemm_tma_kernel<BN, P, ST, CL>, wm, xm, T, K, N, bias, y, ldy);
    }
    if (e == cudaSuccess) __atomic_fetch_add(CL > 1 ? &g_cxl_runs : &g_tma_runs, 1ul, __ATOMIC_RELAXED);
    return true;
}

/* The copy-engine decode tiles' launch (grid as launch()'s): false (nothing launched) when a
 * map can't be made; the caller falls back to s8n, the same bits. */
template <int NW, int P, int ST>
static bool launch_st(cudaStream_t s, const uint16_t *xb, int T, int K, const uint16_t *w, int N,
                      const float *bias, float *y, size_t ldy, int pdl) {
    using C = STile<NW, P, ST>;
    CUtensorMap wm, xm;
    if (!tmap_make(&wm, w, K, N, 1, C::BM, 2) || !tmap_make(&xm, xb, K, T, P, C::BN, 3))
        return false;
    launch_tile<C>(gemm_st_kernel<NW, P, ST>, s, T, N, pdl, wm, xm, T, K, N, bias, y, ldy);
    return true;
}
#endif

__global__ void pdl_probe_kernel(int unused) {
    (void)unused;
    cuda_pdl_wait();
}

/* 1 when the device takes a programmatic launch (tried on `stream`, then synchronized:
 * outside any capture), else 0 (the error cleared). */
extern "C" int tqkv_cuda_gemm_pdl_probe(void *stream) {
    const cudaStream_t s = (cudaStream_t)stream;
    cudaLaunchAttribute at;
    const cudaLaunchConfig_t cfg = cuda_pdl_config(dim3(1), dim3(32), 0, s, &at);
    if (cudaLaunchKernelEx(&cfg, pdl_probe_kernel, 0) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return 1;
}

template <int WM, int WN, int MT, int NT, int P, int ST>
static void launch_grouped(cudaStream_t s, const uint16_t *xb, int TS, int K, const uint16_t *w,
                           size_t wstride, int N, float *y, size_t ldy, const int4 *groups, int G,
                           int max_rows, int pdl, const gemm_epi &ep) {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    const dim3 grid((unsigned)((max_rows + C::BN - 1) / C::BN), (unsigned)((N + C::BM - 1) / C::BM),
                    (unsigned)G);
    cuda_pdl_launch(pdl, gemm_grouped_kernel<WM, WN, MT, NT, P, ST>, grid, dim3(C::THREADS), C::SMEM, s,
                    xb, TS, K, w, wstride, N, y, ldy, groups, ep);
}

extern "C" size_t tqkv_cuda_gemm_xf_bytes(size_t T, size_t kmax) { return 2 * T * kmax * 2; }

extern "C" unsigned long tqkv_cuda_gemm_tma_runs(unsigned long *clustered) {
    if (clustered) *clustered = __atomic_load_n(&g_cxl_runs, __ATOMIC_RELAXED);
    return __atomic_load_n(&g_tma_runs, __ATOMIC_RELAXED) + __atomic_load_n(&g_cxl_runs, __ATOMIC_RELAXED);
}

extern "C" const char *tqkv_cuda_gemm_tile(int T, int N, int parts) {
    (void)gemm_device_ready();
    return g_shape_name[shape_pick(T < 1 ? 1 : T, N < 1 ? 1 : N, parts, 1)];
}

extern "C" tqkv_status tqkv_cuda_gemm_set_tile(const char *name) {
    pthread_once(&g_once, gemm_init);
    if (!name) {
        g_force = -1;
        return TQKV_OK;
    }
    for (int i = 0; i < SH_N; i++)
        if (!strcmp(name, g_shape_name[i])) {
            g_force = i;
            return TQKV_OK;
        }
    char known[16 * SH_N] = "";  /* the names, from g_shape_name (a new tile lists itself) */
    for (int i = 0; i < SH_N; i++) {
        if (i) strcat(known, ", ");
        strcat(known, g_shape_name[i]);
    }
    return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm_set_tile: no tile shape '%s' (%s)", name, known);
}

/* Checks and the one-time setup; 0 or the failure. */
static tqkv_status gemm_check(const char *fn, int T, const void *w, int N, int K, const float *y,
                              const void *xf, int parts) {
    if (!w || !y || !xf || T < 1 || N < 1 || K < 8 || K % 8 || (parts != 1 && parts != 2))
        return tqkv_fail(TQKV_EINVAL, "%s: bad argument (T %d, N %d, K %d, parts %d)", fn, T, N,
                         K, parts);
    /* every tile reads W and xf in 16-byte copies (cp.async 16 / TMA, the split's uint4
     * stores): an address off 16 would fault the context (misaligned address), so refuse it */
    if (((uintptr_t)w | (uintptr_t)xf) & 15u)
        return tqkv_fail(TQKV_EINVAL, "%s: w (%p) and xf (%p) must be 16-byte aligned", fn, w, xf);
    if (!gemm_device_ready()) /* before any launch on this device */
        return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: gemm: the device refused the tiles' shared memory");
    return TQKV_OK;
}

/* gemm_check, then the activations' split of x [T, K] into xf; 0 or the failure. */
static tqkv_status gemm_begin(const char *fn, const float *x, size_t ldx, int T, const void *w,
                              int N, int K, const float *y, void *xf, int parts, cudaStream_t s) {
    if (!x) return tqkv_fail(TQKV_EINVAL, "%s: x is NULL", fn);
    const tqkv_status st = gemm_check(fn, T, w, N, K, y, xf, parts);
    if (st) return st;
    const size_t n8 = (size_t)T * (size_t)(K / 8);
    gemm_split_kernel<<<(unsigned)((n8 + 255) / 256), 256, 0, s>>>(x, ldx, T, K, parts, (uint4 *)xf);
    return TQKV_OK;
}

static tqkv_status gemm_launched(void) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: gemm: %s", cudaGetErrorString(e));
    return TQKV_OK;
}

/* The grouped GEMM's s8n with 8 stages instead of 16 (24 instead of 48 KB of shared memory:
 * nine CTAs an SM instead of four, so a one-token expert layer's CTAs fit one wave). The same
 * copies and mmas: the same bits. On an H100 (session 21) the one-row Qwen3-30B-A3B step took
 * 576 us against 600 with 16 stages (traced), 1,636 / 1,638 against 1,584 / 1,554 tokens/s;
 * 8 rows the same. TQKV_GROUPED_ST8=0 (A/B) keeps the 16 stages. */
static env_switch g_grouped_st8 = ENV_SWITCH("TQKV_GROUPED_ST8");

/* The grouped tile launch on split activations xb [parts, T, K]. */
static tqkv_status grouped_launch(const uint16_t *xb, int T, const uint16_t *w, size_t wstride,
                                  int N, int K, float *y, size_t ldy, const int32_t *groups, int G,
                                  int max_rows, int parts, int pdl, cudaStream_t s,
                                  const gemm_epi &ep = gemm_epi{}) {
    const int4 *gr = (const int4 *)groups;
    const int sh = shape_pick(max_rows, N, parts, 0); /* no grouped warpgroup tile */
    if (sh == SH_S8N && env_switch_get(&g_grouped_st8)) {
        if (parts == 1) launch_grouped<1, 1, 1, 1, 1, 8>(s, xb, T, K, w, wstride, N, y, ldy, gr, G, max_rows, pdl, ep);
        else launch_grouped<1, 1, 1, 1, 2, 8>(s, xb, T, K, w, wstride, N, y, ldy, gr, G, max_rows, pdl, ep);
        return gemm_launched();
    }
#define X(id, wm, wn, mt, nt, p, st)                                                                \
    if (sh == id && parts == p) launch_grouped<wm, wn, mt, nt, p, st>(s, xb, T, K, w, wstride, N, y, ldy, gr, G, max_rows, pdl, ep);
    GEMM_SHAPES(X, 1)
    GEMM_SHAPES(X, 2)
    GEMM_SHAPES_P1(X)
#undef X
    return gemm_launched();
}

static tqkv_status grouped_check(const char *fn, int T, const int32_t *groups, int G, int max_rows,
                                 size_t wstride) {
    if (!groups || G < 1 || max_rows < 1 || max_rows > T)
        return tqkv_fail(TQKV_EINVAL, "%s: bad groups (G %d, max rows %d of %d)", fn, G, max_rows, T);
    if (wstride % 8) /* each matrix 16-byte aligned, as gemm_check wants of w */
        return tqkv_fail(TQKV_EINVAL, "%s: wstride %zu is not a multiple of 8", fn, wstride);
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_gemm_grouped(const float *x, size_t ldx, int T, const uint16_t *w,
                                              size_t wstride, int N, int K, float *y, size_t ldy,
                                              const int32_t *groups, int G, int max_rows, void *xf,
                                              int parts, void *stream) {
    const cudaStream_t s = (cudaStream_t)stream;
    tqkv_status st = grouped_check("tqkv_cuda_gemm_grouped", T, groups, G, max_rows, wstride);
    if (!st) st = gemm_begin("tqkv_cuda_gemm_grouped", x, ldx, T, w, N, K, y, xf, parts, s);
    return st ? st : grouped_launch((const uint16_t *)xf, T, w, wstride, N, K, y, ldy, groups, G,
                                    max_rows, parts, 0, s);
}

extern "C" tqkv_status tqkv_cuda_gemm_grouped_presplit(int T, const uint16_t *w, size_t wstride,
                                                       int N, int K, float *y, size_t ldy,
                                                       const int32_t *groups, int G, int max_rows,
                                                       const void *xf, int parts, int pdl,
                                                       void *stream) {
    const char *fn = "tqkv_cuda_gemm_grouped_presplit";
    tqkv_status st = grouped_check(fn, T, groups, G, max_rows, wstride);
    if (!st) st = gemm_check(fn, T, w, N, K, y, xf, parts);
    return st ? st : grouped_launch((const uint16_t *)xf, T, w, wstride, N, K, y, ldy, groups, G,
                                    max_rows, parts, pdl, (cudaStream_t)stream);
}

extern "C" tqkv_status tqkv_cuda_gemm_grouped_act(const float *x, size_t ldx, int T,
                                                  const uint16_t *w, size_t wstride, int N, int K,
                                                  const tqkv_gemm_act *a, const int32_t *groups,
                                                  int G, int max_rows, void *xf, int parts, int pdl,
                                                  void *stream) {
    const char *fn = "tqkv_cuda_gemm_grouped_act";
    const cudaStream_t s = (cudaStream_t)stream;
    if (!a || !a->h || (a->act != TQKV_GEMM_ACT_SILU && a->act != TQKV_GEMM_ACT_GELU) || N % 16 ||
        a->ldh < (size_t)N / 2 || (a->hf && a->ldh != (size_t)N / 2) || ((uintptr_t)a->hf & 15u))
        return tqkv_fail(TQKV_EINVAL, "%s: bad activation (N %d must be a multiple of 16, ldh >= "
                         "N / 2, == N / 2 with a 16-byte aligned split)", fn, N);
    tqkv_status st = grouped_check(fn, T, groups, G, max_rows, wstride);
    if (!st) st = x ? gemm_begin(fn, x, ldx, T, w, N, K, a->h, xf, parts, s)
                    : gemm_check(fn, T, w, N, K, a->h, xf, parts);
    const gemm_epi ep = {a->act, a->h, a->ldh, (uint16_t *)a->hf, (size_t)T * (N / 2), 0, parts};
    return st ? st : grouped_launch((const uint16_t *)xf, T, w, wstride, N, K, nullptr, 0, groups,
                                    G, max_rows, parts, pdl, s, ep);
}

/* The tile launch on split activations xb [parts, T, K]. */
static tqkv_status gemm_launch(const uint16_t *xb, int T, const uint16_t *w, int N, int K,
                               const float *bias, float *y, size_t ldy, int parts, int pdl,
                               cudaStream_t s) {
    int sh = shape_pick(T, N, parts, 1);
#ifdef TQKV_CUDA_SM90A
    bool done = false;
#define X(id, bn, p, st, cl)                                                                       \
    if (!done && sh == id && parts == p) done = launch_tma<bn, p, st, cl>(s, xb, T, K, w, N, bias, y, ldy, pdl);
    GEMM_TMA_SHAPES(X)
    if (!done && sh == SH_CXL) {
        sh = SH_TXL; /* cxl refused (odd weight tiles, no cluster fits, no map): txl */
        GEMM_TMA_SHAPES(X)
    }
#undef X
#define X(id, nw, p, st)                                                                           \
    if (!done && sh == id && parts == p)                                                           \
        done = launch_st<nw, p, st>(s, xb, T, K, w, N, bias, y, ldy, pdl);
    GEMM_ST_SHAPES(X)
#undef X
    if (!done && sh == SH_S8T) sh = SH_S8N; /* no map: the same bits */
    if (done) return gemm_launched();
    sh = sh == SH_TL ? SH_WL : sh == SH_TXL ? SH_WXL : sh; /* no map (no encoder): the same bits */
#endif
#define X(id, wm, wn, mt, nt, p, st)                                                                \
    if (sh == id && parts == p) launch<wm, wn, mt, nt, p, st>(s, xb, T, K, w, N, bias, y, ldy, pdl);
    GEMM_SHAPES(X, 1)
    GEMM_SHAPES(X, 2)
    GEMM_SHAPES_P1(X)
#undef X
#ifdef TQKV_CUDA_SM90A
#define X(id, bn, p, st)                                                                           \
    if (sh == id && parts == p) launch_wg<bn, p, st>(s, xb, T, K, w, N, bias, y, ldy, pdl);
    GEMM_WG_SHAPES(X)
#undef X
#endif
    return gemm_launched();
}

extern "C" tqkv_status tqkv_cuda_gemm(const float *x, size_t ldx, int T, const uint16_t *w, int N,
                                      int K, const float *bias, float *y, size_t ldy, void *xf,
                                      int parts, void *stream) {
    const cudaStream_t s = (cudaStream_t)stream;
    const tqkv_status st = gemm_begin("tqkv_cuda_gemm", x, ldx, T, w, N, K, y, xf, parts, s);
    return st ? st : gemm_launch((const uint16_t *)xf, T, w, N, K, bias, y, ldy, parts, 0, s);
}

extern "C" tqkv_status tqkv_cuda_gemm_presplit(int T, const uint16_t *w, int N, int K,
                                               const float *bias, float *y, size_t ldy,
                                               const void *xf, int parts, int pdl, void *stream) {
    const tqkv_status st = gemm_check("tqkv_cuda_gemm_presplit", T, w, N, K, y, xf, parts);
    return st ? st : gemm_launch((const uint16_t *)xf, T, w, N, K, bias, y, ldy, parts, pdl,
                                 (cudaStream_t)stream);
}
