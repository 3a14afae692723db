/*
 * src/model/arch/gemma4/graph_cuda.cu - the Gemma 4 text graph on the device (the GPU twin of
 * src/model/arch/gemma4/graph.c; forward_cuda.cu dispatches a Gemma 4 state's forward queue here).
 * Owns: Gemma 4's device weights beyond mc_layer (per-layer inputs, post norms, layer
 * scalars), its per-token kernels (scaled embedding, per-layer input mix, q / k RMSNorm
 * with weight + RoPE per layer type and the scale-free v norm at head_dim 128 or 256,
 * post-attention / post-FFN / post-PLE norms fused with the residual and the layer
 * scalar, GeGLU, the per-layer gate, the final logit softcap), the KV-shared layers'
 * reads of their donor's device cache (no copy), the sliding layers' window views (decode
 * attention over the newest `window` keys) and their bounded caches (the device form of
 * tqkv_batch_drop_oldest, after each forward outside a spec round), and the MoE block's
 * inputs, norms and mix (enable_moe_block; its experts are the shared device experts,
 * src/model/cuda/moe_cuda.h, so a MoE state's decode steps run kernel by kernel).
 * Must not: make a row's result depend on other rows (per-token kernels, the batch-
 * invariant GEMM and attention: nothing here is shared across rows); change the other
 * graphs' device forward (forward_cuda.cu).
 *
 * The operations are src/model/arch/gemma4/graph.c's, in its order, with __f*_rn so nothing is contracted
 * into an FMA the CPU does not do (the CPU builds with -std=c11: no contraction); tanhf is
 * CUDA's (within two ulp of libm's), sums of squares are in double in another order, so the
 * results match the CPU within float32 rounding, not bit for bit.
 *
 * Window views and drops are the cache's (cache_cuda_slide.cu: tqkv_cuda_kv_window_view,
 * tqkv_cuda_kv_drop_oldest); this file decides when a layer takes them.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "model/ops/ops.h"
#include "util/common.h"
}
#include "cache/cache_cuda.h"
#include "model/cuda/model_cuda_impl.h"
#include "model/cuda/moe_cuda.h"
#include "model/ops/ops_cuda.cuh"
extern "C" {
#include "model/arch/gemma4/gemma4.h"
}

// ---------------------------------------------------------------------------
// weights
// ---------------------------------------------------------------------------

typedef struct {
    float *post_attn, *post_ffn, *post_ple; /* [H] each (post_ple NULL without P) */
    bf16 *ple_gate;                         /* [P, H] */
    bf16 *ple_proj;                         /* [H, P] */
    float layer_scalar;
    /* the MoE block (enable_moe_block), else NULL: the experts (moe_cuda.h), the router's
     * input scale and the block's three norms, [H] each */
    mc_moe_layer *moe;
    float *router_scale, *pre_ffn_2, *post_ffn_1, *post_ffn_2;
} g4_cuda_layer;

struct g4_cuda_weights {
    int n_layers;
    g4_cuda_layer *layers; /* [L] */
    bf16 *embed_ple;       /* [ple_vocab, L P] */
    bf16 *ple_model_proj;  /* [L P, H] */
    float *ple_norm;       /* [P] */
};

static void weights_free(void *p) {
    g4_cuda_weights *w = (g4_cuda_weights *)p;
    if (!w) return;
    for (int l = 0; w->layers && l < w->n_layers; l++) {
        g4_cuda_layer *X = &w->layers[l];
        void *ps[] = {X->post_attn,    X->post_ffn,  X->post_ple,   X->ple_gate,  X->ple_proj,
                      X->router_scale, X->pre_ffn_2, X->post_ffn_1, X->post_ffn_2};
        for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
        mc_moe_layer_free(X->moe);
    }
    free(w->layers);
    cudaFree(w->embed_ple);
    cudaFree(w->ple_model_proj);
    cudaFree(w->ple_norm);
    free(w);
}

/* The shape of Gemma 4's experts: GELU-tanh gated MLPs. */
static moe_shape g4_moe_shape(const tqkv_model *m) {
    moe_shape sh = moe_shape_of(&m->cfg);
    sh.act = MOE_ACT_GELU_TANH;
    return sh;
}

