/*
 * llama.h - the Llama family (LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM) inside
 * its folder: config checks, weights, CPU forward.
 * Must not: be included outside src/model/arch/llama/ and the graphs built on it (qwen3moe:
 *   the same attention, its own feed-forward); the rest of the runtime reaches these graphs
 *   through their ops (arch.h).
 */
#ifndef TQKV_ARCH_LLAMA_H
#define TQKV_ARCH_LLAMA_H

#include "model/arch/arch.h"
#include "model/model_impl.h"

tqkv_status llama_config_parse(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status llama_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
tqkv_status llama_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                          const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                          float *logits);

/* ---- for graphs built on this one ---- */
/* Layer l's attention weights and norms (everything but the MLP) into m->layers[l]. */
tqkv_status llama_load_attention(tqkv_model *m, const tqkv_model_load_params *lp, int l);
/* Layer l's dense SwiGLU MLP (mlp.gate_proj / up_proj, read in place and fused when bf16;
 * mlp.down_proj) into m->layers[l]. */
tqkv_status llama_load_mlp(tqkv_model *m, const tqkv_model_load_params *lp, int l);
/* A layer's feed-forward: xn [T, hidden] in, its output added to the residual stream x;
 * pf: prefill-style matmuls. On failure the forward rolls back and returns the status. */
typedef tqkv_status (*llama_ffn_fn)(const tqkv_model *m, tqkv_model_state *s, int l, size_t T,
                                    int pf);
/* The dense SwiGLU MLP (mlp.gate_proj / up_proj / down_proj). */
tqkv_status llama_ffn_dense(const tqkv_model *m, tqkv_model_state *s, int l, size_t T, int pf);
/* llama_forward with each layer's feed-forward from ffn. */
tqkv_status llama_forward_with(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                               const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                               float *logits, llama_ffn_fn ffn);

/* ---- the graph's pieces (graph.c), for its sharded forward (tp.c) ---- */
/* One forward's shape: the parts every block reads. */
typedef struct {
    int    n;       /* columns per row */
    int    prefill; /* rows empty before the call */
    int    as_dec;  /* a verification window (extend_as_decode): decode matmuls, per-query attention */
    int    pf;      /* prefill-style matmuls (n > 1, not as_dec) */
    int    nq_pad;  /* some row has fewer than n real tokens */
    size_t T;       /* compact tokens */
} llama_shape;
/* The state's scratch for T compact tokens and RN = rows * n attention positions, shaped by
 * s->m's config. */
tqkv_status llama_scratch(tqkv_model_state *s, size_t T, size_t RN);
/* y [T, w->n] (rows ldy apart) = x [T, k] . w^T (+ bias): the batch-invariant product (BLAS
 * for prefill when the state asks and w has an f32 copy). */
void llama_matmul_ld(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                     const float *bias, float *y, size_t ldy, int prefill);
void llama_matmul(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                  const float *bias, float *y, int prefill);
/* Undo the KV appends of layers [0, done) after a failure. */
tqkv_status llama_rollback(tqkv_model_state *s, int done, int n, int prefill);
/* Embedding rows into x [T, hidden] and RoPE tables of the compact tokens. */
void llama_embed(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                 const llama_shape *f);
/* RMSNorm of x, q/k/v, q/k norm, RoPE, scattered to qb / kb / vb. */
void llama_qkv_project(const tqkv_model *m, tqkv_model_state *s, const model_layer *L,
                       const llama_shape *f);
/* Layer l's cache append and attention into ob; on failure layers [0, l] rolled back. */
tqkv_status llama_attend(const tqkv_model *m, tqkv_model_state *s, int l, const llama_shape *f);
/* ob gathered to token order and o_proj (+ bias) into tmp [T, hidden]. */
void llama_out_matmul(const tqkv_model *m, tqkv_model_state *s, const model_layer *L,
                      const llama_shape *f, const float *bias);
/* x += o (+ bias), then RMSNorm into xn when norm is not NULL. */
void llama_residual(const tqkv_model *m, tqkv_model_state *s, size_t T, const float *o,
                    const float *bias, const float *norm);
/* The SwiGLU MLP of xn into tmp [T, hidden]. */
void llama_mlp(const tqkv_model *m, tqkv_model_state *s, const model_layer *L, size_t T, int pf);

/* ---- tensor parallelism (tp.c; docs/TP.md) ---- */
tqkv_status llama_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm);
/* Layer L's attention and norms of rank r of n into S (c: the whole model's config): q/k/v
 * rows of its heads, o_proj's columns; the caller shards the feed-forward. */
tqkv_status llama_tp_shard_attn(tqkv_model *rm, const model_layer *L, int r, int n,
                                const tqkv_model_config *c, model_layer *S);
tqkv_status llama_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                             const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                             float *logits);
/* A rank's feed-forward partial: layer l of rank model rm on xn [T, hidden] into tmp
 * [T, hidden] (all-reduced by the caller, then added to x). A failure rolls the call back. */
typedef tqkv_status (*llama_tp_ffn_fn)(const tqkv_model *rm, tqkv_model_state *q, int l,
                                       size_t T, int pf);
/* llama_forward_tp with each layer's feed-forward partial from ffn. */
tqkv_status llama_forward_tp_with(const tqkv_model *m, tqkv_model_state *s,
                                  const int32_t *tokens, const int *lengths, int n, int prefill,
                                  tqkv_logits_mode mode, float *logits, llama_tp_ffn_fn ffn);

#endif
