/*
 * gemm_cuda.cu - the GPU forward's batch-invariant tensor-core GEMM (see gemm_cuda.h for
 * the contract and the reduction order).
 * Owns: the activation kernel (f32 -> bf16 parts [parts, T, K]), the tiled mma kernel
 * (cp.async pipeline, swizzled shared memory, ldmatrix), its tile shapes and their pick,
 * and the skinny kernel for T <= 8 (one warp a CTA, bulk copies into a deep pipeline).
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
#include "model/ops/gemm_cuda.h"

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
        const __nv_bfloat16 h0 = __float2bfloat16_rn(v[2 * j]), h1 = __float2bfloat16_rn(v[2 * j + 1]);
        const __nv_bfloat16 l0 = __float2bfloat16_rn(v[2 * j] - __bfloat162float(h0));
        const __nv_bfloat16 l1 = __float2bfloat16_rn(v[2 * j + 1] - __bfloat162float(h1));
        hi[j] = (uint32_t)__bfloat16_as_ushort(h0) | ((uint32_t)__bfloat16_as_ushort(h1) << 16);
        lo[j] = (uint32_t)__bfloat16_as_ushort(l0) | ((uint32_t)__bfloat16_as_ushort(l1) << 16);
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

/* One stage: W rows n0 .. n0 + BM and the tokens' parts t0 .. t0 + BN at k 64 kt .. 64 kt +
 * 63 into slot `st` (zeros past N, T or K). */