/* Layer SX's MoE block (router, experts, per-expert scale, its norms) into X. */
static tqkv_status upload_moe(const tqkv_model *m, const g4_layer *SX, g4_cuda_layer *X) {
    const int H = m->cfg.hidden_size;
    const moe_shape sh = g4_moe_shape(m);
    tqkv_status st = mc_moe_layer_upload(&SX->moe, &sh, &X->moe);
    if (!st) st = mc_upload_vec(&X->router_scale, &SX->router_scale, &H, 1);
    if (!st) st = mc_upload_vec(&X->pre_ffn_2, &SX->pre_ffn_norm_2, &H, 1);
    if (!st) st = mc_upload_vec(&X->post_ffn_1, &SX->post_ffn_norm_1, &H, 1);
    if (!st) st = mc_upload_vec(&X->post_ffn_2, &SX->post_ffn_norm_2, &H, 1);
    if (!st && (!X->router_scale || !X->pre_ffn_2 || !X->post_ffn_1 || !X->post_ffn_2))
        st = tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: a Gemma 4 MoE block lacks a norm weight");
    return st;
}

/* Every layer's mc_layer (q|k|v stacked as the layer has them: q only on a KV-shared
 * layer, q|k under k_eq_v) and the Gemma extras. w->layers is allocated, zeroed. */
extern "C" tqkv_status g4_cuda_upload(const tqkv_model *m, model_cuda_weights *w) {
    const tqkv_model_config *c = &m->cfg;
    const g4_model *G = gemma4_of(m);
    const g4_config *g = &G->cfg;
    const int H = c->hidden_size, L = c->n_layers, P = g->ple_dim, LP = L * P;
    g4_cuda_weights *x = (g4_cuda_weights *)calloc(1, sizeof *x);
    if (!x) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    x->n_layers = L;
    x->layers = (g4_cuda_layer *)calloc((size_t)L, sizeof *x->layers);
    w->arch = x; /* freed with w on failure */
    w->arch_free = weights_free;
    if (!x->layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++) {
        const model_layer *S = &m->layers[l];
        const g4_layer *SX = &G->layers[l];
        mc_layer *D = &w->layers[l];
        g4_cuda_layer *X = &x->layers[l];
        const int hd = g->head_dim[l], own = g->donor[l] == l;
        const mm_weight *qkv[3] = {&S->wq, &S->wk, &S->wv}, *wo = &S->wo, *wd = &S->wd;
        const mm_weight *gu[2] = {&S->wg, &S->wu};
        const int nq = !own ? 1 : g->k_eq_v[l] ? 2 : 3;
        const float *an = S->attn_norm, *fn = S->ffn_norm, *qn = S->q_norm,
                    *kn = own ? S->k_norm : NULL;
        const float *pa = SX->post_attn_norm, *pf = SX->post_ffn_norm, *pp = SX->post_ple_norm;
        st = mc_upload_matrix(&D->wqkv, qkv, nq);
        if (!st) st = mc_upload_matrix(&D->wo, &wo, 1);
        if (!st) st = mc_upload_matrix(&D->wgu, gu, 2);
        if (!st) st = mc_upload_matrix(&D->wd, &wd, 1);
        if (!st) st = mc_upload_vec(&D->attn_norm, &an, &H, 1);
        if (!st) st = mc_upload_vec(&D->ffn_norm, &fn, &H, 1);
        if (!st) st = mc_upload_vec(&D->q_norm, &qn, &hd, 1);
        if (!st) st = mc_upload_vec(&D->k_norm, &kn, &hd, 1);
        if (!st) st = mc_upload_vec(&X->post_attn, &pa, &H, 1);
        if (!st) st = mc_upload_vec(&X->post_ffn, &pf, &H, 1);
        if (!st && P) {
            const mm_weight *pg = &SX->ple_gate, *pj = &SX->ple_proj;
            st = mc_upload_matrix(&X->ple_gate, &pg, 1);
            if (!st) st = mc_upload_matrix(&X->ple_proj, &pj, 1);
            if (!st) st = mc_upload_vec(&X->post_ple, &pp, &H, 1);
        }
        X->layer_scalar = SX->layer_scalar;
        if (!st && c->n_experts > 0) st = upload_moe(m, SX, X);
        if (!st && (!D->q_norm || (own && !D->k_norm) || !X->post_attn || !X->post_ffn ||
                    (P && !X->post_ple)))
            st = tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: Gemma 4 layer %d lacks a norm weight",
                           l);
    }
    if (!st && P) {
        const mm_weight *e = &G->embed_ple, *pm = &G->ple_model_proj;
        const float *pn = G->ple_norm;
        st = mc_upload_matrix(&x->embed_ple, &e, 1);
        if (!st) st = mc_upload_matrix(&x->ple_model_proj, &pm, 1);
        if (!st) st = mc_upload_vec(&x->ple_norm, &pn, &P, 1);
        if (!st && (LP % 8 || !x->ple_norm))
            st = tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: Gemma 4 per-layer inputs of %d", LP);
    }
    return st;
}

