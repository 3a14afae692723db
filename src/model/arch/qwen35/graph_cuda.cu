/*
 * src/model/arch/qwen35/graph_cuda.cu - the device kernels of Qwen 3.5's gated DeltaNet layers (the GPU
 * twin of src/model/arch/qwen35/graph.c's deltanet(); launched by forward_cuda.cu).
 * Owns: the depthwise causal conv1d + SiLU and the gated delta rule + gated RMSNorm, on
 * the device recurrent rows (model_cuda_impl.h, mc_rec: recurrent.h's row layout), with
 * the spec round's per-token snapshots.
 * Must not: depend on other rows or on the batch size (one thread per (row, channel), one
 * block per (row, value head), tokens in order: batch invariant by construction), or
 * touch the KV caches.
 *
 * The operations are src/model/arch/qwen35/graph.c's, in its order (float32, sequential sums where the
 * CPU sums sequentially); exp / log1p are CUDA's (within an ulp or two of libm's), so the
 * results match the CPU within float32 rounding, not bit for bit.
 */
#include <cuda_runtime.h>
#include <math.h>

extern "C" {
#include "util/common.h"
}
#include "model/cuda/model_cuda_impl.h"
extern "C" {
#include "model/arch/qwen35/qwen35.h"
}

__device__ __forceinline__ float q35_silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float q35_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }
__device__ __forceinline__ float q35_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---------------------------------------------------------------------------
// depthwise causal conv1d + SiLU
// ---------------------------------------------------------------------------

#define Q35_MAX_HIST 7

/* One thread per (row, channel), the row's n tokens in order:
 *   y = w[K-1] x + sum_q w[q] hist[q];  hist <- (hist[1..], x);  cv = silu(y)
 * proj [R n, PW] (qkv channels first), w [CD, K], state rows [R, row_floats] with this
 * layer's conv block at lay ([CD, K-1] oldest first), cv [R n, CD]; slot [R n]: the
 * snapshot slot each token's history goes to (-1: none).
 * grid (R, ceil(CD / 128)), block 128. */
__global__ void q35_conv_kernel(const float *__restrict__ proj, int PW, int CD, int K, int n,
                                const float *__restrict__ w, float *__restrict__ state,
                                size_t row_floats, size_t lay, float *__restrict__ snap,
                                int slots, const int32_t *__restrict__ slot, float *__restrict__ cv) {
    const int ch = blockIdx.y * blockDim.x + threadIdx.x, r = blockIdx.x, HIST = K - 1;
    if (ch >= CD) return;
    float *hp = state + (size_t)r * row_floats + lay + (size_t)ch * HIST;
    const float *wc = w + (size_t)ch * K;
    float h[Q35_MAX_HIST];
#pragma unroll
    for (int q = 0; q < Q35_MAX_HIST; q++) h[q] = q < HIST ? hp[q] : 0.0f;
    for (int j = 0; j < n; j++) {
        const size_t t = (size_t)r * n + j;
        const float x = proj[t * PW + ch];
        float y = __fmul_rn(wc[K - 1], x);
#pragma unroll
        for (int q = 0; q < Q35_MAX_HIST; q++)
            if (q < HIST) y = __fadd_rn(y, __fmul_rn(wc[q], h[q]));
#pragma unroll
        for (int q = 0; q + 1 < Q35_MAX_HIST; q++)
            if (q + 1 < HIST) h[q] = h[q + 1];
#pragma unroll
        for (int q = 0; q < Q35_MAX_HIST; q++)
            if (q == HIST - 1) h[q] = x;
        cv[t * CD + ch] = q35_silu(y);
        const int s = slot[t];
        if (s >= 0) {
            float *d = snap + ((size_t)r * (slots + 1) + s) * row_floats + lay + (size_t)ch * HIST;
#pragma unroll
            for (int q = 0; q < Q35_MAX_HIST; q++)
                if (q < HIST) d[q] = h[q];
        }
    }
#pragma unroll
    for (int q = 0; q < Q35_MAX_HIST; q++)
        if (q < HIST) hp[q] = h[q];
}

