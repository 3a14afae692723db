/*
 * config.c - the Qwen3-MoE part of config.json: the experts (num_experts,
 *   num_experts_per_tok, moe_intermediate_size, norm_topk_prob) and which layers are sparse
 *   (decoder_sparse_step, mlp_only_layers), Qwen3's per-head q/k RMSNorm.
 * Must not: read weights; parse the fields load/config.c parses for every architecture.
 */
#include <math.h>

#include <cjson/cJSON.h>

#include "model/arch/qwen3moe/qwen3moe.h"
#include "util/common.h"

/* layer_moe[] from decoder_sparse_step and mlp_only_layers (transformers' rule). */
static tqkv_status sparse_layers(const cJSON *root, const char *name, tqkv_model_config *c) {
    int step;
    tqkv_status rc = model_config_int(root, "decoder_sparse_step", name, 1, 1, 1 << 20, &step);
    if (rc != TQKV_OK) return rc;
    unsigned char dense[TQKV_MAX_LAYERS] = {0};
    const cJSON *only = cJSON_GetObjectItemCaseSensitive(root, "mlp_only_layers");
    if (only && !cJSON_IsNull(only)) {
        if (!cJSON_IsArray(only))
            return tqkv_fail(TQKV_ECORRUPT, "%s: \"mlp_only_layers\" must be a list of layer indices", name);
        const cJSON *v;
        cJSON_ArrayForEach(v, only) {
            if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
                v->valuedouble >= c->n_layers)
                return tqkv_fail(TQKV_ECORRUPT, "%s: \"mlp_only_layers\" holds a value that is not a "
                                 "layer index in [0, %d)", name, c->n_layers);
            dense[(int)v->valuedouble] = 1;
        }
    }
    c->n_moe_layers = 0;
    for (int l = 0; l < c->n_layers; l++) {
        c->layer_moe[l] = !dense[l] && (l + 1) % step == 0;
        c->n_moe_layers += c->layer_moe[l];
    }
    return TQKV_OK;
}

tqkv_status qwen3moe_config_parse(const cJSON *root, const char *name, tqkv_model_config *c) {
    static const char *const kinds[] = {"full_attention", NULL};
    tqkv_status rc = model_config_check_layer_types(root, name, kinds);
    if (rc != TQKV_OK) return rc;
    if (c->n_layers > TQKV_MAX_LAYERS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: %d layers (at most %d)", name, c->n_layers, TQKV_MAX_LAYERS);
    /* the published checkpoints say num_experts; transformers 5 saves num_local_experts */
    const char *ne = cJSON_GetObjectItemCaseSensitive(root, "num_experts") ? "num_experts"
                                                                           : "num_local_experts";
    if (!cJSON_GetObjectItemCaseSensitive(root, ne))
        return tqkv_fail(TQKV_ECORRUPT, "%s: missing \"num_experts\" (or \"num_local_experts\")", name);
    if ((rc = model_config_int(root, ne, name, -2, 1, 4096, &c->n_experts)) ||
        (rc = model_config_int(root, "num_experts_per_tok", name, -2, 1, 4096, &c->n_experts_used)) ||
        (rc = model_config_int(root, "moe_intermediate_size", name, -2, 1, 1 << 18,
                               &c->moe_intermediate_size)))
        return rc;
    if (c->n_experts_used > c->n_experts)
        return tqkv_fail(TQKV_ECORRUPT, "%s: num_experts_per_tok %d > num_experts %d", name,
                         c->n_experts_used, c->n_experts);
    c->norm_topk_prob = model_config_bool(root, "norm_topk_prob", 0); /* transformers' default */
    c->qk_norm = 1;                                                   /* Qwen3 attention */
    return sparse_layers(root, name, c);
}
