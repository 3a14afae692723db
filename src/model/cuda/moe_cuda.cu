/*
 * moe_cuda.cu - the routed-experts feed-forward on the device (moe_cuda.h), the GPU twin of
 *   src/model/ops/moe.c's moe_experts, for every mixture-of-experts graph: Qwen3-MoE and
 *   Qwen 3.5 MoE through the common device graph's `ffn` hook (the hooks at the end), Gemma 4's
 *   MoE block from its own forward queue (src/model/arch/gemma4/graph_cuda.cu).
 * The experts' files: this one (one sparse layer's queue: gather, the experts' GEMMs, the
 *   shared expert, combine), moe_cuda_route.cu (the router / route / place kernels, the
 *   routing step and the switches), moe_cuda_state.cu (the experts' device weights
 *   mc_moe_layer, a state's experts scratch mc_moe_state, the common graph's hooks);
 *   moe_cuda_impl.cuh between them.
 * Owns: the gather and combine kernels and the order of one sparse layer's launches.
 * Must not: let a token's output depend on the other tokens of the call, or on how many
 *   tokens an expert got: every product is the invariant GEMM (tqkv_cuda_gemm, a row's result
 *   never depends on the rows beside it or on T), the routers a fixed-order kernel, and a
 *   token's expert outputs are added in ascending expert order (moe.c's order).
 *
 * One sparse layer, T tokens, E experts, top K, expert width I, shared expert width S
 * (0: none), P = T K (token, expert) pairs, xr the router's input, xn the experts':
 *   router_kernel   logits [T, E] = xr [T, H] . router [E, H]^T      (float32, fixed order)
 *   route_kernel    per token (a warp) moe.c's moe_route_token (softmax, top-k, ties to the lower
 *                   index, renormalised when norm_topk, times the per-expert scale if any;
 *                   exp rounded from double, within an ulp of the host's expf: GPU vs CPU
 *                   is bounded, not bitwise),
 *                   its K picks sorted by ascending expert: sel [T, K], weights [T, K]
 *                   (each pick by two warp reductions while the probabilities are
 *                   non-negative numbers, else the (value, index) butterfly: the same picks)
 *   place_kernel    (a block per expert, each counting every expert's pairs first) the
 *                   pairs grouped by expert (expert 0's tokens ascending, then expert
 *                   1's ...): tok [P], pair [T, K], and the groups [G, 4] of the experts with
 *                   tokens; the unused groups up to the bound get no rows
 *                   (up to MOE_FUSED_P pairs, i.e. decode, the router kernel's last block
 *                   does route and place itself: one launch instead of three, same integers;
 *                   one token's pairs placed by its warp, moe_place_one; up to
                   MOE_WIDE_T = 8 tokens the router with its tail is router_wide_kernel: a
                   block per (expert, 4 tokens), the same dot products, so they spread over
                   E SMs, and at one token its blocks also do the gather below)
 *   gather_kernel   xg [P, H] = xn [tok[p]]           (not at one token with the grouped GEMMs:
                                                     the router kernel wrote it, r.gathered)
 *   per expert e    gu = xg[o_e .. o_e + n_e) . wgu_e^T   [n_e, 2I]   (tqkv_cuda_gemm_grouped:
 *                                                                       every expert in one
 *                                                                       launch, bitwise the
 *                                                                       per-expert calls')
 *                   h = act(gate) * up                     [P, I]      (SiLU: the dense MLP's
 *                                                                       kernel; GELU-tanh;
 *                                                                       grouped: the gate|up
 *                                                                       GEMM's epilogue,
 *                                                                       TQKV_MOE_FOLD_ACT)
 *                   y = h[o_e ..) . wd_e^T                [n_e, H]
 *   shared (S > 0)  sy = down(act(gate xn) * up xn) [T, H]; sg = xn . sh_gate [T] (the
 *                   router kernel with one expert)
 *   combine_kernel  out [T, H] = sum over the token's K pairs, ascending expert, of
 *                   round(w y[p]), from 0, then + round(sigmoid(sg) sy) (moe.c's order)
 *                   (in the common graph, mc_moe_block_queue: combine_norm_kernel, the same
 *                   sums, x += them and the next norm in one block per token).
 * The routing stays on the device, so a step queues without waiting and decode steps are
 * captured as CUDA graphs: at T <= GEMM_CUDA_SMALL_T (decode) and in any step being captured
 * the grouped GEMMs are sized by bounds (min(E, P) groups of at most T rows: a token picks K
 * distinct experts), and CTAs past a group's rows return at once. Otherwise (prefill) the
 * host reads the group count and the largest group back (one wait per sparse layer) to size
 * the grids tightly.
 * TQKV_MOE_GROUPED=0 (or mc_moe_set_grouped(0)) runs one tqkv_cuda_gemm per expert instead
 * of the grouped launch (the same bits: test_cuda_moe checks it); so does --fast-gemm
 * (cuBLAS). Those read every expert's count back (one wait per sparse layer), so the
 * scratch's reserve turns CUDA graphs off for such a state.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "model/cuda/model_cuda_impl.h"
#include "model/cuda/moe_cuda.h"
#include "model/cuda/moe_cuda_impl.cuh"
#include "model/ops/gemm_cuda.h"
#include "model/ops/ops_cuda.cuh"

// ---------------------------------------------------------------------------
// gather and combine kernels
// ---------------------------------------------------------------------------

/* xg[p] = xn[tok[p]], rows of H; with xf also xg's GEMM split [parts, P, H] (mc_split_store).
 * grid mc_grid_elems(P, H), block 256. */
