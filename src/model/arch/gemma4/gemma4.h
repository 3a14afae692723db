/*
 * gemma4.h - internal layout of the Gemma 4 text graph (Gemma4ForCausalLM, gemma4_text).
 * Owns: the per-layer geometry parsed from config.json (layer types, per-layer head_dim and
 * KV heads, KV-sharing donors, the two RoPE tables, per-layer inputs, soft-capping), the
 * Gemma-only weights, and the entry points that config.c, model.c and forward.c call.
 * Must not: be included outside src/model and tests.
 *
 * Graph (transformers 5.17 modeling_gemma4.py, read as the reference):
 *   x = embed(tok) * sqrt(H)
 *   ple[l] = (rmsnorm_P(W_plp x * H^-1/2) + embed_ple(tok)[l] * sqrt(P)) * 2^-1/2   (if P)
 *   per layer: a = attn(rmsnorm(x)); x += rmsnorm_post_attn(a)
 *              f = down(gelu_tanh(gate(xn)) * up(xn)), xn = rmsnorm_pre_ffn(x);
 *              MoE block (enable_moe_block, every layer): routed on
 *                xr = rmsnorm(x) * router.scale * H^-1/2 (softmax, top-k renormalised, times
 *                router.per_expert_scale), experts (GELU-tanh, src/model/ops/moe.h) of
 *                rmsnorm_pre_ffn_2(x): f = rmsnorm_post_ffn_1(f) + rmsnorm_post_ffn_2(experts)
 *              x += rmsnorm_post_ffn(f)
 *              if P: x += rmsnorm_post_ple(W_proj(gelu_tanh(W_gate x) * ple[l]))
 *              x *= layer_scalar
 *   logits = lm_head(rmsnorm(x)); if softcap: cap * tanh(logits / cap)
 * Attention: q/k RMSNorm with weight, v RMSNorm without, RoPE per layer type (sliding:
 * default; full: proportional, only the first partial*hd/2 frequencies non-zero), scaling
 * 1.0, sliding layers see the newest `window` keys (self included). attention_k_eq_v: full
 * layers have no v_proj and V is the raw K projection (before k_norm and RoPE). The last
 * num_kv_shared_layers layers have no K/V: each reads the cache of its donor, the last
 * non-shared layer of the same type.
 */
#ifndef TQKV_GEMMA4_H
#define TQKV_GEMMA4_H

#include <cjson/cJSON.h>

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "model/ops/moe.h"

#define G4_MAX_LAYERS 512

typedef struct {
    int    n_layers;
    int    sliding[G4_MAX_LAYERS];   /* 1 sliding_attention, 0 full_attention */
    int    head_dim[G4_MAX_LAYERS];
    int    n_kv[G4_MAX_LAYERS];
    int    donor[G4_MAX_LAYERS];     /* layer whose cache this layer reads (itself if own) */
    int    k_eq_v[G4_MAX_LAYERS];    /* V is the raw K projection (no v_proj) */
    int    window;                   /* sliding_window */
    int    ple_dim;                  /* hidden_size_per_layer_input (0 = none) */
    int    ple_vocab;                /* vocab_size_per_layer_input */
    float  softcap;                  /* final_logit_softcapping (0 = none) */
    /* RoPE per layer type: [0] sliding, [1] full */
    double theta[2];
    double partial[2];               /* partial_rotary_factor (proportional only) */
    double factor[2];
    int    proportional[2];
    int    max_hd, max_qd, max_kd;   /* largest head_dim, n_heads*hd, n_kv*hd over layers */
    int    pos_layer;                /* a full non-shared layer (never trimmed at the front), or
                                        -1: then sliding layers keep every token */
} g4_config;

typedef struct {
    float    *post_attn_norm;   /* [hidden] */
    float    *post_ffn_norm;    /* [hidden] */
    float    *post_ple_norm;    /* [hidden] or NULL */
    mm_weight ple_gate;         /* [P, hidden] */
    mm_weight ple_proj;         /* [hidden, P] */
    float     layer_scalar;
    /* the MoE block (m->cfg.n_experts > 0; zeroed otherwise) */
    moe_layer moe;              /* router (router.proj), experts, router.per_expert_scale */
    float    *router_scale;     /* [hidden] router.scale */
    float    *post_ffn_norm_1;  /* [hidden] the dense MLP's output norm */
    float    *pre_ffn_norm_2;   /* [hidden] the experts' input norm */
    float    *post_ffn_norm_2;  /* [hidden] the experts' output norm */
} g4_layer;

typedef struct g4_model {
    g4_config cfg;
    g4_layer  layers[G4_MAX_LAYERS];
    mm_weight embed_ple;        /* [ple_vocab, n_layers * P] */
    mm_weight ple_model_proj;   /* [n_layers * P, hidden] */
    float    *ple_norm;         /* [P] */
    float    *inv_freq[2];      /* [hd/2] per layer type (sliding, full) */
    int       half[2];          /* hd/2 of the two types (0 if the type is absent) */
    float    *ones;             /* [max_hd] weight of the scale-free v norm */
} g4_model;