template <class C, int P>
__device__ __forceinline__ void gemm_load(uint32_t st, const uint16_t *__restrict__ w, int N,
                                          const uint16_t *__restrict__ xb, int T, int K, int n0,
                                          int t0, int kt) {
    const int kc = K / 8;
#pragma unroll
    for (int h = 0; h < C::WCP; h++) {
        const int q = threadIdx.x + C::THREADS * h, r = q >> 3, c = q & 7, n = n0 + r, kq = kt * 8 + c;
        const bool ok = n < N && kq < kc;
        cp_async16(st + swz(r, c), ok ? (const void *)(w + (size_t)n * K + 8 * kq) : (const void *)w,
                   ok ? 16u : 0u);
    }
#pragma unroll
    for (int p = 0; p < P; p++)
#pragma unroll
        for (int h = 0; h < C::XCP; h++) {
            const int q = threadIdx.x + C::THREADS * h, r = q >> 3, c = q & 7, t = t0 + r, kq = kt * 8 + c;
            const bool ok = t < T && kq < kc;
            const uint16_t *src = xb + ((size_t)p * T + t) * K + 8 * kq;
            cp_async16(st + C::WBYTES + p * C::XBYTES + swz(r, c), ok ? (const void *)src : (const void *)xb,
                       ok ? 16u : 0u);
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

/* grid (ceil(T / BN), ceil(N / BM)), block THREADS, dynamic shared memory SMEM.
 * y[t * ldy + n] = acc (+ bias[n]). */
template <int WM, int WN, int MT, int NT, int P, int ST>
__global__ void __launch_bounds__(32 * WM * WN)
gemm_kernel(const uint16_t *__restrict__ xb, int T, int K, const uint16_t *__restrict__ w, int N,
            const float *__restrict__ bias, float *__restrict__ y, size_t ldy) {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(sm);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrow = (warp % WM) * 16 * MT, wtok = (warp / WM) * 8 * NT;
    const int t0 = blockIdx.x * C::BN, n0 = blockIdx.y * C::BM, nk = (K + 63) / 64;
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < nk) gemm_load<C, P>(sbase + s * C::STAGE, w, N, xb, T, K, n0, t0, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<ST - 2>(); /* stage kt has landed (this thread's copies) */
        __syncthreads();         /* ... everyone's, and stage kt - 1's slot is free */
        const int nx = kt + ST - 1;
        if (nx < nk) gemm_load<C, P>(sbase + (nx % ST) * C::STAGE, w, N, xb, T, K, n0, t0, nx);
        cp_async_commit();
        gemm_stage<C, MT, NT, P>(acc, sbase + (kt % ST) * C::STAGE, wrow, wtok, lane);
    }
    cp_async_wait<0>();
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

// ---------------------------------------------------------------------------
// the skinny kernel (decode, T <= 8): one warp per CTA streams whole weight rows
// ---------------------------------------------------------------------------

/* Why: at T <= 8 a GEMM is a stream of the weights, and the tiled kernel's CTAs keep too
 * few bytes in flight when N is small (4096 rows are 128 CTAs of 32 rows). Here a CTA is
 * one warp that owns SK rows (16 MT) of W, walks its row blocks (block b, b + grid, ...)
 * and keeps S stages of BK k in flight with bulk copies (cp.async.bulk, one per weight
 * row and per token row, completing on the stage's mbarrier), the stage sequence running
 * on across its row blocks without a drain. The tokens come in as f32 and are split into
 * their bf16 parts in registers with gemm_split_kernel's arithmetic (so no activation
 * kernel runs at T <= 8, and xf is not used).
 * Same arithmetic as gemm_kernel: the same ldmatrix fragments, the weights the mma's A
 * operand and the tokens (8 columns, those past T zero) its B operand, the k16 steps of
 * K in ascending order, hi then lo, 4 ceil(K / 64) steps in all (the steps past K are
 * mma's of zeros, as the tiled kernel's zero-filled tail tiles are), the bias last.
 *
 * Shared memory: S mbarriers (128 bytes), then S stages of [SK rows of W, SK_RB(BK) bytes
 * a row (BK k of bf16 + 16 bytes of pad: ldmatrix's eight rows of one 16-byte chunk fall
 * in distinct banks) | T token rows of f32, SK_XRB(BK) bytes a row (+ 32 bytes of pad: a
 * half-warp's 8-byte reads of four rows fall in distinct banks)]. */
#define SK_BK 256                  /* k per stage (BK, a multiple of 64), unless TQKV_GEMM_SK_BK */
#define SK_RB(bk) (2 * (bk) + 16)  /* bytes per shared-memory weight row */
#define SK_XRB(bk) (4 * (bk) + 32) /* bytes per shared-memory token row (f32) */
#define SK_BAR 128             /* bytes for the mbarriers (S <= 16) */
#define SK_SMAX 16

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/* Until the phase of `parity` completed. A stage's bytes land in microseconds; after 2^26
 * failed tries (seconds) the kernel traps, so a copy that never completes is a launch
 * error the caller sees, not a hung stream. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    for (uint32_t n = 0;; n++) {
        uint32_t done;
        asm volatile("{\n"
                     ".reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n"
                     "}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (done) return;
        if (n == (1u << 26)) __trap();
    }
}
/* bytes (a multiple of 16, both addresses 16-byte aligned) global -> shared, completing on bar */
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar,
                                          uint64_t policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1], %2, [%3], %4;\n" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy)
                 : "memory");
}

/* Stage i of this warp's sequence (row block j = i / nk, k stage i % nk) into slot i % S:
 * lane 0 arms the slot's mbarrier with the stage's bytes, then the lanes issue one bulk
 * copy each per weight row (rows past N are left out: their outputs are never stored) and
 * per token row (f32, twice a weight row's bytes). */
