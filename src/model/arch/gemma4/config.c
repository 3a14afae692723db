/*
 * src/model/arch/gemma4/config.c - the gemma4_text part of config.json.
 * Owns: layer types, per-layer head_dim / KV heads (per_layer_config of transformers >= 5.15,
 * or the flat global_head_dim / num_global_key_value_heads of older files), KV-sharing
 * donors, RoPE per layer type, per-layer inputs, soft-capping; refusing what the graph
 * does not run (MoE, double-wide MLP, bidirectional attention, other activations).
 * Must not: read files or weights (config.c and src/model/arch/gemma4/load.c call it with parsed JSON).
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/arch/gemma4/gemma4.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// JSON helpers
// ---------------------------------------------------------------------------

static const cJSON *jget(const cJSON *o, const char *key) {
    const cJSON *v = o ? cJSON_GetObjectItemCaseSensitive(o, key) : NULL;
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* An integer field, or def when absent; a number outside int's range (or NaN) reads as
 * INT_MIN, which every size check below refuses (a cast would be undefined). */
static int jint(const cJSON *o, const char *key, int def) {
    const cJSON *v = jget(o, key);
    if (!cJSON_IsNumber(v)) return def;
    const double d = v->valuedouble;
    return d >= (double)INT_MIN && d <= (double)INT_MAX ? (int)d : INT_MIN;
}

