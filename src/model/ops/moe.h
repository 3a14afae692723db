/*
 * moe.h - the routed-experts feed-forward the mixture-of-experts graphs share (issue 24):
 *   router, float32 softmax, top-k, each expert's gated MLP (SiLU, or GELU-tanh for Gemma 4)
 *   over the tokens routed to it, the weighted sum in ascending expert order, and an
 *   optional shared expert scaled by sigmoid(shared_expert_gate) (Qwen3-Next / Qwen 3.5 MoE).
 * Owns: one sparse layer's weights (moe_layer), its shape (moe_shape), the scratch.
 * Must not: load weights (load/weights.c: model_load_experts) or know which graph calls it;
 *   let a token's output depend on the other tokens of the call: every product is a
 *   row-independent GEMM (mm_matmul_ld) and a token's expert outputs are added in ascending
 *   expert order, whatever else was routed with it.
 *
 * moe_experts, per token t (transformers' Qwen3MoeSparseMoeBlock / Qwen3_5MoeSparseMoeBlock,
 * Gemma4TextRouter + Gemma4TextExperts), xr_t the router's input (xn_t unless given):
 *   p = softmax(router xr_t) over E experts;  the K most probable (ties: the lower index),
 *   weights p (divided by their sum when norm_topk, then times expert_scale[e] if given);
 *   r = sum over the chosen e, ascending e, of round(w_e * down_e(act(gate_e xn_t) * up_e xn_t));
 *   shared expert (if any): r = r + sigmoid(shared_gate . xn_t) * shared(xn_t);
 *   out_t = r.   moe_forward: x_t += r.
 */
#ifndef TQKV_OPS_MOE_H
#define TQKV_OPS_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "model/ops/matmul.h"
#include "tqkv_model.h"

/* One sparse layer's weights. */
typedef struct {
    mm_weight  router;   /* [E, hidden] */
    mm_weight *gu;       /* [E] each [2 * inter, hidden] = gate; up rows (data NULL when not
                            fused: then g / u below) */
    mm_weight *g, *u;    /* [E] each [inter, hidden] */
    mm_weight *down;     /* [E] each [hidden, inter] */
    /* shared expert (data NULL when the graph has none) */
    mm_weight  sh_gu;    /* [2 * shared_inter, hidden] gate; up (data NULL: sh_g / sh_u) */
    mm_weight  sh_g, sh_u; /* [shared_inter, hidden] */
    mm_weight  sh_down;  /* [hidden, shared_inter] */
    mm_weight  sh_gate;  /* [1, hidden] */
    const float *expert_scale; /* [E] per-expert factor of the routing weight (Gemma 4), or NULL */
} moe_layer;

typedef enum { MOE_ACT_SILU = 0, MOE_ACT_GELU_TANH } moe_act;

typedef struct {
    int hidden, n_experts, top_k, inter; /* inter: one expert's SwiGLU width */
    int norm_topk;                       /* renormalise the top-k weights to sum 1 */
    int shared_inter;                    /* the shared expert's width (0: none) */
    moe_act act;                         /* the experts' gate activation */
} moe_shape;

/* The shape of a config's sparse layers (SiLU experts: a graph with others sets act). */
moe_shape moe_shape_of(const tqkv_model_config *c);

/* Per-state scratch, grown on demand (zero-initialise before the first use). */
typedef struct {
    size_t   cap;     /* tokens the buffers hold */
    float   *logits;  /* [T, E] router logits, then probabilities */
    float   *wts;     /* [T, K] routing weights of the chosen experts */
    int32_t *sel;     /* [T, K] chosen experts, by descending probability */
    int32_t *tok;     /* [T] tokens routed to the current expert */
    float   *w1;      /* [T] their weights */
    float   *xg;      /* [T, hidden] their inputs */
    float   *gu;      /* [T, 2 * max(inter, shared_inter)] gate | up */
    float   *h;       /* [T, max(inter, shared_inter)] */
    float   *y;       /* [T, hidden] expert outputs */
    float   *acc;     /* [T, hidden] the weighted sum */
    float   *sg;      /* [T] shared expert gate logits */
    float   *perm;    /* [T, max(hidden, inter, shared_inter)] matmul scratch */
} moe_scratch;

/* One token's routing (moe_experts' and the device graphs' one rule): p = softmax(logits
 * [E]) in place; the K most probable experts (ties: the lower index) into sel [K] by
 * descending p, their weights into w [K] (renormalised if norm, then times scale[e] if
 * scale is given). */
void moe_route_token(float *p, int E, int K, int norm, const float *scale, int32_t *sel,
                     float *w);

/* Buffers for T tokens (nothing changes on failure but the scratch, which stays usable). */
tqkv_status moe_scratch_reserve(moe_scratch *x, const moe_shape *sh, size_t T);
void        moe_scratch_free(moe_scratch *x);

/* out [T, hidden] = the layer's experts of xn [T, hidden] routed on xr [T, hidden] (NULL:
 * xn) (formula above); out may be sc->acc once the scratch holds T tokens
 * (moe_scratch_reserve). Fails only when the scratch cannot grow, before
 * touching out. */
tqkv_status moe_experts(const moe_layer *L, const moe_shape *sh, const float *xr,
                        const float *xn, float *out, size_t T, int threads, moe_scratch *sc);
/* x [T, hidden] += the layer's feed-forward of xn [T, hidden]; the same failure rule. */
tqkv_status moe_forward(const moe_layer *L, const moe_shape *sh, const float *xn, float *x,
                        size_t T, int threads, moe_scratch *sc);

#endif