template <int MT, int P>
__device__ __forceinline__ void skinny_issue(int i, uint32_t sbase, int S, int sb, const uint16_t *__restrict__ w,
                                             int N, const float *__restrict__ x, size_t ldx, int T, int K,
                                             int bk, int nk, int rb0, int rbs, int lane, uint64_t pol_w,
                                             uint64_t pol_x) {
    constexpr int SK = 16 * MT;
    const int slot = i % S, j = i / nk, kt = i % nk;
    const int n0 = (rb0 + j * rbs) * SK, k0 = kt * bk;
    const int kn = K - k0 < bk ? K - k0 : bk;
    const int rows = N - n0 < SK ? N - n0 : SK, nc = rows + T;
    const uint32_t bytes = (uint32_t)kn * 2u, bar = sbase + 8u * (uint32_t)slot;
    const uint32_t st = sbase + SK_BAR + (uint32_t)slot * (uint32_t)sb;
    if (lane == 0) mbar_expect_tx(bar, bytes * (uint32_t)(rows + 2 * T));
    __syncwarp();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* the slot's reads are done */
    for (int c = lane; c < nc; c += 32) {
        if (c < rows) bulk_copy(st + (uint32_t)(c * SK_RB(bk)), w + (size_t)(n0 + c) * K + k0, bytes, bar, pol_w);
        else bulk_copy(st + (uint32_t)(SK * SK_RB(bk) + (c - rows) * SK_XRB(bk)), x + (size_t)(c - rows) * ldx + k0,
                       2u * bytes, bar, pol_x);
    }
}

/* Two f32 as the bf16 pair of part 0 (hi) or, P = 2, of both parts: gemm_split_kernel's
 * arithmetic (hi = bf16(v) to nearest even, lo = bf16(v - hi)), its packing (the lower k in
 * the low half, as ldmatrix gives a B fragment from the split kernel's bytes). */
template <int P>
__device__ __forceinline__ void skinny_split(float2 v, uint32_t (&b)[P][2], int half) {
    const __nv_bfloat16 h0 = __float2bfloat16_rn(v.x), h1 = __float2bfloat16_rn(v.y);
    b[0][half] = (uint32_t)__bfloat16_as_ushort(h0) | ((uint32_t)__bfloat16_as_ushort(h1) << 16);
    if (P == 2) {
        const __nv_bfloat16 l0 = __float2bfloat16_rn(v.x - __bfloat162float(h0));
        const __nv_bfloat16 l1 = __float2bfloat16_rn(v.y - __bfloat162float(h1));
        b[P - 1][half] = (uint32_t)__bfloat16_as_ushort(l0) | ((uint32_t)__bfloat16_as_ushort(l1) << 16);
    }
}

/* The fragments of k16 step s of a stage: A of each m tile by ldmatrix; the lane's B
 * values (token g = lane / 4, k 2c, 2c + 1 and 2c + 8, 2c + 9 of the step, c = lane % 4)
 * as f32 from its token row (lanes past T read row T - 1; the caller zeroes them). */
template <int MT>
__device__ __forceinline__ void skinny_frag(uint32_t (&a)[MT][4], float2 (&xv)[2], uint32_t st,
                                            const uint8_t *xs, int s, int lane, int rb) {
#pragma unroll
    for (int m = 0; m < MT; m++) ldsm_x4(a[m], st + (uint32_t)((16 * m + (lane & 15)) * rb + (2 * s + (lane >> 4)) * 16));
    const float2 *r = reinterpret_cast<const float2 *>(xs + 64 * s) + (lane & 3);
    xv[0] = r[0];
    xv[1] = r[4];
}

