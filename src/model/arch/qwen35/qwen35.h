/*
 * qwen35.h - the Qwen 3.5 hybrid graph (Qwen3_5ForCausalLM, model_type qwen3_5_text) inside
 * its folder: config, weights, recurrent state rows, the CPU forward.
 * Must not: be included outside src/model/arch/qwen35/ (the runtime reaches this graph
 *   through model_arch_qwen35, arch.h; its device kernels through graph_cuda.cu).
 */
#ifndef TQKV_ARCH_QWEN35_H
#define TQKV_ARCH_QWEN35_H

#include "model/arch/arch.h"
#include "model/model_impl.h"

tqkv_status qwen35_config_parse(const cJSON *root, const char *name, tqkv_model_config *c);
/* The hybrid's fields alone (layer types, DeltaNet sizes, partial RoPE, gate, norms), for
 * graphs built on this one; qwen35_config_parse also refuses experts. */
tqkv_status qwen35_config_hybrid(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status qwen35_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
/* recurrent rows (state/recurrent.h) and the graph's scratch (s->ext) of a CPU state */
tqkv_status qwen35_state_init(tqkv_model_state *s);
void        qwen35_state_free(tqkv_model_state *s);
tqkv_status qwen35_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits);

/* For graphs built on this one (Qwen 3.5 MoE, src/model/arch/qwen35moe/): the hybrid with
 * its own feed-forward. ffn(m, s, l, xn, x, T): x [T, hidden] += layer l's feed-forward of
 * xn [T, hidden] (a failure rolls the call back as an attention failure does); NULL: the
 * dense SwiGLU MLP (qwen35_forward). qwen35_ffn_ext: the state's slot for the hook's own
 * data (NULL after qwen35_state_init; its owner frees it before qwen35_state_free).
 * qwen35_load_mixer: layer l's norms and token mixer (everything but the MLP);
 * qwen35_load_finish: the step after the final norm (model_load_decoder's finish). */
typedef tqkv_status (*qwen35_ffn_fn)(const tqkv_model *m, tqkv_model_state *s, int l,
                                     const float *xn, float *x, size_t T);
tqkv_status qwen35_forward_with(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                float *logits, qwen35_ffn_fn ffn);
void      **qwen35_ffn_ext(tqkv_model_state *s);
tqkv_status qwen35_load_mixer(tqkv_model *m, const tqkv_model_load_params *lp, int l);
tqkv_status qwen35_load_finish(tqkv_model *m);
/* ---- the graph's pieces (graph.c), for its sharded forward (tp.c) ---- */
/* A CPU state's scratch (s->ext). */
typedef struct qwen35_scratch {
    size_t   cap_t, cap_rn;
    float   *x, *xn;     /* [T, H] residual stream, normed */
    float   *proj;       /* [T, PW] projections: full 2QD + 2KD (q|gate per head, k, v);
                            linear CD + VD + 2NV (qkv, z, b, a) */
    float   *cv;         /* [T, CD] conv + SiLU output (q | k | v of the delta rule) */
    float   *att;        /* [T, AW] mixer output before the out projection (AW = max(QD, VD)) */
    float   *gu;         /* [T, 2I] gate | up */
    float   *h;          /* [T, I] */
    float   *tmp;        /* [T, W] W = max(H, I, QD, VD) */
    float   *mm;         /* [T, W] matmul scratch */
    float   *rc, *rs;    /* [T, rotary_dim / 2] */
    float   *qb, *ob;    /* [R, NH, n, hd] */
    float   *kb, *vb;    /* [R, NKV, n, hd] */
    int32_t *tok_row;    /* [T] */
    int32_t *tok_col;    /* [T] */
    int     *first;      /* [R + 1] first compact token of each row */
    void    *ffn_ext;    /* a feed-forward hook's own per-state data (its owner frees it) */
} qwen35_scratch;
/* One forward's shape. */
typedef struct {
    int    n;       /* columns per row */
    int    prefill; /* rows empty before the call */
    int    nq_pad;  /* some row has fewer than n real tokens */
    size_t T;       /* compact tokens */
} q35_shape;
/* The checks of a state before a forward (its caches' and recurrent rows' rows, positions,
 * spec rounds); the rows' positions into s->off. Changes nothing else. */
tqkv_status q35_check(const tqkv_model *m, tqkv_model_state *s);
/* The rows' real tokens into s->len (checked) and the call's shape f. */
tqkv_status q35_shape_of(tqkv_model_state *s, const int32_t *tokens, const int *lengths, int n,
                         int prefill, q35_shape *f);
/* Scratch, the spec round's per-step room, compact tokens, embeddings x and RoPE tables. */
tqkv_status q35_begin(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                      const q35_shape *f);
/* Layer l's RMSNorm and token mixer (lin: its index among the DeltaNet layers) into tmp
 * [T, hidden] (out_proj's / o_proj's product). A full layer's failure leaves its appends. */
tqkv_status q35_mixer(const tqkv_model *m, tqkv_model_state *s, int l, int lin,
                      const q35_shape *f);
/* x += tmp, xn = RMSNorm_post_attention(x). */
void        q35_mixer_residual(const tqkv_model *m, tqkv_model_state *s, int l, size_t T);
/* The SwiGLU MLP of xn into tmp [T, hidden]; x += tmp. */
void        q35_mlp(const tqkv_model *m, tqkv_model_state *s, const model_layer *L, size_t T);
void        q35_add_tmp(const tqkv_model *m, tqkv_model_state *s, size_t T);

/* ---- tensor parallelism (tp.c; docs/TP.md) ---- */
tqkv_status qwen35_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm);
tqkv_status qwen35_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                              float *logits);
/* Every layer's norms and token mixer of rank r of n into rm (and rm's DeltaNet head
 * counts); the caller shards the feed-forward. */
tqkv_status qwen35_tp_shard_mixers(const tqkv_model *m, int r, int n, tqkv_model *rm);
/* A rank's feed-forward partial: layer l of rank model rm on its scratch's xn [T, hidden]
 * into its tmp [T, hidden] (all-reduced by the caller, then added to x). */
typedef tqkv_status (*qwen35_tp_ffn_fn)(const tqkv_model *rm, tqkv_model_state *q, int l,
                                        size_t T);
tqkv_status qwen35_forward_tp_with(const tqkv_model *m, tqkv_model_state *s,
                                   const int32_t *tokens, const int *lengths, int n, int prefill,
                                   tqkv_logits_mode mode, float *logits, qwen35_tp_ffn_fn ffn);

/* graph_cuda.cu (CUDA builds): the device hooks of model_arch_qwen35 (arch.h): the DeltaNet
 * shapes the kernels take, and a linear layer's conv + gated delta rule queued on s. */
tqkv_status q35_cuda_check(const tqkv_model *m);
tqkv_status q35_cuda_linear(const tqkv_model_config *c, const struct mc_layer *L,
                            struct mc_rec *rec, int j, int R, int n, const float *proj, float *cv,
                            const int32_t *slot, float *att, struct CUstream_st *s);

#endif