static double jnum(const cJSON *o, const char *key, double def) {
    const cJSON *v = jget(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : def;
}

static int jtrue(const cJSON *o, const char *key) { return cJSON_IsTrue(jget(o, key)); }

// ---------------------------------------------------------------------------
// parse
// ---------------------------------------------------------------------------

static tqkv_status parse_rope(const cJSON *rp, const char *type, int idx, const char *name,
                              g4_config *g) {
    const cJSON *r = jget(rp, type);
    g->theta[idx] = idx ? 1e6 : 1e4;
    g->partial[idx] = 1.0;
    g->factor[idx] = 1.0;
    g->proportional[idx] = 0;
    if (!r) return TQKV_OK;
    g->theta[idx] = jnum(r, "rope_theta", g->theta[idx]);
    g->partial[idx] = jnum(r, "partial_rotary_factor", 1.0);
    g->factor[idx] = jnum(r, "factor", 1.0);
    const cJSON *ty = jget(r, "rope_type");
    const char *t = cJSON_IsString(ty) ? ty->valuestring : "default";
    if (!strcmp(t, "proportional")) g->proportional[idx] = 1;
    else if (strcmp(t, "default"))
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: %s rope_type '%s' is not supported (default, "
                         "proportional)", name, type, t);
    if (!(g->theta[idx] > 0) || !(g->factor[idx] > 0) || !(g->partial[idx] >= 0) ||
        g->partial[idx] > 1)
        return tqkv_fail(TQKV_ECORRUPT, "%s: bad %s rope parameters", name, type);
    return TQKV_OK;
}

tqkv_status gemma4_config_parse(const cJSON *root, const char *name, tqkv_model_config *c,
                                g4_config *gout) {
    g4_config *g = tqkv_calloc(1, sizeof *g);
    if (!g) return TQKV_ENOMEM;
    tqkv_status rc = TQKV_OK;
#define BAD(code, ...)                                                                            \
    do {                                                                                          \
        rc = tqkv_fail(code, __VA_ARGS__);                                                        \
        goto done;                                                                                \
    } while (0)
    if (jtrue(root, "use_double_wide_mlp"))
        BAD(TQKV_EUNSUPPORTED, "%s: use_double_wide_mlp is not supported", name);
    if (jget(root, "use_bidirectional_attention"))
        BAD(TQKV_EUNSUPPORTED, "%s: use_bidirectional_attention is not supported", name);
    if (jtrue(root, "attention_bias"))
        BAD(TQKV_EUNSUPPORTED, "%s: attention_bias is not supported for Gemma 4", name);
    const cJSON *act = jget(root, "hidden_activation");
    if (act && (!cJSON_IsString(act) || (strcmp(act->valuestring, "gelu_pytorch_tanh") &&
                                         strcmp(act->valuestring, "gelu_tanh"))))
        BAD(TQKV_EUNSUPPORTED, "%s: hidden_activation must be gelu_pytorch_tanh", name);
    int L = c->n_layers;
    if (L > G4_MAX_LAYERS) BAD(TQKV_EUNSUPPORTED, "%s: more than %d layers", name, G4_MAX_LAYERS);
    g->n_layers = L;

    /* layer types */
    const cJSON *lt = jget(root, "layer_types");
    if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != L)
        BAD(TQKV_ECORRUPT, "%s: layer_types must list %d layers", name, L);
    for (int l = 0; l < L; l++) {
        const cJSON *e = cJSON_GetArrayItem(lt, l);
        if (!cJSON_IsString(e)) BAD(TQKV_ECORRUPT, "%s: layer_types[%d] is not a string", name, l);
        if (!strcmp(e->valuestring, "sliding_attention")) g->sliding[l] = 1;
        else if (!strcmp(e->valuestring, "full_attention")) g->sliding[l] = 0;
        else BAD(TQKV_EUNSUPPORTED, "%s: layer type '%s' is not supported", name, e->valuestring);
    }

    /* per-layer geometry */
    int k_eq_v = jtrue(root, "attention_k_eq_v");
    int ghd = jint(root, "global_head_dim", c->head_dim);
    int gkv = jint(root, "num_global_key_value_heads", c->n_kv_heads);
    const cJSON *plc = jget(root, "per_layer_config");
    for (int l = 0; l < L; l++) {
        g->head_dim[l] = g->sliding[l] ? c->head_dim : ghd;
        g->n_kv[l] = g->sliding[l] || !k_eq_v ? c->n_kv_heads : gkv;
        g->k_eq_v[l] = k_eq_v && !g->sliding[l];
        char key[16];
        snprintf(key, sizeof key, "%d", l);
        const cJSON *pl = jget(plc, key);
        if (pl) {
            g->head_dim[l] = jint(pl, "head_dim", g->head_dim[l]);
            g->n_kv[l] = jint(pl, "num_key_value_heads", g->n_kv[l]);
            if (jint(pl, "num_attention_heads", c->n_heads) != c->n_heads)
                BAD(TQKV_EUNSUPPORTED, "%s: layer %d: per-layer num_attention_heads is not "
                    "supported", name, l);
        }
        if (tqkv_check_dim(g->head_dim[l]) != TQKV_OK)
            BAD(TQKV_EUNSUPPORTED, "%s: layer %d head_dim %d unsupported by the KV cache (needs "
                "a power of two in [32, 512])", name, l, g->head_dim[l]);
        if (g->n_kv[l] < 1 || c->n_heads % g->n_kv[l])
            BAD(TQKV_ECORRUPT, "%s: layer %d: %d query heads are not a multiple of %d KV heads",
                name, l, c->n_heads, g->n_kv[l]);
        if (g->head_dim[l] > g->max_hd) g->max_hd = g->head_dim[l];
        if (c->n_heads * g->head_dim[l] > g->max_qd) g->max_qd = c->n_heads * g->head_dim[l];
        if (g->n_kv[l] * g->head_dim[l] > g->max_kd) g->max_kd = g->n_kv[l] * g->head_dim[l];
    }

    /* KV sharing: the last num_kv_shared_layers layers read the last earlier non-shared
     * layer of their type */
    int shared = jint(root, "num_kv_shared_layers", 0);
    if (shared < 0 || shared >= L)
        BAD(TQKV_ECORRUPT, "%s: num_kv_shared_layers %d must be in [0, %d)", name, shared, L);
    int first_shared = L - shared;
    g->pos_layer = -1;
    for (int l = 0; l < L; l++) {
        g->donor[l] = l;
        if (l >= first_shared) {
            int d = -1;
            for (int j = first_shared - 1; j >= 0 && d < 0; j--)
                if (g->sliding[j] == g->sliding[l]) d = j;
            if (d < 0)
                BAD(TQKV_ECORRUPT, "%s: KV-shared layer %d has no earlier %s layer to read", name,
                    l, g->sliding[l] ? "sliding" : "full");
            if (g->head_dim[d] != g->head_dim[l])
                BAD(TQKV_ECORRUPT, "%s: KV-shared layer %d head_dim %d differs from donor %d's %d",
                    name, l, g->head_dim[l], d, g->head_dim[d]);
            g->donor[l] = d;
            g->n_kv[l] = g->n_kv[d];
        } else if (!g->sliding[l] && g->pos_layer < 0) {
            g->pos_layer = l;
        }
    }

    g->window = jint(root, "sliding_window", 0);
    for (int l = 0; l < L; l++)
        if (g->sliding[l] && g->window < 1)
            BAD(TQKV_ECORRUPT, "%s: sliding layers need sliding_window >= 1", name);
    g->ple_dim = jint(root, "hidden_size_per_layer_input", 0);
    g->ple_vocab = jint(root, "vocab_size_per_layer_input", c->vocab_size);
    if (g->ple_dim < 0 || g->ple_dim > 1 << 16 || g->ple_vocab < 1)
        BAD(TQKV_ECORRUPT, "%s: bad hidden_size_per_layer_input / vocab_size_per_layer_input",
            name);
    double cap = jnum(root, "final_logit_softcapping", 0.0);
    if (!(cap >= 0)) BAD(TQKV_ECORRUPT, "%s: final_logit_softcapping must be >= 0", name);
    g->softcap = (float)cap;

    const cJSON *rp = jget(root, "rope_parameters");
    if ((rc = parse_rope(rp, "sliding_attention", 0, name, g)) != TQKV_OK) goto done;
    if ((rc = parse_rope(rp, "full_attention", 1, name, g)) != TQKV_OK) goto done;

    /* the MoE block beside every layer's MLP (num_experts alone, as in transformers, adds
     * none) */
    if (jtrue(root, "enable_moe_block")) {
        if ((rc = model_config_int(root, "num_experts", name, -2, 1, 4096, &c->n_experts)) ||
            (rc = model_config_int(root, "top_k_experts", name, -2, 1, 4096, &c->n_experts_used)) ||
            (rc = model_config_int(root, "moe_intermediate_size", name, -2, 1, 1 << 18,
                                   &c->moe_intermediate_size)))
            goto done;
        if (c->n_experts_used > c->n_experts)
            BAD(TQKV_ECORRUPT, "%s: top_k_experts %d > num_experts %d", name, c->n_experts_used,
                c->n_experts);
        c->norm_topk_prob = 1; /* Gemma4TextRouter always renormalises */
        c->n_moe_layers = L;
        for (int l = 0; l < L; l++) c->layer_moe[l] = 1;
    }

    /* the public config describes the sliding layers (a full-only model: the first layer) */
    c->qk_norm = 1;
    c->qkv_bias = c->o_bias = 0;
    c->rope_theta = g->theta[0];
    if (gout) *gout = *g;
done:
#undef BAD
    free(g);
    return rc;
}
