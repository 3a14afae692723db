/*
 * config.c - config.json and generation_config.json of a Hugging Face checkpoint.
 * Owns: architecture detection, hyper-parameters, RoPE scaling, eos ids, sampling defaults.
 * Must not: read weights; accept a config it cannot run (errors name the file and the key).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "util/common.h"
#include "util/file.h"

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

static tqkv_status read_file(const char *path, char **out, size_t *len, int *missing) {
    return tqkv_file_read_all(path, (size_t)64 << 20, out, len, missing);
}

/* Parse JSON; a syntax error names the file, line and column. */
static tqkv_status parse_json(const char *json, size_t len, const char *name, cJSON **out) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        int line = 1, col = 1;
        const char *stop = end && end >= json && end <= json + len ? end : json + len;
        for (const char *p = json; p < stop; p++) {
            if (*p == '\n') {
                line++;
                col = 1;
            } else {
                col++;
            }
        }
        return tqkv_fail(TQKV_ECORRUPT, "%s: JSON syntax error at line %d column %d", name, line, col);
    }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_ECORRUPT, "%s: top level is not a JSON object", name);
    }
    *out = root;
    return TQKV_OK;
}

static const cJSON *item(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* Integer field: required (def < -1 means required) or default. */
static tqkv_status get_int(const cJSON *o, const char *key, const char *name, long def, long lo,
                           long hi, int *out) {
    const cJSON *v = item(o, key);
    if (!v) {
        if (def < -1) return tqkv_fail(TQKV_ECORRUPT, "%s: missing \"%s\"", name, key);
        *out = (int)def;
        return TQKV_OK;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo ||
        v->valuedouble > hi)
        return tqkv_fail(TQKV_ECORRUPT, "%s: \"%s\" must be an integer in [%ld, %ld]", name, key, lo,
                         hi);
    *out = (int)v->valuedouble;
    return TQKV_OK;
}

static tqkv_status get_num(const cJSON *o, const char *key, const char *name, double def,
                           double *out) {
    const cJSON *v = item(o, key);
    if (!v) {
        *out = def;
        return TQKV_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return tqkv_fail(TQKV_ECORRUPT, "%s: \"%s\" must be a number", name, key);
    *out = v->valuedouble;
    return TQKV_OK;
}

static int get_bool(const cJSON *o, const char *key, int def) {
    const cJSON *v = item(o, key);
    if (!v) return def;
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    if (cJSON_IsNumber(v)) return v->valuedouble != 0;
    return def;
}

tqkv_status model_config_int(const cJSON *o, const char *key, const char *name, long def, long lo,
                             long hi, int *out) {
    return get_int(o, key, name, def, lo, hi, out);
}

int model_config_bool(const cJSON *o, const char *key, int def) { return get_bool(o, key, def); }

/* A non-negative integer that fits an int (the cast below is then defined). */
static int is_token_id(const cJSON *v) {
    return cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble <= 2147483647.0 &&
           v->valuedouble == floor(v->valuedouble);
}

/* eos_token_id: int or list of ints. Returns count (0 if absent), -1 on a bad value, -2 if
 * the list holds more than cap ids (refused: cutting it would silently drop stop tokens). */
static int get_ids(const cJSON *o, const char *key, int *ids, int cap) {
    const cJSON *v = item(o, key);
    if (!v) return 0;
    if (cJSON_IsNumber(v)) {
        if (!is_token_id(v)) return -1;
        ids[0] = (int)v->valuedouble;
        return 1;
    }
    if (!cJSON_IsArray(v)) return -1;
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!is_token_id(e)) return -1;
        if (n == cap) return -2;
        ids[n++] = (int)e->valuedouble;
    }
    return n;
}

#define TRY(x)                                                                                    \
    do {                                                                                          \
        tqkv_status rc_ = (x);                                                                    \
        if (rc_ != TQKV_OK) {                                                                     \
            cJSON_Delete(root);                                                                   \
            return rc_;                                                                           \
        }                                                                                         \
    } while (0)

