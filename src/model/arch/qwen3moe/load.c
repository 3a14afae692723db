/*
 * load.c - the weights of a Qwen3-MoE checkpoint: the Qwen3 attention of every layer (the
 *   Llama family's loader), the dense MLP of mlp_only / non-sparse layers, and on sparse
 *   layers the router (mlp.gate) and one SwiGLU per expert
 *   (mlp.experts.E.{gate,up,down}_proj, gate / up read in place and fused when bf16).
 * Must not: run the forward pass.
 */
#include <stdio.h>
#include <string.h>

#include "model/arch/llama/llama.h"
#include "model/arch/qwen3moe/qwen3moe.h"
#include "util/common.h"

/* Router and experts of sparse layer l into X. */
static tqkv_status load_experts(tqkv_model *m, const tqkv_model_load_params *lp, int l, q3m_layer *X) {
    const tqkv_model_config *c = &m->cfg;
    const int H = c->hidden_size, I = c->moe_intermediate_size, E = c->n_experts;
    char name[256];
    tqkv_status rc;
    snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
    if ((rc = model_load_matrix(m, lp, name, E, H, &X->router)) != TQKV_OK) return rc;
    X->gu = model_own(m, sizeof(mm_weight) * (size_t)E);
    X->g = model_own(m, sizeof(mm_weight) * (size_t)E);
    X->u = model_own(m, sizeof(mm_weight) * (size_t)E);
    X->down = model_own(m, sizeof(mm_weight) * (size_t)E);
    if (!X->gu || !X->g || !X->u || !X->down) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tqkv_model_load_params lpu = *lp; /* gate / up in place: packed into the fused copy */
    lpu.no_pack = 1;
    lpu.no_f32_prefill = 1;
    for (int e = 0; e < E; e++) {
#define NAME(part) (snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s_proj.weight", l, e, part), name)
        if ((rc = model_load_matrix(m, &lpu, NAME("gate"), I, H, &X->g[e])) ||
            (rc = model_load_matrix(m, &lpu, NAME("up"), I, H, &X->u[e])) ||
            (rc = model_load_matrix(m, lp, NAME("down"), H, I, &X->down[e])))
            return rc;
#undef NAME
        mm_weight *gu[2] = {&X->g[e], &X->u[e]};
        if ((rc = model_fuse(m, lp, gu, 2, &X->gu[e])) != TQKV_OK) return rc;
    }
    return TQKV_OK;
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
    q3m_layer *layers = model_own(m, sizeof(q3m_layer) * (size_t)m->cfg.n_layers);
    if (!X || !layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    memset(layers, 0, sizeof(q3m_layer) * (size_t)m->cfg.n_layers);
    X->layers = layers;
    m->arch = X;
    return model_load_decoder(m, lp, load_layer, NULL);
}