// ---------------------------------------------------------------------------
// per-state extras: window views, drop scratch
// ---------------------------------------------------------------------------

struct g4_cuda_state {
    cuda_kv_slide *slide; /* the sliding layers' window views and drops (one at a time) */
    /* the MoE block (enable_moe_block): the experts' scratch, and for moe_cap tokens the
     * router's input xr, the experts' input x2 and their output h2, [T, H] each */
    mc_moe_state *moe;
    size_t moe_cap;
    float *xr, *x2, *h2;
};

static inline g4_cuda_state *g4s(const model_cuda *g) { return (g4_cuda_state *)g->arch; }

extern "C" void g4_cuda_state_free(model_cuda *g) {
    g4_cuda_state *S = g4s(g);
    if (!S) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    tqkv_cuda_slide_free(S->slide);
    mc_moe_state_free(g, &S->moe);
    cudaFree(S->xr);
    cudaFree(S->x2);
    cudaFree(S->h2);
    free(S);
    g->arch = NULL;
}

/* The first sliding layer with a cache (every sliding layer has the same shape), or -1. */
static int first_sliding(const model_cuda *g) {
    const g4_config *c = &gemma4_of(g->m)->cfg;
    for (int l = 0; l < c->n_layers; l++)
        if (c->sliding[l] && g->kv[l]) return l;
    return -1;
}

/* The MoE block's buffers for the g->cap_t tokens of the common scratch (graphs off). */
static tqkv_status prepare_moe(model_cuda *g, g4_cuda_state *S) {
    const moe_shape sh = g4_moe_shape(g->m);
    tqkv_status st = mc_moe_reserve(g, &sh, &S->moe);
    const size_t T = g->cap_t, bytes = T * (size_t)g->m->cfg.hidden_size * 4;
    if (st || T <= S->moe_cap) return st;
    size_t cap = 0;
    S->moe_cap = 0;
    st = mc_regrow(g, (void **)&S->xr, 0, bytes, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&S->x2, 0, bytes, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&S->h2, 0, bytes, &cap, T);
    if (!st) S->moe_cap = T;
    return st;
}

