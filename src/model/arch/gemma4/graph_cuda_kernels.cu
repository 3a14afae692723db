/*
 * src/model/arch/gemma4/graph_cuda_kernels.cu - the Gemma 4 device graph's per-token kernels
 * and their launchers (graph_cuda.cu's forward queues them).
 * Owns: the scaled embedding, the per-layer input mix, the RMSNorm with weight (the MoE
 * router's and experts' inputs), the post-attention / post-FFN / post-PLE norms fused with
 * the residual and the layer scalar, the MoE block's mix (each norm also in a register
 * form), q / k RMSNorm with weight + RoPE per layer type and the scale-free v norm at
 * head_dim 128 or 256, the attention output gather, the per-layer gate, the final logit
 * softcap; the launchers that pick a norm's form (mc_norm_nv) or a head dim's instance.
 * Must not: make a row's result depend on other rows (per-token kernels).
 *
 * The operations are src/model/arch/gemma4/graph.c's, in its order, with __f*_rn so nothing
 * is contracted into an FMA the CPU does not do (graph_cuda.cu's header says how close).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "model/arch/gemma4/graph_cuda_impl.cuh"
#include "model/ops/ops_cuda.cuh"

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* x[t, :] = embed[token] * escale. grid mc_grid_elems(T, H), block 256. */
__global__ void g4_embed_kernel(const int32_t *__restrict__ tinfo, const bf16 *__restrict__ e,
                                int H, float escale, float *__restrict__ x) {
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < H) x[t * H + i] = __fmul_rn(__bfloat162float(e[(size_t)tinfo[t * 3] * H + i]), escale);
}

/* Per-layer inputs, one warp per (token, layer slice of P), in place on ple [T, L P]
 * (the projection of the scaled embedding): pl *= hs; pl = rmsnorm_P(pl) (weight pn);
 * pl = (pl + embed_ple[token, slice] * pscale) * mix. grid ceil(T L / 4), block 128. */
__global__ void g4_ple_kernel(float *__restrict__ ple, const int32_t *__restrict__ tinfo, int T,
                              int L, int P, const bf16 *__restrict__ eple,
                              const float *__restrict__ pn, float eps, float hs, float pscale,
                              float mix) {
    const size_t gw = (size_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (size_t)T * L) return;
    const size_t t = gw / L, l = gw % L, LP = (size_t)L * P;
    float *pl = ple + t * LP + l * P;
    const bf16 *pe = eple + (size_t)tinfo[t * 3] * LP + l * P;
    double ss = 0;
    for (int e = lane; e < P; e += 32) {
        const float v = __fmul_rn(pl[e], hs);
        pl[e] = v;
        ss += (double)v * v;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = mc_rms_r(ss, P, eps);
    for (int e = lane; e < P; e += 32) {
        const float v = __fmul_rn(pn[e], __fmul_rn(pl[e], r));
        pl[e] = __fmul_rn(__fadd_rn(v, __fmul_rn(__bfloat162float(pe[e]), pscale)), mix);
    }
}

/* The Gemma 4 norms below: block 128, a thread's values i, i + 128, ... loaded G4_U at a time
 * (mc_load_strided), then used in that order: the loads overlap, every sum keeps its order. */
constexpr int G4_U = 8;

/* out[t] = w * (x[t] * r) (RMSNorm, the CPU's formula), then times post when post != 1 (the
 * MoE router's input scale, rounded after the norm as graph.c does); with xf also out's GEMM
 * split (mc_split_store, `parts`). grid T, block 128. */
__global__ void g4_rmsnorm_kernel(const float *__restrict__ x, const float *__restrict__ w,
                                  float eps, int H, float post, float *__restrict__ out,
                                  uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    constexpr int U = G4_U;
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    const float *xr = x + t * H;
    double s = 0;
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float v[U];
        mc_load_strided<U>(v, xr, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++)
            if (i0 + 128 * u < H) s += (double)v[u] * v[u];
    }
    s = mc_block_sum128(s, sh);
    const float r = mc_rms_r(s, H, eps);
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float v[U], g[U];
        mc_load_strided<U>(v, xr, i0, 128, H);
        mc_load_strided<U>(g, w, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + 128 * u;
            if (i >= H) break;
            float o = __fmul_rn(g[u], __fmul_rn(v[u], r));
            if (post != 1.0f) o = __fmul_rn(o, post);
            out[t * H + i] = o;
            if (xf) mc_split_store(xf, (size_t)gridDim.x * H, t * H + i, o, parts);
        }
    }
}