/* grid: min(row blocks, resident CTAs), block 32, dynamic shared memory SK_BAR + S sb. */
template <int MT, int P>
__global__ void __launch_bounds__(32)
gemm_skinny_kernel(const float *__restrict__ x, size_t ldx, int T, int K, const uint16_t *__restrict__ w, int N,
                   const float *__restrict__ bias, float *__restrict__ y, size_t ldy, int S, int bk) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    constexpr int SK = 16 * MT;
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(sm);
    const int lane = threadIdx.x, rb = SK_RB(bk), sb = SK * rb + T * SK_XRB(bk);
    const int nrb = (N + SK - 1) / SK, rb0 = blockIdx.x, rbs = gridDim.x;
    const int nb = (nrb - rb0 + rbs - 1) / rbs, nk = (K + bk - 1) / bk, total = nb * nk;
    uint64_t pol_w, pol_x; /* weights: streamed once, evict first; activations: every CTA reads them */
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol_w));
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(pol_x));
    if (lane == 0) {
        for (int s = 0; s < S; s++) mbar_init(sbase + 8u * (uint32_t)s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncwarp();
    for (int i = 0; i < S && i < total; i++)
        skinny_issue<MT, P>(i, sbase, S, sb, w, N, x, ldx, T, K, bk, nk, rb0, rbs, lane, pol_w, pol_x);
    const int g = lane >> 2, c = lane & 3;
    const bool tok = g < T; /* this lane's B columns are real tokens */
    const int xrow = (tok ? g : T - 1) * SK_XRB(bk); /* its token row in a stage */
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
    for (int i = 0; i < total; i++) {
        const int slot = i % S, kt = i % nk, k0 = kt * bk;
        const uint32_t st = sbase + SK_BAR + (uint32_t)slot * (uint32_t)sb;
        const uint8_t *xs = sm + SK_BAR + (size_t)slot * sb + SK * rb + xrow;
        mbar_wait(sbase + 8u * (uint32_t)slot, (uint32_t)(i / S) & 1u);
        /* the tiled kernel's steps: 4 per 64 k of the stage, zeros past K */
        const int kn = K - k0 < bk ? K - k0 : bk, ns = 4 * ((kn + 63) / 64);
        uint32_t a[MT][4];
        float2 xv[2];
        skinny_frag<MT>(a, xv, st, xs, 0, lane, rb);
        for (int s = 0; s < ns; s++) {
            uint32_t ca[MT][4], cb[P][2];
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int q = 0; q < 4; q++) ca[m][q] = a[m][q];
            skinny_split<P>(xv[0], cb, 0);
            skinny_split<P>(xv[1], cb, 1);
            if (s + 1 < ns) skinny_frag<MT>(a, xv, st, xs, s + 1, lane, rb); /* ahead of the mma's */
            const int kb = 16 * s;
            const bool lo = kb < kn, hi = kb + 8 < kn; /* k 0..7 and 8..15 of the step inside K */
#pragma unroll
            for (int m = 0; m < MT; m++) {
                if (!lo) ca[m][0] = ca[m][1] = 0u;
                if (!hi) ca[m][2] = ca[m][3] = 0u;
            }
#pragma unroll
            for (int p = 0; p < P; p++) {
                if (!lo || !tok) cb[p][0] = 0u;
                if (!hi || !tok) cb[p][1] = 0u;
            }
#pragma unroll
            for (int p = 0; p < P; p++)
#pragma unroll
                for (int m = 0; m < MT; m++) mma16816(acc[m], ca[m], cb[p][0], cb[p][1]);
        }
        __syncwarp(); /* every lane's reads of the slot are done before it is refilled */
        if (i + S < total)
            skinny_issue<MT, P>(i + S, sbase, S, sb, w, N, x, ldx, T, K, bk, nk, rb0, rbs, lane, pol_w, pol_x);
        if (kt == nk - 1) { /* the row block's outputs, then a fresh sum for the next */
            const int n0 = (rb0 + (i / nk) * rbs) * SK;
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int n = n0 + 16 * m + g + (q >> 1) * 8, t = 2 * c + (q & 1);
                    if (n < N && t < T) y[(size_t)t * ldy + n] = bias ? acc[m][q] + bias[n] : acc[m][q];
                    acc[m][q] = 0.f;
                }
        }
    }
#endif
}

// ---------------------------------------------------------------------------
// host: the tile shapes and their pick
// ---------------------------------------------------------------------------

/* s<8 NT>: decode, 32 weight rows x up to 64 tokens, deep pipelines (the weights stream);
 * m: 64 x 64, four warps; l: prefill, 128 x 128, eight warps of 64 x 32; xl: long prefill,
 * 128 x 256, eight warps of 64 x 64 (half the shared-memory reads per mma; one activation
 * part only: two would leave room for two stages). */
#define GEMM_SHAPES(X, P)                                                                          \
    X(SH_S8, 2, 1, 1, 1, P, 8) X(SH_S16, 2, 1, 1, 2, P, 8) X(SH_S32, 2, 1, 1, 4, P, 8)             \
    X(SH_S64, 2, 1, 1, 8, P, (P == 1 ? 6 : 4)) X(SH_M, 2, 2, 2, 4, P, 4) X(SH_L, 2, 4, 4, 4, P, 4)
