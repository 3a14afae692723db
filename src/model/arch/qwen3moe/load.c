/*
 * load.c - the weights of a Qwen3-MoE checkpoint: the Qwen3 attention of every layer (the
 *   Llama family's loader), the dense MLP of mlp_only / non-sparse layers, and on sparse
 *   layers the router (mlp.gate) and one SwiGLU per expert (mlp.experts.E.{gate,up,down}_proj,
 *   or the fused mlp.experts.{gate_up,down}_proj: model_load_experts).
 * Must not: run the forward pass.
 */
#include <stdio.h>
#include <string.h>

#include "model/arch/llama/llama.h"
#include "model/arch/qwen3moe/qwen3moe.h"
#include "util/common.h"

/* Router and experts of sparse layer l into X (either expert layout: model_load_experts). */
static tqkv_status load_experts(tqkv_model *m, const tqkv_model_load_params *lp, int l, moe_layer *X) {
    const moe_shape sh = moe_shape_of(&m->cfg);
    char name[256];
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
    tqkv_status rc = model_load_matrix(m, lp, name, sh.n_experts, sh.hidden, &X->router);
    if (rc != TQKV_OK) return rc;
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.", l);
    return model_load_experts(m, lp, name, &sh, X);
}

static tqkv_status load_layer(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    tqkv_status rc = llama_load_attention(m, lp, l);
    if (rc != TQKV_OK) return rc;
    if (!m->cfg.layer_moe[l]) return llama_load_mlp(m, lp, l);
    return load_experts(m, lp, l, &((q3m_model *)m->arch)->layers[l]);
}

tqkv_status qwen3moe_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp) {
    (void)dir;
    q3m_model *X = model_own(m, sizeof *X);
    moe_layer *layers = model_own(m, sizeof(moe_layer) * (size_t)m->cfg.n_layers);
    if (!X || !layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    memset(layers, 0, sizeof(moe_layer) * (size_t)m->cfg.n_layers);
    X->layers = layers;
    m->arch = X;
    return model_load_decoder(m, lp, load_layer, NULL);
}
