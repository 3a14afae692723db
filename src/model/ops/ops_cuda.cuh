/*
 * ops_cuda.cuh - device helpers shared by the model forward's kernels (forward_cuda.cu,
 * src/model/arch/gemma4/graph_cuda.cu): fixed-order block sums, the RMSNorm factor, the warp-level
 * RoPE of one head, GELU-tanh. The device twins of ops.c's reductions: every sum has one fixed order
 * and every rounding step is explicit, so that a row's result depends on nothing but its
 * own values (batch invariance) and matches the CPU's within float32 rounding.
 * Must not: hold state, allocate, or depend on the launch's grid size.
 */
#ifndef TQKV_MODEL_OPS_CUDA_CUH
#define TQKV_MODEL_OPS_CUDA_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "util/cuda_pdl.cuh" /* cuda_pdl_wait / _trigger / _launch */
#include "util/cuda_split.cuh" /* cuda_split_hi / _lo */

/* Block-wide double sum in a fixed order of the first 128 threads' v (blockDim 128, or any
 * multiple of 32 above it, whose other threads' v is not used; every thread calls it): warp
 * xor butterflies, then the four warp sums as (w0 + w1) + (w2 + w3). sh: 4 doubles of
 * shared memory. */
__device__ __forceinline__ double mc_block_sum128(double v, double *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0 && threadIdx.x < 128) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    const double s = (sh[0] + sh[1]) + (sh[2] + sh[3]);
    __syncthreads();
    return s;
}

/* The RMSNorm factor's sum of squares over a row v [H] that a block holds in shared memory
 * (any of its threads may have written it: a barrier first), in forward_cuda.cu's
 * rmsnorm_kernel order (thread t < 128: v[t]^2 + v[t + 128]^2 + ... from 0 in double, then
 * mc_block_sum128's order): the same bits as that kernel's s for the same row. Every thread
 * of the block (>= 128) calls it; sh: 4 doubles. */
__device__ __forceinline__ double mc_row_sumsq(const float *v, int H, double *sh) {
    __syncthreads();
    double s = 0;
    if (threadIdx.x < 128)
        for (int i = threadIdx.x; i < H; i += 128) s += (double)v[i] * v[i];
    return mc_block_sum128(s, sh);
}

/* Element i of x's GEMM activation split, as gemm_cuda.cu's split kernel writes it:
 * xf [parts, T, K] bf16 (TK = T K), hi at i, lo at TK + i when parts = 2
 * (tqkv_cuda_gemm_presplit then skips its split launch). */
__device__ __forceinline__ void mc_split_store(uint16_t *__restrict__ xf, size_t TK, size_t i,
                                               float v, int parts) {
    const uint16_t hi = cuda_split_hi(v);
    xf[i] = hi;
    if (parts == 2) xf[TK + i] = cuda_split_lo(v, hi);
}

/* v[u] = p[i0 + stride u] for the indices below n, else 0: a thread's strided values loaded
 * before they are used, so the loads overlap while the sums that follow keep their order. */
template <int U>
__device__ __forceinline__ void mc_load_strided(float (&v)[U], const float *__restrict__ p, int i0,
                                                int stride, int n) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int i = i0 + stride * u;
        v[u] = i < n ? p[i] : 0.0f;
    }
}

/* Element-wise kernels take a thread per element: grid (T, ceil(width / 256)), block 256.
 * (One block per token looping over the width waits for memory once per pass: 9-33 us a
 * launch at one token, Nsight Compute on an H100, bench/RESULTS.md "GPU, session 8".) */
static inline dim3 mc_grid_elems(size_t T, size_t width) {
    return dim3((unsigned)T, (unsigned)((width + 255) / 256));
}

/* RMSNorm factor 1 / sqrt(mean + eps) from a sum of squares over n values (in double, as
 * ops_rmsnorm). */
__device__ __forceinline__ float mc_rms_r(double ss, int n, float eps) {
    return (float)(1.0 / sqrt(ss / n + (double)eps));
}

/* RoPE of one head held by a warp, lane l holding dims l + 32 i (i < NPL): pairs (d, d +
 * half) for d < half rotated by rope = cos [half] | sin [half] (ops_rope's order, no
 * contraction); dims from 2 half on pass unchanged. w: the warp's 32 NPL floats of shared
 * scratch. Each pair is one lane's: read and written in place, the warp in step around it.
 * A lane's cos / sin (d = lane + 32 m, half <= 16 NPL) are loaded first, before the warp's
 * barrier. */
template <int NPL>
__device__ __forceinline__ void mc_warp_rope(float (&v)[NPL], float *w, const float *rope, int half) {
    constexpr int NP = NPL / 2;   /* a lane's pairs at most */
    const int lane = threadIdx.x & 31;
    float cc[NP], ss[NP];
#pragma unroll
    for (int m = 0; m < NP; m++) {
        const int d = lane + 32 * m;
        cc[m] = d < half ? rope[d] : 0.0f;
        ss[m] = d < half ? rope[half + d] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < NPL; i++) w[lane + 32 * i] = v[i];
    __syncwarp();
#pragma unroll
    for (int m = 0; m < NP; m++) {
        const int d = lane + 32 * m;
        if (d >= half) break;
        const float a = w[d], b = w[d + half];
        w[d] = __fsub_rn(__fmul_rn(a, cc[m]), __fmul_rn(b, ss[m]));
        w[d + half] = __fadd_rn(__fmul_rn(b, cc[m]), __fmul_rn(a, ss[m]));
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < NPL; i++) v[i] = w[lane + 32 * i];
}

/* gelu_pytorch_tanh as the CPU computes it (src/model/arch/gemma4/graph.c, moe.c), operation
 * for operation (no contraction); tanhf is CUDA's (within two ulp of libm's). */
__device__ __forceinline__ float mc_gelu_tanh(float x) {
    const float x3 = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x);
    const float inner = __fmul_rn(0.7978845608028654f, __fadd_rn(x, x3));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

/* The CPU's exp_scalar (ops.c), operation for operation. */
__device__ __forceinline__ float mc_exp_cpu(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.3365447504f ? -87.3365447504f : x;
    const float nn = rintf(__fmul_rn(x, 1.44269504088896341f));
    float r = fmaf(-nn, 0.693359375f, x);
    r = fmaf(-nn, -2.12194440e-4f, r);
    float p = 1.9875691500E-4f;
    p = fmaf(p, r, 1.3981999507E-3f);
    p = fmaf(p, r, 8.3334519073E-3f);
    p = fmaf(p, r, 4.1665795894E-2f);
    p = fmaf(p, r, 1.6666665459E-1f);
    p = fmaf(p, r, 5.0000001201E-1f);
    const float z = __fmul_rn(r, r);
    const float yv = __fadd_rn(fmaf(p, z, r), 1.0f);
    const float s = __int_as_float(((int)nn + 127) << 23);
    return __fmul_rn(yv, s);
}

/* SwiGLU's g / (1 + exp(-g)) * u with the CPU's exp (the dense MLP's and the experts'). */
__device__ __forceinline__ float mc_silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, mc_exp_cpu(0.0f - g))), u);
}

/* GeGLU's gelu_tanh(g) * u (Gemma 4's MLPs and experts). */
__device__ __forceinline__ float mc_gelu_mul(float g, float u) {
    return __fmul_rn(mc_gelu_tanh(g), u);
}

#endif