/* Buffers for g->rows rows, made before any capture (a new set bumps the generation). */
extern "C" tqkv_status g4_cuda_prepare(model_cuda *g) {
    if (!g->arch) {
        g4_cuda_state *S = (g4_cuda_state *)calloc(1, sizeof *S);
        if (!S) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        tqkv_status st = tqkv_cuda_slide_init(&S->slide);
        if (st) {
            free(S);
            return st;
        }
        g->arch = S;
    }
    if (g->m->cfg.n_experts > 0) {
        const tqkv_status sm = prepare_moe(g, g4s(g));
        if (sm) return sm;
    }
    const int ls = first_sliding(g);
    if (ls < 0) return TQKV_OK;
    int moved = 0;
    tqkv_status st = tqkv_cuda_slide_reserve(g4s(g)->slide, g->kv[ls], &moved);
    if (moved) g->gen++;
    return st;
}

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
    mc_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
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
    mc_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
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
    mc_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
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
    mc_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
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
static void g4_moe_mix_queue(float *o, const float *h2, const float *w1, const float *w2,
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
static void g4_rmsnorm_queue(const float *x, const float *w, float eps, int H, float post,
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
static void g4_residual_queue(float *x, const float *o, const float *wpost, float eps, int H,
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
    mc_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
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
    mc_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
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
// window views and the bounded sliding caches
// ---------------------------------------------------------------------------

/* Decode attention (q, out [R, NH, hd]) of sliding layer cache kv over the newest `window`
 * keys of each row as it stood `back` tokens ago. Capturable (a view and the decode
 * kernel); the split bound of the view's longest row is in the graph key (win_ws). */
static tqkv_status view_attend(model_cuda *g, cuda_kv *kv, int back, const float *q, int NH,
                               float *out) {
    cuda_kv *v = NULL;
    tqkv_status st = tqkv_cuda_kv_window_view(kv, g4s(g)->slide, gemma4_of(g->m)->cfg.window, back, &v);
    if (!st) st = tqkv_cuda_kv_attend_ws(v, q, NH, 1.0f, out, g->aws, g->aws_bytes);
    return st;
}

/* The verification window on a sliding layer: query j through its view n - 1 - j tokens
 * back (mc_attend_as_decode's copies, the view in place of attend_back). */
static tqkv_status view_attend_as_decode(model_cuda *g, cuda_kv *kv, int n, int NH, int hd) {
    const size_t R = (size_t)g->rows, vec = (size_t)hd * sizeof(float);
    float *q1 = g->att, *o1 = g->att + R * NH * hd;
    tqkv_status st = TQKV_OK;
    for (int j = 0; j < n && !st; j++) {
        st = mc_ck(cudaMemcpy2DAsync(q1, vec, g->qb + (size_t)j * hd, (size_t)n * vec, vec, R * NH,
                                     cudaMemcpyDeviceToDevice, g->stream),
                   "verification query copy");
        if (!st) st = view_attend(g, kv, n - 1 - j, q1, NH, o1);
        if (!st)
            st = mc_ck(cudaMemcpy2DAsync(g->ob + (size_t)j * hd, (size_t)n * vec, o1, vec, vec,
                                         R * NH, cudaMemcpyDeviceToDevice, g->stream),
                       "verification output copy");
    }
    return st;
}

extern "C" int g4_cuda_win_tokens(const model_cuda *g, int n) {
    const g4_config *c = &gemma4_of(g->m)->cfg;
    int most = 0;
    for (int l = 0; l < c->n_layers; l++) {
        if (!c->sliding[l] || !g->kv[l]) continue;
        const int *o = tqkv_cuda_kv_offsets(g->kv[l]);
        for (int r = 0; r < g->rows; r++) {
            const int k = o[r] + n < c->window ? o[r] + n : c->window;
            most = k > most ? k : most;
        }
    }
    return most;
}

extern "C" tqkv_status g4_cuda_drop_oldest(model_cuda *g) {
    const g4_config *c = &gemma4_of(g->m)->cfg;
    if (c->pos_layer < 0) return TQKV_OK; /* never: model_cuda_init refuses it */
    tqkv_status st = g4_cuda_prepare(g);
    const int keep = c->window + g->p.window_slack;
    for (int l = 0; l < c->n_layers && !st; l++)
        if (c->sliding[l] && g->kv[l] && !tqkv_cuda_kv_spec_active(g->kv[l]))
            st = tqkv_cuda_kv_drop_oldest(g->kv[l], g4s(g)->slide, keep);
    return st;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

static tqkv_status qkv_launch(model_cuda *g, int hd, int QS, int T, int NH, int nkv, int n,
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

/* The call's upload (token list, both RoPE tables), the scaled embeddings x [T, H], the
 * per-layer inputs from them, layer 0's input norm into xn (and its GEMM split). */
static tqkv_status g4_begin(model_cuda *g, int n) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_cuda_weights *X = (const g4_cuda_weights *)g->w->arch;
    const int H = c->hidden_size, NL = c->n_layers, P = gemma4_of(g->m)->cfg.ple_dim;
    const size_t T = (size_t)g->rows * n, LP = (size_t)NL * P, RW = (size_t)mc_rope_width(g->m);
    const float eps = c->rms_norm_eps;
    const cudaStream_t s = g->stream;
    if (!g->arch) return tqkv_fail(TQKV_ESTATE, "cuda forward: Gemma 4 buffers not prepared");
    tqkv_status st =
        mc_ck(cudaMemcpyAsync(g->tinfo, g->h_tinfo, T * 3 * 4, cudaMemcpyHostToDevice, s),
              "upload tokens");
    if (!st)
        st = mc_ck(cudaMemcpyAsync(g->rope, g->h_rope, T * RW * 4, cudaMemcpyHostToDevice, s),
                   "upload rope");
    if (st) return st;
    g4_embed_kernel<<<mc_grid_elems(T, H), 256, 0, s>>>(g->tinfo, g->w->embed, H, sqrtf((float)H), g->x);
    if (P) {
        st = mc_gemm(g, g->x, H, (int)T, X->ple_model_proj, (int)LP, H, NULL, g->ple, LP);
        if (st) return st;
        const size_t warps = T * (size_t)NL;
        g4_ple_kernel<<<(unsigned)((warps + 3) / 4), 128, 0, s>>>(
            g->ple, g->tinfo, (int)T, NL, P, X->embed_ple, X->ple_norm, eps, 1.0f / sqrtf((float)H),
            sqrtf((float)P), 1.0f / sqrtf(2.0f));
    }
    /* the kernels before a GEMM write its activation split where mc_split_xf says (none
     * with cuBLAS or TQKV_GEMM_PRESPLIT=0); mc_gemm_pre then skips the split launch */
    g4_rmsnorm_queue(g->x, g->w->layers[0].attn_norm, eps, H, 1.0f, g->xn, mc_split_xf(g),
                     g->gemm_parts, T, s);
    return TQKV_OK;
}

/* Layer l's attention of its query heads over its cache (decode, verification window or
 * causal prefill; sliding layers through their window views) into ob. */
static tqkv_status g4_attend(model_cuda *g, int l, int n, int as_decode) {
    const g4_config *gc = &gemma4_of(g->m)->cfg;
    const int R = g->rows, NH = g->m->cfg.n_heads, hd = gc->head_dim[l], ty = gc->sliding[l] ? 0 : 1;
    cuda_kv *kv = g->kv[gc->donor[l]]; /* a KV-shared layer: the donor's, appended earlier */
    if (n == 1)
        return ty ? tqkv_cuda_kv_attend_ws(kv, g->qb, NH, 1.0f, g->ob, g->aws, g->aws_bytes)
                  : view_attend(g, kv, 0, g->qb, NH, g->ob);
    if (as_decode)
        return ty ? mc_attend_as_decode(g, kv, n, NH, hd, 1.0f)
                  : view_attend_as_decode(g, kv, n, NH, hd);
    /* causal; sliding layers see the newest `window` keys, self included */
    const int *o = tqkv_cuda_kv_offsets(kv), *lp = tqkv_cuda_kv_left_pads(kv);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++) {
            const int pos = o[r] - n + j; /* the token's index in this cache */
            const int lo = ty || pos + 1 <= gc->window ? 0 : pos + 1 - gc->window;
            g->h_lo[(size_t)r * n + j] = lp[r] + lo;
            g->h_hi[(size_t)r * n + j] = lp[r] + pos + 1;
        }
    return tqkv_cuda_kv_attend_masked(kv, g->qb, n, NH, 1.0f, g->h_lo, g->h_hi, g->ob);
}

/* Layer l's attention block: xn [T, H] -> q/k/v of the state's heads, the cache append (own
 * layers), attention, o_proj -> tmp [T, H]. *done = l + 1 once its cache took the append. */
static tqkv_status g4_mixer(model_cuda *g, int l, int n, int as_decode, int *lin, int *done) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_model *G = gemma4_of(g->m);
    const g4_config *gc = &G->cfg;
    const mc_layer *L = &g->w->layers[l];
    const int H = c->hidden_size, NH = c->n_heads, hd = gc->head_dim[l], NKV = gc->n_kv[l];
    const int own = gc->donor[l] == l, keqv = gc->k_eq_v[l], ty = gc->sliding[l] ? 0 : 1;
    const int QD = NH * hd, KD = NKV * hd, QS = QD + (own ? (keqv ? 1 : 2) * KD : 0);
    const int T = g->rows * n, RW = mc_rope_width(g->m);
    const float *rope = g->rope + (ty ? 2 * G->half[0] : 0);
    (void)lin; /* no recurrent layers */
    tqkv_status st = mc_gemm_pre(g, g->xn, H, T, L->wqkv, QS, H, NULL, g->qkv, QS); /* split: the norm before */
    if (!st) st = qkv_launch(g, hd, QS, T, NH, own ? NKV : 0, n, keqv, L, c->rms_norm_eps, rope, RW);
    if (!st && own) {
        st = tqkv_cuda_kv_append(g->kv[l], g->kb, g->vb, n);
        if (!st) *done = l + 1;
    }
    if (!st) st = g4_attend(g, l, n, as_decode);
    if (st) return st;
    g4_gather_kernel<<<mc_grid_elems((size_t)T, QD), 256, 0, g->stream>>>(
        g->ob, g->tinfo, NH, n, hd, g->att, mc_split_xf(g), g->gemm_parts);
    return mc_gemm_pre(g, g->att, QD, T, L->wo, H, QD, NULL, g->tmp, H);
}

/* After the attention (its output in tmp): x += post_attn_norm(o), xn = pre_ffn_norm(x);
 * the MoE block's experts of layer l into h2 (routed on xr, from x2) when it has one; the
 * GeGLU MLP of xn -> tmp [T, H]. */
static tqkv_status g4_ffn(model_cuda *g, int l, int T) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_cuda_layer *XL = &((const g4_cuda_weights *)g->w->arch)->layers[l];
    const mc_layer *L = &g->w->layers[l];
    const int H = c->hidden_size, I = c->intermediate_size;
    const float eps = c->rms_norm_eps;
    const cudaStream_t s = g->stream;
    uint16_t *const xf = mc_split_xf(g);
    /* xn's split for the MLP's first GEMM unless the MoE block runs between (its GEMMs may
     * use g->xf) */
    uint16_t *const xf_mlp = XL->moe ? NULL : xf;
    g4_residual_queue(g->x, g->tmp, XL->post_attn, eps, H, 1.0f, L->ffn_norm, g->xn, xf_mlp,
                      g->gemm_parts, T, s);
    tqkv_status st = TQKV_OK;
    if (XL->moe) { /* xr = rmsnorm(x) * router.scale * H^-1/2, x2 = rmsnorm_pre_ffn_2(x) */
        g4_cuda_state *GS = g4s(g);
        const moe_shape msh = g4_moe_shape(g->m);
        g4_rmsnorm_queue(g->x, XL->router_scale, eps, H, 1.0f / sqrtf((float)H), GS->xr, NULL, 1,
                         T, s);
        g4_rmsnorm_queue(g->x, XL->pre_ffn_2, eps, H, 1.0f, GS->x2, NULL, 1, T, s);
        st = mc_moe_queue(g, XL->moe, &msh, GS->moe, GS->xr, GS->x2, GS->h2, T);
        if (st) return st;
    }
    st = xf_mlp ? mc_gemm_pre(g, g->xn, H, T, L->wgu, 2 * I, H, NULL, g->gu, 2 * (size_t)I)
                : mc_gemm(g, g->xn, H, T, L->wgu, 2 * I, H, NULL, g->gu, 2 * (size_t)I);
    if (st) return st;
    mc_geglu_queue(g->gu, I, g->hh, (size_t)T, xf, g->gemm_parts, s);
    return mc_gemm_pre(g, g->hh, I, T, L->wd, H, I, NULL, g->tmp, H);
}

/* The experts' output h2 of layer l (a second partial of a sharded rank), or NULL. */
static float *g4_extra(model_cuda *g, int l) {
    const g4_cuda_layer *XL = &((const g4_cuda_weights *)g->w->arch)->layers[l];
    return XL->moe ? g4s(g)->h2 : NULL;
}

/* After the feed-forward (the MLP's output in tmp, the experts' in h2): with the MoE block
 * f = post_1(f) + post_2(h2); x += post_ffn_norm(f); the per-layer input block
 * x += post_ple_norm(W_proj(gelu(W_gate x) * ple[l])); x *= layer_scalar; xn = the next
 * block's norm (the final norm after the last layer). */
static tqkv_status g4_end(model_cuda *g, int l, int T) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_cuda_layer *XL = &((const g4_cuda_weights *)g->w->arch)->layers[l];
    const int H = c->hidden_size, NL = c->n_layers, P = gemma4_of(g->m)->cfg.ple_dim;
    const size_t LP = (size_t)NL * P;
    const float eps = c->rms_norm_eps;
    const cudaStream_t s = g->stream;
    const int parts = g->gemm_parts;
    uint16_t *const xf = mc_split_xf(g);
    if (XL->moe)
        g4_moe_mix_queue(g->tmp, g4s(g)->h2, XL->post_ffn_1, XL->post_ffn_2, eps, H, T, s);
    const float *nw = mc_next_norm(g, l);
    uint16_t *const xf_next = l + 1 < NL ? xf : NULL; /* the next qkv GEMM's (the lm_head splits) */
    if (!P) {
        g4_residual_queue(g->x, g->tmp, XL->post_ffn, eps, H, XL->layer_scalar, nw, g->xn,
                          xf_next, parts, T, s);
        return TQKV_OK;
    }
    g4_residual_queue(g->x, g->tmp, XL->post_ffn, eps, H, 1.0f, NULL, NULL, NULL, 1, T, s);
    tqkv_status st = mc_gemm(g, g->x, H, T, XL->ple_gate, P, H, NULL, g->pg, P);
    if (st) return st;
    g4_ple_gate_kernel<<<mc_grid_elems((size_t)T, P), 256, 0, s>>>(g->pg, g->ple, P, LP, l, xf, parts);
    st = mc_gemm_pre(g, g->pg, P, T, XL->ple_proj, H, P, NULL, g->tmp, H);
    if (st) return st;
    g4_residual_queue(g->x, g->tmp, XL->post_ple, eps, H, XL->layer_scalar, nw, g->xn, xf_next,
                      parts, T, s);
    return TQKV_OK;
}

