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

#endif