/* The MLP and experts' outputs mixed in place: o = rmsnorm(o, w1) + rmsnorm(h2, w2), o and
 * h2 [T, H] (graph.c's order). grid T, block 128. */
__global__ void g4_moe_mix_kernel(float *__restrict__ o, const float *__restrict__ h2,
                                  const float *__restrict__ w1, const float *__restrict__ w2,
                                  float eps, int H) {
    constexpr int U = G4_U;
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    float *ot = o + t * H;
    const float *ht = h2 + t * H;
    double s1 = 0, s2 = 0;
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float a[U], b[U];
        mc_load_strided<U>(a, ot, i0, 128, H);
        mc_load_strided<U>(b, ht, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (i0 + 128 * u >= H) break;
            s1 += (double)a[u] * a[u];
            s2 += (double)b[u] * b[u];
        }
    }
    s1 = mc_block_sum128(s1, sh);
    s2 = mc_block_sum128(s2, sh);
    const float r1 = mc_rms_r(s1, H, eps), r2 = mc_rms_r(s2, H, eps);
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float a[U], b[U], g1[U], g2[U];
        mc_load_strided<U>(a, ot, i0, 128, H);
        mc_load_strided<U>(b, ht, i0, 128, H);
        mc_load_strided<U>(g1, w1, i0, 128, H);
        mc_load_strided<U>(g2, w2, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + 128 * u;
            if (i >= H) break;
            ot[i] = __fadd_rn(__fmul_rn(g1[u], __fmul_rn(a[u], r1)), __fmul_rn(g2[u], __fmul_rn(b[u], r2)));
        }
    }
}

/* The end of a block: o = rmsnorm(o, wpost); x += o; x *= ls (when ls != 1); then, with
 * wnext, xn = rmsnorm(x, wnext) (the next block's input), and with xf also xn's GEMM split.
 * x, o, xn [T, H]. grid T, block 128 (a thread reads back only the elements of x it wrote). */
__global__ void g4_residual_kernel(float *__restrict__ x, const float *__restrict__ o,
                                   const float *__restrict__ wpost, float eps, int H, float ls,
                                   const float *__restrict__ wnext, float *__restrict__ xn,
                                   uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    constexpr int U = G4_U;
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    float *xr = x + t * H;
    const float *orow = o + t * H;
    double s = 0;
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float a[U];
        mc_load_strided<U>(a, orow, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++)
            if (i0 + 128 * u < H) s += (double)a[u] * a[u];
    }
    s = mc_block_sum128(s, sh);
    const float r = mc_rms_r(s, H, eps);
    double s2 = 0;
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float xv[U], g[U], a[U];
        mc_load_strided<U>(xv, xr, i0, 128, H);
        mc_load_strided<U>(g, wpost, i0, 128, H);
        mc_load_strided<U>(a, orow, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + 128 * u;
            if (i >= H) break;
            float v = __fadd_rn(xv[u], __fmul_rn(g[u], __fmul_rn(a[u], r)));
            if (ls != 1.0f) v = __fmul_rn(v, ls);
            xr[i] = v;
            s2 += (double)v * v;
        }
    }
    if (!wnext) return; /* uniform over the block */
    s2 = mc_block_sum128(s2, sh);
    const float r2 = mc_rms_r(s2, H, eps);
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float xv[U], g[U];
        mc_load_strided<U>(xv, xr, i0, 128, H);
        mc_load_strided<U>(g, wnext, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + 128 * u;
            if (i >= H) break;
            const float y = __fmul_rn(g[u], __fmul_rn(xv[u], r2));
            xn[t * H + i] = y;
            if (xf) mc_split_store(xf, (size_t)gridDim.x * H, t * H + i, y, parts);
        }
    }
}

/* g4_rmsnorm_kernel with a thread's NV values in registers (H <= 128 NV): x and w loaded
 * before the first addition, the same operations in the same order. grid T, block 128. */
template <int NV>
__global__ void __launch_bounds__(128)
g4_rmsnorm_regs_kernel(const float *__restrict__ x, const float *__restrict__ w, float eps, int H,
                       float post, float *__restrict__ out, uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    const int i0 = threadIdx.x;
    float v[NV], g[NV];
    mc_load_strided<NV>(v, x + t * H, i0, 128, H);
    mc_load_strided<NV>(g, w, i0, 128, H);
    double s = 0;
#pragma unroll
    for (int u = 0; u < NV; u++)
        if (i0 + 128 * u < H) s += (double)v[u] * v[u];
    s = mc_block_sum128(s, sh);
    const float r = mc_rms_r(s, H, eps);
#pragma unroll
    for (int u = 0; u < NV; u++) {
        const int i = i0 + 128 * u;
        if (i >= H) break;
        float o = __fmul_rn(g[u], __fmul_rn(v[u], r));
        if (post != 1.0f) o = __fmul_rn(o, post);
        out[t * H + i] = o;
        if (xf) mc_split_store(xf, (size_t)gridDim.x * H, t * H + i, o, parts);
    }
}