/* The lm_head (head_n rows: a tensor-parallel rank's vocabulary slice, else V) over xn
 * into logits [rows or T, V], the soft-cap (elementwise: a slice gets the unsharded bits),
 * the copy to out (host; NULL: none), the device pick when pick > 0 (mode LAST). */
static tqkv_status g4_head_queue(model_cuda *g, int n, tqkv_logits_mode mode, float *out, int pick) {
    const int R = g->rows, H = g->m->cfg.hidden_size;
    const int V = g->head_n ? g->head_n : g->m->cfg.vocab_size;
    const size_t T = (size_t)R * n, nl = mode == TQKV_LOGITS_LAST ? (size_t)R : T;
    const float cap = gemma4_of(g->m)->cfg.softcap;
    const cudaStream_t s = g->stream;
    tqkv_status st;
    if (mode == TQKV_LOGITS_LAST) /* row r's last token is t = r n + n - 1 */
        st = mc_gemm(g, g->xn + (size_t)(n - 1) * H, (size_t)n * H, R, g->w->lm_head, V, H, NULL,
                     g->logits, V);
    else st = mc_gemm(g, g->xn, H, (int)T, g->w->lm_head, V, H, NULL, g->logits, V);
    if (!st && cap > 0) {
        const size_t cnt = nl * (size_t)V;
        g4_softcap_kernel<<<(unsigned)((cnt + 255) / 256), 256, 0, s>>>(g->logits, cnt, cap);
        st = mc_ck(cudaGetLastError(), "softcap");
    }
    /* the full rows leave before the pick's penalty changes them in place */
    if (!st && out)
        st = mc_ck(cudaMemcpyAsync(out, g->logits, nl * V * 4, cudaMemcpyDeviceToHost, s), "logits");
    if (!st && pick && mode == TQKV_LOGITS_LAST) st = mc_pick_queue(g, pick);
    return st;
}