#define GEMM_SHAPES_P1(X) X(SH_XL, 2, 4, 4, 8, 1, 4)

enum { SH_S8, SH_S16, SH_S32, SH_S64, SH_M, SH_L, SH_XL, SH_SK, SH_N };
static const char *const g_shape_name[SH_N] = {"s8", "s16", "s32", "s64", "m", "l", "xl", "sk"};

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_sms = 132, g_force = -1, g_ok;
static int g_sk_ok;                                 /* sm_90 and the skinny kernels set up */
static int g_sk_mt, g_sk_stages, g_sk_bk;           /* forced by tqkv_cuda_gemm_set_skinny (0: the pick) */
static int g_sk_bk_env = SK_BK;                     /* TQKV_GEMM_SK_BK (64 .. 1024, a multiple of 64) */
static int bk_ok(int bk) { return bk >= 64 && bk <= 1024 && bk % 64 == 0; }
static size_t g_smem_sm = 228 << 10, g_smem_cta = 227 << 10; /* shared memory per SM, per CTA */

template <int MT, int P> static bool skinny_setup() {
    return cudaFuncSetAttribute(gemm_skinny_kernel<MT, P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)g_smem_cta) == cudaSuccess;
}

template <int WM, int WN, int MT, int NT, int P, int ST> static bool shape_setup() {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    return cudaFuncSetAttribute(gemm_kernel<WM, WN, MT, NT, P, ST>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM) == cudaSuccess;
}

/* Once per process, before the first launch: the kernels' shared memory, the SM count, and
 * TQKV_GEMM_TILE (a shape name: every T takes it, for benchmarks; the bits are the same). */
static void gemm_init(void) {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0)
        g_sms = sms;
    int major = 0, v = 0;
    (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) == cudaSuccess && v > 0)
        g_smem_sm = (size_t)v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && v > 0)
        g_smem_cta = (size_t)v;
    /* the skinny kernel's bulk copies need sm_90; elsewhere T <= 8 keeps s8 (same bits) */
    g_sk_ok = major >= 9 && skinny_setup<1, 1>() && skinny_setup<1, 2>() && skinny_setup<2, 1>() &&
              skinny_setup<2, 2>();
    if (!g_sk_ok) (void)cudaGetLastError();
    bool ok = true;
#define X(id, wm, wn, mt, nt, p, st) ok = ok && shape_setup<wm, wn, mt, nt, p, st>();
    GEMM_SHAPES(X, 1)
    GEMM_SHAPES(X, 2)
    GEMM_SHAPES_P1(X)
#undef X
    g_ok = ok;
    if (!ok) (void)cudaGetLastError();
    const char *b = getenv("TQKV_GEMM_SK_BK");
    if (b && bk_ok(atoi(b))) g_sk_bk_env = atoi(b);
    const char *e = getenv("TQKV_GEMM_TILE");
    for (int i = 0; e && i < SH_N; i++)
        if (!strcmp(e, g_shape_name[i])) g_force = i;
}

/* The shape for T tokens, N outputs and `parts` (xl has one part: l serves two). */
static int shape_pick(int T, int N, int parts) {
    int sh;
    if (g_force >= 0 && !(g_force == SH_SK && (T > GEMM_CUDA_SKINNY_T || !g_sk_ok))) sh = g_force;
    else if (T <= GEMM_CUDA_SKINNY_T && g_sk_ok) sh = SH_SK; /* by T alone: decode streams the weights */
    else if (T <= GEMM_CUDA_SMALL_T) sh = T <= 8 ? SH_S8 : T <= 16 ? SH_S16 : T <= 32 ? SH_S32 : SH_S64;
    /* xl where its 256-token tiles still about fill the GPU (H200: 1.2-1.3x l's speed at
     * T >= 512 when they do, slower when they leave SMs idle; bench/RESULTS.md "GPU, session
     * 4"); test_gemm checked it bitwise against every other shape on an H100 (session 5). */
    else if (parts == 1 && 10L * ((T + 255) / 256) * ((N + 127) / 128) >= 7L * g_sms) sh = SH_XL;
    else if ((long)((T + 127) / 128) * ((N + 127) / 128) >= g_sms) sh = SH_L; /* fills the GPU */
    else sh = SH_M;
    return sh == SH_XL && parts != 1 ? SH_L : sh;
}