/* The Gemma 4 data of a model loaded by gemma4_load (m->arch). */
static inline g4_model *gemma4_of(const tqkv_model *m) { return (g4_model *)m->arch; }

/* Validate a gemma4_text config and fill the gemma-specific fields of c; g may be NULL. */
tqkv_status gemma4_config_parse(const cJSON *root, const char *name, tqkv_model_config *c,
                                g4_config *g);
/* model.c: after the common config and the safetensors are open: every weight. */
tqkv_status gemma4_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
/* The layer whose offsets are the rows' positions. */
int         gemma4_position_layer(const tqkv_model *m);
tqkv_status gemma4_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits);
void        gemma4_state_free(tqkv_model_state *s);

/* ---- the graph's pieces (graph.c), for its sharded forward (tp.c) ---- */
/* One forward's shape: the parts every block reads. */
typedef struct {
    int    n;       /* columns per row */
    int    prefill; /* rows empty before the call */
    int    as_dec;  /* a verification window (extend_as_decode) */
    int    pf;      /* prefill-style matmuls (n > 1, not as_dec) */
    int    nq_pad;  /* some row has fewer than n real tokens */
    size_t T;       /* compact tokens */
} g4_shape;
/* The checks before a forward (rows of every cache, positions into s->off, token ids, the
 * rows' real tokens into s->len) and the call's shape f; changes nothing else. */
tqkv_status g4_preamble(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                        const int *lengths, int n, int prefill, g4_shape *f);
/* The state's scratch for T compact tokens and RN = rows * n attention slots. */
tqkv_status gemma4_scratch(tqkv_model_state *s, size_t T, size_t RN);
/* Scaled embeddings x [T, hidden], RoPE tables and the per-layer inputs. */
void        g4_embed(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                     const g4_shape *f);
/* Layer l: RMSNorm, q (k, v on a layer with its own KV) of m's heads, scattered to qb/kb/vb. */
void        g4_qkv_project(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f);
/* Layer l's cache append and attention into ob; on failure layers [0, l] rolled back. */
tqkv_status g4_attend(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f);
/* ob gathered to token order, o_proj into tmp [T, hidden]. */
void        g4_out_proj(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f);
/* x += rmsnorm_post_attn(tmp), xn = rmsnorm_pre_ffn(x) (and the MoE block's experts). */
void        g4_attn_residual(const tqkv_model *m, tqkv_model_state *s, int l, size_t T);
/* The MoE block's experts output [T, hidden] of the last g4_attn_residual (n_experts > 0). */
float      *g4_moe_out(tqkv_model_state *s);
/* The GeGLU MLP of xn into tmp [T, hidden]. */
void        g4_mlp(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f);
/* x += rmsnorm_post_ffn(tmp (+ the MoE block's output)). */
void        g4_ffn_residual(const tqkv_model *m, tqkv_model_state *s, int l, size_t T);
/* The per-layer input block and the layer scalar. */
void        g4_ple_block(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f);
/* Bounded sliding layers keep their newest window + slack tokens (outside a spec round). */
tqkv_status g4_drop_sliding(const tqkv_model *m, tqkv_model_state *s);

/* ---- tensor parallelism (tp.c; docs/TP.md) ---- */
tqkv_status gemma4_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm);
tqkv_status gemma4_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                              float *logits);

/* graph_cuda*.cu (CUDA builds): the device hooks of model_arch_gemma4 (arch.h). */
tqkv_status g4_cuda_check(const tqkv_model *m);
tqkv_status g4_cuda_upload(const tqkv_model *m, struct model_cuda_weights *w);
tqkv_status g4_cuda_prepare(struct model_cuda *g);
void        g4_cuda_state_free(struct model_cuda *g);
tqkv_status g4_cuda_forward_queue(struct model_cuda *g, int n, int as_decode,
                                  tqkv_logits_mode mode, float *out, int pick, int *done);
/* After a forward outside a spec round, and when a round begins: every own sliding layer
 * keeps its newest window + window_slack tokens (the device tqkv_batch_drop_oldest). */
tqkv_status g4_cuda_drop_oldest(struct model_cuda *g);
/* The longest row of the sliding layers' window views in a step that appends n tokens. */
int         g4_cuda_win_tokens(const struct model_cuda *g, int n);
int         g4_cuda_rope_width(const tqkv_model *m);
void        g4_cuda_rope_row(const tqkv_model *m, int pos, float *row);
int         g4_cuda_ple_width(const tqkv_model *m);
/* the sharded device forward's pieces (arch.h's model_arch_cuda_tp_ops) */
extern const struct model_arch_cuda_tp_ops g4_cuda_tp;

#endif