tqkv_status model_config_check_layer_types(const cJSON *root, const char *name,
                                           const char *const *kinds) {
    const cJSON *lt = item(root, "layer_types"), *e;
    if (!cJSON_IsArray(lt)) return TQKV_OK;
    cJSON_ArrayForEach(e, lt) {
        int ok = 0;
        for (int k = 0; kinds[k] && !ok; k++)
            ok = cJSON_IsString(e) && !strcmp(e->valuestring, kinds[k]);
        if (!ok)
            return tqkv_fail(TQKV_EUNSUPPORTED, "%s: layer_types other than %s%s%s are not "
                             "supported", name, kinds[0], kinds[1] ? " and " : "",
                             kinds[1] ? kinds[1] : "");
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------

/* A wrapper's text model (model_arch_unwrap): its config parsed as a checkpoint of its
 * own, then the wrapper's name and weight prefix kept. Frees text. */
static tqkv_status parse_wrapped(cJSON *text, const char *name, const tqkv_model_config *wrap,
                                 tqkv_model_config *out) {
    char *json = cJSON_PrintUnformatted(text);
    cJSON_Delete(text);
    if (!json) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    char sub[512];
    snprintf(sub, sizeof sub, "%s (text_config)", name);
    tqkv_model_config c;
    tqkv_status rc = model_config_parse(json, strlen(json), sub, &c);
    free(json);
    if (rc != TQKV_OK) return rc;
    memcpy(c.arch_name, wrap->arch_name, sizeof c.arch_name);
    memcpy(c.weight_prefix, wrap->weight_prefix, sizeof c.weight_prefix);
    *out = c;
    return TQKV_OK;
}

tqkv_status model_config_parse(const char *json, size_t len, const char *name,
                               tqkv_model_config *out) {
    cJSON *root = NULL;
    tqkv_status rc = parse_json(json, len, name, &root);
    if (rc != TQKV_OK) return rc;
    tqkv_model_config c;
    memset(&c, 0, sizeof c);

    /* architecture: the registry's ops (arch/registry.c) */
    const cJSON *archs = item(root, "architectures");
    const char *arch = NULL;
    if (cJSON_IsArray(archs) && cJSON_GetArraySize(archs) > 0 &&
        cJSON_IsString(cJSON_GetArrayItem(archs, 0)))
        arch = cJSON_GetArrayItem(archs, 0)->valuestring;
    const cJSON *mt = item(root, "model_type");
    const char *type = cJSON_IsString(mt) ? mt->valuestring : NULL;
    if (!arch && type) arch = model_arch_name_of_type(type);
    if (!arch && !type) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_ECORRUPT, "%s: no \"architectures\" or \"model_type\"", name);
    }
    cJSON *text = NULL;
    if (model_arch_unwrap(arch, type, root, name, &text, c.arch_name, sizeof c.arch_name,
                          c.weight_prefix, sizeof c.weight_prefix, &rc)) {
        cJSON_Delete(root);
        return rc == TQKV_OK ? parse_wrapped(text, name, &c, out) : rc;
    }
    const model_arch_ops *ops = model_arch_find(arch, type, name, &c.arch, &rc);
    if (!ops) {
        cJSON_Delete(root);
        return rc;
    }
    if (!arch) arch = type;
    snprintf(c.arch_name, sizeof c.arch_name, "%s", arch);

    /* sizes */
    TRY(get_int(root, "vocab_size", name, -2, 1, 1 << 24, &c.vocab_size));
    TRY(get_int(root, "hidden_size", name, -2, 1, 1 << 16, &c.hidden_size));
    TRY(get_int(root, "intermediate_size", name, ops->experts_only ? 0 : -2, 1, 1 << 18,
                &c.intermediate_size));
    TRY(get_int(root, "num_hidden_layers", name, -2, 1, 1024, &c.n_layers));
    TRY(get_int(root, "num_attention_heads", name, -2, 1, 1024, &c.n_heads));
    TRY(get_int(root, "num_key_value_heads", name, c.n_heads, 1, 1024, &c.n_kv_heads));
    TRY(get_int(root, "head_dim", name, c.hidden_size / c.n_heads, 1, 4096, &c.head_dim));
    TRY(get_int(root, "max_position_embeddings", name, 4096, 1, 1 << 30,
                &c.max_position_embeddings));
    if (c.n_heads % c.n_kv_heads) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_ECORRUPT, "%s: num_attention_heads %d is not a multiple of "
                         "num_key_value_heads %d", name, c.n_heads, c.n_kv_heads);
    }
    if (tqkv_check_dim(c.head_dim) != TQKV_OK) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: head_dim %d unsupported by the KV cache (needs a "
                         "power of two in [32, 512])", name, c.head_dim);
    }
    double eps;
    TRY(get_num(root, "rms_norm_eps", name, 1e-6, &eps));
    if (!(eps >= 0)) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_ECORRUPT, "%s: \"rms_norm_eps\" must be >= 0", name);
    }
    c.rms_norm_eps = (float)eps;

    /* activation and unsupported variants */
    const cJSON *act = item(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu"))) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: hidden_act must be \"silu\"", name);
    }
    if (get_bool(root, "mlp_bias", 0)) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: mlp_bias is not supported", name);
    }
    if (get_bool(root, "use_sliding_window", 0)) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: use_sliding_window is not supported", name);
    }
    /* attention variants (an architecture's config_parse may set its own) */
    int attn_bias = get_bool(root, "attention_bias", 0);
    c.qkv_bias = attn_bias;
    c.o_bias = attn_bias;
    c.tie_word_embeddings = get_bool(root, "tie_word_embeddings", 0);

    /* RoPE: rope_parameters (transformers >= 5) or rope_theta + rope_scaling */
    const cJSON *rp = item(root, "rope_parameters");
    const cJSON *rs = item(root, "rope_scaling");
    const cJSON *scal = cJSON_IsObject(rp) ? rp : cJSON_IsObject(rs) ? rs : NULL;
    double theta = 10000.0;
    TRY(get_num(root, "rope_theta", name, 10000.0, &theta));
    if (scal) TRY(get_num(scal, "rope_theta", name, theta, &theta));
    if (!(theta > 0)) {
        cJSON_Delete(root);
        return tqkv_fail(TQKV_ECORRUPT, "%s: rope_theta must be positive", name);
    }
    c.rope_theta = theta;
    c.rope_type = TQKV_ROPE_DEFAULT;
    c.rope_factor = 1.0;
    if (scal) {
        const cJSON *ty = item(scal, "rope_type");
        if (!ty) ty = item(scal, "type");
        const char *t = cJSON_IsString(ty) ? ty->valuestring : "default";
        if (!strcmp(t, "default")) {
            c.rope_type = TQKV_ROPE_DEFAULT;
        } else if (!strcmp(t, "linear")) {
            c.rope_type = TQKV_ROPE_LINEAR;
            TRY(get_num(scal, "factor", name, 1.0, &c.rope_factor));
        } else if (!strcmp(t, "llama3")) {
            c.rope_type = TQKV_ROPE_LLAMA3;
            TRY(get_num(scal, "factor", name, 8.0, &c.rope_factor));
            TRY(get_num(scal, "low_freq_factor", name, 1.0, &c.rope_low_freq_factor));
            TRY(get_num(scal, "high_freq_factor", name, 4.0, &c.rope_high_freq_factor));
            TRY(get_int(scal, "original_max_position_embeddings", name, 8192, 1, 1 << 30,
                        &c.rope_original_max_pos));
            if (!(c.rope_high_freq_factor > c.rope_low_freq_factor) ||
                !(c.rope_low_freq_factor > 0)) {
                cJSON_Delete(root);
                return tqkv_fail(TQKV_ECORRUPT, "%s: llama3 rope needs high_freq_factor > "
                                 "low_freq_factor > 0", name);
            }
        } else {
            tqkv_status s = tqkv_fail(TQKV_EUNSUPPORTED, "%s: rope type '%s' is not supported "
                                      "(default, linear, llama3)", name, t);
            cJSON_Delete(root);
            return s;
        }
        if (!(c.rope_factor > 0)) {
            cJSON_Delete(root);
            return tqkv_fail(TQKV_ECORRUPT, "%s: rope factor must be positive", name);
        }
    }

    /* special ids */
    TRY(get_int(root, "bos_token_id", name, -1, -1, 1 << 24, &c.bos_token_id));
    TRY(get_int(root, "pad_token_id", name, -1, -1, 1 << 24, &c.pad_token_id));
    int n = get_ids(root, "eos_token_id", c.eos_ids, TQKV_MAX_EOS);
    if (n < 0) {
        cJSON_Delete(root);
        if (n == -2)
            return tqkv_fail(TQKV_EUNSUPPORTED, "%s: \"eos_token_id\" lists more than %d ids", name,
                             TQKV_MAX_EOS);
        return tqkv_fail(TQKV_ECORRUPT, "%s: bad \"eos_token_id\"", name);
    }
    c.n_eos = n;
    if (ops->config_parse) TRY(ops->config_parse(root, name, &c)); /* its own fields */
    cJSON_Delete(root);
    *out = c;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// generation_config.json
