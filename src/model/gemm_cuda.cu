/*
 * gemm_cuda.cu - the GPU forward's batch-invariant tensor-core GEMM (see gemm_cuda.h for
 * the contract and the reduction order).
 * Owns: the activation split kernel (f32 -> fragment-ordered bf16 hi | lo), the mma
 * kernel (direct or per-segment partials) and the partials' fold.
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
#include <stdint.h>

extern "C" {
#include "util/common.h"
}
#include "model/gemm_cuda.h"

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
            mma16816(acc[m][j], wa[m].x, wb[m].x, wa[m].y, wb[m].y, xh.x, xh.y);
            mma16816(acc[m][j], wa[m].x, wb[m].x, wa[m].y, wb[m].y, xl.x, xl.y);
            mma16816(acc[m][j], wa[m].z, wb[m].z, wa[m].w, wb[m].w, xh.z, xh.w);
            mma16816(acc[m][j], wa[m].z, wb[m].z, wa[m].w, wb[m].w, xl.z, xl.w);
        }
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
    /* C fragment: tot[m][j][0] = (column n0 + 16 m + g, token 8 (tile0 + j) + 2c), [1] the
     * next token, [2] / [3] the same for column + 8 */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int n = n0 + 16 * m + g + (q >> 1) * 8, t = (tile0 + j) * 8 + 2 * c + (q & 1);
                if (n >= N || t >= T) continue;
                if (SPLIT) part[((size_t)blockIdx.z * T + t) * N + n] = tot[m][j][q];
                else y[(size_t)t * ldy + n] = bias ? tot[m][j][q] + bias[n] : tot[m][j][q];
            }
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

template <int MT, int NT, int U, bool SPLIT>
static void launch(cudaStream_t s, unsigned gx, unsigned gz, const uint4 *xf, int T, int K,
                   const uint16_t *w, int N, const float *bias, float *y, size_t ldy, float *part) {
    const dim3 grid(gx, (unsigned)((N + GEMM_COLS(MT) - 1) / GEMM_COLS(MT)), gz);
    gemm_tc_kernel<MT, NT, U, SPLIT><<<grid, GEMM_THREADS, 0, s>>>(xf, T, K, w, N, bias, y, ldy, part);
}

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
    gemm_split_kernel<<<(unsigned)((total + 255) / 256), 256, 0, s>>>(x, ldx, T, K, nblk, total, xf);
    /* one token tile: 16 columns per warp (more CTAs); more tiles: 32 (each activation
     * fragment feeds two weight tiles). Neither changes a row's arithmetic. */
    if (T <= GEMM_CUDA_SPLIT_T && nseg > 1) {
        if (!part) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm: T %d needs the partials buffer", T);
        const unsigned z = (unsigned)nseg;
        if (ntiles == 1) launch<1, 1, 4, true>(s, 1, z, xf, T, K, w, N, bias, y, ldy, part);
        else if (ntiles == 2) launch<2, 2, 2, true>(s, 1, z, xf, T, K, w, N, bias, y, ldy, part);
        else launch<2, 4, 2, true>(s, 1, z, xf, T, K, w, N, bias, y, ldy, part);
        const size_t tn = (size_t)T * N;
        gemm_fold_kernel<<<(unsigned)((tn + 255) / 256), 256, 0, s>>>(part, nseg, T, N, bias, y, ldy);
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
