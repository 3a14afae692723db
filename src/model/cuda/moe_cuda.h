/*
 * moe_cuda.h - the routed-experts feed-forward on the device (moe_cuda.cu), shared by the
 * mixture-of-experts graphs (issue 24): the GPU twin of src/model/ops/moe.h's moe_experts
 * (router, top-k with the checkpoint's normalisation and per-expert scale, the experts'
 * gated MLPs with SiLU or GELU-tanh, the shared expert and its sigmoid gate).
 * Owns: one sparse layer's device weights (mc_moe_layer), a state's experts scratch
 * (mc_moe_state), and ready-made hooks (arch.h's model_arch_cuda_ops) for graphs whose
 * experts are a `moe_layer` array the common device graph runs through its `ffn` hook
 * (Qwen3-MoE, Qwen 3.5 MoE). Plain C declarations with opaque types: the arch.c files
 * (C) point their hooks here; a graph with its own forward queue (Gemma 4) calls the layer
 * functions itself.
 * Must not: know which graph calls it, or let a token's output depend on the other tokens
 *   of the call (moe_cuda.cu says how).
 */
#ifndef TQKV_MODEL_MOE_CUDA_H
#define TQKV_MODEL_MOE_CUDA_H

#include "model/ops/moe.h"
#include "tqkv_model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most experts and picks per token the device routing takes (a thread's arrays). */
#define MOE_CUDA_E_MAX 512
#define MOE_CUDA_K_MAX 32

struct model_cuda;
struct model_cuda_weights;
typedef struct mc_moe_layer mc_moe_layer; /* one sparse layer's device weights */
typedef struct mc_moe_state mc_moe_state; /* a state's experts scratch */

/* --- one sparse layer, for graphs with their own forward queue ------------------------ */

/* A refusal (TQKV_EUNSUPPORTED, with a message) of expert shapes the device cannot run. */
tqkv_status mc_moe_check(const tqkv_model *m);
/* Sparse layer X of shape sh onto the device (*out NULL on failure, nothing left over). */
tqkv_status mc_moe_layer_upload(const moe_layer *X, const moe_shape *sh, mc_moe_layer **out);
void        mc_moe_layer_free(mc_moe_layer *D);
/* *x holds the scratch for g's cap_t tokens (made or grown; NULL before the first call).
 * With the per-expert GEMMs (mc_moe_set_grouped(0), cuBLAS) it turns g's decode graphs
 * off: those read the experts' counts back inside a step. */
tqkv_status mc_moe_reserve(struct model_cuda *g, const moe_shape *sh, mc_moe_state **x);
/* Frees *x (waits for g's stream) and sets it NULL. */
void        mc_moe_state_free(struct model_cuda *g, mc_moe_state **x);
/* out [T, H] = the layer's experts of xn [T, H] routed on xr [T, H] (xr may be xn), queued
 * on g's stream, routing included: no wait at T <= GEMM_CUDA_SMALL_T (graph capturable),
 * one above it (the grid sizes come back). T <= the reserved tokens. */
tqkv_status mc_moe_queue(struct model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                         mc_moe_state *x, const float *xr, const float *xn, float *out, int T);
/* The common graph's whole block around the layer's experts on g's residual stream: x += tmp,
 * xn = RMSNorm(x) w_in, the experts of xn (mc_moe_queue), x += their output, xn =
 * RMSNorm(x) w_out (and xn's GEMM split): the same bits as mc_residual_norm, mc_moe_queue,
 * mc_residual_norm, with the last norm folded into the combine (mc_moe_set_fold_norm). tmp
 * is left undefined. */
tqkv_status mc_moe_block_queue(struct model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                               mc_moe_state *x, const float *w_in, const float *w_out, int T);

/* The experts' GEMMs as one grouped launch per projection (1, the default unless the
 * environment has TQKV_MOE_GROUPED=0) or one tqkv_cuda_gemm per expert (0): the same bits.
 * For tests and A/B runs; not while a forward runs on another thread. */
void        mc_moe_set_grouped(int on);
/* The routing of up to MOE_FUSED_P pairs in the router kernel's last block (1, the default)
 * or as the route and place launches (0): the same integers. For tests; not while a forward
 * runs on another thread. */
void        mc_moe_set_fused(int on);
/* The routing's K picks by two warp reductions each (1, the default unless the environment
 * has TQKV_MOE_ROUTE_FAST=0; used while every probability is a non-negative number) or by
 * the xor butterfly of (value, index) pairs (0), and at one token the fused tail's direct
 * placement (1) or the block's counting (0): the same picks, weights and integers; -1: as
 * the environment says (what tests put back). For tests and A/B runs; not while a forward
 * runs on another thread. */
