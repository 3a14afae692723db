/*
 * gemm_cuda.cu - the GPU forward's batch-invariant tensor-core GEMM (see gemm_cuda.h for
 * the contract and the reduction order).
 * Owns: the activation split kernel (f32 -> fragment-ordered bf16 hi | lo), the mma
 * kernel (direct or per-segment partials), the partials' fold, and the tiled kernel for
 * many tokens (shared-memory stages, the same arithmetic).
 * Must not: choose a split, tile or order of additions from T for one output's arithmetic.
 *
 * Shapes. A CTA is GEMM_CG x GEMM_CUDA_KW warps: GEMM_CG column groups of MT x 16 output
 * columns (the mma's M = 16 rows are 16 weight rows), each shared by GEMM_CUDA_KW warps
 * that take alternate k32 blocks; NT token tiles of 8 (the mma's N = 8 columns are 8
 * tokens). Per k32 block, thread (g, c) = (lane / 4, lane % 4) loads 16 bytes of weight
 * rows g and g + 8 at k = 8c .. 8c + 7 and the same k of token g's hi and lo parts: mma
 * step 0 takes k 8c .. 8c + 3, step 1 k 8c + 4 .. 8c + 7 (a fixed permutation of k inside
 * the block, the same for A and B, so every product is formed once).
 * Activations: xf [tiles, k32 blocks, 32 lanes, {hi 8 x bf16, lo 8 x bf16}] (32 bytes per
 * lane: one coalesced 1 KiB read per warp, cached in L1 for the CTA's other warps).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" {
#include "util/common.h"
}
#include "model/ops/gemm_cuda.h"

#define GEMM_THREADS 256                           /* 8 warps */
#define GEMM_CG (GEMM_THREADS / 32 / GEMM_CUDA_KW) /* column groups per CTA */
#define GEMM_BPS (GEMM_CUDA_SEG / 32)              /* k32 blocks per segment */

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* xf[(tile * nblk + b) * 32 + lane] = {hi, lo} of x[tile * 8 + lane / 4][b * 32 + 8 (lane % 4)
 * + 0..7] (zeros past T or K). One thread per (tile, block, lane). */
__global__ void gemm_split_kernel(const float *__restrict__ x, size_t ldx, int T, int K, int nblk,
                                  size_t total, uint4 *__restrict__ xf) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int lane = (int)(i & 31);
    const size_t tb = i >> 5;
    const int b = (int)(tb % (size_t)nblk);
    const size_t tile = tb / (size_t)nblk;
    const size_t t = tile * 8 + (size_t)(lane >> 2);
    const int k = b * 32 + 8 * (lane & 3);
    float v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (t < (size_t)T && k < K) {
        const float4 a = *reinterpret_cast<const float4 *>(x + t * ldx + k);
        const float4 c = *reinterpret_cast<const float4 *>(x + t * ldx + k + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
    }
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const __nv_bfloat16 h0 = __float2bfloat16_rn(v[2 * j]), h1 = __float2bfloat16_rn(v[2 * j + 1]);
        const __nv_bfloat16 l0 = __float2bfloat16_rn(v[2 * j] - __bfloat162float(h0));
        const __nv_bfloat16 l1 = __float2bfloat16_rn(v[2 * j + 1] - __bfloat162float(h1));
        hi[j] = (uint32_t)__bfloat16_as_ushort(h0) | ((uint32_t)__bfloat16_as_ushort(h1) << 16);
        lo[j] = (uint32_t)__bfloat16_as_ushort(l0) | ((uint32_t)__bfloat16_as_ushort(l1) << 16);
    }
    xf[2 * i] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    xf[2 * i + 1] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

/* d += A[16 x 16] . B[16 x 8], bf16 in, f32 accumulate. */
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* One output tile's k32 block, the reduction order's unit (gemm_cuda.h): weight rows g / g + 8
 * at k 8c .. 8c + 7 (wa, wb), token g's hi and lo parts (xh, xl); k16 step 0 then 1, each
 * the hi MMA then the lo MMA. Every kernel adds a block through this. */
