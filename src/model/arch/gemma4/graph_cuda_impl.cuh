/*
 * src/model/arch/gemma4/graph_cuda_impl.cuh - what the Gemma 4 device graph's files share
 * (graph_cuda.cu: the forward; graph_cuda_state.cu: weights, per-state extras, checks;
 * graph_cuda_kernels.cu: the per-token kernels and their launchers).
 * Owns: the layouts of Gemma 4's device weights beyond mc_layer and of its per-state extras,
 * the declarations of the kernels and launchers the forward queues.
 * Must not: be included outside src/model/arch/gemma4/.
 */
#ifndef TQKV_MODEL_ARCH_GEMMA4_GRAPH_CUDA_IMPL_CUH
#define TQKV_MODEL_ARCH_GEMMA4_GRAPH_CUDA_IMPL_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "model/ops/ops.h"
#include "util/common.h"
}
#include "cache/cache_cuda.h"
#include "model/cuda/model_cuda_impl.h"
#include "model/cuda/moe_cuda.h"
extern "C" {
#include "model/arch/gemma4/gemma4.h"
}

// ---------------------------------------------------------------------------
// weights (graph_cuda_state.cu)
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

/* The shape of Gemma 4's experts: GELU-tanh gated MLPs. */
static inline moe_shape g4_moe_shape(const tqkv_model *m) {
    moe_shape sh = moe_shape_of(&m->cfg);
    sh.act = MOE_ACT_GELU_TANH;
    return sh;
}

// ---------------------------------------------------------------------------
// per-state extras: window views, drop scratch (graph_cuda_state.cu)
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

// ---------------------------------------------------------------------------
// kernels and their launchers (graph_cuda_kernels.cu)
// ---------------------------------------------------------------------------

/* Launched from graph_cuda.cu; each is documented at its definition. */
__global__ void g4_embed_kernel(const int32_t *__restrict__ tinfo, const bf16 *__restrict__ e,
                                int H, float escale, float *__restrict__ x);
__global__ void g4_ple_kernel(float *__restrict__ ple, const int32_t *__restrict__ tinfo, int T,
                              int L, int P, const bf16 *__restrict__ eple,
                              const float *__restrict__ pn, float eps, float hs, float pscale,
                              float mix);
__global__ void g4_gather_kernel(const float *__restrict__ ob, const int32_t *__restrict__ tinfo,
                                 int NH, int n, int hd, float *__restrict__ att,
                                 uint16_t *__restrict__ xf, int parts);
__global__ void g4_ple_gate_kernel(float *__restrict__ pg, const float *__restrict__ ple, int P,
                                   size_t LP, int l, uint16_t *__restrict__ xf, int parts);
__global__ void g4_softcap_kernel(float *__restrict__ lg, size_t n, float cap);

/* The norm kernels or their register twins (mc_norm_nv) over T rows on s. */
void g4_moe_mix_queue(float *o, const float *h2, const float *w1, const float *w2, float eps,
                      int H, size_t T, cudaStream_t s);
void g4_rmsnorm_queue(const float *x, const float *w, float eps, int H, float post, float *out,
                      uint16_t *xf, int parts, size_t T, cudaStream_t s);
void g4_residual_queue(float *x, const float *o, const float *wpost, float eps, int H, float ls,
                       const float *wnext, float *xn, uint16_t *xf, int parts, size_t T,
                       cudaStream_t s);
/* Layer L's q / k / v norms and RoPE (g4_qkv_kernel at head dim hd) from g->qkv into
 * g->qb, g->kb, g->vb. */
tqkv_status g4_qkv_launch(model_cuda *g, int hd, int QS, int T, int NH, int nkv, int n,
                          int keqv, const mc_layer *L, float eps, const float *rope, int RW);

#endif