__global__ void moe_gather_kernel(const float *__restrict__ xn, const int32_t *__restrict__ tok,
                                  int H, float *__restrict__ xg, uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_wait(); /* programmatic (g->pdl): the routing has completed */
    cuda_pdl_trigger();
    const size_t p = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= H) return;
    const float v = xn[(size_t)tok[p] * H + i];
    xg[p * H + i] = v;
    if (xf) mc_split_store(xf, (size_t)gridDim.x * H, p * H + i, v, parts);
}

/* The shared expert's gate sigmoid(sg) as the combine rounds it. */
__device__ __forceinline__ float moe_shared_gate(float sg) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(0.0f - sg)));
}

/* a[u] = the combine's sum at i0 + stride u (below H) over one token's K pairs (pair, wbits
 * [K]: its rows of y [P, H] and weight bits), ascending expert: round(w y[pair, i]) added
 * from 0. The rows are loaded 8 at a time before they are added, in that order. */
template <int U>
__device__ __forceinline__ void moe_combine_sum(const float *__restrict__ y, const int32_t *pair,
                                                const int32_t *wbits, int K, int H, int i0,
                                                int stride, float (&a)[U]) {
#pragma unroll
    for (int u = 0; u < U; u++) a[u] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 8) {
        float v[8][U];
#pragma unroll
        for (int k = 0; k < 8; k++)
            mc_load_strided<U>(v[k], y + (size_t)pair[k0 + k < K ? k0 + k : 0] * H, i0, stride, H);
#pragma unroll
        for (int k = 0; k < 8; k++)
#pragma unroll
            for (int u = 0; u < U; u++)
                if (k0 + k < K) a[u] = __fadd_rn(a[u], __fmul_rn(v[k][u], __int_as_float(wbits[k0 + k])));
    }
}

/* out[t, i] = sum over k < K (the token's pairs, ascending expert) of round(w y[pair, i]),
 * from 0 (moe_combine_sum); then, with sy, + round(sigmoid(sg[t]) sy[t, i]). pair, wbits
 * [T, K]. grid mc_grid_elems(T, H), block 256. */
__global__ void moe_combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair,
                                   const int32_t *__restrict__ wbits, int K, int H,
                                   const float *__restrict__ sy, const float *__restrict__ sg,
                                   float *__restrict__ out) {
    cuda_pdl_wait(); /* programmatic (g->pdl): the experts' down GEMM has completed */
    cuda_pdl_trigger();
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= H) return;
    const float gate = sy ? moe_shared_gate(sg[t]) : 0.0f;
    float a[1];
    moe_combine_sum<1>(y, pair + t * K, wbits + t * K, K, H, i, 0, a);
    if (sy) a[0] = __fadd_rn(a[0], __fmul_rn(gate, sy[t * H + i]));
    out[t * H + i] = a[0];
}

/* The residual stream after a sparse layer of the common graph (mc_moe_block_queue). */
struct moe_resid_out {
    const float *w;   /* [H] the next norm's weight */
    float eps;
    float *x, *xn;    /* [T, H] */
    uint16_t *xf;     /* xn's GEMM split (mc_split_store, parts), or NULL */
    int parts;
};