__device__ __forceinline__ void mma_k32(float (&d)[4], const uint4 &wa, const uint4 &wb,
                                        const uint4 &xh, const uint4 &xl) {
    mma16816(d, wa.x, wb.x, wa.y, wb.y, xh.x, xh.y);
    mma16816(d, wa.x, wb.x, wa.y, wb.y, xl.x, xl.y);
    mma16816(d, wa.z, wb.z, wa.w, wb.w, xh.z, xh.w);
    mma16816(d, wa.z, wb.z, wa.w, wb.w, xl.z, xl.w);
}

/* One k32 block into acc: per token tile, its hi and lo fragments are loaded once and used
 * by the MT weight tiles; per k16 step the hi MMA, then the lo MMA. */
template <int MT, int NT>
__device__ __forceinline__ void gemm_block(float (&acc)[MT][NT][4], const uint4 (&wa)[MT],
                                           const uint4 (&wb)[MT], const uint4 *__restrict__ xp,
                                           int ntiles_left, size_t tile_stride) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
        if (j >= ntiles_left) break;
        const uint4 xh = __ldg(xp + j * tile_stride), xl = __ldg(xp + j * tile_stride + 1);
#pragma unroll
        for (int m = 0; m < MT; m++) {
            mma_k32(acc[m][j], wa[m], wb[m], xh, xl);
        }
    }
}

/* A warp's C fragments written out: tot[m][j][0] = (column n0 + 16 m + g, token 8 (tile0 + j)
 * + 2c), [1] the next token, [2] / [3] the same for column + 8; rows t >= T and columns
 * n >= N skipped. SPLIT: into partial plane `seg` of part [nseg, T, N] (no bias); else
 * y[t * ldy + n] (+ bias[n]). */
template <int MT, int NT, bool SPLIT>
__device__ __forceinline__ void store_frags(const float (&tot)[MT][NT][4], int n0, int tile0, int g,
                                            int c, int N, int T, const float *__restrict__ bias,
                                            float *__restrict__ y, size_t ldy,
                                            float *__restrict__ part, unsigned seg) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int n = n0 + 16 * m + g + (q >> 1) * 8, t = (tile0 + j) * 8 + 2 * c + (q & 1);
                if (n >= N || t >= T) continue;
                if (SPLIT) part[((size_t)seg * T + t) * N + n] = tot[m][j][q];
                else y[(size_t)t * ldy + n] = bias ? tot[m][j][q] + bias[n] : tot[m][j][q];
            }
}

/* Columns one CTA covers with MT weight tiles of 16 per warp. */
#define GEMM_COLS(MT) (16 * (MT) * GEMM_CG)

/* SPLIT: CTA (0, column block, segment) writes the segment's sums to part [nseg, T, N].
 * Direct: CTA (token-tile group, column block) adds all segments left to right and writes
 * y (+ bias). grid.y = ceil(N / GEMM_COLS(MT)); block GEMM_THREADS. A warp covers MT x 16
 * columns (MT tiles share each activation fragment) and NT x 8 tokens. U: k32 blocks per
 * warp whose weights are loaded before any is used (memory-level parallelism). */