void        mc_moe_set_route_fast(int on);
/* The router with its fused tail at up to 8 tokens as a block per expert (1, the default
 * unless the environment has TQKV_MOE_ROUTER_WIDE=0: the E dot products over E SMs, the
 * tail's routing with 4 experts a lane up to 128 experts) or as the router kernel's warp per
 * (token, expert) (0): the same logits, picks, weights and integers; -1: as the environment
 * says. For tests and A/B runs; not while a forward runs on another thread. */
void        mc_moe_set_router_wide(int on);
/* At one token with the router as a block per expert and the grouped GEMMs, the gather of
 * the token's row for every pick (and its GEMM split) by the router kernel's blocks (1, the
 * default unless the environment has TQKV_MOE_FOLD_GATHER=0; the row does not depend on the
 * picks) or by the gather launch (0): the same stores; -1: as the environment says. For
 * tests and A/B runs; not while a forward runs on another thread. */
void        mc_moe_set_fold_gather(int on);
/* mc_moe_block_queue's residual norm after the experts folded into the combine's kernel (1,
 * the default unless the environment has TQKV_MOE_FOLD_NORM=0; hidden sizes up to 4096) or
 * its own launch (0): the same bits; -1: as the environment says. For tests and A/B runs;
 * not while a forward runs on another thread. */
void        mc_moe_set_fold_norm(int on);
/* The experts' activation (SwiGLU / GeGLU) computed in the grouped gate|up GEMM's epilogue
 * (1, the default unless the environment has TQKV_MOE_FOLD_ACT=0; gemm_cuda.h's
 * tqkv_cuda_gemm_grouped_act) or by its own launch after the GEMM (0): the same bits; the
 * per-expert GEMMs (mc_moe_set_grouped(0), cuBLAS) always launch it. -1: as the environment
 * says. For tests and A/B runs; not while a forward runs on another thread. */
void        mc_moe_set_fold_act(int on);
/* The grouped gate|up launches with the activation in their epilogue queued in this process
 * so far (captured ones count once), for the tests. */
unsigned long mc_moe_fold_act_runs(void);
/* Whether mc_moe_block_queue folds that norm for shape sh under the current switch. */
int         mc_moe_folds_norm(const moe_shape *sh);

/* One routing of T tokens alone on the device with the current switches, for tests. */
typedef struct {
    const float *router; /* host [E, H] float32 */
    const float *scale;  /* host [E] the weights' factors, or NULL */
    const float *xr;     /* host [T, H] the router's input */
    int T, E, K, H;
    int norm;            /* renormalise the K weights */
    int bf16x;           /* xr rounded to bf16 in the product (a model's bf16_act) */
} mc_moe_probe;
/* Routes q on a stream of its own: logits [T, E] and idx, the routing's index words
 * [4 E + 4 P + E + 2] (P = T K): groups [E, 4] (zero past the used ones) | tok [P] | pair [P]
 * | weight bits [P] | sel [P] | count [E] | used groups, most rows; *wide 1 when the router
 * ran as a block per expert. TQKV_EINVAL on a bad shape. */
tqkv_status mc_moe_route_probe(const mc_moe_probe *q, float *logits, int32_t *idx, int *wide);

/* --- hooks for a `moe_layer` array behind the common device graph --------------------- */

/* ffn_upload: the sparse layers (cfg.layer_moe) of `layers` [n_layers], SiLU experts, into
 * w->arch. An arch.c wraps it with its own array. */
tqkv_status mc_moe_upload_layers(const tqkv_model *m, const moe_layer *layers,
                                 struct model_cuda_weights *w);
/* prepare / state_free: the state's scratch in g->arch */
tqkv_status mc_moe_prepare(struct model_cuda *g);
void        mc_moe_free(struct model_cuda *g);
/* ffn: layer l of g->xn [T, H] into g->tmp: the experts on a sparse layer, mc_ffn_dense
 * on the others */
tqkv_status mc_moe_ffn(struct model_cuda *g, int l, int T);
/* ffn_block: layer l's block after its mixer, mc_moe_block_queue on a sparse layer, the
 * common steps (mc_ffn_block_steps) on the others */
tqkv_status mc_moe_ffn_block(struct model_cuda *g, int l, int T);

#ifdef __cplusplus
}
#endif

#endif
