/*
 * load.c - the weights of a Qwen 3.5 MoE checkpoint: each layer's norms and mixer (the
 *   hybrid's loader, qwen35_load_mixer), then its sparse block under mlp.: the router
 *   (gate.weight [E, H]), the experts (experts.gate_up_proj [E, 2I, H] + experts.down_proj
 *   [E, H, I], or one tensor per expert as transformers 5.17 saves them: model_load_experts),
 *   the shared expert (shared_expert.{gate,up,down}_proj: model_load_swiglu) and its gate
 *   (shared_expert_gate.weight [1, H]).
 * Must not: run the forward pass.
 */
#include <stdio.h>
#include <string.h>

#include "model/arch/qwen35/qwen35.h"
#include "model/arch/qwen35moe/qwen35moe.h"
#include "util/common.h"

/* Layer l's sparse block into X; pre = "<prefix>layers.l.mlp.". */
static tqkv_status load_block(tqkv_model *m, const tqkv_model_load_params *lp, const char *pre,
                              moe_layer *X) {
    const moe_shape sh = moe_shape_of(&m->cfg);
    char name[320];
    tqkv_status rc;
#define NAME(suffix) (snprintf(name, sizeof name, "%s%s", pre, suffix), name)
    if ((rc = model_load_matrix(m, lp, NAME("gate.weight"), sh.n_experts, sh.hidden, &X->router)) ||
        (rc = model_load_experts(m, lp, NAME("experts."), &sh, X)) ||
        (rc = model_load_swiglu(m, lp, NAME("shared_expert."), sh.shared_inter, &X->sh_g,
                                &X->sh_u, &X->sh_down, &X->sh_gu)))
        return rc;
    rc = model_load_matrix(m, lp, NAME("shared_expert_gate.weight"), 1, sh.hidden, &X->sh_gate);
#undef NAME
    return rc;
}

static tqkv_status load_layer(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    tqkv_status rc = qwen35_load_mixer(m, lp, l);
    if (rc != TQKV_OK) return rc;
    const char *pfx = m->cfg.weight_prefix[0] ? m->cfg.weight_prefix : "model.";
    char pre[128];
    snprintf(pre, sizeof pre, "%slayers.%d.mlp.", pfx, l);
    return load_block(m, lp, pre, &((q35m_model *)m->arch)->layers[l]);
}

tqkv_status qwen35moe_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp) {
    (void)dir;
    q35m_model *X = model_own(m, sizeof *X);
    moe_layer *layers = model_own(m, sizeof(moe_layer) * (size_t)m->cfg.n_layers);
    if (!X || !layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    memset(layers, 0, sizeof(moe_layer) * (size_t)m->cfg.n_layers);
    X->layers = layers;
    m->arch = X;
    return model_load_decoder(m, lp, load_layer, qwen35_load_finish);
}