// ---------------------------------------------------------------------------
// gated delta rule + gated RMSNorm
// ---------------------------------------------------------------------------

/* Sequential float sum of x[0..n) (the CPU's order), by one thread. */
__device__ float q35_sumsq(const float *x, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
    return s;
}

/* One block per (row, value head h), DV threads: thread e holds column e of the head's
 * state S [DK, DV] in registers. Per token, in order (src/model/arch/qwen35/graph.c's deltanet()):
 *   q, k = l2norm(conv q / k of key head h / (NV / KH)), q /= sqrt(DK)
 *   beta = sigmoid(b_h), g = neg_a_h softplus(a_h + dt_bias_h)
 *   S <- exp(g) S;  d = beta (v - S^T k);  S <- S + k d^T;  o = S^T q
 *   out = norm_w * (o / rms(o)) * silu(z)
 * cv [R n, CD] (q | k | v), proj [R n, PW] (z at CD, b at CD + VD, a at CD + VD + NV),
 * state rows [R, row_floats] with this layer's DeltaNet block at lay ([NV, DK, DV]),
 * att [R n, VD]. grid R NV, block DV (a multiple of 32, <= 256). */
template <int DK>
__global__ void q35_delta_kernel(const float *__restrict__ cv, int CD, const float *__restrict__ proj,
                                 int PW, int n, int KH, int NV, const float *__restrict__ neg_a,
                                 const float *__restrict__ dt_bias, const float *__restrict__ norm_w,
                                 float eps, float *__restrict__ state, size_t row_floats, size_t lay,
                                 float *__restrict__ snap, int slots, const int32_t *__restrict__ slot,
                                 float *__restrict__ att) {
    __shared__ float qs[DK], ks[DK], os[256], bc[2];
    const int DV = blockDim.x, e = threadIdx.x;
    const int r = blockIdx.x / NV, h = blockIdx.x % NV, kh = h / (NV / KH);
    const int LK = KH * DK, VD = NV * DV;
    const size_t head = lay + (size_t)h * DK * DV;
    float *Sg = state + (size_t)r * row_floats + head;
    float S[DK];
#pragma unroll
    for (int a = 0; a < DK; a++) S[a] = Sg[(size_t)a * DV + e];
    const float qscale = __fdiv_rn(1.0f, sqrtf((float)DK));
    for (int j = 0; j < n; j++) {
        const size_t t = (size_t)r * n + j;
        const float *c = cv + t * CD, *pr = proj + t * PW;
        for (int a = e; a < DK; a += DV) {
            qs[a] = c[(size_t)kh * DK + a];
            ks[a] = c[LK + (size_t)kh * DK + a];
        }
        __syncthreads();
        if (e < 2) { /* l2norm's 1 / sqrt(sum x^2 + 1e-6): thread 0 for q, 1 for k */
            const float s = q35_sumsq(e ? ks : qs, DK);
            bc[e] = __fdiv_rn(1.0f, sqrtf(__fadd_rn(s, 1e-6f)));
        }
        __syncthreads();
        const float rq = bc[0], rk = bc[1];
        for (int a = e; a < DK; a += DV) { /* the CPU's x * r, then q * qscale */
            qs[a] = __fmul_rn(__fmul_rn(qs[a], rq), qscale);
            ks[a] = __fmul_rn(ks[a], rk);
        }
        __syncthreads();
        const float beta = q35_sigmoid(pr[CD + VD + h]);
        const float g = __fmul_rn(neg_a[h], q35_softplus(__fadd_rn(pr[CD + VD + NV + h], dt_bias[h])));
        const float eg = expf(g);
        float mem = 0.0f;
#pragma unroll
        for (int a = 0; a < DK; a++) {
            S[a] = __fmul_rn(S[a], eg);
            mem = __fadd_rn(mem, __fmul_rn(S[a], ks[a]));
        }
        const float d = __fmul_rn(__fsub_rn(c[2 * LK + (size_t)h * DV + e], mem), beta);
        float o = 0.0f;
#pragma unroll
        for (int a = 0; a < DK; a++) {
            S[a] = __fadd_rn(S[a], __fmul_rn(ks[a], d));
            o = __fadd_rn(o, __fmul_rn(S[a], qs[a]));
        }
        os[e] = o;
        __syncthreads();
        if (e == 0) bc[0] = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(q35_sumsq(os, DV), (float)DV), eps)));
        __syncthreads();
        const float z = pr[CD + (size_t)h * DV + e];
        att[t * VD + (size_t)h * DV + e] = __fmul_rn(__fmul_rn(norm_w[e], __fmul_rn(o, bc[0])), q35_silu(z));
        const int s = slot[t];
        if (s >= 0) {
            float *dst = snap + ((size_t)r * (slots + 1) + s) * row_floats + head;
#pragma unroll
            for (int a = 0; a < DK; a++) dst[(size_t)a * DV + e] = S[a];
        }
        __syncthreads(); /* qs / ks / bc are rewritten by the next token */
    }