template <int MT, int NT, int U, bool SPLIT>
__global__ void __launch_bounds__(GEMM_THREADS, MT * NT >= 8 ? 1 : 2)
gemm_tc_kernel(const uint4 *__restrict__ xf, int T, int K, const uint16_t *__restrict__ w, int N,
               const float *__restrict__ bias, float *__restrict__ y, size_t ldy,
               float *__restrict__ part) {
    __shared__ float red[GEMM_CUDA_KW - 1][GEMM_CG][MT * NT * 4][32]; /* warps kw > 0 */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int cg = warp % GEMM_CG, kw = warp / GEMM_CG, g = lane >> 2, c = lane & 3;
    const int nblk = (K + 31) / 32, nseg = (K + GEMM_CUDA_SEG - 1) / GEMM_CUDA_SEG;
    const int ntiles = (T + 7) / 8, tile0 = SPLIT ? 0 : blockIdx.x * NT;
    const int n0 = blockIdx.y * GEMM_COLS(MT) + cg * 16 * MT;
    const uint4 *w0[MT], *w1[MT];
#pragma unroll
    for (int m = 0; m < MT; m++) {
        const int a = n0 + 16 * m + g, b = a + 8;
        w0[m] = reinterpret_cast<const uint4 *>(w + (size_t)(a < N ? a : N - 1) * K);
        w1[m] = reinterpret_cast<const uint4 *>(w + (size_t)(b < N ? b : N - 1) * K);
    }
    const int kq_max = K / 8; /* uint4 per weight row */
    float tot[MT][NT][4];
    const int s_lo = SPLIT ? blockIdx.z : 0, s_hi = SPLIT ? blockIdx.z + 1 : nseg;
    for (int s = s_lo; s < s_hi; s++) {
        float acc[MT][NT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
        const int b_end = min(nblk, (s + 1) * GEMM_BPS);
        for (int b = s * GEMM_BPS + kw; b < b_end; b += U * GEMM_CUDA_KW) {
            uint4 wa[U][MT], wb[U][MT]; /* weights first: the DRAM stream; x comes from L1 / L2 */
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int bb = b + u * GEMM_CUDA_KW, kq = bb * 4 + c;
                const bool ok = bb < b_end && kq < kq_max;
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    wa[u][m] = ok ? __ldg(w0[m] + kq) : make_uint4(0, 0, 0, 0);
                    wb[u][m] = ok ? __ldg(w1[m] + kq) : make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int bb = b + u * GEMM_CUDA_KW;
                if (bb < b_end)
                    gemm_block<MT, NT>(acc, wa[u], wb[u], xf + (((size_t)tile0 * nblk + bb) * 32 + lane) * 2,
                                       ntiles - tile0, (size_t)nblk * 64);
            }
        }
        /* the segment's sum: warp kw = 0's, + kw = 1's, ... in warp order; then the running
         * total over segments, left to right */
        constexpr int NR = MT * NT * 4;
        float *af = &acc[0][0][0], *tf = &tot[0][0][0];
        if (kw > 0)
#pragma unroll
            for (int r = 0; r < NR; r++) red[kw - 1][cg][r][lane] = af[r];
        __syncthreads();
        if (kw == 0)
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float v = af[r];
#pragma unroll
                for (int i = 0; i < GEMM_CUDA_KW - 1; i++) v = v + red[i][cg][r][lane];
                tf[r] = s == s_lo ? v : tf[r] + v;
            }
        __syncthreads();
    }
    if (kw != 0) return;
    store_frags<MT, NT, SPLIT>(tot, n0, tile0, g, c, N, T, bias, y, ldy, part, blockIdx.z);
}

// ---------------------------------------------------------------------------
// the tiled kernel (T >= GEMM_CUDA_TILED_T: prefill, verification windows, big batches;
// and, per segment, 17 <= T <= 32: decode of many rows)
// ---------------------------------------------------------------------------
/* The same arithmetic as gemm_tc_kernel, staged through shared memory. A CTA of WC x WT
 * warps (WC across columns, WT across tokens) covers 32 WC columns x 4 WT token tiles; a
 * warp GT_MT = 2 weight tiles x GT_NT = 4 token tiles (32 x 32). Every k32 block is read by
 * all the CTA's warps from a pipeline stage of four (cp.async, ST stages; one barrier per
 * stage: staging one block a stage was measured 4-7% slower), and a warp keeps the four
 * accumulators that gemm_tc_kernel's GEMM_CUDA_KW warps keep: block b of a segment goes to
 * acc[b % 4] (segments start at multiples of 32 blocks, so b % 4 is the warp kw that takes
 * b there), in ascending order, hi then lo per k16 step, and a segment ends with ((acc0 +
 * acc1) + acc2) + acc3, added to the running total left to right (SPLIT: written as the
 * segment's partial for gemm_fold_kernel, as gemm_tc_kernel's SPLIT does): the reduction
 * order of gemm_cuda.h, so a row's outputs are bitwise those of the other paths.
 * Stage layout per block: W [32 WC rows][32 k] bf16 (64 bytes a row: a warp's 16-byte
 * fragment reads of one weight tile are 512 contiguous bytes), X [4 WT tiles][hi: 32 lanes x
 * 16 B | lo: 32 x 16 B] (xf's tile-block with hi and lo apart, so both reads are contiguous). */
