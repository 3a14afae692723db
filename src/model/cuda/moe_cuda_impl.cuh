/*
 * src/model/cuda/moe_cuda_impl.cuh - what the device experts' files share (moe_cuda.cu: one
 * sparse layer's queue; moe_cuda_route.cu: the routing; moe_cuda_state.cu: weights, scratch,
 * the hooks).
 * Owns: the layouts of mc_moe_layer, mc_moe_state and its index buffer, a call's grouping
 * (moe_routing), the routing's entry points and the grouped GEMMs' switch.
 * Must not: be included outside src/model/cuda/moe_cuda*.cu.
 */
#ifndef TQKV_MODEL_CUDA_MOE_CUDA_IMPL_CUH
#define TQKV_MODEL_CUDA_MOE_CUDA_IMPL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "model/cuda/model_cuda_impl.h"
#include "model/cuda/moe_cuda.h"

struct mc_moe_layer {
    float *router;             /* [E, H] float32 (the router decides; the host's precision) */
    bf16  *wgu;                /* [E, 2I, H] expert e's gate rows, then its up rows */
    bf16  *wd;                 /* [E, H, I] */
    bf16  *sh_wgu, *sh_wd;     /* [2S, H], [H, S] the shared expert, or NULL */
    float *sh_gate;            /* [H] float32 its gate, or NULL */
    float *scale;              /* [E] float32 the routing weights' factors (Gemma 4), or NULL */
};

struct mc_moe_state {
    size_t   cap;      /* tokens the buffers hold */
    int      e_cap;    /* experts the buffers hold */
    int      k_cap;    /* picks per token they hold */
    float   *logits;   /* device [T, E] */
    int32_t *idx;      /* device [4 E + 4 P + E + 2], IDX_* below */
    int32_t *h_back;   /* pinned [E + 2]: count [E] | used groups | most rows */
    void    *xf;       /* device: the grouped GEMMs' activations, [parts, P, max(H, I)] bf16 */
    float   *xg;       /* device [P, H] */
    float   *gu;       /* device [max(P 2I, T 2S)] (with the activation in the GEMM's
                        * epilogue: h's split for the down GEMM, [parts, P, I] bf16) */
    float   *h;        /* device [max(P I, T S)] */
    float   *y;        /* device [P, H] */
    float   *sy;       /* device [T, H] the shared expert's output (S > 0) */
    float   *sg;       /* device [T] its gate logits (S > 0) */
    int     *done;     /* device [1] the router's finished blocks (its fused tail), zero between launches */
};

/* The parts of mc_moe_state.idx, in int32 from its start: groups [E, 4] (row0, rows,
 * expert, 0: the experts with tokens, ascending, then rows 0 up to the bound) | tok [P] |
 * pair [T, K] | weight bits [T, K] | sel [T, K] | count [E] | used groups, most rows. */
#define IDX_TOK(E)        (4 * (size_t)(E))
#define IDX_PAIR(E, P)    (IDX_TOK(E) + (size_t)(P))
#define IDX_WB(E, P)      (IDX_TOK(E) + 2 * (size_t)(P))
#define IDX_SEL(E, P)     (IDX_TOK(E) + 3 * (size_t)(P))
#define IDX_COUNT(E, P)   (IDX_TOK(E) + 4 * (size_t)(P))
#define IDX_WORDS(E, P)   (IDX_COUNT(E, P) + (size_t)(E) + 2)

/* One call's grouping as the GEMMs see it. */
typedef struct {
    int            E, P;  /* experts, pairs */
    int            G;     /* groups the grouped launch covers (a bound at decode) */
    int            most;  /* rows of its largest group (a bound at decode) */
    const int32_t *count; /* host [E] each expert's pairs (the per-expert path), or NULL */
    int            gathered; /* the routing wrote the gathered rows x->xg (and xf) too */
} moe_routing;

/* The grouped GEMMs on (TQKV_MOE_GROUPED, mc_moe_set_grouped; moe_cuda_route.cu). */
int mc_moe_grouped_on(void);

/* The experts' activation in the grouped gate|up GEMM's epilogue on (TQKV_MOE_FOLD_ACT,
 * mc_moe_set_fold_act; moe_cuda_route.cu). */
int mc_moe_fold_act_on(void);
/* One more folded launch queued (mc_moe_fold_act_runs counts them). */
void mc_moe_fold_act_count(void);

/* The widest hidden size the combine's folded norm takes (mc_moe_folds_norm: its block holds
 * a row in shared memory and its values in registers). */
#define MOE_FOLD_H_MAX 4096

/* The routing of T tokens into x->idx and r, maybe the gather of xn into x->xg and xf
 * (r->gathered; moe_cuda_route.cu documents it). */
tqkv_status mc_moe_route_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                               mc_moe_state *x, const float *xr, const float *xn, uint16_t *xf,
                               int T, moe_routing *r);

/* The shared expert's gate logits sg [T] = xn [T, H] . sh_gate [H] on g's stream (the router
 * kernel with one expert, no tail; moe_cuda_route.cu). */
void mc_moe_gate_queue(model_cuda *g, const float *xn, const float *sh_gate, int T, int H,
                       float *sg);

#endif
