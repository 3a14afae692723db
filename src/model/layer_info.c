/*
 * layer_info.c - tqkv_model_layer_info: one layer's attention geometry, whichever graph.
 * Owns: translating each graph's own per-layer description (the common config, Gemma 4's
 *   g4_config, Qwen 3.5's layer types) into the public tqkv_layer_info.
 * Must not: load weights or run anything.
 */
#include <string.h>

#include "model/arch/gemma4/gemma4.h"
#include "model/model_impl.h"
#include "util/common.h"

tqkv_status tqkv_model_layer_info(const tqkv_model *m, int layer, tqkv_layer_info *out) {
    if (!m || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_model_layer_info: NULL argument");
    const tqkv_model_config *c = &m->cfg;
    if (layer < 0 || layer >= c->n_layers)
        return tqkv_fail(TQKV_ERANGE, "tqkv_model_layer_info: layer %d of %d", layer, c->n_layers);
    tqkv_layer_info li;
    memset(&li, 0, sizeof li);
    li.type = (tqkv_layer_type)c->layer_type[layer];
    if (li.type == TQKV_LAYER_LINEAR) {
        li.q_heads = c->lin_k_heads;
        li.kv_heads = c->lin_v_heads;
        li.head_dim = c->lin_k_dim;
        li.kv_from = -1;
        *out = li;
        return TQKV_OK;
    }
    li.q_heads = c->n_heads;
    li.kv_heads = c->n_kv_heads;
    li.head_dim = c->head_dim;
    li.rotary_dim = c->rotary_dim ? c->rotary_dim : c->head_dim;
    li.rope_theta = c->rope_theta;
    li.kv_from = layer;
    if (m->g4) {
        const g4_config *g = &m->g4->cfg;
        const int t = g->sliding[layer] ? 0 : 1;
        li.kv_heads = g->n_kv[layer];
        li.head_dim = g->head_dim[layer];
        li.rope_theta = g->theta[t];
        li.rotary_dim = g->proportional[t] ? (int)(g->partial[t] * g->head_dim[layer] + 0.5)
                                           : g->head_dim[layer];
        li.window = g->sliding[layer] ? g->window : 0;
        li.kv_from = g->donor[layer];
    }
    *out = li;
    return TQKV_OK;
}