#define GT_MT 2
#define GT_NT 4
#define GT_SB 4 /* k32 blocks per pipeline stage (a barrier per four) */
static_assert(GEMM_CUDA_KW == 4 && GEMM_BPS % GT_SB == 0 && GT_SB == 4,
              "acc[b % 4] is the warp gemm_tc_kernel gives b; a stage holds one block of each");

template <int WC, int WT, int ST, bool SPLIT> struct Tiled {
    static constexpr int THREADS = 32 * WC * WT;
    static constexpr int COLS = 16 * GT_MT * WC, TILES = GT_NT * WT;
    static constexpr int WBYTES = COLS * 64, XBYTES = TILES * 1024, BLOCK = WBYTES + XBYTES;
    static constexpr int SMEM = ST * GT_SB * BLOCK;
    static constexpr int WCH = COLS * 4 / THREADS, XCH = TILES * 64 / THREADS; /* 16-byte copies */
    static_assert(WCH * THREADS == COLS * 4 && XCH * THREADS == TILES * 64 && ST >= 2, "copy split");
};
using TiledBig = Tiled<4, 2, 3, false>;  /* T >= GEMM_CUDA_TILED_T: 128 x 64, 192 KiB */
using TiledSeg = Tiled<8, 1, 2, true>;   /* 17 <= T <= 32, a CTA per segment: 256 x 32, 160 KiB */

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* grid (ceil(ntiles / TILES), ceil(N / COLS), SPLIT ? nseg : 1), block THREADS, dynamic
 * shared memory SMEM; SPLIT writes part [nseg, T, N]. */
