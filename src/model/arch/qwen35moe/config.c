/*
 * config.c - the Qwen 3.5 MoE part of config.json: the hybrid's fields (qwen35's parser),
 *   the experts (num_experts, num_experts_per_tok, moe_intermediate_size) and the shared
 *   expert (shared_expert_intermediate_size).
 * Must not: read weights; parse the fields load/config.c parses for every architecture.
 *
 * transformers' Qwen3_5MoeTextConfig has no norm_topk_prob, decoder_sparse_step or
 * mlp_only_layers: every layer is sparse and the top-k weights are always renormalised, so
 * those keys, if a config carries them, are ignored here as there.
 */
#include <cjson/cJSON.h>

#include "model/arch/qwen35/qwen35.h"
#include "model/arch/qwen35moe/qwen35moe.h"
#include "util/common.h"

tqkv_status qwen35moe_config_parse(const cJSON *root, const char *name, tqkv_model_config *c) {
    tqkv_status rc = qwen35_config_hybrid(root, name, c);
    if (rc != TQKV_OK) return rc;
    if ((rc = model_config_int(root, "num_experts", name, -2, 1, 4096, &c->n_experts)) ||
        (rc = model_config_int(root, "num_experts_per_tok", name, -2, 1, 4096, &c->n_experts_used)) ||
        (rc = model_config_int(root, "moe_intermediate_size", name, -2, 1, 1 << 18,
                               &c->moe_intermediate_size)) ||
        (rc = model_config_int(root, "shared_expert_intermediate_size", name, -2, 1, 1 << 18,
                               &c->moe_shared_intermediate_size)))
        return rc;
    if (c->n_experts_used > c->n_experts)
        return tqkv_fail(TQKV_ECORRUPT, "%s: num_experts_per_tok %d > num_experts %d", name,
                         c->n_experts_used, c->n_experts);
    c->norm_topk_prob = 1; /* Qwen3_5MoeTopKRouter always renormalises */
    c->n_moe_layers = c->n_layers;
    for (int l = 0; l < c->n_layers; l++) c->layer_moe[l] = 1;
    return TQKV_OK;
}
