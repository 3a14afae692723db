/*
 * qwen35moe.h - the Qwen 3.5 mixture-of-experts graph (Qwen3_5MoeForCausalLM, model_type
 * qwen3_5_moe_text, and the text model of Qwen3_5MoeForConditionalGeneration) inside its
 * folder: the Qwen 3.5 hybrid (src/model/arch/qwen35/: gated DeltaNet + gated full
 * attention, its recurrent rows and scratch) with the sparse block as every layer's
 * feed-forward.
 * Must not: be included outside src/model/arch/qwen35moe/ (the runtime reaches this graph
 *   through model_arch_qwen35moe, arch.h).
 *
 * Graph (transformers modeling_qwen3_5_moe.py, read as the reference): per layer, the
 * Qwen 3.5 mixer block, then x += ffn(rmsnorm(x)) with ffn, on every layer
 * (Qwen3_5MoeSparseMoeBlock), the routed experts of src/model/ops/moe.h: softmax router
 * (mlp.gate), top num_experts_per_tok always renormalised, each expert a SwiGLU of
 * moe_intermediate_size, plus the shared expert (mlp.shared_expert, a SwiGLU of
 * shared_expert_intermediate_size) scaled by sigmoid(mlp.shared_expert_gate . xn).
 */
#ifndef TQKV_ARCH_QWEN35MOE_H
#define TQKV_ARCH_QWEN35MOE_H

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "model/ops/moe.h"

typedef struct {
    moe_layer *layers;  /* [n_layers] router, experts, shared expert */
} q35m_model;

static inline const q35m_model *qwen35moe_of(const tqkv_model *m) {
    return (const q35m_model *)m->arch;
}

tqkv_status qwen35moe_config_parse(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status qwen35moe_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
tqkv_status qwen35moe_state_init(tqkv_model_state *s);
void        qwen35moe_state_free(tqkv_model_state *s);
tqkv_status qwen35moe_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                              float *logits);

/* ---- tensor parallelism (tp.c; docs/TP.md) ---- */
tqkv_status qwen35moe_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm);
tqkv_status qwen35moe_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                 const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                 float *logits);

#endif