/* g4_residual_kernel with a thread's NV values in registers (H <= 128 NV): o, x, wpost and
 * wnext (wpost's again without one) loaded before the first addition, x's new values kept
 * for the last norm; the same operations in the same order. grid T, block 128. */
template <int NV>
__global__ void __launch_bounds__(128)
g4_residual_regs_kernel(float *__restrict__ x, const float *__restrict__ o,
                        const float *__restrict__ wpost, float eps, int H, float ls,
                        const float *__restrict__ wnext, float *__restrict__ xn,
                        uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    const int i0 = threadIdx.x;
    float *xr = x + t * H;
    float a[NV], xv[NV], g[NV], gn[NV];
    mc_load_strided<NV>(a, o + t * H, i0, 128, H);
    mc_load_strided<NV>(xv, xr, i0, 128, H);
    mc_load_strided<NV>(g, wpost, i0, 128, H);
    mc_load_strided<NV>(gn, wnext ? wnext : wpost, i0, 128, H);
    double s = 0;
#pragma unroll
    for (int u = 0; u < NV; u++)
        if (i0 + 128 * u < H) s += (double)a[u] * a[u];
    s = mc_block_sum128(s, sh);
    const float r = mc_rms_r(s, H, eps);
    double s2 = 0;
#pragma unroll
    for (int u = 0; u < NV; u++) {
        const int i = i0 + 128 * u;
        if (i >= H) break;
        float v = __fadd_rn(xv[u], __fmul_rn(g[u], __fmul_rn(a[u], r)));
        if (ls != 1.0f) v = __fmul_rn(v, ls);
        xr[i] = xv[u] = v;
        s2 += (double)v * v;
    }
    if (!wnext) return; /* uniform over the block */
    s2 = mc_block_sum128(s2, sh);
    const float r2 = mc_rms_r(s2, H, eps);
#pragma unroll
    for (int u = 0; u < NV; u++) {
        const int i = i0 + 128 * u;
        if (i >= H) break;
        const float y = __fmul_rn(gn[u], __fmul_rn(xv[u], r2));
        xn[t * H + i] = y;
        if (xf) mc_split_store(xf, (size_t)gridDim.x * H, t * H + i, y, parts);
    }
}

/* g4_moe_mix_kernel with a thread's NV values in registers (H <= 128 NV): o, h2, w1 and w2
 * loaded before the first addition; the same operations in the same order. grid T,
 * block 128. */
template <int NV>
__global__ void __launch_bounds__(128)
g4_moe_mix_regs_kernel(float *__restrict__ o, const float *__restrict__ h2,
                       const float *__restrict__ w1, const float *__restrict__ w2, float eps,
                       int H) {
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    const int i0 = threadIdx.x;
    float *ot = o + t * H;
    float a[NV], b[NV], g1[NV], g2[NV];
    mc_load_strided<NV>(a, ot, i0, 128, H);
    mc_load_strided<NV>(b, h2 + t * H, i0, 128, H);
    mc_load_strided<NV>(g1, w1, i0, 128, H);
    mc_load_strided<NV>(g2, w2, i0, 128, H);
    double s1 = 0, s2 = 0;
#pragma unroll
    for (int u = 0; u < NV; u++) {
        if (i0 + 128 * u >= H) break;
        s1 += (double)a[u] * a[u];
        s2 += (double)b[u] * b[u];
    }
    s1 = mc_block_sum128(s1, sh);
    s2 = mc_block_sum128(s2, sh);
    const float r1 = mc_rms_r(s1, H, eps), r2 = mc_rms_r(s2, H, eps);
#pragma unroll
    for (int u = 0; u < NV; u++) {
        const int i = i0 + 128 * u;
        if (i >= H) break;
        ot[i] = __fadd_rn(__fmul_rn(g1[u], __fmul_rn(a[u], r1)), __fmul_rn(g2[u], __fmul_rn(b[u], r2)));
    }
}