template <int WC, int WT, int ST, bool SPLIT>
__global__ void __launch_bounds__(32 * WC * WT, 1)
gemm_tiled_kernel(const uint4 *__restrict__ xf, int T, int K, const uint16_t *__restrict__ w,
                  int N, const float *__restrict__ bias, float *__restrict__ y, size_t ldy,
                  float *__restrict__ part) {
    using C = Tiled<WC, WT, ST, SPLIT>;
    constexpr int SB = GT_SB;
    extern __shared__ __align__(128) uint8_t sm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int wc = warp % WC, wt = warp / WC;
    const int nblk = (K + 31) / 32, ntiles = (T + 7) / 8, kq_max = K / 8;
    const int tile0 = blockIdx.x * C::TILES, col0 = blockIdx.y * C::COLS;
    /* the blocks this CTA adds: all (segments left to right), or SPLIT segment blockIdx.z's */
    const int bfirst = SPLIT ? (int)blockIdx.z * GEMM_BPS : 0;
    const int bend = SPLIT ? min(nblk, bfirst + GEMM_BPS) : nblk;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(sm);

    /* this thread's copies: weight rows q >> 2 (part q & 3), q = threadIdx.x + THREADS h, and
     * activation tile q >> 6 (its 16-byte unit u = q & 63: lane u >> 1, hi / lo u & 1) */
    const uint16_t *wsrc[C::WCH];
    const uint4 *xsrc[C::XCH];
    uint32_t wdst[C::WCH], xdst[C::XCH], xok[C::XCH];
    int wpart[C::WCH];
#pragma unroll
    for (int h = 0; h < C::WCH; h++) {
        const int q = threadIdx.x + C::THREADS * h, row = q >> 2, n = col0 + row;
        wpart[h] = q & 3;
        wsrc[h] = w + (size_t)(n < N ? n : N - 1) * K + 8 * wpart[h];
        wdst[h] = (uint32_t)(row * 64 + 16 * wpart[h]);
    }
#pragma unroll
    for (int h = 0; h < C::XCH; h++) {
        const int q = threadIdx.x + C::THREADS * h, tile = q >> 6, u = q & 63;
        xok[h] = tile0 + tile < ntiles;
        xsrc[h] = xf + ((size_t)(xok[h] ? tile0 + tile : 0) * nblk) * 64 + u;
        xdst[h] = (uint32_t)(C::WBYTES + tile * 1024 + (u & 1) * 512 + (u >> 1) * 16);
    }
    /* block b's place: stage i = (b - bfirst) / SB, at (i % ST, its (b - bfirst) % SB-th part) */
    auto slot = [&](int b) {
        const int l = b - bfirst;
        return (((l / SB) % ST) * SB + l % SB) * C::BLOCK;
    };
    auto load_stage = [&](int i) { /* stage i's copies (none past bend), one commit group */
#pragma unroll
        for (int r = 0; r < SB; r++) {
            const int b = bfirst + SB * i + r;
            if (b < bend) {
                const uint32_t st = sbase + (uint32_t)slot(b);
#pragma unroll
                for (int h = 0; h < C::WCH; h++) {
                    const bool ok = 4 * b + wpart[h] < kq_max; /* k past K: zeros */
                    cp_async16(st + wdst[h], ok ? (const void *)(wsrc[h] + (size_t)32 * b) : (const void *)w,
                               ok ? 16u : 0u);
                }
#pragma unroll
                for (int h = 0; h < C::XCH; h++)
                    cp_async16(st + xdst[h], xok[h] ? (const void *)(xsrc[h] + (size_t)64 * b) : (const void *)xf,
                               xok[h] ? 16u : 0u);
            }
        }
        cp_async_commit();
    };

    float acc[4][GT_MT][GT_NT][4], tot[GT_MT][GT_NT][4];
#pragma unroll
    for (int i = 0; i < ST - 1; i++) load_stage(i);
    bool first = true;
    for (int b0 = bfirst; b0 < bend; b0 += SB) {
        if (b0 % GEMM_BPS == 0)
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int m = 0; m < GT_MT; m++)
#pragma unroll
                    for (int j = 0; j < GT_NT; j++)
#pragma unroll
                        for (int q = 0; q < 4; q++) acc[r][m][j][q] = 0.f;
        cp_async_wait<ST - 2>(); /* this stage has landed (this thread's copies) */
        __syncthreads();         /* ... everyone's, and the previous stage's slot is free */
        load_stage((b0 - bfirst) / SB + ST - 1);
#pragma unroll
        for (int r = 0; r < SB; r++) {
            const int b = b0 + r;
            if (b >= bend) break;
            const uint8_t *ws = sm + slot(b), *xs = ws + C::WBYTES;
            uint4 wa[GT_MT], wb[GT_MT];
#pragma unroll
            for (int m = 0; m < GT_MT; m++) {
                const int row = wc * 16 * GT_MT + 16 * m + g;
                wa[m] = *reinterpret_cast<const uint4 *>(ws + row * 64 + 16 * c);
                wb[m] = *reinterpret_cast<const uint4 *>(ws + (row + 8) * 64 + 16 * c);
            }
#pragma unroll
            for (int j = 0; j < GT_NT; j++) {
                const uint8_t *xt = xs + (wt * GT_NT + j) * 1024 + 16 * lane;
                const uint4 xh = *reinterpret_cast<const uint4 *>(xt);
                const uint4 xl = *reinterpret_cast<const uint4 *>(xt + 512);
#pragma unroll
                for (int m = 0; m < GT_MT; m++) mma_k32(acc[r][m][j], wa[m], wb[m], xh, xl);
            }
        }
        if ((b0 + SB) % GEMM_BPS == 0 || b0 + SB >= bend) { /* the segment ends */
#pragma unroll
            for (int m = 0; m < GT_MT; m++)
#pragma unroll
                for (int j = 0; j < GT_NT; j++)
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        float v = acc[0][m][j][q];
                        v = v + acc[1][m][j][q];
                        v = v + acc[2][m][j][q];
                        v = v + acc[3][m][j][q];
                        tot[m][j][q] = first ? v : tot[m][j][q] + v;
                    }
            first = false;
        }
    }
    cp_async_wait<0>();
    store_frags<GT_MT, GT_NT, SPLIT>(tot, col0 + wc * 16 * GT_MT, tile0 + wt * GT_NT, g, c, N, T,
                                     bias, y, ldy, part, blockIdx.z);
}

