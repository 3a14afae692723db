/*
 * chat_template.c - public chat-template API (include/tqkv_chat.h): parse a checkpoint's
 * Jinja chat template once, render conversations with it many times.
 *
 * Owns: the template object, the variables a render passes (messages,
 * add_generation_prompt, bos_token, eos_token, tools = none, documents = none, as
 * transformers' apply_chat_template does), the render's memory bound.
 * Must not: tokenize, read files, keep global state.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "chat/chat_internal.h"
#include "tqkv_chat.h"
#include "util/common.h"

/* A render's arena refuses to grow past this many bytes (a template that loops on
 * string concatenation fails with TQKV_ENOMEM instead of exhausting memory). */
#define CHAT_RENDER_BASE_LIMIT ((size_t)256 << 20)

struct tqkv_chat_template {
    chat_arena  arena; /* tokens + tree; read-only after init */
    chat_node  *root;
};

tqkv_status tqkv_chat_template_init(tqkv_chat_template **out, const char *source) {
    if (!out || !source) return tqkv_fail(TQKV_EINVAL, "chat_template_init: NULL argument");
    tqkv_chat_template *t = calloc(1, sizeof *t);
    if (!t) return tqkv_fail(TQKV_ENOMEM, "chat_template_init: out of memory");
    chat_arena_init(&t->arena, 0);
    chat_tokens toks;
    tqkv_status s = chat_lex(&t->arena, source, &toks);
    if (s == TQKV_OK) s = chat_parse(&t->arena, &toks, &t->root);
    if (s != TQKV_OK) {
        chat_arena_free(&t->arena);
        free(t);
        return s;
    }
    *out = t;
    return TQKV_OK;
}

void tqkv_chat_template_free(tqkv_chat_template *t) {
    if (!t) return;
    chat_arena_free(&t->arena);
    free(t);
}

/* ------------------------------------------------------------------------- */
/* Render                                                                     */
/* ------------------------------------------------------------------------- */

#define CHAT_MAX_VARS 64

/* Renders with the standard variables plus extra (names, vals) overriding them. */
static tqkv_status render_vars(const tqkv_chat_template *t, chat_arena *arena, chat_value messages,
                               int add_generation_prompt, const char *bos_token, const char *eos_token,
                               const char *const *xnames, const chat_value *xvals, int n_extra, char **out,
                               size_t *out_len) {
    chat_value none;
    memset(&none, 0, sizeof none);
    none.kind = CV_NONE;
    const char *names[6 + CHAT_MAX_VARS] = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                            "documents"};
    chat_value vals[6 + CHAT_MAX_VARS];
    vals[0] = messages;
    vals[1] = chat_bool(add_generation_prompt != 0);
    vals[2] = chat_str(bos_token ? bos_token : "", bos_token ? strlen(bos_token) : 0);
    vals[3] = chat_str(eos_token ? eos_token : "", eos_token ? strlen(eos_token) : 0);
    vals[4] = none;
    vals[5] = none;
    int n = 6;
    for (int i = 0; i < n_extra; i++) {
        int k = 0;
        while (k < n && strcmp(names[k], xnames[i]) != 0) k++;
        if (k == n) names[n++] = xnames[i];
        vals[k] = xvals[i];
    }
    const char *text = NULL;
    size_t len = 0;
    tqkv_status s = chat_eval_render(t->root, arena, names, vals, n, &text, &len);
    if (s != TQKV_OK) return s;
    char *res = malloc(len + 1);
    if (!res) return tqkv_fail(TQKV_ENOMEM, "chat_template_render: out of memory");
    memcpy(res, text, len);
    res[len] = '\0';
    *out = res;
    if (out_len) *out_len = len;
    return TQKV_OK;
}

static size_t render_limit(size_t input) {
    size_t limit = CHAT_RENDER_BASE_LIMIT;
    if (input < (SIZE_MAX - limit) / 64) limit += input * 64;
    return limit;
}

tqkv_status tqkv_chat_template_render(const tqkv_chat_template *t, const tqkv_chat_message *msgs, int n_msgs,
                                      int add_generation_prompt, const char *bos_token, const char *eos_token,
                                      char **out, size_t *out_len) {
    if (!t || !out || n_msgs < 0 || (n_msgs > 0 && !msgs))
        return tqkv_fail(TQKV_EINVAL, "chat_template_render: NULL argument or negative message count");
    size_t input = 0;
    for (int i = 0; i < n_msgs; i++) {
        if (!msgs[i].role || !msgs[i].content)
            return tqkv_fail(TQKV_EINVAL, "chat_template_render: message %d has a NULL role or content", i);
        input += strlen(msgs[i].role) + strlen(msgs[i].content);
    }
    chat_arena arena;
    chat_arena_init(&arena, render_limit(input));

    /* messages: a list of {"role": ..., "content": ...} */
    chat_value messages;
    memset(&messages, 0, sizeof messages);
    messages.kind = CV_LIST;
    messages.u.list = chat_arena_alloc(&arena, sizeof *messages.u.list);
    if (!messages.u.list) goto oom;
    messages.u.list->n = (size_t)n_msgs;
    messages.u.list->items = chat_arena_alloc(&arena, (size_t)(n_msgs ? n_msgs : 1) * sizeof(chat_value));
    if (!messages.u.list->items) goto oom;
    for (int i = 0; i < n_msgs; i++) {
        chat_dict *d = chat_dict_new(&arena, 4);
        if (!d) goto oom;
        if (chat_dict_set(&arena, d, "role", 4, chat_str(msgs[i].role, strlen(msgs[i].role))) ||
            chat_dict_set(&arena, d, "content", 7, chat_str(msgs[i].content, strlen(msgs[i].content))))
            goto oom;
        chat_value *m = &messages.u.list->items[i];
        m->kind = CV_DICT;
        m->u.dict = d;
    }
    tqkv_status s = render_vars(t, &arena, messages, add_generation_prompt, bos_token, eos_token, NULL, NULL, 0, out,
                                out_len);
    chat_arena_free(&arena);
    return s;
oom:
    chat_arena_free(&arena);
    return tqkv_fail(TQKV_ENOMEM, "chat_template_render: out of memory");
}