/* g4_moe_mix_kernel or its register twin (mc_norm_nv) over T rows on s. */
void g4_moe_mix_queue(float *o, const float *h2, const float *w1, const float *w2,
                      float eps, int H, size_t T, cudaStream_t s) {
    const unsigned b = (unsigned)T;
    switch (mc_norm_nv(H, 32)) {
    case 8: g4_moe_mix_regs_kernel<8><<<b, 128, 0, s>>>(o, h2, w1, w2, eps, H); break;
    case 16: g4_moe_mix_regs_kernel<16><<<b, 128, 0, s>>>(o, h2, w1, w2, eps, H); break;
    case 32: g4_moe_mix_regs_kernel<32><<<b, 128, 0, s>>>(o, h2, w1, w2, eps, H); break;
    default: g4_moe_mix_kernel<<<b, 128, 0, s>>>(o, h2, w1, w2, eps, H); break;
    }
}

/* g4_rmsnorm_kernel or its register twin (mc_norm_nv) over T rows on s. */
void g4_rmsnorm_queue(const float *x, const float *w, float eps, int H, float post,
                      float *out, uint16_t *xf, int parts, size_t T, cudaStream_t s) {
    const unsigned b = (unsigned)T;
    switch (mc_norm_nv(H, 32)) {
    case 8: g4_rmsnorm_regs_kernel<8><<<b, 128, 0, s>>>(x, w, eps, H, post, out, xf, parts); break;
    case 16: g4_rmsnorm_regs_kernel<16><<<b, 128, 0, s>>>(x, w, eps, H, post, out, xf, parts); break;
    case 32: g4_rmsnorm_regs_kernel<32><<<b, 128, 0, s>>>(x, w, eps, H, post, out, xf, parts); break;
    default: g4_rmsnorm_kernel<<<b, 128, 0, s>>>(x, w, eps, H, post, out, xf, parts); break;
    }
}

/* g4_residual_kernel or its register twin (mc_norm_nv) over T rows on s. */
void g4_residual_queue(float *x, const float *o, const float *wpost, float eps, int H,
                       float ls, const float *wnext, float *xn, uint16_t *xf, int parts,
                       size_t T, cudaStream_t s) {
    const unsigned b = (unsigned)T;
    switch (mc_norm_nv(H, 32)) {
    case 8:
        g4_residual_regs_kernel<8><<<b, 128, 0, s>>>(x, o, wpost, eps, H, ls, wnext, xn, xf, parts);
        break;
    case 16:
        g4_residual_regs_kernel<16><<<b, 128, 0, s>>>(x, o, wpost, eps, H, ls, wnext, xn, xf, parts);
        break;
    case 32:
        g4_residual_regs_kernel<32><<<b, 128, 0, s>>>(x, o, wpost, eps, H, ls, wnext, xn, xf, parts);
        break;
    default:
        g4_residual_kernel<<<b, 128, 0, s>>>(x, o, wpost, eps, H, ls, wnext, xn, xf, parts);
        break;
    }
}

/* One warp per (token, head) of q | k | v at head dim HD (128 or 256; NPL = HD / 32 values
 * per lane): q and k RMSNorm with weight, then RoPE (pairs (d, d + HD / 2); rope: this
 * layer type's cos | sin [HD / 2] each, at rope + t RW); v RMSNorm without weight, from its
 * own projection or (kv_src == 1, k_eq_v) the raw k projection. Scatter to qb [R, NH, n,
 * HD], kb / vb [R, NKV, n, HD]. A token's projection row (width QS): q heads, then (own
 * layers) k heads, then v heads. nkv = 0: a KV-shared layer (q only).
 * grid ceil(T (NH + 2 nkv) / 4), block 128. */
template <int HD>
__global__ void g4_qkv_kernel(const float *__restrict__ qkv, int QS, int T, int NH, int nkv, int n,
                              int v_from_k, const int32_t *__restrict__ tinfo,
                              const float *__restrict__ qn, const float *__restrict__ kn, float eps,
                              const float *__restrict__ rope, int RW, float *__restrict__ qb,
                              float *__restrict__ kb, float *__restrict__ vb) {
    constexpr int NPL = HD / 32, HALF = HD / 2;
    __shared__ float sv[4][HD];
    const int HT = NH + 2 * nkv;
    const size_t gw = (size_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (size_t)T * HT) return;
    const size_t t = gw / HT;
    const int h = (int)(gw % HT);
    const int kind = h < NH ? 0 : h < NH + nkv ? 1 : 2; /* q, k, v */
    const int hh = kind == 0 ? h : kind == 1 ? h - NH : h - NH - nkv;
    const size_t QD = (size_t)NH * HD, KD = (size_t)nkv * HD;
    const float *src =
        qkv + t * (size_t)QS +
        (kind == 0 ? (size_t)hh * HD : QD + (kind == 2 && !v_from_k ? KD : 0) + (size_t)hh * HD);
    const int row = tinfo[t * 3 + 1], j = tinfo[t * 3 + 2]; /* (loaded first: no wait at the end) */
    const float *nw = kind == 0 ? qn : kind == 1 ? kn : NULL;
    float v[NPL], g[NPL];
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        v[i] = src[lane + 32 * i];
        g[i] = nw ? nw[lane + 32 * i] : 0.0f;
    }
    double s = 0;
