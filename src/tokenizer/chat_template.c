/*
 * chat_template.c - public chat-template API (include/tqkv_chat.h): parse a checkpoint's
 * Jinja chat template once, render conversations with it many times.
 *
 * Owns: the template object, the variables a render passes (messages,
 * add_generation_prompt, bos_token, eos_token, tools = none, documents = none, as
 * transformers' apply_chat_template does), the render's memory bound.
 * Must not: tokenize, read files, keep global state.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/chat_internal.h"
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
    size_t limit = CHAT_RENDER_BASE_LIMIT;
    if (input < (SIZE_MAX - limit) / 64) limit += input * 64;
    chat_arena_init(&arena, limit);

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
    chat_value none;
    memset(&none, 0, sizeof none);
    none.kind = CV_NONE;
    const char *names[] = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents"};
    chat_value vals[6];
    vals[0] = messages;
    vals[1] = chat_bool(add_generation_prompt != 0);
    vals[2] = chat_str(bos_token ? bos_token : "", bos_token ? strlen(bos_token) : 0);
    vals[3] = chat_str(eos_token ? eos_token : "", eos_token ? strlen(eos_token) : 0);
    vals[4] = none;
    vals[5] = none;

    const char *text = NULL;
    size_t len = 0;
    tqkv_status s = chat_eval_render(t->root, &arena, names, vals, 6, &text, &len);
    if (s != TQKV_OK) {
        chat_arena_free(&arena);
        return s;
    }
    char *res = malloc(len + 1);
    if (!res) goto oom;
    memcpy(res, text, len);
    res[len] = '\0';
    chat_arena_free(&arena);
    *out = res;
    if (out_len) *out_len = len;
    return TQKV_OK;
oom:
    chat_arena_free(&arena);
    return tqkv_fail(TQKV_ENOMEM, "chat_template_render: out of memory");
}