constexpr int MOE_CN_THREADS = 512, MOE_CN_U = 4;
/* passes of MOE_CN_U values a thread over the widest folded row */
constexpr int MOE_CN_NP = (MOE_FOLD_H_MAX + MOE_CN_U * MOE_CN_THREADS - 1) / (MOE_CN_U * MOE_CN_THREADS);

/* moe_combine_kernel and the residual RMSNorm after it (mc_residual_norm) in one block per
 * token: v = x[t] + the combine's out[t, i] (its sum, in its order), x[t] = v, xn[t] =
 * RMSNorm(v) w (forward_cuda.cu's rmsnorm_kernel: mc_row_sumsq's sum, its products) and
 * xn's split: the same bits as the two launches. A thread's values i = t + 512
 * (4 p + u) stay in registers, with their weights (loaded before the grid wait: no kernel
 * writes them) and each value's K rows (loaded before its sum); v goes to shared memory only
 * for the sum of squares' order. H <= MOE_FOLD_H_MAX; dynamic shared memory H floats; grid
 * T, block MOE_CN_THREADS. */
__global__ void __launch_bounds__(MOE_CN_THREADS)
moe_combine_norm_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair,
                        const int32_t *__restrict__ wbits, int K, int H,
                        const float *__restrict__ sy, const float *__restrict__ sg,
                        const moe_resid_out o) {
    constexpr int U = MOE_CN_U, NT = MOE_CN_THREADS, NP = MOE_CN_NP;
    extern __shared__ __align__(16) float vs[]; /* [H] v */
    __shared__ int32_t s_pair[MOE_CUDA_K_MAX], s_wb[MOE_CUDA_K_MAX];
    __shared__ double sh[4];
    float wr[NP][U], vr[NP][U];
#pragma unroll
    for (int p = 0; p < NP; p++) mc_load_strided<U>(wr[p], o.w, threadIdx.x + p * U * NT, NT, H);
    cuda_pdl_wait(); /* programmatic (g->pdl): the experts' down GEMM has completed */
    cuda_pdl_trigger();
    const size_t t = blockIdx.x;
    if (threadIdx.x < K) {
        s_pair[threadIdx.x] = pair[t * K + threadIdx.x];
        s_wb[threadIdx.x] = wbits[t * K + threadIdx.x];
    }
    const float gate = sy ? moe_shared_gate(sg[t]) : 0.0f;
    __syncthreads();
    float *xr = o.x + t * H;
#pragma unroll
    for (int p = 0; p < NP; p++) {
        const int i0 = threadIdx.x + p * U * NT;
        if (p * U * NT >= H) break; /* uniform */
        float a[U];
        mc_load_strided<U>(vr[p], xr, i0, NT, H);
        moe_combine_sum<U>(y, s_pair, s_wb, K, H, i0, NT, a);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + NT * u;
            if (i >= H) break;
            if (sy) a[u] = __fadd_rn(a[u], __fmul_rn(gate, sy[t * H + i]));
            const float v = vr[p][u] + a[u];
            xr[i] = vs[i] = vr[p][u] = v;
        }
    }
    const float r = mc_rms_r(mc_row_sumsq(vs, H, sh), H, o.eps);
#pragma unroll
    for (int p = 0; p < NP; p++)
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = threadIdx.x + p * U * NT + NT * u;
            if (i >= H) break;
            const float v = wr[p][u] * (vr[p][u] * r);
            o.xn[t * H + i] = v;
            if (o.xf) mc_split_store(o.xf, (size_t)gridDim.x * H, t * H + i, v, o.parts);
        }
}

// ---------------------------------------------------------------------------
// one sparse layer
// ---------------------------------------------------------------------------

/* y [P, N] (rows of expert e at its group's rows) = x [P, K] . w_e^T, w_e = w + e N K: one
 * grouped launch over r's groups, or one tqkv_cuda_gemm per expert with tokens (grouped
 * off, or cuBLAS: r->count read back). pre: the kernel before wrote in's split into xf
 * (grouped only). */