#pragma unroll
    for (int i = 0; i < NPL; i++) s += (double)v[i] * v[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float r = mc_rms_r(s, HD, eps);
#pragma unroll
    for (int i = 0; i < NPL; i++) v[i] = nw ? __fmul_rn(g[i], __fmul_rn(v[i], r)) : __fmul_rn(v[i], r);
    if (kind < 2) mc_warp_rope<NPL>(v, sv[threadIdx.x >> 5], rope + t * (size_t)RW, HALF); /* RoPE */
    float *dst = kind == 0 ? qb + (((size_t)row * NH + hh) * n + j) * HD
                           : (kind == 1 ? kb : vb) + (((size_t)row * nkv + hh) * n + j) * HD;
#pragma unroll
    for (int i = 0; i < NPL; i++) dst[lane + 32 * i] = v[i];
}

/* att[t, h hd + d] = ob[((row NH + h) n + col) hd + d]; with xf also att's GEMM split.
 * grid mc_grid_elems(T, NH hd), block 256. */
__global__ void g4_gather_kernel(const float *__restrict__ ob, const int32_t *__restrict__ tinfo,
                                 int NH, int n, int hd, float *__restrict__ att,
                                 uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x, QD = NH * hd;
    if (i >= QD) return;
    const int r = tinfo[t * 3 + 1], j = tinfo[t * 3 + 2];
    const int h = i / hd, d = i - h * hd;
    const float v = ob[(((size_t)r * NH + h) * n + j) * hd + d];
    att[t * QD + i] = v;
    if (xf) mc_split_store(xf, (size_t)gridDim.x * QD, t * QD + i, v, parts);
}

/* pg[t, e] = gelu_tanh(pg[t, e]) * ple[t, l P + e]; with xf also pg's GEMM split. grid
 * mc_grid_elems(T, P), block 256. */
__global__ void g4_ple_gate_kernel(float *__restrict__ pg, const float *__restrict__ ple, int P,
                                   size_t LP, int l, uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    const size_t t = blockIdx.x;
    const int e = blockIdx.y * blockDim.x + threadIdx.x;
    if (e >= P) return;
    const float v = __fmul_rn(mc_gelu_tanh(pg[t * P + e]), ple[t * LP + (size_t)l * P + e]);
    pg[t * P + e] = v;
    if (xf) mc_split_store(xf, (size_t)gridDim.x * P, t * P + e, v, parts);
}

/* logits = tanh(logits / cap) * cap over n floats. */
__global__ void g4_softcap_kernel(float *__restrict__ lg, size_t n, float cap) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) lg[i] = __fmul_rn(tanhf(__fdiv_rn(lg[i], cap)), cap);
}

// ---------------------------------------------------------------------------
// the qkv launch (a head dim's instance)
// ---------------------------------------------------------------------------

tqkv_status g4_qkv_launch(model_cuda *g, int hd, int QS, int T, int NH, int nkv, int n,
                          int keqv, const mc_layer *L, float eps, const float *rope, int RW) {
    const size_t warps = (size_t)T * (size_t)(NH + 2 * nkv);
    const unsigned grid = (unsigned)((warps + 3) / 4);
    if (hd == 128)
        g4_qkv_kernel<128><<<grid, 128, 0, g->stream>>>(g->qkv, QS, T, NH, nkv, n, keqv, g->tinfo,
                                                        L->q_norm, L->k_norm, eps, rope, RW, g->qb,
                                                        g->kb, g->vb);
    else if (hd == 256)
        g4_qkv_kernel<256><<<grid, 128, 0, g->stream>>>(g->qkv, QS, T, NH, nkv, n, keqv, g->tinfo,
                                                        L->q_norm, L->k_norm, eps, rope, RW, g->qb,
                                                        g->kb, g->vb);
    else return tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: Gemma 4 head_dim %d", hd);
    return TQKV_OK;
}