/* y[t, n] = ((part[0] + part[1]) + ...) (+ bias), part [nseg, T, N]. */
__global__ void gemm_fold_kernel(const float *__restrict__ part, int nseg, int T, int N,
                                 const float *__restrict__ bias, float *__restrict__ y, size_t ldy) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * N) return;
    const size_t t = i / (size_t)N, n = i % (size_t)N, plane = (size_t)T * N;
    float v = part[i];
    for (int s = 1; s < nseg; s++) v = v + part[s * plane + i];
    y[t * ldy + n] = bias ? v + bias[n] : v;
}

// ---------------------------------------------------------------------------
// host
// ---------------------------------------------------------------------------

extern "C" size_t tqkv_cuda_gemm_xf_bytes(size_t T, size_t kmax) {
    return ((T + 7) / 8) * ((kmax + 31) / 32) * 32 * 32;
}

extern "C" size_t tqkv_cuda_gemm_part_bytes(size_t nmax, size_t kmax) {
    const size_t nseg = (kmax + GEMM_CUDA_SEG - 1) / GEMM_CUDA_SEG;
    return nseg > 1 ? nseg * GEMM_CUDA_SPLIT_T * nmax * sizeof(float) : 0;
}

/* Whether the tiled kernel runs (T >= GEMM_CUDA_TILED_T, and segment by segment for
 * GEMM_CUDA_SEG_TILED_T <= T <= GEMM_CUDA_SPLIT_T): yes, unless TQKV_GEMM_TILED=0 in the
 * environment (an A/B against gemm_tc_kernel in one binary: `tqkv bench gemm`) or the device
 * refuses its shared memory. Decided once per process, at the first tqkv_cuda_gemm call,
 * before that call launches anything (so clearing a refused attribute's error clears no
 * launch's). A model state's first call is never inside a graph capture (a decode step is
 * captured only once its key has run directly); setting a function attribute is not a
 * stream operation in any case. For the device current then: a process driving several
 * GPUs will need it per device. */
static pthread_once_t g_tiled_once = PTHREAD_ONCE_INIT;
static int g_tiled;
template <class C, class F> static bool tiled_setup(F *fn) {
    if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM) == cudaSuccess)
        return true;
    (void)cudaGetLastError();
    return false;
}
static void tiled_init(void) {
    const char *e = getenv("TQKV_GEMM_TILED");
    g_tiled = !(e && e[0] == '0') &&
              tiled_setup<TiledBig>(gemm_tiled_kernel<4, 2, 3, false>) &&
              tiled_setup<TiledSeg>(gemm_tiled_kernel<8, 1, 2, true>);
}
static int tiled_on(void) {
    pthread_once(&g_tiled_once, tiled_init);
    return g_tiled;
}

template <class C, int WC, int WT, int ST, bool SPLIT>
static void launch_tiled(cudaStream_t s, unsigned gz, const uint4 *xf, int T, int K, const uint16_t *w,
                         int N, const float *bias, float *y, size_t ldy, float *part) {
    const dim3 grid((unsigned)(((T + 7) / 8 + C::TILES - 1) / C::TILES), (unsigned)((N + C::COLS - 1) / C::COLS), gz);
    gemm_tiled_kernel<WC, WT, ST, SPLIT><<<grid, C::THREADS, C::SMEM, s>>>(xf, T, K, w, N, bias, y, ldy, part);
}