static tqkv_status experts_gemm(model_cuda *g, mc_moe_state *x, const moe_routing *r, int pre,
                                void *xf, const float *in, int K, const bf16 *w, int N, float *y) {
    if (!r->count && pre)
        return tqkv_cuda_gemm_grouped_presplit(r->P, (const uint16_t *)w, (size_t)N * K, N, K, y, N,
                                               x->idx, r->G, r->most, xf, g->gemm_parts, g->pdl,
                                               g->stream);
    if (!r->count)
        return tqkv_cuda_gemm_grouped(in, K, r->P, (const uint16_t *)w, (size_t)N * K, N, K, y, N,
                                      x->idx, r->G, r->most, xf, g->gemm_parts, g->stream);
    tqkv_status st = TQKV_OK;
    size_t o = 0;
    for (int e = 0; e < r->E && !st; o += (size_t)r->count[e], e++)
        if (r->count[e])
            st = mc_gemm(g, in + o * K, K, r->count[e], w + (size_t)e * N * K, N, K, NULL,
                         y + o * N, N);
    return st;
}

/* h [n, W] = act(gate) * up of gu [n, 2W] on g's stream; with xf also h's GEMM split. */
static void act_queue(model_cuda *g, moe_act act, const float *gu, int W, float *h, size_t n,
                      uint16_t *xf) {
    if (act == MOE_ACT_SILU) mc_swiglu_queue(gu, W, h, n, xf, g->gemm_parts, g->pdl, g->stream);
    else mc_geglu_queue(gu, W, h, n, xf, g->gemm_parts, g->pdl, g->stream);
}

/* The shared expert of xn [T, H] into x->sy, its gate logits into x->sg. */
static tqkv_status shared_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                                mc_moe_state *x, const float *xn, int T) {
    const int H = sh->hidden, S = sh->shared_inter;
    tqkv_status st = mc_gemm(g, xn, H, T, D->sh_wgu, 2 * S, H, NULL, x->gu, 2 * (size_t)S);
    if (!st) act_queue(g, sh->act, x->gu, S, x->h, (size_t)T, NULL);
    if (!st) st = mc_gemm(g, x->h, S, T, D->sh_wd, H, S, NULL, x->sy, H);
    if (!st) mc_moe_gate_queue(g, xn, D->sh_gate, T, H, x->sg);
    return st;
}

/* The sparse layer's queue up to its combine (mc_moe_queue's steps): routing, gather, the
 * experts' GEMMs, the shared expert. */
static tqkv_status experts_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                                 mc_moe_state *x, const float *xr, const float *xn, int T) {
    const int E = sh->n_experts, K = sh->top_k, H = sh->hidden, I = sh->inter;
    const size_t P = (size_t)T * K;
    const cudaStream_t s = g->stream;
    if (!x || (size_t)T > x->cap || E > x->e_cap || K > x->k_cap || E > MOE_CUDA_E_MAX ||
        K > MOE_CUDA_K_MAX)
        return tqkv_fail(TQKV_ESTATE, "cuda forward: experts scratch holds %zu tokens of %d "
                         "experts top %d, not %d of %d top %d", x ? x->cap : 0, x ? x->e_cap : 0,
                         x ? x->k_cap : 0, T, E, K);
    // ---- routing on the device: x->idx's groups, tok, pair and weights
    /* the grouped GEMMs' activation splits written by the gather and the activation (into
     * x->xf, read by the GEMM right after each; TQKV_GEMM_PRESPLIT=0: the split launches);
     * the per-expert path (r.count) takes the plain rows */
    const int split = g->presplit && !g->cublas && mc_moe_grouped_on();
    moe_routing r;
    tqkv_status st = mc_moe_route_queue(g, D, sh, x, xr, xn, split ? (uint16_t *)x->xf : NULL, T, &r);
    const int32_t *tok = x->idx + IDX_TOK(E);
    const int pre = !st && !r.count && split;
    uint16_t *xf = pre ? (uint16_t *)x->xf : NULL;
    if (!st && !r.gathered) /* (one token: maybe in the router kernel) */
        cuda_pdl_launch(g->pdl, moe_gather_kernel, mc_grid_elems(P, (size_t)H), dim3(256), 0, s, xn,
                        tok, H, x->xg, xf, g->gemm_parts);
    // ---- experts over their gathered rows: gate|up, activation, down
    if (!st && !r.count && mc_moe_fold_act_on()) { /* the activation in gate|up's epilogue */
        /* h's split for the down GEMM goes to x->gu (unused here): gate|up still reads xf */
        void *hf = pre ? (void *)x->gu : NULL;
        const tqkv_gemm_act a = {sh->act == MOE_ACT_SILU ? TQKV_GEMM_ACT_SILU : TQKV_GEMM_ACT_GELU,
                                 x->h, (size_t)I, hf};
        st = tqkv_cuda_gemm_grouped_act(pre ? NULL : x->xg, H, (int)P, (const uint16_t *)D->wgu,
                                        (size_t)2 * I * H, 2 * I, H, &a, x->idx, r.G, r.most, x->xf,
                                        g->gemm_parts, pre ? g->pdl : 0, g->stream);
        if (!st) mc_moe_fold_act_count();
        if (!st) st = experts_gemm(g, x, &r, pre, hf ? hf : x->xf, x->h, I, D->wd, H, x->y);
    } else {
        if (!st) st = experts_gemm(g, x, &r, pre, x->xf, x->xg, H, D->wgu, 2 * I, x->gu);
        if (!st) act_queue(g, sh->act, x->gu, I, x->h, P, xf);
        if (!st) st = experts_gemm(g, x, &r, pre, x->xf, x->h, I, D->wd, H, x->y);
    }
    // ---- the shared expert
    if (!st && sh->shared_inter > 0) st = shared_queue(g, D, sh, x, xn, T);
    return st;
}