// ---------------------------------------------------------------------------

static tqkv_generation_config gen_default(void) {
    tqkv_generation_config g = {0, 1.0f, 50, 1.0f, 0.0f, 1.0f};
    return g;
}

tqkv_status model_generation_parse(const char *json, size_t len, const char *name,
                                   tqkv_model_config *cfg, tqkv_generation_config *out) {
    cJSON *root = NULL;
    tqkv_status rc = parse_json(json, len, name, &root);
    if (rc != TQKV_OK) return rc;
    tqkv_generation_config g = gen_default();
    double v;
    g.do_sample = get_bool(root, "do_sample", 0);
    TRY(get_num(root, "temperature", name, 1.0, &v));
    g.temperature = (float)v;
    TRY(get_int(root, "top_k", name, 50, 0, 1 << 24, &g.top_k));
    TRY(get_num(root, "top_p", name, 1.0, &v));
    g.top_p = (float)v;
    TRY(get_num(root, "min_p", name, 0.0, &v));
    g.min_p = (float)v;
    TRY(get_num(root, "repetition_penalty", name, 1.0, &v));
    g.repetition_penalty = (float)v;
    int ids[TQKV_MAX_EOS];
    int n = get_ids(root, "eos_token_id", ids, TQKV_MAX_EOS);
    if (n < 0) {
        cJSON_Delete(root);
        if (n == -2)
            return tqkv_fail(TQKV_EUNSUPPORTED, "%s: \"eos_token_id\" lists more than %d ids", name,
                             TQKV_MAX_EOS);
        return tqkv_fail(TQKV_ECORRUPT, "%s: bad \"eos_token_id\"", name);
    }
    cJSON_Delete(root);
    if (n > 0) { /* generation_config's eos list is what HF generate() stops on */
        memcpy(cfg->eos_ids, ids, sizeof(int) * (size_t)n);
        cfg->n_eos = n;
    }
    *out = g;
    return TQKV_OK;
}

tqkv_status model_config_load(const char *dir, tqkv_model_config *cfg, tqkv_generation_config *gen) {
    char path[4096];
    char *text = NULL;
    size_t len = 0;
    int missing = 0;
    snprintf(path, sizeof path, "%s/config.json", dir);
    tqkv_status rc = read_file(path, &text, &len, &missing);
    if (rc != TQKV_OK) return rc;
    tqkv_model_config c;
    rc = model_config_parse(text, len, path, &c);
    free(text);
    if (rc != TQKV_OK) return rc;
    tqkv_generation_config g = gen_default();
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    rc = read_file(path, &text, &len, &missing);
    if (rc == TQKV_OK) {
        rc = model_generation_parse(text, len, path, &c, &g);
        free(text);
        if (rc != TQKV_OK) return rc;
    } else if (!missing) {
        return rc;
    }
    tqkv_clear_error();
    *cfg = c;
    *gen = g;
    return TQKV_OK;
}