template <int WM, int WN, int MT, int NT, int P, int ST>
static void launch(cudaStream_t s, const uint16_t *xb, int T, int K, const uint16_t *w, int N,
                   const float *bias, float *y, size_t ldy) {
    using C = Tile<WM, WN, MT, NT, P, ST>;
    const dim3 grid((unsigned)((T + C::BN - 1) / C::BN), (unsigned)((N + C::BM - 1) / C::BM));
    gemm_kernel<WM, WN, MT, NT, P, ST><<<grid, C::THREADS, C::SMEM, s>>>(xb, T, K, w, N, bias, y, ldy);
}

/* The skinny kernel's launch for N rows, K and T tokens: MT (16 or 32 rows a warp: 32 once
 * N gives every SM four warps of 16), the CTAs one SM holds (up to 4, as many as there are
 * row blocks per SM), and the stages that share its shared memory (at least 3 if fewer
 * CTAs allow it; at most SK_SMAX). The grid never exceeds what is resident at once. */
struct skinny_plan {
    int mt, stages, grid, bk;
    size_t smem;
};
static skinny_plan skinny_pick(int T, int N, int K, int parts) {
    skinny_plan p;
    p.mt = g_sk_mt ? g_sk_mt : (long)N >= 64L * 4 * g_sms ? 2 : 1;
    p.bk = g_sk_bk ? g_sk_bk : g_sk_bk_env;
    const int sk = 16 * p.mt, nrb = (N + sk - 1) / sk, nk = (K + p.bk - 1) / p.bk;
    (void)parts; /* the tokens come in as f32, split in registers */
    const size_t sb = (size_t)sk * SK_RB(p.bk) + (size_t)T * SK_XRB(p.bk);
    int per = (nrb + g_sms - 1) / g_sms;
    per = per < 1 ? 1 : per > 4 ? 4 : per;
    long st = 0;
    for (;; per--) {
        const size_t room = g_smem_sm / (size_t)per - 1024 - SK_BAR; /* 1 KiB a CTA is the system's */
        const size_t cta = room < g_smem_cta - SK_BAR ? room : g_smem_cta - SK_BAR;
        st = (long)(cta / sb);
        if (st >= 3 || per == 1) break;
    }
    const long need = (long)((nrb + (long)per * g_sms - 1) / ((long)per * g_sms)) * nk; /* a warp's stages */
    st = st > SK_SMAX ? SK_SMAX : st;
    st = st > need ? need : st;
    if (g_sk_stages) { /* forced (tests): as many as one CTA's shared memory holds */
        const long fit = (long)((g_smem_cta - SK_BAR) / sb);
        st = g_sk_stages < fit ? g_sk_stages : fit;
    }
    p.stages = st < 2 ? 2 : (int)st;
    p.grid = nrb < per * g_sms ? nrb : per * g_sms;
    p.smem = SK_BAR + (size_t)p.stages * sb;
    return p;
}

extern "C" size_t tqkv_cuda_gemm_xf_bytes(size_t T, size_t kmax) { return 2 * T * kmax * 2; }

extern "C" const char *tqkv_cuda_gemm_tile(int T, int N, int parts) {
    pthread_once(&g_once, gemm_init);
    return g_shape_name[shape_pick(T < 1 ? 1 : T, N < 1 ? 1 : N, parts)];
}

