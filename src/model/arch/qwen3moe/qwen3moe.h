/*
 * qwen3moe.h - the Qwen3 mixture-of-experts graph (Qwen3MoeForCausalLM, model_type qwen3_moe)
 * inside its folder: the Llama family's Qwen3 attention (src/model/arch/llama/) with a routed
 * experts feed-forward on the sparse layers.
 * Must not: be included outside src/model/arch/qwen3moe/ (the runtime reaches this graph
 *   through model_arch_qwen3moe, arch.h).
 *
 * Graph (transformers modeling_qwen3_moe.py, read as the reference): per layer, the Qwen3
 * attention block, then x += ffn(rmsnorm(x)) where ffn is, on a sparse layer
 * (layer_moe[l]: not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0):
 *   the routed experts of src/model/ops/moe.h (softmax router, top-k renormalised when
 *   norm_topk_prob, no shared expert);
 * and the dense SwiGLU MLP (intermediate_size) on the other layers.
 */
#ifndef TQKV_ARCH_QWEN3MOE_H
#define TQKV_ARCH_QWEN3MOE_H

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "model/ops/moe.h"

typedef struct {
    moe_layer *layers;  /* [n_layers] router and experts (zeroed on dense layers) */
} q3m_model;

/* The MoE data of a model loaded by qwen3moe_load (m->arch). */
static inline const q3m_model *qwen3moe_of(const tqkv_model *m) { return (const q3m_model *)m->arch; }

tqkv_status qwen3moe_config_parse(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status qwen3moe_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
tqkv_status qwen3moe_state_init(tqkv_model_state *s);
void        qwen3moe_state_free(tqkv_model_state *s);
tqkv_status qwen3moe_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                             const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                             float *logits);

/* ---- tensor parallelism (tp.c; docs/TP.md) ---- */
tqkv_status qwen3moe_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm);
tqkv_status qwen3moe_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                float *logits);

#endif