template <int MT, int NT, int U, bool SPLIT>
static void launch(cudaStream_t s, unsigned gx, unsigned gz, const uint4 *xf, int T, int K,
                   const uint16_t *w, int N, const float *bias, float *y, size_t ldy, float *part) {
    const dim3 grid(gx, (unsigned)((N + GEMM_COLS(MT) - 1) / GEMM_COLS(MT)), gz);
    gemm_tc_kernel<MT, NT, U, SPLIT><<<grid, GEMM_THREADS, 0, s>>>(xf, T, K, w, N, bias, y, ldy, part);
}

extern "C" int tqkv_cuda_gemm_tiled(void) { return tiled_on(); }

extern "C" tqkv_status tqkv_cuda_gemm(const float *x, size_t ldx, int T, const uint16_t *w, int N,
                                      int K, const float *bias, float *y, size_t ldy, void *xf_,
                                      float *part, void *stream) {
    if (!x || !w || !y || !xf_ || T < 1 || N < 1 || K < 8 || K % 8)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm: bad argument (T %d, N %d, K %d)", T, N, K);
    uint4 *xf = (uint4 *)xf_;
    const int nblk = (K + 31) / 32, nseg = (K + GEMM_CUDA_SEG - 1) / GEMM_CUDA_SEG;
    const int ntiles = (T + 7) / 8;
    const size_t total = (size_t)ntiles * nblk * 32;
    const cudaStream_t s = (cudaStream_t)stream;
    const int tiled = tiled_on(); /* before any launch (above) */
    gemm_split_kernel<<<(unsigned)((total + 255) / 256), 256, 0, s>>>(x, ldx, T, K, nblk, total, xf);
    /* one token tile: 16 columns per warp (more CTAs); more tiles: 32 (each activation
     * fragment feeds two weight tiles). Neither changes a row's arithmetic. */
    if (T <= GEMM_CUDA_SPLIT_T && nseg > 1) {
        if (!part) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm: T %d needs the partials buffer", T);
        const unsigned z = (unsigned)nseg;
        if (T >= GEMM_CUDA_SEG_TILED_T && tiled)
            launch_tiled<TiledSeg, 8, 1, 2, true>(s, z, xf, T, K, w, N, bias, y, ldy, part);
        else if (ntiles == 1) launch<1, 1, 4, true>(s, 1, z, xf, T, K, w, N, bias, y, ldy, part);
        else if (ntiles == 2) launch<2, 2, 2, true>(s, 1, z, xf, T, K, w, N, bias, y, ldy, part);
        else launch<2, 4, 2, true>(s, 1, z, xf, T, K, w, N, bias, y, ldy, part);
        const size_t tn = (size_t)T * N;
        gemm_fold_kernel<<<(unsigned)((tn + 255) / 256), 256, 0, s>>>(part, nseg, T, N, bias, y, ldy);
    } else if (T >= GEMM_CUDA_TILED_T && tiled) {
        launch_tiled<TiledBig, 4, 2, 3, false>(s, 1, xf, T, K, w, N, bias, y, ldy, nullptr);
    } else if (ntiles == 1) {
        launch<1, 1, 4, false>(s, 1, 1, xf, T, K, w, N, bias, y, ldy, part);
    } else if (ntiles == 2) {
        launch<2, 2, 2, false>(s, 1, 1, xf, T, K, w, N, bias, y, ldy, part);
    } else {
        launch<2, 4, 2, false>(s, (unsigned)((ntiles + 3) / 4), 1, xf, T, K, w, N, bias, y, ldy, part);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: gemm: %s", cudaGetErrorString(e));
    return TQKV_OK;
}