extern "C" tqkv_status tqkv_cuda_gemm_skinny_plan(int T, int N, int K, int parts, int *mt, int *stages,
                                                  int *grid, int *bk) {
    if (T < 1 || T > GEMM_CUDA_SKINNY_T || N < 1 || K < 8 || K % 8 || (parts != 1 && parts != 2))
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm_skinny_plan: bad argument (T %d, N %d, K %d, parts %d)",
                         T, N, K, parts);
    pthread_once(&g_once, gemm_init);
    const skinny_plan p = skinny_pick(T, N, K, parts);
    if (mt) *mt = p.mt;
    if (stages) *stages = p.stages;
    if (grid) *grid = p.grid;
    if (bk) *bk = p.bk;
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_gemm_set_skinny(int mt, int stages, int bk) {
    if (mt < 0 || mt > 2 || stages < 0 || stages == 1 || stages > SK_SMAX || (bk && !bk_ok(bk)))
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm_set_skinny: mt %d (0, 1, 2), stages %d (0, 2..%d), "
                         "bk %d (0, or 64..1024 by 64)", mt, stages, SK_SMAX, bk);
    pthread_once(&g_once, gemm_init);
    g_sk_mt = mt;
    g_sk_stages = stages;
    g_sk_bk = bk;
    return TQKV_OK;
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
    return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm_set_tile: no tile shape '%s' (s8, s16, s32, s64, m, l, xl, sk)", name);
}

extern "C" tqkv_status tqkv_cuda_gemm(const float *x, size_t ldx, int T, const uint16_t *w, int N,
                                      int K, const float *bias, float *y, size_t ldy, void *xf,
                                      int parts, void *stream) {
    if (!x || !w || !y || !xf || T < 1 || N < 1 || K < 8 || K % 8 || (parts != 1 && parts != 2))
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm: bad argument (T %d, N %d, K %d, parts %d)",
                         T, N, K, parts);
    if ((((uintptr_t)w | (uintptr_t)xf | (uintptr_t)x) & 15) || ldx % 4) /* 16-byte pieces */
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_gemm: x, w or xf not 16-byte aligned, or ldx %zu not a "
                         "multiple of 4", ldx);
    pthread_once(&g_once, gemm_init); /* before any launch */
    if (!g_ok) return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: gemm: the device refused the tiles' shared memory");
    const cudaStream_t s = (cudaStream_t)stream;
    const uint16_t *xb = (const uint16_t *)xf;
    const size_t n8 = (size_t)T * (size_t)(K / 8);
    const int sh = shape_pick(T, N, parts);
    if (sh != SH_SK) /* the skinny kernel splits its tokens itself */
        gemm_split_kernel<<<(unsigned)((n8 + 255) / 256), 256, 0, s>>>(x, ldx, T, K, parts, (uint4 *)xf);
    if (sh == SH_SK) {
        const skinny_plan p = skinny_pick(T, N, K, parts);
        if (p.mt == 1 && parts == 1) gemm_skinny_kernel<1, 1><<<p.grid, 32, p.smem, s>>>(x, ldx, T, K, w, N, bias, y, ldy, p.stages, p.bk);
        if (p.mt == 1 && parts == 2) gemm_skinny_kernel<1, 2><<<p.grid, 32, p.smem, s>>>(x, ldx, T, K, w, N, bias, y, ldy, p.stages, p.bk);
        if (p.mt == 2 && parts == 1) gemm_skinny_kernel<2, 1><<<p.grid, 32, p.smem, s>>>(x, ldx, T, K, w, N, bias, y, ldy, p.stages, p.bk);
        if (p.mt == 2 && parts == 2) gemm_skinny_kernel<2, 2><<<p.grid, 32, p.smem, s>>>(x, ldx, T, K, w, N, bias, y, ldy, p.stages, p.bk);
    }
#define X(id, wm, wn, mt, nt, p, st)                                                                \
    if (sh == id && parts == p) launch<wm, wn, mt, nt, p, st>(s, xb, T, K, w, N, bias, y, ldy);
    GEMM_SHAPES(X, 1)
    GEMM_SHAPES(X, 2)
    GEMM_SHAPES_P1(X)
#undef X
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: gemm: %s", cudaGetErrorString(e));
    return TQKV_OK;
}
