/*
 * layer_info.c - one layer's kind and attention geometry, whichever graph: the common
 * config's (every layer full attention, TQKV_LAYER_LINEAR layers recurrent), or what the
 * architecture's ops->layer_info says (arch.h).
 * Owns: tqkv_model_layer_info, model_layer_kind_of, model_layer_donor.
 * Must not: load weights or run anything; name an architecture.
 */
#include <string.h>

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "util/common.h"

static void layer_describe(const tqkv_model *m, int layer, tqkv_layer_info *li,
                           model_layer_kind *kind) {
    const tqkv_model_config *c = &m->cfg;
    memset(li, 0, sizeof *li);
    li->type = (tqkv_layer_type)c->layer_type[layer];
    if (li->type == TQKV_LAYER_LINEAR) {
        li->q_heads = c->lin_k_heads;
        li->kv_heads = c->lin_v_heads;
        li->head_dim = c->lin_k_dim;
        li->kv_from = -1;
        *kind = MODEL_LAYER_RECURRENT;
        return;
    }
    li->q_heads = c->n_heads;
    li->kv_heads = c->n_kv_heads;
    li->head_dim = c->head_dim;
    li->rotary_dim = c->rotary_dim ? c->rotary_dim : c->head_dim;
    li->rope_theta = c->rope_theta;
    li->kv_from = layer;
    *kind = MODEL_LAYER_KV;
    if (m->ops->layer_info) m->ops->layer_info(m, layer, li, kind);
}

tqkv_status tqkv_model_layer_info(const tqkv_model *m, int layer, tqkv_layer_info *out) {
    if (!m || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_model_layer_info: NULL argument");
    if (layer < 0 || layer >= m->cfg.n_layers)
        return tqkv_fail(TQKV_ERANGE, "tqkv_model_layer_info: layer %d of %d", layer,
                         m->cfg.n_layers);
    model_layer_kind kind;
    layer_describe(m, layer, out, &kind);
    return TQKV_OK;
}

int model_layer_kind_of(const tqkv_model *m, int l) {
    tqkv_layer_info li;
    model_layer_kind kind;
    layer_describe(m, l, &li, &kind);
    return (int)kind;
}

int model_layer_donor(const tqkv_model *m, int l) {
    tqkv_layer_info li;
    model_layer_kind kind;
    layer_describe(m, l, &li, &kind);
    return li.kv_from;
}