/* ------------------------------------------------------------------------- */
/* JSON conversations                                                         */
/* ------------------------------------------------------------------------- */

/* cJSON -> value in the arena; 0 ok, -1 OOM, -2 too deep. */
static int from_json(chat_arena *a, const cJSON *j, chat_value *v, int depth) {
    memset(v, 0, sizeof *v);
    if (depth > 64) return -2;
    if (cJSON_IsNull(j)) v->kind = CV_NONE;
    else if (cJSON_IsBool(j)) *v = chat_bool(cJSON_IsTrue(j));
    else if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) < 9007199254740992.0) *v = chat_int((int64_t)d);
        else {
            v->kind = CV_FLOAT;
            v->u.f = d;
        }
    } else if (cJSON_IsString(j)) *v = chat_str(j->valuestring, strlen(j->valuestring));
    else if (cJSON_IsArray(j)) {
        int n = cJSON_GetArraySize(j), i = 0;
        v->kind = CV_LIST;
        v->u.list = chat_arena_alloc(a, sizeof *v->u.list);
        if (!v->u.list) return -1;
        v->u.list->items = chat_arena_alloc(a, (size_t)(n ? n : 1) * sizeof(chat_value));
        if (!v->u.list->items) return -1;
        v->u.list->n = (size_t)n;
        const cJSON *c;
        cJSON_ArrayForEach(c, j) {
            int r = from_json(a, c, &v->u.list->items[i++], depth + 1);
            if (r) return r;
        }
    } else if (cJSON_IsObject(j)) {
        v->kind = CV_DICT;
        v->u.dict = chat_dict_new(a, (size_t)cJSON_GetArraySize(j));
        if (!v->u.dict) return -1;
        const cJSON *c;
        cJSON_ArrayForEach(c, j) {
            chat_value x;
            int r = from_json(a, c, &x, depth + 1);
            if (r) return r;
            if (chat_dict_set(a, v->u.dict, c->string, strlen(c->string), x)) return -1;
        }
    } else v->kind = CV_NONE;
    return 0;
}

tqkv_status tqkv_chat_template_render_json(const tqkv_chat_template *t, const char *messages_json,
                                           int add_generation_prompt, const char *bos_token, const char *eos_token,
                                           const char *extra_json, char **out, size_t *out_len) {
    if (!t || !out || !messages_json) return tqkv_fail(TQKV_EINVAL, "chat_template_render_json: NULL argument");
    cJSON *jm = cJSON_Parse(messages_json);
    if (!jm || !cJSON_IsArray(jm)) {
        cJSON_Delete(jm);
        return tqkv_fail(TQKV_EINVAL, "chat_template_render_json: messages is not a JSON array");
    }
    cJSON *jx = NULL;
    if (extra_json) {
        jx = cJSON_Parse(extra_json);
        if (!jx || !cJSON_IsObject(jx)) {
            cJSON_Delete(jm);
            cJSON_Delete(jx);
            return tqkv_fail(TQKV_EINVAL, "chat_template_render_json: extra variables are not a JSON object");
        }
        if (cJSON_GetArraySize(jx) > CHAT_MAX_VARS) {
            cJSON_Delete(jm);
            cJSON_Delete(jx);
            return tqkv_fail(TQKV_EINVAL, "chat_template_render_json: more than %d extra variables", CHAT_MAX_VARS);
        }
    }
    chat_arena arena;
    chat_arena_init(&arena, render_limit(strlen(messages_json) + (extra_json ? strlen(extra_json) : 0)));
    tqkv_status s = TQKV_OK;
    chat_value messages;
    const char *xnames[CHAT_MAX_VARS];
    chat_value xvals[CHAT_MAX_VARS];
    int n_extra = 0, r = from_json(&arena, jm, &messages, 0);
    if (!r && jx) {
        const cJSON *c;
        cJSON_ArrayForEach(c, jx) {
            xnames[n_extra] = c->string;
            r = from_json(&arena, c, &xvals[n_extra], 0);
            if (r) break;
            n_extra++;
        }
    }
    if (r == -1) s = tqkv_fail(TQKV_ENOMEM, "chat_template_render_json: out of memory");
    else if (r) s = tqkv_fail(TQKV_EINVAL, "chat_template_render_json: JSON nested deeper than 64 levels");
    else
        s = render_vars(t, &arena, messages, add_generation_prompt, bos_token, eos_token, xnames, xvals, n_extra, out,
                        out_len);
    chat_arena_free(&arena);
    cJSON_Delete(jm);
    cJSON_Delete(jx);
    return s;
}