static tqkv_status g4_head(model_cuda *g, int n, tqkv_logits_mode mode) {
    return g4_head_queue(g, n, mode, NULL, 0);
}

/* The pieces a tensor-parallel rank runs (arch.h; cuda/tp_cuda.cu): the attention's and the
 * MLP's partials all-reduced, and the experts' on their own (they are normed before they
 * join the MLP's), as src/model/arch/gemma4/tp.c on the CPU. */
extern "C" const model_arch_cuda_tp_ops g4_cuda_tp = {
    g4_begin, g4_mixer, g4_ffn, g4_extra, g4_end, g4_head,
};

/* forward_queue's contract (forward_cuda.cu) for src/model/arch/gemma4/graph.c's graph: the
 * pieces above in order. *done: the layers whose cache took this call's append
 * (forward_undo rewinds them). With n == 1 and !as_decode only kernels and copies between
 * fixed buffers, and host reads the graph key holds (rows, the attention shapes, storage
 * generations): capturable. */
extern "C" tqkv_status g4_cuda_forward_queue(model_cuda *g, int n, int as_decode,
                                             tqkv_logits_mode mode, float *out, int pick,
                                             int *done) {
    const int NL = g->m->cfg.n_layers, T = g->rows * n;
    int lin = 0;
    *done = 0;
    tqkv_status st = g4_begin(g, n);
    for (int l = 0; l < NL && !st; l++) {
        st = g4_mixer(g, l, n, as_decode, &lin, done);
        if (!st) st = g4_ffn(g, l, T);
        if (!st) st = g4_end(g, l, T);
    }
    if (!st) st = mc_ck(cudaGetLastError(), "forward kernels");
    if (st || mode == TQKV_LOGITS_NONE) return st;
    /* xn holds every token's final-normed state (the last layer's fused norm) */
    return g4_head_queue(g, n, mode, out, pick);
}

