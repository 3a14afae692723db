/*
 * config.c - the Llama family's part of config.json: Qwen3's per-head q/k RMSNorm, Qwen2's
 * q/k/v bias, Llama's attention_bias (read as every architecture's, load/config.c).
 * Must not: read weights; parse the fields load/config.c parses for every architecture.
 */
#include "model/arch/llama/llama.h"
#include "util/common.h"

tqkv_status llama_config_parse(const cJSON *root, const char *name, tqkv_model_config *c) {
    static const char *const kinds[] = {"full_attention", NULL};
    tqkv_status rc = model_config_check_layer_types(root, name, kinds);
    if (rc != TQKV_OK) return rc;
    c->qk_norm = c->arch == TQKV_ARCH_QWEN3;
    if (c->arch == TQKV_ARCH_QWEN2) { /* q/k/v bias always, never an o_proj bias */
        c->qkv_bias = 1;
        c->o_bias = 0;
    }
    return TQKV_OK;
}