#pragma unroll
    for (int a = 0; a < DK; a++) Sg[(size_t)a * DV + e] = S[a];
}

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------

/* The DeltaNet shapes the device kernels take. */
extern "C" tqkv_status q35_cuda_check(const tqkv_model *m) {
    const tqkv_model_config *c = &m->cfg;
    const int DV = c->lin_v_dim;
    if (c->n_linear == 0) return TQKV_OK; /* no DeltaNet layer to run */
    if ((c->lin_k_dim == 64 || c->lin_k_dim == 128) && DV % 32 == 0 && DV >= 32 && DV <= 256 &&
        c->lin_conv_kernel >= 1 && c->lin_conv_kernel - 1 <= Q35_MAX_HIST && c->lin_k_heads > 0 &&
        c->lin_v_heads % c->lin_k_heads == 0)
        return TQKV_OK;
    return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: DeltaNet key dim %d / value dim %d / "
                     "conv width %d (the device kernels take key dim 64 or 128, value dim a "
                     "multiple of 32 up to 256, conv width up to %d)", c->lin_k_dim,
                     c->lin_v_dim, c->lin_conv_kernel, 8);
}

/* Queue linear layer j's conv and delta rule for R rows of n tokens on `s`: proj [R n, PW]
 * -> cv [R n, CD] -> att [R n, VD]. */
extern "C" tqkv_status q35_cuda_linear(const tqkv_model_config *c, const struct mc_layer *L,
                                       struct mc_rec *rec, int j, int R, int n, const float *proj,
                                       float *cv, const int32_t *slot, float *att,
                                       struct CUstream_st *s) {
    const int KH = c->lin_k_heads, NV = c->lin_v_heads, DK = c->lin_k_dim, DV = c->lin_v_dim;
    const int CD = 2 * KH * DK + NV * DV, PW = CD + NV * DV + 2 * NV;
    const size_t lay = (size_t)j * (rec->conv_floats + rec->ssm_floats);
    q35_conv_kernel<<<dim3((unsigned)R, (unsigned)((CD + 127) / 128)), 128, 0, s>>>(
        proj, PW, CD, c->lin_conv_kernel, n, L->conv_w, rec->state, rec->row_floats, lay, rec->snap,
        rec->spec_cap, slot, cv);
    const size_t dl = lay + rec->conv_floats;
    if (DK == 64)
        q35_delta_kernel<64><<<(unsigned)(R * NV), (unsigned)DV, 0, s>>>(
            cv, CD, proj, PW, n, KH, NV, L->lin_neg_a, L->dt_bias, L->lin_norm, c->rms_norm_eps,
            rec->state, rec->row_floats, dl, rec->snap, rec->spec_cap, slot, att);
    else
        q35_delta_kernel<128><<<(unsigned)(R * NV), (unsigned)DV, 0, s>>>(
            cv, CD, proj, PW, n, KH, NV, L->lin_neg_a, L->dt_bias, L->lin_norm, c->rms_norm_eps,
            rec->state, rec->row_floats, dl, rec->snap, rec->spec_cap, slot, att);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? TQKV_OK
                            : tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: DeltaNet kernels: %s", cudaGetErrorString(e));
}