extern "C" tqkv_status mc_moe_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                                    mc_moe_state *x, const float *xr, const float *xn,
                                    float *out, int T) {
    const int E = sh->n_experts, K = sh->top_k, H = sh->hidden;
    const size_t P = (size_t)T * K;
    tqkv_status st = experts_queue(g, D, sh, x, xr, xn, T);
    // ---- combine: out [T, H], each token's experts in ascending order
    const int shared = sh->shared_inter > 0;
    if (!st)
        cuda_pdl_launch(g->pdl, moe_combine_kernel, mc_grid_elems((size_t)T, (size_t)H), dim3(256), 0,
                        g->stream, x->y, x->idx + IDX_PAIR(E, P), x->idx + IDX_WB(E, P), K, H,
                        shared ? x->sy : NULL, x->sg, out);
    if (!st) st = mc_ck(cudaGetLastError(), "experts kernels");
    return st;
}

extern "C" tqkv_status mc_moe_block_queue(model_cuda *g, const mc_moe_layer *D,
                                          const moe_shape *sh, mc_moe_state *x, const float *w_in,
                                          const float *w_out, int T) {
    const int E = sh->n_experts, K = sh->top_k, H = sh->hidden;
    const size_t P = (size_t)T * K;
    mc_residual_norm(g, w_in, (size_t)T);
    if (!mc_moe_folds_norm(sh)) { /* the launch the fold replaces */
        tqkv_status st = mc_moe_queue(g, D, sh, x, g->xn, g->xn, g->tmp, T);
        if (!st) mc_residual_norm(g, w_out, (size_t)T);
        return st;
    }
    tqkv_status st = experts_queue(g, D, sh, x, g->xn, g->xn, T);
    // ---- combine, x += it, xn = RMSNorm(x) w_out (and xn's split) in one kernel
    const moe_resid_out o = {w_out, g->m->cfg.rms_norm_eps, g->x, g->xn, mc_split_xf(g),
                             g->gemm_parts};
    if (!st)
        cuda_pdl_launch(g->pdl, moe_combine_norm_kernel, dim3((unsigned)T), dim3(MOE_CN_THREADS),
                        (size_t)H * 4, g->stream, x->y, x->idx + IDX_PAIR(E, P),
                        x->idx + IDX_WB(E, P), K, H, sh->shared_inter > 0 ? x->sy : NULL, x->sg, o);
    if (!st) st = mc_ck(cudaGetLastError(), "experts kernels");
    return st;
}

extern "C" tqkv_status mc_moe_check(const tqkv_model *m) {
    const tqkv_model_config *c = &m->cfg;
    const int I = c->moe_intermediate_size, S = c->moe_shared_intermediate_size;
    if (c->n_moe_layers && (c->n_experts > MOE_CUDA_E_MAX || c->n_experts_used > MOE_CUDA_K_MAX))
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %s: %d experts, top %d: the device "
                         "routes at most %d experts, top %d", c->arch_name, c->n_experts,
                         c->n_experts_used, MOE_CUDA_E_MAX, MOE_CUDA_K_MAX);
    if (c->n_moe_layers && (I % 8 || c->hidden_size % 8 || S % 8))
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %s: expert width %d, shared expert "
                         "width %d and hidden %d must be multiples of 8", c->arch_name, I, S,
                         c->hidden_size);
    return TQKV_OK;
}