// ---------------------------------------------------------------------------
// the device runtime's checks and RoPE rows for a Gemma 4 model (arch.h's cuda hooks)
// ---------------------------------------------------------------------------

/* Per-layer head dims and KV heads the device kernels take, a bounded position layer, and
 * per-layer inputs the scratch can hold. */
extern "C" tqkv_status g4_cuda_check(const tqkv_model *m) {
    const tqkv_model_config *c = &m->cfg;
    const g4_config *g4 = &gemma4_of(m)->cfg;
    if (c->n_experts > 0) { /* the MoE blocks' expert shapes */
        const tqkv_status rc = mc_moe_check(m);
        if (rc) return rc;
    }
    for (int l = 0; l < c->n_layers; l++) {
        if (g4->head_dim[l] != CUDA_DIM && g4->head_dim[l] != CUDA_DIM_WIDE)
            return tqkv_fail(TQKV_EUNSUPPORTED,
                             "--device cuda: Gemma 4 layer %d head_dim %d (the "
                             "device kernels take %d and %d)",
                             l, g4->head_dim[l], CUDA_DIM, CUDA_DIM_WIDE);
        if (c->n_heads % g4->n_kv[l] || c->n_heads / g4->n_kv[l] > CUDA_MAX_G)
            return tqkv_fail(TQKV_EUNSUPPORTED,
                             "--device cuda: Gemma 4 layer %d: %d query heads "
                             "per KV head (at most %d)",
                             l, c->n_heads / g4->n_kv[l], CUDA_MAX_G);
    }
    if (g4->pos_layer < 0)
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "--device cuda: a Gemma 4 graph without a full "
                         "non-shared layer (its sliding layers could not be bounded)");
    if (g4->ple_dim && (g4->ple_dim % 8 || g4->ple_dim > c->intermediate_size))
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "--device cuda: per-layer input width %d (the device "
                         "needs a multiple of 8)",
                         g4->ple_dim);
    return TQKV_OK;
}

/* Both layer types' tables per token: sliding | full. */
extern "C" int g4_cuda_rope_width(const tqkv_model *m) {
    return 2 * (gemma4_of(m)->half[0] + gemma4_of(m)->half[1]);
}

extern "C" void g4_cuda_rope_row(const tqkv_model *m, int pos, float *rp) {
    for (int k = 0; k < 2; k++) {
        const int hk = gemma4_of(m)->half[k];
        if (hk) ops_rope_table(pos, gemma4_of(m)->inv_freq[k], hk, rp, rp + hk);
        rp += 2 * hk;
    }
}

extern "C" int g4_cuda_ple_width(const tqkv_model *m) { return gemma4_of(m)->cfg.ple_dim; }
