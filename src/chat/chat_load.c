/*
 * chat_load.c - finds a checkpoint's chat template and special-token strings on disk:
 * chat_template.jinja, else tokenizer_config.json's "chat_template" (string or named list);
 * bos_token / eos_token from tokenizer_config.json (string or AddedToken object).
 *
 * Owns: the file layout rules of Hugging Face checkpoints for chat templates.
 * Must not: parse or render templates itself (chat_template.c does), keep global state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "tqkv_chat.h"
#include "util/common.h"

#define CHAT_MAX_FILE ((long)64 << 20)

/* ------------------------------------------------------------------------- */
/* Files                                                                      */
/* ------------------------------------------------------------------------- */

/* Reads dir/name; NULL with *missing = 1 when the file does not exist. */
static char *slurp(const char *dir, const char *name, int *missing, tqkv_status *st) {
    char path[4096];
    *missing = 0;
    *st = TQKV_OK;
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) {
        *st = tqkv_fail(TQKV_EINVAL, "chat_template_load: path too long");
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        *missing = 1;
        return NULL;
    }
    char *buf = NULL;
    long n = -1;
    if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
    if (n < 0 || n > CHAT_MAX_FILE || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        *st = tqkv_fail(TQKV_EIO, "chat_template_load: cannot read %s (or larger than 64 MiB)", path);
        return NULL;
    }
    buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        *st = tqkv_fail(TQKV_ENOMEM, "chat_template_load: out of memory");
        return NULL;
    }
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        *st = tqkv_fail(TQKV_EIO, "chat_template_load: short read on %s", path);
        return NULL;
    }
    fclose(f);
    buf[n] = '\0';
    return buf;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *p = malloc(n + 1);
    if (p) memcpy(p, s, n + 1);
    return p;
}

/* A token entry: "text", {"content": "text", ...}, or null/absent (-> NULL, ok). */
static tqkv_status token_of(const cJSON *cfg, const char *key, char **out) {
    *out = NULL;
    const cJSON *v = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, key) : NULL;
    if (v && cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!v || cJSON_IsNull(v)) return TQKV_OK;
    if (!cJSON_IsString(v)) return tqkv_fail(TQKV_ECORRUPT, "chat_template_load: %s is neither a string nor a token object", key);
    *out = dup_str(v->valuestring);
    return *out ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "chat_template_load: out of memory");
}

/* ------------------------------------------------------------------------- */
/* Entry                                                                      */
/* ------------------------------------------------------------------------- */

tqkv_status tqkv_chat_template_load(tqkv_chat_template **out, const char *model_dir, char **bos_token,
                                    char **eos_token) {
    if (!out || !model_dir) return tqkv_fail(TQKV_EINVAL, "chat_template_load: NULL argument");
    int missing_jinja, missing_cfg;
    tqkv_status st;
    char *jinja = slurp(model_dir, "chat_template.jinja", &missing_jinja, &st);
    if (st != TQKV_OK) return st;
    char *cfg_text = slurp(model_dir, "tokenizer_config.json", &missing_cfg, &st);
    if (st != TQKV_OK) {
        free(jinja);
        return st;
    }
    cJSON *cfg = NULL;
    if (cfg_text) {
        cfg = cJSON_Parse(cfg_text);
        if (!cfg || !cJSON_IsObject(cfg)) {
            cJSON_Delete(cfg);
            free(cfg_text);
            free(jinja);
            return tqkv_fail(TQKV_ECORRUPT, "chat_template_load: %s/tokenizer_config.json is not a JSON object", model_dir);
        }
    }
    const char *source = jinja;
    if (!source && cfg) {
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        if (cJSON_IsString(ct)) source = ct->valuestring;
        else if (cJSON_IsArray(ct)) {
            const cJSON *e;
            cJSON_ArrayForEach(e, ct) {
                const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *tpl = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (cJSON_IsString(name) && !strcmp(name->valuestring, "default") && cJSON_IsString(tpl))
                    source = tpl->valuestring;
            }
            if (!source) st = tqkv_fail(TQKV_EUNSUPPORTED, "chat_template_load: %s: chat_template list has no \"default\"", model_dir);
        } else if (ct && !cJSON_IsNull(ct))
            st = tqkv_fail(TQKV_ECORRUPT, "chat_template_load: %s: chat_template is neither a string nor a list", model_dir);
    }
    if (st == TQKV_OK && !source)
        st = tqkv_fail(TQKV_EUNSUPPORTED,
                       "chat_template_load: %s has no chat template (no chat_template.jinja, no chat_template in "
                       "tokenizer_config.json)", model_dir);
    char *bos = NULL, *eos = NULL;
    if (st == TQKV_OK && bos_token) st = token_of(cfg, "bos_token", &bos);
    if (st == TQKV_OK && eos_token) st = token_of(cfg, "eos_token", &eos);
    tqkv_chat_template *t = NULL;
    if (st == TQKV_OK) st = tqkv_chat_template_init(&t, source);
    cJSON_Delete(cfg);
    free(cfg_text);
    free(jinja);
    if (st != TQKV_OK) {
        free(bos);
        free(eos);
        return st;
    }
    *out = t;
    if (bos_token) *bos_token = bos;
    if (eos_token) *eos_token = eos;
    return TQKV_OK;
}
