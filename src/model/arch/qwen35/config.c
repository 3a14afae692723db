/*
 * src/model/arch/qwen35/config.c - the Qwen 3.5 hybrid part of config.json (Qwen3_5ForCausalLM,
 * model_type qwen3_5_text).
 * Owns: recognising Qwen 3.5 checkpoints (a dense config with experts is refused: the MoE
 *   graph is its own architecture, src/model/arch/qwen35moe/), the layer types, the gated DeltaNet sizes, partial
 *   RoPE, the attention output gate and the zero-centred norms.
 * Must not: read weights; touch the fields config.c parses for every architecture.
 *
 * mRoPE: rope_parameters.mrope_section splits the rotary frequencies between the temporal,
 * height and width position ids; for text all three ids are the token position, so the
 * sections (interleaved or not) give exactly plain RoPE over rotary_dim and are ignored.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model/arch/qwen35/qwen35.h"
#include "util/common.h"

static const cJSON *item(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static tqkv_status int_field(const cJSON *o, const char *key, const char *name, int def, int lo,
                             int hi, int *out) {
    const cJSON *v = item(o, key);
    if (!v) {
        if (def < 0) return tqkv_fail(TQKV_ECORRUPT, "%s: missing \"%s\"", name, key);
        *out = def;
        return TQKV_OK;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo ||
        v->valuedouble > hi)
        return tqkv_fail(TQKV_ECORRUPT, "%s: \"%s\" must be an integer in [%d, %d]", name, key, lo,
                         hi);
    *out = (int)v->valuedouble;
    return TQKV_OK;
}

tqkv_status qwen35_config_parse(const cJSON *root, const char *name, tqkv_model_config *c) {
    if (item(root, "num_experts") && cJSON_IsNumber(item(root, "num_experts")) &&
        item(root, "num_experts")->valuedouble > 0)
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: a dense Qwen 3.5 config (Qwen3_5ForCausalLM) "
                         "with experts (num_experts); the MoE graph is Qwen3_5MoeForCausalLM "
                         "(model_type qwen3_5_moe_text)", name);
    return qwen35_config_hybrid(root, name, c);
}

tqkv_status qwen35_config_hybrid(const cJSON *root, const char *name, tqkv_model_config *c) {
    static const char *const kinds[] = {"full_attention", "linear_attention", NULL};
    tqkv_status rc = model_config_check_layer_types(root, name, kinds);
    if (rc != TQKV_OK) return rc;
    /* layer types: explicit list, else HF's default (every full_attention_interval-th full) */
    const cJSON *lt = item(root, "layer_types");
    if (c->n_layers > TQKV_MAX_LAYERS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: %d layers (at most %d)", name, c->n_layers,
                         TQKV_MAX_LAYERS);
    if (cJSON_IsArray(lt)) {
        if (cJSON_GetArraySize(lt) != c->n_layers)
            return tqkv_fail(TQKV_ECORRUPT, "%s: \"layer_types\" has %d entries for %d layers",
                             name, cJSON_GetArraySize(lt), c->n_layers);
        for (int l = 0; l < c->n_layers; l++) {
            const cJSON *e = cJSON_GetArrayItem(lt, l);
            c->layer_type[l] = !strcmp(e->valuestring, "linear_attention") ? TQKV_LAYER_LINEAR
                                                                            : TQKV_LAYER_FULL;
        }
    } else {
        int every = 4;
        if ((rc = int_field(root, "full_attention_interval", name, 4, 1, 1 << 20, &every)))
            return rc;
        for (int l = 0; l < c->n_layers; l++)
            c->layer_type[l] = (l + 1) % every ? TQKV_LAYER_LINEAR : TQKV_LAYER_FULL;
    }
    c->n_linear = 0;
    for (int l = 0; l < c->n_layers; l++) c->n_linear += c->layer_type[l] == TQKV_LAYER_LINEAR;
    if (c->n_linear == c->n_layers)
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: every layer is linear_attention; tqkv needs at "
                         "least one full_attention layer (its KV rows carry the row positions)",
                         name);

    /* gated DeltaNet sizes */
    if ((rc = int_field(root, "linear_num_key_heads", name, -1, 1, 1024, &c->lin_k_heads)) ||
        (rc = int_field(root, "linear_num_value_heads", name, -1, 1, 1024, &c->lin_v_heads)) ||
        (rc = int_field(root, "linear_key_head_dim", name, -1, 1, 512, &c->lin_k_dim)) ||
        (rc = int_field(root, "linear_value_head_dim", name, -1, 1, 512, &c->lin_v_dim)) ||
        (rc = int_field(root, "linear_conv_kernel_dim", name, 4, 1, 64, &c->lin_conv_kernel)))
        return rc;
    if (c->lin_v_heads % c->lin_k_heads)
        return tqkv_fail(TQKV_ECORRUPT, "%s: linear_num_value_heads %d is not a multiple of "
                         "linear_num_key_heads %d", name, c->lin_v_heads, c->lin_k_heads);

    /* partial RoPE: rope_parameters.partial_rotary_factor, else the top-level key */
    double f = 1.0;
    const cJSON *rp = item(root, "rope_parameters"), *v;
    if ((v = item(root, "partial_rotary_factor")) && cJSON_IsNumber(v)) f = v->valuedouble;
    if (cJSON_IsObject(rp) && (v = item(rp, "partial_rotary_factor")) && cJSON_IsNumber(v))
        f = v->valuedouble;
    const int rd = f > 0 && f <= 1 ? (int)(c->head_dim * f) : 0; /* cast only in range */
    if (rd < 2 || rd % 2)
        return tqkv_fail(TQKV_ECORRUPT, "%s: partial_rotary_factor %g gives %d rotary dims of "
                         "head_dim %d (need an even count >= 2)", name, f, rd, c->head_dim);
    c->rotary_dim = rd;
    if (c->rope_type != TQKV_ROPE_DEFAULT)
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: Qwen 3.5 with rope scaling is not supported",
                         name);
    c->attn_output_gate = 1; /* HF Qwen3_5Attention always gates */
    c->norm_zero_centred = 1;
    c->qk_norm = 1;
    c->qkv_bias = c->o_bias = 0;
    const cJSON *ab = item(root, "attention_bias");
    if (ab && cJSON_IsTrue(ab))
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: Qwen 3.5 with attention_bias is not supported",
                         name);
    return TQKV_OK;
}
